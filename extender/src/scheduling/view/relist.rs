//! Rebuilding the view's pods from a complete list (a start, or a watch that had to relist).
//!
//! Why rebuild rather than merge: the list is the truth, and pods the watch never reported
//! gone (deleted while it was away) must leave the allocator. Two things must survive the
//! rebuild all the same: a booking an unverified allocation is not trusted to lower ("Why a
//! signature that does not verify keeps the booking" in [`crate::scheduling::view`]), and the
//! reservations of pods that still wait for their Binding ([`crate::scheduling::view::reservations`]).

use std::collections::HashMap;
use std::sync::Arc;

use gpushare_allocator::{PodId, PodPlacement};
use k8s_openapi::api::core::v1::Pod;

use super::facts::{AllocationFacts, PodFacts};
use super::{PodWarning, View, pod_key};
use crate::scheduling::view::reservations::Reservation;

impl View {
    /// On the first list after a start, the demand mix learns the GPU demand of the pods bound
    /// before, pinned to GPU models or not, as if it had seen them arrive: a booking does not
    /// say whether its pod was pinned, so seeded from bookings alone (what
    /// `gpushare_allocator::Cluster::relearn_workload` falls back on) a restarted leader would
    /// put the idle-GPU taint back and count LeastAllocated on a cluster of pinned pods.
    fn seed_demand_mix(&mut self, pods: &[PodFacts]) {
        if self.pods_synced || !self.cluster.demand().is_empty() {
            return;
        }
        for facts in pods.iter().filter(|f| f.node_name.is_some() && !f.finished) {
            if let AllocationFacts::Readable(placement) = &facts.allocation {
                let gpus = 1 + u32::try_from(placement.more_gpus.len()).unwrap_or(u32::MAX - 1);
                let pod_gib = placement.pod_gib.saturating_mul(u64::from(gpus));
                self.cluster.observe_demand(pod_gib, gpus, facts.pinned);
            }
        }
    }

    /// Replaces every pod with a fresh list (after the watch relisted) and rebuilds the
    /// allocator from it. A reservation is kept only while its pod is listed, alive and still
    /// unbound: a bound pod carries its own allocation, and a deleted one can take no Binding.
    pub fn replace_pods(&mut self, pods: &[Pod]) -> Vec<PodWarning> {
        let facts: Vec<PodFacts> = pods
            .iter()
            .filter_map(|pod| PodFacts::read(pod, &self.settings))
            .collect();
        self.replace_pod_facts(facts)
    }

    /// [`View::replace_pods`] from facts already read (what the watch buffers during a relist).
    pub fn replace_pod_facts(&mut self, pods: Vec<PodFacts>) -> Vec<PodWarning> {
        let reservations = self.reservations.take_all();
        let kept = self.untrusted_bookings(&pods);
        self.pods.clear();
        self.pod_keys.clear();
        // Bookings go with the pods; the listed pods' nominations are followed anew, and
        // booked only once every listed pod and kept reservation is back.
        self.nominations.clear();
        self.replaying = true;
        self.cluster.forget_pods();
        for (uid, node, placement) in kept {
            self.cluster.upsert_pod(uid, &node, placement);
        }
        self.rebook_claims();
        self.seed_demand_mix(&pods);
        let warnings = pods
            .into_iter()
            .filter_map(|facts| self.apply_facts(facts))
            .collect();
        self.restore_waiting_reservations(reservations);
        self.replaying = false;
        self.book_nominations();
        // The first list after a start: the fragmentation policy learns the shapes of the
        // pods bound before (a restarted extender scores like the one it replaces).
        if !self.pods_synced {
            self.cluster.relearn_workload();
        }
        self.set_pods_synced();
        warnings
    }

    /// What is booked now for the listed pods that are bound and running with an allocation
    /// that does not verify: carried over the rebuild (see the module doc).
    fn untrusted_bookings(&self, pods: &[PodFacts]) -> Vec<(PodId, Arc<str>, PodPlacement)> {
        pods.iter()
            .filter(|facts| {
                !facts.finished
                    && facts.node_name.is_some()
                    && matches!(facts.allocation, AllocationFacts::Untrusted { .. })
            })
            .filter_map(|facts| {
                let (node, placement) = self.cluster.pod(&facts.uid)?;
                Some((facts.uid.clone(), Arc::from(node), placement.clone()))
            })
            .collect()
    }

