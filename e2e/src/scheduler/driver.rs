//! The moving parts: two watches feeding the state (`watches.rs`), one scheduling loop (one
//! pod at a time, as kube-scheduler's `scheduleOne`), and a bind task per placed pod so binds
//! overlap with the next cycles; what they all hold is `shared.rs`.
//!
//! No API call blocks a scheduling cycle (upstream's `SchedulerAsyncAPICalls`, on by default
//! since v1.34): Events and `PodScheduled` updates are sent by tasks of their own, at most one
//! update in flight per pod and only the latest one queued, so a slow or stalled API server
//! delays what users read, never the scheduling of other pods.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::future;
use k8s_openapi::api::core::v1::{
    Binding, Event, EventSource, Node, ObjectReference, Pod, PodCondition,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use tokio::sync::oneshot;
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, info, warn};

use super::SchedulerConfig;
use super::framework::{
    self, ExtenderPriorities, NodeScore, add_extender_priorities, fit_error_message,
    select_scored_host,
};
use super::shared::{EventKind, Shared};
use super::state::{Candidate, FailureKind, PodKey, Popped};
use super::watches::watch;
use super::wire::ExtenderBindingArgs;
use crate::locked;

/// How long `start` waits for the first list of Pods and Nodes.
const SYNC_TIMEOUT: Duration = Duration::from_secs(30);
/// Upstream truncates event notes to this many bytes.
const EVENT_MESSAGE_LIMIT: usize = 1024;
/// How long an event suppresses its repeats (client-go `tools/events`: an isomorphic event
/// within 6 minutes only increments the first one's series, written every 30 minutes).
const EVENT_SERIES_WINDOW: Duration = Duration::from_secs(6 * 60);

/// The Events kube-scheduler records: (type, reason, action).
const FAILED_SCHEDULING: EventKind = ("Warning", "FailedScheduling", "Scheduling");
const SCHEDULED: EventKind = ("Normal", "Scheduled", "Binding");

/// A pod assumed on a node, waiting for its bind.
struct BindJob {
    popped: Popped,
    host: String,
}

/// How a scheduling cycle ended without a node: the message, and whether it was an error or
/// no node fit (rejected by one of the scheduler's own plugins, or by extenders only).
type CycleFailure = (String, FailureKind);

fn error(message: impl Into<String>) -> CycleFailure {
    (message.into(), FailureKind::Error)
}

pub async fn start(
    client: kube::Client,
    config: SchedulerConfig,
) -> anyhow::Result<(Arc<Shared>, Vec<JoinHandle<()>>)> {
    let shared = Arc::new(Shared::new(client.clone(), config)?);

    let (pods_synced, pods_ready) = oneshot::channel();
    let (nodes_synced, nodes_ready) = oneshot::channel();
    let mut tasks = vec![
        tokio::spawn(watch::<Node>(
            shared.clone(),
            Api::all(client.clone()),
            nodes_synced,
        )),
        tokio::spawn(watch::<Pod>(shared.clone(), Api::all(client), pods_synced)),
    ];
    let synced = tokio::time::timeout(SYNC_TIMEOUT, async {
        nodes_ready
            .await
            .context("node watch ended before listing")?;
        pods_ready.await.context("pod watch ended before listing")
    })
    .await;
    let synced = synced.unwrap_or_else(|_| {
        anyhow::bail!("the API server did not list Pods and Nodes within {SYNC_TIMEOUT:?}")
    });
    if let Err(error) = synced {
        shared.cancel.cancel();
        for task in tasks {
            task.abort();
        }
        return Err(error.context("starting the scheduler driver"));
    }
    tasks.push(tokio::spawn(schedule_loop(shared.clone())));
    info!(scheduler = %shared.config.scheduler_name, extenders = shared.extenders.len(), "scheduler driver started");
    Ok((shared, tasks))
}

// ---- Scheduling loop ----

