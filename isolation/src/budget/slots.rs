//! Slots: each process of the container books what it holds in a slot of its own, so that
//! what a dead process held can be given back.
//!
//! - Claim: a process takes a free slot on its first allocation (a fork child takes its
//!   own). It first locks the slot's bytes (`fcntl(F_OFD_SETLK, F_WRLCK)`) through a
//!   descriptor it opened itself (`O_CLOEXEC`, kept for its life; a fork child closes its
//!   copy of the parent's), marks the slot `SLOT_LOCKED`, then CASes its pid in. A slot
//!   whose lock another claimer holds is passed over. Where the lock cannot be taken (a
//!   filesystem without OFD locks) the slot is claimed unmarked.
//! - Exec: a program that `exec`s leaves a slot with its pid and start time, its lock gone
//!   with the old program's descriptors: the new program frees it before claiming (the old
//!   driver state died with the exec). A slot with the same pid whose lock is held (a
//!   process of another PID namespace) is never taken for one's own.
//!
//! How a slot's holder is found dead, and its slot reclaimed, is in `reclaim`.

use std::fs::OpenOptions;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::Ordering;

use gpushare_isolation_budget::layout::{HEADER_LEN, RECLAIMING, SLOT_LEN, SLOT_LOCKED, SLOTS};

use super::{Budget, saturating_sub};

impl Budget {
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
    pub(super) fn close_lock_fd(&self) {
        let fd = self.lock_fd.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            // SAFETY: this process's lock descriptor (a fork child's copy of it), taken out of
            // `lock_fd` above, so closed once.
            unsafe { libc::close(fd) };
        }
    }

    /// Whether `slot` is marked locked and someone (another open file description than
    /// the budget's own) holds its lock now; `None` when unmarked or the kernel cannot say.
    pub(super) fn slot_lock_held(&self, slot: usize) -> Option<bool> {
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
    pub(super) fn empty_reclaimed(&self, slot: usize) -> u64 {
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
