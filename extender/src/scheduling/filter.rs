//! Filter: which candidate nodes can take the pod's request on one GPU, and
//! why each other one cannot; when a single node passes, its memory is held for the bind that
//! follows.
//!
//! Why filter reads only the view: kube-scheduler calls it for every pod on every scheduling
//! cycle, with hundreds of nodes, so it must answer from memory under a read lock; the only
//! writes are the holds (see [`hold_for_bind`]) and the release of lapsed ones.

use std::time::{Duration, Instant};

use gpushare_allocator::{PodId, Request, Unfit};

use super::args::{Candidate, candidates, pod_uid, read_request};
use super::{Scheduling, Unschedulable};
use crate::scheduling::keep_best::KeepBest;
use crate::scheduling::view::{Hold, NOT_SYNCED, Settings, View, unfit_reason};
use crate::wire::{ExtenderArgs, ExtenderFilterResult, RawNodeListOut};

pub(super) fn filter_answer<'a>(
    state: &Scheduling,
    args: &'a ExtenderArgs<'a>,
) -> ExtenderFilterResult<'a> {
    let candidates = candidates(args);
    let mut result = ExtenderFilterResult::default();
    let mut passing: Vec<usize> = Vec::with_capacity(candidates.len());
    let pod_uid = pod_uid(args);
    let released = release_holds(state, pod_uid.as_ref());
    // The pod whose own nomination booking ends its decision here (no hold made for it).
    let mut resume = pod_uid.clone();
    // The request to hold memory for, when exactly one node passes.
    let mut to_hold: Option<Request> = None;
    let view = state.view();
    match read_request(args, &view) {
        // Not ours: every node passes untouched.
        Ok(None) => passing.extend(0..candidates.len()),
        Ok(Some(_)) | Err(_) if !view.is_synced() => {
            result.error = NOT_SYNCED.to_owned();
        }
        Err(unsized_pod) => {
            let reason = unsized_pod.to_string();
            for (name, _) in &candidates {
                result
                    .failed_and_unresolvable_nodes
                    .insert(name.clone(), reason.clone());
            }
        }
        Ok(Some(request)) => {
            let reserved_on = reserved_node(&view, args);
            match reserved_on {
                Some(reserved_on) => {
                    only_reserved_node(reserved_on, &candidates, &mut passing, &mut result)
                }
                None => {
                    let fits = Fits {
                        state,
                        view: &view,
                        args,
                        request: &request,
                    };
                    fits.filter(&candidates, &mut passing, &mut result);
                }
            }
            if reserved_on.is_none() && passing.len() == 1 {
                to_hold = Some(request);
            }
        }
    }
    drop(view);
    if let (Some(request), Some(uid), [only]) = (to_hold, pod_uid, passing.as_slice()) {
        resume = None;
        hold_for_bind(state, args, uid, &candidates[*only].0, &request);
    }
    // What this filter gave back may be a nomination's booking (its own pod's, when it
    // held nothing again) or make room for one (`crate::scheduling::view`'s nominations).
    if released && state.view().has_unbooked_nominations() {
        let mut view = state.view_mut();
        match &resume {
            Some(uid) => view.resume_nomination(uid),
            None => view.book_nominations(),
        }
    }
    if args.node_names.is_some() {
        result.node_names = Some(passing.iter().map(|&i| candidates[i].0.clone()).collect());
    } else if args.nodes.is_some() {
        result.nodes = Some(RawNodeListOut {
            metadata: Default::default(),
            items: passing.iter().filter_map(|&i| candidates[i].1).collect(),
        });
    }
    result
}

