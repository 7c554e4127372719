//! The extender's Prometheus metrics, registered in a registry the caller passes in; the
//! per-GPU gauges read from the view at scrape time are the domain's
//! ([`exposition`](crate::scheduling::gauges::exposition)).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of a per-verb metric.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct VerbLabels {
    /// filter, prioritize, bind, inspect.
    pub verb: &'static str,
}

/// Labels of a bind outcome.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct BindLabels {
    /// bound, already_bound, not_synced, starting, pod_not_found, pod_recreated,
    /// no_request, unfit, conflict, in_progress, api_error, unresolved; with leader election
    /// also not_leader, no_leader, lease_stale, and forwarded / forward_failed for binds a
    /// follower passed on to the leader.
    pub reason: &'static str,
}

/// A stage of the bind path on the replica that binds, in the order a bind passes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BindStage {
    /// From the handler's start to the decision made: waiting for the view's lock (filters,
    /// the watches and other binds hold it) and deciding under it.
    Decide,
    /// Waiting for one of the Binding write slots (`--bind-writes-in-flight`).
    WriteSlot,
    /// The Binding write itself, as this replica's client sees it: the API server's
    /// admission and storage, and the client's own connection queue.
    BindingWrite,
    /// From the decision to the answer handed back to the HTTP handler (the two stages above,
    /// and settling the reservation under the view's lock).
    Answer,
}

impl BindStage {
    /// Every stage, in order.
    pub const ALL: [BindStage; 4] = [
        BindStage::Decide,
        BindStage::WriteSlot,
        BindStage::BindingWrite,
        BindStage::Answer,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            BindStage::Decide => "decide",
            BindStage::WriteSlot => "write_slot",
            BindStage::BindingWrite => "binding_write",
            BindStage::Answer => "answer",
        }
    }
}

/// Labels of a bind stage's duration.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct BindStageLabels {
    /// decide, write_slot, binding_write, answer ([`BindStage::label`]).
    pub stage: &'static str,
}

/// Every metric the extender exports.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// Requests by verb.
    pub requests: Family<VerbLabels, Counter>,
    /// Request handling time by verb, in seconds.
    pub latency: Family<VerbLabels, Histogram>,
    /// Bind outcomes by reason.
    pub binds: Family<BindLabels, Counter>,
    /// Seconds each stage of a bind this replica decides took ([`BindStage`]).
    pub bind_stages: Family<BindStageLabels, Histogram>,
    /// Reservations awaiting confirmation by the pod watch.
    pub reservations: Gauge,
    /// Reservations whose Binding got no clear answer and is being resolved.
    pub reservations_resolving: Gauge,
    /// Holds: memory filter or prioritize booked for a pod whose bind has not come yet.
    pub reservations_held: Gauge,
    /// How resolutions of ambiguous Binding writes ended.
    pub resolutions: Family<ResolutionLabels, Counter>,
    /// 1 while this replica leads (binds), else 0; 1 without leader election.
    pub leader: Gauge,
    /// How often this replica became leader (a failover, or the first acquisition).
    pub leader_acquisitions: Counter,
    /// filter calls that waited for the Binding write queue to shorten.
    pub paced: Counter,
    /// Seconds filter calls waited for it, in all.
    pub paced_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    /// filter calls that passed every fitting node although `--filter-keep-best` is on, by
    /// why (see [`crate::scheduling::keep_best::StepAside`]).
    pub keep_best_stepped_aside: Family<StepAsideLabels, Counter>,
    /// The share of recent GPU demand in multi-GPU pods, as the view holds it at the scrape
    /// (`gpushare_allocator::demand_mix`).
    pub multi_gpu_demand_share: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// The share of recent GPU demand in pods pinned to GPU models, as the view holds it at
    /// the scrape (`gpushare_allocator::demand_mix`).
    pub pinned_demand_share: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// Idle-GPU taint writes by outcome ([`crate::kube_io::idle_gpu_taint`]).
    pub idle_gpu_taint_writes: Family<TaintWriteLabels, Counter>,
    /// Nodes carrying the idle-GPU taint, as the leader's node watch last showed them.
    pub idle_gpu_tainted_nodes: Gauge,
    /// filter calls answered with an error so that kube-scheduler retries after its backoff:
    /// no node passed, and one waited for kubelet to admit a pod already bound there.
    pub filter_awaiting_admission: Counter,
    /// preempt answers by outcome ([`PreemptLabels`]).
    pub preempt_answers: Family<PreemptLabels, Counter>,
    /// Victims of preempt calls, as kube-scheduler proposed them and as answered.
    pub preempt_victims: Family<VictimLabels, Counter>,
    /// Candidate nodes a preempt answer dropped: no eviction of lower-priority pods there
    /// makes room on one GPU.
    pub preempt_nodes_dropped: Counter,
    /// Unbound pods nominated for a node by preemption, and how many have their memory held.
    pub nominations: Family<NominationLabels, Gauge>,
    /// Calls and handshakes the scheduler port refused, by why ([`RefusalReason`]).
    pub caller_refusals: Family<RefusalLabels, Counter>,
    /// Calls without a client certificate let through while `--accept-uncertified-until`
    /// lasts (`crate::http::callers`).
    pub uncertified_calls_in_grace: Counter,
    /// filter calls that left no node for a GPU pod, by why
    /// ([`Unschedulable`](crate::scheduling::Unschedulable)).
    pub unschedulable: Family<UnschedulableLabels, Counter>,
}

