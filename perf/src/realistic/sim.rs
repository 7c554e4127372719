//! The replay: each strategy places the same task stream on the same cluster, and we watch
//! the allocation ratio climb as demand arrives.
//!
//! gpushare pods ask for whole- and multi-GPU tasks in one of two forms ([`RequestForm`]):
//! the plain form (`gpus: N` and the total GiB: N shared slices, the rest of each GPU left to
//! other pods), or `exclusive` (N empty GPUs, booked in full).
//!
//! Strategies that go through kube-scheduler (gpushare's, and CPU-only pods in a gpushare
//! cluster) see the nodes as kube-scheduler does by default ([`NodesToScore::Adaptive`]): its
//! filters walk the nodes from where the previous cycle stopped and stop once they have found
//! `numFeasibleNodesToFind` feasible nodes; the extender filters and scores only those. A pod
//! none of them takes fails, even when a node the walk did not reach would have taken it.
//! BestFit and FGD are idealized baselines: they always look at every node.

use gpushare_allocator::fragmentation::{Host, Shape};
use gpushare_allocator::{Cluster, Gpu, PodId, Policy, Request, kube_scores};
use gpushare_e2e::scheduler::framework::{
    FitStrategy, Milli, num_feasible_nodes_to_find, num_feasible_nodes_to_find_at,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::generator::{MODELS, Models, SimNode, Task, TaskKind};

/// kube-scheduler's node scores as a scheduler profile configures them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// The default profile: `NodeResourcesFit` LeastAllocated + `NodeResourcesBalancedAllocation`,
    /// plus the extender's score × `weight` × 10. What the chart shipped before.
    Default {
        /// The extender's weight.
        weight: i64,
    },
    /// Both resource scores disabled: the extender's score alone orders the nodes.
    ExtenderOnly,
    /// No extender prioritize: `NodeResourcesFit` with `scoringStrategy` MostAllocated on the
    /// GPU-memory resource alone (weight 1) + `NodeResourcesBalancedAllocation` on CPU and
    /// memory (weight 1), both plugins weight 1 ([`native_most_allocated_score`]). The
    /// extender still filters and binds.
    NativeMostAllocated,
    /// The extender's `--filter-keep-best=1`: its filter passes only the node kube-scheduler
    /// would rank best with the default profile and weight 1 (its default CPU and memory
    /// scores + ours × 10; the first of them in the walk's order), and kube-scheduler binds
    /// that one without scoring.
    FilterKeepBest,
    /// A profile that weighs kube-scheduler's CPU and memory scores against ours:
    /// `NodeResourcesFit` LeastAllocated (`least`) or MostAllocated (`most`) on CPU and
    /// memory, `NodeResourcesBalancedAllocation` (`balanced`), and the extender's score ×
    /// `extender` × 10; the filter keeps the best node (ties to the first in the walk).
    Weighted {
        /// LeastAllocated's plugin weight (0: off).
        least: i64,
        /// MostAllocated's plugin weight (0: off).
        most: i64,
        /// BalancedAllocation's plugin weight (0: off).
        balanced: i64,
        /// The extender's weight.
        extender: i64,
    },
}

impl Profile {
    /// Whether the extender scores the candidates (in prioritize, or in filter to keep the
    /// best).
    fn extender_scores(self) -> bool {
        !matches!(self, Profile::NativeMostAllocated)
    }

    /// How the report names the profile.
    fn label(self) -> String {
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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RequestForm {
    /// `gpus: N`, not exclusive, the total GiB: a slice of the task's GiB on each of N
    /// distinct GPUs of one node; the rest of each GPU stays free for other pods.
    #[default]
    Plain,
    /// `gpus: N` with `exclusive`: N empty GPUs of at least the task's GiB, booked in full (a
    /// larger GPU's surplus is lost to other pods).
    Exclusive,
}

/// Which nodes kube-scheduler filters and scores for a pod (`percentageOfNodesToScore`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum NodesToScore {
    /// kube-scheduler's default, the adaptive percentage: its filters walk the nodes round
    /// robin from where the previous pod's walk stopped, and stop once
    /// [`num_feasible_nodes_to_find`] nodes pass (all of them below 100 nodes; 41 %, 492 nodes,
    /// at 1,200). Only those reach the extender's filter and the scores.
    #[default]
    Adaptive,
    /// Every feasible node is filtered by the extender and scored (`percentageOfNodesToScore:
    /// 100`).
    All,
    /// An explicit `percentageOfNodesToScore` (1-99), as the chart's dedicated scheduler may
    /// set: the walk stops at that share of the nodes, never below 100 of them.
    Percentage(u32),
}

/// A way of placing tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// gpushare: the extender's prioritize and bind under `policy` (`None`: no prioritize,
    /// binpack at bind: the classic extender), nodes ordered by `profile`. Fractional tasks
    /// are shared slices of one GPU; whole- and multi-GPU tasks ask as a pod does, in the
    /// replay's [`RequestForm`] (see [`gpushare_request`]).
    Gpushare {
        /// The extender's policy; `None` is "classic" (filter and bind only).
        policy: Option<Policy>,
        /// How kube-scheduler scores.
        profile: Profile,
    },
    /// gpushare's fragmentation policy, nodes ordered by `profile` (multi-GPU tasks, and
    /// whole-GPU tasks asked for with `exclusive`, scored and placed as binpack does, as the
    /// allocator does).
    Fragmentation {
        /// How kube-scheduler scores.
        profile: Profile,
    },
    /// BestFit (FGD's baseline): the node with the least weighted free GPU, CPU and memory
    /// after placing, the snuggest GPUs on it. Places CPU-only tasks too.
    BestFit {
        /// Places multi-GPU tasks (else refuses them).
        multi_gpu: bool,
    },
    /// FGD: the node and GPUs whose placement adds the least expected fragmentation, measured
    /// against the true shape distribution of the whole task stream. Places CPU-only tasks
    /// unless `cpu_pods_by_default` hands them to the default scheduler, as a gpushare
    /// cluster does.
    Fgd {
        /// Places multi-GPU tasks (else refuses them).
        multi_gpu: bool,
        /// CPU-only tasks go through the default scheduler.
        cpu_pods_by_default: bool,
    },
    /// gpushare's DRA mode: kube-scheduler allocates each task's claim itself (a request of
    /// `gpus` devices with `gpu_gib` of `memory` each). Its walk, with the DynamicResources
    /// filter among its filters, its default scores (nothing scores devices in 1.36), and on
    /// the node it picks the allocator's first fit: the first GPUs in the slice's order with
    /// the share free, distinct.
    DraFirstFit,
}

impl Strategy {
    /// Name in the report.
    pub fn name(self) -> String {
        match self {
            Strategy::Gpushare { policy, profile } => {
                let policy = policy.map_or("classic".to_owned(), |p| format!("gpushare {p}"));
                format!("{policy} ({})", profile.label())
            }
            Strategy::Fragmentation { profile } => {
                format!("gpushare fragmentation ({})", profile.label())
            }
            Strategy::BestFit { multi_gpu } => {
                format!(
                    "BestFit ({}idealized: every node)",
                    if multi_gpu { "places multi-GPU, " } else { "" }
                )
            }
            Strategy::Fgd {
                multi_gpu,
                cpu_pods_by_default,
            } => format!(
                "FGD ({}{}idealized: every node)",
                if multi_gpu { "places multi-GPU, " } else { "" },
                if cpu_pods_by_default {
                    "CPU-only pods by default scheduler, "
                } else {
                    ""
                }
            ),
            Strategy::DraFirstFit => {
                "DRA mode (kube-scheduler's allocator: default scores, first-fit devices)"
                    .to_owned()
            }
        }
    }

