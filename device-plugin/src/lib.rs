//! gpushare's kubelet device plugin: GPU memory as a countable resource, and the link
//! between the extender's decision and the container.
//!
//! ```text
//!              ┌──────────── gpushare-device-plugin ────────────┐
//!   NVML / sim │ backend ──▶ inventory (watch) ──▶ node::publish ├──▶ Node annotation (extender reads)
//!              │                 │                               │
//!   kubelet ◀──┤ server: socket, │ ListAndWatch (1 device / GiB) │
//!   (gRPC)     │ register,       ▼                               │
//!              │ re-register   service::Allocate ◀── pods cache ◀┼─── watch pods on this node
//!              │                  │  env NVIDIA_VISIBLE_DEVICES  │
//!              │                  └──▶ marks (background patch) ─┼──▶ pod annotations
//!              └─────────────────────────────────────────────────┘
//! ```
//!
//! kubelet only knows "N devices of `example.com/gpu-mem`"; the extender already chose a GPU
//! for the pod and wrote it on the pod. At `Allocate` the plugin finds the pod waiting for N
//! GiB in its watch cache ([`pods`], [`matching`]) and returns that GPU's UUID as
//! `NVIDIA_VISIBLE_DEVICES`. With `--allocation-keys-file`, only allocations whose
//! signature verifies under that keyring are acted on (see
//! [`gpushare_contract::signature`]); a pod created with hand-written allocation annotations
//! is refused. Everything host-specific (the socket directory, the GPUs) is a
//! parameter, so the whole plugin runs in tests against a fake kubelet in a temp dir.
//!
//! After the fact, [`pod_resources`] asks kubelet's PodResources API what it really gave
//! each container (device IDs name their GPU): a container holding devices of a GPU its pod
//! was not given, or a pod holding another pod's allocation, becomes a Warning Event on the
//! pod and `gpushare_device_plugin_kubelet_mismatches_total`, and the allocation marks
//! follow these facts ([`facts`], [`facts_plan`]). Without the socket (older
//! kubelets) the plugin works as before.
//!
//! Every long-lived task (the servers, the pod watch and its workers, the checks and
//! publishers) runs in one [`gpushare_runtime::TaskSet`], as in the extender and the DRA
//! plugin: the first to end, fail or panic before shutdown is logged by name and stops the
//! plugin, rather than leaving it up with part of it gone (a dead pod watch would leave
//! Allocate answering from a frozen view). On shutdown they are all told to stop at once
//! and waited for (the server removes its socket on the way out).
//!
//! [`usage`] measures what each pod really uses (NVML process lists traced to pods through
//! their cgroups, or a simulated usage file) against what kubelet gave it, on `/metrics` and
//! in the node annotation `<domain>/v1.usage` that `kubectl gpushare top -d` shows.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use gpushare_contract::env::Enforcement;
use gpushare_contract::{DEFAULT_DOMAIN, DEFAULT_RESOURCE, KeyringFile, Keys};
use gpushare_proto::{DEFAULT_DEVICE_PLUGIN_DIR, DEFAULT_POD_RESOURCES_SOCKET};
use gpushare_runtime::TaskSet;
use gpushare_runtime::uninstall::UninstallWatch;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub use gpushare_runtime::LogFormat;

/// The names this plugin's variables had before the `GPUSHARE_*` scheme: still read, with a
/// warning ([`gpushare_runtime::env::with_legacy_env`]). `CUDA_MPS_PIPE_DIRECTORY` keeps its
/// name: it is CUDA's own, shared with the MPS daemon and its clients.
pub const LEGACY_ENV: &[&str] = &[
    "ALLOCATION_MARKS",
    "CDI_DEVICES",
    "DEVICE_PLUGIN_DIR",
    "EVICT_ON_UNHEALTHY",
    "GPU_BACKEND",
    "LOG_FORMAT",
    "METRICS_LISTEN",
    "NODE_NAME",
    "PENDING_POD_WAIT_MS",
    "POD_RESOURCES_PERIOD_MS",
    "POD_RESOURCES_SOCKET",
    "PROC_ROOT",
    "RESOURCE_NAME",
    "SIMULATE_GPUS",
    "SIMULATE_HEALTH_FILE",
    "SIMULATE_MODEL",
    "SIMULATE_USAGE_FILE",
    "USAGE_ANNOTATION_MIN_CHANGE_MIB",
    "USAGE_ANNOTATION_MIN_INTERVAL_MS",
    "USAGE_PERIOD_MS",
];

