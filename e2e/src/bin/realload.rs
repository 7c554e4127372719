//! The load harness on the real cluster of `../shared/realk8s`: what gpushare costs
//! kube-scheduler, side by side with kube-scheduler alone, in one run (how to run it and what
//! it found: docs/performance.md, "On the real cluster"). Needs root, like the real tier.
//!
//! Each mode (`--modes extender,dra,dra-plain`) is one install (its defaults plus any `--set`)
//! with Node objects in bulk (`--gpus` × `--gpu-gib` each, and as much of a resource gpushare
//! does not manage) and a stand-in for their kubelets (`realk8s::load::NodeStandIn`). Unless
//! `--alone-in-install-only` or `--chart-only`, kube-scheduler alone first drains each round's
//! backlog with the chart uninstalled (a user's alternative is no gpushare at all). Then each
//! round drains a backlog twice, with the kit's kube-scheduler alone and with the mode's
//! scheduler, prints pods/s from the first bind to the last, API calls per pod, CPU seconds
//! per process, the scheduler's own metrics and where the bind time went, and checks every
//! allocation. `dra-plain` is DRA's own ceiling: a plain driver's whole devices on the same
//! nodes. `--resident N` (extender mode) then times each extender replica's restart to Ready
//! with N pods bound, and a drain whose leader is SIGKILLed at its half (`realk8s::scale`).
//! `--creation-only` measures only how fast pods are created, with and without the chart.

use std::time::Duration;

use anyhow::{Context, ensure};
use clap::{Parser, ValueEnum};
use gpushare_contract::DEFAULT_DOMAIN;
use gpushare_e2e::realk8s::load::{
    self, BASELINE_RESOURCE, Backlog, Creating, Creation, Drain, Drainer, Mix, NodeStandIn,
    StandInConfig,
};
use gpushare_e2e::realk8s::{Kit, KitCluster, Mode};
use gpushare_e2e::scenarios::{Harness, allocation, check_no_overcommit};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, ListParams};

/// What a run measures: one of the kit's installs, or DRA's own ceiling on DRA mode's install.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Load {
    /// Extender mode: the chart's drain.
    Extender,
    /// DRA mode: the chart's policy, slices and scheduler.
    Dra,
    /// `dra-plain`: a plain driver's whole devices (no capacity), one per pod, allocated by
    /// the kit's kube-scheduler on the same nodes (DRA mode's install, none of its slices).
    DraPlain,
}

impl Load {
    fn install(self) -> Mode {
        match self {
            Load::Extender => Mode::Extender,
            Load::Dra | Load::DraPlain => Mode::Dra,
        }
    }
}