    /// Whether kube-scheduler's walk picks the nodes (else the strategy sees every node).
    fn walks(self) -> bool {
        self.is_gpushare() || self == Strategy::DraFirstFit
    }

    fn is_gpushare(self) -> bool {
        matches!(
            self,
            Strategy::Gpushare { .. } | Strategy::Fragmentation { .. }
        )
    }

    fn places_multi_gpu(self) -> bool {
        match self {
            Strategy::Gpushare { .. } | Strategy::Fragmentation { .. } | Strategy::DraFirstFit => {
                true
            }
            Strategy::BestFit { multi_gpu } | Strategy::Fgd { multi_gpu, .. } => multi_gpu,
        }
    }

    /// Whether `task` takes its GPUs whole under this strategy and `form` (a gpushare
    /// exclusive pod); otherwise only the task's GiB is booked on each GPU.
    fn books_whole(self, task: &Task, form: RequestForm) -> bool {
        self.is_gpushare() && form == RequestForm::Exclusive && is_whole(task)
    }

    fn cpu_pods_by_default_scheduler(self) -> bool {
        match self {
            Strategy::Gpushare { .. } | Strategy::Fragmentation { .. } | Strategy::DraFirstFit => {
                true
            }
            Strategy::BestFit { .. } => false,
            Strategy::Fgd {
                cpu_pods_by_default,
                ..
            } => cpu_pods_by_default,
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

/// The state at one point of the replay.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// GPU GiB arrived so far / GPU GiB of the cluster.
    pub demand: f64,
    /// GPU GiB allocated / GPU GiB of the cluster.
    pub allocation: f64,
    /// Tasks arrived so far.
    pub arrived: usize,
    /// Tasks that found no node, by cause (indexed like [`Cause::ALL`]).
    pub failed: [usize; 6],
    /// Of `failed`, tasks that no node of kube-scheduler's walk ([`NodesToScore::Adaptive`])
    /// took while a node the walk did not reach would have.
    pub failed_outside_walk: usize,
    /// Free GPU GiB on nodes whose free CPU or memory is below the typical GPU task's, as a
    /// share of the cluster's GPU GiB.
    pub stranded: f64,
    /// Whole idle GPUs on such nodes, as a share of the cluster's GPUs.
    pub stranded_gpus: f64,
    /// GiB booked beyond their request by tasks that take their GPUs whole (a whole-GPU
    /// task on a GPU larger than it asked for, [`RequestForm::Exclusive`] only), as a share
    /// of the cluster's GPU GiB. Not in `allocation`, which counts what tasks asked for.
    pub whole_surplus: f64,
}

/// What one replay measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Run {
    /// The allocation ratio when arrived demand first reached each tenth (10 % … 130 %).
    pub curve: Vec<(f64, f64)>,
    /// At 100 % arrived demand.
    pub at_full: Snapshot,
    /// At the end (130 %).
    pub end: Snapshot,
}

/// The cluster as the replay tracks it, whatever places the tasks.
struct Nodes<'a> {
    specs: &'a [SimNode],
    names: Vec<String>,
    /// Requested CPU and memory per node.
    used: Vec<Host>,
    /// Free GiB per GPU per node.
    free: Vec<Vec<u64>>,
    /// GPU memory the node's pods request, as kube-scheduler counts the extended resource
    /// (a pod's total, whatever its GPUs hold).
    requested_gib: Vec<u64>,
}

impl<'a> Nodes<'a> {
    fn new(specs: &'a [SimNode]) -> Self {
        Self {
            specs,
            names: (0..specs.len()).map(|n| format!("node-{n:05}")).collect(),
            used: vec![Host::default(); specs.len()],
            free: specs
                .iter()
                .map(|n| vec![n.gpu_gib; n.gpus as usize])
                .collect(),
            requested_gib: vec![0; specs.len()],
        }
    }

    fn host_free(&self, n: usize) -> Host {
        self.specs[n].host.saturating_sub(self.used[n])
    }

    fn model_ok(&self, n: usize, task: &Task) -> bool {
        task.model.is_none_or(|m| m.contains(self.specs[n].model))
    }

    /// GPUs of node `n` with `task.gpu_gib` free (`whole`: empty GPUs of at least that
    /// size): enough of them?
    fn gpus_ok(&self, n: usize, task: &Task, whole: bool) -> bool {
        let size = self.specs[n].gpu_gib;
        let takes = |free: u64| {
            if whole {
                free == size && size >= task.gpu_gib
            } else {
                free >= task.gpu_gib
            }
        };
        task.gpus == 0 || self.free[n].iter().filter(|f| takes(**f)).count() >= task.gpus as usize
    }

    /// Books `task` on node `n`'s `gpus`: its GiB on each, or the whole GPUs when `whole`.
    /// Returns the GiB booked beyond the task's request.
    fn place(&mut self, n: usize, task: &Task, gpus: &[usize], whole: bool) -> u64 {
        self.used[n] = self.used[n].saturating_add(task.host);
        self.requested_gib[n] += task.demand_gib();
        let mut surplus = 0;
        for &g in gpus {
            let booked = if whole { self.free[n][g] } else { task.gpu_gib };
            surplus += booked - task.gpu_gib;
            self.free[n][g] -= booked;
        }
        surplus
    }

    /// Why no node took `task` under `strategy` and `form`.
    fn cause(&self, task: &Task, strategy: Strategy, form: RequestForm) -> Cause {
        if task.gpus > 1 && !strategy.places_multi_gpu() {
            return Cause::MultiGpu;
        }
        let whole = strategy.books_whole(task, form);
        let (mut any_gpu, mut cpu, mut memory) = (false, false, false);
        for n in 0..self.specs.len() {
            if !self.model_ok(n, task) || !self.gpus_ok(n, task, whole) {
                continue;
            }
            any_gpu = true;
            let free = self.host_free(n);
            let (c, m) = (
                free.milli_cpu >= task.host.milli_cpu,
                free.memory_mib >= task.host.memory_mib,
            );
            if c && m {
                return Cause::Other;
            }
            cpu |= c;
            memory |= m;
        }
        match (any_gpu, cpu, memory) {
            (false, _, _) => Cause::Gpu,
            (true, true, false) => Cause::Memory,
            (true, false, true) => Cause::Cpu,
            _ => Cause::Both,
        }
    }
}

/// Replays `tasks` on `nodes` with `strategy`, gpushare pods asking for whole- and
/// multi-GPU tasks in `form`, kube-scheduler looking at `to_score` (BestFit and FGD look at
/// every node whatever it says); `seed` drives kube-scheduler's tie-break.
pub fn replay(
    nodes: &[SimNode],
    tasks: &[Task],
    strategy: Strategy,
    form: RequestForm,
    to_score: NodesToScore,
    seed: u64,
) -> Run {
    replay_to_end(nodes, tasks, strategy, form, to_score, seed).0
}

