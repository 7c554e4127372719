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
//! **Cost.** Per node O(GPUs × shapes), no allocation, no division in the common case.
//! What depends only on the workload is prepared when it changes, not per node: normalized
//! weights, each shape's weight × size, reciprocals of each shape's CPU and memory (a
//! multiply and one correction instead of a division), and, only when the set of GPU sizes
//! changes, a table of `⌊x / size⌋` for every shape and every `x` below 512 GiB. Per node,
//! the allocator keeps a [`FreeSummary`] (its healthy GPUs grouped by free amount), updated
//! when the node's bookings change, so scoring reads one table row per distinct free amount
//! instead of walking the GPUs; the host caps the slots before and after the pod; each
//! distinct free amount that fits is then evaluated once, in O(shapes). When a call scores
//! many nodes, a [`Placing`] prepared once per call (a few µs) holds, per free amount, the
//! slots of each shape the pod's GiB take from a GPU, so an evaluation reads one row of it
//! instead of subtracting two quotient rows; what is the same for every GPU of a node (the
//! host's caps, the fullness tie-break) is computed once per node.
//! `perf/benches/extender_http.rs` times it through the extender at 5,000 nodes × 8 GPUs.

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

/// `⌊x / size⌋` for a shape's GPU size, as the per-GPU loops need it thousands of times per
/// scheduling call: a multiply by the reciprocal and one correction step instead of a
/// hardware division.
///
/// Exact: for `x, d < 2³²` the estimate `x · (1/d)` is below `x / d` by less than `2⁻²⁰`
/// (two roundings of relative error `2⁻⁵³`) and above it by less than the distance to the
/// next integer, so its floor is the quotient or one less, which the correction fixes; other
/// operands divide for real.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Divisor {
    d: u64,
    reciprocal: f64,
}

impl Divisor {
    fn new(d: u64) -> Self {
        let reciprocal = if d == 0 || d >= 1 << 32 {
            0.0
        } else {
            1.0 / d as f64
        };
        Self { d, reciprocal }
    }

    /// `⌊x / d⌋`; `u64::MAX` when `d` is 0.
    #[inline]
    fn div(self, x: u64) -> u64 {
        if self.reciprocal == 0.0 || x >= 1 << 32 {
            return x.checked_div(self.d).unwrap_or(u64::MAX);
        }
        // Through i64: below 2⁵³ the conversions are exact, and single instructions.
        let q = ((x as i64) as f64 * self.reciprocal) as i64 as u64;
        // q ≤ x / d < 2³², d < 2³²: no overflow.
        if (q + 1) * self.d <= x { q + 1 } else { q }
    }
}

/// How many pods needing `need` of a resource fit in `free`, given that the GPUs hold at most
/// `slots` of them: a multiply in the common case where the resource is not the limit, a
/// [`Divisor`] only where it is. `need` 0 never limits.
#[inline]
fn cap(slots: u64, free: u64, need: Divisor) -> u64 {
    if need.d == 0 || slots.saturating_mul(need.d) <= free {
        slots
    } else {
        need.div(free)
    }
}

/// [`cap`] of the same `slots` under two amounts of the resource (the host's before and
/// after the pod): the product is computed once.
#[inline]
fn cap_before_after(slots: u64, free: u64, free_after: u64, need: Divisor) -> (u64, u64) {
    if need.d == 0 {
        return (slots, slots);
    }
    let product = slots.saturating_mul(need.d);
    let cap = |free: u64| {
        if product <= free {
            slots
        } else {
            need.div(free)
        }
    };
    (cap(free), cap(free_after))
}

/// `x as f64`, through `i64` where it fits: the same value, one instruction instead of the
/// sequence an unsigned conversion takes.
#[inline]
fn to_f64(x: u64) -> f64 {
    match i64::try_from(x) {
        Ok(x) => x as f64,
        Err(_) => x as f64,
    }
}

/// The GPU size of an unused shape entry: larger than any GPU, within [`Divisor`]'s fast
/// range.
const UNUSED_GIB: u64 = u32::MAX as u64;

/// Free amounts up to this many GiB (less one) find their quotients in [`Quotients`]: more
/// than any GPU sold today holds.
const QUOTIENT_ROWS: usize = 512;

/// `⌊x / size⌋` for every shape's GPU size and every `x` below [`QUOTIENT_ROWS`]: the per-GPU
/// loops read a row instead of dividing (a scheduling call reads a few rows, thousands of
/// times). Built when the set of GPU sizes changes, shared by the workloads prepared since.
#[derive(Debug, Clone, Default, PartialEq)]
struct Quotients {
    /// The GPU size of each shape entry ([`UNUSED_GIB`] when unused).
    sizes: [u64; MAX_SHAPES],
    /// Row `x`: `⌊x / size⌋` per shape entry.
    rows: std::sync::Arc<[[u64; MAX_SHAPES]]>,
}

