//! kube-controller-manager's resourceclaim controller and the part of its garbage collector
//! that DRA pods meet, for the in-process cluster.
//!
//! Users rarely create a ResourceClaim per pod by hand: a pod names a ResourceClaimTemplate
//! (`spec.resourceClaims[].resourceClaimTemplateName`) and the control plane stamps out one
//! claim per pod from it. Upstream (`pkg/controller/resourceclaim/controller.go`) does that
//! like this, and so does [`ClaimController`]:
//!
//! ```text
//!  pod (not deleting), per pod claim with a template, not yet in status.resourceClaimStatuses
//!     ─▶ a claim this pod owns already, annotated with the pod claim's name? reuse it
//!        (created before a failed status write)
//!     ─▶ else create from the template: generateName <pod>-<claim>-, spec from the
//!        template, its labels and annotations + resource.kubernetes.io/pod-claim-name,
//!        ownerReference to the pod (controller, blockOwnerDeletion)
//!     ─▶ pods/status: resourceClaimStatuses += {name: <pod claim>, resourceClaimName}
//!     ─▶ template missing or create refused: Warning Event FailedResourceClaimCreation
//!  claim controlled by a pod, reserved for no one:
//!     pod done (Succeeded/Failed, or deleting and never scheduled) or replaced ─▶ delete
//!     pod gone (confirmed with a GET, as the garbage collector does) ─▶ delete
//! ```
//!
//! The scheduler and kubelet find a pod's claims through [`claim_name`], which is upstream's
//! `resourceclaim.Name`: a template's claim is known only once the controller recorded it in
//! the pod's status, and then it must be controlled by that pod ([`is_for_pod`]).
//!
//! The garbage collector deletes a claim whose owner is gone only once no one holds a
//! reservation on it, as upstream's `resource.kubernetes.io/delete-protection` finalizer
//! keeps a deleted claim until the reservation is dropped and the allocation cleared (which
//! the DRA scheduler driver does here).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::ControlFlow;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{ObjectReference, Pod, PodResourceClaim, PodResourceClaimStatus};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::control_loop::{next_pass, stop_tasks, watch};

/// The annotation that ties a generated claim to its pod claim (upstream's
/// `podResourceClaimAnnotation`).
pub const POD_CLAIM_ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";

/// Why a pod claim names no ResourceClaim yet, or cannot.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ClaimNameError {
    /// The claim comes from a template and the controller has not recorded it yet.
    #[error("pod \"{pod}\": ResourceClaim not created yet")]
    NotCreatedYet {
        /// `namespace/name` of the pod
        pod: String,
    },
    /// The pod claim names neither a claim nor a template.
    #[error("pod \"{pod}\", spec.resourceClaim \"{claim}\": unsupported API")]
    Unsupported {
        /// `namespace/name` of the pod
        pod: String,
        /// the pod claim
        claim: String,
    },
}

/// The ResourceClaim a pod claim stands for, as upstream's `resourceclaim.Name`:
/// `Ok(Some((name, must_check_owner)))`, or `Ok(None)` when the controller recorded that no
/// claim is needed. A template's claim must be checked with [`is_for_pod`].
pub fn claim_name(
    pod: &Pod,
    pod_claim: &PodResourceClaim,
) -> Result<Option<(String, bool)>, ClaimNameError> {
    let pod_key = || format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
    if let Some(name) = &pod_claim.resource_claim_name {
        return Ok(Some((name.clone(), false)));
    }
    if pod_claim.resource_claim_template_name.is_none() {
        return Err(ClaimNameError::Unsupported {
            pod: pod_key(),
            claim: pod_claim.name.clone(),
        });
    }
    pod.status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .into_iter()
        .flatten()
        .find(|status| status.name == pod_claim.name)
        .map(|status| status.resource_claim_name.clone().map(|name| (name, true)))
        .ok_or_else(|| ClaimNameError::NotCreatedYet { pod: pod_key() })
}

/// The pod that controls `claim` (upstream's `owningPod`): name and UID.
pub fn owning_pod(claim: &ResourceClaim) -> Option<(String, String)> {
    claim
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true) && o.api_version == "v1" && o.kind == "Pod")
        .map(|o| (o.name.clone(), o.uid.clone()))
}