pub use gpushare_runtime::gpu as backend;
pub mod attribution;
pub mod compute;
pub mod compute_usage;
pub mod devices;
mod error;
pub mod facts;
pub mod facts_plan;
pub mod gpu_health;
pub mod isolation_usage;
mod mark_writer;
pub mod matching;
pub mod metrics;
pub mod node;
pub mod over_share;
pub mod pod_resources;
mod pod_views;
pub mod pods;
pub mod registrations;
pub mod server;
pub mod service;
pub mod usage;
pub mod view;

pub use error::{Error, Result};

use backend::{GpuBackend, nvml::NvmlBackend, simulated::SimulatedBackend};
use metrics::Metrics;
use pods::PodCache;
use service::PluginState;

pub use backend::BackendKind;

/// Command line and environment configuration.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "gpushare-device-plugin", version, about)]
pub struct Config {
    /// The node this plugin runs on (usually from the downward API).
    #[arg(long, env = "GPUSHARE_NODE_NAME")]
    pub node_name: String,
    /// This plugin's DaemonSet: watched, so that a plugin stopping after it was deleted
    /// removes its isolation files (an uninstall).
    #[command(flatten)]
    pub own_daemon_set: gpushare_runtime::uninstall::OwnDaemonSet,
    /// kubelet's device plugin directory (holds kubelet.sock).
    #[arg(long, env = "GPUSHARE_DEVICE_PLUGIN_DIR", default_value = DEFAULT_DEVICE_PLUGIN_DIR)]
    pub device_plugin_dir: PathBuf,
    /// Where GPUs come from.
    #[arg(long, env = "GPUSHARE_GPU_BACKEND", value_enum, default_value_t = BackendKind::Nvml)]
    pub gpu_backend: BackendKind,
    /// Sizes in GiB of simulated GPUs, e.g. `16,16,24` (with `--gpu-backend simulated`).
    #[arg(
        long,
        env = "GPUSHARE_SIMULATE_GPUS",
        value_delimiter = ',',
        default_value = ""
    )]
    pub simulate_gpus: Vec<String>,
    /// Product name of the simulated GPUs (published in the inventory and node labels); a
    /// `|`-separated list gives each GPU its own, in index order, the last repeating.
    #[arg(long, env = "GPUSHARE_SIMULATE_MODEL", default_value = backend::simulated::SIMULATED_MODEL)]
    pub simulate_model: String,
    /// File listing comma-separated indices of unhealthy simulated GPUs; polled every 200 ms.
    #[arg(long, env = "GPUSHARE_SIMULATE_HEALTH_FILE")]
    pub simulate_health_file: Option<PathBuf>,
    /// The extended resource to advertise.
    #[arg(long, env = "GPUSHARE_RESOURCE_NAME", default_value = DEFAULT_RESOURCE)]
    pub resource: String,
    /// Domain of gpushare's annotations and labels.
    #[arg(long, env = "GPUSHARE_DOMAIN", default_value = DEFAULT_DOMAIN)]
    pub domain: String,
    /// Address for /healthz, /readyz and /metrics.
    #[arg(long, env = "GPUSHARE_METRICS_LISTEN", default_value = "0.0.0.0:9400")]
    pub metrics_listen: SocketAddr,
    /// Log format.
    #[arg(long, env = "GPUSHARE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// How long Allocate waits for the pod watch to show the pod kubelet is admitting.
    #[arg(long, env = "GPUSHARE_PENDING_POD_WAIT_MS", default_value_t = 3000)]
    pub pending_pod_wait_ms: u64,
    /// Keyring the extender signs allocations with (`id:base64key` per line; mount it from
    /// the Secret the extender reads). Only allocations whose signature verifies get a GPU;
    /// the file is re-read when it changes. Unset: allocations are NOT verified.
    #[arg(long, env = "GPUSHARE_ALLOCATION_KEYS_FILE")]
    pub allocation_keys_file: Option<PathBuf>,
    /// Write each pod's allocation marks (the `allocated` and `assigned` annotations) to the
    /// API server once its containers are allocated. Off by default: kubelet writes the
    /// pod's status anyway, and a `startTime` there says it admitted the pod, which is where
    /// it calls Allocate for every container; the extender and this plugin read that, so the
    /// marks would cost one more pod write (and its watch events) per GPU pod for nothing
    /// they need. Turn it on for an extender older than this plugin (it reads only marks).
    #[arg(long, env = "GPUSHARE_ALLOCATION_MARKS", default_value_t = false, action = clap::ArgAction::Set)]
    pub allocation_marks: bool,
    /// kubelet's PodResources socket: what kubelet really gave each container is read from
    /// it, checked against the allocations (mismatches become pod Events and
    /// `gpushare_device_plugin_kubelet_mismatches_total`) and the allocation marks follow it.
    /// Absent or unreadable: logged once, marks are reconciled from pod phases as before.
    #[arg(long, env = "GPUSHARE_POD_RESOURCES_SOCKET", default_value = DEFAULT_POD_RESOURCES_SOCKET)]
    pub pod_resources_socket: PathBuf,
    /// How often kubelet's PodResources API is read (also shortly after each Allocate).
    #[arg(long, env = "GPUSHARE_POD_RESOURCES_PERIOD_MS", default_value_t = 5000)]
    pub pod_resources_period_ms: u64,
    /// How each container's share is enforced: `preload` (gpushare's interposer, mounted
    /// and preloaded into the container: see `isolation/`), `none` (it is told its share, see
    /// `gpushare_contract::env`), `toolkit` (the NVIDIA container toolkit's memory-limit CDI
    /// hook: `NVIDIA_GPU_MEMORY_LIMIT`), `mps` (an MPS control daemon's pinned-memory limit).
    #[arg(long, env = "GPUSHARE_ENFORCEMENT", default_value = "none")]
    pub enforcement: Enforcement,
    /// Where the interposer comes from and goes (`--enforcement preload`).
    #[command(flatten)]
    pub isolation: gpushare_runtime::isolation::IsolationArgs,
    /// Evict the running pods of a GPU that turns unhealthy (they get an Event and a pod
    /// condition either way), so their controllers re-create them elsewhere.
    #[arg(long, env = "GPUSHARE_EVICT_ON_UNHEALTHY", default_value_t = false, action = clap::ArgAction::Set)]
    pub evict_on_unhealthy: bool,
    /// What is done about a pod whose processes use more GPU memory than it was given, by
    /// the driver's count ([`over_share`]): `report` (a Warning Event `GpuMemoryOverShare`
    /// once per episode, and the metrics) or `evict` (the same, then an eviction once it
    /// stayed over for `--over-share-grace-seconds`). Measured every usage period.
    #[arg(
        long,
        env = "GPUSHARE_OVER_SHARE",
        value_enum,
        default_value = "report"
    )]
    pub over_share: over_share::OverShareMode,
    /// How long a pod may stay over its share before `--over-share evict` evicts it.
    #[arg(long, env = "GPUSHARE_OVER_SHARE_GRACE_SECONDS", default_value_t = 30)]
    pub over_share_grace_seconds: u64,
    /// The MPS control daemon's pipe directory on the host, mounted into containers at the
    /// same path (`--enforcement mps`).
    #[arg(
        long,
        env = "CUDA_MPS_PIPE_DIRECTORY",
        default_value = "/tmp/nvidia-mps"
    )]
    pub mps_pipe_directory: String,
    /// Also name each container's GPUs as CDI devices in the Allocate answer
    /// (`nvidia.com/gpu=<uuid>`), so they are pinned where the NVIDIA toolkit resolves
    /// devices through CDI and ignores `NVIDIA_VISIBLE_DEVICES`. Off by default: kubelet hands
    /// these names to the container runtime, and a runtime with CDI enabled (CRI-O,
    /// containerd 2.x, containerd 1.7 with `enable_cdi`) refuses to create the container when
    /// no CDI spec on the node defines them ("unresolvable CDI devices"). Turn it on where
    /// every GPU node has the NVIDIA toolkit's CDI spec with UUID names (`nvidia-ctk cdi
    /// list` shows `nvidia.com/gpu=GPU-…`).
    #[arg(long, env = "GPUSHARE_CDI_DEVICES", default_value_t = false, action = clap::ArgAction::Set)]
    pub cdi_devices: bool,
    /// JSON file saying how much GPU memory each pod uses on simulated GPUs,
    /// `{"default/a": "5Gi", "default/b": 512}` (MiB or a size); re-read at every usage poll.
    #[arg(long, env = "GPUSHARE_SIMULATE_USAGE_FILE")]
    pub simulate_usage_file: Option<PathBuf>,
    /// How often GPU memory use is measured per pod ([`usage`]); 0 turns it off.
    #[arg(long, env = "GPUSHARE_USAGE_PERIOD_MS", default_value_t = 10_000)]
    pub usage_period_ms: u64,
    /// The host's `/proc` as this process sees it (it needs the host's PID namespace to trace
    /// GPU processes to pods).
    #[arg(long, env = "GPUSHARE_PROC_ROOT", default_value = usage::DEFAULT_PROC_ROOT)]
    pub proc_root: PathBuf,
    /// The node's usage annotation is rewritten only when a pod or GPU moved by this many MiB
    /// (or a pod crossed its share, or pods came or went).
    #[arg(
        long,
        env = "GPUSHARE_USAGE_ANNOTATION_MIN_CHANGE_MIB",
        default_value_t = 256
    )]
    pub usage_annotation_min_change_mib: u64,
    /// Least time between two writes of the node's usage annotation.
    #[arg(
        long,
        env = "GPUSHARE_USAGE_ANNOTATION_MIN_INTERVAL_MS",
        default_value_t = 30_000
    )]
    pub usage_annotation_min_interval_ms: u64,
}