async fn schedule_loop(shared: Arc<Shared>) {
    let mut binds: JoinSet<()> = JoinSet::new();
    loop {
        while let Some(done) = binds.try_join_next() {
            if let Err(error) = done
                && error.is_panic()
            {
                tracing::error!(%error, "bind task panicked");
            }
        }
        let next = {
            let mut state = shared.state();
            state.flush(Instant::now());
            state.pop_active().ok_or_else(|| state.next_deadline())
        };
        match next {
            Ok(popped) => {
                let job = tokio::select! {
                    _ = shared.cancel.cancelled() => break,
                    job = schedule_one(&shared, popped) => job,
                };
                if let Some(job) = job {
                    binds.spawn(bind_job(shared.clone(), job));
                }
            }
            Err(deadline) => {
                let sleep = async {
                    match deadline {
                        Some(at) => tokio::time::sleep_until(at.into()).await,
                        None => future::pending().await,
                    }
                };
                tokio::select! {
                    _ = shared.cancel.cancelled() => break,
                    _ = shared.wake.notified() => {}
                    _ = sleep => {}
                }
            }
        }
    }
    binds.shutdown().await;
}

/// One scheduling cycle; returns the bind to start when the pod was assumed on a node.
async fn schedule_one(shared: &Arc<Shared>, popped: Popped) -> Option<BindJob> {
    let started = Instant::now();
    let outcome = find_host(shared, &popped.pod).await;
    {
        let mut stats = shared.stats.lock();
        stats.cycles += 1;
        stats.cycle_latencies.push(started.elapsed());
        match &outcome {
            Ok(_) => stats.assumed += 1,
            Err((_, FailureKind::Error)) => stats.scheduling_errors += 1,
            Err(_) => stats.unschedulable += 1,
        }
    }
    match outcome {
        Ok(host) => {
            debug!(pod = %popped.key, node = %host, "assumed pod on node");
            shared
                .state()
                .assume(&popped, &host)
                .then_some(BindJob { popped, host })
        }
        Err((message, kind)) => {
            fail(shared, &popped, kind, message);
            None
        }
    }
}

/// Filters, extenders, scoring: `schedulePod`. No PostFilter: preemption is proven on the
/// real cluster (`e2e/tests/real.rs`), not copied here.
async fn find_host(shared: &Shared, pod: &Pod) -> Result<String, CycleFailure> {
    let Some(filtered) = shared.state().filter(pod) else {
        return Err(error(framework::reasons::NO_NODES));
    };
    let num_all = filtered.num_all_nodes;
    let mut statuses = filtered.statuses;
    // Upstream's Diagnosis.UnschedulablePlugins: empty when only extenders rejected nodes.
    let kind = match statuses.is_empty() {
        true => FailureKind::UnschedulableByExtendersOnly,
        false => FailureKind::Unschedulable,
    };
    let feasible = match filtered.feasible.is_empty() {
        true => Vec::new(),
        false => pass_extenders(shared, pod, filtered.feasible, &mut statuses).await?,
    };
    if feasible.is_empty() {
        return Err((fit_error_message(num_all, statuses.values()), kind));
    }
    if let [only] = feasible.as_slice() {
        return Ok(only.name.clone());
    }
    prioritize(shared, pod, &feasible).await
}

/// `findNodesThatPassExtenders`: each extender with a filter verb that is interested in
/// `pod` narrows `feasible` in turn, its reasons added to `statuses`. An ignorable extender's
/// error is skipped; another's fails the cycle.
async fn pass_extenders(
    shared: &Shared,
    pod: &Pod,
    mut feasible: Vec<Candidate>,
    statuses: &mut BTreeMap<String, Vec<String>>,
) -> Result<Vec<Candidate>, CycleFailure> {
    for extender in &shared.extenders {
        if feasible.is_empty() {
            break;
        }
        let verb = extender.config.filter_verb.as_deref();
        let Some(verb) = verb.filter(|_| extender.is_interested(pod)) else {
            continue;
        };
        let nodes: Vec<_> = feasible.iter().map(|c| c.node.clone()).collect();
        let outcome = match extender.filter(verb, pod, &nodes).await {
            Ok(outcome) => outcome,
            Err(error) if extender.config.ignorable => {
                info!(extender = %extender.config.url_prefix, %error, "skipping extender as it returned error and has ignorable flag set");
                continue;
            }
            Err(failed) => return Err(error(failed.to_string())),
        };
        let unresolvable = &outcome.failed_and_unresolvable;
        let failed = outcome
            .failed
            .iter()
            .filter(|(node, _)| !unresolvable.contains_key(*node));
        for (node, reason) in unresolvable.iter().chain(failed) {
            statuses
                .entry(node.clone())
                .or_default()
                .push(reason.clone());
        }
        feasible = outcome
            .passed
            .iter()
            .filter_map(|&i| feasible.get(i).cloned())
            .collect();
    }
    Ok(feasible)
}

