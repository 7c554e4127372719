//! The cluster the load harness and the memory instrument build: node names and the
//! already-bound pods, with the annotations the extender and the device plugin leave behind.

use crate::fixtures::{PodBuilder, node, pod};
use gpushare_contract::{ContainerRequest, Keys, PodAllocation};
use k8s_openapi::api::core::v1::{Node, Pod};

/// Largest GiB of an already-bound pod (sizes are 1..=this).
pub const MAX_BOUND_GIB: u64 = 2;

/// Name of node `i`.
pub fn node_name(i: usize) -> String {
    format!("load-node-{i:05}")
}

/// `count` nodes labelled gpushare=true, each with `gpus` GPUs of `gpu_gib`.
pub fn gpushare_nodes(count: usize, gpus: u32, gpu_gib: u64) -> Vec<Node> {
    let sizes = vec![gpu_gib; gpus as usize];
    (0..count)
        .map(|i| node(&node_name(i)).gpushare().gpus(&sizes).build())
        .collect()
}

/// [`bound_pod`] as the API server lists it: with a UUID-shaped UID of its own.
pub fn listed_bound_pod(i: usize, nodes: usize, gpus: u32, keys: &Keys, bind_time: &str) -> Pod {
    let mut pod = bound_pod(i, nodes, gpus, keys, bind_time).build();
    pod.metadata.uid = Some(format!("{i:08x}-0000-4000-8000-{i:012x}"));
    pod
}

/// Bound pod `i`: spread round-robin over `nodes` nodes, then over each node's `gpus` GPUs,
/// 1–2 GiB, carrying the annotations the extender and the device plugin would have left.
pub fn bound_pod(i: usize, nodes: usize, gpus: u32, keys: &Keys, bind_time: &str) -> PodBuilder {
    let node = node_name(i % nodes.max(1));
    let slot = i / nodes.max(1);
    let gpu = u32::try_from(slot % gpus.max(1) as usize).unwrap_or(0);
    let gib = 1 + (i as u64 % MAX_BOUND_GIB);
    // The UUID the node fixture publishes for this GPU.
    let uuid = format!("GPU-{node}-{gpu}");
    let placed = Placed {
        node: &node,
        gpu,
        uuid: &uuid,
        gib,
    };
    allocated_pod(&format!("bound-{i:06}"), &placed, true, keys, bind_time)
}

/// Where a pod of one `main` container was placed.
#[derive(Debug, Clone, Copy)]
pub struct Placed<'a> {
    pub node: &'a str,
    pub gpu: u32,
    pub uuid: &'a str,
    /// GiB asked for and held.
    pub gib: u64,
}

/// A pod of one `main` container bound as `placed`, with the extender's allocation
/// annotations; `allocated` adds the device plugin's mark (the container got its GPU).
pub fn allocated_pod(
    name: &str,
    placed: &Placed<'_>,
    allocated: bool,
    keys: &Keys,
    bind_time: &str,
) -> PodBuilder {
    let allocation = PodAllocation {
        more_gpus: Vec::new(),
        exclusive: false,
        gpu_index: placed.gpu,
        gpu_uuid: placed.uuid.to_owned(),
        pod_gib: placed.gib,
        containers: vec![ContainerRequest {
            name: "main".to_owned(),
            gib: placed.gib,
            init: false,
            compute: 0,
        }],
        bind_time: bind_time.to_owned(),
        assigned: allocated,
        allocated: if allocated {
            vec!["main".to_owned()]
        } else {
            Vec::new()
        },
        signature: None,
        compute: 0,
    };
    allocation.to_annotations(keys).iter().fold(
        pod(name).gpu_mem(placed.gib).on_node(placed.node),
        |builder, (k, v)| builder.annotation(k, v),
    )
}
