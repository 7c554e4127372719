//! What the fragmentation policy adds to the cluster model: each node's CPU and memory
//! (allocatable, and requested by the pods bound to it, GPU pods or not) and the workload of
//! recent pod shapes. See [`crate::fragmentation`] for the measure.

use std::cell::RefCell;
use std::sync::Arc;

use super::{Cluster, Node};
use crate::demand_mix::{DemandMix, ResourceScores};
use crate::fragmentation::{
    self, Before, FreeSummary, Gang, Host, NodeFree, Placing, Shape, Workload,
};
use crate::{ModelFilter, PodId, Request, kube_scores};

impl Node {
    /// No pod is booked here, GPU or not: a node that left the watch can be forgotten.
    pub(super) fn is_vacant(&self) -> bool {
        self.pods.is_empty() && self.host_scored == Host::default()
    }

    /// kube-scheduler's default CPU and memory scores for a pod asking `pod` here
    /// ([`kube_scores::default_scores`]); 0 when the node's allocatable is unknown.
    pub fn default_scores(&self, pod: Host) -> i64 {
        let Some(allocatable) = self.host else {
            return 0;
        };
        let requested = kube_scores::Requested {
            actual: self.host_used,
            non_zero: self.host_scored,
        };
        kube_scores::default_scores(allocatable, requested, pod)
    }

    /// kube-scheduler's CPU and memory scores the ranking counts (`which`) for a pod asking
    /// `pod` here; 0 when the node's allocatable is unknown.
    pub fn resource_scores(&self, pod: Host, which: ResourceScores) -> i64 {
        match (which, self.host) {
            (ResourceScores::Both, _) => self.default_scores(pod),
            (ResourceScores::Balanced, Some(allocatable)) => {
                kube_scores::balanced_allocation(allocatable, self.host_used.saturating_add(pod))
            }
            _ => 0,
        }
    }

    /// The node's free CPU and memory ([`Host::UNLIMITED`] when its allocatable is unknown).
    pub fn host_free(&self) -> Host {
        self.host.map_or(Host::UNLIMITED, |allocatable| {
            allocatable.saturating_sub(self.host_used)
        })
    }

