//! What the isolation tests that run programs share: the interposer and the probes they
//! preload it into, built once per test binary (`cargo build`, same cargo, profile and
//! target folder as the test), or taken prebuilt from `GPUSHARE_ISOLATION_BIN_DIR` (holding
//! `libgpushare_isolation.so`, `gpushare-isolation-probe` and `gpushare-isolation-probe-dl`:
//! CI points it at the library that ships).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use anyhow::{Context, bail};

/// The files the tests run.
pub struct Built {
    /// `libgpushare_isolation.so`.
    pub interposer: PathBuf,
    /// The probe linked to the driver by name.
    pub probe: PathBuf,
    /// The probe that only `dlopen`s the driver.
    #[allow(dead_code)] // not every test file runs it
    pub probe_dl: PathBuf,
}

/// The files, built on first use.
pub fn built() -> &'static Built {
    static BUILT: OnceLock<Result<Built, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| build().map_err(|e| format!("{e:#}")))
        .as_ref()
        .expect("building the interposer and the probes")
}

fn build() -> anyhow::Result<Built> {
    let in_dir = |dir: &Path| Built {
        interposer: dir.join("libgpushare_isolation.so"),
        probe: dir.join("gpushare-isolation-probe"),
        probe_dl: dir.join("gpushare-isolation-probe-dl"),
    };
    if let Some(dir) = std::env::var_os("GPUSHARE_ISOLATION_BIN_DIR") {
        return Ok(in_dir(Path::new(&dir)));
    }
    // This test runs from <target>/<profile>/deps: build into the same place.
    let exe = std::env::current_exe().context("locating the test executable")?;
    let profile_dir = exe
        .ancestors()
        .find(|d| {
            matches!(
                d.file_name().and_then(|n| n.to_str()),
                Some("debug" | "release")
            )
        })
        .context("the test executable is not under a cargo target/<profile> folder")?
        .to_path_buf();
    let target_dir = profile_dir.parent().context("target folder")?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(cargo);
    // The runner's per-package variables would make the nested build differ from a plain one.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if [
            "CARGO_PKG_",
            "CARGO_MANIFEST_",
            "CARGO_BIN_",
            "CARGO_CRATE_",
        ]
        .iter()
        .any(|p| name.starts_with(p))
            || matches!(
                &*name,
                "CARGO_PRIMARY_PACKAGE" | "CARGO_TARGET_TMPDIR" | "OUT_DIR"
            )
        {
            build.env_remove(&*name);
        }
    }
    build
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["build", "--quiet", "--lib", "--bins"])
        .args(["-p", "gpushare-isolation", "-p", "gpushare-isolation-probe"])
        .arg("--target-dir")
        .arg(target_dir);
    if profile_dir.ends_with("release") {
        build.arg("--release");
    }
    let status = build.status().context("running cargo build")?;
    if !status.success() {
        bail!("cargo build of the interposer and the probes failed ({status})");
    }
    Ok(in_dir(&profile_dir))
}
