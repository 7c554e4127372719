//! `kubectl gpushare`: see and check GPU-memory sharing from the command line.
//!
//! - `kubectl gpushare top [NODE] [-d]`: GPU memory per node and GPU, from the node
//!   inventories and the allocations the extender recorded on pods. Pods bound without an
//!   allocation show up under PENDING: that is how a bypassed extender becomes visible. In
//!   DRA mode the same rows come from ResourceSlices and ResourceClaims ([`dra`]).
//! - `kubectl gpushare doctor`: checks extender, scheduler wiring, node labels, device
//!   plugin registration and bypassing pods; prints `[OK]`/`[WARN]`/`[FAIL]` with fixes and
//!   exits non-zero on any failure.
//!
//! Layout: [`usage`] and [`render`] are pure (golden-tested), [`doctor`] is pure over a
//! snapshot, [`cluster`] does the I/O, [`cli`] glues them.

pub mod cli;
pub mod cluster;
pub mod doctor;
pub mod dra;
pub mod render;
pub mod usage;

pub use cli::{Args, run};