/// `prioritizeNodes`: default scores plus every interested extender's, concurrently, then
/// the best total (ties at random). An extender without a prioritize verb answers too
/// (score 0, weight 0), as upstream's HTTPExtender.Prioritize does, which matters for the
/// tie-breaker.
async fn prioritize(
    shared: &Shared,
    pod: &Pod,
    feasible: &[Candidate],
) -> Result<String, CycleFailure> {
    let nodes: Vec<_> = feasible.iter().map(|c| c.node.clone()).collect();
    let mut scores: Vec<NodeScore> = feasible
        .iter()
        .map(|c| NodeScore::new(c.name.clone(), c.score))
        .collect();
    let calls = shared
        .extenders
        .iter()
        .filter(|extender| extender.is_interested(pod))
        .map(|extender| {
            let (nodes, scores) = (&nodes, &scores);
            async move {
                let answer = match extender.config.prioritize_verb.as_deref() {
                    Some(verb) => extender
                        .prioritize(verb, pod, nodes)
                        .await
                        .map(|priorities| ExtenderPriorities {
                            priorities,
                            weight: extender.config.weight,
                        }),
                    None => Ok(ExtenderPriorities::without_verb(scores)),
                };
                (extender, answer)
            }
        });
    let mut answers = Vec::new();
    for (extender, result) in future::join_all(calls).await {
        match result {
            Ok(answer) => answers.push(answer),
            // Upstream: "Prioritization errors from extender can be ignored".
            Err(error) => {
                debug!(extender = %extender.config.url_prefix, %error, "extender prioritize failed; no score given by this extender");
            }
        }
    }
    add_extender_priorities(&mut scores, &answers, &mut *locked(&shared.rng));
    select_scored_host(&scores)
        .map(str::to_owned)
        .ok_or_else(|| error("empty priorityList"))
}

/// A failed attempt: requeue, then tell the user (Event + PodScheduled condition) without
/// waiting for the API server. A pod that is no longer pending (the watch showed it bound or
/// deleted; upstream's "Pod has been assigned to node. Abort adding it back to queue.") is
/// neither requeued nor reported.
fn fail(shared: &Arc<Shared>, popped: &Popped, kind: FailureKind, message: String) {
    let pod = shared
        .state()
        .record_failure(popped, kind, &message, Instant::now());
    shared.wake.notify_one();
    let Some(pod) = pod else { return };
    info!(pod = %popped.key, reason = %message, "unable to schedule pod");
    emit_event(shared, &pod, FAILED_SCHEDULING, &message);
    let reason = match kind {
        FailureKind::Unschedulable | FailureKind::UnschedulableByExtendersOnly => "Unschedulable",
        FailureKind::Error => "SchedulerError",
    };
    queue_pod_scheduled(shared, &popped.key, reason, message);
}

/// Queues a `PodScheduled=False` update for a pod, replacing one not sent yet, and starts the
/// pod's sender unless it runs already: updates of one pod are sent one at a time, in order,
/// and only the latest of those that piled up while one was in flight.
fn queue_pod_scheduled(shared: &Arc<Shared>, key: &PodKey, reason: &'static str, message: String) {
    {
        let mut updates = locked(&shared.status_updates);
        updates.queued.insert(key.clone(), (reason, message));
        if !updates.sending.insert(key.clone()) {
            return;
        }
    }
    let shared = shared.clone();
    let key = key.clone();
    tokio::spawn(async move {
        loop {
            let next = {
                let mut updates = locked(&shared.status_updates);
                let next = updates.queued.remove(&key);
                if next.is_none() {
                    updates.sending.remove(&key);
                }
                next
            };
            let Some((reason, message)) = next else {
                return;
            };
            // The pod as the watch has it now; none once it is bound or gone (a bind
            // supersedes a queued status update, as in upstream's API dispatcher).
            let Some(pod) = shared.state().waiting_pod(&key) else {
                continue;
            };
            tokio::select! {
                () = shared.cancel.cancelled() => return,
                () = update_pod_scheduled(&shared, &pod, reason, &message) => {}
            }
        }
    });
}

