//! The budget file: one per container, shared by all its processes through `mmap(MAP_SHARED)`,
//! updated with atomics only.
//!
//! The file's bytes and name, and the safe reader, are in `gpushare-isolation-budget`
//! ([`gpushare_isolation_budget::layout`]); what is here is the mapping and the atomics that
//! write it.
//!
//! # Protocol
//!
//! In the order a budget lives it, each step with the module that holds its code:
//!
//! - Made, by the plugin or by the container's first process, then mapped: `file`.
//! - Allocate: a CAS loop on `used[gpu]` that refuses past `share[gpu]` (bumping
//!   `refused[gpu]`), then the slot's `used[gpu]` grows. The total is reserved first, so a
//!   process killed between the two steps can only leave the budget too full, never over.
//! - Free: the slot's and the total's `used[gpu]` shrink (saturating).
//! - Claim a slot, and free the one an earlier program of the process left when it called
//!   `exec`: `slots`.
//! - Liveness and reclaim: find the slots of dead processes and give their bytes back:
//!   `reclaim`.
//!
//! Allocate and free are here, with the figures queries read, on the atomics through which
//! [`Budget`] reads and writes the mapping.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use gpushare_isolation_budget::layout::{
    FILE_LEN, HEADER_LEN, MAX_GPUS, OFF_REFUSED, OFF_USED, SLOT_FLAGS, SLOT_LEN, SLOT_PID,
    SLOT_START, SLOT_USED, SLOTS,
};

mod file;
mod reclaim;
mod slots;

pub use file::{Exclusive, path_from_env};
use reclaim::SeenAlive;
pub(crate) use reclaim::this_process;

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

impl Drop for Budget {
    fn drop(&mut self) {
        // Closing this process's lock descriptor lets its slot lock go, as its exit would.
        self.close_lock_fd();
        // SAFETY: the mapping made in open, of FILE_LEN bytes; nothing borrows it any more.
        unsafe { libc::munmap(self.map.as_ptr().cast(), FILE_LEN) };
    }
}

impl Budget {
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

    /// The container this budget is for, as a number no other container on the node shares
    /// (the file's device and inode: every process of the container maps the same file,
    /// whatever path it sees it under); `None` for a closed budget.
    pub fn identity(&self) -> Option<u64> {
        use std::os::unix::fs::MetadataExt as _;
        let meta = self.file.as_ref()?.metadata().ok()?;
        Some(gpushare_isolation_budget::compute::container_id(
            meta.dev(),
            meta.ino(),
        ))
    }

    /// The budget file's path as this process opened it.
    pub fn path(&self) -> &Path {
        &self.path
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
}

fn saturating_sub(atomic: &AtomicU64, bytes: u64) {
    if bytes == 0 {
        return;
    }
    let _ = atomic.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |v| {
        Some(v.saturating_sub(bytes))
    });
}
