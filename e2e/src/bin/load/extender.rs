//! Phase 1: the real `gpushare-extender` under the load kube-scheduler puts on it.
//!
//! ```text
//!  set-up:  N nodes (gpushare=true, G GPUs) + M pods already bound, with allocation annotations
//!  start:   gpushare-extender lists both and rebuilds its view  ──▶ time to /readyz, RSS
//!  drive:   P pending pods, C in flight, each: filter(NodeNames) → prioritize → bind
//!           ──▶ latency per verb (exact percentiles), binds/s, API writes per bind, peak RSS
//! ```
//!
//! The calls are what kube-scheduler sends to an extender configured as our chart configures
//! it (`nodeCacheCapable: true`): JSON bodies built from `gpushare_e2e::scheduler::wire`, with
//! PascalCase keys, over pooled keep-alive connections. Latency is the HTTP round trip only —
//! request encoding and answer decoding on our side are outside the timer — but everything
//! (the in-process API server, this driver and the extender) shares the machine's cores, so
//! the figures are an upper bound for the extender alone.
//!
//! Before driving, the harness waits until the extender's pod watch has delivered the last
//! pending pod and its start-up hold on binds is over (see [`wait_until_binding`]), so no bind
//! is refused only because the drive began before the extender could bind at all.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::{StreamExt, TryStreamExt};
use gpushare_contract::Keys;
use gpushare_e2e::apiserver::{ApiServer, Verb};
use gpushare_e2e::cluster::{Binaries, Extender, ExtenderTls, free_port, wait_for};
use gpushare_e2e::realk8s::latency::Histogram;
use gpushare_e2e::realk8s::load::cpu_seconds;
use gpushare_e2e::scheduler::wire::ExtenderBindingArgs;
use gpushare_testkit::fixtures::{node, pod};
use gpushare_testkit::workload::{MAX_BOUND_GIB, bound_pod, node_name};
use k8s_openapi::api::core::v1::Pod;

use crate::extender_drive::{Drive, Tally};
use crate::extender_http::Http;
use crate::extender_metrics::{
    api_reads, bind_outcomes, describe_handler_time, describe_outcomes, events_by_reason,
    handler_seconds,
};
use crate::report::{QUOTED, figure, in_flight, proc_memory, quoted, ratio, secs, section, took};

/// Namespace of every pod this phase creates.
pub const NAMESPACE: &str = "default";
/// Largest GiB of a pending pod (sizes are 1..=this).
const MAX_PENDING_GIB: u64 = 4;

/// What phase 1 builds and drives: the harness's flags for it.
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    /// Nodes labelled gpushare=true (extender phase).
    #[arg(long, env = "LOAD_NODES", default_value_t = 5000)]
    pub nodes: usize,
    /// GPUs per node.
    #[arg(long, env = "LOAD_GPUS", default_value_t = 8)]
    pub gpus: u32,
    /// GiB per GPU.
    #[arg(long, env = "LOAD_GPU_GIB", default_value_t = 32)]
    pub gpu_gib: u64,
    /// Pods already bound (1–2 GiB, with allocation annotations) before the extender starts.
    #[arg(long, env = "LOAD_BOUND_PODS", default_value_t = 50_000)]
    pub bound_pods: usize,
    /// Pending pods (1–4 GiB) driven through filter → prioritize → bind.
    #[arg(long, env = "LOAD_PODS", default_value_t = 2000)]
    pub pods: usize,
    /// Node names per filter call; 0 sends every node (worst case).
    #[arg(long, env = "LOAD_FILTER_NODES", default_value_t = 0)]
    pub filter_nodes: usize,
    /// Pods in flight at once during the drive.
    #[arg(long, env = "LOAD_CONCURRENCY", default_value_t = 16)]
    pub concurrency: usize,
    /// API creates in flight at once during set-up.
    #[arg(long, env = "LOAD_SETUP_CONCURRENCY", default_value_t = 32)]
    pub setup_concurrency: usize,
    /// Drive without the prioritize verb, as a scheduler profile that scores GPU memory itself
    /// (`NodeResourcesFit` `MostAllocated`) would: filter → bind only, the node with the most
    /// GPU memory requested (ties to the first sent) chosen, so the extender sees the same
    /// kind of packing it would under its own scores.
    #[arg(long, env = "LOAD_NO_PRIORITIZE", default_value_t = false)]
    pub no_prioritize: bool,
    /// The extender's `--filter-keep-best` (0: filter passes every fitting node). With 1, one
    /// node passes and the drive binds it without prioritize, as kube-scheduler does.
    #[arg(long, env = "LOAD_FILTER_KEEP_BEST", default_value_t = 0)]
    pub filter_keep_best: usize,
    /// Call the extender over plain HTTP/1.1. By default it serves HTTPS, as the chart runs
    /// it, and the harness speaks HTTP/2 to it over one connection, as kube-scheduler's
    /// transport negotiates with it.
    #[arg(long, env = "LOAD_PLAIN_HTTP", default_value_t = false)]
    pub plain_http: bool,
    /// The extender's `--worker-threads`. 1 by default: the chart limits the extender to one
    /// CPU, and its runtime starts one worker per CPU it may use. 0: one per core here.
    #[arg(long, env = "LOAD_EXTENDER_WORKER_THREADS", default_value_t = 1)]
    pub extender_worker_threads: usize,
}