    /// The node's GPUs as the measure reads them: healthy ones' free GiB.
    fn free_view(&self) -> NodeFree<impl Fn(usize) -> Option<(u64, u64)> + '_> {
        NodeFree {
            gpus: self.gpus.len(),
            free: |i: usize| {
                let usage: &super::GpuUsage = &self.gpus[i];
                usage.healthy.then(|| (usage.free_gib(), usage.total_gib))
            },
            host: self.host_free(),
        }
    }

    /// Recomputes the node's [`FreeSummary`]: after its GPUs or their bookings changed.
    pub(super) fn refresh_free_summary(&mut self) {
        self.free_summary = self.read_free_summary();
    }

    /// The node's [`FreeSummary`], read GPU by GPU.
    fn read_free_summary(&self) -> FreeSummary {
        let view = self.free_view();
        FreeSummary::new(view.gpus, view.free)
    }

    /// The best GPU (position) for the pod `placing` describes under the fragmentation
    /// measure and its goodness, if any GPU has room: from the node's summary, GPU by GPU
    /// when the summary is incomplete.
    fn fragmentation_best(&self, placing: &Placing) -> Option<(usize, f64)> {
        debug_assert_eq!(
            self.free_summary,
            self.read_free_summary(),
            "the free summary is stale"
        );
        if self.free_summary.is_complete() {
            return fragmentation::best_gpu_summarized(
                placing,
                &self.free_summary,
                self.host_free(),
            );
        }
        fragmentation::best_gpu_placing(placing, &self.free_view())
    }

    /// [`Node::fragmentation_best`] for `request`, which may name GPU models: the same on a
    /// node whose GPUs are all of models it allows; otherwise GPU by GPU among those it
    /// allows ([`fragmentation::best_gpu_among`]), the node's fragmentation counting all of
    /// them; `None` where it allows none.
    fn fragmentation_best_for<'a>(
        &'a self,
        models: &ModelMemo<'a>,
        placing: &Placing,
    ) -> Option<(usize, f64)> {
        if models.filter.is_any() {
            return self.fragmentation_best(placing);
        }
        let allowed = |pos: usize| models.allows(&self.gpus[pos].gpu.model);
        let count = (0..self.gpus.len()).filter(|&pos| allowed(pos)).count();
        if count == self.gpus.len() {
            return self.fragmentation_best(placing);
        }
        if count == 0 {
            return None;
        }
        fragmentation::best_gpu_among(placing, &self.free_view(), allowed)
    }

    /// The GPU (position) the fragmentation measure picks for `request`, if any it may take
    /// has room.
    pub(super) fn fragmentation_gpu(
        &self,
        request: &Request,
        workload: &Workload,
    ) -> Option<usize> {
        let placing = Placing::new(workload, request.pod_gib, request.host);
        if request.compute > 0 {
            // Only GPUs with the compute free besides the memory: GPU by GPU.
            let models = ModelMemo::new(&request.models);
            let allowed = |pos: usize| {
                let usage = &self.gpus[pos];
                usage.free_compute() >= request.compute && models.allows(&usage.gpu.model)
            };
            return fragmentation::best_gpu_among(&placing, &self.free_view(), allowed)
                .map(|(pos, _)| pos);
        }
        self.fragmentation_best_for(&ModelMemo::new(&request.models), &placing)
            .map(|(pos, _)| pos)
    }

    /// How good the node is for a multi-GPU `request` under the fragmentation measure, its
    /// slices on the GPUs at `taken` (those bind would take): the fragmentation
    /// the placement removes (negative when it adds some), then, worth less than 1/64 GiB,
    /// how full the node's GPUs are afterwards, so that equal changes pack. O(GPUs × shapes).
    fn fragmentation_goodness_multi(
        &self,
        taken: &[usize],
        request: &Request,
        workload: &Workload,
    ) -> f64 {
        let per_gpu = request.gib_per_gpu();
        let view = self.free_view();
        let after = NodeFree {
            gpus: view.gpus,
            free: |i: usize| {
                let (free, total) = (view.free)(i)?;
                let held = if taken.contains(&i) { per_gpu } else { 0 };
                Some((free.saturating_sub(held), total))
            },
            host: view.host.saturating_sub(request.host),
        };
        let before = Before::new(workload, &view);
        let removed =
            before.fragmentation(workload) - Before::new(workload, &after).fragmentation(workload);
        removed + before.fullness_after(per_gpu * taken.len() as u64) / 64.0
    }

    /// How good the node is for `request` under the fragmentation measure, placed on the GPU
    /// at `pos` (the one [`Node::decide`](super::Node) chose, twin rule included).
    fn fragmentation_goodness(&self, pos: usize, request: &Request, workload: &Workload) -> f64 {
        let view = self.free_view();
        let before = Before::new(workload, &view);
        before.goodness(
            workload,
            self.gpus[pos].free_gib(),
            request.pod_gib,
            request.host,
        )
    }
}

/// A request's model filter asked GPU by GPU while nodes are scored: each distinct model name
/// is normalized and checked once per call, not once per GPU (node GPUs name a few models).
struct ModelMemo<'a> {
    filter: &'a ModelFilter,
    seen: RefCell<Vec<(&'a str, bool)>>,
}

impl<'a> ModelMemo<'a> {
    fn new(filter: &'a ModelFilter) -> Self {
        Self {
            filter,
            seen: RefCell::default(),
        }
    }

    /// Whether the filter allows a GPU of `model`.
    fn allows(&self, model: &'a str) -> bool {
        if let Some(&(_, allowed)) = self.seen.borrow().iter().find(|(seen, _)| *seen == model) {
            return allowed;
        }
        let allowed = self.filter.allows(model);
        self.seen.borrow_mut().push((model, allowed));
        allowed
    }
}

impl Cluster {
    /// Sets a node's allocatable CPU and memory (`None`: unknown, never the constraint).
    pub fn set_node_host(&mut self, name: &str, allocatable: Option<Host>) {
        if let Some(node) = self.nodes.get_mut(name) {
            node.host = allocatable;
        }
    }

