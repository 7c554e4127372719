//! The compute resource (`<domain>/gpu-compute`): 100 units a GPU, one per percent of its SM
//! time, served on a socket of its own beside the memory resource.
//!
//! Why a second resource and not a field of the memory one: kube-scheduler and kubelet count
//! an extended resource per node, and only a resource of its own lets a pod ask for compute
//! and memory separately (`gpu-mem: 4`, `gpu-compute: 30`) and be refused at admission when
//! the node's total is out. Which GPU the compute is on is the extender's decision, recorded
//! with the memory in the pod's allocation (`<domain>/v1.compute`), exactly as for memory:
//! the unit tokens kubelet picks here say nothing about it.
//!
//! So `Allocate` here only checks that every token is one we advertised and answers with
//! nothing: kubelet calls the memory resource's `Allocate` for the same container, and that
//! answer (which finds the container's pod and its allocation) hands it its compute share
//! (`GPUSHARE_COMPUTE_PERCENT`, see `gpushare_contract::env`). A container that asks for
//! compute without memory never gets here: the webhook and the extender refuse the pod
//! (`gpushare_contract::request`).
//!
//! GPU `GPU-abc` becomes devices `GPU-abc-c0` … `GPU-abc-c99`, healthy while the GPU is.
//! The plugin's `/readyz` follows the memory resource's registration alone: a node whose
//! compute registration lags still takes the pods that ask for memory only.

use std::sync::Arc;

use gpushare_contract::GpuInfo;
use gpushare_proto::v1beta1::device_plugin_server::DevicePlugin;
use gpushare_proto::v1beta1::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, Device, DevicePluginOptions,
    Empty, PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse,
};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::devices::device_of;
use crate::node::Inventory;
use crate::service::{DeviceStream, device_stream};

/// The compute resource's socket file name inside the device plugin directory.
pub const SOCKET_NAME: &str = "gpushare-gpu-compute.sock";
/// Units advertised per healthy GPU: one per percent.
pub const UNITS_PER_GPU: u32 = gpushare_contract::request::COMPUTE_PER_GPU;

/// The ID of compute unit `unit` of the GPU `uuid`.
pub fn device_id(uuid: &str, unit: u32) -> String {
    format!("{uuid}-c{unit}")
}

/// Every compute unit of every GPU, health and NUMA node taken from the GPU.
pub fn device_list(gpus: &[GpuInfo]) -> Vec<Device> {
    gpus.iter()
        .flat_map(|gpu| {
            (0..UNITS_PER_GPU).map(move |unit| device_of(gpu, device_id(&gpu.uuid, unit)))
        })
        .collect()
}

/// Whether `id` is a compute unit we advertise for one of `gpus`.
pub fn is_ours(gpus: &[GpuInfo], id: &str) -> bool {
    let Some((uuid, unit)) = id.rsplit_once("-c") else {
        return false;
    };
    unit.parse::<u32>().is_ok_and(|unit| unit < UNITS_PER_GPU)
        && gpus.iter().any(|gpu| gpu.uuid == uuid)
}

/// The compute resource's service over the node's GPU inventory; `stop` ends its
/// ListAndWatch streams (one socket generation, as for memory).
#[derive(Debug, Clone)]
pub struct GpuComputeService {
    node: String,
    inventory: Inventory,
    stop: CancellationToken,
    announced: Arc<tokio::sync::Notify>,
}

impl GpuComputeService {
    /// A service for `node`'s `inventory`; `announced` is notified when a stream has sent
    /// its list the second time (`service::REANNOUNCE_AFTER`, for the same reason as
    /// memory's).
    pub fn new(
        node: String,
        inventory: Inventory,
        stop: CancellationToken,
        announced: Arc<tokio::sync::Notify>,
    ) -> Self {
        Self {
            node,
            inventory,
            stop,
            announced,
        }
    }
}

#[tonic::async_trait]
impl DevicePlugin for GpuComputeService {
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
            &self.inventory,
            (&self.stop, &self.announced),
            self.node.clone(),
            device_list,
        )))
    }

    async fn get_preferred_allocation(
        &self,
        _request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        Err(Status::unimplemented(
            "the compute resource has no preferred allocation: which GPU is the extender's decision",
        ))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let gpus = self.inventory.borrow().clone();
        let request = request.into_inner();
        let mut container_responses = Vec::with_capacity(request.container_requests.len());
        for container in &request.container_requests {
            let unknown: Vec<&str> = container
                .devices_ids
                .iter()
                .map(String::as_str)
                .filter(|id| !is_ours(&gpus, id))
                .collect();
            if !unknown.is_empty() {
                tracing::warn!(node = %self.node, ?unknown, "Allocate of compute units we never advertised");
                return Err(Status::invalid_argument(format!(
                    "node {}: compute units {} were never advertised here",
                    self.node,
                    unknown.join(", ")
                )));
            }
            // The share itself comes with the container's memory (see the module doc).
            container_responses.push(ContainerAllocateResponse::default());
        }
        Ok(Response::new(AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _request: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// The options sent at registration and from `GetDevicePluginOptions`.
pub fn options() -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: false,
    }
}

#[cfg(test)]
mod tests {
    use gpushare_proto::{HEALTHY, UNHEALTHY};

    use super::*;

    fn gpu(index: u32, healthy: bool) -> GpuInfo {
        GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            model: String::new(),
            mem_gib: 16,
            healthy,
            numa_node: None,
        }
    }

    #[test]
    fn a_hundred_units_a_gpu_healthy_with_it() {
        let gpus = [gpu(0, true), gpu(1, false)];
        let devices = device_list(&gpus);
        assert_eq!(devices.len(), 200);
        assert_eq!(devices[0].id, "GPU-0-c0");
        assert_eq!(devices[199].id, "GPU-1-c99");
        assert!(devices[..100].iter().all(|d| d.health == HEALTHY));
        assert!(devices[100..].iter().all(|d| d.health == UNHEALTHY));
        assert!(is_ours(&gpus, "GPU-1-c99"));
        for foreign in ["GPU-1-c100", "GPU-2-c0", "GPU-0-3", "GPU-0-cx", ""] {
            assert!(!is_ours(&gpus, foreign), "{foreign}");
        }
    }

    #[tokio::test]
    async fn allocate_answers_nothing_for_units_we_advertised_and_refuses_others() {
        let inventory = Inventory::new(Arc::new(vec![gpu(0, true)]));
        let service = GpuComputeService::new(
            "n".into(),
            inventory,
            CancellationToken::new(),
            Arc::default(),
        );
        let ask = |ids: &[&str]| {
            Request::new(AllocateRequest {
                container_requests: vec![gpushare_proto::v1beta1::ContainerAllocateRequest {
                    devices_ids: ids.iter().map(|id| (*id).to_owned()).collect(),
                }],
            })
        };
        let answer = service
            .allocate(ask(&["GPU-0-c1", "GPU-0-c2"]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            answer.container_responses,
            vec![ContainerAllocateResponse::default()]
        );
        let refused = service.allocate(ask(&["GPU-9-c1"])).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
        assert!(
            refused.message().contains("GPU-9-c1"),
            "{}",
            refused.message()
        );
    }
}