/// Labels of a filter call that left no node for a GPU pod.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct UnschedulableLabels {
    /// fragmentation, no_capacity
    /// ([`Unschedulable::label`](crate::scheduling::Unschedulable::label)).
    pub reason: &'static str,
}

/// Why the scheduler port refused a caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalReason {
    /// A call without a client certificate (403).
    NoClientCertificate,
    /// A handshake with a certificate not of the client CA.
    UntrustedCertificate,
}

/// Labels of a refused caller.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct RefusalLabels {
    /// no_client_certificate, untrusted_certificate.
    pub reason: &'static str,
}

/// Labels of a preempt answer.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct PreemptLabels {
    /// victims (some node kept), no_node (every candidate dropped), not_ours (the pod asks
    /// for no GPU memory: kube-scheduler's proposal passed through), unreadable (its request
    /// cannot be read), not_synced.
    pub outcome: &'static str,
}

/// Labels of a preempt call's victims.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct VictimLabels {
    /// proposed (by kube-scheduler, on every candidate node), answered (by the extender).
    pub by: &'static str,
}

/// Labels of the nomination gauge.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct NominationLabels {
    /// nominated (all), held (memory booked on the nominated node).
    pub state: &'static str,
}

/// Labels of an idle-GPU taint write.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct TaintWriteLabels {
    /// added, removed, unchanged (the node already was as wanted), retry (it changed
    /// between read and write, is gone, or the API server failed).
    pub outcome: &'static str,
}

/// Labels of a filter that did not narrow to the best node.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct StepAsideLabels {
    /// preferred_node_affinity, preferred_pod_affinity, soft_topology_spread,
    /// prefer_no_schedule_taint.
    pub reason: &'static str,
}

/// Labels of a resolution's end.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ResolutionLabels {
    /// landed, released, ended_by_watch.
    pub outcome: &'static str,
}

impl Metrics {
    /// Counts a refused caller.
    pub fn refuse_caller(&self, reason: RefusalReason) {
        let reason = match reason {
            RefusalReason::NoClientCertificate => "no_client_certificate",
            RefusalReason::UntrustedCertificate => "untrusted_certificate",
        };
        self.caller_refusals
            .get_or_create(&RefusalLabels { reason })
            .inc();
    }

