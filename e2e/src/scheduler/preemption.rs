//! kube-scheduler's DefaultPreemption (its PostFilter), as it runs when no node fits a pod and
//! an extender has a preempt verb (upstream's `pkg/scheduler/framework/preemption`, with
//! `plugins/defaultpreemption` and `extender.go`'s `ProcessPreemption`).
//!
//! What the driver reproduces, because each changes what our extender sees or what happens to
//! the cluster:
//! - **The dry run reads the scheduler's own filters only.** On every node whose failure is
//!   not unresolvable, the pods of lower priority are removed, the pod must then pass the
//!   built-in filters, and the removed pods are given back most important first while it still
//!   does (`SelectVictimsOnNode`). A node where it fits with no victim is dropped: so a node
//!   that only the extender rejected (room on the node's total, none on one GPU) never reaches
//!   the extender's preempt verb (kubernetes/kubernetes#139270).
//! - **The extender's answer replaces the candidates**, by UID among all the node's pods (an
//!   unknown node or UID is an error), and its victims are the ones evicted. A node it answers
//!   with no victim fails the call unless the extender is ignorable (then the node is dropped).
//! - **The pick** among candidates: fewest PDB violations, then the lowest priority of the
//!   first victim, the lowest sum of priorities, the fewest victims, then the first.
//! - **Eviction** deletes the victims (not those already terminating) and sets the pod's
//!   `status.nominatedNodeName`; the pod is retried when the deletions reach the watch.
//! - **No second preemption** while the node a pod is nominated for still has a lower-priority
//!   pod terminating (`PodEligibleToPreemptOthers`), and none for `preemptionPolicy: Never`.
//!
//! Not reproduced: PodDisruptionBudgets (no victim violates one), the candidate sample
//! (`minCandidateNodesPercentage`: every node is tried), start times in the pick.

use std::collections::{BTreeMap, HashSet};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams};
use tracing::{info, warn};

use super::framework::{self, reasons};
use super::requests::NodeUsage;
use super::shared::Shared;
use super::state::{NodeEntry, NodePod};

/// upstream's `MaxInt32 + 1`, added to each victim's priority before summing.
const PRIORITY_OFFSET: i64 = i32::MAX as i64 + 1;

/// Whether a filter reason is one preemption cannot fix (`UnschedulableAndUnresolvable`):
/// every built-in rejection but NodeResourcesFit's.
pub fn is_unresolvable(reason: &str) -> bool {
    !(reason.starts_with("Insufficient ") || reason == reasons::TOO_MANY_PODS)
}

/// `SelectVictimsOnNode`: the pods of `on_node` below `priority` whose removal lets `pod`
/// pass the built-in filters, after giving back as many as it still passes beside (most
/// important first); `None` when removing them all does not help, or none need go.
pub fn select_victims(
    pod: &Pod,
    priority: i32,
    entry: &NodeEntry,
    mut usage: NodeUsage,
    on_node: Vec<NodePod>,
) -> Option<Vec<NodePod>> {
    let requests = framework::pod_requests(pod, false);
    let mut lower: Vec<NodePod> = on_node
        .into_iter()
        .filter(|p| p.priority < priority)
        .collect();
    if lower.is_empty() {
        return None;
    }
    for victim in &lower {
        usage.remove(&victim.usage);
    }
    let fits = |usage: &NodeUsage| {
        framework::filter_node(pod, &requests, &entry.node, &entry.allocatable, usage).is_empty()
    };
    if !fits(&usage) {
        return None;
    }
    lower.sort_by(|a, b| b.priority.cmp(&a.priority).then_with(|| a.key.cmp(&b.key)));
    let mut victims = Vec::new();
    for candidate in lower {
        usage.add(&candidate.usage);
        if !fits(&usage) {
            usage.remove(&candidate.usage);
            victims.push(candidate);
        }
    }
    (!victims.is_empty()).then_some(victims)
}

/// The rank `pickOneNodeForPreemption` compares, lowest best (PDBs are not modelled).
fn rank(victims: &[NodePod]) -> (i32, i64, usize) {
    let first = victims.iter().map(|v| v.priority).max().unwrap_or(i32::MIN);
    let sum = victims
        .iter()
        .map(|v| i64::from(v.priority) + PRIORITY_OFFSET)
        .sum();
    (first, sum, victims.len())
}

