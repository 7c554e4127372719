//! Load harness: gpushare's REAL binaries, driven at cluster scale on the in-process control
//! plane of this crate, and a report of what they cost.
//!
//! ```sh
//! cargo run --release -p gpushare-e2e --bin load
//! cargo run --release -p gpushare-e2e --bin load -- --nodes 1000 --bound-pods 10000 --skip-allocate
//! ```
//!
//! Two phases, each on its own API server:
//! 1. **extender** — thousands of nodes and bound pods, the extender started on them (time to
//!    list and rebuild), then pending pods driven through filter → prioritize → bind exactly
//!    as kube-scheduler calls an extender: per-verb latency, binds/s, API writes per bind, RSS.
//! 2. **device plugin** — the plugin on simulated GPUs, a node full of pods waiting for their
//!    allocation, and kubelet's `Allocate` calls one at a time: latency, API calls per Allocate.
//!
//! The binaries are built (if needed) with the same profile as this harness, so a `--release`
//! run measures release binaries. Their logs go to `--log-dir` (default: a temp dir removed at
//! exit, kept and named when a phase fails); `GPUSHARE_E2E_LOG` sets their `RUST_LOG`.

mod allocate;
mod extender;
mod extender_drive;
mod extender_http;
mod extender_metrics;
mod report;

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use gpushare_e2e::scheduler::framework::num_feasible_nodes_to_find_at;
use tracing_subscriber::EnvFilter;

use report::{figure, section};

/// Drives gpushare's real extender and device plugin at scale and prints what they cost.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Nodes labelled gpushare=true (extender phase).
    #[arg(long, env = "LOAD_NODES", default_value_t = 5000)]
    nodes: usize,
    /// GPUs per node.
    #[arg(long, env = "LOAD_GPUS", default_value_t = 8)]
    gpus: u32,
    /// GiB per GPU.
    #[arg(long, env = "LOAD_GPU_GIB", default_value_t = 32)]
    gpu_gib: u64,
    /// Pods already bound (1–2 GiB, with allocation annotations) before the extender starts.
    #[arg(long, env = "LOAD_BOUND_PODS", default_value_t = 50_000)]
    bound_pods: usize,
    /// Pending pods (1–4 GiB) driven through filter → prioritize → bind.
    #[arg(long, env = "LOAD_PODS", default_value_t = 2000)]
    pods: usize,
    /// Node names per filter call; 0 sends every node (worst case).
    #[arg(long, env = "LOAD_FILTER_NODES", default_value_t = 0)]
    filter_nodes: usize,
    /// Node names per filter call as kube-scheduler picks them under this
    /// `percentageOfNodesToScore` (0: its adaptive default, 420 of 1,000 nodes; 1: the chart's
    /// dedicated profile, 100 nodes): replaces `--filter-nodes`.
    #[arg(long, env = "LOAD_PERCENTAGE_OF_NODES_TO_SCORE", conflicts_with = "filter_nodes", value_parser = clap::value_parser!(u32).range(0..=100))]
    percentage_of_nodes_to_score: Option<u32>,
    /// Pods in flight at once during the drive.
    #[arg(long, env = "LOAD_CONCURRENCY", default_value_t = 16)]
    concurrency: usize,
    /// API creates in flight at once during set-up.
    #[arg(long, env = "LOAD_SETUP_CONCURRENCY", default_value_t = 32)]
    setup_concurrency: usize,
    /// Pods allocated by the device plugin, one Allocate each (device plugin phase).
    #[arg(long, env = "LOAD_ALLOCATE_PODS", default_value_t = 1000)]
    allocate_pods: usize,
    /// GiB of each of the plugin's 8 simulated GPUs (one device per GiB); raised when the
    /// Allocate pods would not fit.
    #[arg(long, env = "LOAD_ALLOCATE_GPU_GIB", default_value_t = 1024)]
    allocate_gpu_gib: u64,
    /// Drive without the prioritize verb, as a scheduler profile that scores GPU memory itself
    /// (`NodeResourcesFit` `MostAllocated`) would: filter → bind only.
    #[arg(long, env = "LOAD_NO_PRIORITIZE", default_value_t = false)]
    no_prioritize: bool,
    /// The extender's `--filter-keep-best` (0: filter passes every fitting node). With 1, one
    /// node passes and the drive binds it without prioritize, as kube-scheduler does.
    #[arg(long, env = "LOAD_FILTER_KEEP_BEST", default_value_t = 0)]
    filter_keep_best: usize,
    /// Call the extender over plain HTTP/1.1. By default it serves HTTPS, as the chart runs
    /// it, and the harness speaks HTTP/2 to it over one connection, as kube-scheduler's
    /// transport negotiates with it.
    #[arg(long, env = "LOAD_PLAIN_HTTP", default_value_t = false)]
    plain_http: bool,
    /// The extender's `--worker-threads`. 1 by default: the chart limits the extender to one
    /// CPU, and its runtime starts one worker per CPU it may use. 0: one per core here.
    #[arg(long, env = "LOAD_EXTENDER_WORKER_THREADS", default_value_t = 1)]
    extender_worker_threads: usize,
    /// Skip the extender phase.
    #[arg(long, env = "LOAD_SKIP_EXTENDER", default_value_t = false)]
    skip_extender: bool,
    /// Skip the device plugin phase.
    #[arg(long, env = "LOAD_SKIP_ALLOCATE", default_value_t = false)]
    skip_allocate: bool,
    /// Where the binaries' logs and kubeconfigs go, kept after the run; default: a temp dir.
    #[arg(long, env = "LOAD_LOG_DIR")]
    log_dir: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Our own diagnostics only; the report is on stdout.
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let extender_cfg = extender::Config {
        nodes: args.nodes,
        gpus: args.gpus,
        gpu_gib: args.gpu_gib,
        bound_pods: args.bound_pods,
        pods: args.pods,
        filter_nodes: match args.percentage_of_nodes_to_score {
            Some(percentage) => num_feasible_nodes_to_find_at(args.nodes, percentage),
            None => args.filter_nodes,
        },
        concurrency: args.concurrency,
        setup_concurrency: args.setup_concurrency,
        prioritize: !args.no_prioritize,
        filter_keep_best: args.filter_keep_best,
        plain_http: args.plain_http,
        extender_worker_threads: args.extender_worker_threads,
    };
    let allocate_cfg = allocate::Config {
        pods: args.allocate_pods,
        gpu_gib: args.allocate_gpu_gib,
        setup_concurrency: args.setup_concurrency.max(1),
    };
    if !args.skip_extender {
        extender_cfg.validate()?;
    }

    let (log_dir, temp) = match &args.log_dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            (dir.clone(), None)
        }
        None => {
            let temp = tempfile::Builder::new()
                .prefix("gpushare-load-")
                .tempdir()?;
            (temp.path().to_owned(), Some(temp))
        }
    };

    print_configuration(&args, &extender_cfg);
    if args.skip_extender && args.skip_allocate {
        println!();
        return Ok(());
    }
    let bins = tokio::task::spawn_blocking(gpushare_e2e::cluster::binaries)
        .await
        .context("building the binaries")??;

    let result = async {
        if !args.skip_extender {
            extender::run(&extender_cfg, &bins, &log_dir).await?;
        }
        if !args.skip_allocate {
            allocate::run(&allocate_cfg, &bins, &log_dir).await?;
        }
        anyhow::Ok(())
    }
    .await;
    if let Err(err) = result {
        // Keep the logs of a failed run for whoever reads the error.
        let kept = temp.map_or(log_dir, tempfile::TempDir::keep);
        return Err(err.context(format!("load run failed; logs in {}", kept.display())));
    }
    println!();
    Ok(())
}

