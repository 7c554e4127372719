//! A whole gpushare cluster in one process tree: the in-process API server, the scheduler
//! driver, and per node a kubelet driver — with our REAL binaries (`gpushare-extender`,
//! `gpushare-device-plugin` on simulated GPUs) running as child processes against it.
//!
//! Used by the end-to-end scenarios, the demo and the load harness. Everything it starts is
//! stopped on [`TestCluster::shutdown`] or on drop (children are killed on drop, temp dirs
//! removed), so nothing is left running.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::Api;
use tokio::process::{Child, Command};

use crate::apiserver::ApiServer;
use crate::fixtures::node;
use crate::kubelet::{AdmissionOrder, KubeletDriver};
use crate::scheduler::{ExtenderConfig, SchedulerConfig, SchedulerDriver};

/// The resource name every scenario uses.
pub const RESOURCE: &str = gpushare_contract::DEFAULT_RESOURCE;

/// Paths to our two binaries, built once per process with the same cargo and profile as the
/// running test or demo.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// `gpushare-extender`
    pub extender: PathBuf,
    /// `gpushare-device-plugin`
    pub device_plugin: PathBuf,
}

/// Builds (if needed) and finds our binaries. `GPUSHARE_BIN_DIR` points at prebuilt ones.
pub fn binaries() -> anyhow::Result<Binaries> {
    static BUILT: OnceLock<Result<Binaries, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| build_binaries().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn build_binaries() -> anyhow::Result<Binaries> {
    let in_dir = |dir: &Path| Binaries {
        extender: dir.join("gpushare-extender"),
        device_plugin: dir.join("gpushare-device-plugin"),
    };
    if let Some(dir) = std::env::var_os("GPUSHARE_BIN_DIR") {
        return Ok(in_dir(Path::new(&dir)));
    }
    // The running executable lives in <target>/<profile>/[deps/]name: build into the same place.
    let exe = std::env::current_exe().context("locating the running executable")?;
    let profile_dir = exe
        .ancestors()
        .find(|dir| {
            matches!(
                dir.file_name().and_then(|n| n.to_str()),
                Some("debug" | "release")
            )
        })
        .context("the running executable is not under a cargo target/<profile> folder")?
        .to_path_buf();
    let target_dir = profile_dir.parent().context("target dir")?;
    let release = profile_dir.ends_with("release");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("workspace root")?;
    let mut build = std::process::Command::new(cargo);
    // `cargo run` / `cargo test` hand their child the package's CARGO_* variables; some
    // crates read such variables at compile time, so passing them on would make this
    // nested build rebuild what a plain `cargo build` already built.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        let from_runner = [
            "CARGO_PKG_",
            "CARGO_MANIFEST_",
            "CARGO_BIN_",
            "CARGO_CRATE_",
        ]
        .iter()
        .any(|prefix| name.starts_with(prefix))
            || matches!(
                &*name,
                "CARGO_PRIMARY_PACKAGE" | "CARGO_TARGET_TMPDIR" | "OUT_DIR"
            );
        if from_runner {
            build.env_remove(&*name);
        }
    }
    build
        .current_dir(workspace)
        .args([
            "build",
            "--quiet",
            "--bins",
            "-p",
            "gpushare-extender",
            "-p",
            "gpushare-device-plugin",
        ])
        .arg("--target-dir")
        .arg(target_dir);
    if release {
        build.arg("--release");
    }
    let status = build
        .status()
        .context("running cargo build for our binaries")?;
    if !status.success() {
        bail!("cargo build of gpushare-extender and gpushare-device-plugin failed ({status})");
    }
    Ok(in_dir(&profile_dir))
}

/// A free TCP port on 127.0.0.1 (bound and released; good enough for tests on one machine).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
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

/// A child process of ours, killed on drop.
#[derive(Debug)]
pub struct Process {
    name: String,
    child: Child,
}

