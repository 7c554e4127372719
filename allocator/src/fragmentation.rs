//! Fragmentation-aware placement: choose the node and GPU that leave the cluster's free GPU
//! memory most usable by the pods that typically arrive, CPU and memory included.
//!
//! The idea is FGD's (Weng et al., "Beware of Fragmentation", USENIX ATC'23): measure how much
//! of a node's free GPU memory the typical pods could not use, and place each pod where that
//! measure grows the least. Our measure counts, per typical shape, how many such pods the
//! node could still take, limited by its GPUs *and* by its free CPU and memory:
//!
//! ```text
//!   node: GPUs free 16 | 6 | 2 GiB (24 in all), host free 10 cores / 40 GiB
//!   shape 4 GiB + 2 cores:   GPUs take ⌊16/4⌋+⌊6/4⌋ = 5, host takes 5  → uses 20, lost  4
//!   shape 4 GiB + 8 cores:   GPUs take 5, host takes only 1            → uses  4, lost 20
//!   shape 20 GiB:            no GPU has 20 free                        → lost 24
//!   F(node) = Σ over shapes  weight × lost(shape)      (GiB, an expectation)
//! ```
//!
//! A pod goes where its placement raises `F` the least (or lowers it the most); within the
//! node, onto the GPU that does. GPUs stranded behind an exhausted host count as lost, so a
//! placement that would strand them is avoided, and so is one that splits a GPU a typical
//! large pod needs whole.
//!
//! Where we differ from FGD, each measured on the generated clusters of `perf/`
//! (`realistic-sim`):
//! - FGD counts a GPU as fragmented for a shape only when it is too small for one pod of it,
//!   and a node as usable when it fits one pod; we count the pods the node can really take
//!   (GPU slots, CPU and memory together), so a node with 4 free GPUs and CPU for one pod
//!   shows 3 GPUs lost.
//! - FGD is given the task distribution; we learn it online ([`Workload::observe`]): a
//!   decaying histogram of at most [`MAX_SHAPES`] GPU sizes, each with the mean CPU and
//!   memory of its pods, weighted by GPU memory (the measure is in GiB, so a size matters
//!   by the GiB it brings, not by its pod count).
//! - Among placements that change `F` equally, the fuller node and then the fuller GPU win,
//!   so ties pack instead of scattering.
//!
//! **Cost.** Per node O(GPUs × shapes) with no allocation: per-shape sums are computed once
//! ([`Before::new`]), then each candidate GPU's change is O(shapes), and GPUs with equal free
//! memory are evaluated once.

/// CPU and memory: what a pod requests, a node has allocatable, or has free.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Host {
    /// CPU in millicores.
    pub milli_cpu: u64,
    /// Memory in MiB.
    pub memory_mib: u64,
}

impl Host {
    /// A node whose CPU and memory are unknown: never the constraint.
    pub const UNLIMITED: Host = Host {
        milli_cpu: u64::MAX,
        memory_mib: u64::MAX,
    };

    /// CPU and memory.
    pub const fn new(milli_cpu: u64, memory_mib: u64) -> Self {
        Self {
            milli_cpu,
            memory_mib,
        }
    }

    /// Whether `need` fits in `self`.
    pub fn fits(self, need: Host) -> bool {
        self.milli_cpu >= need.milli_cpu && self.memory_mib >= need.memory_mib
    }

    /// `self − other`, each floored at zero.
    pub fn saturating_sub(self, other: Host) -> Host {
        Host {
            milli_cpu: self.milli_cpu.saturating_sub(other.milli_cpu),
            memory_mib: self.memory_mib.saturating_sub(other.memory_mib),
        }
    }

    /// `self + other`, each capped.
    pub fn saturating_add(self, other: Host) -> Host {
        Host {
            milli_cpu: self.milli_cpu.saturating_add(other.milli_cpu),
            memory_mib: self.memory_mib.saturating_add(other.memory_mib),
        }
    }
}

/// A pod shape: GPU memory on one GPU, and CPU and memory on the host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Shape {
    /// GiB on one GPU.
    pub gpu_gib: u64,
    /// CPU and memory.
    pub host: Host,
}

/// The most shapes a [`Workload`] keeps: the measure's cost per node grows with it.
pub const MAX_SHAPES: usize = 8;

/// How much an observation's weight decays per later observation: a weight halves after
/// about 350 pods, so the shapes follow what is arriving now.
const DECAY: f64 = 0.998;

