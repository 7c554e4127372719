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
//! The same share decides how the fragmentation policy scores nodes for multi-GPU pods and
//! for one-GPU pods that take a whole GPU ([`crate::Cluster::scores`]): by the measure while
//! multi-GPU pods are rare, as binpack while they are common (the GPU within the node stays
//! the measure's choice). Why: the replay of the real trace on its multigpu50 mix packs
//! 93.4 % with binpack on every node against 89.1 % with the measure, and there the two
//! differ only in how one-GPU pods are placed (multi-GPU pods were binpacked
//! already); in that mix most one-GPU pods take a whole GPU. On the calibrated generator
//! the chart's default moved 92.6 → 92.9 % on multigpu50. Pods sharing a GPU stay with the
//! measure: binpacking them too cost the earlier generator's multi-GPU-heavy mix (half its
//! demand sharing) 1.8 points. The measure learns multi-GPU shapes too
//! ([`crate::fragmentation::Gang`]), but scoring by it while they are common did not do
//! better (docs/performance.md).
//!
//! The share of recent GPU demand in pods pinned to GPU models (a `nodeSelector` or required
//! node affinity on the device plugin's `gpu-model.*` or `gpu-mem.*` node labels, or
//! gpushare's models annotation) changes two things while it is at least [`PINNED_HEAVY`]:
//! the ranking leaves LeastAllocated out (BalancedAllocation stays), and the extender lifts
//! its idle-GPU taint. Why: the pinned pods need idle GPUs of a few models, and both push the
//! other pods there. LeastAllocated favours the nodes with the most CPU and memory per GPU,
//! such as the trace's T4 nodes (104 cores for 2 GPUs), which the T4-pinned pods need; the
//! taint sends pods asking for no GPU to the nodes whose GPUs are in use, whose CPU the
//! unpinned GPU pods then miss, so they take the idle GPUs of the pinned models. On the
//! trace's gpuspec33 mix (29 % of tasks pinned) this lifts the chart's default from 82.3 to
//! 85.3 % on the calibrated generator (84.0 with our score alone); the replay of the real
//! trace read 1.5 points for the taint and 1.8 for our score alone there
//! (docs/performance.md). No other mix pins any pod, so none changes.
//!
//! "Lately" decays as the fragmentation workload does (a pod's weight halves after about
//! 350 later pods), so the ranking follows the mix that is arriving now.

/// The share of recent GPU demand in multi-GPU pods from which the ranking leaves
/// kube-scheduler's CPU and memory scores out. The generator's default and model-pinned mixes
/// bring about 8 % of it in multi-GPU jobs, the multi-GPU-heavy mix about half.
pub const MULTI_GPU_HEAVY: f64 = 0.25;

/// The share of recent GPU demand in pods pinned to GPU models from which the ranking leaves
/// LeastAllocated out and the idle-GPU taint is lifted. The trace's gpuspec33 mix pins about 30 %.
pub const PINNED_HEAVY: f64 = 0.15;

/// The share under which a pinned-heavy demand is no longer so. Between the two the mix keeps
/// what it was: each time it turns, the extender rewrites the idle-GPU taint on many nodes, so
/// a share hovering at [`PINNED_HEAVY`] must not turn it at every pod.
pub const PINNED_LIGHT: f64 = 0.10;

/// How much an observation's weight decays per later observation (as the workload's).
const DECAY: f64 = 0.998;

/// Which of kube-scheduler's CPU and memory scores the ranking counts beside ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResourceScores {
    /// LeastAllocated and BalancedAllocation, as kube-scheduler's default profile.
    Both,
    /// BalancedAllocation alone.
    Balanced,
    /// Neither: our score alone.
    Neither,
}

/// The recent GPU demand, all of it, the part in multi-GPU pods and the part in pods pinned
/// to GPU models, decaying.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DemandMix {
    /// Decayed GiB asked by every GPU pod.
    all: f64,
    /// Decayed GiB asked by pods spread over several GPUs (or taking GPUs whole).
    multi: f64,
    /// Decayed GiB asked by pods pinned to GPU models.
    pinned: f64,
    /// Whether the pinned share last crossed [`PINNED_HEAVY`] upwards rather than
    /// [`PINNED_LIGHT`] downwards.
    pinned_heavy: bool,
}

impl DemandMix {
    /// Records a GPU pod asking `gib` in all, `multi` when it takes several (or whole) GPUs,
    /// `pinned` when it may run only on some GPU models.
    pub fn observe(&mut self, gib: u64, multi: bool, pinned: bool) {
        if gib == 0 {
            return;
        }
        let part = |yes: bool| if yes { gib as f64 } else { 0.0 };
        self.all = self.all * DECAY + gib as f64;
        self.multi = self.multi * DECAY + part(multi);
        self.pinned = self.pinned * DECAY + part(pinned);
        let share = self.pinned_share();
        self.pinned_heavy = share >= PINNED_HEAVY || (self.pinned_heavy && share >= PINNED_LIGHT);
    }

