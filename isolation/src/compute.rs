//! Compute sharing: each container held to its share of a GPU's SM time, at kernel launch.
//!
//! Memory is only half a GPU: without this, one training loop takes every SM and the other
//! containers on the GPU crawl. A GPU without MPS runs one context at a time (time-slicing),
//! so the only lever from inside a container is *when* its work reaches the driver: the
//! launch hooks (`hooks::launches`, and `cuGraphLaunch` in `hooks::graphs`) ask
//! `Throttle::hold`, which holds a launch back while the container is past its share, and
//! bracket the launch with the events that measure it.
//!
//! ```text
//!   launch ──> hold? ──(events around it)──> driver ──> GPU
//!                │                                       │ start/end events
//!                v                                       v
//!     compute-GPU-<uuid>.v1 (mmap, node-wide) <── busy ns, measured when they complete
//!     per container: vtime | tat | active_until | busy
//! ```
//!
//! # What is measured, and why events
//!
//! Each held launch is bracketed by two CUDA events on its stream (`cuEventRecord` before
//! and after); when the second completes, `cuEventElapsedTime` is what the launch took on
//! the GPU, and it is added to the container's `busy`. Events rather than NVML's
//! per-process utilization because they are exact to the microsecond and per launch (NVML
//! samples every 1/6 s or so), they cover a whole graph launched with `cuGraphLaunch`, and
//! they need no process id (NVML's are the host's, which a container in its own PID
//! namespace cannot see). Their limit: on a GPU time-slicing between contexts, a kernel
//! longer than a time slice is charged the slices other contexts ran in between.
//!
//! A launch is charged an estimate when it is made (this process's running mean on that
//! GPU), and corrected when it is measured, so that a program that queues many launches
//! ahead is held before they complete.
//!
//! # How shares are held (the decision, [`shared_may_launch`] and [`capped_may_launch`])
//!
//! - `shared` (work-conserving, a virtual-time scheduler as in weighted fair queueing): each
//!   container's `vtime` grows by busy × 100 / percent. A launch goes when the container's
//!   `vtime` is at most [`SLACK_NS`] past the smallest `vtime` of the *other* containers
//!   that want the GPU now (`active_until` in the future); else it waits. Alone, or with
//!   everyone else behind it, it never waits: idle SM time is used. A container that comes
//!   back from idle starts from the smallest `vtime` of those active (it does not bank the
//!   time it did not use).
//! - `capped` (a GCRA token bucket per container, shared by its processes): `tat` moves on
//!   by busy × 100 / percent from `max(tat, now)`; a launch goes when `tat` is at most
//!   [`BURST_NS`] ahead of now. Never more than the share, even alone.
//!
//! Processes of one container share one entry (the container is its budget file's device
//! and inode), so the share is the container's, however many processes it runs.
//!
//! # Cost
//!
//! With no compute share set (or `off`), a launch hook only finds that there is no
//! throttle (the process state and one field) and forwards: a few nanoseconds (the
//! bench's `launch` group). A held launch makes seven driver calls besides its own
//! (current context and device, capture status, two event records, the completion query
//! and elapsed time of an earlier pair), and reads the shared file's 64 entries (4 KiB) with
//! a few atomics on its own; no lock is taken across processes.
//!
//! # Not held
//!
//! Launches on a stream that is capturing a graph (they run when the graph is launched,
//! which is held); launches with no current context or on a GPU the container has no
//! compute file for (the driver refuses the first itself). A compute state file that
//! cannot be made or is not one turns holding off on that GPU, with one line on stderr.

use std::ffi::c_int;
use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use gpushare_isolation_budget::compute::{
    ENTRIES, ENTRY_ACTIVE_UNTIL, ENTRY_BUSY, ENTRY_HELD, ENTRY_ID, ENTRY_LAUNCHES, ENTRY_LEN,
    ENTRY_MODE, ENTRY_PERCENT, ENTRY_TAT, ENTRY_VTIME, FILE_LEN, HEADER_LEN, MODE_CAPPED,
    MODE_SHARED, compute_path, header,
};

use crate::settings::{ComputeMode, ComputeShare};
use crate::spin::SpinLock;

