//! The driver's view of the cluster and its scheduling queue, mutated only under one lock and
//! never across an `.await`.
//!
//! It mirrors two pieces of kube-scheduler, a module each:
//! - `cache`: nodes, and what every node already carries (bound pods, and pods assumed there
//!   whose bind is still in flight);
//! - `queue`: the scheduling queue (active, backoff and unschedulable pods).
//!
//! Both are halves of one [`State`] behind one lock, because a pod's changes move it in both
//! at once; those changes are here: a pod added, changed or deleted, a relist, and the assume
//! that ends a scheduling cycle.

mod cache;
mod queue;

use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;

use super::SchedulerConfig;
use super::framework::NodeUsage;
use cache::Accounted;
use queue::{ActiveEntry, WaitingPods};

pub use cache::{Candidate, NodeEntry};
pub use queue::{FailureKind, PendingPod, Phase, Popped};

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

#[derive(Debug, Default)]
pub struct State {
    /// Read for the pods that are ours, queue timing, the walk's length and fit scoring.
    config: SchedulerConfig,
    pub nodes: BTreeMap<String, NodeEntry>,
    usage: HashMap<String, NodeUsage>,
    accounted: HashMap<PodKey, Accounted>,
    pub pending: HashMap<PodKey, PendingPod>,
    active: BinaryHeap<ActiveEntry>,
    backoff: WaitingPods,
    unschedulable: WaitingPods,
    seq: u64,
    move_seq: u64,
    /// The last failure message per pending pod.
    pub reasons: HashMap<PodKey, String>,
    next_start_node_index: usize,
}

impl State {
    pub fn new(config: SchedulerConfig) -> Self {
        State {
            config,
            ..State::default()
        }
    }

    /// A pod was added or changed. Returns true when the change frees resources (a cluster change
    /// that may make unschedulable pods fit).
    pub fn apply_pod(&mut self, pod: Pod) -> bool {
        let key = pod_key(&pod);
        let uid = pod_uid(&pod);
        if gpushare_contract::request::pod_is_finished(&pod) {
            return self.delete_pod(&key);
        }
        let spec = pod.spec.as_ref();
        if let Some(node) = spec
            .and_then(|s| s.node_name.clone())
            .filter(|n| !n.is_empty())
        {
            self.pending.remove(&key);
            self.reasons.remove(&key);
            self.account(&key, &pod, node, false);
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
                self.enqueue(&key, Phase::Active);
            }
        }
        false
    }

    /// A pod was deleted (or finished). True when that freed resources on a node.
    pub fn delete_pod(&mut self, key: &str) -> bool {
        self.pending.remove(key);
        self.reasons.remove(key);
        self.unaccount(key)
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
        self.account(&popped.key, &popped.pod, node.to_owned(), true);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{PodBuilder, node, pod};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;
    use std::time::{Duration, Instant};

    fn state() -> State {
        State::new(SchedulerConfig {
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_millis(350),
            unschedulable_retry: Duration::from_secs(5),
            ..SchedulerConfig::default()
        })
    }

    /// The pod as the API server stores it: with a UID and a creation time.
    fn stored(builder: PodBuilder, uid: &str, created_s: i64) -> Pod {
        let mut p = builder.build();
        p.metadata.uid = Some(uid.to_owned());
        p.metadata.creation_timestamp = Some(Time(Timestamp::from_second(created_s).unwrap()));
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
        s.apply_pod(stored(pod("late"), "1", 300));
        s.apply_pod(stored(pod("early"), "2", 100));
        s.apply_pod(stored(pod("urgent").priority(10), "3", 500));
        s.apply_pod(stored(pod("early-too"), "4", 100));
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
        let other = pod("other").scheduler_name("other-scheduler");
        s.apply_pod(stored(other, "1", 1));
        s.apply_pod(stored(pod("bound").on_node("n1"), "2", 1));
        let mut deleting = stored(pod("deleting"), "3", 1);
        deleting.metadata.deletion_timestamp = Some(Time(Timestamp::from_second(2).unwrap()));
        s.apply_pod(deleting);
        assert!(pop_all(&mut s).is_empty());
        // A pod updated while queued is queued once.
        s.apply_pod(stored(pod("a"), "4", 1));
        s.apply_pod(stored(pod("a"), "4", 1));
        assert_eq!(pop_all(&mut s), ["default/a"]);
    }

    #[test]
    fn failures_back_off_exponentially_up_to_the_cap() {
        let mut s = state();
        s.apply_pod(stored(pod("a"), "u", 1));
        let t0 = Instant::now();
        let mut waits = Vec::new();
        let mut now = t0;
        for _ in 0..4 {
            let popped = s.pop_active().expect("pod is active");
            s.record_failure(&popped, FailureKind::Error, "boom", now);
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
        s.apply_pod(stored(pod("a"), "u", 1));
        let t0 = Instant::now();
        let popped = s.pop_active().unwrap();
        s.record_failure(&popped, FailureKind::Unschedulable, "0/1 nodes", t0);
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
        s.record_failure(&popped, FailureKind::Unschedulable, "0/1 nodes", t0);
        assert_eq!(s.next_deadline(), Some(t0 + Duration::from_secs(5)));
        s.flush(t0 + Duration::from_secs(5));
        assert_eq!(pop_all(&mut s), ["default/a"]);
    }

    #[test]
    fn a_cluster_change_during_the_cycle_sends_the_pod_enter_backoff() {
        let mut s = state();
        s.apply_pod(stored(pod("a"), "u", 1));
        let now = Instant::now();
        let popped = s.pop_active().unwrap();
        s.move_all_to_active_or_backoff(now); // e.g. a node was updated mid-cycle
        s.record_failure(&popped, FailureKind::Unschedulable, "0/1 nodes", now);
        assert!(matches!(s.phase("default/a"), Some(Phase::Backoff(_))));
    }

    #[test]
    fn assumed_pods_hold_resources_until_forgotten_or_confirmed() {
        let mut s = state();
        s.apply_node(node("n1").gpus(&[8]).build());
        s.apply_pod(stored(pod("a").gpu_mem(6), "ua", 1));
        s.apply_pod(stored(pod("b").gpu_mem(6), "ub", 2));
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
        s.apply_pod(stored(pod("b").gpu_mem(6).on_node("n1"), "ub", 2));
        assert!(!s.forget(&b.key, &b.uid, "n1"));
        assert_eq!(s.usage("n1").pods, 1);
        assert!(s.phase(&b.key).is_none(), "b left the queue for good");

        // A terminal pod frees its node.
        let mut done = stored(pod("b").gpu_mem(6).on_node("n1"), "ub", 2);
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
        s.apply_pod(stored(pod("a"), "ua", 1));
        s.apply_pod(stored(pod("b").on_node("n1"), "ub", 1));
        s.retain_pods(&HashSet::new());
        assert!(s.pending.is_empty());
        assert_eq!(s.usage("n1").pods, 0);
    }
}