/// How often the keyring file is checked for changes.
pub const KEYRING_POLL: Duration = Duration::from_secs(5);

impl Config {
    fn simulated_sizes(&self) -> Result<Vec<u64>> {
        self.simulate_gpus
            .iter()
            .map(|s| s.trim())
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<u64>().ok().filter(|&gib| gib > 0).ok_or_else(|| {
                    Error::Config(format!(
                        "--simulate-gpus: {s:?} is not a size in GiB (write e.g. 16,16,24)"
                    ))
                })
            })
            .collect()
    }

    fn backend(&self) -> Result<Arc<dyn GpuBackend>> {
        Ok(match self.gpu_backend {
            BackendKind::Nvml => Arc::new(NvmlBackend::new()?),
            BackendKind::Simulated => Arc::new(
                SimulatedBackend::new(
                    &self.node_name,
                    self.simulated_sizes()?,
                    self.simulate_health_file.clone(),
                )
                .with_model(&self.simulate_model)
                .with_usage_file(self.simulate_usage_file.clone()),
            ),
        })
    }
}

/// Runs the plugin with a client found the standard way (in-cluster or `KUBECONFIG`)
/// until `shutdown` resolves.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    // GPUs first: a node without a driver should say so, not complain about kubeconfig.
    let backend = config.backend()?;
    let client = kube::Client::try_default().await.map_err(Error::Kube)?;
    run_inner(config, backend, client, shutdown).await
}