impl Quotients {
    fn new(sizes: [u64; MAX_SHAPES], gib: &[Divisor; MAX_SHAPES]) -> Self {
        let rows = (0..QUOTIENT_ROWS as u64)
            .map(|x| std::array::from_fn(|m| gib[m].div(x)))
            .collect();
        Self { sizes, rows }
    }
}

/// A workload as the per-node loops read it, derived from its shapes whenever they change:
/// fixed arrays, weights normalized to sum to 1, divisors for each shape's GPU size, CPU and
/// memory.
#[derive(Debug, Clone, PartialEq)]
struct Prepared {
    weight: [f64; MAX_SHAPES],
    /// Σ weight: 1, or 0 for an empty workload (up to rounding).
    weight_sum: f64,
    /// weight × GPU size: what one pod of the shape fewer costs, in expected GiB.
    weighted_gib: [f64; MAX_SHAPES],
    gib: [Divisor; MAX_SHAPES],
    /// Each shape's CPU (millicores) and memory (MiB), as divisors.
    cpu: [Divisor; MAX_SHAPES],
    memory: [Divisor; MAX_SHAPES],
    /// The smallest GPU size: a GPU with less free holds no pod of any shape.
    min_gib: u64,
    /// `⌊x / size⌋` of every shape for small `x`: depends on the GPU sizes only.
    quotients: Quotients,
}

impl Default for Prepared {
    fn default() -> Self {
        Self::new(&[], None)
    }
}

impl Prepared {
    /// Prepares `shapes`; `previous`'s quotient table is reused when the GPU sizes are the
    /// same (weights and CPU means move with every pod, the sizes rarely).
    fn new(shapes: &[(Shape, f64)], previous: Option<&Prepared>) -> Self {
        let total: f64 = shapes.iter().map(|(_, w)| w).sum();
        let total = if total > 0.0 { total } else { 1.0 };
        let mut prepared = Prepared {
            weight: [0.0; MAX_SHAPES],
            weight_sum: 0.0,
            weighted_gib: [0.0; MAX_SHAPES],
            // Unused entries weigh nothing and hold no pod of any free amount we meet: the
            // loops run over all MAX_SHAPES entries, a fixed length the compiler unrolls.
            gib: [Divisor::new(UNUSED_GIB); MAX_SHAPES],
            cpu: [Divisor::new(0); MAX_SHAPES],
            memory: [Divisor::new(0); MAX_SHAPES],
            min_gib: u64::MAX,
            quotients: Quotients::default(),
        };
        let mut sizes = [UNUSED_GIB; MAX_SHAPES];
        for (m, (shape, weight)) in shapes.iter().take(MAX_SHAPES).enumerate() {
            prepared.weight[m] = weight / total;
            prepared.weight_sum += weight / total;
            prepared.weighted_gib[m] = weight / total * shape.gpu_gib as f64;
            prepared.gib[m] = Divisor::new(shape.gpu_gib);
            prepared.cpu[m] = Divisor::new(shape.host.milli_cpu);
            prepared.memory[m] = Divisor::new(shape.host.memory_mib);
            prepared.min_gib = prepared.min_gib.min(shape.gpu_gib);
            sizes[m] = shape.gpu_gib;
        }
        prepared.quotients = match previous {
            Some(previous) if previous.quotients.sizes == sizes => previous.quotients.clone(),
            _ => Quotients::new(sizes, &prepared.gib),
        };
        prepared
    }

    /// Per shape, `⌊x / size⌋`: a table row for the free amounts GPUs have, a division
    /// beyond.
    #[inline]
    fn quotients(&self, x: u64) -> [u64; MAX_SHAPES] {
        match usize::try_from(x)
            .ok()
            .and_then(|x| self.quotients.rows.get(x))
        {
            Some(row) => *row,
            None => std::array::from_fn(|m| self.gib[m].div(x)),
        }
    }

    /// Per shape: how many pods of it a node takes whose GPUs have `slots` for it and
    /// whose host has `free` CPU and memory.
    #[inline]
    fn runs(&self, slots: &[u64; MAX_SHAPES], free: Host) -> [u64; MAX_SHAPES] {
        let mut runs = [0; MAX_SHAPES];
        for m in 0..MAX_SHAPES {
            runs[m] = cap(
                cap(slots[m], free.milli_cpu, self.cpu[m]),
                free.memory_mib,
                self.memory[m],
            );
        }
        runs
    }

