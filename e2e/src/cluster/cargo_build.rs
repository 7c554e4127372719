//! Builds our binaries (`gpushare-extender`, `gpushare-device-plugin`,
//! `gpushare-dra-plugin`, `kubectl-gpushare`) once per process, with the same cargo, profile
//! and target folder as the running test, or finds prebuilt ones in `GPUSHARE_BIN_DIR`.
//!
//! The nested build selects what the outer build selected, so that it resolves the same
//! features and reuses every dependency already compiled (a selection that differs in a few
//! features deep in the graph compiles most of it a second time):
//! - from one of this crate's binaries (`cargo run -p gpushare-e2e --bin demo`, realload),
//!   in whichever profile it was built: this crate's package beside the binaries'
//!   packages. This crate depends on the binaries' libraries, so the two resolve alike and a
//!   cold demo compiles each crate once, then only links the binaries;
//! - from a test (its executable lives in `deps/`): the workspace's libraries, binaries and
//!   tests, as the README's test command builds them (dev-dependencies add features): a no-op
//!   after that command, and after `cargo test -p gpushare-e2e …` the rest of the workspace's
//!   tests are compiled once.
//!
//! Separate because it runs cargo, not the cluster: its environment handling (the runner's
//! `CARGO_*` variables kept out of the nested build) is its own concern.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{Context, bail};

/// Paths to our binaries, built once per process with the same cargo and profile as the
/// running test or demo.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub extender: PathBuf,
    pub device_plugin: PathBuf,
    /// `gpushare-dra-plugin` (installed by the real tier; run by `tests/chart.rs` for its RBAC)
    pub dra_plugin: PathBuf,
    /// `kubectl-gpushare`, the kubectl plugin
    pub kubectl_gpushare: PathBuf,
    /// `libgpushare_isolation.so`, the interposer the plugins install (`isolation/`)
    pub isolation_library: PathBuf,
    /// `gpushare-isolation-probe`, a CUDA program against the fake driver (`isolation/probe`)
    pub isolation_probe: PathBuf,
}

/// The binaries the harness runs, each built by the package of the same name.
const BINARIES: [&str; 5] = [
    "gpushare-extender",
    "gpushare-device-plugin",
    "gpushare-dra-plugin",
    "kubectl-gpushare",
    "gpushare-isolation-probe",
];

/// Builds (if needed) and finds our binaries. `GPUSHARE_BIN_DIR` points at prebuilt ones.
pub fn binaries() -> anyhow::Result<Binaries> {
    static BUILT: OnceLock<Result<Binaries, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| build_binaries().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn build_binaries() -> anyhow::Result<Binaries> {
    let in_dir = |dir: &Path| Binaries {
        extender: dir.join("gpushare-extender"),
        device_plugin: dir.join("gpushare-device-plugin"),
        dra_plugin: dir.join("gpushare-dra-plugin"),
        kubectl_gpushare: dir.join("kubectl-gpushare"),
        isolation_library: dir.join("libgpushare_isolation.so"),
        isolation_probe: dir.join("gpushare-isolation-probe"),
    };
    if let Some(dir) = std::env::var_os("GPUSHARE_BIN_DIR") {
        return Ok(in_dir(Path::new(&dir)));
    }
    // The running executable lives in <target>/<profile>/[deps/]name: build into the same place.
    let exe = std::env::current_exe().context("locating the running executable")?;
    let profile_dir = exe
        .ancestors()
        .find(|dir| {
            matches!(
                dir.file_name().and_then(|n| n.to_str()),
                Some("debug" | "release")
            )
        })
        .context("the running executable is not under a cargo target/<profile> folder")?
        .to_path_buf();
    let target_dir = profile_dir.parent().context("target dir")?;
    let release = profile_dir.ends_with("release");
    // Test executables live in `<profile>/deps/`, this crate's binaries in `<profile>/`.
    let from_a_test = exe
        .parent()
        .is_some_and(|dir| dir.file_name().is_some_and(|name| name == "deps"));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("workspace root")?;
    let mut build = std::process::Command::new(cargo);
    // `cargo run` / `cargo test` hand their child the package's CARGO_* variables; some
    // crates read such variables at compile time, so passing them on would make this
    // nested build rebuild what a plain `cargo build` already built.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        let from_runner = [
            "CARGO_PKG_",
            "CARGO_MANIFEST_",
            "CARGO_BIN_",
            "CARGO_CRATE_",
        ]
        .iter()
        .any(|prefix| name.starts_with(prefix))
            || matches!(
                &*name,
                "CARGO_PRIMARY_PACKAGE" | "CARGO_TARGET_TMPDIR" | "OUT_DIR"
            );
        if from_runner {
            build.env_remove(&*name);
        }
    }
    build.current_dir(workspace).args(["build", "--quiet"]);
    if release {
        build.arg("--release");
    }
    if !from_a_test {
        // The demo, realload: this crate beside the binaries' packages.
        build.args(["-p", env!("CARGO_PKG_NAME")]);
        for binary in BINARIES {
            build.args(["-p", binary, "--bin", binary]);
        }
        build.args(["-p", "gpushare-isolation", "--lib"]);
    } else {
        // A test: what the README's `cargo test --workspace --all-targets` builds, whose
        // dev-dependencies add features (tokio's test-util among them). Built with the same
        // selection, the binaries are already there; built without dev-dependencies, most of
        // the graph would compile a second time.
        build.args(["--workspace", "--lib", "--bins", "--tests"]);
    }
    build.arg("--target-dir").arg(target_dir);
    let status = build
        .status()
        .context("running cargo build for our binaries")?;
    if !status.success() {
        bail!("cargo build of {} failed ({status})", BINARIES.join(", "));
    }
    Ok(in_dir(&profile_dir))
}
