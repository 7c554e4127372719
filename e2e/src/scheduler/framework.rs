//! The parts of kube-scheduler's default profile that decide where a pod may go, as pure functions.
//!
//! A real cluster rejects a node before any extender sees it when the node is unready, does not
//! match the pod's node selector/affinity, or lacks room for the pod's requests (cpu, memory,
//! every extended resource). These filters run in upstream's plugin order, stop at a node's first
//! failing plugin and use upstream's reason strings, so our tests see the extender traffic and
//! `FailedScheduling` messages a real cluster produces. Cordons, taints and tolerations are left
//! to the real tier (no in-process test sets them; gpushare's idle-GPU taint is
//! `PreferNoSchedule`): only the lifecycle controller's not-ready taint is modelled.
//!
//! Scores: `NodeResourcesFit` (the profile's `scoringStrategy`: LeastAllocated on cpu and memory
//! by default, or MostAllocated on named resources, as the chart's profile scores GPU memory) and
//! `NodeResourcesBalancedAllocation`, weight 1, on 0..=100; extender scores added as upstream's
//! `prioritizeNodes` adds them; the host picked as upstream's score heap picks it.
//! `TaintToleration`'s score decides nothing in-process and is checked on the real tier
//! (`cpu_only_pods_prefer_nodes_whose_gpus_are_in_use` in `tests/real.rs`).
//!
//! The filters are here; requests, holdings, scores, the host pick and the walk's length are
//! `gpushare-scheduler-model`'s (shared with the packing simulator), what extender answers add is
//! `scoring.rs`'s; all are re-exported so every path stays `framework::...`.

use std::cmp::Ordering::{Greater, Less};
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, NodeSelectorRequirement, NodeSelectorTerm, Pod};

pub use super::scoring::{ExtenderPriorities, add_extender_priorities};
pub use gpushare_scheduler_model::requests::{
    CPU, DEFAULT_MEMORY_REQUEST, DEFAULT_MILLI_CPU_REQUEST, EPHEMERAL_STORAGE, MEMORY, Milli,
    NodeUsage, PODS, PodUsage, Resources, allocatable, parse_quantity, pod_requests, pod_uses_any,
};
pub use gpushare_scheduler_model::scoring::{
    FitScoring, FitStrategy, MAX_NODE_SCORE, NodeScore, default_score, select_scored_host,
};
pub use gpushare_scheduler_model::{num_feasible_nodes_to_find, num_feasible_nodes_to_find_at};

/// Upstream's reason strings (what users read in `FailedScheduling`).
pub mod reasons {
    pub const NODE_AFFINITY: &str = "node(s) didn't match Pod's node affinity/selector";
    pub const TOO_MANY_PODS: &str = "Too many pods";
    pub const NO_NODES: &str = "no nodes available to schedule pods";
}

/// What `TaintToleration` says of a node whose Ready condition is not True: the node
/// lifecycle controller (which the in-process cluster lacks) taints it so.
const NOT_READY: &str = "node(s) had untolerated taint {node.kubernetes.io/not-ready: }";

fn is_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

fn label<'a>(node: &'a Node, key: &str) -> Option<&'a str> {
    node.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(key))
        .map(String::as_str)
}

fn requirement_matches(req: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = req.values.as_deref().unwrap_or_default();
    let number = |v: &str| v.parse::<i64>().ok();
    match req.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| !values.iter().any(|x| x == v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(actual), [bound]) = (value.and_then(number), values) else {
                return false;
            };
            let want = if req.operator == "Gt" { Greater } else { Less };
            number(bound).is_some_and(|bound| actual.cmp(&bound) == want)
        }
        _ => false,
    }
}

fn term_matches(term: &NodeSelectorTerm, node: &Node) -> bool {
    let expressions = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if expressions.is_empty() && fields.is_empty() {
        return false;
    }
    expressions
        .iter()
        .all(|r| requirement_matches(r, label(node, &r.key)))
        && fields.iter().all(|r| {
            r.key == "metadata.name" && requirement_matches(r, node.metadata.name.as_deref())
        })
}

