//! Packing simulator: replays pod streams through the real allocation core and prints, per
//! strategy, how full the cluster was at the first pod that could not be placed.
//!
//! ```sh
//! cargo run --release -p gpushare-perf --bin packing-sim
//! cargo run --release -p gpushare-perf --bin packing-sim -- --nodes 200 --gpus 8 --departures 0.3
//! ```

use clap::Parser;
use gpushare_perf::{
    EXTENDER_WEIGHT, Event, Outcome, PodProfile, Shape, Strategy, TraceSpec, generate,
    offline_bound, replay,
};

/// Replays GPU-memory requests through gpushare's allocation core and compares strategies.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Nodes in the simulated cluster.
    #[arg(long, env = "SIM_NODES", default_value_t = 100)]
    nodes: usize,
    /// GPUs per node.
    #[arg(long, env = "SIM_GPUS", default_value_t = 8)]
    gpus: usize,
    /// GiB per GPU in the uniform cluster.
    #[arg(long, env = "SIM_GPU_GIB", default_value_t = 16)]
    gpu_gib: u64,
    /// GiB of the two GPU kinds in the mixed cluster.
    #[arg(
        long,
        env = "SIM_MIXED_GIB",
        value_delimiter = ',',
        default_value = "16,24"
    )]
    mixed_gib: Vec<u64>,
    /// Request sizes and weights, `GIB:WEIGHT,…`.
    #[arg(
        long,
        env = "SIM_SIZES",
        default_value = "1:20,2:25,4:25,8:15,12:8,16:7"
    )]
    sizes: String,
    /// Probability a running pod leaves before each arrival (the churn trace).
    #[arg(long, env = "SIM_DEPARTURES", default_value_t = 0.3)]
    departures: f64,
    /// Share of arrivals that are whole-GPU pods of 2 or 4 GPUs, in the third trace.
    #[arg(long, env = "SIM_MULTI_GPU", default_value_t = 0.01)]
    multi_gpu: f64,
    /// Seeds to average over.
    #[arg(long, env = "SIM_SEEDS", default_value_t = 5)]
    seeds: u64,
}

fn parse_sizes(text: &str) -> anyhow::Result<Vec<(u64, u32)>> {
    text.split(',')
        .map(|pair| {
            let (gib, weight) = pair
                .split_once(':')
                .ok_or_else(|| anyhow::anyhow!("size {pair:?} is not GIB:WEIGHT"))?;
            Ok((gib.trim().parse()?, weight.trim().parse()?))
        })
        .collect()
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let sizes = parse_sizes(&args.sizes)?;
    let [a, b] = args.mixed_gib[..] else {
        anyhow::bail!("--mixed-gib takes two sizes, e.g. 16,24");
    };
    let shapes = [
        (
            format!("uniform {}×{}×{} GiB", args.nodes, args.gpus, args.gpu_gib),
            Shape::uniform(args.nodes, args.gpus, args.gpu_gib),
        ),
        (
            format!("mixed {}×{}×({a}|{b}) GiB", args.nodes, args.gpus),
            Shape::mixed(args.nodes, args.gpus, a, b),
        ),
    ];
    println!(
        "sizes (GiB:weight) {}; {} seeds; numbers are means over seeds",
        args.sizes, args.seeds
    );
    println!("utilization = share of cluster GPU memory in use at the first pod that fit nowhere");
    println!(
        "nodes chosen as kube-scheduler does: default scores + extender score × {EXTENDER_WEIGHT} (chart weight) × 10, random tie-break"
    );
    println!(
        "(native MostAllocated: NodeResourcesFit MostAllocated on gpu-mem + BalancedAllocation, no extender score)\n"
    );
    for (label, shape) in &shapes {
        // Enough arrivals to fill the cluster several times over.
        let arrivals = (shape.total_gib() as usize).max(64);
        let multi_name = format!(
            "arrivals only, {:.0}% whole-GPU pods of 2-4 GPUs",
            args.multi_gpu * 100.0
        );
        for (trace_name, departures, multi_gpu) in [
            ("arrivals only", 0.0, 0.0),
            ("with departures", args.departures, 0.0),
            (multi_name.as_str(), 0.0, args.multi_gpu),
        ] {
            println!("{label}, {trace_name}:");
            println!(
                "    {:<64} {:>12} {:>12}",
                "strategy", "utilization", "pods placed"
            );
            let traces: Vec<Vec<Event>> = (0..args.seeds)
                .map(|seed| {
                    generate(&TraceSpec {
                        sizes: sizes.clone(),
                        arrivals,
                        departure_probability: departures,
                        seed,
                        multi_gpu_probability: multi_gpu,
                    })
                })
                .collect();
            for profile in [PodProfile::NoRequests, PodProfile::PROPORTIONAL] {
                println!("  {}", profile.name());
                for strategy in Strategy::ALL {
                    let outcomes: Vec<Outcome> = traces
                        .iter()
                        .zip(0..)
                        .map(|(trace, seed)| replay(shape, trace, strategy, profile, seed))
                        .collect();
                    print_row(strategy.name(), &outcomes);
                }
            }
            if departures == 0.0 {
                let outcomes: Vec<Outcome> =
                    traces.iter().map(|t| offline_bound(shape, t)).collect();
                print_row("offline bound (best-fit decreasing)", &outcomes);
            }
            println!();
        }
    }
    Ok(())
}

fn print_row(name: &str, outcomes: &[Outcome]) {
    let n = outcomes.len().max(1) as f64;
    let utilization = outcomes.iter().map(|o| o.utilization).sum::<f64>() / n;
    let placed = outcomes.iter().map(|o| o.placed as f64).sum::<f64>() / n;
    println!(
        "    {name:<64} {:>11.1}% {placed:>12.0}",
        utilization * 100.0
    );
}