#[derive(Parser, Debug)]
#[command(about = "gpushare's cost to kube-scheduler on the real cluster of ../shared/realk8s")]
struct Args {
    /// Node objects to add (no kubelet behind them).
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// GPUs per node.
    #[arg(long, default_value_t = 4)]
    gpus: usize,
    /// GiB per GPU.
    #[arg(long, default_value_t = 16)]
    gpu_gib: u64,
    /// Pods in each backlog.
    #[arg(long, default_value_t = 3000)]
    pods: usize,
    /// GiB each pod asks for.
    #[arg(long, default_value_t = 4)]
    pod_gib: u64,
    /// CPU each pod requests, millicores (0: none; kube-scheduler scores such a pod as 100m).
    #[arg(long, default_value_t = 0)]
    pod_cpu_millis: u64,
    /// Rounds (each drains one backlog with kube-scheduler alone, then one with the chart).
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// kube-scheduler alone's `percentageOfNodesToScore` (0: upstream's adaptive default).
    #[arg(long, default_value_t = 0)]
    alone_percentage: u32,
    /// Skip kube-scheduler alone.
    #[arg(long)]
    chart_only: bool,
    /// Measure only how fast pods are created (no drain): pods asking for no GPU and GPU
    /// pods, `--pods` of each per round, with the chart installed, then (unless
    /// `--chart-only`) with it uninstalled.
    #[arg(long)]
    creation_only: bool,
    /// With `--creation-only`: which pods to create, `plain` (asking for no GPU), `gpu`, or
    /// both (`plain,gpu`).
    #[arg(long, value_delimiter = ',', default_value = "plain,gpu")]
    creating: Vec<Creating>,
    /// Objects of the install to delete before measuring (`kubectl delete` names, such as
    /// `validatingadmissionpolicybinding/gpushare-allocations`): what one of them costs.
    #[arg(long = "without")]
    without: Vec<String>,
    /// Compare only with kube-scheduler alone inside the chart's install (its admission on
    /// every write), not also on the same cluster with the chart uninstalled.
    #[arg(long)]
    alone_in_install_only: bool,
    /// How long after a bind the stand-in writes the pod's status (kubelet admitting it).
    #[arg(long, default_value_t = 200)]
    allocate_after_ms: u64,
    /// The stand-in also writes the device plugin's allocation marks on each GPU pod, as
    /// `--set devicePlugin.allocationMarks=true` has the real plugin do (the chart's default
    /// before they were off).
    #[arg(long)]
    plugin_marks: bool,
    /// No stand-in: no pod is ever admitted, so the twin rule keeps each node's 4 GiB pods on
    /// one GPU (4 a node here) and neither drain gets the status writes of a real node.
    #[arg(long)]
    without_kubelets: bool,
    /// How long one drain may take.
    #[arg(long, default_value_t = 600)]
    timeout_s: u64,
    /// Installs to measure, one after another, each drained against kube-scheduler alone
    /// in the same install: `extender`, `dra`, `dra-plain` (DRA's own ceiling: a plain
    /// driver's whole devices on the same nodes), or several (`--modes extender,dra,dra-plain`).
    #[arg(long, value_delimiter = ',', default_value = "extender")]
    modes: Vec<Load>,
    /// `helm install` values (`--set key=value`), repeatable.
    #[arg(long = "set")]
    set: Vec<String>,
    /// The backlog's pod shapes instead of `--pod-gib` alone: `GIB[:WEIGHT]` or
    /// `GPUSxGIB[:WEIGHT]`, comma-separated (`1:30,2:30,4:25,8:10,2x8:5`). Multi-GPU shapes
    /// need extender mode; kube-scheduler alone's pods ask for each shape's total.
    #[arg(long, value_parser = Mix::parse)]
    mix: Option<Mix>,
    /// Extender mode, after the rounds: the chart binds this many pods of the mix and keeps
    /// them; then each extender replica is restarted (seconds from its start to Ready, with
    /// those pods bound) and one more backlog is drained while the leader is SIGKILLed at
    /// its half (seconds until another replica holds the Lease and binding resumes).
    #[arg(long, default_value_t = 0)]
    resident: usize,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if mix(&args).has_multi_gpu() && args.modes.iter().any(|m| *m != Load::Extender) {
        anyhow::bail!("multi-GPU shapes in --mix need --modes extender");
    }
    let kit = Kit::locate()?.context("no ../shared/realk8s beside the repository")?;
    if args.creation_only {
        return creation_rates(&kit, &args).await;
    }
    let mut summary = Vec::new();
    for mode in &args.modes {
        let figures = run_mode(&kit, &args, *mode).await?;
        summary.push((*mode, figures));
    }
    println!(
        "\nsummary, pods/s (drain / kube-scheduler alone without the chart, or in the same install with --alone-in-install-only):"
    );
    for (mode, figures) in summary {
        let rounds: Vec<String> = figures
            .iter()
            .map(|(alone, drained)| format!("{drained:.1} / {alone:.1} = {:.2}", drained / alone))
            .collect();
        println!("  {mode:?}: {}", rounds.join("; "));
    }
    Ok(())
}