/// Runs the plugin against `client` until `shutdown` resolves: serves the plugin socket,
/// registers (and re-registers) with kubelet, publishes the node's GPUs, answers Allocate.
pub async fn run_with_client(
    config: Config,
    client: kube::Client,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let backend = config.backend()?;
    run_inner(config, backend, client, shutdown).await
}

async fn run_inner(
    config: Config,
    backend: Arc<dyn GpuBackend>,
    client: kube::Client,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    if config.node_name.trim().is_empty() {
        return Err(Error::Config("--node-name (NODE_NAME) is empty".into()));
    }
    // Another plugin serving our resource name here would replace us at kubelet (and we it)
    // on every registration: refuse before anything is served.
    registrations::refuse_if_registered_elsewhere(
        &config.device_plugin_dir,
        &config.resource,
        &config.device_plugin_dir.join(server::SOCKET_NAME),
    )
    .await?;
    // However this ends (an error, or the caller dropping it), every task is told to stop.
    let token = CancellationToken::new();
    let _stop_all = token.clone().drop_guard();
    let keyring_file = open_keyring(config.allocation_keys_file.as_deref())?;
    let isolation = install_isolation(&config)?;
    let gpus = backend.gpus()?;
    for gpu in &gpus {
        tracing::info!(gpu = gpu.index, uuid = %gpu.uuid, model = %gpu.model, mem_gib = gpu.mem_gib, numa = ?gpu.numa_node, "found GPU");
    }
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    metrics.record_gpus(&gpus);
    let listener = bind_metrics(config.metrics_listen).await?;
    let plugin = Plugin {
        keys: Keys::new(&config.domain),
        config,
        backend,
        client,
        metrics,
        inventory: watch::Sender::new(Arc::new(gpus)),
        ready: Arc::new(AtomicBool::new(false)),
        token: token.clone(),
        isolation,
    };
    // Watched from now on: a plugin stopping after its DaemonSet was deleted removes what was
    // installed on the node, in every enforcement mode (an earlier preload install may have
    // left files there).
    let host_dir = plugin.config.isolation.isolation_host_dir.clone();
    let uninstall = UninstallWatch::start(plugin.client.clone(), &plugin.config.own_daemon_set);
    let tasks = plugin.spawn(listener, registry, keyring_file);
    let outcome = supervise(tasks, shutdown, token).await;
    if outcome.is_ok() {
        uninstall.leave_node_if_uninstalled(&host_dir);
    }
    outcome
}

