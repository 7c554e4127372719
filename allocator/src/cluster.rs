//! The cluster model and its decisions: see the crate documentation for the picture.
//!
//! This module holds the [`Cluster`] itself: the nodes and pods as the watches report them,
//! and [`Cluster::reserve`], which decides and books in one step. The rest is split by job:
//!
//! - `node`: one node's GPUs, pods and the totals derived from them (booking, unbooking);
//! - `decide`: which GPU(s) of a node a request gets, or why none (policy, twin rule, NUMA);
//! - `score`: the read-only questions of the scheduling path (fit, scores, choose a GPU);
//! - `host`: what the fragmentation policy adds (CPU and memory, the learned workload);
//! - `preempt`: which pods must go so a more important pod fits on one GPU.

use std::sync::Arc;

// Node and pod lookups are on the scheduling hot path (one per candidate node per cycle);
// the keys are our own cluster's names, so a fast non-DoS-resistant hash is the right trade.
use rustc_hash::FxHashMap as HashMap;

use crate::demand_mix::DemandMix;
use crate::fragmentation::{Host, Workload};
use crate::{Gpu, Placement, PodId, PodPlacement, Policy, Refusal, Request, Unfit};

mod decide;
mod host;
mod node;
mod preempt;
mod score;

use decide::Choice;
pub use node::{GpuSet, GpuUsage, Node};
pub use preempt::{Evictable, Eviction};

/// Every node's GPUs and the pods booked on them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cluster {
    /// Keyed by a shared name, so the per-pod index below holds a pointer, not a copy.
    nodes: HashMap<Arc<str>, Node>,
    /// Which node each pod is on.
    pod_nodes: HashMap<PodId, Arc<str>>,
    /// Each bound pod's CPU and memory and its node (any pod, GPU or not).
    hosts: HashMap<PodId, (Arc<str>, Host)>,
    /// Recent pod shapes, for [`Policy::Fragmentation`].
    workload: Workload,
    /// How much of the recent GPU demand is multi-GPU, for the ranking
    /// ([`Cluster::scheduler_totals`]).
    demand: DemandMix,
}

impl Cluster {
    /// An empty cluster.
    pub fn new() -> Self {
        Self::default()
    }

    /// Builds the state from scratch, as after a restart: the same as applying each node and
    /// pod in turn, in any order.
    pub fn rebuild(
        nodes: impl IntoIterator<Item = (String, Vec<Gpu>, bool)>,
        pods: impl IntoIterator<Item = (PodId, String, PodPlacement)>,
    ) -> Self {
        let mut cluster = Self::new();
        for (name, gpus, eligible) in nodes {
            cluster.set_node(&name, gpus, eligible);
        }
        for (uid, node, placement) in pods {
            cluster.upsert_pod(uid, &node, placement);
        }
        cluster
    }

    /// Adds or updates a node from the node watch. Bookings of pods already on it are kept
    /// and recounted against the new GPU list.
    pub fn set_node(&mut self, name: &str, mut gpus: Vec<Gpu>, eligible: bool) {
        gpus.sort_by_key(|gpu| gpu.index);
        gpus.dedup_by_key(|gpu| gpu.index);
        if !self.nodes.contains_key(name) {
            self.nodes.insert(name.into(), Node::default());
        }
        let Some(node) = self.nodes.get_mut(name) else {
            return;
        };
        node.present = true;
        node.eligible = eligible;
        let unchanged = node.gpus.len() == gpus.len()
            && node
                .gpus
                .iter()
                .zip(&gpus)
                .all(|(old, new)| *old.gpu == *new);
        if unchanged {
            return;
        }
        node.gpus = gpus.into_iter().map(GpuUsage::new).collect();
        node.rebook();
    }

    /// Forgets a node that left the node watch. Its pods stay booked (they are deleted
    /// through the pod watch) so that order of events does not matter.
    pub fn remove_node(&mut self, name: &str) {
        let Some(node) = self.nodes.get_mut(name) else {
            return;
        };
        if node.is_vacant() {
            self.nodes.remove(name);
        } else {
            *node = Node {
                pods: std::mem::take(&mut node.pods),
                host_used: node.host_used,
                host_scored: node.host_scored,
                ..Node::default()
            };
        }
    }

    /// Records a pod as the watch reports it (annotations on a bound pod). Idempotent;
    /// replaces any earlier booking of the same pod, including a reservation. Never refuses:
    /// the watch is the truth, even when it over-books a GPU.
    pub fn upsert_pod(&mut self, uid: PodId, node: &str, placement: PodPlacement) {
        if let Some(old_node) = self.pod_nodes.get(&uid)
            && **old_node == *node
            && self
                .nodes
                .get(node)
                .and_then(|n| n.pods.get(&uid))
                .is_some_and(|old| *old == placement)
        {
            return;
        }
        self.remove_pod(&uid);
        let name = self.node_name(node);
        let entry = self.nodes.entry(name.clone()).or_default();
        entry.book(&placement);
        entry.pods.insert(uid.clone(), placement);
        self.pod_nodes.insert(uid, name);
    }

