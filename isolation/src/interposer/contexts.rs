//! Contexts: each is charged what it took (measured by the hooks) or
//! [`Settings::context_bytes`] when made (or first seen), and given back, with everything
//! made in it, when destroyed or reset.
//!
//! A device's primary context is made by its first retain and destroyed by its last
//! release; a reset gives back what was made in it. `cuCtxSetLimit` raises (heap, printf
//! buffer, stack) are charged to the context whose limit they raise.
//!
//! [`Settings::context_bytes`]: crate::Settings::context_bytes

use std::sync::atomic::Ordering;

use super::{CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, Interposer, Place};
use crate::ledger::{Entry, Kind};

/// A device's primary context as this process holds it.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Primary {
    ctx: u64,
    retains: u32,
}

impl Interposer {
    /// A context made on `gpu` by `create` (which returns it): charged
    /// [`Settings::context_bytes`], refused like an allocation when that does not fit.
    /// Returns the context.
    ///
    /// [`Settings::context_bytes`]: crate::Settings::context_bytes
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
}