/// With `--enforcement preload`, installs the interposer from the image into the host
/// directory containers mount it from.
fn install_isolation(config: &Config) -> Result<Option<service::Isolation>> {
    if config.enforcement != Enforcement::Preload {
        return Ok(None);
    }
    let host_dir = config.isolation.isolation_host_dir.clone();
    let library = config.isolation.install().map_err(Error::Isolation)?;
    Ok(Some(service::Isolation {
        library,
        host_dir,
        exempt_namespaces: config.isolation.exempt_namespaces(),
        options: config.isolation.options(),
    }))
}

/// Opens the keyring that allocations are verified with; without one, says loudly that
/// they are not.
fn open_keyring(path: Option<&Path>) -> Result<Option<KeyringFile>> {
    let Some(path) = path else {
        tracing::warn!(
            "no --allocation-keys-file: allocations are NOT protected; any pod created with spec.nodeName and hand-written gpushare allocation annotations gets the GPU they name"
        );
        return Ok(None);
    };
    let file = KeyringFile::open(path)?;
    let keyring = file.keyring().current();
    let ids: Vec<&str> = keyring.ids().collect();
    tracing::info!(file = %path.display(), keys = ?ids, "allocation signatures are verified: only allocations signed by the extender get a GPU");
    Ok(Some(file))
}

/// Binds the address of `/healthz`, `/readyz` and `/metrics` before anything starts, so a
/// taken port fails the start at once.
async fn bind_metrics(addr: SocketAddr) -> Result<tokio::net::TcpListener> {
    let listener = metrics::bind(addr)
        .await
        .map_err(|source| Error::MetricsBind { addr, source })?;
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving /healthz, /readyz and /metrics");
    }
    Ok(listener)
}

/// How often the interposer's budget files are read ([`isolation_usage`]).
const ISOLATION_READ_PERIOD: Duration = Duration::from_secs(10);

/// The plugin's long-lived tasks, named for the supervisor.
type Tasks = TaskSet<Result<()>>;

/// What the plugin's long-lived tasks are built from, once the start-up checks passed.
struct Plugin {
    config: Config,
    backend: Arc<dyn GpuBackend>,
    client: kube::Client,
    keys: Keys,
    metrics: Metrics,
    inventory: node::Inventory,
    /// True while registered with kubelet and it has the device list (`/readyz`).
    ready: Arc<AtomicBool>,
    token: CancellationToken,
    /// Where the interposer was installed (`--enforcement preload`).
    isolation: Option<service::Isolation>,
}

