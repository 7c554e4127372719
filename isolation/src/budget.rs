//! The budget file: one per container, shared by all its processes through `mmap(MAP_SHARED)`,
//! updated with atomics only.
//!
//! The file's bytes and name, and the safe reader, are in `gpushare-isolation-budget`
//! ([`gpushare_isolation_budget::layout`]); what is here is the mapping and the atomics that
//! write it.
//!
//! # Protocol
//!
//! - Create: `open(O_CREAT)`, `flock(LOCK_EX)`, an empty file (or one whose creator died
//!   before writing the magic) gets its size and header, magic last; `flock(LOCK_UN)`. The lock is only taken at open, never on allocation.
//! - Allocate: a CAS loop on `used[gpu]` that refuses past `share[gpu]` (bumping
//!   `refused[gpu]`), then the slot's `used[gpu]` grows. The total is reserved first, so a
//!   process killed between the two steps can only leave the budget too full, never over.
//! - Free: the slot's and the total's `used[gpu]` shrink (saturating).
//! - Reclaim: a slot whose pid is dead (`kill(pid, 0)` fails with ESRCH, or the process is a
//!   zombie, or its start time differs: the pid was reused) is taken by CAS to `u32::MAX`,
//!   its bytes are subtracted from the totals and it is freed. Run when an allocation would
//!   otherwise be refused and whenever memory is queried.
//! - A process claims its slot on its first allocation (a fork child claims its own). A
//!   program that `exec`s leaves a slot with its pid and start time: the new program frees it
//!   before claiming (the old driver state died with the exec).

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use gpushare_isolation_budget::Limits;
use gpushare_isolation_budget::layout::{
    ENV_DIR, ENV_KEY, FILE_LEN, HEADER_LEN, Header, MAX_GPUS, OFF_REFUSED, OFF_USED, RECLAIMING,
    SLOT_LEN, SLOT_PID, SLOT_START, SLOT_USED, SLOTS, VERSION, budget_path,
};

/// What went wrong with a budget file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Creating, opening, sizing, locking or mapping it failed.
    #[error("budget file {path}: {what}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The step that failed.
        what: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file exists but is not a version-1 budget for these limits.
    #[error("budget file {path}: {reason}")]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// What differs.
        reason: String,
    },
}

/// `Result` with this module's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The budget file this process's environment names: `$GPUSHARE_ISOLATION_DIR` (default
/// `$TMPDIR/gpushare-isolation-UID`), key `$GPUSHARE_ISOLATION_KEY` (default `default`).
pub fn path_from_env(limits: &Limits) -> PathBuf {
    let dir = std::env::var_os(ENV_DIR)
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            // SAFETY: getuid has no preconditions and cannot fail.
            let uid = unsafe { libc::getuid() };
            std::env::temp_dir().join(format!("gpushare-isolation-{uid}"))
        });
    let key = std::env::var(ENV_KEY)
        .ok()
        .filter(|k| !k.is_empty())
        .unwrap_or_else(|| "default".into());
    budget_path(&dir, &key, limits)
}

/// A mapped budget file.
pub struct Budget {
    map: NonNull<u8>,
    gpu_count: usize,
    shares: [u64; MAX_GPUS],
    /// Per slot, the `(pid, start time)` this process last found alive there and when: a
    /// reclaim reads `/proc` for a live process at most once a second (see `reclaim_dead`).
    seen_alive: Box<[SeenAlive]>,
    epoch: Instant,
    /// The file, for [`Budget::exclusive`].
    path: PathBuf,
}

/// One slot's last proof of life, see [`Budget::reclaim_dead`].
#[derive(Default)]
struct SeenAlive {
    pid: AtomicU32,
    start: AtomicU64,
    /// Milliseconds after the budget's epoch, plus one; 0 never.
    at_ms: AtomicU64,
}

