//! kube-scheduler's arithmetic, as gpushare's harness needs it twice: the in-process scheduler
//! (`gpushare-e2e`) places pods with it, and the packing simulator (`gpushare-perf`) replays a
//! trace through it. One copy, so that what the simulator measures is what the end-to-end tests
//! see kube-scheduler do.
//!
//! - [`requests`]: quantities in exact milli-units, a pod's effective requests, a node's usage.
//! - [`scoring`]: `NodeResourcesFit` and `NodeResourcesBalancedAllocation`, and the pick of a
//!   host among scored nodes.
//! - [`num_feasible_nodes_to_find`]: how far the walk over the nodes goes before it stops.

pub mod requests;
pub mod scoring;
#[cfg(test)]
mod tests;

/// How many feasible nodes the scheduler looks for before it stops filtering
/// (`numFeasibleNodesToFind` with the default adaptive percentage).
pub fn num_feasible_nodes_to_find(all_nodes: usize) -> usize {
    num_feasible_nodes_to_find_at(all_nodes, 0)
}

/// `numFeasibleNodesToFind` under a `percentageOfNodesToScore` of `percentage` (0: the
/// adaptive default, 50 % less 1 % per 125 nodes, at least 5 %). Never fewer than 100 nodes
/// (all of them in a smaller cluster), whatever the percentage.
pub fn num_feasible_nodes_to_find_at(all_nodes: usize, percentage: u32) -> usize {
    const MIN_FEASIBLE_NODES_TO_FIND: usize = 100;
    if all_nodes < MIN_FEASIBLE_NODES_TO_FIND || percentage >= 100 {
        return all_nodes;
    }
    let percentage = match percentage {
        0 => 50usize.saturating_sub(all_nodes / 125).max(5),
        p => p as usize,
    };
    (all_nodes * percentage / 100).max(MIN_FEASIBLE_NODES_TO_FIND)
}
