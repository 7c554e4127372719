//! The DRA scheduler's control loop: it watches Pods, Nodes, ResourceClaims, ResourceSlices
//! and DeviceClasses, and in each pass releases the claims of pods gone or finished (as the
//! resourceclaim controller does), then places pending pods with claims on the first node
//! where [`allocate`] fits them all, writes the claims' status (PreBind) and binds.
//!
//! The allocation itself is pure and lives in `allocate.rs`; this module is the I/O
//! around it: stores, the assume cache of claims just written, status patches, bindings.
//! Node choice is the first feasible node by name: kube-scheduler's DRA plugin does not
//! score and the default scores (least allocated CPU and memory) do not see devices.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Binding, Node, ObjectReference, Pod};
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceClass, ResourceClaim, ResourceClaimConsumerReference,
    ResourceClaimStatus, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::AllocateError;
use super::allocate::{allocate, allocated_node};
use super::usage::Usage;
use crate::control_loop::{next_pass, stop_tasks, watch};
use crate::resourceclaim;

/// The stores a pass reads.
#[derive(Clone)]
struct Stores {
    pods: Store<Pod>,
    nodes: Store<Node>,
    claims: Store<ResourceClaim>,
    slices: Store<ResourceSlice>,
    classes: Store<DeviceClass>,
}

/// Schedules pods that use ResourceClaims, and releases claims their pods no longer need.
pub struct DraScheduler {
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl DraScheduler {
    /// Starts watching and scheduling through `client`.
    pub fn start(client: Client) -> Self {
        let stop = CancellationToken::new();
        let notify = Arc::new(Notify::new());
        let mut tasks = Vec::new();
        let stores = Stores {
            pods: watch("DRA scheduler", &client, &notify, &stop, &mut tasks),
            nodes: watch("DRA scheduler", &client, &notify, &stop, &mut tasks),
            claims: watch("DRA scheduler", &client, &notify, &stop, &mut tasks),
            slices: watch("DRA scheduler", &client, &notify, &stop, &mut tasks),
            classes: watch("DRA scheduler", &client, &notify, &stop, &mut tasks),
        };
        let loop_stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut scheduler = Passes {
                client,
                stores,
                written: HashMap::new(),
            };
            for store in [
                scheduler.stores.pods.wait_until_ready().await.is_ok(),
                scheduler.stores.nodes.wait_until_ready().await.is_ok(),
                scheduler.stores.claims.wait_until_ready().await.is_ok(),
                scheduler.stores.slices.wait_until_ready().await.is_ok(),
                scheduler.stores.classes.wait_until_ready().await.is_ok(),
            ] {
                if !store {
                    return;
                }
            }
            loop {
                scheduler.pass().await;
                if !next_pass(&loop_stop, &notify).await {
                    return;
                }
            }
        }));
        Self { stop, tasks }
    }

    /// Stops every task.
    pub async fn shutdown(self) {
        stop_tasks(self.stop, self.tasks).await;
    }
}

struct Passes {
    client: Client,
    stores: Stores,
    /// Claims as this scheduler last wrote them, until the watch shows that version (the
    /// assume cache: the next pass must not allocate what was just allocated).
    written: HashMap<(String, String), ResourceClaim>,
}

