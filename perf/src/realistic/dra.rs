//! gpushare's DRA mode: kube-scheduler allocates each task's claim itself, with its default
//! scores and the allocator's first fit on the node it picks. Nothing of the extender takes
//! part: no allocator, no extender scores, devices taken in the slice's order.

use super::generator::Task;
use super::kube_scheduler::{KubeScheduler, Missed, select_host};
use super::nodes::Nodes;

/// The devices kube-scheduler's DRA allocator gives `task`'s claim on a node whose GPUs have
/// `free` GiB: the first `gpus` of them, in the slice's order, with the share free.
pub(super) fn first_fit_devices(free: &[u64], task: &Task) -> Option<Vec<usize>> {
    let wanted = task.gpus.max(1) as usize;
    let picked: Vec<usize> = free
        .iter()
        .enumerate()
        .filter(|(_, free)| **free >= task.gpu_gib)
        .map(|(g, _)| g)
        .take(wanted)
        .collect();
    (picked.len() == wanted).then_some(picked)
}

/// [`Strategy::DraFirstFit`]: kube-scheduler's walk with the DynamicResources filter, its
/// default scores, and the allocator's first fit on the node it picks.
///
/// [`Strategy::DraFirstFit`]: super::Strategy::DraFirstFit
pub(super) fn dra_first_fit(
    state: &Nodes<'_>,
    task: &Task,
    kube: &mut KubeScheduler,
) -> Result<(usize, Vec<usize>), Missed> {
    let feasible = |n: usize| {
        state.model_ok(n, task)
            && state.host_free(n).fits(task.host)
            && first_fit_devices(&state.free[n], task).is_some()
    };
    let walk = kube.walk(state.specs.len(), feasible);
    let scores = walk
        .feasible
        .iter()
        .map(|&n| (n, state.default_score(n, task.host)));
    let chosen = select_host(scores, &mut kube.rng);
    match chosen {
        Some(n) => first_fit_devices(&state.free[n], task)
            .map(|gpus| (n, gpus))
            .ok_or(Missed::Everywhere),
        None if walk.unvisited().any(feasible) => Err(Missed::OutsideWalk),
        None => Err(Missed::Everywhere),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::realistic::generator::{TaskKind, test_task as task};

    #[test]
    fn the_dra_allocator_takes_the_first_gpus_with_the_share_free() {
        let free = [2, 8, 16, 8];
        // First fit, not best fit: the 8 GiB GPU before the 16 and the later 8; N distinct
        // GPUs, in the slice's order.
        for (task, devices) in [
            (task(TaskKind::Fractional, 1, 4), Some(vec![1])),
            (task(TaskKind::Multi, 2, 8), Some(vec![1, 2])),
            (task(TaskKind::Multi, 3, 16), None),
            (task(TaskKind::Whole, 1, 16), Some(vec![2])),
        ] {
            assert_eq!(first_fit_devices(&free, &task), devices, "{task:?}");
        }
    }
}