/// Runs preemption for `pod`, which no node fits; `unresolvable` holds the nodes whose
/// failure preemption cannot fix. `Ok(Some(node))` when victims were evicted and the pod
/// nominated there; `Err` when an extender's preempt call failed (the cycle fails with it).
pub(super) async fn post_filter(
    shared: &Shared,
    pod: &Pod,
    unresolvable: &HashSet<String>,
) -> Result<Option<String>, String> {
    let spec = pod.spec.as_ref();
    if spec.and_then(|s| s.preemption_policy.as_deref()) == Some("Never") {
        return Ok(None);
    }
    let priority = spec.and_then(|s| s.priority).unwrap_or(0);
    let mut candidates: BTreeMap<String, Vec<NodePod>> = BTreeMap::new();
    {
        let state = shared.state();
        let nominated = pod
            .status
            .as_ref()
            .and_then(|s| s.nominated_node_name.as_deref())
            .filter(|n| !n.is_empty());
        if let Some(node) = nominated
            && state
                .pods_on(node)
                .iter()
                .any(|p| p.terminating && p.priority < priority)
        {
            return Ok(None);
        }
        for (name, lower) in state.lower_pods_by_node(priority) {
            if unresolvable.contains(&name) {
                continue;
            }
            let Some((entry, usage)) = state.node_and_usage(&name) else {
                continue;
            };
            if let Some(victims) = select_victims(pod, priority, entry, usage, lower) {
                candidates.insert(name, victims);
            }
        }
    }
    if candidates.is_empty() {
        return Ok(None);
    }
    for extender in shared.extenders() {
        let Some(verb) = extender.preempt_verb() else {
            continue;
        };
        if !extender.is_interested(pod) {
            continue;
        }
        let proposal: BTreeMap<String, Vec<(String, Pod)>> = candidates
            .iter()
            .map(|(node, victims)| (node.clone(), victims.iter().map(victim_object).collect()))
            .collect();
        let lookup = |node: &str| {
            let state = shared.state();
            state
                .nodes
                .contains_key(node)
                .then(|| state.pods_on(node).into_iter().map(|p| p.uid).collect())
        };
        let answer = match extender.preempt(verb, pod, &proposal, lookup).await {
            Ok(answer) => answer,
            Err(error) if extender.config.ignorable => {
                info!(extender = %extender.config.url_prefix, %error, "skipping extender as it returned error and has ignorable flag set");
                continue;
            }
            Err(error) => return Err(error.to_string()),
        };
        let mut next = BTreeMap::new();
        let state = shared.state();
        for (node, victims) in answer {
            if victims.uids.is_empty() {
                if extender.config.ignorable {
                    continue;
                }
                return Err(format!("expected at least one victim pod on node {node:?}"));
            }
            let on_node = state.pods_on(&node);
            let resolved: Vec<NodePod> = victims
                .uids
                .iter()
                .filter_map(|uid| on_node.iter().find(|p| p.uid == *uid).cloned())
                .collect();
            next.insert(node, resolved);
        }
        drop(state);
        candidates = next;
        if candidates.is_empty() {
            break;
        }
    }
    let Some((node, victims)) = candidates
        .into_iter()
        .min_by(|(_, a), (_, b)| rank(a).cmp(&rank(b)))
    else {
        return Ok(None);
    };
    evict(shared, pod, &node, &victims).await;
    Ok(Some(node))
}

/// What a victim is sent as when the extender is not `nodeCacheCapable`: its identity.
fn victim_object(victim: &NodePod) -> (String, Pod) {
    let (namespace, name) = victim
        .key
        .split_once('/')
        .unwrap_or(("default", &victim.key));
    let mut pod = Pod::default();
    pod.metadata.namespace = Some(namespace.to_owned());
    pod.metadata.name = Some(name.to_owned());
    pod.metadata.uid = Some(victim.uid.clone());
    (victim.uid.clone(), pod)
}