/// [`replay`], with the cluster as the replay and (for gpushare) the allocator left it.
fn replay_to_end<'a>(
    nodes: &'a [SimNode],
    tasks: &[Task],
    strategy: Strategy,
    form: RequestForm,
    to_score: NodesToScore,
    seed: u64,
) -> (Run, Nodes<'a>, Option<Cluster>) {
    let mut state = Nodes::new(nodes);
    // One kube-scheduler for the whole replay: its walk resumes where the previous pod's
    // stopped, GPU and CPU-only pods alike.
    let mut kube = KubeScheduler::new(
        if strategy.walks() {
            to_score
        } else {
            NodesToScore::All
        },
        seed,
    );
    let capacity: u64 = nodes.iter().map(|n| u64::from(n.gpus) * n.gpu_gib).sum();
    let total_gpus: u64 = nodes.iter().map(|n| u64::from(n.gpus)).sum();
    let typical = typical_gpu_task(tasks);
    let mut cluster = strategy.is_gpushare().then(|| gpushare_cluster(nodes));
    let fgd_shapes = matches!(strategy, Strategy::Fgd { .. }).then(|| fgd::shapes(tasks));
    let mut run = Run::default();
    let mut snapshot = Snapshot::default();
    let (mut arrived_gib, mut allocated_gib, mut surplus_gib) = (0u64, 0u64, 0u64);
    let mut next_tenth = 1;
    let take = |state: &Nodes<'_>, snapshot: &Snapshot, [allocated, arrived, surplus]: [u64; 3]| {
        let (stranded, stranded_gpus) = stranded(state, typical);
        Snapshot {
            demand: arrived as f64 / capacity as f64,
            allocation: allocated as f64 / capacity as f64,
            stranded: stranded as f64 / capacity as f64,
            stranded_gpus: stranded_gpus as f64 / total_gpus as f64,
            whole_surplus: surplus as f64 / capacity as f64,
            ..snapshot.clone()
        }
    };
    for (i, task) in tasks.iter().enumerate() {
        snapshot.arrived += 1;
        arrived_gib += task.demand_gib();
        let mut outside_walk = false;
        let placed = if task.gpus == 0 && strategy.cpu_pods_by_default_scheduler() {
            default_scheduler(&state, task, &mut kube).map(|n| (n, Vec::new()))
        } else if task.gpus > 1 && !strategy.places_multi_gpu() {
            None
        } else {
            let placed = match strategy {
                Strategy::Gpushare { policy, profile } => gpushare(
                    &state,
                    cluster.as_mut(),
                    task,
                    policy,
                    profile,
                    form,
                    (i, &mut kube),
                ),
                Strategy::Fragmentation { profile } => gpushare(
                    &state,
                    cluster.as_mut(),
                    task,
                    Some(Policy::Fragmentation),
                    profile,
                    form,
                    (i, &mut kube),
                ),
                Strategy::BestFit { .. } => best_fit(&state, task).ok_or(Missed::Everywhere),
                Strategy::DraFirstFit => dra_first_fit(&state, task, &mut kube),
                Strategy::Fgd { .. } => {
                    fgd::place(&state, fgd_shapes.as_deref().unwrap_or(&[]), task)
                        .ok_or(Missed::Everywhere)
                }
            };
            outside_walk = placed == Err(Missed::OutsideWalk);
            placed.ok()
        };
        match placed {
            Some((n, gpus)) => {
                surplus_gib += state.place(n, task, &gpus, strategy.books_whole(task, form));
                // The extender's view books every bound pod's CPU and memory.
                if let Some(cluster) = cluster.as_mut() {
                    cluster.set_pod_host(
                        PodId::from(format!("task-{i}")),
                        &state.names[n],
                        task.host,
                    );
                }
                allocated_gib += task.demand_gib();
            }
            None => {
                let cause = state.cause(task, strategy, form);
                snapshot.failed[Cause::ALL.iter().position(|c| *c == cause).unwrap_or(5)] += 1;
                snapshot.failed_outside_walk += usize::from(outside_walk);
            }
        }
        while next_tenth <= 13 && arrived_gib * 10 >= capacity * next_tenth {
            let now = take(&state, &snapshot, [allocated_gib, arrived_gib, surplus_gib]);
            run.curve.push((next_tenth as f64 / 10.0, now.allocation));
            if next_tenth == 10 {
                run.at_full = now;
            }
            next_tenth += 1;
        }
    }
    run.end = take(&state, &snapshot, [allocated_gib, arrived_gib, surplus_gib]);
    (run, state, cluster)
}

/// The median CPU and memory of single-GPU tasks: a node with less free cannot take a
/// typical GPU task, and its free GPUs are stranded.
fn typical_gpu_task(tasks: &[Task]) -> Host {
    let median = |mut values: Vec<u64>| {
        values.sort_unstable();
        values.get(values.len() / 2).copied().unwrap_or(0)
    };
    let single = || tasks.iter().filter(|t| t.gpus == 1);
    Host::new(
        median(single().map(|t| t.host.milli_cpu).collect()),
        median(single().map(|t| t.host.memory_mib).collect()),
    )
}

/// Free GPU GiB and whole idle GPUs on nodes that cannot host the typical GPU task.
fn stranded(state: &Nodes<'_>, typical: Host) -> (u64, u64) {
    let (mut gib, mut gpus) = (0, 0);
    for n in 0..state.specs.len() {
        if state.host_free(n).fits(typical) {
            continue;
        }
        gib += state.free[n].iter().sum::<u64>();
        gpus += state.free[n]
            .iter()
            .filter(|f| **f == state.specs[n].gpu_gib)
            .count() as u64;
    }
    (gib, gpus)
}

fn gpushare_cluster(nodes: &[SimNode]) -> Cluster {
    let mut cluster = Cluster::rebuild(
        nodes.iter().enumerate().map(|(n, spec)| {
            let gpus = (0..spec.gpus)
                .map(|index| Gpu {
                    index,
                    uuid: format!("GPU-{n}-{index}"),
                    model: MODELS[spec.model].name.to_owned(),
                    numa: None,
                    total_gib: spec.gpu_gib,
                    healthy: true,
                })
                .collect();
            (format!("node-{n:05}"), gpus, true)
        }),
        std::iter::empty(),
    );
    for (n, spec) in nodes.iter().enumerate() {
        cluster.set_node_host(&format!("node-{n:05}"), Some(spec.host));
    }
    cluster
}

/// kube-scheduler's `NodeResourcesFit` (LeastAllocated) + `NodeResourcesBalancedAllocation`
/// on CPU and memory, integer for integer as `gpushare_e2e::scheduler::framework::default_score`
/// computes them (a test checks they agree): the extender's [`kube_scores`], every task here
/// asking for CPU and memory.
pub fn default_score(allocatable: Host, used: Host, pod: Host) -> i64 {
    let requested = used.saturating_add(pod);
    kube_scores::least_allocated(allocatable, requested)
        + kube_scores::balanced_allocation(allocatable, requested)
}

