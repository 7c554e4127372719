//! The lifecycle of the GPU memory that `bind` books before its Binding write is known to
//! have landed, and of what `filter` holds for a pod when it passes one node only. Pure
//! bookkeeping: no I/O, and no clock of its own (times are handed in). The I/O that drives it
//! is in [`crate::scheduling::bind`]; the watch and relists end it through [`crate::scheduling::view::View`].
//!
//! ```text
//!   filter passes one node ──hold──▶ Held ──bind comes, filter runs again for the pod,
//!                                           or the hold lapses ──▶ released (bind decides anew)
//!
//!   bind decides ──reserve──▶ Writing ──write ok────────────────────────▶ Written
//!                                │  write refused (404, 400, 403, 422, 429) ─▶ released
//!                                │  write ambiguous (timeout, transport, 5xx, 408, 409)
//!                                ▼                                          │
//!                            Resolving ──read: bound to our node / re-post ok ─▶ Written
//!                                │  read: pod gone, recreated, bound elsewhere,
//!                                │        or re-post refused ─────────────────▶ released
//!                                └─ read or re-post ambiguous: try again after a backoff
//!
//!   in every state: the watch shows the pod bound ───────▶ ended (the pod's own annotations
//!                                                          hold its memory from then on)
//!                   the pod is deleted, finished, or missing from a relist ─▶ released
//! ```
//!
//! Why: a reservation is GPU memory counted for a pod the watch does not show on the node
//! yet. If nothing ends it, the memory is booked for good and every later bind of that pod
//! is refused: the pod is stuck. If it ends too early (a write that timed out may still land),
//! the memory is handed out twice. So each reservation is ended by exactly one of: the watch
//! showing the bound pod, a definitive answer to the write, or a read of the pod; never by a
//! guess, and never by the HTTP caller going away (the write runs in its own task).
//!
//! Why holds: kube-scheduler binds in goroutines of their own while its next scheduling
//! cycle already runs, so the filters of the next pods come before the bind of this one.
//! When filter passes a single node, that node is kube-scheduler's decision (no scoring
//! follows), and without a hold the next pods' filters would see the same free memory and
//! pass the same node: their binds then find it full and fail, and the pods back off. A hold
//! books the memory from the filter on; the bind gives it back and decides in the same step,
//! so it books the same GPU unless something changed. A hold lapses after a few seconds, so
//! memory is never kept for a bind that does not come (a later plugin refused the pod, or the
//! scheduler went away). In DRA mode no bind comes: the hold ends when the pod's claim is
//! watched allocated, which kube-scheduler writes in its binding cycle, so it lapses only
//! after a minute (`DRA_HOLD_FOR` in `scheduling/filter.rs`).
//!
//! Each reservation carries a [`Ticket`]: the task that drives one bind attempt settles only
//! its own reservation, never a later one for the same pod.

mod booking;

use std::collections::HashMap;
use std::time::Instant;

use gpushare_allocator::{PodId, PodPlacement};

pub use booking::Hold;

/// Identifies one bind attempt's reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(u64);

/// Where a reservation's Binding stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Filter passed only this node, so kube-scheduler assumed the pod there and its bind is
    /// on the way; no Binding is written yet. Lapses at [`Reservation::held_until`].
    Held,
    /// The first Binding write is under way.
    Writing,
    /// The write's result was ambiguous: the pod is being read (and the Binding re-posted)
    /// until it is known whether it landed.
    Resolving,
    /// The Binding landed; the watch has not shown the bound pod yet.
    Written,
}

/// Memory booked by bind, not yet shown by the pod watch.
#[derive(Debug, Clone)]
pub struct Reservation {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Target node.
    pub node: String,
    /// What was booked.
    pub placement: PodPlacement,
    /// Where the Binding stands.
    pub phase: Phase,
    /// The bind attempt that owns it.
    pub ticket: Ticket,
    /// When a [`Phase::Held`] one lapses; `None` for the others.
    pub held_until: Option<Instant>,
}

/// What an answer from the API server says about a Binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The Binding is on the pod.
    Landed,
    /// The Binding is not on the pod and will not be: the memory can be released.
    NotLanded,
    /// Nobody knows yet (timeout, lost connection, server error).
    Unknown,
}

/// What [`Reservations::settle`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// The ticket no longer owns a reservation (the watch, a relist or a deletion ended it):
    /// nothing changed; the caller stops.
    Stale,
    /// The reservation is now [`Phase::Written`].
    Written,
    /// The reservation is now [`Phase::Resolving`].
    Resolving,
    /// The reservation was removed; the caller releases its memory in the allocator.
    Released,
}

/// Every reservation, by pod UID: at most one per pod.
#[derive(Debug, Default)]
pub struct Reservations {
    by_pod: HashMap<PodId, Reservation>,
    next_ticket: u64,
}

impl Reservations {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// A fresh ticket for a new reservation.
    pub fn ticket(&mut self) -> Ticket {
        self.next_ticket += 1;
        Ticket(self.next_ticket)
    }

    /// Records a reservation (replacing any earlier one of the same pod).
    pub fn insert(&mut self, uid: PodId, reservation: Reservation) {
        self.by_pod.insert(uid, reservation);
    }

