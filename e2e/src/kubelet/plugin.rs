//! The device manager's client of one registered plugin: dial its endpoint, ask its options,
//! and keep its device list current from ListAndWatch until the stream ends.
//!
//! Separate from registration because it lives as long as the plugin's stream, not as long
//! as the Registration server: a replaced plugin's client runs on until its stream ends.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use gpushare_proto::HEALTHY;
use gpushare_proto::connect_unix as connect;
use gpushare_proto::v1beta1::Empty;
use gpushare_proto::v1beta1::device_plugin_client::DevicePluginClient;

use super::Shared;

/// Dials a registered plugin and keeps its device list current from ListAndWatch.
pub(super) async fn run_plugin(
    shared: Arc<Shared>,
    resource: String,
    path: PathBuf,
    generation: u64,
) {
    let result: anyhow::Result<()> = async {
        let channel = connect(&path)
            .await
            .with_context(|| format!("dialing plugin {}", path.display()))?;
        let mut client = DevicePluginClient::new(channel.clone());
        let options = client
            .get_device_plugin_options(Empty {})
            .await
            .context("GetDevicePluginOptions")?
            .into_inner();
        let mut stream = client
            .list_and_watch(Empty {})
            .await
            .context("ListAndWatch")?
            .into_inner();
        {
            let mut state = shared.lock();
            let Some(plugin) = state.plugins.get_mut(&resource) else {
                return Ok(());
            };
            if plugin.generation != generation {
                return Ok(());
            }
            plugin.options = Some(options);
            plugin.channel = Some(channel);
        }
        // Like kubelet's PluginListAndWatchReceiver, a list updates the resource's devices
        // whichever client it came from.
        while let Some(list) = stream.message().await.context("ListAndWatch stream")? {
            let mut state = shared.lock();
            let Some(plugin) = state.plugins.get_mut(&resource) else {
                return Ok(());
            };
            plugin.numa = list
                .devices
                .iter()
                .filter_map(|device| {
                    let nodes: Vec<i64> = device
                        .topology
                        .as_ref()?
                        .nodes
                        .iter()
                        .map(|n| n.id)
                        .collect();
                    (!nodes.is_empty()).then(|| (device.id.clone(), nodes))
                })
                .collect();
            plugin.devices = list
                .devices
                .into_iter()
                .map(|device| (device.id, device.health == HEALTHY))
                .collect();
            plugin.listed = true;
            drop(state);
            shared.changed();
        }
        Ok(())
    }
    .await;
    if let Err(err) = result {
        tracing::warn!(%resource, error = format!("{err:#}"), "device plugin connection failed");
    }
    // As kubelet does when any client's stream ends (PluginDisconnected is per resource): the
    // resource's devices become unusable, even when the stream was that of a plugin a newer
    // registration already replaced. Only a later list makes them healthy again.
    let mut state = shared.lock();
    if let Some(plugin) = state.plugins.get_mut(&resource) {
        if plugin.generation != generation {
            tracing::info!(%resource, "a replaced plugin's stream ended: devices marked unhealthy, as kubelet does");
        }
        for device in &mut plugin.devices {
            device.1 = false;
        }
    }
    drop(state);
    shared.changed();
}
