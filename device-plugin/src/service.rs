//! The `DevicePlugin` gRPC service kubelet calls.
//!
//! Allocate is where the extender's decision becomes real: kubelet hands us N device IDs
//! (= N GiB), we find the pod container waiting for N GiB on this node in the local pod cache
//! ([`crate::pods`]) and answer with the environment that pins the container to the GPU the
//! extender chose. No API call happens on this path; the marks are written in the background.
//! With a keyring, only allocations the extender signed are matched; when the pod that would
//! match carries one it did not sign, the answer is `PermissionDenied` naming that pod
//! ([`AllocateError::Forged`]), counted in `gpushare_device_plugin_forged_allocations_total`.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use gpushare_contract::env::Enforcement;
use gpushare_contract::{ContainerRequest, GpuInfo, env};
use gpushare_proto::v1beta1::device_plugin_server::DevicePlugin;
use gpushare_proto::v1beta1::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse,
    ContainerPreferredAllocationResponse, DevicePluginOptions, Empty, ListAndWatchResponse, Mount,
    PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse,
};
use tokio_stream::wrappers::WatchStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::devices;
use crate::matching::{self, PodView};
use crate::metrics::Metrics;
use crate::node::Inventory;
use crate::pods::{ClaimError, PodCache};

/// What the service needs, shared across socket restarts.
#[derive(Debug)]
pub struct PluginState {
    /// This node.
    pub node: String,
    /// The extended resource advertised.
    pub resource: String,
    /// The GPUs and their health.
    pub inventory: Inventory,
    /// The node's pods.
    pub pods: Arc<PodCache>,
    /// Metrics.
    pub metrics: Metrics,
    /// How long Allocate waits for the pod watch to show a pod kubelet already admits.
    pub pending_wait: Duration,
    /// Notified after each successful Allocate: kubelet's record of it is checked soon after
    /// ([`crate::pod_resources`]).
    pub allocated: Arc<tokio::sync::Notify>,
    /// How each container's share is enforced (the variables and mounts Allocate adds).
    pub enforcement: Enforcement,
    /// The MPS daemon's pipe directory (with [`Enforcement::Mps`]).
    pub mps_pipe_directory: String,
}

/// The options sent at registration and from `GetDevicePluginOptions`.
pub fn options() -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

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
        "pod {pod} was placed on GPU {index}, but node {node} has no GPU with that index; delete the pod so it is scheduled again"
    )]
    UnknownGpu {
        /// namespace/name
        pod: String,
        /// the GPU index
        index: u32,
        /// the node
        node: String,
    },
    /// The annotation's UUID is not the UUID of our GPU at that index.
    #[error(
        "pod {pod} was placed on GPU {index} with UUID {annotated}, but GPU {index} on this node is {ours}; the GPUs changed since scheduling, delete the pod so it is scheduled again"
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
    },
    /// The GPU chosen is unhealthy.
    #[error(
        "pod {pod} was placed on GPU {index} ({uuid}), which is unhealthy; delete the pod so it is scheduled elsewhere"
    )]
    UnhealthyGpu {
        /// namespace/name
        pod: String,
        /// the GPU index
        index: u32,
        /// its UUID
        uuid: String,
    },
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
            AllocateError::UnhealthyGpu { .. } => Status::unavailable(message),
            AllocateError::Forged { .. } => Status::permission_denied(message),
            AllocateError::NoPendingPod { .. }
            | AllocateError::UnknownGpu { .. }
            | AllocateError::UuidMismatch { .. } => Status::failed_precondition(message),
        }
    }
}

/// The GPU a pod's allocation names, if it is usable.
pub fn check_gpu(gpus: &[GpuInfo], node: &str, view: &PodView) -> Result<GpuInfo, AllocateError> {
    let alloc = &view.allocation;
    let gpu = gpus
        .iter()
        .find(|gpu| gpu.index == alloc.gpu_index)
        .ok_or_else(|| AllocateError::UnknownGpu {
            pod: view.key.clone(),
            index: alloc.gpu_index,
            node: node.to_owned(),
        })?;
    if !alloc.gpu_uuid.is_empty() && alloc.gpu_uuid != gpu.uuid {
        return Err(AllocateError::UuidMismatch {
            pod: view.key.clone(),
            index: alloc.gpu_index,
            annotated: alloc.gpu_uuid.clone(),
            ours: gpu.uuid.clone(),
        });
    }
    if !gpu.healthy {
        return Err(AllocateError::UnhealthyGpu {
            pod: view.key.clone(),
            index: gpu.index,
            uuid: gpu.uuid.clone(),
        });
    }
    Ok(gpu.clone())
}

/// The environment of a container pinned to `gpu`: the placement, and what the enforcer of
/// `enforcement` reads (see `gpushare_contract::env`).
pub fn container_env(
    gpu: &GpuInfo,
    container: &ContainerRequest,
    pod_gib: u64,
    (enforcement, mps_pipe_directory): (Enforcement, &str),
) -> HashMap<String, String> {
    let mut vars = HashMap::from([
        (env::NVIDIA_VISIBLE_DEVICES.to_owned(), gpu.uuid.clone()),
        (env::GPU_INDEX.to_owned(), gpu.index.to_string()),
        (env::GPU_UUID.to_owned(), gpu.uuid.clone()),
        (env::CONTAINER_GIB.to_owned(), container.gib.to_string()),
        (env::POD_GIB.to_owned(), pod_gib.to_string()),
        (env::GPU_TOTAL_GIB.to_owned(), gpu.mem_gib.to_string()),
    ]);
    for (name, value) in enforcement.env(container.gib, mps_pipe_directory) {
        vars.insert(name.to_owned(), value);
    }
    vars
}