    /// Records the CPU and memory a pod bound to `node` requests (any pod, GPU or not; one
    /// asking none still counts in kube-scheduler's scores, see [`kube_scores::non_zero`]).
    /// Idempotent; a pod moved or resized is re-booked.
    pub fn set_pod_host(&mut self, uid: PodId, node: &str, host: Host) {
        if let Some((old_node, old)) = self.hosts.get(&uid)
            && **old_node == *node
            && *old == host
        {
            return;
        }
        self.remove_pod_host(&uid);
        let name = self.node_name(node);
        let entry = self.nodes.entry(name.clone()).or_default();
        entry.host_used = entry.host_used.saturating_add(host);
        entry.host_scored = entry
            .host_scored
            .saturating_add(kube_scores::non_zero(host));
        self.hosts.insert(uid, (name, host));
    }

    /// Forgets a pod's CPU and memory (deleted, or finished).
    pub fn remove_pod_host(&mut self, uid: &PodId) {
        let Some((name, host)) = self.hosts.remove(uid) else {
            return;
        };
        if let Some(node) = self.nodes.get_mut(&name) {
            node.host_used = node.host_used.saturating_sub(host);
            node.host_scored = node.host_scored.saturating_sub(kube_scores::non_zero(host));
            if !node.present && node.is_vacant() {
                self.nodes.remove(&name);
            }
        }
    }

    /// Records the shape of a pod that asks for GPU memory: the workload the fragmentation
    /// policy measures against follows the pods that arrive.
    pub fn observe(&mut self, shape: Shape) {
        self.workload.observe(shape);
    }

    /// Records the shape of a pod that asks for GPU memory on several GPUs (shared slices):
    /// the measure then counts the jobs of its size each node can still take.
    pub fn observe_gang(&mut self, gang: Gang) {
        self.workload.observe_gang(gang);
    }

    /// Records a GPU pod that arrives asking `gib_per_gpu` on each of `gpus` GPUs (whole
    /// ones when `exclusive`) with `host`, `pinned` when it may run only on some GPU models:
    /// the demand mix always, and the shape the measure learns, one-GPU or multi-GPU, unless
    /// its GPUs are its alone (the measure knows no such shape).
    pub fn observe_arrival(
        &mut self,
        (gpus, gib_per_gpu): (u32, u64),
        exclusive: bool,
        host: Host,
        pinned: bool,
    ) {
        self.observe_demand(gib_per_gpu.saturating_mul(u64::from(gpus)), gpus, pinned);
        if exclusive {
            return;
        }
        let shape = Shape {
            gpu_gib: gib_per_gpu,
            host,
        };
        if gpus > 1 {
            self.observe_gang(Gang { gpus, shape });
        } else {
            self.observe(shape);
        }
    }

    /// Records the GPU demand of a pod that arrives asking `pod_gib` in all over `gpus` GPUs,
    /// `pinned` to GPU models or not: the ranking ([`Cluster::scheduler_totals`]) follows how
    /// much of it is multi-GPU or pinned.
    pub fn observe_demand(&mut self, pod_gib: u64, gpus: u32, pinned: bool) {
        self.demand.observe(pod_gib, gpus > 1, pinned);
    }

    /// The recent GPU demand's mix.
    pub fn demand(&self) -> &DemandMix {
        &self.demand
    }

    /// Learns the workload again from the GPU pods booked now, with the shapes observed so
    /// far on top ([`Workload::from_population`]): after a restart, the first pod list holds
    /// mostly bound pods, which are never observed as arriving, so without this a restarted
    /// extender would score as binpack until new pods taught it the shapes again.
    pub fn relearn_workload(&mut self) {
        // Exclusive pods are not shapes the measure knows (as when observed); one-GPU pods
        // are shapes, multi-GPU ones gangs.
        let host_of = |uid: &PodId| {
            self.hosts
                .get(uid)
                .map_or(Host::default(), |(_, host)| *host)
        };
        let shared = || {
            self.nodes.values().flat_map(|node| {
                node.pods
                    .iter()
                    .filter(|(_, placement)| !placement.exclusive)
            })
        };
        let singles = shared()
            .filter(|(_, placement)| placement.more_gpus.is_empty())
            .map(|(uid, placement)| Shape {
                gpu_gib: placement.pod_gib,
                host: host_of(uid),
            });
        let gangs = shared()
            .filter(|(_, placement)| !placement.more_gpus.is_empty())
            .map(|(uid, placement)| Gang {
                gpus: u32::try_from(1 + placement.more_gpus.len()).unwrap_or(u32::MAX),
                shape: Shape {
                    gpu_gib: placement.pod_gib,
                    host: host_of(uid),
                },
            });
        self.workload = Workload::from_populations(singles, gangs, &self.workload);
        // The demand mix likewise, from every GPU pod booked, if none arrived yet.
        if self.demand.is_empty() {
            for node in self.nodes.values() {
                for placement in node.pods.values() {
                    let gpus = 1 + placement.more_gpus.len() as u64;
                    let multi = gpus > 1;
                    self.demand
                        .observe(placement.pod_gib.saturating_mul(gpus), multi, false);
                }
            }
        }
    }

