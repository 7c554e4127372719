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

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use futures::{StreamExt, TryStreamExt};
use gpushare_contract::Keys;
use gpushare_e2e::apiserver::{ApiServer, Verb};
use gpushare_e2e::cluster::{
    Binaries, EXTENDER_SERVICE_HOST, Extender, ExtenderTls, free_port, http_get, wait_for,
};
use gpushare_e2e::scheduler::wire::{self, ExtenderArgs, ExtenderBindingArgs};
use gpushare_perf::workload::{MAX_BOUND_GIB, bound_pod, node_name};
use gpushare_testkit::fixtures::{node, pod};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_rustls::{FixedServerNameResolver, HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::core::v1::Pod;

use crate::report::{Latencies, figure, proc_cpu_seconds, proc_memory, ratio, secs, section};

/// Namespace of every pod this phase creates.
const NAMESPACE: &str = "default";
/// Largest GiB of a pending pod (sizes are 1..=this).
const MAX_PENDING_GIB: u64 = 4;
/// kube-scheduler's default `httpTimeout` for an extender call.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How many refusal or error messages the report quotes.
const QUOTED: usize = 3;
/// Scheduling attempts per pod: kube-scheduler requeues a pod whose bind was refused (forever,
/// with backoff); we give up after this many so a broken extender cannot spin the drive.
const MAX_ATTEMPTS: u32 = 20;

/// What phase 1 builds and drives.
#[derive(Debug, Clone)]
pub struct Config {
    /// Nodes labelled `gpushare=true`.
    pub nodes: usize,
    /// GPUs per node.
    pub gpus: u32,
    /// GiB per GPU.
    pub gpu_gib: u64,
    /// Pods already bound (with allocation annotations) before the extender starts.
    pub bound_pods: usize,
    /// Pending pods driven through filter → prioritize → bind.
    pub pods: usize,
    /// Node names per filter call; 0 = every node.
    pub filter_nodes: usize,
    /// Pods in flight at once during the drive.
    pub concurrency: usize,
    /// API creates in flight at once during set-up.
    pub setup_concurrency: usize,
    /// Whether the scheduler calls the extender's prioritize. Without it, the drive picks among
    /// the passing nodes as `NodeResourcesFit` `MostAllocated` on the GPU-memory resource would
    /// (the node with the most GPU memory requested, ties to the first sent), so the extender
    /// sees the same kind of packing it would under its own scores.
    pub prioritize: bool,
    /// The extender's `--filter-keep-best`.
    pub filter_keep_best: usize,
    /// Call the extender over plain HTTP/1.1 instead of the chart's way: HTTPS, where
    /// kube-scheduler's transport negotiates HTTP/2 and sends every call on one connection.
    pub plain_http: bool,
    /// The extender's `--worker-threads` (0: one per CPU of this machine).
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

    // Set-up.
    let gpus = vec![cfg.gpu_gib; cfg.gpus as usize];
    let started = Instant::now();
    futures::stream::iter(
        (0..cfg.nodes).map(|i| node(&node_name(i)).gpushare().gpus(&gpus).create(&client)),
    )
    .buffer_unordered(cfg.setup_concurrency)
    .try_for_each(|_| async { Ok(()) })
    .await?;
    figure("set-up: nodes created", secs(started.elapsed()));

    let keys = Keys::default();
    let bind_time = jiff::Timestamp::now().to_string();
    let started = Instant::now();
    futures::stream::iter(
        (0..cfg.bound_pods)
            .map(|i| bound_pod(i, cfg.nodes, cfg.gpus, &keys, &bind_time).create(&client)),
    )
    .buffer_unordered(cfg.setup_concurrency)
    .try_for_each(|_| async { Ok(()) })
    .await?;
    figure("set-up: bound pods created", secs(started.elapsed()));

    // Start: list + rebuild.
    let log = log_dir.join("extender.log");
    let started = Instant::now();
    // The chart's policy (the binary's default) with prioritize; without it, `binpack`, the
    // only policy the chart pairs with `scheduler.nativeGpuScoring`.
    let mut extender_args = vec![
        format!("--filter-keep-best={}", cfg.filter_keep_best),
        format!("--worker-threads={}", cfg.extender_worker_threads),
    ];
    if !cfg.prioritize {
        extender_args.push("--policy=binpack".to_owned());
    }
    let tls = if cfg.plain_http {
        None
    } else {
        let dir = log_dir.join("extender-tls");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Some(ExtenderTls::generate(&dir)?)
    };
    let extender = match &tls {
        None => Extender::start(bins, &kubeconfig, &log, &extender_args).await?,
        Some(tls) => {
            let mut extender = Extender::spawn_secured_on(
                bins,
                &kubeconfig,
                &log,
                &extender_args,
                free_port()?,
                (tls, free_port()?),
            )?;
            extender.wait_ready().await?;
            extender
        }
    };
    figure(
        "extender start → ready (list + rebuild)",
        secs(started.elapsed()),
    );
    let pid = extender.process.id();
    figure("extender RSS when ready", proc_memory(pid, "VmRSS"));

    // Pending pods, created after the start so they reach the extender through its watch.
    let started = Instant::now();
    let pending: Vec<Pod> = futures::stream::iter((0..cfg.pods).map(|i| {
        pod(&format!("pending-{i:05}"))
            .gpu_mem(1 + i as u64 % MAX_PENDING_GIB)
            .create(&client)
    }))
    .buffered(cfg.setup_concurrency)
    .map_ok(|mut pod: Pod| {
        // kube-scheduler v1.36 sends the Pod without managedFields (its pod cache drops them).
        pod.metadata.managed_fields = None;
        pod
    })
    .try_collect()
    .await?;
    figure("set-up: pending pods created", secs(started.elapsed()));

    let http = Http::new(extender.url_prefix(), tls.as_ref())?;
    // Health and metrics: the monitor port when the extender serves HTTPS.
    let addr: SocketAddr = extender.monitor_addr();
    if let Some(last) = newest(&pending) {
        let started = Instant::now();
        wait_until_binding(&http, addr, last, &node_name(0)).await?;
        figure(
            "wait until binds accepted (watch, hold)",
            secs(started.elapsed()),
        );
    }

    // Drive.
    let stats = api.stats();
    let outcomes_before = bind_outcomes(addr).await;
    let handled_before = handler_seconds(addr).await;
    let writes_before = stats.writes();
    let all_writes_before = stats.writes_including_events();
    let cpu_before = proc_cpu_seconds(pid);
    let bindings_before = stats.count(Verb::Create, "pods/binding");
    let reads_before = api_reads(&api);
    let events_before = events_by_reason(&client).await?;
    let mut drive = Drive::new(
        http,
        pending,
        (0..cfg.nodes).map(node_name).collect(),
        cfg.filter_nodes,
    );
    drive.prioritize = cfg.prioritize;
    let drive = Arc::new(drive);
    let started = Instant::now();
    let workers: Vec<_> = (0..cfg.concurrency)
        .map(|_| tokio::spawn(drive.clone().worker()))
        .collect();
    let mut tally = Tally::default();
    for worker in workers {
        tally.merge(worker.await.context("a drive worker panicked")?);
    }
    let elapsed = started.elapsed();
    let writes = stats.writes() - writes_before;
    let all_writes = stats.writes_including_events() - all_writes_before;
    let cpu = proc_cpu_seconds(pid)
        .zip(cpu_before)
        .map(|(after, before)| after - before);
    let (calls, sent, received) = drive.http.traffic();
    let bindings = stats.count(Verb::Create, "pods/binding") - bindings_before;
    let reads = api_reads(&api) - reads_before;
    let outcomes = bind_outcomes(addr).await;
    let handled = handler_seconds(addr).await;
    let events = events_by_reason(&client).await?;

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
    figure(
        "extender's own time per call (its histogram)",
        describe_handler_time(&handled_before, &handled),
    );
    figure(
        "API writes per bind (events excluded)",
        ratio(writes, tally.bound),
    );
    // The cost to kube-scheduler and the control plane, per scheduled pod.
    figure(
        "API writes per scheduled pod, Events included",
        ratio(all_writes, tally.bound),
    );
    figure(
        "extender calls per scheduled pod",
        ratio(calls, tally.bound),
    );
    figure(
        "request bytes per scheduled pod (scheduler → extender)",
        ratio(sent, tally.bound),
    );
    figure(
        "answer bytes per scheduled pod (extender → scheduler)",
        ratio(received, tally.bound),
    );
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
    figure(
        "Events written in drive, by reason",
        describe_outcomes(&events_before, &events),
    );
    figure("API creates of pods/binding", bindings);
    figure("API reads (get/list pods, nodes) in drive", reads);
    figure(
        "bind refusals (pod requeued, up to 20 tries)",
        tally.refusals.len(),
    );
    figure(
        "bind outcomes (extender metrics, drive)",
        describe_outcomes(&outcomes_before, &outcomes),
    );
    for message in tally.refusals.iter().take(QUOTED) {
        figure("  refused", message);
    }
    figure("cycles where no node passed filter", tally.unfit);
    figure("pods left unscheduled", tally.unscheduled);
    figure("call errors", tally.errors.len());
    for message in tally.errors.iter().take(QUOTED) {
        figure("  error", message);
    }
    figure("extender peak RSS (VmHWM)", proc_memory(pid, "VmHWM"));
    figure("extender RSS after load (VmRSS)", proc_memory(pid, "VmRSS"));

    extender.process.stop().await;
    api.shutdown().await;
    Ok(())
}

/// Events in the pods' namespace by `<component>/<reason>`, counting repeats (`count`, or the
/// series count): which writes besides the Bindings the drive caused.
async fn events_by_reason(client: &kube::Client) -> anyhow::Result<BTreeMap<String, u64>> {
    use k8s_openapi::api::core::v1::Event;
    let api: kube::Api<Event> = kube::Api::namespaced(client.clone(), NAMESPACE);
    let list = api
        .list(&Default::default())
        .await
        .context("listing Events")?;
    let mut by_reason = BTreeMap::new();
    for event in list.items {
        let component = event
            .reporting_component
            .clone()
            .filter(|c| !c.is_empty())
            .or_else(|| event.source.as_ref().and_then(|s| s.component.clone()))
            .unwrap_or_else(|| "?".to_owned());
        let reason = event.reason.clone().unwrap_or_default();
        let repeats = event
            .series
            .as_ref()
            .and_then(|s| s.count)
            .or(event.count)
            .and_then(|n| u64::try_from(n).ok())
            .unwrap_or(1)
            .max(1);
        *by_reason
            .entry(format!("{component}/{reason}"))
            .or_default() += repeats;
    }
    Ok(by_reason)
}

/// GET and LIST requests on pods and nodes so far: what the extender reads besides its watches.
fn api_reads(api: &ApiServer) -> u64 {
    let stats = api.stats();
    [Verb::Get, Verb::List]
        .iter()
        .flat_map(|verb| ["pods", "nodes"].map(|resource| stats.count(*verb, resource)))
        .sum()
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

/// `gpushare_extender_binds_total` by reason, from the extender's `/metrics`.
async fn bind_outcomes(addr: SocketAddr) -> BTreeMap<String, u64> {
    let Ok((200, text)) = http_get(addr, "/metrics").await else {
        return BTreeMap::new();
    };
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("gpushare_extender_binds_total{")?;
            let (labels, value) = rest.split_once("} ")?;
            let reason = labels
                .split(',')
                .find_map(|label| label.strip_prefix("reason=\""))?
                .trim_end_matches('"');
            let value = value.split_whitespace().next()?.parse::<f64>().ok()?;
            // Counters are whole numbers.
            Some((reason.to_owned(), value as u64))
        })
        .collect()
}

