//! kube-scheduler's score plugins on a simulated node, integer for integer as upstream and
//! gpushare-e2e's scheduler compute them (the tests check they agree).
//!
//! Kept apart because they are the yardstick every strategy's node choice is read against: a
//! change here changes every row of the report, and should be checked against the drivers.

use gpushare_allocator::fragmentation::Host;
use gpushare_allocator::kube_scores;
use gpushare_scheduler_model::requests::Milli;
use gpushare_scheduler_model::scoring::FitStrategy;

use super::nodes::Nodes;

/// kube-scheduler's `NodeResourcesFit` (LeastAllocated) + `NodeResourcesBalancedAllocation`
/// on CPU and memory, integer for integer as `gpushare_scheduler_model::scoring::default_score`
/// computes them (a test checks they agree): the extender's [`kube_scores`], every task here
/// asking for CPU and memory.
pub fn default_score(allocatable: Host, used: Host, pod: Host) -> i64 {
    let requested = used.saturating_add(pod);
    kube_scores::least_allocated(allocatable, requested)
        + kube_scores::balanced_allocation(allocatable, requested)
}

/// kube-scheduler's `TaintToleration` score for a pod that does not tolerate gpushare's
/// idle-GPU taint (`PreferNoSchedule`), weight 3 as in its default profile: a node's raw
/// score counts such taints, reverse-normalized over the nodes scored, so while any of them
/// carries the taint, the ones without it score 100 × 3 more; while none does, all tie.
pub fn taint_toleration(tainted: bool, any_tainted: bool) -> i64 {
    const WEIGHT: i64 = 3;
    if any_tainted && !tainted {
        100 * WEIGHT
    } else {
        0
    }
}

/// `NodeResourcesBalancedAllocation` on CPU and memory.
pub(super) fn balanced_allocation(allocatable: Host, used: Host, pod: Host) -> i64 {
    kube_scores::balanced_allocation(allocatable, used.saturating_add(pod))
}

/// One extended resource as `NodeResourcesFit` scores it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scored {
    /// The node's allocatable amount.
    pub allocatable: u64,
    /// What the node's pods request already.
    pub requested: u64,
    /// What the pod requests.
    pub pod: u64,
    /// The resource's weight in `scoringStrategy.resources`.
    pub weight: i64,
}

/// `NodeResourcesFit` with `scoringStrategy` MostAllocated over extended `resources`, as
/// upstream's `resourceAllocationScorer` computes it: a resource the pod does not request or
/// the node does not have is left out; each other scores
/// `min(requested + pod, allocatable) × 100 / allocatable` (integer); the node's score is the
/// weighted mean, integer, 0 when no resource is left.
pub fn most_allocated(resources: &[Scored]) -> i64 {
    let (mut weighted, mut weights) = (0i64, 0i64);
    for r in resources {
        if r.pod == 0 || r.allocatable == 0 {
            continue;
        }
        let score = FitStrategy::MostAllocated.resource_score(
            Milli::from(r.requested) + Milli::from(r.pod),
            Milli::from(r.allocatable),
        );
        weighted += score * r.weight;
        weights += r.weight;
    }
    if weights == 0 { 0 } else { weighted / weights }
}

