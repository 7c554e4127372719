//! The distribution of pod shapes the measure is taken against, learned online. FGD is given
//! the task distribution; a scheduler is not, so it follows what arrives: a decaying
//! histogram of GPU sizes (each with its pods' mean CPU and memory) weighted by the GiB the
//! pods bring, and, after a restart, the same histogram learned at once from the pods
//! running. This is the only state of the measure that changes; each change re-derives the
//! [`Prepared`] form the loops read.

use super::prepared::Prepared;
use super::{Gang, Host, MAX_GANGS, MAX_SHAPES, Shape};

/// How much an observation's weight decays per later observation: a weight halves after
/// about 350 pods, so the shapes follow what is arriving now.
const DECAY: f64 = 0.998;

/// The distribution of pod shapes the fragmentation is measured against.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Workload {
    /// Shapes and their (decayed) weights; at most [`MAX_SHAPES`].
    shapes: Vec<(Shape, f64)>,
    /// Multi-GPU shapes and their (decayed) weights, on the same scale; at most
    /// [`MAX_GANGS`].
    gangs: Vec<(Gang, f64)>,
    /// Derived from `shapes` each time they change.
    pub(super) prepared: Prepared,
}

// Weights are finite sums and products of finite numbers, never NaN: equality is total.
impl Eq for Workload {}

impl Workload {
    /// An empty workload: until a pod is observed, placement is plain binpack.
    pub fn new() -> Self {
        Self::default()
    }

    /// A fixed workload (weights need not sum to 1); the [`MAX_SHAPES`] heaviest are kept.
    pub fn from_shapes(shapes: impl IntoIterator<Item = (Shape, f64)>) -> Self {
        let mut shapes: Vec<(Shape, f64)> = shapes
            .into_iter()
            .filter(|(shape, weight)| shape.gpu_gib > 0 && *weight > 0.0)
            .collect();
        shapes.sort_by(|a, b| b.1.total_cmp(&a.1));
        shapes.truncate(MAX_SHAPES);
        let prepared = Prepared::new(&shapes, &[], None);
        Self {
            shapes,
            gangs: Vec::new(),
            prepared,
        }
    }

    /// This workload with multi-GPU `gangs` too (weights on the shapes' scale); the
    /// [`MAX_GANGS`] heaviest are kept.
    pub fn with_gangs(mut self, gangs: impl IntoIterator<Item = (Gang, f64)>) -> Self {
        self.gangs.extend(
            gangs
                .into_iter()
                .filter(|(gang, weight)| gang.gpus > 1 && gang.shape.gpu_gib > 0 && *weight > 0.0),
        );
        self.gangs.sort_by(|a, b| b.1.total_cmp(&a.1));
        self.gangs.truncate(MAX_GANGS);
        self.prepared = Prepared::new(&self.shapes, &self.gangs, None);
        self
    }

    /// A workload learned from a population of pods at once (the pods bound when an extender
    /// starts), then `recent`'s shapes on top: what observing the population's pods one by
    /// one, then the recent ones, would have learned, without the arbitrary order.
    ///
    /// Each GPU size weighs the GiB its pods hold, scaled so that the population weighs at
    /// most as much as a steady stream of such pods would (about `1 / (1 − DECAY)` = 500 of
    /// them): new pods then move the shapes as fast as they would have before the restart.
    /// The population is what is running, which over-represents long-running pods; it is
    /// forgotten as pods arrive.
    pub fn from_population(pods: impl IntoIterator<Item = Shape>, recent: &Workload) -> Self {
        Self::from_populations(pods, [], recent)
    }

    /// [`Workload::from_population`] with the multi-GPU pods of the population too: each
    /// (GPUs, GiB per GPU) weighs the GiB its pods hold, on the same scale as the one-GPU
    /// shapes, and `recent`'s multi-GPU shapes count on top.
    pub fn from_populations(
        pods: impl IntoIterator<Item = Shape>,
        gangs: impl IntoIterator<Item = Gang>,
        recent: &Workload,
    ) -> Self {
        let pods: Vec<Shape> = pods.into_iter().filter(|pod| pod.gpu_gib > 0).collect();
        let gangs: Vec<Gang> = gangs
            .into_iter()
            .filter(|g| g.gpus > 1 && g.shape.gpu_gib > 0)
            .collect();
        // One scale for both kinds, so that they weigh as a stream of them would.
        let scale = population_scale(pods.len() + gangs.len());
        let mut shapes = grouped(&pods, scale);
        for &(shape, weight) in &recent.shapes {
            merge(&mut shapes, shape, weight);
        }
        let mut weighted = grouped(&gangs, scale);
        for &(gang, weight) in &recent.gangs {
            merge(&mut weighted, gang, weight);
        }
        Self::from_shapes(shapes).with_gangs(weighted)
    }

    /// Records a pod placed now. Pods are grouped by GPU size; a group keeps the mean CPU
    /// and memory of its pods and weighs the GiB they brought, decaying. When all groups are
    /// taken, the lightest gives way if it weighs less than the new pod.
    pub fn observe(&mut self, shape: Shape) {
        if shape.gpu_gib == 0 {
            return;
        }
        self.decay();
        learn(&mut self.shapes, MAX_SHAPES, shape);
        self.prepared = Prepared::new(&self.shapes, &self.gangs, Some(&self.prepared));
    }

