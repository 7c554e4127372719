//! VMM handles (`cuMemCreate`): charged when made (in `memory`), and given back when the
//! last reference goes: the handle released and mapped nowhere. The creation, each
//! mapping and each `cuMemRetainAllocationHandle` is a reference.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

use super::Interposer;
use crate::ledger::Kind;

/// VMM handles and their references: the creation, each mapping, each retain.
#[derive(Debug, Default)]
pub(super) struct Vmm {
    pub(super) refs: FxHashMap<u64, u32>,
    /// Mapped address → (handle, size).
    maps: BTreeMap<u64, (u64, u64)>,
}

impl Interposer {
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
}
