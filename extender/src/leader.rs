//! Leader election over a `coordination.k8s.io/v1` Lease, and the fence that keeps a deposed
//! leader's Binding writes out of its successor's way.
//!
//! ```text
//!  every retry period:  GET Lease ──▶ step() ──▶ Create / Take / Renew (PUT with resourceVersion,
//!                                      │          a 409 means someone else won this round)
//!                                      └──▶ Follow: remember the holder and its URL
//!
//!  leader's lease, as it counts it:  renewed_at ───────────── renewed_at + lease duration
//!                                    (start of the last successful renew: the server's
//!                                     renewTime, and so every follower's clock, is later)
//!  a Binding write may start at t only if t + its timeout <= renewed_at + lease duration,
//!  so every write of ours has ended (client side) before any other replica can take over.
//! ```
//!
//! Why this shape: a follower takes over only after it has seen the Lease record unchanged for
//! a full lease duration, counted on its own clock from when it saw the record change, which
//! is after the leader started that renewal. The leader, for its part, gives every write a
//! client timeout that ends before its lease could look expired to anyone. So no write of the
//! old leader is still under way when the new one binds; what the old leader wrote has
//! committed, and the new leader waits a short catch-up ([`LeaseTiming::catch_up`]) for its
//! watch to show it. A deposed leader that is still running (partitioned from the API server)
//! refuses binds and stops re-posting Bindings the moment its budget is gone, whether or not
//! it has heard that it lost. The one thing this cannot prove is what an API server does with
//! a write after its client gave up on it (a stalled etcd applying it seconds later): the same
//! residual the restart grace has (docs/operating.md, "Known limits").
//!
//! A term counts the times this replica became leader: a Binding written in an earlier term
//! is never re-posted (another leader may have handed its memory out meanwhile).
//!
//! Why not a crate: none fits kube 5 and the fence. `kube-runtime` has no leader election;
//! `kube-leader-election` (kube 0.96, "without fencing") and `kube-coordinate` (kube ≤ 2, a
//! leader/follower state channel) and `kube-lease-manager` (kube 4) would each pull a second
//! kube and k8s-openapi into the workspace, and none says until when its lease is safe to act
//! on, which is what bounds our writes. What is needed is small: read, compare-and-swap,
//! release.
//!
//! Why a lease can end early: a follower that waits out a SIGKILLed leader's Lease leaves
//! binding stopped for the lease duration and more (3.4–4.3 s on the real cluster). But every
//! leader publishes the URL it serves on, answers `/identity` there with its
//! `holderIdentity`, and keeps that listening socket open until it has released the Lease: on
//! a graceful stop, and on any error of its own, the socket closes only after its last write
//! ended (`crate::serve` holds a copy of it to the end). So each round a follower asks the
//! holder's address who serves there ([`crate::forward::Probe`]): a refused connection (nothing listens) or
//! another identity (a restarted container in the same pod) means no process of the holder
//! is left to write, and the follower takes the Lease over at once, with the same
//! compare-and-swap as an expired one. Anything else (the holder answering, a timeout, a
//! reset, TLS trouble, an older extender without `/identity`) proves nothing, and the Lease
//! is waited out as before. A replica probes only once its own bind grace is over: a container
//! kubelet restarted in the dead leader's pod would otherwise win the race and then refuse
//! binds for that grace, while the other follower could have bound at once.
//!
//! Identity: `<pod name>_<random>`, fresh for every process, so a restarted container never
//! mistakes its predecessor's lease for its own (it knows nothing of that one's writes).
//! Graceful shutdown stops binding, waits for its own writes to end, then releases the Lease
//! (holder cleared), so the successor takes over at once instead of after a lease duration.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Api;
use kube::api::PostParams;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// The Lease's timing, as `--leader-*` flags set it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTiming {
    /// How long a Lease record stays valid after its last renewal (`leaseDurationSeconds`,
    /// rounded up to whole seconds in the record).
    pub duration: Duration,
    /// The leader gives up leading when it could not renew for this long.
    pub renew_deadline: Duration,
    /// How often every replica reads the Lease, and the leader renews it.
    pub retry_period: Duration,
    /// After acquiring, binds wait this long for the watch to show what the previous leader
    /// wrote (its writes have all ended by then: see the module documentation).
    pub catch_up: Duration,
}

