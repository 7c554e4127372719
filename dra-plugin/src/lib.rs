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
    /// The GPU health watch ended before shutdown: unhealthy GPUs would no longer be tainted
    /// in the slice, so the plugin stops rather than publish a health it no longer watches.
    #[error("the GPU health watch ended before shutdown: {0}")]
    HealthEnded(String),
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

type JoinResult =
    std::result::Result<std::result::Result<(), tonic::transport::Error>, tokio::task::JoinError>;

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
    let mut servers = Servers::start(&config, gpus.clone(), client, checkpoint, probes, &stop)?;
    // Health changes re-publish the slice from now on (the servers are up: nothing below
    // can fail before the task is stopped and awaited).
    let mut health = tokio::spawn(
        health::Health {
            backend,
            slices,
            node: config.node_name.clone(),
            driver: config.driver_name.clone(),
            gpus,
        }
        .run(stop.clone()),
    );
    tracing::info!(dra = %servers.dra.socket.display(), registration = %servers.registration.socket.display(), probes = %servers.probe_addr, "serving");

    let outcome = tokio::select! {
        outcome = servers.until_one_ends(shutdown) => outcome,
        ended = &mut health => Err(Error::HealthEnded(match ended {
            Ok(()) => "it returned".to_owned(),
            Err(join) => join.to_string(),
        })),
    };
    if let Err(error) = &outcome {
        tracing::error!(%error, "stopping");
    }
    stop.cancel();
    if !health.is_finished() {
        let _ = health.await;
    }
    servers.stop().await;
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

/// One of the plugin's servers, named in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Which {
    Dra,
    Registration,
    Probes,
}

/// A gRPC server on a unix socket.
struct GrpcServer {
    /// The socket's path.
    socket: PathBuf,
    /// The socket file, removed when the server stops (unless a successor's replaced it).
    file: BoundSocket,
    task: tokio::task::JoinHandle<std::result::Result<(), tonic::transport::Error>>,
}

/// The plugin's servers, from their start until they are stopped.
struct Servers {
    dra: GrpcServer,
    registration: GrpcServer,
    probes: tokio::task::JoinHandle<std::io::Result<()>>,
    probe_addr: SocketAddr,
    /// The server that ended first (already awaited), if one did.
    ended: Option<Which>,
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
    }))
}

impl Servers {
    /// Serves the DRA socket, then the registration socket, then the probes on `probes`
    /// (a listener and the address it is bound to); all stop on `stop`.
    fn start(
        config: &Config,
        gpus: Vec<GpuInfo>,
        client: kube::Client,
        checkpoint: checkpoint::Checkpoint,
        (probe_listener, probe_addr): (tokio::net::TcpListener, SocketAddr),
        stop: &CancellationToken,
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
        let (dra_listener, dra_file) = bind(&dra_socket)?;
        // Both servers read through `authority::unix_incoming`: kubelet may send the socket
        // path as `:authority`, which h2 would reset the call for.
        let dra = tokio::spawn(
            Server::builder()
                .add_service(DraPluginServer::new(service::DraService::new(
                    node, client, checkpoint,
                )))
                .serve_with_incoming_shutdown(
                    authority::unix_incoming(dra_listener),
                    stop.clone().cancelled_owned(),
                ),
        );
        let registration_socket = config.registration_socket();
        let (registration_listener, registration_file) = bind(&registration_socket)?;
        let (registered, registration_state) =
            tokio::sync::watch::channel(service::RegistrationState::default());
        let registration = tokio::spawn(
            Server::builder()
                .add_service(RegistrationServer::new(service::RegistrationService::new(
                    config.driver_name.clone(),
                    dra_socket.clone(),
                    registered,
                )))
                .serve_with_incoming_shutdown(
                    authority::unix_incoming(registration_listener),
                    stop.clone().cancelled_owned(),
                ),
        );
        let probes = tokio::spawn(probes::serve(
            probe_listener,
            registration_state,
            stop.clone(),
        ));
        Ok(Self {
            dra: GrpcServer {
                socket: dra_socket,
                file: dra_file,
                task: dra,
            },
            registration: GrpcServer {
                socket: registration_socket,
                file: registration_file,
                task: registration,
            },
            probes,
            probe_addr,
            ended: None,
        })
    }

    /// Waits for `shutdown`, or for a server to end: before shutdown, that is a failure,
    /// and the plugin ends loudly (its DaemonSet restarts it).
    async fn until_one_ends(&mut self, shutdown: impl Future<Output = ()>) -> Result<()> {
        let ended = |which: &'static str, path: &Path, result: JoinResult| -> Error {
            match result {
                Ok(Err(source)) => Error::Serve { which, source },
                Ok(Ok(())) => {
                    io(path)(std::io::Error::other(format!("the {which} server stopped")))
                }
                Err(join) => io(path)(std::io::Error::other(join)),
            }
        };
        let (which, error) = tokio::select! {
            () = shutdown => return Ok(()),
            result = &mut self.dra.task => {
                (Which::Dra, ended("DRA", &self.dra.socket, result))
            }
            result = &mut self.registration.task => {
                (Which::Registration, ended("registration", &self.registration.socket, result))
            }
            result = &mut self.probes => {
                let source = match result {
                    Ok(Err(source)) => source,
                    Ok(Ok(())) => std::io::Error::other("it stopped"),
                    Err(join) => std::io::Error::other(join),
                };
                (Which::Probes, Error::Probes { addr: self.probe_addr, source })
            }
        };
        self.ended = Some(which);
        Err(error)
    }

    /// Removes the sockets and waits for the servers to end (`stop` must be cancelled).
    async fn stop(self) {
        // Registration socket first: kubelet must stop finding us before the DRA socket goes.
        // A successor's files at the same paths stay.
        for file in [&self.registration.file, &self.dra.file] {
            if let Err(err) = file.remove() {
                tracing::warn!(path = %file.path().display(), error = %err, "cannot remove our socket");
            }
        }
        for (server, which) in [
            (self.dra.task, Which::Dra),
            (self.registration.task, Which::Registration),
        ] {
            if self.ended == Some(which) {
                continue;
            }
            if let Ok(Err(err)) = server.await {
                tracing::warn!(error = %err, "a gRPC server ended with an error on shutdown");
            }
        }
        if self.ended != Some(Which::Probes)
            && let Ok(Err(err)) = self.probes.await
        {
            tracing::warn!(error = %err, "the probe server ended with an error on shutdown");
        }
    }
}
