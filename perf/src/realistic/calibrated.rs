//! The trace-calibrated generator: the public Alibaba GPU-sharing trace's own cluster and task
//! shapes (cluster-trace-gpu-v2023, the data of Weng et al., "Beware of Fragmentation",
//! USENIX ATC'23), drawn from the figures in `../shared/traces/alibaba-gpu-v2023.md`.
//!
//! What comes from the trace's figures:
//! - the nodes: its 15 node types (GPU model, GPUs, cores, memory) in its counts, scaled to
//!   the cluster's size by largest remainder, in an order each seed shuffles;
//! - the tasks of each of the paper's four workloads ([`TraceMix`]): the share of each shape
//!   (CPU-only, sharing, 1, 2, 4 or 8 whole GPUs), and per shape its CPU and memory from the
//!   published quantiles (p10, p50, p90, max), each drawn at the published point nearest its
//!   quantile ([`Quantiles`] says why); a sharing task's GPU share likewise (p10, p50, p90);
//! - gpuspec33's model pins: 29.3 % of its tasks name one of the listed sets of GPU models,
//!   in the listed shares.
//!
//! What the trace's figures leave open, and what we chose:
//! - no minimum is published: below p10 a value stays at p10 (and a sharing task's share
//!   above p90 at p90);
//! - CPU and memory are drawn at the same quantile (a task that asks for much CPU asks for
//!   much memory): drawn independently, a p90 CPU with a p10 memory is a task no trace shows;
//! - every task ran on some node of the trace's cluster: a GPU task's CPU and memory are
//!   drawn first, from its shape's quantiles, below what the largest node with its GPUs (of
//!   its models, when pinned) holds (a quantile drawn in `[0, F(cap))`, so the shape below the
//!   cap keeps the trace's proportions); then it is drawn for a node type that holds them
//!   whole, with its GPUs and models, picked by that type's share of such GPUs. So, as the
//!   trace's notes say, an 8-GPU job of 120 cores fits only G3 (drawn the other way round,
//!   no job outgrew its node; docs/performance.md). A CPU-only task fits the largest node.
//! - GPU memory per model, since gpushare counts GiB, is the models' (`MODELS`); the trace's
//!   anonymised G2 and G3 get 32 (nothing is published of them; as V100M32, so that a
//!   whole-GPU task drawn for one fits the other, as in the trace, where a whole GPU is one
//!   GPU whatever its model). A sharing task asks its share of its target model's GiB (at
//!   least 1, at most all but 1); a whole-GPU task all of it. So on multigpu50 the 32 GiB
//!   tasks ask more than the 32 GiB GPUs hold (`super::ceiling`); [`as_the_trace_counts`]
//!   replays the trace's own protocol instead, each task carrying its demand as the trace
//!   counts it ([`Task::milli`]).

use gpushare_allocator::fragmentation::Host;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::generator::{Models, NodeType, SimNode, Task, TaskKind, holds, node_type, pick};

/// Indices into [`MODELS`](super::generator::MODELS) of the trace's GPU models.
const T4: usize = 0;
const P100: usize = 1;
const V100M16: usize = 2;
const V100M32: usize = 3;
const A10: usize = 4;
const G2: usize = 7;
const G3: usize = 8;

/// The trace's node types, each weighted by its count of them: 1,213 nodes, 6,212 GPUs.
pub const TRACE_NODE_TYPES: [NodeType; 15] = [
    node_type(G2, 8, 96, 384, 549),
    node_type(T4, 2, 104, 512, 387),
    node_type(P100, 2, 16, 120, 107),
    node_type(G3, 8, 128, 768, 39),
    node_type(V100M16, 4, 32, 128, 28),
    node_type(P100, 2, 64, 256, 22),
    node_type(V100M32, 8, 96, 768, 21),
    node_type(V100M16, 1, 8, 32, 19),
    node_type(T4, 4, 96, 384, 17),
    node_type(V100M32, 4, 48, 368, 9),
    node_type(V100M16, 8, 64, 256, 7),
    node_type(P100, 1, 8, 60, 3),
    node_type(P100, 2, 8, 60, 2),
    node_type(A10, 1, 128, 1024, 2),
    node_type(V100M16, 8, 82, 336, 1),
];

