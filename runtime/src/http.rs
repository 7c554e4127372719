//! The one HTTP(S) accept loop every gpushare server runs: the extender's scheduler and
//! monitor ports, the admission webhook, the plugins' probe and metrics ports.
//!
//! Not `axum::serve`, for three reasons each of those servers needs:
//! - connections are owned by a `JoinSet`, so dropping the server (a test "killing" a
//!   process) ends every connection with it, and a shutdown lets in-flight requests finish
//!   (at most [`Server::drain`]) before closing;
//! - over TLS the handshake runs in the connection's task and is bounded by
//!   [`HANDSHAKE_TIMEOUT`], so a client that connects and never finishes it can neither
//!   stall the accept loop nor hold a task until shutdown;
//! - [`Server::let_go_while`] asks every connection to close gracefully (HTTP/2 GOAWAY: calls
//!   under way finish, new ones need a new connection) while a condition holds. The extender
//!   uses it while cut off from the API server, so kube-scheduler's long-lived HTTP/2
//!   connection does not pin it to a replica that cannot bind.
//!
//! HTTP/1.1 and HTTP/2 are both served (by ALPN over TLS, by preface in clear text).

use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
pub use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// How long a TLS handshake may take before the connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a shutdown waits for in-flight requests by default.
pub const DEFAULT_DRAIN: Duration = Duration::from_secs(10);

/// How often the accept loop evaluates a [`Server::let_go_while`] condition.
const LET_GO_CHECK: Duration = Duration::from_millis(250);

/// How long the accept loop pauses after a failed accept (usually out of file descriptors),
/// instead of spinning.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Why a TLS configuration could not be loaded.
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

/// Loads a PEM certificate chain and private key into a TLS acceptor offering HTTP/2 and
/// HTTP/1.1.
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

/// A condition under which every open connection is asked to close (see the module docs).
type LetGo = Arc<dyn Fn() -> bool + Send + Sync>;

/// An HTTP server for one listener: [`Server::new`], options, then [`Server::serve`].
pub struct Server {
    listener: TcpListener,
    app: Router,
    tls: Option<TlsAcceptor>,
    drain: Duration,
    let_go: Option<(LetGo, &'static str)>,
}

impl Server {
    /// Serves `app` on `listener`, in clear text, draining for [`DEFAULT_DRAIN`].
    pub fn new(listener: TcpListener, app: Router) -> Self {
        Self {
            listener,
            app,
            tls: None,
            drain: DEFAULT_DRAIN,
            let_go: None,
        }
    }

    /// Serves over TLS with this acceptor (its configuration may resolve certificates per
    /// handshake, as the webhook's rotating one does).
    pub fn tls(mut self, acceptor: Option<TlsAcceptor>) -> Self {
        self.tls = acceptor;
        self
    }

    /// How long a shutdown waits for in-flight requests before closing them.
    pub fn drain(mut self, drain: Duration) -> Self {
        self.drain = drain;
        self
    }

    /// While `condition` holds (checked every 250 ms), every connection is asked to close
    /// gracefully; `why` is logged once each time it starts holding.
    pub fn let_go_while(
        mut self,
        condition: impl Fn() -> bool + Send + Sync + 'static,
        why: &'static str,
    ) -> Self {
        self.let_go = Some((Arc::new(condition), why));
        self
    }

    /// Accepts connections until `shutdown` completes, then stops accepting (the port is
    /// released) and lets in-flight requests finish for at most the drain time.
    pub async fn serve(self, shutdown: impl Future<Output = ()> + Send) {
        let Self {
            listener,
            app,
            tls,
            drain,
            let_go,
        } = self;
        let mut graceful = GracefulShutdown::new();
        let mut check = tokio::time::interval(LET_GO_CHECK);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut was_letting_go = false;
        let builder = Builder::new(TokioExecutor::new());
        let mut connections = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        let connection = Connection { builder: builder.clone(), app: app.clone(), peer };
                        let watcher = graceful.watcher();
                        match &tls {
                            None => connections.spawn(connection.serve_stream(stream, watcher)),
                            Some(acceptor) => connections.spawn(connection.serve_tls(acceptor.clone(), stream, watcher)),
                        };
                    }
                    Err(error) => {
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                    }
                },
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
                _ = check.tick(), if let_go.is_some() => {
                    let Some((condition, why)) = &let_go else { continue };
                    let letting_go = condition();
                    if letting_go && !was_letting_go {
                        tracing::warn!("{why}: closing open connections so clients dial again");
                    }
                    was_letting_go = letting_go;
                    // Every connection made so far closes gracefully; later ones are watched
                    // afresh and let go at a later check if the condition still holds.
                    if letting_go && graceful.count() > 0 {
                        let closing = std::mem::replace(&mut graceful, GracefulShutdown::new());
                        connections.spawn(closing.shutdown());
                    }
                }
            }
        }
        drop(listener);
        tokio::select! {
            () = graceful.shutdown() => {}
            () = tokio::time::sleep(drain) => tracing::warn!("requests still in flight after {drain:?}; closing"),
        }
    }
}

