//! gpushare's stories in DRA mode: the real `gpushare-dra-plugin` on simulated GPUs, the
//! in-process API server serving `resource.k8s.io/v1`, the DRA scheduler driver allocating
//! memory shares with consumable capacity, the DRA kubelet driver preparing claims over the
//! real sockets and applying the CDI specs the plugin wrote.

use std::collections::BTreeMap;
use std::time::Duration;

use gpushare_e2e::cluster::dra::{DraCluster, GpuUse, key, node_of, phase, unschedulable_message};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};

const WAIT: Duration = Duration::from_secs(60);

/// No GPU holds more than its memory.
fn assert_not_overcommitted(gpus: &[GpuUse]) {
    for gpu in gpus {
        assert!(
            gpu.claimed_gib <= gpu.capacity_gib,
            "{}/{} holds {} GiB of {}",
            gpu.node,
            gpu.device,
            gpu.claimed_gib,
            gpu.capacity_gib
        );
    }
}

/// The GPU (node, device) and GiB a claim was allocated.
fn allocation(claim: &ResourceClaim) -> Option<(String, String, u64)> {
    let result = claim
        .status
        .as_ref()?
        .allocation
        .as_ref()?
        .devices
        .as_ref()?
        .results
        .as_ref()?
        .first()?
        .clone();
    let memory = result.consumed_capacity.as_ref()?.get("memory")?;
    let gib =
        gpushare_dra_plugin::quantity::bytes(&memory.0).ok()? / gpushare_dra_plugin::quantity::GIB;
    Some((result.pool, result.device, u64::try_from(gib).ok()?))
}

/// Every running pod's container sees exactly the GPU and the GiB its claim was allocated,
/// on the node it runs on.
fn assert_each_container_gets_its_gpu(
    cluster: &DraCluster,
    pods: &[Pod],
    claims: &[ResourceClaim],
) {
    for pod in pods.iter().filter(|p| phase(p) == "Running") {
        let node = node_of(pod).expect("a running pod is bound");
        let claim = DraCluster::claim_of(pod, claims)
            .unwrap_or_else(|| panic!("{} runs without its claim", key(pod)));
        let (pool, device, gib) = allocation(claim)
            .unwrap_or_else(|| panic!("{} runs with an unallocated claim", key(pod)));
        assert_eq!(pool, node, "{}: claim allocated on another node", key(pod));
        let reserved = claim
            .status
            .as_ref()
            .and_then(|s| s.reserved_for.clone())
            .unwrap_or_default();
        assert!(
            reserved
                .iter()
                .any(|r| Some(&r.uid) == pod.metadata.uid.as_ref()),
            "{}: claim not reserved for it",
            key(pod)
        );
        let index = device.strip_prefix("gpu-").expect("our device names");
        let env = cluster
            .node(&node)
            .and_then(|n| n.kubelet.container_env("default", &pod.name_any(), "main"))
            .unwrap_or_else(|| panic!("{}: no environment recorded", key(pod)));
        let uuid = format!("GPU-sim-{node}-{index}");
        assert_eq!(
            env.get("NVIDIA_VISIBLE_DEVICES"),
            Some(&uuid),
            "{}",
            key(pod)
        );
        assert_eq!(
            env.get("GPUSHARE_GPU_INDEX").map(String::as_str),
            Some(index),
            "{}",
            key(pod)
        );
        assert_eq!(
            env.get("GPUSHARE_CONTAINER_MEM_GIB"),
            Some(&gib.to_string()),
            "{}",
            key(pod)
        );
    }
}

/// Waits until exactly `count` pods run.
async fn wait_for_running(cluster: &DraCluster, what: &str, count: usize) -> anyhow::Result<()> {
    cluster
        .wait_until(WAIT, what, || async {
            Ok(cluster
                .pods()
                .await?
                .iter()
                .filter(|p| phase(p) == "Running")
                .count()
                == count)
        })
        .await
}

