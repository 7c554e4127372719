//! Our binaries as child processes: started with their kubeconfig and a log file, signalled,
//! stopped or crashed, killed on drop; and what they hold in memory.
//!
//! Separate because every component the harness runs (extender, device plugins, DRA
//! plugins) is such a process, and the cluster only decides which and when.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use tokio::process::{Child, Command};

/// A child process of ours, killed on drop.
#[derive(Debug)]
pub struct Process {
    name: String,
    child: Child,
}

impl Process {
    /// Starts `program` with `args`, `KUBECONFIG` set and its output appended to `log`;
    /// `RUST_LOG` comes from `GPUSHARE_E2E_LOG` (default `info`).
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        kubeconfig: &Path,
        log: &Path,
    ) -> anyhow::Result<Self> {
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        let child = Command::new(program)
            .args(args)
            .env("KUBECONFIG", kubeconfig)
            .env(
                "RUST_LOG",
                std::env::var("GPUSHARE_E2E_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::from(log_file.try_clone()?))
            .stderr(Stdio::from(log_file))
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        Ok(Self {
            name: name.to_owned(),
            child,
        })
    }

    /// Sends the signal named `signal` (`TERM`, `STOP`, `CONT`) to the process.
    pub async fn signal(&self, signal: &str) {
        if let Some(pid) = self.child.id() {
            let _ = Command::new("kill")
                .arg(format!("-{signal}"))
                .arg(pid.to_string())
                .status()
                .await;
        }
    }

    /// Asks the process to stop (SIGTERM) and waits up to 5 s, then kills it.
    pub async fn stop(self) {
        self.signal("TERM").await;
        self.wait_stopped().await;
    }

    /// Waits up to 5 s for the process to exit, then kills it.
    pub async fn wait_stopped(mut self) {
        if tokio::time::timeout(Duration::from_secs(5), self.child.wait())
            .await
            .is_err()
        {
            tracing::warn!(process = %self.name, "did not stop on SIGTERM; killing");
            let _ = self.child.kill().await;
        }
    }

    /// Kills the process at once (SIGKILL), as a crash would.
    pub async fn crash(mut self) {
        let _ = self.child.kill().await;
    }

    /// The OS process id, while the process has not been reaped (for reading `/proc/<pid>`).
    pub fn id(&self) -> Option<u32> {
        self.child.id()
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// How the process ended, once it has.
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

/// The last `lines` lines of a text file ("" if it cannot be read).
pub fn file_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let last: Vec<&str> = text.lines().rev().take(lines).collect();
    last.into_iter().rev().collect::<Vec<_>>().join("\n")
}

/// Memory held by the harness and our child processes (proportional set size), in KiB.
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryUse {
    /// The test or demo process: API server, scheduler driver, kubelet drivers.
    pub harness_kib: u64,
    /// `gpushare-extender`.
    pub extender_kib: u64,
    /// Every `gpushare-device-plugin` together.
    pub device_plugins_kib: u64,
    /// How many device plugins that is.
    pub device_plugins: usize,
}

impl MemoryUse {
    pub fn total_kib(&self) -> u64 {
        self.harness_kib + self.extender_kib + self.device_plugins_kib
    }
}

impl std::fmt::Display for MemoryUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |kib: u64| kib / 1024;
        write!(
            f,
            "{} MiB in all: harness {} MiB, extender {} MiB, {} device plugins {} MiB",
            mib(self.total_kib()),
            mib(self.harness_kib),
            mib(self.extender_kib),
            self.device_plugins,
            mib(self.device_plugins_kib)
        )
    }
}

/// Memory a process holds, in KiB: its proportional set size (`Pss`: private pages plus its
/// share of pages shared with others, so that a sum over processes counts the binary's code
/// once), else `VmRSS`. None where there is no `/proc`.
pub(super) fn memory_kib(pid: u32) -> Option<u64> {
    let field = |file: &str, name: &str| {
        let text = std::fs::read_to_string(format!("/proc/{pid}/{file}")).ok()?;
        text.lines()
            .find_map(|line| line.strip_prefix(name))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    field("smaps_rollup", "Pss:").or_else(|| field("status", "VmRSS:"))
}
