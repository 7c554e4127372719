//! One simulated GPU node: the Node object, a kubelet driver, and the real device plugin on
//! simulated GPUs, started and waited for until the node advertises its GPU memory.
//!
//! Separate so that nodes can start many at a time ([`NodeHost`] owns what that needs),
//! apart from the rest of the cluster.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use gpushare_contract::{Keys, inventory};
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::Api;

use super::{ALLOCATION_KEYS, Binaries, Process, RESOURCE, file_tail, wait_for};
use crate::apiserver::PodIdentity;
use crate::fixtures::node;
use crate::kubelet::{AdmissionOrder, KubeletDriver};

/// One simulated GPU node: the real device plugin on simulated GPUs, and a kubelet driver.
pub struct SimNode {
    pub name: String,
    /// GiB of each simulated GPU.
    pub gpus: Vec<u64>,
    /// The kubelet driver (Registration server, pod admission).
    pub kubelet: KubeletDriver,
    pub(super) plugin: Option<Process>,
    plugin_dir: PathBuf,
    pub(super) health_file: PathBuf,
}

pub(super) const NODE_START_CONCURRENCY: usize = 16;

/// What starting a node needs, owned so that many nodes can start at once.
pub(super) struct NodeHost {
    pub(super) client: Client,
    pub(super) dir: PathBuf,
    pub(super) binaries: Binaries,
    /// The device plugins' ServiceAccount ([`DEVICE_PLUGIN_USER`](super::DEVICE_PLUGIN_USER)): each plugin gets a token
    /// naming its node, as the DaemonSet's pods do.
    pub(super) plugin_identity: PodIdentity,
    pub(super) admission: AdmissionOrder,
    /// Extra flags for every device plugin ([`ClusterSpec::device_plugin_args`](super::ClusterSpec::device_plugin_args)).
    pub(super) plugin_args: Vec<String>,
}

impl NodeHost {
    /// Creates the Node, starts its kubelet driver and device plugin, and waits until the
    /// plugin registered and the node advertises its GPU memory.
    pub(super) async fn start_node(
        &self,
        name: &str,
        gpus: &[u64],
        labelled: bool,
    ) -> anyhow::Result<SimNode> {
        let mut builder = node(name);
        if labelled {
            builder = builder.gpushare();
        }
        builder.create(&self.client).await?;
        let plugin_dir = self.dir.join(format!("{name}-device-plugins"));
        std::fs::create_dir_all(&plugin_dir)?;
        let health_file = self.dir.join(format!("{name}-unhealthy-gpus"));
        std::fs::write(&health_file, "")?;
        let kubelet =
            KubeletDriver::start(&plugin_dir, name, self.client.clone(), self.admission).await?;
        let mut sim = SimNode {
            name: name.to_owned(),
            gpus: gpus.to_vec(),
            kubelet,
            plugin: None,
            plugin_dir,
            health_file,
        };
        sim.plugin = Some(self.spawn_plugin(&sim)?);
        let log = self.dir.join(format!("device-plugin-{name}.log"));
        let registered = sim
            .kubelet
            .wait_registered(RESOURCE, Duration::from_secs(60))
            .await;
        registered.with_context(|| {
            let state = match sim.plugin.as_mut().and_then(Process::exit_status) {
                Some(status) => format!("exited: {status}"),
                None => "running".to_owned(),
            };
            format!(
                "node {name}: the device plugin ({state}) did not register; its log ends:\n{}",
                file_tail(&log, 20)
            )
        })?;
        let total: u64 = gpus.iter().sum();
        let nodes: Api<Node> = Api::all(self.client.clone());
        wait_for(
            &format!("node {name} to advertise {total} GiB"),
            Duration::from_secs(60),
            || {
                let nodes = nodes.clone();
                async move {
                    (node_allocatable(&nodes.get(name).await.ok()?)? == total).then_some(())
                }
            },
        )
        .await?;
        // The plugin shows its GPUs healthy on the node once kubelet has its device list.
        wait_for(
            &format!("node {name} to show its GPUs healthy"),
            Duration::from_secs(60),
            || {
                let nodes = nodes.clone();
                async move {
                    let node = nodes.get(name).await.ok()?;
                    let published = published_gpus(&node)?.ok()?;
                    (published.len() == gpus.len() && published.iter().all(|g| g.healthy))
                        .then_some(())
                }
            },
        )
        .await?;
        Ok(sim)
    }

    pub(super) fn spawn_plugin(&self, sim: &SimNode) -> anyhow::Result<Process> {
        let sizes: Vec<String> = sim.gpus.iter().map(u64::to_string).collect();
        let (keys, socket) = (
            self.dir.join(ALLOCATION_KEYS),
            sim.kubelet.pod_resources_socket(),
        );
        let mut args = vec![
            format!("--node-name={}", sim.name),
            format!("--device-plugin-dir={}", sim.plugin_dir.display()),
            "--gpu-backend=simulated".to_owned(),
            format!("--simulate-gpus={}", sizes.join(",")),
            format!("--simulate-health-file={}", sim.health_file.display()),
            // Port 0: the kernel picks a free one at bind time. (A port picked beforehand with
            // `free_port` may be taken by another of 200 processes' connections meanwhile.)
            "--metrics-listen=127.0.0.1:0".to_owned(),
            format!("--allocation-keys-file={}", keys.display()),
            // What the kubelet driver really handed out (kubelet's PodResources API).
            format!("--pod-resources-socket={}", socket.display()),
        ];
        args.extend(self.plugin_args.iter().cloned());
        let log = self.dir.join(format!("device-plugin-{}.log", sim.name));
        let kubeconfig = self
            .dir
            .join(format!("device-plugin-{}.kubeconfig", sim.name));
        std::fs::write(&kubeconfig, self.plugin_identity.kubeconfig_on(&sim.name))
            .with_context(|| format!("writing {}", kubeconfig.display()))?;
        Process::spawn(
            "gpushare-device-plugin",
            &self.binaries.device_plugin,
            &args,
            &kubeconfig,
            &log,
        )
    }
}

/// Waits until the device plugin registered again (after `before` registrations) and
/// listed healthy devices.
pub(super) async fn wait_reregistered(kubelet: &KubeletDriver, before: u64) -> anyhow::Result<()> {
    kubelet
        .wait_until(
            Duration::from_secs(30),
            "the device plugin to register again",
            |k| {
                k.registrations(RESOURCE) > before
                    && k.registered_resources().iter().any(|r| r == RESOURCE)
                    && k.devices(RESOURCE).iter().any(|(_, healthy)| *healthy)
            },
        )
        .await
}

/// The GPU inventory the device plugin published on `node` (`<domain>/v1.gpus`, the default
/// domain); `None` when there is none.
pub fn published_gpus(node: &Node) -> Option<anyhow::Result<Vec<gpushare_contract::GpuInfo>>> {
    let text = node
        .metadata
        .annotations
        .as_ref()?
        .get(&Keys::default().node_gpus)?;
    Some(inventory::decode(text).map_err(anyhow::Error::from))
}

/// `status.allocatable[RESOURCE]` of a node, in GiB.
pub fn node_allocatable(node: &Node) -> Option<u64> {
    node.status
        .as_ref()?
        .allocatable
        .as_ref()?
        .get(RESOURCE)?
        .0
        .parse()
        .ok()
}