    /// The shared name of `node`: the map's own key when the node is known, else a new one.
    pub fn node_name(&self, node: &str) -> Arc<str> {
        self.nodes
            .get_key_value(node)
            .map_or_else(|| node.into(), |(name, _)| name.clone())
    }

    /// Forgets every pod but keeps the nodes, as before replaying a fresh pod list; nodes
    /// known only through their pods go too.
    pub fn forget_pods(&mut self) {
        self.pod_nodes.clear();
        self.hosts.clear();
        self.nodes.retain(|_, node| node.present);
        for node in self.nodes.values_mut() {
            node.pods.clear();
            node.host_used = Host::default();
            node.host_scored = Host::default();
            node.rebook();
        }
    }

    /// Forgets a pod (deleted, or finished: Succeeded/Failed). Returns its last placement.
    pub fn remove_pod(&mut self, uid: &PodId) -> Option<(Arc<str>, PodPlacement)> {
        let node_name = self.pod_nodes.remove(uid)?;
        let node = self.nodes.get_mut(&node_name)?;
        let placement = node.pods.remove(uid)?;
        node.unbook(&placement);
        if !node.present && node.is_vacant() {
            self.nodes.remove(&node_name);
        }
        Some((node_name, placement))
    }

    /// Undoes a [`Cluster::reserve`] whose bind failed. Same as [`Cluster::remove_pod`].
    pub fn release(&mut self, uid: &PodId) -> Option<(Arc<str>, PodPlacement)> {
        self.remove_pod(uid)
    }

    /// Decides the GPU for a pod being bound to `node` and books it, in one step.
    pub fn reserve(
        &mut self,
        uid: PodId,
        node_name: &str,
        request: &Request,
        policy: Policy,
    ) -> Result<Placement, Refusal> {
        self.reserve_choosing(uid, node_name, request, |node, workload| {
            node.choose(request, policy, workload)
        })
    }

    /// [`Cluster::reserve`], but the GPUs booked are the first that take the request, in
    /// index order, whatever a policy would prefer: what kube-scheduler's DRA allocator takes
    /// on the node it chose (first fit over the slice's devices, which our plugin publishes in
    /// index order). DRA mode's holds book with it, so the filters that run before the
    /// claim's allocation is watched see the GPU that allocation will name.
    pub fn reserve_first_fit(
        &mut self,
        uid: PodId,
        node_name: &str,
        request: &Request,
    ) -> Result<Placement, Refusal> {
        self.reserve_choosing(uid, node_name, request, |node, workload| {
            node.first_fit(request, workload)
        })
    }

    /// Books `request` for pod `uid` on the GPUs of `node_name` that `choose` picks.
    fn reserve_choosing(
        &mut self,
        uid: PodId,
        node_name: &str,
        request: &Request,
        choose: impl FnOnce(&Node, &Workload) -> Result<Choice, Unfit>,
    ) -> Result<Placement, Refusal> {
        if let Some((node, placement)) = self.pod(&uid) {
            return Err(Refusal::AlreadyPlaced {
                node: node.to_owned(),
                gpu: placement.gpu,
            });
        }
        let name = match self.nodes.get_key_value(node_name) {
            Some((name, _)) => name.clone(),
            None => return Err(Unfit::UnknownNode.into()),
        };
        let node = self.nodes.get_mut(node_name).ok_or(Unfit::UnknownNode)?;
        let choice = choose(node, &self.workload)?;
        let gpu = Arc::clone(&node.gpus[choice.first].gpu);
        let more: Vec<Arc<Gpu>> = choice
            .more
            .iter()
            .map(|&pos| Arc::clone(&node.gpus[pos].gpu))
            .collect();
        let pod_gib = request.gib_per_gpu();
        let result = Placement {
            node: node_name.to_owned(),
            gpu: gpu.index,
            uuid: gpu.uuid.clone(),
            more_gpus: more.iter().map(|g| (g.index, g.uuid.clone())).collect(),
            pod_gib,
            exclusive: request.exclusive,
        };
        let placement = PodPlacement {
            gpu: gpu.index,
            uuid: gpu.uuid.as_str().into(),
            more_gpus: more
                .iter()
                .map(|g| (g.index, Arc::from(g.uuid.as_str())))
                .collect(),
            pod_gib,
            exclusive: request.exclusive,
            pending: request.containers.clone(),
            assigned: false,
        };
        node.book(&placement);
        node.pods.insert(uid.clone(), placement);
        self.pod_nodes.insert(uid, name);
        Ok(result)
    }

