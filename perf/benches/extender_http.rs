//! Criterion benchmarks of the extender's filter and prioritize handlers as kube-scheduler
//! calls them: a real request body (the captured v1.36 pod, `NodeNames` form) through the axum
//! router, JSON parse to JSON answer, on a synced view of N nodes × 8 GPUs × 32 GiB with 10
//! pods per GPU. No network: this is the extender's own cost per call.
//!
//! Criterion reports means; the targets are tails, so after the criterion groups a second
//! pass times 2,000 single calls of each verb at 5,000 nodes and prints p50 / p99 / max,
//! once with the caches warm (calls back to back) and once cold (64 MiB, twice this machine's
//! L3, written between calls, as when other work runs between scheduling cycles). Prioritize
//! is timed under `binpack` and under `fragmentation` (every node with its CPU and memory
//! booked, a full workload of 8 learned shapes), and under `fragmentation` again with eight
//! different free amounts on every node's GPUs, its worst case.
//!
//! ```sh
//! cargo bench -p gpushare-perf --bench extender_http
//! ```

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, to_bytes};
use axum::http::Request;
use criterion::{BenchmarkId, Criterion, criterion_group};
use futures::future::BoxFuture;
use gpushare_allocator::Policy;
use gpushare_allocator::fragmentation::Host;
use gpushare_contract::{DEFAULT_DOMAIN, DEFAULT_RESOURCE};
use gpushare_extender::{
    BindError, BindTiming, Binder, BindingTarget, EventSink, PodOnServer, Scheduling, Settings,
    router,
};
use gpushare_perf::filled::{
    Fill, GPU_GIB, GPUS_PER_NODE, filled_pods, learn_full_workload, node_names,
};
use gpushare_testkit::fixtures::node;
use prometheus_client::registry::Registry;
use tower::ServiceExt;

const PREFIX: &str = "/gpushare-scheduler";
/// The pod kube-scheduler v1.36 sent (captured), asking for 4 GiB.
const CAPTURED: &str = include_str!("../../extender/tests/fixtures/filter-request-nodenames.json");

/// Filter and prioritize never bind.
struct NoBinder;

impl Binder for NoBinder {
    fn bind(&self, _target: BindingTarget) -> BoxFuture<'_, Result<(), BindError>> {
        Box::pin(async { Ok(()) })
    }

    fn read_pod<'a>(
        &'a self,
        _namespace: &'a str,
        _name: &'a str,
    ) -> BoxFuture<'a, Result<Option<PodOnServer>, BindError>> {
        Box::pin(async { Ok(None) })
    }
}

/// The extender's state under `policy`, its view synced with `nodes` nodes filled as `fill`
/// says, every pod and node with its CPU and memory, and a full workload of learned shapes.
fn state(nodes: usize, policy: Policy, fill: Fill) -> (Scheduling, Vec<String>) {
    let (events, _rx) = EventSink::channel();
    let settings = Settings::new(DEFAULT_RESOURCE, DEFAULT_DOMAIN, "gpushare=true");
    let state = Scheduling::new(
        settings,
        gpushare_extender::Ranking::by(policy),
        Arc::new(NoBinder),
        BindTiming::default(),
        events,
        Registry::default(),
    );
    let names = node_names(nodes);
    let sizes = [GPU_GIB; GPUS_PER_NODE as usize];
    let objects: Vec<_> = names
        .iter()
        .map(|name| node(name).gpushare().gpus(&sizes).build())
        .collect();
    {
        let mut view = state.view_mut();
        view.replace_nodes(&objects);
        view.replace_pods(&[]);
        let cluster = &mut view.cluster;
        for (uid, name, placement) in filled_pods(&names, fill) {
            cluster.upsert_pod(uid.clone(), &name, placement);
            cluster.set_pod_host(uid, &name, Host::new(1_000, 4_096));
        }
        for name in &names {
            cluster.set_node_host(name, Some(Host::new(128_000, 1 << 20)));
        }
        learn_full_workload(cluster);
    }
    (state, names)
}

fn body(names: &[String]) -> Vec<u8> {
    let mut args: serde_json::Value =
        serde_json::from_str(CAPTURED).expect("the captured request is JSON");
    args["NodeNames"] = serde_json::json!(names);
    serde_json::to_vec(&args).expect("serializable")
}

/// One call of `verb` through the router, JSON in to JSON out; the answer's length.
fn call(runtime: &tokio::runtime::Runtime, app: &axum::Router, verb: &str, body: &[u8]) -> usize {
    runtime.block_on(async {
        let request = Request::post(format!("{PREFIX}/{verb}"))
            .header("content-type", "application/json")
            .body(Body::from(body.to_vec()))
            .expect("a request");
        let response = app.clone().oneshot(request).await.expect("infallible");
        to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("a body")
            .len()
    })
}

