//! Load on the real cluster: Node objects in bulk, a stand-in for their kubelets (and device
//! plugins), and a backlog of pods drained by one scheduler, with what the drain cost.
//!
//! Why a stand-in: the kit has one real kubelet; the other nodes are Node objects only, so no
//! kubelet ever admits their pods. Without that, the allocator's twin rule
//! (`allocator/src/lib.rs`) keeps every later pod of the same size off a GPU that holds one
//! still waiting for its device, which no production node does for long, and the API server
//! would be spared the status write every real node makes for every pod, with either
//! scheduler. The stand-in writes that status (a `startTime`) in both drains and, when asked,
//! the device plugin's marks as the plugin's ServiceAccount on the pod's node, so the chart's
//! allocation policy judges them as it judges the plugin's.
//!
//! A drain ([`drain`]): the scheduler is stopped, the backlog created, the scheduler started,
//! and every pod's first bound moment taken from a pod watch. Throughput is counted from the
//! first bind to the last, so neither pod creation nor the scheduler's start is in it. The
//! API server's request counters, each process's CPU time and the scheduler's own metrics are
//! read around it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use futures::{StreamExt, TryStreamExt, stream};
use gpushare_contract::{DEFAULT_RESOURCE, Keys, PodAllocation};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinHandle;

use super::KitCluster;
use crate::cluster::wait_for;
use crate::fixtures;
use crate::scenarios::Harness;

/// The label every fake node carries (`fake=true`), so they can be deleted in one call.
pub const FAKE_LABEL: &str = "fake";
/// How many API calls the harness keeps in flight when it creates objects in bulk.
const BULK_CALLS: usize = 16;
/// How many pods the node stand-in writes at once: a thousand kubelets write their own pods in
/// parallel, so it must keep up with a drain (with 16 it ran behind, and most writes landed
/// after the last bind).
const STAND_IN_CALLS: usize = 512;

/// Node objects with no kubelet behind them, `<prefix>-0` .. `<prefix>-<count - 1>`, opted in
/// (`gpushare=true`), with the GPUs of `gpus` (GiB each) published as the device plugin
/// publishes them and `extra` extended resources beside `example.com/gpu-mem`. Pods bound there
/// never run.
pub async fn create_fake_gpu_nodes(
    client: &Client,
    prefix: &str,
    count: usize,
    gpus: &[u64],
    extra: &[(&str, u64)],
) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    stream::iter(0..count)
        .map(|i| {
            let nodes = nodes.clone();
            async move {
                let name = format!("{prefix}-{i}");
                let mut node = fixtures::node(&name)
                    .gpushare()
                    .gpus(gpus)
                    .cpu("64")
                    .memory("512Gi")
                    .label(FAKE_LABEL, "true")
                    .build();
                let status = node.status.get_or_insert_default();
                for resources in [&mut status.capacity, &mut status.allocatable] {
                    let resources = resources.get_or_insert_default();
                    resources.insert("pods".to_owned(), Quantity("500".to_owned()));
                    for (resource, amount) in extra {
                        resources.insert((*resource).to_owned(), Quantity(amount.to_string()));
                    }
                }
                let created = nodes
                    .create(&PostParams::default(), &node)
                    .await
                    .with_context(|| format!("creating node {name}"))?;
                // The API server drops a new node's status: write it.
                nodes
                    .patch_status(
                        &name,
                        &PatchParams::default(),
                        &Patch::Merge(json!({ "status": node.status })),
                    )
                    .await
                    .with_context(|| format!("writing the status of node {name}"))?;
                // Admission taints a new node not-ready until its kubelet says otherwise;
                // none will.
                let taints = created.spec.and_then(|s| s.taints).unwrap_or_default();
                if !taints.is_empty() {
                    let kept: Vec<_> = taints
                        .into_iter()
                        .filter(|t| t.key != "node.kubernetes.io/not-ready")
                        .collect();
                    nodes
                        .patch(
                            &name,
                            &PatchParams::default(),
                            &Patch::Merge(json!({ "spec": { "taints": kept } })),
                        )
                        .await
                        .with_context(|| format!("untainting node {name}"))?;
                }
                anyhow::Ok(())
            }
        })
        .buffer_unordered(BULK_CALLS)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Deletes every fake node (not waiting for them to go).