    /// The pod's reservation.
    pub fn get(&self, uid: &PodId) -> Option<&Reservation> {
        self.by_pod.get(uid)
    }

    /// True if `ticket` still owns the pod's reservation and it is in `phase`.
    pub fn is(&self, uid: &PodId, ticket: Ticket, phase: Phase) -> bool {
        self.by_pod
            .get(uid)
            .is_some_and(|r| r.ticket == ticket && r.phase == phase)
    }

    /// Removes the pod's reservation (the watch or a relist ended it).
    pub fn remove(&mut self, uid: &PodId) -> Option<Reservation> {
        self.by_pod.remove(uid)
    }

    /// Takes every reservation out (a relist decides which to put back).
    pub fn take_all(&mut self) -> HashMap<PodId, Reservation> {
        std::mem::take(&mut self.by_pod)
    }

    /// How many there are.
    pub fn len(&self) -> usize {
        self.by_pod.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.by_pod.is_empty()
    }

    /// How many are in `phase`.
    pub fn count(&self, phase: Phase) -> usize {
        self.by_pod.values().filter(|r| r.phase == phase).count()
    }

    /// The pods whose hold lapsed by `now`.
    pub fn lapsed_holds(&self, now: Instant) -> Vec<PodId> {
        self.by_pod
            .iter()
            .filter(|(_, r)| r.phase == Phase::Held && r.held_until.is_none_or(|t| t <= now))
            .map(|(uid, _)| uid.clone())
            .collect()
    }

    /// Applies what the API server said about `ticket`'s Binding.
    pub fn settle(&mut self, uid: &PodId, ticket: Ticket, outcome: Outcome) -> Settled {
        let Some(reservation) = self.by_pod.get_mut(uid).filter(|r| r.ticket == ticket) else {
            return Settled::Stale;
        };
        match outcome {
            Outcome::Landed => {
                reservation.phase = Phase::Written;
                Settled::Written
            }
            // A written Binding cannot be undone by a later ambiguous or failed re-post.
            Outcome::NotLanded | Outcome::Unknown if reservation.phase == Phase::Written => {
                Settled::Written
            }
            Outcome::Unknown => {
                reservation.phase = Phase::Resolving;
                Settled::Resolving
            }
            Outcome::NotLanded => {
                self.by_pod.remove(uid);
                Settled::Released
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reservation(ticket: Ticket) -> Reservation {
        Reservation {
            namespace: "default".into(),
            name: "p".into(),
            node: "n1".into(),
            placement: PodPlacement {
                more_gpus: Vec::new(),
                exclusive: false,
                gpu: 0,
                uuid: "".into(),
                pod_gib: 4,
                pending: vec![4],
                assigned: false,
                compute: 0,
            },
            phase: Phase::Writing,
            ticket,
            held_until: None,
        }
    }

    #[test]
    fn a_write_that_lands_is_written_and_one_refused_is_released() {
        let mut set = Reservations::new();
        let uid = PodId::from("u");
        let ticket = set.ticket();
        set.insert(uid.clone(), reservation(ticket));
        assert_eq!(set.settle(&uid, ticket, Outcome::Landed), Settled::Written);
        // A late failure of a re-post does not undo a landed write.
        assert_eq!(
            set.settle(&uid, ticket, Outcome::NotLanded),
            Settled::Written
        );
        assert!(set.is(&uid, ticket, Phase::Written));

        let other = PodId::from("v");
        let ticket = set.ticket();
        set.insert(other.clone(), reservation(ticket));
        assert_eq!(
            set.settle(&other, ticket, Outcome::NotLanded),
            Settled::Released
        );
        assert!(set.get(&other).is_none());
    }

    #[test]
    fn an_ambiguous_write_resolves_and_an_old_ticket_changes_nothing() {
        let mut set = Reservations::new();
        let uid = PodId::from("u");
        let old = set.ticket();
        set.insert(uid.clone(), reservation(old));
        assert_eq!(set.settle(&uid, old, Outcome::Unknown), Settled::Resolving);
        assert_eq!(set.count(Phase::Resolving), 1);
        // The watch ended it, and a new bind of the same pod reserved again.
        set.remove(&uid);
        let new = set.ticket();
        set.insert(uid.clone(), reservation(new));
        assert_eq!(set.settle(&uid, old, Outcome::NotLanded), Settled::Stale);
        assert!(set.is(&uid, new, Phase::Writing));
        assert_eq!(set.settle(&uid, new, Outcome::Landed), Settled::Written);
    }

    #[test]
    fn only_holds_past_their_time_lapse() {
        let mut set = Reservations::new();
        let now = Instant::now();
        let later = now + std::time::Duration::from_secs(5);
        for (uid, phase, until) in [
            ("lapsed", Phase::Held, Some(now)),
            ("held", Phase::Held, Some(later)),
            ("writing", Phase::Writing, None),
        ] {
            let ticket = set.ticket();
            set.insert(
                uid.into(),
                Reservation {
                    phase,
                    held_until: until,
                    ..reservation(ticket)
                },
            );
        }
        assert_eq!(set.lapsed_holds(now), vec![PodId::from("lapsed")]);
        let mut both = set.lapsed_holds(later);
        both.sort();
        assert_eq!(both, vec![PodId::from("held"), PodId::from("lapsed")]);
    }
}