/// How long a process seen alive through `/proc` is taken as alive while `kill(pid, 0)`
/// still finds it.
const SEEN_ALIVE_MS: u64 = 1000;
/// How long a process seen alive through `/proc` is taken as alive without asking: a
/// process that dies is reclaimed at most this much later (refusals come in bursts, an
/// allocator retrying after it emptied its cache).
const TRUSTED_ALIVE_MS: u64 = 50;

// SAFETY: the mapping lives as long as the Budget, and all access to it goes through atomics
// (or, at creation, through the file before anyone else can see it).
unsafe impl Send for Budget {}
// SAFETY: as above.
unsafe impl Sync for Budget {}

impl std::fmt::Debug for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Budget")
            .field("gpu_count", &self.gpu_count)
            .field("shares", &&self.shares[..self.gpu_count])
            .finish_non_exhaustive()
    }
}

impl Budget {
    /// Opens (creating it if need be) the budget file at `path` for `limits`.
    pub fn open(path: &Path, limits: &Limits) -> Result<Self> {
        let io = |what| {
            move |source| Error::Io {
                path: path.to_path_buf(),
                what,
                source,
            }
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io("creating its directory"))?;
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o666)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(io("opening"))?;
        let gpu_count = limits.shares().len();
        if gpu_count == 0 {
            return Err(Error::Mismatch {
                path: path.to_path_buf(),
                reason: "limits name no GPU".into(),
            });
        }
        let mut shares = [0u64; MAX_GPUS];
        shares[..gpu_count].copy_from_slice(limits.shares());

        // A file already made is only checked: its magic is written last, so a full header
        // is a finished one, and no lock is needed (every process of the container opens
        // it, and none should wait on another to start). Only a file still to be made is
        // made under the lock.
        let want = Header::of(limits);
        if !is_made(&file) {
            flock(&file, libc::LOCK_EX).map_err(io("locking"))?;
            let checked = init_or_check(&file, path, &want);
            let unlocked = flock(&file, libc::LOCK_UN).map_err(io("unlocking"));
            checked?;
            unlocked?;
        } else {
            init_or_check(&file, path, &want)?;
        }

