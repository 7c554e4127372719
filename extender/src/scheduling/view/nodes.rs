//! Applying what the node watch delivers: each node's GPUs (its inventory annotation, or else
//! its capacity split over its GPU count), whether it takes part, its allocatable CPU and
//! memory, and its `PreferNoSchedule` taints (the idle-GPU taint among them).
//!
//! Why a node that leaves the list may stay: its pods' memory is booked on it until those
//! pods go, so the allocator keeps it, not present, and drops it with its last pod (see
//! `gpushare_allocator::Cluster::remove_node`).

use std::collections::HashSet;
use std::sync::Arc;

use gpushare_allocator::Gpu;
use gpushare_contract::{GpuInfo, inventory};
use k8s_openapi::api::core::v1::{Node, Taint};

use super::facts::node_host;
use super::{NodeTaints, View};

/// The node's `PreferNoSchedule` taints (kube-scheduler's TaintToleration score reads them).
fn soft_taints(node: &Node) -> Vec<Taint> {
    node.spec
        .as_ref()
        .and_then(|spec| spec.taints.as_ref())
        .into_iter()
        .flatten()
        .filter(|taint| taint.effect == "PreferNoSchedule")
        .cloned()
        .collect()
}

impl View {
    /// Applies a node from the node watch.
    pub fn apply_node(&mut self, node: &Node) {
        let Some(name) = node.metadata.name.as_deref() else {
            return;
        };
        let (gpus, eligible) = self.read_node(node);
        self.cluster.set_node(name, gpus, eligible);
        self.cluster.set_node_host(name, node_host(node));
        let all_taints = node
            .spec
            .as_ref()
            .and_then(|spec| spec.taints.clone())
            .unwrap_or_default();
        self.node_taints.insert(
            self.cluster.node_name(name),
            NodeTaints {
                resource_version: node.metadata.resource_version.clone().unwrap_or_default(),
                taints: all_taints,
            },
        );
        let soft_taints = soft_taints(node);
        if soft_taints.is_empty() {
            self.prefer_no_schedule.remove(name);
        } else {
            self.prefer_no_schedule
                .insert(self.cluster.node_name(name), soft_taints);
        }
    }

    /// Applies a node deletion.
    pub fn delete_node(&mut self, node: &Node) {
        if let Some(name) = node.metadata.name.as_deref() {
            self.cluster.remove_node(name);
            self.prefer_no_schedule.remove(name);
            self.node_taints.remove(name);
        }
    }

    /// Replaces every node with a fresh list (after the watch relisted).
    pub fn replace_nodes(&mut self, nodes: &[Node]) {
        let listed: HashSet<&str> = nodes
            .iter()
            .filter_map(|n| n.metadata.name.as_deref())
            .collect();
        let gone: Vec<Arc<str>> = self
            .cluster
            .nodes()
            .filter(|(name, node)| node.is_present() && !listed.contains(name))
            .map(|(name, _)| self.cluster.node_name(name))
            .collect();
        for name in gone {
            self.cluster.remove_node(&name);
            self.prefer_no_schedule.remove(&name);
            self.node_taints.remove(&name);
        }
        for node in nodes {
            self.apply_node(node);
        }
        self.set_nodes_synced();
    }

    /// GPUs and eligibility of a node: the inventory annotation, or else capacity split
    /// evenly over the `gpu-count` label (1 when absent).
    fn read_node(&self, node: &Node) -> (Vec<Gpu>, bool) {
        let name = node.metadata.name.as_deref().unwrap_or_default();
        if self.settings.dra.is_some() {
            // DRA mode: the GPUs are our slices' devices; a node with one takes part.
            let gpus = self.dra_gpus(name);
            let eligible = !gpus.is_empty();
            return (gpus, eligible);
        }
        let eligible = node
            .metadata
            .labels
            .as_ref()
            .and_then(|labels| labels.get(&self.settings.label_key))
            .is_some_and(|value| *value == self.settings.label_value);
        let to_gpu = |g: GpuInfo| Gpu {
            index: g.index,
            uuid: g.uuid,
            model: g.model,
            numa: g.numa_node,
            total_gib: g.mem_gib,
            healthy: g.healthy,
        };
        let (gpus, source) = inventory::read(node, &self.settings.keys, &self.settings.resource);
        if let inventory::Source::Unreadable(error) = source {
            tracing::warn!(
                node = %name,
                %error,
                "cannot read the GPU inventory annotation; falling back to capacity"
            );
        }
        (gpus.into_iter().map(to_gpu).collect(), eligible)
    }
}

#[cfg(test)]
mod tests {
    use gpushare_testkit::fixtures::node;
    use k8s_openapi::api::core::v1::{Node, Taint};

    use super::super::testing::{allocated, view};

    /// `node` with `PreferNoSchedule` taints `keys`.
    fn tainted(mut node: Node, keys: &[&str]) -> Node {
        let taints = keys.iter().map(|key| Taint {
            key: (*key).to_owned(),
            effect: "PreferNoSchedule".to_owned(),
            ..Taint::default()
        });
        node.spec.get_or_insert_with(Default::default).taints = Some(taints.collect());
        node
    }