/// One accepted connection, served in its own task.
struct Connection {
    builder: Builder<TokioExecutor>,
    app: Router,
    peer: std::net::SocketAddr,
}

impl Connection {
    async fn serve_tls(
        self,
        acceptor: TlsAcceptor,
        stream: TcpStream,
        watcher: hyper_util::server::graceful::Watcher,
    ) {
        let peer = self.peer;
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
            Ok(Ok(stream)) => self.serve_stream(stream, watcher).await,
            Ok(Err(error)) => tracing::debug!(%peer, %error, "TLS handshake failed"),
            Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
        }
    }

    async fn serve_stream<S>(self, stream: S, watcher: hyper_util::server::graceful::Watcher)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let service = TowerToHyperService::new(self.app);
        let connection = self
            .builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        if let Err(error) = watcher.watch(connection).await {
            tracing::debug!(peer = %self.peer, %error, "connection ended with an error");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn self_signed(dir: &Path) -> TlsAcceptor {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        std::fs::write(dir.join("tls.crt"), cert.pem()).unwrap();
        std::fs::write(dir.join("tls.key"), key.serialize_pem()).unwrap();
        tls_acceptor(&dir.join("tls.crt"), &dir.join("tls.key")).unwrap()
    }

    async fn get(addr: std::net::SocketAddr) -> String {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        response
    }

    /// A client that connects and never sends its ClientHello is let go once the handshake
    /// timeout passes (paused time: the runtime jumps the clock while everyone waits), rather
    /// than holding a task until shutdown.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_never_finishes_the_handshake_is_let_go() {
        let dir = tempfile::tempdir().unwrap();
        let acceptor = self_signed(dir.path());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        let server = tokio::spawn(
            Server::new(listener, Router::new())
                .tls(Some(acceptor))
                .serve(stop.clone().cancelled_owned()),
        );
        let mut idle = TcpStream::connect(addr).await.unwrap();
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

    /// Shutdown releases the port at once and lets the request under way finish: the
    /// handler is held until the port refuses connections, then answers.
    #[tokio::test]
    async fn shutdown_releases_the_port_and_finishes_the_request_under_way() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let entered = Arc::new(tokio::sync::Notify::new());
        let release = Arc::new(tokio::sync::Notify::new());
        let (in_handler, held) = (entered.clone(), release.clone());
        let app = Router::new().route(
            "/",
            axum::routing::get(move || {
                let (in_handler, held) = (in_handler.clone(), held.clone());
                async move {
                    in_handler.notify_one();
                    held.notified().await;
                    "slow answer"
                }
            }),
        );
        let stop = tokio_util::sync::CancellationToken::new();
        let server = tokio::spawn(Server::new(listener, app).serve(stop.clone().cancelled_owned()));
        let request = tokio::spawn(get(addr));
        entered.notified().await;
        stop.cancel();
        let mut refused = false;
        for _ in 0..500 {
            if TcpStream::connect(addr).await.is_err() {
                refused = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(refused, "the port still accepts after shutdown");
        release.notify_one();
        let response = request.await.unwrap();
        assert!(response.ends_with("slow answer"), "{response}");
        server.await.unwrap();
    }

    /// While the let-go condition holds, an idle keep-alive connection is closed; a new one
    /// is served.
    #[tokio::test]
    async fn connections_are_let_go_while_the_condition_holds() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut_off = Arc::new(AtomicBool::new(false));
        let condition = cut_off.clone();
        let app = Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let stop = tokio_util::sync::CancellationToken::new();
        let server = tokio::spawn(
            Server::new(listener, app)
                .let_go_while(move || condition.load(Ordering::Relaxed), "test")
                .serve(stop.clone().cancelled_owned()),
        );
        let mut kept = TcpStream::connect(addr).await.unwrap();
        kept.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 256];
        let n = kept.read(&mut buf).await.unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).contains("ok"));
        cut_off.store(true, Ordering::Relaxed);
        let closed = tokio::time::timeout(Duration::from_secs(5), kept.read(&mut buf)).await;
        assert!(
            matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
            "the kept-alive connection stayed open: {closed:?}"
        );
        assert!(get(addr).await.ends_with("ok"));
        stop.cancel();
        server.await.unwrap();
    }
}