mod measure;

pub(crate) use measure::{Measure, destroy as destroy_events};

/// How far (in vtime ns) a shared container may run ahead of the furthest-behind active one.
pub const SLACK_NS: u64 = 2_000_000;
/// How far ahead of now a capped container's `tat` may be when it launches: its burst.
pub const BURST_NS: u64 = 5_000_000;
/// How long after its last launch (or wait) a container counts as wanting the GPU.
pub const ACTIVE_NS: u64 = 10_000_000;
/// An entry untouched this long belongs to a container that is gone: it may be taken.
const STALE_NS: u64 = 60_000_000_000;
/// How long a held launch sleeps between looks.
const WAIT_STEP: Duration = Duration::from_micros(100);
/// CUDA ordinals a process may have a compute file for.
const ORDINALS: usize = 64;

/// `CLOCK_MONOTONIC` in nanoseconds: the time every container on the node shares.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a place for the answer; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// Another container's entry, as the shared decision sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// Its virtual time (busy × 100 / percent).
    pub vtime: u64,
    /// Whether it wants the GPU now.
    pub active: bool,
}

/// `shared`: whether a container at `vtime` may launch now, given the other containers on the
/// GPU: yes unless an active one is more than [`SLACK_NS`] behind it.
pub fn shared_may_launch(vtime: u64, others: impl IntoIterator<Item = Peer>) -> bool {
    others
        .into_iter()
        .filter(|p| p.active)
        .map(|p| p.vtime)
        .min()
        .is_none_or(|behind| vtime <= behind.saturating_add(SLACK_NS))
}

/// `capped`: whether a container whose share has paid for its work up to `tat` may launch at
/// `now`.
pub fn capped_may_launch(tat: u64, now: u64) -> bool {
    tat <= now.saturating_add(BURST_NS)
}

/// Busy nanoseconds in a share's virtual time.
fn scaled(busy: u64, percent: u8) -> u64 {
    busy.saturating_mul(100) / u64::from(percent.max(1))
}

/// One GPU's compute state file, mapped, and this container's entry in it.
pub(crate) struct GpuFile {
    map: NonNull<u8>,
    /// This container's entry (re-claimed if another container took it).
    entry: AtomicUsize,
}

// SAFETY: the mapping lives as long as the GpuFile and is only reached through atomics.
unsafe impl Send for GpuFile {}
// SAFETY: as above.
unsafe impl Sync for GpuFile {}

impl Drop for GpuFile {
    fn drop(&mut self) {
        // SAFETY: the mapping made in open, FILE_LEN bytes; nothing borrows it any more.
        unsafe { libc::munmap(self.map.as_ptr().cast(), FILE_LEN) };
    }
}

