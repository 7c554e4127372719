//! The load harness (`--bin load`) runs on a tiny configuration and prints every figure of its
//! report.
//!
//! No timing or byte count is asserted: this proves the instruments still drive the real code
//! (so the numbers of a full run mean something), not how fast or small it is.

use std::process::Command;

/// Every figure line the report must carry.
const FIGURES: &[&str] = &[
    "set-up: nodes created",
    "set-up: bound pods created",
    "extender start → ready (list + rebuild)",
    "extender RSS when ready",
    "set-up: pending pods created",
    "wait until binds accepted (watch, hold)",
    "drive: pods scheduled",
    "scheduling cycles per bound pod",
    "drive: wall time",
    "binds per second",
    "filter p50",
    "filter p99",
    "prioritize p50",
    "prioritize p99",
    "bind p50",
    "bind p99",
    "extender's own time per call (its histogram)",
    "API writes per bind (events excluded)",
    "API creates of pods/binding",
    "API reads (get/list pods, nodes) in drive",
    "bind refusals",
    "bind outcomes (extender metrics, drive)",
    "pods left unscheduled",
    "call errors",
    "extender peak RSS (VmHWM)",
    "extender RSS after load (VmRSS)",
    "plugin start → registered and listed",
    "devices advertised (1 per GiB)",
    "plugin watch caught up (sentinel allocated)",
    "Allocate calls answered",
    "Allocate p50",
    "Allocate p99",
    "API pod LISTs during Allocate phase",
    "API pod patches per Allocate",
    "Allocate errors",
    "device plugin peak RSS (VmHWM)",
];

/// The value printed after `label` (the rest of its line), if the line is there.
fn value<'a>(report: &'a str, label: &str) -> Option<&'a str> {
    report
        .lines()
        .find_map(|line| line.trim_start().strip_prefix(label))
        .map(str::trim)
}

#[test]
fn tiny_run_prints_every_figure() {
    let output = Command::new(env!("CARGO_BIN_EXE_load"))
        .args([
            "--nodes",
            "20",
            "--bound-pods",
            "200",
            "--pods",
            "50",
            "--allocate-pods",
            "50",
            "--concurrency",
            "4",
        ])
        .output()
        .expect("running the load binary");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "load failed ({})\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );

    let missing: Vec<&str> = FIGURES
        .iter()
        .copied()
        .filter(|label| value(&stdout, label).is_none())
        .collect();
    assert!(
        missing.is_empty(),
        "figures missing from the report: {missing:?}\n{stdout}"
    );

    // Facts, not timings: every pod got placed and allocated, with one API write each.
    assert_eq!(
        value(&stdout, "drive: pods scheduled"),
        Some("50 of 50"),
        "{stdout}"
    );
    assert_eq!(
        value(&stdout, "Allocate calls answered"),
        Some("50 of 50"),
        "{stdout}"
    );
    assert_eq!(
        value(&stdout, "API creates of pods/binding"),
        Some("50"),
        "{stdout}"
    );
    assert_eq!(
        value(&stdout, "API pod LISTs during Allocate phase"),
        Some("0"),
        "{stdout}"
    );
    assert_eq!(value(&stdout, "call errors"), Some("0"), "{stdout}");
    assert_eq!(value(&stdout, "Allocate errors"), Some("0"), "{stdout}");
}

#[test]
fn skip_flags_skip_phases() {
    let output = Command::new(env!("CARGO_BIN_EXE_load"))
        .args(["--skip-extender", "--skip-allocate"])
        .output()
        .expect("running the load binary");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    assert_eq!(value(&stdout, "extender phase"), Some("skipped"));
    assert_eq!(value(&stdout, "device plugin phase"), Some("skipped"));
    assert!(value(&stdout, "filter p50").is_none());
}
