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

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use gpushare_proto::v1beta1::RegisterRequest;
use gpushare_proto::v1beta1::device_plugin_server::DevicePluginServer;
use gpushare_proto::v1beta1::registration_client::RegistrationClient;
use gpushare_proto::{KUBELET_SOCKET, VERSION};
use tokio::net::UnixListener;
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

/// Which file a path currently names: changes when the file is recreated.
fn identity(path: &Path) -> Option<(u64, u64, i64, i64)> {
    std::fs::metadata(path)
        .ok()
        .map(|meta| (meta.dev(), meta.ino(), meta.mtime(), meta.mtime_nsec()))
}

fn remove_socket(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
        Err(err) => {
            tracing::warn!(path = %path.display(), error = %err, "cannot remove old socket")
        }
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
/// `ready` is true while registered.
pub async fn serve_and_register(
    state: Arc<PluginState>,
    dir: PathBuf,
    ready: Arc<AtomicBool>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let socket = dir.join(SOCKET_NAME);
    let kubelet = dir.join(KUBELET_SOCKET);
    while !shutdown.is_cancelled() {
        let generation = shutdown.child_token();
        remove_socket(&socket);
        let listener = UnixListener::bind(&socket).map_err(|source| Error::Socket {
            path: socket.clone(),
            source,
        })?;
        let service = GpuMemService::new(state.clone(), generation.clone());
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
            if identity(&socket).is_none() {
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
            ready.store(true, Ordering::Relaxed);
            state.metrics.registrations.inc();
            tracing::info!(resource = %state.resource, node = %state.node, "registered with kubelet");
            // Watch for a kubelet restart or our socket vanishing.
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => break,
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
                if identity(&socket).is_none() {
                    tracing::info!(socket = %socket.display(), "our socket was removed (kubelet restart?); serving again and re-registering");
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
    remove_socket(&socket);
    tracing::info!("device plugin stopped");
    Ok(())
}