/// `count` nodes of the trace's types in the trace's proportions (largest remainder), in an
/// order `seed` shuffles: kube-scheduler's walk meets them in that order.
pub fn trace_nodes(count: usize, seed: u64) -> Vec<SimNode> {
    let total: u64 = TRACE_NODE_TYPES.iter().map(|t| u64::from(t.weight)).sum();
    let exact: Vec<(u64, u64)> = TRACE_NODE_TYPES
        .iter()
        .map(|t| {
            let scaled = u64::from(t.weight) * count as u64;
            (scaled / total, scaled % total)
        })
        .collect();
    let mut per_type: Vec<u64> = exact.iter().map(|(whole, _)| *whole).collect();
    let short = count as u64 - per_type.iter().sum::<u64>();
    let mut by_remainder: Vec<usize> = (0..exact.len()).collect();
    by_remainder.sort_by_key(|&i| std::cmp::Reverse(exact[i].1));
    for &i in by_remainder.iter().take(short as usize) {
        per_type[i] += 1;
    }
    let mut nodes: Vec<SimNode> = TRACE_NODE_TYPES
        .iter()
        .zip(per_type)
        .flat_map(|(t, n)| std::iter::repeat_n(t.node(), n as usize))
        .collect();
    nodes.shuffle(&mut StdRng::seed_from_u64(seed ^ 0x7472_6163_6520));
    nodes
}

/// A quantile function through the published points, p10, p50, p90 and the maximum, as steps:
/// a value is one of the four, each taking the quantiles nearer to it than to its neighbours
/// (p10 below 0.3, p50 up to 0.7, p90 up to 0.95, the maximum above).
///
/// Why steps: requests are round numbers (the trace's own sample rows ask 4 cores, 88 cores
/// and 320 GiB, its p50s), and drawn this way the generator reads the replay of the real
/// trace on 8 of its 13 figures, against 7 drawn linearly between the points, which gave 30 %
/// more 8-GPU jobs too large for a G2 node than steps do (docs/performance.md).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Quantiles([f64; 4]);

impl Quantiles {
    /// Where each step ends: halfway between the published quantiles 0.1, 0.5, 0.9 and 1.
    const STEP_ENDS: [f64; 4] = [0.3, 0.7, 0.95, 1.0];

    /// The value at quantile `u` (0 ≤ u ≤ 1).
    fn at(self, u: f64) -> f64 {
        let step = Self::STEP_ENDS.iter().position(|&end| u < end);
        self.0[step.unwrap_or(3)]
    }

    /// The quantile below which every value is at most `x` (1 when every value is).
    fn below(self, x: f64) -> f64 {
        let steps_within = self.0.iter().take_while(|&&v| v <= x).count();
        steps_within
            .checked_sub(1)
            .map_or(0.0, |i| Self::STEP_ENDS[i])
    }
}

/// A task shape of the trace: its GPUs (0: CPU-only; 1 with a share: sharing), and its CPU
/// (cores) and memory (GiB) quantiles.
#[derive(Debug, Clone, Copy, PartialEq)]
struct TraceShape {
    kind: TaskKind,
    gpus: u32,
    cores: Quantiles,
    memory_gib: Quantiles,
}

/// The shapes, in the order of [`TraceMix::shares`]: CPU-only, sharing, 1, 2, 4, 8 GPUs
/// (default and multigpu50 pooled, as published).
#[rustfmt::skip]
const SHAPES: [TraceShape; 6] = [
    shape(TaskKind::CpuOnly,    0, [8.0, 12.5, 32.0, 32.0],   [30.0, 50.0, 56.0, 64.0]),
    shape(TaskKind::Fractional, 1, [3.2, 4.0, 11.9, 12.0],    [5.0, 15.0, 46.0, 46.0]),
    shape(TaskKind::Whole,      1, [3.2, 11.4, 16.0, 24.2],   [5.0, 47.0, 63.0, 123.0]),
    shape(TaskKind::Multi,      2, [6.0, 16.2, 30.2, 30.2],   [42.0, 65.0, 157.0, 157.0]),
    shape(TaskKind::Multi,      4, [32.0, 32.2, 60.2, 60.2],  [128.0, 129.0, 313.0, 313.0]),
    shape(TaskKind::Multi,      8, [64.2, 88.0, 120.0, 120.2], [257.0, 320.0, 625.0, 720.0]),
];

