//! After the fact: the real device plugin reads what the kubelet driver really handed out
//! (kubelet's PodResources API, over the driver's socket) and acts on it.
//!
//! - `an_intruder_holding_a_waiting_pods_allocation_is_reported_and_the_pod_still_runs`: on
//!   a cluster whose admin left out the allocation policy, a pod created straight onto the
//!   node (no scheduler, no allocation) is admitted while an honest pod of the same size
//!   waits; our Allocate matches the honest pod's allocation and marks it. The plugin sees in
//!   kubelet's listing that the intruder holds the devices: a Warning Event on the intruder,
//!   the metric, and the honest pod's stray mark given back, so when kubelet admits it, it
//!   gets its GPU (from guesses alone it would be refused: its allocation looked used).
//! - `the_kubelet_driver_reports_devices_as_kubelet_does`: the driver's PodResources API
//!   itself: sidecars and app containers listed, ordinary init containers not, init devices
//!   reused, rejected pods not listed, `Get` and `GetAllocatableResources`.

use std::time::Duration;

use anyhow::{Context, ensure};
use gpushare_contract::{DEFAULT_RESOURCE, Keys, env};
use gpushare_e2e::cluster::{ClusterSpec, TestCluster, http_get, wait_for, with_cluster};
use gpushare_e2e::fixtures::pod;
use gpushare_e2e::scenarios::{allocation, check_no_overcommit, create_gpu_pod, wait_running};
use gpushare_proto::podresources::v1::pod_resources_lister_client::PodResourcesListerClient;
use gpushare_proto::podresources::v1::{
    AllocatableResourcesRequest, GetPodResourcesRequest, ListPodResourcesRequest, PodResources,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_intruder_holding_a_waiting_pods_allocation_is_reported_and_the_pod_still_runs()
-> anyhow::Result<()> {
    // The story is the marks'; they are on for it (off by default).
    let spec = ClusterSpec::labelled(&[(NODE, &[16])])
        .without_allocation_policy()
        .with_device_plugin_args(&["--allocation-marks", "true"]);
    with_cluster(spec, async |cluster| {
        let kubelet = &cluster.nodes[NODE].kubelet;
        // kubelet learns of the honest pod late; it is scheduled and waits for admission.
        kubelet.hold("default", "honest");
        create_gpu_pod(cluster, "honest", 4).await?;
        let honest = wait_for("pod honest to be bound", WAIT, || async {
            let pod = cluster.pod("default", "honest").await.ok()?;
            allocation(&pod).ok().map(|a| (pod, a))
        })
        .await?;
        let gpu = honest.1.gpu_uuid.clone();

        // The intruder skips the scheduler: bound here, no allocation of its own.
        pod("intruder")
            .gpu_mem(4)
            .on_node(NODE)
            .create(&cluster.client)
            .await?;
        wait_running(cluster, "intruder").await?;
        let env = kubelet
            .container_env("default", "intruder", "main")
            .context("the intruder got no environment")?;
        ensure!(
            env.get(env::NVIDIA_VISIBLE_DEVICES) == Some(&gpu),
            "Allocate answered the intruder with the honest pod's GPU {gpu}: {env:?}"
        );

        // Reported: a Warning Event on the intruder, and the metric.
        let events: Api<Event> = Api::namespaced(cluster.client.clone(), "default");
        let event = wait_for("an Event on the intruder", WAIT, || async {
            events
                .list(&Default::default())
                .await
                .ok()?
                .items
                .into_iter()
                .find(|e| {
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
        wait_for(
            "the honest pod's stray mark to be given back",
            WAIT,
            || async {
                (marks(cluster, "honest").await.ok()? == (String::new(), "false".to_owned()))
                    .then_some(())
            },
        )
        .await?;
        kubelet.release("default", "honest");
        let honest = wait_running(cluster, "honest").await?;
        let env = kubelet
            .container_env("default", "honest", "main")
            .context("the honest pod got no environment")?;
        ensure!(
            env.get(env::NVIDIA_VISIBLE_DEVICES) == Some(&gpu),
            "{env:?}"
        );
        wait_for("the honest pod's marks", WAIT, || async {
            (marks(cluster, "honest").await.ok()? == ("main".to_owned(), "true".to_owned()))
                .then_some(())
        })
        .await?;
        ensure!(honest.metadata.name.as_deref() == Some("honest"));
        // Only the intruder was reported; the booked memory is within the GPU (the
        // intruder's 4 GiB are not booked: that is what the Event says).
        let reported: Vec<String> = events
            .list(&Default::default())
            .await?
            .items
            .into_iter()
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
    pod.containers
        .iter()
        .map(|c| {
            let mut ids: Vec<String> = c
                .devices
                .iter()
                .filter(|d| d.resource_name == DEFAULT_RESOURCE)
                .flat_map(|d| d.device_ids.clone())
                .collect();
            ids.sort();
            (c.name.clone(), ids)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubelet_driver_reports_devices_as_kubelet_does() -> anyhow::Result<()> {
    // Without the policy, so that a pod can be created straight onto the node.
    let spec = ClusterSpec::labelled(&[(NODE, &[16])]).without_allocation_policy();
    with_cluster(spec, async |cluster| {
        // init (ordinary, 2 GiB), sidecar (1 GiB), main (3 GiB).
        let mut spec = pod("mixed")
            .init_container("init", 2)
            .init_container("sidecar", 1)
            .container("main", 3)
            .build();
        if let Some(sidecar) = spec
            .spec
            .as_mut()
            .and_then(|s| s.init_containers.as_mut())
            .and_then(|c| c.iter_mut().find(|c| c.name == "sidecar"))
        {
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
            .find(|p| p.name == "mixed" && p.namespace == "default")
            .context("mixed is not listed")?;
        let containers = listed(mixed);
        let names: Vec<&str> = containers.iter().map(|(n, _)| n.as_str()).collect();
        ensure!(names == ["sidecar", "main"], "{containers:?}");
        let held = kubelet.container_devices("default", "mixed");
        let devices = |name: &str| -> Vec<String> {
            let mut ids = held
                .get(name)
                .and_then(|r| r.get(DEFAULT_RESOURCE))
                .cloned()
                .unwrap_or_default();
            ids.sort();
            ids
        };
        ensure!(devices("init").len() == 2, "{held:?}");
        ensure!(containers[0].1 == devices("sidecar") && containers[0].1.len() == 1);
        ensure!(containers[1].1 == devices("main") && containers[1].1.len() == 3);
        // The ordinary init container's devices are reused by the containers after it, as
        // kubelet does; the sidecar keeps its own while main runs.
        ensure!(
            devices("init")
                .iter()
                .all(|id| devices("sidecar").contains(id) || devices("main").contains(id)),
            "{held:?}"
        );
        ensure!(
            devices("sidecar")
                .iter()
                .all(|id| !devices("main").contains(id)),
            "{held:?}"
        );

        let got = client
            .get(GetPodResourcesRequest {
                pod_name: "mixed".to_owned(),
                pod_namespace: "default".to_owned(),
            })
            .await?
            .into_inner()
            .pod_resources
            .context("Get answered no pod")?;
        ensure!(listed(&got) == containers);
        let missing = client
            .get(GetPodResourcesRequest {
                pod_name: "nope".to_owned(),
                pod_namespace: "default".to_owned(),
            })
            .await
            .expect_err("Get of a pod that does not exist");
        ensure!(
            missing.message() == "pod nope in namespace default not found",
            "{missing:?}"
        );
        let allocatable = client
            .get_allocatable_resources(AllocatableResourcesRequest {})
            .await?
            .into_inner();
        let ours = allocatable
            .devices
            .iter()
            .filter(|d| d.resource_name == DEFAULT_RESOURCE)
            .count();
        ensure!(ours == 16, "{ours} devices allocatable");

        // A pod rejected at admission (no allocation: Allocate refuses it) is not active:
        // not listed.
        pod("rejected")
            .gpu_mem(4)
            .on_node(NODE)
            .create(&cluster.client)
            .await?;
        cluster
            .wait_phase("default", "rejected", "Failed", WAIT)
            .await?;
        let list = client.list(ListPodResourcesRequest {}).await?.into_inner();
        let names: Vec<&str> = list.pod_resources.iter().map(|p| p.name.as_str()).collect();
        ensure!(names == ["mixed"], "{names:?}");
        Ok(())
    })
    .await
}