pub async fn delete_fake_nodes(client: &Client) -> anyhow::Result<()> {
    Api::<Node>::all(client.clone())
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels(&format!("{FAKE_LABEL}=true")),
        )
        .await?;
    Ok(())
}

/// Plays kubelet (and, with marks, the device plugin) of every fake node: once a pod in the
/// namespace is bound to a node whose name starts with the prefix, writes its status after
/// `delay` as kubelet does when it admits the pod (a `startTime`; kubelet then writes more,
/// this writes only that one), and with `marks` also the allocation marks of a GPU pod, as
/// the plugin's ServiceAccount on that node (`devicePlugin.allocationMarks=true`). Runs in
/// both drains: kube-scheduler alone's pods get their status as much as the chart's. Stops
/// when dropped.
pub struct NodeStandIn {
    task: JoinHandle<()>,
    written: Arc<AtomicUsize>,
    marked: Arc<AtomicUsize>,
    failed: Arc<Mutex<Vec<String>>>,
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
        let written = Arc::new(AtomicUsize::new(0));
        let marked = Arc::new(AtomicUsize::new(0));
        let failed = Arc::new(Mutex::new(Vec::new()));
        let plugin_user = config.marks_as.as_deref().map(|account| {
            let (sa_namespace, sa_name) =
                account.split_once('/').unwrap_or(("kube-system", account));
            format!("system:serviceaccount:{sa_namespace}:{sa_name}")
        });
        let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
        let task = tokio::spawn({
            let (written, marked, failed) = (written.clone(), marked.clone(), failed.clone());
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
                    let (writes, written, marked, failed) = (
                        writes.clone(),
                        written.clone(),
                        marked.clone(),
                        failed.clone(),
                    );
                    let namespace = pod.namespace().unwrap_or_default();
                    let delay = config.delay;
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        let Ok(_permit) = writes.acquire().await else {
                            return;
                        };
                        let fail = |error: String| {
                            if let Ok(mut failed) = failed.lock() {
                                failed.push(format!("{name}: {error}"));
                            }
                        };
                        // The plugin's mark comes first: Allocate is part of admission.
                        if let Some((user, body)) = &mark {
                            match patch_as(&client, user, &node, &namespace, &name, body).await {
                                Ok(()) => {
                                    marked.fetch_add(1, Ordering::Relaxed);
                                }
                                Err(error) => fail(format!("mark: {error:#}")),
                            }
                        }
                        let status = json!({ "status": {
                            "startTime": jiff::Timestamp::now().to_string(),
                        }});
                        match pods
                            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                            .await
                        {
                            Ok(_) => {
                                written.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(error) => fail(format!("status: {error:#}")),
                        }
                    });
                }
            }
        });
        Self {
            task,
            written,
            marked,
            failed,
        }
    }

    /// Pods whose status was written so far.
    pub fn statuses(&self) -> usize {
        self.written.load(Ordering::Relaxed)
    }

    /// Pods marked allocated so far.
    pub fn marked(&self) -> usize {
        self.marked.load(Ordering::Relaxed)
    }

    /// The writes the API server refused, each with its error.
    pub fn refused(&self) -> Vec<String> {
        self.failed.lock().map(|f| f.clone()).unwrap_or_default()
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

/// The first moment each pod of a namespace was seen bound, from a pod watch.
pub struct BindClock {
    task: JoinHandle<()>,
    bound: Arc<Mutex<HashMap<String, Instant>>>,
    changed: Arc<Notify>,
}

impl BindClock {
    /// Starts watching the pods of `namespace` that carry `selector`.
    pub fn start(client: Client, namespace: &str, selector: &str) -> Self {
        let bound = Arc::new(Mutex::new(HashMap::new()));
        let changed = Arc::new(Notify::new());
        let pods: Api<Pod> = Api::namespaced(client, namespace);
        let config = watcher::Config::default().labels(selector);
        let task = tokio::spawn({
            let (bound, changed) = (bound.clone(), changed.clone());
            async move {
                let mut events = watcher(pods, config)
                    .default_backoff()
                    .applied_objects()
                    .boxed();
                while let Some(event) = events.next().await {
                    let Ok(pod) = event else { continue };
                    if pod
                        .spec
                        .as_ref()
                        .and_then(|s| s.node_name.as_ref())
                        .is_none()
                    {
                        continue;
                    }
                    if let Ok(mut bound) = bound.lock() {
                        bound.entry(pod.name_any()).or_insert_with(Instant::now);
                    }
                    changed.notify_waiters();
                }
            }
        });
        Self {
            task,
            bound,
            changed,
        }
    }

    /// How many pods were seen bound.
    pub fn count(&self) -> usize {
        self.bound.lock().map(|b| b.len()).unwrap_or_default()
    }

    /// Waits until `pods` were seen bound, at most `timeout`; the moments, earliest first.
    pub async fn wait_for(&self, pods: usize, timeout: Duration) -> anyhow::Result<Vec<Instant>> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            if self.count() >= pods {
                break;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                anyhow::bail!(
                    "{} of {pods} pods bound after {} s",
                    self.count(),
                    timeout.as_secs()
                );
            }
        }
        let mut moments: Vec<Instant> = self
            .bound
            .lock()
            .map(|b| b.values().copied().collect())
            .unwrap_or_default();
        moments.sort();
        Ok(moments)
    }
}

