//! gpushare's DRA kubelet plugin: the same GPU-memory sharing as the device plugin, for
//! clusters that allocate devices with Dynamic Resource Allocation.
//!
//! ```text
//!              ┌──────────────────── gpushare-dra-plugin ─────────────────────┐
//!   NVML / sim │ backend ──▶ GPUs ──▶ slice::publish ─────────────────────────┼──▶ ResourceSlice (scheduler reads,
//!              │                                                              │    allocates memory shares itself)
//!   kubelet ──▶│ <registry>/<driver>-reg.sock   Registration: DRAPlugin, v1   │
//!   (gRPC)  ──▶│ <plugin dir>/dra.sock          NodePrepareResources ─────────┼──▶ GET ResourceClaim (allocation)
//!              │                                  │ prepare::plan            │
//!              │                                  ├─▶ CDI spec (<cdi>/…json) │    env NVIDIA_VISIBLE_DEVICES,
//!              │                                  └─▶ checkpoint.json        │        GPUSHARE_*
//!              │                                NodeUnprepareResources       │
//!              └──────────────────────────────────────────────────────────────┘
//! ```
//!
//! In DRA mode nothing of gpushare sits on the scheduling path: each GPU is published as
//! one device with a consumable `memory` capacity ([`mod@slice`]) and kube-scheduler itself
//! allocates shares of it to ResourceClaims, never more than the GPU holds. What is left for
//! the node is to turn an allocation into what a container sees ([`prepare`], [`cdi`]) and
//! to remember it ([`checkpoint`]). The GPU backends are the device plugin's
//! ([`gpushare_runtime::gpu`]): one inventory code path for both modes.
//!
//! Health ([`health`]): the backend's health reports (NVML XID events, or the simulated
//! health file) re-publish the slice, where an unhealthy GPU's device carries a `NoSchedule`
//! taint so that no new claim gets it ([`mod@slice`] says why a taint and when a withdrawal).
//!
//! Probes ([`probes`]): `/healthz`, and `/readyz` that turns ready only once kubelet has
//! reported the registration successful, so that a rollout waits for kubelet rather than for
//! the process.
//!
//! The servers and the health watch run in one [`gpushare_runtime::TaskSet`], as the
//! extender's and the device plugin's tasks do: the first to end, fail or panic before
//! shutdown is logged by name and ends the plugin (its DaemonSet restarts it). Shutdown
//! stops the health watch first, then removes the sockets (registration first), then waits
//! for the servers.
//!
//! Not done yet: metrics.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpushare_contract::env::Enforcement;
use gpushare_contract::{DEFAULT_DOMAIN, GpuInfo};
use gpushare_proto::DEFAULT_PLUGIN_REGISTRY_DIR;
use gpushare_proto::authority;
use gpushare_proto::dra::v1::dra_plugin_server::DraPluginServer;
use gpushare_proto::pluginregistration::registration_server::RegistrationServer;
use gpushare_proto::socket_file::{self, BoundSocket, Released};
use gpushare_runtime::TaskSet;
use gpushare_runtime::gpu::BackendKind;
use gpushare_runtime::gpu::{
    BackendError, GpuBackend, nvml::NvmlBackend, simulated::SimulatedBackend,
};
use k8s_openapi::api::resource::v1::ResourceSlice;
use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;

pub mod cdi;
pub mod checkpoint;
pub mod health;
pub mod prepare;
pub mod probes;
pub use gpushare_contract::quantity;
pub mod service;
pub mod slice;

pub use gpushare_runtime::LogFormat;

/// The names this plugin's variables had before the `GPUSHARE_*` scheme: still read, with a
/// warning ([`gpushare_runtime::env::with_legacy_env`]).
pub const LEGACY_ENV: &[&str] = &[
    "CDI_DIR",
    "DRA_DRIVER_NAME",
    "DRA_PLUGIN_DIR",
    "GPU_BACKEND",
    "LOG_FORMAT",
    "NODE_NAME",
    "PLUGIN_REGISTRY_DIR",
    "PROBE_ADDR",
    "SIMULATE_GPUS",
    "SIMULATE_HEALTH_FILE",
];

