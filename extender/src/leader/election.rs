//! The Lease rounds: read, compare-and-swap, release, and what they tell [`Leadership`]
//! (see the module docs of [`crate::leader`]).

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Api;
use kube::api::PostParams;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Leadership, LeaseTiming, pod_of};
use crate::metrics::Metrics;

/// Who this replica is and where the Lease lives.
#[derive(Debug, Clone)]
pub struct ElectionConfig {
    /// Asks the holder's published URL who serves there, to take the Lease over at once
    /// when it is not the holder any more (see "Why a lease can end early" in the module
    /// docs); `None`: the Lease is always waited out.
    pub holder_probe: Option<crate::leader::forward::Forwarder>,
    /// How long after its start this replica begins to probe: its own bind grace, during
    /// which it would refuse binds as leader (a container kubelet restarted in the dead
    /// leader's pod must not win the Lease from a follower that can bind at once).
    pub probe_after: Duration,
    /// Namespace of the Lease (the release namespace).
    pub namespace: String,
    /// Name of the Lease.
    pub lease_name: String,
    /// `holderIdentity` when leading: `<pod name>_<random>`.
    pub identity: String,
    /// Where other replicas forward binds to while this one leads (published on the Lease).
    pub url: Option<String>,
    /// Annotation key the URL is published under.
    pub url_annotation: String,
    /// Timing.
    pub timing: LeaseTiming,
}

/// The Lease record as last seen, and when (on our clock) it last changed.
#[derive(Debug, Default, Clone)]
pub struct Observed {
    record: Option<(String, Option<String>, Option<i32>)>,
    at: Option<Instant>,
}

/// What to do with the Lease as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// There is none: create it, holding it.
    Create,
    /// Free or expired: take it (transitions + 1).
    Take,
    /// Ours: renew it.
    Renew,
    /// Another replica holds a valid lease.
    Follow {
        /// Its `holderIdentity`.
        holder: String,
    },
}

/// Decides what to do with `lease` (as read) for `me` at `now`, updating `observed`.
///
/// As client-go does, expiry is judged on our own clock from when we saw the record change,
/// never from its timestamps (clocks differ between machines; their rates do not, much).
pub fn step(spec: Option<&LeaseSpec>, me: &str, observed: &mut Observed, now: Instant) -> Step {
    let Some(spec) = spec else {
        *observed = Observed::default();
        return Step::Create;
    };
    let holder = spec.holder_identity.clone().unwrap_or_default();
    let record = (
        holder.clone(),
        spec.renew_time.as_ref().map(|t| t.0.to_string()),
        spec.lease_transitions,
    );
    if observed.record.as_ref() != Some(&record) {
        observed.record = Some(record);
        observed.at = Some(now);
    }
    if holder == me {
        return Step::Renew;
    }
    if holder.is_empty() {
        return Step::Take;
    }
    let duration =
        Duration::from_secs(u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0));
    let seen = observed.at.unwrap_or(now);
    if now.saturating_duration_since(seen) >= duration {
        Step::Take
    } else {
        Step::Follow { holder }
    }
}

/// Why one round of the election did not end in an answer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server refused or failed the call.
    #[error("Lease {namespace}/{name}: {source}")]
    Api {
        /// Lease namespace.
        namespace: String,
        /// Lease name.
        name: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
    /// The call took longer than the renew deadline.
    #[error("Lease {0}: no answer within the renew deadline")]
    Timeout(String),
}

/// Result of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Renews the Lease as this replica last wrote it, without reading it first (the common
/// case while leading). `None` when that write failed (someone else wrote it, or the API
/// server erred): the caller reads the Lease and decides afresh.
async fn renew_as_written(
    api: &Api<Lease>,
    config: &ElectionConfig,
    mut lease: Lease,
) -> Option<Lease> {
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    spec.renew_time = Some(MicroTime(jiff::Timestamp::now()));
    match api
        .replace(&config.lease_name, &PostParams::default(), &lease)
        .await
    {
        Ok(written) => Some(written),
        Err(error) => {
            tracing::debug!(%error, "renewing the lease as last written failed; reading it");
            None
        }
    }
}

/// Writes this replica into `lease` as its holder for `step` (create, take over or renew):
/// identity, duration, renew and acquire times, transitions, and the URL followers forward
/// binds to.
fn claim(lease: &mut Lease, step: &Step, config: &ElectionConfig) {
    let seconds = i32::try_from(config.timing.duration.as_millis().div_ceil(1000))
        .unwrap_or(i32::MAX)
        .max(1);
    let stamp = Some(MicroTime(jiff::Timestamp::now()));
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    match step {
        Step::Create | Step::Take => {
            spec.acquire_time = stamp.clone();
            spec.lease_transitions = Some(match step {
                Step::Create => 0,
                _ => spec.lease_transitions.unwrap_or(0).saturating_add(1),
            });
        }
        Step::Renew | Step::Follow { .. } => {}
    }
    spec.holder_identity = Some(config.identity.clone());
    spec.lease_duration_seconds = Some(seconds);
    spec.renew_time = stamp;
    let annotations = lease
        .metadata
        .annotations
        .get_or_insert_with(Default::default);
    match &config.url {
        Some(url) => annotations.insert(config.url_annotation.clone(), url.clone()),
        None => annotations.remove(&config.url_annotation),
    };
}

