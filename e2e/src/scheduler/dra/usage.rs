//! What the allocated claims hold, per device: capacity consumed of a shareable device, or
//! the device held whole. Rebuilt from the claims' status ([`Usage::of`]) at every pass, and
//! added to as a pass allocates, so that a pass never over-commits a device.

use std::collections::{BTreeMap, HashMap, HashSet};

use gpushare_dra_plugin::quantity;
use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};

/// A device, as allocations name it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId {
    /// The driver.
    pub driver: String,
    /// The pool.
    pub pool: String,
    /// The device.
    pub device: String,
}

/// What the allocated claims hold: capacity consumed per shareable device, and the devices
/// held whole.
#[derive(Clone, Debug, Default)]
pub struct Usage {
    consumed: HashMap<DeviceId, BTreeMap<String, u128>>,
    exclusive: HashSet<DeviceId>,
}

/// How an allocation holds a device: whole, or a share consuming some of its capacities.
pub(super) enum Hold {
    Whole,
    Share(BTreeMap<String, u128>),
}

impl Usage {
    /// The usage of every allocated claim in `claims`.
    pub fn of<'a>(claims: impl IntoIterator<Item = &'a ResourceClaim>) -> Self {
        let mut usage = Self::default();
        for claim in claims {
            for result in allocation_results(claim) {
                let id = DeviceId {
                    driver: result.driver.clone(),
                    pool: result.pool.clone(),
                    device: result.device.clone(),
                };
                match &result.consumed_capacity {
                    Some(consumed) => {
                        let entry = usage.consumed.entry(id).or_default();
                        for (name, value) in consumed {
                            // A stored allocation with an unreadable quantity counts as the
                            // largest possible use: never over-commit on bad data.
                            let bytes = quantity::bytes(&value.0).unwrap_or(u128::MAX);
                            let slot = entry.entry(name.clone()).or_default();
                            *slot = slot.saturating_add(bytes);
                        }
                    }
                    None => {
                        usage.exclusive.insert(id);
                    }
                }
            }
        }
        usage
    }

    /// Bytes (or units) of `capacity` consumed on `device`.
    pub fn consumed(&self, device: &DeviceId, capacity: &str) -> u128 {
        self.consumed
            .get(device)
            .and_then(|c| c.get(capacity))
            .copied()
            .unwrap_or(0)
    }

    /// Whether `device` is allocated at all, whole or in part.
    pub(super) fn in_use(&self, device: &DeviceId) -> bool {
        self.exclusive.contains(device) || self.consumed.contains_key(device)
    }

    /// Whether `device` is allocated whole.
    pub(super) fn held_whole(&self, device: &DeviceId) -> bool {
        self.exclusive.contains(device)
    }

    /// Counts `hold` of `id` as used.
    pub(super) fn hold(&mut self, id: &DeviceId, hold: &Hold) {
        match hold {
            Hold::Share(consumed) => {
                let entry = self.consumed.entry(id.clone()).or_default();
                for (name, amount) in consumed {
                    let slot = entry.entry(name.clone()).or_default();
                    *slot = slot.saturating_add(*amount);
                }
            }
            Hold::Whole => {
                self.exclusive.insert(id.clone());
            }
        }
    }
}

fn allocation_results(claim: &ResourceClaim) -> &[DeviceRequestAllocationResult] {
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_deref())
        .unwrap_or(&[])
}
