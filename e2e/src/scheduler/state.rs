//! The driver's view of the cluster and its scheduling queue, mutated only under one lock and
//! never across an `.await`.
//!
//! It mirrors two pieces of kube-scheduler:
//! - the cache: nodes, and what every node already carries (pods bound to it and not terminal,
//!   plus pods *assumed* there whose bind is still in flight, so the next cycle cannot
//!   over-commit a node while a bind is pending);
//! - the scheduling queue: an active heap (priority, then creation time, then arrival), a backoff
//!   set (pods whose last attempt failed wait `initial * 2^(attempts-1)`, capped), and the
//!   unschedulable set (pods that fit nowhere wait for a cluster change, or a period).
//!
//! ```text
//!   new pod ──► active ──pop──► Scheduling ──assume──► Binding ──ok──► Bound (until the watch
//!                 ▲                 │ FitError            │ error         shows spec.nodeName)
//!                 │                 ▼                     ▼
//!                 ├──── cluster change/period ── Unschedulable
//!                 └──── backoff expired ───────── Backoff ◄──┘
//! ```

use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::jiff::Timestamp;

use super::framework::{self, NodeUsage, PodUsage, Resources};

/// `namespace/name`.
pub type PodKey = String;

pub fn pod_key(pod: &Pod) -> PodKey {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

fn pod_uid(pod: &Pod) -> String {
    pod.metadata.uid.clone().unwrap_or_default()
}

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
    last_attempt: Option<Instant>,
    /// Identifies the pod's current queue entry; older heap entries are stale.
    seq: u64,
}

#[derive(Debug)]
struct Accounted {
    node: String,
    uid: String,
    usage: PodUsage,
    assumed: bool,
    /// `spec.priority`: preemption evicts only pods below the preemptor's.
    priority: i32,
    /// Deleted, waiting out its grace period (a victim on its way out).
    terminating: bool,
}

/// A pod counted on a node, as preemption's dry run weighs it.
#[derive(Clone, Debug)]
pub struct NodePod {
    pub key: PodKey,
    pub uid: String,
    pub priority: i32,
    pub usage: PodUsage,
    pub terminating: bool,
}

#[derive(Debug)]
pub struct NodeEntry {
    pub node: Arc<Node>,
    pub allocatable: Resources,
}

#[derive(Debug, PartialEq, Eq)]
struct ActiveEntry {
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

/// Queue timing and the profile's resource scoring, from [`super::SchedulerConfig`].
#[derive(Clone, Debug)]
pub struct QueueConfig {
    pub scheduler_name: String,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    pub unschedulable_retry: Duration,
    pub fit_scoring: framework::FitScoring,
    /// `percentageOfNodesToScore` (0: adaptive).
    pub percentage_of_nodes_to_score: u32,
}

/// A feasible node with its default-plugin score.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub node: Arc<Node>,
    pub name: String,
    pub score: i64,
}

/// The built-in filter phase's result.
#[derive(Debug, Default)]
pub struct Filtered {
    pub feasible: Vec<Candidate>,
    /// Node → rejection reasons, for nodes that were evaluated and rejected.
    pub statuses: BTreeMap<String, Vec<String>>,
    pub num_all_nodes: usize,
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

#[derive(Debug)]
pub struct State {
    config: QueueConfig,
    pub nodes: BTreeMap<String, NodeEntry>,
    usage: HashMap<String, NodeUsage>,
    accounted: HashMap<PodKey, Accounted>,
    pub pending: HashMap<PodKey, PendingPod>,
    active: BinaryHeap<ActiveEntry>,
    backoff: BinaryHeap<Reverse<(Instant, u64, PodKey)>>,
    unschedulable: BinaryHeap<Reverse<(Instant, u64, PodKey)>>,
    seq: u64,
    move_seq: u64,
    /// The last failure message per pending pod.
    pub reasons: HashMap<PodKey, String>,
    next_start_node_index: usize,
}

impl State {
    pub fn new(config: QueueConfig) -> Self {
        State {
            config,
            nodes: BTreeMap::new(),
            usage: HashMap::new(),
            accounted: HashMap::new(),
            pending: HashMap::new(),
            active: BinaryHeap::new(),
            backoff: BinaryHeap::new(),
            unschedulable: BinaryHeap::new(),
            seq: 0,
            move_seq: 0,
            reasons: HashMap::new(),
            next_start_node_index: 0,
        }
    }

