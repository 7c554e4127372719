//! The decisions the allocator asks of the measure: which GPU of a node a pod should take
//! ([`best_gpu`] and its forms for a prepared pod or a node's [`FreeSummary`]), and how the
//! candidate nodes rank against each other ([`relative_scores`]), in the 0..=10 a
//! kube-scheduler extender may give. Ties pack: the fuller GPU, then the lower position.

use super::free::DISTINCT;
use super::{Before, FreeSummary, Host, NodeFree, Placing, Workload};

/// Keeps `(i, free, goodness)` in `best` if it is better: higher goodness, then (within
/// rounding) less free memory, so ties pack; an equal candidate seen later loses.
#[inline(always)]
fn keep_better(best: &mut Option<(usize, f64, u64)>, i: usize, free: u64, goodness: f64) {
    let better = match *best {
        None => true,
        Some((_, g, chosen)) => goodness > g + 1e-12 || (goodness > g - 1e-12 && free < chosen),
    };
    if better {
        *best = Some((i, goodness, free));
    }
}

/// The best GPU of a node for a pod of `need` GiB and `host`, read from the node's
/// [`FreeSummary`] and its host's `free` CPU and memory: the position and its
/// [`Before::goodness`]; `None` when no healthy GPU has room, or when the summary is not
/// complete (then [`best_gpu`] reads the node GPU by GPU). Ties go to the GPU with the
/// least free memory (binpack), then the lowest position. A GPU's goodness depends only on
/// its free memory, so each free amount is evaluated once.
pub fn best_gpu_summarized(
    placing: &Placing,
    summary: &FreeSummary,
    free: Host,
) -> Option<(usize, f64)> {
    let need = placing.need;
    if !summary.is_complete() || summary.max_free.is_none_or(|max| max < need) {
        return None;
    }
    let (before, cost) = Before::of_summary(placing.workload, summary, free, placing.host);
    let fullness = before.fullness_after(need);
    // The goodness of every amount first, then the choice: the evaluations are independent
    // of each other and of the choice's branches, so they overlap.
    let mut goodness = [0.0; DISTINCT];
    for ((_, free, _), goodness) in summary.amounts().zip(&mut goodness) {
        if free >= need {
            *goodness = before.goodness_with(placing, free, &cost, fullness);
        }
    }
    let mut best = None;
    for ((i, free, _), goodness) in summary.amounts().zip(goodness) {
        if free >= need {
            keep_better(&mut best, i, free, goodness);
        }
    }
    best.map(|(i, goodness, _)| (i, goodness))
}

/// [`best_gpu_summarized`] for a pod of `need` GiB and `host` on a node read through `node`,
/// GPU by GPU when its GPUs differ in more than eight ways.
pub fn best_gpu<F: Fn(usize) -> Option<(u64, u64)>>(
    workload: &Workload,
    node: &NodeFree<F>,
    need: u64,
    host: Host,
) -> Option<(usize, f64)> {
    best_gpu_placing(&Placing::new(workload, need, host), node)
}

/// [`best_gpu`] for a prepared [`Placing`].
pub fn best_gpu_placing<F: Fn(usize) -> Option<(u64, u64)>>(
    placing: &Placing,
    node: &NodeFree<F>,
) -> Option<(usize, f64)> {
    let summary = FreeSummary::new(node.gpus, &node.free);
    if summary.is_complete() {
        return best_gpu_summarized(placing, &summary, node.host);
    }
    best_gpu_among(placing, node, |_| true)
}

/// [`best_gpu_placing`] among the GPUs `allowed` says the pod may take (those of the models
/// it asks for), read GPU by GPU: the node's fragmentation counts all of its GPUs, the pod
/// goes only on an allowed one.
pub fn best_gpu_among<F: Fn(usize) -> Option<(u64, u64)>>(
    placing: &Placing,
    node: &NodeFree<F>,
    allowed: impl Fn(usize) -> bool,
) -> Option<(usize, f64)> {
    let (workload, need) = (placing.workload, placing.need);
    let before = Before::new(workload, node);
    if before.max_free.is_none_or(|max| max < need) {
        return None;
    }
    let cost = before.after_host(workload, placing.host);
    let fullness = before.fullness_after(need);
    // Each free amount once, at its first allowed GPU.
    let mut seen: Vec<u64> = Vec::new();
    let mut best = None;
    for i in 0..node.gpus {
        let Some((free, _)) = (node.free)(i) else {
            continue;
        };
        if free < need || seen.contains(&free) || !allowed(i) {
            continue;
        }
        seen.push(free);
        keep_better(
            &mut best,
            i,
            free,
            before.goodness_with(placing, free, &cost, fullness),
        );
    }
    best.map(|(i, goodness, _)| (i, goodness))
}

