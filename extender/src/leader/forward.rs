//! How replicas reach the one that leads: a follower passes kube-scheduler's `bind` on to
//! the leader (the HTTP adapter decides when, with this client), so the scheduler may call any
//! replica behind the Service; and the election probes the Lease holder's address with it. Filter and prioritize are answered by every replica from its
//! own view; only bind books memory, and only the leader binds.
//!
//! ```text
//!  kube-scheduler ──bind──▶ Service ──▶ follower ──POST {prefix}/bind, x-gpushare-forwarded──▶ leader
//!                                         ▲ the leader's URL: an annotation on the Lease
//! ```
//!
//! The call goes over the same TLS kube-scheduler uses, verifying the same Service name with
//! the same CA (the leader's certificate is the Service's), one fresh connection per bind. A
//! forwarded call is never forwarded again: a replica that receives one and does not lead
//! refuses it, and kube-scheduler retries. What the leader answers is relayed as it is.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};

use crate::wire::ExtenderBindingResult;

/// Header marking a bind passed on by a follower.
pub const FORWARDED_HEADER: &str = "x-gpushare-forwarded";

/// Largest answer read from the leader (an `ExtenderBindingResult` is a short message).
const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// Why a bind could not be passed on.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The leader's URL is not `http(s)://host:port`.
    #[error("leader URL {0:?} is not http(s)://host:port")]
    Url(String),
    /// The leader is HTTPS but no CA was configured (`--leader-forward-ca`).
    #[error("leader URL {0} is HTTPS but no --leader-forward-ca is set")]
    NoCa(String),
    /// Connecting, TLS, or the HTTP exchange failed.
    #[error("{0}")]
    Transport(String),
    /// No answer within the timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The leader answered something other than a bind result.
    #[error("unexpected answer: HTTP {status}: {body}")]
    Answer {
        /// HTTP status.
        status: u16,
        /// The start of the body.
        body: String,
    },
    /// The CA file cannot be used.
    #[error("--leader-forward-ca {path}: {detail}")]
    Ca {
        /// The file.
        path: String,
        /// What is wrong.
        detail: String,
    },
    /// The client certificate or key cannot be used (`--leader-forward-cert`/`-key`).
    #[error("--leader-forward-cert/--leader-forward-key: {0}")]
    Identity(String),
}

/// Result of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What the holder's address said when asked who serves there ([`Forwarder::probe`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// Nothing listens there: the connection was refused.
    Refused,
    /// A replica answered with its `holderIdentity`.
    Serves(String),
    /// No proof either way: a timeout, a reset, TLS trouble, a replica without `/identity`.
    Unknown(String),
}

impl Probe {
    /// Whether this answer proves that no process of `holder` is left at its address.
    pub fn holder_is_gone(&self, holder: &str) -> bool {
        match self {
            Probe::Refused => true,
            Probe::Serves(identity) => identity != holder,
            Probe::Unknown(_) => false,
        }
    }
}

/// Passes binds on to the leader.
#[derive(Clone)]
pub struct Forwarder {
    /// `{prefix}/bind`.
    path: String,
    /// `{prefix}/identity`.
    identity_path: String,
    tls: Option<(TlsConnector, ServerName<'static>)>,
}

impl std::fmt::Debug for Forwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarder")
            .field("path", &self.path)
            .field("tls", &self.tls.as_ref().map(|(_, name)| name))
            .finish()
    }
}

impl Forwarder {
    /// A forwarder to `{prefix}/bind`, verifying `server_name` with the CA in `ca` (PEM) for
    /// HTTPS leaders, presenting `identity` (certificate and key files) to leaders that ask
    /// for a client certificate; without a CA only plain-HTTP leaders can be reached.
    pub fn new(
        prefix: &str,
        ca: Option<&std::path::Path>,
        identity: Option<(&std::path::Path, &std::path::Path)>,
        server_name: &str,
    ) -> Result<Self> {
        let prefix = prefix.trim_end_matches('/');
        let prefix = if prefix.is_empty() || prefix.starts_with('/') {
            prefix.to_owned()
        } else {
            format!("/{prefix}")
        };
        let path = format!("{prefix}/bind");
        let identity_path = format!("{prefix}/identity");
        let tls = match ca {
            None => None,
            Some(path) => {
                let ca_error = |detail: String| Error::Ca {
                    path: path.display().to_string(),
                    detail,
                };
                let pem = std::fs::read(path).map_err(|e| ca_error(e.to_string()))?;
                let mut roots = rustls::RootCertStore::empty();
                for cert in CertificateDer::pem_slice_iter(&pem) {
                    let cert = cert.map_err(|e| ca_error(e.to_string()))?;
                    roots.add(cert).map_err(|e| ca_error(e.to_string()))?;
                }
                if roots.is_empty() {
                    return Err(ca_error("no certificate in it".to_owned()));
                }
                let provider = Arc::new(rustls::crypto::ring::default_provider());
                let builder = rustls::ClientConfig::builder_with_provider(provider)
                    .with_safe_default_protocol_versions()
                    .map_err(|e| ca_error(e.to_string()))?
                    .with_root_certificates(roots);
                let config = match identity {
                    None => builder.with_no_client_auth(),
                    Some((cert, key)) => {
                        let (chain, key) = gpushare_runtime::http::load_identity(cert, key)
                            .map_err(|e| Error::Identity(e.to_string()))?;
                        builder
                            .with_client_auth_cert(chain, key)
                            .map_err(|e| Error::Identity(e.to_string()))?
                    }
                };
                let name = ServerName::try_from(server_name.to_owned())
                    .map_err(|e| ca_error(format!("server name {server_name}: {e}")))?;
                Some((TlsConnector::from(Arc::new(config)), name))
            }
        };
        Ok(Self {
            path,
            identity_path,
            tls,
        })
    }

