//! What gpushare's measuring binaries share: the realistic packing simulator (`realistic`, run
//! by `realistic-sim`) and the filled clusters the criterion benches time (`filled`). The nodes
//! and pods of the benches and `view-memory` are `gpushare-testkit`'s (`workload`); the load
//! harness is `gpushare-e2e`'s (`--bin load`), so this crate needs nothing of its control plane.

pub mod filled;
pub mod realistic;