/// One install in `mode`, its rounds, and the pods/s of each round: (alone, the mode's drain),
/// alone's drain without the chart where it ran.
async fn run_mode(kit: &Kit, args: &Args, mode: Load) -> anyhow::Result<Vec<(f64, f64)>> {
    let cluster = install(kit, args, mode).await?;
    let client = cluster.client();
    let without_chart = !args.chart_only && !args.alone_in_install_only;
    let values = if without_chart {
        println!("uninstalling the chart: kube-scheduler alone drains first without it");
        Some(cluster.uninstall_chart()?)
    } else {
        None
    };
    add_nodes(&cluster, args, mode).await?;
    let stand_in = (!args.without_kubelets).then(|| start_stand_in(&client, args));
    let mut alone_without_chart = Vec::new();
    if let Some(values) = values {
        let timeout = Duration::from_secs(args.timeout_s);
        for round in 1..=args.rounds {
            let drain = drain_alone(&cluster, args, &format!("bare-{round}"), timeout).await?;
            let title = format!("round {round}: kube-scheduler alone, the chart not installed");
            report(&title, &drain);
            alone_without_chart.push(drain);
        }
        println!("installing the chart again");
        cluster.install_again(&values)?;
    }
    let mut figures: Vec<(f64, f64)> = Vec::new();
    for round in 1..=args.rounds {
        if let Some((alone_in_install, drained)) = run_round(&cluster, args, mode, round).await? {
            let alone = match alone_without_chart.get(round - 1) {
                Some(bare) => {
                    println!(
                        "round {round}: against kube-scheduler alone without the chart: {:.2} ({:.1} / {:.1} pods/s)",
                        drained.pods_per_s / bare.pods_per_s,
                        drained.pods_per_s,
                        bare.pods_per_s
                    );
                    bare
                }
                None => &alone_in_install,
            };
            print_bind_p50(round, &drained, alone);
            figures.push((alone.pods_per_s, drained.pods_per_s));
        }
    }
    if mode == Load::Extender && args.resident > 0 {
        resident_checks(&cluster, args).await?;
    }
    if let Some(stand_in) = &stand_in {
        report_stand_in(stand_in);
    }
    if mode == Load::Extender {
        extender_memory(&cluster);
    } else {
        load::delete_fake_slices(&client).await?;
    }
    load::delete_fake_nodes(&client).await?;
    Ok(figures)
}

/// Brings the kit's cluster up with the chart installed in `mode` with `--set`, less the
/// objects `--without` names.
async fn install(kit: &Kit, args: &Args, mode: Load) -> anyhow::Result<KitCluster> {
    let helm_args: Vec<&str> = args
        .set
        .iter()
        .flat_map(|s| ["--set", s.as_str()])
        .collect();
    println!("installing the chart ({mode:?} mode) {helm_args:?}");
    let cluster = kit.up(mode.install(), &helm_args).await?;
    for object in &args.without {
        println!("deleting {object} from the install");
        cluster.kubectl(&["delete", "-n", "kube-system", object])?;
    }
    Ok(cluster)
}

/// `--creation-only`: pods created per second, without and with a GPU request, with the
/// chart installed and then with it uninstalled, `--rounds` times each, and the API server's
/// CPU per pod created.
async fn creation_rates(kit: &Kit, args: &Args) -> anyhow::Result<()> {
    let cluster = install(kit, args, Load::Extender).await?;
    let kinds: Vec<(Creating, &str)> = [(Creating::Plain, "no GPU"), (Creating::Gpu, "GPU")]
        .into_iter()
        .filter(|(kind, _)| args.creating.contains(kind))
        .collect();
    let mut measured: Vec<(bool, usize, Creation)> = Vec::new();
    // With the chart, then (unless `--chart-only`) without it.
    let settings = [(true, "the chart installed"), (false, "no chart")];
    for (installed, setting) in settings.into_iter().filter(|(i, _)| *i || !args.chart_only) {
        if !installed {
            cluster.uninstall_chart()?;
        }
        for round in 1..=args.rounds {
            for (index, (kind, what)) in kinds.iter().enumerate() {
                let prefix = format!("create-{round}");
                let created = load::creation_rate(&cluster, *kind, &prefix, &backlog(args)).await?;
                println!(
                    "round {round}, {setting}: pods asking for {what} created at {:.1} pods/s, the API server {:.2} CPU-ms a pod",
                    created.per_s, created.api_server_cpu_ms
                );
                measured.push((installed, index, created));
            }
        }
    }
    println!("\nsummary, with the chart / without it (mean over rounds):");
    for (index, (_, what)) in kinds.iter().enumerate() {
        // The mean of `field` with the chart installed, and without it.
        let mean = |field: fn(&Creation) -> f64| {
            [true, false].map(|installed| {
                let all: Vec<f64> = measured
                    .iter()
                    .filter(|(i, k, _)| *i == installed && *k == index)
                    .map(|(_, _, c)| field(c))
                    .collect();
                all.iter().sum::<f64>() / all.len().max(1) as f64
            })
        };
        let [rate_with, rate_without] = mean(|c| c.per_s);
        let [cpu_with, cpu_without] = mean(|c| c.api_server_cpu_ms);
        if args.chart_only {
            println!(
                "  pods asking for {what}: {rate_with:.1} pods/s; the API server {cpu_with:.2} CPU-ms a pod"
            );
            continue;
        }
        println!(
            "  pods asking for {what}: {rate_with:.1} / {rate_without:.1} pods/s = {:.2}; the API server {cpu_with:.2} / {cpu_without:.2} CPU-ms a pod = {:.2}",
            rate_with / rate_without,
            cpu_with / cpu_without
        );
    }
    Ok(())
}