        // SAFETY: a fresh shared read-write mapping of FILE_LEN bytes of a file that is that
        // long (checked above); the kernel picks the address.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                FILE_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(io("mapping")(std::io::Error::last_os_error()));
        }
        let map = NonNull::new(map.cast::<u8>()).ok_or_else(|| Error::Mismatch {
            path: path.to_path_buf(),
            reason: "mapped at address 0".into(),
        })?;
        Ok(Self {
            map,
            gpu_count,
            shares,
            seen_alive: (0..SLOTS).map(|_| SeenAlive::default()).collect(),
            epoch: Instant::now(),
            path: path.to_path_buf(),
        })
    }

    fn u64_at(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset.is_multiple_of(8) && offset + 8 <= FILE_LEN);
        // SAFETY: offset is 8-aligned and inside the page-aligned mapping, which outlives
        // &self; the file is only ever accessed atomically while mapped.
        unsafe { AtomicU64::from_ptr(self.map.as_ptr().add(offset).cast::<u64>()) }
    }

    fn u32_at(&self, offset: usize) -> &AtomicU32 {
        debug_assert!(offset.is_multiple_of(4) && offset + 4 <= FILE_LEN);
        // SAFETY: as in u64_at, for a 4-aligned u32.
        unsafe { AtomicU32::from_ptr(self.map.as_ptr().add(offset).cast::<u32>()) }
    }

    fn total(&self, gpu: usize) -> &AtomicU64 {
        self.u64_at(OFF_USED + 8 * gpu)
    }

    fn refused(&self, gpu: usize) -> &AtomicU64 {
        self.u64_at(OFF_REFUSED + 8 * gpu)
    }

    fn slot_pid(&self, slot: usize) -> &AtomicU32 {
        self.u32_at(HEADER_LEN + slot * SLOT_LEN + SLOT_PID)
    }

    fn slot_start(&self, slot: usize) -> &AtomicU64 {
        self.u64_at(HEADER_LEN + slot * SLOT_LEN + SLOT_START)
    }

    fn slot_used(&self, slot: usize, gpu: usize) -> &AtomicU64 {
        self.u64_at(HEADER_LEN + slot * SLOT_LEN + SLOT_USED + 8 * gpu)
    }

    /// The file's lock, held until the guard goes, so that the container's processes and
    /// threads take turns (a context is measured while no other one is being made). The
    /// lock is taken on a descriptor of its own (threads and fork children share the
    /// budget's), and waited for at most `patience`: `None` when it could not be taken
    /// (its holder may be stuck in the driver), and the caller goes on without its turn.
    pub fn exclusive(&self, patience: std::time::Duration) -> Option<Exclusive> {
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&self.path)
            .ok()?;
        let deadline = Instant::now() + patience;
        loop {
            match flock(&file, libc::LOCK_EX | libc::LOCK_NB) {
                Ok(()) => return Some(Exclusive { _file: file }),
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                Err(_) => return None,
            }
        }
    }

    /// GPUs with a share.
    pub fn gpu_count(&self) -> usize {
        self.gpu_count
    }

    /// GPU `gpu`'s share (0 past the count).
    pub fn share(&self, gpu: usize) -> u64 {
        if gpu < self.gpu_count {
            self.shares[gpu]
        } else {
            0
        }
    }

    /// Bytes the container holds on `gpu`.
    pub fn used(&self, gpu: usize) -> u64 {
        if gpu < self.gpu_count {
            self.total(gpu).load(Ordering::Acquire)
        } else {
            0
        }
    }

    /// Allocations refused on `gpu` so far.
    pub fn refused_count(&self, gpu: usize) -> u64 {
        if gpu < self.gpu_count {
            self.refused(gpu).load(Ordering::Relaxed)
        } else {
            0
        }
    }

    /// Bytes slot `slot` holds on `gpu`.
    pub fn slot_bytes(&self, slot: usize, gpu: usize) -> u64 {
        if slot < SLOTS && gpu < self.gpu_count {
            self.slot_used(slot, gpu).load(Ordering::Acquire)
        } else {
            0
        }
    }

    /// Takes a free slot for process `pid` (started at `start_time`, 0 unknown). When all are
    /// taken, reclaims the dead and tries again; `None` if still full.
    pub fn claim_slot(&self, pid: u32, start_time: u64) -> Option<usize> {
        for attempt in 0..2 {
            for slot in 0..SLOTS {
                let p = self.slot_pid(slot);
                if p.load(Ordering::Relaxed) == 0
                    && p.compare_exchange(0, pid, Ordering::AcqRel, Ordering::Relaxed)
                        .is_ok()
                {
                    self.slot_start(slot).store(start_time, Ordering::Release);
                    return Some(slot);
                }
            }
            if attempt == 0 {
                self.reclaim_dead();
            }
        }
        None
    }

    /// Gives up the slots of process `pid` started at `start_time` (non-zero): those of an
    /// earlier program of this process, before it called `exec`. Returns their bytes.
    pub fn release_slots_of(&self, pid: u32, start_time: u64) -> u64 {
        if start_time == 0 {
            return 0;
        }
        let mut released = 0;
        for slot in 0..SLOTS {
            let p = self.slot_pid(slot);
            if p.load(Ordering::Acquire) != pid
                || self.slot_start(slot).load(Ordering::Acquire) != start_time
                || p.compare_exchange(pid, RECLAIMING, Ordering::AcqRel, Ordering::Relaxed)
                    .is_err()
            {
                continue;
            }
            for gpu in 0..self.gpu_count {
                let bytes = self.slot_used(slot, gpu).swap(0, Ordering::AcqRel);
                saturating_sub(self.total(gpu), bytes);
                released += bytes;
            }
            self.slot_start(slot).store(0, Ordering::Relaxed);
            p.store(0, Ordering::Release);
        }
        released
    }

    /// Whether a slot is held under `pid` (an earlier program of this process, before
    /// `exec`, or this one).
    pub fn has_slot_of(&self, pid: u32) -> bool {
        (0..SLOTS).any(|slot| self.slot_pid(slot).load(Ordering::Relaxed) == pid)
    }

    /// Gives slot `slot` up, and what it holds with it.
    pub fn release_slot(&self, slot: usize) {
        if slot >= SLOTS {
            return;
        }
        for gpu in 0..self.gpu_count {
            let bytes = self.slot_used(slot, gpu).swap(0, Ordering::AcqRel);
            saturating_sub(self.total(gpu), bytes);
        }
        self.slot_start(slot).store(0, Ordering::Relaxed);
        self.slot_pid(slot).store(0, Ordering::Release);
    }

    /// Reserves `bytes` on `gpu` for `slot` (`None`: a process without a slot), unless the
    /// container's total would pass the GPU's share: then reclaims the dead and tries once
    /// more, and on refusal counts it and returns false.
    pub fn try_reserve(&self, slot: Option<usize>, gpu: usize, bytes: u64) -> bool {
        self.try_reserve_with(slot, gpu, bytes, || false)
    }

    /// As [`try_reserve`](Self::try_reserve); before refusing, `make_room` may also give
    /// bytes back (the caller's own stale charges) and says whether it did.
    pub fn try_reserve_with(
        &self,
        slot: Option<usize>,
        gpu: usize,
        bytes: u64,
        make_room: impl FnOnce() -> bool,
    ) -> bool {
        if gpu >= self.gpu_count {
            return false;
        }
        let share = self.shares[gpu];
        let total = self.total(gpu);
        let mut make_room = Some(make_room);
        let mut current = total.load(Ordering::Relaxed);
        loop {
            match current.checked_add(bytes).filter(|next| *next <= share) {
                Some(next) => {
                    match total.compare_exchange_weak(
                        current,
                        next,
                        Ordering::AcqRel,
                        Ordering::Relaxed,
                    ) {
                        Ok(_) => break,
                        Err(now) => current = now,
                    }
                }
                None => {
                    if let Some(make_room) = make_room.take() {
                        let reclaimed = self.reclaim_dead_holding(Some(gpu)) > 0;
                        if make_room() | reclaimed {
                            current = total.load(Ordering::Relaxed);
                            continue;
                        }
                    }
                    self.refused(gpu).fetch_add(1, Ordering::Relaxed);
                    return false;
                }
            }
        }
        if let Some(slot) = slot.filter(|s| *s < SLOTS) {
            self.slot_used(slot, gpu).fetch_add(bytes, Ordering::AcqRel);
        }
        true
    }

    /// Whether `bytes` more would fit `gpu`'s share now (nothing is reserved).
    pub fn fits(&self, gpu: usize, bytes: u64) -> bool {
        gpu < self.gpu_count
            && self
                .used(gpu)
                .checked_add(bytes)
                .is_some_and(|next| next <= self.shares[gpu])
    }

    /// Adds `bytes` on `gpu` for `slot` even past the share: the driver already gave them
    /// (a pitched allocation larger than estimated).
    pub fn add(&self, slot: Option<usize>, gpu: usize, bytes: u64) {
        if gpu >= self.gpu_count {
            return;
        }
        self.total(gpu).fetch_add(bytes, Ordering::AcqRel);
        if let Some(slot) = slot.filter(|s| *s < SLOTS) {
            self.slot_used(slot, gpu).fetch_add(bytes, Ordering::AcqRel);
        }
    }

    /// Gives back `bytes` on `gpu` that `slot` held.
    pub fn release(&self, slot: Option<usize>, gpu: usize, bytes: u64) {
        if gpu >= self.gpu_count {
            return;
        }
        if let Some(slot) = slot.filter(|s| *s < SLOTS) {
            saturating_sub(self.slot_used(slot, gpu), bytes);
        }
        saturating_sub(self.total(gpu), bytes);
    }

    /// Frees the slots of dead processes and gives their bytes back; returns those bytes.
    pub fn reclaim_dead(&self) -> u64 {
        self.reclaim_dead_holding(None)
    }

    /// As [`reclaim_dead`](Self::reclaim_dead), looking only at slots that hold bytes on
    /// `gpu` when one is named (a refused allocation there gains nothing from the others).
    ///
    /// Cheap enough for the refusal path: `/proc/PID/stat` (zombie, reused pid) is read only
    /// for a process this one has not seen alive under the same pid and start time in the
    /// last second; within that second it is asked with `kill(pid, 0)`, and within 50 ms of
    /// the last look not at all.
    pub fn reclaim_dead_holding(&self, gpu: Option<usize>) -> u64 {
        let mut reclaimed = 0;
        // Milliseconds after the epoch plus one, read once a pass (a clock read each slot
        // would be most of a refusal's cost).
        let mut now = None;
        for slot in 0..SLOTS {
            let p = self.slot_pid(slot);
            let pid = p.load(Ordering::Acquire);
            if pid == 0 || pid == RECLAIMING {
                continue;
            }
            if let Some(gpu) = gpu
                && self.slot_bytes(slot, gpu) == 0
            {
                continue;
            }
            let start = self.slot_start(slot).load(Ordering::Acquire);
            let now = *now.get_or_insert_with(|| self.epoch.elapsed().as_millis() as u64 + 1);
            if !self.is_dead(slot, pid, start, now) {
                continue;
            }
            if p.compare_exchange(pid, RECLAIMING, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            for gpu in 0..self.gpu_count {
                let bytes = self.slot_used(slot, gpu).swap(0, Ordering::AcqRel);
                saturating_sub(self.total(gpu), bytes);
                reclaimed += bytes;
            }
            self.slot_start(slot).store(0, Ordering::Relaxed);
            p.store(0, Ordering::Release);
        }
        reclaimed
    }

    /// Whether the process in `slot` is gone at `now` (milliseconds after the epoch, plus
    /// one), remembering a proof of life (see
    /// [`reclaim_dead_holding`](Self::reclaim_dead_holding)).
    fn is_dead(&self, slot: usize, pid: u32, start: u64, now: u64) -> bool {
        let seen = &self.seen_alive[slot];
        let at = seen.at_ms.load(Ordering::Acquire);
        let age = (at != 0
            && seen.pid.load(Ordering::Relaxed) == pid
            && seen.start.load(Ordering::Relaxed) == start)
            .then(|| now.saturating_sub(at));
        match age {
            // Seen alive a moment ago: no system call at all.
            Some(age) if age < TRUSTED_ALIVE_MS => return false,
            // Seen alive lately: only whether it still exists.
            Some(age) if age < SEEN_ALIVE_MS => return !process_exists(pid),
            _ => {}
        }
        let dead = process_is_dead(pid, start);
        if !dead {
            seen.at_ms.store(0, Ordering::Release);
            seen.pid.store(pid, Ordering::Relaxed);
            seen.start.store(start, Ordering::Relaxed);
            seen.at_ms.store(now, Ordering::Release);
        }
        dead
    }
}

