//! Node capacity from device plugin lists, as kubelet's node status manager writes it.
//!
//! Separate because it writes the Node, not pods: its own loop, its own retries.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

use super::Shared;

/// What kubelet's node status manager does with device plugin lists: the node's capacity of
/// each resource is its plugin's device count, allocatable the healthy ones. Patched on the
/// `nodes/status` subresource whenever a list changes.
pub(super) async fn sync_node_capacity(
    shared: Arc<Shared>,
    client: Client,
    node: String,
    stop: CancellationToken,
) {
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client);
    let mut changes = shared.changes.subscribe();
    let mut written: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    loop {
        let wanted: BTreeMap<String, (usize, usize)> = shared
            .lock()
            .plugins
            .iter()
            .filter(|(_, plugin)| plugin.listed)
            .map(|(resource, plugin)| {
                let healthy = plugin
                    .devices
                    .iter()
                    .filter(|(_, healthy)| *healthy)
                    .count();
                (resource.clone(), (plugin.devices.len(), healthy))
            })
            .collect();
        let stale: BTreeMap<_, _> = wanted
            .iter()
            .filter(|(r, v)| written.get(*r) != Some(v))
            .collect();
        if !stale.is_empty() {
            let (mut capacity, mut allocatable) = (serde_json::Map::new(), serde_json::Map::new());
            for (resource, (total, healthy)) in &stale {
                capacity.insert((*resource).clone(), total.to_string().into());
                allocatable.insert((*resource).clone(), healthy.to_string().into());
            }
            let patch =
                serde_json::json!({"status": {"capacity": capacity, "allocatable": allocatable}});
            match nodes
                .patch_status(&node, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => written.extend(stale.into_iter().map(|(r, v)| (r.clone(), *v))),
                Err(error) => {
                    tracing::warn!(%node, %error, "node capacity update failed; retrying")
                }
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            _ = changes.changed() => {}
            () = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
}
