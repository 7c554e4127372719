//! Memory the driver keeps in pools past the call that asked for it, charged what the pool
//! reserves rather than what was asked of it:
//!
//! - stream-ordered pools: a pool is charged what it reserves, read from the driver after
//!   each allocation, free, trim and synchronisation, on the pool's own GPU;
//! - graph memory: each GPU's graph memory pool is charged what it reserves.
//!
//! Both are re-read before an allocation is refused and when memory is queried (the
//! [`RoomMaker`](super::RoomMaker) the hooks set).

use std::sync::atomic::Ordering;

use super::{CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, Interposer, Place};
use crate::ledger::{Entry, Kind};

/// What a stream-ordered pool is charged.
#[derive(Debug, Clone, Copy)]
pub(super) struct PoolCharge {
    gpu: usize,
    charged: u64,
    /// Bumped by each allocation's charge: a re-read begun before one is stale.
    seq: u64,
}

impl Interposer {
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
}