impl Process {
    /// Starts `program` with `args`, `KUBECONFIG` set and its output appended to `log`;
    /// `RUST_LOG` comes from `GPUSHARE_E2E_LOG` (default `info`).
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        kubeconfig: &Path,
        log: &Path,
    ) -> anyhow::Result<Self> {
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        let child = Command::new(program)
            .args(args)
            .env("KUBECONFIG", kubeconfig)
            .env(
                "RUST_LOG",
                std::env::var("GPUSHARE_E2E_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::from(log_file.try_clone()?))
            .stderr(Stdio::from(log_file))
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        Ok(Self {
            name: name.to_owned(),
            child,
        })
    }

    /// Asks the process to stop (SIGTERM) and waits up to 5 s, then kills it.
    pub async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(pid.to_string())
                .status()
                .await;
        }
        if tokio::time::timeout(Duration::from_secs(5), self.child.wait())
            .await
            .is_err()
        {
            tracing::warn!(process = %self.name, "did not stop on SIGTERM; killing");
            let _ = self.child.kill().await;
        }
    }

    /// Kills the process at once (SIGKILL), as a crash would.
    pub async fn crash(mut self) {
        let _ = self.child.kill().await;
    }

    /// The OS process id, while the process has not been reaped (for reading `/proc/<pid>`).
    pub fn id(&self) -> Option<u32> {
        self.child.id()
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

/// The real `gpushare-extender`, serving on a free port of 127.0.0.1.
#[derive(Debug)]
pub struct Extender {
    /// The process.
    pub process: Process,
    /// `http://127.0.0.1:PORT`
    pub base_url: String,
}

impl Extender {
    /// Starts the extender and waits until `/readyz` answers 200.
    pub async fn start(
        bin: &Binaries,
        kubeconfig: &Path,
        log: &Path,
        extra: &[String],
    ) -> anyhow::Result<Self> {
        let port = free_port()?;
        let mut args = vec!["--listen".to_owned(), format!("127.0.0.1:{port}")];
        args.extend_from_slice(extra);
        let mut process =
            Process::spawn("gpushare-extender", &bin.extender, &args, kubeconfig, log)?;
        let base_url = format!("http://127.0.0.1:{port}");
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let ready = wait_for(
            "the extender to become ready",
            Duration::from_secs(30),
            || async { matches!(http_get(addr, "/readyz").await, Ok((200, _))).then_some(()) },
        )
        .await;
        if ready.is_err() && !process.is_running() {
            bail!("gpushare-extender exited at start; see {}", log.display());
        }
        ready?;
        Ok(Self { process, base_url })
    }

    /// The URL prefix kube-scheduler is configured with.
    pub fn url_prefix(&self) -> String {
        format!("{}/gpushare-scheduler", self.base_url)
    }

    /// `GET /gpushare-scheduler/inspect` as JSON.
    pub async fn inspect(&self) -> anyhow::Result<serde_json::Value> {
        let addr: SocketAddr = self.base_url.trim_start_matches("http://").parse()?;
        let (status, body) = http_get(addr, "/gpushare-scheduler/inspect").await?;
        if status != 200 {
            bail!("inspect answered {status}: {body}");
        }
        Ok(serde_json::from_str(&body)?)
    }
}

/// A minimal HTTP/1.1 GET over a fresh connection (no client library needed for two probes).
pub async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .context("malformed HTTP answer")?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, body)| body)
        .unwrap_or_default();
    let body = if text
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_owned()
    };
    Ok((status, body))
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

/// One simulated GPU node: the real device plugin on simulated GPUs, and a kubelet driver.
pub struct SimNode {
    /// Node name.
    pub name: String,
    /// GiB of each simulated GPU.
    pub gpus: Vec<u64>,
    /// The kubelet driver (Registration server, pod admission).
    pub kubelet: KubeletDriver,
    plugin: Option<Process>,
    plugin_dir: PathBuf,
    health_file: PathBuf,
}

/// What a [`TestCluster`] is made of.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// The nodes: name, GPU sizes in GiB, whether it carries the `gpushare=true` label.
    pub nodes: Vec<(String, Vec<u64>, bool)>,
    /// The order kubelet drivers admit pods in.
    pub admission: AdmissionOrder,
    /// Extra flags for the extender.
    pub extender_args: Vec<String>,
}

impl ClusterSpec {
    /// One labelled node per entry, GPUs of the given sizes.
    pub fn labelled(nodes: &[(&str, &[u64])]) -> Self {
        Self {
            nodes: nodes
                .iter()
                .map(|(name, gpus)| ((*name).to_owned(), gpus.to_vec(), true))
                .collect(),
            admission: AdmissionOrder::CreationTime,
            extender_args: Vec::new(),
        }
    }

