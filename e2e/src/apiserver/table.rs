//! Server-side printing: `meta.k8s.io/v1` `Table` answers for clients that ask for one
//! (`Accept: application/json;as=Table;v=v1;g=meta.k8s.io`), which is what `kubectl get`
//! prints. Columns follow the real server's for pods and nodes; other resources get
//! Name and Age.

use http::HeaderMap;
use serde_json::{Value, json};

use super::objects::meta_str;
use super::resources::Kind;

/// What each row carries besides its cells (`includeObject`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Include {
    None,
    Metadata,
    Object,
}

/// Whether the client asked for a Table, and with what rows.
pub(crate) fn requested(headers: &HeaderMap, include: Option<&str>) -> Option<Include> {
    let accept = headers
        .get_all(http::header::ACCEPT)
        .iter()
        .filter_map(|h| h.to_str().ok())
        .collect::<Vec<_>>()
        .join(",");
    let wants = accept.split(',').any(|media| {
        let params: Vec<&str> = media.split(';').map(str::trim).collect();
        params.contains(&"as=Table") && params.contains(&"g=meta.k8s.io")
    });
    let include = match include {
        Some("None") => Include::None,
        Some("Object") => Include::Object,
        _ => Include::Metadata,
    };
    wants.then_some(include)
}

fn column(name: &str, kind: &str, format: &str, priority: u32, description: &str) -> Value {
    json!({"name": name, "type": kind, "format": format, "description": description, "priority": priority})
}

fn columns(kind: Kind) -> Vec<Value> {
    let name = column(
        "Name",
        "string",
        "name",
        0,
        "Name must be unique within a namespace.",
    );
    let age = column("Age", "string", "", 0, "CreationTimestamp of the object.");
    match kind {
        Kind::Pod => pod_columns(name, age),
        Kind::Node => node_columns(name, age),
        Kind::Event | Kind::EventV1 => vec![
            name,
            column("Type", "string", "", 0, "Type of this event."),
            column("Reason", "string", "", 0, "Why the action was taken."),
            column("Object", "string", "", 0, "The object this event is about."),
            column("Message", "string", "", 0, "A human-readable description."),
            age,
        ],
        Kind::Lease => vec![
            name,
            column("Holder", "string", "", 0, "The holder of the lease."),
            age,
        ],
        Kind::ResourceSlice | Kind::ResourceClaim | Kind::PriorityClass => vec![name, age],
        Kind::MutatingWebhookConfiguration => vec![
            name,
            column(
                "Webhooks",
                "integer",
                "",
                0,
                "Webhooks in the configuration.",
            ),
            age,
        ],
    }
}

/// The real server's pod columns, between the `name` and `age` columns given.
fn pod_columns(name: Value, age: Value) -> Vec<Value> {
    vec![
        name,
        column(
            "Ready",
            "string",
            "",
            0,
            "The aggregate readiness state of this pod for accepting traffic.",
        ),
        column(
            "Status",
            "string",
            "",
            0,
            "The aggregate status of the containers in this pod.",
        ),
        column(
            "Restarts",
            "string",
            "",
            0,
            "The number of times the containers in this pod have been restarted.",
        ),
        age,
        column("IP", "string", "", 1, "IP address allocated to the pod."),
        column(
            "Node",
            "string",
            "",
            1,
            "Name of the Node this pod is assigned to.",
        ),
        column(
            "Nominated Node",
            "string",
            "",
            1,
            "Name of the node nominated for this pod.",
        ),
        column("Readiness Gates", "string", "", 1, "Pod readiness gates."),
    ]
}

/// The real server's node columns, around the `name` and `age` columns given.
fn node_columns(name: Value, age: Value) -> Vec<Value> {
    vec![
        name,
        column("Status", "string", "", 0, "The status of the node."),
        column("Roles", "string", "", 0, "The roles of the node."),
        age,
        column(
            "Version",
            "string",
            "",
            0,
            "Kubelet Version reported by the node.",
        ),
        column("Internal-IP", "string", "", 1, "Internal IP of the node."),
    ]
}

