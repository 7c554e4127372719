//! The realistic workload generator: heterogeneous GPU nodes with their own CPU and memory,
//! and a task stream whose CPU and memory go with its GPU share.
//!
//! Built from what the papers publish about production GPU-sharing clusters, not from any
//! trace file (the public openb trace is kept as a held-out evaluation):
//! - Weng et al., "Beware of Fragmentation" (USENIX ATC'23), §2 and §6: a cluster of about
//!   1,200 nodes and 6,200 GPUs of 7 models, 2 or 8 GPUs per node (we add 4-GPU nodes);
//!   tasks that request no GPU, a fraction of one, one whole GPU, or 2–8 whole GPUs; sharing
//!   tasks are about 40% of GPU tasks; multi-GPU tasks are few but a visible share of the
//!   GPU demand (about 7%); many tasks pin a GPU model; CPU and memory requests grow with
//!   the GPU share and reach tens of cores and hundreds of GiB.
//! - Weng et al., "MLaaS in the Wild" (NSDI'22, the PAI 2020 trace): GPU models from P100 and
//!   T4 to V100 and A100 side by side; CPU per GPU varies widely between tasks, and CPU is
//!   often the bottleneck on GPU nodes; a sizeable share of tasks are CPU-only.
//!
//! The numbers below are our reading of those descriptions; they are round on purpose and
//! live in one place ([`NODE_TYPES`], [`TaskMix`]) so they can be argued with.
//!
//! Every task fits some node of the cluster when that node is empty: a trace records tasks
//! that ran. Sizes are drawn independently, so a multi-GPU job is then fitted to the machines
//! it was meant for: it pins only models whose nodes have its GPUs, and asks no more CPU and
//! memory than its GPUs' share of a node of the model it targets (or, where no such node has
//! enough GPUs, of the smallest node that does); unfitted, 8-GPU jobs of 24 or 32 cores per
//! GPU asked more CPU than any node has.
//!
//! Units are gpushare's: GPU memory in whole GiB (a "whole GPU" task asks for all of its
//! model's memory; a fractional one for its share of it), CPU in millicores, memory in MiB.

use gpushare_allocator::fragmentation::Host;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A GPU model and its memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuModel {
    pub name: &'static str,
    /// Whole GiB the device plugin advertises.
    pub gib: u64,
}

/// The GPU models of the generated clusters: seven for the generator below, and the trace's
/// anonymised G2 and G3 for the calibrated one (`calibrated.rs`), which shares the rest.
pub const MODELS: [GpuModel; 9] = [
    model("T4", 15),
    model("P100", 16),
    model("V100-16", 16),
    model("V100-32", 32),
    model("A10", 24),
    model("A100-40", 40),
    model("A100-80", 80),
    model("G2", 32),
    model("G3", 32),
];

const fn model(name: &'static str, gib: u64) -> GpuModel {
    GpuModel { name, gib }
}

/// A kind of node: its GPUs, CPU and memory, and how common it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeType {
    /// Index into [`MODELS`].
    pub model: usize,
    pub gpus: u32,
    /// Allocatable cores.
    pub cores: u64,
    /// Allocatable memory, GiB.
    pub memory_gib: u64,
    /// Relative number of such nodes (the trace's: its count of them).
    pub weight: u32,
}

impl NodeType {
    /// A node of this type.
    pub fn node(self) -> SimNode {
        let host = Host::new(self.cores * 1000, self.memory_gib * 1024);
        let (model, gpus) = (self.model, self.gpus);
        SimNode {
            model,
            gpus,
            gpu_gib: MODELS[model].gib,
            host,
        }
    }
}

/// The node types: 8-GPU training servers, 4-GPU and 2-GPU inference servers. CPU per GPU
/// ranges from 8 cores (P100 servers) to 32 (T4 servers).
pub const NODE_TYPES: [NodeType; 7] = [
    node_type(2, 8, 96, 384, 26),
    node_type(3, 8, 96, 512, 10),
    node_type(1, 8, 64, 256, 8),
    node_type(6, 8, 128, 1024, 5),
    node_type(5, 8, 128, 768, 6),
    node_type(4, 4, 64, 256, 13),
    node_type(0, 2, 64, 256, 32),
];

