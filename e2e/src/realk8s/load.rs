//! Load on the real cluster: Node objects in bulk, a stand-in for their kubelets, and a
//! backlog of pods drained by one scheduler, with what the drain cost.
//!
//! Why a stand-in: the kit has one real kubelet; the other nodes are Node objects only. Without
//! one, the allocator's twin rule (`allocator/src/lib.rs`) keeps every later pod of the same
//! size off a GPU whose pod still waits for its device, which no production node does for long,
//! and the API server would be spared the status write every real node makes for every pod.
//!
//! A drain ([`drain`]): the scheduler stopped, the backlog created, the scheduler started, and
//! every pod's first bound moment taken from a pod watch. Throughput counts from the first bind
//! to the last, so neither pod creation nor the scheduler's start is in it. The fake nodes are
//! in `fake_nodes.rs`, their stand-in in `stand_in.rs`, the measuring in `drain_cost.rs`.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use gpushare_contract::DEFAULT_RESOURCE;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, PodResourceClaim, ResourceClaim as ContainerClaim};
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};

use super::KitCluster;
use super::drain_cost::{api_requests, cpu_by_pid, cpu_since};
use super::fake_nodes::in_bulk;
use super::latency::BindLatency;
use crate::cluster::wait_for;
use crate::fixtures;
use crate::scenarios::Harness;

pub use super::drain_cost::{BindClock, chart_processes, cpu_seconds, rss_mib};
pub use super::fake_nodes::{
    FAKE_LABEL, PLAIN_CLASS, PLAIN_DRIVER, create_fake_gpu_nodes, delete_fake_nodes,
    delete_fake_slices, publish_fake_slices, publish_plain_slices,
};
pub use super::mix::{Mix, Shape};
pub use super::scale::{Leader, Takeover, kill_leader_after, leader_pod, restart_to_ready};
pub use super::stand_in::{NodeStandIn, StandInConfig};

/// Which scheduler drains a backlog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drainer {
    /// The kit's own kube-scheduler (no extender, client QPS 5000), on pods asking for an
    /// extended resource gpushare does not manage; `percentageOfNodesToScore` (0: adaptive).
    KubeSchedulerAlone { percentage: u32 },
    /// The chart's dedicated kube-scheduler calling the extender, on GPU pods, with the
    /// extender Service's name resolving to the leader.
    Chart,
    /// As `Chart`, through the kit's proxy (each connection to a random Ready replica, as
    /// kube-proxy does): for a drain that kills one. Its pods/s are not the chart's figure.
    ChartViaProxy,
    /// DRA mode: the kit's own kube-scheduler (adaptive) allocating the claims the chart's
    /// policy gave GPU pods, started once kube-controller-manager has made every claim.
    Dra,
    /// DRA's own ceiling: the kit's kube-scheduler (as `Dra`) allocating one whole device of a
    /// plain driver ([`publish_plain_slices`]: no capacity) to each pod's claim.
    DraPlain,
    /// DRA mode with the chart's dedicated kube-scheduler (its DRA profile) allocating the
    /// claims, started as `Dra` is.
    DraChart,
}

impl Drainer {
    /// Whether the chart's dedicated kube-scheduler drains (else the kit's own).
    fn is_the_charts(self) -> bool {
        matches!(self, Self::Chart | Self::ChartViaProxy | Self::DraChart)
    }
}

/// The extended resource the kube-scheduler-alone pods ask for: not gpushare's.
pub const BASELINE_RESOURCE: &str = "example.com/baseline-mem";

