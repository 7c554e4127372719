//! `metadata.managedFields`, as the real API server's field manager writes it on every create,
//! update and patch: one entry per (manager, operation, subresource), each with the set of
//! fields that manager last set, in the `FieldsV1` format.
//!
//! Why the in-process server keeps them: they are part of every object a client reads and of
//! every watch event, often as large as the rest of a pod, and clients pay to decode them. A
//! server without them would make watches look cheaper than they are on a real cluster.
//!
//! What is modelled: the manager is the request's `fieldManager` or the User-Agent up to its
//! first `/` (upstream's `prefixFromUserAgent`); a create owns every field of the defaulted
//! object except the identity the server sets (and `status`, which a create of a kind with a
//! status subresource cannot set); an update or patch adds the fields whose values it changed
//! to its manager's entry. List items are keyed by `name` (containers, env, volumes…), `type`
//! (conditions) or `uid` (owner references); other lists are owned whole. Not modelled: taking
//! changed fields away from the other managers, and server-side apply (`operation: Apply`).
//! Bindings and evictions do not go through the field manager, as upstream.

use serde_json::{Map, Value, json};

use super::objects::now;

/// Metadata the server sets, never owned by a manager.
const SERVER_METADATA: [&str; 8] = [
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "creationTimestamp",
    "generation",
    "managedFields",
    "deletionTimestamp",
];

/// The field manager of a write: `?fieldManager=`, else the User-Agent's product.
pub(crate) fn manager(field_manager: Option<&str>, user_agent: Option<&str>) -> String {
    let name = match field_manager.filter(|m| !m.is_empty()) {
        Some(name) => name,
        None => user_agent
            .and_then(|agent| agent.split('/').next())
            .unwrap_or(""),
    };
    name.chars().take(128).collect()
}

/// Records a create: `object` (defaulted, about to be stored) gets one entry owning its fields.
pub(crate) fn track_create(object: &mut Value, manager: &str, has_status: bool) {
    let mut owned = Value::Object(Map::new());
    if let Some(map) = object.as_object() {
        let mut fields = Map::new();
        for (key, value) in map {
            match key.as_str() {
                "apiVersion" | "kind" => {}
                "status" if has_status => {}
                "metadata" => {
                    let metadata = strip_server_metadata(value);
                    if metadata.as_object().is_some_and(|m| !m.is_empty()) {
                        fields.insert(format!("f:{key}"), field_set(&metadata, false));
                    }
                }
                _ => {
                    fields.insert(format!("f:{key}"), field_set(value, false));
                }
            }
        }
        owned = Value::Object(fields);
    }
    let entry = entry(object, manager, None, owned);
    set_entries(object, vec![entry]);
}

/// Records an update or patch of `current` into `new` (`new` carries `current`'s entries):
/// the fields whose values changed join the manager's entry for `subresource`.
pub(crate) fn track_update(
    current: &Value,
    new: &mut Value,
    manager: &str,
    subresource: Option<&str>,
) {
    let changed = changed_fields(current, new, true);
    let mut entries: Vec<Value> = current
        .pointer("/metadata/managedFields")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if changed.as_object().is_none_or(Map::is_empty) {
        set_entries(new, entries);
        return;
    }
    let api_version = new.get("apiVersion").cloned().unwrap_or(Value::Null);
    let mine = entries.iter_mut().find(|e| {
        e.get("manager").and_then(Value::as_str) == Some(manager)
            && e.get("operation").and_then(Value::as_str) == Some("Update")
            && e.get("subresource").and_then(Value::as_str) == subresource
            && e.get("apiVersion") == Some(&api_version)
    });
    match mine {
        Some(entry) => {
            let mut owned = entry.get("fieldsV1").cloned().unwrap_or_else(|| json!({}));
            merge(&mut owned, &changed);
            entry["fieldsV1"] = owned;
            entry["time"] = json!(now());
        }
        None => entries.push(entry(new, manager, subresource, changed)),
    }
    set_entries(new, entries);
}

/// Copies `current`'s entries onto `new`, so that comparing the two sees only real changes.
pub(crate) fn keep_entries(current: &Value, new: &mut Value) {
    let entries = current
        .pointer("/metadata/managedFields")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    set_entries(new, entries);
}

