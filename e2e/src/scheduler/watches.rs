//! The scheduler's watches of Pods and Nodes: each event is applied to the cache and queue
//! ([`super::state`]), a relist forgets what the list no longer holds, and every change
//! wakes the scheduling loop.
//!
//! The [`Watched`] trait says how the state takes in each kind, so one watch loop serves
//! both; the loop itself is in `driver.rs`.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event as WatchEvent};
use kube::{Api, Resource};
use tokio::sync::oneshot;
use tracing::warn;

use super::shared::Shared;
use super::state::{State, pod_key};

/// How the state takes in one kind of watched object.
pub(super) trait Watched:
    Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static
{
    /// For logs.
    const KIND: &'static str;
    /// The state's key of the object.
    fn key(&self) -> String;
    /// An add or update; `now` is when it arrived.
    fn apply(self, state: &mut State, now: Instant);
    fn delete(&self, state: &mut State, now: Instant);
    /// After a (re)list: forget every object the list did not contain.
    fn retain(state: &mut State, listed: &HashSet<String>);
}

impl Watched for Pod {
    const KIND: &'static str = "pod";

    fn key(&self) -> String {
        pod_key(self)
    }

    fn apply(self, state: &mut State, now: Instant) {
        if state.apply_pod(self) {
            // A pod finished and freed its node's resources.
            state.move_all_to_active_or_backoff(now);
        }
    }

    fn delete(&self, state: &mut State, now: Instant) {
        state.delete_pod(&pod_key(self));
        state.move_all_to_active_or_backoff(now);
    }

    fn retain(state: &mut State, listed: &HashSet<String>) {
        state.retain_pods(listed);
    }
}

impl Watched for Node {
    const KIND: &'static str = "node";

    fn key(&self) -> String {
        self.metadata.name.clone().unwrap_or_default()
    }

    fn apply(self, state: &mut State, now: Instant) {
        state.apply_node(self);
        state.move_all_to_active_or_backoff(now);
    }

    fn delete(&self, state: &mut State, _now: Instant) {
        state
            .nodes
            .remove(self.metadata.name.as_deref().unwrap_or_default());
    }

    fn retain(state: &mut State, listed: &HashSet<String>) {
        state.nodes.retain(|name, _| listed.contains(name));
    }
}

/// Feeds one watch into the state until cancelled; `synced` fires after the first list.
pub(super) async fn watch<K: Watched>(
    shared: Arc<Shared>,
    api: Api<K>,
    synced: oneshot::Sender<()>,
) {
    let mut synced = Some(synced);
    let mut listing: Option<HashSet<String>> = None;
    let stream = watcher::watcher(api, watcher::Config::default()).default_backoff();
    futures::pin_mut!(stream);
    loop {
        let event = tokio::select! {
            _ = shared.cancel.cancelled() => return,
            event = stream.next() => event,
        };
        let Some(event) = event else { return };
        let now = Instant::now();
        let mut state = shared.state();
        match event {
            Err(error) => {
                warn!(%error, kind = K::KIND, "watch failed; retrying");
                continue;
            }
            Ok(WatchEvent::Init) => listing = Some(HashSet::new()),
            Ok(WatchEvent::InitApply(object)) => {
                if let Some(seen) = listing.as_mut() {
                    seen.insert(object.key());
                }
                object.apply(&mut state, now);
            }
            Ok(WatchEvent::InitDone) => {
                if let Some(seen) = listing.take() {
                    K::retain(&mut state, &seen);
                }
                state.move_all_to_active_or_backoff(now);
                if let Some(tx) = synced.take() {
                    let _ = tx.send(());
                }
            }
            Ok(WatchEvent::Apply(object)) => object.apply(&mut state, now),
            Ok(WatchEvent::Delete(object)) => object.delete(&mut state, now),
        }
        drop(state);
        shared.wake.notify_one();
    }
}
