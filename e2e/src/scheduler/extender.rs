//! One configured HTTP extender, called the way `HTTPExtender` in kube-scheduler calls it.
//!
//! `POST {urlPrefix}/{verb}` with a JSON body; any status but 200 is an error (body discarded);
//! each call is bounded by `httpTimeout`. An `https://` prefix is verified against `tlsConfig`'s
//! CA and `serverName` (upstream's `makeTransport`); `enableHTTPS` without a CA, which upstream
//! answers by trusting any certificate, is refused. Error texts are upstream's, so the
//! `FailedScheduling` messages a test reads are a real cluster's.
//!
//! Upstream's transport offers `h2` by ALPN over HTTPS and, with an extender that accepts it
//! (ours does), sends every call as a stream of one connection (a call past `httpTimeout` resets
//! its stream, the connection stays); plain HTTP is a keep-alive HTTP/1.1 pool. So is this one.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_rustls::{FixedServerNameResolver, HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ListMeta;

use super::ExtenderConfig;
use super::framework::pod_uses_any;
use super::stats::{Call, StatsRecorder};
use super::wire::{self, ExtenderArgs, ExtenderBindingArgs, HostPriority, NodeList};

/// Why a call to an extender failed; the `Display` text is what upstream would report.
#[derive(Debug, thiserror::Error)]
pub enum ExtenderError {
    /// The request body could not be encoded.
    #[error("encoding the request for {url}: {source}")]
    Encode {
        url: String,
        #[source]
        source: serde_json::Error,
    },
    /// The URL prefix is not a valid URL.
    #[error("invalid extender URL {url}: {source}")]
    Url {
        url: String,
        #[source]
        source: http::Error,
    },
    /// The TLS settings cannot be used.
    #[error("extender {url}: {message}")]
    Tls { url: String, message: String },
    /// Connecting or transferring failed.
    #[error("Post \"{url}\": {message}")]
    Transport { url: String, message: String },
    /// The call did not finish within `httpTimeout`.
    #[error(
        "Post \"{url}\": context deadline exceeded (Client.Timeout exceeded while awaiting headers)"
    )]
    Timeout { url: String },
    /// The extender answered with a status other than 200.
    #[error("failed {verb} with extender at URL {url}, code {code}")]
    Status {
        verb: String,
        url: String,
        code: u16,
    },
    /// The answer was not the expected JSON.
    #[error("decoding the {verb} answer of {url}: {source}")]
    Decode {
        verb: String,
        url: String,
        #[source]
        source: wire::DecodeError,
    },
    /// The extender reported an error in its answer (`Error` field).
    #[error("{0}")]
    Reported(String),
    /// A filter answer named a node that was not in the request.
    #[error(
        "extender {url:?} claims a filtered node {node:?} which is not found in the input node list"
    )]
    UnknownNode { url: String, node: String },
}

/// The outcome of a successful filter call.
#[derive(Debug, Default)]
pub struct FilterOutcome {
    /// Indexes into the node slice that was sent, in the extender's order.
    pub passed: Vec<usize>,
    pub failed: wire::FailedNodesMap,
    pub failed_and_unresolvable: wire::FailedNodesMap,
}

