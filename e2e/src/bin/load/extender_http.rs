//! The scheduler's side of the wire: a client for the extender's verbs that counts what
//! crosses it (calls, request and answer bytes, by verb).
//!
//! Kept apart from the drive because it is the transport kube-scheduler would use (HTTPS with
//! HTTP/2 on one connection as the chart serves it, or plain HTTP/1.1), and its counts are
//! the "bytes per scheduled pod" of the report: the drive decides what to send, this decides
//! how and measures it.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use gpushare_e2e::cluster::{EXTENDER_SERVICE_HOST, ExtenderTls};
use gpushare_e2e::scheduler::tls_client;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_rustls::{FixedServerNameResolver, HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::report::ratio;

/// kube-scheduler's default `httpTimeout` for an extender call.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// A client for the extender's verbs, counting what crosses the wire: over HTTPS it offers h2
/// by ALPN and multiplexes every call on one connection, as kube-scheduler's transport does;
/// over plain HTTP a keep-alive HTTP/1.1 pool.
pub struct Http {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    prefix: String,
    /// Calls made, request body bytes sent, answer body bytes received, by verb: what
    /// kube-scheduler encodes and decodes for the extender in its scheduling cycle.
    by_verb: Mutex<BTreeMap<String, [u64; 3]>>,
}

impl Http {
    pub fn new(prefix: String, tls: Option<&ExtenderTls>) -> anyhow::Result<Self> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.enforce_http(false);
        let connector = match tls {
            Some(tls) => HttpsConnectorBuilder::new()
                .with_tls_config((*tls.client_config()).clone())
                .https_or_http()
                .with_server_name_resolver(FixedServerNameResolver::new(
                    rustls::pki_types::ServerName::try_from(EXTENDER_SERVICE_HOST)?,
                ))
                .enable_all_versions()
                .wrap_connector(connector),
            // Plain `http://` URLs never use the TLS settings: trust nothing.
            None => HttpsConnectorBuilder::new()
                .with_tls_config(tls_client("", None).map_err(|e| anyhow!(e))?)
                .https_or_http()
                .enable_http1()
                .wrap_connector(connector),
        };
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .build(connector);
        Ok(Self {
            client,
            prefix,
            by_verb: Mutex::new(BTreeMap::new()),
        })
    }

    /// `filter 1.00 calls 7.9 KB in 6.1 KB out, …`: per verb, calls per scheduled pod and
    /// the mean request and answer body per call.
    pub fn describe_by_verb(&self, bound: u64) -> String {
        let parts: Vec<String> = self
            .by_verb()
            .iter()
            .filter(|(_, [calls, _, _])| *calls > 0)
            .map(|(verb, [calls, sent, received])| {
                format!(
                    "{verb} {} calls {:.1} KB in {:.1} KB out",
                    ratio(*calls, bound),
                    *sent as f64 / *calls as f64 / 1e3,
                    *received as f64 / *calls as f64 / 1e3
                )
            })
            .collect();
        parts.join(", ")
    }

    fn by_verb(&self) -> MutexGuard<'_, BTreeMap<String, [u64; 3]>> {
        self.by_verb.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn count(&self, verb: &str, slot: usize, n: u64) {
        self.by_verb().entry(verb.to_owned()).or_default()[slot] += n;
    }

    /// (calls, bytes sent, bytes received) so far, all verbs.
    pub fn traffic(&self) -> (u64, u64, u64) {
        self.by_verb()
            .values()
            .fold((0, 0, 0), |(c, s, r), [calls, sent, received]| {
                (c + calls, s + sent, r + received)
            })
    }

    /// `POST {prefix}/{verb}` with a JSON body; the round-trip time and the answer body.
    pub async fn post(&self, verb: &str, body: Vec<u8>) -> anyhow::Result<(Duration, Bytes)> {
        let url = format!("{}/{verb}", self.prefix);
        self.count(verb, 0, 1);
        self.count(verb, 1, body.len() as u64);
        let request = http::Request::post(&url)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))?;
        let started = Instant::now();
        let exchange = async {
            let response = self.client.request(request).await?;
            let status = response.status();
            let body = response.into_body().collect().await?.to_bytes();
            anyhow::Ok((status, body))
        };
        let (status, answer) = tokio::time::timeout(CALL_TIMEOUT, exchange)
            .await
            .map_err(|_| anyhow!("POST {url}: no answer within {CALL_TIMEOUT:?}"))?
            .with_context(|| format!("POST {url}"))?;
        let took = started.elapsed();
        self.count(verb, 2, answer.len() as u64);
        if status != http::StatusCode::OK {
            bail!(
                "POST {url} answered {status}: {}",
                String::from_utf8_lossy(&answer)
            );
        }
        Ok((took, answer))
    }
}