impl Drop for BindClock {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Which scheduler drains a backlog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drainer {
    /// The kit's own kube-scheduler (`default-scheduler`, no extender, client QPS 5000 so its
    /// rate limit is out of the way), on pods asking for an extended resource gpushare does
    /// not manage. `percentage` is its `percentageOfNodesToScore` (0: adaptive).
    KubeSchedulerAlone { percentage: u32 },
    /// The chart's dedicated kube-scheduler calling the extender, on GPU pods, with the
    /// extender Service's name resolving to the leader.
    Chart,
    /// DRA mode: the kit's own kube-scheduler (as `KubeSchedulerAlone`, adaptive
    /// `percentageOfNodesToScore`) allocating the claims the chart's policy gave GPU pods
    /// (`example.com/gpu-mem` turned into a claim from a template). Started once
    /// kube-controller-manager has made every pod's claim, so claim creation is not in it.
    Dra,
}

/// The extended resource the kube-scheduler-alone pods ask for: not gpushare's, so neither
/// its routing nor its allocation policy touches them.
pub const BASELINE_RESOURCE: &str = "example.com/baseline-mem";

/// What one drain measured.
#[derive(Debug, Clone)]
pub struct Drain {
    /// Pods in the backlog.
    pub pods: usize,
    /// From the first bind to the last.
    pub seconds: f64,
    /// Pods bound per second from the first bind to the last.
    pub pods_per_s: f64,
    /// The median of the whole seconds' bind counts (the last, partial second left out).
    pub per_second_p50: usize,
    /// API server requests during the drain per pod, by verb.
    pub api_calls_per_pod: BTreeMap<String, f64>,
    /// CPU seconds each process used during the drain.
    pub cpu_seconds: BTreeMap<String, f64>,
    /// The scheduler's own summary (attempt latency quantiles, attempts by result).
    pub scheduler_metrics: String,
}

/// Where a process of the drain is: a name for the report and a host pid.
fn processes(cluster: &KitCluster) -> Vec<(String, u32)> {
    let mut found = Vec::new();
    let state = cluster
        .kit()
        .root()
        .join("harness")
        .join("state")
        .join("pids");
    for name in [
        "kube-apiserver",
        "etcd",
        "kube-scheduler",
        "kube-controller-manager",
    ] {
        if let Some(pid) = std::fs::read_to_string(state.join(name))
            .ok()
            .and_then(|text| text.trim().parse().ok())
        {
            let name = if name == "kube-scheduler" {
                "kube-scheduler (kit)"
            } else {
                name
            };
            found.push((name.to_owned(), pid));
        }
    }
    found.extend(chart_processes(cluster));
    found
}

/// The host pids of the chart's extender and scheduler containers, by pod name.
pub fn chart_processes(cluster: &KitCluster) -> Vec<(String, u32)> {
    let pods = cluster
        .kubectl(&[
            "-n",
            "kube-system",
            "get",
            "pods",
            "-o",
            "jsonpath={range .items[*]}{.metadata.name}{\"\\n\"}{end}",
        ])
        .unwrap_or_default();
    pods.lines()
        .filter_map(|pod| {
            let container = if pod.starts_with("gpushare-extender-") {
                "extender"
            } else if pod.starts_with("gpushare-scheduler-") {
                "kube-scheduler"
            } else {
                return None;
            };
            let pid = cluster
                .script("chart-cluster.sh", &["pid", pod, container])
                .ok()?
                .trim()
                .parse()
                .ok()?;
            Some((pod.to_owned(), pid))
        })
        .collect()
}

/// User plus system CPU seconds of `pid` so far.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command (which may hold spaces) in parentheses.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // CLK_TCK is 100 on Linux.
    Some(ticks / 100.0)
}

