//! The extender's client of the API server: kube's usual stack (base URI, credentials, extra
//! headers) over a connection pool that speaks HTTP/2 when the server offers it.
//!
//! Why not `kube::Client::try_default()`: kube 5's stack offers only HTTP/1.1 over TLS, so every
//! request in flight needs a connection of its own. kube-scheduler calls bind for each pod in a
//! goroutine of its own, so a burst puts hundreds of Binding writes in flight at once, and an
//! HTTP/1.1 pool then opens a TLS connection for each, a handshake the API server pays for in
//! CPU just when it has none to spare. Measured on the real cluster (docs/performance.md,
//! "Cost to kube-scheduler"). client-go, which kube-scheduler and kubelet use, multiplexes its
//! requests over one HTTP/2 connection; this client does the same.
//!
//! A proxy in the kubeconfig (`proxy-url`) or a `tls-server-name` keeps kube's own stack,
//! which knows how to use them.

use kube::client::ConfigExt;
use kube::client::retry::RetryPolicy;
use kube::{Client, Config};
use tower::ServiceBuilder;

/// Builds the client from the environment, as `kube::Client::try_default()` would (in-cluster
/// service account, else the kubeconfig), offering HTTP/2 and HTTP/1.1 to the server.
pub async fn from_environment() -> Result<Client, kube::Error> {
    let config = Config::infer().await.map_err(kube::Error::InferConfig)?;
    multiplexed(config)
}

/// A client for `config` whose connections speak HTTP/2 where the server agrees to it
/// (TLS with ALPN `h2`; every API server does), HTTP/1.1 otherwise.
pub fn multiplexed(config: Config) -> Result<Client, kube::Error> {
    if config.proxy_url.is_some() || config.tls_server_name.is_some() {
        return Client::try_from(config);
    }
    let tls = config.rustls_client_config()?;
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(config.connect_timeout);
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_all_versions()
        .wrap_connector(http);
    let pool = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(connector);
    // As kube's stack: 429, 503 and 504 are retried with backoff where the config says so.
    let retry = config
        .default_retry
        .then(|| tower::retry::RetryLayer::new(RetryPolicy::server_retry()));
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(retry)
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(tower::BoxError::from)
        .service(pool);
    Ok(Client::new(service, config.default_namespace))
}