/// `prepareCandidate`: deletes the victims not already going, then nominates the pod.
async fn evict(shared: &Shared, pod: &Pod, node: &str, victims: &[NodePod]) {
    let preemptor = format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or_default()
    );
    for victim in victims.iter().filter(|v| !v.terminating) {
        let (namespace, name) = victim
            .key
            .split_once('/')
            .unwrap_or(("default", &victim.key));
        let api: Api<Pod> = Api::namespaced(shared.client().clone(), namespace);
        let params = DeleteParams {
            preconditions: Some(kube::api::Preconditions {
                uid: Some(victim.uid.clone()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match api.delete(name, &params).await {
            Ok(_) => info!(pod = %victim.key, %preemptor, %node, "preempted"),
            Err(error) => warn!(pod = %victim.key, %error, "could not delete a preemption victim"),
        }
    }
    shared.stats.lock().preemptions += 1;
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let api: Api<Pod> = Api::namespaced(shared.client().clone(), namespace);
    let patch = serde_json::json!({ "status": { "nominatedNodeName": node } });
    if let Err(error) = api
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        warn!(pod = %preemptor, %error, "could not set the nominated node");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::requests::{PodUsage, allocatable};
    use super::*;
    use crate::fixtures::{node, pod};

    /// The node by kube-scheduler's eyes: 31 GiB of `example.com/gpu-mem` in all,
    /// seven 4 GiB pods, `low-0` and `low-1` at 10, the others at 100.
    fn seven() -> (NodeEntry, NodeUsage, Vec<NodePod>) {
        let node = node("node-k").gpushare().gpus(&[15, 16]).build();
        let entry = NodeEntry {
            allocatable: allocatable(&node),
            node: Arc::new(node),
        };
        let mut usage = NodeUsage::default();
        let mut pods = Vec::new();
        for (name, priority) in [
            ("low-0", 10),
            ("mid-0", 100),
            ("mid-1", 100),
            ("low-1", 10),
            ("mid-2", 100),
            ("mid-3", 100),
            ("mid-4", 100),
        ] {
            let pod_usage = PodUsage::of(&pod(name).gpu_mem(4).build());
            usage.add(&pod_usage);
            pods.push(NodePod {
                key: format!("default/{name}"),
                uid: format!("uid-{name}"),
                priority,
                usage: pod_usage,
                terminating: false,
            });
        }
        (entry, usage, pods)
    }

    fn keys(victims: &[NodePod]) -> Vec<&str> {
        victims.iter().map(|v| v.key.as_str()).collect()
    }

    #[test]
    fn the_dry_run_picks_victims_by_the_nodes_total() {
        let (entry, usage, pods) = seven();
        let preemptor = pod("important").gpu_mem(8).build();
        // 3 GiB free in all: the two least important pods free 8 more, whatever their GPUs.
        let victims = select_victims(&preemptor, 100_000, &entry, usage.clone(), pods.clone());
        assert_eq!(keys(&victims.unwrap()), ["default/low-0", "default/low-1"]);
        // Below priority 100 only the two low pods may go: still enough by the total.
        let victims = select_victims(&preemptor, 100, &entry, usage.clone(), pods.clone());
        assert_eq!(victims.map(|v| v.len()), Some(2));
        // Nobody below priority 10; and 40 GiB fits the node's total whoever goes.
        assert!(select_victims(&preemptor, 10, &entry, usage.clone(), pods.clone()).is_none());
        let huge = pod("huge").gpu_mem(40).build();
        assert!(select_victims(&huge, 100_000, &entry, usage.clone(), pods.clone()).is_none());
        // A pod that fits the total already has no victim: the node is dropped.
        let small = pod("small").gpu_mem(3).build();
        assert!(select_victims(&small, 100_000, &entry, usage, pods).is_none());
    }

    #[test]
    fn only_resource_fit_failures_are_resolvable() {
        assert!(!is_unresolvable("Insufficient example.com/gpu-mem"));
        assert!(!is_unresolvable(reasons::TOO_MANY_PODS));
        assert!(is_unresolvable(reasons::NODE_AFFINITY));
        assert!(is_unresolvable("node(s) had untolerated taint {a: b}"));
    }
}
