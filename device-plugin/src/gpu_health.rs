//! What a GPU turning unhealthy means for the pods already running on it.
//!
//! kubelet only stops placing new containers on withdrawn devices; the pods already on the
//! GPU keep running on broken hardware, and nothing tells their owners. So when a GPU turns
//! unhealthy (the inventory's health changes, from NVML XID events or the simulated health
//! file), each live pod whose allocation names it gets:
//!
//! ```text
//!  GPU healthy ──▶ unhealthy: Warning Event GpuUnhealthy on each of its pods
//!                             pod condition <domain>/GpuHealthy=False (reason GpuUnhealthy)
//!                             with --evict-on-unhealthy: an Eviction (policy/v1), so its
//!                             controller re-creates it and the scheduler places it elsewhere
//!  unhealthy ──▶ healthy:     condition back to True on the pods still there
//! ```
//!
//! Eviction is opt-in: a pod may hold state a restart loses, and a flapping GPU would evict
//! its pods over and over. Events, conditions and evictions are rare (once per health change
//! per pod), so they cost no API writes on the scheduling path.

use std::collections::BTreeSet;
use std::sync::Arc;

use gpushare_contract::GpuInfo;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::pods::PodCache;

/// What to do for the pods of a GPU that turned unhealthy.
pub struct HealthReporter {
    pub client: kube::Client,
    pub node: String,
    pub pods: Arc<PodCache>,
    pub metrics: Metrics,
    /// The pod condition type (`<domain>/GpuHealthy`).
    pub condition: String,
    /// Evict the pods (opt-in, `--evict-on-unhealthy`).
    pub evict: bool,
}

/// The UUIDs of the unhealthy GPUs in `gpus`.
fn unhealthy(gpus: &[GpuInfo]) -> BTreeSet<String> {
    gpus.iter()
        .filter(|gpu| !gpu.healthy)
        .map(|gpu| gpu.uuid.clone())
        .collect()
}

impl HealthReporter {
    /// Follows `inventory` until `shutdown`, acting on every health change of a GPU.
    pub async fn run(
        self,
        mut inventory: watch::Receiver<Arc<Vec<GpuInfo>>>,
        shutdown: CancellationToken,
    ) {
        let recorder = Recorder::new(
            self.client.clone(),
            Reporter {
                controller: "gpushare-device-plugin".to_owned(),
                instance: Some(self.node.clone()),
            },
        );
        // GPUs unhealthy at start were reported by the previous instance, if any; their pods
        // are reported again only if they change.
        let mut known = unhealthy(&inventory.borrow_and_update());
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                changed = inventory.changed() => if changed.is_err() { return },
            }
            let now = unhealthy(&inventory.borrow_and_update());
            for uuid in now.difference(&known) {
                self.turned_unhealthy(&recorder, uuid).await;
            }
            for uuid in known.difference(&now) {
                self.recovered(uuid).await;
            }
            known = now;
        }
    }

    async fn turned_unhealthy(&self, recorder: &Recorder, uuid: &str) {
        for (key, uid) in self.pods.pods_on_gpu(uuid) {
            let (namespace, name) = key.split_once('/').unwrap_or(("default", key.as_str()));
            tracing::warn!(pod = %key, gpu = %uuid, evict = self.evict, "the GPU of a running pod turned unhealthy");
            let note = if self.evict {
                format!(
                    "GPU {uuid} turned unhealthy; the pod is evicted so that it is placed again"
                )
            } else {
                format!(
                    "GPU {uuid} turned unhealthy; the pod keeps running on it. Delete the pod to place it again"
                )
            };
            let reference = ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Pod".to_owned()),
                namespace: Some(namespace.to_owned()),
                name: Some(name.to_owned()),
                uid: Some(uid.clone()),
                ..ObjectReference::default()
            };
            let event = Event {
                type_: EventType::Warning,
                reason: "GpuUnhealthy".to_owned(),
                note: Some(note.clone()),
                action: "CheckGpuHealth".to_owned(),
                secondary: None,
            };
            if let Err(error) = recorder.publish(&event, &reference).await {
                tracing::warn!(pod = %key, %error, "cannot publish event");
            }
            self.set_condition(namespace, name, &uid, false, &note)
                .await;
            self.metrics.pods_on_unhealthy_gpu.inc();
            if self.evict {
                let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
                match api.evict(name, &crate::pods::eviction_of(&uid)).await {
                    Ok(_) => {
                        self.metrics.evictions.inc();
                    }
                    Err(error) => {
                        tracing::warn!(pod = %key, %error, "cannot evict the pod of an unhealthy GPU")
                    }
                };
            }
        }
    }

    async fn recovered(&self, uuid: &str) {
        tracing::info!(gpu = %uuid, "GPU healthy again");
        for (key, uid) in self.pods.pods_on_gpu(uuid) {
            let (namespace, name) = key.split_once('/').unwrap_or(("default", key.as_str()));
            self.set_condition(
                namespace,
                name,
                &uid,
                true,
                &format!("GPU {uuid} is healthy"),
            )
            .await;
        }
    }

    /// Sets the pod condition (a status patch, guarded by the pod's UID).
    async fn set_condition(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        healthy: bool,
        message: &str,
    ) {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let patch = serde_json::json!({
            "metadata": {"uid": uid},
            "status": {"conditions": [{
                "type": self.condition,
                "status": if healthy { "True" } else { "False" },
                "reason": if healthy { "GpuHealthy" } else { "GpuUnhealthy" },
                "message": message,
                "lastTransitionTime": jiff::Timestamp::now().to_string(),
            }]},
        });
        if let Err(error) = api
            .patch_status(name, &PatchParams::default(), &Patch::Strategic(&patch))
            .await
        {
            tracing::warn!(pod = %format_args!("{namespace}/{name}"), %error, "cannot set the pod's GPU health condition");
        }
    }
}
