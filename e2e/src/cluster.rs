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
//! and the kubelet drivers act as the admin), and the API server enforces the chart's
//! ValidatingAdmissionPolicy on pods ([`allocation_policy_yaml`]), unless
//! [`ClusterSpec::without_allocation_policy`] says otherwise.
//!
//! The extender serves the scheduler's calls over HTTPS with a certificate for its Service
//! name, and the scheduler driver verifies it against the CA, as the chart wires them
//! ([`ExtenderTls`]). With [`ClusterSpec::dedicated`] the cluster runs the chart's
//! `dedicated` mode: the chart's MutatingWebhookConfiguration is created, the extender
//! serves the webhook and patches its caBundle, and the API server calls it on every pod
//! create before the policy runs.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::Api;
use serde::Deserialize as _;
use tokio::process::{Child, Command};

use crate::apiserver::admission::AdmissionPolicies;
use crate::apiserver::{ApiServer, PodIdentity};
use crate::fixtures::node;
use crate::kubelet::{AdmissionOrder, KubeletDriver};
use crate::scheduler::wire::{ExtenderBindingArgs, decode_binding_result};
use crate::scheduler::{ExtenderConfig, ExtenderTlsConfig, SchedulerConfig, SchedulerDriver};

/// The scheduler driver's longest retry backoff in a [`TestCluster`] (kube-scheduler's is
/// 10 s; shorter here so scenarios stay quick). A test waiting for pods to settle must wait
/// longer than this and [`SCHEDULER_UNSCHEDULABLE_RETRY`].
pub const SCHEDULER_BACKOFF_MAX: Duration = Duration::from_millis(500);
/// How soon the scheduler driver retries an unschedulable pod in a [`TestCluster`].
pub const SCHEDULER_UNSCHEDULABLE_RETRY: Duration = Duration::from_millis(300);

/// The resource name every scenario uses.
pub const RESOURCE: &str = gpushare_contract::DEFAULT_RESOURCE;

/// Paths to our binaries, built once per process with the same cargo and profile as the
/// running test or demo.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// `gpushare-extender`
    pub extender: PathBuf,
    /// `gpushare-device-plugin`
    pub device_plugin: PathBuf,
    /// `gpushare-dra-plugin` (DRA mode, see [`crate::cluster_dra`])
    pub dra_plugin: PathBuf,
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
        dra_plugin: dir.join("gpushare-dra-plugin"),
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
            "-p",
            "gpushare-dra-plugin",
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
        bail!(
            "cargo build of gpushare-extender, gpushare-device-plugin and gpushare-dra-plugin failed ({status})"
        );
    }
    Ok(in_dir(&profile_dir))
}

/// The Helm release the harness renders the chart as; the ServiceAccount names follow from it.
pub const RELEASE: &str = "gpushare";
/// The namespace of that release.
pub const RELEASE_NAMESPACE: &str = "kube-system";
/// The username the extender acts as: the chart's extender ServiceAccount.
pub const EXTENDER_USER: &str = "system:serviceaccount:kube-system:gpushare-extender";
/// The username every device plugin acts as: the chart's device plugin ServiceAccount.
pub const DEVICE_PLUGIN_USER: &str = "system:serviceaccount:kube-system:gpushare-device-plugin";