/// Adds the fake GPU nodes (and, in DRA mode, their ResourceSlices).
async fn add_nodes(cluster: &KitCluster, args: &Args, mode: Load) -> anyhow::Result<()> {
    let client = cluster.client();
    let gpus = vec![args.gpu_gib; args.gpus];
    let per_node = args.gpu_gib * args.gpus as u64;
    load::create_fake_gpu_nodes(
        &client,
        "load",
        args.nodes,
        &gpus,
        &[(BASELINE_RESOURCE, per_node)],
    )
    .await?;
    match mode {
        Load::Extender => {}
        Load::Dra => {
            load::publish_fake_slices(&client, "load", args.nodes, &gpus, DEFAULT_DOMAIN).await?
        }
        Load::DraPlain => {
            load::publish_plain_slices(&client, "load", args.nodes, args.gpus).await?
        }
    }
    let asked = mix(args).total_gib(args.pods);
    println!(
        "{} nodes × {} × {} GiB; backlogs of {} pods ({:?}), {asked} GiB: at least {} GPUs",
        args.nodes,
        args.gpus,
        args.gpu_gib,
        args.pods,
        mix(args).shapes(),
        asked.div_ceil(args.gpu_gib)
    );
    Ok(())
}

/// The fake nodes' kubelets: each bound pod's status (and, with `--plugin-marks`, the device
/// plugin's marks) written after `--allocate-after-ms`.
fn start_stand_in(client: &kube::Client, args: &Args) -> NodeStandIn {
    NodeStandIn::start(
        client.clone(),
        "default",
        StandInConfig {
            node_prefix: "load-".to_owned(),
            delay: Duration::from_millis(args.allocate_after_ms),
            marks_as: args
                .plugin_marks
                .then(|| "kube-system/gpushare-device-plugin".to_owned()),
        },
    )
}

