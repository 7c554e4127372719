//! Checking the plugin's bookkeeping against what kubelet really gave each container.
//!
//! ```text
//!   every --pod-resources-period-ms, and shortly after each Allocate:
//!   kubelet PodResources socket ──List──▶ KubeletFacts ──▶ PodCache::set_facts ──▶ reconcile:
//!   (/var/lib/kubelet/pod-resources/        │                                      marks follow
//!    kubelet.sock, --pod-resources-socket)  ▼                                      the facts
//!                                PodCache::findings ──▶ new ones: Warning Event on the pod,
//!                                                       kubelet_mismatches_total{kind}, a log line
//! ```
//!
//! What is compared and why lives in [`crate::facts`]; how the marks follow the facts in
//! [`crate::facts_plan::plan_from_facts`]. This module is the I/O: dialing the socket, turning
//! kubelet's answer into facts (our resource only; nothing in it is trusted to be
//! well-formed), publishing Events.
//!
//! The socket may be absent (an older kubelet, a node where it is not mounted, a test): the
//! plugin then says so once, keeps working as before (marks reconciled from pod phases) and
//! keeps trying, so a socket that appears later is used from then on.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_proto::podresources::v1::ListPodResourcesRequest;
use gpushare_proto::podresources::v1::ListPodResourcesResponse;
use gpushare_proto::podresources::v1::pod_resources_lister_client::PodResourcesListerClient;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;

use crate::facts::{Finding, KubeletFacts, ListedContainer};
use crate::metrics::Metrics;
use crate::node::Inventory;
use crate::pods::PodCache;

/// How long one `List` may take.
const LIST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long after an Allocate the listing is taken: kubelet records a container's devices
/// once our answer reached it.
pub const AFTER_ALLOCATE: Duration = Duration::from_millis(500);
/// Events waiting to be published before new ones are dropped (they are for people, and
/// the metric counts every finding anyway).
const EVENT_QUEUE: usize = 256;
/// Most messages kept from one `List` answer, so a kubelet answering nonsense cannot make the
/// plugin hold unbounded memory.
const MAX_LISTED: usize = 100_000;

/// Why kubelet's PodResources API could not be read.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The socket could not be dialed (absent: an older kubelet, or not mounted).
    #[error("cannot connect to kubelet's PodResources socket {path}: {source}")]
    Connect {
        /// the socket
        path: PathBuf,
        /// the cause
        #[source]
        source: tonic::transport::Error,
    },
    /// kubelet answered `List` with an error.
    #[error("kubelet's PodResources List failed: {0}")]
    List(#[from] tonic::Status),
    /// kubelet did not answer in time.
    #[error("kubelet's PodResources List did not answer within {LIST_TIMEOUT:?}")]
    Timeout,
}

/// Asks kubelet at `socket` what every container on the node holds, keeping `resource` only.
pub async fn list(socket: &std::path::Path, resource: &str) -> Result<KubeletFacts, Error> {
    let taken_at = Instant::now();
    let call = async {
        let channel = gpushare_proto::connect_unix(socket)
            .await
            .map_err(|source| Error::Connect {
                path: socket.to_owned(),
                source,
            })?;
        let response = PodResourcesListerClient::new(channel)
            .list(ListPodResourcesRequest {})
            .await?;
        Ok::<_, Error>(response.into_inner())
    };
    let response = tokio::time::timeout(LIST_TIMEOUT, call)
        .await
        .map_err(|_| Error::Timeout)??;
    Ok(facts_from(taken_at, &response, resource))
}

/// The facts in a `List` answer, for `resource` only. Empty names and device IDs are
/// skipped; nothing in the answer can make this fail.
pub fn facts_from(
    taken_at: Instant,
    response: &ListPodResourcesResponse,
    resource: &str,
) -> KubeletFacts {
    let pods = response
        .pod_resources
        .iter()
        .take(MAX_LISTED)
        .filter(|pod| !pod.name.is_empty())
        .map(|pod| (pod.namespace.clone(), pod.name.clone()));
    let containers = response
        .pod_resources
        .iter()
        .take(MAX_LISTED)
        .filter(|pod| !pod.name.is_empty())
        .flat_map(|pod| {
            pod.containers
                .iter()
                .take(MAX_LISTED)
                .filter(|c| !c.name.is_empty())
                .map(move |c| -> ListedContainer {
                    let ids = c
                        .devices
                        .iter()
                        .filter(|d| d.resource_name == resource)
                        .flat_map(|d| d.device_ids.iter())
                        .filter(|id| !id.is_empty())
                        .take(MAX_LISTED)
                        .cloned()
                        .collect();
                    (pod.namespace.clone(), pod.name.clone(), c.name.clone(), ids)
                })
        });
    KubeletFacts::new(taken_at, pods, containers)
}