    /// [`Prepared::runs`] under `free` and under `free_after` at once. The nested caps of
    /// `runs` are `min(slots, cpu cap, memory cap)`, so each resource caps the slots on its
    /// own and the products are shared by the two hosts.
    #[inline]
    fn runs_before_after(
        &self,
        slots: &[u64; MAX_SHAPES],
        free: Host,
        free_after: Host,
    ) -> ([u64; MAX_SHAPES], [u64; MAX_SHAPES]) {
        let mut runs = [0; MAX_SHAPES];
        let mut runs_after = [0; MAX_SHAPES];
        for m in 0..MAX_SHAPES {
            let cpu = cap_before_after(slots[m], free.milli_cpu, free_after.milli_cpu, self.cpu[m]);
            let memory = cap_before_after(
                slots[m],
                free.memory_mib,
                free_after.memory_mib,
                self.memory[m],
            );
            runs[m] = cpu.0.min(memory.0);
            runs_after[m] = cpu.1.min(memory.1);
        }
        (runs, runs_after)
    }
}

/// The distribution of pod shapes the fragmentation is measured against.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Workload {
    /// Shapes and their (decayed) weights; at most [`MAX_SHAPES`].
    shapes: Vec<(Shape, f64)>,
    /// Derived from `shapes` each time they change.
    prepared: Prepared,
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
        let prepared = Prepared::new(&shapes, None);
        Self { shapes, prepared }
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
        // GPU size → (pods, Σ CPU, Σ memory), in size order so the result is deterministic.
        let mut groups: std::collections::BTreeMap<u64, (u64, u128, u128)> = Default::default();
        for pod in pods.into_iter().filter(|pod| pod.gpu_gib > 0) {
            let group = groups.entry(pod.gpu_gib).or_default();
            group.0 += 1;
            group.1 += u128::from(pod.host.milli_cpu);
            group.2 += u128::from(pod.host.memory_mib);
        }
        let count: u64 = groups.values().map(|group| group.0).sum();
        let scale = (1.0 / (1.0 - DECAY) / count.max(1) as f64).min(1.0);
        let mut shapes: Vec<(Shape, f64)> = groups
            .into_iter()
            .map(|(gpu_gib, (pods, cpu, memory))| {
                let mean = |sum: u128| u64::try_from(sum / u128::from(pods)).unwrap_or(u64::MAX);
                let shape = Shape {
                    gpu_gib,
                    host: Host::new(mean(cpu), mean(memory)),
                };
                (shape, (gpu_gib * pods) as f64 * scale)
            })
            .collect();
        for &(shape, weight) in recent.shapes() {
            match shapes.iter_mut().find(|(s, _)| s.gpu_gib == shape.gpu_gib) {
                Some((known, known_weight)) => {
                    let mean = |old: u64, new: u64| {
                        ((old as f64 * *known_weight + new as f64 * weight)
                            / (*known_weight + weight))
                            .round() as u64
                    };
                    known.host.milli_cpu = mean(known.host.milli_cpu, shape.host.milli_cpu);
                    known.host.memory_mib = mean(known.host.memory_mib, shape.host.memory_mib);
                    *known_weight += weight;
                }
                None => shapes.push((shape, weight)),
            }
        }
        Self::from_shapes(shapes)
    }

    /// Records a pod placed now. Pods are grouped by GPU size; a group keeps the mean CPU
    /// and memory of its pods and weighs the GiB they brought, decaying. When all groups are
    /// taken, the lightest gives way if it weighs less than the new pod.
    pub fn observe(&mut self, shape: Shape) {
        if shape.gpu_gib == 0 {
            return;
        }
        self.learn(shape);
        self.prepared = Prepared::new(&self.shapes, Some(&self.prepared));
    }

    fn learn(&mut self, shape: Shape) {
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

/// A node as the measure reads it: each GPU's free and total GiB (`None`: unhealthy, neither
/// usable nor a fragment) and the host's free CPU and memory.
#[derive(Debug, Clone, Copy)]
pub struct NodeFree<F> {
    /// Number of GPUs.
    pub gpus: usize,
    /// Free and total GiB of GPU `i`, `None` when it takes no pods.
    pub free: F,
    /// Free CPU and memory of the host.
    pub host: Host,
}

/// The most distinct free amounts a [`FreeSummary`] keeps: every node of eight GPUs or fewer
/// fits, and larger ones do unless their GPUs differ in more than eight ways.
const DISTINCT: usize = 8;

/// A node's healthy GPUs grouped by free amount: all the measure reads of them. The
/// allocator keeps one per node, updated when the node's bookings or GPUs change, so that
/// scoring thousands of nodes reads a few amounts per node instead of walking every GPU.
///
/// ```text
///   GPUs free 12 | 12 | 4 | 12 (of 16 each)  →  12 × 3 (first GPU 0), 4 × 1 (first GPU 2)
/// ```
///
/// Exact: the slots of a shape are `Σ ⌊free / size⌋` over GPUs, which is `Σ count × ⌊amount
/// / size⌋` over amounts; a GPU's goodness depends only on its free amount, and the first GPU
/// of an amount is the one the per-GPU choice would keep on a tie.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FreeSummary {
    /// Free GiB over healthy GPUs.
    total_free: u64,
    /// GiB of all healthy GPUs, for the fullness tie-break.
    total_gib: u64,
    /// The largest free GiB of a healthy GPU, `None` when the node has none.
    max_free: Option<u64>,
    /// Distinct amounts kept, in the order of their first GPU.
    len: u8,
    /// A ninth distinct amount was seen: the amounts are incomplete.
    overflow: bool,
    free: [u64; DISTINCT],
    count: [u32; DISTINCT],
    first: [u32; DISTINCT],
}