impl Config {
    /// Refuses configurations that would over-commit a GPU or cannot run at all.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.nodes == 0 || self.gpus == 0 || self.concurrency == 0 || self.setup_concurrency == 0
        {
            bail!("--nodes, --gpus, --concurrency and --setup-concurrency must be at least 1");
        }
        let per_node = self.bound_pods.div_ceil(self.nodes);
        let per_gpu = u64::try_from(per_node.div_ceil(self.gpus as usize)).unwrap_or(u64::MAX);
        if per_gpu.saturating_mul(MAX_BOUND_GIB) > self.gpu_gib {
            bail!(
                "--bound-pods {} on {} nodes puts up to {per_gpu} pods of up to {MAX_BOUND_GIB} GiB on one \
                 {} GiB GPU; raise --gpu-gib or --nodes, or lower --bound-pods",
                self.bound_pods,
                self.nodes,
                self.gpu_gib
            );
        }
        if self.gpu_gib < MAX_PENDING_GIB {
            bail!(
                "--gpu-gib must be at least {MAX_PENDING_GIB}: pending pods ask for up to {MAX_PENDING_GIB} GiB"
            );
        }
        Ok(())
    }

    /// Which node names a filter call carries, for the report.
    pub fn filter_description(&self) -> String {
        if self.filter_nodes == 0 || self.filter_nodes >= self.nodes {
            format!(
                "all {} nodes per call (worst case; kube-scheduler sends its feasible subset)",
                self.nodes
            )
        } else {
            format!(
                "{} of {} nodes per call, a rotating window (like kube-scheduler's percentageOfNodesToScore)",
                self.filter_nodes, self.nodes
            )
        }
    }
}