/// `gpushare_extender_request_duration_seconds` sum and count by verb, from `/metrics`: the
/// time the extender spent in each handler, without transport or the caller's queueing.
async fn handler_seconds(addr: SocketAddr) -> BTreeMap<String, (f64, f64)> {
    match http_get(addr, "/metrics").await {
        Ok((200, text)) => parse_handler_seconds(&text),
        _ => BTreeMap::new(),
    }
}

/// The sums and counts of the extender's request-duration histogram in an OpenMetrics text.
fn parse_handler_seconds(text: &str) -> BTreeMap<String, (f64, f64)> {
    let mut verbs: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("gpushare_extender_request_duration_seconds_") else {
            continue;
        };
        let Some((kind, rest)) = rest.split_once("{verb=\"") else {
            continue;
        };
        let Some((verb, value)) = rest.split_once("\"} ") else {
            continue;
        };
        let Some(value) = value.split_whitespace().next().and_then(|v| v.parse().ok()) else {
            continue;
        };
        let entry = verbs.entry(verb.to_owned()).or_default();
        match kind {
            "sum" => entry.0 = value,
            "count" => entry.1 = value,
            _ => {}
        }
    }
    verbs
}

/// `filter 0.912 ms, prioritize …`: mean handler time per verb between two scrapes.
fn describe_handler_time(
    before: &BTreeMap<String, (f64, f64)>,
    after: &BTreeMap<String, (f64, f64)>,
) -> String {
    let parts: Vec<String> = ["filter", "prioritize", "bind"]
        .iter()
        .filter_map(|verb| {
            let (sum, count) = after.get(*verb)?;
            let (sum0, count0) = before.get(*verb).copied().unwrap_or_default();
            let calls = count - count0;
            (calls > 0.0).then(|| format!("{verb} {:.3} ms", (sum - sum0) / calls * 1e3))
        })
        .collect();
    if parts.is_empty() {
        "unavailable".to_owned()
    } else {
        format!("mean {}", parts.join(", "))
    }
}

