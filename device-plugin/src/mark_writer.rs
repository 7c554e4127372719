//! Writing the allocation marks on the pods (`--allocation-marks`), off the Allocate path.
//!
//! Why a worker of its own: Allocate answers from memory in microseconds, and waiting for
//! the API server there would make kubelet's admission wait on it. So a decision only queues
//! the pod's UID ([`crate::pods`] keeps its marks in the overlay, flagged unwritten), and
//! this one worker writes them in decision order, with retries. It takes a pod's *latest*
//! marks when it gets to it, so a slow write can never overwrite a newer decision, and a pod
//! queued twice is written once.
//!
//! The worker reaches the marks through [`MarkStore`], which the pod cache implements: all
//! it needs is one pod's marks at a time and a way to say how the write went. Naming the
//! cache here had the cache and its worker import each other.

use std::sync::Arc;
use std::time::Duration;

use gpushare_contract::Keys;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::view::Marks;

/// Attempts for one pod patch before waiting for the next reconcile.
const PATCH_ATTEMPTS: u32 = 6;

/// Where the marks wait to be written: the pod cache's overlay ([`crate::pods`]).
pub(crate) trait MarkStore: Send + Sync {
    /// The latest unwritten marks of `uid` (`(namespace, name, marks)`), marked as being
    /// written.
    fn take_dirty(&self, uid: &str) -> Option<(String, String, Marks)>;
    /// Marks `uid`'s marks unwritten again: writing them failed.
    fn set_dirty(&self, uid: &str);
    /// Drops `uid`'s marks: the pod is gone, or another pod has its name now.
    fn forget(&self, uid: &str);
}

/// The worker: writes the marks of each queued pod.
pub(crate) struct MarkWriter<S> {
    /// Holds the marks, and learns how each write went.
    pub(crate) cache: Arc<S>,
    /// Writes the pods.
    pub(crate) client: Client,
    /// The annotation keys of the marks.
    pub(crate) keys: Keys,
    /// Counts the writes.
    pub(crate) metrics: Metrics,
}

/// How writing one pod's marks ended.
enum Written {
    /// The marks are on the pod.
    Done,
    /// The pod is gone, or is another pod under the same name now: its marks are dropped.
    Gone,
    /// Every attempt failed: the marks stay unwritten, for the next reconcile to re-queue.
    Failed,
    /// Shutdown came while waiting to retry.
    Shutdown,
}

impl<S: MarkStore> MarkWriter<S> {
    /// Writes the marks of each UID from `queue` until `shutdown` (or until the queue's
    /// senders are gone).
    pub(crate) async fn run(
        self,
        mut queue: mpsc::UnboundedReceiver<String>,
        shutdown: CancellationToken,
    ) {
        loop {
            let uid = tokio::select! {
                () = shutdown.cancelled() => return,
                uid = queue.recv() => match uid { Some(uid) => uid, None => return },
            };
            let Some((namespace, name, marks)) = self.cache.take_dirty(&uid) else {
                continue;
            };
            match self.write(&uid, &namespace, &name, &marks, &shutdown).await {
                Written::Done => {}
                Written::Gone => self.cache.forget(&uid),
                Written::Failed => self.cache.set_dirty(&uid),
                Written::Shutdown => return,
            }
        }
    }

    /// Patches `marks` onto the pod `namespace/name` with UID `uid`, retrying with backoff.
    async fn write(
        &self,
        uid: &str,
        namespace: &str,
        name: &str,
        marks: &Marks,
        shutdown: &CancellationToken,
    ) -> Written {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        // The UID is a precondition: a pod recreated under the same name (a different
        // pod) answers 409 instead of taking the old pod's marks.
        let patch = serde_json::json!({
            "metadata": {
                "uid": uid,
                "annotations": {
                    self.keys.allocated.as_str(): marks.allocated.join(","),
                    self.keys.assigned.as_str(): marks.assigned.to_string(),
                }
            }
        });
        let pod = format!("{namespace}/{name}");
        let mut attempt = 0;
        loop {
            match api
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    Metrics::patch(&self.metrics.pod_patches, true);
                    tracing::debug!(%pod, allocated = ?marks.allocated, assigned = marks.assigned, "wrote allocation marks");
                    return Written::Done;
                }
                Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {
                    tracing::debug!(%pod, %uid, reason = %status.message, "pod gone or recreated; its marks are dropped");
                    Metrics::patch(&self.metrics.pod_patches, false);
                    return Written::Gone;
                }
                Err(err) => {
                    Metrics::patch(&self.metrics.pod_patches, false);
                    attempt += 1;
                    if attempt >= PATCH_ATTEMPTS {
                        tracing::error!(%pod, error = %err, "cannot write allocation marks; will retry at the next reconcile");
                        return Written::Failed;
                    }
                    tracing::warn!(%pod, error = %err, attempt, "writing allocation marks failed; retrying");
                    let backoff = Duration::from_millis(100 << attempt);
                    tokio::select! {
                        () = shutdown.cancelled() => return Written::Shutdown,
                        () = tokio::time::sleep(backoff) => {}
                    }
                }
            }
        }
    }
}
