//! How much of the GPU demand arriving lately comes in multi-GPU pods, and what that changes
//! in the ranking of the filter that keeps only the best node.
//!
//! Why: kube-scheduler's `NodeResourcesFit` LeastAllocated score spreads pods' CPU and
//! memory over every node, and its BalancedAllocation score sends a pod wherever it evens a
//! node's CPU and memory out, whatever that does to the node's GPUs. Where pods share GPUs
//! that helps (a node whose CPU is nearly gone strands its free GPU memory, and
//! LeastAllocated steers pods away from it), but where jobs of 2, 4 and 8 whole GPUs bring a
//! large share of the demand it leaves no node with the GPUs and the CPU such a job needs.
//! On the realistic generator, leaving LeastAllocated out gains most on the multi-GPU-heavy
//! mix and costs on the sharing mixes, and leaving BalancedAllocation out as well gains a
//! little more there (docs/performance.md, "Workload mixes"). So while multi-GPU pods bring
//! at least [`MULTI_GPU_HEAVY`] of the GPU GiB that arrived lately the ranking is our score
//! alone, and otherwise it counts kube-scheduler's CPU and memory scores as its profile does.
//!
//! The same share decides how the fragmentation policy scores multi-GPU pods
//! ([`crate::Cluster::scores`]): by the measure while they are rare, as binpack while they
//! are common. The measure learns multi-GPU shapes too ([`crate::fragmentation::Gang`]), but
//! scoring multi-GPU pods by it while they are common moved the trace's multigpu50 mix by
//! 0.1 point only (on the generator before 2026-11-29; docs/performance.md), so the switch
//! stays.
//!
//! "Lately" decays as the fragmentation workload does (a pod's weight halves after about
//! 350 later pods), so the ranking follows the mix that is arriving now.

/// The share of recent GPU demand in multi-GPU pods from which the ranking leaves
/// kube-scheduler's CPU and memory scores out. The generator's default and model-pinned mixes
/// bring about 8 % of it in multi-GPU jobs, the multi-GPU-heavy mix about half.
pub const MULTI_GPU_HEAVY: f64 = 0.25;

/// How much an observation's weight decays per later observation (as the workload's).
const DECAY: f64 = 0.998;

/// The recent GPU demand, all of it and the part in multi-GPU pods, decaying.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DemandMix {
    /// Decayed GiB asked by every GPU pod.
    all: f64,
    /// Decayed GiB asked by pods spread over several GPUs (or taking GPUs whole).
    multi: f64,
}

impl DemandMix {
    /// Records a GPU pod asking `gib` in all, `multi` when it takes several (or whole) GPUs.
    pub fn observe(&mut self, gib: u64, multi: bool) {
        if gib == 0 {
            return;
        }
        self.all = self.all * DECAY + gib as f64;
        self.multi = self.multi * DECAY + if multi { gib as f64 } else { 0.0 };
    }

    /// The share of recent GPU demand in multi-GPU pods, 0 before any GPU pod.
    pub fn multi_gpu_share(&self) -> f64 {
        if self.all > 0.0 {
            self.multi / self.all
        } else {
            0.0
        }
    }

    /// Whether multi-GPU pods bring at least [`MULTI_GPU_HEAVY`] of the recent GPU demand.
    pub fn is_multi_gpu_heavy(&self) -> bool {
        self.multi_gpu_share() >= MULTI_GPU_HEAVY
    }

    /// Whether the ranking counts kube-scheduler's CPU and memory scores (LeastAllocated and
    /// BalancedAllocation): not while the recent demand is multi-GPU heavy.
    pub fn counts_resource_scores(&self) -> bool {
        !self.is_multi_gpu_heavy()
    }

    /// Whether nothing has been observed yet.
    pub fn is_empty(&self) -> bool {
        self.all == 0.0
    }
}

// Sums and products of finite numbers, never NaN: equality is total.
impl Eq for DemandMix {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resource_scores_leave_the_ranking_while_multi_gpu_pods_bring_a_quarter_of_the_demand() {
        let mut mix = DemandMix::default();
        assert!(mix.counts_resource_scores());
        for _ in 0..100 {
            mix.observe(8, false);
        }
        mix.observe(0, true);
        assert_eq!(mix.multi_gpu_share(), 0.0);
        assert!(mix.counts_resource_scores());
        // Half the GiB in 8-GPU jobs from now on: the share climbs past a quarter.
        let mut switched_after = None;
        for i in 0..1_000 {
            mix.observe(8, false);
            if i % 8 == 0 {
                mix.observe(64, true);
            }
            if switched_after.is_none() && !mix.counts_resource_scores() {
                switched_after = Some(i);
            }
        }
        let after = switched_after.expect("the ranking left the resource scores out");
        assert!(after < 400, "took {after} pods");
        assert!((0.45..0.55).contains(&mix.multi_gpu_share()));
        // Sharing pods only again: the share decays below a quarter and it comes back.
        for _ in 0..2_000 {
            mix.observe(4, false);
        }
        assert!(mix.counts_resource_scores());
    }
}