impl Plugin {
    /// Spawns every long-lived task: the device plugin server, the kubelet check, GPU
    /// health, its reporter, the inventory publisher, the metrics server, the pod cache's
    /// tasks, and, when configured, the usage reader and the keyring watch. Each ends only
    /// on shutdown; the caller supervises them.
    fn spawn(
        self,
        listener: tokio::net::TcpListener,
        registry: Registry,
        keyring_file: Option<KeyringFile>,
    ) -> Tasks {
        let (pods, pod_tasks) = PodCache::start(
            self.client.clone(),
            &self.config.node_name,
            self.keys.clone(),
            keyring_file.as_ref().map(KeyringFile::keyring),
            self.metrics.clone(),
            self.config.allocation_marks,
            self.token.clone(),
        );
        let allocated = Arc::new(tokio::sync::Notify::new());
        let mut tasks = Tasks::default();
        self.device_plugin_server(&mut tasks, pods.clone(), allocated.clone());
        self.pod_resources_check(&mut tasks, pods.clone(), allocated);
        self.gpu_health(&mut tasks);
        self.unhealthy_gpu_reporter(&mut tasks, pods.clone());
        self.inventory_publisher(&mut tasks);
        self.metrics_server(&mut tasks, listener, registry);
        // The pod view's tasks end only on shutdown: any other end stops the plugin loudly.
        for (name, task) in pod_tasks {
            tasks.spawn(name, async move {
                task.await;
                Ok(())
            });
        }
        if let Some(isolation) = &self.isolation {
            self.isolation_reader(&mut tasks, pods.clone(), isolation);
        }
        if self.config.usage_period_ms > 0 || self.isolation.is_some() {
            self.usage_reader(&mut tasks, pods);
        }
        if let Some(file) = keyring_file {
            tasks.spawn(
                "allocation keyring",
                watch_keyring(file, self.token.clone()),
            );
        }
        tasks
    }

    /// Serves the plugin socket and keeps it registered with kubelet ([`server`]).
    fn device_plugin_server(
        &self,
        tasks: &mut Tasks,
        pods: Arc<PodCache>,
        allocated: Arc<tokio::sync::Notify>,
    ) {
        let config = &self.config;
        let state = Arc::new(PluginState {
            node: config.node_name.clone(),
            resource: config.resource.clone(),
            inventory: self.inventory.clone(),
            pods,
            metrics: self.metrics.clone(),
            pending_wait: Duration::from_millis(config.pending_pod_wait_ms),
            allocated,
            enforcement: config.enforcement,
            mps_pipe_directory: config.mps_pipe_directory.clone(),
            cdi_devices: config.cdi_devices,
            isolation: self.isolation.clone(),
        });
        let serve = server::serve_and_register(
            state,
            config.device_plugin_dir.clone(),
            self.ready.clone(),
            self.token.clone(),
        );
        tasks.spawn("device plugin server", serve);
        let compute = server::serve_compute(
            gpushare_contract::request::compute_resource_of(&config.resource),
            (
                config.node_name.clone(),
                self.inventory.clone(),
                self.metrics.clone(),
            ),
            config.device_plugin_dir.clone(),
            // Not part of `/readyz`, which follows the memory resource (see `compute`).
            Arc::new(AtomicBool::new(false)),
            self.token.clone(),
        );
        tasks.spawn("compute device plugin server", compute);
    }

    /// Compares kubelet's PodResources listing with the allocations ([`pod_resources`]).
    fn pod_resources_check(
        &self,
        tasks: &mut Tasks,
        pods: Arc<PodCache>,
        allocated: Arc<tokio::sync::Notify>,
    ) {
        let checker = pod_resources::Checker {
            socket: self.config.pod_resources_socket.clone(),
            resource: self.config.resource.clone(),
            pods,
            inventory: self.inventory.clone(),
            metrics: self.metrics.clone(),
            period: Duration::from_millis(self.config.pod_resources_period_ms.max(100)),
            allocated,
        };
        let (client, node, token) = (
            self.client.clone(),
            self.config.node_name.clone(),
            self.token.clone(),
        );
        tasks.spawn("kubelet PodResources check", async move {
            checker.run(client, node, token).await;
            Ok(())
        });
    }

    /// Applies the backend's health reports to the inventory ([`node::watch_health`]).
    fn gpu_health(&self, tasks: &mut Tasks) {
        let (backend, inventory, metrics, token) = (
            self.backend.clone(),
            self.inventory.clone(),
            self.metrics.clone(),
            self.token.clone(),
        );
        tasks.spawn("GPU health", async move {
            Ok(node::watch_health(backend, inventory, metrics, token).await?)
        });
    }