/// The distribution of pod shapes the fragmentation is measured against.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Workload {
    /// Shapes and their (decayed) weights; at most [`MAX_SHAPES`].
    shapes: Vec<(Shape, f64)>,
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
        Self { shapes }
    }

    /// Records a pod placed now. Pods are grouped by GPU size; a group keeps the mean CPU
    /// and memory of its pods and weighs the GiB they brought, decaying. When all groups are
    /// taken, the lightest gives way if it weighs less than the new pod.
    pub fn observe(&mut self, shape: Shape) {
        if shape.gpu_gib == 0 {
            return;
        }
        let add = shape.gpu_gib as f64;
        for (_, weight) in &mut self.shapes {
            *weight *= DECAY;
        }
        if let Some((known, weight)) = self
            .shapes
            .iter_mut()
            .find(|(s, _)| s.gpu_gib == shape.gpu_gib)
        {
            let mean = |old: u64, new: u64| {
                ((old as f64 * *weight + new as f64 * add) / (*weight + add)).round() as u64
            };
            known.host.milli_cpu = mean(known.host.milli_cpu, shape.host.milli_cpu);
            known.host.memory_mib = mean(known.host.memory_mib, shape.host.memory_mib);
            *weight += add;
            return;
        }
        if self.shapes.len() < MAX_SHAPES {
            self.shapes.push((shape, add));
            return;
        }
        if let Some(lightest) = self
            .shapes
            .iter_mut()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .filter(|(_, weight)| *weight < add)
        {
            *lightest = (shape, add);
        }
    }

    /// The shapes and their weights.
    pub fn shapes(&self) -> &[(Shape, f64)] {
        &self.shapes
    }

    /// True before any pod was observed.
    pub fn is_empty(&self) -> bool {
        self.shapes.is_empty()
    }
}

/// A node as the measure reads it: each GPU's free GiB (`None`: unhealthy, neither usable nor
/// a fragment) and the host's free CPU and memory.
#[derive(Debug, Clone, Copy)]
pub struct NodeFree<F> {
    /// Number of GPUs.
    pub gpus: usize,
    /// Free GiB of GPU `i`, `None` when it takes no pods.
    pub free: F,
    /// Free CPU and memory of the host.
    pub host: Host,
    /// GiB of all healthy GPUs of the node, for the fullness tie-break.
    pub total_gib: u64,
}

/// What the measure precomputes of a node before trying its GPUs: O(GPUs × shapes), no heap.
#[derive(Debug, Clone, Copy)]
pub struct Before {
    /// Free GiB over healthy GPUs.
    total_free: u64,
    /// Largest free GiB and the GPU holding it; second largest.
    max: (u64, usize),
    second: u64,
    /// Per shape: how many of it the GPUs could take (Σ ⌊free / size⌋).
    slots: [u64; MAX_SHAPES],
    host: Host,
    total_gib: u64,
}

/// GiB of a node's free GPU memory that `shape` cannot use: all of it (`total`) unless the
/// largest free GPU (`max`) and the host take one pod of it; else what is left once the
/// GPUs' `slots` for it, capped by the pods of it the host's free CPU and memory take, are
/// filled.
fn lost(shape: &Shape, total: u64, slots: u64, max: u64, host: Host) -> u64 {
    if max < shape.gpu_gib || !host.fits(shape.host) {
        return total;
    }
    let by_host = |free: u64, need: u64| free.checked_div(need).unwrap_or(u64::MAX);
    let runs = slots
        .min(by_host(host.milli_cpu, shape.host.milli_cpu))
        .min(by_host(host.memory_mib, shape.host.memory_mib));
    total.saturating_sub(runs.saturating_mul(shape.gpu_gib))
}

impl Before {
    /// Reads `node` against `workload`.
    pub fn new<F: Fn(usize) -> Option<u64>>(workload: &Workload, node: &NodeFree<F>) -> Self {
        let mut before = Before {
            total_free: 0,
            max: (0, usize::MAX),
            second: 0,
            slots: [0; MAX_SHAPES],
            host: node.host,
            total_gib: node.total_gib,
        };
        for i in 0..node.gpus {
            let Some(free) = (node.free)(i) else {
                continue;
            };
            before.total_free = before.total_free.saturating_add(free);
            if before.max.1 == usize::MAX || free > before.max.0 {
                before.second = before.max.0;
                before.max = (free, i);
            } else if free > before.second {
                before.second = free;
            }
            for (m, (shape, _)) in workload.shapes.iter().enumerate() {
                before.slots[m] += free / shape.gpu_gib;
            }
        }
        before
    }

