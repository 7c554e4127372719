//! The discovery documents kubectl reads before anything else (`/version`, `/api`, `/apis`,
//! and one resource list per group/version), plus the synthetic namespaces.
//!
//! Aggregated discovery (`Accept: ...;as=APIGroupDiscoveryList`) is not offered: the answer is
//! always plain JSON with `Content-Type: application/json`, which clients take as "fall back to
//! the legacy documents".

use serde_json::{Value, json};

pub(crate) fn version() -> Value {
    json!({
        "major": "1",
        "minor": "36",
        "emulationMajor": "1",
        "emulationMinor": "36",
        "minCompatibilityMajor": "1",
        "minCompatibilityMinor": "35",
        "gitVersion": "v1.36.0-gpushare-sim",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "go1.25",
        "compiler": "gc",
        "platform": "linux/amd64"
    })
}

pub(crate) fn core_versions(server: &str) -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server}]
    })
}

fn group(name: &str, version: &str) -> Value {
    let gv = format!("{name}/{version}");
    json!({
        "name": name,
        "versions": [{"groupVersion": gv, "version": version}],
        "preferredVersion": {"groupVersion": gv, "version": version}
    })
}

pub(crate) fn groups() -> Value {
    json!({
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [
            group("admissionregistration.k8s.io", "v1"),
            group("coordination.k8s.io", "v1"),
            group("events.k8s.io", "v1"),
            group("resource.k8s.io", "v1"),
            group("scheduling.k8s.io", "v1")
        ]
    })
}

/// The `APIGroup` document at `/apis/{group}`.
pub(crate) fn group_doc(name: &str) -> Option<Value> {
    matches!(
        name,
        "admissionregistration.k8s.io"
            | "coordination.k8s.io"
            | "events.k8s.io"
            | "resource.k8s.io"
            | "scheduling.k8s.io"
    )
    .then(|| {
        let mut doc = group(name, "v1");
        doc["kind"] = json!("APIGroup");
        doc["apiVersion"] = json!("v1");
        doc
    })
}

fn resource(name: &str, kind: &str, namespaced: bool, verbs: &[&str], short: &[&str]) -> Value {
    let mut r = json!({
        "name": name,
        "singularName": if name.contains('/') { "" } else { name.trim_end_matches('s') },
        "namespaced": namespaced,
        "kind": kind,
        "verbs": verbs,
    });
    if !short.is_empty() {
        r["shortNames"] = json!(short);
    }
    if !name.contains('/') {
        r["categories"] = json!(["all"]);
    }
    r
}

const RW: &[&str] = &[
    "create", "delete", "get", "list", "patch", "update", "watch",
];

pub(crate) fn resources(group_version: &str) -> Option<Value> {
    let list = match group_version {
        "v1" => vec![
            resource("namespaces", "Namespace", false, &["get", "list"], &["ns"]),
            resource("nodes", "Node", false, RW, &["no"]),
            resource(
                "nodes/status",
                "Node",
                false,
                &["get", "patch", "update"],
                &[],
            ),
            resource("pods", "Pod", true, RW, &["po"]),
            resource("pods/binding", "Binding", true, &["create"], &[]),
            resource("pods/eviction", "Eviction", true, &["create"], &[]),
            resource("pods/status", "Pod", true, &["get", "patch", "update"], &[]),
            resource("events", "Event", true, RW, &["ev"]),
        ],
        "coordination.k8s.io/v1" => vec![resource("leases", "Lease", true, RW, &[])],
        "admissionregistration.k8s.io/v1" => vec![resource(
            "mutatingwebhookconfigurations",
            "MutatingWebhookConfiguration",
            false,
            RW,
            &[],
        )],
        "events.k8s.io/v1" => vec![resource("events", "Event", true, RW, &["ev"])],
        "scheduling.k8s.io/v1" => vec![resource(
            "priorityclasses",
            "PriorityClass",
            false,
            RW,
            &["pc"],
        )],
        "resource.k8s.io/v1" => vec![
            resource("resourceclaims", "ResourceClaim", true, RW, &[]),
            resource(
                "resourceclaims/status",
                "ResourceClaim",
                true,
                &["get", "patch", "update"],
                &[],
            ),
            resource("resourceslices", "ResourceSlice", false, RW, &[]),
        ],
        _ => return None,
    };
    Some(json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": list,
    }))
}

/// A stable UID per namespace name (FNV-1a of the name), so repeated reads agree.
fn namespace_uid(name: &str) -> String {
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("00000000-0000-4000-8000-{:012x}", hash & 0xffff_ffff_ffff)
}

/// Any namespace exists and is Active: gpushare never manages namespaces, and clients that
/// check for one (kubectl sometimes does) should find it.
pub(crate) fn namespace(name: &str) -> Value {
    json!({
        "kind": "Namespace",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "uid": namespace_uid(name),
            "resourceVersion": "1",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"kubernetes.io/metadata.name": name}
        },
        "spec": {"finalizers": ["kubernetes"]},
        "status": {"phase": "Active"}
    })
}
