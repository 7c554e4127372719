//! The slots Binding writes take ([`super::BindTiming::writes_in_flight`]), and the pacing of
//! kube-scheduler's scheduling cycle on the binds queued for them.
//!
//! Why pacing: kube-scheduler binds from a goroutine per pod, outside its serial scheduling
//! cycle, so nothing slows that cycle when the API server falls behind: on a busy server it
//! hands over binds faster than they commit, the queue for write slots grows, and the binds at
//! its end wait past [`super::BindTiming::slot_wait`] and are refused. Each refusal costs more
//! than it saved: kube-scheduler writes the pod's condition and an Event, and schedules the
//! pod again. Measured on the real cluster (3,000 pods on 1,000 nodes, 2 cores;
//! docs/performance.md), that feedback drained at 0.39 of kube-scheduler alone with 2,482
//! refused attempts. filter, though, runs inside the cycle: while as many binds wait for a slot
//! as there are slots, filter waits (at most [`Pacing::max_wait`]) for the queue to shorten,
//! so the cycle runs at the pace the API server commits Bindings and a queued bind waits about
//! one write's time. Only the binding replica has a queue; a follower never waits.

use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// A slot held while one Binding write is under way.
pub type WriteSlot = OwnedSemaphorePermit;

/// How filter paces the scheduling cycle on the write queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pacing {
    /// Longest a filter call waits for the queue to shorten (zero: filter never waits;
    /// [`super::BindTiming::pace_max`]).
    pub max_wait: Duration,
}

/// Binding write slots, with a count of the binds waiting for one.
#[derive(Debug)]
pub struct WriteSlots {
    slots: Arc<Semaphore>,
    limit: usize,
    waiting: AtomicUsize,
    /// Notified whenever a waiting bind stops waiting (it got its slot or gave up).
    moved: Notify,
}

/// Counts one bind as waiting until dropped.
struct Waiting<'a>(&'a WriteSlots);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::AcqRel);
        self.0.moved.notify_waiters();
    }
}

impl WriteSlots {
    /// `limit` slots (at least one).
    pub fn new(limit: usize) -> Self {
        let limit = limit.max(1);
        Self {
            slots: Arc::new(Semaphore::new(limit)),
            limit,
            waiting: AtomicUsize::new(0),
            moved: Notify::new(),
        }
    }

    /// How many writes may be in flight.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Binds waiting for a slot now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// A slot now, if one is free.
    pub fn try_take(&self) -> Option<WriteSlot> {
        Arc::clone(&self.slots).try_acquire_owned().ok()
    }

    /// A slot, waiting at most `wait` for one; `None` when none came.
    pub async fn take(&self, wait: Duration) -> Option<WriteSlot> {
        if let Some(slot) = self.try_take() {
            return Some(slot);
        }
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let _waiting = Waiting(self);
        tokio::time::timeout(wait, Arc::clone(&self.slots).acquire_owned())
            .await
            .ok()?
            .ok()
    }

    /// Waits while at least [`Self::limit`] binds wait for a slot, at most `pacing.max_wait`;
    /// returns how long it waited.
    pub async fn pace(&self, pacing: Pacing) -> Duration {
        if self.waiting() < self.limit {
            return Duration::ZERO;
        }
        let started = Instant::now();
        let deadline = started + pacing.max_wait;
        loop {
            let mut moved = pin!(self.moved.notified());
            // Registered before the check, so a bind that stops waiting in between wakes us.
            moved.as_mut().enable();
            if self.waiting() < self.limit
                || tokio::time::timeout_at(deadline, moved).await.is_err()
            {
                return started.elapsed();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn filter_waits_while_the_queue_is_as_long_as_the_slots() {
        let slots = Arc::new(WriteSlots::new(2));
        let pacing = Pacing {
            max_wait: Duration::from_secs(1),
        };
        // Two writes in flight, nothing queued: no wait.
        let first = slots.try_take().unwrap();
        let _second = slots.try_take().unwrap();
        assert_eq!(slots.pace(pacing).await, Duration::ZERO);
        // Two binds queue behind them: filter waits until one of them gets its slot.
        let queued: Vec<_> = (0..2)
            .map(|_| {
                let slots = slots.clone();
                tokio::spawn(async move { slots.take(Duration::from_secs(5)).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(slots.waiting(), 2);
        let pacer = tokio::spawn({
            let slots = slots.clone();
            async move { slots.pace(pacing).await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!pacer.is_finished(), "filter ran on with the queue full");
        drop(first);
        let waited = pacer.await.unwrap();
        assert!(
            waited >= Duration::from_millis(300) && waited < Duration::from_secs(1),
            "{waited:?}"
        );
        assert_eq!(slots.waiting(), 1);
        assert!(queued[0].is_finished() || queued[1].is_finished());
        // The queue full again and no slot freed: filter gives up waiting after max_wait.
        let third = tokio::spawn({
            let slots = slots.clone();
            async move { slots.take(Duration::from_secs(5)).await }
        });
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(slots.waiting(), 2);
        assert_eq!(slots.pace(pacing).await, Duration::from_secs(1));
        third.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_bind_that_waits_too_long_gets_no_slot_and_leaves_the_queue() {
        let slots = WriteSlots::new(1);
        let _held = slots.try_take().unwrap();
        assert!(slots.take(Duration::from_millis(200)).await.is_none());
        assert_eq!(slots.waiting(), 0);
    }
}
