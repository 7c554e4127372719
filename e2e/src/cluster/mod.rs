//! A whole gpushare cluster in one process tree: the in-process API server, the scheduler
//! driver, and per node a kubelet driver — with our REAL binaries (`gpushare-extender`,
//! `gpushare-device-plugin` on simulated GPUs) running as child processes against it.
//!
//! Used by the end-to-end scenarios, the demo and the load harness. Everything it starts is
//! stopped on [`TestCluster::shutdown`] or on drop (children are killed on drop, temp dirs
//! removed unless [`KEEP_LOGS`] is set), so nothing is left running.
//!
//! Nodes start 16 at a time (200 nodes in about 6 s on two cores). The scheduler driver is
//! configured as the chart configures kube-scheduler (`httpTimeout` 5 s unless
//! [`ClusterSpec::with_http_timeout`] says otherwise; binds unbounded) and calls the extender
//! at one fixed address, so the extender can be killed and restarted under it
//! ([`TestCluster::kill_extender`], [`TestCluster::kill_extender_repeatedly`]) as a crashed
//! pod behind a Service would be.
//!
//! As in production, each binary acts as its own ServiceAccount (a kubeconfig with a token
//! for [`EXTENDER_USER`] or [`DEVICE_PLUGIN_USER`]; the harness itself, the scheduler driver
//! and the kubelet drivers act as the admin). The chart's ValidatingAdmissionPolicy is not
//! enforced here: the real tier holds it to the real API server's CEL.
//!
//! The extender serves the scheduler's calls over HTTPS with a certificate for its Service
//! name, and the scheduler driver verifies it against the CA, as the chart wires them
//! ([`ExtenderTls`]). With [`ClusterSpec::dedicated`] the cluster runs the chart's
//! `dedicated` mode: the chart's MutatingWebhookConfiguration is created, the extender
//! serves the webhook and patches its caBundle, and the API server calls it on every pod
//! create.
//!
//! The harness is split by job, one file each:
//! - `cargo_build`: builds our binaries once per process ([`binaries`]);
//! - `chart`: renders the chart's templates with helm (policy, webhook, scheduler config);
//! - `process`: our child processes ([`Process`]), their logs and memory;
//! - `ports`: free and restart-safe ports on 127.0.0.1;
//! - `http`: a minimal HTTP/1.1 client for probes ([`http_get`], [`http_post_json`]);
//! - `extender`: the extender process and its serving certificate ([`Extender`]);
//! - `spec`: what a cluster is made of ([`ClusterSpec`]);
//! - `node`: one simulated GPU node, its device plugin and kubelet driver ([`SimNode`]);
//! - `scheduling`: the extender and the scheduler driver, wired as the chart wires them;
//! - `faults`: crashes, restarts, rollouts and unhealthy GPUs a scenario inflicts.
//!
//! This file holds [`TestCluster`] itself: starting, inspecting and shutting it down.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::Api;

use crate::apiserver::ApiServer;
use crate::scheduler::SchedulerDriver;

mod cargo_build;
mod chart;
mod extender;
mod faults;
mod http;
mod node;
mod ports;
mod process;
mod scheduling;
mod spec;

pub use cargo_build::{Binaries, binaries};
pub use chart::{
    DEVICE_PLUGIN_USER, EXTENDER_USER, RELEASE, RELEASE_NAMESPACE,
    dedicated_scheduler_configuration, render_chart_template,
};
pub use extender::{ClientCa, EXTENDER_SERVICE_HOST, Extender, ExtenderTls, RESTART_BIND_RETRY};
pub use http::{http_get, http_post_json};
pub use node::{SimNode, node_allocatable, published_gpus};
pub use ports::{free_port, service_port};
pub use process::{MemoryUse, Process, file_tail};
pub use spec::{ClusterSpec, DEDICATED_SCHEDULER, DEFAULT_HTTP_TIMEOUT};

use chart::install_webhook_configuration;
pub(crate) use extender::client_config as tls_client_config;
pub(crate) use http::exchange_on;
use node::{NODE_START_CONCURRENCY, NodeHost};
use process::memory_kib;

/// The scheduler driver's longest retry backoff in a [`TestCluster`] (kube-scheduler's is
/// 10 s; shorter here so scenarios stay quick). A test waiting for pods to settle must wait
/// longer than this and [`SCHEDULER_UNSCHEDULABLE_RETRY`].
pub const SCHEDULER_BACKOFF_MAX: Duration = Duration::from_millis(500);

/// How soon the scheduler driver retries an unschedulable pod in a [`TestCluster`].
pub const SCHEDULER_UNSCHEDULABLE_RETRY: Duration = Duration::from_millis(300);

