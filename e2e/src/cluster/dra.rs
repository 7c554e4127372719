//! gpushare in DRA mode, in one process tree: the in-process API server, the DRA scheduler
//! driver ([`crate::scheduler::dra`]) and per node a DRA kubelet driver
//! ([`crate::kubelet::dra`]) with the REAL `gpushare-dra-plugin` binary on simulated GPUs.
//! No extender, no device plugin: the scheduler allocates GPU-memory shares itself.
//!
//! The DeviceClass is the one the chart installs in DRA mode (less `extendedResourceName`,
//! which the scheduler driver does not implement). Pods either name a ResourceClaimTemplate,
//! as users write DRA pods, and kube-controller-manager's resourceclaim controller
//! ([`crate::resourceclaim`]) stamps out their claims, or name a claim created beforehand.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use gpushare_contract::DEFAULT_DOMAIN;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

use super::{Process, binaries};
use crate::apiserver::ApiServer;
use crate::fixtures::node;
use crate::kubelet::dra::DraKubelet;
use crate::resourceclaim::ClaimController;
use crate::scheduler::dra::DraScheduler;

/// The driver name (the chart's default).
pub const DRIVER: &str = DEFAULT_DOMAIN;
/// The DeviceClass pods' claims name.
pub const DEVICE_CLASS: &str = "gpu-mem.gpushare.example.com";
/// The username every DRA plugin acts as: the chart's DRA plugin ServiceAccount (release
/// `gpushare` in `kube-system`).
pub const DRA_PLUGIN_USER: &str = "system:serviceaccount:kube-system:gpushare-dra-plugin";
/// The namespace scenario pods live in.
pub const NAMESPACE: &str = "default";

/// One node: its kubelet driver and its plugin process.
pub struct DraNode {
    /// The node's name.
    pub name: String,
    /// The DRA side of its kubelet.
    pub kubelet: DraKubelet,
    /// The plugin's directory (DRA socket, checkpoint).
    pub plugin_dir: PathBuf,
    /// The node's CDI spec directory.
    pub cdi_dir: PathBuf,
    /// The simulated GPUs' health file (indices of unhealthy GPUs).
    pub health_file: PathBuf,
    plugin: Option<Process>,
    plugin_args: Vec<String>,
    plugin_log: PathBuf,
    kubeconfig: PathBuf,
    binary: PathBuf,
}

impl DraNode {
    /// Waits until the kubelet driver counted more registrations than `before`.
    async fn wait_registered_again(&self, before: u64) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while self.kubelet.registrations() <= before {
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "the new plugin on {} did not register; see {}",
                self.name,
                self.plugin_log.display()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Starts the node's plugin process.
    fn spawn_plugin(&self) -> anyhow::Result<Process> {
        Process::spawn(
            "gpushare-dra-plugin",
            &self.binary,
            &self.plugin_args,
            &self.kubeconfig,
            &self.plugin_log,
        )
    }
}

/// A running DRA-mode cluster.
pub struct DraCluster {
    /// The API server.
    pub api: ApiServer,
    /// An admin client.
    pub client: Client,
    /// The nodes.
    pub nodes: Vec<DraNode>,
    scheduler: DraScheduler,
    controller: ClaimController,
    dir: tempfile::TempDir,
}

/// The DeviceClass for gpushare's GPUs.
pub fn device_class() -> anyhow::Result<DeviceClass> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": DEVICE_CLASS},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == \"{DRIVER}\"")}}]}
    }))?)
}

/// The claim spec for `gib` GiB of one GPU.
fn memory_claim_spec(gib: u64) -> serde_json::Value {
    json!({"devices": {"requests": [{
        "name": "gpu",
        "exactly": {
            "deviceClassName": DEVICE_CLASS,
            "capacity": {"requests": {"memory": format!("{gib}Gi")}}
        }
    }]}})
}

/// A claim for `gib` GiB of one GPU.
pub fn memory_claim(name: &str, gib: u64) -> anyhow::Result<ResourceClaim> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": memory_claim_spec(gib)
    }))?)
}

/// A template for claims of `gib` GiB of one GPU, as users write them once and name from
/// every pod.
pub fn memory_claim_template(name: &str, gib: u64) -> anyhow::Result<ResourceClaimTemplate> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"spec": memory_claim_spec(gib)}
    }))?)
}