/// `NodeAffinity` filter: `spec.nodeSelector` and required node affinity.
fn matches_node_affinity(pod: &Pod, node: &Node) -> bool {
    let Some(spec) = pod.spec.as_ref() else {
        return true;
    };
    let selector_ok = spec
        .node_selector
        .iter()
        .flatten()
        .all(|(k, v)| label(node, k) == Some(v.as_str()));
    let required = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    let affinity_ok = required.is_none_or(|sel| {
        sel.node_selector_terms
            .iter()
            .any(|term| term_matches(term, node))
    });
    selector_ok && affinity_ok
}

/// `NodeResourcesFit` filter: every reason the pod does not fit (empty = fits).
pub fn insufficient(
    requests: &Resources,
    allocatable: &Resources,
    usage: &NodeUsage,
) -> Vec<String> {
    let mut reasons = Vec::new();
    // A node that does not publish `pods` (only hand-written fixtures do that) is not limited.
    if let Some(allowed) = allocatable.get(PODS)
        && i128::try_from(usage.pods + 1).unwrap_or(i128::MAX) * 1000 > *allowed
    {
        reasons.push(reasons::TOO_MANY_PODS.to_owned());
    }
    if requests.values().all(|v| *v == 0) {
        return reasons;
    }
    let free = |name: &str| {
        allocatable.get(name).copied().unwrap_or_default()
            - usage.requested.get(name).copied().unwrap_or_default()
    };
    // cpu, memory and ephemeral storage first, as upstream reports them, then the others.
    let standard = [CPU, MEMORY, EPHEMERAL_STORAGE];
    let others = requests.keys().map(String::as_str);
    let others = others.filter(|name| !standard.contains(name) && *name != PODS);
    for name in standard.into_iter().chain(others) {
        let want = requests.get(name).copied().unwrap_or_default();
        if want > 0 && want > free(name) {
            reasons.push(format!("Insufficient {name}"));
        }
    }
    reasons
}

/// Runs the default profile's filters for one node, in upstream's order, stopping at the first
/// plugin that rejects. Returns the rejection reasons (empty = the node is feasible).
pub fn filter_node(
    pod: &Pod,
    requests: &Resources,
    node: &Node,
    allocatable: &Resources,
    usage: &NodeUsage,
) -> Vec<String> {
    // TaintToleration, for the one taint in-process nodes get
    if !is_ready(node) {
        return vec![NOT_READY.to_owned()];
    }
    // NodeAffinity
    if !matches_node_affinity(pod, node) {
        return vec![reasons::NODE_AFFINITY.to_owned()];
    }
    // NodeResourcesFit
    insufficient(requests, allocatable, usage)
}

