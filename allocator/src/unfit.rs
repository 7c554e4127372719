//! Why a pod does not fit a node, in words the pod's owner reads in `kubectl describe`.
//!
//! kube-scheduler distinguishes nodes that may fit later (`FailedNodes`: GPUs busy, a twin
//! still waiting) from nodes that never will as things stand (`FailedAndUnresolvableNodes`:
//! not labelled, no GPU that large); [`Unfit::is_unresolvable`] tells which.

/// Why a pod does not fit a node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unfit {
    /// The node is not (or no longer) in the node watch.
    #[error("node is unknown to the gpushare extender")]
    UnknownNode,
    /// The node lacks the participation label.
    #[error("node does not take part in GPU sharing (participation label not set)")]
    NotEligible,
    /// The node published no GPUs.
    #[error("node has no GPUs in its inventory")]
    NoGpus,
    /// Every GPU of the node is marked unhealthy.
    #[error("all {count} GPUs on the node are unhealthy")]
    AllUnhealthy {
        /// number of GPUs on the node
        count: usize,
    },
    /// No healthy GPU is that large, even empty.
    #[error("needs {need} GiB on one GPU; the largest healthy GPU has {largest_total} GiB in all")]
    TooLarge {
        /// GiB the pod needs
        need: u64,
        /// size of the largest healthy GPU
        largest_total: u64,
    },
    /// GPUs are large enough but too full right now.
    #[error("needs {need} GiB on one GPU; largest free is {largest_free} GiB (GPU {gpu})")]
    Busy {
        /// GiB the pod needs
        need: u64,
        /// the most free memory on one healthy GPU
        largest_free: u64,
        /// index of that GPU
        gpu: u32,
    },
    /// A container of the same size waits for device allocation on a GPU without room.
    #[error(
        "a {size} GiB container is still waiting for device allocation on GPU {gpu}, which {}; retry once it starts",
        blocked_why(*need, *free, *healthy)
    )]
    TwinBlocked {
        /// the shared container size
        size: u64,
        /// the GPU the twin is on
        gpu: u32,
        /// GiB the pod needs
        need: u64,
        /// GiB free on that GPU
        free: u64,
        /// whether that GPU is healthy
        healthy: bool,
    },
    /// The pod's containers have pending twins on two different GPUs.
    #[error(
        "this pod's {first_size} GiB and {second_size} GiB containers match containers still waiting for device allocation on different GPUs ({first_gpu} and {second_gpu}); retry once they start"
    )]
    TwinConflict {
        /// one container size
        first_size: u64,
        /// the GPU its twin is on
        first_gpu: u32,
        /// another container size
        second_size: u64,
        /// the GPU its twin is on
        second_gpu: u32,
    },
}

fn blocked_why(need: u64, free: u64, healthy: bool) -> String {
    if healthy {
        format!("has no room (pod needs {need} GiB, {free} GiB free)")
    } else {
        "is unhealthy".to_owned()
    }
}

impl Unfit {
    /// True when waiting will not help: kube-scheduler's `FailedAndUnresolvableNodes`.
    pub fn is_unresolvable(&self) -> bool {
        matches!(
            self,
            Unfit::UnknownNode | Unfit::NotEligible | Unfit::NoGpus | Unfit::TooLarge { .. }
        )
    }
}

/// Why [`crate::Cluster::reserve`] booked nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The pod does not fit the node.
    #[error("{reason}")]
    Unfit {
        /// why
        #[source]
        reason: Unfit,
    },
    /// The pod already holds a place (release or remove it first).
    #[error("pod already holds GPU {gpu} on node {node}")]
    AlreadyPlaced {
        /// its node
        node: String,
        /// its GPU
        gpu: u32,
    },
}

impl From<Unfit> for Refusal {
    fn from(reason: Unfit) -> Self {
        Refusal::Unfit { reason }
    }
}
