//! The view's side of preemption: which pods of a node a preemptor may evict, and memory
//! held for the pods preemption made room for.
//!
//! Who may be evicted: the pods booked on the node that the watch shows with a lower
//! priority than the preemptor. A pod booked only by a bind under way (no watched record
//! yet) is never one: its priority is not known.
//!
//! Why hold memory for nominated pods: once kube-scheduler has evicted pods for a preemptor, it sets the preemptor's
//! `status.nominatedNodeName` and schedules it again when the victims are gone. Its own
//! plugins count a nominated pod on its node meanwhile; the extender's filter is sent nothing
//! about it. Without a booking of our own, the first smaller pod filtered after the victims
//! left would take the GPU they freed, and the preemptor, which cost those pods their lives,
//! would wait again (and preempt again).
//!
//! So a pod the watch shows nominated and unbound gets its request booked on the nominated
//! node as soon as it fits there (usually when the last victim's deletion reaches the watch),
//! the most important nominated pods first. The booking is the pod's own, keyed by its UID
//! like a filter hold: filter and bind give it back before they decide for the pod itself
//! ([`View::release_hold`]), and it is not booked again while they do ([`DECIDING`]): filter
//! books it back when it held nothing for the pod ([`View::resume_nomination`]), a bind
//! replaces it with its own reservation. Otherwise it is booked whenever the pod is left
//! without one (not in the middle of a relist: only once every listed pod and reservation is
//! back, so the nominated pod cannot take memory a pod not yet replayed holds). It
//! ends when the pod is bound (its annotations book it), deleted, finished or no longer
//! nominated (kube-scheduler clears the nomination when it places the pod elsewhere or a more
//! important preemptor takes the node).

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_allocator::{Evictable, PodId, PodPlacement, Policy, Request};

use super::View;

/// How long a nomination whose booking filter, bind or preempt gave back stays unbooked
/// while they decide for the pod: longer than any of them takes, short enough that a bind
/// that fails without settling leaves the GPU unheld only briefly.
pub const DECIDING: Duration = Duration::from_secs(2);

/// A pod nominated for a node by preemption, waiting to be bound.
#[derive(Debug, Clone)]
pub(super) struct Nomination {
    /// The nominated node.
    node: Arc<str>,
    /// What the pod asks for.
    request: Request,
    /// Its priority: nominations are booked the most important first.
    priority: i32,
    /// Whether its memory is booked in the allocator now.
    booked: bool,
    /// Until when it is left unbooked: its booking was given back for a decision about the
    /// pod itself ([`DECIDING`]).
    deciding_until: Option<Instant>,
}

impl View {
    /// The pods booked on `node` that a preemptor of `priority` may evict: watched, of lower
    /// priority. PodDisruptionBudgets are not read: none counts as violated.
    pub fn evictable_on(&self, node: &str, priority: i32) -> Vec<Evictable> {
        let Some(node) = self.cluster.node(node) else {
            return Vec::new();
        };
        node.pods()
            .filter_map(|(uid, _)| {
                let key = self.pod_keys.get(uid)?;
                let pod = self.pods.get(key)?;
                (pod.priority < priority && pod.node_name.is_some()).then(|| Evictable {
                    uid: uid.clone(),
                    priority: pod.priority,
                    violates_budget: false,
                })
            })
            .collect()
    }

    /// Records that pod `uid`, unbound, is nominated for `node` with `request` (from the
    /// watch). A nomination for another node gives back what the old one booked.
    pub(super) fn nominate(&mut self, uid: &PodId, node: &str, request: Request, priority: i32) {
        if let Some(known) = self.nominations.get(uid)
            && *known.node == *node
        {
            return;
        }
        self.end_nomination(uid);
        let node = self.cluster.node_name(node);
        self.nominations.insert(
            uid.clone(),
            Nomination {
                node,
                request,
                priority,
                booked: false,
                deciding_until: None,
            },
        );
    }

    /// Forgets pod `uid`'s nomination, giving back what it booked.
    pub(super) fn end_nomination(&mut self, uid: &PodId) {
        if let Some(nomination) = self.nominations.remove(uid)
            && nomination.booked
            && self.reservations.get(uid).is_none()
        {
            self.cluster.release(uid);
        }
    }

    /// Gives back what pod `uid`'s nomination booked, keeping the nomination, and leaves it
    /// unbooked for [`DECIDING`] (filter, bind or preempt decides for the pod itself next).
    /// True when something was given back.
    pub(super) fn unbook_nomination(&mut self, uid: &PodId) -> bool {
        let Some(nomination) = self.nominations.get_mut(uid) else {
            return false;
        };
        if !nomination.booked {
            return false;
        }
        nomination.booked = false;
        nomination.deciding_until = Some(Instant::now() + DECIDING);
        if self.reservations.get(uid).is_none() {
            self.cluster.release(uid);
        }
        true
    }

    /// Ends the decision about pod `uid` (filter held nothing for it, or preempt answered):
    /// its nomination may be booked again, and is if it fits.
    pub fn resume_nomination(&mut self, uid: &PodId) {
        if let Some(nomination) = self.nominations.get_mut(uid) {
            nomination.deciding_until = None;
        }
        self.book_nominations();
    }

    /// Books every nomination not booked yet whose request fits its node now, the most
    /// important first; pods with a hold or a bind under way are left to those, and so are
    /// pods being decided for. Nothing during a relist's replay.
    pub fn book_nominations(&mut self) {
        if self.replaying || self.nominations.values().all(|n| n.booked) {
            return;
        }
        let now = Instant::now();
        let mut waiting: Vec<(i32, PodId)> = self
            .nominations
            .iter()
            .filter(|(_, n)| !n.booked && n.deciding_until.is_none_or(|until| until <= now))
            .map(|(uid, n)| (n.priority, uid.clone()))
            .collect();
        waiting.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        for (_, uid) in waiting {
            if self.reservations.get(&uid).is_some() || self.cluster.pod(&uid).is_some() {
                continue;
            }
            let Some(nomination) = self.nominations.get_mut(&uid) else {
                continue;
            };
            let node = nomination.node.clone();
            if self
                .cluster
                .reserve(uid.clone(), &node, &nomination.request, Policy::Binpack)
                .is_err()
            {
                continue;
            }
            nomination.booked = true;
            // Booked with no container waiting for a device: the pod is not bound, so no
            // kubelet will ask for it yet, and the twin rule must not pin same-size pods to
            // a GPU they could only wait on.
            if let Some((_, placement)) = self.cluster.pod(&uid) {
                let placement = PodPlacement {
                    pending: Vec::new(),
                    assigned: true,
                    ..placement.clone()
                };
                self.cluster.upsert_pod(uid, &node, placement);
            }
        }
    }

    /// How many pods are nominated, and how many of those have their memory booked.
    pub fn nominations(&self) -> (usize, usize) {
        let booked = self.nominations.values().filter(|n| n.booked).count();
        (self.nominations.len(), booked)
    }

    /// Whether a nominated pod waits for its memory to be booked.
    pub fn has_unbooked_nominations(&self) -> bool {
        self.nominations.values().any(|n| !n.booked)
    }

    /// The node pod `uid` is nominated for, if it is.
    pub fn nominated_node(&self, uid: &PodId) -> Option<&str> {
        self.nominations.get(uid).map(|n| &*n.node)
    }
}
