//! The accounting core: one process's view of its container's budget.
//!
//! An [`Interposer`] joins the shared [`Budget`] (what the container holds, per GPU) and the
//! process's [`Ledger`] (what each of its pointers, handles and contexts counted), and
//! keeps what is charged per holder rather than per call where the driver keeps memory past
//! the call that made it:
//!
//! - **contexts**: each is charged what it took (measured by the hooks) or
//!   [`Settings::context_bytes`] when made (or first seen), and given back, with everything
//!   made in it, when destroyed or reset;
//! - **stream-ordered pools**: a pool is charged what it reserves, read from the driver
//!   after each allocation, free, trim and synchronisation, on the pool's own GPU;
//! - **VMM handles**: charged at `cuMemCreate`, given back when the last reference goes
//!   (the handle released and mapped nowhere);
//! - **graph memory**: each GPU's graph memory pool is charged what it reserves.
//!
//! The `extern "C"` hooks in `hooks` are thin shells around it; it is also usable from Rust
//! (the tests and the bench drive it without a driver).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use gpushare_isolation_budget::Limits;
use gpushare_isolation_budget::layout::{MAX_GPUS, SLOTS};
use rustc_hash::FxHashMap;

use crate::budget::{self, Budget};
use crate::ledger::{Entry, Kind, Ledger};
use crate::settings::Settings;
use crate::spin::SpinLock;

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

/// What a stream-ordered pool is charged.
#[derive(Debug, Clone, Copy)]
struct PoolCharge {
    gpu: usize,
    charged: u64,
    /// Bumped by each allocation's charge: a re-read begun before one is stale.
    seq: u64,
}

/// VMM handles and their references: the creation, each mapping, each retain.
#[derive(Debug, Default)]
struct Vmm {
    refs: FxHashMap<u64, u32>,
    /// Mapped address → (handle, size).
    maps: BTreeMap<u64, (u64, u64)>,
}