/// Round `round`: kube-scheduler alone (unless `--chart-only`), then the mode's drain, each
/// reported and checked; the pods/s of both when both ran.
async fn run_round(
    cluster: &KitCluster,
    args: &Args,
    mode: Load,
    round: usize,
) -> anyhow::Result<Option<(load::Drain, load::Drain)>> {
    let timeout = Duration::from_secs(args.timeout_s);
    let alone = if args.chart_only {
        None
    } else {
        let drain = drain_alone(cluster, args, &format!("alone-{round}"), timeout).await?;
        report(&format!("round {round}: kube-scheduler alone"), &drain);
        Some(drain)
    };
    let (prefix, drainer, what) = match mode {
        Load::Extender => (format!("chart-{round}"), Drainer::Chart, "the chart"),
        Load::DraPlain => (
            format!("plain-{round}"),
            Drainer::DraPlain,
            "a plain DRA driver (whole devices)",
        ),
        Load::Dra if load::chart_runs_a_scheduler(cluster).await? => (
            format!("dra-{round}"),
            Drainer::DraChart,
            "DRA mode (the chart's scheduler)",
        ),
        Load::Dra => (format!("dra-{round}"), Drainer::Dra, "DRA mode"),
    };
    let drained = load::drain(cluster, drainer, &prefix, &backlog(args), timeout).await?;
    report(&format!("round {round}: {what}"), &drained);
    match mode {
        Load::Extender => check_allocations(cluster, &prefix).await?,
        Load::Dra | Load::DraPlain => {
            let (claims, devices) =
                load::check_dra_allocations(&cluster.client(), &prefix, args.pods, args.gpu_gib)
                    .await?;
            println!(
                "  checked: {claims} claims allocated; {devices} GPUs in use, none over-committed"
            );
        }
    }
    load::delete_backlog(cluster, &prefix).await?;
    let Some(alone) = alone else {
        return Ok(None);
    };
    println!(
        "round {round}: {what} drains at {:.2} of kube-scheduler alone ({:.1} / {:.1} pods/s)",
        drained.pods_per_s / alone.pods_per_s,
        drained.pods_per_s,
        alone.pods_per_s
    );
    Ok(Some((alone, drained)))
}

/// How long a bind kept the scheduler waiting, the median, `drained` against `alone`, each
/// with what it was read from: in extender mode the extender's whole answer, against the API
/// server's own time for alone's Bindings, which alone's Bind waits for at least
/// (kube-scheduler's own Bind histogram ends at 204.8 ms, so its quantiles above that read
/// 204.8).
fn print_bind_p50(round: usize, drained: &load::Drain, alone: &load::Drain) {
    let read = |p50: Option<(f64, &str)>| {
        p50.map_or("-".to_owned(), |(s, from)| {
            format!("{:.0} ms ({from})", s * 1e3)
        })
    };
    println!(
        "round {round}: bind p50 {} against alone's {}",
        read(drained.bind_p50),
        read(alone.bind_p50)
    );
}

/// Each round's backlog, as the arguments say.
fn backlog(args: &Args) -> Backlog {
    Backlog {
        count: args.pods,
        mix: mix(args),
        cpu_millis: args.pod_cpu_millis,
    }
}

/// `--mix`, or every pod `--pod-gib` on one GPU.
fn mix(args: &Args) -> Mix {
    args.mix
        .clone()
        .unwrap_or_else(|| Mix::uniform(args.pod_gib))
}

/// `--resident`: the chart binds that many pods and keeps them; each extender replica is
/// restarted and timed to Ready; a backlog is drained through the Service proxy while the
/// leader is killed at its half.
async fn resident_checks(cluster: &KitCluster, args: &Args) -> anyhow::Result<()> {
    let resident = Backlog {
        count: args.resident,
        ..backlog(args)
    };
    // Drained as fast as the chart goes; give it the time it needs at 20 pods/s.
    let slow = Duration::from_secs(args.timeout_s.max(args.resident as u64 / 20));
    let drained = load::drain(cluster, Drainer::Chart, "resident", &resident, slow).await?;
    let title = format!(
        "resident: the chart binds {} pods and keeps them",
        args.resident
    );
    report(&title, &drained);
    check_allocations(cluster, "resident").await?;
    extender_memory(cluster);
    // The follower first: binding goes on meanwhile; then the leader, whose Lease moves.
    let leader = load::leader_pod(cluster)?;
    let mut replicas: Vec<String> = load::chart_processes(cluster)
        .into_iter()
        .map(|(pod, _)| pod)
        .filter(|pod| pod.starts_with("gpushare-extender-"))
        .collect();
    replicas.sort_by_key(|pod| *pod == leader);
    for pod in replicas {
        let role = if pod == leader {
            "the leader"
        } else {
            "a follower"
        };
        let seconds = load::restart_to_ready(cluster, &pod).await?;
        println!(
            "{pod} ({role}) killed and restarted with {} pods bound: Ready {seconds:.2} s after its start",
            args.resident
        );
    }
    let timeout = Duration::from_secs(args.timeout_s);
    let leader = load::Leader::find(cluster)?;
    let (drained, takeover) = load::drain_with(
        cluster,
        Drainer::ChartViaProxy,
        "killed",
        &backlog(args),
        timeout,
        |clock| load::kill_leader_after(cluster, clock, leader, args.pods / 2, args.pods),
    )
    .await?;
    let title = "leader killed mid-drain (through the Service proxy)";
    report(title, &drained);
    println!(
        "  the leader SIGKILLed at {} of {} pods bound: Lease taken over after {:.2} s, binding resumed after {:.2} s",
        takeover.killed_at_pods, args.pods, takeover.lease_s, takeover.resumed_s
    );
    check_allocations(cluster, "killed").await?;
    load::delete_backlog(cluster, "killed").await?;
    load::delete_backlog(cluster, "resident").await?;
    Ok(())
}

