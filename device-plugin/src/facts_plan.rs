//! Marks that follow what kubelet reports each container holds — a pure decision, no kube
//! or tonic.
//!
//! When kubelet's PodResources API answers, the plugin no longer has to guess which pod an
//! Allocate was for: a container kubelet lists with devices has been allocated
//! ([`crate::facts`]). [`plan_from_facts`] moves the marks there, where
//! [`crate::matching::plan_reconcile`] infers the same from pod phases when kubelet cannot be
//! asked. [`crate::pods`] runs the one or the other at every reconcile.
//!
//! ```text
//!   kubelet: A holds 4 devices, B none ──▶ plan_from_facts ──▶ marks move B → A
//!   an intruder (no allocation) holds 4 ──▶ plan_from_facts ──▶ the pod it took from waits again
//! ```

use std::sync::Arc;

use gpushare_contract::ContainerRequest;

use crate::facts;
use crate::view::{Marks, PodView, sort_by_bind_time};

/// A container of a pod without an allocation of its own that kubelet reports holding `gib`
/// devices: its Allocate matched a waiting pod of that size and marked it, wrongly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Intruder {
    /// The intruding pod's UID.
    pub uid: String,
    /// Its container.
    pub container: String,
    /// Devices (GiB) it holds.
    pub gib: u64,
}

/// What [`plan_from_facts`] changes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FactsPlan {
    /// The new marks of every pod changed (index into `views`).
    pub marks: Vec<(usize, Marks)>,
    /// The intruders accounted for (`(uid, container)`): pass each only once.
    pub compensated: Vec<(String, String)>,
}

/// Corrects the marks from what kubelet reports each container holds, instead of from the
/// guesses of [`plan_reconcile`](crate::matching::plan_reconcile).
///
/// kubelet records a container's devices once our Allocate for it succeeded, so a container
/// it lists with devices (or that comes before one in admission order, see
/// [`facts::proven`]) has been allocated. Every Allocate marked exactly one container, so
/// for every proven container that is not marked, some other container of the same size
/// carries its mark: one that kubelet does not report holding anything, taken from a pod
/// that is not running (those kubelet lists holding nothing of ours first, then the most
/// recently bound). The proven container is marked, that mark is taken away: for every
/// size, the containers marked pending stay exactly the Allocate calls still to come.
///
/// The same holds for each [`Intruder`]: its Allocate marked a waiting pod that kubelet does
/// not report holding anything; that mark is taken back so the honest pod's own Allocate
/// finds it waiting. Pass each intruder once (the caller keeps
/// [`FactsPlan::compensated`]): after that, such marks are Allocate calls in flight.
///
/// Marks are only ever moved to containers kubelet proves allocated, and taken from
/// containers it proves are not: an Allocate that succeeded after the listing only leaves
/// a mark where kubelet shows nothing yet, which the next listing settles. Pods `judged`
/// rejects (first seen after the listing was taken) take no part; nor do allocations that
/// are not the extender's.
pub fn plan_from_facts(
    views: &mut [Arc<PodView>],
    node: &str,
    facts: &facts::KubeletFacts,
    judged: impl Fn(&PodView) -> bool,
    intruders: &[Intruder],
) -> FactsPlan {
    let eligible: Vec<bool> = views
        .iter()
        .map(|view| {
            view.bound_to(node)
                && view.trusted()
                && !view.finished()
                && !view.deleting
                && judged(view)
        })
        .collect();
    let proven: Vec<Vec<bool>> = views
        .iter()
        .zip(&eligible)
        .map(|(view, &ok)| {
            if ok {
                facts::proven(view, facts)
            } else {
                vec![false; view.allocation.containers.len()]
            }
        })
        .collect();
    let donors = Donors::new(views, facts, &eligible, &proven);

    let mut changed = std::collections::BTreeSet::new();
    let mut targets: Vec<usize> = (0..views.len())
        .filter(|&i| unmarked_proven(&views[i], &proven[i]).next().is_some())
        .collect();
    sort_by_bind_time(views, &mut targets);
    for target in targets {
        let missing: Vec<(String, u64)> = unmarked_proven(&views[target], &proven[target])
            .map(|c| (c.name.clone(), c.gib))
            .collect();
        for (name, gib) in missing {
            if let Some(donor) = donors.take_mark(views, gib, Some(target)) {
                changed.insert(donor);
            }
            Arc::make_mut(&mut views[target]).mark_allocated(&name);
        }
        changed.insert(target);
    }
    let mut compensated = Vec::with_capacity(intruders.len());
    for intruder in intruders {
        if let Some(donor) = donors.take_mark(views, intruder.gib, None) {
            changed.insert(donor);
        }
        compensated.push((intruder.uid.clone(), intruder.container.clone()));
    }
    FactsPlan {
        marks: changed.into_iter().map(|i| (i, views[i].marks())).collect(),
        compensated,
    }
}

