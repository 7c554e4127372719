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
//!
//! The files, one job each:
//! - `generator`: the seeded clusters and task streams, our reading of the papers;
//! - `calibrated`: the public trace's own cluster and task shapes, from its published figures;
//! - `sim`: the replay itself, and what it measures ([`Run`], [`Snapshot`]);
//! - `strategy`: what a replay compares ([`Strategy`], [`Profile`], [`RequestForm`],
//!   [`NodesToScore`]) and why a task failed ([`Cause`]);
//! - `nodes`: the cluster as the replay books it, the same for every strategy;
//! - `kube_scheduler`: kube-scheduler's walk over the nodes and its tie-break;
//! - `scores`: kube-scheduler's score plugins, integer for integer as upstream;
//! - `gpushare`: a gpushare pod through kube-scheduler, the extender and the allocator;
//! - `dra`: gpushare's DRA mode, kube-scheduler allocating the claims itself;
//! - `best_fit`, `fgd`: the idealized baselines.

mod best_fit;
mod calibrated;
mod ceiling;
mod dra;
mod fgd;
mod generator;
mod gpushare;
mod kube_scheduler;
mod nodes;
mod scores;
mod sim;
mod strategy;

pub use calibrated::{TRACE_GPU_UNITS, TraceMix, as_the_trace_counts, trace_nodes, trace_tasks};
pub use ceiling::placement_ceiling;
pub use generator::{SimNode, Task, TaskKind, TaskMix, generate_nodes, generate_tasks};
pub use sim::{
    Cause, Measure, NodesToScore, Profile, RequestForm, Run, Snapshot, Strategy, arrivals_until,
    replay_measured,
};
