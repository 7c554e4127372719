//! Realistic packing simulator: every strategy replays the same generated clusters and task
//! streams (`gpushare_perf::realistic`, whose doc draws the replay), and the report gives, as
//! FGD (ATC'23) measures, the allocation ratio at 100 % arrived GPU demand and its climb to
//! 130 %. The flags (`--help`) change how gpushare pods ask, how many nodes kube-scheduler's
//! walk finds, the trace's own protocol and measure, and what-ifs on CPU and memory. The
//! preamble prints two ceilings at 100 %: without multi-GPU tasks, and from the GPUs alone
//! (`placement_ceiling`). docs/performance.md has the commands behind its figures, e.g.:
//!
//! ```sh
//! cargo run --release -p gpushare-perf --bin realistic-sim -- --nodes 1200 --seeds 10 \
//!     --percentage-of-nodes-to-score 1 --mix trace-multigpu50 --only 11,13
//! ```

use clap::Parser;
use gpushare_allocator::Policy;
use gpushare_allocator::fragmentation::Host;
use gpushare_perf::realistic::{
    Cause, Measure, NodesToScore, Profile, RequestForm, Run, SimNode, Snapshot, Strategy, Task,
    TaskKind, TaskMix, TraceMix, arrivals_until, as_the_trace_counts, generate_nodes,
    generate_tasks, placement_ceiling, replay_measured, trace_nodes, trace_tasks,
};
use gpushare_scheduler_model::{num_feasible_nodes_to_find, num_feasible_nodes_to_find_at};

/// Compares gpushare's policies with BestFit and FGD on generated realistic clusters.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Nodes in the generated cluster.
    #[arg(long, env = "SIM_NODES", default_value_t = 600)]
    nodes: usize,
    /// Seeds (cluster, tasks, arrival order and tie-breaks) to average over.
    #[arg(long, env = "SIM_SEEDS", default_value_t = 5)]
    seeds: u64,
    /// Arrived GPU demand to stop at, as a multiple of capacity.
    #[arg(long, env = "SIM_DEMAND", default_value_t = 1.3)]
    demand: f64,
    /// Only these strategies (by number in the report), comma-separated; all by default.
    #[arg(long, env = "SIM_ONLY", value_delimiter = ',')]
    only: Vec<usize>,
    /// gpushare pods ask for whole- and multi-GPU tasks with `exclusive` (empty GPUs, booked
    /// in full) instead of as `gpus: N` shared slices.
    #[arg(long, env = "SIM_EXCLUSIVE_WHOLE")]
    exclusive_whole: bool,
    /// gpushare pods pinned to GPU models name them in the request (gpushare's model
    /// annotation) instead of node affinity on the model label, which kube-scheduler's walk
    /// reads.
    #[arg(
        long,
        env = "SIM_MODELS_IN_REQUEST",
        conflicts_with = "exclusive_whole"
    )]
    models_in_request: bool,
    /// kube-scheduler filters and scores every node for gpushare's strategies
    /// (`percentageOfNodesToScore: 100`) instead of its default walk, which stops at
    /// `numFeasibleNodesToFind` feasible nodes.
    #[arg(long, env = "SIM_SCORE_ALL_NODES")]
    score_all_nodes: bool,
    /// kube-scheduler's `percentageOfNodesToScore` for gpushare's strategies (1-99; 0, the
    /// default, is its adaptive percentage). Its walk stops at that share of the nodes, never
    /// below 100 of them.
    #[arg(long, env = "SIM_PERCENTAGE_OF_NODES_TO_SCORE", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..100))]
    percentage_of_nodes_to_score: u32,
    /// The task mix: one of the public trace's four workloads on its own cluster (`trace-*`,
    /// the calibrated generator), or the earlier generator's default, about half the GPU
    /// demand in multi-GPU jobs, about a third of GPU tasks pinned to one or two GPU models,
    /// or fractional GPU tasks only.
    #[arg(long, env = "SIM_MIX", value_enum, default_value_t = Mix::TraceDefault)]
    mix: Mix,
    /// What-if: every node's CPU and memory multiplied by this (tasks unchanged), to read how
    /// much of what is not allocated is lost to CPU and memory rather than to GPU geometry.
    #[arg(
        long,
        env = "SIM_HOST_SCALE",
        default_value_t = 1,
        value_parser = clap::value_parser!(u64).range(1..=1000)
    )]
    host_scale: u64,
    /// The public trace's own protocol (`trace-*` mixes only): every GPU is one GPU whatever
    /// its model (100 units), a sharing task asks its share of one, a task of N whole GPUs all
    /// of N GPUs of any model, instead of the GiB of the model each was drawn for; demand and
    /// allocation are counted in GPUs, not GiB.
    #[arg(
        long,
        env = "SIM_TRACE_PROTOCOL",
        conflicts_with_all = ["exclusive_whole", "models_in_request"]
    )]
    trace_protocol: bool,
    /// Count demand and allocation in GPUs, as the public trace does (`trace-*` mixes only),
    /// the tasks as drawn: what `--trace-protocol` does to the measure alone.
    #[arg(long, env = "SIM_COUNT_GPUS")]
    count_gpus: bool,
}

