//! What the scheduler's tasks share: the configuration, the API client, the extenders'
//! clients, the state behind its one lock, and the bookkeeping of the Events and
//! `PodScheduled` updates sent by tasks of their own.
//!
//! Apart from the scheduling loop (`driver.rs`) so that the tasks around it (the watches in
//! `watches.rs`) hold the same handle without importing the loop that spawns them.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;

use super::SchedulerConfig;
use super::extender::{ExtenderError, HttpExtender};
use super::state::{PodKey, State};
use super::stats::StatsRecorder;
use crate::locked;

pub struct Shared {
    pub config: SchedulerConfig,
    pub(super) client: kube::Client,
    pub(super) extenders: Vec<HttpExtender>,
    state: Mutex<State>,
    pub(super) wake: Notify,
    pub stats: StatsRecorder,
    pub(super) binds: Arc<Semaphore>,
    pub cancel: CancellationToken,
    pub(super) rng: Mutex<StdRng>,
    pub(super) event_seq: AtomicU64,
    pub(super) status_updates: Mutex<StatusUpdates>,
    /// Events sent lately, and when.
    pub(super) recent_events: Mutex<HashMap<EventKey, Instant>>,
}

/// An Event's type, reason and action.
pub(super) type EventKind = (&'static str, &'static str, &'static str);

/// What makes two events the same one (client-go's "isomorphic" events): pod UID, type,
/// reason, action and message.
pub(super) type EventKey = (String, EventKind, String);

/// `PodScheduled=False` updates waiting to be sent: the latest per pod, and the pods whose
/// sender task is running.
#[derive(Default)]
pub(super) struct StatusUpdates {
    pub(super) queued: HashMap<PodKey, (&'static str, String)>,
    pub(super) sending: HashSet<PodKey>,
}

impl Shared {
    /// The shared state of a driver about to start: its extenders' clients, an empty cache
    /// and queue, the tie-breaking RNG (seeded from the configuration, if it names a seed).
    pub(super) fn new(
        client: kube::Client,
        config: SchedulerConfig,
    ) -> Result<Self, ExtenderError> {
        let stats = StatsRecorder::default();
        let extenders = config
            .extenders
            .iter()
            .cloned()
            .map(|c| HttpExtender::new(c, stats.clone()))
            .collect::<Result<Vec<_>, _>>()?;
        let rng = match config.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        Ok(Shared {
            state: Mutex::new(State::new(config.clone())),
            binds: Arc::new(Semaphore::new(config.parallel_binds.max(1))),
            config,
            client,
            extenders,
            wake: Notify::new(),
            stats,
            cancel: CancellationToken::new(),
            rng: Mutex::new(rng),
            event_seq: AtomicU64::new(0),
            status_updates: Mutex::new(StatusUpdates::default()),
            recent_events: Mutex::new(HashMap::new()),
        })
    }

    /// The state is only mutated synchronously; a panic while holding it would be a bug already
    /// reported by the panicking task, so the lock is taken over rather than poisoning the driver.
    pub(super) fn state(&self) -> MutexGuard<'_, State> {
        locked(&self.state)
    }

    pub fn pending_reason(&self, key: &str) -> Option<String> {
        self.state().reasons.get(key).cloned()
    }
}
