//! The built `libgpushare_isolation.so`, preloaded into the probe running against the fake
//! driver: each of the three ways to the driver, every allocation path, processes sharing a
//! budget, a killed process's share coming back, two GPUs, and no limits.
//!
//! The test builds what it runs (`cargo build -p gpushare-isolation -p
//! gpushare-isolation-probe`, same cargo, profile and target folder), or takes prebuilt ones
//! from `GPUSHARE_ISOLATION_BIN_DIR` (holding `libgpushare_isolation.so` and
//! `gpushare-isolation-probe`).

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

// The budget crate, not this one: the test does not link the interposer's exports itself.
use gpushare_isolation_budget::{Limits, Snapshot, budget_path};

const MIB: u64 = 1 << 20;
const WAYS: [&str; 3] = ["link", "dlsym", "getproc"];
const PATHS: [&str; 11] = [
    "mem",
    "pitch",
    "managed",
    "async",
    "async-ptsz",
    "pool",
    "pool-ptsz",
    "vmm",
    "array",
    "array3d",
    "mipmap",
];
/// Each fake GPU's memory: more than any share here, so that refusals are the interposer's.
const FAKE_GPU_MIB: u64 = 16384;

mod common;
use common::built;

/// A container: its environment, and a budget directory of its own.
struct Container {
    dir: tempfile::TempDir,
    vars: Vec<(&'static str, String)>,
    fake_gpus: u32,
}

impl Container {
    /// One GPU with a share of `gib`.
    fn one_gpu(gib: u32) -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
            vars: vec![("GPUSHARE_CONTAINER_MEM_GIB", gib.to_string())],
            fake_gpus: 1,
        }
    }

    /// `count` GPUs with a share of `gib` each.
    fn gpus(count: u32, gib: u32) -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
            vars: vec![
                ("GPUSHARE_GPU_COUNT", count.to_string()),
                ("GPUSHARE_CONTAINER_MEM_GIB_PER_GPU", gib.to_string()),
            ],
            fake_gpus: count,
        }
    }

    /// No limits at all.
    fn unlimited() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
            vars: vec![],
            fake_gpus: 1,
        }
    }

    fn command(&self, via: &str, steps: &[&str]) -> Command {
        let built = built();
        let mut command = Command::new(&built.probe);
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("GPUSHARE_") {
                command.env_remove(name);
            }
        }
        command
            .env("LD_PRELOAD", &built.interposer)
            .env(
                "LD_LIBRARY_PATH",
                gpushare_isolation_probe::fake_driver_dir(),
            )
            .env("FAKE_GPU_COUNT", self.fake_gpus.to_string())
            .env("FAKE_GPU_MEM_MIB", FAKE_GPU_MIB.to_string())
            .env("GPUSHARE_ISOLATION_DIR", self.dir.path())
            // These tests count allocations alone; what contexts cost is
            // real_programs.rs's.
            .env("GPUSHARE_CONTEXT_MIB", "0")
            .envs(self.vars.iter().map(|(k, v)| (k, v)))
            .args(["--via", via])
            .args(steps);
        command
    }

    /// Runs the probe to its end; its output lines.
    fn run(&self, via: &str, steps: &[&str]) -> Output {
        let out = self.command(via, steps).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(
            out.status.success(),
            "probe --via {via} {steps:?} failed: {}\n{stdout}{stderr}",
            out.status
        );
        Output {
            lines: stdout.lines().map(str::to_owned).collect(),
            stderr,
        }
    }

    /// Starts the probe and waits until it holds (its last step is `hold`).
    fn hold(&self, via: &str, steps: &[&str]) -> Holder {
        let mut child = self
            .command(via, steps)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = Vec::new();
        let mut reader = BufReader::new(child.stdout.take().unwrap());
        loop {
            let mut line = String::new();
            assert!(
                reader.read_line(&mut line).unwrap() > 0,
                "the probe ended before holding: {lines:?}"
            );
            let line = line.trim_end().to_owned();
            if line == "holding" {
                break;
            }
            lines.push(line);
        }
        Holder {
            child,
            output: Output {
                lines,
                stderr: String::new(),
            },
        }
    }
}

struct Holder {
    child: Child,
    output: Output,
}

impl Holder {
    /// SIGKILL, and reap it.
    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Output {
    lines: Vec<String>,
    stderr: String,
}

impl Output {
    /// Field `key` of every line that starts with `word`.
    fn all(&self, word: &str, key: &str) -> Vec<u64> {
        self.lines
            .iter()
            .filter(|l| l.split(' ').next() == Some(word))
            .map(|l| {
                l.split(' ')
                    .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
                    .unwrap_or_else(|| panic!("no {key} in {l}"))
                    .parse()
                    .unwrap()
            })
            .collect()
    }

    /// The allocation results, in order.
    fn allocs(&self) -> Vec<u64> {
        self.all("alloc", "result")
    }