/// Passes only `reserved_on`, where an earlier bind of the pod booked its memory (see
/// [`reserved_node`]); the others fail, saying so while no node passes.
fn only_reserved_node<'a>(
    reserved_on: &str,
    candidates: &[Candidate<'a>],
    passing: &mut Vec<usize>,
    result: &mut ExtenderFilterResult<'a>,
) {
    for (i, (name, _)) in candidates.iter().enumerate() {
        if name == reserved_on {
            passing.push(i);
        } else {
            result.failed_nodes.insert(
                name.clone(),
                format!("the pod's GPU memory is booked on node {reserved_on} while its earlier bind there is settled"),
            );
        }
    }
    if !passing.is_empty() {
        result.failed_nodes = Default::default();
    }
}

/// What filter checks each candidate against: the pod's `request` on the current view.
struct Fits<'s, 'a> {
    state: &'s Scheduling,
    view: &'s View,
    args: &'a ExtenderArgs<'a>,
    request: &'s Request,
}

impl<'a> Fits<'_, 'a> {
    /// Passes the candidates the request fits on, narrowed to the best ones with
    /// `--filter-keep-best`; when none passes, says why each failed and counts why none did
    /// ([`Unschedulable`]; not when one waits for kubelet's admission, counted apart).
    fn filter(
        &self,
        candidates: &[Candidate<'a>],
        passing: &mut Vec<usize>,
        result: &mut ExtenderFilterResult<'a>,
    ) {
        // Why each other node fails, kept as the allocator's reason and written out only
        // when no node passes: kube-scheduler reads extender failure reasons only then
        // (for its FitError and preemption); once a node passes it drops them unread, and
        // at hundreds of nodes a call they were most of the answer it decodes.
        let mut rejected: Vec<(usize, Unfit)> = Vec::new();
        for (i, (name, _)) in candidates.iter().enumerate() {
            match self.view.cluster.fit(name, self.request) {
                Ok(()) => passing.push(i),
                Err(unfit) => rejected.push((i, unfit)),
            }
        }
        if passing.is_empty() && self.view.settings().dra.is_some() {
            // DRA mode: kube-scheduler's allocator found every candidate fit, and it is the
            // authority; a view that disagrees (a hold, a claim not seen yet) ranks nothing.
            passing.extend(0..candidates.len());
            return;
        }
        let ranking = self.state.inner.ranking;
        let keep_best = KeepBest {
            keep: ranking.filter_keep_best,
            policy: ranking.policy,
            prioritize_weight: ranking.prioritize_weight,
        };
        let stepped_aside = keep_best.narrow(
            self.view,
            self.args.pod.as_ref(),
            self.request,
            candidates,
            passing,
        );
        if let Some(why) = stepped_aside {
            self.state.metrics().keep_best_stepped_aside(why.label());
        }
        if passing.is_empty() {
            if let Some(error) = awaiting_admission(self.view.settings(), candidates, &rejected) {
                self.state.metrics().filter_awaiting_admission.inc();
                result.error = error;
                return;
            }
            if !candidates.is_empty() {
                let why = Unschedulable::classify(
                    &self.view.cluster,
                    self.request,
                    rejected
                        .iter()
                        .map(|(i, unfit)| (&*candidates[*i].0, unfit)),
                );
                self.state.metrics().unschedulable(why.label());
            }
            write_reasons(self.view.settings(), candidates, rejected, result);
        } else {
            result.failed_nodes = Default::default();
        }
    }
}

/// Gives back, before a filter, the holds whose bind did not come in time, and the hold (or
/// nomination booking) of the pod being filtered (its earlier attempt ended without a bind).
/// The write lock is taken only when there are reservations or booked nominations at all.
/// True when something was given back.
fn release_holds(state: &Scheduling, pod_uid: Option<&PodId>) -> bool {
    {
        let view = state.view();
        if view.reservation_count() == 0 && view.nominations().1 == 0 {
            return false;
        }
    }
    let mut view = state.view_mut();
    let lapsed = view.release_lapsed_holds(Instant::now());
    let own = pod_uid.is_some_and(|uid| view.release_hold(uid));
    state.update_reservation_gauges(&view);
    own || lapsed > 0
}