impl FreeSummary {
    /// Reads `gpus` GPUs through `free` (free and total GiB, `None` when unhealthy).
    pub fn new<F: Fn(usize) -> Option<(u64, u64)>>(gpus: usize, free: F) -> Self {
        let mut summary = Self::default();
        for i in 0..gpus {
            if let Some((free, total)) = free(i) {
                summary.add(i, free, total);
            }
        }
        summary
    }

    #[inline]
    fn add(&mut self, gpu: usize, free: u64, total: u64) {
        self.total_gib = self.total_gib.saturating_add(total);
        self.total_free = self.total_free.saturating_add(free);
        self.max_free = Some(self.max_free.map_or(free, |max| max.max(free)));
        let len = usize::from(self.len);
        if let Some(k) = self.free[..len].iter().position(|&f| f == free) {
            self.count[k] = self.count[k].saturating_add(1);
            return;
        }
        match u32::try_from(gpu) {
            Ok(gpu) if len < DISTINCT => {
                self.free[len] = free;
                self.count[len] = 1;
                self.first[len] = gpu;
                self.len += 1;
            }
            _ => self.overflow = true,
        }
    }

    /// Whether every free amount is kept: false for a node whose GPUs differ in more than
    /// eight ways, which the measure then reads GPU by GPU ([`best_gpu`]).
    pub fn is_complete(&self) -> bool {
        !self.overflow
    }

    /// Each distinct free amount with its first GPU and how many GPUs have it.
    fn amounts(&self) -> impl Iterator<Item = (usize, u64, u32)> + Clone + '_ {
        let len = usize::from(self.len);
        self.first[..len]
            .iter()
            .zip(&self.free[..len])
            .zip(&self.count[..len])
            .map(|((&gpu, &free), &count)| (gpu as usize, free, count))
    }
}

/// What the measure precomputes of a node before trying its GPUs: O(shapes) from its
/// [`FreeSummary`] (O(GPUs × shapes) read GPU by GPU), no heap.
///
/// Per shape, the GiB the node's free GPU memory loses to it is `free − runs × size`, where
/// `runs` is the pods of it the node can still take: its GPUs' slots (`Σ ⌊free / size⌋`,
/// zero exactly when no GPU has `size` free), capped by the pods of it the host's free CPU
/// and memory take (zero exactly when the host cannot take one).
#[derive(Debug, Clone, Copy)]
pub struct Before {
    /// Free GiB over healthy GPUs.
    total_free: u64,
    /// The largest free GiB of a healthy GPU, `None` when the node has none.
    max_free: Option<u64>,
    /// Per shape: how many of it the GPUs could take (Σ ⌊free / size⌋).
    slots: [u64; MAX_SHAPES],
    /// Per shape: how many of it the node can take now (slots capped by the host).
    runs: [u64; MAX_SHAPES],
    host: Host,
    /// GiB of all healthy GPUs, for the fullness tie-break.
    total_gib: u64,
}

/// What a pod's placement on a node costs each shape, whichever GPU it takes, from
/// [`Before::after_host`]. With `limit` the runs of a shape once the pod's CPU and memory are
/// gone, placing it on a GPU that loses `d` slots of the shape leaves
/// `min(slots − d, limit)` runs: `runs − limit` are lost to the host in any case, and
/// `d − (slots − limit)` more when that is positive.
#[derive(Debug, Clone, Copy)]
struct HostCost {
    /// Per shape, `runs − limit`: pods of it lost to the host's CPU and memory.
    lost: [u64; MAX_SHAPES],
    /// Per shape, `slots − limit`: slots the GPU may lose before they cost a pod.
    spare: [u64; MAX_SHAPES],
}

