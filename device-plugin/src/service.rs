//! The `DevicePlugin` gRPC service kubelet calls.
//!
//! Allocate is where the extender's decision becomes real: kubelet hands us N device IDs
//! (= N GiB), we find the pod container waiting for N GiB on this node in the local pod cache
//! ([`crate::pods`]) and answer with the environment that pins the container to the GPU (or,
//! for a multi-GPU pod, the GPUs) the extender chose, every one of them checked first; with
//! `--cdi-devices`, also as CDI device names, for runtimes where the NVIDIA toolkit resolves
//! devices through CDI rather than `NVIDIA_VISIBLE_DEVICES`. No API call happens on this
//! path; the marks are written in the background.
//! With a keyring, only allocations the extender signed are matched; when the pod that would
//! match carries one it did not sign, the answer is `PermissionDenied` naming that pod
//! ([`AllocateError::Forged`]), counted in `gpushare_device_plugin_forged_allocations_total`.
//!
//! This module is the service itself (ListAndWatch, GetPreferredAllocation, Allocate); what
//! an answer is made of is split by concern:
//!
//! - `gpus`: checking the GPUs an allocation names, and naming them as CDI devices;
//! - `enforcement`: how a container's share is enforced (the mode per pod, the interposer's
//!   mounts and accounting, the MPS pipe directory);
//! - `error`: why Allocate refuses ([`AllocateError`]), and the gRPC status each becomes.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use gpushare_contract::ContainerRequest;
use gpushare_contract::env::{Enforcement, comma_list};
use gpushare_proto::v1beta1::device_plugin_server::DevicePlugin;
use gpushare_proto::v1beta1::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse,
    ContainerPreferredAllocationResponse, DevicePluginOptions, Empty, ListAndWatchResponse,
    PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse,
};
use tokio_stream::wrappers::WatchStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::devices;
use crate::matching;
use crate::metrics::Metrics;
use crate::node::Inventory;
use crate::pods::{ClaimError, PodCache};
use crate::view::PodView;

mod enforcement;
mod error;
mod gpus;

pub use enforcement::{Isolation, container_enforcement, container_mounts, isolation_shares};
pub use error::AllocateError;
pub use gpus::{NVIDIA_CDI_KIND, cdi_devices, check_gpus};
pub use gpushare_contract::env::container_env;

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
    /// Whether Allocate also names each container's GPUs as CDI devices ([`cdi_devices`]).
    pub cdi_devices: bool,
    /// The installed interposer ([`Enforcement::Preload`]).
    pub isolation: Option<Isolation>,
}

/// The options sent at registration and from `GetDevicePluginOptions`.
pub fn options() -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

/// How long after opening a ListAndWatch stream the device list is sent again.
///
/// kubelet marks a resource's devices unhealthy whenever any of its clients for that
/// resource ends (`PluginDisconnected` is per resource, not per client), even a client of a
/// plugin generation it has already replaced. When that stale end lands after our first
/// list, our devices stay unhealthy until we send another, and every pod admitted meanwhile
/// fails with `UnexpectedAdmissionError`. One more list shortly after opening heals that; the
/// plugin reports ready only once it was sent ([`GpuMemService::new`]'s `announced`).
pub const REANNOUNCE_AFTER: Duration = Duration::from_secs(1);

/// One served socket's view of the plugin; `stop` ends its ListAndWatch streams.
#[derive(Debug, Clone)]
pub struct GpuMemService {
    state: Arc<PluginState>,
    stop: CancellationToken,
    announced: Arc<tokio::sync::Notify>,
}