    /// [`Cluster::scores`] under [`crate::Policy::Fragmentation`] for a multi-GPU request
    /// (shared slices): each fitting node's goodness with the request on the GPUs bind
    /// would take there, ranked by [`fragmentation::relative_scores`].
    pub(super) fn fragmentation_scores_multi(&self, nodes: &[&str], request: &Request) -> Vec<u8> {
        let goodness: Vec<Option<f64>> = nodes
            .iter()
            .map(|name| {
                let node = self.nodes.get(*name)?;
                let choice = node
                    .choose(request, crate::Policy::Fragmentation, &self.workload)
                    .ok()?;
                let taken: Vec<usize> = std::iter::once(choice.first).chain(choice.more).collect();
                Some(node.fragmentation_goodness_multi(&taken, request, &self.workload))
            })
            .collect();
        fragmentation::relative_scores(&goodness)
    }

    /// The workload of recent pod shapes.
    pub fn workload(&self) -> &Workload {
        &self.workload
    }

    /// [`Cluster::scores`] under [`crate::Policy::Fragmentation`]: each fitting node's
    /// goodness (see [`fragmentation::Before::goodness`]), ranked by
    /// [`fragmentation::relative_scores`].
    pub(super) fn fragmentation_scores(&self, nodes: &[&str], request: &Request) -> Vec<u8> {
        let placing = Placing::for_many_nodes(&self.workload, request.pod_gib, request.host);
        let models = ModelMemo::new(&request.models);
        let goodness: Vec<Option<f64>> = nodes
            .iter()
            .map(|name| {
                let node = self.nodes.get(*name)?;
                if request.compute > 0 {
                    // Only GPUs with the compute free too: the decision bind takes, measured.
                    let pos = node
                        .decide(request, crate::Policy::Fragmentation, &self.workload)
                        .ok()?;
                    return Some(node.fragmentation_goodness(pos, request, &self.workload));
                }
                if node.pending.is_empty() {
                    // No twin can pin the pod: it fits where a healthy GPU of a model it
                    // allows has room, which is what best_gpu finds, in the same pass over
                    // the GPUs.
                    node.check_node().ok()?;
                    return node
                        .fragmentation_best_for(&models, &placing)
                        .map(|(_, goodness)| goodness);
                }
                // Fit and the twin rule first (O(GPUs)); a pinned pod has no GPU to choose.
                let pos = node
                    .decide(request, crate::Policy::Binpack, &self.workload)
                    .ok()?;
                if matches!(node.pin(request), Ok(Some(_))) {
                    return Some(node.fragmentation_goodness(pos, request, &self.workload));
                }
                node.fragmentation_best_for(&models, &placing)
                    .map(|(_, goodness)| goodness)
            })
            .collect();
        fragmentation::relative_scores(&goodness)
    }