/// `NodeResourcesBalancedAllocation` on CPU and memory.
fn balanced_allocation(allocatable: Host, used: Host, pod: Host) -> i64 {
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
fn native_most_allocated_score(state: &Nodes<'_>, n: usize, pod_gib: u64, pod: Host) -> i64 {
    let spec = &state.specs[n];
    let gpu_mem = Scored {
        allocatable: u64::from(spec.gpus) * spec.gpu_gib,
        requested: state.requested_gib[n],
        pod: pod_gib,
        weight: 1,
    };
    most_allocated(&[gpu_mem]) + balanced_allocation(spec.host, state.used[n], pod)
}

/// kube-scheduler as the replay keeps it from pod to pod: where its next walk over the nodes
/// starts, and the randomness of its tie-breaks.
struct KubeScheduler {
    to_score: NodesToScore,
    /// `nextStartNodeIndex`: the node the next walk starts at.
    next_start_node_index: usize,
    rng: StdRng,
}

/// One walk of kube-scheduler's filters over the nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Walk {
    /// The nodes that passed, in the order visited.
    feasible: Vec<usize>,
    /// The first node the walk did not visit.
    stopped_at: usize,
    /// How many nodes, from `stopped_at` round the cluster, it did not visit.
    unvisited: usize,
    /// All nodes.
    all: usize,
}

impl Walk {
    /// The nodes the walk did not reach, in the order it would have visited them.
    fn unvisited(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.unvisited).map(|k| (self.stopped_at + k) % self.all)
    }
}

impl KubeScheduler {
    fn new(to_score: NodesToScore, seed: u64) -> Self {
        Self {
            to_score,
            next_start_node_index: 0,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// `findNodesThatPassFilters`, one node at a time as `State::filter` in gpushare-e2e's
    /// scheduler: from `nextStartNodeIndex`, round the `all` nodes, until enough pass
    /// `feasible` (all of them with [`NodesToScore::All`]); the next walk starts after the last
    /// node visited. With every node visited it starts where this one did.
    fn walk(&mut self, all: usize, mut feasible: impl FnMut(usize) -> bool) -> Walk {
        let want = match self.to_score {
            NodesToScore::Adaptive => num_feasible_nodes_to_find(all),
            NodesToScore::All => all,
            NodesToScore::Percentage(p) => num_feasible_nodes_to_find_at(all, p),
        };
        let start = if all == 0 {
            0
        } else {
            self.next_start_node_index % all
        };
        let mut found = Vec::new();
        let mut processed = 0;
        while processed < all && found.len() < want {
            let n = (start + processed) % all;
            processed += 1;
            if feasible(n) {
                found.push(n);
            }
        }
        let stopped_at = if all == 0 {
            0
        } else {
            (start + processed) % all
        };
        self.next_start_node_index = stopped_at;
        Walk {
            feasible: found,
            stopped_at,
            unvisited: all - processed,
            all,
        }
    }
}

/// Why a strategy placed a task nowhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Missed {
    /// No node it looked at took the task, and it looked at every node that could.
    Everywhere,
    /// No node of kube-scheduler's walk took the task, but a node the walk did not reach would
    /// have.
    OutsideWalk,
}

/// kube-scheduler's `selectHost`: the highest total, ties broken uniformly at random.
fn select_host(scores: impl Iterator<Item = (usize, i64)>, rng: &mut StdRng) -> Option<usize> {
    let mut best: Option<(usize, i64)> = None;
    let mut ties = 0u32;
    for (n, score) in scores {
        match best {
            Some((_, top)) if score < top => {}
            Some((_, top)) if score == top => {
                ties += 1;
                if rng.random_range(0..ties) == 0 {
                    best = Some((n, score));
                }
            }
            _ => {
                best = Some((n, score));
                ties = 1;
            }
        }
    }
    best.map(|(n, _)| n)
}

/// A CPU-only pod in a gpushare cluster: the default scheduler's profile places it among the
/// nodes its walk finds with room for the pod's CPU and memory.
fn default_scheduler(state: &Nodes<'_>, task: &Task, kube: &mut KubeScheduler) -> Option<usize> {
    let walk = kube.walk(state.specs.len(), |n| state.host_free(n).fits(task.host));
    select_host(
        walk.feasible.iter().map(|&n| {
            (
                n,
                default_score(state.specs[n].host, state.used[n], task.host),
            )
        }),
        &mut kube.rng,
    )
}

/// The devices kube-scheduler's DRA allocator gives `task`'s claim on a node whose GPUs have
/// `free` GiB: the first `gpus` of them, in the slice's order, with the share free.
fn first_fit_devices(free: &[u64], task: &Task) -> Option<Vec<usize>> {
    let wanted = task.gpus.max(1) as usize;
    let picked: Vec<usize> = free
        .iter()
        .enumerate()
        .filter(|(_, free)| **free >= task.gpu_gib)
        .map(|(g, _)| g)
        .take(wanted)
        .collect();
    (picked.len() == wanted).then_some(picked)
}

/// [`Strategy::DraFirstFit`]: kube-scheduler's walk with the DynamicResources filter, its
/// default scores, and the allocator's first fit on the node it picks.
fn dra_first_fit(
    state: &Nodes<'_>,
    task: &Task,
    kube: &mut KubeScheduler,
) -> Result<(usize, Vec<usize>), Missed> {
    let feasible = |n: usize| {
        state.model_ok(n, task)
            && state.host_free(n).fits(task.host)
            && first_fit_devices(&state.free[n], task).is_some()
    };
    let walk = kube.walk(state.specs.len(), feasible);
    let chosen = select_host(
        walk.feasible.iter().map(|&n| {
            (
                n,
                default_score(state.specs[n].host, state.used[n], task.host),
            )
        }),
        &mut kube.rng,
    );
    match chosen {
        Some(n) => first_fit_devices(&state.free[n], task)
            .map(|gpus| (n, gpus))
            .ok_or(Missed::Everywhere),
        None if walk.unvisited().any(feasible) => Err(Missed::OutsideWalk),
        None => Err(Missed::Everywhere),
    }
}

/// Whether a task asks for whole GPUs: all of its GPU model's memory, on one GPU or more.
fn is_whole(task: &Task) -> bool {
    matches!(task.kind, TaskKind::Whole | TaskKind::Multi)
}

/// The request a gpushare pod for `task` makes: fractional tasks a shared slice of one GPU;
/// whole- and multi-GPU tasks `gpus: N` and the total GiB, which in the plain `form` is N
/// shared slices of the task's GiB and with [`RequestForm::Exclusive`] N empty GPUs of at
/// least the task's GiB each, booked in full.
pub fn gpushare_request(task: &Task, form: RequestForm) -> Request {
    Request {
        gpus: task.gpus.max(1),
        exclusive: form == RequestForm::Exclusive && is_whole(task),
        pod_gib: task.demand_gib(),
        containers: vec![task.demand_gib()],
        host: task.host,
        ..Request::default()
    }
}

/// A GPU task's pod, asking in `form`, through kube-scheduler and the gpushare extender:
/// kube-scheduler's walk, then on the nodes it found filter = the allocator's fit, prioritize =
/// its scores (as `profile` asks), bind = its reserve.
fn gpushare(
    state: &Nodes<'_>,
    cluster: Option<&mut Cluster>,
    task: &Task,
    policy: Option<Policy>,
    profile: Profile,
    form: RequestForm,
    (i, kube): (usize, &mut KubeScheduler),
) -> Result<(usize, Vec<usize>), Missed> {
    let cluster = cluster.ok_or(Missed::Everywhere)?;
    let request = gpushare_request(task, form);
    // The extender's view sees the pod arrive (pending) before the scheduler asks about it;
    // as the extender, it learns one-GPU shapes only.
    if !request.is_multi() {
        cluster.observe(Shape {
            gpu_gib: request.pod_gib,
            host: task.host,
        });
    }
    // kube-scheduler's filters (the model's node label; CPU, memory and the GPU-memory
    // resource, the node's total, as `NodeResourcesFit` counts them) pick the nodes its walk
    // finds; the extender's filter (the allocator's fit) runs on those alone.
    let walk = kube.walk(state.specs.len(), |n| {
        let spec = &state.specs[n];
        state.model_ok(n, task)
            && state.host_free(n).fits(task.host)
            && state.requested_gib[n] + request.pod_gib <= u64::from(spec.gpus) * spec.gpu_gib
    });
    let extender_fits = |n: usize| cluster.fit(&state.names[n], &request).is_ok();
    let candidates: Vec<usize> = walk
        .feasible
        .iter()
        .copied()
        .filter(|&n| extender_fits(n))
        .collect();
    if candidates.is_empty() {
        // A node the walk did not reach, passing both filters, would have taken the pod.
        let outside = walk.unvisited().any(|n| {
            state.model_ok(n, task) && state.host_free(n).fits(task.host) && extender_fits(n)
        });
        return Err(if outside {
            Missed::OutsideWalk
        } else {
            Missed::Everywhere
        });
    }
    let names: Vec<&str> = candidates.iter().map(|&n| &*state.names[n]).collect();
    let extender: Option<Vec<u8>> = policy
        .filter(|_| candidates.len() > 1 && profile.extender_scores())
        .map(|policy| cluster.scores(&names, &request, policy));
    let totals = candidates.iter().enumerate().map(|(c, &n)| {
        let theirs = extender.as_ref().map_or(0, |s| i64::from(s[c]) * 10);
        let total = match profile {
            Profile::Default { weight } => {
                default_score(state.specs[n].host, state.used[n], task.host) + theirs * weight
            }
            Profile::FilterKeepBest => {
                default_score(state.specs[n].host, state.used[n], task.host) + theirs
            }
            Profile::Weighted {
                least,
                most,
                balanced,
                extender,
            } => {
                let (allocatable, requested) =
                    (state.specs[n].host, state.used[n].saturating_add(task.host));
                let most_score = |r: u64, c: u64| -> i64 {
                    if c == 0 {
                        return 0;
                    }
                    (r.min(c) as i128 * 100 / c as i128) as i64
                };
                let most_allocated = (most_score(requested.milli_cpu, allocatable.milli_cpu)
                    + most_score(requested.memory_mib, allocatable.memory_mib))
                    / 2;
                least * kube_scores::least_allocated(allocatable, requested)
                    + most * most_allocated
                    + balanced * kube_scores::balanced_allocation(allocatable, requested)
                    + extender * theirs
            }
            Profile::ExtenderOnly => theirs,
            Profile::NativeMostAllocated => {
                native_most_allocated_score(state, n, request.pod_gib, task.host)
            }
        };
        (n, total)
    });
    let n = if matches!(profile, Profile::FilterKeepBest | Profile::Weighted { .. }) {
        // The first of the highest totals: the one node the filter passes.
        totals
            .rev()
            .max_by_key(|&(_, total)| total)
            .map(|(n, _)| n)
            .ok_or(Missed::Everywhere)?
    } else {
        select_host(totals, &mut kube.rng).ok_or(Missed::Everywhere)?
    };
    let uid = PodId::from(format!("task-{i}"));
    let bind = policy.unwrap_or(Policy::Binpack);
    let placement = cluster
        .reserve(uid.clone(), &state.names[n], &request, bind)
        .map_err(|_| Missed::Everywhere)?;
    let gpus: Vec<usize> = std::iter::once(placement.gpu)
        .chain(placement.more_gpus.iter().map(|(index, _)| *index))
        .map(|index| index as usize)
        .collect();
    // The device plugin allocates at once in this simulation: no containers wait as twins.
    cluster.upsert_pod(uid, &state.names[n], placement.allocated());
    Ok((n, gpus))
}

/// BestFit: the node left with the least free GPU, CPU and memory (each as a share of the
/// node's own, equally weighted); on it, the snuggest GPUs.
fn best_fit(state: &Nodes<'_>, task: &Task) -> Option<(usize, Vec<usize>)> {
    let mut best: Option<(usize, f64)> = None;
    for n in 0..state.specs.len() {
        if !state.model_ok(n, task)
            || !state.gpus_ok(n, task, false)
            || !state.host_free(n).fits(task.host)
        {
            continue;
        }
        let spec = &state.specs[n];
        let free = state.host_free(n).saturating_sub(task.host);
        let gpu_total = (spec.gpu_gib * u64::from(spec.gpus)) as f64;
        let gpu_free = (state.free[n].iter().sum::<u64>() - task.demand_gib()) as f64;
        let left = gpu_free / gpu_total
            + free.milli_cpu as f64 / spec.host.milli_cpu as f64
            + free.memory_mib as f64 / spec.host.memory_mib as f64;
        if best.is_none_or(|(_, b)| left < b) {
            best = Some((n, left));
        }
    }
    let (n, _) = best?;
    Some((n, snuggest(&state.free[n], task)))
}

/// The `task.gpus` GPUs with the least free memory that still fits.
fn snuggest(free: &[u64], task: &Task) -> Vec<usize> {
    let mut fitting: Vec<usize> = (0..free.len())
        .filter(|&g| free[g] >= task.gpu_gib)
        .collect();
    fitting.sort_by_key(|&g| (free[g], g));
    fitting.truncate(task.gpus as usize);
    fitting
}

/// FGD as published: expected fragmentation against the task population, every task kind.
mod fgd {
    use super::{Host, Models, Nodes, Task, snuggest};
    use std::collections::BTreeMap;

