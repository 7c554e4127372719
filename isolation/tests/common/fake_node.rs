//! The harness of `real_programs.rs`: a node of fake GPUs (`isolation/probe/fake/libcuda.rs`)
//! whose state file (`FAKE_GPU_STATE`) says what every process holds on each physical GPU,
//! containers on it (their limits and a budget directory of their own), the probe run to its
//! end or stopped at its `wait` and `hold` steps, and what it printed.
//!
//! Kept apart from the scenarios so that the test file reads as what must hold; compiled
//! into that test and into `compute.rs` (which also reads what kernels the fake GPUs ran).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use crate::common::built;

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// The UUID the fake gives physical GPU `i` (documented in `fake/libcuda.rs`).
pub fn uuid(i: usize) -> String {
    format!("GPU-00000000-0000-0000-0000-0000000000{i:02x}")
}

/// A node: fake GPUs and the state file every process on it shares.
pub struct Node {
    dir: tempfile::TempDir,
    gpus: usize,
    mem_mib: u64,
    context_mib: u64,
}

impl Node {
    pub fn new(gpus: usize, mem_mib: u64, context_mib: u64) -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
            gpus,
            mem_mib,
            context_mib,
        }
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("gpu-state")
    }

    /// The node-wide directory of the compute state files (`GPUSHARE_COMPUTE_DIR`).
    #[allow(dead_code)] // compute.rs's; real_programs.rs runs no kernels
    pub fn compute_dir(&self) -> &Path {
        self.dir.path()
    }

    /// Every kernel (or graph) the fake GPUs ran: `(pid, physical GPU, start ns, end ns)`,
    /// from the fake's log (`FAKE_GPU_STATE.kernels`, see `fake/state.rs`).
    #[allow(dead_code)] // as compute_dir
    pub fn runs(&self) -> Vec<(u32, usize, u64, u64)> {
        let mut log = self.state().into_os_string();
        log.push(".kernels");
        std::fs::read_to_string(log)
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let w: Vec<u64> = l
                    .split_whitespace()
                    .map(|w| w.parse().unwrap_or_else(|_| panic!("bad kernel line {l}")))
                    .collect();
                (w[0] as u32, w[1] as usize, w[2], w[3])
            })
            .collect()
    }

    /// What the device holds: bytes per physical GPU for each live process.
    pub fn holdings(&self) -> HashMap<u32, Vec<u64>> {
        let text = std::fs::read_to_string(self.state()).unwrap_or_default();
        text.lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .filter_map(|l| {
                let words: Vec<u64> = l
                    .split_whitespace()
                    .map(|w| w.parse().unwrap_or_else(|_| panic!("bad state line {l}")))
                    .collect();
                let (pid, start) = (words[0] as u32, words[1]);
                let mut used = words[2..].to_vec();
                used.resize(self.gpus, 0);
                (start_time(pid) == Some(start)).then_some((pid, used))
            })
            .collect()
    }

    /// What physical GPU `gpu` holds, for every process.
    pub fn device(&self, gpu: usize) -> u64 {
        self.holdings().values().map(|u| u[gpu]).sum()
    }

    /// What physical GPU `gpu` holds for the processes `pids`.
    pub fn held_by(&self, pids: &[u32], gpu: usize) -> u64 {
        self.holdings()
            .iter()
            .filter(|(pid, _)| pids.contains(pid))
            .map(|(_, u)| u[gpu])
            .sum()
    }
}