    /// The node's expected fragmentation now, in GiB.
    pub fn fragmentation(&self, workload: &Workload) -> f64 {
        workload
            .shapes
            .iter()
            .enumerate()
            .map(|(m, (shape, weight))| {
                let lost = lost(shape, self.total_free, self.slots[m], self.max.0, self.host);
                weight * lost as f64
            })
            .sum::<f64>()
            / total_weight(workload)
    }

    /// Change in expected fragmentation (GiB) if a pod of `need` GiB and `host` goes on GPU
    /// `gpu`, which has `free` GiB free. The caller has checked that it fits.
    pub fn delta(&self, workload: &Workload, gpu: usize, free: u64, need: u64, host: Host) -> f64 {
        let after_free = free.saturating_sub(need);
        let total_after = self.total_free.saturating_sub(need);
        let others_max = if gpu == self.max.1 {
            self.second
        } else {
            self.max.0
        };
        let max_after = after_free.max(others_max);
        let host_after = self.host.saturating_sub(host);
        let mut delta = 0.0;
        for (m, (shape, weight)) in workload.shapes.iter().enumerate() {
            let size = shape.gpu_gib;
            let before = lost(shape, self.total_free, self.slots[m], self.max.0, self.host);
            let slots = self.slots[m] - free / size + after_free / size;
            let after = lost(shape, total_after, slots, max_after, host_after);
            delta += weight * (after as f64 - before as f64);
        }
        delta / total_weight(workload)
    }

    /// How good placing the pod on GPU `gpu` is: higher is better. The fragmentation it adds,
    /// negated, in GiB; then, worth less than 1/64 GiB of fragmentation, how full the node's
    /// GPUs are afterwards, so that equal changes pack.
    pub fn goodness(
        &self,
        workload: &Workload,
        gpu: usize,
        free: u64,
        need: u64,
        host: Host,
    ) -> f64 {
        let fragmentation = if workload.is_empty() {
            0.0
        } else {
            self.delta(workload, gpu, free, need, host)
        };
        let used_after = self
            .total_gib
            .saturating_sub(self.total_free.saturating_sub(need));
        let fullness = if self.total_gib == 0 {
            1.0
        } else {
            used_after as f64 / self.total_gib as f64
        };
        -fragmentation + fullness / 64.0
    }
}

fn total_weight(workload: &Workload) -> f64 {
    let total: f64 = workload.shapes.iter().map(|(_, w)| w).sum();
    if total > 0.0 { total } else { 1.0 }
}

/// The best GPU of `node` for a pod of `need` GiB and `host`: the position and its
/// [`Before::goodness`]; `None` when no healthy GPU has room. Ties go to the GPU with the
/// least free memory (binpack), then the lowest position.
pub fn best_gpu<F: Fn(usize) -> Option<u64>>(
    workload: &Workload,
    node: &NodeFree<F>,
    need: u64,
    host: Host,
) -> Option<(usize, f64)> {
    let before = Before::new(workload, node);
    let mut best: Option<(usize, f64, u64)> = None;
    for i in 0..node.gpus {
        let Some(free) = (node.free)(i) else {
            continue;
        };
        if free < need || best.is_some_and(|(_, _, chosen)| chosen == free) {
            continue;
        }
        let goodness = before.goodness(workload, i, free, need, host);
        let better = match best {
            None => true,
            Some((_, g, chosen)) => goodness > g + 1e-12 || (goodness > g - 1e-12 && free < chosen),
        };
        if better {
            best = Some((i, goodness, free));
        }
    }
    best.map(|(i, goodness, _)| (i, goodness))
}