    /// Field `key` of the only (or last) line that starts with `word`.
    fn one(&self, word: &str, key: &str) -> u64 {
        *self
            .all(word, key)
            .last()
            .unwrap_or_else(|| panic!("no {word} line in {:?}", self.lines))
    }
}

fn mib(bytes: u64) -> u64 {
    bytes / MIB
}

#[test]
fn each_way_sees_the_share_through_cuda_and_nvml() {
    let container = Container::one_gpu(4);
    for via in WAYS {
        let out = container.run(via, &["info"]);
        for word in ["cuda", "cuda-total", "nvml", "nvml2"] {
            assert_eq!(mib(out.one(word, "total")), 4096, "{via} {word}");
            assert_eq!(out.one(word, "result"), 0, "{via} {word}");
        }
        for word in ["cuda", "nvml", "nvml2"] {
            assert_eq!(mib(out.one(word, "free")), 4096, "{via} {word}");
        }
        assert_eq!(out.stderr, "", "{via}");
    }
}

#[test]
fn each_way_is_refused_past_the_share_on_every_allocation_path() {
    let container = Container::one_gpu(4);
    for via in WAYS {
        for path in PATHS {
            let [big, too_much, all] = [3072, 2048, 4096].map(|m| format!("alloc:{path}:{m}"));
            let out = container.run(via, &[&big, &too_much, "info", "free", &all, "info"]);
            assert_eq!(out.allocs(), [0, 2, 0], "{via} {path}: {:?}", out.lines);
            let free = out.all("cuda", "free");
            assert_eq!(free, [1024 * MIB, 0], "{via} {path}");
            let used = out.all("nvml", "used");
            assert_eq!(used, [3072 * MIB, 4096 * MIB], "{via} {path}");
        }
    }
}

#[test]
fn processes_of_a_container_share_one_budget() {
    let container = Container::one_gpu(4);
    let holder = container.hold("link", &["alloc:mem:3072", "hold"]);
    assert_eq!(holder.output.allocs(), [0]);
    for via in WAYS {
        let out = container.run(via, &["info", "alloc:async:2048", "alloc:vmm:1024", "free"]);
        assert_eq!(mib(out.one("cuda", "free")), 1024, "{via}");
        assert_eq!(mib(out.one("nvml", "used")), 3072, "{via}");
        assert_eq!(out.allocs(), [2, 0], "{via}");
    }
    // What the plugin reads: the holder's bytes and the three refusals.
    let path = budget_path(
        container.dir.path(),
        "default",
        &Limits::new(vec![4096 * MIB]),
    );
    let snapshot = Snapshot::read(&path).unwrap();
    assert_eq!(snapshot.gpus[0].used, 3072 * MIB);
    assert_eq!(snapshot.gpus[0].refused, 3);
    let holder_pid = holder.child.id();
    assert!(
        snapshot
            .processes
            .iter()
            .any(|p| p.pid == holder_pid && p.used == [3072 * MIB])
    );
}

#[test]
fn a_killed_process_gives_its_share_back_within_5_s() {
    let container = Container::one_gpu(4);
    for via in WAYS {
        let holder = container.hold(via, &["alloc:managed:3072", "alloc:pool-ptsz:1024", "hold"]);
        assert_eq!(holder.output.allocs(), [0, 0], "{via}");
        assert_eq!(container.run(via, &["alloc:mem:1"]).allocs(), [2], "{via}");
        holder.kill();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let free = mib(container.run(via, &["info"]).one("cuda", "free"));
            if free == 4096 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{via}: {free} MiB free 5 s after the kill"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(
            container.run(via, &["alloc:mem:4096"]).allocs(),
            [0],
            "{via}"
        );
    }
}

#[test]
fn a_two_gpu_container_is_held_per_gpu() {
    let container = Container::gpus(2, 2);
    for via in WAYS {
        let out = container.run(
            via,
            &[
                "info",
                "alloc:mem:2048",
                "alloc:mem:1",
                "device:1",
                "info",
                "alloc:async-ptsz:1024",
                "alloc:vmm:1024:0", // names GPU 0, which is full
                "alloc:vmm:1024:1",
                "alloc:array:1",
                "info",
            ],
        );
        assert_eq!(out.allocs(), [0, 2, 0, 2, 0, 2], "{via}: {:?}", out.lines);
        assert_eq!(out.all("cuda-total", "total"), [2048 * MIB; 3], "{via}");
        assert_eq!(out.all("nvml2", "total"), [2048 * MIB; 3], "{via}");
        assert_eq!(
            out.all("cuda", "free"),
            [2048 * MIB, 2048 * MIB, 0],
            "{via}"
        );
        assert_eq!(out.all("cuda", "dev"), [0, 1, 1], "{via}");
    }
}