const fn shape(kind: TaskKind, gpus: u32, cores: [f64; 4], memory_gib: [f64; 4]) -> TraceShape {
    let (cores, memory_gib) = (Quantiles(cores), Quantiles(memory_gib));
    TraceShape {
        kind,
        gpus,
        cores,
        memory_gib,
    }
}

/// A sharing task's GPU share, milli-GPU: p10, p50, p90 (held at p90 above).
const SHARE_MILLI: Quantiles = Quantiles([230.0, 470.0, 810.0, 810.0]);

/// gpuspec33's model constraints and their shares of pinned tasks, percent.
const PINS: [(&[usize], u32); 8] = [
    (&[T4], 54),
    (&[G2], 14),
    (&[P100], 12),
    (&[V100M16, V100M32], 6),
    (&[P100, V100M16, V100M32], 4),
    (&[G3], 4),
    (&[G2, P100, T4, V100M16, V100M32], 2),
    (&[P100, T4, V100M16, V100M32], 1),
];

/// The paper's four workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceMix {
    /// The trace as recorded.
    Default,
    /// Every GPU task shares a GPU.
    Gpushare100,
    /// The default with 29.3 % of tasks pinned to GPU models.
    Gpuspec33,
    /// About half the GPU demand in jobs of 2, 4 and 8 whole GPUs.
    Multigpu50,
}

impl TraceMix {
    /// Every workload, in report order.
    pub const ALL: [TraceMix; 4] = [
        TraceMix::Default,
        TraceMix::Gpushare100,
        TraceMix::Gpuspec33,
        TraceMix::Multigpu50,
    ];

    /// Share of tasks of each shape of [`SHAPES`], in tenths of a percent.
    fn shares(self) -> [u32; 6] {
        match self {
            TraceMix::Default | TraceMix::Gpuspec33 => [133, 378, 480, 2, 2, 5],
            TraceMix::Gpushare100 => [133, 867, 0, 0, 0, 0],
            TraceMix::Multigpu50 => [120, 340, 432, 25, 23, 61],
        }
    }

    /// Tenths of a percent of all tasks that name GPU models.
    fn pinned(self) -> u32 {
        match self {
            TraceMix::Gpuspec33 => 293,
            _ => 0,
        }
    }
}

/// Tasks of `mix` for `nodes`, drawn until their GPU GiB reach `demand` × the cluster's
/// (FGD's protocol: 1.3; the figure is read at 1.0).
pub fn trace_tasks(nodes: &[SimNode], mix: TraceMix, demand: f64, seed: u64) -> Vec<Task> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x7472_6163_6574);
    let capacity: u64 = nodes.iter().map(|n| u64::from(n.gpus) * n.gpu_gib).sum();
    let types = node_types(nodes);
    // CPU-only tasks fit the largest node.
    let largest = largest_fitting(&types, 0, None);
    let shapes: Vec<(usize, u32)> = (0..SHAPES.len()).zip(mix.shares()).collect();
    // Tasks that are pinned, as a share of GPU tasks (CPU-only tasks name no GPU model).
    let gpu_share: u32 = mix.shares()[1..].iter().sum();
    let target = (capacity as f64 * demand) as u64;
    let (mut tasks, mut arrived) = (Vec::new(), 0u64);
    while arrived < target && capacity > 0 {
        let shape = SHAPES[pick(&mut rng, &shapes)];
        let (host, gpu_gib, model, milli) = if shape.gpus == 0 {
            (draw_host(&mut rng, &shape, largest), 0, None, 0)
        } else {
            let pinned = rng.random_range(0..gpu_share.max(1)) < mix.pinned();
            let pin = pinned
                .then(|| draw_pin(&mut rng, &types, shape.gpus))
                .flatten();
            // CPU and memory first, as the trace's quantiles say, then a node type that
            // holds them whole (the task ran on some node of the trace's cluster).
            let cap = largest_fitting(&types, shape.gpus, pin);
            let host = draw_host(&mut rng, &shape, cap);
            let Some(spec) = draw_target(&mut rng, &types, shape.gpus, pin, host) else {
                continue;
            };
            let gib = spec.gpu_gib;
            if shape.kind == TaskKind::Fractional {
                let share = SHARE_MILLI.at(rng.random::<f64>()) / 1000.0;
                let gpu_gib = ((gib as f64 * share).round() as u64).clamp(1, gib - 1);
                (host, gpu_gib, pin, (share * 1000.0).round() as u64)
            } else {
                (host, gib, pin, u64::from(shape.gpus) * 1000)
            }
        };
        let task = Task {
            kind: shape.kind,
            gpus: shape.gpus,
            gpu_gib,
            host,
            model,
            milli,
        };
        arrived += task.demand_gib();
        tasks.push(task);
    }
    tasks
}