impl Before {
    /// Reads `node` against `workload`, GPU by GPU.
    pub fn new<F: Fn(usize) -> Option<(u64, u64)>>(
        workload: &Workload,
        node: &NodeFree<F>,
    ) -> Self {
        let w = &workload.prepared;
        let mut before = Self::empty(node.host);
        for i in 0..node.gpus {
            let Some((free, total)) = (node.free)(i) else {
                continue;
            };
            before.total_gib = before.total_gib.saturating_add(total);
            before.total_free = before.total_free.saturating_add(free);
            before.max_free = Some(before.max_free.map_or(free, |max| max.max(free)));
            if free < w.min_gib {
                continue;
            }
            for (slots, quotient) in before.slots.iter_mut().zip(w.quotients(free)) {
                *slots += quotient;
            }
        }
        before.runs = w.runs(&before.slots, before.host);
        before
    }

    /// Reads a node from its complete `summary` and its host's `free` CPU and memory: one
    /// table row per distinct free amount. With what a pod of `pod` CPU and memory costs it
    /// ([`Before::after_host`]), the host's caps before and after computed together.
    fn of_summary(
        workload: &Workload,
        summary: &FreeSummary,
        free: Host,
        pod: Host,
    ) -> (Self, HostCost) {
        let w = &workload.prepared;
        let mut before = Self::empty(free);
        before.total_gib = summary.total_gib;
        before.total_free = summary.total_free;
        before.max_free = summary.max_free;
        for (_, amount, count) in summary.amounts() {
            if amount < w.min_gib {
                continue;
            }
            let count = u64::from(count);
            for (slots, quotient) in before.slots.iter_mut().zip(w.quotients(amount)) {
                *slots += count * quotient;
            }
        }
        let (runs, limits) = w.runs_before_after(&before.slots, free, free.saturating_sub(pod));
        before.runs = runs;
        let cost = before.cost_given(&limits);
        (before, cost)
    }

    /// A node with no GPUs and `host` free.
    fn empty(host: Host) -> Self {
        Before {
            total_free: 0,
            max_free: None,
            slots: [0; MAX_SHAPES],
            runs: [0; MAX_SHAPES],
            host,
            total_gib: 0,
        }
    }

    /// The node's expected fragmentation now, in GiB.
    pub fn fragmentation(&self, workload: &Workload) -> f64 {
        let w = &workload.prepared;
        (0..MAX_SHAPES)
            .map(|m| {
                let lost = self
                    .total_free
                    .saturating_sub(self.runs[m].saturating_mul(w.gib[m].d));
                w.weight[m] * lost as f64
            })
            .sum()
    }

    /// What placing a pod of `host` costs each shape whichever GPU it goes on (see
    /// [`HostCost`]): the same for every GPU of the node, so [`best_gpu`] computes it once.
    fn after_host(&self, workload: &Workload, host: Host) -> HostCost {
        // Per shape, an upper bound on the pods of it the node takes afterwards: today's
        // slots, capped by what the host has left; ≤ runs and ≤ slots.
        let limits = workload
            .prepared
            .runs(&self.slots, self.host.saturating_sub(host));
        self.cost_given(&limits)
    }

    /// The [`HostCost`] given each shape's runs once the pod's CPU and memory are gone.
    #[inline]
    fn cost_given(&self, limits: &[u64; MAX_SHAPES]) -> HostCost {
        HostCost {
            lost: std::array::from_fn(|m| self.runs[m].saturating_sub(limits[m])),
            spare: std::array::from_fn(|m| self.slots[m].saturating_sub(limits[m])),
        }
    }

    /// Change in expected fragmentation (GiB) if a pod of `need` GiB and `host` goes on a GPU
    /// with `free` GiB free. The caller has checked that it fits.
    pub fn delta(&self, workload: &Workload, free: u64, need: u64, host: Host) -> f64 {
        let cost = self.after_host(workload, host);
        let taken = Placing::new(workload, need, host).taken(free);
        self.delta_with(workload, need, &taken, &cost)
    }

    /// [`Before::delta`] given [`Before::after_host`] and, per shape, the slots the GPU
    /// loses (`taken`, from [`Placing::taken`]). With `lost = free − runs × size` per shape,
    /// the change is `−need` (the pod's GiB leave the free memory) plus `size` per pod of
    /// the shape the node can no longer take: O(shapes).
    #[inline]
    fn delta_with(
        &self,
        workload: &Workload,
        need: u64,
        taken: &[u64; MAX_SHAPES],
        cost: &HostCost,
    ) -> f64 {
        let w = &workload.prepared;
        let mut delta = -(need as f64) * w.weight_sum;
        for (m, taken) in taken.iter().enumerate() {
            let pods_lost = cost.lost[m] + taken.saturating_sub(cost.spare[m]);
            delta += w.weighted_gib[m] * to_f64(pods_lost);
        }
        delta
    }