/// Upstream's `resourceclaim.IsForPod`: a generated claim is used only by the pod that
/// controls it, never by an unrelated pod that happens to know its name.
pub fn is_for_pod(pod: &Pod, claim: &ResourceClaim) -> Result<(), String> {
    let controlled =
        owning_pod(claim).is_some_and(|(_, uid)| Some(uid.as_str()) == pod.metadata.uid.as_deref());
    if controlled {
        Ok(())
    } else {
        Err(format!(
            "ResourceClaim {}/{} was not created for pod {}/{} (pod is not owner)",
            claim.namespace().unwrap_or_default(),
            claim.name_any(),
            pod.namespace().unwrap_or_default(),
            pod.name_any()
        ))
    }
}

/// Upstream's `isPodDone`: none of its containers runs or ever will.
fn pod_done(pod: &Pod) -> bool {
    let terminal = matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    );
    let unscheduled = pod.spec.as_ref().is_none_or(|s| s.node_name.is_none());
    terminal || (pod.metadata.deletion_timestamp.is_some() && unscheduled)
}

/// The `generateName` upstream gives a pod claim's claim: `<pod>-<claim>-`, both parts cut
/// in proportion when longer than 57 characters, so the random suffix fits a 63-character
/// name.
pub fn generate_name(pod: &str, pod_claim: &str) -> String {
    const MAX_BASE: usize = 57;
    let name = format!("{pod}-{pod_claim}-");
    if name.len() <= MAX_BASE {
        return name;
    }
    // Names are DNS labels (ASCII), so byte cuts are character cuts.
    let cut = |s: &str| s[..s.len() * MAX_BASE / name.len()].to_owned();
    format!("{}-{}", cut(pod), cut(pod_claim))
}

/// The claim `template` stamps out for `pod_claim` of `pod`.
pub fn claim_from_template(
    pod: &Pod,
    pod_claim: &PodResourceClaim,
    template: &ResourceClaimTemplate,
) -> ResourceClaim {
    let meta = template.spec.metadata.clone().unwrap_or_default();
    let mut annotations = meta.annotations.unwrap_or_default();
    annotations.insert(POD_CLAIM_ANNOTATION.to_owned(), pod_claim.name.clone());
    ResourceClaim {
        metadata: ObjectMeta {
            generate_name: Some(generate_name(&pod.name_any(), &pod_claim.name)),
            namespace: pod.namespace(),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".to_owned(),
                kind: "Pod".to_owned(),
                name: pod.name_any(),
                uid: pod.metadata.uid.clone().unwrap_or_default(),
                controller: Some(true),
                block_owner_deletion: Some(true),
            }]),
            annotations: Some(annotations),
            labels: meta.labels,
            ..ObjectMeta::default()
        },
        spec: template.spec.spec.clone(),
        status: None,
    }
}

