//! kube-scheduler's extender protocol (`k8s.io/kube-scheduler/extender/v1`), as sent on the wire.
//!
//! The Go structs carry no JSON tags, so keys are the Go field names (`Pod`, `NodeNames`,
//! `FailedNodes`…); Go decodes our answers case-insensitively, and we accept camelCase
//! aliases too. Unknown fields are ignored, wrong types are rejected.
//!
//! Node objects in the `Nodes` form are kept as raw JSON: we read only `metadata.name` and
//! hand passing nodes back verbatim, so a 5,000-node filter does not build 5,000 `Node`s.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// `ExtenderArgs`: the body of `filter` and `prioritize`.
#[derive(Debug, Deserialize)]
pub struct ExtenderArgs<'a> {
    /// The pod being scheduled.
    #[serde(rename = "Pod", alias = "pod", default)]
    pub pod: Option<Pod>,
    /// Candidate nodes as objects (`nodeCacheCapable: false`).
    #[serde(rename = "Nodes", alias = "nodes", default, borrow)]
    pub nodes: Option<RawNodeList<'a>>,
    /// Candidate node names (`nodeCacheCapable: true`).
    #[serde(
        rename = "NodeNames",
        alias = "nodeNames",
        default,
        borrow,
        deserialize_with = "borrowed_names"
    )]
    pub node_names: Option<Vec<Cow<'a, str>>>,
}

/// A string borrowed from the request body when it has no escapes (node names never do),
/// owned otherwise.
///
/// Why: serde borrows a `Cow<str>` only as a direct field; inside a `Vec` it always copies,
/// and 5,000 small copies per filter call were a third of the handler's time (allocator).
struct BorrowedStr<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for BorrowedStr<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = BorrowedStr<'de>;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a node name")
            }

            fn visit_borrowed_str<E: serde::de::Error>(
                self,
                v: &'de str,
            ) -> Result<Self::Value, E> {
                Ok(BorrowedStr(Cow::Borrowed(v)))
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(BorrowedStr(Cow::Owned(v.to_owned())))
            }
        }
        deserializer.deserialize_str(Visit)
    }
}

fn borrowed_names<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Vec<Cow<'de, str>>>, D::Error> {
    let names: Option<Vec<BorrowedStr<'de>>> = Option::deserialize(deserializer)?;
    Ok(names.map(|names| names.into_iter().map(|name| name.0).collect()))
}

/// A `NodeList` whose items stay raw JSON.
#[derive(Debug, Deserialize, Serialize)]
pub struct RawNodeList<'a> {
    /// The list items, verbatim.
    #[serde(default, borrow)]
    pub items: Vec<&'a RawValue>,
}

#[derive(Deserialize)]
struct NameOnly<'a> {
    #[serde(default, borrow)]
    metadata: MetaName<'a>,
}

#[derive(Default, Deserialize)]
struct MetaName<'a> {
    #[serde(default, borrow)]
    name: Option<Cow<'a, str>>,
}

/// `metadata.name` of a raw node object, if it has one.
pub fn raw_node_name<'a>(node: &'a RawValue) -> Option<Cow<'a, str>> {
    serde_json::from_str::<NameOnly<'a>>(node.get())
        .ok()
        .and_then(|n| n.metadata.name)
}

/// The node list in an answer: `{"metadata":{},"items":[…]}`.
#[derive(Debug, Serialize)]
pub struct RawNodeListOut<'a> {
    /// Always empty.
    pub metadata: BTreeMap<String, String>,
    /// The passing nodes, verbatim.
    pub items: Vec<&'a RawValue>,
}

/// `FailedNodesMap` (node name → reason) as filter builds it: one entry per rejected candidate,
/// in the order of the request, written out as a JSON object.
///
/// Why not a map: candidates are distinct names, so there is nothing to merge or look up, and
/// at hundreds of rejected nodes per call a sorted map's key comparisons and node allocations
/// were a visible part of filter's time in the load harness profile.
#[derive(Debug, Default)]
pub struct FailedNodes<'a>(Vec<(Cow<'a, str>, String)>);

impl<'a> FailedNodes<'a> {
    /// Records `node` as rejected for `reason`.
    pub fn insert(&mut self, node: Cow<'a, str>, reason: String) {
        self.0.push((node, reason));
    }

    /// The rejected nodes and reasons, in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0
            .iter()
            .map(|(node, reason)| (&**node, reason.as_str()))
    }

    /// How many nodes were rejected.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether no node was rejected.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Serialize for FailedNodes<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (node, reason) in &self.0 {
            map.serialize_entry(node, reason)?;
        }
        map.end()
    }
}

