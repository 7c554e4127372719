//! The idle-GPU taint (`--idle-gpu-taint`): `<domain>/idle-gpu:PreferNoSchedule` on every
//! gpushare node with a healthy GPU nothing is booked on, kept by the replica that binds.
//!
//! ```text
//!  every 2 s, leader only:  view.idle_gpu_taint_drift()  ──▶  nodes whose taint is wrong,
//!                           each with its taints and resourceVersion as the watch showed them
//!                           for each (at most 100):  taints ± ours ──▶
//!                           merge patch with that resourceVersion (a 409: next pass)
//!  node watch ──▶ view (which nodes carry it)  ──▶  the drift shrinks to nothing
//! ```
//!
//! Why: pods that ask for no GPU memory never reach gpushare; the cluster's default scheduler
//! places them, and its LeastAllocated score sends them first to the emptiest nodes: the GPU
//! servers whose GPUs are all free, the only ones a job needing several whole GPUs and their
//! share of the node's CPU can still take. A `PreferNoSchedule` taint is read by
//! kube-scheduler's TaintToleration score (weight 3 in its default profile, so up to 300
//! points against at most 200 for CPU and memory): such pods then prefer nodes whose GPUs are
//! all in use, where room is left. It is a preference, never a refusal: with no other node
//! that fits, a pod still goes to a tainted one. `realistic-sim` measures what it gains
//! (docs/performance.md).
//!
//! GPU pods: the chart's routing gives the pods it routes a toleration of the taint
//! (`gpushare_admission`, and the routing policy), so it never outweighs their own soft
//! preferences, and the filter that keeps the best node places them as before. A GPU pod
//! without the toleration (not routed) meets it like any `PreferNoSchedule` taint: the filter
//! steps aside, and kube-scheduler's scores prefer, among the nodes that fit it, those
//! without an idle GPU.
//!
//! The taint's list is written whole (a Node's taints have no merge key), computed from the
//! list the node watch last delivered, and the write carries that resourceVersion: a taint
//! someone else set since is never lost, the write fails with 409 and the node is tried again
//! on the next pass, by when the watch has shown the change. No read before the write: a read
//! is one more request per write for the API server, which is busy with the Bindings while
//! the taint follows a drain (docs/performance.md). With the flag off
//! the same loop takes the taint off every node that still carries it, so turning it off in
//! the chart cleans up. Writes are capped per pass, so a burst that fills a thousand nodes at
//! once costs the API server a hundred node writes every 2 s, not a thousand at once.

use std::sync::Arc;
use std::time::Duration;

use gpushare_contract::taints::idle_gpu_taint;
use k8s_openapi::api::core::v1::{Node, Taint};
use kube::Api;
use kube::api::{Patch, PatchParams};

use crate::scheduling::Scheduling;
use crate::scheduling::view::TaintDrift;

/// How often the taints are compared with the view.
pub const PERIOD: Duration = Duration::from_secs(2);

/// Node writes per pass at most.
pub const WRITES_PER_PASS: usize = 100;

/// What one write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The taint was added.
    Added,
    /// The taint was taken off.
    Removed,
    /// The node already was as wanted when the watch last showed it.
    Unchanged,
    /// The node changed since the watch showed it, or is gone: next pass.
    Retry,
}

impl Outcome {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Added => "added",
            Outcome::Removed => "removed",
            Outcome::Unchanged => "unchanged",
            Outcome::Retry => "retry",
        }
    }
}

/// `taints` with the taint `key` (`PreferNoSchedule`) present or absent as `wanted`, and
/// every other taint as it was; `None` when that is what `taints` already is.
pub fn with_idle_gpu_taint(taints: &[Taint], key: &str, wanted: bool) -> Option<Vec<Taint>> {
    let ours = |t: &Taint| t.key == key && t.effect == "PreferNoSchedule";
    let carries = taints.iter().any(ours);
    if carries == wanted {
        return None;
    }
    let mut updated: Vec<Taint> = taints.iter().filter(|t| !ours(t)).cloned().collect();
    if wanted {
        updated.push(idle_gpu_taint(key));
    }
    Some(updated)
}

