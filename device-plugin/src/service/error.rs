//! Why an Allocate call is refused: each reason a message that says what failed, for which
//! pod, and what to do; a metric label; and the gRPC status kubelet shows on the pod.

use gpushare_contract::env::comma_list;
use tonic::Status;

/// Why an Allocate call was refused; each becomes a gRPC status kubelet shows on the pod.
#[derive(Debug, thiserror::Error)]
pub enum AllocateError {
    /// kubelet asked for zero devices.
    #[error("container request #{request} asks for no devices; nothing to allocate")]
    NoDevices {
        /// position in the AllocateRequest
        request: usize,
    },
    /// kubelet named devices this plugin never advertised.
    #[error(
        "unknown device IDs {ids:?}: this plugin advertises <gpu-uuid>-<slot> for the GPUs of node {node}"
    )]
    UnknownDevices {
        /// the node
        node: String,
        /// the unknown IDs
        ids: Vec<String>,
    },
    /// No pod here waits for that many GiB.
    #[error(
        "no pod bound to node {node} is waiting for a {gib} GiB {resource} allocation; was it scheduled by the gpushare extender?"
    )]
    NoPendingPod {
        /// the node
        node: String,
        /// GiB asked for
        gib: u64,
        /// the resource
        resource: String,
    },
    /// The pod that would match carries an allocation the extender did not sign.
    #[error(
        "pod {pod}: this pod's gpushare allocation is not signed by the gpushare extender ({why}); delete it and let the scheduler place it"
    )]
    Forged {
        /// namespace/name
        pod: String,
        /// why its signature does not verify
        why: String,
    },
    /// The annotation names a GPU index this node does not have.
    #[error(
        "pod {pod} was placed on GPU {index}{}, but node {node} has no GPU with that index; delete the pod so it is scheduled again",
        among(.set)
    )]
    UnknownGpu {
        /// namespace/name
        pod: String,
        /// the GPU index
        index: u32,
        /// the node
        node: String,
        /// every GPU index of the pod (named in the message when more than one)
        set: Vec<u32>,
    },
    /// The annotation's UUID is not the UUID of our GPU at that index.
    #[error(
        "pod {pod} was placed on GPU {index}{} with UUID {annotated}, but GPU {index} on this node is {ours}; the GPUs changed since scheduling, delete the pod so it is scheduled again",
        among(.set)
    )]
    UuidMismatch {
        /// namespace/name
        pod: String,
        /// the GPU index
        index: u32,
        /// the UUID in the annotation
        annotated: String,
        /// our UUID
        ours: String,
        /// every GPU index of the pod (named in the message when more than one)
        set: Vec<u32>,
    },
    /// A GPU chosen is unhealthy.
    #[error(
        "pod {pod} was placed on GPU {index} ({uuid}){}, which is unhealthy; delete the pod so it is scheduled elsewhere",
        among(.set)
    )]
    UnhealthyGpu {
        /// namespace/name
        pod: String,
        /// the GPU index
        index: u32,
        /// its UUID
        uuid: String,
        /// every GPU index of the pod (named in the message when more than one)
        set: Vec<u32>,
    },
    /// The container's accounting directory could not be made (`--enforcement preload`).
    #[error(
        "pod {pod}: cannot make its isolation accounting directory under --isolation-host-dir: {why}"
    )]
    Isolation {
        /// namespace/name
        pod: String,
        /// the cause
        why: String,
    },
}

/// ` (one of its GPUs 1,3)` for a multi-GPU pod, nothing for a one-GPU pod.
fn among(set: &[u32]) -> String {
    if set.len() > 1 {
        format!(" (one of its GPUs {})", comma_list(set))
    } else {
        String::new()
    }
}

impl AllocateError {
    /// Metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NoDevices { .. } => "no_devices",
            Self::UnknownDevices { .. } => "unknown_device",
            Self::NoPendingPod { .. } => "no_pending_pod",
            Self::Forged { .. } => "forged_allocation",
            Self::UnknownGpu { .. } => "unknown_gpu",
            Self::UuidMismatch { .. } => "gpu_uuid_mismatch",
            Self::UnhealthyGpu { .. } => "gpu_unhealthy",
            Self::Isolation { .. } => "isolation_dir",
        }
    }
}

impl From<AllocateError> for Status {
    fn from(err: AllocateError) -> Self {
        let message = err.to_string();
        match err {
            AllocateError::NoDevices { .. } | AllocateError::UnknownDevices { .. } => {
                Status::invalid_argument(message)
            }
            AllocateError::UnhealthyGpu { .. } | AllocateError::Isolation { .. } => {
                Status::unavailable(message)
            }
            AllocateError::Forged { .. } => Status::permission_denied(message),
            AllocateError::NoPendingPod { .. }
            | AllocateError::UnknownGpu { .. }
            | AllocateError::UuidMismatch { .. } => Status::failed_precondition(message),
        }
    }
}