/// The claims generated for pod `pod` (from a template): named `<pod>-gpu-<suffix>`.
fn generated_claims<'a>(claims: &'a [ResourceClaim], pod: &str) -> Vec<&'a ResourceClaim> {
    claims
        .iter()
        .filter(|c| {
            c.name_any()
                .strip_prefix(&format!("{pod}-gpu-"))
                .is_some_and(|suffix| suffix.len() == 5)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notebooks_share_one_gpu_and_the_fourth_runs_when_one_leaves() -> anyhow::Result<()> {
    // One "16 GB" T4: 15 GiB, as in the extender-mode story and the demo. The notebooks are
    // written as users write DRA pods: one ResourceClaimTemplate, named by every pod.
    let cluster = DraCluster::start(&[("gpu-node-1", &[15])]).await?;
    cluster.create_claim_template("notebook-4g", 4).await?;
    for name in ["notebook-1", "notebook-2", "notebook-3"] {
        cluster.create_templated_pod(name, "notebook-4g").await?;
    }
    wait_for_running(&cluster, "three notebooks running", 3).await?;
    let gpus = cluster.gpu_use().await?;
    assert_eq!(gpus.len(), 1);
    assert_eq!((gpus[0].capacity_gib, gpus[0].claimed_gib), (15, 12));
    // One claim per pod, generated from the template, owned by the pod and recorded in its
    // status.
    let claims = cluster.claims().await?;
    assert_eq!(claims.len(), 3);
    for pod in cluster.pods().await? {
        let generated = generated_claims(&claims, &pod.name_any());
        assert_eq!(generated.len(), 1, "{}", key(&pod));
        let owner = &generated[0]
            .metadata
            .owner_references
            .as_deref()
            .unwrap_or_default()[0];
        assert_eq!(
            (owner.kind.as_str(), Some(&owner.uid), owner.controller),
            ("Pod", pod.metadata.uid.as_ref(), Some(true))
        );
        let recorded = pod
            .status
            .as_ref()
            .and_then(|s| s.resource_claim_statuses.clone())
            .unwrap_or_default();
        assert_eq!(recorded.len(), 1);
        assert_eq!(
            recorded[0].resource_claim_name.as_deref(),
            Some(generated[0].name_any().as_str())
        );
    }

    // The fourth does not fit (12 + 4 > 15): it waits, and the scheduler says why.
    cluster
        .create_templated_pod("notebook-4", "notebook-4g")
        .await?;
    cluster
        .wait_until(WAIT, "notebook-4 to be reported unschedulable", || async {
            let pods = cluster.pods().await?;
            let fourth = pods.iter().find(|p| p.name_any() == "notebook-4");
            Ok(fourth
                .and_then(unschedulable_message)
                .is_some_and(|m| m.contains("4Gi of memory free")))
        })
        .await?;
    let pods = cluster.pods().await?;
    let fourth = pods
        .iter()
        .find(|p| p.name_any() == "notebook-4")
        .expect("created");
    assert_eq!(node_of(fourth), None);
    assert_not_overcommitted(&cluster.gpu_use().await?);
    assert_each_container_gets_its_gpu(&cluster, &pods, &cluster.claims().await?);

    // One notebook leaves: kubelet unprepares its claim, the claim is released and, as it
    // was made for the pod, deleted; the fourth gets the room.
    cluster.delete_gpu_pod("notebook-2").await?;
    cluster
        .wait_until(
            WAIT,
            "notebook-4 running, notebook-2 and its claim gone",
            || async {
                let pods = cluster.pods().await?;
                let claims = cluster.claims().await?;
                Ok(pods
                    .iter()
                    .any(|p| p.name_any() == "notebook-4" && phase(p) == "Running")
                    && !pods.iter().any(|p| p.name_any() == "notebook-2")
                    && generated_claims(&claims, "notebook-2").is_empty())
            },
        )
        .await?;
    let claims = cluster.claims().await?;
    assert_eq!(claims.len(), 3, "one claim per remaining notebook");
    let gpus = cluster.gpu_use().await?;
    assert_eq!(gpus[0].claimed_gib, 12);
    assert_not_overcommitted(&gpus);
    let pods = cluster.pods().await?;
    assert_each_container_gets_its_gpu(&cluster, &pods, &claims);
    let kubelet = &cluster.node("gpu-node-1").expect("started").kubelet;
    assert_eq!(kubelet.prepared_claims().len(), 3);
    assert!(kubelet.errors().is_empty(), "{:?}", kubelet.errors());
    cluster.shutdown().await;
    Ok(())
}

/// A pod naming a template that does not exist yet waits (no claim, not bound); once the
/// template is created its claim is made and it runs. A pod cannot take over another pod's
/// generated claim by naming it in its status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_waits_for_its_template_and_cannot_use_another_pods_claim() -> anyhow::Result<()> {
    let cluster = DraCluster::start(&[("gpu-node-1", &[15])]).await?;
    cluster.create_templated_pod("early", "later-4g").await?;
    // The controller has seen the pod (its watch delivers in order) once it has made the
    // claim of a pod created after it.
    cluster.create_claim_template("now-2g", 2).await?;
    cluster.create_templated_pod("marker", "now-2g").await?;
    wait_for_running(&cluster, "the marker pod running", 1).await?;
    let claims = cluster.claims().await?;
    assert!(generated_claims(&claims, "early").is_empty());
    // As kube-controller-manager does, the pod says why.
    let events = Api::<Event>::namespaced(cluster.client.clone(), "default")
        .list(&Default::default())
        .await?;
    assert!(
        events.items.iter().any(|e| {
            e.reason.as_deref() == Some("FailedResourceClaimCreation")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("early")
                && e.note
                    .as_deref()
                    .is_some_and(|n| n.contains("\"later-4g\" not found"))
        }),
        "{:?}",
        events.items
    );
    let early = cluster
        .pods()
        .await?
        .into_iter()
        .find(|p| p.name_any() == "early")
        .expect("created");
    assert_eq!(node_of(&early), None);

    cluster.create_claim_template("later-4g", 4).await?;
    wait_for_running(&cluster, "both pods running", 2).await?;
    let claims = cluster.claims().await?;
    let early_claim = generated_claims(&claims, "early")[0].name_any();

    // A pod whose status names that claim as its own is refused: the claim was made for
    // pod early, and a generated claim serves only the pod that controls it.
    cluster
        .create_templated_pod("impostor", "no-such-template")
        .await?;
    let status = serde_json::json!({"status": {"resourceClaimStatuses": [
        {"name": "gpu", "resourceClaimName": early_claim}
    ]}});
    Api::<Pod>::namespaced(cluster.client.clone(), "default")
        .patch_status("impostor", &PatchParams::default(), &Patch::Merge(status))
        .await?;
    cluster
        .wait_until(WAIT, "the impostor to be refused", || async {
            let pods = cluster.pods().await?;
            Ok(pods
                .iter()
                .find(|p| p.name_any() == "impostor")
                .and_then(unschedulable_message)
                .is_some_and(|m| m.contains("pod is not owner")))
        })
        .await?;
    let claims = cluster.claims().await?;
    assert_eq!(claims.len(), 2, "no claim for the impostor: {claims:?}");
    cluster.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_stream_packs_without_overcommitting_any_gpu() -> anyhow::Result<()> {
    let cluster = DraCluster::start(&[("n1", &[16, 16]), ("n2", &[24, 8])]).await?;
    // A fixed mixed stream: sizes 1..=8 GiB, more than fits (64 GiB of GPUs), with
    // departures along the way.
    let sizes: Vec<u64> = (0..24u64).map(|i| (i * 5 + 3) % 8 + 1).collect();
    for (i, gib) in sizes.iter().enumerate() {
        cluster.create_gpu_pod(&format!("p{i:02}"), *gib).await?;
        if i % 6 == 5 {
            // Wait for the earlier pods to settle, then let one go.
            let leaving = format!("p{:02}", i - 3);
            cluster
                .wait_until(
                    WAIT,
                    "the leaving pod to be scheduled or refused",
                    || async {
                        let pods = cluster.pods().await?;
                        Ok(pods.iter().any(|p| {
                            p.name_any() == leaving
                                && (phase(p) == "Running" || unschedulable_message(p).is_some())
                        }))
                    },
                )
                .await?;
            cluster.delete_gpu_pod(&leaving).await?;
        }
    }
    let gib_of: BTreeMap<String, u64> = sizes
        .iter()
        .enumerate()
        .map(|(i, g)| (format!("p{i:02}"), *g))
        .collect();
    // Settled: every pod runs, or waits because no GPU has room for it.
    cluster
        .wait_until(WAIT, "the stream to settle", || async {
            // Read in this order: what the GPUs hold, then the claims, then the pods, so that
            // a pod placed while we read shows up as not running rather than as not fitting.
            let gpus = cluster.gpu_use().await?;
            let claims = cluster.claims().await?;
            let pods = cluster.pods().await?;
            if pods.iter().any(|p| p.metadata.deletion_timestamp.is_some()) {
                return Ok(false);
            }
            // In flight: a pod just removed still holds its claim's allocation until the
            // release pass has seen it go, and a pod being scheduled holds one before its
            // Binding lands. Settled means every allocation belongs to a running pod.
            let in_flight = claims.iter().any(|c| {
                allocation(c).is_some()
                    && !pods.iter().any(|p| {
                        phase(p) == "Running"
                            && DraCluster::claim_of(p, &claims)
                                .is_some_and(|mine| mine.metadata.uid == c.metadata.uid)
                    })
            });
            if in_flight {
                return Ok(false);
            }
            let most_free = gpus
                .iter()
                .map(|g| g.capacity_gib.saturating_sub(g.claimed_gib))
                .max()
                .unwrap_or(0);
            Ok(pods.iter().all(|p| {
                phase(p) == "Running" || (node_of(p).is_none() && gib_of[&p.name_any()] > most_free)
            }))
        })
        .await?;
    let pods = cluster.pods().await?;
    let claims = cluster.claims().await?;
    let gpus = cluster.gpu_use().await?;
    assert_not_overcommitted(&gpus);
    assert_each_container_gets_its_gpu(&cluster, &pods, &claims);
    // The books agree: what the claims hold is what the running pods asked for.
    let running: u64 = pods
        .iter()
        .filter(|p| phase(p) == "Running")
        .map(|p| gib_of[&p.name_any()])
        .sum();
    assert_eq!(gpus.iter().map(|g| g.claimed_gib).sum::<u64>(), running);
    assert!(
        pods.iter().filter(|p| phase(p) == "Running").count() >= 10,
        "the GPUs are used"
    );
    for node in &cluster.nodes {
        assert!(
            node.kubelet.errors().is_empty(),
            "{}: {:?}",
            node.name,
            node.kubelet.errors()
        );
    }
    cluster.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_crash_loses_no_prepared_claim() -> anyhow::Result<()> {
    let mut cluster = DraCluster::start(&[("gpu-node-1", &[15])]).await?;
    for name in ["notebook-1", "notebook-2"] {
        cluster.create_gpu_pod(name, 4).await?;
    }
    wait_for_running(&cluster, "two notebooks running", 2).await?;
    let specs = |cluster: &DraCluster| -> anyhow::Result<usize> {
        let dir = &cluster.node("gpu-node-1").expect("started").cdi_dir;
        Ok(std::fs::read_dir(dir)?
            .filter_map(Result::ok)
            .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
            .count())
    };
    assert_eq!(specs(&cluster)?, 2);

    // The plugin crashes and comes back: its checkpoint remembers both claims.
    cluster.crash_and_restart_plugin("gpu-node-1").await?;

    // Deleting a notebook unprepares its claim through the new process (the CDI spec goes);
    // a new notebook is prepared by it.
    cluster.delete_gpu_pod("notebook-1").await?;
    cluster.create_gpu_pod("notebook-3", 8).await?;
    cluster
        .wait_until(WAIT, "notebook-1 gone and notebook-3 running", || async {
            let pods = cluster.pods().await?;
            Ok(!pods.iter().any(|p| p.name_any() == "notebook-1")
                && pods
                    .iter()
                    .any(|p| p.name_any() == "notebook-3" && phase(p) == "Running"))
        })
        .await?;
    assert_eq!(
        specs(&cluster)?,
        2,
        "notebook-1's spec removed, notebook-3's written"
    );

    // A rollout: the new plugin starts while the old one shuts down. The driver must stay
    // registered (the old one's exit once deleted the new one's sockets) and prepare the
    // next pod.
    cluster.roll_plugin("gpu-node-1").await?;
    cluster.create_gpu_pod("notebook-4", 2).await?;
    wait_for_running(&cluster, "notebook-4 running after the rollout", 3).await?;
    let pods = cluster.pods().await?;
    let claims = cluster.claims().await?;
    assert_each_container_gets_its_gpu(&cluster, &pods, &claims);
    let gpus = cluster.gpu_use().await?;
    assert_eq!(gpus[0].claimed_gib, 14);
    let kubelet = &cluster.node("gpu-node-1").expect("started").kubelet;
    assert!(kubelet.errors().is_empty(), "{:?}", kubelet.errors());
    cluster.shutdown().await;
    Ok(())
}

/// A claim of two GPUs (one request, `count: 2`, 4 GiB of each): kube-scheduler's allocator
/// gives it two distinct GPUs and the container sees both, with extender mode's multi-GPU
/// environment (the plugin once refused any claim of more than one device).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_of_two_gpus_sees_both() -> anyhow::Result<()> {
    let cluster = DraCluster::start(&[("gpu-node-1", &[16, 16])]).await?;
    let template: k8s_openapi::api::resource::v1::ResourceClaimTemplate =
        serde_json::from_value(serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "two-gpus", "namespace": "default"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "gpu-mem.gpushare.example.com",
                "allocationMode": "ExactCount", "count": 2,
                "capacity": {"requests": {"memory": "4Gi"}}}}]}}}
        }))?;
    Api::namespaced(cluster.client.clone(), "default")
        .create(&kube::api::PostParams::default(), &template)
        .await?;
    cluster.create_templated_pod("trainer", "two-gpus").await?;
    wait_for_running(&cluster, "the two-GPU pod running", 1).await?;
    let env = cluster
        .node("gpu-node-1")
        .and_then(|n| n.kubelet.container_env("default", "trainer", "main"))
        .expect("the container's environment");
    let visible: Vec<&str> = env["NVIDIA_VISIBLE_DEVICES"].split(',').collect();
    assert_eq!(visible.len(), 2, "{env:?}");
    assert_ne!(visible[0], visible[1], "{env:?}");
    assert_eq!(env["GPUSHARE_GPU_COUNT"], "2");
    assert_eq!(env["GPUSHARE_CONTAINER_MEM_GIB_PER_GPU"], "4");
    let gpus = cluster.gpu_use().await?;
    let claimed: Vec<u64> = gpus.iter().map(|g| g.claimed_gib).collect();
    assert_eq!(claimed, [4, 4]);
    cluster.shutdown().await;
    Ok(())
}