/// `5s`, `3m20s`, `4h`, `2d`, as `kubectl get` shows ages.
fn age(object: &Value) -> String {
    let Some(created) =
        meta_str(object, "creationTimestamp").and_then(|t| t.parse::<jiff::Timestamp>().ok())
    else {
        return "<unknown>".to_owned();
    };
    let seconds = jiff::Timestamp::now()
        .as_second()
        .saturating_sub(created.as_second())
        .max(0);
    match seconds {
        s if s < 120 => format!("{s}s"),
        s if s < 600 => format!("{}m{}s", s / 60, s % 60),
        s if s < 3 * 3600 => format!("{}m", s / 60),
        s if s < 48 * 3600 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

fn text(object: &Value, pointer: &str) -> String {
    object
        .pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned()
}

fn or_none(s: String) -> String {
    if s.is_empty() { "<none>".to_owned() } else { s }
}

fn cells(kind: Kind, object: &Value) -> Vec<Value> {
    let name = json!(meta_str(object, "name").unwrap_or(""));
    match kind {
        Kind::Pod => pod_cells(name, object),
        Kind::Node => node_cells(name, object),
        Kind::Event | Kind::EventV1 => event_cells(kind, name, object),
        Kind::Lease => vec![
            name,
            json!(text(object, "/spec/holderIdentity")),
            json!(age(object)),
        ],
        Kind::ResourceSlice | Kind::ResourceClaim | Kind::PriorityClass => {
            vec![name, json!(age(object))]
        }
        Kind::MutatingWebhookConfiguration => vec![
            name,
            json!(object["webhooks"].as_array().map_or(0, Vec::len)),
            json!(age(object)),
        ],
    }
}

/// A pod's row: Ready (`ready/total`), Status (Terminating, else the reason, else the
/// phase), Restarts, Age, IP, Node, Nominated Node, Readiness Gates.
fn pod_cells(name: Value, object: &Value) -> Vec<Value> {
    let statuses = object
        .pointer("/status/containerStatuses")
        .and_then(Value::as_array);
    let total = object
        .pointer("/spec/containers")
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    let ready = statuses.map_or(0, |s| {
        s.iter()
            .filter(|c| c.get("ready").and_then(Value::as_bool) == Some(true))
            .count()
    });
    let restarts: i64 = statuses.map_or(0, |s| {
        s.iter()
            .filter_map(|c| c.get("restartCount").and_then(Value::as_i64))
            .sum()
    });
    let status = if object.pointer("/metadata/deletionTimestamp").is_some() {
        "Terminating".to_owned()
    } else {
        let reason = text(object, "/status/reason");
        if reason.is_empty() {
            text(object, "/status/phase")
        } else {
            reason
        }
    };
    vec![
        name,
        json!(format!("{ready}/{total}")),
        json!(status),
        json!(restarts),
        json!(age(object)),
        json!(or_none(text(object, "/status/podIP"))),
        json!(or_none(text(object, "/spec/nodeName"))),
        json!(or_none(text(object, "/status/nominatedNodeName"))),
        json!("<none>"),
    ]
}

/// A node's row: Status (Ready or NotReady, `,SchedulingDisabled` when cordoned), Roles,
/// Age, Version, Internal-IP.
fn node_cells(name: Value, object: &Value) -> Vec<Value> {
    let conditions = object
        .pointer("/status/conditions")
        .and_then(Value::as_array);
    let ready = conditions.is_some_and(|c| {
        c.iter().any(|c| {
            c.get("type").and_then(Value::as_str) == Some("Ready")
                && c.get("status").and_then(Value::as_str) == Some("True")
        })
    });
    let mut status = if ready { "Ready" } else { "NotReady" }.to_owned();
    if object
        .pointer("/spec/unschedulable")
        .and_then(Value::as_bool)
        == Some(true)
    {
        status.push_str(",SchedulingDisabled");
    }
    let roles: Vec<&str> = object
        .pointer("/metadata/labels")
        .and_then(Value::as_object)
        .map(|labels| {
            labels
                .keys()
                .filter_map(|k| k.strip_prefix("node-role.kubernetes.io/"))
                .collect()
        })
        .unwrap_or_default();
    let internal_ip = object
        .pointer("/status/addresses")
        .and_then(Value::as_array)
        .and_then(|a| {
            a.iter()
                .find(|a| a.get("type").and_then(Value::as_str) == Some("InternalIP"))
        })
        .and_then(|a| a.get("address").and_then(Value::as_str))
        .unwrap_or("")
        .to_owned();
    vec![
        name,
        json!(status),
        json!(or_none(roles.join(","))),
        json!(age(object)),
        json!(text(object, "/status/nodeInfo/kubeletVersion")),
        json!(or_none(internal_ip)),
    ]
}

/// An event's row (core/v1 `involvedObject`/`message`, or `events.k8s.io/v1`
/// `regarding`/`note`): Type, Reason, Object (`kind/name`), Message, Age.
fn event_cells(kind: Kind, name: Value, object: &Value) -> Vec<Value> {
    let about = if kind == Kind::Event {
        "/involvedObject"
    } else {
        "/regarding"
    };
    let message = if kind == Kind::Event {
        "/message"
    } else {
        "/note"
    };
    vec![
        name,
        json!(text(object, "/type")),
        json!(text(object, "/reason")),
        json!(format!(
            "{}/{}",
            text(object, &format!("{about}/kind")).to_lowercase(),
            text(object, &format!("{about}/name"))
        )),
        json!(text(object, message)),
        json!(age(object)),
    ]
}

fn row(kind: Kind, object: &Value, include: Include) -> Value {
    let mut row = json!({"cells": cells(kind, object)});
    match include {
        Include::None => {}
        Include::Metadata => {
            row["object"] = json!({
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": object.get("metadata").cloned().unwrap_or_default(),
            });
        }
        Include::Object => row["object"] = object.clone(),
    }
    row
}

/// A Table of `objects`, with the list metadata (`resourceVersion`, `continue`) given.
pub(crate) fn table(kind: Kind, objects: &[Value], metadata: Value, include: Include) -> Value {
    json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": metadata,
        "columnDefinitions": columns(kind),
        "rows": objects.iter().map(|o| row(kind, o, include)).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiation_and_rows() {
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::ACCEPT,
            "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"
                .parse()
                .unwrap(),
        );
        assert_eq!(requested(&headers, None), Some(Include::Metadata));
        assert_eq!(requested(&headers, Some("Object")), Some(Include::Object));
        assert_eq!(requested(&HeaderMap::new(), None), None);

        let pod = json!({"metadata": {"name": "a", "deletionTimestamp": "2026-01-01T00:00:00Z"},
                         "spec": {"containers": [{"name": "c"}], "nodeName": "n1"},
                         "status": {"phase": "Running"}});
        let t = table(Kind::Pod, &[pod], json!({}), Include::Metadata);
        let cells = &t["rows"][0]["cells"];
        assert_eq!(cells[0], "a");
        assert_eq!(cells[1], "0/1");
        assert_eq!(cells[2], "Terminating");
        assert_eq!(cells[6], "n1");
        assert_eq!(t["rows"][0]["object"]["kind"], "PartialObjectMetadata");
    }
}
