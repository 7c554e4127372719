//! What the real server does to an object between the request body and storage: defaulting,
//! validation (422 Invalid), server-owned metadata, and which parts an update may change.

use rand::Rng;
use serde_json::{Map, Value, json};

use super::resources::Kind;
use super::status::{ApiError, ApiResult};

/// Termination grace the real server defaults a pod to.
pub(crate) const DEFAULT_GRACE_SECONDS: i64 = 30;

/// RFC 3339 UTC with second precision, as `metav1.Time` is written.
pub(crate) fn now() -> String {
    now_plus(0)
}

/// RFC 3339 UTC, `seconds` from now.
pub(crate) fn now_plus(seconds: i64) -> String {
    let ts = jiff::Timestamp::now();
    let later = ts
        .checked_add(jiff::SignedDuration::from_secs(seconds))
        .unwrap_or(ts);
    later.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// A random RFC 4122 version-4 UUID.
pub(crate) fn new_uid() -> String {
    let mut bytes: [u8; 16] = rand::rng().random();
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let mut uid = String::with_capacity(36);
    for (i, byte) in bytes.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            uid.push('-');
        }
        uid.push_str(&format!("{byte:02x}"));
    }
    uid
}

/// Five characters from the alphabet the real server uses for `generateName` suffixes.
pub(crate) fn name_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut rng = rand::rng();
    (0..5)
        .map(|_| char::from(ALPHABET[rng.random_range(0..ALPHABET.len())]))
        .collect()
}

pub(crate) fn meta_str<'a>(object: &'a Value, field: &str) -> Option<&'a str> {
    object.get("metadata")?.get(field)?.as_str()
}

/// The string at JSON `pointer`, if there is one.
pub(crate) fn str_at<'a>(object: &'a Value, pointer: &str) -> Option<&'a str> {
    object.pointer(pointer)?.as_str()
}

/// Whether the object lists any `metadata.finalizers`.
pub(crate) fn has_finalizers(object: &Value) -> bool {
    object
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .is_some_and(|f| !f.is_empty())
}

/// `value` as a JSON object, replacing it with `{}` when it is anything else.
pub(crate) fn as_map(value: &mut Value) -> &mut Map<String, Value> {
    if !value.is_object() {
        *value = Value::Object(Map::new());
    }
    match value {
        Value::Object(map) => map,
        _ => unreachable!("replaced by an object just above"),
    }
}

/// The object's `metadata`, created when missing.
pub(crate) fn meta_mut(object: &mut Value) -> &mut Map<String, Value> {
    as_map(as_map(object).entry("metadata").or_insert(Value::Null))
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// A label/annotation name part: alphanumerics, `-`, `_`, `.`, starting and ending alphanumeric.
fn is_qualified_part(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && s.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric())
}

fn is_qualified_name(s: &str) -> bool {
    match s.split_once('/') {
        Some((prefix, name)) => is_dns_subdomain(prefix) && is_qualified_part(name),
        None => is_qualified_part(s),
    }
}

fn check_metadata(kind: Kind, object: &Value, causes: &mut Vec<String>) {
    let name = meta_str(object, "name").unwrap_or("");
    if name.is_empty() {
        causes.push("metadata.name: Required value: name or generateName is required".into());
    } else if !is_dns_subdomain(name) {
        causes.push(format!(
            "metadata.name: Invalid value: {name:?}: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
        ));
    }
    if kind.namespaced() {
        let ns = meta_str(object, "namespace").unwrap_or("");
        if !is_dns_label(ns) {
            causes.push(format!("metadata.namespace: Invalid value: {ns:?}: a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-'"));
        }
    }
    // Labels and annotations: qualified names as keys; label values short and plain,
    // annotation values any strings up to 256 KiB in all.
    for field in ["labels", "annotations"] {
        let Some(map) = object.pointer(&format!("/metadata/{field}")) else {
            continue;
        };
        let Some(map) = map.as_object() else {
            causes.push(format!(
                "metadata.{field}: Invalid value: must be a map of strings"
            ));
            continue;
        };
        let mut total = 0;
        for (key, value) in map {
            if !is_qualified_name(key) {
                causes.push(format!("metadata.{field}: Invalid value: {key:?}: name part must consist of alphanumeric characters, '-', '_' or '.'"));
            }
            match value.as_str() {
                Some(v) if field == "annotations" => total += key.len() + v.len(),
                Some(v) if v.is_empty() || is_qualified_part(v) => {}
                _ if field == "annotations" => causes.push(format!("metadata.annotations: Invalid value: {value}: must be a string")),
                _ => causes.push(format!("metadata.labels: Invalid value: {value}: a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', at most 63 characters")),
            }
        }
        if total > 256 * 1024 {
            causes.push("metadata.annotations: Too long: must have at most 262144 bytes".into());
        }
    }
}

