//! The HTTP accept loop. Not `axum::serve`: connections here are owned by a `JoinSet`, so
//! dropping the server (a test "killing" the extender) ends every connection with it, and a
//! shutdown lets in-flight requests finish before closing. With a certificate and key the
//! same loop serves HTTPS (rustls; the handshake runs in the connection's task, so a slow
//! client cannot stall the accept loop).
//!
//! A replica cut off from the API server lets go of kube-scheduler's connections. Over
//! HTTPS, kube-scheduler speaks HTTP/2 and sends every call down one long-lived connection;
//! a Service routes a connection, not a call, so that connection would pin the scheduler to a
//! replica that can no longer bind (its lease is stale, it cannot reach the leader to forward)
//! for as long as the partition lasts, readiness probes or not: taking a pod out of the
//! endpoints does not end connections already made. So while [`Leadership::reaches_api`] is
//! false, every connection is asked to close gracefully (HTTP/2 GOAWAY: calls under way
//! finish, new ones go to a new connection), and the scheduler dials again, reaching a replica
//! that can serve.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_util::sync::CancellationToken;

use gpushare_admission::tls::HANDSHAKE_TIMEOUT;

use crate::leader::Leadership;

/// Why the TLS configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// the file
        path: String,
        /// the cause
        #[source]
        source: std::io::Error,
    },
    /// A file is not the PEM expected.
    #[error("{path} holds no usable PEM {what}: {detail}")]
    Pem {
        /// the file
        path: String,
        /// certificate or private key
        what: &'static str,
        /// the parser's complaint
        detail: String,
    },
    /// rustls refused the certificate and key.
    #[error("certificate and key do not make a TLS configuration: {0}")]
    Config(#[source] rustls::Error),
}

/// Loads a PEM certificate chain and private key into a TLS acceptor (HTTP/2 and HTTP/1.1).
pub fn tls_acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, TlsError> {
    let read = |path: &Path| {
        std::fs::read(path).map_err(|source| TlsError::Read {
            path: path.display().to_string(),
            source,
        })
    };
    let pem_error = |path: &Path, what, detail: String| TlsError::Pem {
        path: path.display().to_string(),
        what,
        detail,
    };
    let cert_pem = read(cert)?;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| pem_error(cert, "certificate", e.to_string()))?;
    if certs.is_empty() {
        return Err(pem_error(
            cert,
            "certificate",
            "no CERTIFICATE block".to_owned(),
        ));
    }
    let key_pem = read(key)?;
    let key_der = PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|e| pem_error(key, "private key", e.to_string()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Config)?
        .with_no_client_auth()
        .with_single_cert(certs, key_der)
        .map_err(TlsError::Config)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// How long a shutdown waits for in-flight requests.
const DRAIN: Duration = Duration::from_secs(10);

/// How often the accept loop checks whether this replica still reaches the API server.
const CUT_OFF_CHECK: Duration = Duration::from_millis(250);

/// Serves `app` on `listener` (over TLS when `tls` is given) until `stop` is cancelled,
/// then drains. With `leadership`, connections are let go while the replica is cut off from
/// the API server (see the module docs).
pub async fn serve_http(
    listener: TcpListener,
    app: Router,
    tls: Option<TlsAcceptor>,
    stop: CancellationToken,
    leadership: Option<Leadership>,
) {
    let mut graceful = GracefulShutdown::new();
    let mut check = tokio::time::interval(CUT_OFF_CHECK);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut was_cut_off = false;
    let builder = Builder::new(TokioExecutor::new());
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let service = TowerToHyperService::new(app.clone());
                match &tls {
                    None => {
                        let connection = builder
                            .serve_connection(TokioIo::new(stream), service)
                            .into_owned();
                        let connection = graceful.watch(connection);
                        connections.spawn(async move {
                            if let Err(error) = connection.await {
                                tracing::debug!(%peer, %error, "connection ended with an error");
                            }
                        });
                    }
                    Some(acceptor) => {
                        let (acceptor, builder) = (acceptor.clone(), builder.clone());
                        let watcher = graceful.watcher();
                        connections.spawn(async move {
                            let handshake =
                                tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream));
                            let stream = match handshake.await {
                                Ok(Ok(stream)) => stream,
                                Ok(Err(error)) => {
                                    tracing::debug!(%peer, %error, "TLS handshake failed");
                                    return;
                                }
                                Err(_) => {
                                    tracing::debug!(%peer, "TLS handshake timed out");
                                    return;
                                }
                            };
                            let connection = builder
                                .serve_connection(TokioIo::new(stream), service)
                                .into_owned();
                            if let Err(error) = watcher.watch(connection).await {
                                tracing::debug!(%peer, %error, "connection ended with an error");
                            }
                        });
                    }
                }
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            _ = check.tick(), if leadership.is_some() => {
                let cut_off = leadership.as_ref().is_some_and(|l| !l.reaches_api());
                if cut_off && !was_cut_off {
                    tracing::warn!("cut off from the API server: closing the scheduler's connections so it dials a replica that can bind");
                }
                was_cut_off = cut_off;
                // Every connection made so far closes gracefully; later ones are watched
                // afresh and let go at a later check if the replica is still cut off.
                if cut_off && graceful.count() > 0 {
                    let closing = std::mem::replace(&mut graceful, GracefulShutdown::new());
                    connections.spawn(closing.shutdown());
                }
            }
        }
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(DRAIN) => tracing::warn!("requests still in flight after {DRAIN:?}; closing"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_admission::tls::{CertConfig, SelfSignedCa};
    use tokio::io::AsyncReadExt;

    /// A client that connects and never sends its ClientHello is let go once the handshake
    /// timeout passes (paused time: the runtime jumps the clock while everyone waits), rather
    /// than holding a task until shutdown.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_never_finishes_the_handshake_is_let_go() {
        let dir = tempfile::tempdir().unwrap();
        let ca =
            SelfSignedCa::generate(&CertConfig::new("gpushare-extender", "kube-system")).unwrap();
        ca.write_pem_files(dir.path()).unwrap();
        let acceptor =
            tls_acceptor(&dir.path().join("tls.crt"), &dir.path().join("tls.key")).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let server = tokio::spawn(serve_http(
            listener,
            Router::new(),
            Some(acceptor),
            stop.clone(),
            None,
        ));
        let mut idle = tokio::net::TcpStream::connect(addr).await.unwrap();
        let started = tokio::time::Instant::now();
        let mut buf = [0u8; 16];
        let read = tokio::time::timeout(HANDSHAKE_TIMEOUT * 3, idle.read(&mut buf)).await;
        assert!(
            matches!(read, Ok(Ok(0)) | Ok(Err(_))),
            "the idle connection was still open after {:?}: {read:?}",
            started.elapsed()
        );
        assert!(started.elapsed() >= HANDSHAKE_TIMEOUT);
        stop.cancel();
        server.await.unwrap();
    }
}
