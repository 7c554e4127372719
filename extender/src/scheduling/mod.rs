//! The extender's domain: what it knows of the cluster and what it decides, asked directly.
//!
//! [`Scheduling`] owns the view (nodes, GPUs, bookings, holds, reservations), the GPU choice
//! policy, the bind path (decision, write, resolution: [`bind`]), leadership (whether this
//! replica may write) and the metrics. Each of kube-scheduler's verbs is a method here,
//! taking the protocol's arguments and returning its answer: [`Scheduling::filter`] (which
//! nodes pass, and the hold for a single one), [`Scheduling::prioritize`] (scores, and the
//! hold for a sole best), [`Scheduling::preempt`] (which pods to evict so a preemptor gets
//! room on one GPU) and [`Scheduling::bind`].
//!
//! Why apart from the HTTP layer: the handlers in [`crate::http`] only decode, call one method
//! and encode, so everything the extender decides can be asked (and tested) without a
//! server, and the watches and the idle-GPU taint pass, which change or read the same state,
//! depend on this module rather than on the web framework's.

use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use gpushare_allocator::Policy;
use prometheus_client::registry::Registry;

use crate::leader::Leadership;
use crate::metrics::Metrics;
use crate::scheduling::ports::{Binder, EventSink};
use crate::scheduling::view::reservations::Phase;
use crate::scheduling::view::{Settings, View};
use crate::wire::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderFilterResult, ExtenderPreemptionArgs,
    ExtenderPreemptionResult,
};
use bind::BindTiming;
use bind::slots::{Pacing, WriteSlots};

mod args;
pub mod bind;
mod filter;
pub mod gauges;
pub mod keep_best;
pub mod ports;
mod preempt;
mod prioritize;
mod unschedulable;
pub mod view;

pub use bind::BindRefusal;
pub use prioritize::Scores;
pub use unschedulable::Unschedulable;

/// The extender's state and decisions, shared by the HTTP handlers, the watches and the
/// background passes (cheap to clone).
#[derive(Clone)]
pub struct Scheduling {
    inner: Arc<Inner>,
}

struct Inner {
    /// Read by the per-GPU gauges on each scrape ([`gauges::exposition`]).
    view: RwLock<View>,
    ranking: Ranking,
    binder: Arc<dyn Binder>,
    bind_timing: BindTiming,
    /// Slots for Binding writes in flight (`None`: no limit); see [`bind`].
    bind_slots: Option<Arc<WriteSlots>>,
    /// How filter paces kube-scheduler's cycle on the binds waiting for a slot.
    pacing: Pacing,
    events: EventSink,
    metrics: Metrics,
    registry: Registry,
    leadership: Leadership,
}

/// How nodes and GPUs are ranked: fixed for the life of the process (the flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ranking {
    /// The GPU choice policy (`--policy`).
    pub policy: Policy,
    /// Filter passes only the `n` fitting nodes the policy scores best; 0 passes every one
    /// (`--filter-keep-best`).
    pub filter_keep_best: usize,
    /// The weight kube-scheduler's extender stanza gives our prioritize scores: the filter
    /// that keeps the best nodes ranks with it as kube-scheduler would
    /// (`--prioritize-weight`).
    pub prioritize_weight: i64,
}

impl Ranking {
    /// `policy`, every fitting node passed, scores weighted 1.
    pub fn by(policy: Policy) -> Self {
        Self {
            policy,
            filter_keep_best: 0,
            prioritize_weight: 1,
        }
    }

    /// As it is, passing only the `n` best fitting nodes.
    pub fn keeping_best(self, n: usize) -> Self {
        Self {
            filter_keep_best: n,
            ..self
        }
    }
}

impl Scheduling {
    /// State over an empty, unsynced view; metrics are registered in `registry`.
    pub fn new(
        settings: Settings,
        ranking: Ranking,
        binder: Arc<dyn Binder>,
        bind_timing: BindTiming,
        events: EventSink,
        mut registry: Registry,
    ) -> Self {
        let metrics = Metrics::register(&mut registry);
        for why in Unschedulable::ALL {
            metrics.count_unschedulable_from_zero(why.label());
        }
        // Without an election this instance always binds; `serve` switches it to elected.
        metrics.leader.set(1);
        let view = RwLock::new(View::new(settings));
        Self {
            inner: Arc::new(Inner {
                view,
                ranking,
                binder,
                bind_timing,
                bind_slots: (bind_timing.writes_in_flight > 0)
                    .then(|| Arc::new(WriteSlots::new(bind_timing.writes_in_flight))),
                pacing: Pacing {
                    max_wait: bind_timing.pace_max,
                },
                events,
                metrics,
                registry,
                leadership: Leadership::default(),
            }),
        }
    }