    /// How kube-scheduler would rank `nodes` for `request` with scores: our
    /// [`Cluster::scores`] × `extender_weight` × 10, plus its default CPU and memory scores on
    /// each node ([`Node::resource_scores`]), except that those are left out, and our score
    /// alone ranks, while the recent demand is multi-GPU heavy, and LeastAllocated is left
    /// out while it is pinned heavy ([`crate::demand_mix`]). What the filter that keeps only
    /// the best node ranks by (see [`kube_scores`]). A node that does not fit totals its
    /// resource scores alone; the caller passes only nodes that fit.
    pub fn scheduler_totals(
        &self,
        nodes: &[&str],
        request: &Request,
        policy: crate::Policy,
        extender_weight: i64,
    ) -> Vec<i64> {
        let ours = self.scores(nodes, request, policy);
        let which = self.demand.resource_scores();
        nodes
            .iter()
            .zip(ours)
            .map(|(name, score)| {
                let defaults = self
                    .nodes
                    .get(*name)
                    .map_or(0, |node| node.resource_scores(request.host, which));
                i64::from(score)
                    .saturating_mul(extender_weight)
                    .saturating_mul(kube_scores::EXTENDER_SCORE_SCALE)
                    .saturating_add(defaults)
            })
            .collect()
    }

    /// Number of pods whose CPU and memory are booked.
    pub fn host_pod_count(&self) -> usize {
        self.hosts.len()
    }

    /// The node a pod's CPU and memory are booked on.
    pub fn pod_host(&self, uid: &PodId) -> Option<(&Arc<str>, Host)> {
        self.hosts.get(uid).map(|(node, host)| (node, *host))
    }
}

#[cfg(test)]
mod tests {
    use crate::fragmentation::{Host, Shape};
    use crate::{Cluster, Gpu, Policy, Request};

    fn gpus(count: u32) -> Vec<Gpu> {
        (0..count)
            .map(|index| Gpu {
                index,
                uuid: format!("GPU-{index}"),
                model: "T4".into(),
                numa: None,
                total_gib: 16,
                healthy: true,
            })
            .collect()
    }

    /// A one-GPU pod bound to GPU `gpu`, holding `gib` there.
    fn running(gpu: u32, gib: u64) -> crate::PodPlacement {
        crate::PodPlacement {
            more_gpus: Vec::new(),
            exclusive: false,
            gpu,
            uuid: format!("GPU-{gpu}").into(),
            pod_gib: gib,
            pending: vec![],
            assigned: true,
            compute: 0,
        }
    }

    fn request(gib: u64, cores: u64) -> Request {
        Request {
            models: Default::default(),
            gpus: 1,
            exclusive: false,
            pod_gib: gib,
            containers: vec![gib],
            host: Host::new(cores * 1000, cores * 4096),
            compute: 0,
        }
    }

    /// Two nodes of 2 × 16 GiB, "tight" with 16 cores and "roomy" with 64, that have seen ten
    /// pods of `shape`.
    fn tight_and_roomy(shape: Shape) -> Cluster {
        let mut cluster = Cluster::new();
        for name in ["tight", "roomy"] {
            cluster.set_node(name, gpus(2), true);
        }
        cluster.set_node_host("tight", Some(Host::new(16_000, 1 << 20)));
        cluster.set_node_host("roomy", Some(Host::new(64_000, 1 << 20)));
        for _ in 0..10 {
            cluster.observe(shape);
        }
        cluster
    }

    #[test]
    fn a_node_whose_cpu_would_strand_its_gpus_scores_low() {
        let mut cluster = tight_and_roomy(Shape {
            gpu_gib: 16,
            host: Host::new(8_000, 8 * 4096),
        });
        let big = request(16, 12);
        let scores = cluster.scores(&["tight", "roomy"], &big, Policy::Fragmentation);
        assert_eq!(scores, vec![1, 10]);
        // Without CPU information both nodes look alike and the tie keeps both at the top.
        cluster.set_node_host("tight", None);
        assert_eq!(
            cluster.scores(&["tight", "roomy"], &big, Policy::Fragmentation),
            vec![10, 10]
        );
    }