/// The chart's allocation policy (`templates/allocation-policy.yaml`), rendered by helm
/// once per process as release [`RELEASE`] in [`RELEASE_NAMESPACE`], with the scheduler mode
/// the harness models by default: `default-scheduler` (the scheduler driver serves
/// `default-scheduler`; [`ClusterSpec::dedicated`] renders and runs the other mode).
pub fn allocation_policy_yaml() -> anyhow::Result<String> {
    static RENDERED: OnceLock<Result<String, String>> = OnceLock::new();
    RENDERED
        .get_or_init(|| render_allocation_policy(&[]).map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

/// Renders the chart's allocation policy with extra `--set` values (not cached).
pub fn render_allocation_policy(sets: &[&str]) -> anyhow::Result<String> {
    render_chart_template("templates/allocation-policy.yaml", sets)
}

/// Renders one template of the chart (release [`RELEASE`] in [`RELEASE_NAMESPACE`],
/// `default-scheduler` mode unless `sets` say otherwise).
pub fn render_chart_template(template: &str, sets: &[&str]) -> anyhow::Result<String> {
    let helm = crate::tools::helm()?;
    let chart = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("workspace root")?
        .join("charts/gpushare");
    let mut command = std::process::Command::new(helm);
    command
        .args(["template", RELEASE])
        .arg(&chart)
        .args(["--namespace", RELEASE_NAMESPACE])
        .args(["--show-only", template])
        .args(["--set", "scheduler.mode=default-scheduler"]);
    for set in sets {
        command.args(["--set", set]);
    }
    let output = command.output().context("running helm template")?;
    if !output.status.success() {
        bail!(
            "helm template of {template} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8(output.stdout)?)
}

/// The `scheduler-config.yaml` of the chart's dedicated scheduler, rendered with the policy
/// the extender runs (its `--policy=` flag in `extender_args`, else the chart's default) and
/// the extra chart `values` (`key=value`).
pub async fn dedicated_scheduler_configuration(
    extender_args: &[String],
    values: &[String],
) -> anyhow::Result<String> {
    let mut sets = vec!["scheduler.mode=dedicated".to_owned()];
    if let Some(policy) = extender_args
        .iter()
        .find_map(|a| a.strip_prefix("--policy="))
    {
        sets.push(format!("policy={policy}"));
    }
    sets.extend(values.iter().cloned());
    let rendered = tokio::task::spawn_blocking(move || {
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        render_chart_template("templates/scheduler.yaml", &sets)
    })
    .await??;
    for document in serde_yaml::Deserializer::from_str(&rendered) {
        let value = serde_yaml::Value::deserialize(document)?;
        if value.get("kind").and_then(|k| k.as_str()) != Some("ConfigMap") {
            continue;
        }
        if let Some(text) = value
            .get("data")
            .and_then(|d| d.get("scheduler-config.yaml"))
            .and_then(|t| t.as_str())
        {
            return Ok(text.to_owned());
        }
    }
    bail!("the chart's scheduler.yaml renders no scheduler-config.yaml")
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

/// Creates the chart's MutatingWebhookConfiguration (dedicated mode, rendered by helm) as
/// `helm install` would: without a caBundle, which the extender patches in once it runs.
async fn install_webhook_configuration(client: &Client) -> anyhow::Result<()> {
    use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
    let yaml = tokio::task::spawn_blocking(|| {
        render_chart_template("templates/webhook.yaml", &["scheduler.mode=dedicated"])
    })
    .await??;
    let config: MutatingWebhookConfiguration = serde_yaml::from_str(&yaml)?;
    kube::Api::<MutatingWebhookConfiguration>::all(client.clone())
        .create(&kube::api::PostParams::default(), &config)
        .await?;
    Ok(())
}

/// A free TCP port on 127.0.0.1 (bound and released; good enough for tests on one machine).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A port on 127.0.0.1 for a server that restarts on the same address: free now, and below
/// the kernel's ephemeral range, so that no outgoing connection and no [`free_port`] takes it
/// while the server is down.
pub fn service_port() -> anyhow::Result<u16> {
    use rand::Rng;
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (low, high) = (
        ephemeral_low.saturating_sub(12_000).max(1024),
        ephemeral_low,
    );
    let mut rng = rand::rng();
    for _ in 0..100 {
        let port = rng.random_range(low..high);
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free port between {low} and {high}")
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

    /// Sends the signal named `signal` (`TERM`, `STOP`, `CONT`) to the process.
    pub async fn signal(&self, signal: &str) {
        if let Some(pid) = self.child.id() {
            let _ = Command::new("kill")
                .arg(format!("-{signal}"))
                .arg(pid.to_string())
                .status()
                .await;
        }
    }

    /// Asks the process to stop (SIGTERM) and waits up to 5 s, then kills it.
    pub async fn stop(self) {
        self.signal("TERM").await;
        self.wait_stopped().await;
    }

    /// Waits up to 5 s for the process to exit, then kills it.
    pub async fn wait_stopped(mut self) {
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

    /// How the process ended, once it has.
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

/// The real `gpushare-extender`, serving on a port of 127.0.0.1.
#[derive(Debug)]
pub struct Extender {
    /// The process.
    pub process: Process,
    /// `http://127.0.0.1:PORT`, or `https://` when it serves TLS.
    pub base_url: String,
    launch: Launch,
    /// Its certificate, when it serves TLS as the chart runs it.
    tls: Option<ExtenderTls>,
    /// `--monitor-listen`: plain HTTP health and metrics, when set.
    monitor: Option<SocketAddr>,
}

/// The Service name the chart's scheduler configuration dials, and the extender's
/// certificate names (`<service>.<namespace>.svc`).
pub const EXTENDER_SERVICE_HOST: &str = "gpushare-extender.kube-system.svc";

/// The extender's serving certificate as the chart's `<release>-extender-tls` Secret holds
/// it: a CA that kube-scheduler's `tlsConfig` trusts, and a certificate for the Service's
/// names signed by it.
#[derive(Clone)]
pub struct ExtenderTls {
    /// PEM of the CA (the Secret's `ca.crt`, the scheduler's `tlsConfig.caFile`).
    pub ca_pem: String,
    /// `tls.crt` and `tls.key`, as mounted into the extender.
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    client: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for ExtenderTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExtenderTls")
            .field("cert_file", &self.cert_file)
            .finish_non_exhaustive()
    }
}

impl ExtenderTls {
    /// A fresh CA and serving certificate for [`EXTENDER_SERVICE_HOST`], written into `dir`.
    pub fn generate(dir: &Path) -> anyhow::Result<Self> {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject as _;
        let ca = gpushare_admission::SelfSignedCa::generate(&gpushare_admission::CertConfig::new(
            "gpushare-extender",
            "kube-system",
        ))?;
        ca.write_pem_files(dir)?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca.ca_pem().as_bytes()) {
            roots.add(cert?)?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Self {
            ca_pem: ca.ca_pem().to_owned(),
            cert_file: dir.join("tls.crt"),
            key_file: dir.join("tls.key"),
            client: Arc::new(client),
        })
    }

    /// A client configuration trusting the CA (no ALPN set; callers add theirs).
    pub fn client_config(&self) -> Arc<rustls::ClientConfig> {
        self.client.clone()
    }

    /// What the scheduler's extender stanza says about TLS (as the chart renders it).
    pub fn scheduler_config(&self) -> ExtenderTlsConfig {
        ExtenderTlsConfig {
            ca_pem: self.ca_pem.clone(),
            server_name: EXTENDER_SERVICE_HOST.to_owned(),
        }
    }
}

/// How an extender was started, to start it again the same way.
#[derive(Debug, Clone)]
struct Launch {
    program: PathBuf,
    args: Vec<String>,
    kubeconfig: PathBuf,
    log: PathBuf,
    addr: SocketAddr,
}

impl Launch {
    fn spawn(&self) -> anyhow::Result<Process> {
        Process::spawn(
            "gpushare-extender",
            &self.program,
            &self.args,
            &self.kubeconfig,
            &self.log,
        )
    }
}

impl Extender {
    /// Starts the extender on a free port and waits until `/readyz` answers 200.
    pub async fn start(
        bin: &Binaries,
        kubeconfig: &Path,
        log: &Path,
        extra: &[String],
    ) -> anyhow::Result<Self> {
        Self::start_on(bin, kubeconfig, log, extra, free_port()?).await
    }

    /// Starts the extender on `port` of 127.0.0.1 and waits until `/readyz` answers 200.
    pub async fn start_on(
        bin: &Binaries,
        kubeconfig: &Path,
        log: &Path,
        extra: &[String],
        port: u16,
    ) -> anyhow::Result<Self> {
        let mut extender = Self::spawn_on(bin, kubeconfig, log, extra, port)?;
        extender.wait_ready().await?;
        Ok(extender)
    }

    /// Starts the extender process on `port` of 127.0.0.1 without waiting for it.
    pub fn spawn_on(
        bin: &Binaries,
        kubeconfig: &Path,
        log: &Path,
        extra: &[String],
        port: u16,
    ) -> anyhow::Result<Self> {
        Self::spawn_with(bin, kubeconfig, log, extra, port, None)
    }

    /// As [`Extender::spawn_on`], the way the chart runs it: HTTPS with `tls` on `port`,
    /// and health and metrics over plain HTTP on `monitor_port`.
    pub fn spawn_secured_on(
        bin: &Binaries,
        kubeconfig: &Path,
        log: &Path,
        extra: &[String],
        port: u16,
        (tls, monitor_port): (&ExtenderTls, u16),
    ) -> anyhow::Result<Self> {
        Self::spawn_with(
            bin,
            kubeconfig,
            log,
            extra,
            port,
            Some((tls.clone(), monitor_port)),
        )
    }

    fn spawn_with(
        bin: &Binaries,
        kubeconfig: &Path,
        log: &Path,
        extra: &[String],
        port: u16,
        secured: Option<(ExtenderTls, u16)>,
    ) -> anyhow::Result<Self> {
        let mut args = vec!["--listen".to_owned(), format!("127.0.0.1:{port}")];
        if let Some((tls, monitor_port)) = &secured {
            args.extend([
                "--tls-cert".to_owned(),
                tls.cert_file.display().to_string(),
                "--tls-key".to_owned(),
                tls.key_file.display().to_string(),
                "--monitor-listen".to_owned(),
                format!("127.0.0.1:{monitor_port}"),
            ]);
        }
        args.extend_from_slice(extra);
        let (tls, monitor) = match secured {
            Some((tls, monitor_port)) => (
                Some(tls),
                Some(SocketAddr::from(([127, 0, 0, 1], monitor_port))),
            ),
            None => (None, None),
        };
        let scheme = if tls.is_some() { "https" } else { "http" };
        let launch = Launch {
            program: bin.extender.clone(),
            args,
            kubeconfig: kubeconfig.to_owned(),
            log: log.to_owned(),
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
        };
        Ok(Self {
            process: launch.spawn()?,
            base_url: format!("{scheme}://127.0.0.1:{port}"),
            launch,
            tls,
            monitor,
        })
    }

    /// Waits until `/readyz` answers 200 (up to 30 s).
    ///
    /// Right after the previous process on the port was killed, a new one may fail to bind
    /// for a moment; one that exits at start is started again for up to
    /// [`RESTART_BIND_RETRY`], as kubelet restarts a crashed container.
    pub async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let started = tokio::time::Instant::now();
        let deadline = started + Duration::from_secs(30);
        let log = self.launch.log.display().to_string();
        loop {
            // Ready, and ours: the answer counts only while our process runs.
            if matches!(self.get_health("/readyz").await, Ok((200, _))) && self.process.is_running()
            {
                return Ok(());
            }
            if !self.process.is_running() {
                if started.elapsed() >= RESTART_BIND_RETRY {
                    bail!("gpushare-extender exited at start; see {log}");
                }
                tracing::debug!(addr = %self.launch.addr, "gpushare-extender exited at start; starting it again");
                tokio::time::sleep(Duration::from_millis(100)).await;
                self.process = self.launch.spawn()?;
                continue;
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("timed out after 30s waiting for the extender to become ready; see {log}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The URL prefix kube-scheduler is configured with.
    pub fn url_prefix(&self) -> String {
        format!("{}/gpushare-scheduler", self.base_url)
    }

    /// `GET /gpushare-scheduler/inspect` as JSON.
    pub async fn inspect(&self) -> anyhow::Result<serde_json::Value> {
        let request = get_request(self.launch.addr, "/gpushare-scheduler/inspect");
        let (status, body) = self.exchange(&request).await?;
        if status != 200 {
            bail!("inspect answered {status}: {body}");
        }
        Ok(serde_json::from_str(&body)?)
    }

    /// Asks the extender to bind a pod, as kube-scheduler would: `POST
    /// /gpushare-scheduler/bind`. `Ok(None)` when it bound the pod, `Ok(Some(error))` with
    /// the error it reported to the scheduler otherwise.
    pub async fn bind(&self, args: &ExtenderBindingArgs) -> anyhow::Result<Option<String>> {
        let body = serde_json::to_string(args)?;
        let request = post_json_request(self.launch.addr, "/gpushare-scheduler/bind", &body);
        let (status, answer) = self.exchange(&request).await?;
        if status != 200 {
            bail!("bind answered {status}: {answer}");
        }
        let result = decode_binding_result(answer.as_bytes())
            .with_context(|| format!("decoding the bind answer {answer:?}"))?;
        Ok((!result.error.is_empty()).then_some(result.error))
    }

    /// `GET path` of the health and metrics endpoints: on `--monitor-listen` when set.
    pub async fn get_health(&self, path: &str) -> anyhow::Result<(u16, String)> {
        match self.monitor {
            Some(addr) => http_get(addr, path).await,
            None => self.exchange(&get_request(self.launch.addr, path)).await,
        }
    }

    /// Where `/healthz`, `/readyz` and `/metrics` are served: the monitor port when the
    /// scheduler-facing port serves TLS, else that port.
    pub fn monitor_addr(&self) -> SocketAddr {
        self.monitor.unwrap_or(self.launch.addr)
    }

    /// The TLS settings kube-scheduler needs to call this extender, if it serves TLS.
    pub fn tls(&self) -> Option<&ExtenderTls> {
        self.tls.as_ref()
    }

    /// One request to the scheduler-facing port, over TLS when it serves TLS.
    async fn exchange(&self, request: &str) -> anyhow::Result<(u16, String)> {
        match &self.tls {
            None => http_exchange(self.launch.addr, request).await,
            Some(tls) => {
                let tcp = tokio::net::TcpStream::connect(self.launch.addr).await?;
                let name = rustls::pki_types::ServerName::try_from(EXTENDER_SERVICE_HOST)?;
                let stream = tokio_rustls::TlsConnector::from(tls.client.clone())
                    .connect(name, tcp)
                    .await?;
                exchange_on(stream, request).await
            }
        }
    }
}

/// How long a start that fails at once (the port still held by a killed predecessor) is retried.
pub const RESTART_BIND_RETRY: Duration = Duration::from_secs(10);

/// A minimal HTTP/1.1 GET over a fresh connection (no client library needed for two probes).
pub async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    http_exchange(addr, &get_request(addr, path)).await
}

fn get_request(addr: SocketAddr, path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")
}

/// A minimal HTTP/1.1 POST of a JSON `body` over a fresh connection.
pub async fn http_post_json(
    addr: SocketAddr,
    path: &str,
    body: &str,
) -> anyhow::Result<(u16, String)> {
    http_exchange(addr, &post_json_request(addr, path, body)).await
}

fn post_json_request(addr: SocketAddr, path: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Sends `request` and reads the answer to the end: status and (de-chunked) body.
async fn http_exchange(addr: SocketAddr, request: &str) -> anyhow::Result<(u16, String)> {
    exchange_on(tokio::net::TcpStream::connect(addr).await?, request).await
}

/// [`http_exchange`] on an open stream (plain or TLS).
async fn exchange_on(
    mut stream: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    request: &str,
) -> anyhow::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream.write_all(request.as_bytes()).await?;
    let mut raw = Vec::new();
    match stream.read_to_end(&mut raw).await {
        Ok(_) => {}
        // A TLS peer that closes without close_notify after a whole answer: the answer stands.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
        Err(e) => return Err(e.into()),
    }
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

/// The body of a `Transfer-Encoding: chunked` answer, joined.
pub(crate) fn dechunk(mut body: &str) -> String {
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

/// The extender `httpTimeout` gpushare's chart configures.
pub const DEFAULT_HTTP_TIMEOUT: Duration = Duration::from_secs(5);

/// How many nodes start at once.
const NODE_START_CONCURRENCY: usize = 16;

/// What a [`TestCluster`] is made of.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// The nodes: name, GPU sizes in GiB, whether it carries the `gpushare=true` label.
    pub nodes: Vec<(String, Vec<u64>, bool)>,
    /// The order kubelet drivers admit pods in.
    pub admission: AdmissionOrder,
    /// Extra flags for the extender.
    pub extender_args: Vec<String>,
    /// The scheduler's `httpTimeout` for the extender (the chart ships 5 s).
    pub http_timeout: Duration,
    /// Whether the API server enforces the chart's allocation policy (default: yes).
    pub allocation_policy: bool,
    /// Extra flags for every device plugin.
    pub device_plugin_args: Vec<String>,
    /// The chart's `dedicated` scheduler mode: the scheduler driver schedules only pods of
    /// [`DEDICATED_SCHEDULER`], the chart's MutatingWebhookConfiguration routes GPU pods to
    /// it (served by the extender, called by the API server), and the allocation policy
    /// refuses GPU pods of other schedulers. Default: `default-scheduler` mode.
    pub dedicated: bool,
    /// Chart values (`key=value`) the dedicated scheduler's configuration is rendered with.
    pub scheduler_values: Vec<String>,
    /// The scheduler driver's [`SchedulerConfig::binding_cycle_delay`] (default none).
    pub binding_cycle_delay: Duration,
}

/// The scheduler name of the chart's dedicated mode.
pub const DEDICATED_SCHEDULER: &str = "gpushare-scheduler";

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
            http_timeout: DEFAULT_HTTP_TIMEOUT,
            allocation_policy: true,
            device_plugin_args: Vec::new(),
            dedicated: false,
            scheduler_values: Vec::new(),
            binding_cycle_delay: Duration::ZERO,
        }
    }

    /// `count` labelled nodes `node-000`, `node-001`, …, each with GPUs of the given sizes.
    pub fn uniform(count: usize, gpus: &[u64]) -> Self {
        Self {
            nodes: (0..count)
                .map(|i| (format!("node-{i:03}"), gpus.to_vec(), true))
                .collect(),
            ..Self::labelled(&[])
        }
    }

    /// The scheduler's `httpTimeout` for the extender.
    pub fn with_http_timeout(mut self, timeout: Duration) -> Self {
        self.http_timeout = timeout;
        self
    }

    /// Passes `args` to every device plugin.
    pub fn with_device_plugin_args(mut self, args: &[&str]) -> Self {
        self.device_plugin_args = args.iter().map(|a| (*a).to_owned()).collect();
        self
    }

    /// Runs the chart's `dedicated` scheduler mode (see [`ClusterSpec::dedicated`]).
    pub fn dedicated(mut self) -> Self {
        self.dedicated = true;
        self
    }

    /// Renders the dedicated scheduler's configuration with these chart values (`key=value`).
    pub fn with_scheduler_values(mut self, values: &[&str]) -> Self {
        self.scheduler_values = values.iter().map(|v| (*v).to_owned()).collect();
        self
    }

    /// Makes every binding cycle take `delay` before its bind call, so the next pods' filters
    /// come first (see [`SchedulerConfig::binding_cycle_delay`]).
    pub fn with_binding_cycle_delay(mut self, delay: Duration) -> Self {
        self.binding_cycle_delay = delay;
        self
    }

    /// Runs without the chart's allocation policy (as a cluster whose admin left it out).
    pub fn without_allocation_policy(mut self) -> Self {
        self.allocation_policy = false;
        self
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
        if spec.allocation_policy {
            let yaml = if spec.dedicated {
                tokio::task::spawn_blocking(|| {
                    render_allocation_policy(&["scheduler.mode=dedicated"])
                })
                .await??
            } else {
                tokio::task::spawn_blocking(allocation_policy_yaml).await??
            };
            api.set_admission_policies(AdmissionPolicies::from_yaml(&yaml)?);
        }
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

    /// A client acting as `username` (a user the allocation policy does not trust, unless
    /// it is [`EXTENDER_USER`] or [`DEVICE_PLUGIN_USER`]).
    pub async fn client_as(&self, username: &str) -> anyhow::Result<Client> {
        let yaml = self.api.kubeconfig_yaml_as(username);
        let kubeconfig = kube::config::Kubeconfig::from_yaml(&yaml)?;
        let config = kube::Config::from_custom_kubeconfig(
            kubeconfig,
            &kube::config::KubeConfigOptions::default(),
        )
        .await?;
        Ok(Client::try_from(config)?)
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

    async fn start_extender(&mut self) -> anyhow::Result<()> {
        self.spawn_extender()?;
        self.extender
            .as_mut()
            .context("the extender was not started")?
            .wait_ready()
            .await
    }

    /// Starts the extender process on the cluster's extender port, without waiting for it.
    fn spawn_extender(&mut self) -> anyhow::Result<()> {
        let log = self.dir.path().join("extender.log");
        let mut args = self.spec.extender_args.clone();
        if !args.iter().any(|arg| arg.starts_with("--bind-grace-ms")) {
            // Production holds binds 2 s after start-up; the scenarios' API server answers in
            // milliseconds, so a shorter hold keeps them quick without skipping it.
            args.extend(["--bind-grace-ms".to_owned(), "300".to_owned()]);
        }
        args.extend([
            "--allocation-keys-file".to_owned(),
            self.dir.path().join(ALLOCATION_KEYS).display().to_string(),
        ]);
        let native_scoring = self
            .spec
            .scheduler_values
            .iter()
            .any(|value| value == "scheduler.nativeGpuScoring=true");
        if self.spec.dedicated
            && !native_scoring
            && !args.iter().any(|arg| arg.starts_with("--filter-keep-best"))
        {
            // The chart's dedicated install: filter keeps the node the profile would rank
            // best (`extender.filterKeepBest: 1`, its weight `scheduler.extender.weight`);
            // with `scheduler.nativeGpuScoring` the chart renders 0.
            args.extend([
                "--filter-keep-best=1".to_owned(),
                "--prioritize-weight=1".to_owned(),
            ]);
        }
        if let Some(port) = self.webhook_port {
            // As the chart's extender Deployment sets them in dedicated mode.
            args.extend([
                "--webhook-enabled=true".to_owned(),
                format!("--webhook-listen=127.0.0.1:{port}"),
                format!("--webhook-service={RELEASE}-extender"),
                format!("--namespace={RELEASE_NAMESPACE}"),
                format!("--webhook-configuration={RELEASE}-webhook"),
                format!("--scheduler-name={DEDICATED_SCHEDULER}"),
            ]);
        }
        self.extender = Some(Extender::spawn_secured_on(
            &self.binaries,
            &self.extender_kubeconfig,
            &log,
            &args,
            self.extender_port,
            (&self.extender_tls, self.monitor_port),
        )?);
        Ok(())
    }

    async fn start_scheduler(&mut self) -> anyhow::Result<()> {
        // As the chart configures it: HTTPS, trusting the extender's CA, verifying the
        // Service's name (here dialled by address, so the name is given as `serverName`).
        let prefix = format!(
            "https://127.0.0.1:{}/gpushare-scheduler",
            self.extender_port
        );
        let config = SchedulerConfig {
            extenders: vec![ExtenderConfig {
                http_timeout: self.spec.http_timeout,
                enable_https: true,
                tls: Some(self.extender_tls.scheduler_config()),
                ..ExtenderConfig::gpushare(&prefix)
            }],
            // kube-scheduler runs every bind in a goroutine of its own, unbounded.
            parallel_binds: UNBOUNDED_BINDS,
            binding_cycle_delay: self.spec.binding_cycle_delay,
            backoff_initial: Duration::from_millis(50),
            backoff_max: SCHEDULER_BACKOFF_MAX,
            unschedulable_retry: SCHEDULER_UNSCHEDULABLE_RETRY,
            ..SchedulerConfig::default()
        };
        let config = if self.spec.dedicated {
            // The dedicated scheduler runs the configuration the chart renders for this
            // extender's policy; only the address and certificates are the harness's.
            let rendered = dedicated_scheduler_configuration(
                &self.spec.extender_args,
                &self.spec.scheduler_values,
            )
            .await?;
            let mut config = SchedulerConfig::from_kube_scheduler_configuration(&rendered, config)?;
            ensure!(
                config.scheduler_name == DEDICATED_SCHEDULER,
                "{}",
                config.scheduler_name
            );
            for extender in &mut config.extenders {
                extender.url_prefix.clone_from(&prefix);
                extender.http_timeout = self.spec.http_timeout;
                extender.tls = Some(self.extender_tls.scheduler_config());
            }
            config
        } else {
            config
        };
        self.scheduler = Some(SchedulerDriver::start(self.client.clone(), config).await?);
        Ok(())
    }

    /// The port kube-scheduler calls the extender on (the Service's port).
    pub fn extender_port(&self) -> u16 {
        self.extender_port
    }

    /// The CA of the extender's certificate, as a file (the Secret's `ca.crt`).
    pub fn extender_ca_file(&self) -> PathBuf {
        self.extender_tls.cert_file.with_file_name("ca.crt")
    }

    /// Starts one more extender process the way the chart runs each replica: this cluster's
    /// certificate and signing keys, HTTPS on `port` and health on `monitor_port`, acting
    /// with `kubeconfig`, logging to `<name>.log`, with `extra` flags. Does not wait for it.
    /// (The replicas of `tests/ha.rs`; [`TestCluster::extender`] is not one of them.)
    pub fn spawn_extender_replica(
        &self,
        name: &str,
        kubeconfig: &Path,
        (port, monitor_port): (u16, u16),
        extra: &[String],
    ) -> anyhow::Result<Extender> {
        let mut args = vec![
            "--bind-grace-ms".to_owned(),
            "300".to_owned(),
            "--allocation-keys-file".to_owned(),
            self.dir.path().join(ALLOCATION_KEYS).display().to_string(),
        ];
        args.extend_from_slice(extra);
        Extender::spawn_secured_on(
            &self.binaries,
            kubeconfig,
            &self.dir.path().join(format!("{name}.log")),
            &args,
            port,
            (&self.extender_tls, monitor_port),
        )
    }

    /// The running extender.
    pub fn extender(&self) -> anyhow::Result<&Extender> {
        self.extender
            .as_ref()
            .context("the extender is not running")
    }

    /// Kills the extender (as a crash would) and starts a fresh one on the same port; the
    /// scheduler driver is restarted too (a new leader forgets every assumed pod).
    pub async fn crash_and_restart_extender(&mut self) -> anyhow::Result<()> {
        self.kill_extender().await;
        if let Some(scheduler) = self.scheduler.take() {
            scheduler.shutdown().await;
        }
        self.start_extender().await?;
        self.start_scheduler().await
    }

    /// SIGKILLs the extender, as an OOM kill or a node failure would. The scheduler driver
    /// keeps running and calling the extender's address: its calls fail with a transport
    /// error until [`TestCluster::restart_extender`], and the pods are requeued.
    pub async fn kill_extender(&mut self) {
        if let Some(old) = self.extender.take() {
            old.process.crash().await;
        }
    }

    /// Starts the extender again on the same port (as kubelet restarts the container behind
    /// the same Service) and waits until it is ready.
    pub async fn restart_extender(&mut self) -> anyhow::Result<()> {
        if self.extender.is_some() {
            bail!("the extender is running; kill it first");
        }
        self.start_extender().await
    }

    /// [`kill_extender`](Self::kill_extender), then [`restart_extender`](Self::restart_extender);
    /// the scheduler driver is not touched.
    pub async fn crash_and_restart_extender_in_place(&mut self) -> anyhow::Result<()> {
        self.kill_extender().await;
        self.restart_extender().await
    }

    /// SIGKILLs the extender `times` times, `gap` apart, starting a fresh one on the same port
    /// right after each kill, as kubelet restarts a crashed container: a later kill may hit
    /// the new process while it is still starting up. Returns once the last one is ready.
    pub async fn kill_extender_repeatedly(
        &mut self,
        times: usize,
        gap: Duration,
    ) -> anyhow::Result<()> {
        for round in 0..times {
            let killed_at = tokio::time::Instant::now();
            self.kill_extender().await;
            self.spawn_extender()?;
            if round + 1 < times {
                tokio::time::sleep_until(killed_at + gap).await;
            }
        }
        self.extender
            .as_mut()
            .context("the extender was not started")?
            .wait_ready()
            .await
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

    /// Restarts a node's device plugin (SIGTERM, then a fresh process).
    pub async fn restart_device_plugin(&mut self, node: &str) -> anyhow::Result<()> {
        let sim = self.nodes.get_mut(node).context("no such node")?;
        if let Some(plugin) = sim.plugin.take() {
            plugin.stop().await;
        }
        let sim = self.nodes.get(node).context("no such node")?;
        let before = sim.kubelet.registrations(RESOURCE);
        let plugin = self.host().spawn_plugin(sim)?;
        let sim = self.nodes.get_mut(node).context("no such node")?;
        sim.plugin = Some(plugin);
        wait_reregistered(&sim.kubelet, before).await
    }

    /// Rolls a node's device plugin as a DaemonSet rollout does ([`overlap_rollout`]).
    /// Fails if the old one's exit took the new one's socket away.
    pub async fn roll_device_plugin(&mut self, node: &str) -> anyhow::Result<()> {
        let log = self.dir.path().join(format!("device-plugin-{node}.log"));
        let sim = self.nodes.get_mut(node).context("no such node")?;
        let before = sim.kubelet.registrations(RESOURCE);
        let old = sim.plugin.take().context("no device plugin running")?;
        let sim = self.nodes.get(node).context("no such node")?;
        let plugin = overlap_rollout(
            old,
            &log,
            || self.host().spawn_plugin(sim),
            || sim.kubelet.registrations(RESOURCE) > before,
        )
        .await?;
        let sim = self.nodes.get_mut(node).context("no such node")?;
        sim.plugin = Some(plugin);
        wait_reregistered(&sim.kubelet, before).await?;
        let socket = sim
            .kubelet
            .plugin_socket(RESOURCE)
            .context("no plugin registered")?;
        ensure!(
            socket.exists(),
            "the old device plugin's exit removed the new one's socket {}",
            socket.display()
        );
        Ok(())
    }

    /// Restarts a node's kubelet (its socket removed and recreated); the plugin re-registers.
    pub async fn restart_kubelet(&mut self, node: &str) -> anyhow::Result<()> {
        let sim = self.nodes.get_mut(node).context("no such node")?;
        let before = sim.kubelet.registrations(RESOURCE);
        sim.kubelet.restart().await?;
        wait_reregistered(&sim.kubelet, before).await
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

/// The last `lines` lines of a text file ("" if it cannot be read).
pub fn file_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let last: Vec<&str> = text.lines().rev().take(lines).collect();
    last.into_iter().rev().collect::<Vec<_>>().join("\n")
}

/// Set (to anything) to keep a cluster's folder with our binaries' logs after shutdown.
pub const KEEP_LOGS: &str = "GPUSHARE_E2E_KEEP_LOGS";

/// Memory held by the harness and our child processes (proportional set size), in KiB.
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryUse {
    /// The test or demo process: API server, scheduler driver, kubelet drivers.
    pub harness_kib: u64,
    /// `gpushare-extender`.
    pub extender_kib: u64,
    /// Every `gpushare-device-plugin` together.
    pub device_plugins_kib: u64,
    /// How many device plugins that is.
    pub device_plugins: usize,
}

impl MemoryUse {
    /// Everything together.
    pub fn total_kib(&self) -> u64 {
        self.harness_kib + self.extender_kib + self.device_plugins_kib
    }
}

impl std::fmt::Display for MemoryUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |kib: u64| kib / 1024;
        write!(
            f,
            "{} MiB in all: harness {} MiB, extender {} MiB, {} device plugins {} MiB",
            mib(self.total_kib()),
            mib(self.harness_kib),
            mib(self.extender_kib),
            self.device_plugins,
            mib(self.device_plugins_kib)
        )
    }
}

/// Memory a process holds, in KiB: its proportional set size (`Pss`: private pages plus its
/// share of pages shared with others, so that a sum over processes counts the binary's code
/// once), else `VmRSS`. None where there is no `/proc`.
fn memory_kib(pid: u32) -> Option<u64> {
    let field = |file: &str, name: &str| {
        let text = std::fs::read_to_string(format!("/proc/{pid}/{file}")).ok()?;
        text.lines()
            .find_map(|line| line.strip_prefix(name))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    field("smaps_rollup", "Pss:").or_else(|| field("status", "VmRSS:"))
}

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

/// What starting a node needs, owned so that many nodes can start at once.
struct NodeHost {
    client: Client,
    dir: PathBuf,
    binaries: Binaries,
    /// The device plugins' ServiceAccount ([`DEVICE_PLUGIN_USER`]): each plugin gets a token
    /// naming its node, as the DaemonSet's pods do.
    plugin_identity: PodIdentity,
    admission: AdmissionOrder,
    /// Extra flags for every device plugin ([`ClusterSpec::device_plugin_args`]).
    plugin_args: Vec<String>,
}

impl NodeHost {
    /// Creates the Node, starts its kubelet driver and device plugin, and waits until the
    /// plugin registered and the node advertises its GPU memory.
    async fn start_node(
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
                    let published = crate::scenarios::published_gpus(&node)?.ok()?;
                    (published.len() == gpus.len() && published.iter().all(|g| g.healthy))
                        .then_some(())
                }
            },
        )
        .await?;
        Ok(sim)
    }

    fn spawn_plugin(&self, sim: &SimNode) -> anyhow::Result<Process> {
        let sizes: Vec<String> = sim.gpus.iter().map(u64::to_string).collect();
        let mut args = vec![
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
            // Port 0: the kernel picks a free one at bind time. (A port picked beforehand with
            // `free_port` may be taken by another of 200 processes' connections meanwhile.)
            "--metrics-listen".to_owned(),
            "127.0.0.1:0".to_owned(),
            "--allocation-keys-file".to_owned(),
            self.dir.join(ALLOCATION_KEYS).display().to_string(),
            // What the kubelet driver really handed out (kubelet's PodResources API).
            "--pod-resources-socket".to_owned(),
            sim.kubelet.pod_resources_socket().display().to_string(),
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

/// Binds in flight at once: as many as there are pods (kube-scheduler bounds them by nothing).
const UNBOUNDED_BINDS: usize = 100_000;

/// Waits until the device plugin registered again (after `before` registrations) and
/// listed healthy devices.
/// A DaemonSet rollout of a plugin, with the overlap made certain: the new pod starts while
/// the old one is still shutting down, on the same socket paths. The old process is frozen
/// (SIGSTOP) with its SIGTERM pending, the new one started (`start_new`), and the old one
/// resumed only once the new one registered (`registered`) or logged in `log` that it waits
/// for the old one to let go; returns the new process once the old one exited.
pub async fn overlap_rollout(
    old: Process,
    log: &Path,
    start_new: impl FnOnce() -> anyhow::Result<Process>,
    registered: impl Fn() -> bool,
) -> anyhow::Result<Process> {
    let waits_logged = || {
        std::fs::read(log)
            .map(|text| {
                String::from_utf8_lossy(&text)
                    .matches(gpushare_proto::socket_file::WAITING_FOR_PREDECESSOR)
                    .count()
            })
            .unwrap_or(0)
    };
    old.signal("STOP").await;
    old.signal("TERM").await;
    let waits_before = waits_logged();
    let new = start_new()?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !registered() && waits_logged() == waits_before {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the new plugin neither registered nor waited for the old one; see {}",
            log.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    old.signal("CONT").await;
    old.wait_stopped().await;
    Ok(new)
}

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
