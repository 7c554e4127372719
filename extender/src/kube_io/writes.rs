//! The extender's writes to the API server: the Binding (on the bind path, through the
//! domain's [`Binder`] port) and pod Events (off it, from a background task draining the
//! domain's [`EventSink`] queue, so events never slow a bind).

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::{Binding, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::mpsc;

#[cfg(doc)]
use crate::scheduling::ports::EventSink;
use crate::scheduling::ports::{BindError, Binder, BindingTarget, PodEvent, PodOnServer};

fn bind_error(error: kube::Error) -> BindError {
    match error {
        kube::Error::Api(status) => BindError::Refused {
            code: status.code,
            reason: status.reason.clone(),
            message: status.message.clone(),
        },
        other => BindError::Transport(other.to_string()),
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