    /// Asks the replica at `url` who it is (`GET {prefix}/identity`), within `timeout`.
    pub async fn probe(&self, url: &str, timeout: Duration) -> Probe {
        let Some((https, authority)) = split_url(url) else {
            return Probe::Unknown(format!("leader URL {url:?} is not http(s)://host:port"));
        };
        let exchange = async {
            let tcp = match TcpStream::connect(authority.as_str()).await {
                Ok(tcp) => tcp,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    return Probe::Refused;
                }
                Err(e) => return Probe::Unknown(format!("connecting to {authority}: {e}")),
            };
            let answer = if https {
                let Some((connector, name)) = self.tls.as_ref() else {
                    return Probe::Unknown(format!("{url} is HTTPS and no CA is set"));
                };
                match connector.connect(name.clone(), tcp).await {
                    Ok(stream) => self.get_identity(stream, &authority).await,
                    Err(e) => Err(Error::Transport(format!("TLS with {authority}: {e}"))),
                }
            } else {
                self.get_identity(tcp, &authority).await
            };
            answer.map_or_else(|e| Probe::Unknown(e.to_string()), Probe::Serves)
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .unwrap_or_else(|_| Probe::Unknown(format!("no answer within {timeout:?}")))
    }

    async fn get_identity<S>(&self, stream: S, authority: &str) -> Result<String>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let request = hyper::Request::get(self.identity_path.as_str())
            .header(hyper::header::HOST, authority)
            .body(Full::new(Bytes::new()))
            .map_err(|e| Error::Transport(e.to_string()))?;
        let (status, bytes) = exchange(stream, request).await?;
        let identity = String::from_utf8_lossy(&bytes).trim().to_owned();
        if status != 200 || identity.is_empty() {
            return Err(Error::Answer {
                status,
                body: identity.chars().take(200).collect(),
            });
        }
        Ok(identity)
    }

    /// POSTs `body` to the leader at `url` and returns its answer: `Ok(Ok(()))` bound,
    /// `Ok(Err(message))` the leader's refusal.
    pub async fn forward(
        &self,
        url: &str,
        body: &[u8],
        timeout: Duration,
    ) -> Result<std::result::Result<(), String>> {
        let (https, authority) = split_url(url).ok_or_else(|| Error::Url(url.to_owned()))?;
        let authority = authority.as_str();
        let exchange = async {
            let tcp = TcpStream::connect(authority)
                .await
                .map_err(|e| Error::Transport(format!("connecting to {authority}: {e}")))?;
            let _ = tcp.set_nodelay(true);
            if https {
                let (connector, name) = self
                    .tls
                    .as_ref()
                    .ok_or_else(|| Error::NoCa(url.to_owned()))?;
                let stream = connector
                    .connect(name.clone(), tcp)
                    .await
                    .map_err(|e| Error::Transport(format!("TLS with {authority}: {e}")))?;
                self.post(stream, authority, body).await
            } else {
                self.post(tcp, authority, body).await
            }
        };
        let answer = tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| Error::Timeout(timeout))??;
        Ok(if answer.error.is_empty() {
            Ok(())
        } else {
            Err(answer.error)
        })
    }

    async fn post<S>(
        &self,
        stream: S,
        authority: &str,
        body: &[u8],
    ) -> Result<ExtenderBindingResult>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let request = hyper::Request::post(self.path.as_str())
            .header(hyper::header::HOST, authority)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(FORWARDED_HEADER, "1")
            .body(Full::new(Bytes::copy_from_slice(body)))
            .map_err(|e| Error::Transport(e.to_string()))?;
        let (status, bytes) = exchange(stream, request).await?;
        let decoded = (status == 200)
            .then(|| serde_json::from_slice::<ExtenderBindingResult>(&bytes).ok())
            .flatten();
        decoded.ok_or_else(|| Error::Answer {
            status,
            body: String::from_utf8_lossy(&bytes[..bytes.len().min(200)]).into_owned(),
        })
    }
}