    /// A node by name (present or known only through its pods).
    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes.get(name)
    }

    /// Every node, in no particular order.
    pub fn nodes(&self) -> impl Iterator<Item = (&str, &Node)> {
        self.nodes.iter().map(|(name, node)| (&**name, node))
    }

    /// A pod's node and placement.
    pub fn pod(&self, uid: &PodId) -> Option<(&str, &PodPlacement)> {
        let node = self.pod_nodes.get(uid)?;
        let placement = self.nodes.get(node)?.pods.get(uid)?;
        Some((&**node, placement))
    }

    /// Number of pods booked.
    pub fn pod_count(&self) -> usize {
        self.pod_nodes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A healthy Tesla T4 of `total_gib` with index `index` (UUID `GPU-<index>`); the other
    /// modules' tests build their nodes with it too.
    pub(super) fn gpu(index: u32, total_gib: u64) -> Gpu {
        Gpu {
            index,
            uuid: format!("GPU-{index}"),
            model: "Tesla T4".into(),
            numa: None,
            total_gib,
            healthy: true,
        }
    }

    fn request(gib: u64) -> Request {
        Request {
            models: Default::default(),
            gpus: 1,
            exclusive: false,
            pod_gib: gib,
            containers: vec![gib],
            host: Host::default(),
        }
    }

    fn running(gpu: u32, gib: u64) -> PodPlacement {
        PodPlacement {
            more_gpus: Vec::new(),
            exclusive: false,
            gpu,
            uuid: "".into(),
            pod_gib: gib,
            pending: vec![gib],
            assigned: true,
        }
    }

    /// Four 16 GiB GPUs with 12, 8, 4 and 16 GiB free.
    fn design_doc_node() -> Cluster {
        let mut cluster = Cluster::new();
        cluster.set_node("n1", (0..4).map(|i| gpu(i, 16)).collect(), true);
        cluster.upsert_pod("a".into(), "n1", running(0, 4));
        cluster.upsert_pod("b".into(), "n1", running(1, 8));
        cluster.upsert_pod("c".into(), "n1", running(2, 12));
        cluster
    }

    /// The GiB free on each GPU of `node`, in index order.
    fn free_gib(cluster: &Cluster, node: &str) -> Vec<u64> {
        let gpus = cluster.node(node).unwrap().gpus();
        gpus.iter().map(GpuUsage::free_gib).collect()
    }

    #[test]
    fn design_doc_example_binpacks_onto_the_gpu_with_8_free() {
        let cluster = design_doc_node();
        assert_eq!(free_gib(&cluster, "n1"), vec![12, 8, 4, 16]);
        assert_eq!(
            cluster.choose_gpu("n1", &request(8), Policy::Binpack),
            Ok(1)
        );
        assert_eq!(cluster.choose_gpu("n1", &request(8), Policy::Spread), Ok(3));
        let mut cluster = cluster;
        let placed = cluster
            .reserve("p".into(), "n1", &request(8), Policy::Binpack)
            .unwrap();
        assert_eq!((placed.gpu, placed.uuid.as_str()), (1, "GPU-1"));
        assert_eq!(cluster.node("n1").unwrap().gpus()[1].free_gib(), 0);
    }

    #[test]
    fn first_fit_takes_the_lowest_gpus_with_room_whatever_the_policy_prefers() {
        // Free 12, 8, 4, 16: binpack would take GPU 1 for 8 GiB; first fit takes GPU 0.
        let mut cluster = design_doc_node();
        let placed = cluster
            .reserve_first_fit("p".into(), "n1", &request(8))
            .unwrap();
        assert_eq!((placed.gpu, placed.uuid.as_str()), (0, "GPU-0"));
        // Now 4, 8, 4, 16: two slices of 6 GiB go to GPUs 1 and 3, the first two with room.
        let placed = cluster
            .reserve_first_fit("q".into(), "n1", &multi(2, 6, false))
            .unwrap();
        assert_eq!((placed.gpu, placed.more_gpus.len()), (1, 1));
        assert_eq!(placed.more_gpus[0].0, 3);
        assert_eq!(free_gib(&cluster, "n1"), vec![4, 2, 4, 10]);
        // What fits nowhere is refused as a policy's choice refuses it, and books nothing.
        assert_eq!(
            cluster.reserve_first_fit("r".into(), "n1", &request(11)),
            Err(cluster
                .reserve("r".into(), "n1", &request(11), Policy::Binpack)
                .unwrap_err())
        );
        assert!(
            cluster
                .reserve_first_fit("r".into(), "n1", &multi(2, 5, false))
                .is_err()
        );
        assert!(
            cluster
                .reserve_first_fit("r".into(), "n1", &multi(1, 16, true))
                .is_err()
        );
        assert_eq!(cluster.pod_count(), 5);
    }

    /// A pod bound to the GPU with `uuid`, recorded at `index`, with a container still waiting.
    fn waiting_on(uuid: &str, index: u32, gib: u64) -> PodPlacement {
        PodPlacement {
            uuid: uuid.into(),
            assigned: false,
            ..running(index, gib)
        }
    }

    #[test]
    fn bookings_follow_the_gpu_uuid_when_indices_shift() {
        let mut cluster = Cluster::new();
        cluster.set_node("n1", (0..3).map(|i| gpu(i, 16)).collect(), true);
        cluster.upsert_pod("a".into(), "n1", waiting_on("GPU-1", 1, 12));
        cluster.upsert_pod("b".into(), "n1", waiting_on("GPU-2", 2, 4));
        // GPU-0 fell off the bus: the node comes back with GPU-1 at index 0, GPU-2 at 1.
        let renumbered = |index: u32, uuid: &str| Gpu {
            uuid: uuid.into(),
            ..gpu(index, 16)
        };
        cluster.set_node(
            "n1",
            vec![renumbered(0, "GPU-1"), renumbered(1, "GPU-2")],
            true,
        );
        let node = cluster.node("n1").unwrap();
        let used: Vec<(&str, u64)> = node
            .gpus()
            .iter()
            .map(|g| (g.gpu.uuid.as_str(), g.used_gib))
            .collect();
        assert_eq!(used, vec![("GPU-1", 12), ("GPU-2", 4)]);
        // The twin rule pins to the GPU where the waiting container really is.
        let pending: Vec<(u64, &[u32], u32)> = node.pending().collect();
        assert_eq!(pending, vec![(4, &[1][..], 1), (12, &[0][..], 1)]);
        assert_eq!(
            node.gpu_of(&waiting_on("GPU-1", 1, 12))
                .map(|g| g.gpu.index),
            Some(0)
        );
        // 12 GiB of GPU-1 stay taken, so a 12 GiB twin cannot go there.
        assert!(
            cluster
                .reserve("c".into(), "n1", &request(12), Policy::Binpack)
                .is_err()
        );

        // A pod whose GPU left the node books nothing on the card now at its index.
        cluster.upsert_pod("d".into(), "n1", waiting_on("GPU-0", 0, 8));
        let node = cluster.node("n1").unwrap();
        assert_eq!(node.gpus()[0].used_gib, 12);
        assert!(node.gpu_of(&waiting_on("GPU-0", 0, 8)).is_none());
        // Removing it unbooks nothing either.
        cluster.remove_pod(&"d".into());
        assert_eq!(cluster.node("n1").unwrap().gpus()[0].used_gib, 12);
    }

    #[test]
    fn without_uuids_bookings_use_the_index() {
        let mut cluster = Cluster::new();
        let anonymous = |index| Gpu {
            uuid: String::new(),
            ..gpu(index, 16)
        };
        cluster.set_node("n1", vec![anonymous(0), anonymous(1)], true);
        cluster.upsert_pod("a".into(), "n1", waiting_on("GPU-9", 1, 4));
        cluster.upsert_pod("b".into(), "n1", running(0, 2));
        let used: Vec<u64> = cluster
            .node("n1")
            .unwrap()
            .gpus()
            .iter()
            .map(|g| g.used_gib)
            .collect();
        assert_eq!(used, vec![2, 4]);
    }

    #[test]
    fn forgetting_pods_keeps_the_nodes_and_frees_their_gpus() {
        let mut cluster = design_doc_node();
        // A container still waiting for the device plugin: the twin rule's pending count.
        let waiting = PodPlacement {
            assigned: false,
            ..running(3, 4)
        };
        cluster.upsert_pod("w".into(), "n1", waiting);
        assert!(cluster.node("n1").unwrap().pending().next().is_some());
        // A pod on a node the node watch has not shown, and a node deleted with a pod on it:
        // both exist only through their pods.
        cluster.upsert_pod("x".into(), "ghost", running(0, 4));
        cluster.set_node("gone", vec![gpu(0, 16)], true);
        cluster.upsert_pod("y".into(), "gone", running(0, 4));
        cluster.remove_node("gone");
        assert!(cluster.node("gone").is_some_and(|node| !node.is_present()));

        cluster.forget_pods();
        assert_eq!(cluster.pod_count(), 0);
        assert!(cluster.node("ghost").is_none() && cluster.node("gone").is_none());
        let node = cluster.node("n1").unwrap();
        assert!(node.is_present() && node.pods().next().is_none());
        assert!(node.pending().next().is_none());
        assert!(node.gpus().iter().all(|gpu| gpu.used_gib == 0));
        // The shared name handed to pods is the node map's own.
        let name = cluster.node_name("n1");
        cluster.upsert_pod("a".into(), &name, running(0, 4));
        assert_eq!(cluster.pod(&"a".into()).map(|(node, _)| node), Some("n1"));
        assert!(std::ptr::eq(
            cluster.node_name("n1").as_ptr(),
            name.as_ptr()
        ));
    }

    #[test]
    fn mixed_gpu_sizes_use_each_gpus_own_total() {
        let mut cluster = Cluster::new();
        cluster.set_node("n1", vec![gpu(0, 16), gpu(1, 24)], true);
        assert_eq!(
            cluster.choose_gpu("n1", &request(20), Policy::Binpack),
            Ok(1)
        );
        assert_eq!(
            cluster.choose_gpu("n1", &request(10), Policy::Binpack),
            Ok(0)
        );
        assert_eq!(
            cluster.fit("n1", &request(30)),
            Err(Unfit::TooLarge {
                need: 30,
                largest_total: 24
            })
        );
        assert!(
            cluster
                .fit("n1", &request(30))
                .unwrap_err()
                .is_unresolvable()
        );
        cluster.upsert_pod("a".into(), "n1", running(1, 20));
        let err = cluster.fit("n1", &request(20)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "needs 20 GiB on one GPU; largest free is 16 GiB (GPU 0)"
        );
        assert!(!err.is_unresolvable());
    }

    #[test]
    fn unhealthy_gpus_are_skipped() {
        let mut cluster = Cluster::new();
        let mut sick = gpu(0, 24);
        sick.healthy = false;
        cluster.set_node("n1", vec![sick.clone(), gpu(1, 8)], true);
        assert_eq!(cluster.choose_gpu("n1", &request(4), Policy::Spread), Ok(1));
        assert!(matches!(
            cluster.fit("n1", &request(16)),
            Err(Unfit::TooLarge {
                largest_total: 8,
                ..
            })
        ));
        cluster.set_node("n1", vec![sick], true);
        assert_eq!(
            cluster.fit("n1", &request(1)),
            Err(Unfit::AllUnhealthy { count: 1 })
        );
    }

    #[test]
    fn unknown_unlabelled_and_empty_nodes_are_unresolvable() {
        let mut cluster = Cluster::new();
        assert_eq!(cluster.fit("ghost", &request(1)), Err(Unfit::UnknownNode));
        cluster.set_node("plain", vec![gpu(0, 16)], false);
        assert_eq!(cluster.fit("plain", &request(1)), Err(Unfit::NotEligible));
        // Capacity fallback is the caller's: a node with no inventory and no capacity has no GPUs.
        cluster.set_node("bare", vec![], true);
        assert_eq!(cluster.fit("bare", &request(1)), Err(Unfit::NoGpus));
        for node in ["ghost", "plain", "bare"] {
            assert!(
                cluster
                    .fit(node, &request(1))
                    .unwrap_err()
                    .is_unresolvable()
            );
            assert_eq!(cluster.score(node, &request(1), Policy::Binpack), 0);
        }
    }

    #[test]
    fn capacity_fallback_gpus_work_without_uuids() {
        // What the extender builds from capacity 32 and gpu-count 2 when no inventory exists.
        let mut cluster = Cluster::new();
        let fallback = |index| Gpu {
            index,
            uuid: String::new(),
            model: String::new(),
            numa: None,
            total_gib: 16,
            healthy: true,
        };
        cluster.set_node("n1", vec![fallback(0), fallback(1)], true);
        let placed = cluster
            .reserve("a".into(), "n1", &request(16), Policy::Binpack)
            .unwrap();
        assert_eq!((placed.gpu, placed.uuid.as_str()), (0, ""));
        cluster.upsert_pod("a".into(), "n1", running(0, 16));
        assert_eq!(
            cluster.choose_gpu("n1", &request(16), Policy::Binpack),
            Ok(1)
        );
    }

    #[test]
    fn twin_rule_pins_equal_sizes_to_one_gpu() {
        let mut cluster = Cluster::new();
        cluster.set_node("n1", vec![gpu(0, 16), gpu(1, 16)], true);
        cluster
            .reserve("a".into(), "n1", &request(4), Policy::Spread)
            .unwrap();
        // Spread would pick the empty GPU 1, but a 4 GiB container waits on GPU 0.
        assert_eq!(cluster.choose_gpu("n1", &request(4), Policy::Spread), Ok(0));
        // A 6 GiB pod has no twin: spread is free to choose.
        assert_eq!(cluster.choose_gpu("n1", &request(6), Policy::Spread), Ok(1));
        // Fill GPU 0: the next 4 GiB pod must wait for "a" to start.
        cluster
            .reserve("b".into(), "n1", &request(12), Policy::Binpack)
            .unwrap();
        let err = cluster.fit("n1", &request(4)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "a 4 GiB container is still waiting for device allocation on GPU 0, which has no room (pod needs 4 GiB, 0 GiB free); retry once it starts"
        );
        assert!(!err.is_unresolvable());
        assert!(err.awaits_admission());
        assert!(
            !cluster
                .fit("n1", &request(17))
                .unwrap_err()
                .awaits_admission()
        );
        // Once "a" is allocated the pin goes away.
        cluster.upsert_pod("a".into(), "n1", running(0, 4));
        assert_eq!(
            cluster.choose_gpu("n1", &request(4), Policy::Binpack),
            Ok(1)
        );
    }

    #[test]
    fn twin_pins_on_two_gpus_conflict() {
        let mut cluster = Cluster::new();
        cluster.set_node("n1", vec![gpu(0, 16), gpu(1, 16)], true);
        let pending = |gpu, gib| PodPlacement {
            assigned: false,
            ..running(gpu, gib)
        };
        cluster.upsert_pod("a".into(), "n1", pending(0, 2));
        cluster.upsert_pod("c".into(), "n1", pending(1, 3));
        let both = Request {
            models: Default::default(),
            gpus: 1,
            exclusive: false,
            pod_gib: 5,
            containers: vec![2, 3],
            host: Host::default(),
        };
        assert!(matches!(
            cluster.fit("n1", &both),
            Err(Unfit::TwinConflict { .. })
        ));
    }

    #[test]
    fn collisions_from_the_watch_saturate() {
        let mut cluster = Cluster::new();
        cluster.set_node("n1", vec![gpu(0, 16)], true);
        cluster.upsert_pod("a".into(), "n1", running(0, 12));
        cluster.upsert_pod("b".into(), "n1", running(0, 12));
        let gpu0 = &cluster.node("n1").unwrap().gpus()[0];
        assert_eq!((gpu0.used_gib, gpu0.free_gib()), (24, 0));
        assert!(
            cluster
                .reserve("c".into(), "n1", &request(1), Policy::Binpack)
                .is_err()
        );
        cluster.remove_pod(&"a".into());
        assert_eq!(cluster.node("n1").unwrap().gpus()[0].free_gib(), 4);
    }

    #[test]
    fn reserve_release_and_idempotent_upsert() {
        let mut cluster = Cluster::new();
        cluster.set_node("n1", vec![gpu(0, 16)], true);
        cluster
            .reserve("a".into(), "n1", &request(4), Policy::Binpack)
            .unwrap();
        assert!(matches!(
            cluster.reserve("a".into(), "n1", &request(4), Policy::Binpack),
            Err(Refusal::AlreadyPlaced { gpu: 0, .. })
        ));
        cluster.release(&"a".into());
        assert_eq!(cluster.pod_count(), 0);
        assert_eq!(cluster.node("n1").unwrap().gpus()[0].used_gib, 0);
        assert_eq!(cluster.node("n1").unwrap().pending().count(), 0);
        cluster.upsert_pod("a".into(), "n1", running(0, 4));
        cluster.upsert_pod("a".into(), "n1", running(0, 4));
        assert_eq!(cluster.node("n1").unwrap().gpus()[0].used_gib, 4);
    }

    #[test]
    fn pods_before_nodes_and_removed_nodes_keep_their_bookings() {
        let mut cluster = Cluster::new();
        cluster.upsert_pod("a".into(), "n1", running(1, 4));
        assert_eq!(cluster.fit("n1", &request(1)), Err(Unfit::UnknownNode));
        cluster.set_node("n1", vec![gpu(0, 8), gpu(1, 8)], true);
        assert_eq!(cluster.node("n1").unwrap().gpus()[1].used_gib, 4);
        cluster.remove_node("n1");
        assert_eq!(cluster.fit("n1", &request(1)), Err(Unfit::UnknownNode));
        cluster.remove_pod(&"a".into());
        assert!(cluster.node("n1").is_none());
    }

    #[test]
    fn scores_prefer_fuller_nodes_under_binpack() {
        let mut cluster = Cluster::new();
        cluster.set_node("empty", vec![gpu(0, 16)], true);
        cluster.set_node("half", vec![gpu(0, 16)], true);
        cluster.upsert_pod("a".into(), "half", running(0, 8));
        let req = request(4);
        let (empty, half) = (
            cluster.score("empty", &req, Policy::Binpack),
            cluster.score("half", &req, Policy::Binpack),
        );
        assert!(half > empty, "{half} > {empty}");
        let (empty, half) = (
            cluster.score("empty", &req, Policy::Spread),
            cluster.score("half", &req, Policy::Spread),
        );
        assert!(empty > half, "{empty} > {half}");
        cluster.upsert_pod("b".into(), "half", running(0, 4));
        assert_eq!(cluster.score("half", &req, Policy::Binpack), 10);
    }

    #[test]
    fn relative_scores_keep_packing_decisive_on_nearly_empty_nodes() {
        let mut cluster = Cluster::new();
        for name in ["a", "b", "c", "full"] {
            cluster.set_node(
                name,
                vec![gpu(0, 16), gpu(1, 16), gpu(2, 16), gpu(3, 16)],
                true,
            );
        }
        cluster.upsert_pod("p1".into(), "a", running(0, 3));
        cluster.upsert_pod("p2".into(), "b", running(0, 2));
        for index in 0..4 {
            cluster.upsert_pod(format!("f{index}").into(), "full", running(index, 16));
        }
        let req = request(1);
        // Absolute scores cannot tell a (3 GiB used of 64) from b (2 GiB used).
        assert_eq!(
            cluster.score("a", &req, Policy::Binpack),
            cluster.score("b", &req, Policy::Binpack)
        );
        let scores = cluster.scores(&["a", "b", "c", "full"], &req, Policy::Binpack);
        assert_eq!(scores[0], 10, "the fullest node that fits wins: {scores:?}");
        assert!(scores[1] > scores[2] && scores[2] >= 1, "{scores:?}");
        assert_eq!(scores[3], 0, "a node that does not fit scores 0");
        let spread = cluster.scores(&["a", "b", "c"], &req, Policy::Spread);
        assert_eq!(spread[2], 10, "spread prefers the emptiest: {spread:?}");
        assert_eq!(cluster.scores(&["c"], &req, Policy::Binpack), vec![10]);
    }

    fn multi(gpus: u32, per_gpu: u64, exclusive: bool) -> Request {
        Request {
            models: Default::default(),
            gpus,
            exclusive,
            pod_gib: per_gpu * u64::from(gpus),
            containers: vec![per_gpu * u64::from(gpus)],
            host: Host::default(),
        }
    }

    fn two_by_two() -> Cluster {
        let mut cluster = Cluster::new();
        for name in ["a", "b"] {
            cluster.set_node(name, vec![gpu(0, 16), gpu(1, 16)], true);
        }
        cluster
    }

    #[test]
    fn multi_gpu_pods_take_distinct_gpus_next_to_shared_pods() {
        let mut cluster = two_by_two();
        // A 2 × 8 GiB pod, a whole-2-GPU pod, and shared 4 GiB pods on two 2-GPU nodes.
        let two = cluster
            .reserve("two".into(), "a", &multi(2, 8, false), Policy::Binpack)
            .unwrap();
        assert_eq!((two.gpu, two.more_gpus.len(), two.pod_gib), (0, 1, 8));
        assert_eq!(two.more_gpus[0].0, 1);
        let whole = cluster
            .reserve("whole".into(), "b", &multi(2, 16, true), Policy::Binpack)
            .unwrap();
        assert!(whole.exclusive);
        // Node b is taken whole: nothing shares it, however small.
        assert!(matches!(
            cluster.fit("b", &request(1)),
            Err(Unfit::Busy { .. })
        ));
        for (i, expected) in [(0, 0), (1, 0), (2, 1), (3, 1)] {
            let uid = PodId::from(format!("s{i}"));
            let placed = cluster
                .reserve(uid.clone(), "a", &request(4), Policy::Binpack)
                .unwrap();
            assert_eq!(placed.gpu, expected, "shared pod {i}");
            // kubelet admits it before the next one comes (else the twin rule pins them).
            let (_, placement) = cluster.pod(&uid).unwrap();
            let placement = PodPlacement {
                assigned: true,
                ..placement.clone()
            };
            cluster.upsert_pod(uid, "a", placement);
        }
        let used: Vec<u64> = cluster
            .node("a")
            .unwrap()
            .gpus()
            .iter()
            .map(|g| g.used_gib)
            .collect();
        assert_eq!(used, vec![16, 16]);
        let used: Vec<u64> = cluster
            .node("b")
            .unwrap()
            .gpus()
            .iter()
            .map(|g| g.used_gib)
            .collect();
        assert_eq!(used, vec![16, 16]);
        // Releasing the whole-GPU pod frees both GPUs in full.
        cluster.release(&"whole".into());
        assert!(
            cluster
                .node("b")
                .unwrap()
                .gpus()
                .iter()
                .all(|g| g.used_gib == 0)
        );
    }

    #[test]
    fn a_whole_gpu_is_only_taken_empty() {
        let mut cluster = two_by_two();
        cluster
            .reserve("small".into(), "a", &request(1), Policy::Binpack)
            .unwrap();
        let err = cluster.fit("a", &multi(2, 8, true)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "needs 2 whole free GPUs of at least 8 GiB; node has 1"
        );
        assert!(!err.is_unresolvable());
        let one = cluster
            .reserve("one".into(), "a", &multi(1, 8, true), Policy::Binpack)
            .unwrap();
        assert_eq!(one.gpu, 1, "the empty GPU, not the one holding 1 GiB");
    }

    #[test]
    fn filter_reasons_name_the_shortfall() {
        let mut cluster = two_by_two();
        cluster
            .reserve("big".into(), "a", &request(12), Policy::Binpack)
            .unwrap();
        let err = cluster.fit("a", &multi(2, 8, false)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "needs 2 GPUs with 8 GiB free each; node has 1"
        );
        assert!(
            !err.is_unresolvable(),
            "it may fit once the 12 GiB pod leaves"
        );
        let err = cluster.fit("a", &multi(3, 4, false)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "needs 3 GPUs with 4 GiB free each; node has 2 healthy GPUs that large"
        );
        assert!(err.is_unresolvable());
        let err = cluster.fit("a", &multi(2, 20, false)).unwrap_err();
        assert!(err.is_unresolvable(), "{err}");
    }

    #[test]
    fn slices_follow_the_policy_and_prefer_one_numa_node() {
        let mut cluster = Cluster::new();
        let on = |index, numa| Gpu {
            numa: Some(numa),
            ..gpu(index, 16)
        };
        cluster.set_node("n", vec![on(0, 0), on(1, 1), on(2, 1), on(3, 0)], true);
        cluster.upsert_pod("x".into(), "n", running(0, 10));
        cluster.upsert_pod("y".into(), "n", running(1, 6));
        // Binpack alone would take GPUs 0 and 1 (least free); both of NUMA node 1 (1, 2) hold
        // less in all than both of node 0 (0, 3) ... the snuggest NUMA group wins: 0 and 3
        // have 6 + 16 free, 1 and 2 have 10 + 16.
        let binpack = cluster
            .choose_gpus("n", &multi(2, 4, false), Policy::Binpack)
            .unwrap();
        assert_eq!(binpack, vec![0, 3]);
        let spread = cluster
            .choose_gpus("n", &multi(2, 4, false), Policy::Spread)
            .unwrap();
        assert_eq!(spread, vec![2, 1]);
        // No NUMA node can hold three: taken across, by the policy.
        let three = cluster
            .choose_gpus("n", &multi(3, 4, false), Policy::Binpack)
            .unwrap();
        assert_eq!(three, vec![0, 1, 2]);
    }

    #[test]
    fn the_twin_rule_keys_on_the_gpu_set() {
        let mut cluster = two_by_two();
        // A pending 2 × 4 GiB pod: its container asks kubelet for 8 devices.
        cluster
            .reserve("two".into(), "a", &multi(2, 4, false), Policy::Binpack)
            .unwrap();
        // A one-GPU 8 GiB container would look the same to the device plugin.
        let err = cluster.fit("a", &request(8)).unwrap_err();
        assert!(
            matches!(
                err,
                Unfit::TwinShape {
                    size: 8,
                    wanted: 1,
                    ..
                }
            ),
            "{err}"
        );
        // Another 2 × 4 GiB pod is pinned to the same two GPUs.
        let twin = cluster
            .reserve("twin".into(), "a", &multi(2, 4, false), Policy::Spread)
            .unwrap();
        assert_eq!((twin.gpu, twin.more_gpus[0].0), (0, 1));
        // Once allocated, the one-GPU pod fits again.
        for uid in ["two", "twin"] {
            let (_, placement) = cluster.pod(&uid.into()).unwrap();
            let placement = PodPlacement {
                assigned: true,
                ..placement.clone()
            };
            cluster.upsert_pod(uid.into(), "a", placement);
        }
        assert!(cluster.fit("a", &request(8)).is_ok());
    }

    #[test]
    fn model_filters_pick_gpus_on_mixed_model_nodes() {
        let mut cluster = Cluster::new();
        let of = |index, model: &str, gib| Gpu {
            model: model.into(),
            ..gpu(index, gib)
        };
        cluster.set_node(
            "mixed",
            vec![
                of(0, "Tesla T4", 16),
                of(1, "NVIDIA A10G", 24),
                of(2, "NVIDIA A10G", 24),
            ],
            true,
        );
        let wants = |names: &[&str], gib| Request {
            models: crate::ModelFilter::parse(names.iter().copied()),
            ..request(gib)
        };
        // Binpack alone would take the T4 (least free that fits); the label form of the name
        // selects the A10Gs.
        assert_eq!(
            cluster.choose_gpu("mixed", &request(4), Policy::Binpack),
            Ok(0)
        );
        assert_eq!(
            cluster.choose_gpu("mixed", &wants(&["nvidia-a10g"], 4), Policy::Binpack),
            Ok(1)
        );
        assert_eq!(
            cluster.choose_gpu("mixed", &wants(&["!Tesla T4"], 4), Policy::Spread),
            Ok(1)
        );
        let two = Request {
            models: crate::ModelFilter::parse(["NVIDIA A10G"]),
            ..multi(2, 8, false)
        };
        assert_eq!(
            cluster.choose_gpus("mixed", &two, Policy::Binpack),
            Ok(vec![1, 2])
        );
        let t4_pair = Request {
            models: crate::ModelFilter::parse(["Tesla-T4"]),
            ..multi(2, 8, false)
        };
        let err = cluster.fit("mixed", &t4_pair).unwrap_err();
        assert!(err.is_unresolvable(), "one T4 only: {err}");
        // A waiting twin on an A10G does not hide that the node has no H100 at all.
        cluster
            .reserve(
                "twin".into(),
                "mixed",
                &wants(&["NVIDIA A10G"], 4),
                Policy::Binpack,
            )
            .unwrap();
        let err = cluster.fit("mixed", &wants(&["H100"], 4)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "needs a GPU of model h100; node has NVIDIA A10G, Tesla T4"
        );
        assert!(err.is_unresolvable());
        // Room on the T4 does not help a pod that wants an A10G.
        cluster.remove_pod(&"twin".into());
        cluster.upsert_pod("big1".into(), "mixed", running(1, 24));
        cluster.upsert_pod("big2".into(), "mixed", running(2, 24));
        let err = cluster
            .fit("mixed", &wants(&["NVIDIA A10G"], 4))
            .unwrap_err();
        assert!(matches!(err, Unfit::Busy { .. }), "{err}");
        assert!(cluster.fit("mixed", &request(4)).is_ok());
    }
}
