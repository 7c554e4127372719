//! After the fact: the real device plugin reads what the kubelet driver really handed out
//! (kubelet's PodResources API, over the driver's socket) and acts on it; and that API itself
//! reports devices as kubelet does.

use std::time::Duration;

use anyhow::{Context, ensure};
use gpushare_contract::{DEFAULT_RESOURCE, Keys, env};
use gpushare_e2e::cluster::{ClusterSpec, TestCluster, http_get, wait_for, with_cluster};
use gpushare_e2e::fixtures::pod;
use gpushare_e2e::scenarios::{allocation, check_no_overcommit, create_gpu_pod, wait_running};
use gpushare_proto::podresources::v1::pod_resources_lister_client::PodResourcesListerClient;
use gpushare_proto::podresources::v1::{
    AllocatableResourcesRequest, ContainerResources, GetPodResourcesRequest,
    ListPodResourcesRequest, PodResources,
};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::PostParams;

const NODE: &str = "gpu-node-1";
const WAIT: Duration = Duration::from_secs(60);

/// `(allocated, assigned)` marks of pod `name`.
async fn marks(cluster: &TestCluster, name: &str) -> anyhow::Result<(String, String)> {
    let keys = Keys::default();
    let pod = cluster.pod("default", name).await?;
    let annotations = pod.metadata.annotations.unwrap_or_default();
    let get = |key: &str| annotations.get(key).cloned().unwrap_or_default();
    Ok((get(&keys.allocated), get(&keys.assigned)))
}

/// On a cluster whose admin left out the allocation policy, a pod created straight onto the
/// node takes the allocation an honest pod waits for. The plugin sees in kubelet's listing
/// that the intruder holds the devices: a Warning Event, the metric, and the honest pod's
/// stray mark given back, so that kubelet's later Allocate for it is not refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_intruder_holding_a_waiting_pods_allocation_is_reported_and_the_pod_still_runs()
-> anyhow::Result<()> {
    // The story is the marks'; they are on for it (off by default).
    let spec = ClusterSpec::labelled(&[(NODE, &[16])])
        .with_device_plugin_args(&["--allocation-marks", "true"]);
    with_cluster(spec, async |cluster| {
        let kubelet = &cluster.nodes[NODE].kubelet;
        let visible = |name: &str| {
            let env = kubelet.container_env("default", name, "main");
            env.and_then(|mut env| env.remove(env::NVIDIA_VISIBLE_DEVICES))
        };
        let wait_marks = async |want: (&str, &str)| {
            let what = format!("pod honest's marks to be {want:?}");
            wait_for(&what, WAIT, || async {
                let marks = marks(cluster, "honest").await.ok()?;
                (marks.0 == want.0 && marks.1 == want.1).then_some(())
            })
            .await
        };
        // kubelet learns of the honest pod late; it is scheduled and waits for admission.
        kubelet.hold("default", "honest");
        create_gpu_pod(cluster, "honest", 4).await?;
        let gpu = wait_for("pod honest to be bound", WAIT, || async {
            let pod = cluster.pod("default", "honest").await.ok()?;
            allocation(&pod).ok().map(|a| a.gpu_uuid)
        })
        .await?;

        // The intruder skips the scheduler: bound here, no allocation of its own.
        let intruder = pod("intruder").gpu_mem(4).on_node(NODE);
        intruder.create(&cluster.client).await?;
        wait_running(cluster, "intruder").await?;
        let why = "Allocate did not answer the intruder with the honest pod's GPU";
        ensure!(visible("intruder") == Some(gpu.clone()), "{why} {gpu}");

        // Reported: a Warning Event on the intruder, and the metric.
        let events: Api<Event> = Api::namespaced(cluster.client.clone(), "default");
        let event = wait_for("an Event on the intruder", WAIT, || async {
            let list = events.list(&Default::default()).await.ok()?;
            list.items.into_iter().find(|e| {
                e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("intruder")
                    && e.reason.as_deref() == Some("GpuMemWithoutAllocation")
            })
        })
        .await?;
        ensure!(event.type_.as_deref() == Some("Warning"), "{event:?}");
        let note = event.note.unwrap_or_default();
        ensure!(
            note.contains(&gpu) && note.contains("delete the pod"),
            "{note}"
        );
        let metrics = cluster.device_plugin_metrics(NODE)?;
        let line = "gpushare_device_plugin_kubelet_mismatches_total{kind=\"no_allocation\"} 1";
        wait_for("the mismatch metric", WAIT, || async {
            let (_, body) = http_get(metrics, "/metrics").await.ok()?;
            body.lines().any(|l| l == line).then_some(())
        })
        .await?;

        // Corrected from the facts: the honest pod waits again for its own Allocate.
        wait_marks(("", "false")).await?;
        kubelet.release("default", "honest");
        wait_running(cluster, "honest").await?;
        ensure!(
            visible("honest") == Some(gpu.clone()),
            "honest not on {gpu}"
        );
        wait_marks(("main", "true")).await?;
        // Only the intruder was reported, once; the booked memory is within the GPU (the
        // intruder's 4 GiB are not booked: that is what the Event says).
        let listed = events.list(&Default::default()).await?.items.into_iter();
        let reported: Vec<String> = listed
            .filter(|e| e.reason.as_deref().is_some_and(|r| r.starts_with("GpuMem")))
            .filter_map(|e| e.regarding.and_then(|r| r.name))
            .collect();
        ensure!(reported == ["intruder"], "{reported:?}");
        check_no_overcommit(&cluster.client).await?;
        Ok(())
    })
    .await
}