/// Peak and current resident memory of `pid` (`VmHWM`, `VmRSS`), in MiB.
pub fn rss_mib(pid: u32) -> Option<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |key: &str| -> Option<f64> {
        let line = status.lines().find(|l| l.starts_with(key))?;
        let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib / 1024.0)
    };
    Some((field("VmHWM:")?, field("VmRSS:")?))
}

/// The API server's `apiserver_request_total`, summed by verb.
async fn api_requests(client: &Client) -> anyhow::Result<BTreeMap<String, f64>> {
    let request = http::Request::get("/metrics").body(Vec::new())?;
    let text = client.request_text(request).await?;
    let mut by_verb = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let verb = labels
            .split(',')
            .find_map(|l| l.strip_prefix("verb=\""))
            .map(|v| v.trim_end_matches('"').to_owned())
            .unwrap_or_default();
        *by_verb.entry(verb).or_insert(0.0) += value.parse::<f64>().unwrap_or(0.0);
    }
    Ok(by_verb)
}

/// The chart's scheduler Deployment.
const CHART_SCHEDULER: &str = "deploy/gpushare-scheduler";

fn scale_chart_scheduler(cluster: &KitCluster, replicas: u32) -> anyhow::Result<()> {
    cluster.kubectl(&[
        "-n",
        "kube-system",
        "scale",
        CHART_SCHEDULER,
        &format!("--replicas={replicas}"),
    ])?;
    if replicas > 0 {
        cluster.kubectl(&[
            "-n",
            "kube-system",
            "rollout",
            "status",
            CHART_SCHEDULER,
            "--timeout=120s",
        ])?;
    }
    Ok(())
}

async fn chart_scheduler_pods(cluster: &KitCluster) -> anyhow::Result<Vec<Pod>> {
    let pods: Api<Pod> = Api::namespaced(cluster.client(), "kube-system");
    Ok(pods
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|p| p.name_any().starts_with("gpushare-scheduler-"))
        .collect())
}