/// Runs the controller against the in-process API server until shut down.
pub struct ClaimController {
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl ClaimController {
    /// Starts watching pods, claims and templates through `client`.
    pub fn start(client: Client) -> Self {
        let stop = CancellationToken::new();
        let notify = Arc::new(Notify::new());
        let mut tasks = Vec::new();
        let pods: Store<Pod> = watch(
            "resourceclaim controller",
            &client,
            &notify,
            &stop,
            &mut tasks,
        );
        let claims: Store<ResourceClaim> = watch(
            "resourceclaim controller",
            &client,
            &notify,
            &stop,
            &mut tasks,
        );
        let templates: Store<ResourceClaimTemplate> = watch(
            "resourceclaim controller",
            &client,
            &notify,
            &stop,
            &mut tasks,
        );
        let loop_stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            for ready in [
                pods.wait_until_ready().await.is_ok(),
                claims.wait_until_ready().await.is_ok(),
                templates.wait_until_ready().await.is_ok(),
            ] {
                if !ready {
                    return;
                }
            }
            let recorder = Recorder::new(
                client.clone(),
                Reporter {
                    controller: "resourceclaim-controller".to_owned(),
                    instance: None,
                },
            );
            let mut passes = Passes {
                recorder,
                reported: HashSet::new(),
                client,
                pods,
                claims,
                templates,
                created: HashMap::new(),
            };
            loop {
                passes.pass().await;
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
    pods: Store<Pod>,
    claims: Store<ResourceClaim>,
    templates: Store<ResourceClaimTemplate>,
    /// Claims this controller created, by (pod UID, pod claim), until the claim store shows
    /// them (upstream's claim cache mutation): a pass must not create a second one.
    created: HashMap<(String, String), ResourceClaim>,
    recorder: Recorder,
    /// Failures already reported: (pod UID, note).
    reported: HashSet<(String, String)>,
}

impl Passes {
    async fn pass(&mut self) {
        let claims = self.claims.state();
        self.created.retain(|_, created| {
            !claims
                .iter()
                .any(|c| c.metadata.uid.is_some() && c.metadata.uid == created.metadata.uid)
        });
        for pod in self.pods.state() {
            if pod.metadata.deletion_timestamp.is_none() {
                self.sync_pod(&pod, &claims).await;
            }
        }
        for claim in &claims {
            self.sync_claim(claim).await;
        }
    }

    /// Creates the claims of `pod`'s templates that do not exist yet and records them in
    /// its status.
    async fn sync_pod(&mut self, pod: &Pod, claims: &[Arc<ResourceClaim>]) {
        let mut new_statuses: BTreeMap<String, String> = BTreeMap::new();
        for pod_claim in pod
            .spec
            .iter()
            .flat_map(|s| s.resource_claims.iter().flatten())
        {
            match self.claim_for(pod, pod_claim, claims).await {
                ControlFlow::Break(()) => return,
                ControlFlow::Continue(None) => {}
                ControlFlow::Continue(Some(claim)) => {
                    new_statuses.insert(pod_claim.name.clone(), claim);
                }
            }
        }
        if new_statuses.is_empty() {
            return;
        }
        self.record_statuses(pod, new_statuses).await;
    }

    /// The claim to record in `pod`'s status for `pod_claim`: `Continue(None)` when there is
    /// nothing to record (its claim exists and is the pod's, or it names no template),
    /// `Continue(Some(name))` once a claim of the pod's is found or created, `Break` when the
    /// pod is to be left until the next pass (logged, or reported in an Event).
    async fn claim_for(
        &mut self,
        pod: &Pod,
        pod_claim: &PodResourceClaim,
        claims: &[Arc<ResourceClaim>],
    ) -> ControlFlow<(), Option<String>> {
        if !needs_claim(pod, pod_claim, claims)? {
            return ControlFlow::Continue(None);
        }
        let Some(template_name) = &pod_claim.resource_claim_template_name else {
            return ControlFlow::Continue(None);
        };
        let key = (
            pod.metadata.uid.clone().unwrap_or_default(),
            pod_claim.name.clone(),
        );
        let orphan = claims
            .iter()
            .map(|c| (**c).clone())
            .chain(self.created.get(&key).cloned())
            .find(|c| {
                is_for_pod(pod, c).is_ok()
                    && c.annotations().get(POD_CLAIM_ANNOTATION) == Some(&pod_claim.name)
            });
        let claim = match orphan {
            Some(claim) => claim,
            None => {
                self.create_from_template(pod, pod_claim, template_name, key)
                    .await?
            }
        };
        ControlFlow::Continue(Some(claim.name_any()))
    }

    /// Creates `pod_claim`'s claim from the template `template_name` and remembers it under
    /// `key` until the claim store shows it; `Break` when the template is missing or the
    /// create failed (reported).
    async fn create_from_template(
        &mut self,
        pod: &Pod,
        pod_claim: &PodResourceClaim,
        template_name: &str,
        key: (String, String),
    ) -> ControlFlow<(), ResourceClaim> {
        let namespace = pod.namespace().unwrap_or_default();
        let template = self.templates.state().into_iter().find(|t| {
            t.namespace().as_deref() == Some(namespace.as_str()) && t.name_any() == *template_name
        });
        let Some(template) = template else {
            let message = format!(
                "resource claim template \"{template_name}\": resourceclaimtemplates.resource.k8s.io \"{template_name}\" not found"
            );
            self.failed(pod, &pod_claim.name, &message).await;
            return ControlFlow::Break(());
        };
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &namespace);
        match api
            .create(
                &PostParams::default(),
                &claim_from_template(pod, pod_claim, &template),
            )
            .await
        {
            Ok(created) => {
                tracing::info!(pod = %pod.name_any(), claim = %created.name_any(), "created the ResourceClaim from its template");
                self.created.insert(key, created.clone());
                ControlFlow::Continue(created)
            }
            Err(error) => {
                self.failed(
                    pod,
                    &pod_claim.name,
                    &format!("create ResourceClaim: {error}"),
                )
                .await;
                ControlFlow::Break(())
            }
        }
    }

    /// Adds `new_statuses` (pod claim → claim name) to the pod's
    /// `status.resourceClaimStatuses`.
    async fn record_statuses(&self, pod: &Pod, new_statuses: BTreeMap<String, String>) {
        // A merge patch replaces the list: send the recorded entries with the new ones.
        let mut statuses: BTreeMap<String, Option<String>> = pod
            .status
            .as_ref()
            .and_then(|s| s.resource_claim_statuses.clone())
            .unwrap_or_default()
            .into_iter()
            .map(|s| (s.name, s.resource_claim_name))
            .collect();
        for (pod_claim, claim) in new_statuses {
            statuses.insert(pod_claim, Some(claim));
        }
        let statuses: Vec<PodResourceClaimStatus> = statuses
            .into_iter()
            .map(|(name, resource_claim_name)| PodResourceClaimStatus {
                name,
                resource_claim_name,
            })
            .collect();
        let namespace = pod.namespace().unwrap_or_default();
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
        let patch = json!({"status": {"resourceClaimStatuses": statuses}});
        if let Err(error) = api
            .patch_status(
                &pod.name_any(),
                &PatchParams::default(),
                &Patch::Merge(patch),
            )
            .await
        {
            tracing::warn!(pod = %pod.name_any(), %error, "recording the generated claims in the pod status failed; retrying");
        }
    }

    /// As upstream: a Warning Event `FailedResourceClaimCreation` on the pod, here once per
    /// pod and message (upstream's recorder folds the repeats of its retries into a count).
    async fn failed(&mut self, pod: &Pod, pod_claim: &str, message: &str) {
        let note = format!("PodResourceClaim {pod_claim}: {message}");
        tracing::warn!(pod = %pod.name_any(), %note, "cannot create the pod's claim; retrying");
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        if !self.reported.insert((uid.clone(), note.clone())) {
            return;
        }
        let reference = ObjectReference {
            api_version: Some("v1".to_owned()),
            kind: Some("Pod".to_owned()),
            namespace: pod.namespace(),
            name: Some(pod.name_any()),
            uid: Some(uid),
            ..ObjectReference::default()
        };
        let event = Event {
            type_: EventType::Warning,
            reason: "FailedResourceClaimCreation".to_owned(),
            note: Some(note),
            action: "CreateResourceClaim".to_owned(),
            secondary: None,
        };
        if let Err(error) = self.recorder.publish(&event, &reference).await {
            tracing::debug!(pod = %pod.name_any(), %error, "cannot publish the event");
        }
    }

    /// Deletes a generated claim its pod no longer needs: reserved for no one, and the pod
    /// done, replaced or gone.
    async fn sync_claim(&self, claim: &ResourceClaim) {
        let Some((pod_name, pod_uid)) = owning_pod(claim) else {
            return;
        };
        let reserved = claim
            .status
            .as_ref()
            .and_then(|s| s.reserved_for.as_ref())
            .is_some_and(|r| !r.is_empty());
        if reserved {
            return;
        }
        let namespace = claim.namespace().unwrap_or_default();
        let cached = self.pods.state().into_iter().find(|p| {
            p.namespace().as_deref() == Some(namespace.as_str()) && p.name_any() == pod_name
        });
        let needed = match cached {
            Some(pod) => pod.metadata.uid.as_deref() == Some(pod_uid.as_str()) && !pod_done(&pod),
            // Not in the cache: the garbage collector asks the API server before deleting.
            None => {
                let api: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
                match api.get_opt(&pod_name).await {
                    Ok(Some(pod)) => pod.metadata.uid.as_deref() == Some(pod_uid.as_str()),
                    Ok(None) => false,
                    Err(error) => {
                        tracing::debug!(pod = %pod_name, %error, "cannot look the owner up; retrying");
                        true
                    }
                }
            }
        };
        if needed {
            return;
        }
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &namespace);
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: claim.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match api.delete(&claim.name_any(), &params).await {
            Ok(_) => {
                tracing::info!(claim = %claim.name_any(), pod = %pod_name, "deleted the generated claim its pod no longer needs")
            }
            Err(error) => {
                tracing::debug!(claim = %claim.name_any(), %error, "deleting the generated claim failed; retrying")
            }
        }
    }
}

/// Whether `pod_claim` of `pod` needs a claim made (or found) for it: not while the claim
/// it names exists and, when generated, is still the pod's. `Break` when the pod claim
/// cannot be handled at all (logged), which leaves the whole pod until the next pass.
fn needs_claim(
    pod: &Pod,
    pod_claim: &PodResourceClaim,
    claims: &[Arc<ResourceClaim>],
) -> ControlFlow<(), bool> {
    let namespace = pod.namespace().unwrap_or_default();
    match claim_name(pod, pod_claim) {
        Err(ClaimNameError::NotCreatedYet { .. }) => ControlFlow::Continue(true),
        Err(error) => {
            tracing::warn!(pod = %pod.name_any(), %error, "cannot handle the pod claim");
            ControlFlow::Break(())
        }
        Ok(None) => ControlFlow::Continue(false),
        Ok(Some((name, check_owner))) => {
            let existing = claims.iter().find(|c| {
                c.namespace().as_deref() == Some(namespace.as_str()) && c.name_any() == name
            });
            match existing {
                Some(claim) if !check_owner || is_for_pod(pod, claim).is_ok() => {
                    ControlFlow::Continue(false)
                }
                Some(_) => {
                    tracing::warn!(pod = %pod.name_any(), claim = %name, "the claim created for the pod is no longer owned by it; creating a new one");
                    ControlFlow::Continue(true)
                }
                // Recorded, but deleted since (by accident): created again.
                None => ControlFlow::Continue(true),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(status: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "nb", "namespace": "ns", "uid": "pod-uid"},
            "spec": {
                "containers": [{"name": "main"}],
                "resourceClaims": [
                    {"name": "gpu", "resourceClaimTemplateName": "gpu-4g"},
                    {"name": "fixed", "resourceClaimName": "shared"}
                ]
            },
            "status": status
        }))
        .unwrap()
    }

