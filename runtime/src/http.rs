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
    acceptor(cert, key, None)
}

/// As [`tls_acceptor`], and asks each client for a certificate of the CA(s) in `client_ca`.
///
/// A client that presents one signed by another CA fails the handshake; one that presents
/// none is let through, and each of its requests carries [`ClientCertificate::Absent`], so the
/// application answers it (a clear 403, a counted refusal, or a migration grace) rather than
/// a bare TLS alert. Requests over a verified certificate carry
/// [`ClientCertificate::Verified`].
pub fn tls_acceptor_asking_clients(
    cert: &Path,
    key: &Path,
    client_ca: &Path,
) -> Result<TlsAcceptor, TlsError> {
    acceptor(cert, key, Some(client_ca))
}

fn read_pem_file(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.display().to_string(),
        source,
    })
}

fn pem_error(path: &Path, what: &'static str, detail: String) -> TlsError {
    TlsError::Pem {
        path: path.display().to_string(),
        what,
        detail,
    }
}

/// Every certificate in the PEM file at `path`; none is an error.
fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read_pem_file(path)?;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<_, _>>()
        .map_err(|e| pem_error(path, "certificate", e.to_string()))?;
    if certs.is_empty() {
        return Err(pem_error(
            path,
            "certificate",
            "no CERTIFICATE block".to_owned(),
        ));
    }
    Ok(certs)
}

/// A certificate chain and its private key from PEM files: a server's, or the one a client
/// presents (`rustls::ClientConfig`'s `with_client_auth_cert`).
pub fn load_identity(
    cert: &Path,
    key: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
    let certs = certificates(cert)?;
    let key_pem = read_pem_file(key)?;
    let key_der = PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|e| pem_error(key, "private key", e.to_string()))?;
    Ok((certs, key_der))
}

fn acceptor(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<TlsAcceptor, TlsError> {
    let (certs, key_der) = load_identity(cert, key)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Config)?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let mut roots = rustls::RootCertStore::empty();
            for ca in certificates(path)? {
                roots
                    .add(ca)
                    .map_err(|e| pem_error(path, "CA certificate", e.to_string()))?;
            }
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .allow_unauthenticated()
                    .build()
                    .map_err(|e| pem_error(path, "CA certificate", e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(certs, key_der)
        .map_err(TlsError::Config)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// What the client of a TLS connection proved, attached to each of its requests (an
/// `http::Extensions` entry; absent on plain-HTTP servers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientCertificate {
    /// It presented a certificate that chains to the acceptor's client CA.
    Verified,
    /// It presented none.
    Absent,
}

/// Called for each handshake refused because of the client's certificate.
type OnRefused = Arc<dyn Fn() + Send + Sync>;

/// A condition under which every open connection is asked to close (see the module docs).
type LetGo = Arc<dyn Fn() -> bool + Send + Sync>;

/// An HTTP server for one listener: [`Server::new`], options, then [`Server::serve`].
pub struct Server {
    listener: TcpListener,
    app: Router,
    tls: Option<TlsAcceptor>,
    drain: Duration,
    let_go: Option<(LetGo, &'static str)>,
    on_refused: Option<OnRefused>,
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
            on_refused: None,
        }
    }

    /// Calls `refused` for each TLS handshake that fails on the client's certificate (one
    /// not of the client CA, see [`tls_acceptor_asking_clients`]), for a metric.
    pub fn on_refused_handshake(mut self, refused: impl Fn() + Send + Sync + 'static) -> Self {
        self.on_refused = Some(Arc::new(refused));
        self
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
            on_refused,
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
                            None => connections.spawn(connection.serve_stream(stream, watcher, None)),
                            Some(acceptor) => connections.spawn(connection.serve_tls(acceptor.clone(), stream, watcher, on_refused.clone())),
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
        on_refused: Option<OnRefused>,
    ) {
        let peer = self.peer;
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
            Ok(Ok(stream)) => {
                let client = match stream.get_ref().1.peer_certificates() {
                    Some(certs) if !certs.is_empty() => ClientCertificate::Verified,
                    _ => ClientCertificate::Absent,
                };
                self.serve_stream(stream, watcher, Some(client)).await
            }
            Ok(Err(error)) => {
                if refused_for_its_certificate(&error)
                    && let Some(refused) = &on_refused
                {
                    refused();
                }
                tracing::debug!(%peer, %error, "TLS handshake failed")
            }
            Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
        }
    }

    async fn serve_stream<S>(
        self,
        stream: S,
        watcher: hyper_util::server::graceful::Watcher,
        client: Option<ClientCertificate>,
    ) where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let app = match client {
            None => self.app,
            Some(client) => self.app.layer(axum::Extension(client)),
        };
        let service = TowerToHyperService::new(app);
        let connection = self
            .builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        if let Err(error) = watcher.watch(connection).await {
            tracing::debug!(peer = %self.peer, %error, "connection ended with an error");
        }
    }
}

