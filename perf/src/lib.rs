//! What gpushare's measuring binaries share: the realistic packing simulator (`realistic`,
//! run by `realistic-sim`) and the nodes and pods the benches and `view-memory` generate
//! (`workload`). The load harness (`load`) is a binary of its own (`src/bin/load.rs`, its
//! modules in `src/load/`).
//!
//! The synthetic packing simulator (`packing-sim`: GPU memory only, one pod size mix, stop at
//! the first pod that fits nowhere) was retired in issue 65: `realistic-sim` asks the same
//! question with GPU, CPU and memory together, the classic extender among its strategies.

pub mod realistic;
pub mod workload;
