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
            compute: request.compute,
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
            compute: request.compute,
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
mod tests;
