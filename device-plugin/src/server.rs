//! Serving the plugin sockets and staying registered with kubelet: one for the memory
//! resource ([`serve_and_register`]), one for the compute resource ([`serve_compute`],
//! see [`crate::compute`]), each on its own socket with its own registration.
//!
//! ```text
//!   bind <dir>/gpushare-gpu-mem.sock ─▶ serve DevicePlugin ─▶ Register on <dir>/kubelet.sock
//!          ▲                                                        │
//!          └──── restart when kubelet.sock is recreated (kubelet ◀──┘ poll every 500 ms
//!                restarted) or our socket file disappears
//! ```
//!
//! kubelet forgets every plugin when it restarts (and deletes their sockets), so a plugin
//! must notice and register again; it cannot rely on the old connection breaking. Each
//! generation of the socket has its own cancellation token: cancelling it ends that
//! server's ListAndWatch streams so the graceful shutdown completes.
//!
//! A DaemonSet rollout starts the new plugin pod while the old one is still shutting down,
//! and both use the same socket path. So the new plugin waits (at most
//! [`socket_file::PREDECESSOR_WAIT`]) until nothing answers on the path before it takes it
//! over, and a plugin leaving removes the socket file only if it is still the one it bound
//! ([`gpushare_proto::socket_file`]): before, the
//! old plugin's exit deleted its successor's socket, the successor registered a second time,
//! and kubelet (which marks the resource unhealthy when any of its clients ends, even one it
//! replaced) could leave every device unhealthy, refusing the next GPU pod at admission.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use gpushare_proto::socket_file::{self, BoundSocket, FileIdentity, identity};
use gpushare_proto::v1beta1::device_plugin_server::DevicePluginServer;
use gpushare_proto::v1beta1::registration_client::RegistrationClient;
use gpushare_proto::v1beta1::{DevicePluginOptions, RegisterRequest};
use gpushare_proto::{KUBELET_SOCKET, VERSION};
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;
use tonic::transport::server::Router;

use crate::compute::GpuComputeService;
use crate::error::Error;
use crate::metrics::Metrics;
use crate::node::Inventory;
use crate::service::{GpuMemService, PluginState, options};

/// The plugin's socket file name inside the device plugin directory.
pub const SOCKET_NAME: &str = "gpushare-gpu-mem.sock";
/// How often the directory is checked for a kubelet restart.
pub const POLL: Duration = Duration::from_millis(500);
/// How long one registration attempt may take.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(5);
/// Waits (at most [`socket_file::PREDECESSOR_WAIT`], or until `shutdown`) while another
/// process still serves `socket`: a rollout's old pod shutting down.
async fn wait_for_predecessor(socket: &Path, shutdown: &CancellationToken) {
    tokio::select! {
        () = shutdown.cancelled() => {}
        _ = socket_file::wait_for_predecessor(socket) => {}
    }
}

/// Removes our socket file on the way out, unless a successor's replaced it.
fn remove_own_socket(bound: Option<&BoundSocket>) {
    if let Some(bound) = bound
        && let Err(err) = bound.remove()
    {
        tracing::warn!(path = %bound.path().display(), error = %err, "cannot remove our socket");
    }
}

/// A gRPC channel over the unix socket at `path`.
pub use gpushare_proto::connect_unix as connect;

