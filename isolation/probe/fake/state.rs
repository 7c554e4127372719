// The fake driver's device-wide state, shared by every process that names the same file in
// `FAKE_GPU_STATE`. Included (`include!`) by `libcuda.rs` and `libnvidia-ml.rs`; std only.
//
// The format (text, one line per process that holds device memory; `#` lines are comments):
//
//     # gpushare fake GPU state v1: PID START_TIME BYTES_ON_GPU0 BYTES_ON_GPU1 ...
//     4242 1234567 3221225472 0
//
// PID and START_TIME (field 22 of /proc/PID/stat) name a process; the bytes are what it holds
// on each physical GPU (index = physical GPU, not CUDA ordinal): its contexts, allocations,
// pool and graph-pool reservations. Every read-modify-write holds an exclusive `flock` on the
// file. A line whose process is gone (no /proc/PID/stat, a zombie, or another start time) is
// dropped: the real driver frees a process's memory when it dies. A process with nothing on
// the device has no line. A new program image (exec) writes its line afresh at `cuInit`.

#[allow(dead_code)]
mod state {
    use std::io::{Read, Seek, Write};
    use std::path::Path;

    /// One process's line.
    pub struct Entry {
        pub pid: u32,
        pub start: u64,
        pub used: Vec<u64>,
    }

    /// The start time of a live (not zombie) process, from /proc/PID/stat.
    pub fn start_time(pid: u32) -> Option<u64> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let rest = &stat[stat.rfind(')')? + 1..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if matches!(fields.first(), Some(&"Z") | Some(&"X") | None) {
            return None;
        }
        fields.get(19)?.parse().ok()
    }

    pub fn parse(text: &str) -> Vec<Entry> {
        text.lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .filter_map(|l| {
                let mut words = l.split_whitespace();
                let pid = words.next()?.parse().ok()?;
                let start = words.next()?.parse().ok()?;
                let used = words.map(|w| w.parse().unwrap_or(0)).collect();
                Some(Entry { pid, start, used })
            })
            .collect()
    }

    fn render(entries: &[Entry]) -> String {
        let mut text = String::from(
            "# gpushare fake GPU state v1: PID START_TIME BYTES_ON_GPU0 BYTES_ON_GPU1 ...\n",
        );
        for e in entries.iter().filter(|e| e.used.iter().any(|&b| b > 0)) {
            let used: String = e.used.iter().map(|b| format!(" {b}")).collect();
            text.push_str(&format!("{} {}{used}\n", e.pid, e.start));
        }
        text
    }

    /// Runs `f` on the live entries under the file's lock and writes back what it leaves.
    pub fn update<T>(path: &Path, f: impl FnOnce(&mut Vec<Entry>) -> T) -> std::io::Result<T> {
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        file.lock()?;
        let mut text = String::new();
        file.read_to_string(&mut text)?;
        let mut entries: Vec<Entry> = parse(&text)
            .into_iter()
            .filter(|e| start_time(e.pid) == Some(e.start))
            .collect();
        let result = f(&mut entries);
        let text = render(&entries);
        file.set_len(0)?;
        file.seek(std::io::SeekFrom::Start(0))?;
        file.write_all(text.as_bytes())?;
        file.unlock()?;
        Ok(result)
    }

    /// What the live processes hold on each of `gpus` physical GPUs.
    pub fn device_used(path: &Path, gpus: usize) -> Vec<u64> {
        update(path, |entries| {
            let mut used = vec![0u64; gpus];
            for e in entries.iter() {
                for (u, b) in used.iter_mut().zip(&e.used) {
                    *u += b;
                }
            }
            used
        })
        .unwrap_or_else(|_| vec![0; gpus])
    }
}