impl GpuFile {
    /// Maps the compute state file at `path`, making it if there is none (mode 0666, so that
    /// every container's user can map it).
    pub(crate) fn open(path: &Path) -> std::io::Result<Self> {
        let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o666)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
            .open(path)?;
        let meta = file.metadata()?;
        if !meta.is_file() {
            return Err(bad("not a regular file"));
        }
        // Whoever made it: readable and writable by every container's user (the umask
        // narrowed the mode). Another user's file is left as it is.
        let _ = file.set_permissions(std::fs::Permissions::from_mode(0o666));
        file.lock()?;
        let len = file.metadata()?.len();
        let mut head = [0u8; HEADER_LEN];
        if len == FILE_LEN as u64 {
            file.read_exact_at(&mut head, 0)?;
        }
        if head != header() {
            // Only a file that is empty, or was left half made, is made anew.
            if len != 0 && (len != FILE_LEN as u64 || head[..8] != [0; 8]) {
                return Err(bad("not a version-1 compute state file"));
            }
            file.set_len(FILE_LEN as u64)?;
            file.write_all_at(&header(), 0)?;
        }
        // SAFETY: a fresh shared mapping of the file's FILE_LEN bytes; the kernel picks the
        // address. The mapping outlives the descriptor (closed, and unlocked, on return).
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                FILE_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(&file),
                0,
            )
        };
        // The mapping holds the open file description, and with it the lock, past the
        // descriptor's close: let go of it by hand.
        let unlocked = file.unlock();
        if map == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let map = NonNull::new(map.cast::<u8>()).ok_or_else(|| bad("mapped at null"))?;
        let file = Self {
            map,
            entry: AtomicUsize::new(usize::MAX),
        };
        unlocked?;
        Ok(file)
    }

    fn u64_at(&self, entry: usize, field: usize) -> &AtomicU64 {
        let offset = HEADER_LEN + entry * ENTRY_LEN + field;
        debug_assert!(offset.is_multiple_of(8) && offset + 8 <= FILE_LEN);
        // SAFETY: 8-aligned (page-aligned mapping, 8-aligned offsets) and inside the mapping,
        // which outlives &self; the file is only ever reached atomically while mapped.
        unsafe { AtomicU64::from_ptr(self.map.as_ptr().add(offset).cast::<u64>()) }
    }

    fn u32_at(&self, entry: usize, field: usize) -> &AtomicU32 {
        let offset = HEADER_LEN + entry * ENTRY_LEN + field;
        debug_assert!(offset.is_multiple_of(4) && offset + 4 <= FILE_LEN);
        // SAFETY: as in u64_at, for a 4-aligned u32.
        unsafe { AtomicU32::from_ptr(self.map.as_ptr().add(offset).cast::<u32>()) }
    }

    /// This container's entry: the one it holds, else one claimed now (its own if another
    /// process of it made one, else a free one, else a stale one); `None` when all 64 are
    /// held by live containers.
    fn entry(&self, id: u64, share: ComputeShare, now: u64) -> Option<usize> {
        let held = self.entry.load(Ordering::Relaxed);
        if held < ENTRIES && self.u64_at(held, ENTRY_ID).load(Ordering::Relaxed) == id {
            return Some(held);
        }
        let claimed = self.claim(id, now)?;
        self.u32_at(claimed, ENTRY_PERCENT)
            .store(u32::from(share.percent), Ordering::Relaxed);
        let mode = match share.mode {
            ComputeMode::Capped => MODE_CAPPED,
            _ => MODE_SHARED,
        };
        self.u32_at(claimed, ENTRY_MODE)
            .store(mode, Ordering::Relaxed);
        self.entry.store(claimed, Ordering::Relaxed);
        Some(claimed)
    }

    fn claim(&self, id: u64, now: u64) -> Option<usize> {
        let own = |file: &Self| {
            (0..ENTRIES).find(|&e| file.u64_at(e, ENTRY_ID).load(Ordering::Acquire) == id)
        };
        if let Some(e) = own(self) {
            return Some(e);
        }
        let taken = (0..ENTRIES)
            .find(|&e| {
                self.u64_at(e, ENTRY_ID)
                    .compare_exchange(0, id, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            })
            .or_else(|| {
                (0..ENTRIES).find(|&e| {
                    let stale = self
                        .u64_at(e, ENTRY_ACTIVE_UNTIL)
                        .load(Ordering::Acquire)
                        .saturating_add(STALE_NS)
                        < now;
                    let old = self.u64_at(e, ENTRY_ID).load(Ordering::Acquire);
                    stale
                        && self
                            .u64_at(e, ENTRY_ID)
                            .compare_exchange(old, id, Ordering::AcqRel, Ordering::Relaxed)
                            .is_ok()
                })
            })?;
        for field in [
            ENTRY_VTIME,
            ENTRY_TAT,
            ENTRY_BUSY,
            ENTRY_LAUNCHES,
            ENTRY_HELD,
        ] {
            self.u64_at(taken, field).store(0, Ordering::Relaxed);
        }
        self.u64_at(taken, ENTRY_ACTIVE_UNTIL)
            .store(now, Ordering::Release);
        // Two processes of the container may have claimed one each at once: the first
        // entry wins, the other is given back.
        match own(self) {
            Some(first) if first != taken => {
                self.u64_at(taken, ENTRY_ID).store(0, Ordering::Release);
                Some(first)
            }
            _ => Some(taken),
        }
    }

    /// The other containers' entries, for the shared decision.
    fn peers(&self, mine: usize, now: u64) -> impl Iterator<Item = Peer> + '_ {
        (0..ENTRIES)
            .filter(move |&e| e != mine && self.u64_at(e, ENTRY_ID).load(Ordering::Relaxed) != 0)
            .map(move |e| Peer {
                vtime: self.u64_at(e, ENTRY_VTIME).load(Ordering::Relaxed),
                active: self.u64_at(e, ENTRY_ACTIVE_UNTIL).load(Ordering::Relaxed) > now,
            })
    }
}

