//! The clusters the benches time the allocator and the extender on: nodes of 8 GPUs × 32 GiB,
//! every GPU holding pods of 2 GiB as [`Fill`] says, and a full workload of learned shapes.

use gpushare_allocator::fragmentation::{Host, MAX_SHAPES, Shape};
use gpushare_allocator::{Cluster, PodId, PodPlacement};

pub const GPUS_PER_NODE: u32 = 8;
pub const GPU_GIB: u64 = 32;

/// How full each GPU is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fill {
    /// 10 pods on every GPU (12 GiB free): one free amount per node.
    Uniform,
    /// `gpu + node % 4` pods on GPU `gpu`: 8 distinct free amounts per node, the fragmentation
    /// measure's worst case (it evaluates each on its own).
    Varied,
}

/// The names of `nodes` nodes.
pub fn node_names(nodes: usize) -> Vec<String> {
    (0..nodes).map(|n| format!("node-{n:05}")).collect()
}

/// The pods on the GPUs of the nodes `names` as `fill` says: uid `{node}-{gpu}-{p}`, node,
/// placement.
pub fn filled_pods(
    names: &[String],
    fill: Fill,
) -> impl Iterator<Item = (PodId, String, PodPlacement)> + '_ {
    names.iter().enumerate().flat_map(move |(n, name)| {
        (0..GPUS_PER_NODE).flat_map(move |gpu| {
            let pods = match fill {
                Fill::Uniform => 10,
                Fill::Varied => u64::from(gpu) + n as u64 % 4,
            };
            (0..pods).map(move |p| {
                let placement = PodPlacement {
                    gpu,
                    pod_gib: 2,
                    assigned: true,
                    ..PodPlacement::default()
                };
                let uid = PodId::from(format!("{name}-{gpu}-{p}"));
                (uid, name.clone(), placement)
            })
        })
    })
}

/// A full workload of learned shapes: 1 to `MAX_SHAPES` GiB, each with a core and 4 GiB of
/// memory per GiB.
pub fn learn_full_workload(cluster: &mut Cluster) {
    for gib in 1..=MAX_SHAPES as u64 {
        let host = Host::new(gib * 1_000, gib * 4_096);
        cluster.observe(Shape { gpu_gib: gib, host });
    }
}
