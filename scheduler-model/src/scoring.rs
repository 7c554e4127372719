//! The default profile's scores and the pick of a host: `NodeResourcesFit` (its scoring
//! strategy as the profile configures it) and `NodeResourcesBalancedAllocation` on a 0..=100
//! scale, and the host picked as upstream's score heap picks it. How extender scores are added
//! to these is the in-process scheduler's (`gpushare-e2e`), next to the extender's wire types.

use crate::requests::{CPU, EPHEMERAL_STORAGE, MEMORY, Milli, NodeUsage, PodUsage, Resources};

/// `framework.MaxNodeScore`.
pub const MAX_NODE_SCORE: i64 = 100;

/// `NodeResourcesFitArgs.scoringStrategy.type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FitStrategy {
    /// Prefers the emptier node: `(capacity - requested) * 100 / capacity`.
    LeastAllocated,
    /// Prefers the fuller node: `min(requested, capacity) * 100 / capacity`.
    MostAllocated,
}

impl FitStrategy {
    /// One resource's score on 0..=100 for `requested` (the pod included) of `capacity`
    /// (upstream's `leastRequestedScore` / `mostRequestedScore`); 0 without capacity.
    pub fn resource_score(self, requested: Milli, capacity: Milli) -> i64 {
        if capacity <= 0 {
            return 0;
        }
        let score = match self {
            FitStrategy::LeastAllocated if requested > capacity => 0,
            FitStrategy::LeastAllocated => {
                (capacity - requested) * i128::from(MAX_NODE_SCORE) / capacity
            }
            FitStrategy::MostAllocated => {
                requested.min(capacity) * i128::from(MAX_NODE_SCORE) / capacity
            }
        };
        i64::try_from(score).unwrap_or(0)
    }
}

/// `NodeResourcesFitArgs.scoringStrategy`: the strategy and the resources it weighs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FitScoring {
    pub strategy: FitStrategy,
    /// Resource name and weight, in the profile's order.
    pub resources: Vec<(String, i64)>,
}

impl Default for FitScoring {
    /// Upstream's default: LeastAllocated over cpu and memory, weight 1 each.
    fn default() -> Self {
        FitScoring {
            strategy: FitStrategy::LeastAllocated,
            resources: vec![(CPU.to_owned(), 1), (MEMORY.to_owned(), 1)],
        }
    }
}

impl FitScoring {
    /// `NodeResourcesFit`'s score for a pod with `pod_usage` on a node with `usage`, as
    /// upstream's `resourceAllocationScorer`: cpu and memory count the scoring defaults for
    /// containers without requests; an extended resource the pod does not request, or the node
    /// does not have, is left out of the weighted mean.
    pub fn score(&self, allocatable: &Resources, usage: &NodeUsage, pod_usage: &PodUsage) -> i64 {
        let mut weighted = 0i64;
        let mut weight_sum = 0i64;
        for (name, weight) in &self.resources {
            let Some((capacity, requested)) =
                Self::capacity_and_requested(name, allocatable, usage, pod_usage)
            else {
                continue;
            };
            weighted += self.strategy.resource_score(requested, capacity) * weight;
            weight_sum += weight;
        }
        if weight_sum == 0 {
            return 0;
        }
        weighted / weight_sum
    }

    /// `calculateResourceAllocatableRequest`: the node's allocatable amount and what it would
    /// carry with the pod; `None` where upstream returns `(0, 0)` and skips the resource.
    fn capacity_and_requested(
        name: &str,
        allocatable: &Resources,
        usage: &NodeUsage,
        pod_usage: &PodUsage,
    ) -> Option<(Milli, Milli)> {
        let requested_of = |resources: &Resources| resources.get(name).copied().unwrap_or_default();
        let (node_requested, pod_request) = match name {
            CPU => (usage.non_zero_cpu, pod_usage.non_zero_cpu),
            MEMORY => (usage.non_zero_memory, pod_usage.non_zero_memory),
            EPHEMERAL_STORAGE => (
                requested_of(&usage.requested),
                requested_of(&pod_usage.requested),
            ),
            _ => {
                let pod_request = requested_of(&pod_usage.requested);
                if pod_request == 0 {
                    return None;
                }
                (requested_of(&usage.requested), pod_request)
            }
        };
        let capacity = allocatable.get(name).copied().unwrap_or_default();
        (capacity > 0).then_some((capacity, node_requested + pod_request))
    }
}

/// `NodeResourcesFit` scored as `fit` says plus `NodeResourcesBalancedAllocation` (cpu and
/// memory), weight 1 each, for a pod with `pod_usage` on a node with `usage`.
pub fn default_score(
    fit: &FitScoring,
    allocatable: &Resources,
    usage: &NodeUsage,
    pod_usage: &PodUsage,
) -> i64 {
    let capacity = |name: &str| allocatable.get(name).copied().unwrap_or_default();
    let fit_score = fit.score(allocatable, usage, pod_usage);

    let fraction = |name: &str| -> Option<f64> {
        let cap = capacity(name);
        if cap <= 0 {
            return None;
        }
        let requested = usage.requested.get(name).copied().unwrap_or_default()
            + pod_usage.requested.get(name).copied().unwrap_or_default();
        Some((requested as f64 / cap as f64).min(1.0))
    };
    let balanced = match (fraction(CPU), fraction(MEMORY)) {
        (Some(cpu), Some(memory)) => {
            let std = (cpu - memory).abs() / 2.0;
            ((1.0 - std) * MAX_NODE_SCORE as f64) as i64
        }
        _ => MAX_NODE_SCORE,
    };
    fit_score + balanced
}

/// One candidate in `prioritizeNodes`' result (`framework.NodePluginScores`): the sum of its
/// weighted plugin and extender scores, and the tie-breaker upstream draws for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeScore {
    pub name: String,
    pub total: i64,
    /// `Randomizer`: drawn only for nodes named in some interested extender's answer; every
    /// other node keeps 0 and so loses a tie to any node that was named.
    pub randomizer: u64,
}

impl NodeScore {
    /// A candidate with its score plugins' total, before any extender.
    pub fn new(name: impl Into<String>, total: i64) -> Self {
        Self {
            name: name.into(),
            total,
            randomizer: 0,
        }
    }
}

/// `newSortedNodeScores(list).Pop()`: the node `container/heap` puts on top when it heapifies
/// the list in its order, higher total first, then higher `Randomizer`. Among equals (all with
/// `Randomizer` 0) the winner is decided by the heap's sift-down order, not by chance.
pub fn select_scored_host(nodes: &[NodeScore]) -> Option<&str> {
    let less = |a: &NodeScore, b: &NodeScore| {
        a.total > b.total || (a.total == b.total && a.randomizer > b.randomizer)
    };
    let mut heap: Vec<&NodeScore> = nodes.iter().collect();
    let n = heap.len();
    // heap.Init: down(h, i, n) for i from n/2-1 down to 0.
    for start in (0..n / 2).rev() {
        let mut i = start;
        loop {
            let left = 2 * i + 1;
            if left >= n {
                break;
            }
            let mut child = left;
            if left + 1 < n && less(heap[left + 1], heap[left]) {
                child = left + 1;
            }
            if !less(heap[child], heap[i]) {
                break;
            }
            heap.swap(i, child);
            i = child;
        }
    }
    heap.first().map(|node| node.name.as_str())
}
