//! The two gRPC services kubelet calls: the plugin registration API (who we are, where our
//! DRA socket is) and the DRA plugin API (`NodePrepareResources`, `NodeUnprepareResources`).
//!
//! Prepare, per claim: answered from the checkpoint when already prepared; otherwise the
//! claim is read from the API server ([`ClaimSource`]), planned ([`crate::prepare::plan`]),
//! its CDI spec written and the checkpoint saved, in that order, so a crash in between leaves
//! at worst an unused spec file that the next Prepare overwrites. Unprepare removes the spec,
//! then the checkpoint entry; a claim not in the checkpoint is already unprepared. Failures
//! are per claim, in the response's `error`, as the API asks; claims are handled one at a
//! time under one lock (kubelet calls are few, and the checkpoint is one file).

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use gpushare_contract::GpuInfo;
use gpushare_proto::dra::v1::dra_plugin_server::DraPlugin;
use gpushare_proto::dra::v1::{
    Claim, Device, NodePrepareResourceResponse, NodePrepareResourcesRequest,
    NodePrepareResourcesResponse, NodeUnprepareResourceResponse, NodeUnprepareResourcesRequest,
    NodeUnprepareResourcesResponse,
};
use gpushare_proto::pluginregistration::registration_server::Registration;
use gpushare_proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use k8s_openapi::api::resource::v1::ResourceClaim;
use tokio::sync::Mutex;
use tonic::{Request, Response, Status};

use crate::checkpoint::{Checkpoint, PreparedClaim};
use crate::{cdi, prepare};

/// Where Prepare reads claims from: the API server in production, a map in tests.
pub trait ClaimSource: Send + Sync + 'static {
    /// The claim `namespace/name` as stored now, or a message saying why it cannot be read.
    fn claim(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<ResourceClaim, String>> + Send;
}

impl ClaimSource for kube::Client {
    async fn claim(&self, namespace: &str, name: &str) -> Result<ResourceClaim, String> {
        kube::Api::<ResourceClaim>::namespaced(self.clone(), namespace)
            .get(name)
            .await
            .map_err(|err| format!("reading ResourceClaim {namespace}/{name}: {err}"))
    }
}

/// What the DRA service needs to know about its node and driver.
#[derive(Debug, Clone)]
pub struct Node {
    /// The driver name (also the CDI vendor).
    pub driver: String,
    /// This node's name (also the pool name).
    pub node: String,
    /// This node's GPUs.
    pub gpus: Vec<GpuInfo>,
    /// The CDI spec directory.
    pub cdi_dir: PathBuf,
    /// The checkpoint file.
    pub checkpoint_path: PathBuf,
    /// How shares are enforced (what the CDI specs carry for the enforcer).
    pub enforcement: cdi::EnforcementConfig,
}

impl Node {
    /// The CDI kind of our devices: `<driver>/gpu`.
    pub fn cdi_kind(&self) -> String {
        format!("{}/gpu", self.driver)
    }
}

/// The `DRAPlugin` service.
pub struct DraService<C> {
    node: Arc<Node>,
    claims: C,
    checkpoint: Arc<Mutex<Checkpoint>>,
}

impl<C: ClaimSource> DraService<C> {
    /// A service for `node` reading claims from `claims`, remembering in `checkpoint`.
    pub fn new(node: Arc<Node>, claims: C, checkpoint: Checkpoint) -> Self {
        Self {
            node,
            claims,
            checkpoint: Arc::new(Mutex::new(checkpoint)),
        }
    }

    async fn prepare_one(
        &self,
        checkpoint: &mut Checkpoint,
        claim: &Claim,
    ) -> Result<Vec<prepare::PreparedDevice>, String> {
        if let Some(prepared) = checkpoint.claims.get(&claim.uid) {
            return Ok(prepared.devices.clone());
        }
        let object = self.claims.claim(&claim.namespace, &claim.name).await?;
        let node = &self.node;
        let devices = prepare::plan(
            &object,
            &claim.uid,
            &node.driver,
            &node.node,
            &node.gpus,
            &node.cdi_kind(),
        )
        .map_err(|err| err.to_string())?;
        let enforcement = node.enforcement.for_namespace(&claim.namespace);
        if let Some(isolation) = &enforcement.isolation {
            // The claim's budget and the read-only limits file its containers' interposer
            // reads, made before any container starts.
            let name = cdi::accounting_dir_name(&claim.uid);
            let (shares, uuids) = cdi::isolation_shares(&devices);
            gpushare_runtime::isolation::prepare_accounting_with_compute(
                &isolation.host_dir,
                &name,
                (&shares, &uuids),
                isolation.options,
                cdi::claim_compute(&devices),
            )
            .map_err(|err| format!("preparing the claim's isolation accounting {name}: {err}"))?;
        }
        let path = cdi::spec_path(&node.cdi_dir, &node.driver, &claim.uid);
        let spec = cdi::spec(&node.cdi_kind(), &claim.uid, &devices, &enforcement);
        cdi::write(&path, &spec)
            .map_err(|err| format!("writing CDI spec {}: {err}", path.display()))?;
        checkpoint.claims.insert(
            claim.uid.clone(),
            PreparedClaim {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                devices: devices.clone(),
            },
        );
        if let Err(err) = checkpoint.save(&node.checkpoint_path) {
            checkpoint.claims.remove(&claim.uid);
            return Err(err.to_string());
        }
        for device in &devices {
            tracing::info!(claim = %format!("{}/{}", claim.namespace, claim.name), uid = %claim.uid, gpu = device.gpu_index, gib = device.gib, compute = device.compute, "prepared");
        }
        Ok(devices)
    }

