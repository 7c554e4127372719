//! Packing on realistic clusters, measured as FGD measures it.
//!
//! ```text
//!   generator (seeded): heterogeneous nodes (2/4/8 GPUs of 7 models, own CPU and memory)
//!                       tasks: CPU-only, fractional, whole-GPU, multi-GPU; CPU/memory with them
//!        │  tasks arrive in order, none leaves, until GPU demand is 130 % of capacity
//!        ▼  per strategy, on a fresh copy of the cluster
//!   gpushare strategies: kube-scheduler filter (CPU, memory, model, node GPU GiB) walking
//!       the nodes round robin until it finds numFeasibleNodesToFind (adaptive default; or
//!       every node), then on those gpushare_allocator's fit / scores / reserve, node =
//!       highest scheduler total (profile as configured);
//!       CPU-only pods go through the default scheduler (they never reach gpushare);
//!       fractional tasks ask for a slice of one GPU, whole- and multi-GPU tasks for N
//!       slices of their GiB on N GPUs (`gpus: N`), or N empty GPUs booked in full
//!       (`gpus: N`, `exclusive`) as the replay's request form says
//!   baselines (idealized): BestFit and FGD place every task themselves, multi-GPU
//!       included, looking at every node
//!        │
//!        ▼
//!   allocation ratio (GPU GiB allocated / GPU GiB in the cluster) against arrived demand;
//!   failed tasks by cause; free GPU memory stranded on nodes without CPU or memory
//! ```

pub mod generator;
pub mod sim;

pub use generator::{
    GpuModel, MODELS, Models, NODE_TYPES, NodeType, SimNode, Task, TaskKind, TaskMix,
    generate_nodes, generate_tasks,
};
pub use sim::{
    Cause, NodesToScore, Profile, RequestForm, Run, Scored, Snapshot, Strategy, gpushare_request,
    most_allocated, replay,
};
