//! The stories users judge gpushare by, written once and run on any cluster.
//!
//! A [`Harness`] is a cluster with gpushare installed: the in-process one
//! ([`crate::cluster::TestCluster`]) or the real tier's (`crate::realk8s::KitCluster`). The
//! scenarios only talk to the Kubernetes API, plus one question it cannot answer: which
//! environment a container got from the device plugin. Every scenario ends with the project's
//! promises: [`check_no_overcommit`] (no GPU holds more than its memory) and [`check_pinned`]
//! (every running container sees exactly the GPU its pod's annotations name).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::time::Duration;

use anyhow::{Context, ensure};
use gpushare_contract::{Keys, PodAllocation, env};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};

use crate::cluster::{TestCluster, published_gpus, wait_for};
use crate::fixtures::pod;

/// A cluster with gpushare installed, as the scenarios see it.
pub trait Harness: Sync {
    /// A client for the cluster.
    fn client(&self) -> Client;
    /// Namespace the scenario's pods go in.
    fn namespace(&self) -> &str;
    /// The environment `container` of `pod` got from the device plugin.
    fn container_env(
        &self,
        pod: &str,
        container: &str,
    ) -> impl Future<Output = anyhow::Result<BTreeMap<String, String>>> + Send;
}

/// Somebody telling the story as it happens: the demo prints, tests stay quiet.
pub trait Narrator: Sync {
    /// One line of narration.
    fn say(&self, text: &str) -> impl Future<Output = ()> + Send;
    /// Shows who holds which GPU now.
    fn show(&self) -> impl Future<Output = ()> + Send;
}

/// Tells nothing.
pub struct Quiet;

impl Narrator for Quiet {
    async fn say(&self, _text: &str) {}
    async fn show(&self) {}
}

/// How long a pod may take to start in a scenario (generous: CI machines are slow).
pub const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Creates a pod asking for `gib` GiB in its `main` container.
pub async fn create_gpu_pod(h: &impl Harness, name: &str, gib: u64) -> anyhow::Result<Pod> {
    Ok(create_pod(h, pod(name).namespace(h.namespace()).gpu_mem(gib).build()).await?)
}

/// The pods of the harness's namespace.
fn pods(h: &impl Harness) -> Api<Pod> {
    Api::namespaced(h.client(), h.namespace())
}

/// Creates `pod` in the harness's namespace.
pub async fn create_pod(h: &impl Harness, pod: Pod) -> kube::Result<Pod> {
    pods(h).create(&PostParams::default(), &pod).await
}

/// The pod `name` of the harness's namespace, as the API server has it now.
pub async fn get_pod(h: &impl Harness, name: &str) -> kube::Result<Pod> {
    pods(h).get(name).await
}

/// Deletes a pod at once (grace 0) and waits until it is gone.
pub async fn delete_pod(h: &impl Harness, name: &str) -> anyhow::Result<()> {
    delete_now(&pods(h), name, &format!("pod {name} to be gone")).await
}

/// Deletes pod `name` at once (grace 0) and waits until it is gone (`what`, on a timeout).
pub(crate) async fn delete_now(pods: &Api<Pod>, name: &str, what: &str) -> anyhow::Result<()> {
    pods.delete(name, &DeleteParams::default().grace_period(0))
        .await?;
    wait_for(what, START_TIMEOUT, || async {
        pods.get_opt(name).await.ok()?.is_none().then_some(())
    })
    .await
}

/// Waits until the pod in `pods` is bound and returns its node's name.
/// On timeout the error carries the pod's last scheduling message, so a failure tells a
/// refused pod (and why) from one kube-scheduler never tried again.
pub async fn wait_bound(pods: &Api<Pod>, name: &str) -> anyhow::Result<String> {
    let bound = wait_for(&format!("{name} to be bound"), START_TIMEOUT, || async {
        pods.get(name).await.ok()?.spec?.node_name
    })
    .await;
    match bound {
        Ok(node) => Ok(node),
        Err(error) => {
            let why = match pods.get_opt(name).await {
                Ok(Some(pod)) => match scheduling_message(&pod) {
                    Some(message) => format!("last scheduling message: {message}"),
                    None => "no scheduling message".into(),
                },
                Ok(None) => format!("gone; {}", events_naming(pods, name).await),
                Err(read) => format!("reading it failed: {read}"),
            };
            Err(error.context(format!("pod {name}: {why}")))
        }
    }
}

/// The Events that name pod `name` (in any namespace), oldest first, as one line: they say
/// who deleted a pod that is gone (kube-scheduler's preemption, an eviction, kubelet).
async fn events_naming(pods: &Api<Pod>, name: &str) -> String {
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::all(pods.clone().into_client());
    let params = ListParams::default().fields(&format!("involvedObject.name={name}"));
    match events.list(&params).await {
        Ok(list) if list.items.is_empty() => "no Event names it".into(),
        Ok(mut list) => {
            list.items
                .sort_by_key(|e| e.metadata.creation_timestamp.clone());
            let said: Vec<String> = (list.items.iter())
                .map(|e| {
                    format!(
                        "{} {} (uid {}) by {}: {}",
                        e.last_timestamp
                            .as_ref()
                            .or(e.first_timestamp.as_ref())
                            .map(|t| t.0.to_string())
                            .unwrap_or_default(),
                        e.reason.as_deref().unwrap_or("?"),
                        e.involved_object.uid.as_deref().unwrap_or("?"),
                        (e.reporting_component.as_deref())
                            .filter(|c| !c.is_empty())
                            .or(e.source.as_ref().and_then(|s| s.component.as_deref()))
                            .unwrap_or("?"),
                        e.message.as_deref().unwrap_or("")
                    )
                })
                .collect();
            format!("its Events: {}", said.join(" | "))
        }
        Err(error) => format!("listing its Events failed: {error}"),
    }
}

