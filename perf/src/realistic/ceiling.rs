//! What the cluster's GPUs alone leave placeable at 100 % arrived demand, whatever places the
//! tasks.
//!
//! A task goes only on nodes with enough GPUs of one of its models, each with its GiB: its
//! GPU classes (model, GPUs per node, GiB per GPU). For any set `S` of classes, the tasks that
//! fit only classes of `S` are placed within what `S` holds, and every other task books at
//! most its own most. So the allocation is at most
//!
//! ```text
//!   held(S) + Σ over tasks that fit some class outside S of most(task)
//! ```
//!
//! for every `S`, and the ceiling is the least of these (Hall's condition read as a bound;
//! CPU and memory are not counted, so it is an upper bound). In GiB a task's most is its GiB;
//! counted in GPUs, its GiB over the smallest GPU it fits, at most one GPU per GPU it asks
//! for (a whole GPU of any model is one GPU wherever it lands).
//!
//! On multigpu50 the generator's 32 GiB tasks ask more than the 32 GiB GPUs hold (it ties a
//! whole-GPU task to the GiB of the model it was drawn for; the trace asks for a whole GPU of
//! any model), and on gpuspec33 the tasks pinned to T4 and P100 ask more than those hold. This
//! is the figure that shows it. Counted in GPUs it is loose: a sharing task's most is its
//! share of the smallest GPU it fits, where it may well not land.

use super::generator::{MODELS, SimNode, Task};
use super::sim::{Measure, arrivals_until};

/// A GPU class: nodes of one GPU model with as many GPUs of as many GiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct GpuClass {
    /// Index into [`MODELS`].
    pub model: usize,
    pub gpus: u32,
    pub gpu_gib: u64,
}

impl GpuClass {
    fn of(node: &SimNode) -> Self {
        let (model, gpus, gpu_gib) = (node.model, node.gpus, node.gpu_gib);
        GpuClass {
            model,
            gpus,
            gpu_gib,
        }
    }
}

impl std::fmt::Display for GpuClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = MODELS.get(self.model).map_or("?", |m| m.name);
        write!(f, "{name} ×{}", self.gpus)
    }
}

/// The tightest set of GPU classes for a task stream: its classes, what they hold, what the
/// tasks that fit only them ask, and the bound, as shares of the cluster's (in the measure).
#[derive(Debug, Clone, PartialEq)]
pub struct Ceiling {
    /// The classes of the set.
    pub classes: Vec<GpuClass>,
    /// What the set's GPUs hold.
    pub held: f64,
    /// What the tasks that fit only the set ask (at least).
    pub asked: f64,
    /// The most any placement allocates.
    pub allocation_at_most: f64,
}

/// The most classes whose sets are enumerated (2^16 sets).
const MAX_CLASSES: usize = 16;

