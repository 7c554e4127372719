//! The JSON kube-scheduler exchanges with an HTTP extender (`k8s.io/kube-scheduler/extender/v1`).
//!
//! Written independently of `gpushare-extender` on purpose: the driver must speak what the real
//! kube-scheduler speaks, not what our extender happens to accept, so a mismatch shows up as a
//! failing end-to-end test rather than two halves agreeing on the same mistake.
//!
//! Three Go habits shape this module:
//! - the Go types carry no json tags, so keys are the PascalCase field names (`Pod`, `NodeNames`);
//! - the embedded `v1.Pod`/`v1.Node` come from informers with an empty `TypeMeta`, so they have no
//!   `apiVersion`/`kind`, and the `NodeList` is `{"metadata":{},"items":[...]}`;
//! - `encoding/json` matches keys case-insensitively (exact match preferred) and ignores unknown
//!   keys, so answers are decoded the same way here ([`decode_filter_result`] and friends).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ListMeta;
use serde::ser::Error as _;
use serde::{Serialize, Serializer};
use serde_json::{Map, Value};

/// The highest score an extender's prioritize may give (`extenderv1.MaxExtenderPriority`).
pub const MAX_EXTENDER_PRIORITY: i64 = 10;

/// Node name → reason, as in `extenderv1.FailedNodesMap`.
pub type FailedNodesMap = BTreeMap<String, String>;

/// A `v1.NodeList` as the scheduler builds it: no `kind`/`apiVersion`, empty list metadata.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct NodeList {
    pub metadata: ListMeta,
    #[serde(serialize_with = "nodes_without_type_meta")]
    pub items: Vec<Node>,
}

/// Body of `POST {urlPrefix}/{filterVerb}` and `POST {urlPrefix}/{prioritizeVerb}`.
///
/// Exactly one of `nodes` (extender not `nodeCacheCapable`) and `node_names` (`nodeCacheCapable`)
/// is `Some`; the other is sent as `null`.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderArgs {
    #[serde(serialize_with = "without_type_meta")]
    pub pod: Pod,
    pub nodes: Option<NodeList>,
    pub node_names: Option<Vec<String>>,
}

/// Answer to a filter call.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderFilterResult {
    /// Nodes that passed, when the extender is not `nodeCacheCapable`.
    pub nodes: Option<NodeList>,
    /// Names of nodes that passed, when the extender is `nodeCacheCapable`.
    pub node_names: Option<Vec<String>>,
    /// Nodes that failed, with a reason shown to the user; preemption may still help them.
    pub failed_nodes: FailedNodesMap,
    /// Nodes that failed in a way preemption cannot fix.
    pub failed_and_unresolvable_nodes: FailedNodesMap,
    /// A non-empty error fails the whole scheduling cycle.
    pub error: String,
}

/// One entry of a prioritize answer; `score` is 0..=[`MAX_EXTENDER_PRIORITY`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct HostPriority {
    pub host: String,
    pub score: i64,
}

/// Body of `POST {urlPrefix}/{bindVerb}`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderBindingArgs {
    pub pod_name: String,
    pub pod_namespace: String,
    #[serde(rename = "PodUID")]
    pub pod_uid: String,
    pub node: String,
}

/// Answer to a bind call: `{}` or `{"Error":""}` is success.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderBindingResult {
    pub error: String,
}

/// Why an extender's answer could not be decoded, worded like Go's `encoding/json` errors.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The body is not JSON at all.
    #[error("invalid JSON: {0}")]
    Syntax(#[source] serde_json::Error),
    /// A value has the wrong JSON type for its field.
    #[error("json: cannot unmarshal {found} into Go struct field {field} of type {expected}")]
    Type {
        field: String,
        found: &'static str,
        expected: &'static str,
    },
    /// An embedded Kubernetes object (a `v1.Node`) did not decode.
    #[error("json: cannot decode {field}: {source}")]
    Object {
        field: String,
        #[source]
        source: serde_json::Error,
    },
}

/// Serializes a Kubernetes object the way an informer-fed Go client does: without `TypeMeta`.
fn without_type_meta<T: Serialize, S: Serializer>(object: &T, s: S) -> Result<S::Ok, S::Error> {
    let mut value = serde_json::to_value(object).map_err(S::Error::custom)?;
    if let Value::Object(map) = &mut value {
        map.remove("apiVersion");
        map.remove("kind");
    }
    value.serialize(s)
}

/// Every node [`without_type_meta`].
fn nodes_without_type_meta<S: Serializer>(nodes: &[Node], s: S) -> Result<S::Ok, S::Error> {
    struct Item<'a>(&'a Node);
    impl Serialize for Item<'_> {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            without_type_meta(self.0, s)
        }
    }
    s.collect_seq(nodes.iter().map(Item))
}

// ---- Decoding, case-insensitively like encoding/json ----

/// Looks a key up as Go does: the exact spelling first, then any case-insensitive match.
fn field<'a>(object: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    object.get(name).or_else(|| {
        object
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value)
    })
}

fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn type_error(field: &str, value: &Value, expected: &'static str) -> DecodeError {
    DecodeError::Type {
        field: field.to_owned(),
        found: kind_of(value),
        expected,
    }
}

fn parse(body: &[u8]) -> Result<Value, DecodeError> {
    serde_json::from_slice(body).map_err(DecodeError::Syntax)
}