    /// Tells the pods of a GPU that turned unhealthy ([`gpu_health`]).
    fn unhealthy_gpu_reporter(&self, tasks: &mut Tasks, pods: Arc<PodCache>) {
        let reporter = gpu_health::HealthReporter {
            client: self.client.clone(),
            node: self.config.node_name.clone(),
            pods,
            metrics: self.metrics.clone(),
            condition: format!("{}/GpuHealthy", self.config.domain),
            evict: self.config.evict_on_unhealthy,
        };
        let (rx, token) = (self.inventory.subscribe(), self.token.clone());
        tasks.spawn("unhealthy GPU reporter", async move {
            reporter.run(rx, token).await;
            Ok(())
        });
    }

    /// Keeps the node's inventory annotation and labels up to date ([`node::publish`]).
    fn inventory_publisher(&self, tasks: &mut Tasks) {
        let (client, node, keys, rx, serving, metrics, token) = (
            self.client.clone(),
            self.config.node_name.clone(),
            self.keys.clone(),
            self.inventory.subscribe(),
            self.ready.clone(),
            self.metrics.clone(),
            self.token.clone(),
        );
        tasks.spawn("inventory publisher", async move {
            node::publish(client, node, keys, rx, serving, metrics, token).await;
            Ok(())
        });
    }

    /// Serves `/healthz`, `/readyz` and `/metrics` on `listener`.
    fn metrics_server(
        &self,
        tasks: &mut Tasks,
        listener: tokio::net::TcpListener,
        registry: Registry,
    ) {
        let (addr, ready, token) = (
            self.config.metrics_listen,
            self.ready.clone(),
            self.token.clone(),
        );
        tasks.spawn("metrics server", async move {
            metrics::serve(listener, Arc::new(registry), ready, token)
                .await
                .map_err(|source| Error::MetricsBind { addr, source })
        });
    }

    /// Reads what each container's interposer counted ([`isolation_usage`]).
    fn isolation_reader(
        &self,
        tasks: &mut Tasks,
        pods: Arc<PodCache>,
        isolation: &service::Isolation,
    ) {
        let reader = isolation_usage::IsolationReader {
            host_dir: isolation.host_dir.clone(),
            metrics: self.metrics.clone(),
            pods,
            inventory: self.inventory.clone(),
            period: ISOLATION_READ_PERIOD,
        };
        let token = self.token.clone();
        tasks.spawn("isolation usage reader", async move {
            reader.run(token).await;
            Ok(())
        });
    }

    /// Measures what each pod really uses ([`usage`]): the backend's process lists
    /// (`--usage-period-ms` above 0), with what the interposer counted beside them
    /// (`--enforcement preload`), or what the interposer counted alone; pods over their
    /// share are told and, with `--over-share evict`, evicted ([`over_share`]).
    fn usage_reader(&self, tasks: &mut Tasks, pods: Arc<PodCache>) {
        let config = &self.config;
        let interposer = self.isolation.as_ref().map(|i| i.host_dir.clone());
        let period = match (&interposer, config.usage_period_ms) {
            (Some(_), 0) => ISOLATION_READ_PERIOD,
            (_, ms) => Duration::from_millis(ms.max(100)),
        };
        let reader = usage::UsageReader {
            interposer,
            driver: config.usage_period_ms > 0,
            over_share: over_share::Policy {
                mode: config.over_share,
                grace: Duration::from_secs(config.over_share_grace_seconds),
            },
            backend: self.backend.clone(),
            socket: config.pod_resources_socket.clone(),
            resource: config.resource.clone(),
            pods,
            inventory: self.inventory.clone(),
            metrics: self.metrics.clone(),
            proc_root: config.proc_root.clone(),
            period,
            publish: usage::PublishPolicy {
                key: self.keys.node_usage.clone(),
                min_change_mib: config.usage_annotation_min_change_mib,
                min_interval: Duration::from_millis(config.usage_annotation_min_interval_ms),
            },
        };
        let (client, node, token) = (
            self.client.clone(),
            config.node_name.clone(),
            self.token.clone(),
        );
        tasks.spawn("GPU memory use", async move {
            reader.run(client, node, token).await;
            Ok(())
        });
    }
}

