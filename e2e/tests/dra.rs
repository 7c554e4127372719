//! gpushare's stories in DRA mode: the real `gpushare-dra-plugin` on simulated GPUs, the
//! in-process API server serving `resource.k8s.io/v1`, the DRA scheduler driver allocating
//! memory shares with consumable capacity, the DRA kubelet driver preparing claims over the
//! real sockets and applying the CDI specs the plugin wrote.

use std::collections::BTreeMap;
use std::time::Duration;

use gpushare_e2e::cluster_dra::{DraCluster, GpuUse, key, node_of, phase, unschedulable_message};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::ResourceExt;

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
    let by_name: BTreeMap<String, &ResourceClaim> =
        claims.iter().map(|c| (c.name_any(), c)).collect();
    for pod in pods.iter().filter(|p| phase(p) == "Running") {
        let node = node_of(pod).expect("a running pod is bound");
        let claim = by_name[&format!("{}-gpu", pod.name_any())];
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notebooks_share_one_gpu_and_the_fourth_runs_when_one_leaves() -> anyhow::Result<()> {
    // One "16 GB" T4: 15 GiB, as in the extender-mode story and the demo.
    let cluster = DraCluster::start(&[("gpu-node-1", &[15])]).await?;
    for name in ["notebook-1", "notebook-2", "notebook-3"] {
        cluster.create_gpu_pod(name, 4).await?;
    }
    wait_for_running(&cluster, "three notebooks running", 3).await?;
    let gpus = cluster.gpu_use().await?;
    assert_eq!(gpus.len(), 1);
    assert_eq!((gpus[0].capacity_gib, gpus[0].claimed_gib), (15, 12));

    // The fourth does not fit (12 + 4 > 15): it waits, and the scheduler says why.
    cluster.create_gpu_pod("notebook-4", 4).await?;
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

    // One notebook leaves: kubelet unprepares its claim, the claim is released, and the
    // fourth gets the room.
    cluster.delete_gpu_pod("notebook-2").await?;
    cluster
        .wait_until(WAIT, "notebook-4 running and notebook-2 gone", || async {
            let pods = cluster.pods().await?;
            Ok(pods
                .iter()
                .any(|p| p.name_any() == "notebook-4" && phase(p) == "Running")
                && !pods.iter().any(|p| p.name_any() == "notebook-2"))
        })
        .await?;
    let claims = cluster.claims().await?;
    let released = claims
        .iter()
        .find(|c| c.name_any() == "notebook-2-gpu")
        .expect("claims stay");
    assert!(
        allocation(released).is_none(),
        "the claim of a deleted pod is deallocated"
    );
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
            let pods = cluster.pods().await?;
            if pods.iter().any(|p| p.metadata.deletion_timestamp.is_some()) {
                return Ok(false);
            }
            let gpus = cluster.gpu_use().await?;
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
    let pods = cluster.pods().await?;
    let claims = cluster.claims().await?;
    assert_each_container_gets_its_gpu(&cluster, &pods, &claims);
    let gpus = cluster.gpu_use().await?;
    assert_eq!(gpus[0].claimed_gib, 12);
    let kubelet = &cluster.node("gpu-node-1").expect("started").kubelet;
    assert!(kubelet.errors().is_empty(), "{:?}", kubelet.errors());
    cluster.shutdown().await;
    Ok(())
}