/// Runs phase 1 and prints its section of the report.
pub async fn run(cfg: &Config, bins: &Binaries, log_dir: &Path) -> anyhow::Result<()> {
    section("extender (real gpushare-extender, in-process API server)");
    let api = ApiServer::start().await?;
    let client = api.client();
    let kubeconfig = log_dir.join("extender-kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    create_nodes_and_bound_pods(cfg, &client).await?;

    // Start: list + rebuild.
    let started = Instant::now();
    let tls = extender_tls(cfg, log_dir)?;
    let extender = start_extender(cfg, bins, &kubeconfig, log_dir, tls.as_ref()).await?;
    took("extender start → ready (list + rebuild)", started);
    let pid = extender.process.id();
    figure("extender RSS when ready", proc_memory(pid, "VmRSS"));

    let pending = create_pending_pods(cfg, &client).await?;
    let http = Http::new(extender.url_prefix(), tls.as_ref())?;
    // Health and metrics: the monitor port when the extender serves HTTPS.
    let addr: SocketAddr = extender.monitor_addr();
    if let Some(last) = newest(&pending) {
        let started = Instant::now();
        wait_until_binding(&http, addr, last, &node_name(0)).await?;
        took("wait until binds accepted (watch, hold)", started);
    }

    drive(cfg, (&api, &client), (http, pending), addr, pid).await?;

    extender.process.stop().await;
    api.shutdown().await;
    Ok(())
}

/// Set-up: the nodes, then the pods already bound to them, with allocation annotations.
async fn create_nodes_and_bound_pods(cfg: &Config, client: &kube::Client) -> anyhow::Result<()> {
    let gpus = vec![cfg.gpu_gib; cfg.gpus as usize];
    let started = Instant::now();
    let nodes = (0..cfg.nodes).map(|i| node(&node_name(i)).gpushare().gpus(&gpus).create(client));
    in_flight(cfg.setup_concurrency, nodes).await?;
    took("set-up: nodes created", started);

    let keys = Keys::default();
    let bind_time = jiff::Timestamp::now().to_string();
    let started = Instant::now();
    let pods: kube::Api<Pod> = kube::Api::namespaced(client.clone(), NAMESPACE);
    let creates = (0..cfg.bound_pods).map(|i| {
        let pod = bound_pod(i, cfg.nodes, cfg.gpus, &keys, &bind_time).build();
        let pods = pods.clone();
        async move {
            pods.create(&Default::default(), &with_managed_fields(pod))
                .await
        }
    });
    in_flight(cfg.setup_concurrency, creates).await?;
    took("set-up: bound pods created", started);
    Ok(())
}

/// `pod` with the `managedFields` a real API server would list for it: the creator's entry
/// owning its spec, the extender's its annotations, kubelet's its status. The in-process server
/// stores them as sent and records none itself; they are here because a real cluster's pods
/// carry them, and the extender's relist and watches pay to decode them.
fn with_managed_fields(mut pod: Pod) -> Pod {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry};
    let entry = |manager: &str, fields: serde_json::Value| ManagedFieldsEntry {
        manager: Some(manager.to_owned()),
        operation: Some("Update".to_owned()),
        api_version: Some("v1".to_owned()),
        time: pod.metadata.creation_timestamp.clone(),
        fields_type: Some("FieldsV1".to_owned()),
        fields_v1: Some(FieldsV1(fields)),
        subresource: None,
    };
    let spec = serde_json::to_value(&pod.spec).unwrap_or_default();
    let annotations = serde_json::to_value(&pod.metadata.annotations).unwrap_or_default();
    let entries = vec![
        entry(
            "kube-controller-manager",
            serde_json::json!({"f:spec": owned_fields(spec)}),
        ),
        entry(
            "gpushare-extender",
            serde_json::json!({"f:metadata": {"f:annotations": owned_fields(annotations)}}),
        ),
        entry(
            "kubelet",
            serde_json::json!({"f:status": {"f:conditions": {}, "f:phase": {}, "f:podIP": {}}}),
        ),
    ];
    pod.metadata.managed_fields = Some(entries);
    pod
}

/// `value`'s fields as a `FieldsV1` set: an object lists its fields, anything else is owned whole.
fn owned_fields(value: serde_json::Value) -> serde_json::Value {
    match value {
        serde_json::Value::Object(map) => serde_json::Value::Object(
            map.into_iter()
                .map(|(k, v)| (format!("f:{k}"), owned_fields(v)))
                .collect(),
        ),
        _ => serde_json::json!({}),
    }
}

/// The extender's serving certificate, as the chart's is (none with `--plain-http`).
fn extender_tls(cfg: &Config, log_dir: &Path) -> anyhow::Result<Option<ExtenderTls>> {
    if cfg.plain_http {
        return Ok(None);
    }
    let dir = log_dir.join("extender-tls");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(Some(ExtenderTls::generate(&dir)?))
}

