//! The vocabulary of a replay: what is compared ([`Strategy`], [`Profile`]), how gpushare pods
//! ask ([`RequestForm`]), how many nodes kube-scheduler looks at ([`NodesToScore`]), and why a
//! task found no node ([`Cause`]). Adding a strategy or a profile starts here, with its name
//! in the report; the replay only dispatches on it.

use gpushare_allocator::Policy;

use super::generator::Task;

/// kube-scheduler's node scores as a scheduler profile configures them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// The default profile: `NodeResourcesFit` LeastAllocated + `NodeResourcesBalancedAllocation`,
    /// plus the extender's score × `weight` × 10. What the chart shipped before.
    Default { weight: i64 },
    /// Both resource scores disabled: the extender's score alone orders the nodes.
    ExtenderOnly,
    /// No extender prioritize: `NodeResourcesFit` MostAllocated on the GPU-memory resource +
    /// `NodeResourcesBalancedAllocation` on CPU and memory, all weight 1
    /// (`scores::native_most_allocated_score`). The extender still filters and binds.
    NativeMostAllocated,
    /// The extender's `--filter-keep-best=1`: its filter passes only the node kube-scheduler
    /// would rank best with the default profile and weight 1 (ours alone while multi-GPU pods
    /// bring a quarter or more of the recent GPU demand; ties to the first in the walk), and
    /// kube-scheduler binds that one without scoring.
    FilterKeepBest,
    /// The filter keeps the best node (ties to the first in the walk) by plugin weights (0:
    /// off): `NodeResourcesFit` LeastAllocated (`least`) or MostAllocated (`most`) on CPU and
    /// memory, `NodeResourcesBalancedAllocation` (`balanced`), the extender's score × 10 ×
    /// `extender`.
    Weighted {
        least: i64,
        most: i64,
        balanced: i64,
        extender: i64,
    },
}

impl Profile {
    /// Whether the extender scores the candidates (in prioritize, or in filter).
    pub(super) fn extender_scores(self) -> bool {
        !matches!(self, Profile::NativeMostAllocated)
    }

    /// How the report names the profile.
    pub(super) fn label(self) -> String {
        match self {
            Profile::Default { weight } => format!("default scores, weight {weight}"),
            Profile::ExtenderOnly => "extender scores only".to_owned(),
            Profile::NativeMostAllocated => {
                "native MostAllocated on gpu-mem, no prioritize".to_owned()
            }
            Profile::FilterKeepBest => {
                "filter keeps the node kube-scheduler would rank best, no scoring".to_owned()
            }
            Profile::Weighted {
                least,
                most,
                balanced,
                extender,
            } => format!(
                "keeps the best by LeastAllocated ×{least}, MostAllocated ×{most}, BalancedAllocation ×{balanced}, ours ×{extender}"
            ),
        }
    }
}

/// How a gpushare pod asks for a whole- or multi-GPU task (fractional tasks always ask for
/// a shared slice of one GPU). BestFit and FGD place tasks themselves and ignore it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestForm {
    /// `gpus: N`, not exclusive, the total GiB: a slice of the task's GiB on each of N
    /// distinct GPUs of one node; the rest of each GPU stays free for other pods.
    Plain,
    /// `gpus: N` with `exclusive`: N empty GPUs of at least the task's GiB, booked in full (a
    /// larger GPU's surplus is lost to other pods).
    Exclusive,
    /// [`RequestForm::Plain`], and a task pinned to GPU models names them in its request
    /// (gpushare's model annotation) instead of node affinity on the model label:
    /// kube-scheduler's walk does not know the pin, the extender's filter and scores do.
    ModelsInRequest,
}

/// Which nodes kube-scheduler filters and scores for a pod (`percentageOfNodesToScore`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodesToScore {
    /// kube-scheduler's default, the adaptive percentage: its filters walk the nodes round
    /// robin from where the previous pod's walk stopped, and stop once
    /// [`num_feasible_nodes_to_find`] nodes pass (all of them below 100 nodes; 41 %, 492 nodes,
    /// at 1,200). Only those reach the extender's filter and the scores.
    ///
    /// [`num_feasible_nodes_to_find`]: gpushare_scheduler_model::num_feasible_nodes_to_find
    Adaptive,
    /// The extender filters and scores every feasible node (`percentageOfNodesToScore: 100`).
    All,
    /// An explicit `percentageOfNodesToScore` (1-99), as the chart's dedicated scheduler may
    /// set: the walk stops at that share of the nodes, never below 100 of them.
    Percentage(u32),
}

/// A way of placing tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// gpushare: the extender's prioritize and bind under `policy`, nodes ordered by
    /// `profile`; pods ask in the replay's [`RequestForm`] (see `gpushare::gpushare_request`).
    /// `policy: None` is "classic" (filter and bind only).
    Gpushare {
        policy: Option<Policy>,
        profile: Profile,
    },
    /// gpushare's fragmentation policy, nodes ordered by `profile` (multi-GPU and exclusive
    /// pods take their GPUs as binpack does, as the allocator does); the extender keeps the
    /// idle-GPU taint with `idle_gpu_taint`, as the chart does.
    Fragmentation {
        profile: Profile,
        idle_gpu_taint: bool,
    },
    /// BestFit (FGD's baseline): the node with the least weighted free GPU, CPU and memory
    /// after placing, the snuggest GPUs on it. Places CPU-only tasks too, and multi-GPU tasks
    /// with `multi_gpu` (else refuses them).
    BestFit { multi_gpu: bool },
    /// FGD: the node and GPUs whose placement adds the least expected fragmentation against
    /// the whole task stream's true shapes; `multi_gpu` as BestFit's, and CPU-only tasks
    /// through the default scheduler with `cpu_pods_by_default`.
    Fgd {
        multi_gpu: bool,
        cpu_pods_by_default: bool,
    },
    /// gpushare's DRA mode: kube-scheduler allocates each task's claim (`gpus` devices with
    /// `gpu_gib` of `memory` each) itself: its walk with the DynamicResources filter, its
    /// default scores (nothing scores devices in 1.36), the allocator's first fit on the node.
    DraFirstFit,
}

