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
//! one device with a consumable `memory` capacity ([`slice`]) and kube-scheduler itself
//! allocates shares of it to ResourceClaims, never more than the GPU holds. What is left for
//! the node is to turn an allocation into what a container sees ([`prepare`], [`cdi`]) and
//! to remember it ([`checkpoint`]). The GPU backends are the device plugin's
//! ([`gpushare_device_plugin::backend`]): one inventory code path for both modes.
//!
//! Health ([`health`]): the backend's health reports (NVML XID events, or the simulated
//! health file) re-publish the slice, where an unhealthy GPU's device carries a `NoSchedule`
//! taint so that no new claim gets it ([`slice`] says why a taint and when a withdrawal).
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

use gpushare_contract::DEFAULT_DOMAIN;
use gpushare_contract::env::Enforcement;
use gpushare_device_plugin::BackendKind;
use gpushare_device_plugin::backend::{
    BackendError, GpuBackend, nvml::NvmlBackend, simulated::SimulatedBackend,
};
use gpushare_proto::DEFAULT_PLUGIN_REGISTRY_DIR;
use gpushare_proto::authority;
use gpushare_proto::dra::v1::dra_plugin_server::DraPluginServer;
use gpushare_proto::pluginregistration::registration_server::RegistrationServer;
use gpushare_proto::socket_file::{self, BoundSocket, Released};
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
    /// How each container's share is enforced, as in the device plugin: `none`, `toolkit`
    /// (`NVIDIA_GPU_MEMORY_LIMIT` for the NVIDIA toolkit's CDI hook) or `mps`.
    #[arg(long, env = "GPUSHARE_ENFORCEMENT", default_value = "none")]
    pub enforcement: Enforcement,
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
    let dra_socket = config.plugin_dir.join(DRA_SOCKET);
    let registration_socket = config.registration_socket();
    let mut shutdown = std::pin::pin!(shutdown);
    tokio::select! {
        () = &mut shutdown => return Ok(()),
        () = wait_for_predecessor([&registration_socket, &dra_socket]) => {}
    }
    let checkpoint_path = config.plugin_dir.join(CHECKPOINT);
    let checkpoint = checkpoint::Checkpoint::load(&checkpoint_path)?;
    // Bound before anything is published or served: a taken port fails the start at once.
    let probe_listener = tokio::net::TcpListener::bind(config.probe_addr)
        .await
        .map_err(|source| Error::ProbeBind {
            addr: config.probe_addr,
            source,
        })?;
    // What was bound (port 0 picks one): the address the logs and errors name.
    let probe_addr = probe_listener
        .local_addr()
        .map_err(|source| Error::ProbeBind {
            addr: config.probe_addr,
            source,
        })?;
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
    let node = Arc::new(service::Node {
        driver: config.driver_name.clone(),
        node: config.node_name.clone(),
        gpus: gpus.clone(),
        cdi_dir: config.cdi_dir.clone(),
        checkpoint_path,
        enforcement: cdi::EnforcementConfig {
            mode: config.enforcement,
            mps_pipe_directory: config.mps_pipe_directory.clone(),
        },
    });
    let (dra_listener, dra_file) = bind(&dra_socket)?;
    // Both servers read through `authority::unix_incoming`: kubelet may send the socket path
    // as `:authority`, which h2 would reset the call for.
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
    let probe_server = tokio::spawn(probes::serve(
        probe_listener,
        registration_state,
        stop.clone(),
    ));
    // Health changes re-publish the slice from now on (the servers are up: nothing below
    // can fail before the task is stopped and awaited).
    let health = tokio::spawn(
        health::Health {
            backend,
            slices,
            node: config.node_name.clone(),
            driver: config.driver_name.clone(),
            gpus,
        }
        .run(stop.clone()),
    );
    tracing::info!(dra = %dra_socket.display(), registration = %registration_socket.display(), probes = %probe_addr, "serving");

    // Either server ending before shutdown is a failure: the plugin ends loudly, and its
    // DaemonSet restarts it.
    let ended = |which: &'static str, path: &Path, result: JoinResult| -> Error {
        match result {
            Ok(Err(source)) => Error::Serve { which, source },
            Ok(Ok(())) => io(path)(std::io::Error::other(format!("the {which} server stopped"))),
            Err(join) => io(path)(std::io::Error::other(join)),
        }
    };
    let (mut dra, mut registration, mut probe_server) = (dra, registration, probe_server);
    let (mut dra_done, mut registration_done, mut probe_server_done) = (false, false, false);
    let outcome = tokio::select! {
        () = &mut shutdown => Ok(()),
        result = &mut dra => {
            dra_done = true;
            Err(ended("DRA", &dra_socket, result))
        }
        result = &mut registration => {
            registration_done = true;
            Err(ended("registration", &registration_socket, result))
        }
        result = &mut probe_server => {
            probe_server_done = true;
            let source = match result {
                Ok(Err(source)) => source,
                Ok(Ok(())) => std::io::Error::other("it stopped"),
                Err(join) => std::io::Error::other(join),
            };
            Err(Error::Probes { addr: probe_addr, source })
        }
    };
    stop.cancel();
    let _ = health.await;
    // Registration socket first: kubelet must stop finding us before the DRA socket goes. A
    // successor's files at the same paths stay.
    for file in [&registration_file, &dra_file] {
        if let Err(err) = file.remove() {
            tracing::warn!(path = %file.path().display(), error = %err, "cannot remove our socket");
        }
    }
    for (handle, done) in [(dra, dra_done), (registration, registration_done)] {
        if done {
            continue;
        }
        if let Ok(Err(err)) = handle.await {
            tracing::warn!(error = %err, "a gRPC server ended with an error on shutdown");
        }
    }
    if !probe_server_done && let Ok(Err(err)) = probe_server.await {
        tracing::warn!(error = %err, "the probe server ended with an error on shutdown");
    }
    tracing::info!("DRA plugin stopped");
    outcome
}