    #[test]
    fn host_bookings_follow_pods_and_survive_unknown_nodes() {
        let mut cluster = Cluster::new();
        cluster.set_node("n1", gpus(1), true);
        cluster.set_node_host("n1", Some(Host::new(8_000, 32_768)));
        cluster.set_pod_host("cpu-pod".into(), "n1", Host::new(6_000, 1_024));
        cluster.set_pod_host("cpu-pod".into(), "n1", Host::new(6_000, 1_024));
        assert_eq!(
            cluster.node("n1").unwrap().host_free(),
            Host::new(2_000, 31_744)
        );
        // A pod on a node the node watch has not shown yet is kept until it is.
        cluster.set_pod_host("early".into(), "n2", Host::new(1_000, 1_000));
        cluster.set_node("n2", gpus(1), true);
        cluster.set_node_host("n2", Some(Host::new(4_000, 4_000)));
        assert_eq!(
            cluster.node("n2").unwrap().host_free(),
            Host::new(3_000, 3_000)
        );
        cluster.remove_pod_host(&"cpu-pod".into());
        assert_eq!(
            cluster.node("n1").unwrap().host_free(),
            Host::new(8_000, 32_768)
        );
        cluster.forget_pods();
        assert_eq!(cluster.host_pod_count(), 0);
        assert_eq!(
            cluster.node("n2").unwrap().host_free(),
            Host::new(4_000, 4_000)
        );
    }

    #[test]
    fn the_default_scores_count_pods_without_requests_as_kube_scheduler_does() {
        let mut cluster = Cluster::new();
        cluster.set_node("n1", gpus(1), true);
        cluster.set_node_host("n1", Some(Host::new(1_000, 1_000)));
        let pod = Host::new(100, 100);
        // Empty: 90 left of each, balanced.
        assert_eq!(cluster.node("n1").unwrap().default_scores(pod), 90 + 100);
        // A pod asking nothing frees nothing less, but counts 100 m and 200 MiB in the score.
        cluster.set_pod_host("best-effort".into(), "n1", Host::default());
        assert_eq!(
            cluster.node("n1").unwrap().host_free(),
            Host::new(1_000, 1_000)
        );
        assert_eq!(
            cluster.node("n1").unwrap().default_scores(pod),
            (80 + 70) / 2 + 100
        );
        // Gone with the node watch, it keeps the node's entry until the pod goes too.
        cluster.remove_node("n1");
        assert!(cluster.node("n1").is_some());
        cluster.remove_pod_host(&"best-effort".into());
        assert!(cluster.node("n1").is_none());
    }

    /// Two nodes with one empty GPU each, "busy" with 6 of its 8 CPUs taken, and a pod asking
    /// 4 GiB and one CPU.
    fn busy_and_idle() -> (Cluster, Request) {
        let mut cluster = Cluster::new();
        for name in ["busy", "idle"] {
            cluster.set_node(name, gpus(1), true);
            cluster.set_node_host(name, Some(Host::new(8_000, 32_768)));
        }
        cluster.set_pod_host("cpu-hog".into(), "busy", Host::new(6_000, 8_192));
        (cluster, request(4, 1))
    }

    #[test]
    fn scheduler_totals_add_the_default_scores_to_ours_times_weight() {
        let (cluster, pod) = busy_and_idle();
        let ours = cluster.scores(&["busy", "idle"], &pod, Policy::Binpack);
        assert_eq!(ours, vec![10, 10]);
        let totals = cluster.scheduler_totals(&["busy", "idle"], &pod, Policy::Binpack, 2);
        let busy = cluster.node("busy").unwrap().default_scores(pod.host);
        let idle = cluster.node("idle").unwrap().default_scores(pod.host);
        assert!(idle > busy, "{idle} vs {busy}");
        assert_eq!(totals, vec![200 + busy, 200 + idle]);
    }