/// Scores for candidate nodes from their goodness (`None`: does not fit), relative to each
/// other: the best (and any tied with it) get [`crate::MAX_SCORE`], the others 1 to
/// `MAX_SCORE − 1` in proportion, nodes that do not fit 0.
///
/// Why the best alone gets the top score: kube-scheduler adds the extender's 0..=10 to its
/// own scores and breaks ties at random; with a proportional scale, every node within a
/// tenth of the best would tie with it and the choice among them would be random.
pub fn relative_scores(goodness: &[Option<f64>]) -> Vec<u8> {
    let (low, high) = goodness
        .iter()
        .flatten()
        .fold((f64::MAX, f64::MIN), |(low, high), g| {
            (low.min(*g), high.max(*g))
        });
    let top = crate::MAX_SCORE;
    goodness
        .iter()
        .map(|g| match *g {
            None => 0,
            Some(g) if g >= high - 1e-9 => top,
            Some(g) => {
                let scaled = (g - low) / (high - low) * f64::from(top - 2);
                // In 0..=top−2 before the cast, so it cannot truncate.
                1 + scaled.round().clamp(0.0, f64::from(top - 2)) as u8
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(free: &[u64], host: Host) -> NodeFree<impl Fn(usize) -> Option<u64> + '_> {
        NodeFree {
            gpus: free.len(),
            free: move |i| free.get(i).copied(),
            host,
            total_gib: 16 * free.len() as u64,
        }
    }

    fn shape(gpu_gib: u64, cores: u64) -> Shape {
        Shape {
            gpu_gib,
            host: Host::new(cores * 1000, cores * 4096),
        }
    }

    #[test]
    fn fragments_are_the_memory_a_shape_cannot_use() {
        let workload = Workload::from_shapes([(shape(8, 4), 1.0)]);
        let roomy = Host::new(64_000, 1 << 20);
        // Two 8 GiB pods fit the 16 GiB GPU; the 6 and 2 GiB are lost.
        let before = Before::new(&workload, &node(&[16, 6, 2], roomy));
        assert_eq!(before.fragmentation(&workload), 8.0);
        // CPU for one pod only: 16 of the 24 GiB are lost.
        let one = Before::new(&workload, &node(&[16, 6, 2], Host::new(6_000, 1 << 20)));
        assert_eq!(one.fragmentation(&workload), 16.0);
        // No CPU left for the shape: every free GiB is lost.
        let starved = Before::new(&workload, &node(&[16, 6, 2], Host::new(2_000, 1 << 20)));
        assert_eq!(starved.fragmentation(&workload), 24.0);
    }

    #[test]
    fn small_pods_fill_gaps_and_keep_whole_gpus() {
        // 8 GiB pods are typical; a 4 GiB pod should go to the GPU with 6 free, not split
        // the empty one, and not to the GPU with 8 free that an 8 GiB pod could still use.
        let workload = Workload::from_shapes([(shape(8, 1), 3.0), (shape(4, 1), 1.0)]);
        let free = [16, 8, 6];
        let n = node(&free, Host::UNLIMITED);
        let (gpu, _) = best_gpu(&workload, &n, 4, Host::new(1000, 4096)).unwrap();
        assert_eq!(gpu, 2);
    }

    #[test]
    fn a_pod_that_would_strand_a_nodes_gpus_goes_elsewhere() {
        let workload = Workload::from_shapes([(shape(16, 8), 1.0)]);
        let pod = Host::new(12_000, 12 * 4096);
        // Node a: two empty GPUs and CPU for two typical pods, but not after this one.
        let a = node(&[16, 16], Host::new(16_000, 1 << 20));
        let b = node(&[16, 16], Host::new(64_000, 1 << 20));
        let (_, on_a) = best_gpu(&workload, &a, 16, pod).unwrap();
        let (_, on_b) = best_gpu(&workload, &b, 16, pod).unwrap();
        // On a, the other GPU is stranded: 16 GiB lost. On b nothing is.
        assert!(on_a < -15.0 && on_b > -1.0, "{on_a} {on_b}");
    }

    #[test]
    fn equal_changes_pack_onto_the_fuller_node() {
        let workload = Workload::from_shapes([(shape(2, 1), 1.0)]);
        let pod = Host::new(1000, 4096);
        let full = node(&[4, 16], Host::UNLIMITED);
        let empty = node(&[16, 16], Host::UNLIMITED);
        let (gpu, on_full) = best_gpu(&workload, &full, 2, pod).unwrap();
        let (_, on_empty) = best_gpu(&workload, &empty, 2, pod).unwrap();
        assert_eq!(gpu, 0, "binpack inside the node on ties");
        assert!(on_full > on_empty);
    }

    #[test]
    fn only_the_best_gets_the_top_score() {
        let scores = relative_scores(&[Some(-3.0), None, Some(-1.0), Some(-1.0), Some(-1.1)]);
        assert_eq!(scores[1], 0);
        assert_eq!((scores[2], scores[3]), (10, 10));
        assert_eq!(scores[0], 1);
        assert!((1..10).contains(&scores[4]), "{scores:?}");
        assert_eq!(relative_scores(&[Some(2.0)]), vec![10]);
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
}
