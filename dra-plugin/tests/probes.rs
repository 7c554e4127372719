//! The whole plugin (`run_with_client`) on simulated GPUs, with this test as kubelet on the
//! registration socket and a stub API server that takes the ResourceSlice: `/readyz`
//! follows what kubelet says about the registration, and the probe server stops with the
//! plugin.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::IntoResponse;
use clap::Parser as _;
use gpushare_dra_plugin::{Config, Error};
use gpushare_proto::pluginregistration::registration_client::RegistrationClient;
use gpushare_proto::pluginregistration::{InfoRequest, RegistrationStatus};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(20);

/// The calls the stub API server answered, as `METHOD path`.
type Calls = Arc<Mutex<Vec<String>>>;

/// An API server that has no ResourceSlice and stores whatever is created.
fn api_server(calls: Calls) -> kube::Client {
    async fn answer(
        State(calls): State<Calls>,
        method: Method,
        uri: Uri,
        body: Bytes,
    ) -> axum::response::Response {
        calls
            .lock()
            .unwrap()
            .push(format!("{method} {}", uri.path()));
        let json = [(header::CONTENT_TYPE, "application/json")];
        match method {
            Method::GET => (
                StatusCode::NOT_FOUND,
                json,
                r#"{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404,"message":"not found"}"#,
            )
                .into_response(),
            Method::POST => (StatusCode::CREATED, json, body).into_response(),
            _ => (StatusCode::METHOD_NOT_ALLOWED, "not in this stub").into_response(),
        }
    }
    let router = Router::new().fallback(answer).with_state(calls);
    kube::Client::new(router, "default")
}

fn config(dir: &Path, probe_addr: SocketAddr) -> Config {
    let path = |name: &str| dir.join(name).display().to_string();
    Config::try_parse_from([
        "gpushare-dra-plugin".to_owned(),
        "--node-name=n1".to_owned(),
        "--driver-name=gpushare.example.com".to_owned(),
        format!("--plugin-dir={}", path("plugin")),
        format!("--registry-dir={}", path("registry")),
        format!("--cdi-dir={}", path("cdi")),
        "--gpu-backend=simulated".to_owned(),
        "--simulate-gpus=16".to_owned(),
        format!("--probe-addr={probe_addr}"),
    ])
    .unwrap()
}

/// A loopback address with a port nobody listens on right now.
fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// `GET path` over HTTP/1.1: the status and the body.
async fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect(addr).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP response: {response:?}")))?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

#[tokio::test]
async fn readiness_follows_kubelets_verdict_and_the_probes_stop_with_the_plugin() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_addr();
    let calls = Calls::default();
    let stop = CancellationToken::new();
    let plugin = tokio::spawn(gpushare_dra_plugin::run_with_client(
        config(dir.path(), addr),
        api_server(calls.clone()),
        stop.clone().cancelled_owned(),
    ));

    // Up once /healthz answers (the port is bound before the slice is published, the server
    // runs once both sockets are served).
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match tokio::time::timeout(Duration::from_secs(1), get(addr, "/healthz")).await {
            Ok(Ok(answer)) => {
                assert_eq!(answer, (200, "ok".to_owned()));
                break;
            }
            _ => {
                assert!(
                    !plugin.is_finished(),
                    "the plugin ended: {:?}",
                    plugin.await
                );
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "/healthz never answered"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    // The slice is published first; then the plugin may have started watching it (a list,
    // then watches, of the slice collection).
    let made = calls.lock().unwrap().clone();
    assert_eq!(
        made[..2],
        [
            "GET /apis/resource.k8s.io/v1/resourceslices/n1-gpushare.example.com",
            "POST /apis/resource.k8s.io/v1/resourceslices"
        ],
        "{made:?}"
    );
    assert!(
        made[2..]
            .iter()
            .all(|call| call == "GET /apis/resource.k8s.io/v1/resourceslices"),
        "{made:?}"
    );
    assert_eq!(
        get(addr, "/readyz").await.unwrap(),
        (503, "not registered with kubelet yet".to_owned())
    );

    // kubelet's plugin watcher: GetInfo, then the verdict.
    let socket = dir.path().join("registry/gpushare.example.com-reg.sock");
    let mut kubelet = RegistrationClient::new(gpushare_proto::connect_unix(&socket).await.unwrap());
    kubelet.get_info(InfoRequest {}).await.unwrap();
    assert_eq!(
        get(addr, "/readyz").await.unwrap().0,
        503,
        "ready before the verdict"
    );
    kubelet
        .notify_registration_status(RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .unwrap();
    assert_eq!(get(addr, "/readyz").await.unwrap().0, 200);
    kubelet
        .notify_registration_status(RegistrationStatus {
            plugin_registered: false,
            error: "plugin already registered".to_owned(),
        })
        .await
        .unwrap();
    assert_eq!(
        get(addr, "/readyz").await.unwrap(),
        (
            503,
            "kubelet reported registration failed: plugin already registered".to_owned()
        )
    );

    stop.cancel();
    tokio::time::timeout(WAIT, plugin)
        .await
        .expect("the plugin stops on shutdown")
        .unwrap()
        .unwrap();
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "the probe port is still open after shutdown"
    );
}

#[tokio::test]
async fn a_taken_probe_port_fails_the_start_before_anything_is_published() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let calls = Calls::default();
    let err = gpushare_dra_plugin::run_with_client(
        config(dir.path(), addr),
        api_server(calls.clone()),
        std::future::pending(),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&err, Error::ProbeBind { addr: a, .. } if *a == addr),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains(&addr.to_string()) && message.contains("--probe-addr"),
        "{message}"
    );
    assert!(
        calls.lock().unwrap().is_empty(),
        "{:?}",
        calls.lock().unwrap()
    );
    assert!(
        !dir.path()
            .join("registry/gpushare.example.com-reg.sock")
            .exists()
    );
}