/// Extended resources (anything with a domain outside kubernetes.io) must be whole numbers,
/// and requests must equal limits, as the real server insists.
fn check_resources(path: &str, container: &Value, causes: &mut Vec<String>) {
    let extended = |name: &str| {
        name.contains('/')
            && !name.starts_with("kubernetes.io/")
            && !name.contains(".kubernetes.io/")
    };
    let limits = container["resources"]["limits"].as_object();
    let requests = container["resources"]["requests"].as_object();
    for (which, map) in [("limits", limits), ("requests", requests)] {
        for (name, value) in map.into_iter().flatten() {
            if extended(name) {
                let text = match value {
                    Value::String(s) => s.clone(),
                    Value::Number(n) => n.to_string(),
                    _ => String::new(),
                };
                if text.parse::<u64>().is_err() {
                    causes.push(format!("{path}.resources.{which}[{name}]: Invalid value: {value}: must be an integer"));
                }
            }
        }
    }
    for (name, request) in requests.into_iter().flatten() {
        if extended(name) {
            match limits.and_then(|l| l.get(name)) {
                Some(limit) if limit == request => {}
                Some(limit) => causes.push(format!("{path}.resources.requests[{name}]: Invalid value: {request}: must be equal to {name} limit of {limit}")),
                None => causes.push(format!("{path}.resources.limits: Required value: Limit must be set for non overcommitable resources")),
            }
        }
    }
}

fn check_pod(pod: &Value, causes: &mut Vec<String>) {
    let containers = pod.pointer("/spec/containers").and_then(Value::as_array);
    if containers.is_none_or(|c| c.is_empty()) {
        causes.push("spec.containers: Required value".into());
    }
    let mut seen = Vec::new();
    for (list, field) in [
        (pod.pointer("/spec/initContainers"), "initContainers"),
        (pod.pointer("/spec/containers"), "containers"),
    ] {
        let Some(list) = list else { continue };
        let Some(list) = list.as_array() else {
            causes.push(format!("spec.{field}: Invalid value: must be a list"));
            continue;
        };
        for (i, container) in list.iter().enumerate() {
            let path = format!("spec.{field}[{i}]");
            let name = container["name"].as_str().unwrap_or("");
            if !is_dns_label(name) {
                causes.push(format!(
                    "{path}.name: Invalid value: {name:?}: must be a lowercase RFC 1123 label"
                ));
            } else if seen.contains(&name) {
                causes.push(format!("{path}.name: Duplicate value: {name:?}"));
            }
            seen.push(name);
            if container["image"].as_str().is_none_or(str::is_empty) {
                causes.push(format!("{path}.image: Required value"));
            }
            check_resources(&path, container, causes);
        }
    }
}

/// The containers' `resources.limits` and `requests` maps: (JSON pointer, field path).
fn container_quantity_maps(object: &Value) -> Vec<(String, String)> {
    let mut maps = Vec::new();
    for list in ["containers", "initContainers"] {
        let count = object
            .pointer(&format!("/spec/{list}"))
            .and_then(Value::as_array);
        for i in 0..count.map_or(0, Vec::len) {
            for which in ["limits", "requests"] {
                maps.push((
                    format!("/spec/{list}/{i}/resources/{which}"),
                    format!("spec.{list}[{i}].resources.{which}"),
                ));
            }
        }
    }
    maps
}