    /// Adds a node that has GPUs and a device plugin but no participation label.
    pub fn with_unlabelled(mut self, name: &str, gpus: &[u64]) -> Self {
        self.nodes.push((name.to_owned(), gpus.to_vec(), false));
        self
    }
}

/// The whole system on the in-process control plane.
pub struct TestCluster {
    /// The API server.
    pub api: ApiServer,
    /// A client for it.
    pub client: Client,
    /// The real extender process.
    pub extender: Option<Extender>,
    /// The scheduler driver, calling the extender as kube-scheduler does.
    pub scheduler: Option<SchedulerDriver>,
    /// Simulated GPU nodes by name.
    pub nodes: BTreeMap<String, SimNode>,
    binaries: Binaries,
    spec: ClusterSpec,
    dir: tempfile::TempDir,
    kubeconfig: PathBuf,
}

impl TestCluster {
    /// Starts everything and waits until every node advertises its GPU memory.
    pub async fn start(spec: ClusterSpec) -> anyhow::Result<Self> {
        let binaries = tokio::task::spawn_blocking(binaries).await??;
        let dir = tempfile::tempdir()?;
        let api = ApiServer::start().await?;
        let client = api.client();
        let kubeconfig = dir.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig)?;
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
        };
        for (name, gpus, labelled) in &spec.nodes {
            cluster.add_node(name, gpus, *labelled).await?;
        }
        cluster.start_extender().await?;
        cluster.start_scheduler().await?;
        Ok(cluster)
    }

    /// The kubeconfig file for this cluster (for kubectl or our binaries).
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
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(lines).collect();
            out.push_str(&format!("==> {} <==\n", log.display()));
            for line in tail.iter().rev() {
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }

    async fn add_node(&mut self, name: &str, gpus: &[u64], labelled: bool) -> anyhow::Result<()> {
        let mut builder = node(name);
        if labelled {
            builder = builder.gpushare();
        }
        builder.create(&self.client).await?;
        let plugin_dir = self.dir.path().join(format!("{name}-device-plugins"));
        std::fs::create_dir_all(&plugin_dir)?;
        let health_file = self.dir.path().join(format!("{name}-unhealthy-gpus"));
        std::fs::write(&health_file, "")?;
        let kubelet =
            KubeletDriver::start(&plugin_dir, name, self.client.clone(), self.spec.admission)
                .await?;
        let mut sim = SimNode {
            name: name.to_owned(),
            gpus: gpus.to_vec(),
            kubelet,
            plugin: None,
            plugin_dir,
            health_file,
        };
        sim.plugin = Some(self.spawn_plugin(&sim)?);
        sim.kubelet
            .wait_registered(RESOURCE, Duration::from_secs(30))
            .await?;
        let total: u64 = gpus.iter().sum();
        let nodes: Api<Node> = Api::all(self.client.clone());
        wait_for(&format!("node {name} to advertise {total} GiB"), Duration::from_secs(30), || {
            let nodes = nodes.clone();
            async move { (node_allocatable(&nodes.get(name).await.ok()?)? == total).then_some(()) }
        })
        .await?;
        self.nodes.insert(name.to_owned(), sim);
        Ok(())
    }

    fn spawn_plugin(&self, sim: &SimNode) -> anyhow::Result<Process> {
        let sizes: Vec<String> = sim.gpus.iter().map(u64::to_string).collect();
        let args = vec![
            "--node-name".to_owned(),
            sim.name.clone(),
            "--device-plugin-dir".to_owned(),
            sim.plugin_dir.display().to_string(),
            "--gpu-backend".to_owned(),
            "simulated".to_owned(),
            "--simulate-gpus".to_owned(),
            sizes.join(","),
            "--simulate-health-file".to_owned(),
            sim.health_file.display().to_string(),
            "--metrics-listen".to_owned(),
            format!("127.0.0.1:{}", free_port()?),
        ];
        let log = self
            .dir
            .path()
            .join(format!("device-plugin-{}.log", sim.name));
        Process::spawn(
            "gpushare-device-plugin",
            &self.binaries.device_plugin,
            &args,
            &self.kubeconfig,
            &log,
        )
    }

    async fn start_extender(&mut self) -> anyhow::Result<()> {
        let log = self.dir.path().join("extender.log");
        let mut args = self.spec.extender_args.clone();
        if !args.iter().any(|arg| arg.starts_with("--bind-grace-ms")) {
            // Production holds binds 2 s after start-up; the scenarios' API server answers in
            // milliseconds, so a shorter hold keeps them quick without skipping it.
            args.extend(["--bind-grace-ms".to_owned(), "300".to_owned()]);
        }
        let extender = Extender::start(&self.binaries, &self.kubeconfig, &log, &args).await?;
        self.extender = Some(extender);
        Ok(())
    }

    async fn start_scheduler(&mut self) -> anyhow::Result<()> {
        let prefix = self
            .extender
            .as_ref()
            .context("extender not started")?
            .url_prefix();
        let config = SchedulerConfig {
            extenders: vec![ExtenderConfig::gpushare(&prefix)],
            backoff_initial: Duration::from_millis(50),
            backoff_max: Duration::from_millis(500),
            unschedulable_retry: Duration::from_millis(300),
            ..SchedulerConfig::default()
        };
        self.scheduler = Some(SchedulerDriver::start(self.client.clone(), config).await?);
        Ok(())
    }

    /// The running extender.
    pub fn extender(&self) -> anyhow::Result<&Extender> {
        self.extender
            .as_ref()
            .context("the extender is not running")
    }

    /// Kills the extender (as a crash would) and starts a fresh one on the same port-less
    /// config; the scheduler driver is pointed at the new one.
    pub async fn crash_and_restart_extender(&mut self) -> anyhow::Result<()> {
        if let Some(old) = self.extender.take() {
            old.process.crash().await;
        }
        if let Some(scheduler) = self.scheduler.take() {
            scheduler.shutdown().await;
        }
        self.start_extender().await?;
        self.start_scheduler().await
    }

    /// Restarts a node's device plugin (SIGTERM, then a fresh process).
    pub async fn restart_device_plugin(&mut self, node: &str) -> anyhow::Result<()> {
        let sim = self.nodes.get_mut(node).context("no such node")?;
        if let Some(plugin) = sim.plugin.take() {
            plugin.stop().await;
        }
        let sim = self.nodes.get(node).context("no such node")?;
        let before = sim.kubelet.registrations(RESOURCE);
        let plugin = self.spawn_plugin(sim)?;
        let sim = self.nodes.get_mut(node).context("no such node")?;
        sim.plugin = Some(plugin);
        wait_reregistered(&sim.kubelet, before).await
    }

    /// Restarts a node's kubelet (its socket removed and recreated); the plugin re-registers.
    pub async fn restart_kubelet(&mut self, node: &str) -> anyhow::Result<()> {
        let sim = self.nodes.get_mut(node).context("no such node")?;
        let before = sim.kubelet.registrations(RESOURCE);
        sim.kubelet.restart().await?;
        wait_reregistered(&sim.kubelet, before).await
    }

    /// Marks GPUs of a node unhealthy in the simulated backend (empty: all healthy again).
    pub fn set_unhealthy(&self, node: &str, gpus: &[u32]) -> anyhow::Result<()> {
        let sim = self.nodes.get(node).context("no such node")?;
        let list: Vec<String> = gpus.iter().map(u32::to_string).collect();
        std::fs::write(&sim.health_file, list.join(","))?;
        Ok(())
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

    /// Why the scheduler left a pod pending, once it has said so.
    pub async fn wait_pending_reason(
        &self,
        namespace: &str,
        name: &str,
        timeout: Duration,
    ) -> anyhow::Result<String> {
        let scheduler = self.scheduler.as_ref().context("scheduler not running")?;
        wait_for(
            &format!("a pending reason for {namespace}/{name}"),
            timeout,
            || async { scheduler.pending_reason(namespace, name) },
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
        for (_, mut sim) in std::mem::take(&mut self.nodes) {
            if let Some(plugin) = sim.plugin.take() {
                plugin.stop().await;
            }
            sim.kubelet.shutdown().await;
        }
        self.api.shutdown().await;
    }
}

/// Waits until the device plugin registered again (after `before` registrations) and
/// listed healthy devices.
async fn wait_reregistered(kubelet: &KubeletDriver, before: u64) -> anyhow::Result<()> {
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
