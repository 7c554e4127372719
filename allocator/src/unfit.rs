//! Why a pod does not fit a node, in words the pod's owner reads in `kubectl describe`.
//!
//! kube-scheduler distinguishes nodes that may fit later (`FailedNodes`: GPUs busy, a twin
//! still waiting) from nodes that never will as things stand (`FailedAndUnresolvableNodes`:
//! not labelled, no GPU that large); [`Unfit::is_unresolvable`] tells which.

/// GPU indices, written `1` or `0,1` in messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuList(pub Vec<u32>);

impl std::fmt::Display for GpuList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.0.iter().map(u32::to_string).collect();
        f.write_str(&names.join(","))
    }
}

/// `"GPU"` or `"GPUs"`.
fn gpus_word(count: usize) -> &'static str {
    if count == 1 { "GPU" } else { "GPUs" }
}

/// How a multi-GPU request reads in a message: "2 GPUs with 8 GiB free each", or, for whole
/// GPUs, "2 whole free GPUs of at least 8 GiB".
fn slices(wanted: u32, per_gpu: u64, exclusive: bool, compute: u32) -> String {
    let word = gpus_word(wanted as usize);
    let compute = if compute > 0 {
        format!(" and {compute} % compute")
    } else {
        String::new()
    };
    if exclusive {
        format!("{wanted} whole free {word} of at least {per_gpu} GiB")
    } else if wanted == 1 {
        format!("1 GPU with {per_gpu} GiB{compute} free")
    } else {
        format!("{wanted} GPUs with {per_gpu} GiB{compute} free each")
    }
}

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
    /// GPUs have the memory free, but not the compute the pod asks for besides.
    #[error(
        "needs {need} GiB and {compute} % compute on one GPU; the GPUs with that memory free have at most {free} % compute free (GPU {gpu})"
    )]
    ComputeBusy {
        /// GiB the pod needs
        need: u64,
        /// percent of compute it needs
        compute: u32,
        /// the most compute free on a GPU with the memory free
        free: u32,
        /// index of that GPU
        gpu: u32,
    },
    /// A container of the same size waits for device allocation on a GPU without room.
    #[error(
        "a {size} GiB container is still waiting for device allocation on GPU {gpus}, which {}; retry once it starts",
        blocked_why(*need, *free, *healthy, *compute)
    )]
    TwinBlocked {
        /// the shared container size
        size: u64,
        /// the GPU the twin is on (the one without room, for a multi-GPU twin)
        gpus: GpuList,
        /// GiB the pod needs
        need: u64,
        /// GiB free on that GPU
        free: u64,
        /// whether that GPU is healthy
        healthy: bool,
        /// (percent the pod needs, percent free) when the GPU has the memory but not the
        /// compute
        compute: Option<(u32, u32)>,
    },
    /// The pod's containers have pending twins on two different GPUs.
    #[error(
        "this pod's {first_size} GiB and {second_size} GiB containers match containers still waiting for device allocation on different GPUs ({first_gpus} and {second_gpus}); retry once they start"
    )]
    TwinConflict {
        /// one container size
        first_size: u64,
        /// the GPUs its twin is on
        first_gpus: GpuList,
        /// another container size
        second_size: u64,
        /// the GPUs its twin is on
        second_gpus: GpuList,
    },
    /// A container of the same size, spanning a different number of GPUs, waits for device
    /// allocation: the device plugin could not tell the two apart.
    #[error(
        "a {size} GiB container spanning GPU {gpus} is still waiting for device allocation, and this pod wants {wanted} {}; retry once it starts",
        gpus_word(*wanted as usize)
    )]
    TwinShape {
        /// the shared container size
        size: u64,
        /// the GPUs the twin spans
        gpus: GpuList,
        /// how many GPUs this pod wants
        wanted: u32,
    },
    /// No GPU of the node is of a model the pod allows.
    #[error("needs a GPU of model {wanted}; node has {has}")]
    NoModel {
        /// the pod's model filter, in words
        wanted: String,
        /// the node's models
        has: String,
    },
    /// A container of the same size waits for device allocation on a GPU of a model this pod
    /// does not allow.
    #[error(
        "a {size} GiB container is still waiting for device allocation on GPU {gpu} ({model}), a model this pod does not allow; retry once it starts"
    )]
    TwinModel {
        /// the shared container size
        size: u64,
        /// the GPU the twin is on
        gpu: u32,
        /// its model
        model: String,
    },
    /// Fewer healthy GPUs than the pod wants are large enough, even empty.
    #[error("needs {}; node has {large_enough} healthy GPUs that large", slices(*wanted, *per_gpu, *exclusive, 0))]
    TooFewGpus {
        /// GPUs wanted
        wanted: u32,
        /// GiB on each
        per_gpu: u64,
        /// whole GPUs
        exclusive: bool,
        /// healthy GPUs of at least `per_gpu` GiB
        large_enough: usize,
    },
    /// Enough GPUs are large enough, but too few have room right now.
    #[error("needs {}; node has {fitting}", slices(*wanted, *per_gpu, *exclusive, *compute))]
    TooFewFree {
        /// GPUs wanted
        wanted: u32,
        /// GiB on each
        per_gpu: u64,
        /// whole GPUs
        exclusive: bool,
        /// percent of compute on each (0: none asked)
        compute: u32,
        /// GPUs that would take a slice now
        fitting: usize,
    },
}

fn blocked_why(need: u64, free: u64, healthy: bool, compute: Option<(u32, u32)>) -> String {
    match compute {
        _ if !healthy => "is unhealthy".to_owned(),
        Some((need, free)) => {
            format!("has no compute room (pod needs {need} %, {free} % free)")
        }
        None => format!("has no room (pod needs {need} GiB, {free} GiB free)"),
    }
}

impl Unfit {
    /// True when waiting will not help: kube-scheduler's `FailedAndUnresolvableNodes`.
    pub fn is_unresolvable(&self) -> bool {
        matches!(
            self,
            Unfit::UnknownNode
                | Unfit::NotEligible
                | Unfit::NoGpus
                | Unfit::TooLarge { .. }
                | Unfit::TooFewGpus { .. }
                | Unfit::NoModel { .. }
        )
    }

    /// True when the node waits for kubelet to admit a pod already bound there (a container
    /// of the same size still waiting for device allocation): it clears when that pod
    /// starts, a pod status update that kube-scheduler does not requeue waiting pods for.
    pub fn awaits_admission(&self) -> bool {
        matches!(
            self,
            Unfit::TwinBlocked { .. }
                | Unfit::TwinConflict { .. }
                | Unfit::TwinShape { .. }
                | Unfit::TwinModel { .. }
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