/// `(container, devices of our resource)` of a listed pod, in listing order.
fn listed(pod: &PodResources) -> Vec<(String, Vec<String>)> {
    let ours = |c: &ContainerResources| {
        let ours = c
            .devices
            .iter()
            .filter(|d| d.resource_name == DEFAULT_RESOURCE);
        let mut ids: Vec<String> = ours.flat_map(|d| d.device_ids.clone()).collect();
        ids.sort();
        (c.name.clone(), ids)
    };
    pod.containers.iter().map(ours).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubelet_driver_reports_devices_as_kubelet_does() -> anyhow::Result<()> {
    // Without the policy, so that a pod can be created straight onto the node.
    let spec = ClusterSpec::labelled(&[(NODE, &[16])]);
    with_cluster(spec, async |cluster| {
        // init (ordinary, 2 GiB), sidecar (1 GiB), main (3 GiB).
        let mut spec = pod("mixed")
            .init_container("init", 2)
            .init_container("sidecar", 1)
            .container("main", 3)
            .build();
        let init = spec.spec.as_mut().and_then(|s| s.init_containers.as_mut());
        for sidecar in init.into_iter().flatten().filter(|c| c.name == "sidecar") {
            sidecar.restart_policy = Some("Always".to_owned());
        }
        Api::<Pod>::namespaced(cluster.client.clone(), "default")
            .create(&PostParams::default(), &spec)
            .await?;
        wait_running(cluster, "mixed").await?;
        let kubelet = &cluster.nodes[NODE].kubelet;
        let channel = gpushare_proto::connect_unix(&kubelet.pod_resources_socket()).await?;
        let mut client = PodResourcesListerClient::new(channel);

        let list = client.list(ListPodResourcesRequest {}).await?.into_inner();
        let mixed = list
            .pod_resources
            .iter()
            .find(|p| p.name == "mixed" && p.namespace == "default");
        let mixed = mixed.context("mixed is not listed")?;
        let containers = listed(mixed);
        let names: Vec<&str> = containers.iter().map(|(n, _)| n.as_str()).collect();
        ensure!(names == ["sidecar", "main"], "{containers:?}");
        let held = kubelet.container_devices("default", "mixed");
        let devices = |name: &str| -> Vec<String> {
            let ids = held.get(name).and_then(|r| r.get(DEFAULT_RESOURCE));
            let mut ids = ids.cloned().unwrap_or_default();
            ids.sort();
            ids
        };
        ensure!(devices("init").len() == 2, "{held:?}");
        ensure!(containers[0].1 == devices("sidecar") && containers[0].1.len() == 1);
        ensure!(containers[1].1 == devices("main") && containers[1].1.len() == 3);
        // The ordinary init container's devices are reused by the containers after it, as
        // kubelet does; the sidecar keeps its own while main runs.
        let (sidecar, main) = (devices("sidecar"), devices("main"));
        let reused = |id: &String| sidecar.contains(id) || main.contains(id);
        ensure!(devices("init").iter().all(reused), "{held:?}");
        ensure!(sidecar.iter().all(|id| !main.contains(id)), "{held:?}");

        let get = |name: &str| GetPodResourcesRequest {
            pod_name: name.to_owned(),
            pod_namespace: "default".to_owned(),
        };
        let got = client.get(get("mixed")).await?.into_inner().pod_resources;
        ensure!(listed(&got.context("Get answered no pod")?) == containers);
        let missing = client.get(get("nope")).await;
        let missing = missing.expect_err("Get of a pod that does not exist");
        let said = missing.message() == "pod nope in namespace default not found";
        ensure!(said, "{missing:?}");
        let allocatable = client.get_allocatable_resources(AllocatableResourcesRequest {});
        let devices = allocatable.await?.into_inner().devices;
        let ours = devices
            .iter()
            .filter(|d| d.resource_name == DEFAULT_RESOURCE)
            .count();
        ensure!(ours == 16, "{ours} devices allocatable");

        // A pod rejected at admission (no allocation: Allocate refuses it) is not active:
        // not listed.
        let rejected = pod("rejected").gpu_mem(4).on_node(NODE);
        rejected.create(&cluster.client).await?;
        let rejected = cluster.wait_phase("default", "rejected", "Failed", WAIT);
        rejected.await?;
        let list = client.list(ListPodResourcesRequest {}).await?.into_inner();
        let names: Vec<&str> = list.pod_resources.iter().map(|p| p.name.as_str()).collect();
        ensure!(names == ["mixed"], "{names:?}");
        Ok(())
    })
    .await
}
