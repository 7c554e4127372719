//! Preempt: which pods to evict on each candidate node so that the preemptor
//! gets room on one GPU, or which candidates to drop because no eviction there gives it.
//!
//! Why: kube-scheduler proposes victims by the node's total of the resource. On a node whose
//! GPUs each have a little free, it evicts one small pod here and one there, frees memory on
//! both GPUs and room on neither: pods die for nothing and the preemptor still waits. Here
//! each candidate node is decided per GPU by the allocation core
//! ([`gpushare_allocator::Cluster::eviction`]) among the node's pods of lower priority than
//! the preemptor, whether kube-scheduler proposed them or not (it resolves the answer's UIDs
//! among all the node's pods: `convertPodUIDToPod` in upstream's `pkg/scheduler/extender.go`).
//!
//! What is kept of kube-scheduler's proposal: the victims that hold no GPU memory on the
//! node (it chose them for CPU, memory or another resource), after ours. A pod that asks
//! for no GPU memory gets the proposal back unchanged. Whatever cannot be decided (the
//! preemptor's request is unreadable, the view is not synced) drops every node: no pod is
//! evicted on a guess, and kube-scheduler tries again later.

use std::collections::BTreeMap;
use std::sync::{RwLockReadGuard, RwLockWriteGuard};

use gpushare_allocator::{Eviction, PodId};

use super::Scheduling;
use crate::scheduling::ports::PodEvent;
use crate::scheduling::view::View;
use crate::wire::{ExtenderPreemptionArgs, ExtenderPreemptionResult, MetaPod, MetaVictims};

/// The node an answer kept, with the eviction decided there.
struct Kept<'a> {
    node: &'a str,
    eviction: Eviction,
    /// kube-scheduler's victims on the node that hold no GPU memory there.
    others: Vec<&'a str>,
}

pub(super) fn preempt_answer(
    state: &Scheduling,
    args: &ExtenderPreemptionArgs,
) -> ExtenderPreemptionResult {
    let proposals = args.proposals();
    let proposed: usize = proposals.values().map(|(uids, _)| uids.len()).sum();
    let Some(pod) = args.pod.as_ref() else {
        state.metrics().preempt_answer("unreadable");
        return ExtenderPreemptionResult::default();
    };
    let pod_name = format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default()
    );
    tracing::Span::current().record("pod", tracing::field::display(&pod_name));
    let request = match preemptor_request(state, pod) {
        Ok(Some(request)) => request,
        Ok(None) => return pass_through(&proposals),
        Err(()) => return ExtenderPreemptionResult::default(),
    };
    let priority = pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0);
    let uid = pod.metadata.uid.as_deref().map(PodId::from);
    // Its own hold or nomination booking must not count against it: given back (under the
    // write lock) when it has one, which is rare; otherwise the candidates are decided under
    // the read lock, so filters go on meanwhile (a 2-GPU preemptor over 100 nodes of 80 pods
    // takes tens of milliseconds: `cargo bench -p gpushare-perf --bench allocator -- preempt`).
    let (synced, booked) = {
        let view = state.view();
        let booked = uid
            .as_ref()
            .is_some_and(|uid| view.cluster.pod(uid).is_some());
        (view.is_synced(), booked)
    };
    if !synced {
        state.metrics().preempt_answer("not_synced");
        return ExtenderPreemptionResult::default();
    }
    let guard = if booked {
        let mut view = state.view_mut();
        if let Some(uid) = &uid {
            view.release_hold(uid);
        }
        Guard::Write(view)
    } else {
        Guard::Read(state.view())
    };
    let view: &View = &guard;
    let (kept, dropped) = decide_nodes(view, &request, priority, &proposals);
    let event = kept
        .iter()
        .min_by_key(|k| {
            let e = &k.eviction;
            (
                e.budget_violations,
                e.highest_priority,
                e.priority_sum,
                e.victims.len(),
            )
        })
        .map(|best| event_note(view, best, kept.len(), &proposals));
    if let Guard::Write(mut view) = guard {
        if let Some(uid) = &uid {
            view.resume_nomination(uid);
        }
        state.update_reservation_gauges(&view);
    }
    state.metrics().preempt_nodes_dropped.inc_by(dropped);
    let answer = to_answer(&kept);
    let answered: usize = answer
        .node_name_to_meta_victims
        .values()
        .map(|v| v.pods.len())
        .sum();
    state.metrics().preempt_victims(proposed, answered);
    state.metrics().preempt_answer(if kept.is_empty() {
        "no_node"
    } else {
        "victims"
    });
    tracing::info!(
        candidates = proposals.len(),
        kept = kept.len(),
        proposed,
        answered,
        "preempt answered"
    );
    if let (Some(note), Some(uid)) = (event, uid) {
        state.events().send(PodEvent {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            uid: uid.to_string(),
            warning: false,
            reason: "GpuPreemption",
            note,
        });
    }
    answer
}

