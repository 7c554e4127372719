//! kube-scheduler as the replay keeps it from pod to pod: its walk over the nodes (resumed
//! where the previous pod's stopped, until `numFeasibleNodesToFind` pass), which decides the
//! nodes the extender ever sees; its `selectHost` tie-break; and the cluster's default
//! scheduler, which places CPU-only pods with a walk of its own.

use gpushare_scheduler_model::{num_feasible_nodes_to_find, num_feasible_nodes_to_find_at};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::generator::Task;
use super::nodes::Nodes;
use super::scores::taint_toleration;
use super::strategy::NodesToScore;

/// kube-scheduler as the replay keeps it from pod to pod: where its next walk over the nodes
/// starts, and the randomness of its tie-breaks.
pub(super) struct KubeScheduler {
    pub(super) to_score: NodesToScore,
    /// `nextStartNodeIndex`: the node the next walk starts at.
    pub(super) next_start_node_index: usize,
    pub(super) rng: StdRng,
}

/// One walk of kube-scheduler's filters over the nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Walk {
    /// The nodes that passed, in the order visited.
    pub(super) feasible: Vec<usize>,
    /// The first node the walk did not visit.
    pub(super) stopped_at: usize,
    /// How many nodes, from `stopped_at` round the cluster, it did not visit.
    pub(super) unvisited: usize,
    /// All nodes.
    pub(super) all: usize,
}

impl Walk {
    /// The nodes the walk did not reach, in the order it would have visited them.
    pub(super) fn unvisited(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.unvisited).map(|k| (self.stopped_at + k) % self.all)
    }
}