/// Quantities written as JSON numbers (`example.com/gpu-mem: 4` in YAML) are stored as strings,
/// as the real server's decoding does; typed clients cannot read a numeric quantity.
fn normalize_quantities(kind: Kind, object: &mut Value) {
    let pointers: Vec<String> = match kind {
        Kind::Pod => container_quantity_maps(object)
            .into_iter()
            .map(|(pointer, _)| pointer)
            .chain(["/spec/overhead".to_owned()])
            .collect(),
        Kind::Node => vec![
            "/status/capacity".to_owned(),
            "/status/allocatable".to_owned(),
        ],
        _ => Vec::new(),
    };
    for pointer in pointers {
        if let Some(Value::Object(map)) = object.pointer_mut(&pointer) {
            for value in map.values_mut() {
                if let Value::Number(n) = value {
                    *value = Value::String(n.to_string());
                }
            }
        }
    }
}

fn check_quantities(object: &Value, causes: &mut Vec<String>) {
    let maps = container_quantity_maps(object).into_iter().chain(
        ["capacity", "allocatable"]
            .map(|which| (format!("/status/{which}"), format!("status.{which}"))),
    );
    for (pointer, path) in maps {
        let Some(Value::Object(map)) = object.pointer(&pointer) else {
            continue;
        };
        for (name, value) in map {
            let ok = value.as_str().is_some_and(|q| {
                q.starts_with(|c: char| c.is_ascii_digit() || c == '.' || c == '-' || c == '+')
            });
            if !ok {
                causes.push(format!("{path}[{name}]: Invalid value: {value}: quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"));
            }
        }
    }
}

/// Fills in what the real server defaults, so that stored objects (and comparisons between
/// an update and the stored object) look like the real thing.
pub(crate) fn apply_defaults(kind: Kind, object: &mut Value) {
    if kind != Kind::Pod {
        return;
    }
    let Some(spec) = object.get_mut("spec").and_then(Value::as_object_mut) else {
        return;
    };
    spec.entry("schedulerName")
        .or_insert(json!("default-scheduler"));
    spec.entry("restartPolicy").or_insert(json!("Always"));
    spec.entry("dnsPolicy").or_insert(json!("ClusterFirst"));
    spec.entry("terminationGracePeriodSeconds")
        .or_insert(json!(DEFAULT_GRACE_SECONDS));
}