/// Waits until the pod runs and returns it.
pub async fn wait_running(h: &impl Harness, name: &str) -> anyhow::Result<Pod> {
    let pods = pods(h);
    let result = wait_for(&format!("pod {name} to run"), START_TIMEOUT, || async {
        let pod = pods.get(name).await.ok()?;
        (phase(&pod) == "Running").then_some(pod)
    })
    .await;
    match result {
        Ok(pod) => Ok(pod),
        Err(error) => {
            let pod = pods.get(name).await.ok();
            let why = pod.as_ref().map(|p| {
                let status = p.status.as_ref();
                format!(
                    "phase {}, {}{}",
                    phase(p),
                    scheduling_message(p).unwrap_or_default(),
                    status
                        .and_then(|s| s.message.as_deref())
                        .map(|m| format!(
                            " ({}: {m})",
                            status.and_then(|s| s.reason.as_deref()).unwrap_or_default()
                        ))
                        .unwrap_or_default()
                )
            });
            let why = why.unwrap_or_else(|| "gone".into());
            Err(error.context(format!("pod {name}: {why}")))
        }
    }
}

/// Waits until the scheduler has said why the pod cannot be placed, and returns the reason
/// (the `PodScheduled=False` condition's message, as `kubectl describe` shows it).
pub async fn wait_unschedulable(h: &impl Harness, name: &str) -> anyhow::Result<String> {
    let pods = pods(h);
    let what = format!("a reason why pod {name} is pending");
    wait_for(&what, START_TIMEOUT, || async {
        scheduling_message(&pods.get(name).await.ok()?)
    })
    .await
}

/// The pod's phase ("" if none yet).
pub fn phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or_default()
}

/// The `PodScheduled=False` message, if the scheduler set one.
pub fn scheduling_message(pod: &Pod) -> Option<String> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
        .and_then(|c| c.message.clone())
}

/// The allocation the extender recorded on a pod.
pub fn allocation(pod: &Pod) -> anyhow::Result<PodAllocation> {
    let annotations = pod.metadata.annotations.clone().unwrap_or_default();
    PodAllocation::from_annotations(&Keys::default(), &annotations)?.with_context(|| {
        format!(
            "pod {} carries no gpushare allocation",
            pod.metadata.name.as_deref().unwrap_or("?")
        )
    })
}

/// Every running container that asked for GPU memory sees exactly its pod's GPUs: all of
/// them, in the allocation's order, for a multi-GPU pod.
pub async fn check_pinned(h: &impl Harness, pod: &Pod) -> anyhow::Result<()> {
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let alloc = allocation(pod)?;
    let uuids: Vec<&str> = alloc.gpus().map(|(_, uuid)| uuid).collect();
    let indices: Vec<String> = alloc.gpus().map(|(index, _)| index.to_string()).collect();
    let want_visible = uuids.join(",");
    for container in &alloc.containers {
        let env = h.container_env(name, &container.name).await?;
        let visible = env
            .get(env::NVIDIA_VISIBLE_DEVICES)
            .map(String::as_str)
            .unwrap_or_default();
        ensure!(
            uuids.iter().all(|u| !u.is_empty()) && visible == want_visible,
            "pod {name} container {}: NVIDIA_VISIBLE_DEVICES={visible:?} but the pod is on GPUs {} ({want_visible})",
            container.name,
            indices.join(",")
        );
        ensure!(
            env.get(env::GPU_INDEX) == Some(&indices.join(","))
                && env.get(env::CONTAINER_GIB) == Some(&container.gib.to_string()),
            "pod {name} container {}: env {env:?} does not match allocation {alloc:?}",
            container.name
        );
    }
    Ok(())
}

/// GiB in use per (node, GPU index), from every active pod's annotations, checked against
/// each GPU's size from the node inventory. Returns the usage table.
pub async fn check_no_overcommit(
    client: &Client,
) -> anyhow::Result<BTreeMap<(String, u32), (u64, u64)>> {
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    let mut usage: BTreeMap<(String, u32), (u64, u64)> = BTreeMap::new();
    for node in &nodes.items {
        let name = node.metadata.name.clone().unwrap_or_default();
        let Some(gpus) = published_gpus(node) else {
            continue;
        };
        for gpu in gpus? {
            usage.insert((name.clone(), gpu.index), (0, gpu.mem_gib));
        }
    }
    let pods = Api::<Pod>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    for pod in &pods.items {
        if matches!(phase(pod), "Succeeded" | "Failed") {
            continue;
        }
        let (Some(node), Ok(alloc)) = (
            pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            allocation(pod),
        ) else {
            continue;
        };
        for (index, _) in alloc.gpus() {
            let entry = usage
                .get_mut(&(node.clone(), index))
                .with_context(|| format!("pod placed on unknown GPU {index} of node {node}"))?;
            // A whole-GPU pod holds all of it.
            entry.0 += if alloc.exclusive {
                alloc.pod_gib.max(entry.1)
            } else {
                alloc.pod_gib
            };
        }
    }
    for ((node, gpu), (used, total)) in &usage {
        ensure!(
            used <= total,
            "GPU {gpu} of node {node} is over-committed: {used} GiB of {total} GiB"
        );
    }
    Ok(usage)
}