/// What one drain measured.
#[derive(Debug, Clone)]
pub struct Drain {
    pub pods: usize,
    /// From the first bind to the last.
    pub seconds: f64,
    /// Pods bound per second from the first bind to the last.
    pub pods_per_s: f64,
    /// Pods created per second (the scheduler stopped, `BULK_CALLS` creations in flight).
    pub created_per_s: f64,
    /// The median of the whole seconds' bind counts (the last, partial second left out).
    pub per_second_p50: usize,
    /// API server requests during the drain per pod, by verb.
    pub api_calls_per_pod: BTreeMap<String, f64>,
    /// CPU seconds each process used during the drain.
    pub cpu_seconds: BTreeMap<String, f64>,
    /// The scheduler's own summary (attempt latency quantiles, attempts by result).
    pub scheduler_metrics: String,
    /// Where the bind time went ([`BindLatency`]), a line per histogram.
    pub bind_latency: Vec<String>,
    /// How long a bind kept the scheduler waiting, the median, in seconds, and what it was
    /// read from ([`BindLatency::bind_p50_since`]).
    pub bind_p50: Option<(f64, &'static str)>,
}

/// The chart's scheduler Deployment.
const CHART_SCHEDULER: &str = "deploy/gpushare-scheduler";

fn scale_chart_scheduler(cluster: &KitCluster, replicas: u32) -> anyhow::Result<()> {
    cluster.system(&["scale", CHART_SCHEDULER, &format!("--replicas={replicas}")])?;
    if replicas > 0 {
        cluster.system(&["rollout", "status", CHART_SCHEDULER, "--timeout=120s"])?;
    }
    Ok(())
}

/// Whether the install runs the chart's dedicated kube-scheduler (`scheduler.mode`).
pub async fn chart_runs_a_scheduler(cluster: &KitCluster) -> anyhow::Result<bool> {
    let deployments: Api<Deployment> = Api::namespaced(cluster.client(), "kube-system");
    let name = CHART_SCHEDULER.trim_start_matches("deploy/");
    Ok(deployments.get_opt(name).await?.is_some())
}

async fn chart_scheduler_pods(cluster: &KitCluster) -> anyhow::Result<Vec<Pod>> {
    let pods: Api<Pod> = Api::namespaced(cluster.client(), "kube-system");
    let listed = pods.list(&ListParams::default()).await?.items;
    let scheduler = |p: &Pod| p.name_any().starts_with("gpushare-scheduler-");
    Ok(listed.into_iter().filter(scheduler).collect())
}

/// Makes the extender Service's name resolve to the Lease holder's pod IP in the pods started
/// from now on, as kube-proxy's choice lands a connection on one replica (the kit's userspace
/// proxy is a hop that must not be timed).
pub async fn point_service_at_leader(cluster: &KitCluster) -> anyhow::Result<String> {
    let pod = super::scale::leader_pod(cluster)?;
    let ip = (cluster.system_pod_ip(&pod).await?)
        .with_context(|| format!("the leader {pod} has no pod IP"))?;
    point_extender_name(cluster, &ip)?;
    Ok(pod)
}

/// Makes the extender Service's name resolve to the kit's Service proxy again, in the pods
/// started from now on: what a drain that kills a replica needs.
pub fn point_service_at_proxy(cluster: &KitCluster) -> anyhow::Result<()> {
    let Ok(ip) = std::fs::read_to_string(proxy_ip_path(cluster.kit())) else {
        // Never pointed elsewhere: the name still resolves to the proxy.
        return Ok(());
    };
    point_extender_name(cluster, ip.trim())
}

/// Where [`point_extender_name`] keeps the proxy's address for [`point_service_at_proxy`].
fn proxy_ip_path(kit: &super::Kit) -> PathBuf {
    kit.root().join("run").join("extender-proxy-ip")
}

/// Forgets the proxy address kept by [`point_service_at_leader`]: the kit's `up` starts a new
/// proxy.
pub(super) fn forget_proxy_ip(kit: &super::Kit) {
    let _ = std::fs::remove_file(proxy_ip_path(kit));
}

/// Rewrites the extender Service's line of the pods' extra hosts to `ip`; the first time,
/// keeps the proxy's address it replaces.
fn point_extender_name(cluster: &KitCluster, ip: &str) -> anyhow::Result<()> {
    let hosts = cluster.kit().root().join("run").join("hosts-extra");
    let text = std::fs::read_to_string(&hosts)?;
    let mut pointed = false;
    let mut replaced = None;
    let lines: Vec<String> = text
        .lines()
        .map(|line| match line.split_once(' ') {
            Some((was, names)) if names.contains("gpushare-extender.kube-system.svc") => {
                pointed = true;
                replaced = Some(was.to_owned());
                format!("{ip} {names}")
            }
            _ => line.to_owned(),
        })
        .collect();
    ensure!(pointed, "no gpushare-extender line in {}", hosts.display());
    let saved = proxy_ip_path(cluster.kit());
    if let Some(was) = replaced.filter(|_| !saved.exists()) {
        std::fs::write(&saved, was)?;
    }
    std::fs::write(&hosts, lines.join("\n") + "\n")?;
    Ok(())
}

/// A backlog's pods: how many, the shapes they take ([`Mix::shape_of`]), and the CPU each
/// requests (millicores; 0: none, so kube-scheduler scores each as 100m).
#[derive(Debug, Clone)]
pub struct Backlog {
    pub count: usize,
    pub mix: Mix,
    pub cpu_millis: u64,
}

/// Creates the `backlog`'s pods, named `<prefix>-<i>` and labelled `load=<prefix>`, each
/// asking for its shape's GiB of `resource` (for [`BASELINE_RESOURCE`], with
/// `default-scheduler` named; a multi-GPU shape's total, as one amount).
async fn create_backlog(
    client: &Client,
    prefix: &str,
    backlog: &Backlog,
    resource: &str,
) -> anyhow::Result<()> {
    let cpu_millis = backlog.cpu_millis;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    in_bulk(backlog.count, |i| {
        let pods = pods.clone();
        let shape = backlog.mix.shape_of(i);
        async move {
            let mut builder = fixtures::pod(&format!("{prefix}-{i}")).gpu_mem(shape.total_gib());
            if shape.gpus > 1 && resource == DEFAULT_RESOURCE {
                let key = format!("{}/gpus", gpushare_contract::DEFAULT_DOMAIN);
                builder = builder.annotation(&key, &shape.gpus.to_string());
            }
            let mut pod = builder.build();
            pod.labels_mut()
                .insert("load".to_owned(), prefix.to_owned());
            let spec = pod.spec.get_or_insert_default();
            for container in &mut spec.containers {
                if cpu_millis > 0 {
                    let resources = container.resources.get_or_insert_default();
                    let requests = resources.requests.get_or_insert_default();
                    requests.insert("cpu".to_owned(), Quantity(format!("{cpu_millis}m")));
                }
            }
            if resource == PLAIN_CLASS {
                plain_claim(&mut pod);
            } else if resource != DEFAULT_RESOURCE {
                spec.scheduler_name = Some("default-scheduler".to_owned());
                for container in &mut spec.containers {
                    let resources = container.resources.get_or_insert_default();
                    let limits = resources.limits.get_or_insert_default();
                    if let Some(amount) = limits.remove(DEFAULT_RESOURCE) {
                        limits.insert(resource.to_owned(), amount);
                    }
                }
            }
            let created = pods.create(&PostParams::default(), &pod).await;
            created.with_context(|| format!("creating pod {prefix}-{i}"))?;
            anyhow::Ok(())
        }
    })
    .await
}

/// Makes `pod` (a GPU pod) a plain DRA pod: its `example.com/gpu-mem` gone, a claim from the
/// [`PLAIN_CLASS`] template instead, and `default-scheduler` named.
fn plain_claim(pod: &mut Pod) {
    let spec = pod.spec.get_or_insert_default();
    spec.scheduler_name = Some("default-scheduler".to_owned());
    spec.resource_claims = Some(vec![PodResourceClaim {
        name: "gpu".to_owned(),
        resource_claim_template_name: Some(PLAIN_CLASS.to_owned()),
        ..PodResourceClaim::default()
    }]);
    for container in &mut spec.containers {
        let resources = container.resources.get_or_insert_default();
        if let Some(limits) = resources.limits.as_mut() {
            limits.remove(DEFAULT_RESOURCE);
        }
        if let Some(requests) = resources.requests.as_mut() {
            requests.remove(DEFAULT_RESOURCE);
        }
        resources.claims = Some(vec![ContainerClaim {
            name: "gpu".to_owned(),
            ..ContainerClaim::default()
        }]);
    }
}

/// Drains `backlog` with `drainer`: stops it, creates the backlog, starts it, waits until
/// every pod is bound (at most `timeout`), and measures. Leaves the pods in place for the
/// caller's checks.
pub async fn drain(
    cluster: &KitCluster,
    drainer: Drainer,
    prefix: &str,
    backlog: &Backlog,
    timeout: Duration,
) -> anyhow::Result<Drain> {
    let nothing = |_: Arc<BindClock>| async { anyhow::Ok(()) };
    let (drain, ()) = drain_with(cluster, drainer, prefix, backlog, timeout, nothing).await?;
    Ok(drain)
}

/// [`drain`], with `during` run beside the wait for the binds (it sees the drain's
/// [`BindClock`]): a fault injected mid-drain, and what it measured.
pub async fn drain_with<T, F, Fut>(
    cluster: &KitCluster,
    drainer: Drainer,
    prefix: &str,
    backlog: &Backlog,
    timeout: Duration,
    during: F,
) -> anyhow::Result<(Drain, T)>
where
    F: FnOnce(Arc<BindClock>) -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let client = cluster.client();
    let count = backlog.count;
    let resource = stop_drainer(cluster, drainer).await?;
    let creating = Instant::now();
    create_backlog(&client, prefix, backlog, resource).await?;
    let created_per_s = count as f64 / creating.elapsed().as_secs_f64().max(1e-9);
    if matches!(
        drainer,
        Drainer::Dra | Drainer::DraPlain | Drainer::DraChart
    ) {
        wait_for_claims(&client, prefix, count).await?;
    }
    let selector = format!("load={prefix}");
    let clock = Arc::new(BindClock::start(client.clone(), "default", &selector));
    // Counted from before the scheduler starts: a process started since counts whole.
    let cpu_before = cpu_by_pid(cluster);
    let calls_before = api_requests(&client).await?;
    let extender = match drainer {
        Drainer::Chart => Some(super::latency::leader_monitor_addr(cluster).await?),
        _ => None,
    };
    let latency_before = BindLatency::read(&client, extender).await?;
    let metrics_url = start_drainer(cluster, drainer).await?;
    let (moments, seen) = tokio::join!(clock.wait_for(count, timeout), during(clock.clone()));
    let (moments, seen) = (moments?, seen?);
    let calls_after = api_requests(&client).await?;
    let latency_after = BindLatency::read(&client, extender).await?;
    let bind_latency = latency_after.lines_since(&latency_before);
    let bind_p50 = latency_after.bind_p50_since(&latency_before);
    let cpu_seconds = cpu_since(cluster, &cpu_before);
    let (seconds, per_second_p50) = throughput(&moments, count);
    let api_calls_per_pod = calls_after
        .iter()
        .map(|(verb, after)| {
            let before = calls_before.get(verb).copied().unwrap_or(0.0);
            (verb.clone(), (after - before) / count as f64)
        })
        .filter(|(_, per_pod)| *per_pod > 0.0)
        .collect();
    let scheduler_metrics = scheduler_metrics(cluster, &metrics_url)?;
    let drain = Drain {
        pods: count,
        seconds,
        pods_per_s: (count.saturating_sub(1)) as f64 / seconds.max(1e-9),
        created_per_s,
        per_second_p50,
        api_calls_per_pod,
        cpu_seconds,
        scheduler_metrics,
        bind_latency,
        bind_p50,
    };
    Ok((drain, seen))
}

