//! The replay: each strategy places the same task stream on the same cluster, and we watch
//! the allocation ratio climb as demand arrives.
//!
//! Strategies that go through kube-scheduler see only the nodes its walk finds
//! ([`NodesToScore`]): a pod none of them takes fails, even when a node the walk did not reach
//! would have taken it. BestFit and FGD, idealized, always look at every node. CPU-only pods
//! in a gpushare cluster go through the cluster's default scheduler, a process of its own
//! beside the chart's dedicated one (so a walk of its own, at the adaptive percentage); it
//! prefers nodes without an idle GPU where gpushare's extender taints them
//! (`extender.idleGpuTaint`), which GPU pods tolerate (the chart's routing adds it).

use gpushare_allocator::fragmentation::Host;
use gpushare_allocator::{Cluster, PodId, Policy};

use super::best_fit::best_fit;
use super::dra::dra_first_fit;
use super::fgd;
use super::generator::{SimNode, Task};
use super::gpushare::{gpushare, gpushare_cluster};
use super::kube_scheduler::{KubeScheduler, Missed, default_scheduler};
use super::nodes::Nodes;

pub use super::strategy::{Cause, NodesToScore, Profile, RequestForm, Strategy};

/// What demand and allocation are counted in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    /// GPU GiB, over the cluster's: gpushare's unit.
    Gib,
    /// GPUs, as the public trace counts them: demand is the tasks' milli-GPU
    /// ([`Task::milli`]), allocation each GPU's booked share of its memory (a GPU booked whole
    /// counts 1 whatever its size), over the cluster's GPUs.
    Gpus,
}

impl Measure {
    /// A task's demand: its GPU GiB, or its milli-GPU.
    pub fn demand(self, task: &Task) -> u64 {
        match self {
            Measure::Gib => task.demand_gib(),
            Measure::Gpus => task.milli,
        }
    }

    /// The cluster's: its GPU GiB, or its GPUs in milli-GPU.
    pub fn capacity(self, nodes: &[SimNode]) -> u64 {
        nodes
            .iter()
            .map(|n| match self {
                Measure::Gib => u64::from(n.gpus) * n.gpu_gib,
                Measure::Gpus => u64::from(n.gpus) * 1000,
            })
            .sum()
    }
}

/// The state at one point of the replay.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// Demand arrived so far / the cluster's, in the replay's [`Measure`].
    pub demand: f64,
    /// Allocated / the cluster's, in the replay's [`Measure`].
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

/// Replays `tasks` on `nodes` with `strategy`, gpushare pods asking for whole- and
/// multi-GPU tasks in `form`, kube-scheduler looking at `to_score` (BestFit and FGD look at
/// every node whatever it says), demand and allocation counted in `measure`; `seed` drives
/// kube-scheduler's tie-break.
pub fn replay_measured(
    nodes: &[SimNode],
    tasks: &[Task],
    strategy: Strategy,
    (form, measure): (RequestForm, Measure),
    to_score: NodesToScore,
    seed: u64,
) -> Run {
    replay_counting(nodes, tasks, strategy, (form, measure), to_score, seed).0
}

/// How many of `tasks` arrive until their demand reaches `demand` × the cluster's, in
/// `measure`: the one that reaches it included, as the replay reads each tenth.
pub fn arrivals_until(nodes: &[SimNode], tasks: &[Task], measure: Measure, demand: f64) -> usize {
    let target = (measure.capacity(nodes) as f64 * demand) as u64;
    let mut arrived = 0;
    tasks
        .iter()
        .take_while(|t| {
            let before = arrived;
            arrived += measure.demand(t);
            before < target
        })
        .count()
}

