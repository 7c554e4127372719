//! Memory instrument: how many bytes the extender's cluster view holds for N nodes and M
//! bound pods, and how high the heap peaks while a relist of them is buffered and swapped in.
//!
//! ```sh
//! cargo run --release -p gpushare-perf --bin view-memory
//! cargo run --release -p gpushare-perf --bin view-memory -- --nodes 500 --pods 5000 --profile
//! ```
//!
//! It runs the extender's own code path for a start-up list, in process and without the API
//! server: each pod is built as the load harness creates it, read into the compact facts the
//! pod watch buffers ([`PodFacts::read`]), and the buffer handed to
//! [`View::replace_pod_facts`]. The heap is counted by dhat's allocator, so the figures are
//! bytes asked of the allocator (live and peak), not RSS: the load harness reports the real
//! process's RSS, which adds the runtime, the HTTP stack and allocator slack.
//!
//! With `--profile`, dhat also writes `dhat-heap.json` (open it in dhat's viewer) naming the
//! code that holds the bytes.

use clap::Parser;
use gpushare_contract::{DEFAULT_DOMAIN, DEFAULT_RESOURCE, Keys};
use gpushare_extender::scheduling::view::PodFacts;
use gpushare_extender::{Settings, View};
use gpushare_testkit::workload::{gpushare_nodes, listed_bound_pod};

#[global_allocator]
static HEAP: dhat::Alloc = dhat::Alloc;

/// Measures the heap the extender's cluster view holds at cluster scale.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Nodes labelled gpushare=true.
    #[arg(long, default_value_t = 5000)]
    nodes: usize,
    /// GPUs per node.
    #[arg(long, default_value_t = 8)]
    gpus: u32,
    /// GiB per GPU.
    #[arg(long, default_value_t = 32)]
    gpu_gib: u64,
    /// Bound pods, 1–2 GiB each, with allocation annotations.
    #[arg(long, default_value_t = 50_000)]
    pods: usize,
    /// Also write dhat-heap.json with the allocation sites (slower).
    #[arg(long)]
    profile: bool,
}

fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _profiler = if args.profile {
        dhat::Profiler::new_heap()
    } else {
        dhat::Profiler::builder().testing().build()
    };
    let live = || dhat::HeapStats::get().curr_bytes;

    let settings = Settings::new(DEFAULT_RESOURCE, DEFAULT_DOMAIN, "gpushare=true");
    let mut view = View::new(settings.clone());
    let before = live();

    let nodes = gpushare_nodes(args.nodes, args.gpus, args.gpu_gib);
    view.replace_nodes(&nodes);
    drop(nodes);
    let with_nodes = live();

    let keys = Keys::default();
    let bind_time = "2026-01-01T00:00:00Z";
    let build = |i: usize| listed_bound_pod(i, args.nodes, args.gpus, &keys, bind_time);
    let buffer: Vec<PodFacts> = (0..args.pods)
        .filter_map(|i| PodFacts::read(&build(i), &settings).filter(|f| f.concerns_gpushare()))
        .collect();
    let buffered = live() - with_nodes;
    let warnings = view.replace_pod_facts(buffer);
    anyhow::ensure!(warnings.is_empty(), "unexpected warnings: {warnings:?}");
    anyhow::ensure!(
        view.cluster.pod_count() == args.pods,
        "the view booked {} of {} pods",
        view.cluster.pod_count(),
        args.pods
    );
    let with_pods = live();
    // Every pod's next watch event (as when the device plugin marks it): the view must not
    // end up holding a second copy of anything.
    for i in 0..args.pods {
        let warning = view.apply_pod(&build(i));
        anyhow::ensure!(warning.is_none(), "unexpected warning: {warning:?}");
    }
    let after_updates = live();
    let stats = dhat::HeapStats::get();

    let pods = args.pods.max(1);
    println!(
        "extender view: {} nodes × {} GPUs, {} bound pods",
        args.nodes, args.gpus, args.pods
    );
    // `{:>10} B` fills the same 12 columns as `{:>12}`.
    let bytes = |b: usize| format!("{b:>10} B");
    for (label, value) in [
        ("view with nodes only", mib(with_nodes - before)),
        ("relist buffer (pod facts), at its fullest", mib(buffered)),
        ("view with nodes and pods", mib(with_pods - before)),
        (
            "per pod in the view",
            bytes((with_pods - with_nodes) / pods),
        ),
        (
            "per pod after every pod's next watch event",
            bytes(after_updates.saturating_sub(with_nodes) / pods),
        ),
        ("per pod in the relist buffer", bytes(buffered / pods)),
        ("heap peak (whole run)", mib(stats.max_bytes)),
        ("live allocations now", stats.curr_blocks.to_string()),
    ] {
        println!("  {label:<44} {value:>12}");
    }
    drop(view);
    Ok(())
}