/// What a container needs mounted for `enforcement`: the MPS daemon's pipe directory.
pub fn container_mounts(enforcement: Enforcement, mps_pipe_directory: &str) -> Vec<Mount> {
    match enforcement {
        Enforcement::Mps => vec![Mount {
            container_path: mps_pipe_directory.to_owned(),
            host_path: mps_pipe_directory.to_owned(),
            read_only: false,
        }],
        Enforcement::None | Enforcement::Toolkit => Vec::new(),
    }
}

/// One served socket's view of the plugin; `stop` ends its ListAndWatch streams.
#[derive(Debug, Clone)]
pub struct GpuMemService {
    state: Arc<PluginState>,
    stop: CancellationToken,
}

impl GpuMemService {
    /// A service over `state` whose streams end when `stop` is cancelled.
    pub fn new(state: Arc<PluginState>, stop: CancellationToken) -> Self {
        Self { state, stop }
    }

    async fn allocate_inner(
        &self,
        request: AllocateRequest,
    ) -> Result<AllocateResponse, AllocateError> {
        let state = &self.state;
        let gpus = state.inventory.borrow().clone();
        let mut sizes = Vec::with_capacity(request.container_requests.len());
        for (position, container) in request.container_requests.iter().enumerate() {
            if container.devices_ids.is_empty() {
                return Err(AllocateError::NoDevices { request: position });
            }
            let unknown: Vec<String> = container
                .devices_ids
                .iter()
                .filter(|id| devices::gpu_of(&gpus, id).is_none())
                .cloned()
                .collect();
            if !unknown.is_empty() {
                return Err(AllocateError::UnknownDevices {
                    node: state.node.clone(),
                    ids: unknown,
                });
            }
            sizes.push(u64::try_from(container.devices_ids.len()).unwrap_or(u64::MAX));
        }
        let check = |view: &PodView, _: &ContainerRequest| check_gpu(&gpus, &state.node, view);
        let claims = state
            .pods
            .claim(&sizes, check, state.pending_wait)
            .await
            .map_err(|err| match err {
                ClaimError::NoPendingPod { gib } => AllocateError::NoPendingPod {
                    node: state.node.clone(),
                    gib,
                    resource: state.resource.clone(),
                },
                ClaimError::Rejected(err) => err,
                ClaimError::Untrusted { pod, why, .. } => AllocateError::Forged { pod, why },
            })?;
        let container_responses = claims
            .iter()
            .map(|claim| {
                tracing::info!(
                    pod = %claim.pod,
                    container = %claim.container.name,
                    gpu = claim.checked.index,
                    uuid = %claim.checked.uuid,
                    gib = claim.container.gib,
                    "allocated"
                );
                let enforcement = (state.enforcement, state.mps_pipe_directory.as_str());
                ContainerAllocateResponse {
                    envs: container_env(
                        &claim.checked,
                        &claim.container,
                        claim.allocation.pod_gib,
                        enforcement,
                    ),
                    mounts: container_mounts(state.enforcement, &state.mps_pipe_directory),
                    ..Default::default()
                }
            })
            .collect();
        Ok(AllocateResponse {
            container_responses,
        })
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for GpuMemService {
    async fn get_device_plugin_options(
        &self,
        _request: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(options()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _request: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let node = self.state.node.clone();
        let stream = WatchStream::new(self.state.inventory.subscribe())
            .map(move |gpus| {
                let devices = devices::device_list(&gpus);
                tracing::info!(%node, devices = devices.len(), healthy = gpus.iter().filter(|g| g.healthy).count(), "sending device list to kubelet");
                Ok(ListAndWatchResponse { devices })
            })
            .take_until(self.stop.clone().cancelled_owned());
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let gpus = self.state.inventory.borrow().clone();
        let mut container_responses = Vec::new();
        for container in &request.into_inner().container_requests {
            let size = usize::try_from(container.allocation_size).unwrap_or(0);
            let gib = u64::try_from(size).unwrap_or(u64::MAX);
            // kubelet may admit a pod a moment before our watch shows it: wait as Allocate does.
            let gpu = self.state.pods.preview(gib, self.state.pending_wait).await;
            container_responses.push(ContainerPreferredAllocationResponse {
                device_i_ds: matching::preferred_devices(
                    &container.available_device_i_ds,
                    &container.must_include_device_i_ds,
                    size,
                    gpu,
                    |id| devices::gpu_of(&gpus, id),
                ),
            });
        }
        Ok(Response::new(PreferredAllocationResponse {
            container_responses,
        }))
    }

    #[tracing::instrument(skip_all, fields(node = %self.state.node))]
    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let started = Instant::now();
        let result = self.allocate_inner(request.into_inner()).await;
        let metrics = &self.state.metrics;
        metrics
            .allocate_duration
            .observe(started.elapsed().as_secs_f64());
        match result {
            Ok(response) => {
                metrics
                    .allocations
                    .inc_by(response.container_responses.len() as u64);
                self.state.allocated.notify_one();
                Ok(Response::new(response))
            }
            Err(err) => {
                metrics.allocate_error(err.reason());
                if let AllocateError::Forged { pod, why } = &err {
                    // Someone bypassed the scheduler, or edited a decision: worth an alert.
                    metrics.forged_allocations.inc();
                    tracing::error!(%pod, %why, reason = err.reason(), "Allocate refused: the pod's gpushare allocation is not signed by the extender");
                } else {
                    tracing::warn!(reason = err.reason(), error = %err, "Allocate refused");
                }
                Err(err.into())
            }
        }
    }

    async fn pre_start_container(
        &self,
        _request: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}