/// Re-reads the keyring file every [`KEYRING_POLL`] until `token` is cancelled, so a
/// Secret update (key rotation) applies without a restart. A file that became unreadable or
/// malformed is reported once and the keys in use stay.
async fn watch_keyring(mut file: KeyringFile, token: CancellationToken) -> Result<()> {
    let mut tick = tokio::time::interval(KEYRING_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = token.cancelled() => return Ok(()),
            _ = tick.tick() => {}
        }
        file.reload_logged();
    }
}

/// Runs the plugin's `tasks` until `shutdown`, as every gpushare binary runs its own
/// ([`gpushare_runtime::TaskSet`]): the first to end, fail or panic before it stops the
/// plugin, logged with its name; a task that fails hands its own error up. Then every task
/// is told to stop (`token`) and waited for, so the server removes its socket; their errors
/// on the way out are logged, not returned.
async fn supervise(
    mut tasks: Tasks,
    shutdown: impl Future<Output = ()>,
    token: CancellationToken,
) -> Result<()> {
    let outcome = tasks.until_shutdown(shutdown).await;
    token.cancel();
    for (task, ended) in tasks.join_all().await {
        if let Ok(Err(error)) = ended {
            tracing::warn!(task, %error, "task failed during shutdown");
        }
    }
    outcome
}

#[cfg(test)]
mod tests {
    use gpushare_runtime::TaskStopped;

    use super::*;

    /// A task that runs until it is told to stop, then reports it did.
    fn stops_on(token: &CancellationToken, stopped: tokio::sync::oneshot::Sender<()>) -> Tasks {
        let mut tasks = Tasks::default();
        let token = token.clone();
        tasks.spawn("server", async move {
            token.cancelled().await;
            let _ = stopped.send(());
            Ok(())
        });
        tasks
    }

    /// The supervisor's reasons become the plugin's errors: a long-lived task that ends
    /// before shutdown (a pod watch gone quiet would leave Allocate answering from a frozen
    /// view) is named, and the others are stopped and waited for; one that panics is named
    /// as crashed; one that fails hands its own error up.
    #[tokio::test]
    async fn a_task_that_ends_before_shutdown_stops_the_plugin() {
        let token = CancellationToken::new();
        let (stopped, server_stopped) = tokio::sync::oneshot::channel();
        let mut tasks = stops_on(&token, stopped);
        tasks.spawn("pod watch", async { Ok(()) });
        let outcome = supervise(tasks, std::future::pending(), token).await;
        assert!(
            matches!(outcome, Err(Error::Task(TaskStopped::Ended("pod watch")))),
            "{outcome:?}"
        );
        assert_eq!(server_stopped.await, Ok(()), "the server was stopped");

        let mut tasks = Tasks::default();
        tasks.spawn("GPU memory use", async { panic!("the usage reader broke") });
        let outcome = supervise(tasks, std::future::pending(), CancellationToken::new()).await;
        assert!(
            matches!(
                outcome,
                Err(Error::Task(TaskStopped::Crashed {
                    task: "GPU memory use",
                    ..
                }))
            ),
            "{outcome:?}"
        );

        let mut tasks = Tasks::default();
        tasks.spawn("keyring", async {
            Err(Error::Task(TaskStopped::Ended("inner")))
        });
        let outcome = supervise(tasks, std::future::pending(), CancellationToken::new()).await;
        assert!(
            matches!(outcome, Err(Error::Task(TaskStopped::Ended("inner")))),
            "{outcome:?}"
        );
    }

    /// Shutdown is a clean end, and every task is told to stop and waited for before the
    /// plugin returns.
    #[tokio::test]
    async fn shutdown_stops_every_task_and_waits_for_it() {
        let token = CancellationToken::new();
        let (stopped, mut server_stopped) = tokio::sync::oneshot::channel();
        let tasks = stops_on(&token, stopped);
        let outcome = supervise(tasks, std::future::ready(()), token).await;
        assert!(outcome.is_ok(), "{outcome:?}");
        assert_eq!(server_stopped.try_recv(), Ok(()));
    }
}
