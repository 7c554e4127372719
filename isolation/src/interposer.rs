//! The accounting core: one process's view of its container's budget.
//!
//! An [`Interposer`] joins the shared [`Budget`] (what the container holds, per GPU) and the
//! process's [`Ledger`] (what each of its pointers counted). The `extern "C"` hooks in
//! `exports` are thin shells around it; it is also usable from Rust (the bench drives it
//! against a fake driver).

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use gpushare_isolation_budget::Limits;
use gpushare_isolation_budget::layout::SLOTS;

use crate::budget::{self, Budget};
use crate::ledger::{Entry, Kind, Ledger};

/// `CUDA_SUCCESS`.
pub const CUDA_SUCCESS: i32 = 0;
/// `CUDA_ERROR_OUT_OF_MEMORY`: what a refused allocation returns.
pub const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;

/// No slot claimed yet (a fresh process, or a fork child).
const UNCLAIMED: usize = usize::MAX;
/// Every slot was taken: count without one.
const NO_SLOT: usize = usize::MAX - 1;
/// A thread is claiming the slot; the others wait for it.
const CLAIMING: usize = usize::MAX - 2;
/// Memory queries reclaim dead processes' bytes at most this often.
const QUERY_RECLAIM_EVERY_MS: u64 = 200;

/// One process's accounting; see the module doc.
#[derive(Debug)]
pub struct Interposer {
    budget: Budget,
    ledger: Ledger,
    slot: AtomicUsize,
    epoch: Instant,
    /// Milliseconds after `epoch` of the last reclaim on the query path, plus one.
    last_query_reclaim: AtomicU64,
    /// Whether `before_fork` took the ledger (the state may appear between the handlers).
    locked_for_fork: AtomicBool,
}

impl Interposer {
    /// Opens the budget at `path` for `limits`.
    pub fn open(limits: &Limits, path: &Path) -> budget::Result<Self> {
        Ok(Self {
            budget: Budget::open(path, limits)?,
            ledger: Ledger::default(),
            slot: AtomicUsize::new(UNCLAIMED),
            epoch: Instant::now(),
            last_query_reclaim: AtomicU64::new(0),
            locked_for_fork: AtomicBool::new(false),
        })
    }

    /// The shared budget.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// This process's record.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// This process's slot, claimed on first use; `None` when all are taken.
    ///
    /// One thread claims while the others wait: the claim first gives up the slots of this
    /// very process (an earlier program's, before `exec`), and a second thread doing that
    /// after the first had claimed would give up the first's slot, and the bytes it already
    /// counted, letting the container past its share.
    fn slot(&self) -> Option<usize> {
        loop {
            // A plain load first: every allocation passes here, and a write (even a failed
            // compare-exchange) would bounce the line between the threads' caches.
            match self.slot.load(Ordering::Acquire) {
                s if s < SLOTS => return Some(s),
                NO_SLOT => return None,
                UNCLAIMED
                    if self
                        .slot
                        .compare_exchange(UNCLAIMED, CLAIMING, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok() =>
                {
                    break;
                }
                // Another thread is claiming: a few microseconds.
                _ => std::thread::yield_now(),
            }
        }
        let (pid, start) = budget::this_process();
        self.budget.release_slots_of(pid, start);
        let claimed = self.budget.claim_slot(pid, start).unwrap_or(NO_SLOT);
        // Only this thread moves the slot out of CLAIMING; a fork child starts over from
        // UNCLAIMED (`after_fork_in_child`).
        self.slot.store(claimed, Ordering::Release);
        (claimed < SLOTS).then_some(claimed)
    }

    /// An allocation of `bytes` on `gpu`: past the share it is refused with
    /// [`CUDA_ERROR_OUT_OF_MEMORY`] and `call` never runs; else `call` (the driver) runs and,
    /// when it returns the new pointer or handle, the bytes stay counted under it.
    pub fn allocate(
        &self,
        kind: Kind,
        gpu: usize,
        bytes: u64,
        call: impl FnOnce() -> Result<u64, i32>,
    ) -> i32 {
        self.allocate_sized(kind, gpu, bytes, || call().map(|key| (key, bytes)))
    }

    /// As [`allocate`](Self::allocate), for a size known only afterwards (pitched memory):
    /// `estimate` is held to the share, and `call` returns the key and the real size, which
    /// replaces the estimate.
    pub fn allocate_sized(
        &self,
        kind: Kind,
        gpu: usize,
        estimate: u64,
        call: impl FnOnce() -> Result<(u64, u64), i32>,
    ) -> i32 {
        let slot = self.slot();
        if !self.budget.try_reserve(slot, gpu, estimate) {
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        match call() {
            Ok((key, bytes)) => {
                if bytes > estimate {
                    self.budget.add(slot, gpu, bytes - estimate);
                } else {
                    self.budget.release(slot, gpu, estimate - bytes);
                }
                if let Some(stale) = self.ledger.insert(kind, key, Entry { gpu, bytes }) {
                    // The driver handed out a key whose free we never saw: it was freed.
                    self.budget.release(slot, stale.gpu, stale.bytes);
                }
                CUDA_SUCCESS
            }
            Err(code) => {
                self.budget.release(slot, gpu, estimate);
                code
            }
        }
    }

    /// A free of `key`: `call` (the driver) runs; on success what the allocation counted is
    /// given back. Keys we never counted (allocated before the limits, or by the parent of a
    /// fork) just pass.
    pub fn free(&self, kind: Kind, key: u64, call: impl FnOnce() -> i32) -> i32 {
        // Taken out before the call: once the driver has freed it, another thread may get the
        // same address back and record it.
        let entry = self.ledger.remove(kind, key);
        let code = call();
        if let Some(entry) = entry {
            if code == CUDA_SUCCESS {
                self.budget.release(self.slot(), entry.gpu, entry.bytes);
            } else {
                self.ledger.insert(kind, key, entry);
            }
        }
        code
    }

    /// `(free, total)` of `gpu` as the program should see them, given what the driver says
    /// is free: total is the share, free is `min(share - used, driver_free)`. Reclaims dead
    /// processes' bytes first (at most every 200 ms).
    pub fn memory(&self, gpu: usize, driver_free: u64) -> (u64, u64) {
        let now = self.epoch.elapsed().as_millis() as u64 + 1;
        let last = self.last_query_reclaim.load(Ordering::Relaxed);
        if (last == 0 || now.saturating_sub(last) >= QUERY_RECLAIM_EVERY_MS)
            && self
                .last_query_reclaim
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            self.budget.reclaim_dead();
        }
        let share = self.budget.share(gpu);
        let free = share.saturating_sub(self.budget.used(gpu)).min(driver_free);
        (free, share)
    }

    /// Before `fork`.
    pub(crate) fn before_fork(&self) {
        self.ledger.lock_all();
        self.locked_for_fork.store(true, Ordering::Release);
    }

    /// After `fork`, in the parent.
    pub(crate) fn after_fork_in_parent(&self) {
        if self.locked_for_fork.swap(false, Ordering::AcqRel) {
            self.ledger.unlock_all();
        }
    }

    /// After `fork`, in the child: a new process, so a new slot (claimed on its first
    /// allocation) and an empty record.
    pub(crate) fn after_fork_in_child(&self) {
        self.slot.store(UNCLAIMED, Ordering::Release);
        if self.locked_for_fork.swap(false, Ordering::AcqRel) {
            self.ledger.clear_and_unlock_all();
        }
    }
}