/// The named task mixes: the trace-calibrated generator's four workloads (`TraceMix`), and the
/// earlier generator's mixes (`TaskMix`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Mix {
    TraceDefault,
    TraceGpushare100,
    TraceGpuspec33,
    TraceMultigpu50,
    Default,
    MultiGpuHeavy,
    ModelPinned,
    AllSharing,
}

impl Mix {
    /// The public trace's workload, for the `trace-*` mixes.
    fn trace(self) -> Option<TraceMix> {
        match self {
            Mix::TraceDefault => Some(TraceMix::Default),
            Mix::TraceGpushare100 => Some(TraceMix::Gpushare100),
            Mix::TraceGpuspec33 => Some(TraceMix::Gpuspec33),
            Mix::TraceMultigpu50 => Some(TraceMix::Multigpu50),
            _ => None,
        }
    }

    /// The cluster and the task stream of `seed`, to `demand` × its GPU memory.
    fn generate(self, nodes: usize, demand: f64, seed: u64) -> Trace {
        if let Some(mix) = self.trace() {
            let nodes = trace_nodes(nodes, seed);
            let tasks = trace_tasks(&nodes, mix, demand, seed);
            return (nodes, tasks);
        }
        let mix = match self {
            Mix::MultiGpuHeavy => TaskMix::multi_gpu_heavy(),
            Mix::ModelPinned => TaskMix::model_pinned(),
            Mix::AllSharing => TaskMix::all_sharing(),
            _ => TaskMix::default(),
        };
        let nodes = generate_nodes(nodes, seed);
        let tasks = generate_tasks(&nodes, &mix, demand, seed);
        (nodes, tasks)
    }
}

/// The strategies in report order: a row's number is its place here, from 1.
fn strategies() -> Vec<Strategy> {
    let chart = Profile::Default { weight: 1 };
    let binpack = |profile| Strategy::extender(Some(Policy::Binpack), profile);
    let fgd = |multi_gpu, cpu_pods_by_default| Strategy::Fgd {
        multi_gpu,
        cpu_pods_by_default,
    };
    // What else the profile could weigh, the filter keeping the best node: without
    // LeastAllocated (not a chart value), and with `scheduler.extender.weight: 3`.
    let weighted = |least, extender| {
        Strategy::fragmentation(Profile::Weighted {
            least,
            most: 0,
            balanced: 1,
            extender,
        })
    };
    vec![
        binpack(chart),
        binpack(Profile::ExtenderOnly),
        Strategy::extender(Some(Policy::Spread), chart),
        Strategy::extender(None, chart),
        Strategy::BestFit { multi_gpu: false },
        fgd(false, false),
        fgd(false, true),
        Strategy::fragmentation(Profile::ExtenderOnly),
        Strategy::fragmentation(chart),
        Strategy::fragmentation(Profile::Default { weight: 2 }),
        Strategy::fragmentation(Profile::FilterKeepBest),
        Strategy::BestFit { multi_gpu: true },
        fgd(true, false),
        binpack(Profile::NativeMostAllocated),
        Strategy::DraFirstFit,
        weighted(0, 1),
        weighted(1, 3),
        Strategy::Fragmentation {
            profile: Profile::FilterKeepBest,
            idle_gpu_taint: false,
        },
    ]
}