/// Sets the taint `key` on `drift`'s node as it wants, from its taints as the watch showed
/// them, with their resourceVersion (no read first).
pub async fn set_idle_gpu_taint(
    nodes: &Api<Node>,
    drift: &TaintDrift,
    key: &str,
) -> Result<Outcome, kube::Error> {
    let Some(updated) = with_idle_gpu_taint(&drift.seen.taints, key, drift.wanted) else {
        return Ok(Outcome::Unchanged);
    };
    let patch = serde_json::json!({
        "metadata": { "resourceVersion": drift.seen.resource_version },
        "spec": { "taints": updated },
    });
    match nodes
        .patch(&drift.node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => Ok(if drift.wanted {
            Outcome::Added
        } else {
            Outcome::Removed
        }),
        Err(kube::Error::Api(status)) if status.code == 409 || status.code == 404 => {
            Ok(Outcome::Retry)
        }
        Err(error) => Err(error),
    }
}

/// Keeps the idle-GPU taint on the nodes that should carry it (`enabled`), and off the
/// others, every [`PERIOD`], while this replica leads and the view has synced. Runs until
/// aborted. A pass that met API errors logs one warning (how many, and the first), and its
/// nodes are tried again on the next pass.
pub async fn keep_idle_gpu_taints(client: kube::Client, state: Scheduling, enabled: bool) {
    let nodes: Api<Node> = Api::all(client);
    let key = state.view().settings().keys.node_idle_gpu_taint.clone();
    tracing::info!(enabled, taint = %key, "keeping the idle-GPU taint (PreferNoSchedule) on nodes with an idle GPU");
    let mut tick = tokio::time::interval(PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if !state.leadership().is_leader() {
            state.metrics().idle_gpu_tainted_nodes.set(0);
            continue;
        }
        let drift: Vec<TaintDrift> = {
            let view = state.view();
            if !view.is_synced() {
                continue;
            }
            state
                .metrics()
                .idle_gpu_tainted_nodes
                .set(view.idle_gpu_tainted_nodes() as i64);
            view.idle_gpu_taint_drift(enabled)
        };
        let mut failed: Option<(Arc<str>, kube::Error)> = None;
        let mut failures = 0;
        for drift in drift.iter().take(WRITES_PER_PASS) {
            let outcome = match set_idle_gpu_taint(&nodes, drift, &key).await {
                Ok(outcome) => outcome,
                Err(error) => {
                    failures += 1;
                    failed.get_or_insert((drift.node.clone(), error));
                    Outcome::Retry
                }
            };
            tracing::debug!(node = %drift.node, wanted = drift.wanted, outcome = outcome.label(), "idle-GPU taint");
            state.metrics().record_idle_gpu_taint(outcome.label());
        }
        if let Some((node, error)) = failed {
            tracing::warn!(failures, first = %node, %error, "cannot update the idle-GPU taint of some nodes; trying again");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "gpushare.example.com/idle-gpu";

    fn taint(key: &str, effect: &str) -> Taint {
        Taint {
            key: key.to_owned(),
            effect: effect.to_owned(),
            ..Taint::default()
        }
    }

    #[test]
    fn the_taint_is_added_or_taken_off_and_every_other_taint_stays() {
        let theirs = vec![
            taint("node.kubernetes.io/not-ready", "NoSchedule"),
            taint("dedicated", "PreferNoSchedule"),
            // Our key with another effect is someone else's taint.
            taint(KEY, "NoSchedule"),
        ];
        let added = with_idle_gpu_taint(&theirs, KEY, true).unwrap();
        assert_eq!(added[..3], theirs[..]);
        assert_eq!(added[3], taint(KEY, "PreferNoSchedule"));
        assert_eq!(added.len(), 4);
        // Already so: nothing to write.
        assert_eq!(with_idle_gpu_taint(&added, KEY, true), None);
        assert_eq!(with_idle_gpu_taint(&theirs, KEY, false), None);
        // Taken off, the others in their order.
        let mut carrying = theirs.clone();
        carrying.insert(1, taint(KEY, "PreferNoSchedule"));
        assert_eq!(with_idle_gpu_taint(&carrying, KEY, false), Some(theirs));
        assert_eq!(
            with_idle_gpu_taint(&[], KEY, true),
            Some(vec![taint(KEY, "PreferNoSchedule")])
        );
    }
}
