//! The scheduling queue, as kube-scheduler's: an active heap (priority, then creation time,
//! then arrival), a backoff set (pods whose last attempt failed wait
//! `initial * 2^(attempts-1)`, capped), and the unschedulable set (pods that fit nowhere wait
//! for a cluster change, or a period).
//!
//! ```text
//!   new pod ──► active ──pop──► Scheduling ──assume──► Binding ──ok──► Bound (until the watch
//!                 ▲                 │ FitError            │ error         shows spec.nodeName)
//!                 │                 ▼                     ▼
//!                 ├──── cluster change/period ── Unschedulable
//!                 └──── backoff expired ───────── Backoff ◄──┘
//! ```
//!
//! One half of [`State`]; what a node carries is the other, in `cache.rs`.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;

use super::{PodKey, State};

/// Pods waiting in the backoff or unschedulable set, soonest first: (instant, seq, key).
pub(super) type WaitingPods = BinaryHeap<Reverse<(Instant, u64, PodKey)>>;

/// Where a pending pod is in its life with this scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Active,
    Backoff(Instant),
    Unschedulable(Instant),
    Scheduling,
    Binding,
    Bound,
}

/// How a scheduling or binding attempt failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// No node fits (a FitError) and one of the scheduler's own plugins rejected a node:
    /// wait for the cluster to change.
    Unschedulable,
    /// No node fits, but only extenders rejected nodes: no plugin names a cluster event to
    /// wait for, so upstream retries the pod after its backoff (`queueAfterBackoff` in
    /// `determineSchedulingHintForInFlightPod`, `pkg/scheduler/backend/queue`).
    UnschedulableByExtendersOnly,
    /// Something failed (an extender, a bind): retry after backoff.
    Error,
}

#[derive(Debug)]
pub struct PendingPod {
    pub pod: Arc<Pod>,
    pub uid: String,
    pub phase: Phase,
    pub attempts: u32,
    pub(super) last_attempt: Option<Instant>,
    /// Identifies the pod's current queue entry; older heap entries are stale.
    pub(super) seq: u64,
}

#[derive(Debug, PartialEq, Eq)]
pub(super) struct ActiveEntry {
    priority: i32,
    created: Option<Timestamp>,
    seq: u64,
    key: PodKey,
}