/// Stops the scheduler of `drainer` (waiting for the chart's to be gone) and says which
/// resource its backlog's pods ask for.
async fn stop_drainer(cluster: &KitCluster, drainer: Drainer) -> anyhow::Result<&'static str> {
    let resource = match drainer {
        Drainer::KubeSchedulerAlone { .. } => BASELINE_RESOURCE,
        Drainer::DraPlain => PLAIN_CLASS,
        _ => DEFAULT_RESOURCE,
    };
    if !drainer.is_the_charts() {
        cluster.script("realk8s.sh", &["sched-stop"])?;
        return Ok(resource);
    }
    scale_chart_scheduler(cluster, 0)?;
    let what = "the chart's scheduler to stop";
    wait_for(what, Duration::from_secs(60), || async {
        let pods = chart_scheduler_pods(cluster).await.ok()?;
        pods.is_empty().then_some(())
    })
    .await?;
    Ok(resource)
}

/// Starts the scheduler of `drainer` and returns the URL of its metrics.
async fn start_drainer(cluster: &KitCluster, drainer: Drainer) -> anyhow::Result<String> {
    match drainer {
        Drainer::KubeSchedulerAlone { percentage } => start_kit_scheduler(cluster, percentage)?,
        Drainer::Dra | Drainer::DraPlain => start_kit_scheduler(cluster, 0)?,
        Drainer::Chart => {
            point_service_at_leader(cluster).await?;
        }
        Drainer::ChartViaProxy => point_service_at_proxy(cluster)?,
        Drainer::DraChart => {}
    }
    if !drainer.is_the_charts() {
        return Ok("https://127.0.0.1:10259/metrics".to_owned());
    }
    scale_chart_scheduler(cluster, 1)?;
    let ip = chart_scheduler_pods(cluster)
        .await?
        .into_iter()
        .find_map(|p| p.status.and_then(|s| s.pod_ip))
        .context("the chart's scheduler has no pod IP")?;
    Ok(format!("https://{ip}:10259/metrics"))
}