/// The extender, started on the API server of `kubeconfig` and ready (listed and rebuilt).
async fn start_extender(
    cfg: &Config,
    bins: &Binaries,
    kubeconfig: &Path,
    log_dir: &Path,
    tls: Option<&ExtenderTls>,
) -> anyhow::Result<Extender> {
    let log = log_dir.join("extender.log");
    // The chart's policy (the binary's default) with prioritize; without it, `binpack`, the
    // only policy the chart pairs with `scheduler.nativeGpuScoring`.
    let mut extender_args = vec![
        format!("--filter-keep-best={}", cfg.filter_keep_best),
        format!("--worker-threads={}", cfg.extender_worker_threads),
    ];
    if cfg.no_prioritize {
        extender_args.push("--policy=binpack".to_owned());
    }
    match tls {
        None => Extender::start(bins, kubeconfig, &log, &extender_args).await,
        Some(tls) => {
            let mut extender = Extender::spawn_secured_on(
                bins,
                kubeconfig,
                &log,
                &extender_args,
                free_port()?,
                (tls, free_port()?),
            )?;
            extender.wait_ready().await?;
            Ok(extender)
        }
    }
}

/// Pending pods, created after the start so they reach the extender through its watch.
async fn create_pending_pods(cfg: &Config, client: &kube::Client) -> anyhow::Result<Vec<Pod>> {
    let started = Instant::now();
    let pending: Vec<Pod> = futures::stream::iter((0..cfg.pods).map(|i| {
        pod(&format!("pending-{i:05}"))
            .gpu_mem(1 + i as u64 % MAX_PENDING_GIB)
            .create(client)
    }))
    .buffered(cfg.setup_concurrency)
    .map_ok(|mut pod: Pod| {
        // kube-scheduler v1.36 sends the Pod without managedFields (its pod cache drops them).
        pod.metadata.managed_fields = None;
        pod
    })
    .try_collect()
    .await?;
    took("set-up: pending pods created", started);
    Ok(pending)
}

/// Drives the `pending` pods through the extender over `http` and prints what it cost.
async fn drive(
    cfg: &Config,
    (api, client): (&ApiServer, &kube::Client),
    (http, pending): (Http, Vec<Pod>),
    addr: SocketAddr,
    pid: Option<u32>,
) -> anyhow::Result<()> {
    let before = Counters::read(api, client, addr, pid, true).await?;
    let mut drive = Drive::new(
        http,
        pending,
        (0..cfg.nodes).map(node_name).collect(),
        cfg.filter_nodes,
    );
    drive.prioritize = !cfg.no_prioritize;
    let drive = Arc::new(drive);
    let started = Instant::now();
    let tally = drive.run(cfg.concurrency).await?;
    let elapsed = started.elapsed();
    let after = Counters::read(api, client, addr, pid, false).await?;
    report_throughput(cfg, &tally, &drive, elapsed);
    figure(
        "extender's own time per call (its histogram)",
        describe_handler_time(&before.handled, &after.handled),
    );
    report_cost(&tally, &drive, &before, &after);
    report_outcomes(&tally, &before, &after);
    figure("extender peak RSS (VmHWM)", proc_memory(pid, "VmHWM"));
    figure("extender RSS after load (VmRSS)", proc_memory(pid, "VmRSS"));
    Ok(())
}

/// The counters the drive is measured by, read before it and after it. The extender's CPU
/// time is read after the `/metrics` scrapes before the drive and before them after it, so
/// the scrapes' own cost stays out of the drive's.
struct Counters {
    /// Bind outcomes by reason (the extender's metrics).
    outcomes: BTreeMap<String, u64>,
    /// Handler time by verb (the extender's metrics).
    handled: BTreeMap<String, Histogram>,
    /// API writes, Events excluded.
    writes: u64,
    /// API writes, Events included.
    all_writes: u64,
    /// The extender's CPU seconds.
    cpu: Option<f64>,
    /// API creates of pods/binding.
    bindings: u64,
    /// API reads of pods and nodes.
    reads: u64,
    /// Events by reason.
    events: BTreeMap<String, u64>,
}

