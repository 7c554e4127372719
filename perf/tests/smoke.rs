//! `view-memory` runs on a tiny configuration and prints every figure of its report.
//!
//! No byte count is asserted beyond "more than none": this proves the instrument still reads
//! the real view (so the numbers of a full run mean something), not how small it is.

use std::process::Command;

#[test]
fn tiny_run_measures_a_view_that_holds_the_pods() {
    let output = Command::new(env!("CARGO_BIN_EXE_view-memory"))
        .args(["--nodes", "10", "--pods", "200"])
        .output()
        .expect("running the view-memory binary");
    let report = String::from_utf8_lossy(&output.stdout);
    // The value printed after a label (the rest of its line), if the line is there.
    let value = |report: &str, label: &str| {
        let line = report
            .lines()
            .find_map(|l| l.trim_start().strip_prefix(label));
        line.map(|rest| rest.trim().to_owned())
    };
    assert!(
        output.status.success(),
        "view-memory failed ({}):\n{report}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    for label in [
        "view with nodes only",
        "relist buffer (pod facts), at its fullest",
        "view with nodes and pods",
        "heap peak (whole run)",
    ] {
        let figure = value(&report, label).unwrap_or_else(|| panic!("no {label:?} in:\n{report}"));
        assert!(figure.ends_with("MiB"), "{label}: {figure}");
    }
    // Zero bytes per pod would mean the pods were never read into the view.
    for label in [
        "per pod in the view",
        "per pod in the relist buffer",
        "per pod after every pod's next watch event",
    ] {
        let bytes: u64 = value(&report, label)
            .and_then(|v| v.trim_end_matches('B').trim().parse().ok())
            .unwrap_or_else(|| panic!("no {label:?} in:\n{report}"));
        assert!(bytes > 0, "{label}: {bytes} B\n{report}");
    }
    assert!(report.contains("200 bound pods"), "{report}");
}