// ---- Binding ----

async fn bind_job(shared: Arc<Shared>, job: BindJob) {
    let Ok(_permit) = shared.binds.clone().acquire_owned().await else {
        return;
    };
    if !shared.config.binding_cycle_delay.is_zero() {
        tokio::time::sleep(shared.config.binding_cycle_delay).await;
    }
    shared.stats.bind_started();
    let started = Instant::now();
    let result = bind(&shared, &job.popped.pod, &job.host).await;
    shared
        .stats
        .bind_finished(started.elapsed(), result.is_ok());
    let BindJob { popped, host } = job;
    match result {
        Ok(()) => {
            shared.state().bound(&popped.key, &popped.uid);
            info!(pod = %popped.key, node = %host, "bound pod");
            // The key is `namespace/name`.
            let message = format!("Successfully assigned {} to {host}", popped.key);
            emit_event(&shared, &popped.pod, SCHEDULED, &message);
        }
        Err(message) => {
            warn!(pod = %popped.key, node = %host, error = %message, "bind failed; requeueing");
            // handleBindingCycleError: unreserve, forget the assumed pod and, if it was
            // still assumed (not already confirmed by the watch), treat its freed
            // resources as an AssignedPodDelete cluster event.
            let mut state = shared.state();
            if state.forget(&popped.key, &popped.uid, &host) {
                state.move_all_to_active_or_backoff(Instant::now());
            }
            drop(state);
            // Then the FailureHandler: backoff (a bind error is never "unschedulable").
            fail(&shared, &popped, FailureKind::Error, message);
        }
    }
}

/// Extender bind (first binder interested in the pod; ignorable failures fall through), else the
/// API's `pods/binding` as the DefaultBinder does.
async fn bind(shared: &Shared, pod: &Pod, host: &str) -> Result<(), String> {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    for extender in &shared.extenders {
        let verb = extender.config.bind_verb.as_deref();
        let Some(verb) = verb.filter(|_| extender.is_interested(pod)) else {
            continue;
        };
        let args = ExtenderBindingArgs {
            pod_name: name.clone(),
            pod_namespace: namespace.clone(),
            pod_uid: pod.metadata.uid.clone().unwrap_or_default(),
            node: host.to_owned(),
        };
        match extender.bind(verb, &args).await {
            Err(error) if extender.config.ignorable => {
                info!(extender = %extender.config.url_prefix, %error, "skipping extender in bind as it returned error and has ignorable flag set");
            }
            result => return result.map_err(|e| e.to_string()),
        }
    }
    let binding = Binding {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(namespace.clone()),
            uid: pod.metadata.uid.clone(),
            ..ObjectMeta::default()
        },
        target: ObjectReference {
            kind: Some("Node".to_owned()),
            name: Some(host.to_owned()),
            ..ObjectReference::default()
        },
    };
    let api: Api<Pod> = Api::namespaced(shared.client.clone(), &namespace);
    api.create_subresource::<_, serde_json::Value>(
        "binding",
        &name,
        &PostParams::default(),
        &binding,
    )
    .await
    .map(|_| ())
    .map_err(kube_message)
}

fn kube_message(error: kube::Error) -> String {
    match error {
        kube::Error::Api(status) => status.message,
        other => other.to_string(),
    }
}

// ---- Reporting to the user ----

