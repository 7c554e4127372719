//! Real usage, end to end on simulated GPUs: the device plugin is told what each pod uses
//! (`--simulate-usage-file`), traces it to the GPUs kubelet's PodResources API says the pod
//! holds, and exports allocated vs used on `/metrics` and in the node's `<domain>/v1.usage`
//! annotation; `kubectl gpushare top -d` shows USED beside ALLOCATED and flags the pod over
//! its share. The Event and the eviction of such a pod run on the real cluster
//! (`a_pod_over_its_share_by_the_drivers_count_is_evicted` in `e2e/tests/real.rs`).

use std::time::Duration;

use anyhow::{Context, ensure};
use gpushare_contract::Keys;
use gpushare_contract::usage::NodeMemoryUse;
use gpushare_e2e::cluster::{
    ClusterSpec, TestCluster, http_get, top_details, wait_for, with_cluster,
};
use gpushare_e2e::scenarios::{allocation, create_gpu_pod, wait_running};
use k8s_openapi::api::core::v1::Node;
use kube::Api;

const NODE: &str = "n1";
const WAIT: Duration = Duration::from_secs(60);
const GIB: u64 = 1 << 30;

/// The node's usage annotation, once it reads as `want` (pod → MiB).
async fn wait_annotation(
    cluster: &TestCluster,
    want: &[(&str, u64)],
) -> anyhow::Result<NodeMemoryUse> {
    let nodes: Api<Node> = Api::all(cluster.client.clone());
    let key = Keys::default().node_usage;
    let what = format!("the node's usage annotation to read {want:?}");
    wait_for(&what, WAIT, || async {
        let node = nodes.get(NODE).await.ok()?;
        let text = node.metadata.annotations?.remove(&key)?;
        let usage = NodeMemoryUse::decode(&text).ok()?;
        let pods: Vec<(&str, u64)> = usage.pods.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        (pods == want).then_some(usage)
    })
    .await
}

/// Waits until `/metrics` of the node's device plugin has every line of `want`.
async fn wait_metrics(cluster: &TestCluster, want: &[String]) -> anyhow::Result<()> {
    let addr = cluster.device_plugin_metrics(NODE)?;
    wait_for("the usage metrics", WAIT, || async {
        let (_, body) = http_get(addr, "/metrics").await.ok()?;
        let has = |line: &String| body.lines().any(|l| l == line);
        want.iter().all(has).then_some(())
    })
    .await
}

/// The row of pod `name` in `top -d`'s pod table, split into cells.
fn pod_row<'a>(text: &'a str, name: &str) -> anyhow::Result<Vec<&'a str>> {
    text.lines()
        .map(|line| line.split_whitespace().collect::<Vec<_>>())
        .find(|cells| cells.len() > 2 && cells[0] == "default" && cells[1] == name)
        .with_context(|| format!("no row for pod {name} in\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_over_its_share_shows_in_metrics_the_node_annotation_and_top() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let usage_file = dir.path().join("usage.json");
    // What pods use is read every 200 ms; the annotation may be rewritten at once, for any
    // change of 1 MiB.
    let usage_arg = format!("--simulate-usage-file={}", usage_file.display());
    let spec = ClusterSpec::labelled(&[(NODE, &[16])]).with_device_plugin_args(&[
        usage_arg.as_str(),
        "--usage-period-ms=200",
        "--usage-annotation-min-interval-ms=0",
        "--usage-annotation-min-change-mib=1",
    ]);
    with_cluster(spec, async |cluster| {
        // a (4 GiB) and b (2 GiB) on the same GPU.
        create_gpu_pod(cluster, "a", 4).await?;
        create_gpu_pod(cluster, "b", 2).await?;
        let gpu = allocation(&wait_running(cluster, "a").await?)?.gpu_index;
        ensure!(allocation(&wait_running(cluster, "b").await?)?.gpu_index == gpu);

        // Nothing written yet: measured, nothing in use.
        wait_annotation(cluster, &[("default/a", 0), ("default/b", 0)]).await?;
        let text = top_details(&cluster.client).await?;
        ensure!(pod_row(&text, "a")?.last() == Some(&"0.0"), "{text}");
        ensure!(!text.contains("over its share"), "{text}");

        // a uses less than its 4 GiB, b more than its 2 GiB.
        std::fs::write(&usage_file, r#"{"default/a": "3Gi", "default/b": 3072}"#)?;
        let pod_line = |metric: &str, pod: &str, bytes: u64| {
            format!(
                "gpushare_device_plugin_{metric}{{namespace=\"default\",pod=\"{pod}\",gpu=\"{gpu}\"}} {bytes}"
            )
        };
        let gpu_line = |metric: &str, bytes: u64| {
            format!(
                "gpushare_device_plugin_{metric}{{gpu=\"{gpu}\",uuid=\"GPU-sim-{NODE}-{gpu}\"}} {bytes}"
            )
        };
        let lines = [
            pod_line("pod_allocated_bytes", "a", 4 * GIB),
            pod_line("pod_used_bytes", "a", 3 * GIB),
            pod_line("pod_allocated_bytes", "b", 2 * GIB),
            pod_line("pod_used_bytes", "b", 3 * GIB),
            gpu_line("gpu_allocated_bytes", 6 * GIB),
            gpu_line("gpu_used_bytes", 6 * GIB),
            gpu_line("gpu_unattributed_bytes", 0),
            "gpushare_device_plugin_pods_over_share 1".to_owned(),
        ];
        wait_metrics(cluster, &lines).await?;
        let usage = wait_annotation(cluster, &[("default/a", 3072), ("default/b", 3072)]).await?;
        ensure!(usage.gpus.get(&gpu) == Some(&6144), "{usage:?}");

        let text = top_details(&cluster.client).await?;
        ensure!(text.contains("USED(GiB)"), "{text}");
        for (pod, used) in [("a", "3.0"), ("b", "3.0!")] {
            ensure!(pod_row(&text, pod)?.last() == Some(&used), "{pod}: {text}");
        }
        let flag = "! over its share: its processes use more GPU memory than it was allocated";
        ensure!(text.contains(flag), "{text}");
        ensure!(text.contains("6.0 (37%)"), "GPU{gpu}'s USED cell:\n{text}");

        // b frees memory: no longer flagged anywhere.
        std::fs::write(&usage_file, r#"{"default/a": "3Gi", "default/b": "1Gi"}"#)?;
        let not_over = ["gpushare_device_plugin_pods_over_share 0".to_owned()];
        wait_metrics(cluster, &not_over).await?;
        wait_annotation(cluster, &[("default/a", 3072), ("default/b", 1024)]).await?;
        let text = top_details(&cluster.client).await?;
        ensure!(pod_row(&text, "b")?.last() == Some(&"1.0"), "{text}");
        ensure!(!text.contains("over its share"), "{text}");
        Ok(())
    })
    .await
}