/// [`replay_measured`], with the cluster as the replay and (for gpushare) the allocator left
/// it.
fn replay_counting<'a>(
    nodes: &'a [SimNode],
    tasks: &[Task],
    strategy: Strategy,
    (form, measure): (RequestForm, Measure),
    to_score: NodesToScore,
    seed: u64,
) -> (Run, Nodes<'a>, Option<Cluster>) {
    let mut state = Nodes::new(nodes);
    let mut placer = Placer::new(nodes, tasks, strategy, form, (to_score, seed));
    let meter = Meter::new(nodes, tasks, measure);
    let mut run = Run::default();
    let mut snapshot = Snapshot::default();
    let mut counts = Counts::default();
    let mut next_tenth = 1;
    for (i, task) in tasks.iter().enumerate() {
        snapshot.arrived += 1;
        counts.arrived += measure.demand(task);
        match placer.place(&state, i, task) {
            Ok((n, gpus)) => {
                counts.surplus += state.place(n, task, &gpus, strategy.books_whole(task, form));
                // The extender's view books every bound pod's CPU and memory.
                if let Some(cluster) = placer.cluster.as_mut() {
                    cluster.set_pod_host(
                        PodId::from(format!("task-{i}")),
                        &state.names[n],
                        task.host,
                    );
                }
                counts.allocated += task.demand_gib();
            }
            Err(missed) => {
                let cause = state.cause(task, strategy, form);
                snapshot.failed[Cause::ALL.iter().position(|c| *c == cause).unwrap_or(5)] += 1;
                snapshot.failed_outside_walk += usize::from(missed == Missed::OutsideWalk);
            }
        }
        while next_tenth <= 13 && meter.demand_reached(&counts, next_tenth) {
            let now = meter.take(&state, &snapshot, &counts);
            run.curve.push((next_tenth as f64 / 10.0, now.allocation));
            if next_tenth == 10 {
                run.at_full = now;
            }
            next_tenth += 1;
        }
    }
    run.end = meter.take(&state, &snapshot, &counts);
    (run, state, placer.cluster)
}

/// Mixed into the seed of the default scheduler's tie-breaks.
const DEFAULT_SCHEDULER: u64 = 0x0064_6566_6175_6c74;

/// What places the tasks of one replay: the strategy, and what it keeps from task to task.
struct Placer {
    strategy: Strategy,
    form: RequestForm,
    /// One kube-scheduler for the whole replay: its walk resumes where the previous pod's
    /// stopped.
    kube: KubeScheduler,
    /// The cluster's default scheduler, which places CPU-only pods: its own walk, adaptive.
    /// (The classic extender and DRA mode, which run in it, get `kube`: only the walk's start
    /// and percentage differ.)
    default_kube: KubeScheduler,
    /// The allocator's cluster, as the extender keeps it (gpushare's strategies).
    cluster: Option<Cluster>,
    /// The task population FGD weighs (FGD only).
    fgd_shapes: Option<Vec<fgd::Typical>>,
}

impl Placer {
    fn new(
        nodes: &[SimNode],
        tasks: &[Task],
        strategy: Strategy,
        form: RequestForm,
        (to_score, seed): (NodesToScore, u64),
    ) -> Self {
        let to_score = if strategy.walks() {
            to_score
        } else {
            NodesToScore::All
        };
        Self {
            strategy,
            form,
            kube: KubeScheduler::new(to_score, seed),
            default_kube: KubeScheduler::new(NodesToScore::Adaptive, seed ^ DEFAULT_SCHEDULER),
            cluster: strategy.is_gpushare().then(|| gpushare_cluster(nodes)),
            fgd_shapes: matches!(strategy, Strategy::Fgd { .. }).then(|| fgd::shapes(tasks)),
        }
    }

