//! Watch streams: newline-delimited `{"type":..,"object":..}` over a chunked response.
//!
//! A watch replays the store's history after its starting resourceVersion, then follows live
//! writes. It applies the request's namespace and selectors to the object before and after
//! each write, so an object that stops matching arrives as DELETED and one that starts
//! matching as ADDED, as from the real server. It ends on `timeoutSeconds`, on
//! [`super::Faults::drop_watches`], on shutdown, or when the client goes away. A start before
//! the held history gets one ERROR event carrying a 410 Expired `Status`, then the end.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::response::Response;
use http::{StatusCode, header};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_stream::wrappers::ReceiverStream;

use super::App;
use super::objects::meta_str;
use super::resources::Kind;
use super::selector::Selector;
use super::status::ApiError;
use super::store::{Change, ChangeType};

/// How often a watch that allows bookmarks gets one.
const BOOKMARK_INTERVAL: Duration = Duration::from_secs(1);

/// Where a watch starts.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Start {
    /// Synthetic ADDED events for the current state, then live (no or "0" resourceVersion).
    Current,
    /// Everything after this resourceVersion.
    After(u64),
}

pub(crate) struct WatchRequest {
    pub kind: Kind,
    pub namespace: Option<String>,
    pub selector: Selector,
    pub start: Start,
    pub bookmarks: bool,
    /// `sendInitialEvents=true`: end the initial ADDED events with an annotated bookmark.
    pub initial_events_end: bool,
    pub timeout: Duration,
}

impl WatchRequest {
    /// The node a pod watch is scoped to by `spec.nodeName=<node>`, if any.
    fn pod_node(&self) -> Option<&str> {
        self.selector.node_name().filter(|_| self.kind == Kind::Pod)
    }

    fn visible(&self, object: &Value) -> bool {
        let namespace_ok = self
            .namespace
            .as_deref()
            .is_none_or(|ns| meta_str(object, "namespace") == Some(ns));
        namespace_ok && self.selector.matches(object)
    }

    /// The event line this watch sends for `change`, if any.
    fn event_for(&self, change: &Change) -> Option<Bytes> {
        if change.kind != self.kind {
            return None;
        }
        // A node-scoped pod watch: another node's pod can match neither before nor after.
        if let Some(node) = self.pod_node()
            && !change.pod_nodes.iter().any(|n| n == node)
        {
            return None;
        }
        let now = self.visible(&change.object);
        let before = change.old.as_ref().is_some_and(|old| self.visible(old));
        let kind = match change.change {
            ChangeType::Added => now.then_some("ADDED"),
            ChangeType::Modified => match (before, now) {
                (true, true) => Some("MODIFIED"),
                (false, true) => Some("ADDED"),
                (true, false) => Some("DELETED"),
                (false, false) => None,
            },
            ChangeType::Deleted => before.then_some("DELETED"),
        }?;
        // The object is serialized once per change, whoever watches it.
        let line = format!("{{\"type\":\"{kind}\",\"object\":{}}}\n", change.json());
        Some(Bytes::from(line))
    }

    fn bookmark(&self, rv: u64, initial_end: bool) -> Value {
        let mut metadata = json!({"resourceVersion": rv.to_string()});
        if initial_end {
            metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        json!({
            "type": "BOOKMARK",
            "object": {"kind": self.kind.kind(), "apiVersion": self.kind.api_version(), "metadata": metadata}
        })
    }
}

type Tx = mpsc::Sender<Result<Bytes, Infallible>>;

/// Starts the stream and answers with its response at once (headers first, events as they come).
pub(crate) fn serve(app: App, request: WatchRequest) -> Response {
    let (tx, rx) = mpsc::channel(256);
    tokio::spawn(run(app, request, tx));
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CACHE_CONTROL, "no-cache, private")
        .body(Body::from_stream(ReceiverStream::new(rx)))
        .unwrap_or_else(|_| Response::new(Body::empty()))
}

/// Sends one event; false when the client has gone.
async fn send(tx: &Tx, event: &Value) -> bool {
    send_line(tx, Bytes::from(format!("{event}\n"))).await
}

/// Sends one event line; false when the client has gone.
async fn send_line(tx: &Tx, line: Bytes) -> bool {
    tx.send(Ok(line)).await.is_ok()
}

async fn run(app: App, request: WatchRequest, tx: Tx) {
    let mut dropped = app.faults.drop_signal();
    dropped.borrow_and_update();
    // A pod watch scoped to one node only needs waking for pods on that node.
    let mut versions = match request.pod_node() {
        Some(node) => app.store.subscribe_pods_on(node),
        None => app.store.subscribe(),
    };
    versions.borrow_and_update();
    let deadline = Instant::now() + request.timeout;

    let mut position = match request.start {
        Start::After(rv) => rv,
        Start::Current => {
            let (objects, rv) = app.store.read(|store| {
                let objects: Vec<Value> = store
                    .list(request.kind, request.namespace.as_deref())
                    .map(|(_, object)| object)
                    .filter(|object| request.selector.matches(object))
                    .cloned()
                    .collect();
                (objects, store.resource_version())
            });
            for object in objects {
                if !send(&tx, &json!({"type": "ADDED", "object": object})).await {
                    return;
                }
            }
            if request.initial_events_end && !send(&tx, &request.bookmark(rv, true)).await {
                return;
            }
            rv
        }
    };

    let mut bookmarks =
        tokio::time::interval_at(Instant::now() + BOOKMARK_INTERVAL, BOOKMARK_INTERVAL);
    bookmarks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        versions.borrow_and_update();
        let changes = app.store.read(|store| store.changes_since(position));
        match changes {
            Err(expired) => {
                let status = ApiError::expired(format!(
                    "too old resource version: {} ({})",
                    expired.requested, expired.oldest
                ));
                let _ = send(&tx, &json!({"type": "ERROR", "object": status.to_status()})).await;
                return;
            }
            Ok(changes) => {
                for change in changes {
                    position = change.rv;
                    if let Some(event) = request.event_for(&change)
                        && !send_line(&tx, event).await
                    {
                        return;
                    }
                }
            }
        }
        tokio::select! {
            biased;
            _ = app.cancel.cancelled() => return,
            _ = dropped.changed() => return,
            _ = tx.closed() => return,
            _ = tokio::time::sleep_until(deadline) => return,
            changed = versions.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            _ = bookmarks.tick(), if request.bookmarks => {
                if !send(&tx, &request.bookmark(position, false)).await {
                    return;
                }
            }
        }
    }
}
