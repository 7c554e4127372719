//! What the domain asks of the API server, as narrow ports the Kubernetes I/O implements
//! ([`crate::kube_io::writes`]): write a Binding, read a pod back, queue an Event.
//!
//! Why ports: the bind path decides on the view and then needs exactly two calls and a
//! queue; behind this trait the domain is tested with an in-memory binder, and nothing here
//! knows about kube's client, HTTP or retries.

use std::collections::BTreeMap;

use futures::future::BoxFuture;
use tokio::sync::mpsc;

use super::view::reservations::Outcome;

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
    /// The request did not get an answer (the client's error, as text).
    #[error("request to the API server failed: {0}")]
    Transport(String),
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

/// Writes Bindings and reads pods back. The kube implementation is
/// [`KubeBinder`](crate::kube_io::writes::KubeBinder); tests inject their own.
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