/// Starts the kit's own kube-scheduler with `percentageOfNodesToScore` `percentage` (0:
/// adaptive). Its output goes nowhere: it runs on after the script returns.
fn start_kit_scheduler(cluster: &KitCluster, percentage: u32) -> anyhow::Result<()> {
    let status = cluster
        .kit()
        .script("realk8s.sh")
        .arg("sched-start")
        .env("PCT_NODES", percentage.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()?;
    ensure!(status.success(), "realk8s.sh sched-start failed ({status})");
    Ok(())
}

/// From the bind `moments` (earliest first, at least one) of a drain of `count` pods: the
/// seconds from the first bind to the last, and the median of the whole seconds' bind counts
/// (the last, partial second left out; `count` when there is no whole second).
fn throughput(moments: &[Instant], count: usize) -> (f64, usize) {
    let (first, last) = (moments[0], moments[moments.len() - 1]);
    let seconds = (last - first).as_secs_f64();
    let mut per_second: BTreeMap<u64, usize> = BTreeMap::new();
    for moment in moments {
        *per_second.entry((*moment - first).as_secs()).or_default() += 1;
    }
    let mut whole: Vec<usize> = per_second.values().copied().collect();
    whole.pop();
    whole.sort_unstable();
    let median = whole.get(whole.len() / 2).copied().unwrap_or(count);
    (seconds, median)
}

/// The scheduler's own summary (`realk8s.sh metrics-summary`) from its metrics at `url`.
fn scheduler_metrics(cluster: &KitCluster, url: &str) -> anyhow::Result<String> {
    let output = cluster
        .kit()
        .script("realk8s.sh")
        .arg("metrics-summary")
        .env("SCHED_METRICS_URL", url)
        .output()?;
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Which pods [`creation_rate`] creates (`realload --creating plain,gpu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Creating {
    /// Pods asking for no GPU ([`BASELINE_RESOURCE`], `default-scheduler` named): what every
    /// other workload of the cluster creates.
    Plain,
    /// GPU pods (`example.com/gpu-mem`), as users write them: routed by the chart's
    /// admission when it is installed.
    Gpu,
}

/// How fast a backlog was created, and what it cost the API server.
#[derive(Debug, Clone, Copy)]
pub struct Creation {
    /// Pods created per second.
    pub per_s: f64,
    /// The API server's CPU milliseconds per pod created (its admission included).
    pub api_server_cpu_ms: f64,
}

/// Creates `backlog`'s pods as `kind` (named `<prefix>-<i>`, no scheduler to take them while
/// they are created: the kit's and the chart's are stopped meanwhile), measures how fast they
/// were created and what that cost the API server, then deletes them.
pub async fn creation_rate(
    cluster: &KitCluster,
    kind: Creating,
    prefix: &str,
    backlog: &Backlog,
) -> anyhow::Result<Creation> {
    cluster.script("realk8s.sh", &["sched-stop"])?;
    let chart_scheduler = chart_runs_a_scheduler(cluster).await?;
    if chart_scheduler {
        scale_chart_scheduler(cluster, 0)?;
    }
    let resource = match kind {
        Creating::Plain => BASELINE_RESOURCE,
        Creating::Gpu => DEFAULT_RESOURCE,
    };
    let cpu_before = cpu_by_pid(cluster);
    let creating = Instant::now();
    create_backlog(&cluster.client(), prefix, backlog, resource).await?;
    let rate = backlog.count as f64 / creating.elapsed().as_secs_f64().max(1e-9);
    let api_server_cpu = cpu_since(cluster, &cpu_before)
        .get("kube-apiserver")
        .copied()
        .unwrap_or(0.0);
    delete_backlog(cluster, prefix).await?;
    // Both schedulers run again: the cluster's own pods (the chart's hooks too) need them.
    start_kit_scheduler(cluster, 0)?;
    if chart_scheduler {
        scale_chart_scheduler(cluster, 1)?;
    }
    Ok(Creation {
        per_s: rate,
        api_server_cpu_ms: api_server_cpu * 1e3 / backlog.count.max(1) as f64,
    })
}

/// Deletes the pods of a drain and waits until they are gone.
pub async fn delete_backlog(cluster: &KitCluster, prefix: &str) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(cluster.client(), "default");
    let selector = format!("load={prefix}");
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        // One pod is enough to know some are left; listing tens of thousands each time is not.
        let left = pods
            .list(&ListParams::default().labels(&selector).limit(1))
            .await;
        if left.as_ref().is_ok_and(|l| l.items.is_empty()) {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "the pods of {prefix} are not gone after 900 s"
        );
        // A collection delete of tens of thousands of pods can outlast the client's timeout,
        // which ends it part way: ask again until none is left.
        let now = DeleteParams::default().grace_period(0);
        let backlog = ListParams::default().labels(&selector);
        if let Err(error) = pods.delete_collection(&now, &backlog).await {
            println!("  deleting the pods of {prefix}: {error}; asking again");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Waits until kube-controller-manager has made a claim for each of the `count` pods of the
/// backlog `prefix` (its claims are named after the pods).
async fn wait_for_claims(client: &Client, prefix: &str, count: usize) -> anyhow::Result<()> {
    let what = format!("kube-controller-manager to make the {count} claims of {prefix}");
    wait_for(&what, Duration::from_secs(600), || async {
        (claims_of(client, prefix).await.ok()?.len() >= count).then_some(())
    })
    .await
}

/// The claims of the backlog `prefix` (kube-controller-manager names them after the pods).
async fn claims_of(client: &Client, prefix: &str) -> kube::Result<Vec<ResourceClaim>> {
    let claims = Api::<ResourceClaim>::namespaced(client.clone(), "default")
        .list(&ListParams::default())
        .await?;
    let made = format!("{prefix}-");
    Ok((claims.items.into_iter())
        .filter(|c| c.name_any().starts_with(&made))
        .collect())
}

/// DRA mode's audit of a drain: every claim of the backlog `prefix` allocated, and no
/// device's `memory` given out beyond `gpu_gib` (a device allocated without consumed
/// capacity, the plain baseline's, is taken whole). Returns (claims allocated, devices in
/// use).
pub async fn check_dra_allocations(
    client: &Client,
    prefix: &str,
    count: usize,
    gpu_gib: u64,
) -> anyhow::Result<(usize, usize)> {
    let mut allocated = 0;
    let mut used: BTreeMap<(String, String), u64> = BTreeMap::new();
    for claim in claims_of(client, prefix).await? {
        let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
            continue;
        };
        allocated += 1;
        let name = claim.name_any();
        let results = allocation
            .devices
            .as_ref()
            .and_then(|d| d.results.as_deref());
        for result in results.unwrap_or_default() {
            let memory = match &result.consumed_capacity {
                None => gpu_gib,
                Some(consumed) => consumed
                    .get("memory")
                    .and_then(|q| q.0.strip_suffix("Gi"))
                    .and_then(|n| n.parse::<u64>().ok())
                    .with_context(|| format!("claim {name} has no whole-GiB consumed memory"))?,
            };
            let device = (result.pool.clone(), result.device.clone());
            *used.entry(device).or_default() += memory;
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
