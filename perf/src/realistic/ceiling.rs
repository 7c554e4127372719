//! What the cluster's GPU sizes alone leave placeable at 100 % arrived demand, whatever
//! places the tasks.
//!
//! A task asking more GiB per GPU than a GPU holds never goes on it. So for every GPU size
//! `s` of the cluster, the GiB asked by tasks needing more than `s` per GPU can only be
//! allocated on the GPUs larger than `s`: what they ask beyond those GPUs' GiB is lost in
//! any placement. The trace-calibrated generator ties a whole-GPU task to the GiB of the
//! model it was drawn for (the trace asks for a whole GPU of any model), and on multigpu50
//! its 32 GiB tasks ask more than the 32 GiB GPUs hold: this is the figure that shows it.

use super::generator::{SimNode, Task};

/// The tightest GPU size of a cluster for a task stream: the GiB asked of the GPUs larger
/// than `above_gib` against what those GPUs hold, shares of the cluster's GPU GiB.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SizeCeiling {
    /// The GPU size (GiB): tasks asking more per GPU fit only larger GPUs.
    pub above_gib: u64,
    /// GiB asked by tasks needing more than `above_gib` per GPU.
    pub asked: f64,
    /// GiB of the GPUs larger than `above_gib`.
    pub held: f64,
}

impl SizeCeiling {
    /// The most any placement allocates: all but what the larger GPUs cannot hold.
    pub fn allocation_at_most(&self) -> f64 {
        1.0 - (self.asked - self.held).max(0.0)
    }
}

/// For the tasks arriving until their GiB reach the cluster's (100 % arrived demand), the
/// GPU size whose larger GPUs are asked the most beyond what they hold (the smallest size on
/// a tie); model pins are not counted, so the ceiling is an upper bound. `None` for a
/// cluster whose GPUs are all of one size (the last task's overshoot of 100 % is not a
/// size's doing).
pub fn size_ceiling(nodes: &[SimNode], tasks: &[Task]) -> Option<SizeCeiling> {
    let capacity: u64 = nodes.iter().map(|n| u64::from(n.gpus) * n.gpu_gib).sum();
    if capacity == 0 {
        return None;
    }
    let mut arrived_tasks = Vec::new();
    let mut arrived = 0;
    for task in tasks {
        if arrived >= capacity {
            break;
        }
        arrived += task.demand_gib();
        arrived_tasks.push(task);
    }
    // Each distinct GPU size below the largest: above the largest nothing is held or fits.
    let mut sizes: Vec<u64> = nodes.iter().map(|n| n.gpu_gib).collect();
    sizes.sort_unstable();
    sizes.dedup();
    sizes.pop();
    let share = |gib: u64| gib as f64 / capacity as f64;
    sizes
        .into_iter()
        .map(|above| {
            let asked = arrived_tasks
                .iter()
                .filter(|t| t.gpu_gib > above)
                .map(|t| t.demand_gib())
                .sum();
            let held = nodes
                .iter()
                .filter(|n| n.gpu_gib > above)
                .map(|n| u64::from(n.gpus) * n.gpu_gib)
                .sum();
            SizeCeiling {
                above_gib: above,
                asked: share(asked),
                held: share(held),
            }
        })
        .fold(None, |tightest: Option<SizeCeiling>, c| match tightest {
            Some(t) if t.asked - t.held >= c.asked - c.held => Some(t),
            _ => Some(c),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::realistic::calibrated::{TraceMix, trace_nodes, trace_tasks};
    use crate::realistic::generator::TaskKind;
    use gpushare_allocator::fragmentation::Host;

    fn node(gpus: u32, gpu_gib: u64) -> SimNode {
        SimNode {
            model: 0,
            gpus,
            gpu_gib,
            host: Host::new(64_000, 256 * 1024),
        }
    }

    fn whole(gpus: u32, gpu_gib: u64) -> Task {
        Task {
            kind: if gpus > 1 {
                TaskKind::Multi
            } else {
                TaskKind::Whole
            },
            gpus,
            gpu_gib,
            host: Host::new(1_000, 1_024),
            model: None,
            milli: u64::from(gpus) * 1000,
        }
    }

    #[test]
    fn tasks_too_large_for_the_small_gpus_are_held_only_by_the_large_ones() {
        // 2 × 16 GiB and 2 × 32 GiB: 96 GiB. Three 32 GiB tasks (96 GiB) arrive by 100 %:
        // the 32 GiB GPUs hold two of them, so at most 64 of 96 GiB are allocated.
        let nodes = [node(2, 16), node(2, 32)];
        let tasks = [whole(1, 32), whole(2, 32), whole(1, 16)];
        let ceiling = size_ceiling(&nodes, &tasks).unwrap();
        assert_eq!(ceiling.above_gib, 16);
        assert_eq!((ceiling.asked, ceiling.held), (1.0, 64.0 / 96.0));
        assert!((ceiling.allocation_at_most() - 64.0 / 96.0).abs() < 1e-12);
        // The 16 GiB task arrived after 100 %: it does not count.
        let fits = [whole(1, 16), whole(1, 32), whole(1, 16), whole(1, 32)];
        let ceiling = size_ceiling(&nodes, &fits).unwrap();
        assert_eq!(ceiling.allocation_at_most(), 1.0, "{ceiling:?}");
        assert_eq!(size_ceiling(&[], &tasks), None);
        assert_eq!(size_ceiling(&[node(2, 32)], &tasks), None, "one size");
    }

    #[test]
    fn on_multigpu50_the_32_gib_gpus_are_asked_more_than_they_hold() {
        for seed in 0..3 {
            let nodes = trace_nodes(1_200, seed);
            let over = |mix| {
                let tasks = trace_tasks(&nodes, mix, 1.3, seed);
                size_ceiling(&nodes, &tasks).unwrap()
            };
            let multigpu50 = over(TraceMix::Multigpu50);
            // Above 16 GiB: the 24 and 32 GiB GPUs (above 24 is within a fraction of it).
            assert!(multigpu50.above_gib >= 16, "seed {seed}: {multigpu50:?}");
            assert!(multigpu50.asked > multigpu50.held, "{multigpu50:?}");
            assert!(multigpu50.allocation_at_most() < 0.998, "{multigpu50:?}");
            // On the default mix the large GPUs are asked less than they hold.
            assert_eq!(over(TraceMix::Default).allocation_at_most(), 1.0);
        }
    }
}