#[test]
fn without_the_variables_nothing_changes() {
    let container = Container::unlimited();
    for via in WAYS {
        let mut steps = vec!["info".to_string()];
        steps.extend(PATHS.iter().map(|p| format!("alloc:{p}:1024")));
        steps.push("info".into());
        let steps: Vec<&str> = steps.iter().map(String::as_str).collect();
        let out = container.run(via, &steps);
        assert_eq!(out.allocs(), [0; 11], "{via}");
        assert_eq!(out.all("cuda", "total"), [FAKE_GPU_MIB * MIB; 2], "{via}");
        assert_eq!(
            out.all("cuda", "free"),
            [FAKE_GPU_MIB * MIB, (FAKE_GPU_MIB - 11 * 1024) * MIB],
            "{via}"
        );
        assert_eq!(out.all("nvml2", "total"), [FAKE_GPU_MIB * MIB; 2], "{via}");
        assert_eq!(out.stderr, "", "{via}");
    }
    assert_eq!(std::fs::read_dir(container.dir.path()).unwrap().count(), 0);
}

#[test]
fn bad_limits_pass_everything_through_with_one_line_on_stderr() {
    let mut container = Container::unlimited();
    container.vars = vec![("GPUSHARE_CONTAINER_MEM_GIB", "four".into())];
    let out = container.run("link", &["alloc:mem:8192", "info", "alloc:mem:1"]);
    assert_eq!(out.allocs(), [0, 0]);
    assert_eq!(mib(out.one("cuda", "total")), FAKE_GPU_MIB);
    assert_eq!(out.stderr.lines().count(), 1, "{}", out.stderr);
    assert!(
        out.stderr
            .starts_with("gpushare-isolation: not limiting GPU memory")
    );

    // A budget directory that cannot be made (a file is in the way).
    let mut container = Container::one_gpu(4);
    let blocked = container.dir.path().join("blocked");
    std::fs::write(&blocked, b"").unwrap();
    container
        .vars
        .push(("GPUSHARE_ISOLATION_DIR", blocked.display().to_string()));
    let out = container.run("getproc", &["alloc:mem:8192", "info"]);
    assert_eq!(out.allocs(), [0]);
    assert_eq!(mib(out.one("cuda", "total")), FAKE_GPU_MIB);
    assert_eq!(out.stderr.lines().count(), 1, "{}", out.stderr);
}

#[test]
fn threads_allocating_at_once_fill_the_share_exactly() {
    let container = Container::one_gpu(4);
    for via in WAYS {
        let out = container.run(via, &["threads:8:1", "info", "free", "info"]);
        assert_eq!(out.one("threads", "allocated"), 4096, "{via}");
        assert_eq!(out.all("cuda", "free"), [0, 4096 * MIB], "{via}");
        assert_eq!(out.one("free", "result"), 0, "{via}");
    }
}

#[test]
fn a_forked_child_counts_in_a_slot_of_its_own() {
    let container = Container::one_gpu(4);
    for via in WAYS {
        // The second child's allocation fits only once the first child's share is back,
        // which needs the first child to have had its own slot (and to be dead).
        let out = container.run(
            via,
            &[
                "alloc:mem:3072",
                "fork-alloc:1024",
                "fork-alloc:1024",
                "info",
                "free",
                "info",
            ],
        );
        assert_eq!(out.allocs(), [0, 0, 0], "{via}: {:?}", out.lines);
        assert_eq!(out.all("fork", "status"), [0, 0], "{via}");
        assert_eq!(out.all("cuda", "free"), [1024 * MIB, 4096 * MIB], "{via}");
    }
}

#[test]
fn dlsym_rtld_next_stays_relative_to_its_caller() {
    // The probe asks dlsym(RTLD_NEXT, "dlsym"): after the probe comes the interposer, so the
    // answer is the interposer's dlsym, as RTLD_DEFAULT's is. Resolved relative to the
    // interposer instead, it would be glibc's.
    for container in [Container::one_gpu(4), Container::unlimited()] {
        let out = container.run("link", &["rtld-next"]);
        assert_eq!(out.one("rtld-next", "same"), 1);
    }
}

#[test]
fn a_program_gives_its_share_back_when_its_process_execs_another() {
    let container = Container::one_gpu(4);
    for via in WAYS {
        // The same process (pid and start time), a new program: the old one's 3072 MiB
        // died with its driver state.
        let out = container.run(via, &["alloc:mem:3072", "exec", "alloc:mem:4096", "info"]);
        assert_eq!(out.allocs(), [0, 0], "{via}: {:?}", out.lines);
        assert_eq!(out.one("cuda", "free"), 0, "{via}");
    }
}

#[test]
fn the_budget_is_writable_by_every_user_whatever_the_creators_umask() {
    // A root entrypoint that queries the GPU under umask 077, before the application runs as
    // another user: the file it creates must still be the application's to write.
    use std::os::unix::fs::PermissionsExt;
    let container = Container::one_gpu(4);
    let probe = container.command("link", &["alloc:mem:1"]);
    let mut shell = Command::new("sh");
    shell
        .arg("-c")
        .arg("umask 077; exec \"$@\"")
        .arg("sh")
        .arg(probe.get_program())
        .args(probe.get_args())
        .envs(probe.get_envs().filter_map(|(k, v)| Some((k, v?))));
    let out = shell.output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let path = budget_path(
        container.dir.path(),
        "default",
        &Limits::new(vec![4096 * MIB]),
    );
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o666, "{}", path.display());
}