pub(super) const fn node_type(
    model: usize,
    gpus: u32,
    cores: u64,
    memory_gib: u64,
    weight: u32,
) -> NodeType {
    NodeType {
        model,
        gpus,
        cores,
        memory_gib,
        weight,
    }
}

/// One generated node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimNode {
    /// Index into `MODELS`.
    pub model: usize,
    pub gpus: u32,
    /// GiB of each GPU.
    pub gpu_gib: u64,
    /// Allocatable CPU and memory.
    pub host: Host,
}

/// `count` nodes drawn from `NODE_TYPES` by weight (the same seed, the same nodes).
pub fn generate_nodes(count: usize, seed: u64) -> Vec<SimNode> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6e6f_6465);
    let weights: Vec<(usize, u32)> = NODE_TYPES
        .iter()
        .enumerate()
        .map(|(i, t)| (i, t.weight))
        .collect();
    (0..count)
        .map(|_| NODE_TYPES[pick(&mut rng, &weights)].node())
        .collect()
}

/// What a task asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TaskKind {
    /// No GPU.
    CpuOnly,
    /// Part of one GPU's memory.
    Fractional,
    /// All the memory of one GPU of its model. It may name no model: a gpushare pod asks for
    /// the model's GiB as a slice of one GPU, or with `exclusive` for one empty GPU of at
    /// least that size (the replay's request form).
    Whole,
    /// All the memory of several GPUs of its model: a gpushare pod asks with `gpus: N` for the
    /// total GiB, N slices on N GPUs of one node (with `exclusive`: N empty GPUs).
    Multi,
}

impl TaskKind {
    /// Every kind, in report order.
    pub const ALL: [TaskKind; 4] = [
        TaskKind::CpuOnly,
        TaskKind::Fractional,
        TaskKind::Whole,
        TaskKind::Multi,
    ];

    /// Name in the report.
    pub fn name(self) -> &'static str {
        match self {
            TaskKind::CpuOnly => "CPU-only",
            TaskKind::Fractional => "fractional GPU",
            TaskKind::Whole => "whole GPU",
            TaskKind::Multi => "multi-GPU",
        }
    }
}

/// The GPU models a task may run on, a bit per [`MODELS`] index (a pod's node affinity on
/// the model label, `In` one or two models).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Models(u16);

impl Models {
    /// Exactly this model.
    pub fn one(model: usize) -> Self {
        Self(1 << model)
    }

    /// Each of these models.
    pub fn of(models: &[usize]) -> Self {
        Self(models.iter().fold(0, |bits, m| bits | (1 << m)))
    }

    /// Whether `model` is one of them.
    pub fn contains(self, model: usize) -> bool {
        model < MODELS.len() && self.0 & (1 << model) != 0
    }
}

/// One task of the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Task {
    pub kind: TaskKind,
    /// GPUs it needs (0 for CPU-only).
    pub gpus: u32,
    /// GiB on each of those GPUs.
    pub gpu_gib: u64,
    /// CPU and memory.
    pub host: Host,
    /// The GPU models it must run on, if it names any.
    pub model: Option<Models>,
    /// GPU demand as the public trace counts it, in milli-GPU: 1000 per whole GPU, a
    /// sharing task's share of the GPU it was drawn for (read by [`Measure::Gpus`]).
    ///
    /// [`Measure::Gpus`]: super::sim::Measure::Gpus
    pub milli: u64,
}

impl Task {
    /// GPU GiB asked for in all.
    pub fn demand_gib(&self) -> u64 {
        u64::from(self.gpus) * self.gpu_gib
    }

    /// Whether the task asks for whole GPUs: all of its GPU model's memory, on one GPU or
    /// more (what a gpushare pod may ask for with `exclusive`).
    pub(super) fn is_whole(&self) -> bool {
        matches!(self.kind, TaskKind::Whole | TaskKind::Multi)
    }
}

