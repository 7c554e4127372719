//! FGD as published (ATC'23), the yardstick of gpushare's fragmentation policy: expected
//! fragmentation against its own model of the task population, every task kind. Idealized:
//! it looks at every node.

use std::collections::BTreeMap;

use gpushare_allocator::fragmentation::Host;

use super::best_fit::snuggest;
use super::generator::{Models, Task};
use super::nodes::Nodes;

/// A typical task: GPUs, GiB each, host, model constraint; and its share of the stream.
#[derive(Debug, Clone, Copy)]
pub(super) struct Typical {
    gpus: u32,
    gpu_gib: u64,
    host: Host,
    model: Option<Models>,
    weight: f64,
}

/// The most typical tasks FGD weighs (the rest are too rare to move a decision).
const MAX_TYPICAL: usize = 32;

/// The task population: tasks grouped by GPUs, GiB, model and CPU/memory within a power of
/// two (the group keeps its largest host), the heaviest groups (ties in key order, so every run keeps the same ones).
pub(super) fn shapes(tasks: &[Task]) -> Vec<Typical> {
    let mut groups: BTreeMap<(u32, u64, Option<Models>, u32, u32), Typical> = BTreeMap::new();
    for t in tasks {
        let key = (
            t.gpus,
            t.gpu_gib,
            t.model,
            u64::BITS - t.host.milli_cpu.leading_zeros(),
            u64::BITS - t.host.memory_mib.leading_zeros(),
        );
        let group = groups.entry(key).or_insert(Typical {
            gpus: t.gpus,
            gpu_gib: t.gpu_gib,
            host: t.host,
            model: t.model,
            weight: 0.0,
        });
        group.host.milli_cpu = group.host.milli_cpu.max(t.host.milli_cpu);
        group.host.memory_mib = group.host.memory_mib.max(t.host.memory_mib);
        group.weight += 1.0;
    }
    let mut shapes: Vec<Typical> = groups.into_values().collect();
    shapes.sort_by(|a, b| {
        b.weight
            .total_cmp(&a.weight)
            .then(a.gpu_gib.cmp(&b.gpu_gib))
    });
    shapes.truncate(MAX_TYPICAL);
    shapes
}

/// F_n(M) of node `n` with `free` GPU memory and `host` free.
fn fragmentation(state: &Nodes<'_>, n: usize, free: &[u64], host: Host, shapes: &[Typical]) -> f64 {
    let total: u64 = free.iter().sum();
    let model = state.specs[n].model;
    shapes
        .iter()
        .map(|s| {
            let runs = s.gpus > 0
                && s.model.is_none_or(|m| m.contains(model))
                && host.fits(s.host)
                && free.iter().filter(|f| **f >= s.gpu_gib).count() >= s.gpus as usize;
            let lost = if runs {
                free.iter().filter(|f| **f < s.gpu_gib).sum::<u64>()
            } else {
                total
            };
            s.weight * lost as f64
        })
        .sum()
}

/// The node and GPUs adding the least fragmentation; ties to the lowest node.
pub(super) fn place(
    state: &Nodes<'_>,
    shapes: &[Typical],
    task: &Task,
) -> Option<(usize, Vec<usize>)> {
    let mut best: Option<(usize, Vec<usize>, f64)> = None;
    let mut scratch = Vec::new();
    for n in (0..state.specs.len()).filter(|&n| state.takes(n, task)) {
        let host = state.host_free(n);
        let free = &state.free[n];
        let before = fragmentation(state, n, free, host, shapes);
        let after_host = host.saturating_sub(task.host);
        let choices: Vec<Vec<usize>> = if task.gpus == 1 {
            // Each distinct free amount once.
            let mut seen = Vec::new();
            (0..free.len())
                .filter(|&g| free[g] >= task.gpu_gib)
                .filter(|&g| {
                    let new = !seen.contains(&free[g]);
                    seen.push(free[g]);
                    new
                })
                .map(|g| vec![g])
                .collect()
        } else {
            vec![snuggest(free, task)]
        };
        for gpus in choices {
            scratch.clear();
            scratch.extend_from_slice(free);
            for &g in &gpus {
                scratch[g] -= task.gpu_gib;
            }
            let delta = fragmentation(state, n, &scratch, after_host, shapes) - before;
            if best.as_ref().is_none_or(|(_, _, b)| delta < *b) {
                best = Some((n, gpus, delta));
            }
        }
    }
    best.map(|(n, gpus, _)| (n, gpus))
}