    /// Records a multi-GPU pod placed now: as [`Workload::observe`], grouped by GPUs and GiB
    /// per GPU, weighing the GiB it brought in all.
    pub fn observe_gang(&mut self, gang: Gang) {
        if gang.gpus < 2 || gang.shape.gpu_gib == 0 {
            return;
        }
        self.decay();
        learn(&mut self.gangs, MAX_GANGS, gang);
        self.prepared = Prepared::new(&self.shapes, &self.gangs, Some(&self.prepared));
    }

    /// Every weight, one-GPU and multi-GPU, decays by one observation.
    fn decay(&mut self) {
        for (_, weight) in &mut self.shapes {
            *weight *= DECAY;
        }
        for (_, weight) in &mut self.gangs {
            *weight *= DECAY;
        }
    }

    /// The shapes and their weights.
    pub fn shapes(&self) -> &[(Shape, f64)] {
        &self.shapes
    }

    /// The multi-GPU shapes and their weights.
    pub fn gangs(&self) -> &[(Gang, f64)] {
        &self.gangs
    }

    /// True before any pod was observed.
    pub fn is_empty(&self) -> bool {
        self.shapes.is_empty() && self.gangs.is_empty()
    }
}

/// What the workload groups pods into: one-GPU shapes by GPU size, multi-GPU shapes by GPUs
/// and GiB per GPU. A group keeps its pods' mean CPU and memory.
trait Learned: Copy {
    /// What pods of one group share.
    fn key(&self) -> (u32, u64);
    /// GiB a pod asks in all: what it weighs.
    fn gib(&self) -> u64;
    fn host(&self) -> Host;
    fn host_mut(&mut self) -> &mut Host;
}

impl Learned for Shape {
    fn key(&self) -> (u32, u64) {
        (1, self.gpu_gib)
    }
    fn gib(&self) -> u64 {
        self.gpu_gib
    }
    fn host(&self) -> Host {
        self.host
    }
    fn host_mut(&mut self) -> &mut Host {
        &mut self.host
    }
}

impl Learned for Gang {
    fn key(&self) -> (u32, u64) {
        (self.gpus, self.shape.gpu_gib)
    }
    fn gib(&self) -> u64 {
        Gang::gib(self)
    }
    fn host(&self) -> Host {
        self.shape.host
    }
    fn host_mut(&mut self) -> &mut Host {
        &mut self.shape.host
    }
}

/// `pods` grouped, each group weighing its pods' GiB × `scale`, in key order so that the
/// result is deterministic.
fn grouped<T: Learned>(pods: &[T], scale: f64) -> Vec<(T, f64)> {
    // Key → (a pod, pods, Σ CPU, Σ memory).
    let mut groups: std::collections::BTreeMap<(u32, u64), (T, u64, u128, u128)> =
        Default::default();
    for pod in pods {
        let group = groups.entry(pod.key()).or_insert((*pod, 0, 0, 0));
        group.1 += 1;
        group.2 += u128::from(pod.host().milli_cpu);
        group.3 += u128::from(pod.host().memory_mib);
    }
    groups
        .into_values()
        .map(|(mut pod, count, cpu, memory)| {
            let mean = |sum: u128| u64::try_from(sum / u128::from(count)).unwrap_or(u64::MAX);
            *pod.host_mut() = Host::new(mean(cpu), mean(memory));
            (pod, (pod.gib() * count) as f64 * scale)
        })
        .collect()
}

/// Adds `add` of `pod` to its group in `groups` (the group's CPU and memory move to the
/// weighted mean); false when it has none.
fn merge_into<T: Learned>(groups: &mut [(T, f64)], pod: T, add: f64) -> bool {
    let Some((known, weight)) = groups.iter_mut().find(|(g, _)| g.key() == pod.key()) else {
        return false;
    };
    let mean = |old: u64, new: u64| {
        ((old as f64 * *weight + new as f64 * add) / (*weight + add)).round() as u64
    };
    let host = known.host();
    *known.host_mut() = Host::new(
        mean(host.milli_cpu, pod.host().milli_cpu),
        mean(host.memory_mib, pod.host().memory_mib),
    );
    *weight += add;
    true
}

/// [`merge_into`], or a group of its own.
fn merge<T: Learned>(groups: &mut Vec<(T, f64)>, pod: T, add: f64) {
    if !merge_into(groups, pod, add) {
        groups.push((pod, add));
    }
}

/// Learns a pod arriving now, weighing its GiB: into its group, else a new group while there
/// are fewer than `max`, else in place of the lightest if that weighs less than the pod.
fn learn<T: Learned>(groups: &mut Vec<(T, f64)>, max: usize, pod: T) {
    let add = pod.gib() as f64;
    if merge_into(groups, pod, add) {
        return;
    }
    if groups.len() < max {
        groups.push((pod, add));
    } else if let Some(lightest) = groups
        .iter_mut()
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .filter(|(_, weight)| *weight < add)
    {
        *lightest = (pod, add);
    }
}