/// `bound=1998 unfit=2`: the change of each reason between two scrapes.
fn describe_outcomes(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> String {
    let parts: Vec<String> = after
        .iter()
        .filter_map(|(reason, n)| {
            let delta = n.saturating_sub(before.get(reason).copied().unwrap_or(0));
            (delta > 0).then(|| format!("{reason}={delta}"))
        })
        .collect();
    if parts.is_empty() {
        "none".to_owned()
    } else {
        parts.join(" ")
    }
}

/// A client for the extender's verbs, counting what crosses the wire: over HTTPS it offers h2
/// by ALPN and multiplexes every call on one connection, as kube-scheduler's transport does;
/// over plain HTTP a keep-alive HTTP/1.1 pool.
struct Http {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    prefix: String,
    /// Calls made, request body bytes sent, answer body bytes received: what kube-scheduler
    /// encodes and decodes for the extender in its scheduling cycle.
    calls: AtomicU64,
    sent: AtomicU64,
    received: AtomicU64,
    /// The same three, by verb.
    by_verb: Mutex<BTreeMap<String, [u64; 3]>>,
}

impl Http {
    fn new(prefix: String, tls: Option<&ExtenderTls>) -> anyhow::Result<Self> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.enforce_http(false);
        let connector = match tls {
            Some(tls) => HttpsConnectorBuilder::new()
                .with_tls_config((*tls.client_config()).clone())
                .https_or_http()
                .with_server_name_resolver(FixedServerNameResolver::new(
                    rustls::pki_types::ServerName::try_from(EXTENDER_SERVICE_HOST)?,
                ))
                .enable_all_versions()
                .wrap_connector(connector),
            // Plain `http://` URLs never use the TLS settings: trust nothing.
            None => HttpsConnectorBuilder::new()
                .with_tls_config(
                    rustls::ClientConfig::builder_with_provider(Arc::new(
                        rustls::crypto::ring::default_provider(),
                    ))
                    .with_safe_default_protocol_versions()?
                    .with_root_certificates(rustls::RootCertStore::empty())
                    .with_no_client_auth(),
                )
                .https_or_http()
                .enable_http1()
                .wrap_connector(connector),
        };
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .build(connector);
        Ok(Self {
            client,
            prefix,
            calls: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            received: AtomicU64::new(0),
            by_verb: Mutex::new(BTreeMap::new()),
        })
    }

    /// `filter 1.00 calls 7.9 KB in 6.1 KB out, …`: per verb, calls per scheduled pod and
    /// the mean request and answer body per call.
    fn describe_by_verb(&self, bound: u64) -> String {
        let by_verb = self
            .by_verb
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let parts: Vec<String> = by_verb
            .iter()
            .filter(|(_, [calls, _, _])| *calls > 0)
            .map(|(verb, [calls, sent, received])| {
                format!(
                    "{verb} {} calls {:.1} KB in {:.1} KB out",
                    ratio(*calls, bound),
                    *sent as f64 / *calls as f64 / 1e3,
                    *received as f64 / *calls as f64 / 1e3
                )
            })
            .collect();
        parts.join(", ")
    }

    fn count(&self, verb: &str, slot: usize, n: u64) {
        let mut by_verb = self
            .by_verb
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        by_verb.entry(verb.to_owned()).or_default()[slot] += n;
    }

    /// (calls, bytes sent, bytes received) so far.
    fn traffic(&self) -> (u64, u64, u64) {
        (
            self.calls.load(Ordering::Relaxed),
            self.sent.load(Ordering::Relaxed),
            self.received.load(Ordering::Relaxed),
        )
    }

    /// `POST {prefix}/{verb}` with a JSON body; the round-trip time and the answer body.
    async fn post(&self, verb: &str, body: Vec<u8>) -> anyhow::Result<(Duration, Bytes)> {
        let url = format!("{}/{verb}", self.prefix);
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.sent.fetch_add(body.len() as u64, Ordering::Relaxed);
        self.count(verb, 0, 1);
        self.count(verb, 1, body.len() as u64);
        let request = http::Request::post(&url)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))?;
        let started = Instant::now();
        let exchange = async {
            let response = self.client.request(request).await?;
            let status = response.status();
            let body = response.into_body().collect().await?.to_bytes();
            anyhow::Ok((status, body))
        };
        let (status, answer) = tokio::time::timeout(CALL_TIMEOUT, exchange)
            .await
            .map_err(|_| anyhow!("POST {url}: no answer within {CALL_TIMEOUT:?}"))?
            .with_context(|| format!("POST {url}"))?;
        let took = started.elapsed();
        self.received
            .fetch_add(answer.len() as u64, Ordering::Relaxed);
        self.count(verb, 2, answer.len() as u64);
        if status != http::StatusCode::OK {
            bail!(
                "POST {url} answered {status}: {}",
                String::from_utf8_lossy(&answer)
            );
        }
        Ok((took, answer))
    }
}

