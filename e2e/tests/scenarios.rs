//! End-to-end scenarios: our real `gpushare-extender` and `gpushare-device-plugin` binaries
//! (simulated GPUs) against the in-process API server, scheduler driver and kubelet drivers.
//! Assertions are on what a user sees: pod phase, node, annotations, each container's
//! environment, the scheduler's reason, and the no-over-commit promise.
//!
//! `notebook_story_on_a_real_cluster` runs the same story against the cluster `KUBECONFIG`
//! names (gpushare installed, one labelled node with one free GPU of 14–16 GiB):
//! `cargo test -p gpushare-e2e --test scenarios -- --ignored`.

use std::time::Duration;

use anyhow::{Context, ensure};
use gpushare_contract::{Keys, inventory};
use gpushare_e2e::apiserver::Verb;
use gpushare_e2e::cluster::{ClusterSpec, TestCluster, wait_for};
use gpushare_e2e::scenarios::{
    Harness, Quiet, RealCluster, allocation, check_no_overcommit, check_pinned, create_gpu_pod,
    notebook, phase, placements, scheduling_message, wait_running,
};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};

/// Runs `body` on a fresh cluster; on failure, prints the tail of our binaries' logs.
async fn with_cluster(
    spec: ClusterSpec,
    body: impl AsyncFnOnce(&mut TestCluster) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let mut cluster = TestCluster::start(spec).await?;
    let result = body(&mut cluster).await;
    if result.is_err() {
        eprintln!("{}", cluster.log_tail(40));
    }
    cluster.shutdown().await;
    result
}

/// Every pod in `names` ends up Running (and pinned right) or Pending with a reason, and
/// stays so for two seconds (a pending pod may still be on its way after a retry).
async fn settle(
    cluster: &TestCluster,
    names: &[String],
) -> anyhow::Result<(Vec<Pod>, Vec<(String, String)>)> {
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), "default");
    let quiet_for = Duration::from_secs(2);
    let mut last: Option<(Vec<String>, tokio::time::Instant)> = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let list = pods.list(&ListParams::default()).await?;
        let state: Option<Vec<String>> = names
            .iter()
            .map(|name| {
                let pod = list
                    .items
                    .iter()
                    .find(|p| p.metadata.name.as_deref() == Some(name))?;
                if phase(pod) == "Running" {
                    Some(format!("{name}: running"))
                } else {
                    scheduling_message(pod).map(|_| format!("{name}: pending"))
                }
            })
            .collect();
        match (state, &last) {
            (Some(state), Some((previous, since))) if *previous == state => {
                if since.elapsed() >= quiet_for {
                    break;
                }
            }
            (Some(state), _) => last = Some((state, tokio::time::Instant::now())),
            (None, _) => last = None,
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "pods did not settle: {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut running = Vec::new();
    let mut pending = Vec::new();
    for name in names {
        let pod = pods.get(name).await?;
        match phase(&pod) {
            "Running" => {
                check_pinned(cluster, &pod).await?;
                running.push(pod);
            }
            "Failed" => anyhow::bail!(
                "pod {name} failed: {:?}",
                pod.status.and_then(|s| s.message)
            ),
            _ => pending.push((name.clone(), scheduling_message(&pod).unwrap_or_default())),
        }
    }
    check_no_overcommit(&cluster.client).await?;
    Ok((running, pending))
}

/// Creates pods one at a time, each once the previous one is bound: a stream of arrivals.
/// (In a burst, kube-scheduler scores the next pod before the previous bind reached the
/// extender, as the real one does; a stream shows the packing policy itself.)
async fn create_stream(
    cluster: &TestCluster,
    prefix: &str,
    sizes: &[u64],
) -> anyhow::Result<Vec<String>> {
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), "default");
    let mut names = Vec::new();
    for (i, gib) in sizes.iter().enumerate() {
        let name = format!("{prefix}-{i}-{gib}g");
        create_gpu_pod(cluster, &name, *gib).await?;
        wait_for(
            &format!("{name} to be bound"),
            Duration::from_secs(60),
            || {
                let pods = pods.clone();
                let name = name.clone();
                async move {
                    let pod = pods.get(&name).await.ok()?;
                    pod.spec.as_ref()?.node_name.as_ref().map(|_| ())
                }
            },
        )
        .await?;
        names.push(name);
    }
    Ok(names)
}

