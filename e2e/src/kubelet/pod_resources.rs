//! kubelet's PodResources API (`v1`), served from what the test kubelet really handed out.
//!
//! Faithful to kubelet's `pkg/kubelet/apis/podresources/server_v1.go` and the device
//! manager's `GetDevices`:
//! - `List` walks the *active* pods (kubelet's default since 1.34): every pod bound here that
//!   is not Succeeded or Failed, including pods not admitted yet, but not pods rejected at
//!   admission (they are Failed);
//! - per pod, restartable (sidecar) init containers first, then app containers; ordinary
//!   init containers are never listed, though their devices were handed out;
//! - a container's devices appear once its Allocate succeeded, one `ContainerDevices` per
//!   device and NUMA node (without topology when the plugin reported none);
//! - `Get` answers one active pod, or an error naming it; `GetAllocatableResources` lists
//!   every device of every registered plugin.
//!
//! Pods are named by namespace and name only: the API carries no UID.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use gpushare_contract::request::pod_is_finished as finished;
use gpushare_proto::KUBELET_SOCKET;
use gpushare_proto::podresources::v1::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use gpushare_proto::podresources::v1::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices,
    ContainerResources, GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest,
    ListPodResourcesResponse, NumaNode, PodResources, TopologyInfo,
};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::Store;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

use super::{ServedSocket, Shared, State, by_creation};

/// `<dir>/pod-resources/kubelet.sock`.
pub(super) fn socket(dir: &Path) -> PathBuf {
    dir.join("pod-resources").join(KUBELET_SOCKET)
}

/// Serves the API on [`socket`] until the returned handle is stopped.
pub(super) async fn serve(shared: Arc<Shared>, pods: Store<Pod>) -> anyhow::Result<ServedSocket> {
    let path = socket(&shared.dir);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    let service = PodResourcesListerServer::new(PodResourcesService { shared, pods });
    ServedSocket::serve(&path, Server::builder().add_service(service))
}

struct PodResourcesService {
    shared: Arc<Shared>,
    pods: Store<Pod>,
}

impl PodResourcesService {
    /// Pods kubelet counts as active, oldest first.
    fn active_pods(&self, state: &State) -> Vec<Arc<Pod>> {
        let mut pods: Vec<Arc<Pod>> = self
            .pods
            .state()
            .into_iter()
            .filter(|pod| {
                let uid = pod.metadata.uid.as_deref().unwrap_or_default();
                !finished(pod) && !state.rejected.contains(uid)
            })
            .collect();
        pods.sort_by(|a, b| by_creation(a, b));
        pods
    }

    fn pod_resources(state: &State, pod: &Pod) -> PodResources {
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        let held = state.container_devices.get(uid);
        let containers = pod
            .spec
            .iter()
            .flat_map(|spec| {
                let sidecars = spec
                    .init_containers
                    .iter()
                    .flatten()
                    .filter(|c| c.restart_policy.as_deref() == Some("Always"));
                sidecars.chain(&spec.containers)
            })
            .map(|container| ContainerResources {
                name: container.name.clone(),
                devices: held
                    .and_then(|held| held.get(&container.name))
                    .into_iter()
                    .flatten()
                    .flat_map(|(resource, ids)| {
                        ids.iter()
                            .flat_map(|id| device_entries(state, resource, id))
                            .collect::<Vec<_>>()
                    })
                    .collect(),
                ..ContainerResources::default()
            })
            .collect();
        PodResources {
            name: pod.metadata.name.clone().unwrap_or_default(),
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            containers,
        }
    }
}

/// How kubelet reports one device: once per NUMA node it sits on, or once without topology.
fn device_entries(state: &State, resource: &str, id: &str) -> Vec<ContainerDevices> {
    let nodes = state
        .plugins
        .get(resource)
        .and_then(|plugin| plugin.numa.get(id))
        .cloned()
        .unwrap_or_default();
    let entry = |topology| ContainerDevices {
        resource_name: resource.to_owned(),
        device_ids: vec![id.to_owned()],
        topology,
    };
    if nodes.is_empty() {
        return vec![entry(None)];
    }
    nodes
        .into_iter()
        .map(|node| {
            entry(Some(TopologyInfo {
                nodes: vec![NumaNode { id: node }],
            }))
        })
        .collect()
}

#[tonic::async_trait]
impl PodResourcesLister for PodResourcesService {
    async fn list(
        &self,
        _request: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        let state = self.shared.lock();
        let pod_resources = self
            .active_pods(&state)
            .iter()
            .map(|pod| Self::pod_resources(&state, pod))
            .collect();
        Ok(Response::new(ListPodResourcesResponse { pod_resources }))
    }

    async fn get_allocatable_resources(
        &self,
        _request: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        let state = self.shared.lock();
        let devices = state
            .plugins
            .iter()
            .flat_map(|(resource, plugin)| {
                plugin
                    .devices
                    .iter()
                    .flat_map(|(id, _)| device_entries(&state, resource, id))
                    .collect::<Vec<_>>()
            })
            .collect();
        Ok(Response::new(AllocatableResourcesResponse {
            devices,
            ..AllocatableResourcesResponse::default()
        }))
    }

    async fn get(
        &self,
        request: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        let request = request.into_inner();
        let state = self.shared.lock();
        let pod = self.active_pods(&state).into_iter().find(|pod| {
            pod.metadata.name.as_deref() == Some(request.pod_name.as_str())
                && pod.metadata.namespace.as_deref() == Some(request.pod_namespace.as_str())
        });
        match pod {
            Some(pod) => Ok(Response::new(GetPodResourcesResponse {
                pod_resources: Some(Self::pod_resources(&state, &pod)),
            })),
            None => Err(Status::unknown(format!(
                "pod {} in namespace {} not found",
                request.pod_name, request.pod_namespace
            ))),
        }
    }
}
