//! `/version` and the synthetic namespaces. No discovery documents (`/api`, `/apis`): no
//! client of this server discovers; kubectl runs only against the real cluster.

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

/// A stable UID per namespace name (FNV-1a of the name), so repeated reads agree.
fn namespace_uid(name: &str) -> String {
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("00000000-0000-4000-8000-{:012x}", hash & 0xffff_ffff_ffff)
}

/// Any namespace exists and is Active: gpushare never manages namespaces, and clients that
/// check for one should find it.
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
