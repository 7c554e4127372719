//! What gpushare's measuring binaries share: the realistic packing simulator (`realistic`,
//! run by `realistic-sim`). The nodes and pods the benches and `view-memory` generate are
//! `gpushare-testkit`'s (`workload`); the load harness, which drives the real binaries on the
//! in-process control plane, is `gpushare-e2e`'s (`--bin load`), so that this crate needs
//! nothing of that control plane.
//! (`packing-sim`, GPU memory only, was retired in issue 65 for `realistic-sim`.)

pub mod realistic;