async fn create_all(
    cluster: &TestCluster,
    prefix: &str,
    sizes: &[u64],
) -> anyhow::Result<Vec<String>> {
    let mut names = Vec::new();
    for (i, gib) in sizes.iter().enumerate() {
        let name = format!("{prefix}-{i}-{gib}g");
        create_gpu_pod(cluster, &name, *gib).await?;
        names.push(name);
    }
    Ok(names)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notebook_story_three_share_one_gpu_and_the_fourth_waits_then_runs() -> anyhow::Result<()> {
    with_cluster(
        ClusterSpec::labelled(&[("gpu-node-1", &[15])]),
        async |cluster| {
            let outcome = notebook(&*cluster, &Quiet).await?;
            assert_eq!(outcome.sharing.len(), 3);
            assert!(
                outcome.pending_reason.contains("example.com/gpu-mem")
                    || outcome.pending_reason.contains("GiB"),
                "the reason should name GPU memory: {}",
                outcome.pending_reason
            );
            assert_eq!(outcome.fourth_gpu, outcome.sharing[0].1);
            Ok(())
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_the_label_is_never_used() -> anyhow::Result<()> {
    let spec = ClusterSpec::labelled(&[("shared", &[8])]).with_unlabelled("exclusive", &[16]);
    with_cluster(spec, async |cluster| {
        let names = create_all(cluster, "job", &[4, 4, 4]).await?;
        let (running, pending) = settle(cluster, &names).await?;
        assert_eq!(running.len(), 2, "two 4 GiB pods fit the 8 GiB GPU");
        for pod in &running {
            assert_eq!(
                pod.spec.as_ref().and_then(|s| s.node_name.as_deref()),
                Some("shared")
            );
        }
        let [(_, reason)] = &pending[..] else {
            panic!("one pod should wait: {pending:?}")
        };
        assert!(
            reason.contains("exclusive does not take part"),
            "the unlabelled node's reason is shown: {reason}"
        );
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_mixed_stream_packs_nodes_and_keeps_whole_gpus_free() -> anyhow::Result<()> {
    let spec =
        ClusterSpec::labelled(&[("node-a", &[16, 16, 16, 16]), ("node-b", &[16, 16, 16, 16])]);
    with_cluster(spec, async |cluster| {
        // 40 GiB of small and medium pods: less than one node holds.
        let small = create_stream(cluster, "small", &[1, 2, 4, 8, 3, 2, 1, 6, 5, 8]).await?;
        let (running, pending) = settle(cluster, &small).await?;
        assert!(pending.is_empty(), "all fit: {pending:?}");
        let where_ = placements(&*cluster, &small).await?;
        let nodes: std::collections::BTreeSet<_> =
            where_.values().map(|(node, _)| node.clone()).collect();
        assert_eq!(
            nodes.len(),
            1,
            "node-level binpack puts them on one node: {where_:?}"
        );
        assert_eq!(running.len(), small.len());
        // Whole GPUs stayed free on the other node: four 16 GiB pods fit.
        let large = create_all(cluster, "large", &[16, 16, 16, 16]).await?;
        let (running, pending) = settle(cluster, &large).await?;
        assert!(pending.is_empty(), "whole GPUs were kept free: {pending:?}");
        assert_eq!(running.len(), 4);
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_gpu_sizes_put_large_pods_on_the_large_gpu() -> anyhow::Result<()> {
    with_cluster(
        ClusterSpec::labelled(&[("mixed", &[16, 24])]),
        async |cluster| {
            create_gpu_pod(&*cluster, "big", 20).await?;
            let pod = wait_running(&*cluster, "big").await?;
            check_pinned(&*cluster, &pod).await?;
            assert_eq!(
                allocation(&pod)?.gpu_index,
                1,
                "only the 24 GiB GPU holds 20 GiB"
            );
            create_gpu_pod(&*cluster, "small", 4).await?;
            let small = wait_running(&*cluster, "small").await?;
            assert_eq!(
                allocation(&small)?.gpu_index,
                1,
                "binpack: the GPU with least free that fits (4 GiB left)"
            );
            check_no_overcommit(&cluster.client).await?;
            Ok(())
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extender_crash_mid_burst_never_over_commits() -> anyhow::Result<()> {
    with_cluster(
        ClusterSpec::labelled(&[("n1", &[16, 16]), ("n2", &[16, 16])]),
        async |cluster| {
            let sizes = [2, 3, 4, 5, 6, 2, 3, 4, 5, 6, 1, 2, 3, 4, 8, 6];
            let names = create_all(cluster, "burst", &sizes).await?;
            let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), "default");
            wait_for("a few binds", Duration::from_secs(60), || {
                let pods = pods.clone();
                async move {
                    let list = pods.list(&ListParams::default()).await.ok()?;
                    let bound = list
                        .items
                        .iter()
                        .filter(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_some()))
                        .count();
                    (bound >= 3).then_some(())
                }
            })
            .await?;
            cluster.crash_and_restart_extender().await?;
            let (running, pending) = settle(cluster, &names).await?;
            let total: u64 = sizes.iter().sum();
            assert!(total <= 64);
            for (name, reason) in &pending {
                assert!(!reason.is_empty(), "{name} pending without a reason");
            }
            assert!(running.len() + pending.len() == names.len());
            Ok(())
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_plugin_and_kubelet_restarts_keep_serving() -> anyhow::Result<()> {
    with_cluster(
        ClusterSpec::labelled(&[("n1", &[16, 16])]),
        async |cluster| {
            let first = create_all(cluster, "before", &[4, 4, 2]).await?;
            settle(cluster, &first).await?;
            cluster.restart_device_plugin("n1").await?;
            let second = create_all(cluster, "after-plugin", &[4, 2]).await?;
            let (running, pending) = settle(cluster, &second).await?;
            assert_eq!(running.len(), 2, "pending: {pending:?}");
            cluster.restart_kubelet("n1").await?;
            let third = create_all(cluster, "after-kubelet", &[8, 1]).await?;
            let (running, pending) = settle(cluster, &third).await?;
            assert_eq!(running.len(), 2, "pending: {pending:?}");
            Ok(())
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_errors_slowness_and_watch_drops_lose_nothing() -> anyhow::Result<()> {
    with_cluster(
        ClusterSpec::labelled(&[("n1", &[16, 16]), ("n2", &[16])]),
        async |cluster| {
            let faults = cluster.api.faults();
            faults.set_latency(Duration::from_millis(15));
            faults.set_error_rate(Verb::Create, 0.2, 500);
            faults.set_error_rate(Verb::Patch, 0.2, 503);
            faults.set_error_rate(Verb::List, 0.1, 429);
            let dropper = {
                let faults = faults.clone();
                tokio::spawn(async move {
                    for _ in 0..6 {
                        tokio::time::sleep(Duration::from_millis(700)).await;
                        faults.drop_watches();
                    }
                })
            };
            // Pod creation itself goes through the faulty server: retry like a user would.
            let sizes = [4, 4, 2, 8, 6, 3, 1, 5, 8, 2];
            let mut names = Vec::new();
            for (i, gib) in sizes.iter().enumerate() {
                let name = format!("faulty-{i}-{gib}g");
                wait_for(
                    "pod creation through the faults",
                    Duration::from_secs(30),
                    || async {
                        match create_gpu_pod(&*cluster, &name, *gib).await {
                            Ok(_) => Some(()),
                            Err(error) => error.to_string().contains("AlreadyExists").then_some(()),
                        }
                    },
                )
                .await?;
                names.push(name);
            }
            dropper.await?;
            let (running, pending) = settle(cluster, &names).await?;
            faults.clear();
            ensure!(running.len() + pending.len() == names.len());
            assert!(sizes.iter().sum::<u64>() <= 48);
            assert!(
                pending.iter().all(|(_, reason)| !reason.is_empty()),
                "{pending:?}"
            );
            Ok(())
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhealthy_gpu_gets_no_new_pods_until_it_recovers() -> anyhow::Result<()> {
    with_cluster(
        ClusterSpec::labelled(&[("n1", &[16, 16])]),
        async |cluster| {
            cluster.set_unhealthy("n1", &[0])?;
            let nodes: Api<Node> = Api::all(cluster.client.clone());
            let keys = Keys::default();
            let gpu0_healthy = |nodes: Api<Node>, keys: Keys| async move {
                let node = nodes.get("n1").await.ok()?;
                let gpus =
                    inventory::decode(node.metadata.annotations.as_ref()?.get(&keys.node_gpus)?)
                        .ok()?;
                gpus.iter().find(|g| g.index == 0).map(|g| g.healthy)
            };
            wait_for(
                "GPU 0 to be published unhealthy",
                Duration::from_secs(30),
                || {
                    let (nodes, keys) = (nodes.clone(), keys.clone());
                    async move { (gpu0_healthy(nodes, keys).await == Some(false)).then_some(()) }
                },
            )
            .await?;
            let names = create_all(cluster, "avoid", &[8, 8, 8]).await?;
            let (running, pending) = settle(cluster, &names).await?;
            for pod in &running {
                assert_eq!(
                    allocation(pod)?.gpu_index,
                    1,
                    "nothing new on the unhealthy GPU"
                );
            }
            assert_eq!(running.len(), 2);
            assert_eq!(pending.len(), 1, "{pending:?}");
            cluster.set_unhealthy("n1", &[])?;
            let waiting = &pending[0].0;
            let pod = wait_running(&*cluster, waiting)
                .await
                .context("the waiting pod should start on recovery")?;
            assert_eq!(allocation(&pod)?.gpu_index, 0);
            check_pinned(&*cluster, &pod).await?;
            Ok(())
        },
    )
    .await
}

#[tokio::test]
#[ignore = "needs cluster"]
async fn notebook_story_on_a_real_cluster() -> anyhow::Result<()> {
    let cluster = RealCluster::connect("gpushare-e2e").await?;
    let result = notebook(&cluster, &Quiet).await;
    let _ = check_no_overcommit(&cluster.client()).await;
    cluster.cleanup().await?;
    let outcome = result?;
    assert_eq!(outcome.sharing.len(), 3);
    Ok(())
}