/// A task of `kind` asking `gpus` × `gpu_gib` with one core and 1 GiB, no model: the tests'
/// task.
#[cfg(test)]
pub(super) fn test_task(kind: TaskKind, gpus: u32, gpu_gib: u64) -> Task {
    Task {
        kind,
        gpus,
        gpu_gib,
        host: Host::new(1_000, 1_024),
        model: None,
        milli: u64::from(gpus) * 1000,
    }
}

/// Whether some node of `nodes`, empty, would take `task`: a trace records tasks that ran.
#[cfg(test)]
pub(super) fn fits_an_empty_node(nodes: &[SimNode], task: &Task) -> bool {
    let fits =
        |n: &SimNode| holds(n, task.gpus, task.gpu_gib, task.model) && n.host.fits(task.host);
    nodes.iter().any(fits)
}

/// `gpus` × `gpu_gib` GiB of `model`, 64 cores and 256 GiB: the tests' node.
#[cfg(test)]
pub(super) fn test_node(model: usize, gpus: u32, gpu_gib: u64) -> SimNode {
    let host = Host::new(64_000, 262_144);
    SimNode {
        model,
        gpus,
        gpu_gib,
        host,
    }
}

/// The task mix: shares of each kind and the distributions their sizes are drawn from.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskMix {
    /// Relative number of CPU-only, fractional, whole-GPU and multi-GPU tasks.
    pub kinds: [u32; 4],
    /// Fraction of one GPU a fractional task takes, in percent, with weights.
    pub fractions: Vec<(u64, u32)>,
    /// GPUs of a multi-GPU task, with weights.
    pub multi: Vec<(u32, u32)>,
    /// Cores per whole GPU of a GPU task, with weights.
    pub cores_per_gpu: Vec<(u64, u32)>,
    /// Cores of a CPU-only task, with weights.
    pub cpu_only_cores: Vec<(u64, u32)>,
    /// GiB of memory per core, with weights.
    pub memory_per_core: Vec<(u64, u32)>,
    /// Percent of GPU tasks that name a GPU model.
    pub constrained_percent: u32,
    /// Percent of those that name a second model too (one with at least as much memory
    /// per GPU).
    pub two_models_percent: u32,
}

impl Default for TaskMix {
    fn default() -> Self {
        Self {
            kinds: [30, 76, 91, 3],
            fractions: weighted(
                [10, 20, 25, 30, 40, 50, 60, 75, 90],
                [8, 6, 22, 6, 5, 33, 5, 8, 7],
            ),
            multi: vec![(2, 5), (4, 3), (8, 2)],
            cores_per_gpu: weighted([2, 4, 6, 8, 12, 16, 24, 32], [3, 10, 15, 20, 22, 18, 8, 4]),
            cpu_only_cores: vec![(1, 20), (2, 25), (4, 25), (8, 15), (16, 10), (32, 5)],
            memory_per_core: vec![(1, 10), (2, 30), (4, 35), (6, 15), (8, 10)],
            constrained_percent: 25,
            two_models_percent: 0,
        }
    }
}

/// `values`, each with its weight.
fn weighted<const N: usize>(values: [u64; N], weights: [u32; N]) -> Vec<(u64, u32)> {
    values.into_iter().zip(weights).collect()
}

/// The named mixes the simulator reports on, each the default with one thing pushed to where
/// published traces show it (Weng et al., ATC'23, §6: their multi-GPU, GPU-type-constrained
/// and sharing-only workloads).
impl TaskMix {
    /// About half the GPU demand in jobs of 2, 4 and 8 whole GPUs (the default has 8 %).
    pub fn multi_gpu_heavy() -> Self {
        Self {
            kinds: [30, 76, 91, 33],
            ..Self::default()
        }
    }

    /// About a third of the GPU tasks restricted to one or two GPU models (half of them two).
    pub fn model_pinned() -> Self {
        Self {
            constrained_percent: 33,
            two_models_percent: 50,
            ..Self::default()
        }
    }

    /// Every GPU task shares a GPU: fractional tasks only, beside the CPU-only ones.
    pub fn all_sharing() -> Self {
        Self {
            kinds: [30, 100, 0, 0],
            ..Self::default()
        }
    }
}

