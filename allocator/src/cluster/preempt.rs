//! Preemption per GPU: which of a node's pods must go so that a more important pod fits on
//! one GPU (on N GPUs for a multi-GPU pod, on a whole GPU for an exclusive one).
//!
//! Why this is ours to decide: kube-scheduler picks victims by the node's total of the
//! resource, so on a node whose GPUs hold 3 and 4 small pods it may evict one pod from each
//! GPU, free memory on both and room on neither. Here each *target* (a GPU, or a set of N
//! GPUs) is tried on its own:
//!
//! ```text
//!   target GPU g:  pool = evictable pods booked on g, and those whose containers still
//!                  waiting for device allocation pin the request (the twin rule)
//!     1. unbook the whole pool              → does the request fit now?  no: target out
//!     2. give pods back one at a time, the most important first (budget-protected before
//!        the rest, higher priority before lower, smaller before larger), keeping each one
//!        the request still fits beside                                  → the rest are victims
//!   best target: fewest budget violations, then the lowest highest priority among the
//!   victims, then the lowest sum of their priorities, then the fewest victims, then the
//!   fewest GiB evicted
//! ```
//!
//! Step 2 is kube-scheduler's own reprieve (`SelectVictimsOnNode`), asked of our per-GPU fit
//! instead of the node's total; the ranking is kube-scheduler's among candidate nodes. Fit is
//! the decision every bind takes ([`Node::choose`]), so the twin rule and the containers
//! still waiting for device allocation are honoured as they are at bind: the node state the
//! victims leave behind is one a bind can take.
//!
//! Cost: per target, one clone of the node and at most two fit checks per pod of the pool;
//! targets are the node's GPUs, or its N-GPU sets while there are at most [`MAX_TARGETS`] of
//! them (the whole node as one target beyond). Preemption is rare; this runs only then.

use super::{Cluster, Node};
use crate::{PodId, Policy, Request};

/// How many N-GPU sets are tried one by one for a multi-GPU request before the whole node is
/// taken as a single target (8 GPUs, 4 wanted: 70 sets).
pub const MAX_TARGETS: usize = 128;

/// A pod the preemptor may displace: lower priority than the preemptor, on the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evictable {
    /// The pod's UID.
    pub uid: PodId,
    /// Its priority (`spec.priority`).
    pub priority: i32,
    /// Whether evicting it would violate a PodDisruptionBudget.
    pub violates_budget: bool,
}

/// The cheapest set of pods whose eviction makes room for a request on one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Eviction {
    /// The pods to evict, by UID, the most important first (kube-scheduler ranks candidate
    /// nodes by the priority of the first victim); empty when the request fits as it is.
    pub victims: Vec<PodId>,
    /// The GPUs (indices) the request would get once they are gone, best first.
    pub gpus: Vec<u32>,
    /// How many victims are protected by a PodDisruptionBudget.
    pub budget_violations: usize,
    /// The highest priority among the victims (`i32::MIN` when there are none).
    pub highest_priority: i32,
    /// The sum of the victims' priorities.
    pub priority_sum: i64,
    /// GiB the victims hold on the node's GPUs, all together.
    pub evicted_gib: u64,
}

impl Eviction {
    /// The order kube-scheduler ranks candidates in, then the least memory taken away.
    fn rank(&self) -> (usize, i32, i64, usize, u64) {
        (
            self.budget_violations,
            self.highest_priority,
            self.priority_sum,
            self.victims.len(),
            self.evicted_gib,
        )
    }

    fn none() -> Self {
        Self {
            victims: Vec::new(),
            gpus: Vec::new(),
            budget_violations: 0,
            highest_priority: i32::MIN,
            priority_sum: 0,
            evicted_gib: 0,
        }
    }
}