/// Turns a create request's body into the object to store. `namespace` is the request path's.
pub(crate) fn prepare_create(
    kind: Kind,
    mut object: Value,
    namespace: Option<&str>,
) -> ApiResult<Value> {
    check_type(kind, &mut object)?;
    let meta = meta_mut(&mut object);
    if let Some(ns) = namespace {
        match meta.get("namespace").and_then(Value::as_str) {
            Some(body_ns) if !body_ns.is_empty() && body_ns != ns => {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
            _ => {
                meta.insert("namespace".into(), json!(ns));
            }
        }
    } else {
        meta.remove("namespace");
    }
    let has_name = meta
        .get("name")
        .and_then(Value::as_str)
        .is_some_and(|n| !n.is_empty());
    if !has_name && let Some(prefix) = meta.get("generateName").and_then(Value::as_str) {
        let name = format!("{prefix}{}", name_suffix());
        meta.insert("name".into(), json!(name));
    }
    meta.insert("uid".into(), json!(new_uid()));
    meta.insert("creationTimestamp".into(), json!(now()));
    for server_owned in ["deletionTimestamp", "deletionGracePeriodSeconds"] {
        meta.remove(server_owned);
    }
    if kind == Kind::Pod {
        meta.insert("generation".into(), json!(1));
    }
    apply_defaults(kind, &mut object);
    if kind == Kind::Pod {
        if !object.get("status").is_some_and(Value::is_object) {
            object["status"] = json!({});
        }
        if object.pointer("/status/phase").is_none() {
            object["status"]["phase"] = json!("Pending");
        }
    }
    normalize_quantities(kind, &mut object);
    validate(kind, &object)?;
    Ok(object)
}

/// kind/apiVersion in a body must match the URL's resource when present; then they are set.
fn check_type(kind: Kind, object: &mut Value) -> ApiResult<()> {
    if !object.is_object() {
        return Err(ApiError::bad_request(
            "the body of the request must be a JSON object",
        ));
    }
    let body_kind = object["kind"].as_str().unwrap_or(kind.kind());
    let body_version = object["apiVersion"].as_str().unwrap_or(kind.api_version());
    if body_kind != kind.kind() || body_version != kind.api_version() {
        return Err(ApiError::bad_request(format!(
            "the API version in the data ({body_version}) does not match the expected API version ({}) or kind {body_kind} is not {}",
            kind.api_version(),
            kind.kind()
        )));
    }
    object["kind"] = json!(kind.kind());
    object["apiVersion"] = json!(kind.api_version());
    Ok(())
}

pub(crate) fn validate(kind: Kind, object: &Value) -> ApiResult<()> {
    let mut causes = Vec::new();
    check_metadata(kind, object, &mut causes);
    check_quantities(object, &mut causes);
    if kind == Kind::Pod {
        check_pod(object, &mut causes);
    }
    if causes.is_empty() {
        Ok(())
    } else {
        let name = meta_str(object, "name").unwrap_or("");
        Err(ApiError::invalid(kind.kind(), name, &causes))
    }
}

/// Which part of the object a write may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    /// The main resource: everything but status.
    Main,
    /// The `status` subresource: only status.
    Status,
}

/// Spec fields of a pod that an update may change (the rest is immutable after create).
fn pod_spec_mutable_view(spec: &Value) -> Value {
    let mut spec = spec.clone();
    if let Some(map) = spec.as_object_mut() {
        for field in ["activeDeadlineSeconds", "tolerations", "schedulingGates"] {
            map.remove(field);
        }
        for list in ["containers", "initContainers"] {
            if let Some(Value::Array(containers)) = map.get_mut(list) {
                for container in containers {
                    if let Some(c) = container.as_object_mut() {
                        c.remove("image");
                    }
                }
            }
        }
    }
    spec
}