    /// What a node carries now (bound and assumed pods).
    #[cfg(test)]
    pub fn usage(&self, node: &str) -> NodeUsage {
        self.usage.get(node).cloned().unwrap_or_default()
    }

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

    fn activate(&mut self, key: &str) {
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

    fn account(&mut self, key: &str, pod: &Pod, node: String, usage: PodUsage, assumed: bool) {
        let uid = pod_uid(pod);
        let priority = pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0);
        let terminating = pod.metadata.deletion_timestamp.is_some();
        if let Some(old) = self.accounted.get_mut(key)
            && old.node == node
            && old.uid == uid
            && old.usage == usage
        {
            old.assumed = assumed;
            old.terminating = terminating;
            return;
        }
        self.unaccount(key);
        self.usage.entry(node.clone()).or_default().add(&usage);
        self.accounted.insert(
            key.to_owned(),
            Accounted {
                node,
                uid,
                usage,
                assumed,
                priority,
                terminating,
            },
        );
    }

    /// Removes a pod's resources from its node; true if it held any.
    fn unaccount(&mut self, key: &str) -> bool {
        let Some(old) = self.accounted.remove(key) else {
            return false;
        };
        if let Some(usage) = self.usage.get_mut(&old.node) {
            usage.remove(&old.usage);
            if usage.pods == 0 {
                self.usage.remove(&old.node);
            }
        }
        true
    }

    /// A pod was added or changed. Returns true when the change frees resources (a cluster change
    /// that may make unschedulable pods fit).
    pub fn apply_pod(&mut self, pod: Pod) -> bool {
        let key = pod_key(&pod);
        let uid = pod_uid(&pod);
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        if matches!(phase, Some("Succeeded" | "Failed")) {
            self.pending.remove(&key);
            self.reasons.remove(&key);
            return self.unaccount(&key);
        }
        let spec = pod.spec.as_ref();
        if let Some(node) = spec
            .and_then(|s| s.node_name.clone())
            .filter(|n| !n.is_empty())
        {
            self.pending.remove(&key);
            self.reasons.remove(&key);
            let usage = PodUsage::of(&pod);
            self.account(&key, &pod, node, usage, false);
            return false;
        }
        if self.accounted.get(&key).is_some_and(|a| a.uid != uid) {
            self.unaccount(&key);
        }
        let scheduler = spec
            .and_then(|s| s.scheduler_name.as_deref())
            .unwrap_or("default-scheduler");
        let ours =
            scheduler == self.config.scheduler_name && pod.metadata.deletion_timestamp.is_none();
        if !ours {
            self.pending.remove(&key);
            return false;
        }
        match self.pending.get_mut(&key) {
            Some(p) if p.uid == uid => p.pod = Arc::new(pod),
            _ => {
                self.pending.insert(
                    key.clone(),
                    PendingPod {
                        pod: Arc::new(pod),
                        uid,
                        phase: Phase::Active,
                        attempts: 0,
                        last_attempt: None,
                        seq: 0,
                    },
                );
                self.reasons.remove(&key);
                self.activate(&key);
            }
        }
        false
    }

    /// A pod was deleted.
    pub fn delete_pod(&mut self, key: &str) {
        self.pending.remove(key);
        self.reasons.remove(key);
        self.unaccount(key);
    }

    /// After a watch relist: everything not listed is gone.
    pub fn retain_pods(&mut self, listed: &HashSet<PodKey>) {
        let gone: Vec<PodKey> = self
            .pending
            .keys()
            .chain(self.accounted.keys())
            .filter(|k| !listed.contains(*k))
            .cloned()
            .collect();
        for key in gone {
            self.delete_pod(&key);
        }
    }

    pub fn apply_node(&mut self, node: Node) {
        let name = node.metadata.name.clone().unwrap_or_default();
        let allocatable = framework::allocatable(&node);
        self.nodes.insert(
            name,
            NodeEntry {
                node: Arc::new(node),
                allocatable,
            },
        );
    }

    pub fn delete_node(&mut self, name: &str) {
        self.nodes.remove(name);
    }