/// A pod whose container `main` uses a claim made for it from template `template`.
pub fn pod_with_claim_template(name: &str, template: &str) -> anyhow::Result<Pod> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
            "containers": [{
                "name": "main",
                "image": "jupyter/base-notebook",
                "resources": {"claims": [{"name": "gpu"}]}
            }]
        }
    }))?)
}

/// A pod whose container `main` uses claim `claim`.
pub fn pod_with_claim(name: &str, claim: &str) -> anyhow::Result<Pod> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "containers": [{
                "name": "main",
                "image": "jupyter/base-notebook",
                "resources": {"claims": [{"name": "gpu"}]}
            }]
        }
    }))?)
}

/// What one GPU holds, read from the claims' allocations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuUse {
    /// The node (pool).
    pub node: String,
    /// The device (`gpu-<index>`).
    pub device: String,
    /// Its memory, GiB.
    pub capacity_gib: u64,
    /// GiB allocated to claims.
    pub claimed_gib: u64,
}

impl DraCluster {
    /// Starts a cluster with `nodes`: (name, GPU sizes in GiB).
    pub async fn start(nodes: &[(&str, &[u64])]) -> anyhow::Result<Self> {
        let bins = binaries()?;
        let api = ApiServer::start().await?;
        let client = api.client();
        let dir = tempfile::tempdir()?;
        Api::<DeviceClass>::all(client.clone())
            .create(&PostParams::default(), &device_class()?)
            .await
            .context("creating the DeviceClass")?;
        // As in production, the plugin acts as its own ServiceAccount.
        let kubeconfig = dir.path().join("dra-plugin.kubeconfig");
        api.write_kubeconfig_as(&kubeconfig, DRA_PLUGIN_USER)?;
        let mut started = Vec::new();
        for (name, gpus) in nodes {
            Api::<Node>::all(client.clone())
                .create(&PostParams::default(), &node(name).build())
                .await
                .with_context(|| format!("creating node {name}"))?;
            let root = dir.path().join(name);
            let registry = root.join("plugins_registry");
            let cdi = root.join("cdi");
            let plugin_dir: PathBuf = root.join("plugins").join(DRIVER);
            for d in [&registry, &cdi, &plugin_dir] {
                std::fs::create_dir_all(d)?;
            }
            let health_file = root.join("unhealthy-gpus");
            let sizes = gpus
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(",");
            let args: Vec<String> = [
                "--node-name",
                name,
                "--driver-name",
                DRIVER,
                "--plugin-dir",
                &plugin_dir.display().to_string(),
                "--registry-dir",
                &registry.display().to_string(),
                "--cdi-dir",
                &cdi.display().to_string(),
                "--gpu-backend",
                "simulated",
                "--simulate-gpus",
                &sizes,
                "--simulate-health-file",
                &health_file.display().to_string(),
                // Any free port: nodes' plugins run side by side, and tests in parallel.
                "--probe-addr",
                "127.0.0.1:0",
            ]
            .iter()
            .map(|a| (*a).to_owned())
            .collect();
            let log = dir.path().join(format!("dra-plugin-{name}.log"));
            let kubelet = DraKubelet::start(client.clone(), name, registry, cdi.clone());
            let mut node = DraNode {
                name: (*name).to_owned(),
                kubelet,
                plugin_dir,
                cdi_dir: cdi,
                health_file,
                plugin: None,
                plugin_args: args,
                plugin_log: log,
                kubeconfig: kubeconfig.clone(),
                binary: bins.dra_plugin.clone(),
            };
            node.plugin = Some(node.spawn_plugin()?);
            started.push(node);
        }
        for node in &started {
            node.kubelet
                .wait_registered(DRIVER, Duration::from_secs(60))
                .await
                .with_context(|| {
                    format!(
                        "see {}",
                        dir.path()
                            .join(format!("dra-plugin-{}.log", node.name))
                            .display()
                    )
                })?;
        }
        let scheduler = DraScheduler::start(client.clone());
        let controller = ClaimController::start(client.clone());
        Ok(Self {
            api,
            client,
            nodes: started,
            scheduler,
            controller,
            dir,
        })
    }

    /// The node called `name`.
    pub fn node(&self, name: &str) -> Option<&DraNode> {
        self.nodes.iter().find(|n| n.name == name)
    }

    fn node_mut(&mut self, name: &str) -> anyhow::Result<&mut DraNode> {
        self.nodes
            .iter_mut()
            .find(|n| n.name == name)
            .with_context(|| format!("no node {name}"))
    }