/// Whether `view` carries a mark for its container `name`.
fn marked(view: &PodView, name: &str) -> bool {
    view.allocation.allocated.iter().any(|n| n == name)
}

/// The containers of `view` that kubelet proves allocated (`proven`, by position) but that
/// carry no mark.
fn unmarked_proven<'a>(
    view: &'a PodView,
    proven: &'a [bool],
) -> impl Iterator<Item = &'a ContainerRequest> {
    view.allocation
        .containers
        .iter()
        .enumerate()
        .filter(move |(pos, c)| proven[*pos] && !marked(view, &c.name))
        .map(|(_, c)| c)
}

/// The pods a mark may be taken from in [`plan_from_facts`].
struct Donors<'a> {
    /// Indices into the views, best first: eligible pods that are not running, those
    /// kubelet lists holding nothing of ours first, then the most recently bound.
    order: Vec<usize>,
    /// Which containers kubelet proves allocated, per view (by position): their marks stay.
    proven: &'a [Vec<bool>],
}

impl<'a> Donors<'a> {
    fn new(
        views: &[Arc<PodView>],
        facts: &facts::KubeletFacts,
        eligible: &[bool],
        proven: &'a [Vec<bool>],
    ) -> Self {
        let mut order: Vec<usize> = (0..views.len())
            .filter(|&i| eligible[i] && !views[i].running())
            .collect();
        sort_by_bind_time(views, &mut order);
        order.reverse();
        order.sort_by_key(|&i| facts.pod(&views[i].key).is_some_and(|p| p.holds_any()));
        Self { order, proven }
    }