/// Why one registration attempt failed.
#[derive(Debug, thiserror::Error)]
enum RegisterError {
    #[error("cannot connect to kubelet: {0}")]
    Connect(#[from] tonic::transport::Error),
    #[error("kubelet refused the registration: {0}")]
    Refused(#[from] tonic::Status),
    #[error("kubelet did not answer within {REGISTER_TIMEOUT:?}")]
    Timeout,
}

async fn register(kubelet: &Path, endpoint: &Endpoint) -> Result<(), RegisterError> {
    let attempt = async {
        let mut client = RegistrationClient::new(connect(kubelet).await?);
        client
            .register(RegisterRequest {
                version: VERSION.to_owned(),
                endpoint: endpoint.socket_name.to_owned(),
                resource_name: endpoint.resource.clone(),
                options: Some(endpoint.options),
            })
            .await?;
        Ok(())
    };
    tokio::time::timeout(REGISTER_TIMEOUT, attempt)
        .await
        .map_err(|_| RegisterError::Timeout)?
}

/// What one registration with kubelet names: our socket, the resource, the options.
struct Endpoint {
    socket_name: &'static str,
    resource: String,
    options: DevicePluginOptions,
}

/// Builds the gRPC server of one socket generation from its stop token and the notify its
/// streams ring once kubelet has had the list twice.
type MakeRouter = Box<dyn Fn(CancellationToken, Arc<tokio::sync::Notify>) -> Router + Send + Sync>;

/// Serves the memory resource's socket in `dir` and keeps it registered with kubelet until
/// `shutdown`. `ready` is true while registered and kubelet has had the device list twice
/// ([`crate::service::REANNOUNCE_AFTER`]).
pub async fn serve_and_register(
    state: Arc<PluginState>,
    dir: PathBuf,
    ready: Arc<AtomicBool>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let endpoint = Endpoint {
        socket_name: SOCKET_NAME,
        resource: state.resource.clone(),
        options: options(),
    };
    let (node, metrics) = (state.node.clone(), state.metrics.clone());
    let make: MakeRouter = Box::new(move |generation, announced| {
        let service = GpuMemService::new(state.clone(), generation, announced);
        Server::builder().add_service(DevicePluginServer::new(service))
    });
    serve_endpoint(endpoint, make, (node, metrics), dir, ready, shutdown).await
}

/// Serves the compute resource `resource` ([`crate::compute`]) for `inventory`'s GPUs in
/// `dir` and keeps it registered with kubelet until `shutdown`; `ready` as for memory.
pub async fn serve_compute(
    resource: String,
    (node, inventory, metrics): (String, Inventory, Metrics),
    dir: PathBuf,
    ready: Arc<AtomicBool>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let endpoint = Endpoint {
        socket_name: crate::compute::SOCKET_NAME,
        resource,
        options: crate::compute::options(),
    };
    let service_node = node.clone();
    let make: MakeRouter = Box::new(move |generation, announced| {
        let service = GpuComputeService::new(
            service_node.clone(),
            inventory.clone(),
            generation,
            announced,
        );
        Server::builder().add_service(DevicePluginServer::new(service))
    });
    serve_endpoint(endpoint, make, (node, metrics), dir, ready, shutdown).await
}

async fn serve_endpoint(
    endpoint: Endpoint,
    make_router: MakeRouter,
    (node, metrics): (String, Metrics),
    dir: PathBuf,
    ready: Arc<AtomicBool>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let plugin = Plugin {
        socket: dir.join(endpoint.socket_name),
        kubelet: dir.join(KUBELET_SOCKET),
        endpoint,
        make_router,
        node,
        metrics,
        ready,
        shutdown,
    };
    let mut bound = None;
    while !plugin.shutdown.is_cancelled() {
        wait_for_predecessor(&plugin.socket, &plugin.shutdown).await;
        if plugin.shutdown.is_cancelled() {
            break;
        }
        bound = Some(plugin.serve_generation().await?);
    }
    remove_own_socket(bound.as_ref());
    tracing::info!(resource = %plugin.endpoint.resource, "device plugin stopped");
    Ok(())
}

/// A plugin socket and what serving it needs.
struct Plugin {
    /// Our socket.
    socket: PathBuf,
    /// kubelet's registration socket.
    kubelet: PathBuf,
    endpoint: Endpoint,
    make_router: MakeRouter,
    node: String,
    metrics: Metrics,
    ready: Arc<AtomicBool>,
    shutdown: CancellationToken,
}

/// The server of one generation of the socket.
type ServerTask = tokio::task::JoinHandle<Result<(), tonic::transport::Error>>;

impl Plugin {
    /// One generation: binds the socket, serves it, registers, and watches until kubelet
    /// restarts, the socket vanishes, the server ends or shutdown; then stops this
    /// generation's server. Returns the socket file it bound.
    async fn serve_generation(&self) -> Result<BoundSocket, Error> {
        let generation = self.shutdown.child_token();
        let (listener, socket_file) =
            BoundSocket::bind(&self.socket).map_err(|source| Error::Socket {
                path: self.socket.clone(),
                source,
            })?;
        let announced = Arc::new(tokio::sync::Notify::new());
        let mut server = tokio::spawn(
            (self.make_router)(generation.clone(), announced.clone()).serve_with_incoming_shutdown(
                UnixListenerStream::new(listener),
                generation.clone().cancelled_owned(),
            ),
        );
        let mut server_done = false;
        tracing::info!(socket = %self.socket.display(), "serving the device plugin API");

        if let Some(kubelet_id) = self.register_until_answered(&socket_file).await {
            self.metrics.registrations.inc();
            tracing::info!(resource = %self.endpoint.resource, node = %self.node, "registered with kubelet");
            server_done = self
                .watch(kubelet_id, &socket_file, &announced, &mut server)
                .await;
            self.ready.store(false, Ordering::Relaxed);
        }

        generation.cancel();
        if !server_done {
            match server.await {
                Ok(Err(err)) => {
                    tracing::warn!(error = %err, "device plugin server ended with an error")
                }
                Err(err) => tracing::warn!(error = %err, "device plugin server crashed"),
                Ok(Ok(())) => {}
            }
        }
        Ok(socket_file)
    }

    /// Registers, retrying every [`POLL`] until kubelet answers; the identity of the
    /// kubelet socket it registered on. `None`: shutdown, or our socket file went away.
    async fn register_until_answered(&self, socket_file: &BoundSocket) -> Option<FileIdentity> {
        let kubelet = &self.kubelet;
        while !self.shutdown.is_cancelled() {
            if !socket_file.in_place() {
                break;
            }
            if let Some(kubelet_id) = identity(kubelet) {
                match register(kubelet, &self.endpoint).await {
                    Ok(()) => return Some(kubelet_id),
                    Err(err) => {
                        tracing::warn!(kubelet = %kubelet.display(), error = %err, "registration failed; retrying")
                    }
                }
            } else {
                tracing::debug!(kubelet = %kubelet.display(), "waiting for kubelet's socket");
            }
            tokio::select! {
                () = self.shutdown.cancelled() => {}
                () = tokio::time::sleep(POLL) => {}
            }
        }
        None
    }

    /// Watches, while registered, for a kubelet restart (its socket recreated), our socket
    /// vanishing, the server ending or shutdown; turns ready once kubelet has the device
    /// list. Returns whether the server ended (so it is not awaited again).
    async fn watch(
        &self,
        kubelet_id: FileIdentity,
        socket_file: &BoundSocket,
        announced: &tokio::sync::Notify,
        server: &mut ServerTask,
    ) -> bool {
        loop {
            tokio::select! {
                () = self.shutdown.cancelled() => return false,
                () = announced.notified(), if !self.ready.load(Ordering::Relaxed) => {
                    self.ready.store(true, Ordering::Relaxed);
                    tracing::info!(resource = %self.endpoint.resource, "kubelet has the device list; ready");
                }
                () = tokio::time::sleep(POLL) => {}
                result = &mut *server => {
                    match result {
                        Ok(Ok(())) => tracing::warn!("device plugin server stopped; restarting"),
                        Ok(Err(err)) => tracing::error!(error = %err, "device plugin server failed; restarting"),
                        Err(err) => tracing::error!(error = %err, "device plugin server crashed; restarting"),
                    }
                    return true;
                }
            }
            if !socket_file.in_place() {
                tracing::info!(socket = %self.socket.display(), "our socket was removed or replaced (kubelet restart?); serving again and re-registering");
                return false;
            }
            let now = identity(&self.kubelet);
            if now.is_some() && now != Some(kubelet_id) {
                tracing::info!("kubelet.sock was recreated (kubelet restarted); re-registering");
                return false;
            }
        }
    }
}
