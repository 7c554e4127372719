//! Serving the plugin socket and staying registered with kubelet.
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

use gpushare_proto::socket_file::{self, BoundSocket, identity};
use gpushare_proto::v1beta1::RegisterRequest;
use gpushare_proto::v1beta1::device_plugin_server::DevicePluginServer;
use gpushare_proto::v1beta1::registration_client::RegistrationClient;
use gpushare_proto::{KUBELET_SOCKET, VERSION};
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;

use crate::Error;
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

async fn register(kubelet: &Path, resource: &str) -> Result<(), RegisterError> {
    let attempt = async {
        let mut client = RegistrationClient::new(connect(kubelet).await?);
        client
            .register(RegisterRequest {
                version: VERSION.to_owned(),
                endpoint: SOCKET_NAME.to_owned(),
                resource_name: resource.to_owned(),
                options: Some(options()),
            })
            .await?;
        Ok(())
    };
    tokio::time::timeout(REGISTER_TIMEOUT, attempt)
        .await
        .map_err(|_| RegisterError::Timeout)?
}

/// Serves the plugin socket in `dir` and keeps it registered with kubelet until `shutdown`.
/// `ready` is true while registered and kubelet has had the device list twice
/// ([`crate::service::REANNOUNCE_AFTER`]).
pub async fn serve_and_register(
    state: Arc<PluginState>,
    dir: PathBuf,
    ready: Arc<AtomicBool>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let socket = dir.join(SOCKET_NAME);
    let kubelet = dir.join(KUBELET_SOCKET);
    let mut bound = None;
    while !shutdown.is_cancelled() {
        let generation = shutdown.child_token();
        wait_for_predecessor(&socket, &shutdown).await;
        if shutdown.is_cancelled() {
            break;
        }
        let (listener, socket_file) =
            BoundSocket::bind(&socket).map_err(|source| Error::Socket {
                path: socket.clone(),
                source,
            })?;
        let announced = Arc::new(tokio::sync::Notify::new());
        let service = GpuMemService::new(state.clone(), generation.clone(), announced.clone());
        let mut server = tokio::spawn(
            Server::builder()
                .add_service(DevicePluginServer::new(service))
                .serve_with_incoming_shutdown(
                    UnixListenerStream::new(listener),
                    generation.clone().cancelled_owned(),
                ),
        );
        let mut server_done = false;
        tracing::info!(socket = %socket.display(), "serving the device plugin API");

        // Register, retrying until kubelet answers.
        let mut registered = None;
        while registered.is_none() && !shutdown.is_cancelled() {
            if !socket_file.in_place() {
                break;
            }
            if let Some(kubelet_id) = identity(&kubelet) {
                match register(&kubelet, &state.resource).await {
                    Ok(()) => {
                        registered = Some(kubelet_id);
                        break;
                    }
                    Err(err) => {
                        tracing::warn!(kubelet = %kubelet.display(), error = %err, "registration failed; retrying")
                    }
                }
            } else {
                tracing::debug!(kubelet = %kubelet.display(), "waiting for kubelet's socket");
            }
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = tokio::time::sleep(POLL) => {}
            }
        }

        if let Some(kubelet_id) = registered {
            state.metrics.registrations.inc();
            tracing::info!(resource = %state.resource, node = %state.node, "registered with kubelet");
            // Watch for a kubelet restart or our socket vanishing.
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = announced.notified(), if !ready.load(Ordering::Relaxed) => {
                        ready.store(true, Ordering::Relaxed);
                        tracing::info!("kubelet has the device list; ready");
                    }
                    () = tokio::time::sleep(POLL) => {}
                    result = &mut server => {
                        server_done = true;
                        match result {
                            Ok(Ok(())) => tracing::warn!("device plugin server stopped; restarting"),
                            Ok(Err(err)) => tracing::error!(error = %err, "device plugin server failed; restarting"),
                            Err(err) => tracing::error!(error = %err, "device plugin server crashed; restarting"),
                        }
                        break;
                    }
                }
                if !socket_file.in_place() {
                    tracing::info!(socket = %socket.display(), "our socket was removed or replaced (kubelet restart?); serving again and re-registering");
                    break;
                }
                let now = identity(&kubelet);
                if now.is_some() && now != Some(kubelet_id) {
                    tracing::info!(
                        "kubelet.sock was recreated (kubelet restarted); re-registering"
                    );
                    break;
                }
            }
            ready.store(false, Ordering::Relaxed);
        }

        generation.cancel();
        bound = Some(socket_file);
        if !server_done {
            match server.await {
                Ok(Err(err)) => {
                    tracing::warn!(error = %err, "device plugin server ended with an error")
                }
                Err(err) => tracing::warn!(error = %err, "device plugin server crashed"),
                Ok(Ok(())) => {}
            }
        }
    }
    remove_own_socket(bound.as_ref());
    tracing::info!("device plugin stopped");
    Ok(())
}
