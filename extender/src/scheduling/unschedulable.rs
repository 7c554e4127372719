//! Why filter left no node for a GPU pod, in the two answers an operator acts on differently
//! (`gpushare_extender_unschedulable_total{reason}`):
//!
//! ```text
//!  no node passed ─┬─ some node is short only per GPU: its healthy GPUs of a model the pod
//!                  │  allows have the memory free between them, and one is large enough
//!                  │  (Busy, TooFewFree) ─────────────────────────────────▶ fragmentation
//!                  └─ on none of them ─────────────────────────────────────▶ no_capacity
//! ```
//!
//! `fragmentation`: packing differently (moving pods between a node's GPUs, the
//! fragmentation policy, fewer pods spread thinly) would have made room. `no_capacity`: the
//! free memory is not there at all; only more GPUs or fewer pods help. A pod larger than any
//! GPU, and candidates that do not take part in sharing, count as `no_capacity` too: no
//! packing helps them (the pod's events say which).
//!
//! What is "free between them": the free GiB of every healthy GPU of an allowed model, summed,
//! against what the pod would occupy: its GiB on each of its GPUs, times their number; for
//! whole GPUs, the full size of the smallest GPUs that are large enough. Only nodes refused
//! for a memory shortfall ([`Unfit::Busy`], [`Unfit::TooFewFree`]) are looked at, so a node
//! refused for anything else (not labelled, a twin still waiting) never reads as fragmented.

use gpushare_allocator::{Cluster, Node, Request, Unfit};

/// Why no candidate node could take a GPU pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unschedulable {
    /// Some node had the memory free in total, split over GPUs so that none (or too few)
    /// could take the pod.
    Fragmentation,
    /// No node had that much memory free on the GPUs the pod may use.
    NoCapacity,
}

impl Unschedulable {
    /// Every reason, for counters that start at 0.
    pub const ALL: [Self; 2] = [Self::Fragmentation, Self::NoCapacity];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Fragmentation => "fragmentation",
            Self::NoCapacity => "no_capacity",
        }
    }

    /// Why `request` fits none of the `rejected` nodes (each with the reason it was refused),
    /// on `cluster`. O(GPUs) per node refused for a memory shortfall, stopping at the first
    /// fragmented one.
    pub fn classify<'a>(
        cluster: &Cluster,
        request: &Request,
        rejected: impl IntoIterator<Item = (&'a str, &'a Unfit)>,
    ) -> Self {
        let fragmented = rejected.into_iter().any(|(name, unfit)| {
            matches!(unfit, Unfit::Busy { .. } | Unfit::TooFewFree { .. })
                && cluster
                    .node(name)
                    .is_some_and(|node| free_in_total(node, request))
        });
        if fragmented {
            Self::Fragmentation
        } else {
            Self::NoCapacity
        }
    }
}

/// Whether `node`'s healthy GPUs of a model `request` allows have what it would occupy free
/// between them.
fn free_in_total(node: &Node, request: &Request) -> bool {
    let usable = || {
        node.gpus()
            .iter()
            .filter(|usage| usage.gpu.healthy && request.models.allows(&usage.gpu.model))
    };
    let free: u64 = usable().map(|usage| usage.free_gib()).sum();
    let wanted = request.gpus.max(1) as usize;
    let per_gpu = request.gib_per_gpu();
    let occupied = if request.exclusive {
        let mut sizes: Vec<u64> = usable()
            .map(|usage| usage.gpu.total_gib)
            .filter(|&total| total >= per_gpu)
            .collect();
        if sizes.len() < wanted {
            return false;
        }
        sizes.sort_unstable();
        sizes[..wanted].iter().sum()
    } else {
        per_gpu.saturating_mul(wanted as u64)
    };
    // A request of nothing fits wherever a GPU is free; never "fragmented".
    occupied > 0 && free >= occupied
}

#[cfg(test)]
mod tests {
    use gpushare_allocator::{Gpu, ModelFilter, PodPlacement};

    use super::*;

    fn gpu(index: u32, total_gib: u64) -> Gpu {
        Gpu {
            index,
            uuid: format!("GPU-{index}"),
            model: "Tesla T4".to_owned(),
            total_gib,
            healthy: true,
            numa: None,
        }
    }

    fn slice(gib: u64) -> Request {
        Request {
            pod_gib: gib,
            containers: vec![gib],
            ..Request::default()
        }
    }

    /// Node `name` with `gpus`, and `used[i]` GiB booked on the i-th by a pod already
    /// running (assigned: no twin rule).
    fn with_node(cluster: &mut Cluster, name: &str, gpus: Vec<Gpu>, used: &[u64]) {
        cluster.set_node(name, gpus, true);
        for (index, &gib) in (0u32..).zip(used) {
            let placement = PodPlacement {
                gpu: index,
                uuid: format!("GPU-{index}").into(),
                pod_gib: gib,
                assigned: true,
                ..PodPlacement::default()
            };
            cluster.upsert_pod(format!("{name}-{index}").into(), name, placement);
        }
    }