    /// The node and GPUs task `i` goes to, or why it goes nowhere: CPU-only pods through the
    /// default scheduler where the strategy hands them to it, multi-GPU tasks refused where
    /// the strategy does not place them, every other task as the strategy places it.
    fn place(
        &mut self,
        state: &Nodes<'_>,
        i: usize,
        task: &Task,
    ) -> Result<(usize, Vec<usize>), Missed> {
        if task.gpus == 0 && self.strategy.cpu_pods_by_default_scheduler() {
            // The extender lifts its taint while pinned pods bring much of the GPU demand.
            let lifted = self
                .cluster
                .as_ref()
                .is_some_and(|c| !c.demand().wants_idle_gpu_taint());
            let taint = self.strategy.taints_idle_gpus() && !lifted;
            return default_scheduler(state, task, &mut self.default_kube, taint)
                .map(|n| (n, Vec::new()))
                .ok_or(Missed::Everywhere);
        }
        if task.gpus > 1 && !self.strategy.places_multi_gpu() {
            return Err(Missed::Everywhere);
        }
        let (policy, profile) = match self.strategy {
            Strategy::Gpushare { policy, profile } => (policy, profile),
            Strategy::Fragmentation { profile, .. } => (Some(Policy::Fragmentation), profile),
            Strategy::BestFit { .. } => return best_fit(state, task).ok_or(Missed::Everywhere),
            Strategy::DraFirstFit => return dra_first_fit(state, task, &mut self.kube),
            Strategy::Fgd { .. } => {
                let shapes = self.fgd_shapes.as_deref().unwrap_or(&[]);
                return fgd::place(state, shapes, task).ok_or(Missed::Everywhere);
            }
        };
        let (form, cluster, kube) = (self.form, self.cluster.as_mut(), (i, &mut self.kube));
        gpushare(state, cluster, task, policy, profile, form, kube)
    }
}

/// Demand and GiB counted as the replay goes.
#[derive(Debug, Clone, Copy, Default)]
struct Counts {
    /// Demand arrived so far (placed or not), in the replay's [`Measure`].
    arrived: u64,
    /// GiB asked for by the tasks placed.
    allocated: u64,
    /// GiB booked beyond their request by tasks that take their GPUs whole.
    surplus: u64,
}

/// Reads a [`Snapshot`] off the replay: the cluster's totals, and the typical GPU task that
/// decides which free GPUs are stranded.
struct Meter {
    /// GPU GiB of the cluster.
    capacity: u64,
    /// GPUs of the cluster.
    total_gpus: u64,
    typical: Host,
    measure: Measure,
    /// The cluster's demand in `measure`.
    demand_capacity: u64,
}

impl Meter {
    fn new(nodes: &[SimNode], tasks: &[Task], measure: Measure) -> Self {
        Self {
            capacity: Measure::Gib.capacity(nodes),
            total_gpus: nodes.iter().map(|n| u64::from(n.gpus)).sum(),
            typical: typical_gpu_task(tasks),
            measure,
            demand_capacity: measure.capacity(nodes),
        }
    }

    /// Whether arrived demand has reached `tenths` / 10 of the cluster's.
    fn demand_reached(&self, counts: &Counts, tenths: u64) -> bool {
        counts.arrived * 10 >= self.demand_capacity * tenths
    }

    /// `snapshot` (its counts of tasks) with the shares of the cluster as they are now.
    fn take(&self, state: &Nodes<'_>, snapshot: &Snapshot, counts: &Counts) -> Snapshot {
        let capacity = self.capacity;
        let (stranded, stranded_gpus) = stranded(state, self.typical);
        let (demand, allocation) = match self.measure {
            Measure::Gib => (
                counts.arrived as f64 / capacity as f64,
                counts.allocated as f64 / capacity as f64,
            ),
            Measure::Gpus => {
                let gpus = self.total_gpus.max(1) as f64;
                (
                    counts.arrived as f64 / 1000.0 / gpus,
                    booked_gpus(state) / gpus,
                )
            }
        };
        Snapshot {
            demand,
            allocation,
            stranded: stranded as f64 / capacity as f64,
            stranded_gpus: stranded_gpus as f64 / self.total_gpus as f64,
            whole_surplus: counts.surplus as f64 / capacity as f64,
            ..snapshot.clone()
        }
    }
}

