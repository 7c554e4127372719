//! The accounting core: one process's view of its container's budget.
//!
//! An [`Interposer`] joins the shared [`Budget`] (what the container holds, per GPU) and the
//! process's [`Ledger`] (what each of its pointers, handles and contexts counted), and
//! keeps what is charged per holder rather than per call where the driver keeps memory past
//! the call that made it, each holder in a module of its own:
//!
//! - **contexts** (`contexts`): each is charged what it took (measured by the hooks) or
//!   [`Settings::context_bytes`] when made (or first seen), and given back, with everything
//!   made in it, when destroyed or reset;
//! - **stream-ordered pools** (`pools`): a pool is charged what it reserves, read from the
//!   driver after each allocation, free, trim and synchronisation, on the pool's own GPU;
//! - **VMM handles** (`vmm`): charged at `cuMemCreate`, given back when the last reference
//!   goes (the handle released and mapped nowhere);
//! - **graph memory** (`pools`): each GPU's graph memory pool is charged what it reserves.
//!
//! Allocations charged per pointer or handle, and their frees, are in `memory`. Here: the
//! slot this process counts in, holding a charge to the share, what programs are told of
//! memory ([`Interposer::memory`]) and the `fork` handlers.
//!
//! The `extern "C"` hooks in `hooks` are thin shells around it; it is also usable from Rust
//! (the tests and the bench drive it without a driver).

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use gpushare_isolation_budget::Limits;
use gpushare_isolation_budget::layout::{MAX_GPUS, SLOTS};
use rustc_hash::FxHashMap;

use crate::budget::{self, Budget};
use crate::compute::Throttle;
use crate::ledger::Ledger;
use crate::settings::Settings;
use crate::spin::SpinLock;

mod contexts;
mod memory;
mod pools;
mod vmm;

use contexts::Primary;
use pools::PoolCharge;
use vmm::Vmm;

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

/// Where an allocation is made: the GPU (its index in the budget) and the context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Place {
    /// The GPU's index in the container's budget.
    pub gpu: usize,
    /// The `CUcontext` (0: none known).
    pub ctx: u64,
}

/// Re-reads what the driver holds for this process's pools and graph memory, giving back
/// what it no longer does; says whether anything came back. Set by the hooks (it needs the
/// driver); the core alone has nothing to re-read.
pub type RoomMaker = fn(&Interposer) -> bool;

/// One process's accounting; see the module doc.
pub struct Interposer {
    budget: Budget,
    ledger: Ledger,
    settings: Settings,
    slot: AtomicUsize,
    epoch: Instant,
    /// Milliseconds after `epoch` of the last reclaim on the query path, plus one.
    last_query_reclaim: AtomicU64,
    /// Whether `before_fork` took the locks (the state may appear between the handlers).
    locked_for_fork: AtomicBool,
    pools: SpinLock<FxHashMap<u64, PoolCharge>>,
    vmm: SpinLock<Vmm>,
    primaries: SpinLock<FxHashMap<i32, Primary>>,
    graph_charged: [AtomicU64; MAX_GPUS],
    /// Per GPU, what the last context measured took (0: none measured).
    measured_context: [AtomicU64; MAX_GPUS],
    /// The last context found charged: the allocation path's fast check.
    last_ctx: AtomicU64,
    make_room: RoomMaker,
    /// The compute share's throttle; `None`: launches pass untouched.
    throttle: Option<Throttle>,
}