/// The budget file's lock, held: see [`Budget::exclusive`]. Closing its descriptor lets
/// it go.
pub struct Exclusive {
    _file: File,
}

impl Drop for Budget {
    fn drop(&mut self) {
        // SAFETY: the mapping made in open, of FILE_LEN bytes; nothing borrows it any more.
        unsafe { libc::munmap(self.map.as_ptr().cast(), FILE_LEN) };
    }
}

fn saturating_sub(atomic: &AtomicU64, bytes: u64) {
    if bytes == 0 {
        return;
    }
    let _ = atomic.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |v| {
        Some(v.saturating_sub(bytes))
    });
}

fn flock(file: &File, op: libc::c_int) -> std::io::Result<()> {
    loop {
        // SAFETY: flock on a descriptor that `file` keeps open.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Whether the file is a finished budget file: its length, and its magic in place (the
/// header's last write).
fn is_made(file: &File) -> bool {
    let mut magic = [0u8; 8];
    file.metadata().is_ok_and(|m| m.len() == FILE_LEN as u64)
        && file.read_exact_at(&mut magic, 0).is_ok()
        && magic == gpushare_isolation_budget::layout::MAGIC
}

/// Under the file lock: writes the header of an empty file, or checks an existing one.
fn init_or_check(file: &File, path: &Path, want: &Header) -> Result<()> {
    let io = |what| {
        move |source| Error::Io {
            path: path.to_path_buf(),
            what,
            source,
        }
    };
    let mismatch = |reason: String| Error::Mismatch {
        path: path.to_path_buf(),
        reason,
    };
    let len = file.metadata().map_err(io("reading its size"))?.len();
    let mut magic = [0u8; 8];
    if len == FILE_LEN as u64 {
        file.read_exact_at(&mut magic, 0)
            .map_err(io("reading its header"))?;
    }
    // Empty, or sized by a creator that died before its magic: (re)write the header.
    if len == 0 || (len == FILE_LEN as u64 && magic == [0; 8]) {
        // Writable by every user of the container whatever the creator's umask: an image
        // whose root entrypoint queries the GPU before it starts the application as another
        // user must not lock that user out of the budget. Best effort: only the owner may.
        let _ = file.set_permissions(std::fs::Permissions::from_mode(0o666));
        file.set_len(FILE_LEN as u64).map_err(io("sizing"))?;
        let header = want.encode();
        file.write_all_at(&header[8..], 8)
            .map_err(io("writing its header"))?;
        file.write_all_at(&header[..8], 0)
            .map_err(io("writing its header"))?;
        return Ok(());
    }
    if len != FILE_LEN as u64 {
        return Err(mismatch(format!(
            "{len} bytes, not {FILE_LEN}: not a version-{VERSION} budget"
        )));
    }
    let mut header = vec![0u8; HEADER_LEN];
    file.read_exact_at(&mut header, 0)
        .map_err(io("reading its header"))?;
    let header = Header::parse(&header).map_err(|e| mismatch(e.to_string()))?;
    if header.shares != want.shares {
        return Err(mismatch(format!(
            "made for shares {:?}, not {:?}: another container's limits under the same key",
            header.shares, want.shares
        )));
    }
    Ok(())
}

/// `(state, start time)` of `pid` from `/proc/PID/stat`, `None` if unreadable.
pub(crate) fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // After the state (field 3) come fields 4..; the start time is field 22.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// Whether a process `pid` exists (a zombie does): `kill(pid, 0)` does not answer ESRCH.
fn process_exists(pid: u32) -> bool {
    let Ok(pid_t) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks that the process exists.
    let answered = unsafe { libc::kill(pid_t, 0) };
    answered == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Whether process `pid`, started at `start_time` (0 unknown), is gone.
pub(crate) fn process_is_dead(pid: u32, start_time: u64) -> bool {
    if !process_exists(pid) {
        return true;
    }
    match proc_stat(pid) {
        Some((state, _)) if state == 'Z' || state == 'X' => true,
        Some((_, start)) => start_time != 0 && start != start_time,
        None => false,
    }
}

/// This process's pid and start time (0 if /proc cannot tell).
pub(crate) fn this_process() -> (u32, u64) {
    let pid = std::process::id();
    (pid, proc_stat(pid).map(|(_, start)| start).unwrap_or(0))
}
