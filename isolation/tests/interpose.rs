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
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

// The budget crate, not this one: the test does not link the interposer's exports itself.
use gpushare_isolation_budget::{
    ENV_LIMITS_FILE, Limits, PreparedLimits, Snapshot, budget_path, prepare,
};

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

    /// One GPU with a share of `gib`, prepared as the plugins prepare a container: the
    /// budget and a limits file naming it (under `prepared/`), the limits file named by
    /// `GPUSHARE_ISOLATION_LIMITS_FILE`; no limits in the environment. Every user may reach
    /// both (a test runs the probe as another user).
    fn prepared(gib: u32) -> Self {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let prepared = dir.path().join("prepared");
        std::fs::create_dir(&prepared).unwrap();
        for d in [dir.path(), &prepared] {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let limits = Limits::new(vec![u64::from(gib) << 30]);
        let budget = budget_path(&prepared, "container", &limits);
        let limits_file = prepared.join("limits");
        let limits = PreparedLimits {
            budget,
            shares: limits.shares().to_vec(),
            uuids: Vec::new(),
            context_mib: Some(0),
            managed_memory: None,
        };
        prepare(&limits.budget, &limits_file, &limits).unwrap();
        Self {
            dir,
            vars: vec![(ENV_LIMITS_FILE, limits_file.display().to_string())],
            fake_gpus: 1,
        }
    }

    /// The budget [`Container::prepared`] made.
    fn prepared_budget(&self) -> PathBuf {
        let text = std::fs::read_to_string(self.dir.path().join("prepared/limits")).unwrap();
        PreparedLimits::parse(&text).unwrap().budget
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

    /// Runs `command` (a probe, maybe [`wrap`]ped) to its end, whatever its exit.
    fn output(&self, mut command: Command) -> (ExitStatus, Output) {
        let out = command.stdin(Stdio::null()).output().unwrap();
        (
            out.status,
            Output {
                lines: String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .map(str::to_owned)
                    .collect(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            },
        )
    }

    /// Starts the probe and waits until it holds (its last step is `hold`).
    fn hold(&self, via: &str, steps: &[&str]) -> Holder {
        self.hold_command(self.command(via, steps))
    }

    /// Starts `command` (a probe, maybe [`wrap`]ped) and waits until it holds.
    fn hold_command(&self, mut command: Command) -> Holder {
        let mut child = command.stdout(Stdio::piped()).spawn().unwrap();
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

/// `probe` run through `prefix` (`unshare ...`, `setpriv ...`): same arguments and
/// environment.
fn wrap(prefix: &[&str], probe: &Command) -> Command {
    let mut command = Command::new(prefix[0]);
    command
        .args(&prefix[1..])
        .arg(probe.get_program())
        .args(probe.get_args());
    for (name, value) in probe.get_envs() {
        match value {
            Some(value) => command.env(name, value),
            None => command.env_remove(name),
        };
    }
    command
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

/// The one line a process that refuses everything says, or a failure.
fn the_refusal_line(out: &Output) -> &str {
    assert_eq!(out.stderr.lines().count(), 1, "{}", out.stderr);
    let line = out.stderr.trim_end();
    assert!(
        line.starts_with("gpushare-isolation: refusing all GPU memory: "),
        "{line}"
    );
    line
}

/// Limits that are set but cannot be applied refuse everything: even device 0's context (a
/// context holds device memory too), so the probe cannot start.
fn assert_refused_at_start(status: ExitStatus, out: &Output) {
    assert!(!status.success(), "{:?}", out.lines);
    assert_eq!(
        out.lines,
        ["error message=making_device_0_current:_device_dev=0_result=2"],
        "{}",
        out.stderr
    );
}

#[test]
fn bad_limits_refuse_everything_with_one_line_on_stderr() {
    let mut container = Container::unlimited();
    container.vars = vec![("GPUSHARE_CONTAINER_MEM_GIB", "four".into())];
    let (status, out) = container.output(container.command("link", &["alloc:mem:8192"]));
    assert_refused_at_start(status, &out);
    assert!(
        the_refusal_line(&out).contains("GPUSHARE_CONTAINER_MEM_GIB"),
        "{}",
        out.stderr
    );
    // A query still answers: no share is known, so the driver's total, nothing free.
    let (status, out) = container.output(container.command("link", &["no-context", "nvml-info:0"]));
    assert!(status.success(), "{out:?}", out = out.lines);
    assert_eq!(out.one("nvml-info", "result"), 0);
    assert_eq!(mib(out.one("nvml-info", "total")), FAKE_GPU_MIB);
    assert_eq!(out.one("nvml-info", "free"), 0);

    // A budget directory that cannot be made (a file is in the way).
    let mut container = Container::one_gpu(4);
    let blocked = container.dir.path().join("blocked");
    std::fs::write(&blocked, b"").unwrap();
    container
        .vars
        .push(("GPUSHARE_ISOLATION_DIR", blocked.display().to_string()));
    let (status, out) = container.output(container.command("getproc", &["alloc:mem:8192"]));
    assert_refused_at_start(status, &out);
    the_refusal_line(&out);
}

#[test]
fn a_budget_that_fails_validation_refuses_everything_and_says_why() {
    // One byte over the header (its version), then a file of the wrong length: each refuses
    // everything, in a prepared container and in one run from the environment.
    type Damage = fn(&Path);
    let damage: [(&str, Damage); 2] = [
        ("a byte over the header", |path| {
            use std::os::unix::fs::FileExt as _;
            let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
            file.write_all_at(&[7], 8).unwrap();
        }),
        ("the wrong length", |path| {
            let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
            file.set_len(4096).unwrap();
        }),
    ];
    for (what, damage) in damage {
        let prepared = Container::prepared(4);
        let budget = prepared.prepared_budget();
        damage(&budget);
        let (status, out) = prepared.output(prepared.command("link", &["alloc:mem:1"]));
        assert_refused_at_start(status, &out);
        let line = the_refusal_line(&out);
        assert!(
            line.contains(&budget.display().to_string()),
            "{what}: {line}"
        );
        assert!(line.contains("restart the pod"), "{what}: {line}");
        // A query still answers: the share as total, nothing free.
        let (status, out) =
            prepared.output(prepared.command("dlsym", &["no-context", "nvml-info:0", "device:0"]));
        assert!(status.success(), "{what}: {:?}", out.lines);
        assert_eq!(out.one("nvml-info", "result"), 0, "{what}");
        assert_eq!(mib(out.one("nvml-info", "total")), 4096, "{what}");
        assert_eq!(out.one("nvml-info", "free"), 0, "{what}");
        assert_eq!(out.one("device", "result"), 2, "{what}: no context either");
        the_refusal_line(&out);

        // Limits from the environment: a damaged budget is not passed over either.
        let from_env = Container::one_gpu(4);
        let path = budget_path(from_env.dir.path(), "default", &Limits::new(vec![4 << 30]));
        assert_eq!(from_env.run("link", &["alloc:mem:1"]).allocs(), [0]);
        damage(&path);
        let (status, out) = from_env.output(from_env.command("link", &["alloc:mem:1"]));
        assert_refused_at_start(status, &out);
        the_refusal_line(&out);
    }
    // A limits file that names no budget there: refused too (the budget is never made here).
    let prepared = Container::prepared(4);
    let budget = prepared.prepared_budget();
    std::fs::remove_file(&budget).unwrap();
    let (status, out) = prepared.output(prepared.command("link", &["alloc:mem:1"]));
    assert_refused_at_start(status, &out);
    the_refusal_line(&out);
    assert!(!budget.exists());
}

#[test]
fn a_child_cannot_raise_its_limit_or_leave_its_budget_through_the_environment() {
    let container = Container::prepared(4);
    for via in WAYS {
        let mut command = container.command(via, &["alloc:mem:3072", "alloc:mem:2048", "info"]);
        command
            .env("GPUSHARE_CONTAINER_MEM_GIB", "16")
            .env("GPUSHARE_GPU_COUNT", "1")
            .env("GPUSHARE_CONTAINER_MEM_GIB_PER_GPU", "16")
            .env("GPUSHARE_ISOLATION_KEY", "another")
            .env("GPUSHARE_MANAGED_MEMORY", "ignore");
        let (status, out) = container.output(command);
        assert!(status.success(), "{via}: {:?}\n{}", out.lines, out.stderr);
        assert_eq!(out.allocs(), [0, 2], "{via}: {:?}", out.lines);
        assert_eq!(mib(out.one("cuda", "total")), 4096, "{via}");
        assert_eq!(out.stderr, "", "{via}");
        // Counted in the prepared budget (the probe is gone, not yet reclaimed).
        let snapshot = Snapshot::read(&container.prepared_budget()).unwrap();
        assert_eq!(snapshot.gpus[0].share, 4096 * MIB, "{via}");
        assert!(
            snapshot.processes.iter().any(|p| p.used == [3072 * MIB]),
            "{via}: {snapshot:?}"
        );
        assert_eq!(
            snapshot.gpus[0].refused,
            1 + WAYS.iter().position(|w| *w == via).unwrap() as u64
        );
        // Reclaimed for the next way.
        assert_eq!(container.run(via, &["info"]).allocs(), [0; 0]);
    }
    // Nothing made where the environment points.
    let made: Vec<_> = std::fs::read_dir(container.dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(made, ["prepared"]);
}

/// A prefix that runs a program in a new PID namespace, `None` where the kernel allows none.
fn pid_namespace() -> Option<&'static [&'static str]> {
    const AS_ROOT: &[&str] = &["unshare", "--pid", "--fork", "--kill-child"];
    const IN_USER_NS: &[&str] = &[
        "unshare",
        "--user",
        "--map-root-user",
        "--pid",
        "--fork",
        "--kill-child",
    ];
    [AS_ROOT, IN_USER_NS].into_iter().find(|prefix| {
        Command::new(prefix[0])
            .args(&prefix[1..])
            .arg("true")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

#[test]
fn two_pid_namespaces_sharing_a_budget_never_pass_it() {
    let Some(prefix) = pid_namespace() else {
        eprintln!(
            "SKIPPED two_pid_namespaces_sharing_a_budget_never_pass_it: the kernel refuses \
             a new PID namespace (unshare --pid, with or without a user namespace)"
        );
        return;
    };
    // Prepared by the plugin, and made from the environment: both judge slots by their locks.
    for container in [Container::prepared(4), Container::one_gpu(4)] {
        let budget = if container.vars[0].0 == ENV_LIMITS_FILE {
            container.prepared_budget()
        } else {
            budget_path(
                container.dir.path(),
                "default",
                &Limits::new(vec![4096 * MIB]),
            )
        };
        // A: pid 1 of its namespace, 3 GiB held.
        let a = container.hold_command(wrap(
            prefix,
            &container.command("link", &["alloc:mem:3072", "hold"]),
        ));
        assert_eq!(a.output.allocs(), [0]);
        for via in WAYS {
            // B: pid 1 of another namespace, where A's pid means another process (or itself).
            let b = wrap(
                prefix,
                &container.command(via, &["info", "alloc:mem:3072", "info"]),
            );
            let (status, out) = container.output(b);
            assert!(status.success(), "{via}: {:?}\n{}", out.lines, out.stderr);
            assert_eq!(out.allocs(), [2], "{via}: B got A's share: {:?}", out.lines);
            assert_eq!(out.all("cuda", "free"), [1024 * MIB; 2], "{via}");
            let snapshot = Snapshot::read(&budget).unwrap();
            assert_eq!(
                snapshot.gpus[0].used,
                3072 * MIB,
                "{via}: A's 3 GiB still counted"
            );
        }
        // A gone: its lock went with it, and B gets the share back.
        a.kill();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let b = wrap(prefix, &container.command("link", &["alloc:mem:3072"]));
            let (status, out) = container.output(b);
            assert!(status.success(), "{:?}\n{}", out.lines, out.stderr);
            if out.allocs() == [0] {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "A's 3 GiB not back 5 s after it died"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A fork child outliving its parent does not keep the parent's slot alive: it let go of
/// the parent's slot lock (its copy of the lock descriptor) at the fork.
#[test]
fn a_forked_child_does_not_keep_its_dead_parents_share() {
    let container = Container::prepared(4);
    let parent = container.hold("link", &["alloc:mem:3072", "fork-sleep", "hold"]);
    assert_eq!(parent.output.allocs(), [0]);
    let child = parent.output.one("fork-sleep", "child");
    let child = libc::pid_t::try_from(child).unwrap();
    parent.kill();
    let deadline = Instant::now() + Duration::from_secs(5);
    let back = loop {
        let free = mib(container.run("link", &["info"]).one("cuda", "free"));
        if free == 4096 || Instant::now() >= deadline {
            break free;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // SAFETY: signals the sleeping child this test's probe forked.
    unsafe { libc::kill(child, libc::SIGKILL) };
    assert_eq!(back, 4096, "the parent's 3 GiB kept by its live child");
}

#[test]
fn a_prepared_budget_serves_another_user() {
    // The plugin (root) prepares the budget; the container runs as another user.
    // SAFETY: getuid has no preconditions.
    let root = unsafe { libc::getuid() } == 0;
    let container = Container::prepared(4);
    let probe = container.command("link", &["alloc:mem:3072", "alloc:mem:2048", "info"]);
    let command = if root {
        wrap(
            &["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups"],
            &probe,
        )
    } else {
        eprintln!("a_prepared_budget_serves_another_user: not root, the probe runs as this user");
        probe
    };
    let (status, out) = container.output(command);
    assert!(status.success(), "{:?}\n{}", out.lines, out.stderr);
    assert_eq!(out.allocs(), [0, 2], "{:?}", out.lines);
    assert_eq!(out.stderr, "");
    let snapshot = Snapshot::read(&container.prepared_budget()).unwrap();
    assert_eq!(snapshot.gpus[0].used, 3072 * MIB);
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