/// One HTTP/1.1 request on `stream`: the answer's status and body (at most
/// `MAX_ANSWER_BYTES`).
async fn exchange<S>(stream: S, request: hyper::Request<Full<Bytes>>) -> Result<(u16, Bytes)>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let transport = |e: hyper::Error| Error::Transport(e.to_string());
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(transport)?;
    let connection = tokio::spawn(connection);
    let response = sender.send_request(request).await.map_err(transport)?;
    let status = response.status().as_u16();
    let bytes = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
        .collect()
        .await
        .map_err(|e| Error::Transport(e.to_string()))?
        .to_bytes();
    connection.abort();
    Ok((status, bytes))
}

/// `(https, "host:port")` of `http(s)://host:port[/...]`; a bare IPv6 host (as
/// `$(POD_IP)` expands on an IPv6 cluster) gets its brackets.
fn split_url(url: &str) -> Option<(bool, String)> {
    let (https, rest) = if let Some(rest) = url.strip_prefix("https://") {
        (true, rest)
    } else {
        (false, url.strip_prefix("http://")?)
    };
    let authority = rest.split('/').next()?;
    let (host, port) = authority.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    let authority = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        authority.to_owned()
    };
    Some((https, authority))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_need_a_scheme_and_a_port() {
        assert_eq!(
            split_url("https://10.0.0.7:39999"),
            Some((true, "10.0.0.7:39999".to_owned()))
        );
        assert_eq!(
            split_url("http://[::1]:8080/x"),
            Some((false, "[::1]:8080".to_owned()))
        );
        assert_eq!(
            split_url("https://fd00::7:39999"),
            Some((true, "[fd00::7]:39999".to_owned()))
        );
        assert_eq!(split_url("10.0.0.7:39999"), None);
        assert_eq!(split_url("https://host"), None);
    }

    /// A leader that answers `answer` and hands back the request it read.
    async fn leader(answer: &'static str) -> (String, tokio::task::JoinHandle<String>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut request = Vec::new();
            let mut buf = [0u8; 4096];
            while !String::from_utf8_lossy(&request).contains("{\"PodName\"")
                && !String::from_utf8_lossy(&request).starts_with("GET ")
            {
                let n = stream.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                request.extend_from_slice(&buf[..n]);
            }
            let response = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
                answer.len()
            );
            stream.write_all(response.as_bytes()).await.unwrap();
            String::from_utf8_lossy(&request).into_owned()
        });
        (url, task)
    }

    #[tokio::test]
    async fn a_bind_reaches_the_leader_marked_and_its_answer_comes_back() {
        let forwarder = Forwarder::new("/gpushare-scheduler", None, None, "x").unwrap();
        let body = br#"{"PodName":"p","PodNamespace":"default","PodUID":"u","Node":"n1"}"#;
        let (url, seen) = leader(r#"{"Error":"node n1 is full"}"#).await;
        let answer = forwarder
            .forward(&url, body, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(answer, Err("node n1 is full".to_owned()));
        let request = seen.await.unwrap().to_ascii_lowercase();
        assert!(
            request.starts_with("post /gpushare-scheduler/bind "),
            "{request}"
        );
        assert!(request.contains("x-gpushare-forwarded: 1"), "{request}");

        let (url, _) = leader(r#"{"Error":""}"#).await;
        let answer = forwarder.forward(&url, body, Duration::from_secs(5)).await;
        assert_eq!(answer.unwrap(), Ok(()));
        // An HTTPS leader without a CA to check it with is not called.
        let refused = forwarder
            .forward("https://127.0.0.1:1", body, Duration::from_secs(5))
            .await;
        assert!(refused.is_err());
    }

    #[tokio::test]
    async fn a_probe_proves_the_holder_gone_only_by_a_refusal_or_another_identity() {
        let forwarder = Forwarder::new("/gpushare-scheduler", None, None, "x").unwrap();
        let wait = Duration::from_secs(5);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        drop(listener);
        assert_eq!(forwarder.probe(&url, wait).await, Probe::Refused);
        // Another process answers there (a restarted container of the same pod).
        let (url, seen) = leader("extender-a_2").await;
        let answer = forwarder.probe(&url, wait).await;
        assert_eq!(answer, Probe::Serves("extender-a_2".into()));
        assert!(answer.holder_is_gone("extender-a_1"));
        let request = seen.await.unwrap().to_ascii_lowercase();
        assert!(
            request.starts_with("get /gpushare-scheduler/identity "),
            "{request}"
        );
        assert!(!Probe::Unknown("timeout".into()).holder_is_gone("a_1"));
        assert!(Probe::Refused.holder_is_gone("a_1"));
        assert!(!Probe::Serves("a_1".into()).holder_is_gone("a_1"));
        assert!(Probe::Serves("a_2".into()).holder_is_gone("a_1"));
    }

    #[test]
    fn the_bind_path_follows_the_prefix() {
        let forwarder = Forwarder::new("/gpushare-scheduler/", None, None, "x").unwrap();
        assert_eq!(forwarder.path, "/gpushare-scheduler/bind");
        assert_eq!(
            Forwarder::new("p", None, None, "x").unwrap().path,
            "/p/bind"
        );
    }
}