/// What one GPU holds under the trace's own protocol, in the unit the replay books (its
/// "GiB"): a hundredth of a GPU, 10 milli-GPU.
pub const TRACE_GPU_UNITS: u64 = 100;

/// The trace's own protocol (FGD's, and the replay's of the real trace): every GPU is one GPU
/// whatever its model, 1000 milli-GPU, so every GPU holds [`TRACE_GPU_UNITS`]; a sharing task
/// asks its share of one ([`Task::milli`], rounded up to the unit, never all of it) and fits
/// any GPU of its models with that much free; a task of N whole GPUs asks all of N GPUs, of
/// any model its pin allows. Drawn in GiB instead, a sharing task drawn for a 32 GiB model
/// fits no 16 GiB GPU, and a whole-GPU task's GiB tie it to the models as large. CPU, memory
/// and pins stay as drawn.
pub fn as_the_trace_counts(nodes: &mut [SimNode], tasks: &mut [Task]) {
    for node in nodes.iter_mut() {
        node.gpu_gib = TRACE_GPU_UNITS;
    }
    let unit = 1000 / TRACE_GPU_UNITS;
    for task in tasks.iter_mut().filter(|t| t.gpus > 0) {
        task.gpu_gib = match task.kind {
            TaskKind::Fractional => task.milli.div_ceil(unit).clamp(1, TRACE_GPU_UNITS - 1),
            _ => TRACE_GPU_UNITS,
        };
    }
}

/// The distinct node types of `nodes` and how many GPUs of each the cluster has.
fn node_types(nodes: &[SimNode]) -> Vec<(SimNode, u32)> {
    let mut types: Vec<(SimNode, u32)> = Vec::new();
    for node in nodes {
        match types.iter_mut().find(|(t, _)| t == node) {
            Some((_, gpus)) => *gpus += node.gpus,
            None => types.push((*node, node.gpus)),
        }
    }
    types
}

/// The most cores and the most memory any node type with `gpus` GPUs (of `pin`'s models)
/// has: no task of that shape can ask for more.
fn largest_fitting(types: &[(SimNode, u32)], gpus: u32, pin: Option<Models>) -> Host {
    types
        .iter()
        .filter(|(t, _)| holds(t, gpus, 0, pin))
        .fold(Host::default(), |a, (t, _)| {
            Host::new(
                a.milli_cpu.max(t.host.milli_cpu),
                a.memory_mib.max(t.host.memory_mib),
            )
        })
}

/// A node type for a task of `gpus` GPUs (of `pin`'s models, if any) asking for `host`, by
/// its share of the cluster's GPUs on such nodes that hold `host` whole.
fn draw_target(
    rng: &mut StdRng,
    types: &[(SimNode, u32)],
    gpus: u32,
    pin: Option<Models>,
    host: Host,
) -> Option<SimNode> {
    let fitting: Vec<(SimNode, u32)> = types
        .iter()
        .filter(|(t, _)| holds(t, gpus, 0, pin) && t.host.fits(host))
        .copied()
        .collect();
    (!fitting.is_empty()).then(|| pick(rng, &fitting))
}

/// A model constraint from [`PINS`] that some node of `types` with `gpus` GPUs meets.
fn draw_pin(rng: &mut StdRng, types: &[(SimNode, u32)], gpus: u32) -> Option<Models> {
    let possible: Vec<(Models, u32)> = PINS
        .iter()
        .map(|&(models, share)| (Models::of(models), share))
        .filter(|(m, _)| {
            types
                .iter()
                .any(|(t, _)| t.gpus >= gpus && m.contains(t.model))
        })
        .collect();
    (!possible.is_empty()).then(|| pick(rng, &possible))
}