impl std::fmt::Debug for Interposer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interposer")
            .field("budget", &self.budget)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Interposer {
    /// Opens the budget at `path` for `limits`, with the default [`Settings`] but no
    /// context charge (the accounting alone).
    pub fn open(limits: &Limits, path: &Path) -> budget::Result<Self> {
        let settings = Settings {
            context_bytes: 0,
            measure_context: false,
            ..Settings::default()
        };
        Self::open_with(limits, settings, path)
    }

    /// Opens the budget at `path` for `limits` and `settings`.
    pub fn open_with(limits: &Limits, settings: Settings, path: &Path) -> budget::Result<Self> {
        Ok(Self::with_budget(Budget::open(path, limits)?, settings))
    }

    /// The accounting over `budget` (opened, prepared or closed) with `settings`.
    pub fn with_budget(budget: Budget, settings: Settings) -> Self {
        // The container's compute state is shared with the node's other containers, in the
        // node-wide directory (else beside the budget); a closed budget holds no launch.
        let throttle = budget.identity().and_then(|id| {
            let dir = settings
                .compute_dir
                .clone()
                .or_else(|| budget.path().parent().map(Path::to_path_buf))?;
            Throttle::new(settings.compute, id, dir)
        });
        Self {
            budget,
            ledger: Ledger::default(),
            settings,
            slot: AtomicUsize::new(UNCLAIMED),
            epoch: Instant::now(),
            last_query_reclaim: AtomicU64::new(0),
            locked_for_fork: AtomicBool::new(false),
            pools: SpinLock::new(FxHashMap::default()),
            vmm: SpinLock::new(Vmm::default()),
            primaries: SpinLock::new(FxHashMap::default()),
            graph_charged: std::array::from_fn(|_| AtomicU64::new(0)),
            measured_context: std::array::from_fn(|_| AtomicU64::new(0)),
            last_ctx: AtomicU64::new(0),
            make_room: |_| false,
            throttle,
        }
    }

    /// The compute throttle, when the container has a compute share that is held.
    #[inline]
    pub fn throttle(&self) -> Option<&Throttle> {
        self.throttle.as_ref()
    }

    /// Sets what re-reads the driver's figures before an allocation is refused.
    pub fn with_room_maker(mut self, make_room: RoomMaker) -> Self {
        self.make_room = make_room;
        self
    }

    /// The shared budget.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// This process's record.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// The settings it was opened with.
    pub fn settings(&self) -> &Settings {
        &self.settings
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
        let claimed = self.budget.claim_own_slot(pid, start).unwrap_or(NO_SLOT);
        // Only this thread moves the slot out of CLAIMING; a fork child starts over from
        // UNCLAIMED (`after_fork_in_child`).
        self.slot.store(claimed, Ordering::Release);
        (claimed < SLOTS).then_some(claimed)
    }

    /// Gives back what an earlier program of this process held, before it called `exec`:
    /// the driver state died with it. Run when the library is loaded into a new program.
    pub fn forget_earlier_program(&self) {
        let pid = std::process::id();
        if self.budget.has_slot_of(pid) {
            let (pid, start) = budget::this_process();
            self.budget.release_slots_of(pid, start);
        }
    }

    /// Reserves `bytes` on `gpu`, re-reading the driver's figures and reclaiming the dead
    /// before refusing.
    fn reserve(&self, slot: Option<usize>, gpu: usize, bytes: u64) -> bool {
        self.budget
            .try_reserve_with(slot, gpu, bytes, || (self.make_room)(self))
    }

    /// Whether `bytes` more fit `gpu`'s share now, after re-reading the driver's figures and
    /// reclaiming the dead; nothing stays reserved, and a refusal is counted.
    pub fn would_fit(&self, gpu: usize, bytes: u64) -> bool {
        let slot = self.slot();
        let fits = self.reserve(slot, gpu, bytes);
        if fits {
            self.budget.release(slot, gpu, bytes);
        }
        fits
    }

    /// Moves what `gpu` holds for this process from `from` to `to` bytes.
    fn adjust(&self, slot: Option<usize>, gpu: usize, from: u64, to: u64) {
        if to > from {
            self.budget.add(slot, gpu, to - from);
        } else {
            self.budget.release(slot, gpu, from - to);
        }
    }

    /// `(free, total)` of `gpu` as the program should see them, given what the driver says
    /// is free: total is the share, free is `min(share - used, driver_free)`. Reclaims dead
    /// processes' bytes and re-reads this process's pools first (at most every 200 ms).
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
            (self.make_room)(self);
        }
        let share = self.budget.share(gpu);
        let free = share.saturating_sub(self.budget.used(gpu)).min(driver_free);
        (free, share)
    }

    /// Before `fork`.
    pub(crate) fn before_fork(&self) {
        self.ledger.lock_all();
        self.pools.raw_lock();
        self.vmm.raw_lock();
        self.primaries.raw_lock();
        if let Some(throttle) = &self.throttle {
            throttle.measure.raw_lock();
        }
        self.locked_for_fork.store(true, Ordering::Release);
    }

    /// After `fork`, in the parent.
    pub(crate) fn after_fork_in_parent(&self) {
        if self.locked_for_fork.swap(false, Ordering::AcqRel) {
            self.ledger.unlock_all();
            // SAFETY: before_fork took these in this thread.
            unsafe {
                self.pools.raw_unlock();
                self.vmm.raw_unlock();
                self.primaries.raw_unlock();
                if let Some(throttle) = &self.throttle {
                    throttle.measure.raw_unlock();
                }
            }
        }
    }

    /// After `fork`, in the child: a new process, so a new slot (claimed on its first
    /// allocation) and an empty record: the parent's contexts, pools and mappings are the
    /// parent's.
    pub(crate) fn after_fork_in_child(&self) {
        self.budget.forget_lock_in_child();
        self.slot.store(UNCLAIMED, Ordering::Release);
        self.last_ctx.store(0, Ordering::Release);
        for charged in &self.graph_charged {
            charged.store(0, Ordering::Release);
        }
        if self.locked_for_fork.swap(false, Ordering::AcqRel) {
            self.ledger.clear_and_unlock_all();
            // SAFETY: before_fork took these in the thread that forked, the child's only
            // thread.
            unsafe {
                self.pools.locked_value().clear();
                *self.vmm.locked_value() = Vmm::default();
                self.primaries.locked_value().clear();
                self.pools.raw_unlock();
                self.vmm.raw_unlock();
                self.primaries.raw_unlock();
                if let Some(throttle) = &self.throttle {
                    throttle.measure.locked_value().forget();
                    throttle.measure.raw_unlock();
                }
            }
        }
    }
}