impl KubeScheduler {
    pub(super) fn new(to_score: NodesToScore, seed: u64) -> Self {
        Self {
            to_score,
            next_start_node_index: 0,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// `findNodesThatPassFilters`, one node at a time as `State::filter` in gpushare-e2e's
    /// scheduler: from `nextStartNodeIndex`, round the `all` nodes, until enough pass
    /// `feasible` (all of them with [`NodesToScore::All`]); the next walk starts after the last
    /// node visited. With every node visited it starts where this one did.
    pub(super) fn walk(&mut self, all: usize, mut feasible: impl FnMut(usize) -> bool) -> Walk {
        let want = match self.to_score {
            NodesToScore::Adaptive => num_feasible_nodes_to_find(all),
            NodesToScore::All => all,
            NodesToScore::Percentage(p) => num_feasible_nodes_to_find_at(all, p),
        };
        let start = self.next_start_node_index.checked_rem(all).unwrap_or(0);
        let mut found = Vec::new();
        let mut processed = 0;
        while processed < all && found.len() < want {
            let n = (start + processed) % all;
            processed += 1;
            if feasible(n) {
                found.push(n);
            }
        }
        let stopped_at = (start + processed).checked_rem(all).unwrap_or(0);
        self.next_start_node_index = stopped_at;
        Walk {
            feasible: found,
            stopped_at,
            unvisited: all - processed,
            all,
        }
    }
}

/// Why a strategy placed a task nowhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Missed {
    /// No node it looked at took the task, and it looked at every node that could.
    Everywhere,
    /// No node of kube-scheduler's walk took the task, but a node the walk did not reach would
    /// have.
    OutsideWalk,
}

/// kube-scheduler's `selectHost`: the highest total, ties broken uniformly at random.
pub(super) fn select_host(
    scores: impl Iterator<Item = (usize, i64)>,
    rng: &mut StdRng,
) -> Option<usize> {
    let mut best: Option<(usize, i64)> = None;
    let mut ties = 0u32;
    for (n, score) in scores {
        match best {
            Some((_, top)) if score < top => {}
            Some((_, top)) if score == top => {
                ties += 1;
                if rng.random_range(0..ties) == 0 {
                    best = Some((n, score));
                }
            }
            _ => {
                best = Some((n, score));
                ties = 1;
            }
        }
    }
    best.map(|(n, _)| n)
}

/// A CPU-only pod in a gpushare cluster: the cluster's default scheduler (its own walk, see
/// `Placer`) places it among the nodes its walk finds with room for the pod's CPU and
/// memory, by its CPU and memory scores and, where gpushare's extender taints the nodes
/// with an idle GPU (`idle_gpu_taint`), its `TaintToleration` score.
pub(super) fn default_scheduler(
    state: &Nodes<'_>,
    task: &Task,
    kube: &mut KubeScheduler,
    idle_gpu_taint: bool,
) -> Option<usize> {
    let walk = kube.walk(state.specs.len(), |n| state.host_free(n).fits(task.host));
    let tainted = |n: usize| idle_gpu_taint && state.has_idle_gpu(n);
    let any_tainted = walk.feasible.iter().any(|&n| tainted(n));
    let score = |n| state.default_score(n, task.host) + taint_toleration(tainted(n), any_tainted);
    select_host(walk.feasible.iter().map(|&n| (n, score(n))), &mut kube.rng)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(nodes: impl Iterator<Item = usize>) -> Vec<usize> {
        nodes.collect()
    }

    #[test]
    fn kube_scheduler_walks_round_robin_until_it_finds_enough_nodes() {
        // 300 nodes: 50 - 300 / 125 = 48 % of them, 144 (at least 100).
        assert_eq!(num_feasible_nodes_to_find(300), 144);
        let mut kube = KubeScheduler::new(NodesToScore::Adaptive, 0);
        let walk = kube.walk(300, |_| true);
        assert_eq!(walk.feasible, ids(0..144));
        assert_eq!(ids(walk.unvisited()), ids(144..300));
        assert_eq!(kube.next_start_node_index, 144);
        // The next walk starts where this one stopped and wraps round the cluster.
        let walk = kube.walk(300, |_| true);
        assert_eq!(walk.feasible, ids(144..288));
        let walk = kube.walk(300, |_| true);
        assert_eq!(walk.feasible, ids((288..300).chain(0..132)));
        assert_eq!(kube.next_start_node_index, 132);
        // Every third node infeasible: the walk visits 215 nodes to find 144, and the next
        // one starts 215 further on, infeasible nodes counted.
        let mut kube = KubeScheduler::new(NodesToScore::Adaptive, 0);
        let walk = kube.walk(300, |n| n % 3 != 2);
        let feasible = (0..300).filter(|n| n % 3 != 2);
        assert_eq!(walk.feasible, ids(feasible.take(144)));
        assert_eq!(walk.feasible.last(), Some(&214));
        assert_eq!(kube.next_start_node_index, 215);
        assert_eq!(walk.unvisited().count(), 85);
        // Fewer feasible nodes than it looks for: it visits every node, finds them all, and
        // the next walk starts where this one did.
        let walk = kube.walk(300, |n| n % 50 == 0);
        assert_eq!(walk.feasible, [250, 0, 50, 100, 150, 200]);
        assert_eq!(walk.unvisited().count(), 0);
        assert_eq!(kube.next_start_node_index, 215);
        // 1,200 nodes: 41 %, 492.
        let walk = kube.walk(1_200, |_| true);
        assert_eq!(walk.feasible.len(), 492);
        assert_eq!(kube.next_start_node_index, 215 + 492);
        // Below 100 nodes, and with every node to score: all of them, from the first.
        let walk = KubeScheduler::new(NodesToScore::Adaptive, 0).walk(99, |_| true);
        assert_eq!(walk.feasible, ids(0..99));
        let mut all = KubeScheduler::new(NodesToScore::All, 0);
        for _ in 0..2 {
            let walk = all.walk(1_200, |_| true);
            assert_eq!(walk.feasible, ids(0..1_200));
            assert_eq!(all.next_start_node_index, 0);
        }
        assert!(all.walk(0, |_| true).feasible.is_empty());
        // The chart's profile (1 %): 100 nodes at 1,200, the next walk from node 100.
        let mut chart = KubeScheduler::new(NodesToScore::Percentage(1), 0);
        assert_eq!(chart.walk(1_200, |_| true).feasible, ids(0..100));
        assert_eq!(chart.walk(1_200, |_| true).feasible, ids(100..200));
    }
}
