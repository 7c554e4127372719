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

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use gpushare_contract::env::{self, comma_list};
use gpushare_contract::env::{Enforcement, EnforcerSettings, IsolationOptions};
use gpushare_contract::{ContainerRequest, GpuInfo};
use gpushare_proto::v1beta1::device_plugin_server::DevicePlugin;
use gpushare_proto::v1beta1::{
    AllocateRequest, AllocateResponse, CdiDevice, ContainerAllocateResponse,
    ContainerPreferredAllocationResponse, DevicePluginOptions, Empty, ListAndWatchResponse, Mount,
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

/// The interposer as installed on this node ([`Enforcement::Preload`]).
#[derive(Debug, Clone)]
pub struct Isolation {
    /// The library on the host, under its versioned name.
    pub library: PathBuf,
    /// The host directory holding `containers/<name>`, the accounting directories.
    pub host_dir: PathBuf,
    /// Namespaces whose containers get no interposer.
    pub exempt_namespaces: std::collections::BTreeSet<String>,
    /// The interposer's settings, passed to every container it is loaded into.
    pub options: IsolationOptions,
}

impl Isolation {
    /// Whether containers of `pod` (`namespace/name`) get the interposer.
    pub fn applies_to(&self, pod: &str) -> bool {
        let namespace = pod.split_once('/').map_or(pod, |(ns, _)| ns);
        !self.exempt_namespaces.contains(namespace)
    }

    /// The mounts that load the interposer into a container of `pod` (`namespace/name`),
    /// granted `shares` (bytes per GPU) of the GPUs `uuids` (in the same order), and give it
    /// a fresh accounting directory, named `<namespace>_<pod>_<container>_<n>` (Kubernetes
    /// names hold no `_`; `<n>` tells apart containers of a re-created pod). The accounting
    /// is prepared here, before the container starts: its budget, and the read-only limits
    /// file the interposer takes its limits from
    /// ([`gpushare_runtime::isolation::prepare_accounting`]).
    pub fn mounts(
        &self,
        pod: &str,
        container: &str,
        shares: &[u64],
        uuids: &[String],
    ) -> std::io::Result<Vec<Mount>> {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let name = format!("{}_{container}_{stamp:x}", pod.replace('/', "_"));
        let accounting = gpushare_runtime::isolation::prepare_accounting(
            &self.host_dir,
            &name,
            shares,
            uuids,
            self.options,
        )?;
        let dir = accounting.dir;
        Ok(vec![
            Mount {
                container_path: env::ISOLATION_LIBRARY_IN_CONTAINER.to_owned(),
                host_path: self.library.display().to_string(),
                read_only: true,
            },
            Mount {
                container_path: env::ISOLATION_DIR_IN_CONTAINER.to_owned(),
                host_path: dir.display().to_string(),
                read_only: false,
            },
            Mount {
                container_path: env::ISOLATION_LIMITS_IN_CONTAINER.to_owned(),
                host_path: accounting.limits_file.display().to_string(),
                read_only: true,
            },
        ])
    }
}

/// A container's shares for the interposer's budget, bytes per GPU, and the GPUs' UUIDs in
/// the same order: what [`container_env`] passes as `GPUSHARE_CONTAINER_MEM_GIB` (one GPU)
/// or `GPUSHARE_CONTAINER_MEM_GIB_PER_GPU` on `GPUSHARE_GPU_COUNT` GPUs.
pub fn isolation_shares(gpus: &[GpuInfo], gib: u64) -> (Vec<u64>, Vec<String>) {
    let count = gpus.len().max(1);
    let per_gpu = gib / u64::try_from(count).unwrap_or(u64::MAX);
    (
        vec![per_gpu.saturating_mul(1 << 30); count],
        gpus.iter().map(|gpu| gpu.uuid.clone()).collect(),
    )
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

/// The GPUs a pod's allocation names (the first one first), if every one of them is usable:
/// this node has it, its UUID is the one the extender recorded, and it is healthy. A
/// multi-GPU pod gets none of its GPUs when any one of them fails.
pub fn check_gpus(
    gpus: &[GpuInfo],
    node: &str,
    view: &PodView,
) -> Result<Vec<GpuInfo>, AllocateError> {
    let alloc = &view.allocation;
    let set: Vec<u32> = alloc.gpus().map(|(index, _)| index).collect();
    let mut checked = Vec::with_capacity(alloc.gpu_count());
    for (index, uuid) in alloc.gpus() {
        let gpu = gpus.iter().find(|gpu| gpu.index == index).ok_or_else(|| {
            AllocateError::UnknownGpu {
                pod: view.key.clone(),
                index,
                node: node.to_owned(),
                set: set.clone(),
            }
        })?;
        if !uuid.is_empty() && uuid != gpu.uuid {
            return Err(AllocateError::UuidMismatch {
                pod: view.key.clone(),
                index,
                annotated: uuid.to_owned(),
                ours: gpu.uuid.clone(),
                set,
            });
        }
        if !gpu.healthy {
            return Err(AllocateError::UnhealthyGpu {
                pod: view.key.clone(),
                index: gpu.index,
                uuid: gpu.uuid.clone(),
                set,
            });
        }
        checked.push(gpu.clone());
    }
    Ok(checked)
}

pub use gpushare_contract::env::container_env;

/// The CDI kind the NVIDIA container toolkit gives GPUs in the spec it generates.
pub const NVIDIA_CDI_KIND: &str = "nvidia.com/gpu";

/// The CDI devices that give a container `gpus`: `nvidia.com/gpu=<uuid>` each.
///
/// The NVIDIA container toolkit's generated CDI spec (`nvidia-ctk cdi generate`, kind
/// `nvidia.com/gpu`) names every GPU both by index and by UUID, `nvidia.com/gpu=0` and
/// `nvidia.com/gpu=GPU-…`, beside `nvidia.com/gpu=all`; `nvidia-ctk cdi list` prints them
/// (<https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/latest/cdi-support.html>).
/// The UUID is used because it names the same GPU whatever the enumeration order, as the
/// allocation does. A GPU without a UUID (no inventory) gets no CDI device.
pub fn cdi_devices(gpus: &[GpuInfo]) -> Vec<CdiDevice> {
    gpus.iter()
        .filter(|gpu| !gpu.uuid.is_empty())
        .map(|gpu| CdiDevice {
            name: format!("{NVIDIA_CDI_KIND}={}", gpu.uuid),
        })
        .collect()
}

/// How the containers of `pod` (`namespace/name`) are enforced on a node running `mode`:
/// that mode, with the MPS pipe directory and the interposer's settings (`isolation`, the
/// installed interposer, present with [`Enforcement::Preload`]), except no interposer in a
/// namespace exempt from it.
pub fn container_enforcement<'a>(
    mode: Enforcement,
    isolation: Option<&Isolation>,
    mps_pipe_directory: &'a str,
    pod: &str,
) -> (Enforcement, EnforcerSettings<'a>) {
    let mode = match (mode, isolation) {
        (Enforcement::Preload, Some(isolation)) if !isolation.applies_to(pod) => Enforcement::None,
        (mode, _) => mode,
    };
    let settings = EnforcerSettings {
        mps_pipe_directory,
        isolation: isolation
            .map(|isolation| isolation.options)
            .unwrap_or_default(),
    };
    (mode, settings)
}

/// What a container needs mounted for `enforcement`: the MPS daemon's pipe directory.
pub fn container_mounts(enforcement: Enforcement, mps_pipe_directory: &str) -> Vec<Mount> {
    match enforcement {
        Enforcement::Mps => vec![Mount {
            container_path: mps_pipe_directory.to_owned(),
            host_path: mps_pipe_directory.to_owned(),
            read_only: false,
        }],
        Enforcement::None | Enforcement::Toolkit | Enforcement::Preload => Vec::new(),
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
                        let preload = isolation
                            .mounts(&claim.pod, &claim.container.name, &shares, &uuids)
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
        let inventory = self.state.inventory.subscribe();
        let announced = self.announced.clone();
        let again = futures::stream::once(async move {
            tokio::time::sleep(REANNOUNCE_AFTER).await;
            let gpus = inventory.borrow().clone();
            announced.notify_one();
            gpus
        });
        let lists = WatchStream::new(self.state.inventory.subscribe());
        let stream = tokio_stream::StreamExt::merge(lists, again)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn isolation_skips_exempt_namespaces_and_gives_each_container_its_own_directory() {
        let dir = tempfile::tempdir().unwrap();
        let isolation = Isolation {
            library: dir.path().join("lib.so"),
            host_dir: dir.path().to_owned(),
            exempt_namespaces: ["trusted".to_owned()].into(),
            options: IsolationOptions::default(),
        };
        assert!(isolation.applies_to("default/a"));
        assert!(!isolation.applies_to("trusted/a"));
        let (shares, uuids) = isolation_shares(&[gpu(0, 16, true), gpu(1, 16, true)], 8);
        assert_eq!(shares, [4 << 30, 4 << 30]);
        let first = isolation
            .mounts("default/a", "main", &shares, &uuids)
            .unwrap();
        let second = isolation
            .mounts("default/a", "main", &shares, &uuids)
            .unwrap();
        assert_eq!(first[0].host_path, second[0].host_path, "one library");
        assert_ne!(first[1].host_path, second[1].host_path, "a directory each");
        assert_ne!(
            first[2].host_path, second[2].host_path,
            "a limits file each"
        );
        assert!(first[0].read_only && !first[1].read_only && first[2].read_only);
        assert!(
            first[1].host_path.contains("/containers/default_a_main_"),
            "{}",
            first[1].host_path
        );
        assert_eq!(first[2].container_path, env::ISOLATION_LIMITS_IN_CONTAINER);
        assert_eq!(
            env::ISOLATION_LIMITS_IN_CONTAINER,
            gpushare_isolation_budget::LIMITS_FILE_IN_CONTAINER
        );
        // Prepared before the container starts: the limits file names the budget as the
        // container sees it, and the budget is there, for these shares.
        let limits = gpushare_isolation_budget::PreparedLimits::parse(
            &std::fs::read_to_string(&first[2].host_path).unwrap(),
        )
        .unwrap();
        assert_eq!(limits.shares, shares);
        assert_eq!(limits.uuids, ["GPU-0", "GPU-1"]);
        let name = limits
            .budget
            .strip_prefix(env::ISOLATION_DIR_IN_CONTAINER)
            .unwrap();
        let snapshot = gpushare_isolation_budget::Snapshot::read(
            &std::path::Path::new(&first[1].host_path).join(name),
        )
        .unwrap();
        assert_eq!(snapshot.gpus.len(), 2);
        assert_eq!(snapshot.gpus[1].share, 4 << 30);
    }

    #[test]
    fn preload_containers_get_the_interposers_settings_except_where_exempt() {
        let isolation = Isolation {
            library: "/var/lib/gpushare/isolation/lib/lib.so".into(),
            host_dir: "/var/lib/gpushare/isolation".into(),
            exempt_namespaces: ["trusted".to_owned()].into(),
            options: IsolationOptions {
                context_mib: Some(640),
                managed_memory: env::ManagedMemory::Ignore,
            },
        };
        let env_of = |pod: &str| {
            let (mode, settings) =
                container_enforcement(Enforcement::Preload, Some(&isolation), "", pod);
            container_env(&[gpu(0, 16, true)], &main(4), 4, (mode, &settings))
        };
        let held = env_of("default/a");
        assert_eq!(held[env::LD_PRELOAD], env::ISOLATION_LIBRARY_IN_CONTAINER);
        assert_eq!(held[env::ISOLATION_CONTEXT_MIB], "640");
        assert_eq!(held[env::ISOLATION_MANAGED_MEMORY], "ignore");
        let exempt = env_of("trusted/a");
        for name in [
            env::LD_PRELOAD,
            env::ISOLATION_CONTEXT_MIB,
            env::ISOLATION_MANAGED_MEMORY,
        ] {
            assert!(!exempt.contains_key(name), "{name} in an exempt namespace");
        }
        // Another mode keeps its own variables and its pipe directory.
        let (mode, settings) = container_enforcement(Enforcement::Mps, None, "/run/mps", "a/b");
        assert_eq!(mode, Enforcement::Mps);
        assert_eq!(settings, EnforcerSettings::mps("/run/mps"));
    }

    fn main(gib: u64) -> ContainerRequest {
        ContainerRequest {
            name: "main".into(),
            gib,
            init: false,
        }
    }

    use crate::view::Trust;
    use gpushare_contract::{GpuRef, PodAllocation};

    fn gpu(index: u32, mem_gib: u64, healthy: bool) -> GpuInfo {
        GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            model: String::new(),
            mem_gib,
            healthy,
            numa_node: None,
        }
    }

    /// A pod placed on `gpus` (index, uuid) with `pod_gib` on each.
    fn placed(gpus: &[(u32, &str)], pod_gib: u64, exclusive: bool) -> PodView {
        let (first, more) = gpus.split_first().expect("at least one GPU");
        PodView {
            key: "default/p".into(),
            uid: "uid-p".into(),
            node: Some("n1".into()),
            phase: Some("Pending".into()),
            deleting: false,
            admitted: false,
            allocation: PodAllocation {
                gpu_index: first.0,
                gpu_uuid: first.1.into(),
                more_gpus: more
                    .iter()
                    .map(|&(index, uuid)| GpuRef {
                        index,
                        uuid: uuid.into(),
                    })
                    .collect(),
                pod_gib,
                exclusive,
                containers: vec![ContainerRequest {
                    name: "main".into(),
                    gib: pod_gib * u64::try_from(gpus.len()).unwrap(),
                    init: false,
                }],
                bind_time: "2026-11-22T10:00:00Z".into(),
                assigned: false,
                allocated: vec![],
                signature: None,
            },
            trust: Trust::Verified,
        }
    }

    #[test]
    fn cdi_devices_name_every_gpu_by_uuid() {
        let names: Vec<String> = cdi_devices(&[gpu(3, 24, true), gpu(1, 16, true)])
            .into_iter()
            .map(|device| device.name)
            .collect();
        assert_eq!(names, ["nvidia.com/gpu=GPU-3", "nvidia.com/gpu=GPU-1"]);
        let mut bare = gpu(0, 16, true);
        bare.uuid.clear();
        assert!(cdi_devices(&[bare]).is_empty());
    }

    #[test]
    fn every_gpu_of_the_allocation_is_checked() {
        let node = [gpu(0, 16, true), gpu(1, 16, true), gpu(3, 24, true)];
        let view = placed(&[(3, "GPU-3"), (1, "GPU-1")], 8, false);
        let checked = check_gpus(&node, "n1", &view).unwrap();
        assert_eq!(
            checked.iter().map(|g| g.index).collect::<Vec<_>>(),
            [3, 1],
            "the allocation's order, the first GPU first"
        );
        // Recorded without UUIDs (no inventory when scheduled): indices alone.
        let view = placed(&[(0, ""), (1, "")], 8, false);
        assert_eq!(check_gpus(&node, "n1", &view).unwrap().len(), 2);
    }

    #[test]
    fn an_unhealthy_second_gpu_refuses_the_whole_allocation() {
        let node = [gpu(1, 16, true), gpu(3, 24, false)];
        let view = placed(&[(1, "GPU-1"), (3, "GPU-3")], 8, false);
        let err = check_gpus(&node, "n1", &view).unwrap_err();
        assert_eq!(err.reason(), "gpu_unhealthy");
        assert_eq!(
            err.to_string(),
            "pod default/p was placed on GPU 3 (GPU-3) (one of its GPUs 1,3), which is unhealthy; delete the pod so it is scheduled elsewhere"
        );
        assert_eq!(Status::from(err).code(), tonic::Code::Unavailable);
        // The one-GPU message is unchanged.
        let view = placed(&[(3, "GPU-3")], 8, false);
        assert_eq!(
            check_gpus(&node, "n1", &view).unwrap_err().to_string(),
            "pod default/p was placed on GPU 3 (GPU-3), which is unhealthy; delete the pod so it is scheduled elsewhere"
        );
    }

    #[test]
    fn a_second_gpu_that_is_missing_or_changed_is_refused() {
        let node = [gpu(0, 16, true), gpu(1, 16, true)];
        let err = check_gpus(
            &node,
            "n1",
            &placed(&[(0, "GPU-0"), (5, "GPU-5")], 8, false),
        )
        .unwrap_err();
        assert_eq!(err.reason(), "unknown_gpu");
        assert!(
            err.to_string()
                .contains("was placed on GPU 5 (one of its GPUs 0,5), but node n1 has no GPU"),
            "{err}"
        );
        let err = check_gpus(
            &node,
            "n1",
            &placed(&[(0, "GPU-0"), (1, "GPU-x")], 8, false),
        )
        .unwrap_err();
        assert_eq!(err.reason(), "gpu_uuid_mismatch");
        assert!(
            err.to_string().contains(
                "GPU 1 (one of its GPUs 0,1) with UUID GPU-x, but GPU 1 on this node is GPU-1"
            ),
            "{err}"
        );
    }
}