    fn template() -> ResourceClaimTemplate {
        serde_json::from_value(json!({
            "metadata": {"name": "gpu-4g", "namespace": "ns"},
            "spec": {
                "metadata": {"labels": {"team": "a"}, "annotations": {"note": "x"}},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "c"}}]}}
            }
        }))
        .unwrap()
    }

    #[test]
    fn a_template_claim_is_named_only_once_recorded_in_the_pod_status() {
        let waiting = pod(json!({}));
        let claims = &waiting
            .spec
            .as_ref()
            .unwrap()
            .resource_claims
            .as_ref()
            .unwrap();
        assert_eq!(
            claim_name(&waiting, &claims[0]),
            Err(ClaimNameError::NotCreatedYet {
                pod: "ns/nb".into()
            })
        );
        assert_eq!(
            claim_name(&waiting, &claims[1]),
            Ok(Some(("shared".into(), false)))
        );
        let recorded = pod(json!({"resourceClaimStatuses": [
            {"name": "gpu", "resourceClaimName": "nb-gpu-abcde"}
        ]}));
        assert_eq!(
            claim_name(&recorded, &claims[0]),
            Ok(Some(("nb-gpu-abcde".into(), true)))
        );
        let not_needed = pod(json!({"resourceClaimStatuses": [{"name": "gpu"}]}));
        assert_eq!(claim_name(&not_needed, &claims[0]), Ok(None));
    }

    #[test]
    fn the_generated_claim_is_owned_by_its_pod_and_carries_the_template() {
        let p = pod(json!({}));
        let pod_claim = &p.spec.as_ref().unwrap().resource_claims.as_ref().unwrap()[0];
        let claim = claim_from_template(&p, pod_claim, &template());
        assert_eq!(claim.metadata.generate_name.as_deref(), Some("nb-gpu-"));
        assert_eq!(claim.metadata.namespace.as_deref(), Some("ns"));
        assert_eq!(claim.annotations()[POD_CLAIM_ANNOTATION], "gpu");
        assert_eq!(claim.annotations()["note"], "x");
        assert_eq!(claim.labels()["team"], "a");
        assert_eq!(claim.spec, template().spec.spec);
        assert_eq!(owning_pod(&claim), Some(("nb".into(), "pod-uid".into())));
        assert!(is_for_pod(&p, &claim).is_ok());
        let mut other = p.clone();
        other.metadata.uid = Some("another-pod".into());
        let refused = is_for_pod(&other, &claim).unwrap_err();
        assert!(refused.contains("pod is not owner"), "{refused}");
    }

    #[test]
    fn long_names_keep_both_parts() {
        // 72 characters cut to 57/72 of each part: 47 of the pod's, 7 of the claim's.
        let name = generate_name(&"p".repeat(60), "gpu-memory");
        assert_eq!(name, format!("{}-gpu-mem", "p".repeat(47)));
        assert_eq!(generate_name("nb", "gpu"), "nb-gpu-");
    }
}
