//! Test fixtures shared by the measure's unit tests: a node from its GPUs' free GiB, a
//! shape from its GiB and cores.

use super::{Host, NodeFree, Shape};

pub(super) fn node(
    free: &[u64],
    host: Host,
) -> NodeFree<impl Fn(usize) -> Option<(u64, u64)> + '_> {
    NodeFree {
        gpus: free.len(),
        free: move |i| free.get(i).map(|free| (*free, 16)),
        host,
    }
}

pub(super) fn shape(gpu_gib: u64, cores: u64) -> Shape {
    Shape {
        gpu_gib,
        host: Host::new(cores * 1000, cores * 4096),
    }
}
