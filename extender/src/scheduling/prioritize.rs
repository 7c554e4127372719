//! Prioritize: the policy's score of each candidate, and a hold on the one
//! scored above all others.
//!
//! Why the answer leaves hosts out: see [`compact_priorities`]; why a sole best is held: see
//! [`sole_best`].

use std::borrow::Cow;

use super::Scheduling;
use super::args::{candidates, pod_uid, read_request};
use super::filter::hold_for_bind;
use crate::wire::{ExtenderArgs, HostPriority};

/// The policy's score of each candidate of a prioritize call, as [`Scores::answer`] sends it.
#[derive(Debug)]
pub struct Scores<'a> {
    names: Vec<Cow<'a, str>>,
    raw: Vec<u8>,
}

impl Scores<'_> {
    /// The prioritize answer: the scores, the ones at the bottom left out
    /// (`compact_priorities`).
    pub fn answer(&self) -> Vec<HostPriority<'_>> {
        compact_priorities(&self.names, &self.raw)
    }
}

/// Scores `args`'s candidates; the candidate scored above all others is held for the bind.
pub(super) fn prioritize_answer<'a>(state: &Scheduling, args: &'a ExtenderArgs<'a>) -> Scores<'a> {
    let names: Vec<Cow<'a, str>> = candidates(args).into_iter().map(|(name, _)| name).collect();
    let view = state.view();
    let request = read_request(args, &view)
        .ok()
        .flatten()
        .filter(|_| view.is_synced());
    let borrowed: Vec<&str> = names.iter().map(|name| &**name).collect();
    let raw = match &request {
        Some(request) => view.cluster.scores(&borrowed, request, state.policy()),
        None => vec![0; names.len()],
    };
    drop(view);
    if let (Some(request), Some(best), Some(uid)) = (&request, sole_best(&raw), pod_uid(args)) {
        hold_for_bind(state, args, uid, borrowed[best], request);
    }
    drop(borrowed);
    Scores { names, raw }
}

/// The position of the one candidate scored above all others, if one is (a tie has none).
///
/// Why prioritize holds it: our score is what sets GPU pods apart (kube-scheduler's own scores
/// barely move for a pod's small CPU and memory request), so the node scored best alone is
/// where the pod is bound next, and the filters of the pods scheduled before that bind must
/// see its memory taken, as with filter's hold ([`crate::scheduling::view::reservations`], "Why holds"). If
/// kube-scheduler chooses another node, the bind gives the hold back and books there; until
/// then the held node merely looked a little fuller. On a tie kube-scheduler draws the node,
/// so nothing is held.
fn sole_best(raw: &[u8]) -> Option<usize> {
    let best = raw.iter().copied().max().filter(|&best| best > 0)?;
    let mut at_best = raw.iter().enumerate().filter(|(_, score)| **score == best);
    let (position, _) = at_best.next()?;
    at_best.next().is_none().then_some(position)
}

/// The prioritize answer for `names` scored `raw`: every score lowered by the lowest one, and
/// only the hosts left above 0.
///
/// Why this is the same answer: kube-scheduler adds `score × weight × 10` to each candidate's
/// total and adds nothing for a host the list leaves out (`prioritizeNodes` in upstream's
/// `pkg/scheduler/schedule_one.go` walks the list, not the candidates), so a host left out
/// counts as 0; lowering every candidate by the same amount moves no total past another.
/// What it saves: after filter every candidate fits, and on a cluster with room most of them
/// tie at the bottom (all of them when none is better than another), so the list kube-scheduler
/// decodes in its scheduling cycle holds only the hosts we prefer.
///
/// One thing does change: upstream draws a random tie-breaker only for hosts a list names, so a
/// host left out loses a tie of totals to one that is listed, and ties among hosts left out go
/// by the order of its score heap rather than by chance.
fn compact_priorities<'a, S: AsRef<str>>(names: &'a [S], raw: &[u8]) -> Vec<HostPriority<'a>> {
    let lowest = raw.iter().copied().min().unwrap_or(0);
    names
        .iter()
        .zip(raw)
        .filter(|(_, score)| **score > lowest)
        .map(|(name, score)| HostPriority {
            host: name.as_ref(),
            score: i64::from(score - lowest),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each host's score with a host left out counting as 0, as kube-scheduler counts it.
    fn as_upstream_reads(names: &[&str], answer: &[HostPriority<'_>]) -> Vec<i64> {
        names
            .iter()
            .map(|name| {
                answer
                    .iter()
                    .filter(|h| h.host == *name)
                    .map(|h| h.score)
                    .sum()
            })
            .collect()
    }

    #[test]
    fn sole_best_is_the_one_top_score_and_never_a_tie_or_a_zero() {
        assert_eq!(sole_best(&[3, 10, 7]), Some(1));
        assert_eq!(sole_best(&[0, 0, 1]), Some(2));
        assert_eq!(sole_best(&[10, 3, 10]), None);
        assert_eq!(sole_best(&[0, 0]), None);
        assert_eq!(sole_best(&[]), None);
    }

    #[test]
    fn compact_priorities_keep_every_difference_and_leave_out_the_bottom() {
        let names = ["a", "b", "c", "d"];
        let cases: [&[u8]; 5] = [
            &[3, 1, 10, 1],
            &[0, 4, 10, 0],
            &[10, 10, 10, 10],
            &[1, 2, 3, 4],
            &[0; 4],
        ];
        for raw in cases {
            let answer = compact_priorities(&names, raw);
            let read = as_upstream_reads(&names, &answer);
            for i in 0..names.len() {
                for j in 0..names.len() {
                    assert_eq!(
                        read[i] - read[j],
                        i64::from(raw[i]) - i64::from(raw[j]),
                        "{raw:?} → {answer:?}"
                    );
                }
            }
            assert!(answer.iter().all(|h| h.score > 0), "{answer:?}");
        }
        assert_eq!(
            compact_priorities(&names, &[3, 1, 10, 1]),
            [
                HostPriority {
                    host: "a",
                    score: 2
                },
                HostPriority {
                    host: "c",
                    score: 9
                }
            ]
        );
        // A host that does not fit scores 0: the others keep their scores.
        assert_eq!(
            compact_priorities(&names, &[0, 4, 10, 0]),
            [
                HostPriority {
                    host: "b",
                    score: 4
                },
                HostPriority {
                    host: "c",
                    score: 10
                }
            ]
        );
        assert!(compact_priorities(&names, &[10; 4]).is_empty());
        assert!(compact_priorities::<&str>(&[], &[]).is_empty());
    }
}
