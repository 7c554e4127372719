//! A barrage of bad input at a running extender replica's scheduler port, as any pod on the
//! cluster network could send it: TCP connections that never finish a TLS handshake, then,
//! over TLS, empty, truncated and non-JSON bodies, 8 MiB bodies, JSON nested 100,000 deep,
//! absurd quantities, 10,000 node names, unknown pods and nodes, to every verb.
//!
//! The calls verify the replica's certificate against the chart's CA (the Secret's `ca.crt`)
//! for the Service's name, as kube-scheduler does, and dial the pod's address directly, so
//! each replica gets the whole barrage.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_rustls::{FixedServerNameResolver, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// How many connections are opened and left in the middle of a handshake.
pub const STALLED_HANDSHAKES: usize = 200;

/// What the barrage got back: each request's verb, what was sent, and the status answered.
#[derive(Debug, Default)]
pub struct BarrageReport {
    /// (verb, what, HTTP status, whether the body was JSON).
    pub answers: Vec<(&'static str, String, u16, bool)>,
    /// Requests that got no HTTP answer at all (the connection failed), with why.
    pub unanswered: Vec<(String, String)>,
}

impl BarrageReport {
    /// The answers that are not a clear one: 200 with JSON, or 400/413 with a JSON error.
    pub fn unclear(&self) -> Vec<String> {
        self.answers
            .iter()
            .filter(|(_, _, status, json)| !(matches!(status, 200 | 400 | 413) && *json))
            .map(|(verb, what, status, json)| format!("{verb} {what}: {status} (json: {json})"))
            .chain(
                self.unanswered
                    .iter()
                    .map(|(what, why)| format!("{what}: no answer: {why}")),
            )
            .collect()
    }
}

/// The bodies of the barrage, by what they are: `pod` is a pending pod's JSON to build on.
fn bodies(pod: &Value) -> Vec<(String, Vec<u8>)> {
    let filter = json!({"Pod": pod, "NodeNames": ["node-k"], "Nodes": null}).to_string();
    let mut out: Vec<(String, Vec<u8>)> = vec![
        ("empty".into(), Vec::new()),
        ("not JSON".into(), b"GET / HTTP/1.0 hello".to_vec()),
        (
            "truncated".into(),
            filter.as_bytes()[..filter.len() / 2].to_vec(),
        ),
        ("8 MiB".into(), vec![b'{'; 8 << 20]),
        (
            "nested 100,000 deep".into(),
            format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes(),
        ),
        (
            "nested 100,000 deep under an unknown key".into(),
            format!(r#"{{"x":{}{}}}"#, "[".repeat(100_000), "]".repeat(100_000)).into_bytes(),
        ),
    ];
    for quantity in ["1e100", "-5", "99999999999999999999999Gi", "0.5"] {
        let mut absurd = pod.clone();
        absurd["spec"]["containers"][0]["resources"] =
            json!({"limits": {"example.com/gpu-mem": quantity}});
        out.push((
            format!("gpu-mem {quantity}"),
            json!({"Pod": absurd, "NodeNames": ["node-k"]})
                .to_string()
                .into_bytes(),
        ));
    }
    let names: Vec<String> = (0..10_000).map(|i| format!("ghost-{i}")).collect();
    out.push((
        "10,000 node names".into(),
        json!({"Pod": pod, "NodeNames": names})
            .to_string()
            .into_bytes(),
    ));
    out.push((
        "unknown pod and node".into(),
        json!({"PodName": "nobody", "PodNamespace": "nowhere", "PodUID": "u", "Node": "ghost",
               "Pod": {"metadata": {"name": "nobody", "uid": "u"}},
               "NodeNameToMetaVictims": {"ghost": {"Pods": [{"UID": "x"}]}}})
        .to_string()
        .into_bytes(),
    ));
    out
}

/// Opens [`STALLED_HANDSHAKES`] connections to `address` that send half a TLS record and then
/// nothing; they stay open until the returned streams are dropped.
pub async fn stall_handshakes(address: &str) -> anyhow::Result<Vec<TcpStream>> {
    let mut streams = Vec::with_capacity(STALLED_HANDSHAKES);
    for _ in 0..STALLED_HANDSHAKES {
        let mut stream = TcpStream::connect(address)
            .await
            .with_context(|| format!("connecting to {address}"))?;
        // The first bytes of a ClientHello record, never finished.
        stream.write_all(&[0x16, 0x03, 0x01, 0x02]).await?;
        streams.push(stream);
    }
    Ok(streams)
}

/// Sends the barrage to the replica at `address` (`ip:port`), verified against `ca_pem` for
/// `server_name`, under `prefix` (`/gpushare-scheduler`); `pod` is a pending pod's JSON.
pub async fn send(
    address: &str,
    server_name: &str,
    ca_pem: &str,
    prefix: &str,
    pod: &Value,
) -> anyhow::Result<BarrageReport> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, ServerName};
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert?)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = ServerName::try_from(server_name.to_owned())?;
    let connector = HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_only()
        .with_server_name_resolver(FixedServerNameResolver::new(name))
        .enable_all_versions()
        .build();
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(connector);
    let mut report = BarrageReport::default();
    for verb in ["filter", "prioritize", "bind", "preempt"] {
        for (what, body) in bodies(pod) {
            let request = http::Request::post(format!("https://{address}{prefix}/{verb}"))
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Full::new(Bytes::from(body)))?;
            let answer = tokio::time::timeout(Duration::from_secs(30), async {
                let response = client.request(request).await?;
                let status = response.status().as_u16();
                let bytes = response.into_body().collect().await?.to_bytes();
                anyhow::Ok((status, serde_json::from_slice::<Value>(&bytes).is_ok()))
            })
            .await;
            match answer {
                Ok(Ok((status, json))) => report.answers.push((verb, what, status, json)),
                Ok(Err(error)) => report
                    .unanswered
                    .push((format!("{verb} {what}"), format!("{error:#}"))),
                Err(_) => report
                    .unanswered
                    .push((format!("{verb} {what}"), "no answer in 30 s".into())),
            }
        }
    }
    Ok(report)
}