/// The drive: pending pods handed out one at a time to `concurrency` workers; a pod whose
/// bind was refused goes to the back of the queue, as kube-scheduler requeues it.
struct Drive {
    http: Http,
    pods: Vec<Pod>,
    names: Vec<String>,
    filter_nodes: usize,
    /// Pod index and attempts so far.
    queue: Mutex<VecDeque<(usize, u32)>>,
    /// Scheduling cycles started, for rotating the filter window.
    cycles: AtomicUsize,
    /// Whether the extender scores the passing nodes (else: most GPU memory requested wins).
    prioritize: bool,
    /// GiB of the resource requested on each node by the pods bound so far.
    requested: Mutex<HashMap<String, u64>>,
}

/// What one worker saw.
#[derive(Default)]
struct Tally {
    filter: Latencies,
    prioritize: Latencies,
    bind: Latencies,
    bound: u64,
    /// Cycles in which no node passed filter.
    unfit: u64,
    /// Pods given up on (out of attempts, or a call failed).
    unscheduled: u64,
    refusals: Vec<String>,
    errors: Vec<String>,
}

impl Tally {
    fn merge(&mut self, other: Tally) {
        self.filter.extend(other.filter);
        self.prioritize.extend(other.prioritize);
        self.bind.extend(other.bind);
        self.bound += other.bound;
        self.unfit += other.unfit;
        self.unscheduled += other.unscheduled;
        self.refusals.extend(other.refusals);
        self.errors.extend(other.errors);
    }
}

