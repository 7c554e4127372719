//! The process's own record of what it holds: pointer or handle → (GPU, bytes), so that a
//! free gives back exactly what its allocation counted.
//!
//! Sharded by key over small spin locks, so threads allocating at once seldom meet. Spin
//! locks rather than `std::sync::Mutex` because of `fork`: the atfork handlers take every
//! shard before the fork and let go after it in both processes, so the child never inherits a
//! shard locked by a thread that does not exist there.

use std::cell::UnsafeCell;
use std::hash::{BuildHasher, Hash};
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

use rustc_hash::{FxBuildHasher, FxHashMap};

/// What a key names: each kind has its own free call, and values of different kinds may
/// coincide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A device pointer (`cuMemAlloc*`, freed by `cuMemFree*`).
    Pointer,
    /// A VMM handle (`cuMemCreate`, freed by `cuMemRelease`).
    Handle,
    /// A `CUarray` (`cuArrayCreate`, `cuArray3DCreate`, freed by `cuArrayDestroy`).
    Array,
    /// A `CUmipmappedArray` (freed by `cuMipmappedArrayDestroy`).
    Mipmapped,
}

/// What an allocation counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// CUDA ordinal.
    pub gpu: usize,
    /// Bytes counted.
    pub bytes: u64,
}

const SHARDS: usize = 64;

type Map = FxHashMap<(Kind, u64), Entry>;

/// The record, see the module doc.
pub struct Ledger {
    shards: [SpinLock<Map>; SHARDS],
}

impl Default for Ledger {
    fn default() -> Self {
        Self {
            shards: std::array::from_fn(|_| SpinLock::new(Map::default())),
        }
    }
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger").finish_non_exhaustive()
    }
}

impl Ledger {
    fn shard(&self, kind: Kind, key: u64) -> &SpinLock<Map> {
        let hash = FxBuildHasher.hash_one((kind, key));
        // The high bits of an Fx hash are the well-mixed ones.
        &self.shards[(hash >> 58) as usize % SHARDS]
    }

    /// Records `entry` under `key`; returns what was there (a driver reusing a key we never
    /// saw freed).
    pub fn insert(&self, kind: Kind, key: u64, entry: Entry) -> Option<Entry> {
        self.shard(kind, key).lock().insert((kind, key), entry)
    }

    /// Takes the entry under `key`.
    pub fn remove(&self, kind: Kind, key: u64) -> Option<Entry> {
        self.shard(kind, key).lock().remove(&(kind, key))
    }

    /// How many allocations are recorded.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Before `fork`: takes every shard, so no other thread is inside one.
    pub(crate) fn lock_all(&self) {
        for shard in &self.shards {
            shard.raw_lock();
        }
    }

    /// After `fork`, in the parent: lets every shard go.
    pub(crate) fn unlock_all(&self) {
        for shard in &self.shards {
            // SAFETY: lock_all took every shard in this thread before the fork.
            unsafe { shard.raw_unlock() };
        }
    }

    /// After `fork`, in the child: forgets everything (the parent's allocations are the
    /// parent's) and lets every shard go.
    pub(crate) fn clear_and_unlock_all(&self) {
        for shard in &self.shards {
            // SAFETY: lock_all took every shard in the thread that forked, the only thread of
            // the child, so nothing else can touch the map.
            unsafe {
                (*shard.value.get()).clear();
                shard.raw_unlock();
            }
        }
    }
}

struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is only reached by the thread that holds `locked`.
unsafe impl<T: Send> Sync for SpinLock<T> {}

impl<T> SpinLock<T> {
    fn new(value: T) -> Self {
        Self {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    fn raw_lock(&self) {
        let mut spins = 0u32;
        while self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// # Safety
    /// The caller holds the lock (took it with `raw_lock`) and keeps no reference into it.
    unsafe fn raw_unlock(&self) {
        self.locked.store(false, Ordering::Release);
    }

    fn lock(&self) -> Guard<'_, T> {
        self.raw_lock();
        Guard { lock: self }
    }
}

struct Guard<'a, T> {
    lock: &'a SpinLock<T>,
}

impl<T> Deref for Guard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard holds the lock.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for Guard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard holds the lock, and &mut self makes this the only reference.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for Guard<'_, T> {
    fn drop(&mut self) {
        // SAFETY: the guard took the lock and its borrows end with it.
        unsafe { self.lock.raw_unlock() };
    }
}
