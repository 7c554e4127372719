//! The view's side of bind's reservations and filter's holds: the record of each booking the
//! allocator holds for a pod the watch does not show bound yet, and the release that gives
//! the memory back together with the record, so the two never disagree.
//!
//! The lifecycle itself (phases, tickets, why each ends how it ends) is drawn in
//! [`crate::scheduling::view::reservations`]; the watch and relists end reservations in `pods.rs` and
//! `relist.rs`.

use std::time::Instant;

use gpushare_allocator::{PodId, PodPlacement, Policy, Request};

use super::{Outcome, Phase, Reservation, Settled, Ticket};
use crate::scheduling::view::View;

/// Which pod [`View::hold`] holds memory for, where, and until when.
#[derive(Debug, Clone)]
pub struct Hold<'a> {
    /// The pod's UID.
    pub uid: PodId,
    /// Pod namespace.
    pub namespace: &'a str,
    /// Pod name.
    pub name: &'a str,
    /// The one node filter passed.
    pub node: &'a str,
    /// When the hold lapses if no bind came.
    pub until: Instant,
}

impl View {
    /// A reservation by UID.
    pub fn reservation(&self, uid: &PodId) -> Option<&Reservation> {
        self.reservations.get(uid)
    }

    /// Number of reservations the watch has not shown yet.
    pub fn reservation_count(&self) -> usize {
        self.reservations.len()
    }

    /// Number of reservations in `phase`.
    pub fn reservations_in(&self, phase: Phase) -> usize {
        self.reservations.count(phase)
    }

    /// True while `ticket` owns the pod's reservation and it is in `phase`.
    pub fn reservation_is(&self, uid: &PodId, ticket: Ticket, phase: Phase) -> bool {
        self.reservations.is(uid, ticket, phase)
    }

    /// Records the reservation of `placement` that [`gpushare_allocator::Cluster::reserve`]
    /// just booked, its Binding about to be written; the ticket settles it.
    pub fn add_reservation(
        &mut self,
        uid: PodId,
        namespace: &str,
        name: &str,
        node: &str,
        placement: PodPlacement,
    ) -> Ticket {
        let reservation = self.new_reservation([namespace, name, node], placement, Phase::Writing);
        let ticket = reservation.ticket;
        self.reservations.insert(uid, reservation);
        ticket
    }

    /// A reservation of pod `namespace/name` on `node` with a fresh ticket, not yet recorded.
    fn new_reservation(
        &mut self,
        [namespace, name, node]: [&str; 3],
        placement: PodPlacement,
        phase: Phase,
    ) -> Reservation {
        Reservation {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            node: node.to_owned(),
            placement,
            phase,
            ticket: self.reservations.ticket(),
            held_until: None,
        }
    }

    /// Holds `request`'s memory for pod `uid` on `node` until `until`: filter passed that node
    /// alone, so kube-scheduler binds the pod there next, and the filters that run before the
    /// bind must see the memory taken ([`crate::scheduling::view::reservations`], "Why holds"). A hold the pod
    /// already had is given back first; a pod already booked otherwise (its bind under way or
    /// its Binding written) gets none. False when nothing was held.
    ///
    /// The GPUs held are those the pod will get: the policy's choice in extender mode (bind
    /// decides with it), the first with room in DRA mode (kube-scheduler's allocator takes
    /// devices so, [`Cluster::reserve_first_fit`]).
    ///
    /// [`Cluster::reserve_first_fit`]: gpushare_allocator::Cluster::reserve_first_fit
    pub fn hold(&mut self, hold: Hold<'_>, request: &Request, policy: Policy) -> bool {
        let Hold {
            uid,
            namespace,
            name,
            node,
            until,
        } = hold;
        self.release_hold(&uid);
        if self.reservations.get(&uid).is_some() {
            return false;
        }
        // In DRA mode kube-scheduler's allocator, not the policy, picks the GPUs: first fit.
        let booked = if self.settings.dra.is_some() {
            self.cluster.reserve_first_fit(uid.clone(), node, request)
        } else {
            self.cluster.reserve(uid.clone(), node, request, policy)
        };
        if booked.is_err() {
            return false;
        }
        let Some((_, placement)) = self.cluster.pod(&uid) else {
            return false;
        };
        let placement = placement.clone();
        let reservation = Reservation {
            held_until: Some(until),
            ..self.new_reservation([namespace, name, node], placement, Phase::Held)
        };
        self.reservations.insert(uid, reservation);
        true
    }

    /// Gives back the pod's hold, if it has one: its bind came (and decides anew), or filter
    /// runs for it again.
    ///
    /// What a preemption nomination booked for the pod is given back too (filter and bind
    /// decide for the pod itself); [`View::book_nominations`] books it again if they leave
    /// the pod without a booking.
    pub fn release_hold(&mut self, uid: &PodId) -> bool {
        if self.unbook_nomination(uid) {
            return true;
        }
        if self
            .reservations
            .get(uid)
            .is_none_or(|r| r.phase != Phase::Held)
        {
            return false;
        }
        self.reservations.remove(uid);
        self.cluster.release(uid);
        true
    }

    /// Gives back every hold whose bind did not come by `now`; how many.
    pub fn release_lapsed_holds(&mut self, now: Instant) -> usize {
        let lapsed = self.reservations.lapsed_holds(now);
        for uid in &lapsed {
            self.release_hold(uid);
        }
        if !lapsed.is_empty() {
            self.book_nominations();
        }
        lapsed.len()
    }

    /// Applies what the API server said about `ticket`'s Binding; a released reservation
    /// gives its memory back at once.
    pub fn settle_reservation(&mut self, uid: &PodId, ticket: Ticket, outcome: Outcome) -> Settled {
        let settled = self.reservations.settle(uid, ticket, outcome);
        if settled == Settled::Released {
            self.cluster.release(uid);
            self.book_nominations();
        }
        settled
    }
}
