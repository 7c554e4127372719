//! The extender's writes to the API server: the Binding (on the bind path) and pod Events
//! (off it, from a background task with a bounded queue, so events never slow a bind).

use std::collections::BTreeMap;

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::{Binding, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::mpsc;

use crate::reservation::Outcome;

/// A Binding to write: the pod, its target node and the allocation annotations.
#[derive(Debug, Clone)]
pub struct BindingTarget {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Pod UID (the API server refuses the Binding if the pod was recreated).
    pub uid: String,
    /// Target node.
    pub node: String,
    /// Annotations the API server copies onto the pod.
    pub annotations: BTreeMap<String, String>,
}

/// Why a Binding write failed.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// The API server refused it.
    #[error("API server refused the binding ({code} {reason}): {message}")]
    Refused {
        /// HTTP status
        code: u16,
        /// machine-readable reason
        reason: String,
        /// human-readable message
        message: String,
    },
    /// The request did not get an answer.
    #[error("request to the API server failed: {0}")]
    Transport(#[source] kube::Error),
    /// No answer within the bind path's client timeout.
    #[error("no answer from the API server within {0:?}")]
    Timeout(std::time::Duration),
}

impl BindError {
    /// What this error says about whether a Binding landed.
    ///
    /// A refusal the API server made before writing anything (the pod is gone, the request
    /// is invalid or forbidden, too many requests) means it did not land. A timeout, a lost
    /// connection or a server error may come after the write was committed, and a conflict
    /// may mean the pod was bound meanwhile (by this very Binding, sent earlier): only a
    /// read of the pod tells.
    pub fn outcome(&self) -> Outcome {
        match self {
            BindError::Refused { code, .. } if *code == 408 || *code == 409 || *code >= 500 => {
                Outcome::Unknown
            }
            BindError::Refused { .. } => Outcome::NotLanded,
            BindError::Transport(_) | BindError::Timeout(_) => Outcome::Unknown,
        }
    }
}

/// What a read of a pod shows of its binding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodOnServer {
    /// The pod's UID.
    pub uid: String,
    /// `spec.nodeName`, once bound.
    pub node: Option<String>,
}

/// Writes Bindings and reads pods back. The kube implementation is [`KubeBinder`]; tests
/// inject their own.
pub trait Binder: Send + Sync + 'static {
    /// Writes one Binding.
    fn bind(&self, target: BindingTarget) -> BoxFuture<'_, Result<(), BindError>>;

    /// Reads a pod from the API server (not a cache); `None` when it does not exist.
    fn read_pod<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<PodOnServer>, BindError>>;
}

fn bind_error(error: kube::Error) -> BindError {
    match error {
        kube::Error::Api(status) => BindError::Refused {
            code: status.code,
            reason: status.reason.clone(),
            message: status.message.clone(),
        },
        other => BindError::Transport(other),
    }
}

/// Posts `pods/binding` through a kube client: one API write per bind.
#[derive(Clone)]
pub struct KubeBinder {
    client: kube::Client,
}

impl KubeBinder {
    /// A binder using `client`.
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }
}

impl Binder for KubeBinder {
    fn bind(&self, target: BindingTarget) -> BoxFuture<'_, Result<(), BindError>> {
        Box::pin(async move {
            let binding = Binding {
                metadata: ObjectMeta {
                    name: Some(target.name.clone()),
                    namespace: Some(target.namespace.clone()),
                    uid: Some(target.uid.clone()),
                    annotations: Some(target.annotations),
                    ..ObjectMeta::default()
                },
                target: ObjectReference {
                    api_version: Some("v1".to_owned()),
                    kind: Some("Node".to_owned()),
                    name: Some(target.node),
                    ..ObjectReference::default()
                },
            };
            let pods: Api<Pod> = Api::namespaced(self.client.clone(), &target.namespace);
            // The answer is a Status on a real API server; we need nothing from it.
            pods.create_subresource::<_, serde_json::Value>(
                "binding",
                &target.name,
                &PostParams::default(),
                &binding,
            )
            .await
            .map(|_| ())
            .map_err(bind_error)
        })
    }

    fn read_pod<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<PodOnServer>, BindError>> {
        Box::pin(async move {
            let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
            let pod = pods.get_opt(name).await.map_err(bind_error)?;
            Ok(pod.map(|pod| PodOnServer {
                uid: pod.metadata.uid.unwrap_or_default(),
                node: pod
                    .spec
                    .and_then(|spec| spec.node_name)
                    .filter(|node| !node.is_empty()),
            }))
        })
    }
}

/// An event about a pod, queued for the background recorder.
#[derive(Debug, Clone)]
pub struct PodEvent {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Pod UID.
    pub uid: String,
    /// Warning rather than Normal.
    pub warning: bool,
    /// Short PascalCase reason (`GpuBindRefused`…).
    pub reason: &'static str,
    /// The message people read.
    pub note: String,
}

/// Where handlers drop events; never blocks. Events beyond the queue's room are dropped
/// (and logged): they are for people, not for correctness.
#[derive(Debug, Clone)]
pub struct EventSink {
    tx: Option<mpsc::Sender<PodEvent>>,
}

/// Events the queue holds before new ones are dropped.
pub const EVENT_QUEUE: usize = 1024;

impl EventSink {
    /// A sink that drops everything (tests of handlers).
    pub fn disabled() -> Self {
        Self { tx: None }
    }

    /// A sink and the receiver a recorder task drains.
    pub fn channel() -> (Self, mpsc::Receiver<PodEvent>) {
        let (tx, rx) = mpsc::channel(EVENT_QUEUE);
        (Self { tx: Some(tx) }, rx)
    }

    /// Queues an event without waiting.
    pub fn send(&self, event: PodEvent) {
        if let Some(tx) = &self.tx
            && let Err(error) = tx.try_send(event)
        {
            tracing::debug!(%error, "event queue full or closed; event dropped");
        }
    }
}

/// Publishes queued events until the queue closes.
pub async fn record_events(client: kube::Client, mut rx: mpsc::Receiver<PodEvent>) {
    let reporter = Reporter {
        controller: "gpushare-extender".to_owned(),
        instance: std::env::var("POD_NAME").ok(),
    };
    let recorder = Recorder::new(client, reporter);
    while let Some(event) = rx.recv().await {
        let reference = ObjectReference {
            api_version: Some("v1".to_owned()),
            kind: Some("Pod".to_owned()),
            namespace: Some(event.namespace.clone()),
            name: Some(event.name.clone()),
            uid: Some(event.uid.clone()),
            ..ObjectReference::default()
        };
        let published = recorder
            .publish(
                &Event {
                    type_: if event.warning {
                        EventType::Warning
                    } else {
                        EventType::Normal
                    },
                    reason: event.reason.to_owned(),
                    note: Some(event.note),
                    action: "Binding".to_owned(),
                    secondary: None,
                },
                &reference,
            )
            .await;
        if let Err(error) = published {
            tracing::warn!(pod = %format_args!("{}/{}", event.namespace, event.name), %error, "cannot publish event");
        }
    }
}
