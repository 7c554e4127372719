//! Which pod an `Allocate` call is for — pure decisions, no kube or tonic.
//!
//! kubelet's `Allocate` names device IDs, not pods. What we know is the size: a container
//! request of N devices is N GiB. So we look, among the pods bound to this node that carry
//! the extender's allocation and are not yet fully allocated, for a pending container of N GiB:
//! oldest bind first, then containers in admission order (init containers first).
//!
//! That may pick a *twin* — another pod waiting for the same size — rather than the pod
//! kubelet is actually admitting. It does not matter for correctness: the extender never
//! lets two pending containers of the same size on one node span different GPU sets (the
//! twin rule; for a one-GPU pod the set is its GPU), so any match names the right GPUs. Only
//! the bookkeeping (`allocated`/`assigned` marks) may land on the twin; [`plan_reconcile`]
//! moves it back once kubelet starts the real pod.
//!
//! A container spread over N GPUs is matched by its total, as any other: kubelet asks
//! Allocate for all its devices at once (8 GiB on each of 2 GPUs is one request of 16), so
//! nothing here counts GPUs; only [`preferred_devices`] splits the devices over the set.
//!
//! Only allocations the extender signed take part ([`Trust`]): a pod created with
//! hand-written allocation annotations is never a candidate, so it is never handed a GPU
//! and never stands in as a twin for an honest container. When the only pod that would
//! match is such a pod, [`find_untrusted`] names it, so the refusal can say which pod and why.
//!
//! When kubelet's PodResources API is reachable, [`crate::facts_plan`] moves marks by what
//! kubelet reports each container holds ([`crate::facts`]) instead: no guess about which pod
//! started or which twin carries the stray mark.
//!
//! ```text
//!   Allocate(4 devices) ──▶ find_pending(views, node, 4) ──▶ pod B / container "main" ──▶ GPU 1
//!   pod A Running, unmarked + pod B marked, Pending ──▶ plan_reconcile ──▶ marks move B → A
//!   kubelet: A holds 4 devices, B none ──────────────▶ plan_from_facts ──▶ marks move B → A
//! ```

use std::sync::Arc;

use gpushare_contract::ContainerRequest;

use crate::view::{Marks, PodView, Trust, sort_by_bind_time};

/// The pod and container an Allocate of `gib` devices on `node` is for: the first pending
/// container of exactly that size, oldest bind first, among trusted allocations only.
/// Returns the index into `views`.
pub fn find_pending<'a>(
    views: &'a [Arc<PodView>],
    node: &str,
    gib: u64,
) -> Option<(usize, &'a ContainerRequest)> {
    first_pending(views, node, gib, true)
}

/// The pod an Allocate of `gib` devices would have matched if allocations that are not the
/// extender's counted: for the refusal's message, once [`find_pending`] found nothing.
/// Returns the index into `views` and why the allocation is refused.
pub fn find_untrusted<'a>(
    views: &'a [Arc<PodView>],
    node: &str,
    gib: u64,
) -> Option<(usize, &'a str)> {
    let (index, _) = first_pending(views, node, gib, false)?;
    match &views[index].trust {
        Trust::Refused(why) => Some((index, why.as_str())),
        Trust::Verified | Trust::Unchecked => None,
    }
}

fn first_pending<'a>(
    views: &'a [Arc<PodView>],
    node: &str,
    gib: u64,
    trusted: bool,
) -> Option<(usize, &'a ContainerRequest)> {
    let mut candidates: Vec<usize> = (0..views.len())
        .filter(|&i| views[i].waiting_on(node) && views[i].trusted() == trusted)
        .collect();
    sort_by_bind_time(views, &mut candidates);
    candidates.into_iter().find_map(|i| {
        views[i]
            .allocation
            .pending_containers()
            .find(|c| c.gib == gib)
            .map(|c| (i, c))
    })
}

