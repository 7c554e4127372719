//! `gpushare-extender cleanup-nodes`: the chart's post-delete hook, so that `helm uninstall`
//! leaves no trace of gpushare on the nodes.
//!
//! While installed, gpushare writes on Node objects: the device plugin its inventory and usage
//! annotations (`<domain>/v1.gpus`, `<domain>/v1.usage`) and labels (`<domain>/gpu-count`,
//! `<domain>/gpu-model.*`, `<domain>/gpu-mem-gib.*`), the extender the idle-GPU taint
//! (`<domain>/idle-gpu`). Nothing removes them when the release goes: the components cannot
//! tell an uninstall from a restart, and a restart must not strip a node of its inventory. So
//! helm runs this once the release's objects are deleted: every node loses every label,
//! annotation and taint under `<domain>/`. The admin's opt-in label (`gpushare=true`) is not
//! gpushare's to remove.
//!
//! The extender and the device plugin may still be shutting down when the hook starts (helm
//! deletes, it does not wait for the pods to end), and one of them could write again. So the
//! sweep runs until two passes a few seconds apart find nothing left, within a deadline.
//!
//! `helm test`'s pod is a test hook, which `helm uninstall` does not delete either: the hook
//! deletes it first (`--delete-pods`).
//!
//! A node changed by someone else between read and write is read again: each patch carries
//! the resourceVersion it was computed from.

use std::time::Duration;

use clap::Parser;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};

use crate::config::LogFormat;

/// The first argument that selects this job instead of the extender.
pub const SUBCOMMAND: &str = "cleanup-nodes";

/// Configuration of `gpushare-extender cleanup-nodes`.
#[derive(Debug, Clone, Parser)]
#[command(name = "gpushare-extender cleanup-nodes", version, about)]
pub struct CleanupConfig {
    /// The domain of gpushare's node labels, annotations and taints (the chart's `domain`).
    #[arg(long, env = "GPUSHARE_DOMAIN", default_value = gpushare_contract::DEFAULT_DOMAIN)]
    pub domain: String,
    /// Seconds between the passes that must both find nothing left.
    #[arg(long, env = "GPUSHARE_CLEANUP_SETTLE_SECONDS", default_value_t = 5)]
    pub settle_seconds: u64,
    /// Pods of the release that helm leaves behind (`helm test`'s pod: a test hook is not
    /// deleted with the release), deleted first; absent ones are fine.
    #[arg(long, env = "GPUSHARE_CLEANUP_PODS", value_delimiter = ',')]
    pub delete_pods: Vec<String>,
    /// The namespace of `--delete-pods` (the release namespace).
    #[arg(long, env = "GPUSHARE_POD_NAMESPACE", default_value = "kube-system")]
    pub namespace: String,
    /// Give up (and fail the hook, so helm reports it) after this many seconds.
    #[arg(long, env = "GPUSHARE_CLEANUP_TIMEOUT_SECONDS", default_value_t = 120)]
    pub timeout_seconds: u64,
    /// Log format.
    #[arg(long, env = "GPUSHARE_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

/// Why the nodes could not be cleaned.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No client for the API server.
    #[error("no Kubernetes client: {0}")]
    Client(#[source] kube::Error),
    /// Nodes still carried gpushare's marks at the deadline.
    #[error(
        "after {seconds} s nodes still carry gpushare's labels, annotations or taints ({last}); \
         is a gpushare extender or device plugin still running?"
    )]
    NotClean {
        /// The timeout, in seconds.
        seconds: u64,
        /// The last pass's finding.
        last: String,
    },
}

/// The JSON merge patch that removes every label, annotation and taint under `<domain>/`
/// from `node`, pinned to the resourceVersion it was read at; `None` when it has none.
pub fn cleanup_patch(node: &Node, domain: &str) -> Option<serde_json::Value> {
    let prefix = format!("{domain}/");
    let ours = |key: &String| key.starts_with(&prefix);
    let removed = |map: &Option<std::collections::BTreeMap<String, String>>| {
        map.iter()
            .flatten()
            .filter(|(key, _)| ours(key))
            .map(|(key, _)| (key.clone(), serde_json::Value::Null))
            .collect::<serde_json::Map<_, _>>()
    };
    let labels = removed(&node.metadata.labels);
    let annotations = removed(&node.metadata.annotations);
    let taints = node.spec.as_ref().and_then(|s| s.taints.as_ref());
    let kept_taints = taints.map(|taints| {
        taints
            .iter()
            .filter(|t| !ours(&t.key))
            .cloned()
            .collect::<Vec<_>>()
    });
    let taints_changed = taints
        .zip(kept_taints.as_ref())
        .is_some_and(|(a, b)| a.len() != b.len());
    if labels.is_empty() && annotations.is_empty() && !taints_changed {
        return None;
    }
    let mut patch = serde_json::json!({"metadata": {
        "resourceVersion": node.metadata.resource_version,
    }});
    if !labels.is_empty() {
        patch["metadata"]["labels"] = labels.into();
    }
    if !annotations.is_empty() {
        patch["metadata"]["annotations"] = annotations.into();
    }
    if taints_changed {
        patch["spec"] = serde_json::json!({ "taints": kept_taints });
    }
    Some(patch)
}

