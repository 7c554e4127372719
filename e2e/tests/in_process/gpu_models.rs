//! GPU model choice through node affinity: the device plugin labels its node with the models
//! and memory sizes it has, and a pod that requires a model lands only where it is. The
//! model annotation that picks a GPU within a node runs on the real cluster
//! (`the_gpu_model_annotation_picks_the_gpu` in `e2e/tests/real.rs`).

use std::time::Duration;

use anyhow::{Context, ensure};
use gpushare_contract::Keys;
use gpushare_e2e::cluster::{ClusterSpec, wait_for, with_cluster};
use gpushare_e2e::fixtures;
use gpushare_e2e::scenarios::{check_no_overcommit, check_pinned, phase, wait_running};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, PostParams};
use serde_json::json;

/// A 4 GiB pod that requires the node label `key` to exist.
fn requiring(name: &str, key: &str) -> anyhow::Result<Pod> {
    let mut pod = fixtures::pod(name).gpu_mem(4).build();
    let affinity = json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": key, "operator": "Exists"}]}]
    }}});
    pod.spec.get_or_insert_default().affinity = Some(serde_json::from_value(affinity)?);
    Ok(pod)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_requiring_a_gpu_model_runs_only_where_the_model_is() -> anyhow::Result<()> {
    let spec = ClusterSpec::labelled(&[("t4-node", &[15, 15])])
        .with_device_plugin_args(&["--simulate-model", "Tesla T4"]);
    with_cluster(spec, async |cluster| {
        let keys = Keys::default();
        let t4 = keys.gpu_model_label("Tesla T4");
        let a10 = keys.gpu_model_label("NVIDIA A10");
        let nodes: Api<Node> = Api::all(cluster.client.clone());
        let labels = wait_for("the model labels", Duration::from_secs(20), || async {
            let labels = nodes.get("t4-node").await.ok()?.metadata.labels?;
            labels.contains_key(&t4).then_some(labels)
        })
        .await?;
        let mem = labels.get(&keys.gpu_mem_label(15)).map(String::as_str);
        ensure!(
            mem == Some("true") && !labels.contains_key(&a10),
            "{labels:?}"
        );

        let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), "default");
        for (name, label) in [("wants-a10", &a10), ("wants-t4", &t4)] {
            let pod = requiring(name, label)?;
            pods.create(&PostParams::default(), &pod).await?;
        }
        let running = wait_running(cluster, "wants-t4").await?;
        check_pinned(cluster, &running).await?;
        // The A10 pod waits, with the scheduler's own reason; it never got a GPU.
        let waiting = pods.get("wants-a10").await?;
        ensure!(phase(&waiting) == "Pending", "{:?}", phase(&waiting));
        let node = waiting.spec.and_then(|s| s.node_name);
        ensure!(
            node.is_none(),
            "the A10 pod was bound to {node:?}, without A10s"
        );
        let overcommit = check_no_overcommit(&cluster.client).await;
        overcommit.context("over-commit")?;
        Ok(())
    })
    .await
}