/// The preemptor's request in the allocator's form; `None` when it asks for no GPU memory
/// (counted), an error when it cannot be read (counted and logged).
fn preemptor_request(
    state: &Scheduling,
    pod: &k8s_openapi::api::core::v1::Pod,
) -> Result<Option<gpushare_allocator::Request>, ()> {
    let read = state.view().request_of(pod);
    match read {
        Ok(Some(request)) => Ok(Some(request)),
        Ok(None) => {
            state.metrics().preempt_answer("not_ours");
            Ok(None)
        }
        Err(error) => {
            tracing::warn!(%error, "preempt: the preemptor's request cannot be read; no node is preempted on");
            state.metrics().preempt_answer("unreadable");
            Err(())
        }
    }
}

/// Decides each proposed node per GPU: the eviction that gives `request` room on one GPU
/// among the node's pods of lower `priority`, or the node dropped (the count).
fn decide_nodes<'a>(
    view: &View,
    request: &gpushare_allocator::Request,
    priority: i32,
    proposals: &BTreeMap<&'a str, (Vec<&'a str>, i64)>,
) -> (Vec<Kept<'a>>, u64) {
    let mut kept: Vec<Kept<'_>> = Vec::new();
    let mut dropped = 0_u64;
    for (&node, (uids, _)) in proposals {
        let evictable = view.evictable_on(node, priority);
        match view.cluster.eviction(node, request, &evictable) {
            Some(eviction) => {
                let booked_here = |uid: &str| {
                    view.cluster
                        .pod(&PodId::from(uid))
                        .is_some_and(|(on, _)| on == node)
                };
                let others: Vec<&str> = uids.iter().copied().filter(|u| !booked_here(u)).collect();
                // Nothing to evict (the pod fits there already, freed since kube-scheduler's
                // dry run): kube-scheduler takes a node with no victim as an error that fails
                // the whole preemption, so the node is left out; the pod is retried anyway.
                if eviction.victims.is_empty() && others.is_empty() {
                    dropped += 1;
                    continue;
                }
                kept.push(Kept {
                    node,
                    eviction,
                    others,
                });
            }
            None => dropped += 1,
        }
    }
    (kept, dropped)
}

/// The answer kube-scheduler reads: per kept node, our victims then its own that hold no GPU
/// memory there.
fn to_answer(kept: &[Kept<'_>]) -> ExtenderPreemptionResult {
    let mut answer = ExtenderPreemptionResult::default();
    for Kept {
        node,
        eviction,
        others,
    } in kept
    {
        let pods = eviction
            .victims
            .iter()
            .map(PodId::as_str)
            .chain(others.iter().copied())
            .map(|uid| MetaPod {
                uid: uid.to_owned(),
            })
            .collect();
        let victims = MetaVictims {
            pods,
            num_pdb_violations: i64::try_from(eviction.budget_violations).unwrap_or(i64::MAX),
        };
        answer
            .node_name_to_meta_victims
            .insert((*node).to_owned(), victims);
    }
    answer
}

/// The view as a preempt call holds it: read, or written when the preemptor's own booking
/// had to be given back first.
enum Guard<'a> {
    Read(RwLockReadGuard<'a, View>),
    Write(RwLockWriteGuard<'a, View>),
}

impl std::ops::Deref for Guard<'_> {
    type Target = View;

    fn deref(&self) -> &View {
        match self {
            Guard::Read(view) => view,
            Guard::Write(view) => view,
        }
    }
}

/// kube-scheduler's proposal, unchanged (a pod that asks for no GPU memory).
fn pass_through(proposals: &BTreeMap<&str, (Vec<&str>, i64)>) -> ExtenderPreemptionResult {
    let mut answer = ExtenderPreemptionResult::default();
    for (node, (uids, violations)) in proposals {
        let pods = uids
            .iter()
            .map(|uid| MetaPod {
                uid: (*uid).to_owned(),
            })
            .collect();
        answer.node_name_to_meta_victims.insert(
            (*node).to_owned(),
            MetaVictims {
                pods,
                num_pdb_violations: *violations,
            },
        );
    }
    answer
}

/// What the preemptor's Event says: the node kube-scheduler will most likely pick (the best
/// by its own ranking), the GPUs freed there, the pods to evict and those it had proposed.
fn event_note(
    view: &View,
    best: &Kept<'_>,
    kept: usize,
    proposals: &BTreeMap<&str, (Vec<&str>, i64)>,
) -> String {
    let name = |uid: &str| {
        view.pod_key(&PodId::from(uid))
            .map_or_else(|| uid.to_owned(), |(ns, name)| format!("{ns}/{name}"))
    };
    let gpus: Vec<String> = best.eviction.gpus.iter().map(u32::to_string).collect();
    let victims: Vec<String> = best
        .eviction
        .victims
        .iter()
        .map(|uid| name(uid.as_str()))
        .collect();
    let theirs: Vec<String> = proposals
        .get(best.node)
        .map(|(uids, _)| uids.iter().map(|uid| name(uid)).collect())
        .unwrap_or_default();
    let more = match kept {
        0 | 1 => String::new(),
        n => format!(" ({} other candidate nodes kept)", n - 1),
    };
    let evicting = if victims.is_empty() {
        "nothing to evict".to_owned()
    } else {
        format!("evicting {}", victims.join(", "))
    };
    format!(
        "preemption on node {}: GPU {} gets room for the pod by {evicting}; kube-scheduler proposed {}{more}",
        best.node,
        gpus.join(","),
        if theirs.is_empty() {
            "none".to_owned()
        } else {
            theirs.join(", ")
        }
    )
}