impl Drive {
    fn new(http: Http, pods: Vec<Pod>, names: Vec<String>, filter_nodes: usize) -> Self {
        let queue = (0..pods.len()).map(|i| (i, 0)).collect();
        Self {
            http,
            pods,
            names,
            filter_nodes,
            queue: Mutex::new(queue),
            cycles: AtomicUsize::new(0),
            prioritize: true,
            requested: Mutex::new(HashMap::new()),
        }
    }

    fn requested(&self) -> std::sync::MutexGuard<'_, HashMap<String, u64>> {
        self.requested
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `NodeResourcesFit` `MostAllocated` on the GPU-memory resource alone, where every node
    /// has the same capacity: the passing node with the most GiB requested; ties to the first.
    fn most_allocated<'a>(&self, passed: &'a [String]) -> &'a str {
        let requested = self.requested();
        let mut best: Option<(&str, u64)> = None;
        for host in passed {
            let gib = requested.get(host).copied().unwrap_or(0);
            if best.is_none_or(|(_, top)| gib > top) {
                best = Some((host, gib));
            }
        }
        best.map_or("", |(host, _)| host)
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, VecDeque<(usize, u32)>> {
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The node names of scheduling cycle `cycle`.
    fn candidates(&self, cycle: usize) -> Vec<String> {
        let n = self.names.len();
        if self.filter_nodes == 0 || self.filter_nodes >= n {
            return self.names.clone();
        }
        let start = cycle.wrapping_mul(self.filter_nodes) % n;
        self.names
            .iter()
            .cycle()
            .skip(start)
            .take(self.filter_nodes)
            .cloned()
            .collect()
    }

    async fn worker(self: Arc<Self>) -> Tally {
        let mut tally = Tally::default();
        loop {
            let next = self.queue().pop_front();
            let Some((index, attempts)) = next else { break };
            let Some(pod) = self.pods.get(index) else {
                break;
            };
            let cycle = self.cycles.fetch_add(1, Ordering::Relaxed);
            match self.schedule(cycle, pod, &mut tally).await {
                Ok(true) => {}
                Ok(false) if attempts + 1 < MAX_ATTEMPTS => {
                    self.queue().push_back((index, attempts + 1))
                }
                Ok(false) => tally.unscheduled += 1,
                Err(err) => {
                    tally.unscheduled += 1;
                    tally.errors.push(format!("{err:#}"));
                }
            }
        }
        tally
    }

    /// One scheduling cycle, as kube-scheduler runs it with our extender configured; whether
    /// the pod was bound.
    async fn schedule(&self, cycle: usize, pod: &Pod, tally: &mut Tally) -> anyhow::Result<bool> {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let args = ExtenderArgs {
            pod: pod.clone(),
            nodes: None,
            node_names: Some(self.candidates(cycle)),
        };
        let (took, answer) = self.http.post("filter", serde_json::to_vec(&args)?).await?;
        tally.filter.push(took);
        let filtered = wire::decode_filter_result(&answer)?;
        if !filtered.error.is_empty() {
            bail!("filter of pod {name}: {}", filtered.error);
        }
        let passed = filtered.node_names.unwrap_or_default();
        let Some(first) = passed.first() else {
            tally.unfit += 1;
            return Ok(false);
        };
        // kube-scheduler asks for scores only when there is a choice to make.
        let node = if passed.len() > 1 && !self.prioritize {
            self.most_allocated(&passed).to_owned()
        } else if passed.len() > 1 {
            let args = ExtenderArgs {
                pod: pod.clone(),
                nodes: None,
                node_names: Some(passed.clone()),
            };
            let (took, answer) = self
                .http
                .post("prioritize", serde_json::to_vec(&args)?)
                .await?;
            tally.prioritize.push(took);
            let scores = wire::decode_host_priorities(&answer)?;
            best_node(&passed, &scores).to_owned()
        } else {
            first.clone()
        };
        let args = ExtenderBindingArgs {
            pod_name: name,
            pod_namespace: pod
                .metadata
                .namespace
                .clone()
                .unwrap_or_else(|| NAMESPACE.to_owned()),
            pod_uid: pod.metadata.uid.clone().unwrap_or_default(),
            node,
        };
        let node = args.node.clone();
        let (took, answer) = self.http.post("bind", serde_json::to_vec(&args)?).await?;
        tally.bind.push(took);
        let result = wire::decode_binding_result(&answer)?;
        if result.error.is_empty() {
            let gib = gpushare_contract::pod_request(pod, gpushare_contract::DEFAULT_RESOURCE)
                .ok()
                .flatten()
                .map_or(0, |request| request.pod_gib);
            *self.requested().entry(node).or_default() += gib;
            tally.bound += 1;
            Ok(true)
        } else {
            tally.refusals.push(result.error);
            Ok(false)
        }
    }
}