/// The periodic check; see the module doc.
#[derive(Debug)]
pub struct Checker {
    /// kubelet's PodResources socket.
    pub socket: PathBuf,
    /// The resource whose devices are ours.
    pub resource: String,
    /// The node's pods and our marks.
    pub pods: Arc<PodCache>,
    /// The node's GPUs.
    pub inventory: Inventory,
    /// Metrics.
    pub metrics: Metrics,
    /// How often kubelet is asked without an Allocate.
    pub period: Duration,
    /// Notified after each Allocate.
    pub allocated: Arc<Notify>,
}

/// Whether the socket answered last time, for logging changes only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reachable {
    Unknown,
    Yes,
    No,
}

impl Checker {
    /// Lists, compares and reconciles until `shutdown`; reports findings through
    /// `client`'s Events. Never fails: an unreadable socket is logged and retried.
    ///
    /// The Event publisher runs inside this future rather than as a task of its own, so that
    /// whoever supervises this one supervises both: a publisher that died would otherwise
    /// leave findings dropped without a word.
    pub async fn run(self, client: kube::Client, node: String, shutdown: CancellationToken) {
        let (events, rx) = mpsc::channel(EVENT_QUEUE);
        tokio::join!(
            self.check(events, shutdown.clone()),
            publish_events(client, node, rx, shutdown.clone()),
        );
    }