    /// How good placing the pod on a GPU with `free` GiB free is: higher is better. The
    /// fragmentation it adds, negated, in GiB; then, worth less than 1/64 GiB of
    /// fragmentation, how full the node's GPUs are afterwards, so that equal changes pack.
    pub fn goodness(&self, workload: &Workload, free: u64, need: u64, host: Host) -> f64 {
        let placing = Placing::new(workload, need, host);
        let cost = self.after_host(workload, host);
        self.goodness_with(&placing, free, &cost, self.fullness_after(need))
    }

    /// How full the node's GPUs are once `need` GiB more are used, from 0 to 1: the same for
    /// every GPU of the node, so computed once per node.
    fn fullness_after(&self, need: u64) -> f64 {
        let used_after = self
            .total_gib
            .saturating_sub(self.total_free.saturating_sub(need));
        if self.total_gib == 0 {
            1.0
        } else {
            used_after as f64 / self.total_gib as f64
        }
    }

    /// [`Before::goodness`] given [`Before::after_host`] and [`Before::fullness_after`].
    #[inline(always)]
    fn goodness_with(&self, placing: &Placing, free: u64, cost: &HostCost, fullness: f64) -> f64 {
        let workload = placing.workload;
        let fragmentation = if workload.is_empty() {
            0.0
        } else {
            self.delta_with(workload, placing.need, &placing.taken(free), cost)
        };
        -fragmentation + fullness / 64.0
    }
}

/// A pod being scored, as the per-node loops read it: its GPU memory and host needs with
/// its workload, and, when many nodes are scored at once, a table of the slots a GPU loses
/// to it per shape and free amount, built once per scheduling call (a few µs) instead of
/// two quotient rows read and subtracted per evaluation.
#[derive(Debug, Clone)]
pub struct Placing<'w> {
    workload: &'w Workload,
    /// GiB on one GPU.
    need: u64,
    /// CPU and memory.
    host: Host,
    /// Row `free − need`, for `need ≤ free <` [`QUOTIENT_ROWS`]: per shape,
    /// `⌊free / size⌋ − ⌊(free − need) / size⌋`. Empty when scoring a single node.
    taken: Vec<[u64; MAX_SHAPES]>,
}

impl<'w> Placing<'w> {
    /// A pod of `need` GiB and `host` scored against `workload` on one node: no table.
    pub fn new(workload: &'w Workload, need: u64, host: Host) -> Self {
        Self {
            workload,
            need,
            host,
            taken: Vec::new(),
        }
    }

    /// [`Placing::new`] for scoring many nodes: with the table of slots taken.
    pub fn for_many_nodes(workload: &'w Workload, need: u64, host: Host) -> Self {
        let rows = &workload.prepared.quotients.rows;
        let taken = usize::try_from(need)
            .ok()
            .filter(|&need| need < rows.len())
            .map_or(Vec::new(), |need| {
                rows[need..]
                    .iter()
                    .zip(rows.iter())
                    .map(|(on_gpu, after)| std::array::from_fn(|m| on_gpu[m] - after[m]))
                    .collect()
            });
        Self {
            taken,
            ..Self::new(workload, need, host)
        }
    }

    /// Per shape, the slots a GPU with `free` GiB free loses to the pod: ⌊x / size⌋ grows
    /// with x, so this is ≥ 0. A table row where there is one, two quotient rows beyond.
    /// Inlined into the per-node loop so that the row is read in place, not copied out.
    #[inline(always)]
    fn taken(&self, free: u64) -> [u64; MAX_SHAPES] {
        let row = free
            .checked_sub(self.need)
            .and_then(|after_free| usize::try_from(after_free).ok())
            .and_then(|after_free| self.taken.get(after_free));
        if let Some(row) = row {
            return *row;
        }
        let w = &self.workload.prepared;
        let (on_gpu, after) = (
            w.quotients(free),
            w.quotients(free.saturating_sub(self.need)),
        );
        std::array::from_fn(|m| on_gpu[m].saturating_sub(after[m]))
    }
}

/// Keeps `(i, free, goodness)` in `best` if it is better: higher goodness, then (within
/// rounding) less free memory, so ties pack; an equal candidate seen later loses.
#[inline(always)]
fn keep_better(best: &mut Option<(usize, f64, u64)>, i: usize, free: u64, goodness: f64) {
    let better = match *best {
        None => true,
        Some((_, g, chosen)) => goodness > g + 1e-12 || (goodness > g - 1e-12 && free < chosen),
    };
    if better {
        *best = Some((i, goodness, free));
    }
}

