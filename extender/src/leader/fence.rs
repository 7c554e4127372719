//! The write fence: whether this replica may bind now, and with what budget per write, as
//! the election last left it (see the module docs of [`crate::leader`] for why a write's
//! timeout must end before its lease could look expired to anyone).

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use super::LeaseTiming;

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
    /// This process's `holderIdentity`, answered at `/identity` (see [`crate::leader::forward::Probe`]).
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

    pub(super) fn is_leader_at(&self, now: Instant) -> bool {
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
    pub(super) fn answered(&self, at: Instant) {
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
    pub(super) async fn writes_ended(&self, deadline: Option<Instant>) {
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
    pub(super) fn renewed(&self, started: Instant) -> bool {
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
    pub(super) fn follow(&self, other: Option<(String, Option<String>)>) {
        if let Some(e) = &mut self.state().elected {
            e.other = other;
        }
    }

    /// Drops leadership now if the last renewal is older than the renew deadline; true if
    /// this replica led until now.
    pub(super) fn check_deadline(&self, now: Instant) -> bool {
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
    pub(super) fn step_down(&self) -> (bool, Option<Instant>) {
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
