//! `bind`: decide under the view lock, book the memory, then write the Binding from a task of
//! its own that drives the reservation to an end (see [`crate::scheduling::view::reservations`]).
//!
//! The decision (may the pod be bound there, which GPU, the reservation and the Binding's
//! annotations) is in `decision.rs`; this file drives the write and settles its reservation.
//!
//! Why a task of its own: kube-scheduler gives every call `httpTimeout` and then closes the
//! connection, and hyper drops the handler with it. Whatever ran inside the handler stops
//! there. The write and the resolution of an ambiguous write therefore run in a spawned task
//! that neither knows nor cares whether anyone still waits for the answer; the handler only
//! relays the first result it gets.
//!
//! Every API call on this path has a client timeout ([`BindTiming::timeout`]), shorter than
//! the scheduler's `httpTimeout`, so a slow API server turns into an answer the scheduler
//! still reads ("no answer yet, retry") rather than a dropped connection.
//!
//! Why a limit on writes in flight ([`BindTiming::writes_in_flight`]): kube-scheduler calls
//! bind from a goroutine per pod, so in a burst it hands us Bindings faster than a busy API
//! server commits them. Unlimited, every one of them is in flight at once, each on a
//! connection of its own (kube's client speaks HTTP/1.1), and the API server commits no more
//! per second for it, only answers each later. With a limit, a decided bind waits for a slot
//! (its memory already booked, so filters see it) and gets its write budget from that moment;
//! one that waits longer than [`BindTiming::slot_wait`] is refused, nothing written, and
//! kube-scheduler retries it. Measured on the real cluster (3,000 pods on 1,000 nodes, 2
//! cores; docs/performance.md): 64 slots drained as fast as no limit, with the slowest
//! scheduling attempts twice as quick (p99 1.0 s against 2.0 s) and half the extender's peak
//! memory; 32 throttled the drain.

use std::future::Future;
use std::time::Duration;

use gpushare_allocator::PodId;
use tokio::sync::oneshot;

use super::Scheduling;
use crate::leader::Gate;
use crate::metrics::BindStage;
use crate::scheduling::ports::{BindError, BindingTarget, PodEvent, PodOnServer};
use crate::scheduling::view::reservations::{Outcome, Phase, Settled, Ticket};
use crate::wire::ExtenderBindingArgs;
pub use decision::Refused;
use decision::{Decision, decide};

/// How long the bind path waits on the API server, and how it retries a resolution.
#[derive(Debug, Clone, Copy)]
pub struct BindTiming {
    /// Bound on each API call of the bind path (the Binding, a read, a re-post). Keep it
    /// below kube-scheduler's `httpTimeout` so the first answer reaches the scheduler.
    pub timeout: Duration,
    /// First pause between two attempts to resolve an ambiguous write.
    pub backoff_initial: Duration,
    /// Longest pause between two attempts.
    pub backoff_max: Duration,
    /// Binding writes this replica has in flight at most (0: no limit); the others wait for a
    /// slot ("Why a limit on writes in flight" in the module docs).
    pub writes_in_flight: usize,
    /// How long a decided bind may wait for a write slot before it is refused (retryably,
    /// its memory released, nothing written).
    pub slot_wait: Duration,
    /// Longest a filter call waits while as many binds wait for a slot as there are slots
    /// (zero: never); see [`slots`].
    pub pace_max: Duration,
}

impl Default for BindTiming {
    fn default() -> Self {
        Self {
            timeout: Duration::from_millis(2500),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(2),
            writes_in_flight: 64,
            slot_wait: Duration::from_millis(2000),
            pace_max: Duration::from_millis(1000),
        }
    }
}

/// A Binding to write for a booked reservation.
#[derive(Debug, Clone)]
struct Write {
    uid: PodId,
    ticket: Ticket,
    target: BindingTarget,
    gpu: u32,
    uuid: String,
    gib: u64,
    /// The leadership term it was decided in.
    term: u64,
}

impl Write {
    fn pod_key(&self) -> String {
        format!("{}/{}", self.target.namespace, self.target.name)
    }
}

/// Why a bind was not done here: kube-scheduler reports the text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BindRefusal {
    /// Another replica leads, at `url`: the HTTP adapter may pass the bind on to it. Not
    /// counted here: the adapter counts what it did with it.
    #[error("this extender replica does not lead ({leader} does); retry")]
    Follower {
        /// The leader's base URL.
        url: String,
        /// Its pod name.
        leader: String,
    },
    /// Refused or failed, counted under its reason; the text kube-scheduler reports.
    #[error("{0}")]
    Refused(String),
}

