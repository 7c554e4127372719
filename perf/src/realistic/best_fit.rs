//! BestFit, FGD's baseline: the node left with the least free GPU, CPU and memory, the
//! snuggest GPUs on it. Idealized: it looks at every node, and places tasks itself, without
//! kube-scheduler or the allocator; FGD shares its choice of GPUs for multi-GPU tasks.

use super::generator::Task;
use super::nodes::Nodes;

/// BestFit: the node left with the least free GPU, CPU and memory (each as a share of the
/// node's own, equally weighted); on it, the snuggest GPUs.
pub(super) fn best_fit(state: &Nodes<'_>, task: &Task) -> Option<(usize, Vec<usize>)> {
    let mut best: Option<(usize, f64)> = None;
    for n in (0..state.specs.len()).filter(|&n| state.takes(n, task)) {
        let spec = &state.specs[n];
        let free = state.host_free(n).saturating_sub(task.host);
        let gpu_total = (spec.gpu_gib * u64::from(spec.gpus)) as f64;
        let gpu_free = (state.free[n].iter().sum::<u64>() - task.demand_gib()) as f64;
        let left = gpu_free / gpu_total
            + free.milli_cpu as f64 / spec.host.milli_cpu as f64
            + free.memory_mib as f64 / spec.host.memory_mib as f64;
        if best.is_none_or(|(_, b)| left < b) {
            best = Some((n, left));
        }
    }
    let (n, _) = best?;
    Some((n, snuggest(&state.free[n], task)))
}

/// The `task.gpus` GPUs with the least free memory that still fits.
pub(super) fn snuggest(free: &[u64], task: &Task) -> Vec<usize> {
    let mut fitting: Vec<usize> = (0..free.len())
        .filter(|&g| free[g] >= task.gpu_gib)
        .collect();
    fitting.sort_by_key(|&g| (free[g], g));
    fitting.truncate(task.gpus as usize);
    fitting
}