/// Turns an update (PUT or patched object) into the object to store, given the stored one.
/// The caller has already checked resourceVersion and the name.
pub(crate) fn prepare_update(
    kind: Kind,
    current: &Value,
    mut new: Value,
    part: Part,
) -> ApiResult<Value> {
    check_type(kind, &mut new)?;
    normalize_quantities(kind, &mut new);
    let name = meta_str(current, "name").unwrap_or("").to_owned();
    if let (Some(body_uid), Some(uid)) = (meta_str(&new, "uid"), meta_str(current, "uid"))
        && !body_uid.is_empty()
        && body_uid != uid
    {
        return Err(ApiError::conflict(
            kind.plural(),
            &name,
            format!(
                "Precondition failed: UID in precondition: {body_uid}, UID in object meta: {uid}"
            ),
        ));
    }
    // `to`'s status becomes `from`'s, or goes when `from` has none.
    let copy_status = |from: &Value, to: &mut Value| match from.get("status") {
        Some(status) => to["status"] = status.clone(),
        None => {
            as_map(to).remove("status");
        }
    };
    let mut out = match part {
        Part::Status => {
            let mut out = current.clone();
            copy_status(&new, &mut out);
            out
        }
        Part::Main => {
            apply_defaults(kind, &mut new);
            if kind.has_status() {
                copy_status(current, &mut new);
            }
            // Server-owned metadata is the stored object's, whatever the body says.
            let current_meta = current.get("metadata").cloned().unwrap_or_default();
            let meta = meta_mut(&mut new);
            for owned in [
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "generation",
                "namespace",
                "name",
            ] {
                match current_meta.get(owned) {
                    Some(value) => meta.insert(owned.into(), value.clone()),
                    None => meta.remove(owned),
                };
            }
            if kind == Kind::Pod {
                let old_spec = current.get("spec").cloned().unwrap_or_default();
                let new_spec = new.get("spec").cloned().unwrap_or_default();
                if pod_spec_mutable_view(&old_spec) != pod_spec_mutable_view(&new_spec) {
                    return Err(ApiError::invalid(
                        "Pod",
                        &name,
                        &["spec: Forbidden: pod updates may not change fields other than `spec.containers[*].image`, `spec.initContainers[*].image`, `spec.activeDeadlineSeconds`, `spec.tolerations` (only additions to existing tolerations) or `spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)".to_owned()],
                    ));
                }
                if old_spec != new_spec {
                    let generation = current
                        .pointer("/metadata/generation")
                        .and_then(Value::as_i64)
                        .unwrap_or(1);
                    meta_mut(&mut new).insert("generation".into(), json!(generation + 1));
                }
            }
            new
        }
    };
    // The stored version is stamped on write; compare like with like.
    let rv = current
        .pointer("/metadata/resourceVersion")
        .cloned()
        .unwrap_or_default();
    meta_mut(&mut out).insert("resourceVersion".into(), rv);
    normalize_quantities(kind, &mut out);
    validate(kind, &out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod() -> Value {
        json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "main", "image": "busybox"}]}})
    }

    #[test]
    fn create_defaults_and_validates() {
        let created = prepare_create(Kind::Pod, pod(), Some("default")).unwrap();
        assert_eq!(created["status"]["phase"], "Pending");
        assert_eq!(created["spec"]["terminationGracePeriodSeconds"], 30);
        assert_eq!(created["metadata"]["namespace"], "default");
        assert_eq!(created["metadata"]["uid"].as_str().unwrap().len(), 36);

        let code = |change: &dyn Fn(&mut Value)| {
            let mut pod = pod();
            change(&mut pod);
            let error = prepare_create(Kind::Pod, pod, Some("default")).unwrap_err();
            error.code
        };
        assert_eq!(code(&|p| p["metadata"]["name"] = json!("Not_Valid")), 422);
        assert_eq!(code(&|p| p["spec"]["containers"] = json!([])), 422);
        assert_eq!(code(&|p| p["metadata"]["namespace"] = json!("other")), 400);
        let unequal = json!({"limits": {"example.com/gpu-mem": "4"}, "requests": {"example.com/gpu-mem": "2"}});
        let resources = |p: &mut Value| p["spec"]["containers"][0]["resources"] = unequal.clone();
        assert_eq!(code(&resources), 422);
    }

    #[test]
    fn update_keeps_status_and_refuses_spec_changes() {
        let current = prepare_create(Kind::Pod, pod(), Some("default")).unwrap();
        let mut new = current.clone();
        new["status"]["phase"] = json!("Running");
        new["metadata"]["labels"] = json!({"a": "b"});
        let out = prepare_update(Kind::Pod, &current, new, Part::Main).unwrap();
        assert_eq!(out["status"]["phase"], "Pending");
        assert_eq!(out["metadata"]["labels"]["a"], "b");

        let mut moved = current.clone();
        moved["spec"]["nodeName"] = json!("n1");
        let refused = prepare_update(Kind::Pod, &current, moved, Part::Main).unwrap_err();
        assert_eq!(refused.code, 422);

        let mut status = current.clone();
        status["status"]["phase"] = json!("Running");
        status["metadata"]["labels"] = json!({"ignored": "yes"});
        let out = prepare_update(Kind::Pod, &current, status, Part::Status).unwrap();
        assert_eq!(out["status"]["phase"], "Running");
        assert!(out["metadata"].get("labels").is_none());
    }
}
