//! Keeps the view in step with the API server: one watch over Nodes, one over Pods (all
//! namespaces). A (re)list is buffered and swapped in whole at `InitDone`, so the allocator
//! is rebuilt from one consistent list, never from half of one.

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};

use crate::api::AppState;
use crate::kube_io::PodEvent;
use crate::view::PodWarning;

/// Follows Nodes until the stream ends (it ends only if the watcher gives up).
pub async fn watch_nodes(client: kube::Client, state: AppState) {
    let api: Api<Node> = Api::all(client);
    let stream = watcher::watcher(api, watcher::Config::default()).default_backoff();
    follow(
        stream,
        "nodes",
        |event, buffer: &mut Vec<Node>| match event {
            Event::Init => buffer.clear(),
            Event::InitApply(node) => buffer.push(node),
            Event::InitDone => {
                let nodes = std::mem::take(buffer);
                state.view_mut().replace_nodes(&nodes);
                tracing::info!(nodes = nodes.len(), "node watch synced");
            }
            Event::Apply(node) => state.view_mut().apply_node(&node),
            Event::Delete(node) => state.view_mut().delete_node(&node),
        },
    )
    .await;
}

/// Follows Pods until the stream ends (it ends only if the watcher gives up).
pub async fn watch_pods(client: kube::Client, state: AppState) {
    let api: Api<Pod> = Api::all(client);
    let stream = watcher::watcher(api, watcher::Config::default()).default_backoff();
    let warn = |warnings: Vec<PodWarning>| {
        for warning in warnings {
            state.events().send(PodEvent {
                namespace: warning.namespace,
                name: warning.name,
                uid: warning.uid,
                warning: true,
                reason: "GpuAllocationUnreadable",
                note: warning.message,
            });
        }
    };
    follow(stream, "pods", |event, buffer: &mut Vec<Pod>| match event {
        Event::Init => buffer.clear(),
        Event::InitApply(pod) => buffer.push(pod),
        Event::InitDone => {
            let pods = std::mem::take(buffer);
            let warnings = {
                let mut view = state.view_mut();
                let warnings = view.replace_pods(&pods);
                let synced = view.is_synced();
                tracing::info!(pods = pods.len(), ready = synced, "pod watch synced");
                warnings
            };
            warn(warnings);
        }
        Event::Apply(pod) => {
            let warning = state.view_mut().apply_pod(&pod);
            warn(warning.into_iter().collect());
        }
        Event::Delete(pod) => state.view_mut().delete_pod(&pod),
    })
    .await;
}

async fn follow<K, S, F>(stream: S, what: &'static str, mut apply: F)
where
    S: Stream<Item = Result<Event<K>, watcher::Error>>,
    F: FnMut(Event<K>, &mut Vec<K>),
{
    let mut stream = std::pin::pin!(stream);
    let mut buffer = Vec::new();
    while let Some(item) = stream.next().await {
        match item {
            Ok(event) => apply(event, &mut buffer),
            Err(error) => tracing::warn!(watch = what, %error, "watch error; retrying"),
        }
    }
}