    /// Takes the mark of one `gib` GiB container kubelet does not prove allocated from the
    /// best donor other than `except`; returns that donor.
    fn take_mark(
        &self,
        views: &mut [Arc<PodView>],
        gib: u64,
        except: Option<usize>,
    ) -> Option<usize> {
        for &donor in &self.order {
            if Some(donor) == except {
                continue;
            }
            let found = views[donor]
                .allocation
                .containers
                .iter()
                .enumerate()
                .find(|(pos, c)| {
                    c.gib == gib && !self.proven[donor][*pos] && marked(&views[donor], &c.name)
                })
                .map(|(_, c)| c.name.clone());
            if let Some(name) = found {
                let alloc = &mut Arc::make_mut(&mut views[donor]).allocation;
                alloc.allocated.retain(|n| *n != name);
                alloc.assigned = false;
                return Some(donor);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matching::{find_pending, plan_reconcile};
    use crate::view::fixtures::{forged, shared, view};

    fn found<V: Clone + Into<Arc<PodView>>>(views: &[V], gib: u64) -> Option<(String, String)> {
        let views: Vec<Arc<PodView>> = views.iter().cloned().map(Into::into).collect();
        find_pending(&views, "n1", gib).map(|(i, c)| (views[i].key.clone(), c.name.clone()))
    }

    fn kubelet(pods: &[(&str, &[(&str, u64)])]) -> facts::KubeletFacts {
        facts::KubeletFacts::new(
            std::time::Instant::now(),
            pods.iter()
                .map(|(name, _)| ("default".to_owned(), (*name).to_owned())),
            pods.iter().flat_map(|(name, containers)| {
                containers.iter().map(|&(c, n)| {
                    let ids = (0..n).map(|s| format!("GPU-0-{s}")).collect();
                    ("default".to_owned(), (*name).to_owned(), c.to_owned(), ids)
                })
            }),
        )
    }

    fn marks(allocated: &[&str], assigned: bool) -> Marks {
        Marks {
            allocated: allocated.iter().map(|s| (*s).to_owned()).collect(),
            assigned,
        }
    }

    #[test]
    fn facts_move_marks_to_the_pod_kubelet_gave_the_devices() {
        // b was admitted first; its Allocate matched the older twin a. kubelet says b holds
        // the devices, a nothing. b is not even Running yet: no need to wait for it.
        let mut a = view("a", 10, &[("main", 4, false)]);
        a.mark_allocated("main");
        let b = view("b", 20, &[("main", 4, false)]);
        let mut views = shared(vec![a, b]);
        let facts = kubelet(&[("a", &[]), ("b", &[("main", 4)])]);
        let plan = plan_from_facts(&mut views, "n1", &facts, |_| true, &[]);
        assert_eq!(
            plan.marks,
            [(0, Marks::default()), (1, marks(&["main"], true))]
        );
        assert_eq!(found(&views, 4).unwrap().0, "default/a");
        // Settled: nothing more to do.
        let plan = plan_from_facts(&mut views, "n1", &facts, |_| true, &[]);
        assert!(plan.marks.is_empty());
    }

    #[test]
    fn facts_pick_the_twin_that_holds_nothing_where_guesses_pick_the_youngest() {
        // c runs, unmarked; a and b both carry a 4 GiB mark and neither is Running yet, but
        // kubelet already gave b its devices (its status write is late). The guess takes the
        // most recently bound twin's mark (b's), wrongly; the facts take a's.
        let mut a = view("a", 10, &[("main", 4, false)]);
        a.mark_allocated("main");
        let mut b = view("b", 20, &[("main", 4, false)]);
        b.mark_allocated("main");
        let mut c = view("c", 5, &[("main", 4, false)]);
        c.phase = Some("Running".into());
        let mut guessed = shared(vec![a.clone(), b.clone(), c.clone()]);
        plan_reconcile(&mut guessed, "n1", |_| true);
        assert!(!guessed[1].allocation.assigned, "the guess took b's mark");

        let mut views = shared(vec![a, b, c]);
        let facts = kubelet(&[("a", &[]), ("b", &[("main", 4)]), ("c", &[("main", 4)])]);
        let plan = plan_from_facts(&mut views, "n1", &facts, |_| true, &[]);
        assert_eq!(
            plan.marks,
            [(0, Marks::default()), (2, marks(&["main"], true))]
        );
        assert!(views[1].allocation.assigned, "b keeps its mark");
    }

    #[test]
    fn facts_prove_init_containers_kubelet_does_not_list() {
        // kubelet lists app containers only; main holding devices proves init was allocated.
        let mut p = view("p", 10, &[("init", 2, true), ("main", 1, false)]);
        p.phase = Some("Running".into());
        let mut q = view("q", 20, &[("init", 2, true), ("main", 1, false)]);
        q.mark_allocated("init");
        q.mark_allocated("main");
        let mut views = shared(vec![p, q]);
        let facts = kubelet(&[("p", &[("main", 1)]), ("q", &[])]);
        let plan = plan_from_facts(&mut views, "n1", &facts, |_| true, &[]);
        assert_eq!(
            plan.marks,
            [(0, marks(&["init", "main"], true)), (1, Marks::default())]
        );
    }

    #[test]
    fn an_intruders_allocation_is_given_back_once() {
        // A pod without an allocation was admitted: its Allocate(4) marked a, which waits.
        let mut a = view("a", 10, &[("main", 4, false)]);
        a.mark_allocated("main");
        let mut views = shared(vec![a, view("b", 20, &[("main", 8, false)])]);
        let facts = kubelet(&[("a", &[]), ("intruder", &[("main", 4)])]);
        let intruder = Intruder {
            uid: "uid-intruder".into(),
            container: "main".into(),
            gib: 4,
        };
        let plan = plan_from_facts(
            &mut views,
            "n1",
            &facts,
            |_| true,
            std::slice::from_ref(&intruder),
        );
        assert_eq!(plan.marks, [(0, Marks::default())]);
        assert_eq!(
            plan.compensated,
            [("uid-intruder".to_owned(), "main".to_owned())]
        );
        assert_eq!(found(&views, 4).unwrap().0, "default/a", "a waits again");
        // a's own Allocate marks it; kubelet has not listed that yet. Passed again, the
        // intruder would take that mark: the caller passes it once.
        Arc::make_mut(&mut views[0]).mark_allocated("main");
        let plan = plan_from_facts(&mut views, "n1", &facts, |_| true, &[]);
        assert!(plan.marks.is_empty());
    }

    #[test]
    fn facts_leave_unjudged_forged_and_running_pods_alone() {
        let mut late = view("late", 10, &[("main", 4, false)]);
        late.mark_allocated("main");
        let mut forged_marked = forged(view("forged", 11, &[("main", 4, false)]));
        forged_marked.mark_allocated("main");
        let mut running = view("running", 12, &[("main", 4, false)]);
        running.phase = Some("Running".into());
        running.mark_allocated("main");
        let holder = view("holder", 20, &[("main", 4, false)]);
        let mut views = shared(vec![late, forged_marked, running, holder]);
        let facts = kubelet(&[
            ("late", &[]),
            ("forged", &[]),
            ("running", &[]),
            ("holder", &[("main", 4)]),
        ]);
        let plan = plan_from_facts(&mut views, "n1", &facts, |v| v.key != "default/late", &[]);
        // holder is marked; no donor qualifies: late is not judged, forged is not the
        // extender's, running is Running.
        assert_eq!(plan.marks, [(3, marks(&["main"], true))]);
        // A forged pod kubelet lists with devices is never marked from the facts either.
        let mut views = shared(vec![forged(view("f", 1, &[("main", 4, false)]))]);
        let facts = kubelet(&[("f", &[("main", 4)])]);
        assert!(
            plan_from_facts(&mut views, "n1", &facts, |_| true, &[])
                .marks
                .is_empty()
        );
    }

    proptest::proptest! {
        /// Whatever order kubelet admits pods in (so whichever twins Allocate's marks land
        /// on), once kubelet lists what it handed out, the marks are exactly that: every
        /// container of an admitted pod, nothing of the others; and a second pass changes
        /// nothing.
        #[test]
        fn facts_make_the_marks_exactly_what_kubelet_holds(
            pods in proptest::collection::vec(
                (1u64..4, proptest::option::of(1u64..4), proptest::bool::ANY, proptest::bool::ANY),
                1..10,
            ),
            seed in proptest::num::u64::ANY,
        ) {
            let mut views = shared(
                pods.iter()
                    .enumerate()
                    .map(|(i, &(main, init, _, _))| {
                        let mut containers = Vec::new();
                        if let Some(gib) = init {
                            containers.push(("init", gib, true));
                        }
                        containers.push(("main", main, false));
                        view(&format!("p{i}"), u32::try_from(i).unwrap(), &containers)
                    })
                    .collect(),
            );
            let mut order: Vec<usize> = (0..pods.len()).filter(|&i| pods[i].2).collect();
            order.sort_by_key(|&i| (i as u64 + 1).wrapping_mul(seed | 1).rotate_left(29));
            for &i in &order {
                let sizes: Vec<u64> = views[i].allocation.containers.iter().map(|c| c.gib).collect();
                for gib in sizes {
                    let (j, name) = find_pending(&views, "n1", gib)
                        .map(|(j, c)| (j, c.name.clone()))
                        .expect("an admitted pod's own container waits at least");
                    Arc::make_mut(&mut views[j]).mark_allocated(&name);
                }
                if pods[i].3 {
                    Arc::make_mut(&mut views[i]).phase = Some("Running".into());
                }
            }
            let names: Vec<String> = (0..pods.len()).map(|i| format!("p{i}")).collect();
            let held: Vec<(&str, Vec<(&str, u64)>)> = names
                .iter()
                .enumerate()
                .map(|(i, name)| {
                    let containers = if pods[i].2 { vec![("main", pods[i].0)] } else { vec![] };
                    (name.as_str(), containers)
                })
                .collect();
            let listing: Vec<(&str, &[(&str, u64)])> =
                held.iter().map(|(n, c)| (*n, c.as_slice())).collect();
            let facts = kubelet(&listing);
            plan_from_facts(&mut views, "n1", &facts, |_| true, &[]);
            for (i, view) in views.iter().enumerate() {
                let all: Vec<&str> = view.allocation.containers.iter().map(|c| c.name.as_str()).collect();
                let mut marked: Vec<&str> = view.allocation.allocated.iter().map(String::as_str).collect();
                marked.sort_by_key(|name| all.iter().position(|n| n == name));
                if pods[i].2 {
                    proptest::prop_assert_eq!(&marked, &all, "{} was admitted", view.key);
                    proptest::prop_assert!(view.allocation.assigned);
                } else {
                    proptest::prop_assert!(marked.is_empty(), "{} waits: {:?}", view.key, marked);
                    proptest::prop_assert!(!view.allocation.assigned);
                }
            }
            let again = plan_from_facts(&mut views, "n1", &facts, |_| true, &[]);
            proptest::prop_assert!(again.marks.is_empty());
        }
    }
}