/// A backlog named `prefix` drained by kube-scheduler alone, then deleted.
async fn drain_alone(
    cluster: &KitCluster,
    args: &Args,
    prefix: &str,
    timeout: Duration,
) -> anyhow::Result<Drain> {
    let alone = Drainer::KubeSchedulerAlone {
        percentage: args.alone_percentage,
    };
    let drain = load::drain(cluster, alone, prefix, &backlog(args), timeout).await?;
    load::delete_backlog(cluster, prefix).await?;
    Ok(drain)
}

/// What the node stand-in wrote and had refused over the whole install.
fn report_stand_in(stand_in: &NodeStandIn) {
    println!(
        "node stand-in: {} pod statuses written, {} pods marked allocated, {} writes refused",
        stand_in.statuses(),
        stand_in.marked(),
        stand_in.refused().len()
    );
    if let Some(first) = stand_in.refused().first() {
        println!("  the first refused: {first}");
    }
}

fn report(title: &str, drain: &Drain) {
    println!(
        "{title}: {} pods in {:.2} s = {:.1} pods/s (median second {} pods); created at {:.1} pods/s",
        drain.pods, drain.seconds, drain.pods_per_s, drain.per_second_p50, drain.created_per_s
    );
    let calls: Vec<String> = drain
        .api_calls_per_pod
        .iter()
        .map(|(verb, n)| format!("{verb} {n:.2}"))
        .collect();
    println!("  API requests per pod: {}", calls.join(", "));
    let cpu: Vec<String> = drain
        .cpu_seconds
        .iter()
        .map(|(name, s)| format!("{name} {s:.1}"))
        .collect();
    println!("  CPU seconds: {}", cpu.join(", "));
    let latency = drain.bind_latency.iter().map(String::as_str);
    for line in drain.scheduler_metrics.lines().chain(latency) {
        println!("  {line}");
    }
}

/// Every GPU pod of the drain holds an allocation and no GPU is over-committed.
async fn check_allocations(cluster: &KitCluster, prefix: &str) -> anyhow::Result<()> {
    let pods = Api::<Pod>::namespaced(cluster.client(), "default")
        .list(&ListParams::default().labels(&format!("load={prefix}")))
        .await?;
    for pod in &pods.items {
        allocation(pod).with_context(|| format!("pod {}", pod.name_any()))?;
    }
    let usage = check_no_overcommit(&cluster.client()).await?;
    let used_gpus = usage.values().filter(|(used, _)| *used > 0).count();
    ensure!(!pods.items.is_empty(), "no pods of {prefix}");
    println!(
        "  checked: {} pods, each with an allocation; {used_gpus} GPUs in use, none over-committed",
        pods.items.len()
    );
    Ok(())
}

fn extender_memory(cluster: &KitCluster) {
    let processes = load::chart_processes(cluster).into_iter();
    for (pod, pid) in processes.filter(|(pod, _)| pod.starts_with("gpushare-extender-")) {
        if let Some((peak, now)) = load::rss_mib(pid) {
            println!("{pod}: RSS peak {peak:.1} MiB, now {now:.1} MiB");
        }
    }
}
