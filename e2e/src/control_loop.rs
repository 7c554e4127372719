//! The plumbing every in-process control loop shares (the DRA scheduler in
//! [`crate::scheduler::dra`], the resourceclaim controller in [`crate::resourceclaim`]): a
//! reflector store per watched kind that wakes the loop on each event, the wait for the next
//! pass, and the stop.
//!
//! Kept apart from the loops themselves so each loop reads as its own decisions, and so
//! both wait and stop the same way; and at the crate's root, below both, so that neither
//! loop imports the other's module for it.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::api::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How often a pass runs without any watch event (the backoff of unschedulable pods).
const RETRY: Duration = Duration::from_millis(500);

/// A reflector store of every `K`, kept by a task pushed on `tasks` that wakes `notify` on
/// each event and ends with `stop`; `who` names the watcher in warnings. Shared by the
/// in-process control loops (the DRA scheduler, the resourceclaim controller).
pub(crate) fn watch<K>(
    who: &'static str,
    client: &Client,
    notify: &Arc<Notify>,
    stop: &CancellationToken,
    tasks: &mut Vec<JoinHandle<()>>,
) -> Store<K>
where
    K: Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    let api: Api<K> = Api::all(client.clone());
    let notify = notify.clone();
    let stop = stop.clone();
    tasks.push(tokio::spawn(async move {
        let stream = watcher(api, watcher::Config::default())
            .default_backoff()
            .reflect(writer);
        let mut stream = std::pin::pin!(stream);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                event = stream.next() => match event {
                    Some(Ok(_)) => notify.notify_one(),
                    Some(Err(err)) => tracing::warn!(error = %err, "{who} watch failed"),
                    None => return,
                },
            }
        }
    }));
    store
}

/// Waits for the next pass of a control loop: a watch event, or [`RETRY`] at the latest.
/// `false` once `stop` is cancelled.
pub(crate) async fn next_pass(stop: &CancellationToken, notify: &Notify) -> bool {
    tokio::select! {
        () = stop.cancelled() => false,
        () = notify.notified() => true,
        () = tokio::time::sleep(RETRY) => true,
    }
}

/// Cancels `stop` and waits for every task of a control loop.
pub(crate) async fn stop_tasks(stop: CancellationToken, tasks: Vec<JoinHandle<()>>) {
    stop.cancel();
    for task in tasks {
        let _ = task.await;
    }
}
