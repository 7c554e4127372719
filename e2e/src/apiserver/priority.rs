//! The `Priority` admission plugin, as the real API server runs it on every pod create: the
//! pod's `priorityClassName` resolves to the class's value in `spec.priority` (and its
//! `preemptionPolicy`), or to the global default class's, or to 0.
//!
//! Why here: kube-scheduler's preemption compares these numbers, and the real server refuses a
//! pod that sets `spec.priority` itself or names a class that does not exist. A scenario that
//! passed here by writing `spec.priority` by hand would fail on a real cluster.

use serde_json::{Value, json};

use super::resources::Kind;
use super::status::{ApiError, ApiResult};
use super::store::Inner;

/// The classes every cluster has (`scheduling.k8s.io` system classes).
const SYSTEM_CLASSES: [(&str, i64); 2] = [
    ("system-node-critical", 2_000_001_000),
    ("system-cluster-critical", 2_000_000_000),
];

/// Resolves the priority of a pod being created, as upstream's
/// `plugin/pkg/admission/priority` does.
pub(super) fn admit_pod(store: &Inner, pod: &mut Value) -> ApiResult<()> {
    let name = pod
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let class_name = pod
        .pointer("/spec/priorityClassName")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .map(str::to_owned);
    let class = match &class_name {
        Some(class_name) => Some(find(store, class_name).ok_or_else(|| {
            forbidden(
                &name,
                &format!("no PriorityClass with name {class_name} was found"),
            )
        })?),
        None => global_default(store),
    };
    let (value, policy) = class.map_or((0, None), |c| (c.0, c.1));
    let given = pod.pointer("/spec/priority").and_then(Value::as_i64);
    if let Some(given) = given
        && given != value
    {
        return Err(forbidden(
            &name,
            &format!(
                "the integer value of priority ({given}) must not be provided in pod spec; priority admission controller computed {value} from the given PriorityClass name"
            ),
        ));
    }
    if let Some(spec) = pod.get_mut("spec").and_then(Value::as_object_mut) {
        spec.insert("priority".into(), json!(value));
        spec.insert(
            "preemptionPolicy".into(),
            json!(policy.unwrap_or_else(|| "PreemptLowerPriority".to_owned())),
        );
    }
    Ok(())
}

/// A class's value and preemption policy, by name.
fn find(store: &Inner, name: &str) -> Option<(i64, Option<String>)> {
    if let Some((_, value)) = SYSTEM_CLASSES.iter().find(|(n, _)| *n == name) {
        return Some((*value, None));
    }
    let class = store.get(Kind::PriorityClass, &(String::new(), name.to_owned()))?;
    Some(read(class))
}

/// The class marked `globalDefault`, if one is.
fn global_default(store: &Inner) -> Option<(i64, Option<String>)> {
    store
        .list(Kind::PriorityClass, None)
        .find(|(_, class)| class.get("globalDefault").and_then(Value::as_bool) == Some(true))
        .map(|(_, class)| read(class))
}

fn read(class: &Value) -> (i64, Option<String>) {
    let value = class.get("value").and_then(Value::as_i64).unwrap_or(0);
    let policy = class
        .get("preemptionPolicy")
        .and_then(Value::as_str)
        .map(str::to_owned);
    (value, policy)
}

fn forbidden(pod: &str, why: &str) -> ApiError {
    ApiError::new(
        403,
        "Forbidden",
        format!("pods \"{pod}\" is forbidden: {why}"),
    )
    .with_details("pods", pod)
}
