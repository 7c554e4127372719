//! The pod status writer: what kubelet's status manager writes once a pod is admitted
//! (Running, with container statuses) or rejected (Failed), retried until it lands.
//!
//! Separate because the writes outlive the admission that asked for them: each runs in a
//! task of its own, so a slow API server never holds the admission loop.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, Pod};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};

/// Writes the pod's status without waiting, as kubelet's status manager does: until it
/// lands or the pod is gone. (kubelet retries a failed write at its next status sync; the
/// extender and the device plugin read a pod's `startTime` as "admitted", so a status
/// that is given up on would leave the pod looking unadmitted for good.)
pub(super) fn write_status(client: &Client, ns: &str, name: &str, status: serde_json::Value) {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let name = name.to_owned();
    tokio::spawn(async move {
        let patch = serde_json::json!({ "status": status });
        for attempt in 0u32.. {
            match api
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => return,
                Err(kube::Error::Api(status)) if status.code == 404 => return,
                Err(err) => {
                    tracing::warn!(pod = %name, error = %err, attempt, "pod status write failed; retrying");
                    let backoff = Duration::from_millis(50 << attempt.min(4));
                    tokio::time::sleep(backoff.min(Duration::from_secs(1))).await;
                }
            }
        }
    });
}

/// Status of a pod whose containers all started.
pub(super) fn running_status(pod: &Pod) -> serde_json::Value {
    let now = jiff::Timestamp::now().to_string();
    let Some(spec) = &pod.spec else {
        return serde_json::json!({ "phase": "Running", "startTime": now });
    };
    // App containers started and running; init containers completed (no `started`).
    let status = |c: &Container, state: &serde_json::Value| {
        let mut status = serde_json::json!({
            "name": c.name, "image": c.image.clone().unwrap_or_default(), "imageID": "",
            "ready": true, "restartCount": 0, "state": state,
        });
        if state.get("running").is_some() {
            status["started"] = true.into();
        }
        status
    };
    let running = serde_json::json!({ "running": { "startedAt": now } });
    let completed = serde_json::json!({ "terminated": { "exitCode": 0, "reason": "Completed", "startedAt": now, "finishedAt": now } });
    let containers: Vec<_> = spec
        .containers
        .iter()
        .map(|c| status(c, &running))
        .collect();
    let init: Vec<_> = (spec.init_containers.iter().flatten())
        .map(|c| status(c, &completed))
        .collect();
    serde_json::json!({
        "phase": "Running",
        "startTime": now,
        "conditions": [{ "type": "Ready", "status": "True", "lastTransitionTime": now }],
        "containerStatuses": containers,
        "initContainerStatuses": init,
    })
}
