//! The budget file: one per container, shared by all its processes through `mmap(MAP_SHARED)`,
//! updated with atomics only.
//!
//! The file's bytes and name, and the safe reader, are in `gpushare-isolation-budget`
//! ([`gpushare_isolation_budget::layout`]); what is here is the mapping and the atomics that
//! write it.
//!
//! # Protocol
//!
//! - Made by the plugin, before the container starts (`gpushare_isolation_budget::prepare`,
//!   mode 0666, in a directory the container cannot replace it in), where a limits file
//!   names it: opened as it is ([`Budget::open_prepared`]), never created, and anything but
//!   a finished budget of the limits file's shares is refused (the process then refuses
//!   every allocation, see [`Budget::closed`]).
//! - Made by the container, where the limits come from the environment ([`Budget::open`]):
//!   `open(O_CREAT)`, `flock(LOCK_EX)`, an empty file (or one whose creator died before
//!   writing the magic) gets its size and header, magic last; `flock(LOCK_UN)`. The lock is
//!   only taken at open, never on allocation.
//! - Allocate: a CAS loop on `used[gpu]` that refuses past `share[gpu]` (bumping
//!   `refused[gpu]`), then the slot's `used[gpu]` grows. The total is reserved first, so a
//!   process killed between the two steps can only leave the budget too full, never over.
//! - Free: the slot's and the total's `used[gpu]` shrink (saturating).
//! - Claim: a process takes a free slot on its first allocation (a fork child takes its
//!   own). It first locks the slot's bytes (`fcntl(F_OFD_SETLK, F_WRLCK)`) through a
//!   descriptor it opened itself (`O_CLOEXEC`, kept for its life; a fork child closes its
//!   copy of the parent's), marks the slot `SLOT_LOCKED`, then CASes its pid in. A slot
//!   whose lock another claimer holds is passed over. Where the lock cannot be taken (a
//!   filesystem without OFD locks) the slot is claimed unmarked.
//! - Liveness: a marked slot's holder is alive exactly while its lock is held, asked with
//!   one `F_OFD_GETLK` through the budget's own descriptor (which holds no slot lock): the
//!   kernel drops the lock when the holder dies or `exec`s, whatever PID namespace it lived
//!   in and whatever its pid is reused for. An unmarked slot is dead when `kill(pid, 0)`
//!   fails with ESRCH, or the process is a zombie, or its start time differs (the pid was
//!   reused): that only holds within one PID namespace. A slot seen alive within 50 ms is
//!   not asked about again.
//! - Reclaim: a dead slot is taken by CAS to `u32::MAX`, its bytes are subtracted from the
//!   totals, its mark cleared, and it is freed. Run when an allocation would otherwise be
//!   refused and whenever memory is queried.
//! - Exec: a program that `exec`s leaves a slot with its pid and start time, its lock gone
//!   with the old program's descriptors: the new program frees it before claiming (the old
//!   driver state died with the exec). A slot with the same pid whose lock is held (a
//!   process of another PID namespace) is never taken for one's own.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use gpushare_isolation_budget::Limits;
use gpushare_isolation_budget::layout::{
    ENV_DIR, ENV_KEY, FILE_LEN, HEADER_LEN, Header, MAX_GPUS, OFF_REFUSED, OFF_USED, RECLAIMING,
    SLOT_FLAGS, SLOT_LEN, SLOT_LOCKED, SLOT_PID, SLOT_START, SLOT_USED, SLOTS, VERSION,
    budget_path,
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

impl Error {
    /// The error of step `what` on the file at `path`, for `map_err`.
    fn io<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(std::io::Error) -> Self + 'a {
        move |source| Error::Io {
            path: path.to_path_buf(),
            what,
            source,
        }
    }

    /// The file at `path` is not the budget wanted, because of `reason`.
    fn mismatch(path: &Path, reason: String) -> Self {
        Error::Mismatch {
            path: path.to_path_buf(),
            reason,
        }
    }
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
    /// The file, for [`Budget::exclusive`] and for this process's lock descriptor.
    path: PathBuf,
    /// The file, kept open for the mapping's life: it holds no slot lock, so asking through
    /// it (`F_OFD_GETLK`) sees every holder's lock. `None` for a closed budget.
    file: Option<File>,
    /// This process's descriptor for its slot lock (its own open file description, opened
    /// at its claim), -1 none. A fork child closes its copy: the parent's lock is not its.
    lock_fd: AtomicI32,
    /// Refuses everything: the limits are set but could not be applied (see
    /// [`Budget::closed`]).
    closed: bool,
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
    /// Opens (creating it if need be) the budget file at `path` for `limits`: limits from
    /// the environment, where the first process of the container makes its budget.
    pub fn open(path: &Path, limits: &Limits) -> Result<Self> {
        let io = |what| Error::io(path, what);
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
        let want = Self::header_for(path, limits)?;

        // A file already made is only checked: its magic is written last, so a full header
        // is a finished one, and no lock is needed (every process of the container opens
        // it, and none should wait on another to start). Only a file still to be made is
        // made under the lock.
        if !is_made(&file) {
            flock(&file, libc::LOCK_EX).map_err(io("locking"))?;
            let checked = init_or_check(&file, path, &want);
            let unlocked = flock(&file, libc::LOCK_UN).map_err(io("unlocking"));
            checked?;
            unlocked?;
        } else {
            init_or_check(&file, path, &want)?;
        }
        Self::map_file(file, path, limits)
    }

    /// Opens the budget file the plugin prepared at `path` for `limits` (a limits file named
    /// it): never created here, and used only if it is a finished budget of exactly these
    /// shares. Anything else is an error, and the caller refuses every allocation.
    pub fn open_prepared(path: &Path, limits: &Limits) -> Result<Self> {
        let io = |what| Error::io(path, what);
        let mismatch = |reason: String| Error::mismatch(path, reason);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
            .map_err(io("opening the prepared budget"))?;
        let meta = file.metadata().map_err(io("reading its size"))?;
        if !meta.is_file() {
            return Err(mismatch("not a regular file".into()));
        }
        if meta.len() != FILE_LEN as u64 {
            return Err(mismatch(format!(
                "{} bytes, not {FILE_LEN}: not a version-{VERSION} budget",
                meta.len()
            )));
        }
        let want = Self::header_for(path, limits)?;
        check_header(&file, path, &want, "the limits file's")?;
        Self::map_file(file, path, limits)
    }

    /// A budget that refuses every allocation and shows every GPU full: for a process
    /// whose limits are set but cannot be applied (fail closed). `limits`: the shares, if
    /// they are known (queries then answer the share as total and nothing free); `None`:
    /// no GPU has a share, and queries answer the driver's total and nothing free.
    ///
    /// Backed by an anonymous shared mapping (shared with fork children, like a file),
    /// whose totals stand at the shares.
    pub fn closed(limits: Option<&Limits>) -> Result<Self> {
        let path = PathBuf::from("(closed)");
        let shares = limits.map(Limits::shares).unwrap_or(&[]);
        let gpu_count = shares.len().min(MAX_GPUS);
        // SAFETY: a fresh anonymous shared mapping of FILE_LEN bytes (zeroed by the
        // kernel); the kernel picks the address.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                FILE_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(Error::Io {
                path,
                what: "mapping a closed budget",
                source: std::io::Error::last_os_error(),
            });
        }
        let map = NonNull::new(map.cast::<u8>()).ok_or_else(|| Error::Mismatch {
            path: path.clone(),
            reason: "mapped at address 0".into(),
        })?;
        let mut share_array = [0u64; MAX_GPUS];
        share_array[..gpu_count].copy_from_slice(&shares[..gpu_count]);
        let budget = Self {
            map,
            gpu_count,
            shares: share_array,
            seen_alive: (0..SLOTS).map(|_| SeenAlive::default()).collect(),
            epoch: Instant::now(),
            path,
            file: None,
            lock_fd: AtomicI32::new(-1),
            closed: true,
        };
        for (gpu, share) in share_array[..gpu_count].iter().enumerate() {
            budget.total(gpu).store(*share, Ordering::Release);
        }
        Ok(budget)
    }

    /// Whether this budget refuses everything ([`Budget::closed`]).
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// The header a budget for `limits` has.
    fn header_for(path: &Path, limits: &Limits) -> Result<Header> {
        if limits.shares().is_empty() {
            return Err(Error::Mismatch {
                path: path.to_path_buf(),
                reason: "limits name no GPU".into(),
            });
        }
        Ok(Header::of(limits))
    }

    /// Maps `file`, a finished budget for `limits` (checked by the caller).
    fn map_file(file: File, path: &Path, limits: &Limits) -> Result<Self> {
        let gpu_count = limits.shares().len();
        let mut shares = [0u64; MAX_GPUS];
        shares[..gpu_count].copy_from_slice(limits.shares());
        // SAFETY: a fresh shared read-write mapping of FILE_LEN bytes of a file that is that
        // long (checked by the caller); the kernel picks the address.
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
            return Err(Error::Io {
                path: path.to_path_buf(),
                what: "mapping",
                source: std::io::Error::last_os_error(),
            });
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
            file: Some(file),
            lock_fd: AtomicI32::new(-1),
            closed: false,
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

    fn slot_flags(&self, slot: usize) -> &AtomicU32 {
        self.u32_at(HEADER_LEN + slot * SLOT_LEN + SLOT_FLAGS)
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

    /// Bytes the container holds on `gpu` (a closed budget: all of the share).
    pub fn used(&self, gpu: usize) -> u64 {
        if self.closed {
            self.share(gpu)
        } else if gpu < self.gpu_count {
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

    /// Takes a free slot for process `pid` (started at `start_time`, 0 unknown), without a
    /// lock: the slot is judged alive by its pid (for a process other than this one, as
    /// tests and benches make them). When all are taken, reclaims the dead and tries again;
    /// `None` if still full.
    pub fn claim_slot(&self, pid: u32, start_time: u64) -> Option<usize> {
        self.claim(pid, start_time, None)
    }

    /// As [`claim_slot`](Self::claim_slot), for this very process: the slot is also locked
    /// (`F_OFD_SETLK`, `F_WRLCK` on its bytes) through a descriptor this process opens for
    /// itself and keeps, and marked [`SLOT_LOCKED`], so that it counts as alive exactly as
    /// long as this process lives, seen from any PID namespace. Where the lock cannot be
    /// taken (a filesystem without OFD locks) the slot is claimed as `claim_slot` does.
    pub fn claim_own_slot(&self, pid: u32, start_time: u64) -> Option<usize> {
        let fd = self.own_lock_fd();
        self.claim(pid, start_time, fd)
    }

    fn claim(&self, pid: u32, start_time: u64, lock_fd: Option<RawFd>) -> Option<usize> {
        for attempt in 0..2 {
            for slot in 0..SLOTS {
                let p = self.slot_pid(slot);
                if p.load(Ordering::Relaxed) != 0 {
                    continue;
                }
                // The lock first: another claimer holding it is taking this slot now. The
                // mark goes in before the pid, so a slot with a pid and no mark never hides
                // a lock.
                let locked = match lock_fd.map(|fd| set_slot_lock(fd, slot, libc::F_WRLCK)) {
                    Some(Ok(())) => true,
                    Some(Err(e)) if lock_is_busy(&e) => continue,
                    Some(Err(_)) | None => false,
                };
                if locked {
                    self.slot_flags(slot).store(SLOT_LOCKED, Ordering::Release);
                }
                if p.compare_exchange(0, pid, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    if !locked {
                        self.slot_flags(slot).store(0, Ordering::Release);
                    }
                    self.slot_start(slot).store(start_time, Ordering::Release);
                    return Some(slot);
                }
                if let (true, Some(fd)) = (locked, lock_fd) {
                    let _ = set_slot_lock(fd, slot, libc::F_UNLCK);
                }
            }
            if attempt == 0 {
                self.reclaim_dead();
            }
        }
        None
    }

    /// This process's lock descriptor, opened on first use: its own open file description
    /// (`O_CLOEXEC`: an `exec` drops the lock with the old program). `None` for a closed
    /// budget or when the file cannot be opened again.
    fn own_lock_fd(&self) -> Option<RawFd> {
        let fd = self.lock_fd.load(Ordering::Acquire);
        if fd >= 0 {
            return Some(fd);
        }
        self.file.as_ref()?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&self.path)
            .ok()?;
        let fd = std::os::fd::IntoRawFd::into_raw_fd(file);
        match self
            .lock_fd
            .compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Some(fd),
            Err(other) => {
                // SAFETY: the descriptor just opened above, owned by nobody else.
                unsafe { libc::close(fd) };
                Some(other)
            }
        }
    }

    /// In a fork child: closes its copy of the parent's lock descriptor (the child would
    /// otherwise keep the parent's slot looking alive after the parent died). The child
    /// opens its own when it claims its own slot.
    pub fn forget_lock_in_child(&self) {
        self.close_lock_fd();
    }

    /// Closes this process's lock descriptor, if open: its slot lock goes with it.
    fn close_lock_fd(&self) {
        let fd = self.lock_fd.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            // SAFETY: this process's lock descriptor (a fork child's copy of it), taken out of
            // `lock_fd` above, so closed once.
            unsafe { libc::close(fd) };
        }
    }

    /// Whether `slot` is marked locked and someone (another open file description than
    /// the budget's own) holds its lock now; `None` when unmarked or the kernel cannot say.
    fn slot_lock_held(&self, slot: usize) -> Option<bool> {
        if self.slot_flags(slot).load(Ordering::Acquire) & SLOT_LOCKED == 0 {
            return None;
        }
        let file = self.file.as_ref()?;
        slot_lock_held(file.as_raw_fd(), slot).ok()
    }

    /// Gives up the slots of process `pid` started at `start_time` (non-zero): those of an
    /// earlier program of this process, before it called `exec`. Returns their bytes. A slot
    /// whose lock is held is left alone: its holder lives (a process of another PID
    /// namespace with the same pid number, or this program itself).
    pub fn release_slots_of(&self, pid: u32, start_time: u64) -> u64 {
        if start_time == 0 {
            return 0;
        }
        let mut released = 0;
        for slot in 0..SLOTS {
            let p = self.slot_pid(slot);
            if p.load(Ordering::Acquire) != pid
                || self.slot_start(slot).load(Ordering::Acquire) != start_time
                || self.slot_lock_held(slot) == Some(true)
                || p.compare_exchange(pid, RECLAIMING, Ordering::AcqRel, Ordering::Relaxed)
                    .is_err()
            {
                continue;
            }
            released += self.empty_reclaimed(slot);
        }
        released
    }

    /// Whether a slot is held under `pid` by no live lock holder (an earlier program of
    /// this process, before `exec`).
    pub fn has_slot_of(&self, pid: u32) -> bool {
        (0..SLOTS).any(|slot| {
            self.slot_pid(slot).load(Ordering::Relaxed) == pid
                && self.slot_lock_held(slot) != Some(true)
        })
    }

    /// Gives slot `slot` up, and what it holds with it (and its lock, when this process
    /// holds it).
    pub fn release_slot(&self, slot: usize) {
        if slot >= SLOTS {
            return;
        }
        for gpu in 0..self.gpu_count {
            let bytes = self.slot_used(slot, gpu).swap(0, Ordering::AcqRel);
            saturating_sub(self.total(gpu), bytes);
        }
        let was_locked = self.slot_flags(slot).swap(0, Ordering::AcqRel) & SLOT_LOCKED != 0;
        self.slot_start(slot).store(0, Ordering::Relaxed);
        self.slot_pid(slot).store(0, Ordering::Release);
        let fd = self.lock_fd.load(Ordering::Acquire);
        if was_locked && fd >= 0 {
            let _ = set_slot_lock(fd, slot, libc::F_UNLCK);
        }
    }

    /// Empties `slot`, which this process moved to [`RECLAIMING`], and frees it; returns
    /// its bytes.
    fn empty_reclaimed(&self, slot: usize) -> u64 {
        let mut bytes_back = 0;
        for gpu in 0..self.gpu_count {
            let bytes = self.slot_used(slot, gpu).swap(0, Ordering::AcqRel);
            saturating_sub(self.total(gpu), bytes);
            bytes_back += bytes;
        }
        self.slot_flags(slot).store(0, Ordering::Release);
        self.slot_start(slot).store(0, Ordering::Relaxed);
        self.slot_pid(slot).store(0, Ordering::Release);
        bytes_back
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
        if gpu >= self.gpu_count || self.closed {
            if gpu < self.gpu_count {
                self.refused(gpu).fetch_add(1, Ordering::Relaxed);
            }
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
            && !self.closed
            && self
                .used(gpu)
                .checked_add(bytes)
                .is_some_and(|next| next <= self.shares[gpu])
    }

    /// Adds `bytes` on `gpu` for `slot` even past the share: the driver already gave them
    /// (a pitched allocation larger than estimated).
    pub fn add(&self, slot: Option<usize>, gpu: usize, bytes: u64) {
        if gpu >= self.gpu_count || self.closed {
            return;
        }
        self.total(gpu).fetch_add(bytes, Ordering::AcqRel);
        if let Some(slot) = slot.filter(|s| *s < SLOTS) {
            self.slot_used(slot, gpu).fetch_add(bytes, Ordering::AcqRel);
        }
    }

    /// Gives back `bytes` on `gpu` that `slot` held.
    pub fn release(&self, slot: Option<usize>, gpu: usize, bytes: u64) {
        if gpu >= self.gpu_count || self.closed {
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
    /// Cheap enough for the refusal path: a slot seen alive within the last 50 ms is not
    /// asked about at all. A slot marked [`SLOT_LOCKED`] is alive while its lock is held
    /// (one `F_OFD_GETLK`, whatever PID namespace its holder is in). Any other is judged by
    /// pid: `/proc/PID/stat` (zombie, reused pid) is read only for a process this one has
    /// not seen alive under the same pid and start time in the last second; within that
    /// second it is asked with `kill(pid, 0)`.
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
            reclaimed += self.empty_reclaimed(slot);
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
        // Seen alive a moment ago: no system call at all.
        if age.is_some_and(|age| age < TRUSTED_ALIVE_MS) {
            return false;
        }
        let dead = match self.slot_lock_held(slot) {
            // A lock tells, whatever the pid means here.
            Some(held) => !held,
            None => match age {
                // Seen alive lately: only whether it still exists.
                Some(age) if age < SEEN_ALIVE_MS => return !process_exists(pid),
                _ => process_is_dead(pid, start),
            },
        };
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
        // Closing this process's lock descriptor lets its slot lock go, as its exit would.
        self.close_lock_fd();
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

/// A lock request over `slot`'s bytes.
fn slot_lock_request(slot: usize, kind: libc::c_int) -> libc::flock {
    // SAFETY: `flock` is a plain C struct for which all-zero bytes are a valid value.
    let mut request: libc::flock = unsafe { std::mem::zeroed() };
    request.l_type = kind as libc::c_short;
    request.l_whence = libc::SEEK_SET as libc::c_short;
    request.l_start = (HEADER_LEN + slot * SLOT_LEN) as libc::off_t;
    request.l_len = SLOT_LEN as libc::off_t;
    // OFD locks want 0 here.
    request.l_pid = 0;
    request
}

/// Takes (`F_WRLCK`) or lets go (`F_UNLCK`) the OFD lock on `slot`'s bytes through `fd`,
/// without waiting.
fn set_slot_lock(fd: RawFd, slot: usize, kind: libc::c_int) -> std::io::Result<()> {
    let request = slot_lock_request(slot, kind);
    // SAFETY: fcntl on a descriptor this budget keeps open, with a pointer to a live flock.
    if unsafe { libc::fcntl(fd, libc::F_OFD_SETLK, &raw const request) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Whether another open file description than `fd`'s holds a lock on `slot`'s bytes.
fn slot_lock_held(fd: RawFd, slot: usize) -> std::io::Result<bool> {
    let mut request = slot_lock_request(slot, libc::F_WRLCK);
    // SAFETY: fcntl on a descriptor this budget keeps open, with a pointer to a live flock
    // the kernel fills in.
    if unsafe { libc::fcntl(fd, libc::F_OFD_GETLK, &raw mut request) } == 0 {
        Ok(request.l_type != libc::F_UNLCK as libc::c_short)
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Whether a lock request failed because someone else holds the lock (rather than because
/// the filesystem has no OFD locks).
fn lock_is_busy(error: &std::io::Error) -> bool {
    matches!(error.raw_os_error(), Some(libc::EAGAIN | libc::EACCES))
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

/// Reads the finished header of the budget at `path` and checks it is `want`'s (`whose`
/// names where `want` came from, for the message).
fn check_header(file: &File, path: &Path, want: &Header, whose: &str) -> Result<()> {
    let mut header = vec![0u8; HEADER_LEN];
    file.read_exact_at(&mut header, 0)
        .map_err(Error::io(path, "reading its header"))?;
    let header = Header::parse(&header).map_err(|e| Error::mismatch(path, e.to_string()))?;
    if header.shares != want.shares {
        return Err(Error::mismatch(
            path,
            format!(
                "made for shares {:?}, not {whose} {:?}",
                header.shares, want.shares
            ),
        ));
    }
    Ok(())
}

/// Under the file lock: writes the header of an empty file, or checks an existing one.
fn init_or_check(file: &File, path: &Path, want: &Header) -> Result<()> {
    let io = |what| Error::io(path, what);
    let mismatch = |reason: String| Error::mismatch(path, reason);
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
    check_header(file, path, want, "this key's")?;
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
