//! Fault injection: what a test does to the API server to see how gpushare copes with a
//! cluster under stress (latency on every request, errors at a rate per verb,
//! a write stall that applies or fails the writes it held, a stalled etcd holding
//! consistent reads, a client cut off, watches dropped, history compacted).
//!
//! Kept apart from the request handlers so that every fault is one method here, and the
//! handlers only ask "hold this?" or "fail this?" at the points a real server would.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Verb;
use super::status;
use super::store::{self, Store};

/// A write stall: until when, and what becomes of the writes it held.
#[derive(Clone, Copy, Debug)]
struct Stall {
    until: Instant,
    /// Fail the held writes (unapplied) instead of applying them.
    fail: bool,
}

/// What becomes of an accepted write once faults let it go.
pub(crate) enum Release {
    Apply,
    /// Answer with this error, unapplied.
    Fail(status::ApiError),
}

/// Fault injection, shared by every request. Cheap to clone.
#[derive(Clone)]
pub struct Faults {
    inner: Arc<Mutex<FaultState>>,
    drop_watches: Arc<watch::Sender<u64>>,
    stall: Arc<watch::Sender<Option<Stall>>>,
    /// Bearer tokens cut off from the server (a network partition of one client).
    cut: Arc<watch::Sender<BTreeSet<String>>>,
    store: Arc<Store>,
}

struct FaultState {
    latency: Duration,
    errors: HashMap<Verb, (f64, u16)>,
    rng: StdRng,
}

impl Faults {
    pub(super) fn new(store: Arc<Store>) -> Self {
        Self {
            inner: Arc::new(Mutex::new(FaultState {
                latency: Duration::ZERO,
                errors: HashMap::new(),
                // Seeded: a failing run can be replayed.
                rng: StdRng::seed_from_u64(0x6770_7573_6861_7265),
            })),
            drop_watches: Arc::new(watch::Sender::new(0)),
            stall: Arc::new(watch::Sender::new(None)),
            cut: Arc::new(watch::Sender::new(BTreeSet::new())),
            store,
        }
    }

    /// Cuts the client holding `token` off, as a network partition would: its requests hang
    /// until [`Faults::heal`] (or until it gives up), then fail with a 503, unapplied; its open
    /// watches end now (every client's do; the others reconnect at once).
    pub fn cut(&self, token: &str) {
        self.cut.send_modify(|cut| {
            cut.insert(token.to_owned());
        });
        self.drop_watches();
    }

    /// Ends the cut of `token`.
    pub fn heal(&self, token: &str) {
        self.cut.send_modify(|cut| {
            cut.remove(token);
        });
    }

