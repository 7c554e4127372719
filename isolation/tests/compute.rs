//! Compute sharing against the fake driver, which runs kernels the way a time-sliced GPU
//! does (`isolation/probe/fake/libcuda.rs`: a kernel holds its GPU for as many µs as its grid
//! has blocks, one at a time in submission order across every process on the node).
//!
//! Each container is its own process with its own budget and compute share, on one fake
//! GPU, running back-to-back kernels (`kernels:PATH:MS:US`, each waited for) through the
//! interposer. What must hold is read from the fake's own log of what ran when (not from
//! the interposer's figures): each container's share of the GPU time used while they all
//! ran. Ratios of simulated busy time, never wall-clock bounds, so they hold on a loaded CI
//! box too; each scenario runs for two or three seconds.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

mod common;
// The harness `real_programs.rs` drives; not every helper is used here.
#[allow(dead_code)]
#[path = "common/fake_node.rs"]
mod fake_node;

use fake_node::{Container, Node};
use gpushare_isolation_budget::{
    ENV_LIMITS_FILE, Limits, PreparedCompute, PreparedLimits, budget_path, prepare_with_compute,
};

/// One container of a scenario: its share, mode, how it reaches the driver and launches.
struct Spec {
    percent: u32,
    mode: &'static str,
    via: &'static str,
    path: &'static str,
    /// A limits file to name (`GPUSHARE_ISOLATION_LIMITS_FILE`), which wins over the share
    /// and mode in the environment.
    limits_file: Option<std::path::PathBuf>,
}

fn spec(percent: u32, mode: &'static str, via: &'static str, path: &'static str) -> Spec {
    Spec {
        percent,
        mode,
        via,
        path,
        limits_file: None,
    }
}

/// What a scenario measured, per container in the order given.
struct Measured {
    /// Percent of the GPU time used by all of them, while all of them ran.
    share: Vec<f64>,
    /// Percent of the wall time (the same window) the GPU ran each one's kernels.
    busy: Vec<f64>,
    /// The probes' lines.
    lines: Vec<Vec<String>>,
}

/// One scenario at a time: on a two-core CI box, scenarios run side by side would take CPU
/// from each other's launches (not their shares, but the alone figures).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `specs` at once on one fake GPU, each launching `us`-µs kernels for `ms` ms, and
/// measures what each got from the fake's log of runs.
fn contend(specs: &[Spec], ms: u64, us: u64) -> Measured {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let node = Node::new(1, 16384, 0);
    let compute_dir = node.compute_dir().display().to_string();
    let containers: Vec<Container> = specs
        .iter()
        .map(|s| {
            let container = Container::new(&node, &[0], 2)
                .with("GPUSHARE_COMPUTE_PERCENT", &s.percent.to_string())
                .with("GPUSHARE_COMPUTE_MODE", s.mode)
                .with("GPUSHARE_COMPUTE_DIR", &compute_dir);
            match &s.limits_file {
                Some(file) => container.with(ENV_LIMITS_FILE, &file.display().to_string()),
                None => container,
            }
        })
        .collect();
    let steps: Vec<String> = specs
        .iter()
        .map(|s| format!("kernels:{}:{ms}:{us}", s.path))
        .collect();
    let mut sessions: Vec<_> = containers
        .iter()
        .zip(&steps)
        .zip(specs)
        .map(|((c, kernels), s)| c.start(s.via, &["wait", kernels, "gpu-util", "wait"]))
        .collect();
    // Every probe set up and waiting: let them all go at once.
    for session in &mut sessions {
        session.stop();
    }
    for session in &mut sessions {
        session.resume();
    }
    let lines: Vec<Vec<String>> = sessions.iter_mut().map(|s| s.stop().lines).collect();
    for (out, s) in lines.iter().zip(specs) {
        let kernels = out.iter().find(|l| l.starts_with("kernels ")).unwrap();
        assert!(
            kernels.ends_with("result=0") && !kernels.contains(" count=0 "),
            "{} via {}: {out:?}",
            s.path,
            s.via
        );
    }
    let pids: Vec<u32> = sessions.iter().map(|s| s.pid).collect();
    let runs = node.runs();
    let mut spans: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    for &(pid, _, start, end) in &runs {
        let span = spans.entry(pid).or_insert((start, end));
        span.0 = span.0.min(start);
        span.1 = span.1.max(end);
    }
    let from = pids.iter().map(|p| spans[p].0).max().unwrap();
    let to = pids.iter().map(|p| spans[p].1).min().unwrap();
    assert!(to > from, "the containers never ran together: {spans:?}");
    let busy: Vec<u64> = pids
        .iter()
        .map(|pid| {
            runs.iter()
                .filter(|r| r.0 == *pid)
                .map(|r| r.3.min(to).saturating_sub(r.2.max(from)))
                .sum()
        })
        .collect();
    let total: u64 = busy.iter().sum();
    let percent = |b: &u64, of: u64| *b as f64 * 100.0 / of as f64;
    // The figures docs/isolation.md quotes (`--nocapture` shows them).
    eprintln!(
        "{}: share of use {:.1?}, of time {:.1?} over {} ms",
        specs
            .iter()
            .map(|s| format!("{}% {} {}", s.percent, s.mode, s.path))
            .collect::<Vec<_>>()
            .join(", "),
        busy.iter().map(|b| percent(b, total)).collect::<Vec<_>>(),
        busy.iter()
            .map(|b| percent(b, to - from))
            .collect::<Vec<_>>(),
        (to - from) / 1_000_000
    );
    Measured {
        share: busy
            .iter()
            .map(|b| *b as f64 * 100.0 / total as f64)
            .collect(),
        busy: busy
            .iter()
            .map(|b| *b as f64 * 100.0 / (to - from) as f64)
            .collect(),
        lines,
    }
}