/// Whether a failed handshake failed on the client's certificate (rustls' error, wrapped).
fn refused_for_its_certificate(error: &std::io::Error) -> bool {
    error
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .is_some_and(|e| {
            matches!(
                e,
                rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// How long a test waits for what should come soon: only a hung test reaches it.
    const PATIENCE: Duration = Duration::from_secs(60);

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
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while TcpStream::connect(addr).await.is_ok() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the port still accepts connections {PATIENCE:?} after shutdown"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
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
        // The accept loop looks at the condition every LET_GO_CHECK; PATIENCE only ends a
        // hung test.
        let closed = tokio::time::timeout(PATIENCE, kept.read(&mut buf)).await;
        assert!(
            matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
            "the kept-alive connection was not closed while the let-go condition held: {closed:?}"
        );
        assert!(get(addr).await.ends_with("ok"));
        stop.cancel();
        server.await.unwrap();
    }

    /// A CA that signs client certificates, and one such certificate (PEM cert, PEM key).
    struct ClientCa {
        issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
        pem: String,
    }

    impl ClientCa {
        fn new() -> Self {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut params = rcgen::CertificateParams::new(Vec::new()).unwrap();
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            let pem = params.self_signed(&key).unwrap().pem();
            Self {
                issuer: rcgen::Issuer::new(params, key),
                pem,
            }
        }

        fn client(&self) -> (String, String) {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut params = rcgen::CertificateParams::new(Vec::new()).unwrap();
            params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
            let cert = params.signed_by(&key, &self.issuer).unwrap();
            (cert.pem(), key.serialize_pem())
        }
    }

    /// A TLS exchange of `GET /` trusting `server_pem`, presenting `identity` if any.
    async fn get_over_tls(
        addr: std::net::SocketAddr,
        server_pem: &str,
        identity: Option<(String, String)>,
    ) -> std::io::Result<String> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(server_pem.as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let config = match identity {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain = CertificateDer::pem_slice_iter(cert.as_bytes())
                    .collect::<Result<Vec<_>, _>>()
                    .unwrap();
                let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
                builder.with_client_auth_cert(chain, key).unwrap()
            }
        };
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let stream = TcpStream::connect(addr).await?;
        let mut stream = connector.connect(name, stream).await?;
        stream
            .write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await?;
        Ok(response)
    }

    #[tokio::test]
    async fn requests_say_whether_the_client_proved_a_certificate_of_the_client_ca() {
        let dir = tempfile::tempdir().unwrap();
        let _ = self_signed(dir.path());
        let server_pem = std::fs::read_to_string(dir.path().join("tls.crt")).unwrap();
        let ours = ClientCa::new();
        std::fs::write(dir.path().join("client-ca.crt"), &ours.pem).unwrap();
        let acceptor = tls_acceptor_asking_clients(
            &dir.path().join("tls.crt"),
            &dir.path().join("tls.key"),
            &dir.path().join("client-ca.crt"),
        )
        .unwrap();
        let app = Router::new().route(
            "/",
            axum::routing::get(
                |client: Option<axum::Extension<ClientCertificate>>| async move {
                    format!("{:?}", client.map(|axum::Extension(c)| c))
                },
            ),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = refused.clone();
        let stop = tokio_util::sync::CancellationToken::new();
        let server = tokio::spawn(
            Server::new(listener, app)
                .tls(Some(acceptor))
                .on_refused_handshake(move || {
                    counted.fetch_add(1, Ordering::SeqCst);
                })
                .serve(stop.clone().cancelled_owned()),
        );

        let verified = get_over_tls(addr, &server_pem, Some(ours.client())).await;
        assert!(verified.unwrap().ends_with("Some(Verified)"));
        let absent = get_over_tls(addr, &server_pem, None).await;
        assert!(absent.unwrap().ends_with("Some(Absent)"));
        let foreign = get_over_tls(addr, &server_pem, Some(ClientCa::new().client())).await;
        assert!(
            !foreign.as_deref().unwrap_or("").contains("200 OK"),
            "a certificate of another CA was served: {foreign:?}"
        );
        wait_until("the refused handshake to be counted", || {
            refused.load(Ordering::SeqCst) == 1
        })
        .await;
        stop.cancel();
        server.await.unwrap();
    }

    /// Waits until `condition` holds, checking every 10 ms; fails the test, naming `what`,
    /// after [`PATIENCE`].
    async fn wait_until(what: &str, condition: impl Fn() -> bool) {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while !condition() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out after {PATIENCE:?} waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