/// The DRA socket's file name inside the plugin directory.
pub const DRA_SOCKET: &str = "dra.sock";
/// The checkpoint's file name inside the plugin directory.
pub const CHECKPOINT: &str = "checkpoint.json";

/// Command line and environment configuration.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "gpushare-dra-plugin", version, about)]
pub struct Config {
    /// The node this plugin runs on (usually from the downward API).
    #[arg(long, env = "GPUSHARE_NODE_NAME")]
    pub node_name: String,
    /// This plugin's DaemonSet: watched, so that a plugin stopping after it was deleted
    /// removes its isolation files (an uninstall).
    #[command(flatten)]
    pub own_daemon_set: gpushare_runtime::uninstall::OwnDaemonSet,
    /// The DRA driver name: DeviceClasses select it, allocations name it, and it is the
    /// vendor of the CDI devices.
    #[arg(long, env = "GPUSHARE_DRA_DRIVER_NAME", default_value = DEFAULT_DOMAIN)]
    pub driver_name: String,
    /// The plugin's own directory: holds the DRA socket and the checkpoint.
    #[arg(
        long,
        env = "GPUSHARE_DRA_PLUGIN_DIR",
        default_value = "/var/lib/kubelet/plugins/gpushare.example.com"
    )]
    pub plugin_dir: PathBuf,
    /// kubelet's plugin registry directory, watched by kubelet for registration sockets.
    #[arg(long, env = "GPUSHARE_PLUGIN_REGISTRY_DIR", default_value = DEFAULT_PLUGIN_REGISTRY_DIR)]
    pub registry_dir: PathBuf,
    /// Where the container runtime reads CDI specs.
    #[arg(long, env = "GPUSHARE_CDI_DIR", default_value = "/var/run/cdi")]
    pub cdi_dir: PathBuf,
    /// Where GPUs come from.
    #[arg(long, env = "GPUSHARE_GPU_BACKEND", value_enum, default_value_t = BackendKind::Nvml)]
    pub gpu_backend: BackendKind,
    /// Sizes in GiB of simulated GPUs, e.g. `16,16,24` (with `--gpu-backend simulated`).
    #[arg(long, env = "GPUSHARE_SIMULATE_GPUS", value_delimiter = ',')]
    pub simulate_gpus: Vec<u64>,
    /// A file listing the indices of unhealthy simulated GPUs, comma-separated (with
    /// `--gpu-backend simulated`); missing or empty: all healthy.
    #[arg(long, env = "GPUSHARE_SIMULATE_HEALTH_FILE")]
    pub simulate_health_file: Option<PathBuf>,
    /// How each container's share is enforced, as in the device plugin: `preload`
    /// (gpushare's interposer, see `isolation/`), `none`, `toolkit`
    /// (`NVIDIA_GPU_MEMORY_LIMIT` for the NVIDIA toolkit's CDI hook) or `mps`.
    #[arg(long, env = "GPUSHARE_ENFORCEMENT", default_value = "none")]
    pub enforcement: Enforcement,
    /// Where the interposer comes from and goes (`--enforcement preload`).
    #[command(flatten)]
    pub isolation: gpushare_runtime::isolation::IsolationArgs,
    /// The MPS control daemon's pipe directory on the host, mounted into containers at the
    /// same path (`--enforcement mps`).
    #[arg(
        long,
        env = "CUDA_MPS_PIPE_DIRECTORY",
        default_value = "/tmp/nvidia-mps"
    )]
    pub mps_pipe_directory: String,
    /// Address of the HTTP probes: `/healthz` (the plugin runs) and `/readyz` (kubelet has
    /// registered it); port 0 picks a free port.
    #[arg(long, env = "GPUSHARE_PROBE_ADDR", default_value = "0.0.0.0:9402")]
    pub probe_addr: SocketAddr,
    /// Log format.
    #[arg(long, env = "GPUSHARE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// Why the plugin stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The GPUs could not be listed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The isolation library could not be installed (`--enforcement preload`).
    #[error(
        "cannot install the isolation library into --isolation-host-dir: {0}; fix the path or run with --enforcement none"
    )]
    Isolation(#[source] std::io::Error),
    /// No Kubernetes client could be built.
    #[error("cannot build a Kubernetes client (in-cluster or KUBECONFIG): {0}")]
    Client(#[source] kube::Error),
    /// The ResourceSlice could not be published.
    #[error(
        "publishing the ResourceSlice of node {node}: {source}; does the plugin's ServiceAccount may create and update resourceslices?"
    )]
    Publish {
        /// the node
        node: String,
        /// the API error
        #[source]
        source: kube::Error,
    },
    /// A directory or socket could not be set up.
    #[error("{path}: {source}")]
    Io {
        /// the path
        path: PathBuf,
        /// the I/O error
        #[source]
        source: std::io::Error,
    },
    /// The checkpoint could not be read.
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    /// A gRPC server failed.
    #[error("the {which} gRPC server failed: {source}")]
    Serve {
        /// which server
        which: &'static str,
        /// the transport error
        #[source]
        source: tonic::transport::Error,
    },
    /// The probe address could not be bound.
    #[error(
        "cannot listen on {addr} for the probes (/healthz, /readyz): {source}; is another process on that port? --probe-addr (PROBE_ADDR) chooses another"
    )]
    ProbeBind {
        /// the address
        addr: SocketAddr,
        /// the cause
        #[source]
        source: std::io::Error,
    },
    /// The probe server stopped before shutdown.
    #[error("the probe server on {addr} failed: {source}")]
    Probes {
        /// the address it listened on
        addr: SocketAddr,
        /// the cause
        #[source]
        source: std::io::Error,
    },
    /// A long-lived task (a server, the GPU health watch) returned or panicked before
    /// shutdown: the plugin stops rather than run with part of it gone (without the health
    /// watch, it would publish a health it no longer watches: unhealthy GPUs would no longer
    /// be tainted in the slice).
    #[error(transparent)]
    Task(#[from] gpushare_runtime::TaskStopped),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Config {
    /// The GPU backend the flags choose.
    pub fn backend(&self) -> Result<Arc<dyn GpuBackend>> {
        Ok(match self.gpu_backend {
            BackendKind::Nvml => Arc::new(NvmlBackend::new()?),
            BackendKind::Simulated => Arc::new(SimulatedBackend::new(
                &self.node_name,
                self.simulate_gpus.clone(),
                self.simulate_health_file.clone(),
            )),
        })
    }

    /// The DRA socket: `<plugin dir>/dra.sock`.
    fn dra_socket(&self) -> PathBuf {
        self.plugin_dir.join(DRA_SOCKET)
    }

    /// The registration socket: `<registry dir>/<driver>-reg.sock`.
    pub fn registration_socket(&self) -> PathBuf {
        self.registry_dir
            .join(format!("{}-reg.sock", self.driver_name))
    }
}

