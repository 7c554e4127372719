//! Pod admission, as kubelet's admit handler and pod workers do it: watch the pods bound to
//! the node, free the devices of finished or deleted ones, admit new ones in
//! [`AdmissionOrder`], and write Running or Failed.
//!
//! Separate from the device picking ([`super::allocation`]) so the loop and the order it
//! admits in read on their own.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use gpushare_contract::request::pod_is_finished as finished;
use gpushare_contract::request::pod_key;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use tokio_util::sync::CancellationToken;

use super::allocation::{allocate_pod, container_resources, is_extended};
use super::status::{running_status, write_status};
use super::{AdmissionOrder, Shared, State, by_creation};

/// How often pods are swept even without events.
const SWEEP: Duration = Duration::from_millis(500);

/// The admission loop of one node: watches the pods bound to it, frees what finished pods
/// held, and admits new ones one at a time.
pub(super) struct Admission {
    pub(super) shared: Arc<Shared>,
    pub(super) client: Client,
    pub(super) node: String,
    pub(super) order: AdmissionOrder,
    pub(super) rng: StdRng,
}

impl Admission {
    pub(super) async fn run(
        mut self,
        writer: reflector::store::Writer<Pod>,
        stop: CancellationToken,
    ) {
        let api: Api<Pod> = Api::all(self.client.clone());
        let store = writer.as_reader();
        let config = watcher::Config::default().fields(&format!("spec.nodeName={}", self.node));
        let stream = reflector::reflector(writer, watcher(api, config).default_backoff());
        let mut stream = std::pin::pin!(stream);
        let mut changes = self.shared.changes.subscribe();
        let mut synced = false;
        let mut tick = tokio::time::interval(SWEEP);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                event = stream.next() => {
                    let mut next = Some(event);
                    // Take every event already waiting, so one sweep sees them all.
                    while let Some(event) = next {
                        match event {
                            Some(Ok(watcher::Event::InitDone)) => synced = true,
                            Some(Ok(_)) => {}
                            Some(Err(err)) => tracing::warn!(error = %err, "kubelet pod watch failed"),
                            None => return,
                        }
                        next = stream.next().now_or_never();
                    }
                }
                _ = changes.changed() => {}
                _ = tick.tick() => {}
            }
            if synced {
                self.sweep(&store).await;
            }
        }
    }

    /// Frees devices of gone or finished pods, then admits new ones one at a time.
    async fn sweep(&mut self, store: &Store<Pod>) {
        let pods = store.state();
        let by_uid: HashMap<String, &Pod> = pods
            .iter()
            .filter_map(|pod| pod.metadata.uid.clone().map(|uid| (uid, pod.as_ref())))
            .collect();
        {
            let mut state = self.shared.lock();
            let live = |uid: &String| by_uid.get(uid).is_some_and(|pod| !finished(pod));
            state.admitted.retain(|uid, _| live(uid));
            state.container_devices.retain(|uid, _| live(uid));
        }
        let mut batch: Vec<&Pod> = {
            let state = self.shared.lock();
            by_uid
                .iter()
                .filter(|(uid, pod)| {
                    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
                    pod.spec.as_ref().and_then(|s| s.node_name.as_deref())
                        == Some(self.node.as_str())
                        && matches!(phase, None | Some("Pending"))
                        && pod.metadata.deletion_timestamp.is_none()
                        && !state.admitted.contains_key(uid.as_str())
                        && !state.rejected.contains(uid.as_str())
                        && !state.held.contains(&pod_key(pod))
                        && self.plugins_ready(&state, pod)
                })
                .map(|(_, pod)| *pod)
                .collect()
        };
        batch.sort_by(|a, b| by_creation(a, b));
        if let AdmissionOrder::Shuffled(_) = self.order {
            batch.shuffle(&mut self.rng);
        }
        for pod in batch {
            self.admit(pod).await;
        }
    }

    /// A pod asking for an extended resource waits until its plugin is registered.
    fn plugins_ready(&self, state: &State, pod: &Pod) -> bool {
        let Some(spec) = &pod.spec else { return true };
        spec.init_containers
            .iter()
            .flatten()
            .chain(&spec.containers)
            .flat_map(container_resources)
            .filter(|(name, _)| is_extended(name))
            .all(|(name, _)| {
                state
                    .plugins
                    .get(&name)
                    .is_some_and(|p| p.listed && p.channel.is_some())
            })
    }

    async fn admit(&mut self, pod: &Pod) {
        let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let key = pod_key(pod);
        match allocate_pod(&self.shared, pod, ns, name).await {
            Ok(devices) => {
                self.shared
                    .lock()
                    .admitted
                    .insert(uid, (key.clone(), devices));
                tracing::debug!(pod = %key, "admitted");
                write_status(&self.client, ns, name, running_status(pod));
            }
            Err(message) => {
                let message = format!("Pod was rejected: {message}");
                tracing::info!(pod = %key, %message, "admission failed");
                {
                    let mut state = self.shared.lock();
                    state.errors.push((key, message.clone()));
                    // A rejected pod is not active: kubelet drops what its containers held.
                    state.container_devices.remove(&uid);
                    state.rejected.insert(uid);
                }
                let status = serde_json::json!({
                    "phase": "Failed",
                    "reason": "UnexpectedAdmissionError",
                    "message": message,
                });
                write_status(&self.client, ns, name, status);
            }
        }
        self.shared.changed();
    }
}