    /// Books again the `reservations` taken before the rebuild whose pods are listed, the
    /// same pod (UID), still unbound and booked nowhere else; the others end.
    fn restore_waiting_reservations(&mut self, reservations: HashMap<PodId, Reservation>) {
        for (uid, reservation) in reservations {
            let waiting = self
                .pods
                .get(pod_key(&reservation.namespace, &reservation.name).as_str())
                .is_some_and(|p| p.uid == uid && p.node_name.is_none());
            if !waiting || self.cluster.pod(&uid).is_some() {
                continue;
            }
            self.cluster.upsert_pod(
                uid.clone(),
                &reservation.node,
                reservation.placement.clone(),
            );
            self.reservations.insert(uid, reservation);
        }
    }
}

#[cfg(test)]
mod tests {
    use gpushare_testkit::fixtures::{node, pod};

    use super::super::testing::{allocated, reserve, used, view, with_uid};
    use crate::scheduling::view::reservations::{Outcome, Phase, Settled};

    /// A restarted extender lists bound pods, a third of them pinned to a GPU model: the
    /// demand mix is pinned heavy from the first list, not only once new pinned pods arrive.
    #[test]
    fn the_first_list_seeds_the_demand_mix_with_the_bound_pods_pins() {
        let mut view = view();
        view.replace_nodes(&[node("n1").gpushare().gpus(&[16, 16, 16, 16]).build()]);
        let label = view.settings().keys.gpu_model_label("Tesla T4");
        let pods: Vec<_> = (0..12)
            .map(|i| {
                let mut p = allocated(&format!("p{i}"), &format!("u{i}"), i % 4, 1);
                if i % 3 == 0 {
                    let spec = p.spec.as_mut().unwrap();
                    spec.node_selector = Some([(label.clone(), "true".to_owned())].into());
                }
                p
            })
            .collect();
        view.replace_pods(&pods);
        let demand = view.cluster.demand();
        assert!(
            (demand.pinned_share() - 1.0 / 3.0).abs() < 0.05,
            "{}",
            demand.pinned_share()
        );
        assert!(!demand.wants_idle_gpu_taint());
        // A later relist learns nothing again: the mix follows arrivals from here on.
        view.replace_pods(&pods[1..3]);
        assert!((view.cluster.demand().pinned_share() - 1.0 / 3.0).abs() < 0.05);
    }

    #[test]
    fn relist_keeps_reservations_of_waiting_pods_only() {
        let mut view = view();
        view.replace_nodes(&[node("n1").gpushare().gpus(&[16]).build()]);
        let a = with_uid(pod("a").gpu_mem(4).build(), "ua");
        let c = with_uid(pod("c").gpu_mem(4).build(), "uc");
        view.replace_pods(&[a.clone(), c.clone()]);
        let ta = reserve(&mut view, "ua", "a");
        reserve(&mut view, "ub", "b");
        let tc = reserve(&mut view, "uc", "c");
        assert_eq!(
            view.settle_reservation(&"uc".into(), tc, Outcome::Landed),
            Settled::Written
        );
        assert_eq!(used(&view, 0), 12);
        // "b" is gone from the new list: its Binding cannot land, its memory is released.
        // "a" (being written) and "c" (written, not yet watched) still wait: kept.
        view.replace_pods(&[a.clone(), c]);
        assert_eq!(used(&view, 0), 8);
        assert!(view.reservation(&"ub".into()).is_none());
        assert!(view.reservation_is(&"ua".into(), ta, Phase::Writing));
        assert!(view.reservation_is(&"uc".into(), tc, Phase::Written));
        assert!(view.is_synced());
        // The watch shows "a" bound with its allocation: the reservation is replaced.
        view.apply_pod(&allocated("a", "ua", 0, 4));
        assert!(view.reservation(&"ua".into()).is_none());
        assert_eq!(used(&view, 0), 8);
        // A late answer for "a"'s write changes nothing any more.
        assert_eq!(
            view.settle_reservation(&"ua".into(), ta, Outcome::NotLanded),
            Settled::Stale
        );
        assert_eq!(used(&view, 0), 8);
    }
}
