//! The process's own record of what it holds: pointer or handle → (GPU, bytes, context), so
//! that a free gives back exactly what its allocation counted, and a context's destruction
//! gives back everything made in it.
//!
//! Sharded by key over small spin locks ([`crate::spin`]), so threads allocating at once
//! seldom meet; `fork` takes every shard (see that module).

use std::hash::{BuildHasher, Hash};

use rustc_hash::{FxBuildHasher, FxHashMap};

use crate::spin::SpinLock;

/// What a key names: each kind has its own free call, and values of different kinds may
/// coincide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A device pointer (`cuMemAlloc*`, freed by `cuMemFree*`).
    Pointer,
    /// A pointer from a stream-ordered pool: its bytes are the pool's reservation, counted
    /// per pool; the entry only names the pool (`Entry::pool`) for the free.
    PoolPointer,
    /// A VMM handle (`cuMemCreate`, given back when released and mapped nowhere).
    Handle,
    /// A `CUarray` (`cuArrayCreate`, `cuArray3DCreate`, freed by `cuArrayDestroy`).
    Array,
    /// A `CUmipmappedArray` (freed by `cuMipmappedArrayDestroy`).
    Mipmapped,
    /// A context's own memory (key: the `CUcontext`).
    Context,
    /// What `cuCtxSetLimit` raised a limit by (key: the `CUcontext`; the `CUlimit` here).
    Limit(u8),
}

/// What an allocation counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Entry {
    /// The GPU's index in the container's budget.
    pub gpu: usize,
    /// Bytes counted.
    pub bytes: u64,
    /// The context it was made in (0: none or unknown); destroying or resetting that
    /// context gives it back.
    pub ctx: u64,
    /// For [`Kind::PoolPointer`], the pool.
    pub pool: u64,
}

impl Entry {
    /// `bytes` on `gpu`, made in no known context.
    pub fn new(gpu: usize, bytes: u64) -> Self {
        Self {
            gpu,
            bytes,
            ..Self::default()
        }
    }
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

    /// The entry under `key`, left in place.
    pub fn get(&self, kind: Kind, key: u64) -> Option<Entry> {
        self.shard(kind, key).lock().get(&(kind, key)).copied()
    }

    /// Changes the entry under `key` (inserting `Entry::default()` first if there is none);
    /// returns what `change` returns.
    pub fn update<T>(&self, kind: Kind, key: u64, change: impl FnOnce(&mut Entry) -> T) -> T {
        let mut shard = self.shard(kind, key).lock();
        let entry = shard.entry((kind, key)).or_default();
        change(entry)
    }

    /// Takes every entry made in context `ctx` (of every kind that belongs to a context).
    pub fn take_context(&self, ctx: u64) -> Vec<(Kind, Entry)> {
        let mut taken = Vec::new();
        for shard in &self.shards {
            shard.lock().retain(|&(kind, _), entry| {
                if entry.ctx == ctx && kind != Kind::Handle {
                    taken.push((kind, *entry));
                    false
                } else {
                    true
                }
            });
        }
        taken
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
                shard.locked_value().clear();
                shard.raw_unlock();
            }
        }
    }
}
