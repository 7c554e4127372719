//! A stand-in for the kubelets (and device plugins) of the fake nodes. Why: no kubelet ever
//! admits a fake node's pods, so without it the allocator's twin rule would keep later pods
//! off a GPU still waiting for its device, and the API server would be spared the status write
//! every real node makes (see [`super::load`]).

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use gpushare_contract::{Keys, PodAllocation};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

/// How many pods the node stand-in writes at once: it must keep up with a thousand kubelets
/// (with 16 it ran behind, and most writes landed after the last bind).
const STAND_IN_CALLS: usize = 512;

/// Plays kubelet (and, with marks, the device plugin) of every fake node: once a pod is bound
/// to one, writes its status's `startTime` after `delay`, as kubelet does on admitting it, and
/// with `marks_as` the allocation marks of a GPU pod, as the plugin's ServiceAccount on that
/// node. Runs in both drains alike. Stops when dropped.
pub struct NodeStandIn {
    task: JoinHandle<()>,
    tally: Arc<Tally>,
}

/// What the stand-in wrote: statuses, marks, and the writes refused with their errors.
#[derive(Default)]
struct Tally {
    written: AtomicUsize,
    marked: AtomicUsize,
    failed: Mutex<Vec<String>>,
}

/// What [`NodeStandIn`] writes for each bound pod.
#[derive(Debug, Clone)]
pub struct StandInConfig {
    /// Only pods bound to nodes whose names start with this.
    pub node_prefix: String,
    /// How long after the bind (kubelet admitting the pod).
    pub delay: Duration,
    /// Also the device plugin's marks, as `system:serviceaccount:<this>` (`namespace/name`);
    /// `None`: no marks (the chart's default).
    pub marks_as: Option<String>,
}

impl NodeStandIn {
    /// Starts watching `namespace`.
    pub fn start(client: Client, namespace: &str, config: StandInConfig) -> Self {
        let tally = Arc::new(Tally::default());
        let plugin_user = config.marks_as.as_deref().map(|account| {
            let (sa_namespace, sa_name) =
                account.split_once('/').unwrap_or(("kube-system", account));
            format!("system:serviceaccount:{sa_namespace}:{sa_name}")
        });
        let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
        let task = tokio::spawn({
            let tally = tally.clone();
            async move {
                let keys = Keys::default();
                let writes = Arc::new(Semaphore::new(STAND_IN_CALLS));
                let mut started: HashSet<String> = HashSet::new();
                let mut events = watcher(pods.clone(), watcher::Config::default())
                    .default_backoff()
                    .applied_objects()
                    .boxed();
                while let Some(event) = events.next().await {
                    let Ok(pod) = event else { continue };
                    let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) else {
                        continue;
                    };
                    let uid = pod.uid().unwrap_or_default();
                    if !node.starts_with(&config.node_prefix) || !started.insert(uid.clone()) {
                        continue;
                    }
                    let mark = plugin_user.clone().and_then(|user| {
                        let allocation =
                            PodAllocation::from_annotations(&keys, pod.annotations()).ok()??;
                        let names: Vec<&str> =
                            allocation.containers.iter().map(|c| &*c.name).collect();
                        let body = json!({ "metadata": { "uid": uid, "annotations": {
                            keys.assigned.as_str(): "true",
                            keys.allocated.as_str(): names.join(","),
                        }}});
                        Some((user, body))
                    });
                    let (client, pods, name) = (client.clone(), pods.clone(), pod.name_any());
                    let (writes, tally) = (writes.clone(), tally.clone());
                    let namespace = pod.namespace().unwrap_or_default();
                    let delay = config.delay;
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        let Ok(_permit) = writes.acquire().await else {
                            return;
                        };
                        let fail = |error: String| {
                            if let Ok(mut failed) = tally.failed.lock() {
                                failed.push(format!("{name}: {error}"));
                            }
                        };
                        // The plugin's mark comes first: Allocate is part of admission.
                        if let Some((user, body)) = &mark {
                            match patch_as(&client, user, &node, &namespace, &name, body).await {
                                Ok(()) => {
                                    tally.marked.fetch_add(1, Ordering::Relaxed);
                                }
                                Err(error) => fail(format!("mark: {error:#}")),
                            }
                        }
                        let status = json!({ "status": {
                            "startTime": jiff::Timestamp::now().to_string(),
                        }});
                        let params = PatchParams::default();
                        let status = Patch::Merge(&status);
                        match pods.patch_status(&name, &params, &status).await {
                            Ok(_) => {
                                tally.written.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(error) => fail(format!("status: {error:#}")),
                        }
                    });
                }
            }
        });
        Self { task, tally }
    }

    /// Pods whose status was written so far.
    pub fn statuses(&self) -> usize {
        self.tally.written.load(Ordering::Relaxed)
    }

    /// Pods marked allocated so far.
    pub fn marked(&self) -> usize {
        self.tally.marked.load(Ordering::Relaxed)
    }

    /// The writes the API server refused, each with its error.
    pub fn refused(&self) -> Vec<String> {
        self.tally
            .failed
            .lock()
            .map(|f| f.clone())
            .unwrap_or_default()
    }
}

impl Drop for NodeStandIn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A merge patch of pod `namespace/name` by the admin impersonating `user` with the node claim
/// (`authentication.kubernetes.io/node-name`) a plugin pod's projected token carries.
async fn patch_as(
    client: &Client,
    user: &str,
    node: &str,
    namespace: &str,
    name: &str,
    body: &serde_json::Value,
) -> anyhow::Result<()> {
    let request = kube::core::Request::new(format!("/api/v1/namespaces/{namespace}/pods")).patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(body),
    )?;
    let (mut parts, body) = request.into_parts();
    for (header, value) in [
        ("impersonate-user", user),
        ("impersonate-group", "system:serviceaccounts"),
        (
            "impersonate-extra-authentication.kubernetes.io%2fnode-name",
            node,
        ),
    ] {
        parts
            .headers
            .insert(http::HeaderName::from_static(header), value.parse()?);
    }
    client
        .request::<Pod>(http::Request::from_parts(parts, body))
        .await?;
    Ok(())
}