/// Tasks drawn from `mix` until their GPU demand reaches `demand` × the GPU memory of
/// `nodes` (FGD's protocol: 1.3). A task's GPU model (its target, and its constraint when it
/// names one) is drawn by each model's share of the cluster's GPUs.
pub fn generate_tasks(nodes: &[SimNode], mix: &TaskMix, demand: f64, seed: u64) -> Vec<Task> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x7461_736b);
    let capacity: u64 = nodes.iter().map(|n| u64::from(n.gpus) * n.gpu_gib).sum();
    let mut gpus_per_model = [0u32; MODELS.len()];
    for node in nodes {
        gpus_per_model[node.model] += node.gpus;
    }
    let models: Vec<(usize, u32)> = gpus_per_model.iter().copied().enumerate().collect();
    let kinds: Vec<(TaskKind, u32)> = TaskKind::ALL.iter().copied().zip(mix.kinds).collect();
    let target = (capacity as f64 * demand) as u64;
    let mut tasks = Vec::new();
    let mut arrived = 0u64;
    while arrived < target && capacity > 0 {
        let kind = pick(&mut rng, &kinds);
        let model = pick(&mut rng, &models);
        let gib = MODELS[model].gib;
        let (gpus, gpu_gib, gpu_share) = match kind {
            TaskKind::CpuOnly => (0, 0, 0.0),
            TaskKind::Fractional => {
                let percent = pick(&mut rng, &mix.fractions);
                let share = percent as f64 / 100.0;
                let gpu_gib = ((gib as f64 * share).round() as u64).clamp(1, gib - 1);
                (1, gpu_gib, share)
            }
            TaskKind::Whole => (1, gib, 1.0),
            TaskKind::Multi => {
                let gpus = pick(&mut rng, &mix.multi);
                (gpus, gib, f64::from(gpus))
            }
        };
        let cores = if kind == TaskKind::CpuOnly {
            pick(&mut rng, &mix.cpu_only_cores) as f64
        } else {
            pick(&mut rng, &mix.cores_per_gpu) as f64 * gpu_share
        };
        let milli_cpu = ((cores * 1000.0).round() as u64).max(500);
        let memory_mib = milli_cpu * pick(&mut rng, &mix.memory_per_core) * 1024 / 1000;
        let constrained =
            kind != TaskKind::CpuOnly && rng.random_range(0..100) < mix.constrained_percent;
        // The second draw only where a mix names two models, so the default mix's stream
        // stays what it was.
        let models = if !constrained {
            None
        } else if mix.two_models_percent > 0 && rng.random_range(0..100) < mix.two_models_percent {
            // A second model the task fits on, drawn like the first.
            let larger: Vec<(usize, u32)> = models
                .iter()
                .copied()
                .filter(|&(m, _)| m != model && MODELS[m].gib >= gib)
                .collect();
            let second = if larger.is_empty() {
                model
            } else {
                pick(&mut rng, &larger)
            };
            Some(Models::of(&[model, second]))
        } else {
            Some(Models::one(model))
        };
        // A multi-GPU job pins models whose nodes can hold it, and asks for no more CPU and
        // memory than its share of such a node: it was sized for the machines it runs on.
        let models = models.filter(|&m| {
            kind != TaskKind::Multi || nodes.iter().any(|n| holds(n, gpus, gpu_gib, Some(m)))
        });
        let mut host = Host::new(milli_cpu, memory_mib);
        if kind == TaskKind::Multi {
            host = sized_for_its_nodes(nodes, (gpus, gpu_gib, models), model, host);
        }
        let task = Task {
            kind,
            gpus,
            gpu_gib,
            host,
            model: models,
            milli: (gpu_share * 1000.0).round() as u64,
        };
        arrived += task.demand_gib();
        tasks.push(task);
    }
    tasks
}

/// Whether `node` has `gpus` GPUs of at least `gpu_gib` of `models`.
pub(super) fn holds(node: &SimNode, gpus: u32, gpu_gib: u64, models: Option<Models>) -> bool {
    node.gpus >= gpus && node.gpu_gib >= gpu_gib && models.is_none_or(|m| m.contains(node.model))
}