/// CPU and memory of `shape` at one quantile, drawn below what `cap` holds.
fn draw_host(rng: &mut StdRng, shape: &TraceShape, cap: Host) -> Host {
    let cap_cores = cap.milli_cpu as f64 / 1000.0;
    let cap_gib = cap.memory_mib as f64 / 1024.0;
    let top = shape
        .cores
        .below(cap_cores)
        .min(shape.memory_gib.below(cap_gib));
    let u = rng.random::<f64>() * top;
    let milli_cpu = ((shape.cores.at(u) * 1000.0).round() as u64).min(cap.milli_cpu);
    let memory_mib = ((shape.memory_gib.at(u) * 1024.0).round() as u64).min(cap.memory_mib);
    Host::new(milli_cpu, memory_mib)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::realistic::generator::fits_an_empty_node;

    #[test]
    fn the_trace_cluster_keeps_its_node_counts_and_scales_by_largest_remainder() {
        let nodes = trace_nodes(1_213, 0);
        for t in TRACE_NODE_TYPES {
            let of = nodes.iter().filter(|n| **n == t.node()).count();
            assert_eq!(of, t.weight as usize, "{t:?}");
        }
        assert_eq!(nodes.iter().map(|n| n.gpus).sum::<u32>(), 6_212);
        let scaled = trace_nodes(1_200, 3);
        assert_eq!(scaled.len(), 1_200);
        assert_eq!(scaled, trace_nodes(1_200, 3), "same seed, same nodes");
        assert_ne!(scaled, trace_nodes(1_200, 4), "a seed shuffles the order");
        let g2 = scaled.iter().filter(|n| n.model == G2).count();
        assert_eq!(g2, 543, "549 × 1200 / 1213 = 543.1");
    }

    #[test]
    fn quantiles_step_at_the_published_points_and_invert() {
        let q = Quantiles([64.2, 88.0, 120.0, 120.2]);
        let at = [0.0, 0.29, 0.3, 0.5, 0.69, 0.7, 0.94, 0.95, 1.0].map(|u| q.at(u));
        assert_eq!(
            at,
            [64.2, 64.2, 88.0, 88.0, 88.0, 120.0, 120.0, 120.2, 120.2]
        );
        // An 8-GPU job of at most 96 cores (a G2 node's) is one of the quantiles below 0.7.
        assert_eq!(q.below(96.0), 0.7);
        assert_eq!(q.below(60.0), 0.0);
        assert_eq!(q.below(64.2), 0.3);
        assert_eq!(q.below(500.0), 1.0);
        for x in [50.0, 64.2, 90.0, 120.0, 121.0] {
            let top = q.below(x);
            assert!(
                top == 0.0 || q.at(top * 0.999) <= x,
                "{x}: every value below {top} fits"
            );
            assert!(top == 1.0 || q.at(top) > x, "{x}: the next step does not");
        }
    }

    #[test]
    fn each_workload_draws_the_published_shares_and_every_task_fits_an_empty_node() {
        let nodes = trace_nodes(1_200, 1);
        for mix in TraceMix::ALL {
            let tasks = trace_tasks(&nodes, mix, 1.3, 1);
            let share = |s: TraceShape| {
                let of = tasks
                    .iter()
                    .filter(|t| t.gpus == s.gpus && t.kind == s.kind);
                of.count() as f64 * 1000.0 / tasks.len() as f64
            };
            let drawn = SHAPES.map(share);
            for (drawn, published) in drawn.iter().zip(mix.shares()) {
                let published = f64::from(published);
                let (off, slack) = ((drawn - published).abs(), 6.0 + published * 0.1);
                assert!(off < slack, "{mix:?}: {drawn:.1}‰ against {published}‰");
            }
            for task in &tasks {
                assert!(fits_an_empty_node(&nodes, task), "{mix:?}: {task:?}");
            }
            let pinned = tasks.iter().filter(|t| t.model.is_some()).count() as f64;
            let pinned = pinned * 1000.0 / tasks.len() as f64;
            let off = (pinned - f64::from(mix.pinned())).abs();
            assert!(off < 25.0, "{mix:?}: {pinned:.1}‰ pinned");
        }
    }

    #[test]
    fn under_the_traces_protocol_every_gpu_is_one_gpu_whatever_its_model() {
        let mut nodes = trace_nodes(1_200, 4);
        let drawn = trace_tasks(&nodes, TraceMix::Gpuspec33, 1.3, 4);
        let mut counted = drawn.clone();
        as_the_trace_counts(&mut nodes, &mut counted);
        assert!(nodes.iter().all(|n| n.gpu_gib == TRACE_GPU_UNITS));
        let mut shares = 0;
        for (before, after) in drawn.iter().zip(&counted) {
            assert_eq!(
                (before.host, before.model, before.milli),
                (after.host, after.model, after.milli)
            );
            let expected = match before.kind {
                TaskKind::CpuOnly => 0,
                TaskKind::Whole | TaskKind::Multi => 100,
                TaskKind::Fractional => {
                    shares += 1;
                    assert!((230..=810).contains(&before.milli), "{before:?}");
                    before.milli.div_ceil(10)
                }
            };
            assert_eq!(after.gpu_gib, expected, "{before:?}");
        }
        assert!(shares > 1_000);
        // A share of 810 milli asks 81 of a GPU's 100 units, on a T4 as on a G3: drawn in
        // GiB, 81 % of a 32 GiB model was 26 GiB, which no 15 GiB T4 holds.
        let large = counted.iter().find(|t| t.milli == 810).unwrap();
        assert_eq!(large.gpu_gib, 81);
        let t4 = nodes.iter().find(|n| n.model == T4).unwrap();
        assert!(holds(t4, 1, large.gpu_gib, None));
    }

    #[test]
    fn cpu_and_memory_follow_the_quantiles_and_pick_a_node_that_holds_them() {
        let nodes = trace_nodes(1_200, 2);
        let tasks = trace_tasks(&nodes, TraceMix::Multigpu50, 1.3, 2);
        let median = |mut v: Vec<u64>| {
            v.sort_unstable();
            v[v.len() / 2]
        };
        let cores = |gpus: u32, kind: TaskKind| {
            let of = tasks.iter().filter(|t| t.gpus == gpus && t.kind == kind);
            median(of.map(|t| t.host.milli_cpu).collect()) as f64 / 1000.0
        };
        // Sharing and whole-GPU tasks are rarely capped: their medians are the trace's.
        assert!((cores(1, TaskKind::Fractional) - 4.0).abs() < 0.4);
        assert!((cores(1, TaskKind::Whole) - 11.4).abs() < 1.0);
        // 8-GPU jobs take the trace's CPU and memory whatever node they fit: those past a G2
        // node (96 cores, 384 GiB) are the trace's share above it, and go to G3 (128 cores,
        // 768 GiB), the only 8-GPU node that holds them.
        let eight: Vec<&Task> = tasks.iter().filter(|t| t.gpus == 8).collect();
        assert!(eight.len() > 100);
        let g2 = Host::new(96_000, 384 * 1024);
        let beyond_g2 = eight.iter().filter(|t| !g2.fits(t.host)).count() as f64;
        let shape = SHAPES[5];
        let expected = 1.0 - shape.cores.below(96.0).min(shape.memory_gib.below(384.0));
        let observed = beyond_g2 / eight.len() as f64;
        assert!(
            (observed - expected).abs() < 0.08,
            "{observed:.2} of 8-GPU jobs outgrow a G2 node; the quantiles say {expected:.2}"
        );
        let g3 = Host::new(128_000, 768 * 1024);
        assert!(eight.iter().all(|t| g3.fits(t.host)));
        // CPU and memory are drawn at one quantile: a task's CPU and memory sit at the same
        // place in their distributions (where neither is held at p10).
        let shape = SHAPES[2];
        let mut inside = 0;
        for task in tasks.iter().filter(|t| t.kind == TaskKind::Whole) {
            let cores = task.host.milli_cpu as f64 / 1000.0;
            let gib = task.host.memory_mib as f64 / 1024.0;
            if cores > 3.21 && gib > 5.01 {
                let (u, v) = (shape.cores.below(cores), shape.memory_gib.below(gib));
                assert!((u - v).abs() < 0.01, "{task:?}: {u} against {v}");
                inside += 1;
            }
        }
        assert!(inside > 1_000);
    }
}