/// For the tasks arriving until their demand reaches the cluster's (100 %, in `measure`), the
/// set of GPU classes that bounds the allocation the most. `None` when no set bounds it below
/// 100 %, or when the cluster has more than sixteen classes.
pub fn placement_ceiling(nodes: &[SimNode], tasks: &[Task], measure: Measure) -> Option<Ceiling> {
    let mut classes: Vec<GpuClass> = nodes
        .iter()
        .filter(|n| n.gpus > 0)
        .map(GpuClass::of)
        .collect();
    classes.sort_unstable();
    classes.dedup();
    if classes.is_empty() || classes.len() > MAX_CLASSES {
        return None;
    }
    // What each class holds, in the measure.
    let held: Vec<f64> = classes
        .iter()
        .map(|c| {
            let of = nodes.iter().filter(|n| GpuClass::of(n) == *c);
            let per_node = match measure {
                Measure::Gib => (u64::from(c.gpus) * c.gpu_gib) as f64,
                Measure::Gpus => f64::from(c.gpus),
            };
            of.count() as f64 * per_node
        })
        .collect();
    let total: f64 = held.iter().sum();
    // The arrived GPU tasks grouped by the classes they fit: (mask, least, most).
    let mut groups: Vec<(u32, f64, f64)> = Vec::new();
    let arrived = &tasks[..arrivals_until(nodes, tasks, measure, 1.0)];
    for task in arrived.iter().filter(|t| t.gpus > 0) {
        let fits = |c: &GpuClass| {
            task.model.is_none_or(|m| m.contains(c.model))
                && c.gpus >= task.gpus
                && c.gpu_gib >= task.gpu_gib
        };
        let mask = classes
            .iter()
            .enumerate()
            .filter(|(_, c)| fits(c))
            .fold(0u32, |mask, (i, _)| mask | 1 << i);
        let sizes = classes.iter().filter(|c| fits(c)).map(|c| c.gpu_gib);
        let (least, most) = match measure {
            Measure::Gib => (task.demand_gib() as f64, task.demand_gib() as f64),
            Measure::Gpus => {
                let share =
                    |size: u64| f64::from(task.gpus) * (task.gpu_gib as f64 / size as f64).min(1.0);
                // A task that fits nowhere books nothing, and asks at least a GPU's share.
                let largest = sizes.clone().max().unwrap_or(task.gpu_gib.max(1));
                (share(largest), sizes.min().map_or(0.0, share))
            }
        };
        match groups.iter_mut().find(|(m, _, _)| *m == mask) {
            Some(group) => {
                group.1 += least;
                group.2 += most;
            }
            None => groups.push((mask, least, most)),
        }
    }
    let members = |set: u32| (0..classes.len()).filter(move |i| set & (1 << i) != 0);
    let mut tightest: Option<(u32, f64)> = None;
    for set in 0u32..(1 << classes.len()) {
        let held_by_set: f64 = members(set).map(|i| held[i]).sum();
        let others: f64 = groups
            .iter()
            .filter(|(mask, _, _)| mask & !set != 0)
            .map(|(_, _, most)| most)
            .sum();
        let bound = (held_by_set + others).min(total);
        if tightest.is_none_or(|(_, least)| bound < least - 1e-9) {
            tightest = Some((set, bound));
        }
    }
    let (set, bound) = tightest?;
    if bound >= total - 1e-9 {
        return None;
    }
    Some(Ceiling {
        classes: members(set).map(|i| classes[i]).collect(),
        held: members(set).map(|i| held[i]).sum::<f64>() / total,
        asked: groups
            .iter()
            .filter(|(mask, _, _)| mask & !set == 0)
            .map(|(_, least, _)| least)
            .sum::<f64>()
            / total,
        allocation_at_most: bound / total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::realistic::calibrated::{TraceMix, as_the_trace_counts, trace_nodes, trace_tasks};
    use crate::realistic::generator::{Models, TaskKind, test_node as node, test_task};

    fn whole(gpus: u32, gpu_gib: u64) -> Task {
        let kind = if gpus > 1 {
            TaskKind::Multi
        } else {
            TaskKind::Whole
        };
        test_task(kind, gpus, gpu_gib)
    }

    #[test]
    fn tasks_too_large_for_the_small_gpus_are_held_only_by_the_large_ones() {
        // 2 × 16 GiB and 2 × 32 GiB: 96 GiB. Three 32 GiB tasks (96 GiB) arrive by 100 %:
        // the 32 GiB GPUs hold two of them, so at most 64 of 96 GiB are allocated.
        let nodes = [node(1, 2, 16), node(3, 2, 32)];
        let tasks = [whole(1, 32), whole(2, 32), whole(1, 16)];
        let ceiling = placement_ceiling(&nodes, &tasks, Measure::Gib).unwrap();
        assert_eq!(ceiling.classes, [GpuClass::of(&node(3, 2, 32))]);
        assert_eq!((ceiling.asked, ceiling.held), (1.0, 64.0 / 96.0));
        assert!((ceiling.allocation_at_most - 64.0 / 96.0).abs() < 1e-12);
        // The 16 GiB task arrived after 100 %: it does not count. Nor does a task that fits.
        let fits = [whole(1, 16), whole(1, 32), whole(1, 16), whole(1, 32)];
        assert_eq!(placement_ceiling(&nodes, &fits, Measure::Gib), None);
        assert_eq!(placement_ceiling(&[], &tasks, Measure::Gib), None);
    }

    #[test]
    fn pinned_tasks_and_gpus_per_node_bound_it_too() {
        // Two T4 ×2 nodes (4 GPUs of 15 GiB) and one 8-GPU node of 32 GiB: 12 GPUs.
        let nodes = [node(0, 2, 15), node(0, 2, 15), node(7, 8, 32)];
        let t4 = Some(Models::one(0));
        let pinned = |gpus| Task {
            model: t4,
            ..whole(gpus, 15)
        };
        // Six whole T4 GPUs and six GPUs of any model arrive: 12 GPUs. The T4s take four of
        // the six pinned; counted in GPUs, at most 4 + 6 of 12 are allocated.
        let mut tasks = vec![pinned(1); 6];
        tasks.extend(vec![whole(1, 15); 6]);
        let ceiling = placement_ceiling(&nodes, &tasks, Measure::Gpus).unwrap();
        assert_eq!(ceiling.classes, [GpuClass::of(&node(0, 2, 15))]);
        assert_eq!((ceiling.held, ceiling.asked), (4.0 / 12.0, 6.0 / 12.0));
        assert!((ceiling.allocation_at_most - 10.0 / 12.0).abs() < 1e-12);
        // A 4-GPU job fits no node of two T4s: only the 8-GPU node holds it. Of three such
        // jobs (12 GPUs), at most 8 GPUs are allocated; the one-GPU task arrives after 100 %.
        let tasks = [whole(4, 32), whole(4, 32), whole(4, 32), whole(1, 15)];
        let ceiling = placement_ceiling(&nodes, &tasks, Measure::Gpus).unwrap();
        assert_eq!(ceiling.classes, [GpuClass::of(&node(7, 8, 32))]);
        assert_eq!((ceiling.held, ceiling.asked), (8.0 / 12.0, 1.0));
        let off = (ceiling.allocation_at_most - 8.0 / 12.0).abs();
        assert!(off < 1e-12, "{ceiling:?}");
        // Counted in GPUs, a 15 GiB slice on a 32 GiB GPU books 15/32 of it: three 4-GPU
        // jobs of 15 GiB slices book at most 5.625 GPUs wherever they go.
        let slices = [whole(4, 15), whole(4, 15), whole(4, 15)];
        let ceiling = placement_ceiling(&nodes, &slices, Measure::Gpus).unwrap();
        assert_eq!(ceiling.classes, []);
        let off = (ceiling.allocation_at_most - 5.625 / 12.0).abs();
        assert!(off < 1e-12, "{ceiling:?}");
    }

    #[test]
    fn on_the_trace_mixes_the_ceilings_name_the_pinned_small_gpus() {
        for seed in 0..3 {
            let nodes = trace_nodes(1_200, seed);
            let ceiling = |mix, measure| {
                let (mut nodes, mut tasks) = (nodes.clone(), trace_tasks(&nodes, mix, 1.3, seed));
                if measure == Measure::Gpus {
                    as_the_trace_counts(&mut nodes, &mut tasks);
                }
                placement_ceiling(&nodes, &tasks, measure)
            };
            // gpuspec33's tasks pinned to T4 and P100 ask more than those GPUs hold.
            let gpuspec33 = ceiling(TraceMix::Gpuspec33, Measure::Gib).unwrap();
            let t4_p100 = gpuspec33.classes.iter().all(|c| c.model <= 1);
            assert!(t4_p100, "{gpuspec33:?}");
            assert!(gpuspec33.asked > gpuspec33.held, "{gpuspec33:?}");
            assert!(gpuspec33.allocation_at_most < 0.98, "{gpuspec33:?}");
            // Counted as the trace counts, every GPU one GPU, the T4 pins alone do.
            let counted = ceiling(TraceMix::Gpuspec33, Measure::Gpus).unwrap();
            assert!(counted.classes.iter().all(|c| c.model == 0), "{counted:?}");
            assert!(counted.allocation_at_most < 0.97, "{counted:?}");
            // The default and multigpu50 mixes: no set of classes is over-asked.
            assert_eq!(ceiling(TraceMix::Default, Measure::Gib), None);
            assert_eq!(ceiling(TraceMix::Multigpu50, Measure::Gpus), None);
        }
    }
}