/// The start time of a live, not zombie, process (field 22 of /proc/PID/stat).
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat[stat.rfind(')')? + 1..].split_whitespace().collect();
    if matches!(fields.first(), Some(&"Z" | &"X") | None) {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// A container on a node: its environment and a budget directory of its own.
pub struct Container<'n> {
    node: &'n Node,
    dir: tempfile::TempDir,
    pub vars: Vec<(&'static str, String)>,
}

impl<'n> Container<'n> {
    /// Physical GPUs `gpus` (in share order), a share of `gib` GiB on each.
    pub fn new(node: &'n Node, gpus: &[usize], gib: u32) -> Self {
        let limits = if gpus.len() == 1 {
            vec![("GPUSHARE_CONTAINER_MEM_GIB", gib.to_string())]
        } else {
            vec![
                ("GPUSHARE_GPU_COUNT", gpus.len().to_string()),
                ("GPUSHARE_CONTAINER_MEM_GIB_PER_GPU", gib.to_string()),
            ]
        };
        let uuids: Vec<String> = gpus.iter().map(|&g| uuid(g)).collect();
        let mut vars = limits;
        vars.push(("GPUSHARE_GPU_UUID", uuids.join(",")));
        vars.push(("GPUSHARE_CONTEXT_MIB", node.context_mib.to_string()));
        Self {
            node,
            dir: tempfile::tempdir().unwrap(),
            vars,
        }
    }

    pub fn with(mut self, name: &'static str, value: &str) -> Self {
        self.vars.push((name, value.to_string()));
        self
    }

    pub fn command(&self, probe: &Path, via: &str, steps: &[&str]) -> Command {
        let built = built();
        let mut command = Command::new(probe);
        for (name, _) in std::env::vars_os() {
            let name = name.to_string_lossy();
            if name.starts_with("GPUSHARE_")
                || name.starts_with("FAKE_")
                || name == "CUDA_VISIBLE_DEVICES"
            {
                command.env_remove(&*name);
            }
        }
        command
            .env("LD_PRELOAD", &built.interposer)
            .env(
                "LD_LIBRARY_PATH",
                gpushare_isolation_probe::fake_driver_dir(),
            )
            .env("FAKE_GPU_COUNT", self.node.gpus.to_string())
            .env("FAKE_GPU_MEM_MIB", self.node.mem_mib.to_string())
            .env("FAKE_GPU_STATE", self.node.state())
            .env("FAKE_CONTEXT_MIB", self.node.context_mib.to_string())
            .env("FAKE_MANAGED_ON_HOST", "1")
            .env("GPUSHARE_ISOLATION_DIR", self.dir.path())
            .envs(self.vars.iter().map(|(k, v)| (k, v)))
            .args(["--via", via])
            .args(steps);
        command
    }

    /// Starts the linked probe; stop at each `wait` step with [`Session::stop`].
    pub fn start(&self, via: &str, steps: &[&str]) -> Session {
        self.start_command(self.command(&built().probe, via, steps), steps)
    }

    pub fn start_command(&self, mut command: Command, steps: &[&str]) -> Session {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let stdin = child.stdin.take();
        Session {
            pid: child.id(),
            child,
            stdout,
            stdin,
            steps: steps.join(" "),
        }
    }

    /// Runs the probe to its end; its output.
    pub fn run(&self, via: &str, steps: &[&str]) -> Output {
        let out = self
            .command(&built().probe, via, steps)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let lines = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect();
        let output = Output { lines };
        assert!(
            out.status.success(),
            "probe --via {via} {steps:?} failed: {}\n{:?}\n{}",
            out.status,
            output.lines,
            String::from_utf8_lossy(&out.stderr)
        );
        output
    }
}

/// A running probe, stopped at its `wait` and `hold` steps.
pub struct Session {
    child: Child,
    pub pid: u32,
    stdout: BufReader<ChildStdout>,
    stdin: Option<ChildStdin>,
    steps: String,
}

impl Session {
    /// Resumes (after the first call) and reads up to the next `waiting` or `holding`.
    pub fn stop(&mut self) -> Output {
        let mut lines = Vec::new();
        loop {
            let mut line = String::new();
            let n = self.stdout.read_line(&mut line).unwrap();
            let line = line.trim_end().to_owned();
            if n == 0 || line.starts_with("error") {
                let mut stderr = String::new();
                if let Some(mut e) = self.child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut stderr);
                }
                panic!(
                    "the probe ({}) ended before its next stop: {lines:?} {line}\n{stderr}",
                    self.steps
                );
            }
            if line == "waiting" || line == "holding" {
                return Output { lines };
            }
            lines.push(line);
        }
    }

    /// Lets a `wait` step go on.
    pub fn resume(&mut self) {
        let stdin = self.stdin.as_mut().unwrap();
        stdin.write_all(b"\n").unwrap();
        stdin.flush().unwrap();
    }

    /// Resumes and reads up to the next stop.
    pub fn next(&mut self) -> Output {
        self.resume();
        self.stop()
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct Output {
    pub lines: Vec<String>,
}

impl Output {
    /// Field `key` of every line that starts with `word`.
    pub fn all(&self, word: &str, key: &str) -> Vec<u64> {
        self.lines
            .iter()
            .filter(|l| l.split(' ').next() == Some(word))
            .map(|l| {
                l.split(' ')
                    .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
                    .unwrap_or_else(|| panic!("no {key} in {l}"))
                    .parse()
                    .unwrap_or_else(|_| panic!("{key} in {l} is not a number"))
            })
            .collect()
    }

    /// The allocation results, in order.
    pub fn allocs(&self) -> Vec<u64> {
        self.all("alloc", "result")
    }

    /// Field `key` of the only (or last) line that starts with `word`.
    pub fn one(&self, word: &str, key: &str) -> u64 {
        *self
            .all(word, key)
            .last()
            .unwrap_or_else(|| panic!("no {word} line in {:?}", self.lines))
    }
}

/// Asserts that physical GPU `gpu` holds at most `limit` bytes (for every process).
pub fn assert_device_within(node: &Node, gpu: usize, limit: u64, what: &str, out: &Output) {
    let held = node.device(gpu);
    assert!(
        held <= limit,
        "{what}: GPU {gpu} holds {} MiB, past {} MiB: {:?}\nstate: {:?}",
        held / MIB,
        limit / MIB,
        out.lines,
        node.holdings()
    );
}