impl Cluster {
    /// The cheapest eviction of `evictable` pods of `node` that lets `request` fit there, or
    /// `None` when no eviction of them does (or the node cannot take the pod at all: unknown,
    /// not taking part, no GPUs). Pods of `evictable` that are not booked on the node are
    /// ignored: their going frees no GPU memory. See the module documentation.
    pub fn eviction(
        &self,
        node_name: &str,
        request: &Request,
        evictable: &[Evictable],
    ) -> Option<Eviction> {
        let node = self.nodes.get(node_name)?;
        node.check_node().ok()?;
        if let Ok(choice) = node.choose(request, Policy::Binpack, &self.workload) {
            let gpus = std::iter::once(choice.first)
                .chain(choice.more)
                .map(|pos| node.gpus[pos].index)
                .collect();
            return Some(Eviction {
                gpus,
                ..Eviction::none()
            });
        }
        // The evictable pods on this node, with the GPU positions each holds memory on.
        let on_node: Vec<(&Evictable, Vec<usize>)> = evictable
            .iter()
            .filter_map(|pod| {
                let placement = node.pods.get(&pod.uid)?;
                Some((pod, node.slots(placement)))
            })
            .filter(|(_, slots)| !slots.is_empty())
            .collect();
        if on_node.is_empty() {
            return None;
        }
        // Pods still waiting for device allocation with a container of a size the request
        // has: the twin rule pins the request to their GPUs, so they are in every target's
        // pool (kept there when the request fits beside them).
        let pins = |pod: &Evictable| {
            node.pods.get(&pod.uid).is_some_and(|placement| {
                placement
                    .pending_sizes()
                    .iter()
                    .any(|size| request.containers.contains(size))
            })
        };
        targets(node, request)
            .into_iter()
            .filter_map(|target| {
                let pool: Vec<&Evictable> = on_node
                    .iter()
                    .filter(|(pod, slots)| {
                        slots.iter().any(|pos| target.contains(pos)) || pins(pod)
                    })
                    .map(|(pod, _)| *pod)
                    .collect();
                self.evict_for(node, request, pool)
            })
            .min_by_key(Eviction::rank)
    }

    /// Step 1 and 2 of the module documentation on one target's `pool`.
    fn evict_for(
        &self,
        node: &Node,
        request: &Request,
        mut pool: Vec<&Evictable>,
    ) -> Option<Eviction> {
        if pool.is_empty() {
            return None;
        }
        let mut scratch = node.scratch();
        for pod in &pool {
            if let Some(placement) = node.pods.get(&pod.uid) {
                scratch.unbook(placement);
            }
        }
        let fits = |scratch: &Node| {
            scratch
                .choose(request, Policy::Binpack, &self.workload)
                .is_ok()
        };
        if !fits(&scratch) {
            return None;
        }
        let size = |pod: &Evictable| node.pods.get(&pod.uid).map_or(0, |p| p.pod_gib);
        // The most important first: they are given back while the request still fits.
        pool.sort_by(|a, b| {
            b.violates_budget
                .cmp(&a.violates_budget)
                .then(b.priority.cmp(&a.priority))
                .then(size(a).cmp(&size(b)))
                .then(a.uid.cmp(&b.uid))
        });
        let mut eviction = Eviction::none();
        let mut victims: Vec<&Evictable> = Vec::new();
        for pod in pool {
            let Some(placement) = node.pods.get(&pod.uid) else {
                continue;
            };
            scratch.book(placement);
            if fits(&scratch) {
                continue;
            }
            scratch.unbook(placement);
            let held: u64 = node
                .slots(placement)
                .iter()
                .map(|&pos| Node::held(placement, node.gpus[pos].total_gib))
                .sum();
            eviction.evicted_gib = eviction.evicted_gib.saturating_add(held);
            eviction.budget_violations += usize::from(pod.violates_budget);
            eviction.highest_priority = eviction.highest_priority.max(pod.priority);
            eviction.priority_sum = eviction
                .priority_sum
                .saturating_add(i64::from(pod.priority));
            victims.push(pod);
        }
        victims.sort_by_key(|pod| std::cmp::Reverse(pod.priority));
        eviction.victims = victims.into_iter().map(|pod| pod.uid.clone()).collect();
        let choice = scratch
            .choose(request, Policy::Binpack, &self.workload)
            .ok()?;
        eviction.gpus = std::iter::once(choice.first)
            .chain(choice.more)
            .map(|pos| node.gpus[pos].index)
            .collect();
        Some(eviction)
    }
}