    /// The share of recent GPU demand in multi-GPU pods, 0 before any GPU pod.
    pub fn multi_gpu_share(&self) -> f64 {
        self.share(self.multi)
    }

    /// The share of recent GPU demand in pods pinned to GPU models, 0 before any GPU pod.
    pub fn pinned_share(&self) -> f64 {
        self.share(self.pinned)
    }

    fn share(&self, part: f64) -> f64 {
        if self.all > 0.0 { part / self.all } else { 0.0 }
    }

    /// Whether pods pinned to GPU models bring at least [`PINNED_HEAVY`] of the recent GPU
    /// demand, or did and still bring [`PINNED_LIGHT`].
    pub fn is_pinned_heavy(&self) -> bool {
        self.pinned_heavy
    }

    /// Whether the extender keeps its idle-GPU taint on the nodes with an idle GPU: not while
    /// the recent demand is pinned heavy.
    pub fn wants_idle_gpu_taint(&self) -> bool {
        !self.is_pinned_heavy()
    }

    /// Whether multi-GPU pods bring at least [`MULTI_GPU_HEAVY`] of the recent GPU demand.
    pub fn is_multi_gpu_heavy(&self) -> bool {
        self.multi_gpu_share() >= MULTI_GPU_HEAVY
    }

    /// Which of kube-scheduler's CPU and memory scores the ranking counts: neither while the
    /// recent demand is multi-GPU heavy, BalancedAllocation alone while it is pinned heavy,
    /// both (with LeastAllocated) otherwise.
    pub fn resource_scores(&self) -> ResourceScores {
        if self.is_multi_gpu_heavy() {
            ResourceScores::Neither
        } else if self.is_pinned_heavy() {
            ResourceScores::Balanced
        } else {
            ResourceScores::Both
        }
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
        assert!(mix.resource_scores() == ResourceScores::Both);
        for _ in 0..100 {
            mix.observe(8, false, false);
        }
        mix.observe(0, true, true);
        assert_eq!(mix.multi_gpu_share(), 0.0);
        assert!(mix.resource_scores() == ResourceScores::Both);
        // Half the GiB in 8-GPU jobs from now on: the share climbs past a quarter.
        let mut switched_after = None;
        for i in 0..1_000 {
            mix.observe(8, false, false);
            if i % 8 == 0 {
                mix.observe(64, true, false);
            }
            if switched_after.is_none() && mix.resource_scores() != ResourceScores::Both {
                switched_after = Some(i);
            }
        }
        let after = switched_after.expect("the ranking left the resource scores out");
        assert!(after < 400, "took {after} pods");
        assert!((0.45..0.55).contains(&mix.multi_gpu_share()));
        // Sharing pods only again: the share decays below a quarter and it comes back.
        for _ in 0..2_000 {
            mix.observe(4, false, false);
        }
        assert!(mix.resource_scores() == ResourceScores::Both);
        assert!(mix.wants_idle_gpu_taint(), "nothing pinned yet");
    }

    #[test]
    fn pinned_pods_bringing_fifteen_percent_of_the_demand_lift_the_taint_and_the_resource_scores() {
        let mut mix = DemandMix::default();
        for _ in 0..500 {
            mix.observe(8, false, false);
        }
        assert!(mix.wants_idle_gpu_taint() && mix.resource_scores() == ResourceScores::Both);
        // One pod in ten pinned: 10 % of the GiB, under the threshold.
        for i in 0..2_000 {
            mix.observe(8, false, i % 10 == 0);
        }
        assert!(
            (0.08..0.12).contains(&mix.pinned_share()),
            "{}",
            mix.pinned_share()
        );
        assert!(mix.wants_idle_gpu_taint() && mix.resource_scores() == ResourceScores::Both);
        // One in three, as the trace's gpuspec33 mix: both lifted.
        for i in 0..2_000 {
            mix.observe(8, false, i % 3 == 0);
        }
        assert!(mix.is_pinned_heavy());
        assert!(!mix.wants_idle_gpu_taint());
        assert_eq!(mix.resource_scores(), ResourceScores::Balanced);
        assert!(!mix.is_multi_gpu_heavy(), "the two shares are apart");
        // One in eight: under the threshold, over the way back; it stays lifted.
        for i in 0..2_000 {
            mix.observe(8, false, i % 8 == 0);
        }
        assert!((0.11..0.14).contains(&mix.pinned_share()));
        assert!(mix.is_pinned_heavy() && !mix.wants_idle_gpu_taint());
        // Nothing pinned any more: both come back once the share decays.
        for _ in 0..2_000 {
            mix.observe(8, false, false);
        }
        assert!(mix.wants_idle_gpu_taint() && mix.resource_scores() == ResourceScores::Both);
    }
}