/// The resource name every scenario uses.
pub const RESOURCE: &str = gpushare_contract::DEFAULT_RESOURCE;

/// `kubectl gpushare top -d` over what the API server at `client` has now.
pub async fn top_details(client: &Client) -> anyhow::Result<String> {
    use kube::api::ListParams;
    let nodes = Api::<k8s_openapi::api::core::v1::Node>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let pods = Api::<Pod>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    Ok(kubectl_gpushare::render::render_top_details(
        &kubectl_gpushare::usage::cluster_usage(
            &nodes,
            &pods,
            &kubectl_gpushare::usage::Settings::default(),
        ),
    ))
}

/// Runs `body` on a fresh cluster started from `spec`, then shuts it down; on failure,
/// prints the tail of our binaries' logs first.
pub async fn with_cluster(
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

/// Waits until `check` returns `Some`, polling every 20 ms, up to `timeout`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return Ok(value);
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The whole system on the in-process control plane.
pub struct TestCluster {
    pub api: ApiServer,
    pub client: Client,
    /// The real extender process.
    pub extender: Option<Extender>,
    /// The scheduler driver, calling the extender as kube-scheduler does.
    pub scheduler: Option<SchedulerDriver>,
    pub nodes: BTreeMap<String, SimNode>,
    binaries: Binaries,
    spec: ClusterSpec,
    dir: tempfile::TempDir,
    kubeconfig: PathBuf,
    /// The extender's kubeconfig ([`EXTENDER_USER`]).
    extender_kubeconfig: PathBuf,
    /// The extender's port, kept across restarts (the Service address kube-scheduler calls).
    extender_port: u16,
    /// Its plain-HTTP health and metrics port.
    monitor_port: u16,
    /// Its serving certificate, kept across restarts (the chart's Secret).
    extender_tls: ExtenderTls,
    /// The extender's admission webhook port, in dedicated mode.
    webhook_port: Option<u16>,
}

impl TestCluster {
    /// Starts everything and waits until every node advertises its GPU memory.
    pub async fn start(spec: ClusterSpec) -> anyhow::Result<Self> {
        let binaries = tokio::task::spawn_blocking(binaries).await??;
        let dir = tempfile::tempdir()?;
        let api = ApiServer::start().await?;
        let client = api.client();
        let webhook_port = if spec.dedicated {
            install_webhook_configuration(&client).await?;
            let port = service_port()?;
            api.route_service(
                RELEASE_NAMESPACE,
                &format!("{RELEASE}-extender"),
                443,
                SocketAddr::from(([127, 0, 0, 1], port)),
            );
            Some(port)
        } else {
            None
        };
        let kubeconfig = dir.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig)?;
        let extender_kubeconfig = dir.path().join("extender.kubeconfig");
        api.write_kubeconfig_as(&extender_kubeconfig, EXTENDER_USER)?;
        write_allocation_keys(&dir.path().join(ALLOCATION_KEYS))?;
        let extender_tls = ExtenderTls::generate(&dir.path().join("extender-tls"))?;
        let extender_port = service_port()?;
        let mut monitor_port = service_port()?;
        while monitor_port == extender_port {
            monitor_port = service_port()?;
        }
        let mut cluster = Self {
            api,
            client,
            extender: None,
            scheduler: None,
            nodes: BTreeMap::new(),
            binaries,
            spec: spec.clone(),
            dir,
            kubeconfig,
            extender_kubeconfig,
            extender_port,
            monitor_port,
            extender_tls,
            webhook_port,
        };
        cluster.add_nodes(&spec.nodes).await?;
        cluster.start_extender().await?;
        cluster.start_scheduler().await?;
        Ok(cluster)
    }

    /// The admin's kubeconfig file for this cluster (for kubectl).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Where the child processes' logs go.
    pub fn log_dir(&self) -> &Path {
        self.dir.path()
    }

    /// The last `lines` lines of each of our binaries' logs, for a failing test to print.
    pub fn log_tail(&self, lines: usize) -> String {
        let mut out = String::new();
        let Ok(entries) = std::fs::read_dir(self.dir.path()) else {
            return out;
        };
        let mut logs: Vec<PathBuf> = entries
            .flatten()
            .map(|entry| entry.path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "log"))
            .collect();
        logs.sort();
        for log in logs {
            out.push_str(&format!("==> {} <==\n", log.display()));
            let tail = file_tail(&log, lines);
            out.extend(tail.lines().map(|line| format!("{line}\n")));
        }
        out
    }

    /// Starts nodes, [`NODE_START_CONCURRENCY`] at a time, each once its device plugin has
    /// registered and its capacity reached the API server.
    async fn add_nodes(&mut self, nodes: &[(String, Vec<u64>, bool)]) -> anyhow::Result<()> {
        use futures::{StreamExt, TryStreamExt};
        let host = self.host();
        let started: Vec<SimNode> = futures::stream::iter(nodes)
            .map(|(name, gpus, labelled)| host.start_node(name, gpus, *labelled))
            .buffer_unordered(NODE_START_CONCURRENCY)
            .try_collect()
            .await?;
        for sim in started {
            self.nodes.insert(sim.name.clone(), sim);
        }
        Ok(())
    }

    fn host(&self) -> NodeHost {
        NodeHost {
            client: self.client.clone(),
            dir: self.dir.path().to_owned(),
            binaries: self.binaries.clone(),
            plugin_identity: self.api.pod_identity(DEVICE_PLUGIN_USER),
            admission: self.spec.admission,
            plugin_args: self.spec.device_plugin_args.clone(),
        }
    }

    /// Memory held by the harness process and by our binaries it started.
    pub fn memory_use(&self) -> MemoryUse {
        let plugins = self
            .nodes
            .values()
            .filter_map(|sim| sim.plugin.as_ref()?.id())
            .filter_map(memory_kib);
        MemoryUse {
            harness_kib: memory_kib(std::process::id()).unwrap_or(0),
            extender_kib: self
                .extender
                .as_ref()
                .and_then(|e| e.process.id())
                .and_then(memory_kib)
                .unwrap_or(0),
            device_plugins_kib: plugins.sum(),
            device_plugins: self.nodes.len(),
        }
    }

    /// The address a node's device plugin serves `/metrics` on (it binds port 0 and logs
    /// the address it got).
    pub fn device_plugin_metrics(&self, node: &str) -> anyhow::Result<SocketAddr> {
        let log = self.dir.path().join(format!("device-plugin-{node}.log"));
        let text =
            std::fs::read_to_string(&log).with_context(|| format!("reading {}", log.display()))?;
        let line = text
            .lines()
            .find(|line| line.contains("serving /healthz, /readyz and /metrics"))
            .context("the device plugin did not log its metrics address")?;
        let addr = line
            .split_whitespace()
            .find_map(|word| word.strip_prefix("addr="))
            .context("no addr= in the metrics log line")?;
        Ok(addr.parse()?)
    }

    /// A pod as the API server has it now.
    pub async fn pod(&self, namespace: &str, name: &str) -> anyhow::Result<Pod> {
        Ok(Api::<Pod>::namespaced(self.client.clone(), namespace)
            .get(name)
            .await?)
    }

    /// Waits until a pod reaches `phase`.
    pub async fn wait_phase(
        &self,
        namespace: &str,
        name: &str,
        phase: &str,
        timeout: Duration,
    ) -> anyhow::Result<Pod> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        wait_for(
            &format!("pod {namespace}/{name} to be {phase}"),
            timeout,
            || {
                let pods = pods.clone();
                async move {
                    let pod = pods.get(name).await.ok()?;
                    (pod.status.as_ref()?.phase.as_deref() == Some(phase)).then_some(pod)
                }
            },
        )
        .await
    }

    /// Stops everything this cluster started.
    pub async fn shutdown(mut self) {
        if let Some(scheduler) = self.scheduler.take() {
            scheduler.shutdown().await;
        }
        if let Some(extender) = self.extender.take() {
            extender.process.stop().await;
        }
        let nodes = std::mem::take(&mut self.nodes);
        futures::future::join_all(nodes.into_values().map(|mut sim| async move {
            if let Some(plugin) = sim.plugin.take() {
                plugin.stop().await;
            }
            sim.kubelet.shutdown().await;
        }))
        .await;
        self.api.shutdown().await;
        if std::env::var_os(KEEP_LOGS).is_some() {
            eprintln!("logs kept in {}", self.dir.keep().display());
        }
    }
}

/// Set (to anything) to keep a cluster's folder with our binaries' logs after shutdown.
pub const KEEP_LOGS: &str = "GPUSHARE_E2E_KEEP_LOGS";

/// The keyring file in a cluster's folder: the extender signs its decisions with it and the
/// device plugins verify them, as the chart sets them up.
pub const ALLOCATION_KEYS: &str = "allocation-keys";

/// Writes a fresh one-key keyring (`k1:<32 random bytes, base64>`).
fn write_allocation_keys(path: &Path) -> anyhow::Result<()> {
    use base64::Engine;
    let key: [u8; 32] = rand::random();
    let line = format!(
        "k1:{}\n",
        base64::engine::general_purpose::STANDARD.encode(key)
    );
    std::fs::write(path, line).with_context(|| format!("writing {}", path.display()))
}
