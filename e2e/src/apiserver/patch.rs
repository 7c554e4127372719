//! The three patch formats the real server accepts from ordinary clients.
//!
//! Strategic merge patch is implemented for what our objects need: it is a JSON merge patch,
//! except that lists with a known merge key (containers by `name`, conditions by `type`, ...)
//! are merged element by element, `$patch: delete` removes an element, `$patch: replace`
//! replaces a map, and kubectl's `$setElementOrder/...` / `$retainKeys` directives are accepted
//! and ignored. Server-side apply is not supported (415), which clients can detect.

use serde_json::{Map, Value};

use super::status::{ApiError, ApiResult};

/// How the body of a PATCH is to be read, from its Content-Type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PatchKind {
    Merge,
    Strategic,
    Json,
}

impl PatchKind {
    pub fn from_content_type(content_type: &str) -> ApiResult<Self> {
        let media = content_type.split(';').next().unwrap_or("").trim();
        match media {
            "application/merge-patch+json" => Ok(PatchKind::Merge),
            "application/strategic-merge-patch+json" => Ok(PatchKind::Strategic),
            "application/json-patch+json" => Ok(PatchKind::Json),
            _ => Err(ApiError::unsupported_media_type(content_type)),
        }
    }
}

/// Applies `body` to `target`, returning the patched object.
pub(crate) fn apply(kind: PatchKind, target: &Value, body: &[u8]) -> ApiResult<Value> {
    let patch: Value = serde_json::from_slice(body)
        .map_err(|err| ApiError::bad_request(format!("error decoding patch: {err}")))?;
    let mut out = target.clone();
    match kind {
        PatchKind::Merge => {
            if !patch.is_object() {
                return Err(ApiError::bad_request(
                    "merge patch body must be a JSON object",
                ));
            }
            json_patch::merge(&mut out, &patch);
        }
        PatchKind::Strategic => {
            let Value::Object(patch) = patch else {
                return Err(ApiError::bad_request(
                    "strategic merge patch body must be a JSON object",
                ));
            };
            strategic_merge_map(&mut out, patch, "");
        }
        PatchKind::Json => {
            let ops: json_patch::Patch = serde_json::from_value(patch).map_err(|err| {
                ApiError::bad_request(format!("error decoding json patch: {err}"))
            })?;
            json_patch::patch(&mut out, &ops).map_err(|err| {
                ApiError::new(
                    422,
                    "Invalid",
                    format!(
                        "the server rejected our request due to an error in our request: {err}"
                    ),
                )
            })?;
        }
    }
    Ok(out)
}

/// The merge key of a list at `path` (dot-joined field names from the object root), if the
/// list is merged element-wise by strategic merge patch.
fn merge_key(path: &str) -> Option<&'static str> {
    let last = path.rsplit('.').next().unwrap_or(path);
    match last {
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "containerStatuses"
        | "initContainerStatuses"
        | "ephemeralContainerStatuses"
        | "env"
        | "volumes"
        | "imagePullSecrets"
        | "resourceClaims" => Some("name"),
        "conditions" => Some("type"),
        "volumeMounts" => Some("mountPath"),
        "ports" if path.contains("ontainers") => Some("containerPort"),
        "addresses" => Some("type"),
        "ownerReferences" => Some("uid"),
        // MutatingWebhookConfiguration: `patchStrategy:"merge" patchMergeKey:"name"`.
        "webhooks" if path == "webhooks" => Some("name"),
        _ => None,
    }
}

fn strategic_merge_map(target: &mut Value, patch: Map<String, Value>, path: &str) {
    if patch.get("$patch").and_then(Value::as_str) == Some("replace") {
        let mut patch = patch;
        patch.remove("$patch");
        *target = Value::Object(patch);
        return;
    }
    let map = super::objects::as_map(target);
    for (key, value) in patch {
        if key.starts_with("$setElementOrder/") || key == "$retainKeys" || key == "$patch" {
            continue;
        }
        if let Some(field) = key.strip_prefix("$deleteFromPrimitiveList/") {
            if let (Some(Value::Array(list)), Value::Array(remove)) = (map.get_mut(field), &value) {
                list.retain(|item| !remove.contains(item));
            }
            continue;
        }
        let child_path = if path.is_empty() {
            key.clone()
        } else {
            format!("{path}.{key}")
        };
        match value {
            Value::Null => {
                map.remove(&key);
            }
            Value::Object(child) => {
                let slot = map.entry(key).or_insert(Value::Null);
                strategic_merge_map(slot, child, &child_path);
            }
            Value::Array(items) => match merge_key(&child_path) {
                Some(merge_key) => {
                    let slot = map.entry(key).or_insert(Value::Array(Vec::new()));
                    strategic_merge_list(slot, items, merge_key, &child_path);
                }
                None if key == "finalizers" => {
                    // metadata.finalizers merges as a set.
                    let slot = map.entry(key).or_insert(Value::Array(Vec::new()));
                    if let Value::Array(list) = slot {
                        for item in items {
                            if !list.contains(&item) {
                                list.push(item);
                            }
                        }
                    }
                }
                None => {
                    map.insert(key, Value::Array(items));
                }
            },
            other => {
                map.insert(key, other);
            }
        }
    }
}

