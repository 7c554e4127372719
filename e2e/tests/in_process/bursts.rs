//! What the burst tests of `scenarios.rs` and `ha.rs` share: a watch of the burst's pods and
//! the reservations an extender still holds once the burst has drained.

use std::time::Duration;

use futures::StreamExt;
use gpushare_e2e::cluster::wait_for;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use serde_json::Value;

/// The pods of namespace `default` as a watch shows them: progress is read from a local
/// cache, so that counting the burst's pods several times a second costs the API server
/// nothing. The watch is aborted on drop.
pub struct PodWatch {
    pods: reflector::Store<Pod>,
    task: tokio::task::JoinHandle<()>,
}

impl PodWatch {
    pub async fn start(client: &kube::Client) -> anyhow::Result<Self> {
        let api: Api<Pod> = Api::namespaced(client.clone(), "default");
        let (pods, writer) = reflector::store();
        let stream = reflector::reflector(writer, watcher(api, watcher::Config::default()))
            .default_backoff()
            .applied_objects();
        let task = tokio::spawn(stream.for_each(|_| async {}));
        pods.wait_until_ready().await?;
        Ok(Self { pods, task })
    }

    pub fn pods(&self) -> Vec<Pod> {
        self.pods.state().iter().map(|p| (**p).clone()).collect()
    }

    pub fn bound(&self) -> usize {
        self.pods().iter().filter(|p| node_of(p).is_some()).count()
    }
}

impl Drop for PodWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub fn node_of(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref()?.node_name.as_deref()
}

/// The pods (`namespace/name`) an extender's inspect shows as reserved by a bind
/// (`"reserved": true` anywhere in it).
pub fn reserved_in(inspect: &Value, out: &mut Vec<String>) {
    if inspect["reserved"] == true {
        let field = |key: &str| inspect[key].as_str().unwrap_or("?").to_owned();
        out.push(format!("{}/{}", field("namespace"), field("name")));
    }
    match inspect {
        Value::Object(map) => map.values().for_each(|v| reserved_in(v, out)),
        Value::Array(items) => items.iter().for_each(|v| reserved_in(v, out)),
        _ => {}
    }
}

/// The reservations `reserved` reports once none is left, or after `limit` (an extender's
/// watch may lag the last binds by a moment) those still there.
pub async fn reservations_left(
    limit: Duration,
    reserved: impl AsyncFn() -> anyhow::Result<Vec<String>>,
) -> anyhow::Result<Vec<String>> {
    let none_left = || async { reserved().await.ok().filter(Vec::is_empty) };
    match wait_for("the extenders' reservations to end", limit, none_left).await {
        Ok(none) => Ok(none),
        Err(_) => reserved().await,
    }
}