/// `ExtenderFilterResult`.
#[derive(Debug, Default, Serialize)]
pub struct ExtenderFilterResult<'a> {
    /// Passing nodes as objects, when they were sent as objects.
    #[serde(rename = "Nodes")]
    pub nodes: Option<RawNodeListOut<'a>>,
    /// Passing node names, when names were sent.
    #[serde(rename = "NodeNames")]
    pub node_names: Option<Vec<Cow<'a, str>>>,
    /// Nodes that may fit later, with the reason.
    #[serde(rename = "FailedNodes")]
    pub failed_nodes: FailedNodes<'a>,
    /// Nodes that will not fit as things stand, with the reason.
    #[serde(rename = "FailedAndUnresolvableNodes")]
    pub failed_and_unresolvable_nodes: FailedNodes<'a>,
    /// Set when the whole call failed; kube-scheduler then retries the pod.
    #[serde(rename = "Error")]
    pub error: String,
}

/// One element of `HostPriorityList`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostPriority<'a> {
    /// Node name.
    #[serde(rename = "Host")]
    pub host: &'a str,
    /// 0..=10.
    #[serde(rename = "Score")]
    pub score: i64,
}

/// `ExtenderBindingArgs`.
#[derive(Debug, Clone, Deserialize)]
pub struct ExtenderBindingArgs {
    /// Pod name.
    #[serde(rename = "PodName", alias = "podName")]
    pub pod_name: String,
    /// Pod namespace.
    #[serde(rename = "PodNamespace", alias = "podNamespace")]
    pub pod_namespace: String,
    /// Pod UID.
    #[serde(rename = "PodUID", alias = "podUID", alias = "podUid")]
    pub pod_uid: String,
    /// Target node.
    #[serde(rename = "Node", alias = "node")]
    pub node: String,
}

/// `ExtenderBindingResult`: empty `Error` means bound.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct ExtenderBindingResult {
    /// Why the bind failed, or empty.
    #[serde(rename = "Error", default)]
    pub error: String,
}

/// `ExtenderPreemptionArgs`: the body of `preempt`. With `nodeCacheCapable: true`
/// kube-scheduler sends `NodeNameToMetaVictims` (UIDs), otherwise `NodeNameToVictims` (whole
/// pods, of which only the UIDs are read here); the other map is `null`.
#[derive(Debug, Deserialize)]
pub struct ExtenderPreemptionArgs {
    /// The pod that needs room (the preemptor).
    #[serde(rename = "Pod", alias = "pod", default)]
    pub pod: Option<Pod>,
    /// Candidate nodes with the victims kube-scheduler proposes there, as whole pods.
    #[serde(rename = "NodeNameToVictims", alias = "nodeNameToVictims", default)]
    pub node_name_to_victims: Option<BTreeMap<String, Option<Victims>>>,
    /// Candidate nodes with the victims kube-scheduler proposes there, as UIDs.
    #[serde(
        rename = "NodeNameToMetaVictims",
        alias = "nodeNameToMetaVictims",
        default
    )]
    pub node_name_to_meta_victims: Option<BTreeMap<String, Option<MetaVictims>>>,
}

/// `Victims`: whole pods (only their UIDs are decoded).
#[derive(Debug, Default, Deserialize)]
pub struct Victims {
    /// The pods.
    #[serde(rename = "Pods", alias = "pods", default)]
    pub pods: Option<Vec<Option<UidOnly>>>,
    /// How many of them a PodDisruptionBudget protects.
    #[serde(rename = "NumPDBViolations", alias = "numPDBViolations", default)]
    pub num_pdb_violations: i64,
}

/// A pod object of which only `metadata.uid` is read.
#[derive(Debug, Default, Deserialize)]
pub struct UidOnly {
    /// Its metadata.
    #[serde(default)]
    pub metadata: UidMeta,
}

/// `metadata.uid`.
#[derive(Debug, Default, Deserialize)]
pub struct UidMeta {
    /// The UID.
    #[serde(default)]
    pub uid: Option<String>,
}

/// `MetaVictims`: victims by UID; what the answer carries too.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaVictims {
    /// The pods, most important first (kube-scheduler ranks candidate nodes by the priority
    /// of the first).
    #[serde(rename = "Pods", alias = "pods", default)]
    pub pods: Vec<MetaPod>,
    /// How many of them a PodDisruptionBudget protects.
    #[serde(rename = "NumPDBViolations", alias = "numPDBViolations", default)]
    pub num_pdb_violations: i64,
}

/// `MetaPod`: a pod by UID.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaPod {
    /// The pod's UID.
    #[serde(rename = "UID", alias = "uid", default)]
    pub uid: String,
}

/// `ExtenderPreemptionResult`: the nodes kept, each with the victims to evict there.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct ExtenderPreemptionResult {
    /// Node name → victims. A node left out is not preempted on.
    #[serde(rename = "NodeNameToMetaVictims", default)]
    pub node_name_to_meta_victims: BTreeMap<String, MetaVictims>,
}

