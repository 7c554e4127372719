//! What gpushare's measuring binaries share: the realistic packing simulator (`realistic`,
//! run by `realistic-sim`). The nodes and pods the benches and `view-memory` generate are
//! `gpushare-testkit`'s (`workload`); the load harness, which drives the real binaries on the
//! in-process control plane, is `gpushare-e2e`'s (`--bin load`), so that this crate needs
//! nothing of that control plane.
//!
//! The synthetic packing simulator (`packing-sim`: GPU memory only, one pod size mix, stop at
//! the first pod that fits nowhere) was retired in issue 65: `realistic-sim` asks the same
//! question with GPU, CPU and memory together, the classic extender among its strategies.

pub mod realistic;