/// This process's compute throttle: the container's share, and per GPU its state file.
pub struct Throttle {
    share: ComputeShare,
    /// The container.
    id: u64,
    dir: PathBuf,
    /// Per CUDA ordinal, the GPU's file (`None`: not held there).
    gpus: [OnceLock<Option<GpuFile>>; ORDINALS],
    /// Per CUDA ordinal, the running mean of what a launch took (ns): a launch's charge
    /// until it is measured.
    estimate: [AtomicU64; ORDINALS],
    pub(crate) measure: SpinLock<Measure>,
}

impl std::fmt::Debug for Throttle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Throttle")
            .field("share", &self.share)
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// A launch being made: where it is charged and what it was charged.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Charge {
    pub ordinal: usize,
    pub estimate: u64,
}

impl Throttle {
    /// The throttle for `share` (none when it holds nothing) of the container `id`, with
    /// its GPUs' files in `dir`.
    pub fn new(share: Option<ComputeShare>, id: u64, dir: PathBuf) -> Option<Self> {
        let share = share.filter(ComputeShare::throttles)?;
        Some(Self {
            share,
            id,
            dir,
            gpus: std::array::from_fn(|_| OnceLock::new()),
            estimate: std::array::from_fn(|_| AtomicU64::new(0)),
            measure: SpinLock::new(Measure::default()),
        })
    }

    /// The share it holds.
    pub fn share(&self) -> ComputeShare {
        self.share
    }

    /// The file of the GPU at CUDA `ordinal` (its UUID from `uuid`), opened on first use.
    pub(crate) fn gpu(
        &self,
        ordinal: c_int,
        uuid: impl FnOnce() -> Option<String>,
    ) -> Option<&GpuFile> {
        let slot = self.gpus.get(usize::try_from(ordinal).ok()?)?;
        slot.get_or_init(|| {
            let path = compute_path(&self.dir, &uuid()?);
            GpuFile::open(&path)
                .map_err(|e| {
                    eprintln!(
                        "gpushare-isolation: compute share not held on this GPU: {}: {e}; \
                         check that the node's compute directory is mounted read-write",
                        path.display()
                    );
                })
                .ok()
        })
        .as_ref()
    }