impl Default for LeaseTiming {
    fn default() -> Self {
        Self {
            duration: Duration::from_millis(3000),
            renew_deadline: Duration::from_millis(2000),
            retry_period: Duration::from_millis(500),
            catch_up: Duration::from_millis(500),
        }
    }
}

/// Who this replica is and where the Lease lives.
#[derive(Debug, Clone)]
pub struct ElectionConfig {
    /// Asks the holder's published URL who serves there, to take the Lease over at once
    /// when it is not the holder any more (see "Why a lease can end early" in the module
    /// docs); `None`: the Lease is always waited out.
    pub holder_probe: Option<crate::forward::Forwarder>,
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

/// A `holderIdentity` for this process: the pod name and a random suffix.
pub fn identity(pod_name: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    let name = if pod_name.is_empty() {
        "gpushare-extender"
    } else {
        pod_name
    };
    format!("{name}_{:08x}", hasher.finish() as u32)
}

/// The pod name part of a `holderIdentity` made by [`identity`].
pub fn pod_of(identity: &str) -> &str {
    identity.rsplit_once('_').map_or(identity, |(pod, _)| pod)
}

/// What the bind path may do now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gate {
    /// Bind here; each API write must end within `budget`.
    Bind {
        /// The longest client timeout a write may have.
        budget: Duration,
        /// Which term of leadership this is (0 without an election): a write of an earlier
        /// term is never re-posted, since another leader may have had its memory meanwhile.
        term: u64,
    },
    /// Another replica leads and can be reached at this URL.
    Forward {
        /// The leader's base URL.
        url: String,
        /// Its pod name.
        leader: String,
    },
    /// Not now; kube-scheduler retries.
    Refuse {
        /// The metric reason.
        reason: &'static str,
        /// What kube-scheduler reports.
        message: String,
    },
}

/// Shorter write budgets than this are refused rather than attempted: such a write would
/// time out before a healthy API server answers, and only add an ambiguous outcome.
pub const MIN_WRITE_BUDGET: Duration = Duration::from_millis(200);

/// Whether this replica may bind, shared by the election task and the bind path. Without an
/// election ([`Leadership::default`]) it always may, with the full timeout.
#[derive(Debug, Clone, Default)]
pub struct Leadership {
    inner: Arc<Mutex<State>>,
    /// Woken when a write ends.
    write_ended: Arc<tokio::sync::Notify>,
}

/// A write under way; dropped when its client call has ended.
#[derive(Debug)]
pub struct WriteGuard {
    leadership: Leadership,
}

impl Drop for WriteGuard {
    fn drop(&mut self) {
        if let Some(e) = &mut self.leadership.state().elected {
            e.in_flight = e.in_flight.saturating_sub(1);
        }
        self.leadership.write_ended.notify_waiters();
    }
}

#[derive(Debug, Default)]
struct State {
    /// `None`: no election, this instance binds alone.
    elected: Option<Elected>,
}

#[derive(Debug)]
struct Elected {
    timing: LeaseTiming,
    /// Start of the last successful acquire or renew, while leading.
    renewed_at: Option<Instant>,
    /// When this replica last became leader.
    acquired_at: Option<Instant>,
    /// The other replica leading, as last read: pod name and URL.
    other: Option<(String, Option<String>)>,
    /// When the last write this replica started ends at the latest.
    writes_end_by: Option<Instant>,
    /// Writes under way.
    in_flight: usize,
    /// Shutting down: bind nothing more.
    stepping_down: bool,
    /// How often this replica became leader.
    term: u64,
    /// When the last election round got an answer from the API server.
    answered_at: Option<Instant>,
    /// This process's `holderIdentity`, answered at `/identity` (see [`crate::forward::Probe`]).
    identity: String,
}