    /// Kills the plugin of `node` (SIGKILL, as a crash) and starts it again; returns once
    /// the kubelet driver registered it again.
    pub async fn crash_and_restart_plugin(&mut self, node: &str) -> anyhow::Result<()> {
        let node = self.node_mut(node)?;
        let before = node.kubelet.registrations();
        if let Some(plugin) = node.plugin.take() {
            plugin.crash().await;
        }
        node.plugin = Some(node.spawn_plugin()?);
        node.wait_registered_again(before).await
    }

    /// Rolls the plugin of `node` as a DaemonSet rollout does
    /// ([`super::overlap_rollout`]); returns once every driver it had registered is
    /// registered again.
    pub async fn roll_plugin(&mut self, node: &str) -> anyhow::Result<()> {
        let node = self.node_mut(node)?;
        let before = node.kubelet.registrations();
        let drivers = node.kubelet.drivers();
        let old = node.plugin.take().context("no DRA plugin running")?;
        let new = super::overlap_rollout(
            old,
            &node.plugin_log,
            || node.spawn_plugin(),
            || node.kubelet.registrations() > before,
        )
        .await?;
        node.plugin = Some(new);
        // The new process's own registration: until then the kubelet may still hold the
        // old one's, which it drops when it sees that socket gone.
        node.wait_registered_again(before).await?;
        for driver in &drivers {
            node.kubelet
                .wait_registered(driver, Duration::from_secs(30))
                .await?;
        }
        Ok(())
    }

    /// Creates a claim for `gib` GiB and a pod `name` using it (claim `<name>-gpu`).
    pub async fn create_gpu_pod(&self, name: &str, gib: u64) -> anyhow::Result<()> {
        let claim = format!("{name}-gpu");
        Api::<ResourceClaim>::namespaced(self.client.clone(), NAMESPACE)
            .create(&PostParams::default(), &memory_claim(&claim, gib)?)
            .await
            .with_context(|| format!("creating claim {claim}"))?;
        Api::<Pod>::namespaced(self.client.clone(), NAMESPACE)
            .create(&PostParams::default(), &pod_with_claim(name, &claim)?)
            .await
            .with_context(|| format!("creating pod {name}"))?;
        Ok(())
    }

    /// Marks the simulated GPUs `gpus` of `node` unhealthy (and every other one healthy).
    pub fn set_unhealthy(&self, node: &str, gpus: &[u32]) -> anyhow::Result<()> {
        let node = self.node(node).with_context(|| format!("no node {node}"))?;
        let list: Vec<String> = gpus.iter().map(u32::to_string).collect();
        std::fs::write(&node.health_file, list.join(","))?;
        Ok(())
    }

    /// The slices as the API server has them.
    pub async fn slices(&self) -> anyhow::Result<Vec<ResourceSlice>> {
        Ok(Api::<ResourceSlice>::all(self.client.clone())
            .list(&ListParams::default())
            .await?
            .items)
    }

    /// Creates the ResourceClaimTemplate `name` for `gib` GiB of one GPU.
    pub async fn create_claim_template(&self, name: &str, gib: u64) -> anyhow::Result<()> {
        Api::<ResourceClaimTemplate>::namespaced(self.client.clone(), NAMESPACE)
            .create(&PostParams::default(), &memory_claim_template(name, gib)?)
            .await
            .with_context(|| format!("creating ResourceClaimTemplate {name}"))?;
        Ok(())
    }

    /// Creates pod `name` whose claim comes from template `template`.
    pub async fn create_templated_pod(&self, name: &str, template: &str) -> anyhow::Result<()> {
        Api::<Pod>::namespaced(self.client.clone(), NAMESPACE)
            .create(
                &PostParams::default(),
                &pod_with_claim_template(name, template)?,
            )
            .await
            .with_context(|| format!("creating pod {name}"))?;
        Ok(())
    }