    /// A typical task: GPUs, GiB each, host, model constraint; and its share of the stream.
    #[derive(Debug, Clone, Copy)]
    pub(super) struct Typical {
        gpus: u32,
        gpu_gib: u64,
        host: Host,
        model: Option<Models>,
        weight: f64,
    }

    /// The most typical tasks FGD weighs (the rest are too rare to move a decision).
    const MAX_TYPICAL: usize = 32;

    /// The task population: tasks grouped by GPUs, GiB, model and CPU/memory within a power of
    /// two (the group keeps its largest host), the heaviest groups (ties in key order, so every run keeps the same ones).
    pub(super) fn shapes(tasks: &[Task]) -> Vec<Typical> {
        let mut groups: BTreeMap<(u32, u64, Option<Models>, u32, u32), Typical> = BTreeMap::new();
        for t in tasks {
            let key = (
                t.gpus,
                t.gpu_gib,
                t.model,
                u64::BITS - t.host.milli_cpu.leading_zeros(),
                u64::BITS - t.host.memory_mib.leading_zeros(),
            );
            let group = groups.entry(key).or_insert(Typical {
                gpus: t.gpus,
                gpu_gib: t.gpu_gib,
                host: t.host,
                model: t.model,
                weight: 0.0,
            });
            group.host.milli_cpu = group.host.milli_cpu.max(t.host.milli_cpu);
            group.host.memory_mib = group.host.memory_mib.max(t.host.memory_mib);
            group.weight += 1.0;
        }
        let mut shapes: Vec<Typical> = groups.into_values().collect();
        shapes.sort_by(|a, b| {
            b.weight
                .total_cmp(&a.weight)
                .then(a.gpu_gib.cmp(&b.gpu_gib))
        });
        shapes.truncate(MAX_TYPICAL);
        shapes
    }