/// A TLS client trusting only the PEM certificates `ca_pem` and presenting `identity` (PEM
/// certificate chain and key) when given; errors name the `tlsConfig` field at fault.
pub fn tls_client(
    ca_pem: &str,
    identity: Option<(&str, &str)>,
) -> Result<rustls::ClientConfig, String> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        let cert = cert.map_err(|e| format!("caData: {e}"))?;
        roots.add(cert).map_err(|e| format!("caData: {e}"))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    let Some((cert, key)) = identity else {
        return Ok(builder.with_no_client_auth());
    };
    let chain = CertificateDer::pem_slice_iter(cert.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("certData: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).map_err(|e| format!("keyData: {e}"))?;
    builder
        .with_client_auth_cert(chain, key)
        .map_err(|e| format!("certData and keyData: {e}"))
}

/// The connector for `config`: plain HTTP, or HTTPS trusting only `tlsConfig`'s CA.
fn connector(config: &ExtenderConfig) -> Result<HttpsConnector<HttpConnector>, ExtenderError> {
    let fail = |message: String| ExtenderError::Tls {
        url: config.url_prefix.clone(),
        message,
    };
    let tls = config.tls.clone().unwrap_or_default();
    if config.enable_https && tls.ca_pem.trim().is_empty() {
        return Err(fail(
            "enableHTTPS without tlsConfig caData/caFile: kube-scheduler would skip certificate verification; configure the CA".to_owned(),
        ));
    }
    // Upstream's `makeTransport` presents `certFile`/`keyFile` (or their data) when set.
    let identity = (!tls.cert_pem.trim().is_empty()).then_some((&*tls.cert_pem, &*tls.key_pem));
    let client_config =
        tls_client(&tls.ca_pem, identity).map_err(|e| fail(format!("tlsConfig {e}")))?;
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.enforce_http(false);
    let builder = HttpsConnectorBuilder::new()
        .with_tls_config(client_config)
        .https_or_http();
    let builder = if tls.server_name.is_empty() {
        builder
    } else {
        let name = rustls::pki_types::ServerName::try_from(tls.server_name.clone())
            .map_err(|e| fail(format!("tlsConfig serverName {:?}: {e}", tls.server_name)))?;
        builder.with_server_name_resolver(FixedServerNameResolver::new(name))
    };
    Ok(builder.enable_all_versions().wrap_connector(http))
}

/// A configured extender plus its HTTP client.
pub struct HttpExtender {
    pub config: ExtenderConfig,
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    stats: StatsRecorder,
}

impl HttpExtender {
    pub fn new(mut config: ExtenderConfig, stats: StatsRecorder) -> Result<Self, ExtenderError> {
        // An empty verb is no verb, as upstream reads it.
        for verb in [
            &mut config.filter_verb,
            &mut config.prioritize_verb,
            &mut config.bind_verb,
        ] {
            verb.take_if(|verb| verb.is_empty());
        }
        let connector = connector(&config)?;
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .build(connector);
        Ok(HttpExtender {
            config,
            client,
            stats,
        })
    }

    /// `IsInterested`: every pod when no managed resources are configured, else only pods whose
    /// containers or init containers request or limit one of them.
    pub fn is_interested(&self, pod: &Pod) -> bool {
        self.config.managed_resources.is_empty()
            || pod_uses_any(pod, &self.config.managed_resources)
    }

    /// The body of a filter or prioritize call. The Pod goes without `managedFields`, as
    /// kube-scheduler v1.36 sends it (its pod cache drops them; the captured requests in
    /// `shared/fixtures` show it); Nodes go as they are.
    fn args(&self, pod: &Pod, nodes: &[Arc<Node>]) -> ExtenderArgs {
        let mut pod = pod.clone();
        pod.metadata.managed_fields = None;
        let cached = self.config.node_cache_capable;
        let names = nodes
            .iter()
            .map(|n| n.metadata.name.clone().unwrap_or_default());
        ExtenderArgs {
            pod,
            nodes: (!cached).then(|| NodeList {
                metadata: ListMeta::default(),
                items: nodes.iter().map(|n| (**n).clone()).collect(),
            }),
            node_names: cached.then(|| names.collect()),
        }
    }

    /// `Filter`: which of `nodes` the extender keeps, and why it rejected the others.
    pub async fn filter(
        &self,
        verb: &str,
        pod: &Pod,
        nodes: &[Arc<Node>],
    ) -> Result<FilterOutcome, ExtenderError> {
        let url = self.url(verb);
        let body = self
            .send(Call::Filter, verb, &self.args(pod, nodes))
            .await?;
        let result = wire::decode_filter_result(&body).map_err(self.decode_error(verb))?;
        if !result.error.is_empty() {
            return Err(ExtenderError::Reported(result.error));
        }
        let index_of = |name: &str| {
            nodes
                .iter()
                .position(|n| n.metadata.name.as_deref() == Some(name))
                .ok_or_else(|| ExtenderError::UnknownNode {
                    url: url.clone(),
                    node: name.to_owned(),
                })
        };
        let passed: Vec<&str> = match (&result.node_names, &result.nodes) {
            (Some(names), _) if self.config.node_cache_capable => {
                names.iter().map(String::as_str).collect()
            }
            (_, Some(list)) => list
                .items
                .iter()
                .map(|n| n.metadata.name.as_deref().unwrap_or_default())
                .collect(),
            _ => Vec::new(),
        };
        Ok(FilterOutcome {
            passed: passed.into_iter().map(index_of).collect::<Result<_, _>>()?,
            failed: result.failed_nodes,
            failed_and_unresolvable: result.failed_and_unresolvable_nodes,
        })
    }

    /// `Prioritize`: the extender's 0..=10 scores.
    pub async fn prioritize(
        &self,
        verb: &str,
        pod: &Pod,
        nodes: &[Arc<Node>],
    ) -> Result<Vec<HostPriority>, ExtenderError> {
        let body = self
            .send(Call::Prioritize, verb, &self.args(pod, nodes))
            .await?;
        wire::decode_host_priorities(&body).map_err(self.decode_error(verb))
    }

    /// `Bind`: asks the extender to bind the pod.
    pub async fn bind(&self, verb: &str, args: &ExtenderBindingArgs) -> Result<(), ExtenderError> {
        let body = self.send(Call::Bind, verb, args).await?;
        let result = wire::decode_binding_result(&body).map_err(self.decode_error(verb))?;
        if result.error.is_empty() {
            Ok(())
        } else {
            Err(ExtenderError::Reported(result.error))
        }
    }

    fn decode_error(&self, verb: &str) -> impl FnOnce(wire::DecodeError) -> ExtenderError {
        let (verb, url) = (verb.to_owned(), self.url(verb));
        move |source| ExtenderError::Decode { verb, url, source }
    }

    fn url(&self, verb: &str) -> String {
        format!("{}/{verb}", self.config.url_prefix.trim_end_matches('/'))
    }

    async fn send<T: serde::Serialize>(
        &self,
        call: Call,
        verb: &str,
        args: &T,
    ) -> Result<Bytes, ExtenderError> {
        let url = self.url(verb);
        let body = serde_json::to_vec(args).map_err(|source| ExtenderError::Encode {
            url: url.clone(),
            source,
        })?;
        let request = http::Request::post(&url)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|source| ExtenderError::Url {
                url: url.clone(),
                source,
            })?;
        let started = Instant::now();
        let transport = |e: &dyn std::error::Error| ExtenderError::Transport {
            url: url.clone(),
            message: error_chain(e),
        };
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| transport(&e))?;
            self.stats.answer(response.version());
            let status = response.status();
            if status != http::StatusCode::OK {
                return Err(ExtenderError::Status {
                    verb: verb.to_owned(),
                    url: url.clone(),
                    code: status.as_u16(),
                });
            }
            let collected = response.into_body().collect().await;
            Ok(collected.map_err(|e| transport(&e))?.to_bytes())
        };
        let result = match tokio::time::timeout(self.config.http_timeout, exchange).await {
            Ok(result) => result,
            Err(_) => Err(ExtenderError::Timeout { url: url.clone() }),
        };
        self.stats.call(call, started.elapsed(), result.is_ok());
        result
    }
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}