    /// Holds the calling thread until the container may launch on `gpu` (CUDA `ordinal`),
    /// then charges the launch its estimate. `poll` folds in launches that completed.
    pub(crate) fn hold(
        &self,
        ordinal: c_int,
        gpu: &GpuFile,
        mut poll: impl FnMut(),
    ) -> Option<Charge> {
        let ordinal = usize::try_from(ordinal).ok()?;
        let started = now_ns();
        let mut now = started;
        let entry = gpu.entry(self.id, self.share, now)?;
        let active_until = gpu.u64_at(entry, ENTRY_ACTIVE_UNTIL);
        let vtime = gpu.u64_at(entry, ENTRY_VTIME);
        let tat = gpu.u64_at(entry, ENTRY_TAT);
        loop {
            poll();
            if active_until.load(Ordering::Relaxed) <= now {
                // Back from idle: no credit for the time not used.
                let behind = gpu
                    .peers(entry, now)
                    .filter(|p| p.active)
                    .map(|p| p.vtime)
                    .min();
                if let Some(behind) = behind {
                    vtime.fetch_max(behind, Ordering::AcqRel);
                }
            }
            active_until.fetch_max(now.saturating_add(ACTIVE_NS), Ordering::AcqRel);
            let go = match self.share.mode {
                ComputeMode::Capped => capped_may_launch(tat.load(Ordering::Acquire), now),
                _ => shared_may_launch(vtime.load(Ordering::Acquire), gpu.peers(entry, now)),
            };
            if go {
                break;
            }
            let step = match self.share.mode {
                ComputeMode::Capped => Duration::from_nanos(
                    tat.load(Ordering::Relaxed)
                        .saturating_sub(now.saturating_add(BURST_NS))
                        .clamp(10_000, 2_000_000),
                ),
                _ => WAIT_STEP,
            };
            std::thread::sleep(step);
            now = now_ns();
        }
        if now > started {
            gpu.u64_at(entry, ENTRY_HELD)
                .fetch_add(now - started, Ordering::Relaxed);
        }
        let estimate = self.estimate[ordinal].load(Ordering::Relaxed);
        let charge = scaled(estimate, self.share.percent);
        vtime.fetch_add(charge, Ordering::AcqRel);
        let _ = tat.fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
            Some(t.max(now).saturating_add(charge))
        });
        active_until.fetch_max(
            now.saturating_add(ACTIVE_NS)
                .saturating_add(estimate.saturating_mul(2)),
            Ordering::AcqRel,
        );
        gpu.u64_at(entry, ENTRY_LAUNCHES)
            .fetch_add(1, Ordering::Relaxed);
        Some(Charge { ordinal, estimate })
    }

    /// A launch charged `charge` took `busy` ns on the GPU (`None`: it cannot be told, and
    /// keeps its charge): corrects its charge and learns the estimate.
    pub(crate) fn settle(&self, charge: Charge, busy: Option<u64>) {
        if let Some(busy) = busy {
            self.correct(charge, busy);
            // A running mean over about the last eight launches.
            let mean = &self.estimate[charge.ordinal];
            let old = mean.load(Ordering::Relaxed);
            let new = if old == 0 { busy } else { (old * 7 + busy) / 8 };
            mean.store(new, Ordering::Relaxed);
        }
    }

    /// A launch charged `charge` did not run: its charge is given back.
    pub(crate) fn refund(&self, charge: Charge) {
        self.correct(charge, 0);
    }

    fn correct(&self, charge: Charge, busy: u64) {
        let Some(Some(gpu)) = self.gpus.get(charge.ordinal).and_then(OnceLock::get) else {
            return;
        };
        let entry = gpu.entry.load(Ordering::Relaxed);
        if entry >= ENTRIES || gpu.u64_at(entry, ENTRY_ID).load(Ordering::Relaxed) != self.id {
            return;
        }
        let percent = self.share.percent;
        let (more, less) = (
            scaled(busy.saturating_sub(charge.estimate), percent),
            scaled(charge.estimate.saturating_sub(busy), percent),
        );
        for field in [ENTRY_VTIME, ENTRY_TAT] {
            let word = gpu.u64_at(entry, field);
            if more > 0 {
                word.fetch_add(more, Ordering::AcqRel);
            } else if less > 0 {
                let _ = word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                    Some(v.saturating_sub(less))
                });
            }
        }
        gpu.u64_at(entry, ENTRY_BUSY)
            .fetch_add(busy, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(vtime: u64, active: bool) -> Peer {
        Peer { vtime, active }
    }

    #[test]
    fn shared_alone_or_behind_always_goes() {
        assert!(shared_may_launch(u64::MAX / 2, []));
        assert!(shared_may_launch(5_000_000_000, [peer(0, false)]));
        assert!(shared_may_launch(10, [peer(20, true)]));
        assert!(shared_may_launch(20 + SLACK_NS, [peer(20, true)]));
    }

    #[test]
    fn shared_ahead_of_an_active_peer_waits() {
        assert!(!shared_may_launch(21 + SLACK_NS, [peer(20, true)]));
        // The furthest-behind active peer decides.
        assert!(!shared_may_launch(
            10 * SLACK_NS,
            [
                peer(20 * SLACK_NS, true),
                peer(SLACK_NS, true),
                peer(0, false)
            ]
        ));
    }

    #[test]
    fn capped_goes_within_its_burst() {
        assert!(capped_may_launch(0, 100));
        assert!(capped_may_launch(100 + BURST_NS, 100));
        assert!(!capped_may_launch(101 + BURST_NS, 100));
    }

    #[test]
    fn virtual_time_scales_by_share() {
        assert_eq!(scaled(1_000, 20), 5_000);
        assert_eq!(scaled(1_000, 100), 1_000);
        assert_eq!(scaled(u64::MAX, 1), u64::MAX);
    }

    const SHARED_30: ComputeShare = ComputeShare {
        percent: 30,
        mode: ComputeMode::Shared,
    };

    #[test]
    fn a_container_has_one_entry_whatever_its_processes() {
        let dir = tempfile::tempdir().unwrap();
        let path = compute_path(dir.path(), "GPU-00000000-0000-0000-0000-000000000000");
        let (first, second, other) = (
            GpuFile::open(&path).unwrap(),
            GpuFile::open(&path).unwrap(),
            GpuFile::open(&path).unwrap(),
        );
        let now = now_ns();
        let mine = first.entry(7, SHARED_30, now).unwrap();
        assert_eq!(second.entry(7, SHARED_30, now), Some(mine));
        let theirs = other.entry(8, SHARED_30, now).unwrap();
        assert_ne!(mine, theirs);
        // What one process of the container writes, the other sees; the other container
        // sees it as a peer (not yet wanting the GPU: claimed, nothing launched).
        first.u64_at(mine, ENTRY_VTIME).store(42, Ordering::Relaxed);
        assert_eq!(second.u64_at(mine, ENTRY_VTIME).load(Ordering::Relaxed), 42);
        let peers: Vec<Peer> = other.peers(theirs, now).collect();
        assert_eq!(peers, [peer(42, false)]);
        second
            .u64_at(mine, ENTRY_ACTIVE_UNTIL)
            .store(now + ACTIVE_NS, Ordering::Relaxed);
        let peers: Vec<Peer> = other.peers(theirs, now).collect();
        assert_eq!(peers, [peer(42, true)]);
        let usage = gpushare_isolation_budget::compute::read(&path).unwrap();
        assert_eq!(usage.len(), 2);
        assert_eq!(usage[0].percent, 30);
    }

    #[test]
    fn a_full_file_gives_up_the_entries_of_containers_long_gone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("compute-GPU-x.v1");
        let file = GpuFile::open(&path).unwrap();
        let now = STALE_NS * 2;
        for id in 1..=ENTRIES as u64 {
            assert!(file.entry(id, SHARED_30, now).is_some(), "entry {id}");
        }
        let fresh = GpuFile::open(&path).unwrap();
        assert_eq!(fresh.entry(1000, SHARED_30, now), None, "all 64 are live");
        let later = now + STALE_NS + 1;
        file.u64_at(5, ENTRY_ACTIVE_UNTIL)
            .store(later, Ordering::Relaxed);
        let taken = fresh.entry(1000, SHARED_30, later + 1).unwrap();
        assert_ne!(taken, 5, "a live entry is never taken");
        assert_eq!(fresh.u64_at(taken, ENTRY_VTIME).load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_file_that_is_not_compute_state_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("compute-GPU-x.v1");
        std::fs::write(&path, b"not a compute state file").unwrap();
        assert!(GpuFile::open(&path).is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"not a compute state file");
    }

    /// Containers at 20/30/50 % that always want the GPU, each running 1 ms kernels one at a
    /// time, scheduled by the shared decision alone (the GPU as a single queue): each gets
    /// its share.
    #[test]
    fn the_shared_decision_splits_a_busy_gpu_by_share() {
        let percents = [20u8, 30, 50];
        let mut vtime = [0u64; 3];
        let mut busy = [0u64; 3];
        for _ in 0..10_000 {
            let next = (0..3)
                .find(|&c| {
                    shared_may_launch(
                        vtime[c],
                        (0..3).filter(|&o| o != c).map(|o| peer(vtime[o], true)),
                    )
                })
                .unwrap();
            busy[next] += 1_000_000;
            vtime[next] += scaled(1_000_000, percents[next]);
        }
        let total: u64 = busy.iter().sum();
        for c in 0..3 {
            let share = busy[c] as f64 * 100.0 / total as f64;
            assert!(
                (share - f64::from(percents[c])).abs() < 1.0,
                "{c}: {share:.1} % for {} %",
                percents[c]
            );
        }
    }
}