/// What each pod of a population of `count` weighs (× its GiB): the population weighs at most
/// as much as a steady stream of about `1 / (1 − DECAY)` pods.
fn population_scale(count: usize) -> f64 {
    (1.0 / (1.0 - DECAY) / count.max(1) as f64).min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fragmentation::fixtures::shape;

    #[test]
    fn a_population_teaches_what_its_pods_would_and_weighs_like_a_stream() {
        let pods = [shape(4, 2), shape(4, 4), shape(16, 8)];
        let learned = Workload::from_population(pods, &Workload::new());
        // Heaviest first: 16 GiB from one pod, 8 GiB from two; CPU is the group's mean.
        assert_eq!(
            learned.shapes(),
            &[(shape(16, 8), 16.0), (shape(4, 3), 8.0)]
        );
        // The order of the pods does not matter.
        let reversed = Workload::from_population(pods.into_iter().rev(), &Workload::new());
        assert_eq!(reversed, learned);
        // Waiting pods learned meanwhile count on top.
        let mut recent = Workload::new();
        recent.observe(shape(2, 1));
        recent.observe(shape(16, 8));
        let merged = Workload::from_population(pods, &recent);
        assert_eq!(merged.shapes().len(), 3);
        assert!(merged.shapes()[0].1 > 31.0, "{merged:?}");
        // Ten thousand running pods weigh as 500 recent ones would.
        let many = Workload::from_population(vec![shape(4, 2); 10_000], &Workload::new());
        assert!((many.shapes()[0].1 - 2_000.0).abs() < 1e-6, "{many:?}");
        assert_eq!(
            Workload::from_population([], &Workload::new()),
            Workload::new()
        );
    }

    #[test]
    fn the_workload_learns_and_forgets_shapes() {
        let mut workload = Workload::new();
        assert!(workload.is_empty());
        for _ in 0..100 {
            workload.observe(shape(4, 2));
        }
        // One group per GPU size, holding its pods' mean CPU and memory.
        workload.observe(Shape {
            gpu_gib: 4,
            host: Host::new(6000, 8192),
        });
        assert_eq!(workload.shapes().len(), 1);
        let cpu = workload.shapes()[0].0.host.milli_cpu;
        assert!((2001..2100).contains(&cpu), "{cpu}");
        for gib in 1..=20 {
            workload.observe(shape(gib, 1));
        }
        assert_eq!(workload.shapes().len(), MAX_SHAPES);
        assert!(
            workload.shapes().iter().any(|(s, _)| s.gpu_gib == 4),
            "the heavy size stays: {workload:?}"
        );
        // Weighted by GiB: one 20 GiB pod weighs as much as five 4 GiB pods.
        let weight = |w: &Workload, gib| {
            w.shapes()
                .iter()
                .find(|(s, _)| s.gpu_gib == gib)
                .map_or(0.0, |(_, weight)| *weight)
        };
        assert!(weight(&workload, 20) > 19.0);
        // CPU-only pods are not GPU shapes.
        let before = workload.clone();
        workload.observe(Shape::default());
        assert_eq!(workload, before);
    }

    #[test]
    fn multi_gpu_shapes_are_learned_beside_the_others_on_one_scale() {
        use crate::fragmentation::Gang;
        let gang = |gpus, gib, cores| Gang {
            gpus,
            shape: shape(gib, cores),
        };
        let mut workload = Workload::new();
        workload.observe(shape(4, 1));
        workload.observe_gang(gang(8, 16, 64));
        workload.observe_gang(gang(8, 16, 32));
        // One group per (GPUs, GiB), its CPU the mean, weighing the GiB brought in all, and
        // every weight decays with every pod.
        assert_eq!(workload.gangs().len(), 1);
        let (learned, weight) = workload.gangs()[0];
        assert_eq!(
            learned.shape.host.milli_cpu, 47_984,
            "(64 × 0.998 + 32) / 1.998 cores"
        );
        assert!((weight - (128.0 * DECAY + 128.0)).abs() < 1e-9, "{weight}");
        assert!((workload.shapes()[0].1 - 4.0 * DECAY * DECAY).abs() < 1e-9);
        // One GPU is no gang, and exclusive pods are never observed as one.
        workload.observe_gang(gang(1, 16, 8));
        assert_eq!(workload.gangs().len(), 1);
        // A population: both kinds on one scale, recent gangs on top.
        let relearned =
            Workload::from_populations([shape(4, 1), shape(4, 1)], [gang(2, 8, 4)], &workload);
        assert_eq!(relearned.shapes().len(), 1);
        assert!((relearned.shapes()[0].1 - (8.0 + 4.0 * DECAY * DECAY)).abs() < 1e-9);
        let gangs: Vec<(u32, u64)> = relearned
            .gangs()
            .iter()
            .map(|(g, _)| (g.gpus, g.shape.gpu_gib))
            .collect();
        assert_eq!(gangs, [(8, 16), (2, 8)]);
        assert_eq!(relearned.gangs()[1].1, 16.0);
        assert!(!relearned.is_empty());
    }
}
