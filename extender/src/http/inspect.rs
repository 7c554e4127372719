//! `GET {prefix}/inspect[/{node}]`: the view as JSON, per node and GPU with the pods on it,
//! for `kubectl gpushare` and for people.
//!
//! Why its own types: the answer is a stable wire format for the CLI, and must not change
//! shape when the allocator's or the view's types do.

use std::time::Instant;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use super::{ErrorBody, json_response};
use crate::scheduling::Scheduling;
use crate::scheduling::view::View;

/// `GET {prefix}/inspect`.
pub(super) async fn inspect_all(State(state): State<Scheduling>) -> Response {
    let started = Instant::now();
    let view = state.view();
    let mut nodes: Vec<InspectNode> = view
        .cluster
        .nodes()
        .filter(|(_, node)| node.is_present())
        .map(|(name, _)| inspect(&view, name))
        .collect();
    drop(view);
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    let response = json_response(&InspectAll { nodes });
    state.metrics().observe("inspect", started);
    response
}

/// `GET {prefix}/inspect/{node}`.
pub(super) async fn inspect_node(
    State(state): State<Scheduling>,
    Path(node): Path<String>,
) -> Response {
    let started = Instant::now();
    let view = state.view();
    let response = if view.cluster.node(&node).is_some_and(|n| n.is_present()) {
        json_response(&inspect(&view, &node))
    } else {
        (
            StatusCode::NOT_FOUND,
            Json(ErrorBody {
                error: format!("node {node} is unknown to the gpushare extender"),
            }),
        )
            .into_response()
    };
    drop(view);
    state.metrics().observe("inspect", started);
    response
}

#[derive(Serialize)]
struct InspectAll {
    nodes: Vec<InspectNode>,
}

/// One node in `inspect` output.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct InspectNode {
    name: String,
    eligible: bool,
    gpus: Vec<InspectGpu>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct InspectGpu {
    index: u32,
    uuid: String,
    model: String,
    #[serde(rename = "totalGiB")]
    total_gib: u64,
    #[serde(rename = "usedGiB")]
    used_gib: u64,
    /// Percent of the GPU's compute booked (`gpu-compute`; a whole-GPU pod books 100).
    used_compute: u32,
    healthy: bool,
    pods: Vec<InspectPod>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct InspectPod {
    namespace: String,
    name: String,
    uid: String,
    gib: u64,
    /// Percent of the GPU's compute the pod holds (0: none asked).
    compute: u32,
    assigned: bool,
    /// True while only bind's reservation, not yet the watch, knows the pod is here.
    reserved: bool,
}

fn inspect(view: &View, name: &str) -> InspectNode {
    let Some(node) = view.cluster.node(name) else {
        return InspectNode {
            name: name.to_owned(),
            eligible: false,
            gpus: Vec::new(),
        };
    };
    let mut gpus: Vec<InspectGpu> = node
        .gpus()
        .iter()
        .map(|usage| InspectGpu {
            index: usage.gpu.index,
            uuid: usage.gpu.uuid.clone(),
            model: usage.gpu.model.clone(),
            total_gib: usage.gpu.total_gib,
            used_gib: usage.used_gib,
            used_compute: usage.used_compute,
            healthy: usage.gpu.healthy,
            pods: Vec::new(),
        })
        .collect();
    // A multi-GPU pod is listed on each of its GPUs, with what it holds there.
    for (uid, placement) in node.pods() {
        let (namespace, pod_name) = view.pod_key(uid).unwrap_or(("", ""));
        for holder in node.gpus_of(placement) {
            let Some(gpu) = gpus.iter_mut().find(|g| g.index == holder.gpu.index) else {
                continue;
            };
            let gib = if placement.exclusive {
                placement.pod_gib.max(holder.gpu.total_gib)
            } else {
                placement.pod_gib
            };
            gpu.pods.push(InspectPod {
                namespace: namespace.to_owned(),
                name: pod_name.to_owned(),
                uid: uid.to_string(),
                gib,
                compute: placement.compute,
                assigned: placement.assigned,
                reserved: view.reservation(uid).is_some(),
            });
        }
    }
    for gpu in &mut gpus {
        gpu.pods
            .sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    }
    InspectNode {
        name: name.to_owned(),
        eligible: node.is_eligible(),
        gpus,
    }
}
