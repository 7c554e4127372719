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
//! Why apart from the HTTP layer: the handlers in [`crate::api`] only decode, call one method
//! and encode, so everything the extender decides can be asked (and tested) without a
//! server, and the watches and the idle-GPU taint pass, which change or read the same state,
//! depend on this module rather than on the web framework's.

use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use gpushare_allocator::Policy;
use prometheus_client::registry::Registry;

use crate::kube_io::{Binder, EventSink};
use crate::leader::Leadership;
use crate::metrics::{GpuGauges, Metrics};
use crate::reservation::Phase;
use crate::view::{Settings, View};
use crate::wire::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderFilterResult, ExtenderPreemptionArgs,
    ExtenderPreemptionResult,
};
use bind::BindTiming;
use bind::slots::{Pacing, WriteSlots};

mod args;
pub mod bind;
mod filter;
mod preempt;
mod prioritize;
mod unschedulable;

pub use prioritize::Scores;
pub use unschedulable::Unschedulable;

/// The extender's state and decisions, shared by the HTTP handlers, the watches and the
/// background passes (cheap to clone).
#[derive(Clone)]
pub struct Scheduling {
    inner: Arc<Inner>,
}

struct Inner {
    /// Shared with the per-GPU gauges, which read it on each scrape
    /// ([`crate::metrics::GpuGauges`]).
    view: Arc<RwLock<View>>,
    policy: Policy,
    /// `--filter-keep-best`: 0 passes every fitting node.
    filter_keep_best: AtomicUsize,
    /// `--prioritize-weight`: what kube-scheduler multiplies our scores by.
    prioritize_weight: AtomicI64,
    binder: Arc<dyn Binder>,
    bind_timing: BindTiming,
    /// Slots for Binding writes in flight (`None`: no limit); see [`bind`].
    bind_slots: Option<Arc<WriteSlots>>,
    /// How filter paces kube-scheduler's cycle on the binds waiting for a slot.
    pacing: Pacing,
    events: EventSink,
    metrics: Metrics,
    registry: Arc<Registry>,
    leadership: Leadership,
    forwarder: RwLock<Option<crate::forward::Forwarder>>,
}

impl Scheduling {
    /// State over an empty, unsynced view; metrics are registered in `registry`.
    pub fn new(
        settings: Settings,
        policy: Policy,
        binder: Arc<dyn Binder>,
        bind_timing: BindTiming,
        events: EventSink,
        mut registry: Registry,
    ) -> Self {
        let metrics = Metrics::register(&mut registry);
        // Without an election this instance always binds; `serve` switches it to elected.
        metrics.leader.set(1);
        let view = Arc::new(RwLock::new(View::new(settings)));
        GpuGauges::register(&mut registry, view.clone());
        Self {
            inner: Arc::new(Inner {
                view,
                policy,
                filter_keep_best: AtomicUsize::new(0),
                prioritize_weight: AtomicI64::new(1),
                binder,
                bind_timing,
                bind_slots: (bind_timing.writes_in_flight > 0)
                    .then(|| Arc::new(WriteSlots::new(bind_timing.writes_in_flight))),
                pacing: Pacing {
                    max_wait: bind_timing.pace_max,
                },
                events,
                metrics,
                registry: Arc::new(registry),
                leadership: Leadership::default(),
                forwarder: RwLock::new(None),
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

    /// The registry the metrics are in, for `/metrics`.
    pub fn registry(&self) -> &Registry {
        &self.inner.registry
    }

    /// The event sink.
    pub fn events(&self) -> &EventSink {
        &self.inner.events
    }

    /// The GPU choice policy.
    pub fn policy(&self) -> Policy {
        self.inner.policy
    }

    /// Makes filter pass only the `n` fitting nodes the policy scores best (0: all of them;
    /// see `--filter-keep-best`).
    pub fn set_filter_keep_best(&self, n: usize) {
        self.inner.filter_keep_best.store(n, Ordering::Relaxed);
    }

    /// The weight kube-scheduler's extender stanza gives our prioritize scores: the filter
    /// that keeps the best nodes ranks with it as kube-scheduler would (see
    /// `--prioritize-weight`).
    pub fn set_prioritize_weight(&self, weight: i64) {
        self.inner
            .prioritize_weight
            .store(weight, Ordering::Relaxed);
    }

    /// What writes Bindings and reads pods.
    pub fn binder(&self) -> &dyn Binder {
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

    /// How a follower passes binds on to the leader, if it does.
    pub fn forwarder(&self) -> Option<crate::forward::Forwarder> {
        self.inner
            .forwarder
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Sets [`Scheduling::forwarder`].
    pub fn set_forwarder(&self, forwarder: crate::forward::Forwarder) {
        *self
            .inner
            .forwarder
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Some(forwarder);
    }

    /// Sets the reservation gauges from `view`.
    pub fn update_reservation_gauges(&self, view: &View) {
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

    /// kube-scheduler's bind: picks the GPU, books it and writes the Binding, or passes the
    /// bind on to the leader (`body` is what was received, forwarded as is; `forwarded`: it
    /// came from another replica, which is never passed on again). The error is the text
    /// kube-scheduler reports.
    pub async fn bind(
        &self,
        args: &ExtenderBindingArgs,
        body: &[u8],
        forwarded: bool,
    ) -> Result<(), String> {
        bind::bind_or_forward(self, args, body, forwarded).await
    }
}