impl Strategy {
    pub fn extender(policy: Option<Policy>, profile: Profile) -> Self {
        Strategy::Gpushare { policy, profile }
    }

    pub fn fragmentation(profile: Profile) -> Self {
        Strategy::Fragmentation {
            profile,
            idle_gpu_taint: true,
        }
    }

    /// Name in the report.
    pub fn name(self) -> String {
        let multi = |places: bool| if places { "places multi-GPU, " } else { "" };
        match self {
            Strategy::Gpushare { policy, profile } => {
                let policy = policy.map_or("classic".to_owned(), |p| format!("gpushare {p}"));
                format!("{policy} ({})", profile.label())
            }
            Strategy::Fragmentation {
                profile,
                idle_gpu_taint,
            } => {
                let taint = if idle_gpu_taint {
                    ""
                } else {
                    ", no idle-GPU taint"
                };
                format!("gpushare fragmentation ({}{taint})", profile.label())
            }
            Strategy::BestFit { multi_gpu } => {
                format!("BestFit ({}idealized: every node)", multi(multi_gpu))
            }
            Strategy::Fgd {
                multi_gpu,
                cpu_pods_by_default,
            } => {
                let cpu = match cpu_pods_by_default {
                    true => "CPU-only pods by default scheduler, ",
                    false => "",
                };
                format!("FGD ({}{cpu}idealized: every node)", multi(multi_gpu))
            }
            Strategy::DraFirstFit => {
                "DRA mode (kube-scheduler's allocator: default scores, first-fit devices)"
                    .to_owned()
            }
        }
    }

    /// Whether kube-scheduler's walk picks the nodes (else the strategy sees every node).
    pub(super) fn walks(self) -> bool {
        self.is_gpushare() || self == Strategy::DraFirstFit
    }

    /// Whether pods go through an extender's allocator (gpushare's policies, the classic
    /// extender) and ask in the replay's [`RequestForm`]: not the idealized baselines, not DRA
    /// mode.
    pub fn is_gpushare(self) -> bool {
        matches!(
            self,
            Strategy::Gpushare { .. } | Strategy::Fragmentation { .. }
        )
    }

    pub(super) fn places_multi_gpu(self) -> bool {
        match self {
            Strategy::BestFit { multi_gpu } | Strategy::Fgd { multi_gpu, .. } => multi_gpu,
            _ => true,
        }
    }

    /// Whether `task` takes its GPUs whole under this strategy and `form` (a gpushare
    /// exclusive pod); otherwise only the task's GiB is booked on each GPU.
    pub(super) fn books_whole(self, task: &Task, form: RequestForm) -> bool {
        self.is_gpushare() && form == RequestForm::Exclusive && task.is_whole()
    }

    /// Whether gpushare's extender runs, and so taints the nodes with an idle GPU
    /// (`extender.idleGpuTaint`, on in the chart): not with the classic extender, DRA mode,
    /// or the idealized strategies.
    pub(super) fn taints_idle_gpus(self) -> bool {
        matches!(
            self,
            Strategy::Gpushare {
                policy: Some(_),
                ..
            } | Strategy::Fragmentation {
                idle_gpu_taint: true,
                ..
            }
        )
    }

    pub(super) fn cpu_pods_by_default_scheduler(self) -> bool {
        match self {
            Strategy::BestFit { .. } => false,
            Strategy::Fgd {
                cpu_pods_by_default,
                ..
            } => cpu_pods_by_default,
            _ => true,
        }
    }
}

/// Why a task found no node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Cause {
    /// No node (of the model it names) has the GPU memory free.
    Gpu,
    /// Nodes with the GPU memory have too little CPU.
    Cpu,
    /// Nodes with the GPU memory have too little memory.
    Memory,
    /// Nodes with the GPU memory lack CPU and memory (or one each).
    Both,
    /// A multi-GPU task, which the strategy does not place (BestFit and FGD without
    /// `multi_gpu`).
    MultiGpu,
    /// A node had room, but the strategy's rules refused it.
    Other,
}

impl Cause {
    /// Every cause, in report order.
    pub const ALL: [Cause; 6] = [
        Cause::Gpu,
        Cause::Cpu,
        Cause::Memory,
        Cause::Both,
        Cause::MultiGpu,
        Cause::Other,
    ];

    /// Column name.
    pub fn name(self) -> &'static str {
        match self {
            Cause::Gpu => "GPU",
            Cause::Cpu => "CPU",
            Cause::Memory => "memory",
            Cause::Both => "CPU+mem",
            Cause::MultiGpu => "multi-GPU",
            Cause::Other => "other",
        }
    }
}
