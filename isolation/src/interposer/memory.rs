//! Allocations charged per pointer or handle (`cuMemAlloc` and its kinds, arrays, managed
//! memory, VMM handles at `cuMemCreate`): held to the share before the driver runs,
//! counted under the key the driver returns, and given back when that key is freed.

use super::{CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, Interposer, Place};
use crate::ledger::{Entry, Kind};

impl Interposer {
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
}