/// The best GPU of a node for a pod of `need` GiB and `host`, read from the node's
/// [`FreeSummary`] and its host's `free` CPU and memory: the position and its
/// [`Before::goodness`]; `None` when no healthy GPU has room, or when the summary is not
/// complete (then [`best_gpu`] reads the node GPU by GPU). Ties go to the GPU with the
/// least free memory (binpack), then the lowest position. A GPU's goodness depends only on
/// its free memory, so each free amount is evaluated once.
pub fn best_gpu_summarized(
    placing: &Placing,
    summary: &FreeSummary,
    free: Host,
) -> Option<(usize, f64)> {
    let need = placing.need;
    if !summary.is_complete() || summary.max_free.is_none_or(|max| max < need) {
        return None;
    }
    let (before, cost) = Before::of_summary(placing.workload, summary, free, placing.host);
    let fullness = before.fullness_after(need);
    // The goodness of every amount first, then the choice: the evaluations are independent
    // of each other and of the choice's branches, so they overlap.
    let mut goodness = [0.0; DISTINCT];
    for ((_, free, _), goodness) in summary.amounts().zip(&mut goodness) {
        if free >= need {
            *goodness = before.goodness_with(placing, free, &cost, fullness);
        }
    }
    let mut best = None;
    for ((i, free, _), goodness) in summary.amounts().zip(goodness) {
        if free >= need {
            keep_better(&mut best, i, free, goodness);
        }
    }
    best.map(|(i, goodness, _)| (i, goodness))
}

/// [`best_gpu_summarized`] for a pod of `need` GiB and `host` on a node read through `node`,
/// GPU by GPU when its GPUs differ in more than eight ways.
pub fn best_gpu<F: Fn(usize) -> Option<(u64, u64)>>(
    workload: &Workload,
    node: &NodeFree<F>,
    need: u64,
    host: Host,
) -> Option<(usize, f64)> {
    best_gpu_placing(&Placing::new(workload, need, host), node)
}