impl Counters {
    /// Reads every counter, `before` the drive or after it. The extender's own `/metrics`
    /// scrapes cost it CPU: before the drive they come first and after it last, so the
    /// drive's CPU figure leaves them out.
    async fn read(
        api: &ApiServer,
        client: &kube::Client,
        addr: SocketAddr,
        pid: Option<u32>,
        before: bool,
    ) -> anyhow::Result<Self> {
        let scrape = || async { (bind_outcomes(addr).await, handler_seconds(addr).await) };
        let scraped_first = if before { Some(scrape().await) } else { None };
        let stats = api.stats();
        let writes = stats.writes();
        let all_writes = stats.writes_including_events();
        let cpu = pid.and_then(cpu_seconds);
        let bindings = stats.count(Verb::Create, "pods/binding");
        let reads = api_reads(api);
        let (outcomes, handled) = match scraped_first {
            Some(scraped) => scraped,
            None => scrape().await,
        };
        let events = events_by_reason(client).await?;
        Ok(Self {
            outcomes,
            handled,
            writes,
            all_writes,
            cpu,
            bindings,
            reads,
            events,
        })
    }
}

/// Pods scheduled, cycles, wall time, binds/s and the latency of each verb.
fn report_throughput(cfg: &Config, tally: &Tally, drive: &Drive, elapsed: Duration) {
    figure(
        "drive: pods scheduled",
        format!("{} of {}", tally.bound, cfg.pods),
    );
    let cycles = u64::try_from(drive.cycles.load(Ordering::Relaxed)).unwrap_or(u64::MAX);
    figure(
        "scheduling cycles per bound pod",
        ratio(cycles, tally.bound),
    );
    figure("drive: wall time", secs(elapsed));
    figure(
        "binds per second",
        format!(
            "{:.1} /s",
            tally.bound as f64 / elapsed.as_secs_f64().max(f64::EPSILON)
        ),
    );
    tally.filter.clone().summary().print("filter");
    tally.prioritize.clone().summary().print("prioritize");
    tally.bind.clone().summary().print("bind");
}

/// API writes per bind; the cost to kube-scheduler and the control plane per scheduled pod
/// (writes, extender calls and bytes, the extender's CPU).
fn report_cost(tally: &Tally, drive: &Drive, before: &Counters, after: &Counters) {
    let writes = after.writes - before.writes;
    let all_writes = after.all_writes - before.all_writes;
    let cpu = after
        .cpu
        .zip(before.cpu)
        .map(|(after, before)| after - before);
    let (calls, sent, received) = drive.http.traffic();
    // The first is per bind; the rest are the cost to kube-scheduler and the control plane,
    // per scheduled pod.
    for (label, total) in [
        ("API writes per bind (events excluded)", writes),
        ("API writes per scheduled pod, Events included", all_writes),
        ("extender calls per scheduled pod", calls),
        (
            "request bytes per scheduled pod (scheduler → extender)",
            sent,
        ),
        (
            "answer bytes per scheduled pod (extender → scheduler)",
            received,
        ),
    ] {
        figure(label, ratio(total, tally.bound));
    }
    figure(
        "per verb: calls per scheduled pod, bytes per call",
        drive.http.describe_by_verb(tally.bound),
    );
    figure(
        "extender CPU per scheduled pod",
        match cpu {
            Some(seconds) if tally.bound > 0 => {
                format!("{:.1} µs", seconds / tally.bound as f64 * 1e6)
            }
            _ => "unavailable".to_owned(),
        },
    );
}

