//! kubectl, helm and promtool for the tests that need the real tools, installed on first use
//! by the project's own `scripts/install-tools.sh` into `<repo>/.tools/bin` (gitignored).
//!
//! Installation is idempotent and serialized twice over: a process-wide mutex for test
//! threads, and an exclusive file lock on `.tools/.install.lock` for parallel test binaries.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use anyhow::{Context, bail};

static INSTALL: Mutex<()> = Mutex::new(());

/// The repository root (the workspace this crate lives in).
pub(crate) fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// Path to a kubectl binary, installing it on first use.
pub fn kubectl() -> anyhow::Result<PathBuf> {
    tool("kubectl")
}

/// Path to a helm binary, installing it on first use.
pub fn helm() -> anyhow::Result<PathBuf> {
    tool("helm")
}

/// Path to a promtool binary (Prometheus's rule checker), installing it on first use.
pub fn promtool() -> anyhow::Result<PathBuf> {
    tool("promtool")
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
}

fn tool(name: &str) -> anyhow::Result<PathBuf> {
    let root = repo_root();
    let tools = root.join(".tools");
    let path = tools.join("bin").join(name);
    let _guard = INSTALL.lock().unwrap_or_else(|poison| poison.into_inner());
    if is_executable(&path) {
        return Ok(path);
    }
    std::fs::create_dir_all(&tools).with_context(|| format!("creating {}", tools.display()))?;
    let lock_path = tools.join(".install.lock");
    let lock =
        File::create(&lock_path).with_context(|| format!("creating {}", lock_path.display()))?;
    lock.lock()
        .with_context(|| format!("locking {}", lock_path.display()))?;
    if is_executable(&path) {
        return Ok(path);
    }
    let script = root.join("scripts").join("install-tools.sh");
    let output = Command::new("bash")
        .arg(&script)
        .current_dir(&root)
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !output.status.success() {
        bail!(
            "{} failed ({}): {}{}",
            script.display(),
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    if !is_executable(&path) {
        bail!(
            "{} succeeded but {} is missing",
            script.display(),
            path.display()
        );
    }
    Ok(path)
}