// The simulated GPUs' time, shared the same way: `FAKE_GPU_STATE` + `.time` holds, per
// physical GPU (up to 64), the CLOCK_MONOTONIC nanosecond at which it is next free (a native
// u64 each, mapped shared and updated atomically: a launch costs no lock), and
// `FAKE_GPU_STATE` + `.kernels` a line per kernel (or graph) run, appended:
//
//     PID PHYS START_NS END_NS
//
// A GPU runs one piece of work at a time, in the order it was submitted across every
// process (time-slicing at kernel granularity): work submitted at `now` starts at
// max(now, the GPU's free time) and holds the GPU until it ends. Without `FAKE_GPU_STATE`
// each process has GPUs of its own, and its last runs are kept in memory.
#[allow(dead_code)]
mod timeline {
    use std::collections::VecDeque;
    use std::ffi::c_void;
    use std::io::Write;
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Mutex, OnceLock};

    #[repr(C)]
    struct Timespec {
        sec: i64,
        nsec: i64,
    }

    unsafe extern "C" {
        fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
        fn mmap(
            addr: *mut c_void,
            len: usize,
            prot: i32,
            flags: i32,
            fd: i32,
            off: i64,
        ) -> *mut c_void;
    }

    /// Physical GPUs the time file has room for.
    const GPUS: usize = 64;
    /// Runs kept in memory without a state file.
    const LOCAL_RUNS: usize = 4096;

    /// One kernel (or graph) run.
    #[derive(Clone, Copy, Debug)]
    pub struct Run {
        pub pid: u32,
        pub phys: usize,
        pub start: u64,
        pub end: u64,
    }

    static LOCAL_FREE: [AtomicU64; GPUS] = [const { AtomicU64::new(0) }; GPUS];
    static LOCAL_RUNS_KEPT: Mutex<VecDeque<Run>> = Mutex::new(VecDeque::new());
    /// The mapped time file (its address) and the open log, for this process's state file.
    static SHARED: OnceLock<Option<(usize, std::fs::File)>> = OnceLock::new();

    /// CLOCK_MONOTONIC in nanoseconds.
    pub fn now_ns() -> u64 {
        let mut ts = Timespec { sec: 0, nsec: 0 };
        // SAFETY: a place for the answer; CLOCK_MONOTONIC (1) always exists.
        unsafe { clock_gettime(1, &mut ts) };
        ts.sec as u64 * 1_000_000_000 + ts.nsec as u64
    }

    /// Sleeps until CLOCK_MONOTONIC reaches `at`.
    pub fn sleep_until(at: u64) {
        loop {
            let now = now_ns();
            if now >= at {
                return;
            }
            std::thread::sleep(std::time::Duration::from_nanos(at - now));
        }
    }

    fn with_suffix(state: &Path, suffix: &str) -> PathBuf {
        let mut name = state.as_os_str().to_owned();
        name.push(suffix);
        PathBuf::from(name)
    }

    fn shared(state: &Path) -> Option<&'static (usize, std::fs::File)> {
        SHARED
            .get_or_init(|| {
                use std::os::fd::AsRawFd;
                let time = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(with_suffix(state, ".time"))
                    .ok()?;
                let len = (GPUS * 8) as u64;
                if time.metadata().ok()?.len() < len {
                    time.set_len(len).ok()?;
                }
                // SAFETY: a shared read-write mapping of the file's first GPUS u64s.
                let map =
                    unsafe { mmap(std::ptr::null_mut(), GPUS * 8, 3, 1, time.as_raw_fd(), 0) };
                if map as isize == -1 {
                    return None;
                }
                let log = std::fs::OpenOptions::new()
                    .append(true)
                    .create(true)
                    .open(with_suffix(state, ".kernels"))
                    .ok()?;
                Some((map as usize, log))
            })
            .as_ref()
    }

    /// Physical GPU `phys`'s free time.
    fn free_of(state: Option<&Path>, phys: usize) -> Option<&'static AtomicU64> {
        let phys = phys.min(GPUS - 1);
        match state {
            None => Some(&LOCAL_FREE[phys]),
            Some(state) => {
                let (map, _) = shared(state)?;
                // SAFETY: 8-aligned, inside the GPUS * 8 bytes mapped, which stay mapped.
                Some(unsafe { AtomicU64::from_ptr((*map as *mut u64).add(phys)) })
            }
        }
    }

    /// `ns` of work on physical GPU `phys` for process `pid`, submitted at `submitted` (the
    /// call's entry): its (start, end).
    pub fn run(state: Option<&Path>, phys: usize, ns: u64, pid: u32, submitted: u64) -> (u64, u64) {
        let Some(free) = free_of(state, phys) else {
            return (submitted, submitted + ns);
        };
        let mut start = 0;
        let _ = free.fetch_update(Ordering::AcqRel, Ordering::Acquire, |f| {
            start = submitted.max(f);
            Some(start + ns)
        });
        let end = start + ns;
        match state.and_then(shared) {
            Some((_, log)) => {
                let _ = (&*log).write_all(format!("{pid} {phys} {start} {end}\n").as_bytes());
            }
            None => {
                let mut runs = LOCAL_RUNS_KEPT.lock().unwrap_or_else(|e| e.into_inner());
                if runs.len() >= LOCAL_RUNS {
                    runs.pop_front();
                }
                runs.push_back(Run {
                    pid,
                    phys,
                    start,
                    end,
                });
            }
        }
        (start, end)
    }

    /// When physical GPU `phys` is next free (now or later).
    pub fn free_at(state: Option<&Path>, phys: usize) -> u64 {
        free_of(state, phys).map_or(0, |f| f.load(Ordering::Acquire))
    }

    /// Every run logged (the last ones, without a state file).
    pub fn runs(state: Option<&Path>) -> Vec<Run> {
        let Some(state) = state else {
            let runs = LOCAL_RUNS_KEPT.lock().unwrap_or_else(|e| e.into_inner());
            return runs.iter().copied().collect();
        };
        let text = std::fs::read_to_string(with_suffix(state, ".kernels")).unwrap_or_default();
        text.lines()
            .filter_map(|l| {
                let w: Vec<u64> = l
                    .split_whitespace()
                    .filter_map(|w| w.parse().ok())
                    .collect();
                (w.len() == 4).then(|| Run {
                    pid: w[0] as u32,
                    phys: w[1] as usize,
                    start: w[2],
                    end: w[3],
                })
            })
            .collect()
    }

    /// Nanoseconds of `runs` within [from, to).
    pub fn busy_within(runs: impl Iterator<Item = Run>, from: u64, to: u64) -> u64 {
        runs.map(|r| r.end.min(to).saturating_sub(r.start.max(from)))
            .sum()
    }
}

// Also shared by both libraries: their settings and the UUIDs' text.

/// A number from the environment (`FAKE_*`), or `default`.
fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Physical GPU `phys`'s UUID as NVML writes it.
fn uuid_string(phys: usize) -> String {
    format!("GPU-00000000-0000-0000-0000-0000000000{:02x}", phys as u8)
}