impl Ord for ActiveEntry {
    /// The heap pops the greatest: highest priority, then the oldest, then the first queued.
    fn cmp(&self, other: &Self) -> Ordering {
        self.priority
            .cmp(&other.priority)
            .then_with(|| other.created.cmp(&self.created))
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

impl PartialOrd for ActiveEntry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// A pod popped for a scheduling cycle.
#[derive(Clone, Debug)]
pub struct Popped {
    pub key: PodKey,
    pub uid: String,
    pub pod: Arc<Pod>,
    /// `move_seq` when the cycle began: a cluster change during the cycle means a FitError may be
    /// stale, so the pod goes to backoff rather than waiting as unschedulable (upstream's
    /// `moveRequestCycle`).
    pub move_seq: u64,
}

impl State {
    /// `initial * 2^(attempts-1)`, capped at the maximum.
    pub fn backoff_for(&self, attempts: u32) -> Duration {
        let doublings = attempts.saturating_sub(1).min(32);
        self.config
            .backoff_initial
            .saturating_mul(1u32 << doublings.min(31))
            .min(self.config.backoff_max)
    }

    /// Queues the pod anew in the set its `phase` names: active, backing off until an
    /// instant, or unschedulable since one. Older heap entries of the pod go stale.
    pub(super) fn enqueue(&mut self, key: &str, phase: Phase) {
        self.seq += 1;
        let seq = self.seq;
        let Some(p) = self.pending.get_mut(key) else {
            return;
        };
        p.phase = phase;
        p.seq = seq;
        let waiting = |at: Instant| Reverse((at, seq, key.to_owned()));
        match phase {
            Phase::Backoff(until) => self.backoff.push(waiting(until)),
            Phase::Unschedulable(since) => self.unschedulable.push(waiting(since)),
            // Active: a pod is never queued as being scheduled, bound or binding.
            _ => self.active.push(ActiveEntry {
                priority: p.pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0),
                created: p.pod.metadata.creation_timestamp.as_ref().map(|t| t.0),
                seq,
                key: key.to_owned(),
            }),
        }
    }

    /// Leaves the unschedulable set: to backoff if the pod's backoff has not expired, else active.
    fn requeue(&mut self, key: &str, now: Instant) {
        let Some(p) = self.pending.get(key) else {
            return;
        };
        let until = p
            .last_attempt
            .map(|t| t + self.backoff_for(p.attempts))
            .unwrap_or(now);
        if until > now {
            self.enqueue(key, Phase::Backoff(until));
        } else {
            self.enqueue(key, Phase::Active);
        }
    }

    /// A cluster change: every unschedulable pod gets another chance (after its backoff).
    pub fn move_all_to_active_or_backoff(&mut self, now: Instant) {
        self.move_seq += 1;
        let waiting: Vec<PodKey> = self
            .pending
            .iter()
            .filter(|(_, p)| matches!(p.phase, Phase::Unschedulable(_)))
            .map(|(k, _)| k.clone())
            .collect();
        for key in waiting {
            self.requeue(&key, now);
        }
    }

    /// Moves pods whose backoff expired to active, and pods unschedulable for longer than the
    /// retry period out of the unschedulable set.
    pub fn flush(&mut self, now: Instant) {
        for (seq, key) in pop_due(&mut self.backoff, Duration::ZERO, now) {
            if self.is_queued(&key, seq, |phase| matches!(phase, Phase::Backoff(_))) {
                self.enqueue(&key, Phase::Active);
            }
        }
        let retry = self.config.unschedulable_retry;
        for (seq, key) in pop_due(&mut self.unschedulable, retry, now) {
            if self.is_queued(&key, seq, |phase| matches!(phase, Phase::Unschedulable(_))) {
                self.requeue(&key, now);
            }
        }
    }

    /// Whether the heap entry `seq` of `key` is the pod's current one, in a phase `in_set`.
    fn is_queued(&self, key: &str, seq: u64, in_set: impl Fn(Phase) -> bool) -> bool {
        self.pending
            .get(key)
            .is_some_and(|p| p.seq == seq && in_set(p.phase))
    }

    /// When [`flush`](Self::flush) next has work (may be early when heap entries are stale).
    pub fn next_deadline(&self) -> Option<Instant> {
        let backoff = self.backoff.peek().map(|Reverse((t, _, _))| *t);
        let retry = self
            .unschedulable
            .peek()
            .map(|Reverse((t, _, _))| *t + self.config.unschedulable_retry);
        backoff.into_iter().chain(retry).min()
    }

    /// The next pod to schedule, marked as being scheduled.
    pub fn pop_active(&mut self) -> Option<Popped> {
        while let Some(entry) = self.active.pop() {
            if let Some(p) = self.pending.get_mut(&entry.key)
                && p.seq == entry.seq
                && p.phase == Phase::Active
            {
                p.phase = Phase::Scheduling;
                return Some(Popped {
                    key: entry.key,
                    uid: p.uid.clone(),
                    pod: p.pod.clone(),
                    move_seq: self.move_seq,
                });
            }
        }
        None
    }

    /// The bind succeeded: wait for the watch to show the pod on its node.
    pub fn bound(&mut self, key: &str, uid: &str) {
        if let Some(p) = self.pending.get_mut(key)
            && p.uid == uid
            && p.phase == Phase::Binding
        {
            p.phase = Phase::Bound;
        }
        self.reasons.remove(key);
    }

    /// Records a failed attempt of the cycle that popped the pod, and queues it accordingly.
    pub fn record_failure(
        &mut self,
        popped: &Popped,
        kind: FailureKind,
        message: &str,
        now: Instant,
    ) -> Option<Arc<Pod>> {
        let p = self.pending.get_mut(&popped.key)?;
        if p.uid != popped.uid || !matches!(p.phase, Phase::Scheduling | Phase::Binding) {
            return None;
        }
        p.attempts += 1;
        p.last_attempt = Some(now);
        let (attempts, pod) = (p.attempts, p.pod.clone());
        self.reasons.insert(popped.key.clone(), message.to_owned());
        let phase = if kind == FailureKind::Unschedulable && self.move_seq == popped.move_seq {
            Phase::Unschedulable(now)
        } else {
            Phase::Backoff(now + self.backoff_for(attempts))
        };
        self.enqueue(&popped.key, phase);
        Some(pod)
    }

    /// The pod, while it still waits for a node (not bound, not being bound, not gone).
    pub fn waiting_pod(&self, key: &str) -> Option<Arc<Pod>> {
        self.pending
            .get(key)
            .filter(|p| !matches!(p.phase, Phase::Binding | Phase::Bound))
            .map(|p| p.pod.clone())
    }

    #[cfg(test)]
    pub fn phase(&self, key: &str) -> Option<Phase> {
        self.pending.get(key).map(|p| p.phase)
    }
}

/// The heap's entries due by `now` (their instant plus `wait`), popped: (seq, key) each.
fn pop_due(heap: &mut WaitingPods, wait: Duration, now: Instant) -> Vec<(u64, PodKey)> {
    let mut due = Vec::new();
    while let Some(Reverse((at, _, _))) = heap.peek()
        && *at + wait <= now
    {
        let Some(Reverse((_, seq, key))) = heap.pop() else {
            break;
        };
        due.push((seq, key));
    }
    due
}