fn print_configuration(args: &Args, extender_cfg: &extender::Config) {
    println!("gpushare load harness");
    section("configuration");
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    figure("build profile (harness and binaries)", profile);
    figure(
        "machine cores",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    if args.skip_extender {
        figure("extender phase", "skipped");
    } else {
        figure(
            "nodes",
            format!(
                "{} (gpushare=true, {} GPUs × {} GiB)",
                args.nodes, args.gpus, args.gpu_gib
            ),
        );
        figure(
            "bound pods (1–2 GiB, allocation annotations)",
            args.bound_pods,
        );
        figure("pending pods (1–4 GiB)", args.pods);
        figure("pods in flight", args.concurrency);
        figure("filter NodeNames", extender_cfg.filter_description());
        figure("extender --filter-keep-best", args.filter_keep_best);
        figure("extender --worker-threads", args.extender_worker_threads);
        figure(
            "scheduler → extender transport",
            if args.plain_http {
                "plain HTTP/1.1, a keep-alive pool (--plain-http)"
            } else {
                "HTTPS as the chart serves it, HTTP/2 on one connection (as kube-scheduler negotiates)"
            },
        );
        figure(
            "verbs per scheduling cycle",
            if extender_cfg.prioritize {
                "filter, prioritize (when 2+ nodes pass), bind"
            } else {
                "filter, bind (node: most GPU memory requested, as MostAllocated)"
            },
        );
    }
    if args.skip_allocate {
        figure("device plugin phase", "skipped");
    } else {
        figure("Allocate pods (1–8 GiB, twin rule)", args.allocate_pods);
    }
    figure("set-up creates in flight", args.setup_concurrency);
    match &args.log_dir {
        Some(dir) => figure("binaries' logs", dir.display()),
        None => figure("binaries' logs", "temp dir (removed at exit)"),
    }
}