fn rv(claim: &ResourceClaim) -> u64 {
    claim
        .metadata
        .resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn claim_key(claim: &ResourceClaim) -> (String, String) {
    (claim.namespace().unwrap_or_default(), claim.name_any())
}

impl Passes {
    /// The claims as they are now: the store, or what this scheduler wrote if newer.
    fn claims(&mut self) -> HashMap<(String, String), ResourceClaim> {
        let mut claims: HashMap<_, _> = self
            .stores
            .claims
            .state()
            .into_iter()
            .map(|c| (claim_key(&c), (*c).clone()))
            .collect();
        self.written.retain(|key, written| match claims.get(key) {
            Some(stored) if rv(stored) >= rv(written) => false,
            // Deleted since: forget it.
            None => false,
            Some(_) => true,
        });
        for (key, written) in &self.written {
            claims.insert(key.clone(), written.clone());
        }
        claims
    }

    async fn pass(&mut self) {
        self.release().await;
        let mut pods: Vec<Arc<Pod>> = self
            .stores
            .pods
            .state()
            .into_iter()
            .filter(|pod| {
                pod.spec.as_ref().is_some_and(|s| {
                    s.node_name.is_none()
                        && s.resource_claims.as_ref().is_some_and(|c| !c.is_empty())
                }) && pod.metadata.deletion_timestamp.is_none()
            })
            .collect();
        pods.sort_by(|a, b| {
            (
                a.metadata.creation_timestamp.as_ref().map(|t| t.0),
                a.name_any(),
            )
                .cmp(&(
                    b.metadata.creation_timestamp.as_ref().map(|t| t.0),
                    b.name_any(),
                ))
        });
        for pod in pods {
            self.schedule(&pod).await;
        }
    }

    /// As the resourceclaim controller: reservations of pods that are gone or finished are
    /// removed, and a claim reserved for no one is deallocated.
    async fn release(&mut self) {
        let live: HashSet<String> = self
            .stores
            .pods
            .state()
            .iter()
            .filter(|pod| !gpushare_contract::request::pod_is_finished(pod))
            .filter_map(|pod| pod.metadata.uid.clone())
            .collect();
        for (_, claim) in self.claims() {
            let Some(status) = &claim.status else {
                continue;
            };
            let reserved = status.reserved_for.clone().unwrap_or_default();
            let kept: Vec<_> = reserved
                .iter()
                .filter(|r| r.resource != "pods" || live.contains(&r.uid))
                .cloned()
                .collect();
            if kept.len() == reserved.len() && !(kept.is_empty() && status.allocation.is_some()) {
                continue;
            }
            let mut updated = claim.clone();
            updated.status = Some(ResourceClaimStatus {
                allocation: if kept.is_empty() {
                    None
                } else {
                    status.allocation.clone()
                },
                reserved_for: (!kept.is_empty()).then_some(kept),
                devices: status.devices.clone(),
            });
            if let Err(error) = self.write_status(&updated).await {
                tracing::debug!(claim = ?claim_key(&claim), %error, "releasing the claim failed; retrying");
            }
        }
    }

    async fn write_status(&mut self, claim: &ResourceClaim) -> Result<(), String> {
        let (namespace, name) = claim_key(claim);
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &namespace);
        let stored = api
            .replace_status(&name, &PostParams::default(), claim)
            .await
            .map_err(kube_message)?;
        self.written.insert(claim_key(&stored), stored);
        Ok(())
    }

    /// One scheduling attempt for `pod`: find its claims, the first node where all of them
    /// fit, reserve them (PreBind), bind.
    async fn schedule(&mut self, pod: &Pod) {
        let namespace = pod.namespace().unwrap_or_default();
        let pod_key = format!("{namespace}/{}", pod.name_any());
        let claims = self.claims();
        let Some(mine) = self.pod_claims(pod, &pod_key, &claims).await else {
            return;
        };
        let nodes = self.candidate_nodes(&mine);
        let slices = self.stores.slices.state();
        let classes: HashMap<String, Arc<DeviceClass>> = self
            .stores
            .classes
            .state()
            .into_iter()
            .map(|c| (c.name_any(), c))
            .collect();
        let base = Usage::of(claims.values());
        let (node, allocations) = match place(&mine, &nodes, &slices, &classes, &base) {
            Ok(placed) => placed,
            Err(Unplaced::Unsupported(message)) => {
                self.unschedulable(pod, &message).await;
                return;
            }
            Err(Unplaced::NoFit(reasons)) => {
                let detail = reasons
                    .iter()
                    .map(|(reason, count)| format!("{count} {reason}"))
                    .collect::<Vec<_>>()
                    .join(", ");
                self.unschedulable(
                    pod,
                    &format!("0/{} nodes are available: {detail}.", nodes.len()),
                )
                .await;
                return;
            }
        };
        if self.reserve(pod, &pod_key, &mine, allocations).await {
            self.bind(pod, &pod_key, &node).await;
        }
    }

    /// The claims `pod` uses, as [`Passes::claims`] sees them; `None` when the pod must wait
    /// (its claim is not created yet, or it is unschedulable, which is then reported).
    async fn pod_claims(
        &self,
        pod: &Pod,
        pod_key: &str,
        claims: &HashMap<(String, String), ResourceClaim>,
    ) -> Option<Vec<ResourceClaim>> {
        let namespace = pod.namespace().unwrap_or_default();
        let mut mine = Vec::new();
        for entry in pod
            .spec
            .iter()
            .flat_map(|s| s.resource_claims.iter().flatten())
        {
            let (name, check_owner) = match resourceclaim::claim_name(pod, entry) {
                Ok(Some(found)) => found,
                // The controller recorded that no claim is needed.
                Ok(None) => continue,
                // As upstream's PreEnqueue: the pod waits, without a condition, until the
                // resourceclaim controller created its claim.
                Err(error @ resourceclaim::ClaimNameError::NotCreatedYet { .. }) => {
                    tracing::debug!(pod = %pod_key, %error, "waiting for the claim");
                    return None;
                }
                Err(error) => {
                    self.unschedulable(pod, &error.to_string()).await;
                    return None;
                }
            };
            match claims.get(&(namespace.clone(), name.clone())) {
                Some(claim) => {
                    if check_owner && let Err(message) = resourceclaim::is_for_pod(pod, claim) {
                        self.unschedulable(pod, &message).await;
                        return None;
                    }
                    mine.push(claim.clone());
                }
                None => {
                    self.unschedulable(pod, &format!("resourceclaim \"{name}\" not found"))
                        .await;
                    return None;
                }
            }
        }
        Some(mine)
    }

    /// The schedulable nodes by name, or only the node a claim in `mine` is allocated on.
    fn candidate_nodes(&self, mine: &[ResourceClaim]) -> Vec<Arc<Node>> {
        let mut nodes: Vec<Arc<Node>> = self
            .stores
            .nodes
            .state()
            .into_iter()
            .filter(|n| {
                !n.spec
                    .as_ref()
                    .and_then(|s| s.unschedulable)
                    .unwrap_or(false)
            })
            .collect();
        nodes.sort_by_key(|n| n.name_any());
        if let Some(node) = mine.iter().find_map(allocated_node) {
            nodes.retain(|n| n.name_any() == node);
        }
        nodes
    }

    /// PreBind: each claim in `mine` gets its allocation (if new) and `pod` in
    /// `reservedFor`. `false` when a write failed (the pod is retried).
    async fn reserve(
        &mut self,
        pod: &Pod,
        pod_key: &str,
        mine: &[ResourceClaim],
        allocations: Vec<Option<AllocationResult>>,
    ) -> bool {
        let reference = ResourceClaimConsumerReference {
            api_group: Some(String::new()),
            resource: "pods".to_owned(),
            name: pod.name_any(),
            uid: pod.metadata.uid.clone().unwrap_or_default(),
        };
        for (claim, allocation) in mine.iter().zip(allocations) {
            let mut updated = claim.clone();
            let status = updated
                .status
                .get_or_insert_with(ResourceClaimStatus::default);
            if let Some(allocation) = allocation {
                status.allocation = Some(allocation);
            }
            let reserved = status.reserved_for.get_or_insert_with(Vec::new);
            if !reserved.iter().any(|r| r.uid == reference.uid) {
                reserved.push(reference.clone());
            }
            if let Err(error) = self.write_status(&updated).await {
                tracing::info!(pod = %pod_key, claim = ?claim_key(claim), %error, "reserving the claim failed; the pod is retried");
                return false;
            }
        }
        true
    }

    /// Binds `pod` to `node` through `pods/binding`.
    async fn bind(&self, pod: &Pod, pod_key: &str, node: &str) {
        let namespace = pod.namespace().unwrap_or_default();
        let binding = Binding {
            metadata: ObjectMeta {
                name: Some(pod.name_any()),
                namespace: Some(namespace.clone()),
                uid: pod.metadata.uid.clone(),
                ..ObjectMeta::default()
            },
            target: ObjectReference {
                kind: Some("Node".to_owned()),
                name: Some(node.to_owned()),
                ..ObjectReference::default()
            },
        };
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
        match api
            .create_subresource::<_, serde_json::Value>(
                "binding",
                &pod.name_any(),
                &PostParams::default(),
                &binding,
            )
            .await
        {
            Ok(_) => tracing::info!(pod = %pod_key, %node, "bound with its claims allocated"),
            Err(error) => {
                tracing::info!(pod = %pod_key, error = %kube_message(error), "binding failed; the claims are released when the pod goes")
            }
        }
    }

    /// Sets `PodScheduled=False`, reason `Unschedulable`, unless already so with `message`.
    async fn unschedulable(&self, pod: &Pod, message: &str) {
        let already = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .any(|c| c.type_ == "PodScheduled" && c.message.as_deref() == Some(message));
        if already {
            return;
        }
        let api: Api<Pod> =
            Api::namespaced(self.client.clone(), &pod.namespace().unwrap_or_default());
        let patch = json!({"status": {"conditions": [{
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": message,
            "lastTransitionTime": jiff::Timestamp::now().to_string(),
        }]}});
        if let Err(error) = api
            .patch_status(
                &pod.name_any(),
                &PatchParams::default(),
                &Patch::Strategic(patch),
            )
            .await
        {
            tracing::debug!(pod = %pod.name_any(), error = %kube_message(error), "cannot report why the pod waits");
        }
    }
}