/// The devices to suggest to kubelet: `must_include` first, then devices of the pod's `gpus`
/// (when known; empty otherwise), then any others, `size` in all. `gpu_of` maps a device ID
/// to its GPU index.
///
/// A container spread over N GPUs holds `size / N` GiB of each, so each GPU of the set is
/// filled up to its share (counting what `must_include` already holds there) before any
/// GPU's devices go beyond it: kubelet's count per GPU then matches what the container
/// really uses, and the PodResources cross-check ([`crate::facts`]) sees devices of the
/// pod's GPUs only. With one GPU the share is the whole size, as it always was.
pub fn preferred_devices(
    available: &[String],
    must_include: &[String],
    size: usize,
    gpus: &[u32],
    gpu_of: impl Fn(&str) -> Option<u32>,
) -> Vec<String> {
    let mut chosen: Vec<String> = Vec::with_capacity(size);
    let push = |id: &String, chosen: &mut Vec<String>| {
        if chosen.len() < size && !chosen.contains(id) {
            chosen.push(id.clone());
        }
    };
    for id in must_include {
        push(id, &mut chosen);
    }
    if !gpus.is_empty() {
        let share = size / gpus.len();
        for &gpu in gpus {
            let mut held = chosen.iter().filter(|id| gpu_of(id) == Some(gpu)).count();
            for id in available.iter().filter(|id| gpu_of(id) == Some(gpu)) {
                if held >= share {
                    break;
                }
                let before = chosen.len();
                push(id, &mut chosen);
                held += chosen.len() - before;
            }
        }
        // An uneven size (not a multiple of N): the rest from the pod's GPUs still.
        for id in available
            .iter()
            .filter(|id| gpu_of(id).is_some_and(|g| gpus.contains(&g)))
        {
            push(id, &mut chosen);
        }
    }
    for id in available {
        push(id, &mut chosen);
    }
    chosen
}

