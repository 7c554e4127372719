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
    #[command(flatten)]
    extender: extender::Config,
    /// Node names per filter call as kube-scheduler picks them under this
    /// `percentageOfNodesToScore` (0: its adaptive default, 420 of 1,000 nodes; 1: the chart's
    /// dedicated profile, 100 nodes): replaces `--filter-nodes`.
    #[arg(long, env = "LOAD_PERCENTAGE_OF_NODES_TO_SCORE", conflicts_with = "filter_nodes", value_parser = clap::value_parser!(u32).range(0..=100))]
    percentage_of_nodes_to_score: Option<u32>,
    /// Pods allocated by the device plugin, one Allocate each (device plugin phase).
    #[arg(long, env = "LOAD_ALLOCATE_PODS", default_value_t = 1000)]
    allocate_pods: usize,
    /// GiB of each of the plugin's 8 simulated GPUs (one device per GiB); raised when the
    /// Allocate pods would not fit.
    #[arg(long, env = "LOAD_ALLOCATE_GPU_GIB", default_value_t = 1024)]
    allocate_gpu_gib: u64,
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
    let mut extender_cfg = args.extender.clone();
    if let Some(percentage) = args.percentage_of_nodes_to_score {
        extender_cfg.filter_nodes = num_feasible_nodes_to_find_at(extender_cfg.nodes, percentage);
    }
    let allocate_cfg = allocate::Config {
        pods: args.allocate_pods,
        gpu_gib: args.allocate_gpu_gib,
        setup_concurrency: extender_cfg.setup_concurrency.max(1),
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

fn print_configuration(args: &Args, cfg: &extender::Config) {
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
                cfg.nodes, cfg.gpus, cfg.gpu_gib
            ),
        );
        figure(
            "bound pods (1–2 GiB, allocation annotations)",
            cfg.bound_pods,
        );
        figure("pending pods (1–4 GiB)", cfg.pods);
        figure("pods in flight", cfg.concurrency);
        figure("filter NodeNames", cfg.filter_description());
        figure("extender --filter-keep-best", cfg.filter_keep_best);
        figure("extender --worker-threads", cfg.extender_worker_threads);
        figure(
            "scheduler → extender transport",
            if cfg.plain_http {
                "plain HTTP/1.1, a keep-alive pool (--plain-http)"
            } else {
                "HTTPS as the chart serves it, HTTP/2 on one connection (as kube-scheduler negotiates)"
            },
        );
        figure(
            "verbs per scheduling cycle",
            if cfg.no_prioritize {
                "filter, bind (node: most GPU memory requested, as MostAllocated)"
            } else {
                "filter, prioritize (when 2+ nodes pass), bind"
            },
        );
    }
    if args.skip_allocate {
        figure("device plugin phase", "skipped");
    } else {
        figure("Allocate pods (1–8 GiB, twin rule)", args.allocate_pods);
    }
    figure("set-up creates in flight", cfg.setup_concurrency);
    match &args.log_dir {
        Some(dir) => figure("binaries' logs", dir.display()),
        None => figure("binaries' logs", "temp dir (removed at exit)"),
    }
}