/// `host` cut to what its GPUs' share of a node brings (`gpus / node GPUs` of the node's CPU
/// and memory): a node of the model it targets where one can hold it, else the smallest
/// share among the nodes that can (a job meant to run wherever its GPUs fit).
fn sized_for_its_nodes(
    nodes: &[SimNode],
    (gpus, gpu_gib, models): (u32, u64, Option<Models>),
    target: usize,
    host: Host,
) -> Host {
    let share = |node: &SimNode| {
        let of = |v: u64| v * u64::from(gpus) / u64::from(node.gpus);
        Host::new(of(node.host.milli_cpu), of(node.host.memory_mib))
    };
    let min =
        |a: Host, b: Host| Host::new(a.milli_cpu.min(b.milli_cpu), a.memory_mib.min(b.memory_mib));
    let holders = nodes.iter().filter(|n| holds(n, gpus, gpu_gib, models));
    let cap = match holders.clone().find(|node| node.model == target) {
        Some(node) => share(node),
        None => holders.map(share).reduce(min).unwrap_or_default(),
    };
    min(host, cap)
}

/// A value drawn from `(value, weight)` pairs.
pub(super) fn pick<T: Copy>(rng: &mut StdRng, weighted: &[(T, u32)]) -> T {
    let total: u32 = weighted.iter().map(|(_, w)| w).sum();
    let mut at = rng.random_range(0..total.max(1));
    for &(value, weight) in weighted {
        if at < weight {
            return value;
        }
        at -= weight;
    }
    weighted[0].0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The multi-GPU tasks' share of the GPU demand.
    fn multi_gpu_share(tasks: &[Task]) -> f64 {
        let all: u64 = tasks.iter().map(Task::demand_gib).sum();
        let multi = tasks.iter().filter(|t| t.kind == TaskKind::Multi);
        multi.map(Task::demand_gib).sum::<u64>() as f64 / all as f64
    }

    #[test]
    fn the_cluster_has_the_promised_shape() {
        let nodes = generate_nodes(2_000, 1);
        assert_eq!(nodes, generate_nodes(2_000, 1), "same seed, same nodes");
        for gpus in [2, 4, 8] {
            assert!(nodes.iter().any(|n| n.gpus == gpus), "{gpus}-GPU nodes");
        }
        let models: std::collections::BTreeSet<usize> = nodes.iter().map(|n| n.model).collect();
        let typed: std::collections::BTreeSet<usize> = NODE_TYPES.iter().map(|t| t.model).collect();
        assert_eq!(models, typed, "every model of the node types appears");
        // 8-GPU servers have 8 to 16 cores per GPU, 2-GPU ones 32: CPU per GPU varies.
        let per_gpu = |n: &SimNode| n.host.milli_cpu / 1000 / u64::from(n.gpus);
        assert!(nodes.iter().any(|n| per_gpu(n) == 8));
        assert!(nodes.iter().any(|n| per_gpu(n) == 32));
    }

    #[test]
    fn tasks_mix_kinds_and_their_host_requests_follow_the_gpu_share() {
        let nodes = generate_nodes(300, 2);
        let capacity: u64 = nodes.iter().map(|n| u64::from(n.gpus) * n.gpu_gib).sum();
        let tasks = generate_tasks(&nodes, &TaskMix::default(), 1.3, 2);
        let demand: u64 = tasks.iter().map(Task::demand_gib).sum();
        assert!(demand as f64 >= 1.3 * capacity as f64);
        assert!(((demand - tasks.last().unwrap().demand_gib()) as f64) < 1.3 * capacity as f64);
        let share =
            |kind| tasks.iter().filter(|t| t.kind == kind).count() as f64 / tasks.len() as f64;
        assert!((0.10..0.20).contains(&share(TaskKind::CpuOnly)));
        assert!((0.32..0.44).contains(&share(TaskKind::Fractional)));
        assert!((0.39..0.51).contains(&share(TaskKind::Whole)));
        assert!((0.005..0.04).contains(&share(TaskKind::Multi)));
        // Multi-GPU tasks are a few percent of tasks but a larger share of GPU demand.
        let multi_share = multi_gpu_share(&tasks);
        assert!((0.04..0.15).contains(&multi_share), "{multi_share}");
        // CPU grows with the GPU share: whole-GPU tasks ask for more than fractional ones.
        let mean_cpu = |kind| {
            let of = tasks.iter().filter(|t| t.kind == kind);
            of.clone().map(|t| t.host.milli_cpu).sum::<u64>() as f64 / of.count() as f64
        };
        assert!(mean_cpu(TaskKind::Whole) > 1.5 * mean_cpu(TaskKind::Fractional));
        assert!(mean_cpu(TaskKind::Multi) > 2.0 * mean_cpu(TaskKind::Whole));
        // Fractional tasks fit their model's GPU with room to share; some tasks name a model.
        for task in &tasks {
            if task.kind == TaskKind::Fractional {
                for (m, model) in MODELS.iter().enumerate() {
                    if task.model.is_some_and(|models| models.contains(m)) {
                        assert!(task.gpu_gib >= 1 && task.gpu_gib < model.gib);
                    }
                }
            }
            assert!(task.host.memory_mib >= task.host.milli_cpu * 1024 / 1000);
        }
        let constrained = tasks.iter().filter(|t| t.model.is_some()).count() as f64;
        let gpu_tasks = tasks.iter().filter(|t| t.gpus > 0).count() as f64;
        assert!((0.18..0.32).contains(&(constrained / gpu_tasks)));
    }

    #[test]
    fn the_named_mixes_push_what_they_say() {
        let nodes = generate_nodes(300, 3);
        let heavy = multi_gpu_share(&generate_tasks(&nodes, &TaskMix::multi_gpu_heavy(), 1.3, 3));
        assert!((0.40..0.60).contains(&heavy), "{heavy}");

        let pinned = generate_tasks(&nodes, &TaskMix::model_pinned(), 1.3, 3);
        let gpu_tasks: Vec<&Task> = pinned.iter().filter(|t| t.gpus > 0).collect();
        let named = gpu_tasks.iter().filter(|t| t.model.is_some()).count() as f64;
        let two = gpu_tasks
            .iter()
            .filter(|t| t.model.is_some_and(|m| m.0.count_ones() == 2))
            .count() as f64;
        assert!((0.28..0.38).contains(&(named / gpu_tasks.len() as f64)));
        assert!((0.35..0.65).contains(&(two / named)), "{two} of {named}");

        let sharing = generate_tasks(&nodes, &TaskMix::all_sharing(), 1.3, 3);
        let kinds = |t: &Task| matches!(t.kind, TaskKind::CpuOnly | TaskKind::Fractional);
        assert!(sharing.iter().all(kinds));
    }

    #[test]
    fn every_task_fits_an_empty_node_of_its_cluster() {
        let nodes = generate_nodes(1_200, 0);
        for mix in [
            TaskMix::default(),
            TaskMix::multi_gpu_heavy(),
            TaskMix::model_pinned(),
            TaskMix::all_sharing(),
        ] {
            let tasks = generate_tasks(&nodes, &mix, 1.3, 0);
            let unplaceable: Vec<&Task> = tasks
                .iter()
                .filter(|t| !fits_an_empty_node(&nodes, t))
                .collect();
            assert!(unplaceable.is_empty(), "{mix:?}: {unplaceable:?}");
        }
        // A job that targets a model whose nodes have its GPUs asks at most its share of one:
        // a 4-GPU A100-80 job at most half of a 128-core, 1 TiB node.
        let heavy = generate_tasks(&nodes, &TaskMix::multi_gpu_heavy(), 1.3, 0);
        let a100_80 = heavy
            .iter()
            .filter(|t| t.kind == TaskKind::Multi && t.gpus == 4 && t.gpu_gib == 80);
        let mut seen = 0;
        for task in a100_80 {
            assert!(Host::new(64_000, 512 * 1024).fits(task.host), "{task:?}");
            seen += 1;
        }
        assert!(seen > 0);
    }
}