/// One generated cluster and its task stream.
type Trace = (Vec<SimNode>, Vec<Task>);

/// A strategy's number in the report (from 0), the strategy, and its replay of each trace.
type Replayed = (usize, Strategy, Vec<Run>);

fn main() {
    let args = Args::parse();
    let measure = args.measure();
    if measure == Measure::Gpus && args.mix.trace().is_none() {
        eprintln!("--trace-protocol and --count-gpus replay the trace-* mixes only");
        std::process::exit(2);
    }
    let form = args.request_form();
    let to_score = args.nodes_to_score();
    let traces: Vec<Trace> = (0..args.seeds).map(|seed| args.trace(seed)).collect();
    print_setup(&args, form, to_score, &traces);
    println!();
    // Each strategy replayed on every trace (its seed drives kube-scheduler's tie-break), the
    // time each took on stderr.
    let results: Vec<Replayed> = strategies()
        .into_iter()
        .enumerate()
        .filter(|(i, _)| args.only.is_empty() || args.only.contains(&(i + 1)))
        .map(|(i, strategy)| {
            let start = std::time::Instant::now();
            let runs: Vec<Run> = traces
                .iter()
                .zip(0..)
                .map(|((nodes, tasks), seed)| {
                    replay_measured(nodes, tasks, strategy, (form, measure), to_score, seed)
                })
                .collect();
            let took = start.elapsed().as_secs_f64();
            eprintln!("{}: {took:.1} s", strategy.name());
            (i, strategy, runs)
        })
        .collect();
    print_at_full(&results);
    println!();
    print_curves(&results);
}

impl Args {
    /// How gpushare pods ask for whole- and multi-GPU tasks.
    fn request_form(&self) -> RequestForm {
        if self.exclusive_whole {
            RequestForm::Exclusive
        } else if self.models_in_request {
            RequestForm::ModelsInRequest
        } else {
            RequestForm::Plain
        }
    }

    /// What demand and allocation are counted in.
    fn measure(&self) -> Measure {
        if self.trace_protocol || self.count_gpus {
            Measure::Gpus
        } else {
            Measure::Gib
        }
    }

    /// Which nodes kube-scheduler filters and scores for gpushare's strategies.
    fn nodes_to_score(&self) -> NodesToScore {
        if self.score_all_nodes {
            NodesToScore::All
        } else if self.percentage_of_nodes_to_score > 0 {
            NodesToScore::Percentage(self.percentage_of_nodes_to_score)
        } else {
            NodesToScore::Adaptive
        }
    }

    /// Seed `seed`'s cluster and tasks: the tasks drawn for the nodes as generated, then the
    /// nodes' CPU and memory scaled.
    fn trace(&self, seed: u64) -> Trace {
        let (mut nodes, tasks) = match self.measure() {
            Measure::Gib => self.mix.generate(self.nodes, self.demand, seed),
            Measure::Gpus => {
                // Drawn well past the demand in GiB, then cut where it reaches it in GPUs
                // (the stream is the same draw whatever its length).
                let (nodes, mut tasks) = self.mix.generate(self.nodes, self.demand * 2.0, seed);
                let mut nodes = nodes;
                if self.trace_protocol {
                    as_the_trace_counts(&mut nodes, &mut tasks);
                }
                tasks.truncate(arrivals_until(&nodes, &tasks, Measure::Gpus, self.demand));
                (nodes, tasks)
            }
        };
        for node in &mut nodes {
            let (cpu, memory) = (node.host.milli_cpu, node.host.memory_mib);
            node.host = Host::new(cpu * self.host_scale, memory * self.host_scale);
        }
        (nodes, tasks)
    }
}

/// The mean of `of` over `items`.
fn mean<T>(items: &[T], of: impl Fn(&T) -> f64) -> f64 {
    items.iter().map(of).sum::<f64>() / items.len() as f64
}

