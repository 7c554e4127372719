//! What the extenders' prioritize answers add to the default profile's scores
//! ([`gpushare_scheduler_model::scoring`]), exactly as upstream's `prioritizeNodes` adds them.
//! Kept beside the scheduler because it reads the extender's wire types.

use gpushare_scheduler_model::scoring::{MAX_NODE_SCORE, NodeScore};
use rand::Rng;

use super::wire::{HostPriority, MAX_EXTENDER_PRIORITY};

/// One interested extender's prioritize answer and its `weight`. An extender configured
/// without a prioritize verb still answers in upstream (`HTTPExtender.Prioritize`): every
/// node with score 0, weight 0 ([`ExtenderPriorities::without_verb`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtenderPriorities {
    pub priorities: Vec<HostPriority>,
    pub weight: i64,
}

impl ExtenderPriorities {
    /// What upstream makes up for an interested extender that has no prioritize verb.
    pub fn without_verb(nodes: &[NodeScore]) -> Self {
        Self {
            priorities: nodes
                .iter()
                .map(|n| HostPriority {
                    host: n.name.clone(),
                    score: 0,
                })
                .collect(),
            weight: 0,
        }
    }
}

/// Adds the extenders' answers to the candidates exactly as upstream's `prioritizeNodes` does.
///
/// - Each listed host gets `score × weight × (MaxNodeScore / MaxExtenderPriority)`, in Go's
///   wrapping `int64` arithmetic, with no range check on `score`; a host listed twice counts twice.
/// - A candidate an answer leaves out gets nothing from it: the same total as score 0. Only its
///   tie-breaker differs: a node named by any answer draws a random `Randomizer`, the others
///   keep 0.
/// - Hosts that are not candidates are ignored.
///
/// Extenders whose prioritize failed are not passed in: upstream logs and ignores them.
pub fn add_extender_priorities<R: Rng + ?Sized>(
    nodes: &mut [NodeScore],
    answers: &[ExtenderPriorities],
    rng: &mut R,
) {
    let scale = MAX_NODE_SCORE / MAX_EXTENDER_PRIORITY;
    let mut by_host: std::collections::HashMap<&str, i64> = std::collections::HashMap::new();
    for answer in answers {
        for priority in &answer.priorities {
            let added = priority
                .score
                .wrapping_mul(answer.weight)
                .wrapping_mul(scale);
            let total = by_host.entry(priority.host.as_str()).or_insert(0);
            *total = total.wrapping_add(added);
        }
    }
    for node in nodes {
        if let Some(added) = by_host.get(node.name.as_str()) {
            node.total = node.total.wrapping_add(*added);
            // Go's rand.Int(): a non-negative 63-bit number.
            node.randomizer = rng.random::<u64>() >> 1;
        }
    }
}