    fn unprepare_one(&self, checkpoint: &mut Checkpoint, claim: &Claim) -> Result<(), String> {
        let Some(prepared) = checkpoint.claims.remove(&claim.uid) else {
            return Ok(());
        };
        let path = cdi::spec_path(&self.node.cdi_dir, &self.node.driver, &claim.uid);
        let result = cdi::remove(&path)
            .map_err(|err| format!("removing CDI spec {}: {err}", path.display()))
            .and_then(|()| {
                checkpoint
                    .save(&self.node.checkpoint_path)
                    .map_err(|err| err.to_string())
            });
        if result.is_err() {
            checkpoint.claims.insert(claim.uid.clone(), prepared);
        } else {
            if let Some(isolation) = &self.node.enforcement.isolation {
                let name = cdi::accounting_dir_name(&claim.uid);
                if let Err(err) =
                    gpushare_runtime::isolation::remove_accounting_dir(&isolation.host_dir, &name)
                {
                    tracing::warn!(uid = %claim.uid, %err, "could not remove the claim's isolation accounting directory and limits file");
                }
            }
            tracing::info!(claim = %format!("{}/{}", claim.namespace, claim.name), uid = %claim.uid, "unprepared");
        }
        result
    }
}

#[tonic::async_trait]
impl<C: ClaimSource> DraPlugin for DraService<C> {
    async fn node_prepare_resources(
        &self,
        request: Request<NodePrepareResourcesRequest>,
    ) -> Result<Response<NodePrepareResourcesResponse>, Status> {
        let mut checkpoint = self.checkpoint.lock().await;
        let mut claims = HashMap::new();
        for claim in request.into_inner().claims {
            let answer = match self.prepare_one(&mut checkpoint, &claim).await {
                Ok(devices) => NodePrepareResourceResponse {
                    devices: devices
                        .into_iter()
                        .map(|d| Device {
                            request_names: vec![d.request],
                            pool_name: d.pool,
                            device_name: d.device,
                            cdi_device_ids: vec![d.cdi_device_id],
                        })
                        .collect(),
                    error: String::new(),
                },
                Err(error) => {
                    tracing::warn!(claim = %format!("{}/{}", claim.namespace, claim.name), uid = %claim.uid, %error, "prepare failed");
                    NodePrepareResourceResponse {
                        devices: vec![],
                        error,
                    }
                }
            };
            claims.insert(claim.uid, answer);
        }
        Ok(Response::new(NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<NodeUnprepareResourcesRequest>,
    ) -> Result<Response<NodeUnprepareResourcesResponse>, Status> {
        let mut checkpoint = self.checkpoint.lock().await;
        let mut claims = HashMap::new();
        for claim in request.into_inner().claims {
            let error = self
                .unprepare_one(&mut checkpoint, &claim)
                .err()
                .unwrap_or_default();
            claims.insert(claim.uid, NodeUnprepareResourceResponse { error });
        }
        Ok(Response::new(NodeUnprepareResourcesResponse { claims }))
    }
}

/// What kubelet last told us about our registration (`NotifyRegistrationStatus`); the
/// readiness probe ([`crate::probes`]) answers from it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum RegistrationState {
    /// kubelet has not answered since the plugin started: it may not have found the
    /// registration socket yet, or not called `GetInfo`.
    #[default]
    Pending,
    /// kubelet registered the plugin: it sends claims to the DRA socket.
    Registered,
    /// kubelet refused the registration, with its error.
    Refused(String),
}

/// The registration service kubelet's plugin watcher calls on our registry socket.
#[derive(Debug, Clone)]
pub struct RegistrationService {
    driver: String,
    endpoint: PathBuf,
    registered: tokio::sync::watch::Sender<RegistrationState>,
}

impl RegistrationService {
    /// Registers `driver` with its DRA socket at `endpoint`; `registered` follows kubelet's
    /// verdict.
    pub fn new(
        driver: String,
        endpoint: PathBuf,
        registered: tokio::sync::watch::Sender<RegistrationState>,
    ) -> Self {
        Self {
            driver,
            endpoint,
            registered,
        }
    }
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: gpushare_proto::dra::PLUGIN_TYPE.to_owned(),
            name: self.driver.clone(),
            endpoint: self.endpoint.display().to_string(),
            supported_versions: vec![gpushare_proto::dra::V1_SERVICE.to_owned()],
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        let state = if status.plugin_registered {
            tracing::info!(driver = %self.driver, "registered with kubelet");
            RegistrationState::Registered
        } else {
            tracing::error!(driver = %self.driver, error = %status.error, "kubelet refused the registration");
            RegistrationState::Refused(status.error)
        };
        self.registered.send_replace(state);
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}