fn strategic_merge_list(target: &mut Value, items: Vec<Value>, merge_key: &str, path: &str) {
    if !target.is_array() {
        *target = Value::Array(Vec::new());
    }
    let Value::Array(list) = target else { return };
    for item in items {
        let Value::Object(mut item) = item else {
            list.push(item);
            continue;
        };
        let Some(key_value) = item.get(merge_key).cloned() else {
            list.push(Value::Object(item));
            continue;
        };
        let position = list
            .iter()
            .position(|e| e.get(merge_key) == Some(&key_value));
        let directive = item
            .get("$patch")
            .and_then(Value::as_str)
            .map(str::to_owned);
        match (directive.as_deref(), position) {
            (Some("delete"), Some(index)) => {
                list.remove(index);
            }
            (Some("delete"), None) => {}
            (Some("replace"), Some(index)) => {
                item.remove("$patch");
                list[index] = Value::Object(item);
            }
            (_, Some(index)) => strategic_merge_map(&mut list[index], item, path),
            (_, None) => {
                item.remove("$patch");
                let mut fresh = Value::Object(Map::new());
                strategic_merge_map(&mut fresh, item, path);
                list.push(fresh);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn strategic_merges_conditions_by_type_and_containers_by_name() {
        let pod = json!({
            "spec": {"containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "y"}]},
            "status": {"conditions": [{"type": "Ready", "status": "False"}, {"type": "PodScheduled", "status": "True"}]}
        });
        let patch = json!({
            "spec": {"containers": [{"name": "b", "image": "z"}]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}], "$setElementOrder/conditions": []}
        });
        let out = apply(PatchKind::Strategic, &pod, patch.to_string().as_bytes()).unwrap();
        assert_eq!(out["spec"]["containers"][0]["image"], "x");
        assert_eq!(out["spec"]["containers"][1]["image"], "z");
        assert_eq!(out["status"]["conditions"][0]["status"], "True");
        assert_eq!(out["status"]["conditions"][1]["type"], "PodScheduled");

        let merge = apply(PatchKind::Merge, &pod, patch.to_string().as_bytes()).unwrap();
        assert_eq!(merge["spec"]["containers"].as_array().unwrap().len(), 1);
    }

    #[test]
    fn strategic_merges_a_webhook_configurations_webhooks_by_name() {
        let config = json!({"webhooks": [
            {"name": "a", "rules": [{"operations": ["CREATE"]}], "clientConfig": {"service": {"name": "s"}}},
            {"name": "b", "rules": []},
        ]});
        // What the extender sends to publish its CA: only the names and the caBundle.
        let patch = json!({"webhooks": [{"name": "a", "clientConfig": {"caBundle": "Q0E="}}]});
        let out = apply(PatchKind::Strategic, &config, patch.to_string().as_bytes()).unwrap();
        assert_eq!(out["webhooks"].as_array().unwrap().len(), 2);
        assert_eq!(out["webhooks"][0]["rules"][0]["operations"][0], "CREATE");
        assert_eq!(out["webhooks"][0]["clientConfig"]["service"]["name"], "s");
        assert_eq!(out["webhooks"][0]["clientConfig"]["caBundle"], "Q0E=");
    }

    #[test]
    fn strategic_delete_directive_and_null() {
        let obj = json!({"metadata": {"labels": {"a": "1", "b": "2"}}, "status": {"conditions": [{"type": "X"}]}});
        let patch = json!({"metadata": {"labels": {"a": null}}, "status": {"conditions": [{"type": "X", "$patch": "delete"}]}});
        let out = apply(PatchKind::Strategic, &obj, patch.to_string().as_bytes()).unwrap();
        assert_eq!(out["metadata"]["labels"], json!({"b": "2"}));
        assert_eq!(out["status"]["conditions"], json!([]));
    }

    #[test]
    fn json_patch_and_errors() {
        let obj = json!({"metadata": {"annotations": {}}});
        let patch = json!([{"op": "add", "path": "/metadata/annotations/k", "value": "v"}]);
        let out = apply(PatchKind::Json, &obj, patch.to_string().as_bytes()).unwrap();
        assert_eq!(out["metadata"]["annotations"]["k"], "v");
        let code = |kind, body: &[u8]| apply(kind, &obj, body).unwrap_err().code;
        let bad = json!([{"op": "test", "path": "/metadata/annotations/k", "value": "v"}]);
        assert_eq!(code(PatchKind::Json, bad.to_string().as_bytes()), 422);
        assert_eq!(code(PatchKind::Merge, b"{nope"), 400);
        let apply_patch = PatchKind::from_content_type("application/apply-patch+yaml");
        assert_eq!(apply_patch.unwrap_err().code, 415);
    }
}