/// Go decodes `null` into any field by leaving its zero value.
fn object<'a>(value: &'a Value, what: &str) -> Result<Option<&'a Map<String, Value>>, DecodeError> {
    match value {
        Value::Null => Ok(None),
        Value::Object(map) => Ok(Some(map)),
        other => Err(type_error(what, other, "object")),
    }
}

fn string(value: Option<&Value>, what: &str) -> Result<String, DecodeError> {
    match value {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(type_error(what, other, "string")),
    }
}

fn string_map(value: Option<&Value>, what: &str) -> Result<FailedNodesMap, DecodeError> {
    let Some(map) = value.map(|v| object(v, what)).transpose()?.flatten() else {
        return Ok(FailedNodesMap::new());
    };
    map.iter()
        .map(|(node, reason)| Ok((node.clone(), string(Some(reason), what)?)))
        .collect()
}

fn string_list(value: Option<&Value>, what: &str) -> Result<Option<Vec<String>>, DecodeError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| string(Some(item), what))
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(other) => Err(type_error(what, other, "[]string")),
    }
}

fn node_list(value: Option<&Value>, what: &str) -> Result<Option<NodeList>, DecodeError> {
    let Some(map) = value.map(|v| object(v, what)).transpose()?.flatten() else {
        return Ok(None);
    };
    let items = match field(map, "items") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| {
                serde_json::from_value::<Node>(item.clone()).map_err(|source| DecodeError::Object {
                    field: format!("{what}.items"),
                    source,
                })
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(other) => return Err(type_error(what, other, "[]v1.Node")),
    };
    Ok(Some(NodeList {
        metadata: ListMeta::default(),
        items,
    }))
}

pub fn decode_filter_result(body: &[u8]) -> Result<ExtenderFilterResult, DecodeError> {
    let value = parse(body)?;
    let Some(map) = object(&value, "ExtenderFilterResult")? else {
        return Ok(ExtenderFilterResult::default());
    };
    let failed = |name: &str| string_map(field(map, name), &format!("ExtenderFilterResult.{name}"));
    Ok(ExtenderFilterResult {
        nodes: node_list(field(map, "Nodes"), "ExtenderFilterResult.Nodes")?,
        node_names: string_list(field(map, "NodeNames"), "ExtenderFilterResult.NodeNames")?,
        failed_nodes: failed("FailedNodes")?,
        failed_and_unresolvable_nodes: failed("FailedAndUnresolvableNodes")?,
        error: string(field(map, "Error"), "ExtenderFilterResult.Error")?,
    })
}

/// Decodes a prioritize answer (`null` is an empty list, as in Go).
pub fn decode_host_priorities(body: &[u8]) -> Result<Vec<HostPriority>, DecodeError> {
    let value = parse(body)?;
    let items = match &value {
        Value::Null => return Ok(Vec::new()),
        Value::Array(items) => items,
        other => return Err(type_error("HostPriorityList", other, "[]HostPriority")),
    };
    items
        .iter()
        .map(|item| {
            let Some(map) = object(item, "HostPriority")? else {
                return Ok(HostPriority::default());
            };
            let score = match field(map, "Score") {
                None | Some(Value::Null) => 0,
                Some(value) => value
                    .as_i64()
                    .ok_or_else(|| type_error("HostPriority.Score", value, "int64"))?,
            };
            Ok(HostPriority {
                host: string(field(map, "Host"), "HostPriority.Host")?,
                score,
            })
        })
        .collect()
}

pub fn decode_binding_result(body: &[u8]) -> Result<ExtenderBindingResult, DecodeError> {
    let value = parse(body)?;
    let Some(map) = object(&value, "ExtenderBindingResult")? else {
        return Ok(ExtenderBindingResult::default());
    };
    Ok(ExtenderBindingResult {
        error: string(field(map, "Error"), "ExtenderBindingResult.Error")?,
    })
}

/// Decodes a filter/prioritize request body (what a fake extender receives).
pub fn decode_extender_args(body: &[u8]) -> Result<ExtenderArgs, DecodeError> {
    let value = parse(body)?;
    let map = object(&value, "ExtenderArgs")?
        .ok_or_else(|| type_error("ExtenderArgs", &value, "object"))?;
    let pod = match field(map, "Pod") {
        None | Some(Value::Null) => Pod::default(),
        Some(pod) => serde_json::from_value(pod.clone()).map_err(|source| DecodeError::Object {
            field: "ExtenderArgs.Pod".to_owned(),
            source,
        })?,
    };
    Ok(ExtenderArgs {
        pod,
        nodes: node_list(field(map, "Nodes"), "ExtenderArgs.Nodes")?,
        node_names: string_list(field(map, "NodeNames"), "ExtenderArgs.NodeNames")?,
    })
}

/// Decodes a bind request body (what a fake extender receives).
pub fn decode_binding_args(body: &[u8]) -> Result<ExtenderBindingArgs, DecodeError> {
    let value = parse(body)?;
    let map = object(&value, "ExtenderBindingArgs")?
        .ok_or_else(|| type_error("ExtenderBindingArgs", &value, "object"))?;
    let text = |name: &str| string(field(map, name), &format!("ExtenderBindingArgs.{name}"));
    Ok(ExtenderBindingArgs {
        pod_name: text("PodName")?,
        pod_namespace: text("PodNamespace")?,
        pod_uid: text("PodUID")?,
        node: text("Node")?,
    })
}