/// GPUs booked, each counting its booked share of its memory.
fn booked_gpus(state: &Nodes<'_>) -> f64 {
    state
        .free
        .iter()
        .zip(state.specs)
        .filter(|(_, spec)| spec.gpu_gib > 0)
        .map(|(free, spec)| {
            let size = spec.gpu_gib as f64;
            free.iter().map(|f| 1.0 - *f as f64 / size).sum::<f64>()
        })
        .sum()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::realistic::generator::{
        MODELS, Models, TaskKind, TaskMix, generate_nodes, generate_tasks, test_node,
        test_task as task,
    };
    use crate::realistic::gpushare::gpushare_request;
    use NodesToScore::{Adaptive, All};
    use RequestForm::{Exclusive, ModelsInRequest, Plain};
    use gpushare_allocator::{GpuUsage, ModelFilter};
    use gpushare_scheduler_model::num_feasible_nodes_to_find;

    /// [`replay_counting`] in GiB.
    fn replay<'a>(
        nodes: &'a [SimNode],
        tasks: &[Task],
        strategy: Strategy,
        form: RequestForm,
        to_score: NodesToScore,
        seed: u64,
    ) -> (Run, Nodes<'a>, Option<Cluster>) {
        replay_counting(nodes, tasks, strategy, (form, Measure::Gib), to_score, seed)
    }

    /// Free GiB per GPU of node `name` as the allocator books it.
    fn allocator_free(cluster: Option<&Cluster>, name: &str) -> Vec<u64> {
        let node = cluster.and_then(|c| c.node(name));
        node.map_or(Vec::new(), |n| {
            n.gpus().iter().map(GpuUsage::free_gib).collect()
        })
    }

    /// 128 cores and 1 TiB.
    const BIG_HOST: Host = Host::new(128_000, 1_048_576);

    /// The chart's former default profile: default scores, the extender's weight 1.
    const CHART: Profile = Profile::Default { weight: 1 };

    /// binpack, classic, fragmentation (extender scores only) and native MostAllocated.
    fn binpack_classic_fragmentation_native() -> [Strategy; 4] {
        [
            Strategy::extender(Some(Policy::Binpack), CHART),
            Strategy::extender(None, CHART),
            Strategy::fragmentation(Profile::ExtenderOnly),
            Strategy::extender(Some(Policy::Binpack), Profile::NativeMostAllocated),
        ]
    }

    /// gpushare's extender taints the nodes with an idle GPU, so the default scheduler sends a
    /// CPU-only pod to the node whose GPU is in use, although LeastAllocated prefers the empty
    /// one (which it does with the classic extender, which taints nothing).
    #[test]
    fn cpu_only_pods_go_where_the_gpus_are_in_use_when_the_extender_taints_idle_ones() {
        let nodes = [test_node(1, 1, 16); 2];
        let tasks = [task(TaskKind::Whole, 1, 16), task(TaskKind::CpuOnly, 0, 0)];
        let tainting = Strategy::fragmentation(Profile::FilterKeepBest);
        let classic = Strategy::extender(None, CHART);
        assert!(tainting.taints_idle_gpus() && !classic.taints_idle_gpus());
        for (strategy, together) in [(tainting, true), (classic, false)] {
            let (run, state, _) = replay(&nodes, &tasks, strategy, Plain, Adaptive, 0);
            assert_eq!(run.end.failed, [0; 6], "{strategy:?}");
            let gpu_node = (0..2).find(|&n| state.free[n] == [0]).unwrap();
            // Both tasks ask for one core.
            let both_on_it = state.used[gpu_node].milli_cpu == 2_000;
            assert_eq!(both_on_it, together, "{strategy:?}: {:?}", state.used);
        }
    }

    /// With [`RequestForm::ModelsInRequest`] a pinned task names its models in the request,
    /// which kube-scheduler's walk does not read: on 150 T4 nodes and one A100-80 node last,
    /// a walk of 100 feasible nodes finds only T4s and the extender keeps none of them, where
    /// node affinity would have made the walk go on to the A100. On two nodes the extender
    /// keeps the one of the model.
    #[test]
    fn a_pin_in_the_request_is_honoured_by_the_extender_not_the_walk() {
        let node = |model: usize| test_node(model, 2, MODELS[model].gib);
        let pinned = Task {
            model: Some(Models::one(6)),
            ..task(TaskKind::Fractional, 1, 8)
        };
        let request = |form| gpushare_request(&pinned, form);
        assert!(request(Plain).models.is_any());
        let named = request(ModelsInRequest).models;
        assert_eq!(named, ModelFilter::parse(["A100-80"]));
        let row_11 = Strategy::fragmentation(Profile::FilterKeepBest);
        let mut many: Vec<SimNode> = vec![node(0); 150];
        many.push(node(6));
        let walk = NodesToScore::Percentage(1);
        let by_affinity = replay(&many, &[pinned], row_11, Plain, walk, 0).0;
        assert_eq!(by_affinity.end.failed, [0; 6]);
        let in_request = replay(&many, &[pinned], row_11, ModelsInRequest, walk, 0).0;
        assert_eq!(in_request.end.failed.iter().sum::<usize>(), 1);
        assert_eq!(in_request.end.failed_outside_walk, 1);
        let two = [node(0), node(6)];
        for form in [Plain, ModelsInRequest] {
            let (run, state, _) = replay(&two, &[pinned, pinned], row_11, form, Adaptive, 0);
            assert_eq!(run.end.failed, [0; 6], "{form:?}");
            assert_eq!(state.free[0], [15, 15], "{form:?}");
            assert_eq!(state.free[1].iter().sum::<u64>(), 160 - 16, "{form:?}");
        }
    }

    #[test]
    fn exclusive_whole_and_multi_gpu_tasks_take_whole_empty_gpus() {
        // One node of 4 x 16 GiB.
        let nodes = [test_node(1, 4, 16)];
        let tasks = [
            task(TaskKind::Fractional, 1, 4),
            task(TaskKind::Multi, 2, 16),
            task(TaskKind::Whole, 1, 16),
            task(TaskKind::Fractional, 1, 8),
            task(TaskKind::Whole, 1, 16),
        ];
        let exclusive = |t| gpushare_request(t, Exclusive);
        let multi = exclusive(&tasks[1]);
        assert_eq!((multi.gpus, multi.pod_gib, multi.exclusive), (2, 32, true));
        assert!(exclusive(&tasks[2]).exclusive && !exclusive(&tasks[3]).exclusive);
        for strategy in [
            Strategy::extender(Some(Policy::Binpack), CHART),
            Strategy::extender(Some(Policy::Spread), Profile::ExtenderOnly),
            Strategy::fragmentation(Profile::ExtenderOnly),
            Strategy::extender(Some(Policy::Binpack), Profile::NativeMostAllocated),
        ] {
            let (run, state, _) = replay(&nodes, &tasks, strategy, Exclusive, Adaptive, 1);
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
            host: BIG_HOST,
            ..test_node(6, 2, 80)
        }];
        let tasks = [
            task(TaskKind::Whole, 1, 15),
            task(TaskKind::Fractional, 1, 40),
            task(TaskKind::Fractional, 1, 40),
            task(TaskKind::Fractional, 1, 10),
        ];
        let binpack = Strategy::extender(Some(Policy::Binpack), CHART);
        let (run, state, cluster) = replay(&nodes, &tasks, binpack, Exclusive, Adaptive, 1);
        assert_eq!(run.end.failed, [1, 0, 0, 0, 0, 0]);
        assert_eq!(run.end.allocation, 95.0 / 160.0);
        assert_eq!(run.end.whole_surplus, 65.0 / 160.0);
        assert_eq!(state.requested_gib[0], 95);
        let free = allocator_free(cluster.as_ref(), "node-00000");
        assert_eq!(free, state.free[0]);
        // BestFit books only what the task asks for: the 10 GiB slice fits beside it.
        let best_fit = Strategy::BestFit { multi_gpu: true };
        let run = replay(&nodes, &tasks, best_fit, Exclusive, Adaptive, 1).0;
        assert_eq!(run.end.failed, [0; 6]);
        assert_eq!(run.end.whole_surplus, 0.0);
    }

    #[test]
    fn counted_in_gpus_a_whole_gpu_counts_one_and_a_shared_one_its_booked_share() {
        // 2 × 16 GiB and 2 × 32 GiB: 4 GPUs, 96 GiB.
        let node = |model: usize, gpu_gib: u64| test_node(model, 2, gpu_gib);
        let nodes = [node(1, 16), node(3, 32)];
        // Three whole GPUs of any model (`exclusive`, 16 GiB), then a quarter of a GPU
        // drawn for a 32 GiB model (8 GiB): 3.25 GPUs of 4 arrive, 56 GiB of 96.
        let tasks = [
            task(TaskKind::Whole, 1, 16),
            task(TaskKind::Whole, 1, 16),
            task(TaskKind::Whole, 1, 16),
            Task {
                milli: 250,
                ..task(TaskKind::Fractional, 1, 8)
            },
        ];
        let binpack = Strategy::extender(Some(Policy::Binpack), Profile::ExtenderOnly);
        let form = (Exclusive, Measure::Gpus);
        let run = replay_measured(&nodes, &tasks, binpack, form, All, 0);
        assert_eq!(run.end.failed, [0; 6]);
        assert_eq!(run.end.demand, 3.25 / 4.0);
        // Three GPUs booked whole, whatever their size, and 8 of the last one's 32 GiB.
        assert_eq!(run.end.allocation, 3.25 / 4.0);
        // Counted in GiB, the same replay books 16 + 16 + 32 + 8 of 96 GiB, and reads the
        // GiB the tasks asked for.
        let gib = replay(&nodes, &tasks, binpack, Exclusive, All, 0).0;
        assert_eq!(gib.end.allocation, 56.0 / 96.0);
        assert_eq!(gib.end.whole_surplus, 16.0 / 96.0);
        // Demand reaches 50 % of the GPUs with the second task, 75 % with the third.
        assert_eq!(run.curve.len(), 8, "{:?}", run.curve);
        assert_eq!(run.curve[4], (0.5, 0.5));
        assert_eq!(run.curve[6], (0.7, 0.75));
    }

    #[test]
    fn a_plain_whole_gpu_task_leaves_a_larger_gpu_to_fractional_tasks() {
        // One 80 GiB GPU; a whole-GPU task of a 15 GiB model names no model, then 65 GiB of
        // fractional tasks.
        let nodes = [SimNode {
            host: BIG_HOST,
            ..test_node(6, 1, 80)
        }];
        let tasks = [
            task(TaskKind::Whole, 1, 15),
            task(TaskKind::Fractional, 1, 40),
            task(TaskKind::Fractional, 1, 25),
        ];
        let request = gpushare_request(&tasks[0], Plain);
        let asked = (request.gpus, request.pod_gib, request.exclusive);
        assert_eq!(asked, (1, 15, false));
        for strategy in binpack_classic_fragmentation_native() {
            let (run, state, cluster) = replay(&nodes, &tasks, strategy, Plain, Adaptive, 1);
            assert_eq!(run.end.failed, [0; 6], "{strategy:?}");
            assert_eq!(run.end.allocation, 1.0, "{strategy:?}");
            assert_eq!(run.end.whole_surplus, 0.0, "{strategy:?}");
            assert_eq!(state.free[0], [0], "{strategy:?}");
            let free = allocator_free(cluster.as_ref(), "node-00000");
            assert_eq!(free, [0], "{strategy:?}");
            // Asked for with `exclusive`, the whole-GPU task keeps the GPU to itself.
            let (run, _, _) = replay(&nodes, &tasks, strategy, Exclusive, Adaptive, 1);
            assert_eq!(run.end.failed, [2, 0, 0, 0, 0, 0], "{strategy:?}");
            assert_eq!(run.end.whole_surplus, 65.0 / 80.0, "{strategy:?}");
        }
    }

    #[test]
    fn the_replay_books_what_the_allocator_books() {
        let nodes = generate_nodes(40, 5);
        let tasks = generate_tasks(&nodes, &TaskMix::default(), 1.3, 5);
        assert!(tasks.iter().any(|t| t.kind == TaskKind::Multi));
        let spread = Strategy::extender(Some(Policy::Spread), CHART);
        for strategy in binpack_classic_fragmentation_native()
            .into_iter()
            .chain([spread])
        {
            for form in [Plain, Exclusive] {
                let (run, state, cluster) = replay(&nodes, &tasks, strategy, form, Adaptive, 5);
                let Some(cluster) = cluster else {
                    panic!("{strategy:?} replays through the allocator");
                };
                assert_eq!(run.end.failed[4], 0, "{strategy:?} places multi-GPU tasks");
                if form == Plain {
                    assert_eq!(run.end.whole_surplus, 0.0, "{strategy:?}");
                }
                for (n, name) in state.names.iter().enumerate() {
                    let free = allocator_free(Some(&cluster), name);
                    assert_eq!(free, state.free[n], "{strategy:?} {form:?}, {name}");
                }
                let booked: u64 = (0..state.specs.len())
                    .map(|n| {
                        let spec = &state.specs[n];
                        u64::from(spec.gpus) * spec.gpu_gib - state.free[n].iter().sum::<u64>()
                    })
                    .sum();
                let capacity = Measure::Gib.capacity(&nodes) as f64;
                let counted = (run.end.allocation + run.end.whole_surplus) * capacity;
                let off = (counted - booked as f64).abs();
                assert!(off < 1e-6, "{strategy:?} {form:?}");
            }
        }
    }

    #[test]
    fn fragmentation_policy_beats_binpack_on_a_small_generated_cluster() {
        // Summed over three seeds: on 60 nodes one seed's difference is a few tasks.
        let traces: Vec<_> = (3..6)
            .map(|seed| {
                let nodes = generate_nodes(60, seed);
                let tasks = generate_tasks(&nodes, &TaskMix::default(), 1.3, seed);
                (nodes, tasks, seed)
            })
            .collect();
        for form in [Plain, Exclusive] {
            let at_full = |strategy| -> f64 {
                traces
                    .iter()
                    .map(|(nodes, tasks, seed)| {
                        replay(nodes, tasks, strategy, form, Adaptive, *seed)
                            .0
                            .at_full
                            .allocation
                    })
                    .sum()
            };
            let binpack = at_full(Strategy::extender(Some(Policy::Binpack), CHART));
            let ours = at_full(Strategy::fragmentation(CHART));
            assert!(ours > binpack, "{form:?}: {ours} vs binpack {binpack}");
        }
    }

    #[test]
    fn replays_account_every_task_and_never_overcommit() {
        let nodes = generate_nodes(20, 4);
        let tasks = generate_tasks(&nodes, &TaskMix::default(), 1.3, 4);
        for strategy in [
            Strategy::extender(Some(Policy::Spread), CHART),
            Strategy::BestFit { multi_gpu: true },
            Strategy::Fgd {
                multi_gpu: false,
                cpu_pods_by_default: false,
            },
        ] {
            let run = replay(&nodes, &tasks, strategy, Plain, Adaptive, 4).0;
            assert_eq!(run.end.arrived, tasks.len());
            let allocation = run.end.allocation;
            assert!(allocation <= 1.0 && allocation > 0.3, "{run:?}");
            assert!(run.end.demand >= 1.3);
            assert_eq!(run.curve.len(), 13);
            let grows = run.curve.windows(2).all(|w| w[0].1 <= w[1].1);
            assert!(grows, "allocation only grows");
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
    fn a_pod_fails_when_the_extender_refuses_every_node_of_the_walk() {
        // 200 nodes of 2 x 16 GiB: kube-scheduler looks for 100. Nodes 0-99 carry model 1,
        // nodes 100-199 model 2.
        let node = |model| test_node(model, 2, 16);
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
            let (run, state, _) = replay(&nodes, &tasks, strategy, Plain, Adaptive, 1);
            assert_eq!(run.end.failed, [0, 0, 0, 0, 0, 1], "{strategy:?}");
            assert_eq!(run.end.failed_outside_walk, 1, "{strategy:?}");
            assert_eq!(run.end.allocation, 2_012.0 / 6_400.0, "{strategy:?}");
            let full = (0..100).all(|n| state.free[n] == [6, 6]);
            assert!(full, "{strategy:?}: model-1 nodes full");
            // Scoring every node, the first 12 GiB pod finds an empty node too.
            let (run, _, _) = replay(&nodes, &tasks, strategy, Plain, All, 1);
            assert_eq!(run.end.failed, [0; 6], "{strategy:?}");
            assert_eq!(run.end.failed_outside_walk, 0, "{strategy:?}");
            assert_eq!(run.end.allocation, 2_024.0 / 6_400.0, "{strategy:?}");
        }
    }
}
