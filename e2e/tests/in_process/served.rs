//! An extender served in-process by `gpushare_extender::serve`, as its binary serves it
//! (watches, HTTP, Binding writes, the Lease), for `extender_live.rs` and `extender_leader.rs`.

use std::net::SocketAddr;
use std::time::Duration;

use gpushare_e2e::cluster::{http_get, wait_for};
use gpushare_extender::{Config, serve};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Where the chart's kube-scheduler configuration sends the verbs.
pub const PREFIX: &str = "/gpushare-scheduler";

/// A running extender; dropping it aborts it: its listener and API connections end at once,
/// nothing released, as when its process is killed.
pub struct Served {
    pub addr: SocketAddr,
    task: JoinHandle<Result<(), gpushare_extender::Error>>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Served {
    /// Serves the configuration `config` makes for the address on `listener` (127.0.0.1:0 if
    /// none), and waits until `/readyz` answers 200.
    pub async fn serve(
        client: &kube::Client,
        listener: Option<TcpListener>,
        config: impl FnOnce(SocketAddr) -> Config,
    ) -> anyhow::Result<Self> {
        let listener = match listener {
            Some(listener) => listener,
            None => TcpListener::bind("127.0.0.1:0").await?,
        };
        let addr = listener.local_addr()?;
        let config = Config {
            listen: addr,
            ..config(addr)
        };
        let task = tokio::spawn(serve(
            config,
            client.clone(),
            listener,
            std::future::pending(),
        ));
        let served = Self { addr, task };
        wait_for(
            "the extender to be ready",
            Duration::from_secs(60),
            || async { matches!(http_get(addr, "/readyz").await, Ok((200, _))).then_some(()) },
        )
        .await?;
        Ok(served)
    }
}

/// The bind kube-scheduler sends for `pod` on `node`.
pub fn bind_body(pod: &Pod, node: &str) -> Value {
    let meta = &pod.metadata;
    json!({
        "PodName": meta.name, "PodNamespace": meta.namespace, "PodUID": meta.uid, "Node": node,
    })
}