    /// If the request's bearer token is cut off: waits until it is healed or the server shuts
    /// down, and returns true (the request is then refused, unapplied).
    pub(crate) async fn hold_if_cut(
        &self,
        authorization: Option<&str>,
        cancel: &CancellationToken,
    ) -> bool {
        let Some(token) = authorization.and_then(|h| h.strip_prefix("Bearer ")) else {
            return false;
        };
        let mut cut = self.cut.subscribe();
        if !cut.borrow_and_update().contains(token) {
            return false;
        }
        loop {
            tokio::select! {
                () = cancel.cancelled() => return true,
                changed = cut.changed() => {
                    if changed.is_err() || !cut.borrow_and_update().contains(token) {
                        return true;
                    }
                }
            }
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, FaultState> {
        super::locked(&self.inner)
    }

    /// Delay added before every request is handled.
    pub fn set_latency(&self, d: Duration) {
        self.state().latency = d;
    }

    /// Freezes writes for `d` from now, as a frozen etcd would: every write arriving before
    /// the returned instant hangs until then and is applied afterwards, in whatever order the
    /// held writes wake up, even if its client timed out or hung up meanwhile (so a client
    /// that retries may find its first attempt already applied). Consistent reads (a GET, a
    /// list without `resourceVersion=0`) wait for the end of the stall too, and are then
    /// answered; watches and lists served from the watch cache answer as usual. Calling it again moves the end of the stall to `d` from now; `Duration::ZERO`
    /// ends a stall at once.
    pub fn stall_writes(&self, d: Duration) -> Instant {
        self.start_stall(d, false)
    }

    /// Like [`Faults::stall_writes`], but when the stall ends every write it held fails,
    /// unapplied, with a 500 `etcdserver: leader changed` (as when etcd loses its leader with
    /// the uncommitted proposals): a client that gave up meanwhile never learns that its write
    /// did not happen.
    pub fn stall_writes_then_fail(&self, d: Duration) -> Instant {
        self.start_stall(d, true)
    }

    fn start_stall(&self, d: Duration, fail: bool) -> Instant {
        let until = Instant::now() + d;
        self.stall.send_replace(Some(Stall { until, fail }));
        until
    }

    /// Whether writes arriving now are held.
    pub fn writes_stalled(&self) -> bool {
        self.stall
            .borrow()
            .is_some_and(|stall| stall.until > Instant::now())
    }

    /// Answers `rate` (0.0..=1.0) of the requests with `verb` with `status` as a real
    /// `metav1.Status` (429 carries `Retry-After: 1`). A rate of 0 removes the fault.
    pub fn set_error_rate(&self, verb: Verb, rate: f64, status: u16) {
        let mut state = self.state();
        if rate <= 0.0 {
            state.errors.remove(&verb);
        } else {
            state.errors.insert(verb, (rate.min(1.0), status));
        }
    }

    /// Ends every open watch stream now (as an API server restart or a load balancer would).
    pub fn drop_watches(&self) {
        self.drop_watches.send_modify(|generation| *generation += 1);
    }

    /// Forgets history: a watch from any older resourceVersion gets a 410 Expired event.
    pub fn compact(&self) {
        self.store.write(store::Inner::compact);
    }

    /// No latency, no errors, no write stall.
    pub fn clear(&self) {
        let mut state = self.state();
        state.latency = Duration::ZERO;
        state.errors.clear();
        drop(state);
        self.stall.send_replace(None);
    }

    pub(crate) fn latency(&self) -> Duration {
        self.state().latency
    }

    /// Holds a read that etcd itself must answer (a GET, or a list that is not served from the
    /// watch cache) until the current stall ends: with etcd frozen, a quorum read waits like a
    /// write. False when the server shuts down meanwhile.
    pub(crate) async fn hold_consistent_read(&self, cancel: &CancellationToken) -> bool {
        self.wait_out_stall(cancel).await.is_some()
    }

    /// Holds an accepted write through the current stall, and says
    /// what becomes of it. `None` if the server shut down meanwhile (nothing is applied).
    pub(crate) async fn hold_write(&self, cancel: &CancellationToken) -> Option<Release> {
        if self.wait_out_stall(cancel).await?.is_some_and(|s| s.fail) {
            return Some(Release::Fail(status::ApiError::new(
                500,
                "InternalError",
                "Internal error occurred: etcdserver: leader changed",
            )));
        }
        Some(Release::Apply)
    }

    /// Waits until no stall holds what arrives now, and returns the stall that held the
    /// request as it was when it let go: ended by time, that stall decides; ended by `clear`
    /// (or none held it), `Some(None)`. `None` if the server shut down meanwhile.
    async fn wait_out_stall(&self, cancel: &CancellationToken) -> Option<Option<Stall>> {
        let mut stall = self.stall.subscribe();
        let mut held_by: Option<Stall> = None;
        loop {
            let current = *stall.borrow_and_update();
            let Some(current) = current.filter(|s| s.until > Instant::now()) else {
                return Some(held_by.filter(|_| current.is_some()));
            };
            held_by = Some(current);
            tokio::select! {
                () = cancel.cancelled() => return None,
                () = tokio::time::sleep_until(current.until) => {}
                // The stall was moved or ended: look again.
                _ = stall.changed() => {}
            }
        }
    }

    /// The status code to fail this request with, if the dice say so.
    pub(crate) fn draw_error(&self, verb: Verb) -> Option<u16> {
        let mut state = self.state();
        let (rate, status) = *state.errors.get(&verb)?;
        (state.rng.random::<f64>() < rate).then_some(status)
    }

    pub(crate) fn drop_signal(&self) -> watch::Receiver<u64> {
        self.drop_watches.subscribe()
    }
}