/// Sweeps until two passes `settle_seconds` apart find nothing, or the timeout.
pub async fn run(config: CleanupConfig) -> Result<(), Error> {
    let client = kube::Client::try_default().await.map_err(Error::Client)?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &config.namespace);
    for name in &config.delete_pods {
        match pods.delete(name, &DeleteParams::default()).await {
            Ok(_) => tracing::info!(pod = %name, "deleted the release's leftover pod"),
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(error) => {
                tracing::warn!(pod = %name, %error, "cannot delete the release's leftover pod")
            }
        }
    }
    let nodes: Api<Node> = Api::all(client);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(config.timeout_seconds);
    let mut clean_passes = 0;
    loop {
        let last = match sweep(&nodes, &config.domain).await {
            Ok(0) => {
                clean_passes += 1;
                if clean_passes >= 2 {
                    tracing::info!("no node carries gpushare's labels, annotations or taints");
                    return Ok(());
                }
                "none left in one pass".to_owned()
            }
            Ok(cleaned) => {
                clean_passes = 0;
                tracing::info!(
                    nodes = cleaned,
                    "removed gpushare's labels, annotations and taints"
                );
                format!("{cleaned} nodes cleaned in the last pass")
            }
            Err(error) => {
                clean_passes = 0;
                tracing::warn!(%error, "cleaning the nodes failed; trying again");
                error.to_string()
            }
        };
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::NotClean {
                seconds: config.timeout_seconds,
                last,
            });
        }
        tokio::time::sleep(Duration::from_secs(config.settle_seconds.max(1))).await;
    }
}

/// One pass over every node; returns how many were patched.
async fn sweep(nodes: &Api<Node>, domain: &str) -> Result<usize, kube::Error> {
    let mut cleaned = 0;
    for node in nodes.list(&ListParams::default()).await? {
        let Some(patch) = cleanup_patch(&node, domain) else {
            continue;
        };
        let name = node.metadata.name.clone().unwrap_or_default();
        match nodes
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => cleaned += 1,
            // Changed since it was read, or gone: the next pass reads it again.
            Err(kube::Error::Api(status)) if matches!(status.code, 404 | 409) => cleaned += 1,
            Err(error) => return Err(error),
        }
    }
    Ok(cleaned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_testkit::fixtures::node;

    #[test]
    fn only_gpushares_marks_go_and_the_rest_stays() {
        let mut n = node("n1").gpushare().gpus(&[16]).build();
        n.metadata.resource_version = Some("42".into());
        let labels = n.metadata.labels.get_or_insert_default();
        labels.insert("gpushare.example.com/gpu-count".into(), "1".into());
        labels.insert("gpushare.example.com/gpu-model.T4".into(), "true".into());
        labels.insert("kubernetes.io/hostname".into(), "n1".into());
        let annotations = n.metadata.annotations.get_or_insert_default();
        annotations.insert("gpushare.example.com/v1.usage".into(), "{}".into());
        annotations.insert("node.alpha.kubernetes.io/ttl".into(), "0".into());
        n.spec.get_or_insert_default().taints = Some(vec![
            gpushare_contract::taints::idle_gpu_taint("gpushare.example.com/idle-gpu"),
            k8s_openapi::api::core::v1::Taint {
                key: "dedicated".into(),
                effect: "NoSchedule".into(),
                ..Default::default()
            },
        ]);
        let patch = cleanup_patch(&n, "gpushare.example.com").unwrap();
        assert_eq!(patch["metadata"]["resourceVersion"], "42");
        let labels = patch["metadata"]["labels"].as_object().unwrap();
        assert!(labels.values().all(serde_json::Value::is_null));
        assert!(labels.contains_key("gpushare.example.com/gpu-count"));
        assert!(!labels.contains_key("kubernetes.io/hostname"));
        // The admin's opt-in label is not gpushare's to remove.
        assert!(!labels.contains_key("gpushare"));
        let annotations = patch["metadata"]["annotations"].as_object().unwrap();
        assert!(annotations.contains_key("gpushare.example.com/v1.usage"));
        assert!(annotations.contains_key("gpushare.example.com/v1.gpus"));
        assert!(!annotations.contains_key("node.alpha.kubernetes.io/ttl"));
        let taints = patch["spec"]["taints"].as_array().unwrap();
        assert_eq!(taints.len(), 1);
        assert_eq!(taints[0]["key"], "dedicated");
    }

    #[test]
    fn a_node_without_gpushares_marks_is_left_alone() {
        let mut n = node("n1").build();
        n.metadata
            .labels
            .get_or_insert_default()
            .insert("gpushare".into(), "true".into());
        assert_eq!(cleanup_patch(&n, "gpushare.example.com"), None);
    }
}