/// Sets `PodScheduled=False` with `reason`/`message` (skipped when already so), via pods/status.
async fn update_pod_scheduled(shared: &Shared, pod: &Pod, reason: &str, message: &str) {
    let conditions = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default();
    let existing = conditions.iter().find(|c| c.type_ == "PodScheduled");
    if existing.is_some_and(|c| {
        c.status == "False"
            && c.reason.as_deref() == Some(reason)
            && c.message.as_deref() == Some(message)
    }) {
        return;
    }
    let now = Time(Timestamp::now());
    let transition = existing
        .filter(|c| c.status == "False")
        .and_then(|c| c.last_transition_time.clone())
        .unwrap_or(now);
    let condition = PodCondition {
        type_: "PodScheduled".to_owned(),
        status: "False".to_owned(),
        reason: Some(reason.to_owned()),
        message: Some(message.to_owned()),
        last_transition_time: Some(transition),
        ..PodCondition::default()
    };
    // A merge patch replaces the whole list, so send every condition with ours replaced.
    let mut updated: Vec<PodCondition> = conditions
        .into_iter()
        .filter(|c| c.type_ != "PodScheduled")
        .collect();
    updated.push(condition);
    let patch = serde_json::json!({ "status": { "conditions": updated } });
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let api: Api<Pod> = Api::namespaced(shared.client.clone(), namespace);
    if let Err(error) = api
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        warn!(pod = %format!("{namespace}/{name}"), %error, "could not update the PodScheduled condition");
    }
}

fn truncate(message: &str, limit: usize) -> String {
    if message.len() <= limit {
        return message.to_owned();
    }
    const SUFFIX: &str = " ...";
    let mut end = limit - SUFFIX.len();
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{SUFFIX}", &message[..end])
}

/// Posts a core/v1 Event about `pod` without holding up scheduling, unless the same event
/// (same pod, type, reason, action and message) was posted within [`EVENT_SERIES_WINDOW`]:
/// kube-scheduler's event broadcaster folds such repeats into the first event's series
/// instead of writing them, which matters when a pod fails the same way many times.
fn emit_event(shared: &Shared, pod: &Pod, kind: EventKind, message: &str) {
    let (type_, reason, action) = kind;
    let key = (
        pod.metadata.uid.clone().unwrap_or_default(),
        kind,
        message.to_owned(),
    );
    {
        let now = Instant::now();
        let mut recent = locked(&shared.recent_events);
        if recent
            .get(&key)
            .is_some_and(|sent| now.duration_since(*sent) < EVENT_SERIES_WINDOW)
        {
            return;
        }
        if recent.len() >= 10_000 {
            recent.retain(|_, sent| now.duration_since(*sent) < EVENT_SERIES_WINDOW);
        }
        recent.insert(key, now);
    }
    let namespace = pod
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".to_owned());
    let pod_name = pod.metadata.name.clone().unwrap_or_default();
    let now = Timestamp::now();
    let unique =
        now.as_nanosecond() as u128 + u128::from(shared.event_seq.fetch_add(1, Ordering::Relaxed));
    let component = shared.config.scheduler_name.clone();
    let event = Event {
        metadata: ObjectMeta {
            name: Some(format!("{pod_name}.{unique:x}")),
            namespace: Some(namespace.clone()),
            ..ObjectMeta::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".to_owned()),
            kind: Some("Pod".to_owned()),
            name: Some(pod_name.clone()),
            namespace: Some(namespace.clone()),
            uid: pod.metadata.uid.clone(),
            resource_version: pod.metadata.resource_version.clone(),
            ..ObjectReference::default()
        },
        reason: Some(reason.to_owned()),
        message: Some(truncate(message, EVENT_MESSAGE_LIMIT)),
        type_: Some(type_.to_owned()),
        action: Some(action.to_owned()),
        source: Some(EventSource {
            component: Some(component.clone()),
            host: None,
        }),
        reporting_component: Some(component.clone()),
        reporting_instance: Some(component),
        first_timestamp: Some(Time(now)),
        last_timestamp: Some(Time(now)),
        count: Some(1),
        ..Event::default()
    };
    let api: Api<Event> = Api::namespaced(shared.client.clone(), &namespace);
    tokio::spawn(async move {
        if let Err(error) = api.create(&PostParams::default(), &event).await {
            warn!(pod = %format!("{namespace}/{pod_name}"), %error, "could not record event");
        }
    });
}