/// The taints the slice of `node` puts on `device`.
async fn taints_of(cluster: &DraCluster, node: &str, device: &str) -> anyhow::Result<Vec<String>> {
    Ok(cluster
        .slices()
        .await?
        .iter()
        .filter(|s| s.spec.node_name.as_deref() == Some(node))
        .flat_map(|s| s.spec.devices.iter().flatten())
        .filter(|d| d.name == device)
        .flat_map(|d| d.taints.iter().flatten())
        .map(|t| format!("{}:{}", t.key, t.effect))
        .collect())
}

/// The device the claim of pod `pod` was allocated.
async fn device_of(cluster: &DraCluster, pod: &str) -> anyhow::Result<Option<String>> {
    let pods = cluster.pods().await?;
    let claims = cluster.claims().await?;
    Ok(pods
        .iter()
        .find(|p| p.name_any() == pod)
        .and_then(|p| DraCluster::claim_of(p, &claims))
        .and_then(allocation)
        .map(|(_, device, _)| device))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhealthy_gpu_gets_no_new_claims_and_its_pods_keep_running() -> anyhow::Result<()> {
    let cluster = DraCluster::start(&[("gpu-node-1", &[8, 8])]).await?;
    // First fit: the first pod lands on gpu-0.
    cluster.create_gpu_pod("before", 4).await?;
    wait_for_running(&cluster, "pod before running", 1).await?;
    assert_eq!(
        device_of(&cluster, "before").await?.as_deref(),
        Some("gpu-0")
    );

    // gpu-0 breaks: the plugin taints its device, and a new pod (which gpu-0 has room for)
    // goes to gpu-1. The pod already there keeps running on its allocation.
    cluster.set_unhealthy("gpu-node-1", &[0])?;
    cluster
        .wait_until(WAIT, "gpu-0 to be tainted", || async {
            Ok(taints_of(&cluster, "gpu-node-1", "gpu-0").await?
                == ["gpushare.example.com/unhealthy:NoSchedule"])
        })
        .await?;
    assert!(taints_of(&cluster, "gpu-node-1", "gpu-1").await?.is_empty());
    cluster.create_gpu_pod("after", 2).await?;
    wait_for_running(&cluster, "both pods running", 2).await?;
    assert_eq!(
        device_of(&cluster, "after").await?.as_deref(),
        Some("gpu-1")
    );
    assert_eq!(
        device_of(&cluster, "before").await?.as_deref(),
        Some("gpu-0")
    );

    // Healthy again: the taint goes and gpu-0 takes new claims again.
    cluster.set_unhealthy("gpu-node-1", &[])?;
    cluster
        .wait_until(WAIT, "gpu-0's taint to be lifted", || async {
            Ok(taints_of(&cluster, "gpu-node-1", "gpu-0").await?.is_empty())
        })
        .await?;
    cluster.create_gpu_pod("recovered", 1).await?;
    wait_for_running(&cluster, "three pods running", 3).await?;
    assert_eq!(
        device_of(&cluster, "recovered").await?.as_deref(),
        Some("gpu-0")
    );
    let kubelet = &cluster.node("gpu-node-1").expect("started").kubelet;
    assert!(kubelet.errors().is_empty(), "{:?}", kubelet.errors());
    cluster.shutdown().await;
    Ok(())
}

/// `kubectl gpushare top` on a DRA cluster: the rows come from the slices and the claims'
/// allocations, as `top` gathers them (same hook, same renderer as extender mode).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_shows_dra_allocations_per_gpu() -> anyhow::Result<()> {
    let cluster = DraCluster::start(&[("gpu-node-1", &[15, 16])]).await?;
    cluster.create_claim_template("notebook-4g", 4).await?;
    for name in ["notebook-1", "notebook-2"] {
        cluster.create_templated_pod(name, "notebook-4g").await?;
    }
    wait_for_running(&cluster, "two notebooks running", 2).await?;
    // 12 GiB do not fit beside the notebooks on gpu-0 (8 + 12 > 15): gpu-1.
    cluster.create_gpu_pod("trainer", 12).await?;
    wait_for_running(&cluster, "three pods running", 3).await?;
    cluster.set_unhealthy("gpu-node-1", &[1])?;
    cluster
        .wait_until(WAIT, "gpu-1 to be tainted", || async {
            Ok(!taints_of(&cluster, "gpu-node-1", "gpu-1").await?.is_empty())
        })
        .await?;

    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    cluster.api.write_kubeconfig(&kubeconfig)?;
    let kubectl = kubectl_gpushare::cluster::Cluster::connect(Some(&kubeconfig)).await?;
    let (nodes, pods) = tokio::try_join!(kubectl.nodes(), kubectl.pods())?;
    let settings = kubectl_gpushare::usage::Settings::default();
    let mut usage = kubectl_gpushare::usage::cluster_usage(&nodes, &pods, &settings);
    kubectl_gpushare::dra::add_rows(
        &kubectl,
        &mut usage,
        &nodes,
        &pods,
        gpushare_e2e::cluster::dra::DRIVER,
    )
    .await;

    let top = kubectl_gpushare::render::render_top(&usage);
    let row: Vec<&str> = top
        .lines()
        .find(|l| l.starts_with("gpu-node-1"))
        .unwrap_or_else(|| panic!("no row for the node:\n{top}"))
        .split_whitespace()
        .collect();
    // NAME, IPADDRESS, GPU0, GPU1 (unhealthy: starred), PENDING, node total.
    assert_eq!(
        row,
        ["gpu-node-1", "-", "8/15", "12/16*", "0", "20/31"],
        "{top}"
    );
    assert!(
        top.contains("Allocated/Total GPU Memory In Cluster: 20/31"),
        "{top}"
    );
    let details = kubectl_gpushare::render::render_top_details(&usage);
    let pod_row = |name: &str| -> Vec<String> {
        details
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(name))
            .unwrap_or_else(|| panic!("no row for {name}:\n{details}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    };
    // NAMESPACE, NAME, GPU0, GPU1, PENDING (then whatever further columns top prints).
    for (name, cells) in [
        ("notebook-1", ["4", "0", "0"]),
        ("notebook-2", ["4", "0", "0"]),
        ("trainer", ["0", "12", "0"]),
    ] {
        assert_eq!(pod_row(name)[2..5], cells, "{details}");
    }
    cluster.shutdown().await;
    Ok(())
}

/// Where the API server drops device taints (`DRADeviceTaints` off, as before Kubernetes
/// 1.36), the plugin notices and leaves the unhealthy GPU out of its slice instead, so it is
/// still not offered; it comes back when healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_device_taints_an_unhealthy_gpu_is_withdrawn() -> anyhow::Result<()> {
    let cluster = DraCluster::start(&[("gpu-node-1", &[8, 8])]).await?;
    cluster.api.set_dra_device_taints(false);
    let devices = || async {
        let mut names: Vec<String> = cluster
            .slices()
            .await?
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .map(|d| d.name.clone())
            .collect();
        names.sort();
        anyhow::Ok(names)
    };
    cluster.set_unhealthy("gpu-node-1", &[0])?;
    cluster
        .wait_until(WAIT, "gpu-0 to be withdrawn", || async {
            Ok(devices().await? == ["gpu-1"])
        })
        .await?;
    cluster.create_gpu_pod("placed", 2).await?;
    wait_for_running(&cluster, "the pod running", 1).await?;
    assert_eq!(
        device_of(&cluster, "placed").await?.as_deref(),
        Some("gpu-1")
    );
    cluster.set_unhealthy("gpu-node-1", &[])?;
    cluster
        .wait_until(WAIT, "gpu-0 to be offered again", || async {
            Ok(devices().await? == ["gpu-0", "gpu-1"])
        })
        .await?;
    cluster.shutdown().await;
    Ok(())
}
