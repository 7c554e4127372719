//! kube-scheduler's default CPU and memory scores, for the filter that keeps only the best
//! node (`--filter-keep-best`).
//!
//! Why the extender computes them: when filter passes one node, kube-scheduler binds it
//! without scoring, so the node it would have chosen with scores (its `NodeResourcesFit` and
//! `NodeResourcesBalancedAllocation` plus our prioritize score × weight × 10) must be chosen by
//! the extender. Leaving them out packed worse once CPU ran short (docs/performance.md,
//! "Cost to kube-scheduler", keeping the best node in filter): LeastAllocated steers pods away from nodes whose CPU is nearly
//! gone, where the GPU memory left would be stranded. The extender leaves both out only while
//! multi-GPU pods dominate the demand ([`crate::demand_mix`]).
//!
//! Upstream's arithmetic, integer for integer where it is integer:
//! - `NodeResourcesFit`, LeastAllocated over CPU and memory (weight 1 each):
//!   `(allocatable − requested) × 100 / allocatable` per resource, the mean of the two. It
//!   counts requests as `NonZeroRequested`: a pod asking no CPU counts 100 m, no memory
//!   200 MiB ([`non_zero`]).
//! - `NodeResourcesBalancedAllocation` over CPU and memory: `100 × (1 − σ)`, σ the standard
//!   deviation of the two requested fractions (each capped at 1), truncated. It counts the
//!   requests as they are.
//!
//! Memory is counted in MiB, not bytes: a score may differ from kube-scheduler's by one
//! point on a node whose figures fall between two MiB, which moves a choice only between
//! nodes that nearly tie.

use crate::fragmentation::Host;

/// kube-scheduler's `MaxNodeScore`.
pub const MAX_NODE_SCORE: i64 = 100;

/// What kube-scheduler scales an extender's 0..=10 score by (`MaxNodeScore` /
/// `MaxExtenderPriority`).
pub const EXTENDER_SCORE_SCALE: i64 = 10;

/// The CPU a pod that requests none counts for in the scores (`DefaultMilliCPURequest`).
pub const DEFAULT_MILLI_CPU_REQUEST: u64 = 100;

/// The memory a pod that requests none counts for in the scores (`DefaultMemoryRequest`).
pub const DEFAULT_MEMORY_REQUEST_MIB: u64 = 200;

/// A pod's request as the LeastAllocated score counts it.
///
/// Upstream applies the defaults per container; here they apply to the pod's total, which is
/// the same for pods whose containers all ask for CPU and memory or none does.
pub fn non_zero(pod: Host) -> Host {
    Host::new(
        if pod.milli_cpu == 0 {
            DEFAULT_MILLI_CPU_REQUEST
        } else {
            pod.milli_cpu
        },
        if pod.memory_mib == 0 {
            DEFAULT_MEMORY_REQUEST_MIB
        } else {
            pod.memory_mib
        },
    )
}

/// The node's requests before the pod: as they are, and as [`non_zero`] counts them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Requested {
    /// The pods' requests.
    pub actual: Host,
    /// The pods' requests with [`non_zero`] applied pod by pod.
    pub non_zero: Host,
}

/// `NodeResourcesFit` (LeastAllocated) + `NodeResourcesBalancedAllocation`, both weight 1,
/// for `pod` on a node with `allocatable` and `requested` already.
pub fn default_scores(allocatable: Host, requested: Requested, pod: Host) -> i64 {
    least_allocated(
        allocatable,
        requested.non_zero.saturating_add(non_zero(pod)),
    ) + balanced_allocation(allocatable, requested.actual.saturating_add(pod))
}

/// LeastAllocated over CPU and memory, equally weighted, for the node's requests with the
/// pod's.
pub fn least_allocated(allocatable: Host, requested: Host) -> i64 {
    let least = |requested: u64, capacity: u64| -> i64 {
        if capacity == 0 || requested > capacity {
            return 0;
        }
        ((u128::from(capacity - requested) * 100) / u128::from(capacity)) as i64
    };
    (least(requested.milli_cpu, allocatable.milli_cpu)
        + least(requested.memory_mib, allocatable.memory_mib))
        / 2
}

/// BalancedAllocation over CPU and memory, for the node's requests with the pod's.
pub fn balanced_allocation(allocatable: Host, requested: Host) -> i64 {
    if allocatable.milli_cpu == 0 || allocatable.memory_mib == 0 {
        return MAX_NODE_SCORE;
    }
    let fraction = |r: u64, c: u64| (r as f64 / c as f64).min(1.0);
    let cpu = fraction(requested.milli_cpu, allocatable.milli_cpu);
    let memory = fraction(requested.memory_mib, allocatable.memory_mib);
    ((1.0 - (cpu - memory).abs() / 2.0) * MAX_NODE_SCORE as f64) as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_node_scores_the_pods_share_left() {
        let node = Host::new(8_000, 32_768);
        // 2 of 8 cores (75 left) and 8 of 32 GiB (75 left); fractions equal, so balanced 100.
        let score = default_scores(node, Requested::default(), Host::new(2_000, 8_192));
        assert_eq!(score, 75 + 100);
    }

    #[test]
    fn least_allocated_counts_a_pod_without_requests_as_upstream_does() {
        let node = Host::new(1_000, 1_000);
        let requested = Requested {
            actual: Host::default(),
            non_zero: non_zero(Host::default()),
        };
        // Node: 100 m and 200 MiB counted; the pod asks 100 m more (its memory defaults).
        // CPU (1000-200)/1000 = 80, memory (1000-400)/1000 = 60: mean 70.
        assert_eq!(
            least_allocated(
                node,
                requested
                    .non_zero
                    .saturating_add(non_zero(Host::new(100, 0)))
            ),
            70
        );
        // Balanced reads the real requests: 100 m of CPU (0.1) against no memory (0).
        assert_eq!(balanced_allocation(node, Host::new(100, 0)), 95);
    }

    #[test]
    fn a_full_node_scores_nothing_for_fit_and_an_unknown_size_everything_for_balance() {
        let node = Host::new(4_000, 4_096);
        let requested = Requested {
            actual: Host::new(4_000, 4_096),
            non_zero: Host::new(4_000, 4_096),
        };
        assert_eq!(default_scores(node, requested, Host::new(1_000, 0)), 100);
        assert_eq!(balanced_allocation(Host::new(0, 0), Host::new(1, 1)), 100);
    }
}