    /// The check's loop: lists, compares, reconciles, queues an Event per new finding on
    /// `events`.
    async fn check(&self, events: mpsc::Sender<(Finding, String)>, shutdown: CancellationToken) {
        let mut reachable = Reachable::Unknown;
        let mut reported: HashSet<(String, &'static str, String)> = HashSet::new();
        loop {
            match list(&self.socket, &self.resource).await {
                Ok(facts) => {
                    if reachable != Reachable::Yes {
                        tracing::info!(socket = %self.socket.display(), pods = facts.len(), "reading what kubelet gave each container from its PodResources API: allocation marks follow it, and mismatches are reported");
                    }
                    reachable = Reachable::Yes;
                    self.metrics.pod_resources_up.set(1);
                    self.report(&facts, &mut reported, &events);
                    self.pods.set_facts(Some(facts));
                }
                Err(err) => {
                    if reachable != Reachable::No {
                        tracing::warn!(socket = %self.socket.display(), error = %err, "cannot read kubelet's PodResources API (an older kubelet, or --pod-resources-socket not mounted): what kubelet gave each container is not checked, and allocation marks are reconciled from pod phases; retrying");
                        self.pods.set_facts(None);
                    } else {
                        tracing::debug!(error = %err, "kubelet's PodResources API still unreadable");
                    }
                    reachable = Reachable::No;
                    self.metrics.pod_resources_up.set(0);
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(self.period) => {}
                () = self.allocated.notified() => {
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(AFTER_ALLOCATE) => {}
                    }
                }
            }
        }
    }

    /// Counts, logs and queues an Event for each finding not reported before (for this
    /// pod, kind and container, while the pod exists).
    fn report(
        &self,
        facts: &KubeletFacts,
        reported: &mut HashSet<(String, &'static str, String)>,
        events: &mpsc::Sender<(Finding, String)>,
    ) {
        let gpus = self.inventory.borrow().clone();
        let (findings, live) = self.pods.findings(facts, |index| {
            gpus.iter()
                .find(|gpu| gpu.index == index)
                .map(|gpu| gpu.uuid.clone())
        });
        // Reported once per pod for as long as it exists, even if a listing misses it.
        reported.retain(|(uid, _, _)| live.contains(uid));
        for finding in findings {
            let key = (
                finding.pod().1.to_owned(),
                finding.kind(),
                finding.container().to_owned(),
            );
            if !reported.insert(key) {
                continue;
            }
            self.metrics.kubelet_mismatch(finding.kind());
            let note = finding.note(&self.resource);
            tracing::warn!(pod = %finding.pod().0, uid = %finding.pod().1, kind = finding.kind(), %note, "kubelet gave a container GPU memory that does not match its pod's gpushare allocation");
            if let Err(err) = events.try_send((finding, note)) {
                tracing::debug!(error = %err, "event queue full; event dropped");
            }
        }
    }
}

/// Publishes findings as Warning Events on their pods until `shutdown`.
async fn publish_events(
    client: kube::Client,
    node: String,
    mut rx: mpsc::Receiver<(Finding, String)>,
    shutdown: CancellationToken,
) {
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: "gpushare-device-plugin".to_owned(),
            instance: Some(node),
        },
    );
    loop {
        let (finding, note) = tokio::select! {
            () = shutdown.cancelled() => return,
            item = rx.recv() => match item { Some(item) => item, None => return },
        };
        let (key, uid) = finding.pod();
        let (namespace, name) = key.split_once('/').unwrap_or(("default", key));
        let reference = ObjectReference {
            api_version: Some("v1".to_owned()),
            kind: Some("Pod".to_owned()),
            namespace: Some(namespace.to_owned()),
            name: Some(name.to_owned()),
            uid: Some(uid.to_owned()),
            ..ObjectReference::default()
        };
        let event = Event {
            type_: EventType::Warning,
            reason: finding.reason().to_owned(),
            note: Some(note),
            action: "CheckKubeletAllocation".to_owned(),
            secondary: None,
        };
        if let Err(error) = recorder.publish(&event, &reference).await {
            tracing::warn!(pod = %key, %error, "cannot publish event");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_proto::podresources::v1::{ContainerDevices, ContainerResources, PodResources};

    fn container(name: &str, devices: Vec<ContainerDevices>) -> ContainerResources {
        ContainerResources {
            name: name.to_owned(),
            devices,
            ..ContainerResources::default()
        }
    }

    fn devices(resource: &str, ids: &[&str]) -> ContainerDevices {
        ContainerDevices {
            resource_name: resource.to_owned(),
            device_ids: ids.iter().map(|s| (*s).to_owned()).collect(),
            topology: None,
        }
    }

    #[test]
    fn only_our_resource_counts_and_odd_answers_do_not_break_anything() {
        let response = ListPodResourcesResponse {
            pod_resources: vec![
                PodResources {
                    name: "a".into(),
                    namespace: "ns".into(),
                    containers: vec![
                        // kubelet repeats a device once per NUMA node.
                        container(
                            "main",
                            vec![
                                devices("example.com/gpu-mem", &["G-0", "G-1"]),
                                devices("example.com/gpu-mem", &["G-1"]),
                                devices("nvidia.com/gpu", &["GPU-x"]),
                            ],
                        ),
                        container("cpu", vec![devices("nvidia.com/gpu", &["GPU-y"])]),
                        container("", vec![devices("example.com/gpu-mem", &["G-2"])]),
                    ],
                },
                PodResources::default(),
                PodResources {
                    name: "b".into(),
                    namespace: "ns".into(),
                    containers: vec![container(
                        "main",
                        vec![devices("example.com/gpu-mem", &[""])],
                    )],
                },
            ],
        };
        let facts = facts_from(Instant::now(), &response, "example.com/gpu-mem");
        assert_eq!(
            facts.held("ns/a", "main"),
            Some(&["G-0".to_owned(), "G-1".to_owned()][..])
        );
        assert_eq!(facts.held("ns/a", "cpu"), None);
        assert_eq!(facts.held("ns/a", ""), None);
        assert!(!facts.pod("ns/b").unwrap().holds_any());
        assert_eq!(facts.len(), 2);
    }

    #[tokio::test]
    async fn an_absent_socket_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubelet.sock");
        let err = list(&path, "example.com/gpu-mem").await.unwrap_err();
        assert!(matches!(err, Error::Connect { .. }), "{err}");
        assert!(err.to_string().contains("kubelet.sock"), "{err}");
    }
}
