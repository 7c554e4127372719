//! Pods that need more than one GPU, end to end with the real extender and device plugin:
//! a 2 × 8 GiB pod (`<domain>/gpus: "2"`), a whole-2-GPU pod (`<domain>/exclusive`) and
//! shared 4 GiB pods fill two nodes of 2 × 16 GiB, with kubelet admitting them in a shuffled
//! order. Every container sees exactly its pod's GPUs, nothing is over-committed, and a pod
//! that cannot fit says why in its scheduling message.

use std::collections::BTreeSet;

use anyhow::ensure;
use gpushare_contract::{Keys, env};
use gpushare_e2e::cluster::{ClusterSpec, TestCluster, top_details, with_cluster};
use gpushare_e2e::fixtures::pod;
use gpushare_e2e::kubelet::AdmissionOrder;
use gpushare_e2e::scenarios::{
    Harness, allocation, check_no_overcommit, check_pinned, create_pod, wait_bound, wait_running,
    wait_unschedulable,
};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;

/// Creates pod `name` asking for `total` GiB in `main`, laid out by `annotations`.
async fn create(
    cluster: &TestCluster,
    name: &str,
    total: u64,
    annotations: &[(&str, &str)],
) -> anyhow::Result<Pod> {
    let builder = pod(name).namespace(cluster.namespace()).gpu_mem(total);
    let builder = (annotations.iter()).fold(builder, |b, (key, value)| b.annotation(key, value));
    Ok(create_pod(cluster, builder.build()).await?)
}

fn two_nodes(seed: u64) -> ClusterSpec {
    ClusterSpec {
        admission: AdmissionOrder::Shuffled(seed),
        ..ClusterSpec::labelled(&[("node-a", &[16, 16]), ("node-b", &[16, 16])])
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_gpu_whole_gpu_and_shared_pods_share_two_nodes_under_shuffled_admission()
-> anyhow::Result<()> {
    with_cluster(two_nodes(7), async |cluster| {
        let keys = Keys::default();
        let pods: Api<Pod> = Api::namespaced(cluster.client(), cluster.namespace());
        let whole = [
            (keys.request_gpus.as_str(), "2"),
            (keys.request_exclusive.as_str(), "true"),
        ];
        // The large pods first (so binpack does not fill a GPU with small ones before the
        // pair comes), each bound before the next; the shared pods then arrive together,
        // and kubelet admits the pair and them in a shuffled order.
        create(cluster, "whole", 32, &whole).await?;
        wait_bound(&pods, "whole").await?;
        create(cluster, "pair", 16, &[(keys.request_gpus.as_str(), "2")]).await?;
        wait_bound(&pods, "pair").await?;
        let shared = ["s1", "s2", "s3", "s4"];
        for name in shared {
            create(cluster, name, 4, &[]).await?;
        }
        let mut running = Vec::new();
        for name in ["whole", "pair"].iter().chain(&shared) {
            running.push(wait_running(&*cluster, name).await?);
        }
        // The whole-GPU pod holds one node alone; the pair and the shared pods fill the other.
        let whole = allocation(&running[0])?;
        ensure!(whole.exclusive && whole.gpu_count() == 2, "{whole:?}");
        let node_of = |pod: &Pod| pod.spec.as_ref().and_then(|s| s.node_name.clone());
        for pod in &running[1..] {
            let (name, node) = (&pod.metadata.name, node_of(pod));
            ensure!(
                node != node_of(&running[0]),
                "pod {name:?} shares node {node:?} with the whole-GPU pod"
            );
        }
        let pair = allocation(&running[1])?;
        let pair_gpus: BTreeSet<u32> = pair.gpus().map(|(index, _)| index).collect();
        ensure!(pair_gpus.len() == 2 && pair.pod_gib == 8, "{pair:?}");
        // Every container sees exactly its pod's GPUs, whatever order kubelet admitted them.
        for pod in &running {
            check_pinned(&*cluster, pod).await?;
        }
        let env = cluster.container_env("pair", "main").await?;
        let per_gpu = [env::GPU_COUNT, env::CONTAINER_GIB_PER_GPU];
        let per_gpu = per_gpu.map(|k| env.get(k).map(String::as_str));
        ensure!(per_gpu == [Some("2"), Some("8")], "pair env: {env:?}");
        let usage = check_no_overcommit(&cluster.client()).await?;
        let full = usage.values().filter(|(used, total)| used == total).count();
        ensure!(full == 4, "not all four GPUs are full: {usage:?}");
        // One more shared pod cannot fit anywhere (kube-scheduler's own fit already says so:
        // every GiB of both nodes is taken, the whole GPUs counted as kubelet counts them).
        create(cluster, "s5", 4, &[]).await?;
        let reason = wait_unschedulable(&*cluster, "s5").await?;
        ensure!(reason.contains("0/2 nodes are available"), "s5: {reason}");
        // `kubectl gpushare top -d` lists the pair on each of its GPUs.
        let top = top_details(&cluster.client()).await?;
        let pair = |l: &&str| l.split_whitespace().nth(1) == Some("pair");
        let rows = top.lines().filter(pair);
        ensure!(rows.count() == 2, "the pair shows on both its GPUs:\n{top}");
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_gpu_requests_that_cannot_fit_say_why() -> anyhow::Result<()> {
    let spec = ClusterSpec::labelled(&[("node-a", &[16, 16])]);
    with_cluster(spec, async |cluster| {
        let keys = Keys::default();
        let gpus = keys.request_gpus.as_str();
        // Three GPUs: no node has that many.
        create(cluster, "three", 12, &[(gpus, "3")]).await?;
        let reason = wait_unschedulable(&*cluster, "three").await?;
        let why = "needs 3 GPUs with 4 GiB free each; node has 2 healthy GPUs that large";
        ensure!(reason.contains(why), "three: {reason}");
        // A total that does not split evenly over the GPUs.
        create(cluster, "uneven", 9, &[(gpus, "2")]).await?;
        let reason = wait_unschedulable(&*cluster, "uneven").await?;
        ensure!(reason.contains("multiple of 2"), "uneven: {reason}");
        // One GPU holds a small pod: only one GPU is whole, and a whole-2-GPU pod waits,
        // saying so, until the small pod leaves.
        create(cluster, "small", 1, &[]).await?;
        wait_running(&*cluster, "small").await?;
        let exclusive = keys.request_exclusive.as_str();
        // 16 GiB over two whole GPUs: at least 8 GiB each (kubelet counts 16 of the node's
        // 31 free; the extender books both GPUs in full).
        create(cluster, "whole", 16, &[(gpus, "2"), (exclusive, "true")]).await?;
        let reason = wait_unschedulable(&*cluster, "whole").await?;
        let why = "needs 2 whole free GPUs of at least 8 GiB; node has 1";
        ensure!(reason.contains(why), "whole: {reason}");
        let pods: Api<Pod> = Api::namespaced(cluster.client(), cluster.namespace());
        pods.delete("small", &Default::default()).await?;
        let whole = wait_running(&*cluster, "whole").await?;
        check_pinned(&*cluster, &whole).await?;
        ensure!(allocation(&whole)?.exclusive);
        check_no_overcommit(&cluster.client()).await?;
        Ok(())
    })
    .await
}