/// Scores for candidate nodes from their goodness (`None`: does not fit), relative to each
/// other: the best (and any tied with it) get [`crate::MAX_SCORE`], the others 1 to
/// `MAX_SCORE − 1` in proportion, nodes that do not fit 0.
///
/// Why the best alone gets the top score: kube-scheduler adds the extender's 0..=10 to its
/// own scores and breaks ties at random; with a proportional scale, every node within a
/// tenth of the best would tie with it and the choice among them would be random.
pub fn relative_scores(goodness: &[Option<f64>]) -> Vec<u8> {
    let (low, high) = goodness
        .iter()
        .flatten()
        .fold((f64::MAX, f64::MIN), |(low, high), g| {
            (low.min(*g), high.max(*g))
        });
    let top = crate::MAX_SCORE;
    goodness
        .iter()
        .map(|g| match *g {
            None => 0,
            Some(g) if g >= high - 1e-9 => top,
            Some(g) => {
                let scaled = (g - low) / (high - low) * f64::from(top - 2);
                // In 0..=top−2 before the cast, so it cannot truncate.
                1 + scaled.round().clamp(0.0, f64::from(top - 2)) as u8
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fragmentation::MAX_SHAPES;
    use crate::fragmentation::fixtures::{node, shape};
    use crate::fragmentation::prepared::Quotients;

    #[test]
    fn small_pods_fill_gaps_and_keep_whole_gpus() {
        // 8 GiB pods are typical; a 4 GiB pod should go to the GPU with 6 free, not split
        // the empty one, and not to the GPU with 8 free that an 8 GiB pod could still use.
        let workload = Workload::from_shapes([(shape(8, 1), 3.0), (shape(4, 1), 1.0)]);
        let free = [16, 8, 6];
        let n = node(&free, Host::UNLIMITED);
        let (gpu, _) = best_gpu(&workload, &n, 4, Host::new(1000, 4096)).unwrap();
        assert_eq!(gpu, 2);
    }

    #[test]
    fn a_pod_that_would_strand_a_nodes_gpus_goes_elsewhere() {
        let workload = Workload::from_shapes([(shape(16, 8), 1.0)]);
        let pod = Host::new(12_000, 12 * 4096);
        // Node a: two empty GPUs and CPU for two typical pods, but not after this one.
        let a = node(&[16, 16], Host::new(16_000, 1 << 20));
        let b = node(&[16, 16], Host::new(64_000, 1 << 20));
        let (_, on_a) = best_gpu(&workload, &a, 16, pod).unwrap();
        let (_, on_b) = best_gpu(&workload, &b, 16, pod).unwrap();
        // On a, the other GPU is stranded: 16 GiB lost. On b nothing is.
        assert!(on_a < -15.0 && on_b > -1.0, "{on_a} {on_b}");
    }

    #[test]
    fn equal_changes_pack_onto_the_fuller_node() {
        let workload = Workload::from_shapes([(shape(2, 1), 1.0)]);
        let pod = Host::new(1000, 4096);
        let full = node(&[4, 16], Host::UNLIMITED);
        let empty = node(&[16, 16], Host::UNLIMITED);
        let (gpu, on_full) = best_gpu(&workload, &full, 2, pod).unwrap();
        let (_, on_empty) = best_gpu(&workload, &empty, 2, pod).unwrap();
        assert_eq!(gpu, 0, "binpack inside the node on ties");
        assert!(on_full > on_empty);
    }

    #[test]
    fn only_the_best_gets_the_top_score() {
        let scores = relative_scores(&[Some(-3.0), None, Some(-1.0), Some(-1.0), Some(-1.1)]);
        assert_eq!(scores[1], 0);
        assert_eq!((scores[2], scores[3]), (10, 10));
        assert_eq!(scores[0], 1);
        assert!((1..10).contains(&scores[4]), "{scores:?}");
        assert_eq!(relative_scores(&[Some(2.0)]), vec![10]);
    }

    /// The measure as first written, dividing for every quotient: what the quotient table,
    /// the divisors and the single pass over the GPUs must reproduce bit for bit.
    fn reference_best_gpu(
        workload: &Workload,
        free: &[Option<u64>],
        node_host: Host,
        need: u64,
        host: Host,
    ) -> Option<(usize, f64)> {
        let w = &workload.prepared;
        let sizes: Vec<u64> = (0..MAX_SHAPES).map(|m| w.gib[m].d).collect();
        let needs: Vec<Host> = (0..MAX_SHAPES)
            .map(|m| Host::new(w.cpu[m].d, w.memory[m].d))
            .collect();
        let cap = |slots: u64, free: u64, need: u64| {
            if need == 0 || slots.saturating_mul(need) <= free {
                slots
            } else {
                free / need
            }
        };
        let runs = |slots: &[u64], free: Host| -> Vec<u64> {
            (0..MAX_SHAPES)
                .map(|m| {
                    cap(
                        cap(slots[m], free.milli_cpu, needs[m].milli_cpu),
                        free.memory_mib,
                        needs[m].memory_mib,
                    )
                })
                .collect()
        };
        let healthy = || free.iter().flatten().copied();
        let mut slots = vec![0u64; MAX_SHAPES];
        for f in healthy() {
            for m in 0..MAX_SHAPES {
                slots[m] += f / sizes[m];
            }
        }
        let total_free = healthy().fold(0u64, u64::saturating_add);
        let total_gib = 32 * free.iter().flatten().count() as u64;
        if healthy().max().is_none_or(|max| max < need) {
            return None;
        }
        let runs_now = runs(&slots, node_host);
        let limits = runs(&slots, node_host.saturating_sub(host));
        let mut best: Option<(usize, f64, u64)> = None;
        let mut seen = [u64::MAX; 8];
        for (i, f) in free.iter().enumerate() {
            let Some(f) = *f else { continue };
            if f < need || seen.contains(&f) {
                continue;
            }
            seen[i % seen.len()] = f;
            let mut delta = -(need as f64) * w.weight_sum;
            for m in 0..MAX_SHAPES {
                let after = slots[m].saturating_sub(f / sizes[m]) + (f - need) / sizes[m];
                let runs_after = after.min(limits[m]);
                delta += w.weighted_gib[m] * runs_now[m].saturating_sub(runs_after) as f64;
            }
            let fragmentation = if workload.is_empty() { 0.0 } else { delta };
            let used_after = total_gib.saturating_sub(total_free.saturating_sub(need));
            let fullness = if total_gib == 0 {
                1.0
            } else {
                used_after as f64 / total_gib as f64
            };
            let goodness = -fragmentation + fullness / 64.0;
            let better = match best {
                None => true,
                Some((_, g, chosen)) => {
                    goodness > g + 1e-12 || (goodness > g - 1e-12 && f < chosen)
                }
            };
            if better {
                best = Some((i, goodness, f));
            }
        }
        best.map(|(i, goodness, _)| (i, goodness))
    }

    proptest::proptest! {
        #[test]
        fn the_fast_measure_is_the_measure_bit_for_bit(
            learned in proptest::collection::vec((1..=40u64, 0..=16u64), 0..30),
            large in proptest::collection::vec(400..=700u64, 0..3),
            free in proptest::collection::vec(proptest::option::weighted(0.9, 0..=40u64), 1..=12),
            beyond in proptest::option::of(500..=800u64),
            node_cores in 0..=96u64,
            need in 1..=40u64,
            cores in 0..=16u64,
        ) {
            let mut workload = Workload::new();
            // Sizes and free amounts beyond the quotient table take the divisions.
            for (gpu_gib, cores) in learned.iter().copied().chain(large.iter().map(|&gib| (gib, 1))) {
                workload.observe(shape(gpu_gib, cores));
                let fresh = Quotients::new(workload.prepared.quotients.sizes, &workload.prepared.gib);
                proptest::prop_assert_eq!(&workload.prepared.quotients, &fresh);
            }
            let mut free = free;
            if let Some(beyond) = beyond {
                free.push(Some(beyond));
            }
            let node_host = Host::new(node_cores * 1000, node_cores * 4096);
            let view = NodeFree {
                gpus: free.len(),
                free: |i: usize| free[i].map(|f| (f, 32)),
                host: node_host,
            };
            let pod = Host::new(cores * 1000, cores * 4096);
            let fast = best_gpu(&workload, &view, need, pod);
            let reference = reference_best_gpu(&workload, &free, node_host, need, pod);
            proptest::prop_assert_eq!(
                fast.map(|(gpu, g)| (gpu, g.to_bits())),
                reference.map(|(gpu, g)| (gpu, g.to_bits())),
                "{:?} vs {:?}", fast, reference
            );
            // Scoring many nodes reads the slots taken from a table: the same bits.
            let tabled = best_gpu_placing(&Placing::for_many_nodes(&workload, need, pod), &view);
            proptest::prop_assert_eq!(
                tabled.map(|(gpu, g)| (gpu, g.to_bits())),
                reference.map(|(gpu, g)| (gpu, g.to_bits())),
                "{:?} vs {:?}", tabled, reference
            );
        }
    }
}
