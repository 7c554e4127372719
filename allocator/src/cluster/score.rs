//! The read-only questions of the scheduling path, asked of a [`Cluster`] without booking
//! anything: does a request fit a node, how good is each candidate node (absolute, or
//! relative to the other candidates, which is what the extender returns), and which GPUs
//! would a bind take. Every answer comes from [`Node::choose`](super::Node::choose), the
//! decision [`Cluster::reserve`] books, so a node that fits is one a bind can take.

use super::{Cluster, GpuUsage};
use crate::{Policy, Request, Unfit};

impl Cluster {
    /// Whether `request` fits `node` now: one healthy GPU with enough free memory that the
    /// twin rule allows (N such GPUs for a multi-GPU request; N empty ones for whole GPUs).
    pub fn fit(&self, node: &str, request: &Request) -> Result<(), Unfit> {
        let node = self.nodes.get(node).ok_or(Unfit::UnknownNode)?;
        node.choose(request, Policy::Binpack, &self.workload)
            .map(|_| ())
    }

    /// How full `node` would be after placing `request`, in 0.0..=1.0; `None` when it does
    /// not fit. The node's healthy GPU memory in use weighs three quarters, the chosen GPU's
    /// one quarter (so among equally full nodes the one with the snugger GPU wins).
    pub fn fullness(&self, node: &str, request: &Request, policy: Policy) -> Option<f64> {
        let node = self.nodes.get(node)?;
        let choice = node.choose(request, policy, &self.workload).ok()?;
        let (total, used) = node.healthy_totals();
        let usage = &node.gpus[choice.first];
        let per_gpu = request.gib_per_gpu();
        // What the pod adds: its request, or the whole GPUs when exclusive.
        let held = |usage: &GpuUsage| {
            if request.exclusive {
                usage.total_gib.max(per_gpu)
            } else {
                per_gpu
            }
        };
        let added: u64 = std::iter::once(choice.first)
            .chain(choice.more.iter().copied())
            .map(|pos| held(&node.gpus[pos]))
            .sum();
        let fraction = |used: u64, added: u64, total: u64| {
            if total == 0 {
                1.0
            } else {
                (used.saturating_add(added) as f64 / total as f64).min(1.0)
            }
        };
        Some(
            0.75 * fraction(used, added, total)
                + 0.25 * fraction(usage.used_gib, held(usage), usage.total_gib),
        )
    }

    /// How good `node` is for `request` on its own, 0..=[`crate::MAX_SCORE`]; 0 when it does
    /// not fit. Binpack scores fullness after placing, spread its complement; fragmentation,
    /// which only ranks nodes against each other ([`Cluster::scores`]), scores as binpack.
    pub fn score(&self, node: &str, request: &Request, policy: Policy) -> u8 {
        let Some(full) = self.fullness(node, request, policy) else {
            return 0;
        };
        let score = match policy {
            Policy::Binpack | Policy::Fragmentation => full,
            Policy::Spread => 1.0 - full,
        };
        to_score(score)
    }

    /// Scores for a set of candidate nodes, relative to each other: the best fitting node
    /// gets [`crate::MAX_SCORE`], the worst fitting one 1, the rest in proportion; nodes that
    /// do not fit get 0.
    ///
    /// Why relative: kube-scheduler only takes 0..=10 from an extender. Absolute fullness
    /// rounds to the same score on nearly empty nodes (3 GiB and 2 GiB used of 64 both
    /// round to 1), and the scheduler's own spreading scores then decide — fragmenting GPUs.
    /// Ranking among the candidates keeps the packing preference decisive at any fill level.
    ///
    /// Under the fragmentation policy, a multi-GPU request (shared slices) is scored by the
    /// measure too (what its slices on the GPUs bind would take cost the node). While
    /// multi-GPU pods bring a large share of the recent demand
    /// ([`crate::demand_mix::MULTI_GPU_HEAVY`]) they are scored as binpack, and so is a
    /// one-GPU request that takes a whole GPU (every healthy GPU of its models) on every
    /// candidate: that keeps whole nodes for
    /// the multi-GPU jobs (see [`crate::demand_mix`] for the figures).
    /// Exclusive requests (empty GPUs, booked in full) are always scored as binpack: by the
    /// measure they packed worse (docs/performance.md, "Workload mixes"). A request that
    /// names GPU models is measured on the GPUs of those models; the node's fragmentation
    /// counts all of its GPUs.
    pub fn scores(&self, nodes: &[&str], request: &Request, policy: Policy) -> Vec<u8> {
        if policy == Policy::Fragmentation {
            let heavy = self.demand.is_multi_gpu_heavy();
            if !request.is_multi() {
                if !heavy || !self.takes_whole_gpus(nodes, request) {
                    return self.fragmentation_scores(nodes, request);
                }
            } else if !request.exclusive && !heavy {
                return self.fragmentation_scores_multi(nodes, request);
            }
        }
        let goodness: Vec<Option<f64>> = nodes
            .iter()
            .map(|node| {
                self.fullness(node, request, policy)
                    .map(|full| match policy {
                        Policy::Binpack | Policy::Fragmentation => full,
                        Policy::Spread => 1.0 - full,
                    })
            })
            .collect();
        let (low, high) = goodness
            .iter()
            .flatten()
            .fold((f64::MAX, f64::MIN), |(low, high), g| {
                (low.min(*g), high.max(*g))
            });
        goodness
            .iter()
            .map(|g| match g {
                None => 0,
                Some(_) if high - low < 1e-9 => crate::MAX_SCORE,
                Some(g) => 1 + to_score((g - low) / (high - low) * 0.9),
            })
            .collect()
    }

    /// Whether `request` asks all of a GPU's memory on every healthy GPU it allows (its
    /// models) of every node of `nodes`: where some candidate would give it part of a larger
    /// GPU, it shares, and the measure places it.
    fn takes_whole_gpus(&self, nodes: &[&str], request: &Request) -> bool {
        nodes.iter().all(|name| {
            self.nodes.get(*name).is_none_or(|node| {
                node.gpus
                    .iter()
                    .filter(|usage| usage.gpu.healthy && request.models.allows(&usage.gpu.model))
                    .all(|usage| request.pod_gib >= usage.gpu.total_gib)
            })
        })
    }

    /// The GPU `request` would get on `node` under `policy`, without booking it (the first
    /// one, for a multi-GPU request; see [`Cluster::choose_gpus`]).
    pub fn choose_gpu(&self, node: &str, request: &Request, policy: Policy) -> Result<u32, Unfit> {
        self.choose_gpus(node, request, policy)
            .map(|gpus| gpus.first().copied().unwrap_or_default())
    }

    /// Every GPU (index) `request` would get on `node` under `policy`, best first, without
    /// booking them.
    pub fn choose_gpus(
        &self,
        node: &str,
        request: &Request,
        policy: Policy,
    ) -> Result<Vec<u32>, Unfit> {
        let node = self.nodes.get(node).ok_or(Unfit::UnknownNode)?;
        let choice = node.choose(request, policy, &self.workload)?;
        Ok(std::iter::once(choice.first)
            .chain(choice.more)
            .map(|pos| node.gpus[pos].index)
            .collect())
    }
}

/// 0.0..=1.0 to 0..=[`crate::MAX_SCORE`], rounded.
fn to_score(value: f64) -> u8 {
    // Clamped to 0..=10 first, so the cast cannot truncate.
    (value * f64::from(crate::MAX_SCORE))
        .round()
        .clamp(0.0, f64::from(crate::MAX_SCORE)) as u8
}