/// The plugin's long-lived tasks, named for the supervisor.
type Tasks = TaskSet<Result<()>>;

/// The health watch's task: stopped first on shutdown, before the sockets go.
const GPU_HEALTH: &str = "GPU health watch";

/// Runs the plugin with a client found the standard way (in-cluster or `KUBECONFIG`)
/// until `shutdown` resolves.
pub async fn run(config: Config, shutdown: impl Future<Output = ()> + Send) -> Result<()> {
    let client = kube::Client::try_default().await.map_err(Error::Client)?;
    run_with_client(config, client, shutdown).await
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_owned(),
        source,
    }
}

/// Waits while another process (a rollout's old pod, still shutting down) serves one of
/// `sockets` ([`socket_file::wait_for_predecessor`]).
async fn wait_for_predecessor(sockets: [&Path; 2]) {
    for socket in sockets {
        if socket_file::wait_for_predecessor(socket).await == Released::StillServed {
            return;
        }
    }
}

fn bind(path: &Path) -> Result<(UnixListener, BoundSocket)> {
    BoundSocket::bind(path).map_err(io(path))
}

/// Runs the plugin against `client` until `shutdown` resolves: publishes the slice, then
/// serves the DRA socket and the registration socket (registration socket last, so kubelet
/// never finds us before we can answer), and the probes beside them. Any server failing
/// ends the plugin.
pub async fn run_with_client(
    config: Config,
    client: kube::Client,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<()> {
    let backend = config.backend()?;
    let gpus = backend.gpus()?;
    tracing::info!(node = %config.node_name, driver = %config.driver_name, gpus = gpus.len(), "starting the DRA plugin");
    for dir in [&config.plugin_dir, &config.registry_dir, &config.cdi_dir] {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
    }
    // A rollout's old pod may still be shutting down: its checkpoint and sockets are ours
    // only once it let go.
    let (dra_socket, registration_socket) = (config.dra_socket(), config.registration_socket());
    let mut shutdown = std::pin::pin!(shutdown);
    tokio::select! {
        () = &mut shutdown => return Ok(()),
        () = wait_for_predecessor([&registration_socket, &dra_socket]) => {}
    }
    let checkpoint = checkpoint::Checkpoint::load(&config.plugin_dir.join(CHECKPOINT))?;
    // Bound before anything is published or served: a taken port fails the start at once.
    let probes = bind_probes(config.probe_addr).await?;
    let slices = kube::Api::<ResourceSlice>::all(client.clone());
    // Every GPU is healthy at start (the backend's contract), so no taint can be dropped yet.
    slice::publish(
        &slices,
        &config.node_name,
        &config.driver_name,
        &gpus,
        slice::Unhealthy::Taint,
    )
    .await
    .map_err(|source| Error::Publish {
        node: config.node_name.clone(),
        source,
    })?;

    let stop = CancellationToken::new();
    let mut tasks = Tasks::default();
    // With isolation, watched from now on: a plugin stopping after its DaemonSet was deleted
    // removes what it installed on the node.
    let uninstall = (config.enforcement == Enforcement::Preload).then(|| {
        gpushare_runtime::uninstall::UninstallWatch::start(client.clone(), &config.own_daemon_set)
    });
    let servers = Servers::start(
        &config,
        gpus.clone(),
        client,
        checkpoint,
        probes,
        &stop,
        &mut tasks,
    )?;
    // Health changes re-publish the slice from now on; its end before shutdown ends the
    // plugin like a server's (`Error::Task` says why).
    let health = health::Health {
        backend,
        slices,
        node: config.node_name.clone(),
        driver: config.driver_name.clone(),
        gpus,
    };
    let health_stop = stop.clone();
    tasks.spawn(GPU_HEALTH, async move {
        health.run(health_stop).await;
        Ok(())
    });
    tracing::info!(dra = %servers.dra.path().display(), registration = %servers.registration.path().display(), probes = %servers.probe_addr, "serving");

    let outcome = tasks.until_shutdown(&mut shutdown).await;
    stop.cancel();
    if let Some(health) = tasks.take(GPU_HEALTH) {
        let _ = health.await;
    }
    servers.stop(tasks).await;
    if let (Ok(()), Some(uninstall)) = (&outcome, uninstall) {
        uninstall.leave_node_if_uninstalled(&config.isolation.isolation_host_dir);
    }
    tracing::info!("DRA plugin stopped");
    outcome
}

/// Binds the probe address; what was bound (port 0 picks one) is the address the logs and
/// errors name.
async fn bind_probes(addr: SocketAddr) -> Result<(tokio::net::TcpListener, SocketAddr)> {
    let bind_error = |source| Error::ProbeBind { addr, source };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(bind_error)?;
    let bound = listener.local_addr().map_err(bind_error)?;
    Ok((listener, bound))
}

/// The plugin's sockets, from the start of its servers until they are stopped (the servers
/// themselves run in the plugin's [`Tasks`]).
struct Servers {
    /// The DRA socket's file, removed on shutdown (unless a successor's replaced it).
    dra: BoundSocket,
    /// The registration socket's file, the same.
    registration: BoundSocket,
    /// Where the probes are served.
    probe_addr: SocketAddr,
}

/// With `--enforcement preload`, installs the interposer from the image into the host
/// directory the CDI specs mount it from.
fn install_isolation(config: &Config) -> Result<Option<cdi::Isolation>> {
    if config.enforcement != Enforcement::Preload {
        return Ok(None);
    }
    let host_dir = config.isolation.isolation_host_dir.clone();
    let library = config.isolation.install().map_err(Error::Isolation)?;
    Ok(Some(cdi::Isolation {
        library,
        host_dir,
        exempt_namespaces: config.isolation.exempt_namespaces(),
        options: config.isolation.options(),
    }))
}

impl Servers {
    /// Serves the DRA socket, then the registration socket, then the probes on `probes`
    /// (a listener and the address it is bound to), in `tasks`; all stop on `stop`.
    fn start(
        config: &Config,
        gpus: Vec<GpuInfo>,
        client: kube::Client,
        checkpoint: checkpoint::Checkpoint,
        (probe_listener, probe_addr): (tokio::net::TcpListener, SocketAddr),
        stop: &CancellationToken,
        tasks: &mut Tasks,
    ) -> Result<Self> {
        let node = Arc::new(service::Node {
            driver: config.driver_name.clone(),
            node: config.node_name.clone(),
            gpus,
            cdi_dir: config.cdi_dir.clone(),
            checkpoint_path: config.plugin_dir.join(CHECKPOINT),
            enforcement: cdi::EnforcementConfig {
                mode: config.enforcement,
                mps_pipe_directory: config.mps_pipe_directory.clone(),
                isolation: install_isolation(config)?,
            },
        });
        let dra_socket = config.dra_socket();
        let (dra_listener, dra) = bind(&dra_socket)?;
        // Both servers read through `authority::unix_incoming`: kubelet may send the socket
        // path as `:authority`, which h2 would reset the call for.
        let serving = Server::builder()
            .add_service(DraPluginServer::new(service::DraService::new(
                node, client, checkpoint,
            )))
            .serve_with_incoming_shutdown(
                authority::unix_incoming(dra_listener),
                stop.clone().cancelled_owned(),
            );
        tasks.spawn("DRA gRPC server", async move {
            serving.await.map_err(|source| Error::Serve {
                which: "DRA",
                source,
            })
        });
        let registration_socket = config.registration_socket();
        let (registration_listener, registration) = bind(&registration_socket)?;
        let (registered, registration_state) =
            tokio::sync::watch::channel(service::RegistrationState::default());
        let serving = Server::builder()
            .add_service(RegistrationServer::new(service::RegistrationService::new(
                config.driver_name.clone(),
                dra_socket,
                registered,
            )))
            .serve_with_incoming_shutdown(
                authority::unix_incoming(registration_listener),
                stop.clone().cancelled_owned(),
            );
        tasks.spawn("registration gRPC server", async move {
            serving.await.map_err(|source| Error::Serve {
                which: "registration",
                source,
            })
        });
        let serving = probes::serve(probe_listener, registration_state, stop.clone());
        tasks.spawn("probe server", async move {
            serving.await.map_err(|source| Error::Probes {
                addr: probe_addr,
                source,
            })
        });
        Ok(Self {
            dra,
            registration,
            probe_addr,
        })
    }

    /// Removes the sockets, then waits for the servers left in `tasks` to end (`stop` must
    /// be cancelled), in the order they were started.
    async fn stop(self, tasks: Tasks) {
        // Registration socket first: kubelet must stop finding us before the DRA socket goes.
        // A successor's files at the same paths stay.
        for file in [&self.registration, &self.dra] {
            if let Err(err) = file.remove() {
                tracing::warn!(path = %file.path().display(), error = %err, "cannot remove our socket");
            }
        }
        for (task, ended) in tasks.join_all().await {
            if let Ok(Err(error)) = ended {
                tracing::warn!(task, %error, "a server ended with an error on shutdown");
            }
        }
    }
}