/// Fixes the marks after kubelet started a pod whose Allocate calls marked a twin.
///
/// A pod on `node` that is Running but not `assigned` had all its containers allocated
/// (kubelet does not start a pod otherwise), so each of its unmarked containers was answered
/// by an Allocate call that marked a same-sized container of some other pod instead. For
/// each such container of N GiB, one N GiB mark is taken off another pod here that is not
/// Running (the most recently bound first), and the running pod is marked in full. That keeps
/// the invariant Allocate relies on: for every size, the containers still marked pending are
/// exactly the Allocate calls still to come. Returns the new marks of every pod changed
/// (index into `views`), and applies them to `views`.
///
/// Allocations that are not the extender's take no part, neither as the running pod nor as
/// the twin: they were never handed a GPU, so no mark of theirs stands for an Allocate.
///
/// Only pods for which `settled` holds are fixed: kubelet writes a pod's Running status a
/// moment after admitting it, so right after a pod starts, a twin that is "not Running" may
/// in fact be admitted already, and taking its mark would leave a later Allocate with
/// nothing to match. The caller passes pods that have been Running for a while.
pub fn plan_reconcile(
    views: &mut [Arc<PodView>],
    node: &str,
    settled: impl Fn(&PodView) -> bool,
) -> Vec<(usize, Marks)> {
    let mut changed = std::collections::BTreeSet::new();
    let mut running: Vec<usize> = (0..views.len())
        .filter(|&i| {
            let view = &views[i];
            view.bound_to(node)
                && view.trusted()
                && view.running()
                && !view.deleting
                && !view.allocation.assigned
                && settled(view)
        })
        .collect();
    sort_by_bind_time(views, &mut running);
    for target in running {
        let missing: Vec<u64> = views[target]
            .allocation
            .containers
            .iter()
            .filter(|c| !views[target].allocation.allocated.contains(&c.name))
            .map(|c| c.gib)
            .collect();
        for gib in missing {
            let marked_container = |view: &PodView| {
                view.allocation
                    .containers
                    .iter()
                    .find(|c| c.gib == gib && view.allocation.allocated.contains(&c.name))
                    .map(|c| c.name.clone())
            };
            let mut twins: Vec<usize> = (0..views.len())
                .filter(|&i| {
                    let view = &views[i];
                    i != target
                        && view.bound_to(node)
                        && view.trusted()
                        && !view.running()
                        && !view.finished()
                        && marked_container(view).is_some()
                })
                .collect();
            // The most recently bound twin is the least likely to have been admitted itself.
            sort_by_bind_time(views, &mut twins);
            twins.reverse();
            let Some(&twin) = twins.first() else {
                continue;
            };
            if let Some(name) = marked_container(&views[twin]) {
                let alloc = &mut Arc::make_mut(&mut views[twin]).allocation;
                alloc.allocated.retain(|n| *n != name);
                alloc.assigned = false;
                changed.insert(twin);
            }
        }
        let all: Vec<String> = views[target]
            .allocation
            .containers
            .iter()
            .map(|c| c.name.clone())
            .collect();
        Arc::make_mut(&mut views[target]).set_marks(&Marks {
            allocated: all,
            assigned: true,
        });
        changed.insert(target);
    }
    changed.into_iter().map(|i| (i, views[i].marks())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::fixtures::{forged, shared, view};

    fn found<V: Clone + Into<Arc<PodView>>>(views: &[V], gib: u64) -> Option<(String, String)> {
        let views: Vec<Arc<PodView>> = views.iter().cloned().map(Into::into).collect();
        find_pending(&views, "n1", gib).map(|(i, c)| (views[i].key.clone(), c.name.clone()))
    }

    #[test]
    fn picks_the_oldest_bind_with_a_container_of_that_size() {
        let views = vec![
            view("young", 30, &[("main", 4, false)]),
            view("old", 10, &[("main", 4, false)]),
            view("other", 0, &[("main", 2, false)]),
        ];
        assert_eq!(
            found(&views, 4),
            Some(("default/old".into(), "main".into()))
        );
        assert_eq!(
            found(&views, 2),
            Some(("default/other".into(), "main".into()))
        );
        assert_eq!(found(&views, 3), None);
    }

    #[test]
    fn precise_bind_times_order_correctly() {
        let mut early = view("early", 0, &[("main", 4, false)]);
        early.allocation.bind_time = "2026-11-22T10:00:05.5Z".into();
        let late = view("late", 6, &[("main", 4, false)]);
        let views = vec![late, early];
        assert_eq!(found(&views, 4).unwrap().0, "default/early");
    }

    #[test]
    fn skips_other_nodes_deleted_finished_and_assigned_pods() {
        let mut elsewhere = view("elsewhere", 0, &[("main", 4, false)]);
        elsewhere.node = Some("n2".into());
        let mut deleting = view("deleting", 1, &[("main", 4, false)]);
        deleting.deleting = true;
        let mut done = view("done", 2, &[("main", 4, false)]);
        done.phase = Some("Succeeded".into());
        let mut assigned = view("assigned", 3, &[("main", 4, false)]);
        assigned.mark_allocated("main");
        let views = vec![elsewhere, deleting, done, assigned];
        assert_eq!(found(&views, 4), None);
        let mut views = views;
        views.push(view("fresh", 9, &[("main", 4, false)]));
        assert_eq!(found(&views, 4).unwrap().0, "default/fresh");
    }

    #[test]
    fn a_pod_kubelet_admitted_waits_for_nothing_though_unmarked() {
        // With marks off (or a mark lost in a plugin restart), the older pod kubelet already
        // admitted still reads as unallocated: only its status says it holds its devices.
        let mut started = view("started", 0, &[("main", 4, false)]);
        started.admitted = true;
        started.allocation.gpu_index = 1;
        let waiting = view("waiting", 5, &[("main", 4, false)]);
        let views = vec![started, waiting];
        assert_eq!(
            found(&views, 4),
            Some(("default/waiting".into(), "main".into()))
        );
    }

    #[test]
    fn walks_containers_in_order_and_skips_allocated_ones() {
        let mut pod = view(
            "p",
            0,
            &[("init", 4, true), ("a", 4, false), ("b", 2, false)],
        );
        assert_eq!(found(std::slice::from_ref(&pod), 4).unwrap().1, "init");
        pod.mark_allocated("init");
        assert_eq!(found(std::slice::from_ref(&pod), 4).unwrap().1, "a");
        pod.mark_allocated("a");
        assert!(!pod.allocation.assigned);
        pod.mark_allocated("b");
        assert!(pod.allocation.assigned);
        assert_eq!(found(std::slice::from_ref(&pod), 4), None);
    }

    #[test]
    fn preferred_devices_stay_on_the_chosen_gpu() {
        let ids = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let gpu_of = |id: &str| id.split('-').nth(1).and_then(|g| g.parse().ok());
        let available = ids(&["G-0-0", "G-0-1", "G-1-0", "G-1-1", "G-1-2"]);
        assert_eq!(
            preferred_devices(&available, &[], 2, &[1], gpu_of),
            ids(&["G-1-0", "G-1-1"])
        );
        // must_include first, then the GPU, then anything to fill.
        assert_eq!(
            preferred_devices(&available, &ids(&["G-0-1"]), 5, &[1], gpu_of),
            ids(&["G-0-1", "G-1-0", "G-1-1", "G-1-2", "G-0-0"])
        );
        // No known pod: kubelet's own pick, the first N.
        assert_eq!(
            preferred_devices(&available, &[], 3, &[], gpu_of),
            ids(&["G-0-0", "G-0-1", "G-1-0"])
        );
        assert!(preferred_devices(&available, &[], 0, &[0], gpu_of).is_empty());
    }

    #[test]
    fn preferred_devices_split_a_multi_gpu_container_over_its_gpus() {
        let ids = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let gpu_of = |id: &str| id.split('-').nth(1).and_then(|g| g.parse().ok());
        let available = ids(&[
            "G-0-0", "G-0-1", "G-0-2", "G-1-0", "G-1-1", "G-1-2", "G-2-0", "G-2-1", "G-2-2",
        ]);
        // 4 GiB over GPUs 2 and 0: 2 of each, none of GPU 1's, though kubelet lists them
        // before GPU 2's.
        assert_eq!(
            preferred_devices(&available, &[], 4, &[2, 0], gpu_of),
            ids(&["G-2-0", "G-2-1", "G-0-0", "G-0-1"])
        );
        // must_include (devices an init container held) count toward their GPU's share.
        assert_eq!(
            preferred_devices(&available, &ids(&["G-0-2", "G-2-2"]), 4, &[2, 0], gpu_of),
            ids(&["G-0-2", "G-2-2", "G-2-0", "G-0-0"])
        );
        // A GPU of the set short of devices: the rest from the set's other GPU first.
        let short = ids(&["G-0-0", "G-1-0", "G-1-1", "G-2-0", "G-2-1", "G-2-2"]);
        assert_eq!(
            preferred_devices(&short, &[], 4, &[0, 2], gpu_of),
            ids(&["G-0-0", "G-2-0", "G-2-1", "G-2-2"])
        );
    }

    #[test]
    fn a_multi_gpu_container_is_matched_by_its_total_and_reconciled_as_any() {
        // p: 16 GiB over GPUs 0 and 1; q: 8 GiB on GPU 2. Allocate(16) is for p.
        let mut p = view("p", 10, &[("main", 16, false)]);
        p.allocation.pod_gib = 8;
        p.allocation.more_gpus = vec![gpushare_contract::GpuRef {
            index: 1,
            uuid: "GPU-1".into(),
        }];
        let q = view("q", 5, &[("main", 8, false)]);
        assert_eq!(
            found(&[p.clone(), q.clone()], 16),
            Some(("default/p".into(), "main".into()))
        );
        assert_eq!(found(&[p.clone(), q.clone()], 8).unwrap().0, "default/q");
        // A twin of p (same size, same GPU set) took p's mark; p runs: the mark moves back.
        let mut twin = p.clone();
        twin.key = "default/twin".into();
        twin.uid = "uid-twin".into();
        twin.allocation.bind_time = "2026-11-22T10:00:20Z".into();
        twin.mark_allocated("main");
        p.phase = Some("Running".into());
        let mut views = shared(vec![p, twin, q]);
        let changes = plan_reconcile(&mut views, "n1", |_| true);
        assert_eq!(changes.iter().map(|c| c.0).collect::<Vec<_>>(), [0, 1]);
        assert!(views[0].allocation.assigned);
        assert_eq!(found(&views, 16).unwrap().0, "default/twin");
    }

    #[test]
    fn reconcile_moves_marks_from_a_pending_twin_to_the_running_pod() {
        let mut running = view("a", 20, &[("main", 4, false)]);
        running.phase = Some("Running".into());
        let mut twin = view("b", 10, &[("main", 4, false)]);
        twin.mark_allocated("main");
        let unrelated = view("c", 5, &[("main", 8, false)]);
        let mut views = shared(vec![running, twin, unrelated]);
        let changes = plan_reconcile(&mut views, "n1", |_| true);
        assert_eq!(changes.len(), 2);
        assert_eq!(changes[1], (1, Marks::default()));
        assert_eq!(
            changes[0],
            (
                0,
                Marks {
                    allocated: vec!["main".into()],
                    assigned: true
                }
            )
        );
        assert!(views[0].allocation.assigned);
        // Now b waits again and a later Allocate(4) finds it.
        assert_eq!(found(&views, 4).unwrap().0, "default/b");
        assert!(plan_reconcile(&mut views, "n1", |_| true).is_empty());
    }

    #[test]
    fn reconcile_moves_only_the_missing_sizes() {
        // m (init 2, main 1) runs; its init was marked on itself, its main's Allocate(1)
        // marked p. q carries a legitimate 2 GiB mark made for someone else.
        let mut m = view("m", 10, &[("init", 2, true), ("main", 1, false)]);
        m.phase = Some("Running".into());
        m.mark_allocated("init");
        let mut p = view("p", 20, &[("main", 1, false)]);
        p.mark_allocated("main");
        let mut q = view("q", 30, &[("init", 2, true), ("main", 1, false)]);
        q.mark_allocated("init");
        let mut views = shared(vec![m, p, q]);
        let changes = plan_reconcile(&mut views, "n1", |_| true);
        let changed: Vec<usize> = changes.iter().map(|c| c.0).collect();
        assert_eq!(changed, [0, 1]);
        assert!(views[0].allocation.assigned);
        assert!(views[1].allocation.allocated.is_empty());
        assert_eq!(
            views[2].allocation.allocated,
            ["init"],
            "q keeps its 2 GiB mark"
        );
        // Exactly one 1 GiB container waits again (p's), and q's main.
        assert_eq!(found(&views, 1).unwrap().0, "default/p");
    }

    #[test]
    fn reconcile_marks_a_running_pod_without_a_twin() {
        let mut running = view("a", 20, &[("main", 4, false)]);
        running.phase = Some("Running".into());
        let mut wrong_size = view("b", 10, &[("main", 8, false)]);
        wrong_size.mark_allocated("main");
        let mut views = shared(vec![running, wrong_size]);
        let changes = plan_reconcile(&mut views, "n1", |_| true);
        assert_eq!(changes.len(), 1);
        assert_eq!(changes[0].0, 0);
        assert!(
            views[1].allocation.assigned,
            "the 8 GiB pod keeps its marks"
        );
    }

    #[test]
    fn forged_allocations_are_never_candidates_nor_twins() {
        // The forged pod is the oldest and the same size: it would win without signatures.
        let views = vec![
            forged(view("forged", 0, &[("main", 4, false)])),
            view("honest", 10, &[("main", 4, false)]),
        ];
        assert_eq!(
            found(&views, 4),
            Some(("default/honest".into(), "main".into()))
        );
        // Once the honest pod is allocated, nothing trusted waits: the forged one is named.
        let mut views = shared(views);
        Arc::make_mut(&mut views[1]).mark_allocated("main");
        assert_eq!(find_pending(&views, "n1", 4), None);
        let (index, why) = find_untrusted(&views, "n1", 4).unwrap();
        assert_eq!(
            (views[index].key.as_str(), why),
            ("default/forged", "it carries no signature")
        );
        assert_eq!(find_untrusted(&views, "n1", 8), None);
        // Without a keyring every allocation counts.
        let mut unchecked = view("unchecked", 0, &[("main", 4, false)]);
        unchecked.trust = Trust::Unchecked;
        assert_eq!(found(&[unchecked], 4).unwrap().0, "default/unchecked");
    }

    #[test]
    fn reconcile_ignores_forged_allocations() {
        // A forged pod that runs does not take an honest twin's mark...
        let mut running = forged(view("a", 20, &[("main", 4, false)]));
        running.phase = Some("Running".into());
        let mut twin = view("b", 10, &[("main", 4, false)]);
        twin.mark_allocated("main");
        let mut views = shared(vec![running, twin]);
        assert!(plan_reconcile(&mut views, "n1", |_| true).is_empty());
        assert!(views[1].allocation.assigned);
        // ...and an honest running pod does not take a forged pod's mark.
        let mut running = view("a", 20, &[("main", 4, false)]);
        running.phase = Some("Running".into());
        let mut marked = forged(view("b", 10, &[("main", 4, false)]));
        marked.mark_allocated("main");
        let mut views = shared(vec![running, marked]);
        let changes = plan_reconcile(&mut views, "n1", |_| true);
        assert_eq!(changes.iter().map(|c| c.0).collect::<Vec<_>>(), [0]);
        assert!(
            views[1].allocation.assigned,
            "the forged pod keeps its marks"
        );
    }
}