/// Makes the extender Service's name resolve to the Lease holder's pod IP in the pods started
/// from now on, as kube-proxy's per-connection choice would land a scheduler's connection on
/// one replica (the kit's userspace proxy is a hop that must not be timed).
pub async fn point_service_at_leader(cluster: &KitCluster) -> anyhow::Result<String> {
    let holder = cluster.extender_lease_holder()?;
    let pod = holder
        .rsplit_once('_')
        .map_or(holder.as_str(), |(pod, _)| pod);
    let ip = Api::<Pod>::namespaced(cluster.client(), "kube-system")
        .get(pod)
        .await?
        .status
        .and_then(|s| s.pod_ip)
        .with_context(|| format!("the leader {pod} has no pod IP"))?;
    let hosts: PathBuf = cluster.kit().root().join("run").join("hosts-extra");
    let text = std::fs::read_to_string(&hosts)?;
    let mut pointed = false;
    let lines: Vec<String> = text
        .lines()
        .map(|line| match line.split_once(' ') {
            Some((_, names)) if names.contains("gpushare-extender.kube-system.svc") => {
                pointed = true;
                format!("{ip} {names}")
            }
            _ => line.to_owned(),
        })
        .collect();
    ensure!(pointed, "no gpushare-extender line in {}", hosts.display());
    std::fs::write(&hosts, lines.join("\n") + "\n")?;
    Ok(pod.to_owned())
}

