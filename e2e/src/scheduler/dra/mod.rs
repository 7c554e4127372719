//! Dynamic Resource Allocation for the in-process cluster: what kube-scheduler's
//! DynamicResources plugin and kube-controller-manager's resourceclaim controller (its
//! reservation bookkeeping; claims from templates are [`crate::resourceclaim`]'s) do, for
//! the claim shapes gpushare's DRA mode uses. A pod's claims are found as upstream finds them
//! ([`crate::resourceclaim::claim_name`]): a template's claim once the controller recorded
//! it in the pod's status, and only if the pod controls it.
//!
//! ```text
//!  watch Pods, Nodes, ResourceClaims, ResourceSlices, DeviceClasses ──▶ stores ──▶ pass
//!  pass, per pending pod with claims (oldest first):
//!     claims allocated already ─▶ their node only
//!     nodes in name order: allocate every unallocated claim from the node's slices
//!        (first fit, devices in slice order, consumable capacity summed per device)
//!     fit  ─▶ PUT claim status {allocation, reservedFor += pod} ─▶ pods/binding
//!     none ─▶ PodScheduled=False, Unschedulable, with every node's reason
//!  then, as the resourceclaim controller: drop reservations of pods gone or finished;
//!     a claim reserved for no one is deallocated
//! ```
//!
//! - `allocate`: a claim's devices on one node, first fit, and the shapes refused with a
//!   clear message rather than half-done; pure.
//! - `device`: whether one device can serve a request: CEL selectors, taints (KEP-5055),
//!   consumable capacity (KEP-5075) rounded to the device's policy.
//! - `usage`: what the allocated claims hold per device, rebuilt from their status.
//! - `driver`: the control loop ([`DraScheduler`]) that watches, writes the claims' status
//!   and binds; the I/O around the pure allocation.

mod allocate;
mod device;
mod driver;
mod usage;

pub use allocate::{allocate, allocated_node, quantity_of};
pub use driver::DraScheduler;
pub use usage::{DeviceId, Usage};

/// Why a claim could not be allocated.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AllocateError {
    /// The claim asks for something this scheduler does not implement.
    #[error("{0}")]
    Unsupported(String),
    /// Not on this node.
    #[error("{0}")]
    NoFit(String),
}