/// The message of kube-scheduler's `FitError`: "0/3 nodes are available: 1 Insufficient cpu,
/// 2 node(s) didn't match Pod's node affinity/selector." Each reason of each node is counted; the
/// "count reason" strings are sorted as strings, as upstream's `sort.Strings` does.
pub fn fit_error_message<'a>(
    num_all_nodes: usize,
    node_reasons: impl IntoIterator<Item = &'a Vec<String>>,
) -> String {
    let mut histogram: BTreeMap<&str, usize> = BTreeMap::new();
    for reasons in node_reasons {
        for reason in reasons {
            *histogram.entry(reason.as_str()).or_default() += 1;
        }
    }
    let mut parts: Vec<String> = histogram
        .into_iter()
        .map(|(reason, count)| format!("{count} {reason}"))
        .collect();
    parts.sort();
    let mut message = format!("0/{num_all_nodes} nodes are available:");
    if !parts.is_empty() {
        message.push_str(&format!(" {}.", parts.join(", ")));
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{node, pod};
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    fn check(p: &Pod, n: &Node, usage: &NodeUsage) -> Vec<String> {
        filter_node(p, &pod_requests(p, false), n, &allocatable(n), usage)
    }

    /// [`check`] on a node that carries nothing.
    fn check_idle(p: &Pod, n: &Node) -> Vec<String> {
        check(p, n, &NodeUsage::default())
    }

    #[test]
    fn resource_fit_counts_what_the_node_already_carries() {
        let n = node("n1").gpus(&[8, 8]).build();
        let p = pod("a").gpu_mem(4).cpu("2").build();
        assert!(check_idle(&p, &n).is_empty());

        let mut usage = NodeUsage::default();
        usage.add(&PodUsage::of(&pod("b").gpu_mem(14).cpu("7").build()));
        assert_eq!(
            check(&p, &n, &usage),
            ["Insufficient cpu", "Insufficient example.com/gpu-mem"]
        );
        let (big, n2) = (
            pod("big").gpu_mem(17).build(),
            node("n2").gpus(&[16]).build(),
        );
        assert_eq!(check_idle(&big, &n2), ["Insufficient example.com/gpu-mem"]);
        let (c, plain) = (pod("c").gpu_mem(1).build(), node("plain").build());
        assert_eq!(
            check_idle(&c, &plain),
            ["Insufficient example.com/gpu-mem"],
            "a node without the extended resource has none of it"
        );
    }

    #[test]
    fn too_many_pods() {
        let n = node("n1").build();
        let usage = NodeUsage {
            pods: 110,
            ..NodeUsage::default()
        };
        assert_eq!(
            check(&pod("a").build(), &n, &usage),
            [reasons::TOO_MANY_PODS]
        );
    }

    #[test]
    fn unready_and_unselected_nodes_are_rejected_first() {
        let p = pod("a").gpu_mem(100).build();
        let mut unready = node("n2").gpus(&[8]).build();
        if let Some(conditions) = unready.status.as_mut().and_then(|s| s.conditions.as_mut()) {
            conditions[0].status = "False".into();
        }
        assert_eq!(check_idle(&p, &unready), [NOT_READY]);

        let mut selective = pod("b").gpu_mem(1).build();
        if let Some(spec) = selective.spec.as_mut() {
            spec.node_selector = Some([("gpushare".to_owned(), "true".to_owned())].into());
        }
        let labelled = node("n3").gpushare().gpus(&[8]).build();
        let unlabelled = node("n4").gpus(&[8]).build();
        assert!(check_idle(&selective, &labelled).is_empty());
        assert_eq!(
            check_idle(&selective, &unlabelled),
            [reasons::NODE_AFFINITY]
        );
    }

    #[test]
    fn fit_error_message_matches_kube_scheduler() {
        let statuses = [
            vec!["Insufficient example.com/gpu-mem".to_owned()],
            vec!["no GPU with 8 GiB free".to_owned()],
            vec!["no GPU with 8 GiB free".to_owned()],
        ];
        assert_eq!(
            fit_error_message(3, statuses.iter()),
            "0/3 nodes are available: 1 Insufficient example.com/gpu-mem, 2 no GPU with 8 GiB free."
        );
        let both = [vec![
            "Insufficient cpu".to_owned(),
            "Insufficient memory".to_owned(),
        ]];
        assert_eq!(
            fit_error_message(1, both.iter()),
            "0/1 nodes are available: 1 Insufficient cpu, 1 Insufficient memory."
        );
        assert_eq!(fit_error_message(2, [].iter()), "0/2 nodes are available:");
    }

    fn priorities(list: &[(&str, i64)], weight: i64) -> ExtenderPriorities {
        ExtenderPriorities {
            priorities: list
                .iter()
                .map(|(host, score)| crate::scheduler::wire::HostPriority {
                    host: (*host).to_owned(),
                    score: *score,
                })
                .collect(),
            weight,
        }
    }

    fn candidates(totals: &[(&str, i64)]) -> Vec<NodeScore> {
        totals.iter().map(|(n, t)| NodeScore::new(*n, *t)).collect()
    }

    fn totals(nodes: &[NodeScore]) -> Vec<i64> {
        nodes.iter().map(|n| n.total).collect()
    }

    #[test]
    fn a_host_missing_from_the_answer_scores_as_zero_like_upstream() {
        let mut rng = StdRng::seed_from_u64(1);
        // a: best default score, left out of the answer; b: named with 2; c: left out.
        let mut nodes = candidates(&[("a", 50), ("b", 40), ("c", 40)]);
        add_extender_priorities(&mut nodes, &[priorities(&[("b", 2)], 1)], &mut rng);
        assert_eq!(
            totals(&nodes),
            [50, 60, 40],
            "missing hosts get nothing added"
        );
        assert_eq!(select_scored_host(&nodes), Some("b"));
        assert_eq!((nodes[0].randomizer, nodes[2].randomizer), (0, 0));
        assert_ne!(nodes[1].randomizer, 0);

        // Leaving a host out and sending it with 0 give the same totals.
        let mut explicit = candidates(&[("a", 50), ("b", 40), ("c", 40)]);
        add_extender_priorities(
            &mut explicit,
            &[priorities(&[("a", 0), ("b", 2), ("c", 0)], 1)],
            &mut rng,
        );
        assert_eq!(totals(&explicit), totals(&nodes));

        // A driver that gave a missing host anything but 0 would pick `a` here.
        let mut nodes = candidates(&[("a", 45), ("b", 40)]);
        add_extender_priorities(&mut nodes, &[priorities(&[("b", 1)], 1)], &mut rng);
        assert_eq!(select_scored_host(&nodes), Some("b"));
    }

    #[test]
    fn extender_scores_are_weighted_scaled_and_summed_like_upstream() {
        let mut rng = StdRng::seed_from_u64(2);
        let mut nodes = candidates(&[("a", 0), ("b", 0), ("c", 7)]);
        let answers = [
            // Listed twice, an unknown host, a score above 10: all taken as upstream takes them.
            priorities(&[("a", 3), ("a", 1), ("ghost", 10), ("b", 12)], 5),
            priorities(&[("b", 1)], 2),
            ExtenderPriorities::without_verb(&candidates(&[("c", 0)])),
        ];
        add_extender_priorities(&mut nodes, &answers, &mut rng);
        assert_eq!(totals(&nodes), [200, 620, 7]);
        assert!(
            nodes.iter().all(|n| n.randomizer != 0),
            "every named node, even at 0, draws a tie-breaker"
        );
    }

    #[test]
    fn ties_go_to_named_nodes_then_to_heap_order() {
        let mut rng = StdRng::seed_from_u64(3);
        // a is left out, b is named with 0: same total, b wins the tie.
        let mut nodes = candidates(&[("a", 10), ("b", 10)]);
        add_extender_priorities(&mut nodes, &[priorities(&[("b", 0)], 1)], &mut rng);
        assert_eq!(select_scored_host(&nodes), Some("b"));
        // Nobody named: container/heap keeps the first of equals on top.
        let nodes = candidates(&[("a", 10), ("b", 10), ("c", 10)]);
        assert_eq!(select_scored_host(&nodes), Some("a"));
        // Heapify moves a strictly better child up past its equals.
        let nodes = candidates(&[("a", 1), ("b", 5), ("c", 5), ("d", 5)]);
        assert_eq!(select_scored_host(&nodes), Some("b"));
        assert_eq!(select_scored_host(&[]), None);
        // Named ties are broken at random, reproducibly under a seed.
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..100 {
            let mut nodes = candidates(&[("a", 0), ("b", 0), ("c", 0)]);
            add_extender_priorities(
                &mut nodes,
                &[priorities(&[("a", 1), ("b", 1), ("c", 1)], 1)],
                &mut rng,
            );
            seen.extend(select_scored_host(&nodes).map(str::to_owned));
        }
        assert_eq!(seen.len(), 3, "each named tied node wins some of the time");
    }
}