/// Creates `count` pods named `<prefix>-<i>` labelled `load=<prefix>`, each asking for `gib`
/// of `resource` (for [`BASELINE_RESOURCE`], with `default-scheduler` named).
async fn create_backlog(
    client: &Client,
    prefix: &str,
    count: usize,
    gib: u64,
    resource: &str,
) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    stream::iter(0..count)
        .map(|i| {
            let pods = pods.clone();
            async move {
                let mut pod = fixtures::pod(&format!("{prefix}-{i}")).gpu_mem(gib).build();
                pod.labels_mut()
                    .insert("load".to_owned(), prefix.to_owned());
                if resource != DEFAULT_RESOURCE {
                    let spec = pod.spec.get_or_insert_default();
                    spec.scheduler_name = Some("default-scheduler".to_owned());
                    for container in &mut spec.containers {
                        let limits = container
                            .resources
                            .get_or_insert_default()
                            .limits
                            .get_or_insert_default();
                        if let Some(amount) = limits.remove(DEFAULT_RESOURCE) {
                            limits.insert(resource.to_owned(), amount);
                        }
                    }
                }
                pods.create(&PostParams::default(), &pod)
                    .await
                    .with_context(|| format!("creating pod {prefix}-{i}"))?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(BULK_CALLS)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Drains a backlog of `count` pods of `gib` with `drainer`: stops it, creates the backlog,
/// starts it, waits until every pod is bound (at most `timeout`), and measures. Leaves the pods
/// in place for the caller's checks.
pub async fn drain(
    cluster: &KitCluster,
    drainer: Drainer,
    prefix: &str,
    count: usize,
    gib: u64,
    timeout: Duration,
) -> anyhow::Result<Drain> {
    let client = cluster.client();
    let resource = match drainer {
        Drainer::KubeSchedulerAlone { .. } => {
            cluster.script("realk8s.sh", &["sched-stop"])?;
            BASELINE_RESOURCE
        }
        Drainer::Dra => {
            cluster.script("realk8s.sh", &["sched-stop"])?;
            DEFAULT_RESOURCE
        }
        Drainer::Chart => {
            scale_chart_scheduler(cluster, 0)?;
            wait_for(
                "the chart's scheduler to stop",
                Duration::from_secs(60),
                || async {
                    chart_scheduler_pods(cluster)
                        .await
                        .ok()?
                        .is_empty()
                        .then_some(())
                },
            )
            .await?;
            DEFAULT_RESOURCE
        }
    };
    create_backlog(&client, prefix, count, gib, resource).await?;
    if drainer == Drainer::Dra {
        wait_for_claims(&client, prefix, count).await?;
    }
    let clock = BindClock::start(client.clone(), "default", &format!("load={prefix}"));
    // Counted from before the scheduler starts: a process started since counts whole.
    let cpu_before: HashMap<u32, f64> = processes(cluster)
        .into_iter()
        .filter_map(|(_, pid)| Some((pid, cpu_seconds(pid)?)))
        .collect();
    let calls_before = api_requests(&client).await?;
    let metrics_url = match drainer {
        Drainer::KubeSchedulerAlone { .. } | Drainer::Dra => {
            let percentage = match drainer {
                Drainer::KubeSchedulerAlone { percentage } => percentage,
                _ => 0,
            };
            let mut start = cluster.kit().script("realk8s.sh");
            let status = start
                .arg("sched-start")
                .env("PCT_NODES", percentage.to_string())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()?;
            ensure!(status.success(), "realk8s.sh sched-start failed ({status})");
            "https://127.0.0.1:10259/metrics".to_owned()
        }
        Drainer::Chart => {
            point_service_at_leader(cluster).await?;
            scale_chart_scheduler(cluster, 1)?;
            let ip = chart_scheduler_pods(cluster)
                .await?
                .into_iter()
                .find_map(|p| p.status.and_then(|s| s.pod_ip))
                .context("the chart's scheduler has no pod IP")?;
            format!("https://{ip}:10259/metrics")
        }
    };
    let moments = clock.wait_for(count, timeout).await?;
    let calls_after = api_requests(&client).await?;
    let cpu_seconds: BTreeMap<String, f64> = processes(cluster)
        .into_iter()
        .filter_map(|(name, pid)| {
            let before = cpu_before.get(&pid).copied().unwrap_or(0.0);
            Some((name, cpu_seconds(pid)? - before))
        })
        .collect();
    let (first, last) = (moments[0], moments[moments.len() - 1]);
    let seconds = (last - first).as_secs_f64();
    let mut per_second: BTreeMap<u64, usize> = BTreeMap::new();
    for moment in &moments {
        *per_second.entry((*moment - first).as_secs()).or_default() += 1;
    }
    let mut whole: Vec<usize> = per_second.values().copied().collect();
    whole.pop();
    whole.sort_unstable();
    let api_calls_per_pod = calls_after
        .iter()
        .map(|(verb, after)| {
            let before = calls_before.get(verb).copied().unwrap_or(0.0);
            (verb.clone(), (after - before) / count as f64)
        })
        .filter(|(_, per_pod)| *per_pod > 0.0)
        .collect();
    let scheduler_metrics = {
        let output = cluster
            .kit()
            .script("realk8s.sh")
            .arg("metrics-summary")
            .env("SCHED_METRICS_URL", &metrics_url)
            .output()?;
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    Ok(Drain {
        pods: count,
        seconds,
        pods_per_s: (count.saturating_sub(1)) as f64 / seconds.max(1e-9),
        per_second_p50: whole.get(whole.len() / 2).copied().unwrap_or(count),
        api_calls_per_pod,
        cpu_seconds,
        scheduler_metrics,
    })
}

/// Deletes the pods of a drain and waits until they are gone.
pub async fn delete_backlog(cluster: &KitCluster, prefix: &str) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(cluster.client(), "default");
    let selector = format!("load={prefix}");
    pods.delete_collection(
        &DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::default()
        },
        &ListParams::default().labels(&selector),
    )
    .await?;
    wait_for(
        &format!("the pods of {prefix} to be gone"),
        Duration::from_secs(120),
        || {
            let pods = pods.clone();
            let selector = selector.clone();
            async move {
                let list = pods
                    .list(&ListParams::default().labels(&selector))
                    .await
                    .ok()?;
                list.items.is_empty().then_some(())
            }
        },
    )
    .await
}

/// Waits until kube-controller-manager has made a claim for each of the `count` pods of the
/// backlog `prefix` (its claims are named after the pods).
async fn wait_for_claims(client: &Client, prefix: &str, count: usize) -> anyhow::Result<()> {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let made = format!("{prefix}-");
    wait_for(
        &format!("kube-controller-manager to make the {count} claims of {prefix}"),
        Duration::from_secs(600),
        || {
            let claims = claims.clone();
            let made = made.clone();
            async move {
                let list = claims.list(&ListParams::default()).await.ok()?;
                let n = list
                    .items
                    .iter()
                    .filter(|c| c.name_any().starts_with(&made))
                    .count();
                (n >= count).then_some(())
            }
        },
    )
    .await
}

/// A ResourceSlice for each fake node `<prefix>-0` .., as the DRA plugin publishes one for its
/// node (`gpushare_dra_plugin::slice::build`): one device per GPU of `gpus` (GiB each), with
/// consumable `memory`.
pub async fn publish_fake_slices(
    client: &Client,
    prefix: &str,
    count: usize,
    gpus: &[u64],
    driver: &str,
) -> anyhow::Result<()> {
    use gpushare_contract::inventory::GpuInfo;
    use gpushare_dra_plugin::slice::{self, Unhealthy};
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    stream::iter(0..count)
        .map(|i| {
            let slices = slices.clone();
            async move {
                let node = format!("{prefix}-{i}");
                let infos: Vec<GpuInfo> = gpus
                    .iter()
                    .zip(0u32..)
                    .map(|(gib, index)| GpuInfo {
                        index,
                        uuid: format!("GPU-{node}-{index}"),
                        model: "Fake".to_owned(),
                        mem_gib: *gib,
                        healthy: true,
                        numa_node: None,
                    })
                    .collect();
                let mut built = slice::build(&node, driver, &infos, 1, Unhealthy::Taint);
                built
                    .labels_mut()
                    .insert(FAKE_LABEL.to_owned(), "true".to_owned());
                slices
                    .create(&PostParams::default(), &built)
                    .await
                    .with_context(|| format!("creating the ResourceSlice of {node}"))?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(BULK_CALLS)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Deletes the slices [`publish_fake_slices`] made.
pub async fn delete_fake_slices(client: &Client) -> anyhow::Result<()> {
    Api::<ResourceSlice>::all(client.clone())
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels(&format!("{FAKE_LABEL}=true")),
        )
        .await?;
    Ok(())
}

/// DRA mode's audit of a drain: every claim of the backlog `prefix` allocated, and no
/// device's `memory` given out beyond `gpu_gib`. Returns (claims allocated, devices in use).
pub async fn check_dra_allocations(
    client: &Client,
    prefix: &str,
    count: usize,
    gpu_gib: u64,
) -> anyhow::Result<(usize, usize)> {
    let claims = Api::<ResourceClaim>::namespaced(client.clone(), "default")
        .list(&ListParams::default())
        .await?;
    let made = format!("{prefix}-");
    let mut allocated = 0;
    let mut used: BTreeMap<(String, String), u64> = BTreeMap::new();
    for claim in claims
        .items
        .iter()
        .filter(|c| c.name_any().starts_with(&made))
    {
        let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
            continue;
        };
        allocated += 1;
        for result in allocation
            .devices
            .as_ref()
            .and_then(|d| d.results.as_deref())
            .unwrap_or_default()
        {
            let memory = result
                .consumed_capacity
                .as_ref()
                .and_then(|c| c.get("memory"))
                .and_then(|q| q.0.strip_suffix("Gi"))
                .and_then(|n| n.parse::<u64>().ok())
                .with_context(|| {
                    format!(
                        "claim {} has no whole-GiB consumed memory",
                        claim.name_any()
                    )
                })?;
            *used
                .entry((result.pool.clone(), result.device.clone()))
                .or_default() += memory;
        }
    }
    ensure!(
        allocated == count,
        "{allocated} of {count} claims of {prefix} allocated"
    );
    if let Some(((pool, device), gib)) = used.iter().find(|(_, gib)| **gib > gpu_gib) {
        anyhow::bail!("{pool}/{device} has {gib} GiB allocated of {gpu_gib}");
    }
    Ok((allocated, used.len()))
}