/// Holds `request`'s memory on `node` for the pod kube-scheduler is about to bind there:
/// exactly one node passed filter (kube-scheduler does not score a single node), or
/// prioritize scored one node above all others (`sole_best` in `prioritize.rs`). The hold
/// lasts until the pod's bind comes, so the filters of the pods scheduled meanwhile see the
/// memory taken ([`crate::scheduling::view::reservations`], "Why holds").
pub(super) fn hold_for_bind(
    state: &Scheduling,
    args: &ExtenderArgs<'_>,
    uid: PodId,
    node: &str,
    request: &Request,
) {
    let Some(pod) = args.pod.as_ref() else {
        return;
    };
    let (Some(namespace), Some(name)) = (
        pod.metadata.namespace.as_deref(),
        pod.metadata.name.as_deref(),
    ) else {
        return;
    };
    let mut view = state.view_mut();
    let hold_for = if view.settings().dra.is_some() {
        DRA_HOLD_FOR
    } else {
        HOLD_FOR
    };
    let hold = Hold {
        uid,
        namespace,
        name,
        node,
        until: Instant::now() + hold_for,
    };
    view.hold(hold, request, state.policy());
    state.update_reservation_gauges(&view);
}

/// How long filter holds memory for a pod whose bind has not come: kube-scheduler calls bind
/// milliseconds after filter unless its binding cycle is stuck or gone.
const HOLD_FOR: Duration = Duration::from_secs(5);

/// How long filter holds a share in DRA mode. There the hold ends when kube-scheduler's
/// allocation of the pod's claim is watched, and kube-scheduler writes that allocation in its
/// binding cycle (DynamicResources' PreBind), behind the API server's queue. On the saturated
/// real cluster (realload, 3,000 DRA pods on 2 cores) its scheduling attempts took 12–14 s at
/// the median in some runs, well past a 5 s hold, and the pods ranked meanwhile saw those GPUs
/// free (786–793 GPUs instead of 764–769). The pod's next filter (a retry) or its deletion
/// gives the hold back sooner; so does the watched allocation.
const DRA_HOLD_FOR: Duration = Duration::from_secs(60);

