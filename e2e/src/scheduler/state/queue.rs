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
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;

use super::{PodKey, State};

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

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    pub(super) fn activate(&mut self, key: &str) {
        let seq = self.next_seq();
        let Some(p) = self.pending.get_mut(key) else {
            return;
        };
        p.phase = Phase::Active;
        p.seq = seq;
        let spec = p.pod.spec.as_ref();
        self.active.push(ActiveEntry {
            priority: spec.and_then(|s| s.priority).unwrap_or(0),
            created: p.pod.metadata.creation_timestamp.as_ref().map(|t| t.0),
            seq,
            key: key.to_owned(),
        });
    }

    fn enter_backoff(&mut self, key: &str, until: Instant) {
        let seq = self.next_seq();
        if let Some(p) = self.pending.get_mut(key) {
            p.phase = Phase::Backoff(until);
            p.seq = seq;
            self.backoff.push(Reverse((until, seq, key.to_owned())));
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
            self.enter_backoff(key, until);
        } else {
            self.activate(key);
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
        while let Some(Reverse((until, _, _))) = self.backoff.peek()
            && *until <= now
        {
            let Some(Reverse((_, seq, key))) = self.backoff.pop() else {
                break;
            };
            if self
                .pending
                .get(&key)
                .is_some_and(|p| p.seq == seq && matches!(p.phase, Phase::Backoff(_)))
            {
                self.activate(&key);
            }
        }
        let retry = self.config.unschedulable_retry;
        while let Some(Reverse((since, _, _))) = self.unschedulable.peek()
            && *since + retry <= now
        {
            let Some(Reverse((_, seq, key))) = self.unschedulable.pop() else {
                break;
            };
            if self
                .pending
                .get(&key)
                .is_some_and(|p| p.seq == seq && matches!(p.phase, Phase::Unschedulable(_)))
            {
                self.requeue(&key, now);
            }
        }
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

    /// Records a failed attempt and queues the pod accordingly.
    pub fn record_failure(
        &mut self,
        key: &str,
        uid: &str,
        kind: FailureKind,
        cycle_move_seq: u64,
        message: &str,
        now: Instant,
    ) -> Option<Arc<Pod>> {
        let move_seq = self.move_seq;
        let p = self.pending.get_mut(key)?;
        if p.uid != uid || !matches!(p.phase, Phase::Scheduling | Phase::Binding) {
            return None;
        }
        p.attempts += 1;
        p.last_attempt = Some(now);
        let attempts = p.attempts;
        let pod = p.pod.clone();
        self.reasons.insert(key.to_owned(), message.to_owned());
        if kind == FailureKind::Unschedulable && move_seq == cycle_move_seq {
            let seq = self.next_seq();
            if let Some(p) = self.pending.get_mut(key) {
                p.phase = Phase::Unschedulable(now);
                p.seq = seq;
            }
            self.unschedulable.push(Reverse((now, seq, key.to_owned())));
        } else {
            let until = now + self.backoff_for(attempts);
            self.enter_backoff(key, until);
        }
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