/// Events and API requests in the drive, binds refused and their outcomes, pods left over and
/// call errors.
fn report_outcomes(tally: &Tally, before: &Counters, after: &Counters) {
    figure(
        "Events written in drive, by reason",
        describe_outcomes(&before.events, &after.events),
    );
    figure(
        "API creates of pods/binding",
        after.bindings - before.bindings,
    );
    figure(
        "API reads (get/list pods, nodes) in drive",
        after.reads - before.reads,
    );
    figure(
        "bind refusals (pod requeued, up to 20 tries)",
        tally.refusals.len(),
    );
    figure(
        "bind outcomes (extender metrics, drive)",
        describe_outcomes(&before.outcomes, &after.outcomes),
    );
    for message in tally.refusals.iter().take(QUOTED) {
        figure("  refused", message);
    }
    figure("cycles where no node passed filter", tally.unfit);
    quoted(
        "filter errors (pod requeued; a node waits for an admission)",
        "filter error",
        &tally.filter_errors,
    );
    figure("pods left unscheduled", tally.unscheduled);
    quoted("call errors", "error", &tally.errors);
}

/// The pod with the highest resourceVersion: once a watch has delivered it, it has delivered
/// every pod created before.
fn newest(pods: &[Pod]) -> Option<&Pod> {
    pods.iter().max_by_key(|pod| {
        pod.metadata
            .resource_version
            .as_deref()
            .and_then(|rv| rv.parse::<u64>().ok())
            .unwrap_or(0)
    })
}

/// Waits until a bind of `last` would be decided: the extender's watch has delivered it and
/// any start-up hold on binds is over. The probe carries a UID that is not the pod's, so the
/// extender refuses it without writing; the refusal counts as `pod_recreated` in its metrics
/// only once both hold (before, it counts as `starting` or `pod_not_found`).
async fn wait_until_binding(
    http: &Http,
    addr: SocketAddr,
    last: &Pod,
    node: &str,
) -> anyhow::Result<()> {
    let probe = ExtenderBindingArgs {
        pod_name: last.metadata.name.clone().unwrap_or_default(),
        pod_namespace: last.metadata.namespace.clone().unwrap_or_default(),
        pod_uid: "load-harness-probe-not-the-pods-uid".to_owned(),
        node: node.to_owned(),
    };
    let body = serde_json::to_vec(&probe)?;
    let body = &body;
    let recreated =
        |outcomes: BTreeMap<String, u64>| outcomes.get("pod_recreated").copied().unwrap_or(0);
    wait_for(
        "the extender to see the last pending pod and accept binds",
        Duration::from_secs(120),
        || async move {
            let before = recreated(bind_outcomes(addr).await);
            http.post("bind", body.clone()).await.ok()?;
            (recreated(bind_outcomes(addr).await) > before).then_some(())
        },
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg() -> Config {
        Config {
            nodes: 10,
            gpus: 8,
            gpu_gib: 32,
            bound_pods: 100,
            pods: 10,
            filter_nodes: 0,
            concurrency: 2,
            setup_concurrency: 2,
            no_prioritize: false,
            filter_keep_best: 0,
            plain_http: false,
            extender_worker_threads: 1,
        }
    }

    #[test]
    fn bound_pods_never_overcommit_a_gpu() {
        let cfg = cfg();
        cfg.validate().unwrap();
        let keys = Keys::default();
        let mut used: HashMap<(String, u32), u64> = HashMap::new();
        for i in 0..cfg.bound_pods {
            let pod = bound_pod(i, cfg.nodes, cfg.gpus, &keys, "2026-01-01T00:00:00Z").build();
            let node = pod.spec.as_ref().unwrap().node_name.clone().unwrap();
            let alloc = gpushare_contract::PodAllocation::from_annotations(
                &keys,
                pod.metadata.annotations.as_ref().unwrap(),
            )
            .unwrap()
            .unwrap();
            assert!(alloc.assigned);
            *used.entry((node, alloc.gpu_index)).or_default() += alloc.pod_gib;
        }
        assert!(used.values().all(|&gib| gib <= cfg.gpu_gib));
        assert!(
            Config {
                bound_pods: 10_000,
                ..cfg
            }
            .validate()
            .is_err()
        );
    }
}