fn entry(object: &Value, manager: &str, subresource: Option<&str>, owned: Value) -> Value {
    let mut entry = json!({
        "manager": manager,
        "operation": "Update",
        "apiVersion": object.get("apiVersion").cloned().unwrap_or(Value::Null),
        "time": now(),
        "fieldsType": "FieldsV1",
        "fieldsV1": owned,
    });
    if let Some(subresource) = subresource {
        entry["subresource"] = json!(subresource);
    }
    entry
}

fn set_entries(object: &mut Value, entries: Vec<Value>) {
    let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) else {
        return;
    };
    if entries.is_empty() {
        meta.remove("managedFields");
    } else {
        meta.insert("managedFields".into(), Value::Array(entries));
    }
}

fn strip_server_metadata(metadata: &Value) -> Value {
    let mut metadata = metadata.clone();
    if let Some(map) = metadata.as_object_mut() {
        for key in SERVER_METADATA {
            map.remove(key);
        }
    }
    metadata
}

/// The `FieldsV1` set of `value`: `{}` for a leaf, `f:<key>` per map field, `k:<key>` per list
/// item with a key; `dot` adds the `.` entry a set map or list item carries for itself.
fn field_set(value: &Value, dot: bool) -> Value {
    match value {
        Value::Object(map) => {
            let mut set = Map::new();
            if dot {
                set.insert(".".into(), json!({}));
            }
            for (key, child) in map {
                set.insert(format!("f:{key}"), field_set(child, true));
            }
            Value::Object(set)
        }
        Value::Array(items) => match items.iter().map(item_key).collect::<Option<Vec<_>>>() {
            Some(keys) if !keys.is_empty() => {
                let mut set = Map::new();
                for (key, item) in keys.into_iter().zip(items) {
                    set.insert(key, field_set(item, true));
                }
                Value::Object(set)
            }
            _ => json!({}),
        },
        _ => json!({}),
    }
}

/// `k:{"name":"c"}` for an item of a list keyed by name, type or uid; `None` otherwise.
fn item_key(item: &Value) -> Option<String> {
    let map = item.as_object()?;
    ["name", "type", "uid"].iter().find_map(|field| {
        let value = map.get(*field)?.as_str()?;
        Some(format!("k:{}", json!({ *field: value })))
    })
}

/// The fields of `new` whose values differ from `old`'s, as a `FieldsV1` set.
fn changed_fields(old: &Value, new: &Value, top: bool) -> Value {
    let mut set = Map::new();
    let (Some(old_map), Some(new_map)) = (old.as_object(), new.as_object()) else {
        return field_set(new, true);
    };
    for (key, value) in new_map {
        if top && matches!(key.as_str(), "apiVersion" | "kind") {
            continue;
        }
        let value = if top && key == "metadata" {
            strip_server_metadata(value)
        } else {
            value.clone()
        };
        let before = match old_map.get(key) {
            Some(before) if top && key == "metadata" => strip_server_metadata(before),
            Some(before) => before.clone(),
            None => {
                set.insert(format!("f:{key}"), field_set(&value, !top));
                continue;
            }
        };
        if before == value {
            continue;
        }
        let child = match (&before, &value) {
            (Value::Object(_), Value::Object(_)) => changed_fields(&before, &value, false),
            (Value::Array(old_items), Value::Array(new_items)) => {
                changed_items(old_items, new_items).unwrap_or_else(|| field_set(&value, true))
            }
            _ => field_set(&value, true),
        };
        if child.as_object().is_some_and(|c| !c.is_empty()) || !value.is_object() {
            set.insert(format!("f:{key}"), child);
        }
    }
    Value::Object(set)
}

/// Changed items of a keyed list, or `None` when the list is not keyed.
fn changed_items(old: &[Value], new: &[Value]) -> Option<Value> {
    let mut set = Map::new();
    for item in new {
        let key = item_key(item)?;
        let before = old.iter().find(|o| item_key(o).as_deref() == Some(&key));
        match before {
            Some(before) if before == item => {}
            Some(before) => {
                set.insert(key, changed_fields(before, item, false));
            }
            None => {
                set.insert(key, field_set(item, true));
            }
        }
    }
    Some(Value::Object(set))
}