impl ExtenderPreemptionArgs {
    /// The candidate nodes with the UIDs proposed on each and their budget violations, from
    /// whichever form was sent (`MetaVictims` when both were).
    pub fn proposals(&self) -> BTreeMap<&str, (Vec<&str>, i64)> {
        if let Some(meta) = &self.node_name_to_meta_victims {
            return meta
                .iter()
                .map(|(node, victims)| {
                    let victims = victims.as_ref();
                    let uids = victims.map_or_else(Vec::new, |v| {
                        v.pods.iter().map(|pod| pod.uid.as_str()).collect()
                    });
                    let violations = victims.map_or(0, |v| v.num_pdb_violations);
                    (node.as_str(), (uids, violations))
                })
                .collect();
        }
        let Some(whole) = &self.node_name_to_victims else {
            return BTreeMap::new();
        };
        whole
            .iter()
            .map(|(node, victims)| {
                let victims = victims.as_ref();
                let uids = victims
                    .and_then(|v| v.pods.as_ref())
                    .map_or_else(Vec::new, |pods| {
                        pods.iter()
                            .flatten()
                            .filter_map(|pod| pod.metadata.uid.as_deref())
                            .collect()
                    });
                let violations = victims.map_or(0, |v| v.num_pdb_violations);
                (node.as_str(), (uids, violations))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_borrow_from_the_body_unless_escaped() {
        let body = r#"{"Pod":null,"NodeNames":["node-a","node-\u0062"]}"#;
        let args: ExtenderArgs<'_> = serde_json::from_str(body).unwrap();
        let names = args.node_names.unwrap();
        assert!(matches!(names[0], Cow::Borrowed("node-a")));
        assert!(matches!(&names[1], Cow::Owned(name) if name == "node-b"));
        let args: ExtenderArgs<'_> = serde_json::from_str(r#"{"NodeNames":null}"#).unwrap();
        assert!(args.node_names.is_none());
        let args: ExtenderArgs<'_> = serde_json::from_str("{}").unwrap();
        assert!(args.node_names.is_none());
        let wrong = serde_json::from_str::<ExtenderArgs<'_>>(r#"{"NodeNames":[1]}"#);
        assert!(wrong.unwrap_err().to_string().contains("a node name"));
    }

    #[test]
    fn failed_nodes_are_written_as_an_object_in_request_order() {
        let mut result = ExtenderFilterResult::default();
        assert_eq!(
            serde_json::to_value(&result).unwrap()["FailedNodes"],
            serde_json::json!({})
        );
        result
            .failed_nodes
            .insert(Cow::Borrowed("node-b"), "full".to_owned());
        result
            .failed_nodes
            .insert(Cow::Owned("node-a".to_owned()), "unhealthy".to_owned());
        let text = serde_json::to_string(&result).unwrap();
        assert!(
            text.contains(r#""FailedNodes":{"node-b":"full","node-a":"unhealthy"}"#),
            "{text}"
        );
        assert_eq!(result.failed_nodes.len(), 2);
        assert_eq!(
            result.failed_nodes.iter().last(),
            Some(("node-a", "unhealthy"))
        );
    }
}

#[cfg(test)]
mod preemption_tests {
    use super::*;

    #[test]
    fn preemption_args_read_either_form_and_the_answer_is_what_kube_scheduler_decodes() {
        let meta = r#"{"Pod":{"metadata":{"uid":"p"}},"NodeNameToVictims":null,
            "NodeNameToMetaVictims":{"n1":{"Pods":[{"UID":"a"},{"UID":"b"}],"NumPDBViolations":1},"n2":null}}"#;
        let args: ExtenderPreemptionArgs = serde_json::from_str(meta).unwrap();
        let proposals = args.proposals();
        assert_eq!(proposals["n1"], (vec!["a", "b"], 1));
        assert_eq!(proposals["n2"], (vec![], 0));
        let whole = r#"{"Pod":null,"NodeNameToVictims":{"n1":{"Pods":[{"metadata":{"uid":"a","name":"x"},"spec":{"containers":[]}},null],"NumPDBViolations":0}},"NodeNameToMetaVictims":null}"#;
        let args: ExtenderPreemptionArgs = serde_json::from_str(whole).unwrap();
        assert_eq!(args.proposals()["n1"], (vec!["a"], 0));
        let empty: ExtenderPreemptionArgs = serde_json::from_str("{}").unwrap();
        assert!(empty.proposals().is_empty());
        assert!(
            serde_json::from_str::<ExtenderPreemptionArgs>(r#"{"NodeNameToMetaVictims":[1]}"#)
                .is_err()
        );
        // The form upstream's types_test pins.
        let mut answer = ExtenderPreemptionResult::default();
        answer.node_name_to_meta_victims.insert(
            "foo".into(),
            MetaVictims {
                pods: vec![MetaPod {
                    uid: "myuid".into(),
                }],
                num_pdb_violations: 1,
            },
        );
        assert_eq!(
            serde_json::to_string(&answer).unwrap(),
            r#"{"NodeNameToMetaVictims":{"foo":{"Pods":[{"UID":"myuid"}],"NumPDBViolations":1}}}"#
        );
    }
}