/// What the notebook story showed.
#[derive(Debug)]
pub struct NotebookOutcome {
    /// The three pods sharing the GPU: (name, GPU index, GPU UUID).
    pub sharing: Vec<(String, u32, String)>,
    /// Why the fourth pod waited.
    pub pending_reason: String,
    /// The GPU the fourth pod got once a pod was deleted.
    pub fourth_gpu: u32,
}

/// The classic story on a node with one GPU of 14–16 GiB: three pods × 4 GiB share it, a
/// fourth waits with a reason, and starts once one of the three is deleted.
pub async fn notebook(
    h: &impl Harness,
    narrator: &impl Narrator,
) -> anyhow::Result<NotebookOutcome> {
    narrator
        .say("Three notebooks each ask for 4 GiB of GPU memory (example.com/gpu-mem: 4).")
        .await;
    for i in 1..=3 {
        create_gpu_pod(h, &format!("notebook-{i}"), 4).await?;
    }
    let mut sharing = Vec::new();
    for i in 1..=3 {
        let pod = wait_running(h, &format!("notebook-{i}")).await?;
        check_pinned(h, &pod).await?;
        let alloc = allocation(&pod)?;
        sharing.push((format!("notebook-{i}"), alloc.gpu_index, alloc.gpu_uuid));
    }
    ensure!(
        sharing
            .iter()
            .all(|(_, gpu, uuid)| (*gpu, uuid) == (sharing[0].1, &sharing[0].2)),
        "the three notebooks should share one GPU: {sharing:?}"
    );
    narrator
        .say(&format!(
            "All three run on the same GPU ({}); each container sees only that GPU.",
            sharing[0].2
        ))
        .await;
    narrator.show().await;

    narrator
        .say("A fourth notebook asks for 4 GiB: 12 GiB are taken, so it cannot fit.")
        .await;
    create_gpu_pod(h, "notebook-4", 4).await?;
    let pending_reason = wait_unschedulable(h, "notebook-4").await?;
    narrator
        .say(&format!("notebook-4 stays Pending: {pending_reason}"))
        .await;
    narrator.show().await;

    narrator
        .say("Delete notebook-1: its 4 GiB come free.")
        .await;
    delete_pod(h, "notebook-1").await?;
    let fourth = wait_running(h, "notebook-4").await?;
    check_pinned(h, &fourth).await?;
    let fourth_gpu = allocation(&fourth)?.gpu_index;
    narrator
        .say("notebook-4 is running now, on the GPU notebook-1 left.")
        .await;
    narrator.show().await;
    check_no_overcommit(&h.client()).await?;
    Ok(NotebookOutcome {
        sharing,
        pending_reason,
        fourth_gpu,
    })
}

/// The in-process cluster as a harness: container environments come from the kubelet
/// drivers, which recorded what the device plugin answered at `Allocate`.
impl Harness for TestCluster {
    fn client(&self) -> Client {
        self.client.clone()
    }

    fn namespace(&self) -> &str {
        "default"
    }

    async fn container_env(
        &self,
        pod: &str,
        container: &str,
    ) -> anyhow::Result<BTreeMap<String, String>> {
        self.nodes
            .values()
            .find_map(|node| node.kubelet.container_env("default", pod, container))
            .with_context(|| format!("no kubelet admitted container {container} of pod {pod}"))
    }
}

/// Counts pods per (node, GPU) among `names`, for assertions about packing.
pub async fn placements(
    h: &impl Harness,
    names: &[String],
) -> anyhow::Result<HashMap<String, (String, u32)>> {
    let pods = pods(h);
    let mut out = HashMap::new();
    for name in names {
        let pod = pods.get(name).await?;
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        out.insert(name.clone(), (node, allocation(&pod)?.gpu_index));
    }
    Ok(out)
}

/// The `events.k8s.io` Events of `namespace` with `reason`: (the object's name, the note)
/// each; `None` while there is none (or the API cannot be read), for [`wait_for`].
pub async fn events_with_reason(
    client: &Client,
    namespace: &str,
    reason: &str,
) -> Option<Vec<(String, String)>> {
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), namespace);
    let about: Vec<(String, String)> = events
        .list(&ListParams::default())
        .await
        .ok()?
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .filter_map(|e| Some((e.regarding?.name?, e.note.unwrap_or_default())))
        .collect();
    (!about.is_empty()).then_some(about)
}
