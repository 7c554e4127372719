//! The pod `binding` subresource: how a scheduler assigns a pod to a node. Checked as the
//! real server checks it (names, UID precondition, a pod being deleted or bound already),
//! and applied once: `spec.nodeName`, the Binding's annotations, `PodScheduled=True`.

use http::StatusCode;
use serde_json::{Value, json};

use super::App;
use super::objects::{self, meta_mut, meta_str, str_at};
use super::request::{Reply, Target, current_or_404, parse_body};
use super::resources::Kind;
use super::status::{self, ApiError};

/// `POST .../pods/{name}/binding`: assigns the pod to a node, copying the Binding's
/// annotations onto the pod, exactly once.
pub(super) fn bind(app: &App, target: &Target, body: &[u8]) -> Reply {
    let binding = parse_body("application/json", body)?;
    let pod_name = target.name();
    let binding_name = meta_str(&binding, "name").unwrap_or("");
    if binding_name != pod_name {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({binding_name}) does not match the name on the URL ({pod_name})"
        )));
    }
    if let Some(ns) = meta_str(&binding, "namespace").filter(|ns| !ns.is_empty())
        && Some(ns) != target.namespace.as_deref()
    {
        return Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    let target_kind = str_at(&binding, "/target/kind").unwrap_or("");
    let node = str_at(&binding, "/target/name").unwrap_or("");
    let mut causes = Vec::new();
    if !target_kind.is_empty() && target_kind != "Node" {
        causes.push(format!(
            "target.kind: Invalid value: {target_kind:?}: must be empty or 'Node'"
        ));
    }
    if node.is_empty() {
        causes.push("target.name: Required value".to_owned());
    }
    if !causes.is_empty() {
        return Err(ApiError::invalid("Binding", pod_name, &causes));
    }
    let annotations = binding.pointer("/metadata/annotations").cloned();
    let uid = meta_str(&binding, "uid")
        .filter(|u| !u.is_empty())
        .map(str::to_owned);
    app.store.write(|store| {
        let current = current_or_404(store, target)?.clone();
        let pod_uid = meta_str(&current, "uid").unwrap_or("");
        if let Some(uid) = uid.as_deref().filter(|u| *u != pod_uid) {
            return Err(ApiError::conflict("pods", pod_name, format!(
                "Operation cannot be fulfilled on pods/binding \"{pod_name}\": Precondition failed: UID in precondition: {uid}, UID in object meta: {pod_uid}"
            )));
        }
        if current.pointer("/metadata/deletionTimestamp").is_some() {
            return Err(ApiError::conflict("pods", pod_name, format!(
                "Operation cannot be fulfilled on pods/binding \"{pod_name}\": pod {pod_name} is being deleted, cannot be assigned to a host"
            )));
        }
        if let Some(bound) = str_at(&current, "/spec/nodeName").filter(|n| !n.is_empty()) {
            return Err(ApiError::conflict("pods", pod_name, format!(
                "Operation cannot be fulfilled on pods/binding \"{pod_name}\": pod {pod_name} is already assigned to node \"{bound}\""
            )));
        }
        let mut pod = current;
        pod["spec"]["nodeName"] = json!(node);
        if let Some(Value::Object(annotations)) = annotations {
            let meta = meta_mut(&mut pod);
            objects::as_map(meta.entry("annotations").or_insert(Value::Null)).extend(annotations);
        }
        set_condition(&mut pod, "PodScheduled", "True");
        objects::validate(Kind::Pod, &pod)?;
        store.update(Kind::Pod, target.key(), pod);
        Ok((StatusCode::CREATED, status::success(201)))
    })
}

fn set_condition(pod: &mut Value, kind: &str, status: &str) {
    let condition = json!({"type": kind, "status": status, "lastProbeTime": null, "lastTransitionTime": objects::now()});
    let pod_status = objects::as_map(objects::as_map(pod).entry("status").or_insert(Value::Null));
    let conditions = pod_status.entry("conditions").or_insert(json!([]));
    if !conditions.is_array() {
        *conditions = json!([]);
    }
    if let Value::Array(list) = conditions {
        match list
            .iter_mut()
            .find(|c| c.get("type").and_then(Value::as_str) == Some(kind))
        {
            Some(existing) => *existing = condition,
            None => list.push(condition),
        }
    }
}