    #[test]
    fn the_idle_gpu_taint_should_be_on_the_nodes_with_a_gpu_nothing_is_booked_on() {
        let ours = "gpushare.example.com/idle-gpu";
        let mut view = view();
        // n1: two GPUs, one busy then both; n2: idle; n3: idle but not taking part, and
        // carrying the taint from before; n4: its one GPU unhealthy.
        view.apply_node(&node("n1").gpushare().gpus(&[16, 16]).build());
        view.apply_node(&tainted(node("n2").gpushare().gpus(&[16]).build(), &[ours]));
        view.apply_node(&tainted(
            node("n3").gpus(&[16]).build(),
            &[ours, "dedicated"],
        ));
        view.apply_node(&node("n4").gpushare().gpus(&[16]).unhealthy(0).build());
        view.replace_pods(&[allocated("a", "u1", 0, 4)]);
        let drift = |view: &super::View, enabled| {
            view.idle_gpu_taint_drift(enabled)
                .into_iter()
                .map(|drift| (drift.node.to_string(), drift.wanted))
                .collect::<Vec<_>>()
        };
        // n1 still has an idle GPU and lacks the taint; n3 carries it and takes no part.
        assert_eq!(
            drift(&view, true),
            [("n1".to_owned(), true), ("n3".to_owned(), false)]
        );
        // With both GPUs booked, n1 should not carry it.
        view.replace_pods(&[allocated("a", "u1", 0, 4), allocated("b", "u2", 1, 4)]);
        assert_eq!(drift(&view, true), [("n3".to_owned(), false)]);
        // Off: every node that carries it should lose it.
        assert_eq!(
            drift(&view, false),
            [("n2".to_owned(), false), ("n3".to_owned(), false)]
        );
        // So while pods pinned to GPU models bring much of the recent demand, then on again.
        let (off, on) = (drift(&view, false), drift(&view, true));
        for _ in 0..100 {
            view.cluster.observe_demand(4, 1, true);
        }
        assert_eq!(drift(&view, true), off);
        for _ in 0..3_000 {
            view.cluster.observe_demand(4, 1, false);
        }
        assert_eq!(drift(&view, true), on);
        // It is a soft taint like the others: the filter that keeps the best steps aside for
        // a pod that does not tolerate it (routed GPU pods do).
        assert_eq!(view.prefer_no_schedule_taints("n2").len(), 1);
        assert_eq!(view.prefer_no_schedule_taints("n3").len(), 2);
        assert_eq!(view.idle_gpu_tainted_nodes(), 2);
        // Each drift carries the node's taints as the watch showed them, every effect, for a
        // write without a read first.
        let n3 = view
            .idle_gpu_taint_drift(true)
            .into_iter()
            .find(|d| &*d.node == "n3")
            .unwrap();
        let keys: Vec<&str> = n3.seen.taints.iter().map(|t| t.key.as_str()).collect();
        assert_eq!(keys, [ours, "dedicated"]);
        // Once the watch shows it gone, and the node deleted, nothing is left to do.
        view.apply_node(&node("n3").gpus(&[16]).build());
        view.delete_node(&node("n2").build());
        assert!(drift(&view, false).is_empty());
    }

    #[test]
    fn capacity_fallback_splits_over_the_gpu_count() {
        let mut view = view();
        view.apply_node(&node("n1").gpushare().capacity_only(32, 2).build());
        let gpus = view.cluster.node("n1").unwrap().gpus();
        assert_eq!(gpus.len(), 2);
        assert!(
            gpus.iter()
                .all(|g| g.gpu.total_gib == 16 && g.gpu.uuid.is_empty())
        );
        view.apply_node(&node("n2").capacity_only(8, 0).build());
        assert!(!view.cluster.node("n2").unwrap().is_eligible());
    }

    #[test]
    fn node_relists_drop_missing_nodes_and_pod_relists_their_ghosts() {
        let mut view = view();
        view.replace_nodes(&[
            node("n1").gpushare().gpus(&[16]).build(),
            node("n2").gpushare().gpus(&[16]).build(),
        ]);
        let on_n2 = {
            let mut p = allocated("b", "u2", 0, 4);
            p.spec.as_mut().unwrap().node_name = Some("n2".into());
            p
        };
        view.replace_pods(&[allocated("a", "u1", 0, 4), on_n2.clone()]);
        // n2 leaves the node list while its pod is still there: it stays, not present, with
        // the pod's memory booked until the pod goes.
        view.replace_nodes(&[node("n1").gpushare().gpus(&[16]).build()]);
        assert!(view.cluster.node("n2").is_some_and(|n| !n.is_present()));
        view.replace_pods(std::slice::from_ref(&on_n2));
        assert!(view.cluster.node("n2").is_some_and(|n| !n.is_present()));
        assert_eq!(view.cluster.pod_count(), 1);
        assert!(view.pod("default", "a").is_none());
        // Once its pod is gone too, so is the node.
        view.replace_pods(&[]);
        assert!(view.cluster.node("n2").is_none());
        assert!(view.cluster.node("n1").is_some_and(|n| n.is_present()));
    }
}