/// The targets tried on `node` for `request`, as GPU positions: each healthy GPU for a
/// one-GPU request; each set of N healthy GPUs for an N-GPU one while there are at most
/// [`MAX_TARGETS`], else all healthy GPUs as one target.
fn targets(node: &Node, request: &Request) -> Vec<Vec<usize>> {
    let healthy: Vec<usize> = (0..node.gpus.len())
        .filter(|&pos| node.gpus[pos].healthy)
        .collect();
    let wanted = usize::try_from(request.gpus.max(1)).unwrap_or(usize::MAX);
    if wanted > healthy.len() {
        return Vec::new();
    }
    if wanted == 1 {
        return healthy.into_iter().map(|pos| vec![pos]).collect();
    }
    let mut sets = Vec::new();
    if !combinations(&healthy, wanted, &mut Vec::new(), &mut sets) {
        return vec![healthy];
    }
    sets
}

/// Every `k`-subset of `items` appended to `out`, in order; false (and stops) once there
/// would be more than [`MAX_TARGETS`].
fn combinations(
    items: &[usize],
    k: usize,
    current: &mut Vec<usize>,
    out: &mut Vec<Vec<usize>>,
) -> bool {
    if current.len() == k {
        if out.len() == MAX_TARGETS {
            return false;
        }
        out.push(current.clone());
        return true;
    }
    let still_needed = k - current.len();
    for (i, &item) in items.iter().enumerate() {
        if items.len() - i < still_needed {
            break;
        }
        current.push(item);
        let more = combinations(&items[i + 1..], k, current, out);
        current.pop();
        if !more {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::super::tests::gpu;
    use super::*;
    use crate::fragmentation::Host;
    use crate::{Gpu, PodPlacement};

    fn request(gib: u64, gpus: u32) -> Request {
        Request {
            pod_gib: gib * u64::from(gpus),
            containers: vec![gib * u64::from(gpus)],
            host: Host::default(),
            gpus,
            exclusive: false,
            models: Default::default(),
            compute: 0,
        }
    }

    fn on(gpu: u32, gib: u64) -> PodPlacement {
        PodPlacement {
            gpu,
            uuid: format!("GPU-{gpu}").into(),
            more_gpus: Vec::new(),
            pod_gib: gib,
            exclusive: false,
            pending: vec![gib],
            assigned: true,
            compute: 0,
        }
    }

    fn evictable(uid: &str, priority: i32) -> Evictable {
        Evictable {
            uid: uid.into(),
            priority,
            violates_budget: false,
        }
    }

    fn uids(eviction: &Eviction) -> Vec<&str> {
        eviction.victims.iter().map(PodId::as_str).collect()
    }

    /// The issue's node: GPUs of 15 and 16 GiB holding three and four 4 GiB pods; the least
    /// important pod of each GPU (`low-0`, `low-1`) has priority 10, the others 100.
    fn seven_pods() -> (Cluster, Vec<Evictable>) {
        let mut cluster = Cluster::new();
        cluster.set_node("n", vec![gpu(0, 15), gpu(1, 16)], true);
        let mut pods = Vec::new();
        for (gpu, count) in [(0, 3), (1, 4)] {
            for i in 0..count {
                let (uid, priority) = if i == 0 {
                    (format!("low-{gpu}"), 10)
                } else {
                    (format!("mid-{gpu}-{i}"), 100)
                };
                cluster.upsert_pod(uid.as_str().into(), "n", on(gpu, 4));
                pods.push(evictable(&uid, priority));
            }
        }
        (cluster, pods)
    }

    #[test]
    fn an_8_gib_pod_evicts_two_pods_of_one_gpu_not_the_two_least_important() {
        let (cluster, pods) = seven_pods();
        let eviction = cluster.eviction("n", &request(8, 1), &pods).unwrap();
        let victims = uids(&eviction);
        assert_eq!(victims.len(), 2, "{victims:?}");
        let gpu = eviction.gpus[0];
        assert!(
            victims.iter().all(|v| v.contains(&format!("-{gpu}"))),
            "{victims:?} on GPU {gpu}"
        );
        // The least important pod of that GPU goes, and it is listed last (most important first).
        assert_eq!(victims[1], format!("low-{gpu}"));
        assert_eq!(eviction.highest_priority, 100);
        // What kube-scheduler would have done (one pod from each GPU) frees 8 GiB on neither.
        let mut theirs = cluster.clone();
        theirs.remove_pod(&"low-0".into());
        theirs.remove_pod(&"low-1".into());
        assert!(theirs.fit("n", &request(8, 1)).is_err());
        // Ours does.
        let mut ours = cluster.clone();
        for victim in &eviction.victims {
            ours.remove_pod(victim);
        }
        assert_eq!(
            ours.choose_gpu("n", &request(8, 1), Policy::Binpack),
            Ok(gpu)
        );
    }

    #[test]
    fn a_pod_short_of_compute_evicts_the_compute_not_the_memory() {
        // One 16 GiB GPU: a 2 GiB pod holding 70 % compute (priority 10) and two 4 GiB pods
        // without compute (priority 5). A 4 GiB pod asking 50 % has the memory but not the
        // compute: only the compute holder must go, though the others are less important.
        let mut cluster = Cluster::new();
        cluster.set_node("n", vec![gpu(0, 16)], true);
        let busy = PodPlacement {
            compute: 70,
            ..on(0, 2)
        };
        cluster.upsert_pod("busy".into(), "n", busy);
        cluster.upsert_pod("plain-1".into(), "n", on(0, 4));
        cluster.upsert_pod("plain-2".into(), "n", on(0, 4));
        let pods = vec![
            evictable("busy", 10),
            evictable("plain-1", 5),
            evictable("plain-2", 5),
        ];
        let wanted = Request {
            compute: 50,
            containers: vec![3],
            ..request(3, 1)
        };
        assert!(cluster.fit("n", &wanted).is_err());
        let eviction = cluster.eviction("n", &wanted, &pods).unwrap();
        assert_eq!(uids(&eviction), ["busy"]);
    }

    #[test]
    fn a_pod_no_eviction_can_place_evicts_nobody() {
        let (cluster, pods) = seven_pods();
        assert_eq!(cluster.eviction("n", &request(20, 1), &pods), None);
        // Nor when only pods it may not displace are in the way.
        assert_eq!(cluster.eviction("n", &request(8, 1), &[]), None);
        assert_eq!(cluster.eviction("unknown", &request(8, 1), &pods), None);
    }

    #[test]
    fn only_lower_priority_pods_the_caller_lists_are_victims() {
        let (cluster, pods) = seven_pods();
        // Only the two least important pods may go: one from each GPU frees 8 GiB on neither.
        let low: Vec<Evictable> = pods.iter().filter(|p| p.priority == 10).cloned().collect();
        assert_eq!(cluster.eviction("n", &request(8, 1), &low), None);
        // A 7 GiB pod fits once the low pod of GPU 0 alone goes.
        let eviction = cluster.eviction("n", &request(7, 1), &low).unwrap();
        assert_eq!(uids(&eviction), ["low-0"]);
        assert_eq!(eviction.gpus, [0]);
    }

    #[test]
    fn a_two_gpu_pod_evicts_the_fewest_pods_over_two_gpus() {
        let (cluster, pods) = seven_pods();
        let eviction = cluster.eviction("n", &request(8, 2), &pods).unwrap();
        // 3 GiB free on GPU 0 needs two pods gone, 0 on GPU 1 two more.
        assert_eq!(eviction.victims.len(), 4, "{:?}", uids(&eviction));
        let mut gpus = eviction.gpus.clone();
        gpus.sort_unstable();
        assert_eq!(gpus, [0, 1]);
        assert!(uids(&eviction).contains(&"low-0") && uids(&eviction).contains(&"low-1"));
    }

    #[test]
    fn a_whole_gpu_pod_empties_one_gpu() {
        let (cluster, pods) = seven_pods();
        let whole = Request {
            exclusive: true,
            ..request(8, 1)
        };
        let eviction = cluster.eviction("n", &whole, &pods).unwrap();
        // GPU 0 holds three pods, GPU 1 four.
        assert_eq!(eviction.gpus, [0]);
        assert_eq!(eviction.victims.len(), 3);
    }

    #[test]
    fn budget_protected_pods_go_last_and_count() {
        let (cluster, mut pods) = seven_pods();
        for pod in &mut pods {
            pod.violates_budget = pod.uid.as_str().ends_with("-0");
        }
        // GPU 1's pods are unprotected: the victims come from there.
        let eviction = cluster.eviction("n", &request(8, 1), &pods).unwrap();
        assert_eq!(eviction.gpus, [1]);
        assert_eq!(eviction.budget_violations, 0);
    }

    #[test]
    fn a_waiting_twin_pins_the_request_and_can_be_a_victim() {
        let mut cluster = Cluster::new();
        cluster.set_node("n", vec![gpu(0, 16), gpu(1, 16)], true);
        // GPU 1 is full with an 8 GiB pod still waiting for its device and one running;
        // GPU 0 holds a 12 GiB pod.
        let waiting = PodPlacement {
            assigned: false,
            ..on(1, 8)
        };
        cluster.upsert_pod("twin".into(), "n", waiting);
        cluster.upsert_pod("beside".into(), "n", on(1, 8));
        cluster.upsert_pod("big".into(), "n", on(0, 12));
        let pods = [
            evictable("twin", 2),
            evictable("beside", 1),
            evictable("big", 1),
        ];
        // An 8 GiB pod is pinned to GPU 1 by the twin: evicting the 12 GiB pod of GPU 0 would
        // not let it bind. Evicting the running pod beside the twin does.
        assert!(cluster.fit("n", &request(8, 1)).is_err());
        let eviction = cluster.eviction("n", &request(8, 1), &pods).unwrap();
        assert_eq!(uids(&eviction), ["beside"]);
        assert_eq!(eviction.gpus, [1]);
        // Where the twin is the least important pod, it goes instead, and the pin with it.
        let pods = [
            evictable("twin", 1),
            evictable("beside", 2),
            evictable("big", 2),
        ];
        let eviction = cluster.eviction("n", &request(8, 1), &pods).unwrap();
        assert_eq!(uids(&eviction), ["twin"]);
        // A 4 GiB pod fits as it is: nobody goes.
        let eviction = cluster.eviction("n", &request(4, 1), &pods).unwrap();
        assert!(eviction.victims.is_empty());
    }

    /// GPU sizes; pods as (GiB, priority: 0 is not listed, waiting for its device); the
    /// request's GiB per GPU, GPUs and whether whole.
    type NodeCase = (Vec<u64>, Vec<(u64, i32, bool)>, u64, u32, bool);

    fn node_strategy() -> impl Strategy<Value = NodeCase> {
        (
            prop::collection::vec(prop::sample::select(vec![8u64, 15, 16, 24]), 1..5),
            prop::collection::vec((1u64..9, 0i32..4, any::<bool>()), 0..14),
            1u64..17,
            1u32..3,
            any::<bool>(),
        )
    }

    proptest! {
        /// Whatever the node: victims are only listed pods of the node; once they are gone
        /// the request binds (reserve books it); and `None` means that even evicting every
        /// listed pod would not make room.
        #[test]
        fn an_eviction_makes_room_and_none_means_none_can(
            (gpus, pods, gib, wanted, exclusive) in node_strategy()
        ) {
            let mut cluster = Cluster::new();
            let gpus: Vec<Gpu> = gpus.iter().enumerate().map(|(i, &g)| gpu(i as u32, g)).collect();
            cluster.set_node("n", gpus, true);
            let mut listed = Vec::new();
            for (i, (pod_gib, priority, waiting)) in pods.iter().enumerate() {
                let uid = PodId::from(format!("p{i}"));
                let ask = Request { containers: vec![*pod_gib], ..request(*pod_gib, 1) };
                if cluster.reserve(uid.clone(), "n", &ask, Policy::Binpack).is_err() {
                    continue;
                }
                if !*waiting {
                    let (_, placement) = cluster.pod(&uid).unwrap();
                    let placement = PodPlacement { assigned: true, ..placement.clone() };
                    cluster.upsert_pod(uid.clone(), "n", placement);
                }
                if *priority > 0 {
                    listed.push(evictable(uid.as_str(), *priority));
                }
            }
            let ask = Request { exclusive, ..request(gib, wanted) };
            match cluster.eviction("n", &ask, &listed) {
                Some(eviction) => {
                    let mut after = cluster.clone();
                    for victim in &eviction.victims {
                        prop_assert!(listed.iter().any(|p| p.uid == *victim));
                        prop_assert!(after.remove_pod(victim).is_some());
                    }
                    prop_assert!(after.reserve("preemptor".into(), "n", &ask, Policy::Binpack).is_ok());
                }
                None => {
                    let mut after = cluster.clone();
                    for pod in &listed {
                        after.remove_pod(&pod.uid);
                    }
                    prop_assert!(after.fit("n", &ask).is_err());
                }
            }
        }
    }
}