impl Leadership {
    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Switches to elected mode: nothing is bound until the Lease is acquired.
    pub fn elect(&self, timing: LeaseTiming, identity: &str) {
        self.state().elected = Some(Elected {
            identity: identity.to_owned(),
            timing,
            renewed_at: None,
            acquired_at: None,
            other: None,
            writes_end_by: None,
            in_flight: 0,
            stepping_down: false,
            term: 0,
            answered_at: None,
        });
    }

    /// The `holderIdentity` this process elects under; `None` without an election.
    pub fn identity(&self) -> Option<String> {
        self.state().elected.as_ref().map(|e| e.identity.clone())
    }

    /// True while this replica leads (or there is no election).
    pub fn is_leader(&self) -> bool {
        self.is_leader_at(Instant::now())
    }

    fn is_leader_at(&self, now: Instant) -> bool {
        match &self.state().elected {
            None => true,
            Some(e) => e.leading(now),
        }
    }

    /// Whether this replica reaches the API server: its last Lease round got an answer
    /// within a lease duration (always, without an election). `/readyz` is 503 otherwise,
    /// so a Service stops sending kube-scheduler to a replica cut off from the cluster: it
    /// could neither bind nor tell where the leader is.
    pub fn reaches_api(&self) -> bool {
        let now = Instant::now();
        match &self.state().elected {
            None => true,
            Some(e) => e
                .answered_at
                .is_some_and(|at| now.saturating_duration_since(at) <= e.timing.duration),
        }
    }

    /// Records an answer from the API server to an election round.
    fn answered(&self, at: Instant) {
        if let Some(e) = &mut self.state().elected {
            e.answered_at = Some(at);
        }
    }

    /// The term this replica leads in at `now` (0 without an election), if it leads.
    pub fn term(&self, now: Instant) -> Option<u64> {
        match &self.state().elected {
            None => Some(0),
            Some(e) => e.leading(now).then_some(e.term),
        }
    }

    /// What the bind path may do at `now`, for a write that would like `timeout`.
    pub fn gate(&self, now: Instant, timeout: Duration) -> Gate {
        let state = self.state();
        let Some(e) = &state.elected else {
            return Gate::Bind {
                budget: timeout,
                term: 0,
            };
        };
        if e.stepping_down {
            return Gate::Refuse {
                reason: "not_leader",
                message: "this extender replica is shutting down; retry".to_owned(),
            };
        }
        let (Some(renewed_at), true) = (e.renewed_at, e.leading(now)) else {
            return match &e.other {
                Some((leader, Some(url))) => Gate::Forward {
                    url: url.clone(),
                    leader: leader.clone(),
                },
                Some((leader, None)) => Gate::Refuse {
                    reason: "not_leader",
                    message: format!(
                        "this extender replica does not lead ({leader} does, and publishes no address); retry"
                    ),
                },
                None => Gate::Refuse {
                    reason: "no_leader",
                    message: "no gpushare extender replica leads right now (one takes over within seconds); retry".to_owned(),
                },
            };
        };
        if let Some(from) = e.acquired_at.map(|at| at + e.timing.catch_up)
            && now < from
        {
            return Gate::Refuse {
                reason: "starting",
                message: format!(
                    "this extender replica just took over; binds resume in {} ms, once the previous leader's writes are in its view",
                    (from - now).as_millis()
                ),
            };
        }
        let left = (renewed_at + e.timing.duration).saturating_duration_since(now);
        if left < MIN_WRITE_BUDGET {
            return Gate::Refuse {
                reason: "lease_stale",
                message: "the extender leader could not renew its lease in time; retry".to_owned(),
            };
        }
        Gate::Bind {
            budget: timeout.min(left),
            term: e.term,
        }
    }

