//! The scheduler's cache, as kube-scheduler's: nodes, and what every node already carries
//! (pods bound to it and not terminal, plus pods *assumed* there whose bind is still in
//! flight, so the next cycle cannot over-commit a node while a bind is pending); and what is
//! read from it: the built-in filters and default scores.
//!
//! One half of [`State`]; the scheduling queue is the other, in `queue.rs`.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};

use super::{State, pod_uid};
use crate::scheduler::framework::{self, PodUsage, Resources};

#[derive(Debug)]
pub(super) struct Accounted {
    node: String,
    pub(super) uid: String,
    usage: PodUsage,
    assumed: bool,
}

#[derive(Debug)]
pub struct NodeEntry {
    pub node: Arc<Node>,
    pub allocatable: Resources,
}

/// A feasible node with its default-plugin score.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub node: Arc<Node>,
    pub name: String,
    pub score: i64,
}

/// The built-in filter phase's result.
#[derive(Debug, Default)]
pub struct Filtered {
    pub feasible: Vec<Candidate>,
    /// Node → rejection reasons, for nodes that were evaluated and rejected.
    pub statuses: BTreeMap<String, Vec<String>>,
    pub num_all_nodes: usize,
}

impl State {
    /// What a node carries now (bound and assumed pods).
    #[cfg(test)]
    pub fn usage(&self, node: &str) -> framework::NodeUsage {
        self.usage.get(node).cloned().unwrap_or_default()
    }

    /// Counts what `pod` uses on `node` (replacing what it was counted for before), bound
    /// there or only `assumed`.
    pub(super) fn account(&mut self, key: &str, pod: &Pod, node: String, assumed: bool) {
        let (uid, usage) = (pod_uid(pod), PodUsage::of(pod));
        if let Some(old) = self.accounted.get_mut(key)
            && old.node == node
            && old.uid == uid
            && old.usage == usage
        {
            old.assumed = assumed;
            return;
        }
        self.unaccount(key);
        self.usage.entry(node.clone()).or_default().add(&usage);
        self.accounted.insert(
            key.to_owned(),
            Accounted {
                node,
                uid,
                usage,
                assumed,
            },
        );
    }

    /// Removes a pod's resources from its node; true if it held any.
    pub(super) fn unaccount(&mut self, key: &str) -> bool {
        let Some(old) = self.accounted.remove(key) else {
            return false;
        };
        if let Some(usage) = self.usage.get_mut(&old.node) {
            usage.remove(&old.usage);
            if usage.pods == 0 {
                self.usage.remove(&old.node);
            }
        }
        true
    }

    pub fn apply_node(&mut self, node: Node) {
        let name = node.metadata.name.clone().unwrap_or_default();
        let allocatable = framework::allocatable(&node);
        let node = Arc::new(node);
        self.nodes.insert(name, NodeEntry { node, allocatable });
    }

    /// Built-in filters and default scores over the nodes, visiting at most enough nodes to find
    /// `numFeasibleNodesToFind` feasible ones, starting where the previous cycle stopped.
    /// `None` when the cluster has no nodes at all.
    pub fn filter(&mut self, pod: &Pod) -> Option<Filtered> {
        let all = self.nodes.len();
        if all == 0 {
            return None;
        }
        let requests = framework::pod_requests(pod, false);
        let pod_usage = PodUsage::of(pod);
        let want =
            framework::num_feasible_nodes_to_find_at(all, self.config.percentage_of_nodes_to_score);
        let start = self.next_start_node_index % all;
        let entries: Vec<(&String, &NodeEntry)> = self.nodes.iter().collect();
        let mut filtered = Filtered {
            num_all_nodes: all,
            ..Filtered::default()
        };
        let mut processed = 0;
        for offset in 0..all {
            let (name, entry) = entries[(start + offset) % all];
            processed += 1;
            let usage = self.usage.get(name).cloned().unwrap_or_default();
            let reasons =
                framework::filter_node(pod, &requests, &entry.node, &entry.allocatable, &usage);
            if reasons.is_empty() {
                filtered.feasible.push(Candidate {
                    node: entry.node.clone(),
                    name: name.clone(),
                    score: framework::default_score(
                        &self.config.fit_scoring,
                        &entry.allocatable,
                        &usage,
                        &pod_usage,
                    ),
                });
                if filtered.feasible.len() >= want {
                    break;
                }
            } else {
                filtered.statuses.insert(name.clone(), reasons);
            }
        }
        self.next_start_node_index = (start + processed) % all;
        Some(filtered)
    }

    /// The bind failed: drop the assumption (unless the watch already confirmed the pod there).
    pub fn forget(&mut self, key: &str, uid: &str, node: &str) -> bool {
        let assumed = self.accounted.get(key);
        let assumed = assumed.is_some_and(|a| a.assumed && a.uid == uid && a.node == node);
        assumed && self.unaccount(key)
    }
}
