//! A barrage of bad input at a running extender replica's scheduler port, as any pod on the
//! cluster network could send it: TCP connections that never finish a TLS handshake, then,
//! over TLS, empty, truncated and non-JSON bodies, 8 MiB bodies, JSON nested 100,000 deep,
//! absurd quantities, 10,000 node names, unknown pods and nodes, to every verb.
//!
//! The calls verify the replica against the chart's CA for the Service's name, as
//! kube-scheduler does, and dial the pod's address, so each replica gets the whole barrage.
//! They present the scheduler's client certificate, so the bodies reach the decoders.

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

use crate::scheduler::tls_client;

/// How many connections are opened and left in the middle of a handshake.
pub const STALLED_HANDSHAKES: usize = 200;

/// What the barrage got back.
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
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let mut out: Vec<(String, Vec<u8>)> = vec![
        ("empty".into(), Vec::new()),
        ("not JSON".into(), b"GET / HTTP/1.0 hello".to_vec()),
        (
            "truncated".into(),
            filter.as_bytes()[..filter.len() / 2].to_vec(),
        ),
        ("8 MiB".into(), vec![b'{'; 8 << 20]),
        ("nested 100,000 deep".into(), deep.clone().into_bytes()),
        (
            "nested 100,000 deep under an unknown key".into(),
            format!(r#"{{"x":{deep}}}"#).into_bytes(),
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

/// Who calls: the extender's CA to verify it by, and the client certificate presented.
#[derive(Clone)]
pub struct Caller {
    /// The CA of the extender's certificate (the Secret `<release>-extender-tls`'s `ca.crt`).
    pub ca_pem: String,
    /// The client certificate and key presented (PEM), if any.
    pub identity: Option<(String, String)>,
}

impl Caller {
    /// An HTTP client that verifies the extender for `server_name` and presents the identity.
    fn client(&self, server_name: &str) -> anyhow::Result<Client<HttpsConnector, Full<Bytes>>> {
        let identity = self
            .identity
            .as_ref()
            .map(|(c, k)| (c.as_str(), k.as_str()));
        let tls = tls_client(&self.ca_pem, identity).map_err(|e| anyhow::anyhow!(e))?;
        let name = rustls::pki_types::ServerName::try_from(server_name.to_owned())?;
        let connector = HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_only()
            .with_server_name_resolver(FixedServerNameResolver::new(name))
            .enable_all_versions()
            .build();
        Ok(Client::builder(TokioExecutor::new()).build(connector))
    }
}

type HttpsConnector =
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>;

/// One request with a 30 s bound: the status and whether the body was JSON, or why none came.
async fn ask(
    client: &Client<HttpsConnector, Full<Bytes>>,
    request: http::Request<Full<Bytes>>,
) -> Result<(u16, bool), String> {
    let answer = tokio::time::timeout(Duration::from_secs(30), async {
        let response = client.request(request).await?;
        let status = response.status().as_u16();
        let bytes = response.into_body().collect().await?.to_bytes();
        anyhow::Ok((status, serde_json::from_slice::<Value>(&bytes).is_ok()))
    })
    .await;
    match answer {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(error)) => Err(format!("{error:#}")),
        Err(_) => Err("no answer in 30 s".into()),
    }
}

/// A POST of the JSON `body` to `url`.
fn post_json(url: String, body: Vec<u8>) -> anyhow::Result<http::Request<Full<Bytes>>> {
    Ok(http::Request::post(url)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))?)
}

/// Sends the barrage to the replica at `address` (`ip:port`) as `caller`, verifying it for
/// `server_name`, under `prefix` (`/gpushare-scheduler`); `pod` is a pending pod's JSON.
pub async fn send(
    address: &str,
    server_name: &str,
    caller: &Caller,
    prefix: &str,
    pod: &Value,
) -> anyhow::Result<BarrageReport> {
    let client = caller.client(server_name)?;
    let mut report = BarrageReport::default();
    for verb in ["filter", "prioritize", "bind", "preempt"] {
        for (what, body) in bodies(pod) {
            let request = post_json(format!("https://{address}{prefix}/{verb}"), body)?;
            match ask(&client, request).await {
                Ok((status, json)) => report.answers.push((verb, what, status, json)),
                Err(why) => report.unanswered.push((format!("{verb} {what}"), why)),
            }
        }
    }
    Ok(report)
}

/// Each verb of the replica at `address` asked once by `caller` (well-formed bodies built on
/// `pod`): per verb, the status and whether the body was JSON, or why no answer came.
pub async fn callers(
    address: &str,
    server_name: &str,
    caller: &Caller,
    prefix: &str,
    pod: &Value,
) -> anyhow::Result<Vec<(&'static str, Result<(u16, bool), String>)>> {
    let client = caller.client(server_name)?;
    let filter = json!({"Pod": pod, "NodeNames": ["node-k"]}).to_string();
    let bind = json!({"PodName": "barrage", "PodNamespace": "default",
        "PodUID": "barrage-uid", "Node": "node-k"})
    .to_string();
    let preempt = json!({"Pod": pod, "NodeNameToMetaVictims": {}}).to_string();
    let calls = [
        ("filter", Some(filter.clone())),
        ("prioritize", Some(filter)),
        ("bind", Some(bind)),
        ("preempt", Some(preempt)),
        ("inspect", None),
    ];
    let mut out = Vec::new();
    for (verb, body) in calls {
        let url = format!("https://{address}{prefix}/{verb}");
        let request = match body {
            Some(body) => post_json(url, body.into_bytes())?,
            None => http::Request::get(url).body(Full::new(Bytes::new()))?,
        };
        out.push((verb, ask(&client, request).await));
    }
    Ok(out)
}