    /// While multi-GPU pods bring a quarter of the recent GPU demand, the ranking leaves
    /// kube-scheduler's CPU and memory scores out: the CPU-busy node no longer loses for being
    /// busy, and our score alone decides (here it ties); once the demand is one-GPU again,
    /// the resource scores are back.
    #[test]
    fn the_ranking_is_ours_alone_while_the_demand_is_multi_gpu_heavy() {
        let (mut cluster, pod) = busy_and_idle();
        let totals = |cluster: &Cluster| {
            cluster.scheduler_totals(&["busy", "idle"], &pod, Policy::Binpack, 1)
        };
        let with_defaults =
            ["busy", "idle"].map(|name| 100 + cluster.node(name).unwrap().default_scores(pod.host));
        assert_eq!(totals(&cluster), with_defaults);
        assert!(with_defaults[1] > with_defaults[0], "{with_defaults:?}");
        for _ in 0..50 {
            cluster.observe_demand(4, 1, false);
            cluster.observe_demand(64, 8, false);
        }
        assert!(cluster.demand().multi_gpu_share() > 0.9);
        assert_eq!(totals(&cluster), vec![100, 100]);
        for _ in 0..3_000 {
            cluster.observe_demand(4, 1, false);
        }
        assert_eq!(totals(&cluster), with_defaults);
        // One-GPU pods, half of them pinned to GPU models: BalancedAllocation alone counts.
        for i in 0..1_000 {
            cluster.observe_demand(4, 1, i % 2 == 0);
        }
        assert!(!cluster.demand().is_multi_gpu_heavy() && cluster.demand().is_pinned_heavy());
        let balanced = ["busy", "idle"].map(|name| {
            let node = cluster.node(name).unwrap();
            let used = node.host_used.saturating_add(pod.host);
            100 + crate::kube_scores::balanced_allocation(node.host.unwrap(), used)
        });
        assert_eq!(totals(&cluster), balanced);
        assert!(
            balanced != with_defaults && balanced != [100, 100],
            "{balanced:?}"
        );
    }

    #[test]
    fn bind_picks_the_gpu_the_measure_prefers() {
        let mut cluster = Cluster::new();
        cluster.set_node("n1", gpus(3), true);
        for _ in 0..10 {
            cluster.observe(Shape {
                gpu_gib: 8,
                host: Host::new(1_000, 1_024),
            });
        }
        // GPU 0 empty, GPU 1 has 8 free, GPU 2 has 6 free.
        cluster.upsert_pod("a".into(), "n1", running(1, 8));
        cluster.upsert_pod("b".into(), "n1", running(2, 10));
        let placed = cluster
            .reserve("p".into(), "n1", &request(4, 1), Policy::Fragmentation)
            .unwrap();
        assert_eq!(
            placed.gpu, 2,
            "the 6 GiB gap, keeping 8 and 16 for 8 GiB pods"
        );
    }

    /// A pod that names GPU models is measured too, on the GPUs of its models: across nodes
    /// it scores as the same pod naming none would where every GPU is of its model; on a node
    /// with GPUs of two models bind takes the GPU of its models the measure prefers (binpack
    /// would take the snuggest), whether the pod names its model or refuses the other; a node
    /// with none of its models scores 0; a multi-GPU pod's slices go on GPUs of its models.
    #[test]
    fn model_restricted_pods_are_measured_on_their_models_gpus() {
        let mut cluster = tight_and_roomy(Shape {
            gpu_gib: 8,
            host: Host::new(3_000, 1_024),
        });
        let t4_only = |gib, cores| Request {
            models: crate::ModelFilter::parse(["T4"]),
            ..request(gib, cores)
        };
        let nodes = ["tight", "roomy"];
        let plain = cluster.scores(&nodes, &request(16, 12), Policy::Fragmentation);
        assert_eq!(plain, vec![1, 10]);
        assert_eq!(
            cluster.scores(&nodes, &t4_only(16, 12), Policy::Fragmentation),
            plain
        );
        // GPUs 0 and 1 are T4s with 9 and 12 GiB free, GPU 2 an A10 with 4 free.
        let mut mixed = gpus(3);
        mixed[2].model = "A10".into();
        cluster.set_node("mixed", mixed, true);
        cluster.upsert_pod("a".into(), "mixed", running(0, 7));
        cluster.upsert_pod("b".into(), "mixed", running(1, 4));
        cluster.upsert_pod("c".into(), "mixed", running(2, 12));
        // Refusing the A10 is the same filter here; an A10-only node takes neither.
        let not_a10 = Request {
            models: crate::ModelFilter::parse(["!A10"]),
            ..request(4, 1)
        };
        let mut a10s = gpus(1);
        a10s[0].model = "A10".into();
        cluster.set_node("a10s", a10s, true);
        for pod in [&t4_only(4, 1), &not_a10] {
            let scores = cluster.scores(&["mixed", "a10s"], pod, Policy::Fragmentation);
            assert_eq!(scores, vec![10, 0], "{pod:?}");
            let gpu = cluster.choose_gpu("mixed", pod, Policy::Fragmentation);
            assert_eq!(
                gpu,
                Ok(1),
                "12 → 8 GiB keeps room for an 8 GiB pod; 9 → 5 would not"
            );
        }
        // Two slices of T4s: the measure scores them on the two T4s, never the A10.
        let two_t4s = Request {
            gpus: 2,
            pod_gib: 4,
            containers: vec![4],
            ..t4_only(2, 1)
        };
        let scores = cluster.scores(&["mixed", "a10s"], &two_t4s, Policy::Fragmentation);
        assert_eq!(scores, vec![10, 0]);
        let mut taken = cluster
            .choose_gpus("mixed", &two_t4s, Policy::Fragmentation)
            .unwrap();
        taken.sort_unstable();
        assert_eq!(taken, [0, 1]);
        let placed = cluster
            .reserve("p".into(), "mixed", &t4_only(4, 1), Policy::Fragmentation)
            .unwrap();
        assert_eq!(placed.gpu, 1);
    }