/// Binds `args`'s pod when this replica may (see [`crate::leader`]); otherwise says who
/// leads or why it cannot now.
pub(super) async fn bind_here(
    state: &Scheduling,
    args: &ExtenderBindingArgs,
) -> Result<(), BindRefusal> {
    let now = tokio::time::Instant::now();
    match state.leadership().gate(now, state.bind_timing().timeout) {
        Gate::Bind { budget, term } => bind_pod(state, args, now + budget, term)
            .await
            .map_err(BindRefusal::Refused),
        Gate::Forward { url, leader } => Err(BindRefusal::Follower { url, leader }),
        Gate::Refuse { reason, message } => {
            state.metrics().bind(reason);
            tracing::debug!(pod = %format_args!("{}/{}", args.pod_namespace, args.pod_name), %message, "bind not taken");
            Err(BindRefusal::Refused(message))
        }
    }
}

/// Binds a pod in leadership term `term`; the Binding write ends by `deadline` (within the
/// lease, see [`crate::leader`]); the error is the text kube-scheduler reports.
pub async fn bind_pod(
    state: &Scheduling,
    args: &ExtenderBindingArgs,
    deadline: tokio::time::Instant,
    term: u64,
) -> Result<(), String> {
    let pod_key = format!("{}/{}", args.pod_namespace, args.pod_name);
    let started = tokio::time::Instant::now();
    let decision = {
        let mut view = state.view_mut();
        let decision = decide(&mut view, state.policy(), args, &pod_key).map(|d| match d {
            Decision::Write(write) => Decision::Write(Write { term, ..write }),
            other => other,
        });
        state.update_reservation_gauges(&view);
        decision
    };
    let decided = tokio::time::Instant::now();
    state
        .metrics()
        .bind_stage(BindStage::Decide, decided - started);
    let write = match decision {
        Ok(Decision::AlreadyBound) => {
            state.metrics().bind("already_bound");
            return Ok(());
        }
        Ok(Decision::Write(write)) => write,
        Err(Refused { reason, message }) => {
            refused(
                state,
                &args.pod_namespace,
                &args.pod_name,
                &args.pod_uid,
                reason,
                &message,
            );
            return Err(message);
        }
    };
    let (answer_tx, answer_rx) = oneshot::channel();
    tokio::spawn(drive(state.clone(), write, deadline, answer_tx));
    let answer = answer_rx.await;
    state
        .metrics()
        .bind_stage(BindStage::Answer, decided.elapsed());
    match answer {
        Ok(answer) => answer,
        // The task ended without an answer: it panicked. Its reservation stays booked (safe);
        // the next relist or the pod's deletion ends it.
        Err(_) => Err(format!(
            "binding pod {pod_key} to node {} stopped without an answer; retry",
            args.node
        )),
    }
}

/// Refusals that settle by themselves when kube-scheduler retries (start-up, a write still
/// in flight, a race with another bind for the same memory): no Event of ours. kube-scheduler
/// records `FailedScheduling` with our message on every refused bind anyway, so an Event here
/// would be a second API write per retry for nothing a person must do.
const TRANSIENT_REFUSALS: &[&str] = &[
    "not_synced",
    "starting",
    "in_progress",
    "unfit",
    "slow_api",
    "unresolved",
];

/// Logs and counts a refused bind, and records an Event for one a person should look at.
fn refused(
    state: &Scheduling,
    namespace: &str,
    name: &str,
    uid: &str,
    reason: &'static str,
    message: &str,
) {
    state.metrics().bind(reason);
    tracing::info!(pod = %format_args!("{namespace}/{name}"), %message, "bind refused");
    if TRANSIENT_REFUSALS.contains(&reason) {
        return;
    }
    state.events().send(PodEvent {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        uid: uid.to_owned(),
        warning: true,
        reason: "GpuBindRefused",
        note: message.to_owned(),
    });
}

/// Runs `call` until `deadline`: a Binding write must end within the lease.
async fn timed_until<T>(
    deadline: tokio::time::Instant,
    call: impl Future<Output = Result<T, BindError>>,
) -> Result<T, BindError> {
    let budget = deadline.saturating_duration_since(tokio::time::Instant::now());
    tokio::time::timeout_at(deadline, call)
        .await
        .unwrap_or(Err(BindError::Timeout(budget)))
}

/// Runs `call` with the bind path's client timeout.
async fn timed<T>(
    timeout: Duration,
    call: impl Future<Output = Result<T, BindError>>,
) -> Result<T, BindError> {
    tokio::time::timeout(timeout, call)
        .await
        .unwrap_or(Err(BindError::Timeout(timeout)))
}

