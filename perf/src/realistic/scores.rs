//! kube-scheduler's score plugins on a simulated node, integer for integer as upstream and
//! gpushare-e2e's scheduler compute them (the tests check they agree): every strategy's node
//! choice is read against them, so a change here changes every row of the report.

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

/// `NodeResourcesFit` with `scoringStrategy` MostAllocated on one extended resource of weight
/// 1, as upstream's `resourceAllocationScorer` computes it: `min(requested + pod, allocatable)
/// × 100 / allocatable` (integer); 0 when the pod does not request it or the node lacks it.
pub fn most_allocated(allocatable: u64, requested: u64, pod: u64) -> i64 {
    if pod == 0 || allocatable == 0 {
        return 0;
    }
    let requested = Milli::from(requested) + Milli::from(pod);
    FitStrategy::MostAllocated.resource_score(requested, Milli::from(allocatable))
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
    let gpu_gib = u64::from(spec.gpus) * spec.gpu_gib;
    let gpu_mem = most_allocated(gpu_gib, state.requested_gib[n], pod_gib);
    gpu_mem + kube_scores::balanced_allocation(spec.host, state.used[n].saturating_add(pod))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::realistic::generator::test_node;
    use gpushare_scheduler_model::requests::{CPU, MEMORY, NodeUsage, PodUsage, Resources};
    use gpushare_scheduler_model::scoring as framework;

    #[test]
    fn default_score_matches_the_scheduler_drivers() {
        const MIB: i128 = 1024 * 1024 * 1000;
        let host = |(cpu, mib): (u64, u64)| {
            Resources::from([
                (CPU.to_owned(), i128::from(cpu)),
                (MEMORY.to_owned(), i128::from(mib) * MIB),
            ])
        };
        let h = |(cpu, mib): (u64, u64)| Host::new(cpu, mib);
        let fit = framework::FitScoring::default();
        for (alloc, used, pod) in [
            ((96_000, 393_216), (10_000, 50_000), (8_000, 32_768)),
            ((64_000, 262_144), (60_000, 10_000), (4_000, 200_000)),
            ((2_000, 1_024), (0, 0), (500, 1_000)),
        ] {
            let usage = NodeUsage {
                requested: host(used),
                non_zero_cpu: i128::from(used.0),
                non_zero_memory: i128::from(used.1) * MIB,
                pods: 1,
            };
            let pod_usage = PodUsage {
                requested: host(pod),
                non_zero_cpu: i128::from(pod.0),
                non_zero_memory: i128::from(pod.1) * MIB,
            };
            let theirs = framework::default_score(&fit, &host(alloc), &usage, &pod_usage);
            assert_eq!(default_score(h(alloc), h(used), h(pod)), theirs);
        }
    }

    #[test]
    fn most_allocated_scores_as_upstream() {
        // (0 + 4) * 100 / 32 and (12 + 4) * 100 / 32, integer division.
        assert_eq!(most_allocated(32, 0, 4), 12);
        assert_eq!(most_allocated(32, 12, 4), 50);
        // 100 * 100 / 30 = 333 is capped: a request beyond capacity scores as full.
        assert_eq!(most_allocated(30, 20, 20), 100);
        // Not requested by the pod, or absent on the node: left out, and nothing left scores 0.
        assert_eq!(most_allocated(32, 12, 0), 0);
        assert_eq!(most_allocated(0, 0, 4), 0);
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
            let theirs = fit.score(&gib(allocatable), &usage, &pod_usage);
            let ours = most_allocated(allocatable, requested, pod);
            assert_eq!(ours, theirs, "{allocatable} {requested} {pod}");
        }
    }

    #[test]
    fn native_profile_adds_gpu_memory_most_allocated_to_balanced_allocation() {
        let node = |gpus| test_node(1, gpus, 16);
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