/// Adds every field of `extra` to `owned`.
fn merge(owned: &mut Value, extra: &Value) {
    let (Some(owned), Some(extra)) = (owned.as_object_mut(), extra.as_object()) else {
        return;
    };
    for (key, value) in extra {
        match owned.get_mut(key) {
            Some(existing) => merge(existing, value),
            None => {
                owned.insert(key.clone(), value.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod() -> Value {
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p", "namespace": "default", "uid": "u", "resourceVersion": "7",
                         "labels": {"app": "a"}},
            "spec": {"containers": [{"name": "c", "image": "i",
                                     "resources": {"limits": {"example.com/gpu-mem": "4"}}}],
                     "tolerations": [{"key": "k", "operator": "Exists"}]},
            "status": {"phase": "Pending"}
        })
    }

    #[test]
    fn the_manager_is_the_field_manager_or_the_user_agents_product() {
        assert_eq!(
            manager(Some("kubectl-edit"), Some("kube/1.0")),
            "kubectl-edit"
        );
        assert_eq!(
            manager(None, Some("gpushare-extender/0.1 (linux)")),
            "gpushare-extender"
        );
        assert_eq!(manager(Some(""), None), "");
        assert_eq!(manager(Some(&"m".repeat(300)), None).len(), 128);
    }

    #[test]
    fn a_create_owns_every_field_it_set_but_identity_and_status() {
        let mut object = pod();
        track_create(&mut object, "kubectl", true);
        let entries = object["metadata"]["managedFields"].as_array().unwrap();
        assert_eq!(entries.len(), 1);
        let entry = &entries[0];
        assert_eq!(entry["manager"], "kubectl");
        assert_eq!(entry["operation"], "Update");
        assert_eq!(entry["apiVersion"], "v1");
        assert_eq!(entry["fieldsType"], "FieldsV1");
        assert!(entry.get("subresource").is_none());
        assert_eq!(
            entry["fieldsV1"],
            json!({
                "f:metadata": {"f:labels": {".": {}, "f:app": {}}},
                "f:spec": {"f:containers": {"k:{\"name\":\"c\"}": {
                               ".": {}, "f:image": {}, "f:name": {},
                               "f:resources": {".": {}, "f:limits": {".": {}, "f:example.com/gpu-mem": {}}}}},
                           "f:tolerations": {}}
            })
        );
    }

    #[test]
    fn an_update_adds_what_it_changed_to_its_managers_entry() {
        let mut current = pod();
        track_create(&mut current, "kubectl", true);
        // A status write by kubelet: a new entry for the status subresource.
        let mut running = current.clone();
        running["status"] =
            json!({"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]});
        track_update(&current, &mut running, "kubelet", Some("status"));
        let entries = running["metadata"]["managedFields"].as_array().unwrap();
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[1]["manager"], "kubelet");
        assert_eq!(entries[1]["subresource"], "status");
        assert_eq!(
            entries[1]["fieldsV1"],
            json!({"f:status": {"f:phase": {}, "f:conditions": {"k:{\"type\":\"Ready\"}": {".": {}, "f:type": {}, "f:status": {}}}}})
        );
        // An annotation patch by the same kubelet on the main resource: a third entry; a second
        // one merges into it; the resourceVersion the server bumps is never owned.
        let mut annotated = running.clone();
        annotated["metadata"]["annotations"] = json!({"a": "1"});
        annotated["metadata"]["resourceVersion"] = json!("8");
        track_update(&running, &mut annotated, "kubelet", None);
        let mut twice = annotated.clone();
        twice["metadata"]["annotations"]["b"] = json!("2");
        track_update(&annotated, &mut twice, "kubelet", None);
        let entries = twice["metadata"]["managedFields"].as_array().unwrap();
        assert_eq!(entries.len(), 3);
        assert_eq!(
            entries[2]["fieldsV1"],
            json!({"f:metadata": {"f:annotations": {".": {}, "f:a": {}, "f:b": {}}}})
        );
        // Nothing changed: no entry moves.
        let mut same = twice.clone();
        track_update(&twice, &mut same, "someone", None);
        assert_eq!(same, twice);
    }
}