    /// Records that a write was started that ends, client side, by `until`; it is under way
    /// until the guard is dropped.
    pub fn write_started(&self, until: Instant) -> WriteGuard {
        if let Some(e) = &mut self.state().elected {
            e.writes_end_by = Some(e.writes_end_by.map_or(until, |t| t.max(until)));
            e.in_flight += 1;
        }
        WriteGuard {
            leadership: self.clone(),
        }
    }

    /// Returns once no write is under way, or at `deadline` (when the last one ends at the
    /// latest).
    async fn writes_ended(&self, deadline: Option<Instant>) {
        loop {
            let ended = self.write_ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            let in_flight = self.state().elected.as_ref().map_or(0, |e| e.in_flight);
            if in_flight == 0 {
                return;
            }
            match deadline {
                Some(deadline) => tokio::select! {
                    () = ended => {}
                    () = tokio::time::sleep_until(deadline) => return,
                },
                None => ended.await,
            }
        }
    }

    /// Records a successful acquire or renew that started at `started`; true if this made
    /// the replica leader (it was not before).
    fn renewed(&self, started: Instant) -> bool {
        let mut state = self.state();
        let Some(e) = &mut state.elected else {
            return false;
        };
        let was = e.leading(started);
        e.renewed_at = Some(started);
        e.other = None;
        if !was {
            e.acquired_at = Some(started);
            e.term += 1;
        }
        !was
    }

    /// Records the holder read from the Lease (another replica, or nobody).
    fn follow(&self, other: Option<(String, Option<String>)>) {
        if let Some(e) = &mut self.state().elected {
            e.other = other;
        }
    }

    /// Drops leadership now if the last renewal is older than the renew deadline; true if
    /// this replica led until now.
    fn check_deadline(&self, now: Instant) -> bool {
        let mut state = self.state();
        let Some(e) = &mut state.elected else {
            return false;
        };
        match e.renewed_at {
            Some(at) if now.saturating_duration_since(at) > e.timing.renew_deadline => {
                e.renewed_at = None;
                e.acquired_at = None;
                true
            }
            _ => false,
        }
    }

    /// Stops binding; returns when this replica's last write ends (client side), and
    /// whether it led.
    fn step_down(&self) -> (bool, Option<Instant>) {
        let mut state = self.state();
        let Some(e) = &mut state.elected else {
            return (false, None);
        };
        let led = e.renewed_at.is_some();
        e.stepping_down = true;
        e.renewed_at = None;
        (led, e.writes_end_by)
    }
}

