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
use k8s_openapi::api::core::v1::{
    Affinity, Node, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Pod,
};
use kube::api::{Api, PostParams};

/// A 4 GiB pod that requires the node label `key` to exist.
fn requiring(name: &str, key: &str) -> Pod {
    let mut pod = fixtures::pod(name).gpu_mem(4).build();
    pod.spec.get_or_insert_default().affinity = Some(Affinity {
        node_affinity: Some(NodeAffinity {
            required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_expressions: Some(vec![NodeSelectorRequirement {
                        key: key.to_owned(),
                        operator: "Exists".to_owned(),
                        values: None,
                    }]),
                    ..NodeSelectorTerm::default()
                }],
            }),
            ..NodeAffinity::default()
        }),
        ..Affinity::default()
    });
    pod
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
        ensure!(
            labels.get(&keys.gpu_mem_label(15)).map(String::as_str) == Some("true"),
            "{labels:?}"
        );
        ensure!(!labels.contains_key(&a10), "{labels:?}");

        let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), "default");
        pods.create(&PostParams::default(), &requiring("wants-a10", &a10))
            .await?;
        pods.create(&PostParams::default(), &requiring("wants-t4", &t4))
            .await?;
        let running = wait_running(cluster, "wants-t4").await?;
        check_pinned(cluster, &running).await?;
        // The A10 pod waits, with the scheduler's own reason; it never got a GPU.
        let waiting = pods.get("wants-a10").await?;
        ensure!(phase(&waiting) == "Pending", "{:?}", phase(&waiting));
        ensure!(
            waiting
                .spec
                .as_ref()
                .and_then(|s| s.node_name.as_ref())
                .is_none(),
            "the A10 pod was bound to a node without A10s"
        );
        check_no_overcommit(&cluster.client)
            .await
            .context("over-commit")?;
        Ok(())
    })
    .await
}