impl GpuMemService {
    /// A service over `state` whose streams end when `stop` is cancelled; `announced` is
    /// notified when a stream has sent its device list the second time
    /// ([`REANNOUNCE_AFTER`]).
    pub fn new(
        state: Arc<PluginState>,
        stop: CancellationToken,
        announced: Arc<tokio::sync::Notify>,
    ) -> Self {
        Self {
            state,
            stop,
            announced,
        }
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
        let check = |view: &PodView, _: &ContainerRequest| check_gpus(&gpus, &state.node, view);
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
            .map(
                |claim| -> Result<ContainerAllocateResponse, AllocateError> {
                    tracing::info!(
                        pod = %claim.pod,
                        container = %claim.container.name,
                        gpu = %comma_list(claim.checked.iter().map(|gpu| gpu.index)),
                        uuid = %comma_list(claim.checked.iter().map(|gpu| gpu.uuid.as_str())),
                        gib = claim.container.gib,
                        "allocated"
                    );
                    let (mode, settings) = container_enforcement(
                        state.enforcement,
                        state.isolation.as_ref(),
                        &state.mps_pipe_directory,
                        &claim.pod,
                    );
                    let mut mounts = container_mounts(mode, &state.mps_pipe_directory);
                    if let (Enforcement::Preload, Some(isolation)) = (mode, &state.isolation) {
                        let (shares, uuids) = isolation_shares(&claim.checked, claim.container.gib);
                        let compute = claim.container.compute_per_gpu(claim.checked.len());
                        let preload = isolation
                            .mounts(
                                (&claim.pod, &claim.container.name),
                                (&shares, &uuids),
                                compute,
                            )
                            .map_err(|e| AllocateError::Isolation {
                                pod: claim.pod.clone(),
                                why: e.to_string(),
                            })?;
                        mounts.extend(preload);
                    }
                    Ok(ContainerAllocateResponse {
                        envs: container_env(
                            &claim.checked,
                            &claim.container,
                            claim.allocation.pod_gib,
                            (mode, &settings),
                        ),
                        mounts,
                        cdi_devices: if state.cdi_devices {
                            cdi_devices(&claim.checked)
                        } else {
                            Vec::new()
                        },
                        ..Default::default()
                    })
                },
            )
            .collect::<Result<_, _>>()?;
        Ok(AllocateResponse {
            container_responses,
        })
    }
}

/// A ListAndWatch stream: what `listed` makes of the inventory, sent at once, whenever the
/// inventory changes, and once more after [`REANNOUNCE_AFTER`] (then `announced` rings);
/// it ends when `stop` is cancelled. For both resources, memory and compute.
pub type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

/// See [`DeviceStream`].
pub fn device_stream(
    inventory: &Inventory,
    (stop, announced): (&CancellationToken, &Arc<tokio::sync::Notify>),
    node: String,
    listed: fn(&[gpushare_contract::GpuInfo]) -> Vec<gpushare_proto::v1beta1::Device>,
) -> DeviceStream {
    let watched = inventory.subscribe();
    let announced = announced.clone();
    let again = futures::stream::once(async move {
        tokio::time::sleep(REANNOUNCE_AFTER).await;
        let gpus = watched.borrow().clone();
        announced.notify_one();
        gpus
    });
    let lists = WatchStream::new(inventory.subscribe());
    let stream = tokio_stream::StreamExt::merge(lists, again)
        .map(move |gpus| {
            let devices = listed(&gpus);
            tracing::info!(%node, devices = devices.len(), healthy = gpus.iter().filter(|g| g.healthy).count(), "sending device list to kubelet");
            Ok(ListAndWatchResponse { devices })
        })
        .take_until(stop.clone().cancelled_owned());
    Box::pin(stream)
}

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
        Ok(Response::new(device_stream(
            &self.state.inventory,
            (&self.stop, &self.announced),
            self.state.node.clone(),
            devices::device_list,
        )))
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
            let pod_gpus = self.state.pods.preview(gib, self.state.pending_wait).await;
            container_responses.push(ContainerPreferredAllocationResponse {
                device_i_ds: matching::preferred_devices(
                    &container.available_device_i_ds,
                    &container.must_include_device_i_ds,
                    size,
                    &pod_gpus,
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