/// [`best_gpu`] for a prepared [`Placing`].
pub fn best_gpu_placing<F: Fn(usize) -> Option<(u64, u64)>>(
    placing: &Placing,
    node: &NodeFree<F>,
) -> Option<(usize, f64)> {
    let summary = FreeSummary::new(node.gpus, &node.free);
    if summary.is_complete() {
        return best_gpu_summarized(placing, &summary, node.host);
    }
    let (workload, need) = (placing.workload, placing.need);
    let before = Before::new(workload, node);
    if before.max_free.is_none_or(|max| max < need) {
        return None;
    }
    let cost = before.after_host(workload, placing.host);
    let fullness = before.fullness_after(need);
    // Each free amount once, at its first GPU.
    let mut seen: Vec<u64> = Vec::new();
    let mut best = None;
    for i in 0..node.gpus {
        let Some((free, _)) = (node.free)(i) else {
            continue;
        };
        if free < need || seen.contains(&free) {
            continue;
        }
        seen.push(free);
        keep_better(
            &mut best,
            i,
            free,
            before.goodness_with(placing, free, &cost, fullness),
        );
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

    fn node(free: &[u64], host: Host) -> NodeFree<impl Fn(usize) -> Option<(u64, u64)> + '_> {
        NodeFree {
            gpus: free.len(),
            free: move |i| free.get(i).map(|free| (*free, 16)),
            host,
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

    proptest::proptest! {
        #[test]
        fn the_divisor_divides_exactly(x in proptest::prelude::any::<u64>(), d in 0..=1u64 << 40, small in 0..=1u64 << 20) {
            for x in [x, x >> 12, small, small.saturating_mul(d.max(1)), (1 << 52) - 1, 1 << 52] {
                let expected = x.checked_div(d).unwrap_or(u64::MAX);
                proptest::prop_assert_eq!(Divisor::new(d).div(x), expected, "{} / {}", x, d);
            }
        }
    }

    /// The measure as first written, dividing for every quotient: what the quotient table,
    /// the divisors and the single pass over the GPUs must reproduce bit for bit.
    fn reference_best_gpu(
        workload: &Workload,
        free: &[Option<u64>],
        node_host: Host,
        need: u64,
        host: Host,
    ) -> Option<(usize, f64)> {
        let w = &workload.prepared;
        let sizes: Vec<u64> = (0..MAX_SHAPES).map(|m| w.gib[m].d).collect();
        let needs: Vec<Host> = (0..MAX_SHAPES)
            .map(|m| Host::new(w.cpu[m].d, w.memory[m].d))
            .collect();
        let cap = |slots: u64, free: u64, need: u64| {
            if need == 0 || slots.saturating_mul(need) <= free {
                slots
            } else {
                free / need
            }
        };
        let runs = |slots: &[u64], free: Host| -> Vec<u64> {
            (0..MAX_SHAPES)
                .map(|m| {
                    cap(
                        cap(slots[m], free.milli_cpu, needs[m].milli_cpu),
                        free.memory_mib,
                        needs[m].memory_mib,
                    )
                })
                .collect()
        };
        let healthy = || free.iter().flatten().copied();
        let mut slots = vec![0u64; MAX_SHAPES];
        for f in healthy() {
            for m in 0..MAX_SHAPES {
                slots[m] += f / sizes[m];
            }
        }
        let total_free = healthy().fold(0u64, u64::saturating_add);
        let total_gib = 32 * free.iter().flatten().count() as u64;
        if healthy().max().is_none_or(|max| max < need) {
            return None;
        }
        let runs_now = runs(&slots, node_host);
        let limits = runs(&slots, node_host.saturating_sub(host));
        let mut best: Option<(usize, f64, u64)> = None;
        let mut seen = [u64::MAX; 8];
        for (i, f) in free.iter().enumerate() {
            let Some(f) = *f else { continue };
            if f < need || seen.contains(&f) {
                continue;
            }
            seen[i % seen.len()] = f;
            let mut delta = -(need as f64) * w.weight_sum;
            for m in 0..MAX_SHAPES {
                let after = slots[m].saturating_sub(f / sizes[m]) + (f - need) / sizes[m];
                let runs_after = after.min(limits[m]);
                delta += w.weighted_gib[m] * runs_now[m].saturating_sub(runs_after) as f64;
            }
            let fragmentation = if workload.is_empty() { 0.0 } else { delta };
            let used_after = total_gib.saturating_sub(total_free.saturating_sub(need));
            let fullness = if total_gib == 0 {
                1.0
            } else {
                used_after as f64 / total_gib as f64
            };
            let goodness = -fragmentation + fullness / 64.0;
            let better = match best {
                None => true,
                Some((_, g, chosen)) => {
                    goodness > g + 1e-12 || (goodness > g - 1e-12 && f < chosen)
                }
            };
            if better {
                best = Some((i, goodness, f));
            }
        }
        best.map(|(i, goodness, _)| (i, goodness))
    }

    proptest::proptest! {
        #[test]
        fn the_fast_measure_is_the_measure_bit_for_bit(
            learned in proptest::collection::vec((1..=40u64, 0..=16u64), 0..30),
            large in proptest::collection::vec(400..=700u64, 0..3),
            free in proptest::collection::vec(proptest::option::weighted(0.9, 0..=40u64), 1..=12),
            beyond in proptest::option::of(500..=800u64),
            node_cores in 0..=96u64,
            need in 1..=40u64,
            cores in 0..=16u64,
        ) {
            let mut workload = Workload::new();
            // Sizes and free amounts beyond the quotient table take the divisions.
            for (gpu_gib, cores) in learned.iter().copied().chain(large.iter().map(|&gib| (gib, 1))) {
                workload.observe(shape(gpu_gib, cores));
                let fresh = Quotients::new(workload.prepared.quotients.sizes, &workload.prepared.gib);
                proptest::prop_assert_eq!(&workload.prepared.quotients, &fresh);
            }
            let mut free = free;
            if let Some(beyond) = beyond {
                free.push(Some(beyond));
            }
            let node_host = Host::new(node_cores * 1000, node_cores * 4096);
            let view = NodeFree {
                gpus: free.len(),
                free: |i: usize| free[i].map(|f| (f, 32)),
                host: node_host,
            };
            let pod = Host::new(cores * 1000, cores * 4096);
            let fast = best_gpu(&workload, &view, need, pod);
            let reference = reference_best_gpu(&workload, &free, node_host, need, pod);
            proptest::prop_assert_eq!(
                fast.map(|(gpu, g)| (gpu, g.to_bits())),
                reference.map(|(gpu, g)| (gpu, g.to_bits())),
                "{:?} vs {:?}", fast, reference
            );
            // Scoring many nodes reads the slots taken from a table: the same bits.
            let tabled = best_gpu_placing(&Placing::for_many_nodes(&workload, need, pod), &view);
            proptest::prop_assert_eq!(
                tabled.map(|(gpu, g)| (gpu, g.to_bits())),
                reference.map(|(gpu, g)| (gpu, g.to_bits())),
                "{:?} vs {:?}", tabled, reference
            );
        }
    }

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
}