/// A device's primary context as this process holds it.
#[derive(Debug, Clone, Copy, Default)]
struct Primary {
    ctx: u64,
    retains: u32,
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
        }
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
        self.allocate_at(kind, Place { gpu, ctx: 0 }, bytes, call)
    }

    /// As [`allocate`](Self::allocate), made in `place`'s context.
    pub fn allocate_at(
        &self,
        kind: Kind,
        place: Place,
        bytes: u64,
        call: impl FnOnce() -> Result<u64, i32>,
    ) -> i32 {
        self.allocate_sized_at(kind, place, bytes, || call().map(|key| (key, bytes)))
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
        self.allocate_sized_at(kind, Place { gpu, ctx: 0 }, estimate, call)
    }

    /// As [`allocate_sized`](Self::allocate_sized), made in `place`'s context.
    pub fn allocate_sized_at(
        &self,
        kind: Kind,
        place: Place,
        estimate: u64,
        call: impl FnOnce() -> Result<(u64, u64), i32>,
    ) -> i32 {
        let slot = self.slot();
        let gpu = place.gpu;
        if !self.reserve(slot, gpu, estimate) {
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        match call() {
            Ok((key, bytes)) => {
                self.adjust(slot, gpu, estimate, bytes);
                let entry = Entry {
                    gpu,
                    bytes,
                    ctx: place.ctx,
                    pool: 0,
                };
                if let Some(stale) = self.ledger.insert(kind, key, entry) {
                    // The driver handed out a key whose free we never saw: it was freed.
                    self.budget.release(slot, stale.gpu, stale.bytes);
                }
                if kind == Kind::Handle {
                    self.vmm.lock().refs.insert(key, 1);
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

    /// A free of device pointer `key`, from `cuMemAlloc*` or from a pool: as
    /// [`free`](Self::free); returns the driver's answer and, for a pool's pointer, the pool
    /// (whose reservation the caller re-reads).
    pub fn free_pointer(&self, key: u64, call: impl FnOnce() -> i32) -> (i32, Option<u64>) {
        match self.ledger.remove(Kind::PoolPointer, key) {
            Some(entry) => {
                let code = call();
                if code != CUDA_SUCCESS {
                    self.ledger.insert(Kind::PoolPointer, key, entry);
                }
                (code, Some(entry.pool))
            }
            None => (self.free(Kind::Pointer, key, call), None),
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

    // ---- contexts ----

    /// A context made on `gpu` by `create` (which returns it): charged
    /// [`Settings::context_bytes`], refused like an allocation when that does not fit.
    /// Returns the context.
    pub fn create_context(
        &self,
        gpu: usize,
        create: impl FnOnce() -> Result<u64, i32>,
    ) -> Result<u64, i32> {
        self.create_context_measured(gpu, create, || None)
    }

    /// As [`create_context`](Self::create_context); `measured` then says what the context
    /// really took (`None`: unknown), which becomes its charge, and this process's estimate
    /// for the next context on that GPU.
    pub fn create_context_measured(
        &self,
        gpu: usize,
        create: impl FnOnce() -> Result<u64, i32>,
        measured: impl FnOnce() -> Option<u64>,
    ) -> Result<u64, i32> {
        let estimate = self.context_estimate(gpu);
        let slot = self.slot();
        if !self.reserve(slot, gpu, estimate) {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        match create() {
            Ok(ctx) => {
                let bytes = match measured() {
                    Some(bytes) => {
                        if let Some(remembered) = self.measured_context.get(gpu) {
                            remembered.store(bytes, Ordering::Relaxed);
                        }
                        self.adjust(slot, gpu, estimate, bytes);
                        bytes
                    }
                    None => estimate,
                };
                self.record_context(slot, ctx, gpu, bytes);
                Ok(ctx)
            }
            Err(code) => {
                self.budget.release(slot, gpu, estimate);
                Err(code)
            }
        }
    }

    /// What a context on `gpu` is charged before (or without) a measure: the last measured
    /// in this process, else the configured figure.
    fn context_estimate(&self, gpu: usize) -> u64 {
        match self
            .measured_context
            .get(gpu)
            .map(|m| m.load(Ordering::Relaxed))
        {
            Some(measured) if measured > 0 && self.settings.measure_context => measured,
            _ => self.settings.context_bytes,
        }
    }

    /// Records `ctx`'s charge, already counted in the budget.
    fn record_context(&self, slot: Option<usize>, ctx: u64, gpu: usize, bytes: u64) {
        let entry = Entry {
            gpu,
            bytes,
            ctx,
            pool: 0,
        };
        if let Some(stale) = self.ledger.insert(Kind::Context, ctx, entry) {
            self.budget.release(slot, stale.gpu, stale.bytes);
        }
        self.last_ctx.store(ctx, Ordering::Release);
    }

    /// Charges context `ctx` on `gpu` if it is not yet (one made before the limits, or
    /// brought back after a reset); the driver already holds it, so past the share too.
    pub fn ensure_context(&self, ctx: u64, gpu: usize) {
        if ctx == 0 || self.last_ctx.load(Ordering::Acquire) == ctx {
            return;
        }
        if self.ledger.get(Kind::Context, ctx).is_none() {
            let slot = self.slot();
            let bytes = self.context_estimate(gpu);
            self.budget.add(slot, gpu, bytes);
            self.record_context(slot, ctx, gpu, bytes);
        } else {
            self.last_ctx.store(ctx, Ordering::Release);
            // A destruction or reset may have taken the charge meanwhile: the fast path
            // must not skip a context that is no longer charged.
            if self.ledger.get(Kind::Context, ctx).is_none() {
                let _ = self
                    .last_ctx
                    .compare_exchange(ctx, 0, Ordering::AcqRel, Ordering::Relaxed);
            }
        }
    }

    /// Everything made in `ctx` is gone (the context destroyed or reset): gives it back,
    /// the context's own charge too. Returns the bytes.
    pub fn drop_context(&self, ctx: u64) -> u64 {
        let _ = self
            .last_ctx
            .compare_exchange(ctx, 0, Ordering::AcqRel, Ordering::Relaxed);
        let slot = self.slot();
        let mut bytes = 0;
        for (_, entry) in self.ledger.take_context(ctx) {
            self.budget.release(slot, entry.gpu, entry.bytes);
            bytes += entry.bytes;
        }
        bytes
    }

    /// `cuDevicePrimaryCtxRetain` of device `ordinal` (budget GPU `gpu`): the first retain
    /// makes the primary context, and charges it (what `measured` says it took, if it can).
    pub fn retain_primary(
        &self,
        ordinal: i32,
        gpu: usize,
        retain: impl FnOnce() -> Result<u64, i32>,
        measured: impl FnOnce() -> Option<u64>,
    ) -> i32 {
        let first = self
            .primaries
            .lock()
            .get(&ordinal)
            .is_none_or(|p| p.retains == 0);
        if !first {
            return match retain() {
                Ok(ctx) => {
                    self.count_retain(ordinal, ctx);
                    CUDA_SUCCESS
                }
                Err(code) => code,
            };
        }
        match self.create_context_measured(gpu, retain, measured) {
            Ok(ctx) => {
                self.count_retain(ordinal, ctx);
                CUDA_SUCCESS
            }
            Err(code) => code,
        }
    }

    fn count_retain(&self, ordinal: i32, ctx: u64) {
        let mut primaries = self.primaries.lock();
        let primary = primaries.entry(ordinal).or_default();
        primary.ctx = ctx;
        primary.retains = primary.retains.saturating_add(1);
    }

    /// `cuDevicePrimaryCtxRelease` of device `ordinal` succeeded: the last release destroys
    /// the primary context.
    pub fn release_primary(&self, ordinal: i32) {
        let gone = {
            let mut primaries = self.primaries.lock();
            match primaries.get_mut(&ordinal) {
                Some(p) if p.retains > 0 => {
                    p.retains -= 1;
                    (p.retains == 0).then_some(p.ctx)
                }
                _ => None,
            }
        };
        if let Some(ctx) = gone {
            self.drop_context(ctx);
        }
    }

    /// `cuDevicePrimaryCtxReset` of device `ordinal` succeeded: everything in its primary
    /// context is gone (the context comes back, and is charged again, when next used).
    pub fn reset_primary(&self, ordinal: i32) {
        let ctx = self.primaries.lock().get(&ordinal).map(|p| p.ctx);
        if let Some(ctx) = ctx {
            self.drop_context(ctx);
        }
    }

    /// `cuCtxSetLimit` raising (or lowering) a limit of `place`'s context by `delta` bytes
    /// of device memory: a raise past the share is refused and `call` never runs.
    pub fn change_limit(
        &self,
        place: Place,
        limit: u8,
        delta: i128,
        call: impl FnOnce() -> i32,
    ) -> i32 {
        let slot = self.slot();
        let raise = u64::try_from(delta.max(0)).unwrap_or(u64::MAX);
        if raise > 0 && !self.reserve(slot, place.gpu, raise) {
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        let code = call();
        if code != CUDA_SUCCESS {
            self.budget.release(slot, place.gpu, raise);
            return code;
        }
        let lower = u64::try_from((-delta).max(0)).unwrap_or(u64::MAX);
        let given_back = self.ledger.update(Kind::Limit(limit), place.ctx, |entry| {
            entry.gpu = place.gpu;
            entry.ctx = place.ctx;
            let back = lower.min(entry.bytes);
            entry.bytes = entry.bytes.saturating_add(raise) - back;
            back
        });
        self.budget.release(slot, place.gpu, given_back);
        code
    }

    // ---- stream-ordered pools ----

    /// A pool made on `gpu`: its reservation is charged there.
    pub fn pool_created(&self, pool: u64, gpu: usize) {
        self.pools.lock().insert(
            pool,
            PoolCharge {
                gpu,
                charged: 0,
                seq: 0,
            },
        );
    }

    /// The GPU a pool we know is on.
    pub fn pool_gpu(&self, pool: u64) -> Option<usize> {
        self.pools.lock().get(&pool).map(|p| p.gpu)
    }

    /// Every pool charged, for a re-read.
    pub fn pools(&self) -> Vec<u64> {
        self.pools.lock().keys().copied().collect()
    }

    /// An allocation of `bytes` from `pool` (on `place.gpu`), which holds `room` bytes
    /// reserved and unused: what it may grow by (`bytes - room`) is held to the share;
    /// `call` allocates, and `reserved` reads the pool's reservation afterwards, which
    /// becomes its charge.
    pub fn allocate_from_pool(
        &self,
        place: Place,
        pool: u64,
        bytes: u64,
        room: u64,
        call: impl FnOnce() -> Result<u64, i32>,
        reserved: impl FnOnce() -> Option<u64>,
    ) -> i32 {
        let slot = self.slot();
        let gpu = place.gpu;
        let hold = bytes.saturating_sub(room);
        if !self.reserve(slot, gpu, hold) {
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        match call() {
            Ok(key) => {
                match reserved() {
                    Some(now) => self.set_pool_charge(slot, pool, gpu, now, hold),
                    // The driver cannot say: the pool is charged what was asked of it.
                    None => {
                        let mut pools = self.pools.lock();
                        let charge = pools.entry(pool).or_insert(PoolCharge {
                            gpu,
                            charged: 0,
                            seq: 0,
                        });
                        charge.charged = charge.charged.saturating_add(hold);
                    }
                }
                let entry = Entry {
                    gpu,
                    bytes: 0,
                    ctx: place.ctx,
                    pool,
                };
                self.ledger.insert(Kind::PoolPointer, key, entry);
                CUDA_SUCCESS
            }
            Err(code) => {
                self.budget.release(slot, gpu, hold);
                code
            }
        }
    }

    /// `pool` reserves `reserved` bytes now (`held`: bytes already reserved for it in the
    /// budget besides its charge).
    fn set_pool_charge(
        &self,
        slot: Option<usize>,
        pool: u64,
        gpu: usize,
        reserved: u64,
        held: u64,
    ) {
        let (gpu, old) = {
            let mut pools = self.pools.lock();
            let charge = pools.entry(pool).or_insert(PoolCharge {
                gpu,
                charged: 0,
                seq: 0,
            });
            let old = charge.charged;
            charge.charged = reserved;
            charge.seq = charge.seq.wrapping_add(1);
            (charge.gpu, old)
        };
        self.adjust(slot, gpu, old.saturating_add(held), reserved);
    }

    /// Re-reads `pool`: `reserved` is its reservation now (`None`: the driver could not
    /// say, and the charge stays). Returns the bytes given back.
    pub fn refresh_pool(&self, pool: u64, reserved: Option<u64>) -> u64 {
        self.refresh_pool_with(pool, || reserved)
    }

    /// As [`refresh_pool`](Self::refresh_pool), `read` reading the reservation; a reading
    /// begun before an allocation from the pool charged it is dropped (it may predate
    /// the growth that allocation made).
    pub fn refresh_pool_with(&self, pool: u64, read: impl FnOnce() -> Option<u64>) -> u64 {
        let Some(seq) = self.pools.lock().get(&pool).map(|p| p.seq) else {
            return 0;
        };
        let Some(now) = read() else {
            return 0;
        };
        let Some((gpu, old)) = ({
            let mut pools = self.pools.lock();
            pools
                .get_mut(&pool)
                .filter(|charge| charge.seq == seq)
                .map(|charge| {
                    let old = charge.charged;
                    charge.charged = now;
                    (charge.gpu, old)
                })
        }) else {
            return 0;
        };
        self.adjust(self.slot(), gpu, old, now);
        old.saturating_sub(now)
    }

    /// `pool` was destroyed: its charge goes. Returns it.
    pub fn pool_destroyed(&self, pool: u64) -> u64 {
        let gone = self.pools.lock().remove(&pool);
        gone.map_or(0, |charge| {
            self.budget.release(self.slot(), charge.gpu, charge.charged);
            charge.charged
        })
    }

    // ---- VMM ----

    /// `cuMemMap` of `handle` at `ptr` succeeded: a reference.
    pub fn mapped(&self, ptr: u64, size: u64, handle: u64) {
        let mut vmm = self.vmm.lock();
        if let Some(refs) = vmm.refs.get_mut(&handle) {
            *refs = refs.saturating_add(1);
            vmm.maps.insert(ptr, (handle, size));
        }
    }

    /// `cuMemUnmap` of `[ptr, ptr + size)` succeeded: each mapping in it drops a reference.
    pub fn unmapped(&self, ptr: u64, size: u64) {
        let gone: Vec<u64> = {
            let mut vmm = self.vmm.lock();
            let end = ptr.saturating_add(size.max(1));
            let inside: Vec<(u64, u64)> = vmm
                .maps
                .range(ptr..end)
                .map(|(&at, &(handle, _))| (at, handle))
                .collect();
            let mut gone = Vec::new();
            for (at, handle) in inside {
                vmm.maps.remove(&at);
                if let Some(refs) = vmm.refs.get_mut(&handle) {
                    *refs = refs.saturating_sub(1);
                    if *refs == 0 {
                        vmm.refs.remove(&handle);
                        gone.push(handle);
                    }
                }
            }
            gone
        };
        for handle in gone {
            self.give_back_handle(handle);
        }
    }

    /// `cuMemRetainAllocationHandle` answered `handle`: a reference.
    pub fn retained(&self, handle: u64) {
        if let Some(refs) = self.vmm.lock().refs.get_mut(&handle) {
            *refs = refs.saturating_add(1);
        }
    }

    /// `cuMemRelease` of `handle` succeeded: a reference goes, and with the last one its
    /// bytes (a handle we never saw made is given back at once, as before).
    pub fn released(&self, handle: u64) {
        let last = {
            let mut vmm = self.vmm.lock();
            match vmm.refs.get_mut(&handle) {
                Some(refs) if *refs > 1 => {
                    *refs -= 1;
                    false
                }
                _ => {
                    vmm.refs.remove(&handle);
                    true
                }
            }
        };
        if last {
            self.give_back_handle(handle);
        }
    }

    fn give_back_handle(&self, handle: u64) {
        if let Some(entry) = self.ledger.remove(Kind::Handle, handle) {
            self.budget.release(self.slot(), entry.gpu, entry.bytes);
        }
    }

    // ---- graph memory ----

    /// `gpu`'s graph memory pool reserves `reserved` bytes now: its charge. Returns the
    /// bytes given back.
    pub fn set_graph_charge(&self, gpu: usize, reserved: u64) -> u64 {
        let Some(charged) = self.graph_charged.get(gpu) else {
            return 0;
        };
        let old = charged.swap(reserved, Ordering::AcqRel);
        self.adjust(self.slot(), gpu, old, reserved);
        old.saturating_sub(reserved)
    }

    // ---- fork ----

    /// Before `fork`.
    pub(crate) fn before_fork(&self) {
        self.ledger.lock_all();
        self.pools.raw_lock();
        self.vmm.raw_lock();
        self.primaries.raw_lock();
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
            }
        }
    }
}