/// One round: read the Lease, and create, take or renew it when [`step`] says so. `Ok(true)`
/// when this replica holds it now. `ours` is the Lease as our last write left it.
///
/// Why a leader renews without reading first: under a burst the API server answers each call
/// in hundreds of milliseconds, and a read followed by a write can take the renewal past its
/// deadline, so the leader stops binding for a while (on the real cluster, in a run whose API
/// client had its calls queued behind the binds, 2,152 binds of a 3,000-pod backlog were
/// refused that way). One call per renewal halves that exposure. While this replica leads, it writes
/// its last Lease back with a new renew time straight away: the resourceVersion from its own
/// last write makes it a compare-and-swap, so a Lease anyone else changed gets a 409 and the
/// round falls back to reading (client-go's leader election does the same since 1.29).
async fn round(
    api: &Api<Lease>,
    config: &ElectionConfig,
    observed: &mut Observed,
    leadership: &Leadership,
    ours: &mut Option<Lease>,
    may_probe: bool,
) -> Result<bool> {
    let api_error = |source| Error::Api {
        namespace: config.namespace.clone(),
        name: config.lease_name.clone(),
        source,
    };
    if let Some(lease) = ours.take().filter(|_| leadership.is_leader())
        && let Some(written) = renew_as_written(api, config, lease).await
    {
        *ours = Some(written);
        return Ok(true);
    }
    let current = api.get_opt(&config.lease_name).await.map_err(api_error)?;
    let now = Instant::now();
    let mut step = step(
        current.as_ref().and_then(|l| l.spec.as_ref()),
        &config.identity,
        observed,
        now,
    );
    let holder_url = current
        .as_ref()
        .and_then(|lease| lease.metadata.annotations.as_ref())
        .and_then(|a| a.get(&config.url_annotation))
        .cloned();
    if let (Step::Follow { holder }, Some(url), Some(probe), true) =
        (&step, &holder_url, &config.holder_probe, may_probe)
    {
        let answer = probe.probe(url, config.timing.retry_period).await;
        if answer.holder_is_gone(holder) {
            tracing::warn!(%holder, %url, ?answer, "the leader's process is gone; taking the lease over without waiting for it to expire");
            step = Step::Take;
        }
    }
    if let Step::Follow { holder } = &step {
        leadership.follow(Some((pod_of(holder).to_owned(), holder_url)));
        return Ok(false);
    }
    let mut lease = current.unwrap_or_default();
    claim(&mut lease, &step, config);
    let written = match step {
        Step::Create => {
            lease.metadata = ObjectMeta {
                name: Some(config.lease_name.clone()),
                namespace: Some(config.namespace.clone()),
                annotations: lease.metadata.annotations.take(),
                ..ObjectMeta::default()
            };
            api.create(&PostParams::default(), &lease).await
        }
        // The resourceVersion read above makes this a compare-and-swap: 409 if it moved.
        _ => {
            api.replace(&config.lease_name, &PostParams::default(), &lease)
                .await
        }
    };
    match written {
        Ok(written) => {
            *ours = Some(written);
            Ok(true)
        }
        Err(kube::Error::Api(status)) if status.code == 409 => {
            leadership.follow(None);
            Ok(false)
        }
        Err(source) => Err(api_error(source)),
    }
}

/// Runs the election until `stop`, then steps down: binds stop at once, the Lease is released
/// once this replica's last write has ended.
pub async fn run(
    client: kube::Client,
    config: ElectionConfig,
    leadership: Leadership,
    metrics: Metrics,
    stop: CancellationToken,
) {
    let api: Api<Lease> = Api::namespaced(client, &config.namespace);
    let timing = config.timing;
    let mut observed = Observed::default();
    let mut ours: Option<Lease> = None;
    let mut tick = tokio::time::interval(timing.retry_period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let probe_from = Instant::now() + config.probe_after;
    tracing::info!(identity = %config.identity, lease = %format_args!("{}/{}", config.namespace, config.lease_name), "leader election started");
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        let started = Instant::now();
        let outcome = tokio::select! {
            () = stop.cancelled() => break,
            outcome = tokio::time::timeout(
                timing.renew_deadline,
                round(&api, &config, &mut observed, &leadership, &mut ours, started >= probe_from),
            ) => outcome.unwrap_or_else(|_| Err(Error::Timeout(config.lease_name.clone()))),
        };
        if outcome.is_ok() {
            leadership.answered(Instant::now());
        }
        match outcome {
            Ok(true) => {
                if leadership.renewed(started) {
                    metrics.leader.set(1);
                    metrics.leader_acquisitions.inc();
                    tracing::info!(identity = %config.identity, "acquired the lease: this replica binds from now on");
                }
            }
            Ok(false) => {}
            Err(error) => tracing::warn!(%error, "leader election round failed"),
        }
        if leadership.check_deadline(Instant::now()) {
            metrics.leader.set(0);
            tracing::warn!(identity = %config.identity, deadline_ms = timing.renew_deadline.as_millis(), "could not renew the lease within the renew deadline: stopped binding");
        }
    }
    let (led, writes_end_by) = leadership.step_down();
    metrics.leader.set(0);
    if !led {
        return;
    }
    leadership.writes_ended(writes_end_by).await;
    let release = async {
        let mut lease = api.get(&config.lease_name).await?;
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        if spec.holder_identity.as_deref() != Some(config.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(jiff::Timestamp::now()));
        api.replace(&config.lease_name, &PostParams::default(), &lease)
            .await
            .map(|_| ())
    };
    match tokio::time::timeout(timing.renew_deadline, release).await {
        Ok(Ok(())) => tracing::info!(identity = %config.identity, "released the lease"),
        Ok(Err(error)) => {
            tracing::warn!(%error, "cannot release the lease; another replica takes over once it expires")
        }
        Err(_) => tracing::warn!(
            "releasing the lease timed out; another replica takes over once it expires"
        ),
    }
}