/// The report's preamble: the cluster and task stream of seed 0, how kube-scheduler looks at
/// the nodes, the task mix, and the ceilings.
fn print_setup(args: &Args, form: RequestForm, to_score: NodesToScore, traces: &[Trace]) {
    let (nodes, tasks) = &traces[0];
    let gpus: u32 = nodes.iter().map(|n| n.gpus).sum();
    println!(
        "mix {:?}: {} nodes ({} GPUs, seed 0), {} tasks to {:.0}% demand (seed 0); {} seeds, means over seeds; gpushare whole- and multi-GPU pods ask {}",
        args.mix,
        args.nodes,
        gpus,
        tasks.len(),
        args.demand * 100.0,
        args.seeds,
        match form {
            RequestForm::Plain => "`gpus: N`, shared",
            RequestForm::Exclusive => "`gpus: N`, `exclusive`",
            RequestForm::ModelsInRequest => {
                "`gpus: N`, shared; pinned tasks name their models in the request"
            }
        }
    );
    if args.host_scale > 1 {
        println!(
            "  what-if: every node's CPU and memory × {} (tasks drawn for the nodes as generated)",
            args.host_scale
        );
    }
    match to_score {
        NodesToScore::Adaptive => println!(
            "  kube-scheduler (gpushare rows): filters round robin until {} feasible nodes of {} (adaptive percentageOfNodesToScore), the extender filters and scores those",
            num_feasible_nodes_to_find(args.nodes),
            args.nodes
        ),
        NodesToScore::Percentage(p) => println!(
            "  kube-scheduler (gpushare rows): filters round robin until {} feasible nodes of {} (percentageOfNodesToScore {p}), the extender filters and scores those",
            num_feasible_nodes_to_find_at(args.nodes, p),
            args.nodes
        ),
        NodesToScore::All => println!(
            "  kube-scheduler (gpushare rows): every node filtered and scored (--score-all-nodes)"
        ),
    }
    if args.trace_protocol {
        println!(
            "  the trace's protocol: every GPU one GPU whatever its model (100 units), sharing tasks ask their share of one, whole-GPU tasks all of one GPU of any model; demand and allocation counted in GPUs; BestFit and FGD: idealized, every node looked at"
        );
    } else {
        if args.count_gpus {
            println!("  demand and allocation counted in GPUs (--count-gpus)");
        }
        println!("  BestFit and FGD: idealized, every node looked at");
    }
    let measure = args.measure();
    let all: u64 = tasks.iter().map(|t| measure.demand(t)).sum();
    for kind in TaskKind::ALL {
        let of: Vec<_> = tasks.iter().filter(|t| t.kind == kind).collect();
        let demand: u64 = of.iter().map(|t| measure.demand(t)).sum();
        println!(
            "  {:<15} {:>5.1}% of tasks, {:>5.1}% of GPU demand",
            kind.name(),
            of.len() as f64 * 100.0 / tasks.len() as f64,
            demand as f64 * 100.0 / all.max(1) as f64
        );
    }
    if measure == Measure::Gib {
        // What a strategy that refuses multi-GPU tasks and places every other one reaches.
        let without_multi_gpu = mean(traces, |(nodes, tasks)| {
            let arrived = &tasks[..arrivals_until(nodes, tasks, Measure::Gib, 1.0)];
            let single = arrived.iter().filter(|t| t.gpus <= 1).map(Task::demand_gib);
            single.sum::<u64>() as f64 / Measure::Gib.capacity(nodes) as f64
        });
        println!(
            "  ceiling at 100% demand without multi-GPU tasks: {:.1}% (every other task placed)",
            without_multi_gpu * 100.0
        );
    }
    print_placement_ceiling(traces, measure);
}