    /// How filter would call it: every node refused, with the reason the allocator gives.
    fn classify(cluster: &Cluster, request: &Request) -> Unschedulable {
        let rejected: Vec<(&str, Unfit)> = cluster
            .nodes()
            .map(|(name, _)| (name, cluster.fit(name, request).unwrap_err()))
            .collect();
        Unschedulable::classify(cluster, request, rejected.iter().map(|(n, u)| (*n, u)))
    }

    #[test]
    fn free_memory_split_over_gpus_is_fragmentation() {
        let mut cluster = Cluster::new();
        // 6 + 6 GiB free: an 8 GiB pod fits on neither GPU.
        with_node(&mut cluster, "n1", vec![gpu(0, 16), gpu(1, 16)], &[10, 10]);
        assert_eq!(classify(&cluster, &slice(8)), Unschedulable::Fragmentation);
        // 12 GiB free in all is not enough for 14 anywhere: the GPUs are full.
        assert_eq!(classify(&cluster, &slice(14)), Unschedulable::NoCapacity);
    }

    #[test]
    fn one_fragmented_node_among_full_ones_is_enough() {
        let mut cluster = Cluster::new();
        with_node(&mut cluster, "full", vec![gpu(0, 16)], &[15]);
        with_node(&mut cluster, "split", vec![gpu(0, 8), gpu(1, 8)], &[4, 4]);
        assert_eq!(classify(&cluster, &slice(6)), Unschedulable::Fragmentation);
        cluster.remove_node("split");
        assert_eq!(classify(&cluster, &slice(6)), Unschedulable::NoCapacity);
    }

    #[test]
    fn a_pod_larger_than_any_gpu_or_nodes_not_taking_part_are_no_capacity() {
        let mut cluster = Cluster::new();
        // 32 GiB free in all, but no GPU holds 24 even empty: no packing helps.
        with_node(&mut cluster, "n1", vec![gpu(0, 16), gpu(1, 16)], &[]);
        assert_eq!(classify(&cluster, &slice(24)), Unschedulable::NoCapacity);
        let mut cluster = Cluster::new();
        cluster.set_node("plain", vec![gpu(0, 16)], false);
        assert_eq!(classify(&cluster, &slice(4)), Unschedulable::NoCapacity);
        assert_eq!(
            Unschedulable::classify(&cluster, &slice(4), []),
            Unschedulable::NoCapacity
        );
    }

    #[test]
    fn unhealthy_gpus_and_models_the_pod_refuses_hold_no_free_memory() {
        let mut cluster = Cluster::new();
        let mut sick = gpu(1, 16);
        sick.healthy = false;
        with_node(&mut cluster, "n1", vec![gpu(0, 16), sick], &[10]);
        assert_eq!(classify(&cluster, &slice(8)), Unschedulable::NoCapacity);

        let mut cluster = Cluster::new();
        let mut other = gpu(1, 16);
        other.model = "NVIDIA A10".to_owned();
        with_node(&mut cluster, "n1", vec![gpu(0, 16), other], &[10]);
        let t4_only = Request {
            models: ModelFilter::parse(["Tesla T4"]),
            ..slice(8)
        };
        assert_eq!(classify(&cluster, &t4_only), Unschedulable::NoCapacity);
        // Any model: the A10's 16 GiB count, and the pod fits there.
        assert!(cluster.fit("n1", &slice(8)).is_ok());
    }

    #[test]
    fn multi_gpu_and_whole_gpu_requests_count_what_they_would_occupy() {
        let mut cluster = Cluster::new();
        // 2 GPUs of 6 GiB each wanted; free: 4, 4, 8 (16 in all, 12 needed) but one GPU has 6.
        with_node(
            &mut cluster,
            "n1",
            vec![gpu(0, 16), gpu(1, 16), gpu(2, 16)],
            &[12, 12, 8],
        );
        let two = Request {
            gpus: 2,
            ..slice(12)
        };
        assert!(matches!(
            cluster.fit("n1", &two),
            Err(Unfit::TooFewFree { .. })
        ));
        assert_eq!(classify(&cluster, &two), Unschedulable::Fragmentation);

        // One whole 16 GiB GPU: 2 + 2 GiB booked on two GPUs leaves 28 free, none empty.
        let mut cluster = Cluster::new();
        with_node(&mut cluster, "n1", vec![gpu(0, 16), gpu(1, 16)], &[2, 2]);
        let whole = Request {
            exclusive: true,
            ..slice(16)
        };
        assert_eq!(classify(&cluster, &whole), Unschedulable::Fragmentation);
        // 15 + 15 booked: 2 GiB free can never make a GPU empty.
        let mut cluster = Cluster::new();
        with_node(&mut cluster, "n1", vec![gpu(0, 16), gpu(1, 16)], &[15, 15]);
        assert_eq!(classify(&cluster, &whole), Unschedulable::NoCapacity);
    }
}