    /// F_n(M) of node `n` with `free` GPU memory and `host` free.
    fn fragmentation(
        state: &Nodes<'_>,
        n: usize,
        free: &[u64],
        host: Host,
        shapes: &[Typical],
    ) -> f64 {
        let total: u64 = free.iter().sum();
        let model = state.specs[n].model;
        shapes
            .iter()
            .map(|s| {
                let runs = s.gpus > 0
                    && s.model.is_none_or(|m| m.contains(model))
                    && host.fits(s.host)
                    && free.iter().filter(|f| **f >= s.gpu_gib).count() >= s.gpus as usize;
                let lost = if runs {
                    free.iter().filter(|f| **f < s.gpu_gib).sum::<u64>()
                } else {
                    total
                };
                s.weight * lost as f64
            })
            .sum()
    }

    /// The node and GPUs adding the least fragmentation; ties to the lowest node.
    pub(super) fn place(
        state: &Nodes<'_>,
        shapes: &[Typical],
        task: &Task,
    ) -> Option<(usize, Vec<usize>)> {
        let mut best: Option<(usize, Vec<usize>, f64)> = None;
        let mut scratch = Vec::new();
        for n in 0..state.specs.len() {
            let host = state.host_free(n);
            if !state.model_ok(n, task) || !state.gpus_ok(n, task, false) || !host.fits(task.host) {
                continue;
            }
            let free = &state.free[n];
            let before = fragmentation(state, n, free, host, shapes);
            let after_host = host.saturating_sub(task.host);
            let choices: Vec<Vec<usize>> = if task.gpus == 1 {
                // Each distinct free amount once.
                let mut seen = Vec::new();
                (0..free.len())
                    .filter(|&g| free[g] >= task.gpu_gib)
                    .filter(|&g| {
                        let new = !seen.contains(&free[g]);
                        seen.push(free[g]);
                        new
                    })
                    .map(|g| vec![g])
                    .collect()
            } else {
                vec![snuggest(free, task)]
            };
            for gpus in choices {
                scratch.clear();
                scratch.extend_from_slice(free);
                for &g in &gpus {
                    scratch[g] -= task.gpu_gib;
                }
                let delta = fragmentation(state, n, &scratch, after_host, shapes) - before;
                if best.as_ref().is_none_or(|(_, _, b)| delta < *b) {
                    best = Some((n, gpus, delta));
                }
            }
        }
        best.map(|(n, gpus, _)| (n, gpus))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::realistic::generator::{TaskMix, generate_nodes, generate_tasks};
    use gpushare_allocator::GpuUsage;
    use gpushare_e2e::scheduler::framework::{self, CPU, MEMORY, NodeUsage, PodUsage, Resources};

    /// binpack, classic, fragmentation (extender scores only) and native MostAllocated.
    fn binpack_classic_fragmentation_native() -> [Strategy; 4] {
        [
            Strategy::Gpushare {
                policy: Some(Policy::Binpack),
                profile: Profile::Default { weight: 1 },
            },
            Strategy::Gpushare {
                policy: None,
                profile: Profile::Default { weight: 1 },
            },
            Strategy::Fragmentation {
                profile: Profile::ExtenderOnly,
            },
            Strategy::Gpushare {
                policy: Some(Policy::Binpack),
                profile: Profile::NativeMostAllocated,
            },
        ]
    }

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
            strategy: framework::FitStrategy::MostAllocated,
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

    fn task(kind: TaskKind, gpus: u32, gpu_gib: u64) -> Task {
        Task {
            kind,
            gpus,
            gpu_gib,
            host: Host::new(1_000, 1_024),
            model: None,
        }
    }

    #[test]
    fn the_dra_allocator_takes_the_first_gpus_with_the_share_free() {
        let free = [2, 8, 16, 8];
        // First fit, not best fit: the 8 GiB GPU before the 16 and the later 8.
        assert_eq!(
            first_fit_devices(&free, &task(TaskKind::Fractional, 1, 4)),
            Some(vec![1])
        );
        // N distinct GPUs, in the slice's order.
        assert_eq!(
            first_fit_devices(&free, &task(TaskKind::Multi, 2, 8)),
            Some(vec![1, 2])
        );
        assert_eq!(
            first_fit_devices(&free, &task(TaskKind::Multi, 3, 16)),
            None
        );
        assert_eq!(
            first_fit_devices(&free, &task(TaskKind::Whole, 1, 16)),
            Some(vec![2])
        );
    }

    #[test]
    fn exclusive_whole_and_multi_gpu_tasks_take_whole_empty_gpus() {
        // One node of 4 x 16 GiB.
        let nodes = [SimNode {
            model: 1,
            gpus: 4,
            gpu_gib: 16,
            host: Host::new(64_000, 262_144),
        }];
        let tasks = [
            task(TaskKind::Fractional, 1, 4),
            task(TaskKind::Multi, 2, 16),
            task(TaskKind::Whole, 1, 16),
            task(TaskKind::Fractional, 1, 8),
            task(TaskKind::Whole, 1, 16),
        ];
        let exclusive = |t| gpushare_request(t, RequestForm::Exclusive);
        assert_eq!(
            (exclusive(&tasks[1]).gpus, exclusive(&tasks[1]).pod_gib),
            (2, 32)
        );
        assert!(exclusive(&tasks[1]).exclusive && exclusive(&tasks[2]).exclusive);
        assert!(!exclusive(&tasks[3]).exclusive);
        for strategy in [
            Strategy::Gpushare {
                policy: Some(Policy::Binpack),
                profile: Profile::Default { weight: 1 },
            },
            Strategy::Gpushare {
                policy: Some(Policy::Spread),
                profile: Profile::ExtenderOnly,
            },
            Strategy::Fragmentation {
                profile: Profile::ExtenderOnly,
            },
            Strategy::Gpushare {
                policy: Some(Policy::Binpack),
                profile: Profile::NativeMostAllocated,
            },
        ] {
            let (run, state, _) = replay_to_end(
                &nodes,
                &tasks,
                strategy,
                RequestForm::Exclusive,
                NodesToScore::Adaptive,
                1,
            );
            // 4 + 8 share a GPU, the 2-GPU task and the first whole one take the other three;
            // the second whole-GPU task finds no empty GPU.
            assert_eq!(run.end.failed, [1, 0, 0, 0, 0, 0], "{strategy:?}");
            assert_eq!(run.end.allocation, 60.0 / 64.0, "{strategy:?}");
            let mut free = state.free[0].clone();
            free.sort_unstable();
            assert_eq!(free, [0, 0, 0, 4], "{strategy:?}");
        }
    }

    #[test]
    fn an_exclusive_whole_gpu_task_books_a_larger_gpu_in_full() {
        // One node of 2 x 80 GiB; a whole-GPU task of a 15 GiB model names no model.
        let nodes = [SimNode {
            model: 6,
            gpus: 2,
            gpu_gib: 80,
            host: Host::new(128_000, 1_048_576),
        }];
        let tasks = [
            task(TaskKind::Whole, 1, 15),
            task(TaskKind::Fractional, 1, 40),
            task(TaskKind::Fractional, 1, 40),
            task(TaskKind::Fractional, 1, 10),
        ];
        let binpack = Strategy::Gpushare {
            policy: Some(Policy::Binpack),
            profile: Profile::Default { weight: 1 },
        };
        let (run, state, cluster) = replay_to_end(
            &nodes,
            &tasks,
            binpack,
            RequestForm::Exclusive,
            NodesToScore::Adaptive,
            1,
        );
        assert_eq!(run.end.failed, [1, 0, 0, 0, 0, 0]);
        assert_eq!(run.end.allocation, 95.0 / 160.0);
        assert_eq!(run.end.whole_surplus, 65.0 / 160.0);
        assert_eq!(state.requested_gib[0], 95);
        let booked = cluster.as_ref().and_then(|c| c.node("node-00000"));
        let free: Vec<u64> = booked.map_or(Vec::new(), |n| {
            n.gpus().iter().map(GpuUsage::free_gib).collect()
        });
        assert_eq!(free, state.free[0]);
        // BestFit books only what the task asks for: the 10 GiB slice fits beside it.
        let (run, _, _) = replay_to_end(
            &nodes,
            &tasks,
            Strategy::BestFit { multi_gpu: true },
            RequestForm::Exclusive,
            NodesToScore::Adaptive,
            1,
        );
        assert_eq!(run.end.failed, [0; 6]);
        assert_eq!(run.end.whole_surplus, 0.0);
    }

    #[test]
    fn a_plain_whole_gpu_task_leaves_a_larger_gpu_to_fractional_tasks() {
        // One 80 GiB GPU; a whole-GPU task of a 15 GiB model names no model, then 65 GiB of
        // fractional tasks.
        let nodes = [SimNode {
            model: 6,
            gpus: 1,
            gpu_gib: 80,
            host: Host::new(128_000, 1_048_576),
        }];
        let tasks = [
            task(TaskKind::Whole, 1, 15),
            task(TaskKind::Fractional, 1, 40),
            task(TaskKind::Fractional, 1, 25),
        ];
        let request = gpushare_request(&tasks[0], RequestForm::Plain);
        assert_eq!(
            (request.gpus, request.pod_gib, request.exclusive),
            (1, 15, false)
        );
        for strategy in binpack_classic_fragmentation_native() {
            let (run, state, cluster) = replay_to_end(
                &nodes,
                &tasks,
                strategy,
                RequestForm::Plain,
                NodesToScore::Adaptive,
                1,
            );
            assert_eq!(run.end.failed, [0; 6], "{strategy:?}");
            assert_eq!(run.end.allocation, 1.0, "{strategy:?}");
            assert_eq!(run.end.whole_surplus, 0.0, "{strategy:?}");
            assert_eq!(state.free[0], [0], "{strategy:?}");
            let booked = cluster.as_ref().and_then(|c| c.node("node-00000"));
            let free: Vec<u64> = booked.map_or(Vec::new(), |n| {
                n.gpus().iter().map(GpuUsage::free_gib).collect()
            });
            assert_eq!(free, [0], "{strategy:?}");
            // Asked for with `exclusive`, the whole-GPU task keeps the GPU to itself.
            let (run, _, _) = replay_to_end(
                &nodes,
                &tasks,
                strategy,
                RequestForm::Exclusive,
                NodesToScore::Adaptive,
                1,
            );
            assert_eq!(run.end.failed, [2, 0, 0, 0, 0, 0], "{strategy:?}");
            assert_eq!(run.end.whole_surplus, 65.0 / 80.0, "{strategy:?}");
        }
    }

    #[test]
    fn the_replay_books_what_the_allocator_books() {
        let nodes = generate_nodes(40, 5);
        let tasks = generate_tasks(&nodes, &TaskMix::default(), 1.3, 5);
        assert!(tasks.iter().any(|t| t.kind == TaskKind::Multi));
        for strategy in [
            Strategy::Gpushare {
                policy: Some(Policy::Binpack),
                profile: Profile::Default { weight: 1 },
            },
            Strategy::Gpushare {
                policy: None,
                profile: Profile::Default { weight: 1 },
            },
            Strategy::Gpushare {
                policy: Some(Policy::Spread),
                profile: Profile::Default { weight: 1 },
            },
            Strategy::Fragmentation {
                profile: Profile::ExtenderOnly,
            },
            Strategy::Gpushare {
                policy: Some(Policy::Binpack),
                profile: Profile::NativeMostAllocated,
            },
        ] {
            for form in [RequestForm::Plain, RequestForm::Exclusive] {
                let (run, state, cluster) =
                    replay_to_end(&nodes, &tasks, strategy, form, NodesToScore::Adaptive, 5);
                let Some(cluster) = cluster else {
                    panic!("{strategy:?} replays through the allocator");
                };
                assert_eq!(run.end.failed[4], 0, "{strategy:?} places multi-GPU tasks");
                if form == RequestForm::Plain {
                    assert_eq!(run.end.whole_surplus, 0.0, "{strategy:?}");
                }
                for (n, name) in state.names.iter().enumerate() {
                    let free: Vec<u64> = cluster.node(name).map_or(Vec::new(), |node| {
                        node.gpus().iter().map(GpuUsage::free_gib).collect()
                    });
                    assert_eq!(free, state.free[n], "{strategy:?} {form:?}, {name}");
                }
                let booked: u64 = (0..state.specs.len())
                    .map(|n| {
                        let spec = &state.specs[n];
                        u64::from(spec.gpus) * spec.gpu_gib - state.free[n].iter().sum::<u64>()
                    })
                    .sum();
                let capacity: u64 = nodes.iter().map(|n| u64::from(n.gpus) * n.gpu_gib).sum();
                let counted = (run.end.allocation + run.end.whole_surplus) * capacity as f64;
                assert!(
                    (counted - booked as f64).abs() < 1e-6,
                    "{strategy:?} {form:?}"
                );
            }
        }
    }

    #[test]
    fn fragmentation_policy_beats_binpack_on_a_small_generated_cluster() {
        let nodes = generate_nodes(60, 3);
        let tasks = generate_tasks(&nodes, &TaskMix::default(), 1.3, 3);
        let chart = Profile::Default { weight: 1 };
        for form in [RequestForm::Plain, RequestForm::Exclusive] {
            let at_full = |strategy| {
                replay(&nodes, &tasks, strategy, form, NodesToScore::Adaptive, 3)
                    .at_full
                    .allocation
            };
            let binpack = at_full(Strategy::Gpushare {
                policy: Some(Policy::Binpack),
                profile: chart,
            });
            let ours = at_full(Strategy::Fragmentation { profile: chart });
            assert!(ours > binpack, "{form:?}: {ours} vs binpack {binpack}");
        }
    }

    #[test]
    fn replays_account_every_task_and_never_overcommit() {
        let nodes = generate_nodes(20, 4);
        let tasks = generate_tasks(&nodes, &TaskMix::default(), 1.3, 4);
        for strategy in [
            Strategy::Gpushare {
                policy: Some(Policy::Spread),
                profile: Profile::Default { weight: 1 },
            },
            Strategy::BestFit { multi_gpu: true },
            Strategy::Fgd {
                multi_gpu: false,
                cpu_pods_by_default: false,
            },
        ] {
            let run = replay(
                &nodes,
                &tasks,
                strategy,
                RequestForm::default(),
                NodesToScore::Adaptive,
                4,
            );
            assert_eq!(run.end.arrived, tasks.len());
            assert!(
                run.end.allocation <= 1.0 && run.end.allocation > 0.3,
                "{run:?}"
            );
            assert!(run.end.demand >= 1.3);
            assert_eq!(run.curve.len(), 13);
            assert!(
                run.curve.windows(2).all(|w| w[0].1 <= w[1].1),
                "allocation only grows"
            );
            let multi = tasks.iter().filter(|t| t.gpus > 1).count();
            let refused_multi = run.end.failed[4];
            if strategy.places_multi_gpu() {
                assert_eq!(refused_multi, 0);
            } else {
                assert_eq!(refused_multi, multi);
            }
        }
    }

    #[test]
    fn kube_scheduler_walks_round_robin_until_it_finds_enough_nodes() {
        // 300 nodes: 50 - 300 / 125 = 48 % of them, 144 (at least 100).
        assert_eq!(num_feasible_nodes_to_find(300), 144);
        let mut kube = KubeScheduler::new(NodesToScore::Adaptive, 0);
        let walk = kube.walk(300, |_| true);
        assert_eq!(walk.feasible, (0..144).collect::<Vec<_>>());
        assert_eq!(
            walk.unvisited().collect::<Vec<_>>(),
            (144..300).collect::<Vec<_>>()
        );
        assert_eq!(kube.next_start_node_index, 144);
        // The next walk starts where this one stopped and wraps round the cluster.
        let walk = kube.walk(300, |_| true);
        assert_eq!(walk.feasible, (144..288).collect::<Vec<_>>());
        let walk = kube.walk(300, |_| true);
        assert_eq!(walk.feasible, (288..300).chain(0..132).collect::<Vec<_>>());
        assert_eq!(kube.next_start_node_index, 132);
        // Every third node infeasible: the walk visits 215 nodes to find 144, and the next
        // one starts 215 further on, infeasible nodes counted.
        let mut kube = KubeScheduler::new(NodesToScore::Adaptive, 0);
        let walk = kube.walk(300, |n| n % 3 != 2);
        assert_eq!(
            walk.feasible,
            (0..300)
                .filter(|n| n % 3 != 2)
                .take(144)
                .collect::<Vec<_>>()
        );
        assert_eq!(walk.feasible.last(), Some(&214));
        assert_eq!(kube.next_start_node_index, 215);
        assert_eq!(walk.unvisited().count(), 85);
        // Fewer feasible nodes than it looks for: it visits every node, finds them all, and
        // the next walk starts where this one did.
        let walk = kube.walk(300, |n| n % 50 == 0);
        assert_eq!(walk.feasible, [250, 0, 50, 100, 150, 200]);
        assert_eq!(walk.unvisited().count(), 0);
        assert_eq!(kube.next_start_node_index, 215);
        // 1,200 nodes: 41 %, 492.
        let walk = kube.walk(1_200, |_| true);
        assert_eq!(walk.feasible.len(), 492);
        assert_eq!(kube.next_start_node_index, 215 + 492);
        // Below 100 nodes, and with every node to score: all of them, from the first.
        let walk = KubeScheduler::new(NodesToScore::Adaptive, 0).walk(99, |_| true);
        assert_eq!(walk.feasible, (0..99).collect::<Vec<_>>());
        let mut all = KubeScheduler::new(NodesToScore::All, 0);
        for _ in 0..2 {
            let walk = all.walk(1_200, |_| true);
            assert_eq!(walk.feasible, (0..1_200).collect::<Vec<_>>());
            assert_eq!(all.next_start_node_index, 0);
        }
        assert!(all.walk(0, |_| true).feasible.is_empty());
        // The chart's profile (1 %): 100 nodes at 1,200, the next walk from node 100.
        let mut chart = KubeScheduler::new(NodesToScore::Percentage(1), 0);
        assert_eq!(
            chart.walk(1_200, |_| true).feasible,
            (0..100).collect::<Vec<_>>()
        );
        assert_eq!(
            chart.walk(1_200, |_| true).feasible,
            (100..200).collect::<Vec<_>>()
        );
    }

    #[test]
    fn a_pod_fails_when_the_extender_refuses_every_node_of_the_walk() {
        // 200 nodes of 2 x 16 GiB: kube-scheduler looks for 100. Nodes 0-99 carry model 1,
        // nodes 100-199 model 2.
        let node = |model| SimNode {
            model,
            gpus: 2,
            gpu_gib: 16,
            host: Host::new(64_000, 262_144),
        };
        let nodes: Vec<SimNode> = (0..200)
            .map(|n| node(if n < 100 { 1 } else { 2 }))
            .collect();
        assert_eq!(num_feasible_nodes_to_find(200), 100);
        // 200 tasks of 10 GiB on model 1 fill one GPU each, leaving 6 + 6 GiB per node: 12 GiB
        // free for kube-scheduler, no GPU with 12 GiB for the extender. The walks start at node
        // 100 from the second on (the first found nodes 0-99). A CPU-only pod's walk takes
        // nodes 100-199, so the first 12 GiB pod's walk is nodes 0-99: all refused by the
        // extender while nodes 100-199 are empty. The second one's walk is nodes 100-199.
        let mut tasks: Vec<Task> = (0..200)
            .map(|_| Task {
                model: Some(Models::one(1)),
                ..task(TaskKind::Fractional, 1, 10)
            })
            .collect();
        tasks.push(task(TaskKind::CpuOnly, 0, 0));
        tasks.push(task(TaskKind::Fractional, 1, 12));
        tasks.push(task(TaskKind::Fractional, 1, 12));
        for strategy in binpack_classic_fragmentation_native() {
            let (run, state, _) = replay_to_end(
                &nodes,
                &tasks,
                strategy,
                RequestForm::Plain,
                NodesToScore::Adaptive,
                1,
            );
            assert_eq!(run.end.failed, [0, 0, 0, 0, 0, 1], "{strategy:?}");
            assert_eq!(run.end.failed_outside_walk, 1, "{strategy:?}");
            assert_eq!(run.end.allocation, 2_012.0 / 6_400.0, "{strategy:?}");
            assert!(
                (0..100).all(|n| state.free[n] == [6, 6]),
                "{strategy:?}: model-1 nodes full"
            );
            // Scoring every node, the first 12 GiB pod finds an empty node too.
            let (run, _, _) = replay_to_end(
                &nodes,
                &tasks,
                strategy,
                RequestForm::Plain,
                NodesToScore::All,
                1,
            );
            assert_eq!(run.end.failed, [0; 6], "{strategy:?}");
            assert_eq!(run.end.failed_outside_walk, 0, "{strategy:?}");
            assert_eq!(run.end.allocation, 2_024.0 / 6_400.0, "{strategy:?}");
        }
    }
}