fn assert_near(got: f64, want: f64, what: &str, measured: &Measured) {
    assert!(
        (got - want).abs() <= 5.0,
        "{what}: {got:.1} %, not {want} % ± 5: shares {:.1?} busy {:.1?}\n{:?}",
        measured.share,
        measured.busy,
        measured.lines
    );
}

#[test]
fn three_containers_get_their_shares_under_contention() {
    // Each through another launch entry point and another way to the driver.
    let specs = [
        spec(20, "shared", "link", "launch"),
        spec(30, "shared", "dlsym", "ex"),
        spec(50, "shared", "getproc", "coop"),
    ];
    let measured = contend(&specs, 2500, 2000);
    for (s, share) in specs.iter().zip(&measured.share) {
        assert_near(
            *share,
            f64::from(s.percent),
            &format!("{} % container ({})", s.percent, s.path),
            &measured,
        );
    }
}

#[test]
fn capped_containers_get_their_shares_under_contention() {
    let specs = [
        spec(20, "capped", "link", "launch-ptsz"),
        spec(30, "capped", "getproc", "launch-ptsz"),
        spec(50, "capped", "link", "launch"),
    ];
    let measured = contend(&specs, 2500, 2000);
    for (s, busy) in specs.iter().zip(&measured.busy) {
        // Capped at the share of the GPU's time, not just of what was used.
        assert_near(
            *busy,
            f64::from(s.percent),
            &format!("capped {} % container", s.percent),
            &measured,
        );
    }
}

#[test]
fn alone_in_shared_mode_a_container_uses_the_idle_gpu() {
    let measured = contend(&[spec(30, "shared", "link", "launch")], 1500, 10_000);
    assert!(
        measured.busy[0] >= 90.0,
        "a 30 % container alone got {:.1} % of the GPU: {:?}",
        measured.busy[0],
        measured.lines
    );
    // NVML's utilization follows the fake's kernels.
    let util: f64 = measured.lines[0]
        .iter()
        .find_map(|l| l.strip_prefix("gpu-util dev=0 gpu="))
        .and_then(|rest| rest.split(' ').next()?.parse().ok())
        .unwrap();
    assert!(util >= 80.0, "NVML says {util} %: {:?}", measured.lines);
}

#[test]
fn capped_a_container_alone_gets_its_cap() {
    let measured = contend(&[spec(30, "capped", "link", "launch")], 2000, 2000);
    assert_near(measured.busy[0], 30.0, "capped 30 % alone", &measured);
}

#[test]
fn graph_launches_are_held_like_kernel_launches() {
    let specs = [
        spec(25, "shared", "link", "graph"),
        spec(75, "shared", "link", "launch"),
    ];
    let measured = contend(&specs, 2500, 2000);
    assert_near(
        measured.share[0],
        25.0,
        "25 % container launching graphs",
        &measured,
    );
    assert_near(measured.share[1], 75.0, "75 % container", &measured);
}

#[test]
fn capped_graph_launches_through_get_proc_address_are_held() {
    let measured = contend(&[spec(30, "capped", "getproc", "graph-ptsz")], 2000, 2000);
    assert_near(
        measured.busy[0],
        30.0,
        "capped 30 % graphs alone",
        &measured,
    );
}

#[test]
fn a_limits_file_sets_the_share_and_wins_over_the_environment() {
    // Prepared as the plugins prepare a container: the budget, and a limits file with the
    // compute lines. Its compute state lives in the budget's directory (no compute_dir).
    let dir = tempfile::tempdir().unwrap();
    let limits = Limits::new(vec![2 << 30]);
    let budget = budget_path(dir.path(), "container", &limits);
    let limits_file = dir.path().join("limits");
    let prepared = PreparedLimits {
        budget,
        shares: limits.shares().to_vec(),
        uuids: vec![fake_node::uuid(0)],
        context_mib: Some(0),
        managed_memory: None,
    };
    let compute = PreparedCompute {
        percent: Some(30),
        mode: Some("capped".into()),
        dir: None,
    };
    prepare_with_compute(&prepared.budget, &limits_file, &prepared, &compute).unwrap();
    // The environment asks for 90 % shared: the file's 30 % capped holds.
    let measured = contend(
        &[Spec {
            limits_file: Some(limits_file),
            ..spec(90, "shared", "link", "launch")
        }],
        2000,
        2000,
    );
    assert_near(
        measured.busy[0],
        30.0,
        "capped 30 % from the limits file",
        &measured,
    );
    let made = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .any(|e| e.file_name().to_string_lossy().starts_with("compute-GPU-"));
    assert!(made, "no compute state beside the budget");
}

#[test]
fn without_a_compute_share_or_with_off_launches_pass_untouched() {
    let node = Node::new(1, 16384, 0);
    let compute_dir = node.compute_dir().display().to_string();
    let unset = Container::new(&node, &[0], 2).with("GPUSHARE_COMPUTE_DIR", &compute_dir);
    let off = Container::new(&node, &[0], 2)
        .with("GPUSHARE_COMPUTE_PERCENT", "10")
        .with("GPUSHARE_COMPUTE_MODE", "off")
        .with("GPUSHARE_COMPUTE_DIR", &compute_dir);
    for container in [&unset, &off] {
        let out = container.run(
            "link",
            &["kernels:launch:300:2000", "kernels:graph:100:2000"],
        );
        assert_eq!(out.all("kernels", "result"), [0, 0], "{:?}", out.lines);
    }
    // Nothing was held: no compute state was ever made.
    let made: Vec<_> = std::fs::read_dir(node.compute_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("compute-"))
        .map(|e| e.file_name())
        .collect();
    assert!(made.is_empty(), "{made:?}");
}