/// [`Profile::NativeMostAllocated`]: MostAllocated on GPU memory (weight 1) +
/// `NodeResourcesBalancedAllocation` on CPU and memory, for a pod asking `pod_gib` of GPU
/// memory and `pod` of the host on node `n`.
///
/// [`Profile::NativeMostAllocated`]: super::Profile::NativeMostAllocated
pub(super) fn native_most_allocated_score(
    state: &Nodes<'_>,
    n: usize,
    pod_gib: u64,
    pod: Host,
) -> i64 {
    let spec = &state.specs[n];
    let gpu_mem = Scored {
        allocatable: u64::from(spec.gpus) * spec.gpu_gib,
        requested: state.requested_gib[n],
        pod: pod_gib,
        weight: 1,
    };
    most_allocated(&[gpu_mem]) + balanced_allocation(spec.host, state.used[n], pod)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::realistic::generator::SimNode;
    use gpushare_scheduler_model::requests::{CPU, MEMORY, NodeUsage, PodUsage, Resources};
    use gpushare_scheduler_model::scoring as framework;

    #[test]
    fn default_score_matches_the_scheduler_drivers() {
        const MIB: i128 = 1024 * 1024 * 1000;
        let host = |cpu: u64, mib: u64| {
            Resources::from([
                (CPU.to_owned(), i128::from(cpu)),
                (MEMORY.to_owned(), i128::from(mib) * MIB),
            ])
        };
        for (alloc, used, pod) in [
            ((96_000, 393_216), (10_000, 50_000), (8_000, 32_768)),
            ((64_000, 262_144), (60_000, 10_000), (4_000, 200_000)),
            ((2_000, 1_024), (0, 0), (500, 1_000)),
        ] {
            let usage = NodeUsage {
                requested: host(used.0, used.1),
                non_zero_cpu: i128::from(used.0),
                non_zero_memory: i128::from(used.1) * MIB,
                pods: 1,
            };
            let pod_usage = PodUsage {
                requested: host(pod.0, pod.1),
                non_zero_cpu: i128::from(pod.0),
                non_zero_memory: i128::from(pod.1) * MIB,
            };
            assert_eq!(
                default_score(
                    Host::new(alloc.0, alloc.1),
                    Host::new(used.0, used.1),
                    Host::new(pod.0, pod.1)
                ),
                framework::default_score(
                    &framework::FitScoring::default(),
                    &host(alloc.0, alloc.1),
                    &usage,
                    &pod_usage
                )
            );
        }
    }

    #[test]
    fn most_allocated_scores_as_upstream() {
        let gpu_mem = |allocatable, requested, pod| Scored {
            allocatable,
            requested,
            pod,
            weight: 1,
        };
        // (0 + 4) * 100 / 32 and (12 + 4) * 100 / 32, integer division.
        assert_eq!(most_allocated(&[gpu_mem(32, 0, 4)]), 12);
        assert_eq!(most_allocated(&[gpu_mem(32, 12, 4)]), 50);
        // 100 * 100 / 30 = 333 is capped: a request beyond capacity scores as full.
        assert_eq!(most_allocated(&[gpu_mem(30, 20, 20)]), 100);
        // Not requested by the pod, or absent on the node: left out; nothing left scores 0.
        assert_eq!(most_allocated(&[gpu_mem(32, 12, 0)]), 0);
        assert_eq!(most_allocated(&[gpu_mem(0, 0, 4)]), 0);
        assert_eq!(most_allocated(&[]), 0);
        // Weighted mean: (50 * 3 + 10 * 1) / 4 = 40; a skipped resource takes its weight out.
        let other = Scored {
            allocatable: 10,
            requested: 0,
            pod: 1,
            weight: 1,
        };
        let weighted = Scored {
            weight: 3,
            ..gpu_mem(32, 12, 4)
        };
        assert_eq!(most_allocated(&[weighted, other]), 40);
        assert_eq!(most_allocated(&[Scored { pod: 0, ..weighted }, other]), 10);
        // (7 * 100 / 9 = 77) * 2 + (1 * 100 / 3 = 33) * 1, over 3 = 62.
        assert_eq!(
            most_allocated(&[
                Scored {
                    weight: 2,
                    ..gpu_mem(9, 5, 2)
                },
                gpu_mem(3, 0, 1)
            ]),
            62
        );
    }

    #[test]
    fn most_allocated_matches_the_scheduler_drivers() {
        use gpushare_contract::DEFAULT_RESOURCE;
        let fit = framework::FitScoring {
            strategy: FitStrategy::MostAllocated,
            resources: vec![(DEFAULT_RESOURCE.to_owned(), 1)],
        };
        let gib = |n: u64| Resources::from([(DEFAULT_RESOURCE.to_owned(), i128::from(n) * 1000)]);
        for (allocatable, requested, pod) in [(32, 12, 4), (640, 17, 80), (15, 0, 15), (48, 40, 24)]
        {
            let usage = NodeUsage {
                requested: gib(requested),
                ..NodeUsage::default()
            };
            let pod_usage = PodUsage {
                requested: gib(pod),
                ..PodUsage::default()
            };
            assert_eq!(
                most_allocated(&[Scored {
                    allocatable,
                    requested,
                    pod,
                    weight: 1
                }]),
                fit.score(&gib(allocatable), &usage, &pod_usage),
                "{allocatable} {requested} {pod}"
            );
        }
    }

    #[test]
    fn native_profile_adds_gpu_memory_most_allocated_to_balanced_allocation() {
        let node = |gpus| SimNode {
            model: 1,
            gpus,
            gpu_gib: 16,
            host: Host::new(64_000, 262_144),
        };
        let specs = [node(2), node(8)];
        let mut state = Nodes::new(&specs);
        state.requested_gib[0] = 12;
        state.used[0] = Host::new(8_000, 65_536);
        let pod = Host::new(8_000, 32_768);
        // (12 + 4) * 100 / 32 = 50; CPU 16/64 and memory 96/256 GiB: 100 * (1 - 0.0625) = 93.
        assert_eq!(native_most_allocated_score(&state, 0, 4, pod), 50 + 93);
        // 4 * 100 / 128 = 3; CPU 8/64 and memory 32/256 GiB balance: 100.
        assert_eq!(native_most_allocated_score(&state, 1, 4, pod), 3 + 100);
    }
}