impl Elected {
    fn leading(&self, now: Instant) -> bool {
        !self.stepping_down
            && self
                .renewed_at
                .is_some_and(|at| now.saturating_duration_since(at) <= self.timing.renew_deadline)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(holder: &str, seconds: i32, renewed: &str) -> LeaseSpec {
        LeaseSpec {
            holder_identity: (!holder.is_empty()).then(|| holder.to_owned()),
            lease_duration_seconds: Some(seconds),
            renew_time: Some(MicroTime(renewed.parse().unwrap())),
            lease_transitions: Some(0),
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn identities_differ_per_process_start_and_name_the_pod() {
        let a = identity("gpushare-extender-7d9f-abcde");
        assert_eq!(pod_of(&a), "gpushare-extender-7d9f-abcde");
        assert!(a.starts_with("gpushare-extender-7d9f-abcde_"));
        assert_eq!(pod_of(&identity("")), "gpushare-extender");
    }

    #[tokio::test]
    async fn a_follower_takes_over_only_after_the_record_stood_still_a_lease_duration() {
        let mut observed = Observed::default();
        let t0 = Instant::now();
        assert_eq!(step(None, "b", &mut observed, t0), Step::Create);
        let held = spec("a", 3, "2026-01-01T00:00:00Z");
        assert_eq!(
            step(Some(&held), "b", &mut observed, t0),
            Step::Follow { holder: "a".into() }
        );
        let later = t0 + Duration::from_millis(2900);
        assert!(matches!(
            step(Some(&held), "b", &mut observed, later),
            Step::Follow { .. }
        ));
        // A renewal resets the count, whatever its timestamp says.
        let renewed = spec("a", 3, "2026-01-01T00:00:01Z");
        assert!(matches!(
            step(Some(&renewed), "b", &mut observed, later),
            Step::Follow { .. }
        ));
        let expired = later + Duration::from_secs(3);
        assert_eq!(
            step(Some(&renewed), "b", &mut observed, expired),
            Step::Take
        );
        // Ours: renew; released (no holder): take at once.
        assert_eq!(step(Some(&renewed), "a", &mut observed, later), Step::Renew);
        let released = spec("", 1, "2026-01-01T00:00:02Z");
        assert_eq!(step(Some(&released), "b", &mut observed, later), Step::Take);
    }

    #[tokio::test]
    async fn writes_fit_in_the_lease_and_stop_at_the_renew_deadline() {
        let timing = LeaseTiming::default();
        let leadership = Leadership::default();
        let timeout = Duration::from_millis(2500);
        // No election: always bind, with the full timeout.
        assert!(leadership.reaches_api());
        assert_eq!(
            leadership.gate(Instant::now(), timeout),
            Gate::Bind {
                budget: timeout,
                term: 0
            }
        );
        leadership.elect(timing, "solo");
        assert!(!leadership.reaches_api());
        leadership.answered(Instant::now());
        assert!(leadership.reaches_api());
        assert!(matches!(
            leadership.gate(Instant::now(), timeout),
            Gate::Refuse {
                reason: "no_leader",
                ..
            }
        ));
        leadership.follow(Some((
            "pod-a".into(),
            Some("https://10.0.0.1:39999".into()),
        )));
        assert!(matches!(
            leadership.gate(Instant::now(), timeout),
            Gate::Forward { .. }
        ));
        let t0 = Instant::now();
        assert!(leadership.renewed(t0));
        // Catching up first.
        assert!(matches!(
            leadership.gate(t0, timeout),
            Gate::Refuse {
                reason: "starting",
                ..
            }
        ));
        let t1 = t0 + timing.catch_up;
        assert_eq!(
            leadership.gate(t1, timeout),
            Gate::Bind {
                budget: timeout,
                term: 1
            }
        );
        // A renewal that keeps coming later shrinks the budget: every write ends before
        // t0 + lease duration.
        let t2 = t0 + Duration::from_millis(1000);
        assert_eq!(
            leadership.gate(t2, timeout),
            Gate::Bind {
                budget: Duration::from_millis(2000),
                term: 1
            }
        );
        assert!(!leadership.check_deadline(t0 + timing.renew_deadline));
        let t3 = t0 + timing.renew_deadline + Duration::from_millis(1);
        assert!(leadership.check_deadline(t3));
        assert!(!leadership.is_leader_at(t3));
        assert!(matches!(
            leadership.gate(t3, timeout),
            Gate::Refuse { .. } | Gate::Forward { .. }
        ));
        // Leading again means catching up again, in a new term.
        assert!(leadership.renewed(t3));
        assert!(matches!(
            leadership.gate(t3, timeout),
            Gate::Refuse {
                reason: "starting",
                ..
            }
        ));
        assert!(matches!(
            leadership.gate(t3 + timing.catch_up, timeout),
            Gate::Bind { term: 2, .. }
        ));
        // Stepping down refuses at once and reports when the last write ends.
        let write = leadership.write_started(t3 + timeout);
        assert_eq!(leadership.step_down(), (true, Some(t3 + timeout)));
        let waiting = tokio::spawn({
            let leadership = leadership.clone();
            async move { leadership.writes_ended(None).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        drop(write);
        waiting.await.unwrap();
        assert!(matches!(
            leadership.gate(t3 + timing.catch_up, timeout),
            Gate::Refuse {
                reason: "not_leader",
                ..
            }
        ));
    }
}