    pub fn retain_nodes(&mut self, listed: &HashSet<String>) {
        self.nodes.retain(|name, _| listed.contains(name));
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
        match (backoff, retry) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
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

    /// Built-in filters and default scores over the nodes, visiting at most enough nodes to find
    /// `numFeasibleNodesToFind` feasible ones, starting where the previous cycle stopped.
    /// `None` when the cluster has no nodes at all.
    pub fn filter(&mut self, pod: &Pod) -> Option<Filtered> {
        let all = self.nodes.len();
        if all == 0 {
            return None;
        }
        let requests = framework::pod_requests(pod, false);
        let pod_usage = PodUsage::of(pod);
        let want =
            framework::num_feasible_nodes_to_find_at(all, self.config.percentage_of_nodes_to_score);
        let start = self.next_start_node_index % all;
        let entries: Vec<(&String, &NodeEntry)> = self.nodes.iter().collect();
        let mut filtered = Filtered {
            num_all_nodes: all,
            ..Filtered::default()
        };
        let mut processed = 0;
        for offset in 0..all {
            let (name, entry) = entries[(start + offset) % all];
            processed += 1;
            let usage = self.usage.get(name).cloned().unwrap_or_default();
            let reasons =
                framework::filter_node(pod, &requests, &entry.node, &entry.allocatable, &usage);
            if reasons.is_empty() {
                filtered.feasible.push(Candidate {
                    node: entry.node.clone(),
                    name: name.clone(),
                    score: framework::default_score(
                        &self.config.fit_scoring,
                        &entry.allocatable,
                        &usage,
                        &pod_usage,
                    ),
                });
                if filtered.feasible.len() >= want {
                    break;
                }
            } else {
                filtered.statuses.insert(name.clone(), reasons);
            }
        }
        self.next_start_node_index = (start + processed) % all;
        Some(filtered)
    }

    /// The built-in filters on `node` alone (a nominated node), with its default score;
    /// `None` when the node is unknown or rejects the pod.
    pub fn filter_one(&self, pod: &Pod, node: &str) -> Option<Candidate> {
        let entry = self.nodes.get(node)?;
        let usage = self.usage.get(node).cloned().unwrap_or_default();
        let requests = framework::pod_requests(pod, false);
        let reasons =
            framework::filter_node(pod, &requests, &entry.node, &entry.allocatable, &usage);
        reasons.is_empty().then(|| Candidate {
            node: entry.node.clone(),
            name: node.to_owned(),
            score: framework::default_score(
                &self.config.fit_scoring,
                &entry.allocatable,
                &usage,
                &PodUsage::of(pod),
            ),
        })
    }

    /// The scheduler's "assume": the pod's resources count on `node` from now on, before the bind.
    /// False if the pod went away (or changed) during the cycle.
    pub fn assume(&mut self, popped: &Popped, node: &str) -> bool {
        let Some(p) = self.pending.get_mut(&popped.key) else {
            return false;
        };
        if p.uid != popped.uid || p.phase != Phase::Scheduling {
            return false;
        }
        p.phase = Phase::Binding;
        let usage = PodUsage::of(&popped.pod);
        self.account(&popped.key, &popped.pod, node.to_owned(), usage, true);
        true
    }

    /// The pods counted on `node` (bound and assumed), for preemption's dry run.
    pub fn pods_on(&self, node: &str) -> Vec<NodePod> {
        self.accounted
            .iter()
            .filter(|(_, a)| a.node == node)
            .map(|(key, a)| NodePod {
                key: key.clone(),
                uid: a.uid.clone(),
                priority: a.priority,
                usage: a.usage.clone(),
                terminating: a.terminating,
            })
            .collect()
    }

    /// The pods below `priority` counted on each node (bound and assumed), in one pass: what
    /// preemption's dry run may evict. Empty when no pod is below it (the common case of a
    /// cluster without priorities, where the dry run then costs nothing).
    pub fn lower_pods_by_node(&self, priority: i32) -> HashMap<String, Vec<NodePod>> {
        let mut by_node: HashMap<String, Vec<NodePod>> = HashMap::new();
        for (key, a) in self.accounted.iter().filter(|(_, a)| a.priority < priority) {
            by_node.entry(a.node.clone()).or_default().push(NodePod {
                key: key.clone(),
                uid: a.uid.clone(),
                priority: a.priority,
                usage: a.usage.clone(),
                terminating: a.terminating,
            });
        }
        by_node
    }

    /// What `node` carries now and its entry, if it is known.
    pub fn node_and_usage(&self, node: &str) -> Option<(&NodeEntry, NodeUsage)> {
        let entry = self.nodes.get(node)?;
        Some((entry, self.usage.get(node).cloned().unwrap_or_default()))
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

    /// The bind failed: drop the assumption (unless the watch already confirmed the pod there).
    pub fn forget(&mut self, key: &str, uid: &str, node: &str) -> bool {
        if self
            .accounted
            .get(key)
            .is_some_and(|a| a.assumed && a.uid == uid && a.node == node)
        {
            self.unaccount(key)
        } else {
            false
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{node, pod};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn state() -> State {
        State::new(QueueConfig {
            scheduler_name: "default-scheduler".to_owned(),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_millis(350),
            unschedulable_retry: Duration::from_secs(5),
            fit_scoring: framework::FitScoring::default(),
            percentage_of_nodes_to_score: 0,
        })
    }

    fn stored(
        builder: crate::fixtures::PodBuilder,
        uid: &str,
        created_s: i64,
        priority: i32,
    ) -> Pod {
        let mut p = builder.build();
        p.metadata.uid = Some(uid.to_owned());
        p.metadata.creation_timestamp = Some(Time(Timestamp::from_second(created_s).unwrap()));
        if let Some(spec) = p.spec.as_mut() {
            spec.priority = Some(priority);
        }
        p
    }

    fn pop_all(s: &mut State) -> Vec<String> {
        std::iter::from_fn(|| s.pop_active().map(|p| p.key)).collect()
    }

    #[test]
    fn filtering_stops_at_the_profiles_share_of_nodes() {
        let walk = |percentage: u32| {
            let mut s = state();
            s.config.percentage_of_nodes_to_score = percentage;
            for i in 0..300 {
                s.apply_node(node(&format!("n{i:03}")).build());
            }
            let filtered = s.filter(&pod("p").build()).unwrap();
            filtered.feasible.len()
        };
        // Adaptive at 300 nodes: 48 %; 1 % and 30 % fall back to the floor of 100 nodes.
        assert_eq!(walk(0), 144);
        assert_eq!(walk(1), 100);
        assert_eq!(walk(30), 100);
        assert_eq!(walk(50), 150);
        assert_eq!(walk(100), 300);
    }

    #[test]
    fn queue_orders_by_priority_then_creation_then_arrival() {
        let mut s = state();
        s.apply_pod(stored(pod("late"), "1", 300, 0));
        s.apply_pod(stored(pod("early"), "2", 100, 0));
        s.apply_pod(stored(pod("urgent"), "3", 500, 10));
        s.apply_pod(stored(pod("early-too"), "4", 100, 0));
        assert_eq!(
            pop_all(&mut s),
            [
                "default/urgent",
                "default/early",
                "default/early-too",
                "default/late"
            ]
        );
    }

    #[test]
    fn only_our_pending_pods_are_queued() {
        let mut s = state();
        s.apply_pod(stored(
            pod("other").scheduler_name("other-scheduler"),
            "1",
            1,
            0,
        ));
        s.apply_pod(stored(pod("bound").on_node("n1"), "2", 1, 0));
        let mut deleting = stored(pod("deleting"), "3", 1, 0);
        deleting.metadata.deletion_timestamp = Some(Time(Timestamp::from_second(2).unwrap()));
        s.apply_pod(deleting);
        assert!(pop_all(&mut s).is_empty());
        // A pod updated while queued is queued once.
        s.apply_pod(stored(pod("a"), "4", 1, 0));
        s.apply_pod(stored(pod("a"), "4", 1, 0));
        assert_eq!(pop_all(&mut s), ["default/a"]);
    }

    #[test]
    fn failures_back_off_exponentially_up_to_the_cap() {
        let mut s = state();
        s.apply_pod(stored(pod("a"), "u", 1, 0));
        let t0 = Instant::now();
        let mut waits = Vec::new();
        let mut now = t0;
        for _ in 0..4 {
            let popped = s.pop_active().expect("pod is active");
            s.record_failure(
                &popped.key,
                &popped.uid,
                FailureKind::Error,
                popped.move_seq,
                "boom",
                now,
            );
            let Some(Phase::Backoff(until)) = s.phase("default/a") else {
                panic!("pod should be backing off");
            };
            waits.push(until - now);
            s.flush(until - Duration::from_millis(1));
            assert!(s.pop_active().is_none(), "not before the backoff expires");
            now = until;
            s.flush(now);
        }
        let ms: Vec<u128> = waits.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, [100, 200, 350, 350]);
        assert_eq!(s.reasons.get("default/a").map(String::as_str), Some("boom"));
    }

    #[test]
    fn unschedulable_pods_wait_for_a_cluster_change_or_the_retry_period() {
        let mut s = state();
        s.apply_pod(stored(pod("a"), "u", 1, 0));
        let t0 = Instant::now();
        let popped = s.pop_active().unwrap();
        s.record_failure(
            &popped.key,
            &popped.uid,
            FailureKind::Unschedulable,
            popped.move_seq,
            "0/1 nodes",
            t0,
        );
        assert_eq!(s.phase("default/a"), Some(Phase::Unschedulable(t0)));
        s.flush(t0 + Duration::from_secs(1));
        assert!(
            s.pop_active().is_none(),
            "backoff expired, but nothing changed"
        );
        // A cluster change after the backoff moves it straight to active.
        s.move_all_to_active_or_backoff(t0 + Duration::from_secs(1));
        let popped = s.pop_active().expect("moved to active");
        assert!(s.pop_active().is_none());

        // Without any change, the retry period brings it back.
        s.record_failure(
            &popped.key,
            &popped.uid,
            FailureKind::Unschedulable,
            popped.move_seq,
            "0/1 nodes",
            t0,
        );
        assert_eq!(s.next_deadline(), Some(t0 + Duration::from_secs(5)));
        s.flush(t0 + Duration::from_secs(5));
        assert_eq!(pop_all(&mut s), ["default/a"]);
    }

    #[test]
    fn a_cluster_change_during_the_cycle_sends_the_pod_enter_backoff() {
        let mut s = state();
        s.apply_pod(stored(pod("a"), "u", 1, 0));
        let now = Instant::now();
        let popped = s.pop_active().unwrap();
        s.move_all_to_active_or_backoff(now); // e.g. a node was updated mid-cycle
        s.record_failure(
            &popped.key,
            &popped.uid,
            FailureKind::Unschedulable,
            popped.move_seq,
            "0/1 nodes",
            now,
        );
        assert!(matches!(s.phase("default/a"), Some(Phase::Backoff(_))));
    }

    #[test]
    fn assumed_pods_hold_resources_until_forgotten_or_confirmed() {
        let mut s = state();
        s.apply_node(node("n1").gpus(&[8]).build());
        s.apply_pod(stored(pod("a").gpu_mem(6), "ua", 1, 0));
        s.apply_pod(stored(pod("b").gpu_mem(6), "ub", 2, 0));
        let a = s.pop_active().unwrap();
        let filtered = s.filter(&a.pod).unwrap();
        assert_eq!(filtered.feasible.len(), 1);
        assert!(s.assume(&a, "n1"));
        assert_eq!(
            s.usage("n1").requested.get("example.com/gpu-mem"),
            Some(&6000)
        );

        let b = s.pop_active().unwrap();
        let filtered = s.filter(&b.pod).unwrap();
        assert!(filtered.feasible.is_empty(), "a's assumption blocks b");
        assert_eq!(
            filtered.statuses.get("n1").map(Vec::as_slice),
            Some(&["Insufficient example.com/gpu-mem".to_owned()][..])
        );

        // a's bind fails: the assumption goes, b fits again.
        assert!(s.forget(&a.key, &a.uid, "n1"));
        assert!(s.usage("n1").requested.is_empty());
        assert_eq!(s.filter(&b.pod).unwrap().feasible.len(), 1);

        // b is assumed, bound, and confirmed by the watch: forget no longer applies.
        assert!(s.assume(&b, "n1"));
        s.bound(&b.key, &b.uid);
        s.apply_pod(stored(pod("b").gpu_mem(6).on_node("n1"), "ub", 2, 0));
        assert!(!s.forget(&b.key, &b.uid, "n1"));
        assert_eq!(s.usage("n1").pods, 1);
        assert!(s.phase(&b.key).is_none(), "b left the queue for good");

        // A terminal pod frees its node.
        let mut done = stored(pod("b").gpu_mem(6).on_node("n1"), "ub", 2, 0);
        done.status = Some(k8s_openapi::api::core::v1::PodStatus {
            phase: Some("Succeeded".into()),
            ..Default::default()
        });
        assert!(s.apply_pod(done));
        assert_eq!(s.usage("n1").pods, 0);
    }

    #[test]
    fn relist_drops_what_is_gone() {
        let mut s = state();
        s.apply_pod(stored(pod("a"), "ua", 1, 0));
        s.apply_pod(stored(pod("b").on_node("n1"), "ub", 1, 0));
        s.retain_pods(&HashSet::new());
        assert!(s.pending.is_empty());
        assert_eq!(s.usage("n1").pods, 0);
    }
}