    /// A 2-GPU pod under the fragmentation policy: binpack would put it on the fuller node,
    /// where its CPU leaves the host room for one more typical pod and strands the rest of
    /// the GPUs' memory; the measure puts it on the roomy node instead, while multi-GPU pods
    /// are rare. Once they bring a large share of the demand it is scored as binpack again,
    /// and so is a one-GPU pod taking a whole GPU, which the measure would have sent to the
    /// roomy node too; a one-GPU pod sharing a GPU is still measured.
    #[test]
    fn whole_gpus_are_scored_by_the_measure_while_multi_gpu_pods_are_rare() {
        let mut cluster = Cluster::new();
        for (name, cores) in [("fuller", 10), ("roomy", 64)] {
            cluster.set_node(name, gpus(4), true);
            cluster.set_node_host(name, Some(Host::new(cores * 1_000, 1 << 20)));
        }
        cluster.upsert_pod(
            "resident".into(),
            "fuller",
            crate::PodPlacement {
                more_gpus: Vec::new(),
                exclusive: false,
                gpu: 0,
                uuid: "GPU-0".into(),
                pod_gib: 8,
                pending: vec![],
                assigned: true,
                compute: 0,
            },
        );
        for _ in 0..20 {
            cluster.observe(Shape {
                gpu_gib: 8,
                host: Host::new(2_000, 4_096),
            });
            cluster.observe_demand(8, 1, false);
        }
        let two_gpus = Request {
            gpus: 2,
            pod_gib: 16,
            containers: vec![16],
            host: Host::new(8_000, 8_192),
            ..request(16, 8)
        };
        let nodes = ["fuller", "roomy"];
        let binpack = cluster.scores(&nodes, &two_gpus, Policy::Binpack);
        assert_eq!(binpack, vec![10, 1], "binpack prefers the fuller node");
        assert_eq!(
            cluster.scores(&nodes, &two_gpus, Policy::Fragmentation),
            vec![1, 10],
            "on the fuller node only 2 cores would be left: one 8 GiB pod, 32 GiB stranded"
        );
        let whole_gpu = request(16, 8);
        let sharing = request(8, 8);
        let whole_binpack = cluster.scores(&nodes, &whole_gpu, Policy::Binpack);
        assert_eq!(whole_binpack, vec![10, 1]);
        for one_gpu in [&whole_gpu, &sharing] {
            assert_eq!(
                cluster.scores(&nodes, one_gpu, Policy::Fragmentation),
                vec![1, 10],
                "8 cores on the fuller node strand its other GPUs too"
            );
        }
        for _ in 0..50 {
            cluster.observe_demand(64, 8, false);
        }
        assert!(cluster.demand().is_multi_gpu_heavy());
        assert_eq!(
            cluster.scores(&nodes, &two_gpus, Policy::Fragmentation),
            binpack
        );
        assert_eq!(
            cluster.scores(&nodes, &whole_gpu, Policy::Fragmentation),
            whole_binpack,
            "while multi-GPU pods are common, a whole GPU is taken where it keeps nodes whole"
        );
        assert_eq!(
            cluster.scores(&nodes, &sharing, Policy::Fragmentation),
            vec![1, 10],
            "a pod sharing a GPU is still measured"
        );
    }
}