/// The error filter answers when no node passed and one of them waits for kubelet to admit a
/// pod already bound there ([`Unfit::awaits_admission`]); `None` when none waits.
///
/// Why an error and not failed nodes: kube-scheduler puts a pod no node passed for in its
/// unschedulable set, and takes it out again only for a cluster event that one of the plugins
/// which rejected other nodes (NodeAffinity, NodeResourcesFit…) names, or after five minutes.
/// The pod that blocks this one starting is a status update of an assigned pod, which none of
/// them names: the pod would wait minutes for memory that frees in a second. A pod whose
/// scheduling failed with an error, by contrast, is retried after its backoff (1 s, doubling
/// to 10 s) whatever happens meanwhile (`determineSchedulingHintForInFlightPod` in upstream's
/// `pkg/scheduler/backend/queue/scheduling_queue.go`: no rejecting plugin, `queueAfterBackoff`).
fn awaiting_admission(
    settings: &Settings,
    candidates: &[Candidate<'_>],
    rejected: &[(usize, Unfit)],
) -> Option<String> {
    let mut waiting = rejected
        .iter()
        .filter(|(_, unfit)| unfit.awaits_admission());
    let (first, unfit) = waiting.next()?;
    let others = waiting.count();
    let node = &candidates[*first].0;
    let more = match others {
        0 => String::new(),
        1 => " (and 1 more node)".to_owned(),
        n => format!(" (and {n} more nodes)"),
    };
    Some(format!(
        "no node can take the pod until kubelet admits a pod bound before it; node {node}{more}: {}",
        unfit_reason(settings, node, unfit)
    ))
}

/// Writes why each `rejected` candidate fails into `result`'s failed or unresolvable nodes.
///
/// Formatting a reason per rejected node was the handler's largest cost of its own in the
/// load harness profile (busy clusters reject hundreds of nodes a call, most for the same
/// shortfall): the text of the last one is reused while it repeats.
fn write_reasons<'a>(
    settings: &Settings,
    candidates: &[Candidate<'a>],
    rejected: Vec<(usize, Unfit)>,
    result: &mut ExtenderFilterResult<'a>,
) {
    let mut last_reason: Option<(Unfit, String)> = None;
    for (i, unfit) in rejected {
        let name = &candidates[i].0;
        let reason = match &last_reason {
            // These two name the node; every other reason reads the same on each node with
            // the same shortfall.
            _ if matches!(unfit, Unfit::UnknownNode | Unfit::NotEligible) => {
                unfit_reason(settings, name, &unfit)
            }
            Some((seen, text)) if *seen == unfit => text.clone(),
            _ => {
                let text = unfit_reason(settings, name, &unfit);
                last_reason = Some((unfit.clone(), text.clone()));
                text
            }
        };
        let map = if unfit.is_unresolvable() {
            &mut result.failed_and_unresolvable_nodes
        } else {
            &mut result.failed_nodes
        };
        map.insert(name.clone(), reason);
    }
}

/// The node where the pod's memory is already booked by an earlier bind whose Binding is not
/// settled yet: a retry can only succeed there (and will, once it landed).
fn reserved_node<'v>(view: &'v View, args: &ExtenderArgs<'_>) -> Option<&'v str> {
    if view.reservation_count() == 0 {
        return None;
    }
    let uid = args.pod.as_ref()?.metadata.uid.as_deref()?;
    view.reservation(&PodId::from(uid))
        .map(|reservation| reservation.node.as_str())
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;
    use std::sync::Arc;

    use futures::future::BoxFuture;
    use gpushare_allocator::{PodPlacement, Policy};
    use gpushare_testkit::fixtures::{node, pod};
    use prometheus_client::registry::Registry;

    use super::*;
    use crate::scheduling::bind::BindTiming;
    use crate::scheduling::ports::{BindError, Binder, BindingTarget, EventSink, PodOnServer};

    /// Filter never binds.
    struct NoBinds;

    impl Binder for NoBinds {
        fn bind(&self, _: BindingTarget) -> BoxFuture<'_, Result<(), BindError>> {
            unreachable!("filter does not bind")
        }

        fn read_pod<'a>(
            &'a self,
            _: &'a str,
            _: &'a str,
        ) -> BoxFuture<'a, Result<Option<PodOnServer>, BindError>> {
            unreachable!("filter reads no pod")
        }
    }

    /// Node n1 with two 16 GiB GPUs, 10 GiB booked on each, as the served registry shows it.
    fn split_node() -> Scheduling {
        let state = Scheduling::new(
            Settings::new(
                gpushare_contract::DEFAULT_RESOURCE,
                gpushare_contract::DEFAULT_DOMAIN,
                "gpushare=true",
            ),
            crate::scheduling::Ranking::by(Policy::Binpack),
            Arc::new(NoBinds),
            BindTiming::default(),
            EventSink::disabled(),
            Registry::default(),
        );
        let mut view = state.view_mut();
        view.replace_nodes(&[node("n1").gpushare().gpus(&[16, 16]).build()]);
        view.set_pods_synced();
        for index in 0..2u32 {
            let placement = PodPlacement {
                gpu: index,
                uuid: format!("GPU-n1-{index}").into(),
                pod_gib: 10,
                assigned: true,
                ..PodPlacement::default()
            };
            view.cluster
                .upsert_pod(format!("running-{index}").as_str().into(), "n1", placement);
        }
        drop(view);
        state
    }

    /// Filters a pod of `gib` GiB over n1: the nodes passed, and those failed.
    fn filter(state: &Scheduling, gib: u64) -> (Vec<String>, Vec<String>) {
        let mut pod = pod("p").gpu_mem(gib).build();
        pod.metadata.uid = Some(format!("uid-{gib}"));
        let args = ExtenderArgs {
            pod: Some(pod),
            nodes: None,
            node_names: Some(vec![Cow::Borrowed("n1")]),
        };
        let result = state.filter(&args);
        let passed = result.node_names.into_iter().flatten();
        let failed = result.failed_nodes.iter();
        (
            passed.map(Cow::into_owned).collect(),
            failed.map(|(node, _)| node.to_owned()).collect(),
        )
    }

    fn scrape(state: &Scheduling) -> String {
        state.metrics_exposition().unwrap().collect()
    }

    fn has(text: &str, line: &str) -> bool {
        text.lines().any(|l| l == line)
    }

    /// The demand mix's shares are read at the scrape: a GPU pod pinned to a model no node
    /// has waits without any filter call ranking it, and still moves the pinned share (and
    /// with it the idle-GPU taint).
    #[test]
    fn the_demand_gauges_follow_pods_no_filter_call_sees() {
        let state = split_node();
        let share = |text: &str| {
            let value = text
                .lines()
                .find_map(|l| l.strip_prefix("gpushare_extender_pinned_demand_share "));
            value.and_then(|v| v.parse::<f64>().ok())
        };
        assert_eq!(share(&scrape(&state)), Some(0.0));
        let label = state.view().settings().keys.gpu_model_label("Missing");
        let mut pinned = pod("pinned").gpu_mem(4).build();
        pinned.metadata.uid = Some("uid-pinned".to_owned());
        pinned.spec.as_mut().unwrap().node_selector = Some([(label, "true".to_owned())].into());
        state.view_mut().apply_pod(&pinned);
        assert_eq!(share(&scrape(&state)), Some(1.0));
    }

    #[test]
    fn a_gpu_pod_no_node_takes_is_counted_by_why_from_zero() {
        let state = split_node();
        let text = scrape(&state);
        for reason in ["fragmentation", "no_capacity"] {
            let line = format!("gpushare_extender_unschedulable_total{{reason=\"{reason}\"}} 0");
            assert!(has(&text, &line), "{line} missing from\n{text}");
        }

        // 6 + 6 GiB free: 8 fits on neither GPU; 14 is more than is free at all.
        assert_eq!(filter(&state, 8), (vec![], vec!["n1".to_owned()]));
        filter(&state, 14);
        filter(&state, 14);
        // A pod that fits is not counted.
        assert_eq!(filter(&state, 4).0, ["n1"]);
        let text = scrape(&state);
        for line in [
            "gpushare_extender_unschedulable_total{reason=\"fragmentation\"} 1",
            "gpushare_extender_unschedulable_total{reason=\"no_capacity\"} 2",
        ] {
            assert!(has(&text, line), "{line} missing from\n{text}");
        }
    }

    #[test]
    fn the_served_registry_has_each_gpu_of_the_view() {
        let state = split_node();
        let text = scrape(&state);
        for line in [
            "gpushare_gpu_capacity_bytes{node=\"n1\",gpu=\"1\",uuid=\"GPU-n1-1\",model=\"Simulated GPU\"} 17179869184",
            "gpushare_gpu_allocated_bytes{node=\"n1\",gpu=\"1\",uuid=\"GPU-n1-1\",model=\"Simulated GPU\"} 10737418240",
        ] {
            assert!(has(&text, line), "{line} missing from\n{text}");
        }
        // The 4 GiB pod's hold (one node passed) counts at once.
        filter(&state, 4);
        let text = scrape(&state);
        let line = "gpushare_gpu_allocated_bytes{node=\"n1\",gpu=\"0\",uuid=\"GPU-n1-0\",model=\"Simulated GPU\"} 15032385536";
        assert!(has(&text, line), "{line} missing from\n{text}");
    }
}