/// The highest-scored of `passed`; ties go to the node sent first. Unscored nodes score 0.
fn best_node<'a>(passed: &'a [String], scores: &[wire::HostPriority]) -> &'a str {
    let by_host: HashMap<&str, i64> = scores.iter().map(|h| (h.host.as_str(), h.score)).collect();
    let mut best: Option<(&str, i64)> = None;
    for host in passed {
        let score = by_host.get(host.as_str()).copied().unwrap_or(0);
        if best.is_none_or(|(_, top)| score > top) {
            best = Some((host, score));
        }
    }
    best.map_or("", |(host, _)| host)
}

#[cfg(test)]
mod tests {
    use super::*;

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
            prioritize: true,
            filter_keep_best: 0,
            plain_http: false,
            extender_worker_threads: 1,
        }
    }

    #[test]
    fn best_node_prefers_score_then_order() {
        let passed = vec!["a".to_owned(), "b".to_owned(), "c".to_owned()];
        let host = |h: &str, score| wire::HostPriority {
            host: h.to_owned(),
            score,
        };
        assert_eq!(
            best_node(&passed, &[host("a", 3), host("b", 7), host("c", 7)]),
            "b"
        );
        assert_eq!(best_node(&passed, &[]), "a");
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

    #[test]
    fn candidate_windows_rotate() {
        let names: Vec<String> = (0..5).map(node_name).collect();
        let http = || Http::new("http://127.0.0.1:1".to_owned(), None).unwrap();
        let drive = Drive::new(http(), Vec::new(), names.clone(), 2);
        assert_eq!(drive.candidates(2), [node_name(4), node_name(0)]);
        assert_eq!(
            Drive::new(http(), Vec::new(), names, 0).candidates(7).len(),
            5
        );
    }

    #[test]
    fn without_prioritize_the_most_requested_node_wins() {
        let names: Vec<String> = (0..3).map(node_name).collect();
        let drive = Drive::new(
            Http::new("http://127.0.0.1:1".to_owned(), None).unwrap(),
            Vec::new(),
            names.clone(),
            0,
        );
        assert_eq!(
            drive.most_allocated(&names),
            node_name(0),
            "ties: first sent"
        );
        drive.requested().insert(node_name(1), 3);
        drive.requested().insert(node_name(2), 5);
        assert_eq!(drive.most_allocated(&names), node_name(2));
        assert_eq!(drive.most_allocated(&names[..2]), node_name(1));
    }

    #[test]
    fn handler_time_from_the_extenders_own_metrics() {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = gpushare_extender::metrics::Metrics::register(&mut registry);
        let mut encoded = String::new();
        prometheus_client::encoding::text::encode(&mut encoded, &registry).unwrap();
        let before = parse_handler_seconds(&encoded);
        metrics.observe("filter", Instant::now() - Duration::from_millis(3));
        metrics.observe("filter", Instant::now() - Duration::from_millis(1));
        let mut encoded = String::new();
        prometheus_client::encoding::text::encode(&mut encoded, &registry).unwrap();
        let after = parse_handler_seconds(&encoded);
        assert_eq!(after["filter"].1, 2.0, "{encoded}");
        let text = describe_handler_time(&before, &after);
        let mean: f64 = text
            .strip_prefix("mean filter ")
            .and_then(|t| t.strip_suffix(" ms"))
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("{text}"));
        // At least the 3 ms and 1 ms the two calls were started before.
        assert!((2.0..1000.0).contains(&mean), "{text}");
        assert_eq!(describe_handler_time(&after, &after), "unavailable");
    }

    #[test]
    fn outcome_deltas() {
        let before = BTreeMap::from([("bound".to_owned(), 1), ("unfit".to_owned(), 2)]);
        let after = BTreeMap::from([("bound".to_owned(), 11), ("unfit".to_owned(), 2)]);
        assert_eq!(describe_outcomes(&before, &after), "bound=10");
        assert_eq!(describe_outcomes(&after, &after), "none");
    }
}