    /// Reads the view. A poisoned lock is recovered: the view holds no invariant a panic
    /// half-way through a handler could break worse than losing the process would.
    pub fn view(&self) -> RwLockReadGuard<'_, View> {
        self.inner.view.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the view (the watches, and tests building a state directly).
    pub fn view_mut(&self) -> RwLockWriteGuard<'_, View> {
        self.inner.view.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// `/metrics` in pieces: the registry's families and the per-GPU gauges, written as the
    /// caller takes them ([`gauges::exposition`]). The demand mix's shares are read from the
    /// view now: pods that no filter call sees (pinned to a model no node has, say) still move
    /// them, and the idle-GPU taint with them.
    pub fn metrics_exposition(
        &self,
    ) -> Result<impl Iterator<Item = String> + Send + 'static, std::fmt::Error> {
        {
            let view = self.view();
            let demand = view.cluster.demand();
            let metrics = self.metrics();
            metrics.multi_gpu_demand_share.set(demand.multi_gpu_share());
            metrics.pinned_demand_share.set(demand.pinned_share());
        }
        gauges::exposition(&self.inner.registry, &self.inner.view)
    }

    /// The event queue (the watch warns pods' owners through it too).
    pub(crate) fn events(&self) -> &EventSink {
        &self.inner.events
    }

    /// The GPU choice policy.
    fn policy(&self) -> Policy {
        self.inner.ranking.policy
    }

    /// What writes Bindings and reads pods.
    fn binder(&self) -> &dyn Binder {
        &*self.inner.binder
    }

    /// The bind path's timeouts.
    pub fn bind_timing(&self) -> BindTiming {
        self.inner.bind_timing
    }

    /// The slots Binding writes take, when their number is limited.
    pub fn bind_slots(&self) -> Option<&Arc<WriteSlots>> {
        self.inner.bind_slots.as_ref()
    }

    /// Waits while the binds queued for a write slot are as many as the slots (see
    /// [`bind::slots`]); counts the wait.
    pub async fn pace(&self) {
        let Some(slots) = self.bind_slots() else {
            return;
        };
        let waited = slots.pace(self.inner.pacing).await;
        if !waited.is_zero() {
            self.metrics().paced(waited);
        }
    }

    /// Whether this replica may bind now (see [`crate::leader`]).
    pub fn leadership(&self) -> &Leadership {
        &self.inner.leadership
    }

    /// Sets the reservation gauges from `view`.
    pub(crate) fn update_reservation_gauges(&self, view: &View) {
        let gauge = |count: usize| i64::try_from(count).unwrap_or(i64::MAX);
        let metrics = &self.inner.metrics;
        metrics.reservations.set(gauge(view.reservation_count()));
        metrics
            .reservations_resolving
            .set(gauge(view.reservations_in(Phase::Resolving)));
        metrics
            .reservations_held
            .set(gauge(view.reservations_in(Phase::Held)));
        metrics.set_nominations(view.nominations());
    }

    /// kube-scheduler's filter: which of `args`'s candidates can take the pod's request on one
    /// GPU, and why each other one cannot; a single node that passes is held for the bind.
    pub fn filter<'a>(&self, args: &'a ExtenderArgs<'a>) -> ExtenderFilterResult<'a> {
        filter::filter_answer(self, args)
    }

    /// kube-scheduler's prioritize: the policy's score of the candidates it prefers (the
    /// others count as 0); the one scored above all others is held for the bind.
    pub fn prioritize<'a>(&self, args: &'a ExtenderArgs<'a>) -> Scores<'a> {
        prioritize::prioritize_answer(self, args)
    }

    /// kube-scheduler's preempt: which pods to evict on each candidate so the preemptor gets
    /// room on one GPU, or which candidates to drop.
    pub fn preempt(&self, args: &ExtenderPreemptionArgs) -> ExtenderPreemptionResult {
        preempt::preempt_answer(self, args)
    }

    /// kube-scheduler's bind: picks the GPU, books it and writes the Binding when this
    /// replica may bind; otherwise says who leads ([`BindRefusal::Follower`], which the HTTP
    /// adapter passes on) or why it cannot now.
    pub async fn bind(&self, args: &ExtenderBindingArgs) -> Result<(), BindRefusal> {
        bind::bind_here(self, args).await
    }
}