/// The ceiling the GPUs alone set at 100 % (`placement_ceiling`), each seed's: where the
/// tasks that fit only some GPU classes ask more than those hold, no placement allocates it
/// all.
fn print_placement_ceiling(traces: &[Trace], measure: Measure) {
    let ceilings: Vec<_> = traces
        .iter()
        .map(|(nodes, tasks)| placement_ceiling(nodes, tasks, measure))
        .collect();
    let lowest = ceilings
        .iter()
        .flatten()
        .min_by(|a, b| a.allocation_at_most.total_cmp(&b.allocation_at_most));
    let Some(lowest) = lowest else {
        println!(
            "  ceiling at 100% demand from the GPUs: none (no set of GPU classes is asked more than it holds)"
        );
        return;
    };
    let mean = mean(&ceilings, |c| {
        c.as_ref().map_or(1.0, |c| c.allocation_at_most)
    });
    let classes: Vec<String> = lowest
        .classes
        .iter()
        .map(|c| format!("{c} ({} GiB)", c.gpu_gib))
        .collect();
    println!(
        "  ceiling at 100% demand from the GPUs: {:.1}% (lowest seed {:.1}%: tasks that fit only {} ask {:.1}% of the cluster, those GPUs hold {:.1}%)",
        mean * 100.0,
        lowest.allocation_at_most * 100.0,
        if classes.is_empty() {
            "no GPU".to_string()
        } else {
            classes.join(", ")
        },
        lowest.asked * 100.0,
        lowest.held * 100.0
    );
}

/// The table at 100 % arrived demand: allocation, failures by cause, stranded memory and the
/// surplus of exclusive whole-GPU tasks, means over seeds.
fn print_at_full(results: &[Replayed]) {
    println!(
        "At 100% arrived GPU demand (failed tasks: % of arrived tasks, by cause; outside walk: of the failed, tasks no node of kube-scheduler's walk took while a node it did not reach would have, mean tasks per seed in brackets; stranded: free GPU memory / idle GPUs on nodes without CPU or memory for a median GPU task; whole surplus: GPU memory booked beyond their request by exclusive whole-GPU tasks on larger GPUs, not counted in allocation):"
    );
    print!("| # | strategy | allocation | min–max |");
    for cause in Cause::ALL {
        print!(" fail {} |", cause.name());
    }
    println!(" outside walk | stranded GiB | stranded GPUs | whole surplus |");
    println!(
        "|---|---|---|---|{}---|---|---|---|",
        "---|".repeat(Cause::ALL.len())
    );
    for (i, strategy, runs) in results {
        let at_full = |of: &dyn Fn(&Snapshot) -> f64| mean(runs, |r| of(&r.at_full));
        // A count of tasks as a share of the arrived.
        let share = |tasks: usize, s: &Snapshot| tasks as f64 / s.arrived.max(1) as f64;
        let (low, high) = runs.iter().fold((f64::MAX, f64::MIN), |(l, h), r| {
            (l.min(r.at_full.allocation), h.max(r.at_full.allocation))
        });
        print!(
            "| {} | {} | **{:.1}%** | {:.1}–{:.1}% |",
            i + 1,
            strategy.name(),
            at_full(&|s| s.allocation) * 100.0,
            low * 100.0,
            high * 100.0
        );
        for c in 0..Cause::ALL.len() {
            print!(" {:.1}% |", at_full(&|s| share(s.failed[c], s)) * 100.0);
        }
        print!(
            " {:.2}% ({:.1} tasks) |",
            at_full(&|s| share(s.failed_outside_walk, s)) * 100.0,
            at_full(&|s| s.failed_outside_walk as f64)
        );
        println!(
            " {:.1}% | {:.1}% | {:.1}% |",
            at_full(&|s| s.stranded) * 100.0,
            at_full(&|s| s.stranded_gpus) * 100.0,
            at_full(&|s| s.whole_surplus) * 100.0
        );
    }
}

/// The allocation ratio of each strategy as arrived demand climbs, means over seeds.
fn print_curves(results: &[Replayed]) {
    println!("Allocation ratio against arrived GPU demand:");
    print!("| # | strategy |");
    let tenths = [5, 7, 8, 9, 10, 11, 12, 13];
    for t in tenths {
        print!(" {}% |", t * 10);
    }
    println!();
    println!("|---|---|{}", "---|".repeat(tenths.len()));
    for (i, strategy, runs) in results {
        print!("| {} | {} |", i + 1, strategy.name());
        for t in tenths {
            let at = mean(runs, |r| r.curve.get(t - 1).map_or(0.0, |p| p.1));
            print!(" {:.1}% |", at * 100.0);
        }
        println!();
    }
}