/// Settles the write's reservation, keeping the gauges current.
fn settle(state: &Scheduling, write: &Write, outcome: Outcome) -> Settled {
    let mut view = state.view_mut();
    let settled = view.settle_reservation(&write.uid, write.ticket, outcome);
    state.update_reservation_gauges(&view);
    settled
}

/// Writes the Binding and drives its reservation to an end; sends the first answer for
/// kube-scheduler to `answer` (nobody may be listening any more).
async fn drive(
    state: Scheduling,
    write: Write,
    deadline: tokio::time::Instant,
    answer: oneshot::Sender<Result<(), String>>,
) {
    let pod_key = write.pod_key();
    let node = write.target.node.clone();
    let waiting = tokio::time::Instant::now();
    let granted = write_slot(&state, &write, deadline).await;
    let writing = tokio::time::Instant::now();
    state
        .metrics()
        .bind_stage(BindStage::WriteSlot, writing - waiting);
    let (slot, deadline) = match granted {
        Ok(granted) => granted,
        Err(Refused { reason, message }) => {
            settle(&state, &write, Outcome::NotLanded);
            refused_write(&state, &write, reason, &message);
            let _ = answer.send(Err(message));
            return;
        }
    };
    let under_way = state.leadership().write_started(deadline);
    let first = timed_until(deadline, state.binder().bind(write.target.clone())).await;
    state
        .metrics()
        .bind_stage(BindStage::BindingWrite, writing.elapsed());
    drop(under_way);
    drop(slot);
    let outcome = match &first {
        Ok(()) => Outcome::Landed,
        Err(error) => error.outcome(),
    };
    let reply = match (settle(&state, &write, outcome), first) {
        (Settled::Written, _) => {
            bound(&state, &write);
            Ok(())
        }
        // The watch saw the pod bound before our answer came back.
        (Settled::Stale, Ok(())) => {
            state.metrics().bind("bound");
            Ok(())
        }
        (Settled::Stale, Err(error)) => Err(format!(
            "binding pod {pod_key} to node {node} failed and the pod changed meanwhile: {error}"
        )),
        (Settled::Released, Err(error)) => {
            let message = format!(
                "binding pod {pod_key} to node {node} failed, GPU {} released: {error}",
                write.gpu
            );
            refused_write(&state, &write, "api_error", &message);
            Err(message)
        }
        (Settled::Resolving, Err(error)) => {
            let message = format!(
                "binding pod {pod_key} to node {node} got no clear answer ({error}); GPU {} stays booked until a read of the pod shows whether it landed; retry shortly",
                write.gpu
            );
            refused_write(&state, &write, "unresolved", &message);
            let _ = answer.send(Err(message));
            resolve(&state, &write).await;
            return;
        }
        // Landed never releases nor leaves the write unresolved.
        (Settled::Released | Settled::Resolving, Ok(())) => Ok(()),
    };
    let _ = answer.send(reply);
}

/// Waits for a slot to write `write`'s Binding in ([`BindTiming::writes_in_flight`]); returns
/// it with the deadline the write must end by. After a wait the leadership is asked again: the
/// lease may have moved on meanwhile, and the write's budget counts from now.
async fn write_slot(
    state: &Scheduling,
    write: &Write,
    deadline: tokio::time::Instant,
) -> Result<(Option<slots::WriteSlot>, tokio::time::Instant), Refused> {
    let Some(slots) = state.bind_slots() else {
        return Ok((None, deadline));
    };
    if let Some(slot) = slots.try_take() {
        return Ok((Some(slot), deadline));
    }
    let timing = state.bind_timing();
    let waited = tokio::time::Instant::now();
    let Some(slot) = slots.take(timing.slot_wait).await else {
        return Err(Refused::new(
            "slow_api",
            format!(
                "the API server is slow: {} Bindings of this extender are in flight and this one waited {} ms for its turn; GPU {} released, retry",
                timing.writes_in_flight,
                timing.slot_wait.as_millis(),
                write.gpu
            ),
        ));
    };
    let now = tokio::time::Instant::now();
    match state.leadership().gate(now, timing.timeout) {
        Gate::Bind { budget, term } if term == write.term => Ok((Some(slot), now + budget)),
        Gate::Refuse { reason, message } => Err(Refused { reason, message }),
        _ => Err(Refused::new(
            "not_leader",
            format!(
                "this extender replica stopped leading while the bind waited {} ms for its turn; retry",
                (now - waited).as_millis()
            ),
        )),
    }
}