fn kube_message(error: kube::Error) -> String {
    match error {
        kube::Error::Api(status) => status.message,
        other => other.to_string(),
    }
}

/// Why no node could take a pod's claims.
enum Unplaced {
    /// A claim asks for something this scheduler does not implement.
    Unsupported(String),
    /// Every node's reason, with how many nodes gave it.
    NoFit(BTreeMap<String, usize>),
}

/// The first of `nodes` where every claim in `mine` that is not allocated yet can be
/// allocated beside `base`, with those allocations (`None` for a claim allocated already).
fn place(
    mine: &[ResourceClaim],
    nodes: &[Arc<Node>],
    slices: &[Arc<ResourceSlice>],
    classes: &HashMap<String, Arc<DeviceClass>>,
    base: &Usage,
) -> Result<(String, Vec<Option<AllocationResult>>), Unplaced> {
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    for node in nodes {
        let name = node.name_any();
        let mut usage = base.clone();
        let mut allocations = Vec::new();
        let mut failed = None;
        for claim in mine {
            if claim
                .status
                .as_ref()
                .is_some_and(|s| s.allocation.is_some())
            {
                allocations.push(None);
                continue;
            }
            match allocate(claim, &name, slices, classes, &mut usage) {
                Ok(allocation) => allocations.push(Some(allocation)),
                Err(AllocateError::Unsupported(message)) => {
                    return Err(Unplaced::Unsupported(message));
                }
                Err(AllocateError::NoFit(message)) => {
                    failed = Some(message);
                    break;
                }
            }
        }
        match failed {
            Some(reason) => *reasons.entry(reason).or_default() += 1,
            None => return Ok((name, allocations)),
        }
    }
    Err(Unplaced::NoFit(reasons))
}