    /// Creates the metrics and registers them under `gpushare_extender_` in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            requests: Family::default(),
            latency: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.000_025, 4.0, 10))
            }),
            binds: Family::default(),
            bind_stages: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.000_1, 2.0, 16))
            }),
            reservations: Gauge::default(),
            reservations_resolving: Gauge::default(),
            reservations_held: Gauge::default(),
            resolutions: Family::default(),
            leader: Gauge::default(),
            leader_acquisitions: Counter::default(),
            paced: Counter::default(),
            paced_seconds: Counter::default(),
            keep_best_stepped_aside: Family::default(),
            multi_gpu_demand_share: Gauge::default(),
            pinned_demand_share: Gauge::default(),
            idle_gpu_taint_writes: Family::default(),
            idle_gpu_tainted_nodes: Gauge::default(),
            filter_awaiting_admission: Counter::default(),
            preempt_answers: Family::default(),
            preempt_victims: Family::default(),
            preempt_nodes_dropped: Counter::default(),
            nominations: Family::default(),
            caller_refusals: Family::default(),
            uncertified_calls_in_grace: Counter::default(),
            unschedulable: Family::default(),
        };
        for stage in BindStage::ALL {
            drop(metrics.bind_stages.get_or_create(&BindStageLabels {
                stage: stage.label(),
            }));
        }
        let sub = registry.sub_registry_with_prefix("gpushare_extender");
        metrics.register_requests_and_binds(sub);
        metrics.register_filter_preempt_and_callers(sub);
        metrics
    }

    /// Registers the request, bind, reservation and leadership metrics.
    fn register_requests_and_binds(&self, sub: &mut Registry) {
        sub.register(
            "requests",
            "Extender requests by verb",
            self.requests.clone(),
        );
        sub.register(
            "request_duration_seconds",
            "Time to answer an extender request, by verb",
            self.latency.clone(),
        );
        sub.register("binds", "Bind outcomes by reason", self.binds.clone());
        sub.register(
            "bind_stage_duration_seconds",
            "Time each stage of a bind this replica decides took: decide (the view's lock and the decision), write_slot (waiting for a Binding write slot), binding_write (the Binding's API call), answer (from the decision to the answer)",
            self.bind_stages.clone(),
        );
        sub.register(
            "reservations",
            "GPU memory reservations made at bind and not yet seen in the pod watch",
            self.reservations.clone(),
        );
        sub.register(
            "reservations_resolving",
            "Reservations whose Binding got no clear answer and is being resolved by reading the pod",
            self.reservations_resolving.clone(),
        );
        sub.register(
            "reservations_held",
            "GPU memory held for pods between the filter or prioritize call that decided their node and their bind",
            self.reservations_held.clone(),
        );
        sub.register(
            "bind_resolutions",
            "How resolutions of ambiguous Binding writes ended",
            self.resolutions.clone(),
        );
        sub.register(
            "leader",
            "1 while this replica leads and binds (always 1 without leader election), else 0",
            self.leader.clone(),
        );
        sub.register(
            "leader_acquisitions",
            "How often this replica became the leader",
            self.leader_acquisitions.clone(),
        );
    }

    /// Registers what filter, the idle-GPU taint, preempt and the caller check count.
    fn register_filter_preempt_and_callers(&self, sub: &mut Registry) {
        sub.register(
            "filter_paced",
            "filter calls that waited because as many binds waited for a Binding write slot as there are slots",
            self.paced.clone(),
        );
        sub.register(
            "filter_paced_seconds",
            "Seconds filter calls waited for the Binding write queue to shorten, in all",
            self.paced_seconds.clone(),
        );
        sub.register(
            "filter_awaiting_admission",
            "filter calls answered with an error, so that kube-scheduler retries after its backoff: no node passed, and one waits for kubelet to admit a pod of the same size bound there",
            self.filter_awaiting_admission.clone(),
        );
        sub.register(
            "unschedulable",
            "filter calls that left no node for a GPU pod, by why: fragmentation (some node had the memory free on its GPUs in total, but not on one GPU, or not on as many as the pod wants), no_capacity (no node had it free at all)",
            self.unschedulable.clone(),
        );
        sub.register(
            "filter_keep_best_stepped_aside",
            "filter calls that passed every fitting node although filterKeepBest is on, because kube-scheduler's scores would weigh something the extender does not model",
            self.keep_best_stepped_aside.clone(),
        );
        sub.register(
            "multi_gpu_demand_share",
            format!("Share of the recent GPU demand in multi-GPU pods; from {} the filter that keeps the best ranks by our score alone, without kube-scheduler's CPU and memory scores", gpushare_allocator::demand_mix::MULTI_GPU_HEAVY),
            self.multi_gpu_demand_share.clone(),
        );
        sub.register(
            "pinned_demand_share",
            format!("Share of the recent GPU demand in pods pinned to GPU models (node selector or required node affinity on the gpu-model or gpu-mem node labels, or the models annotation); from {} the filter that keeps the best leaves LeastAllocated out of its ranking and the idle-GPU taint is lifted", gpushare_allocator::demand_mix::PINNED_HEAVY),
            self.pinned_demand_share.clone(),
        );
        sub.register(
            "idle_gpu_taint_writes",
            "Writes of the idle-GPU taint (PreferNoSchedule on nodes with a GPU nothing is booked on), by outcome",
            self.idle_gpu_taint_writes.clone(),
        );
        sub.register(
            "idle_gpu_tainted_nodes",
            "Nodes carrying the idle-GPU taint, as the leader's node watch last showed them (0 on a follower: only the leader reads it)",
            self.idle_gpu_tainted_nodes.clone(),
        );
        sub.register(
            "caller_refusals",
            "Callers the scheduler port refused: no_client_certificate (a verb called without the client certificate, answered 403), untrusted_certificate (a handshake with a certificate of another CA)",
            self.caller_refusals.clone(),
        );
        sub.register(
            "uncertified_calls_in_grace",
            "Calls without a client certificate let through while the upgrade grace (--accept-uncertified-until) lasts",
            self.uncertified_calls_in_grace.clone(),
        );
        sub.register(
            "preempt_answers",
            "preempt answers by outcome: victims (a node kept), no_node (no eviction of lower-priority pods makes room on one GPU anywhere), not_ours, unreadable, not_synced",
            self.preempt_answers.clone(),
        );
        sub.register(
            "preempt_victims",
            "Victims in preempt calls: proposed by kube-scheduler (by the node's total) and answered by the extender (per GPU)",
            self.preempt_victims.clone(),
        );
        sub.register(
            "preempt_nodes_dropped",
            "Candidate nodes a preempt answer dropped because no eviction there makes room on one GPU",
            self.preempt_nodes_dropped.clone(),
        );
        sub.register(
            "nominations",
            "Unbound pods nominated for a node by preemption (state=nominated), and those whose memory is held there (state=held)",
            self.nominations.clone(),
        );
    }

    /// Sets the nomination gauges from (nominated, held).
    pub fn set_nominations(&self, (nominated, held): (usize, usize)) {
        let gauge = |count: usize| i64::try_from(count).unwrap_or(i64::MAX);
        for (state, count) in [("nominated", nominated), ("held", held)] {
            self.nominations
                .get_or_create(&NominationLabels { state })
                .set(gauge(count));
        }
    }

    /// Counts a preempt answer.
    pub fn preempt_answer(&self, outcome: &'static str) {
        self.preempt_answers
            .get_or_create(&PreemptLabels { outcome })
            .inc();
    }

    /// Counts the victims kube-scheduler proposed and those answered.
    pub fn preempt_victims(&self, proposed: usize, answered: usize) {
        for (by, count) in [("proposed", proposed), ("answered", answered)] {
            self.preempt_victims
                .get_or_create(&VictimLabels { by })
                .inc_by(count as u64);
        }
    }

    /// Counts a filter that passed every fitting node for `reason` (the label of a
    /// `keep_best::StepAside`).
    pub fn keep_best_stepped_aside(&self, reason: &'static str) {
        self.keep_best_stepped_aside
            .get_or_create(&StepAsideLabels { reason })
            .inc();
    }

    /// Counts an idle-GPU taint write by `outcome` (the label of an `idle_gpu_taint::Outcome`).
    pub fn record_idle_gpu_taint(&self, outcome: &'static str) {
        self.idle_gpu_taint_writes
            .get_or_create(&TaintWriteLabels { outcome })
            .inc();
    }

    /// Starts the count of filter calls that left no node for a GPU pod for `reason` at 0,
    /// so that `increase()` sees the first one.
    pub fn count_unschedulable_from_zero(&self, reason: &'static str) {
        drop(
            self.unschedulable
                .get_or_create(&UnschedulableLabels { reason }),
        );
    }

    /// Counts a filter call that left no node for a GPU pod, for `reason`.
    pub fn unschedulable(&self, reason: &'static str) {
        self.unschedulable
            .get_or_create(&UnschedulableLabels { reason })
            .inc();
    }

    /// Counts a filter call that waited `waited` for the write queue.
    pub fn paced(&self, waited: std::time::Duration) {
        self.paced.inc();
        self.paced_seconds.inc_by(waited.as_secs_f64());
    }

    /// Counts the end of a resolution.
    pub fn resolution(&self, outcome: &'static str) {
        self.resolutions
            .get_or_create(&ResolutionLabels { outcome })
            .inc();
    }

    /// Counts a request and its duration.
    pub fn observe(&self, verb: &'static str, started: std::time::Instant) {
        let labels = VerbLabels { verb };
        self.requests.get_or_create(&labels).inc();
        self.latency
            .get_or_create(&labels)
            .observe(started.elapsed().as_secs_f64());
    }

    /// Records how long a stage of a bind took.
    pub fn bind_stage(&self, stage: BindStage, took: std::time::Duration) {
        self.bind_stages
            .get_or_create(&BindStageLabels {
                stage: stage.label(),
            })
            .observe(took.as_secs_f64());
    }

    /// Counts a bind outcome.
    pub fn bind(&self, reason: &'static str) {
        self.binds.get_or_create(&BindLabels { reason }).inc();
    }
}