    /// The claim pod `pod` uses for its pod claim `gpu`: named `<pod>-gpu` (created with
    /// the pod by [`Self::create_gpu_pod`]) or recorded in its status (from a template).
    pub fn claim_of<'a>(pod: &Pod, claims: &'a [ResourceClaim]) -> Option<&'a ResourceClaim> {
        let pod_claim = pod
            .spec
            .as_ref()?
            .resource_claims
            .as_ref()?
            .iter()
            .find(|c| c.name == "gpu")?;
        let (name, _) = crate::resourceclaim::claim_name(pod, pod_claim).ok()??;
        claims.iter().find(|c| c.name_any() == name)
    }

    /// Deletes pod `name` as a user does (gracefully). Its claim stays, and is deallocated
    /// once the pod is gone.
    pub async fn delete_gpu_pod(&self, name: &str) -> anyhow::Result<()> {
        Api::<Pod>::namespaced(self.client.clone(), NAMESPACE)
            .delete(name, &DeleteParams::default())
            .await
            .with_context(|| format!("deleting pod {name}"))?;
        Ok(())
    }

    /// Pods in the scenario namespace.
    pub async fn pods(&self) -> anyhow::Result<Vec<Pod>> {
        Ok(Api::<Pod>::namespaced(self.client.clone(), NAMESPACE)
            .list(&ListParams::default())
            .await?
            .items)
    }

    /// Claims in the scenario namespace.
    pub async fn claims(&self) -> anyhow::Result<Vec<ResourceClaim>> {
        Ok(
            Api::<ResourceClaim>::namespaced(self.client.clone(), NAMESPACE)
                .list(&ListParams::default())
                .await?
                .items,
        )
    }

    /// Every GPU of every slice with the GiB the claims' allocations hold on it.
    pub async fn gpu_use(&self) -> anyhow::Result<Vec<GpuUse>> {
        let slices = Api::<ResourceSlice>::all(self.client.clone())
            .list(&ListParams::default())
            .await?
            .items;
        let claims = self.claims().await?;
        let mut claimed: BTreeMap<(String, String), u64> = BTreeMap::new();
        for claim in &claims {
            let results = claim
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .and_then(|a| a.devices.as_ref())
                .and_then(|d| d.results.clone())
                .unwrap_or_default();
            for result in results {
                let consumed = result
                    .consumed_capacity
                    .as_ref()
                    .and_then(|c| c.get("memory"))
                    .context("an allocation of a shared GPU without consumedCapacity.memory")?;
                let gib = gpushare_dra_plugin::quantity::bytes(&consumed.0)?
                    / gpushare_dra_plugin::quantity::GIB;
                *claimed.entry((result.pool, result.device)).or_default() += u64::try_from(gib)?;
            }
        }
        let mut out = Vec::new();
        for slice in slices {
            for device in slice.spec.devices.unwrap_or_default() {
                let capacity = device
                    .capacity
                    .as_ref()
                    .and_then(|c| c.get("memory"))
                    .context("a device without memory capacity")?;
                let capacity_gib = u64::try_from(
                    gpushare_dra_plugin::quantity::bytes(&capacity.value.0)?
                        / gpushare_dra_plugin::quantity::GIB,
                )?;
                let key = (slice.spec.pool.name.clone(), device.name.clone());
                out.push(GpuUse {
                    node: key.0.clone(),
                    device: key.1.clone(),
                    capacity_gib,
                    claimed_gib: claimed.get(&key).copied().unwrap_or(0),
                });
            }
        }
        Ok(out)
    }

    /// Waits until `check` holds, up to `timeout`; the error names `what`.
    pub async fn wait_until<F, Fut>(
        &self,
        timeout: Duration,
        what: &str,
        mut check: F,
    ) -> anyhow::Result<()>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<bool>>,
    {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if check().await? {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                anyhow::bail!("timed out after {timeout:?} waiting for {what}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops everything.
    pub async fn shutdown(mut self) {
        self.controller.shutdown().await;
        self.scheduler.shutdown().await;
        for node in &mut self.nodes {
            if let Some(plugin) = node.plugin.take() {
                plugin.stop().await;
            }
        }
        for node in self.nodes {
            node.kubelet.shutdown().await;
        }
        self.api.shutdown().await;
        drop(self.dir);
    }
}

/// The pod's phase.
pub fn phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

/// The pod's `PodScheduled=False` message, if the scheduler said why it waits.
pub fn unschedulable_message(pod: &Pod) -> Option<String> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
        .and_then(|c| c.message.clone())
}

/// The node a pod is bound to.
pub fn node_of(pod: &Pod) -> Option<String> {
    pod.spec.as_ref()?.node_name.clone()
}

/// `namespace/name` of a pod.
pub fn key(pod: &Pod) -> String {
    format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any())
}