fn app(state: Scheduling) -> axum::Router {
    router(state, PREFIX, gpushare_extender::DEFAULT_BODY_LIMIT)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime")
}

fn handlers(c: &mut Criterion) {
    let runtime = runtime();
    for (verb, policy) in [
        ("filter", Policy::Binpack),
        ("prioritize", Policy::Binpack),
        ("prioritize", Policy::Fragmentation),
    ] {
        let mut group = c.benchmark_group(format!("http {verb} {policy} (NodeNames)"));
        for nodes in [100, 1_000, 5_000] {
            let (state, names) = state(nodes, policy, Fill::Uniform);
            let app = app(state);
            let body = body(&names);
            group.bench_with_input(BenchmarkId::from_parameter(nodes), &body, |b, body| {
                b.iter(|| black_box(call(&runtime, &app, verb, body)))
            });
        }
        group.finish();
    }
}

/// The idle-GPU taint loop's scan of the view every 2 s (`View::idle_gpu_taint_drift`), under
/// the view's read lock: every GPU of every node, none idle here (the whole walk).
fn idle_gpu_taint_scan(c: &mut Criterion) {
    let mut group = c.benchmark_group("idle-GPU taint drift (8 GPUs per node)");
    for nodes in [1_000, 5_000] {
        let (state, _) = state(nodes, Policy::Fragmentation, Fill::Uniform);
        group.bench_function(BenchmarkId::from_parameter(nodes), |b| {
            b.iter(|| black_box(state.view().idle_gpu_taint_drift(true).len()))
        });
    }
    group.finish();
}

/// Exact p50 / p99 / max of single calls at 5,000 nodes (a handful of calls when run as a
/// test, i.e. without `--bench`).
fn tail_latency() {
    let calls = if std::env::args().any(|a| a == "--bench") {
        2_000
    } else {
        5
    };
    let runtime = runtime();
    let (binpack, names) = state(5_000, Policy::Binpack, Fill::Uniform);
    let binpack = app(binpack);
    let fragmentation = app(state(5_000, Policy::Fragmentation, Fill::Uniform).0);
    let varied = app(state(5_000, Policy::Fragmentation, Fill::Varied).0);
    // What kube-scheduler sends at 5,000 nodes: it stops filtering once it has found
    // `numFeasibleNodesToFind` nodes (adaptive `percentageOfNodesToScore`: 10 % here, 500
    // names), starting where the previous cycle stopped; each call names the next window.
    let subset = 500;
    let windows: Vec<Vec<u8>> = names.chunks(subset).map(body).collect();
    let body = body(&names);
    let rows = [
        ("filter", "binpack", &binpack),
        ("prioritize", "binpack", &binpack),
        ("prioritize", "fragmentation", &fragmentation),
        ("prioritize", "fragmentation, varied", &varied),
    ];
    let mut scribble = vec![0u8; 64 << 20];
    println!("single-call latency at 5,000 nodes, {calls} calls each (exact percentiles)");
    for cache in ["warm", "cold"] {
        for &(verb, policy, app) in &rows {
            let times = (0..calls).map(|i| {
                if cache == "cold" {
                    for byte in scribble.iter_mut().step_by(64) {
                        *byte = byte.wrapping_add(i as u8);
                    }
                    black_box(&scribble);
                }
                timed(|| call(&runtime, app, verb, &body))
            });
            print_percentiles(
                &format!("http {verb:<10} {policy:<21} {cache} cache"),
                times,
            );
        }
    }

    println!(
        "as kube-scheduler calls at 5,000 nodes: {subset} names per call (percentageOfNodesToScore), rotating, warm cache"
    );
    for &(verb, policy, app) in &rows {
        let times =
            (0..calls).map(|i| timed(|| call(&runtime, app, verb, &windows[i % windows.len()])));
        print_percentiles(
            &format!("http {verb:<10} {policy:<21} {subset} names"),
            times,
        );
    }
}

/// How long `f` took.
fn timed(f: impl FnOnce() -> usize) -> Duration {
    let started = Instant::now();
    black_box(f());
    started.elapsed()
}

fn print_percentiles(label: &str, times: impl Iterator<Item = Duration>) {
    let mut times: Vec<Duration> = times.collect();
    times.sort_unstable();
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    println!(
        "  {label}  p50 {:>9.3?}  p99 {:>9.3?}  max {:>9.3?}",
        at(0.50),
        at(0.99),
        at(1.0)
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = handlers, idle_gpu_taint_scan
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    tail_latency();
}