/// Counts and logs a landed Binding. No Event: the pod's annotations, kube-scheduler's own
/// `Scheduled` event, `inspect` and `kubectl gpushare top` tell that story, and an Event per
/// bind would double the API writes of every scheduled pod. Refusals do get Events.
fn bound(state: &Scheduling, write: &Write) {
    state.metrics().bind("bound");
    tracing::info!(pod = %write.pod_key(), node = %write.target.node, gpu = write.gpu, uuid = %write.uuid, gib = write.gib, "bound");
}

fn refused_write(state: &Scheduling, write: &Write, reason: &'static str, message: &str) {
    let target = &write.target;
    refused(
        state,
        &target.namespace,
        &target.name,
        &target.uid,
        reason,
        message,
    );
}

/// Resolves an ambiguous write: reads the pod until it shows where it stands, re-posting the
/// same Binding while it is unbound (a first write still on its way makes the re-post fail
/// with a conflict; the next read then sees it). Ends when the reservation is settled, or
/// when the watch, a relist or a deletion ended it first.
async fn resolve(state: &Scheduling, write: &Write) {
    let timing = state.bind_timing();
    let mut pause = timing.backoff_initial;
    loop {
        if !state
            .view()
            .reservation_is(&write.uid, write.ticket, Phase::Resolving)
        {
            state.metrics().resolution("ended_by_watch");
            return;
        }
        if let Some(outcome) = resolve_once(state, write, timing.timeout).await {
            match settle(state, write, outcome) {
                Settled::Written => {
                    state.metrics().resolution("landed");
                    bound(state, write);
                }
                Settled::Released => {
                    state.metrics().resolution("released");
                    tracing::info!(pod = %write.pod_key(), node = %write.target.node, gpu = write.gpu, "the Binding did not land; GPU memory released");
                }
                Settled::Stale => state.metrics().resolution("ended_by_watch"),
                Settled::Resolving => {}
            }
            if outcome != Outcome::Unknown {
                return;
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(timing.backoff_max);
    }
}

/// One step of [`resolve`]: what the API server says now, if it said anything.
async fn resolve_once(state: &Scheduling, write: &Write, timeout: Duration) -> Option<Outcome> {
    let target = &write.target;
    let read = timed(
        timeout,
        state.binder().read_pod(&target.namespace, &target.name),
    )
    .await;
    let pod = match read {
        Ok(pod) => pod,
        Err(error) => {
            tracing::debug!(pod = %write.pod_key(), %error, "cannot read the pod to resolve its Binding");
            return None;
        }
    };
    let now = tokio::time::Instant::now();
    let same_term = state.leadership().term(now) == Some(write.term);
    if let Some(verdict) = read_verdict(pod.as_ref(), target, same_term) {
        return Some(verdict);
    }
    // Re-post only while this replica leads, in the term it decided in, within its lease
    // (see `crate::leader`).
    let Gate::Bind { budget, .. } = state.leadership().gate(now, timeout) else {
        return None;
    };
    let deadline = now + budget;
    let _under_way = state.leadership().write_started(deadline);
    match timed_until(deadline, state.binder().bind(target.clone())).await {
        Ok(()) => Some(Outcome::Landed),
        Err(error) => {
            tracing::debug!(pod = %write.pod_key(), %error, "re-posting the Binding failed");
            Some(error.outcome())
        }
    }
}

/// What a read of the pod says about a Binding to `target`; `None` while the pod is still
/// unbound, when the Binding may yet land and is re-posted (a copy still on its way then
/// makes the re-post fail with a conflict, and the next read sees it).
///
/// Unless `same_term`: the replica no longer leads in the term it wrote in. Another leader
/// may have handed the memory out since, so the Binding must not be re-posted, and the
/// pod still unbound says it did not land: every write of ours had ended before another
/// replica could lead (`crate::leader`), and this one's resolution awaits each write before
/// reading. Released, so the pod is bound afresh.
pub(crate) fn read_verdict(
    pod: Option<&PodOnServer>,
    target: &BindingTarget,
    same_term: bool,
) -> Option<Outcome> {
    match pod {
        // Gone or recreated: no Binding of ours can land on it any more.
        None => Some(Outcome::NotLanded),
        Some(pod) if pod.uid != target.uid => Some(Outcome::NotLanded),
        Some(PodOnServer {
            node: Some(node), ..
        }) if *node == target.node => Some(Outcome::Landed),
        // Bound elsewhere: its own annotations say where its memory is.
        Some(PodOnServer { node: Some(_), .. }) => Some(Outcome::NotLanded),
        Some(PodOnServer { node: None, .. }) if !same_term => Some(Outcome::NotLanded),
        Some(PodOnServer { node: None, .. }) => None,
    }
}

mod decision;
#[cfg(test)]
mod lifecycle;
pub mod slots;
