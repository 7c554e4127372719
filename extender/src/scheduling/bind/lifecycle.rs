//! Property test of the reservation lifecycle: random interleavings of binds, Binding writes
//! that commit at once, late or never, answers that are clear or ambiguous (the caller having
//! gone away changes nothing: the write's task answers whoever listens), resolutions, watch
//! events, relists, restarts, deletions and recreations, against a model of the API server.
//!
//! With two replicas: `Failover` makes the warm standby the leader, as a lost Lease does. The
//! deposed leader keeps its view and reservations; answers to its writes still reach it, and
//! it resolves them by reading only: a write of an earlier term is never re-posted (not even
//! by a replica leading again later), and the pod still unbound releases it. The new leader
//! binds only once the fence of `crate::leader` holds: every write of an earlier leader has
//! met its fate (its client timeout ended within the old lease) and its own watch has caught
//! up (the catch-up).
//!
//! Invariants:
//! - the API server never holds more GiB on a GPU than it has (no over-commit);
//! - the view books each pod on at most one node;
//! - once every write has met its fate, every answer is in, every resolution has run and the
//!   watch has caught up, no reservation is left and the view equals one rebuilt from the
//!   API server's pods.

use std::collections::{BTreeMap, HashSet, VecDeque};

use gpushare_allocator::{PodId, Policy};
use gpushare_testkit::fixtures::{node, pod};
use k8s_openapi::api::core::v1::{Node, Pod};
use proptest::prelude::*;

use super::{Decision, decide, read_verdict};
use crate::scheduling::ports::{BindingTarget, PodOnServer};
use crate::scheduling::view::reservations::{Outcome, Phase, Settled, Ticket};
use crate::scheduling::view::{Settings, View};
use crate::wire::ExtenderBindingArgs;

/// GiB each pod asks for; the GPUs below hold about half of them at once.
const POD_GIB: [u64; 6] = [2, 4, 8, 4, 6, 3];
const NODES: [(&str, &[u64]); 2] = [("n1", &[16, 8]), ("n2", &[8])];

#[derive(Debug, Clone)]
enum Op {
    /// kube-scheduler asks to bind pod `pod` to node `node`.
    Bind { pod: usize, node: usize },
    /// A Binding still on its way commits now (or meets a conflict).
    ServerApplies { write: usize },
    /// A Binding still on its way is lost: it will never commit.
    ServerDrops { write: usize },
    /// The first answer to a write reaches its task: clear if the server has decided, or a
    /// timeout (`ambiguous`) whatever the server did.
    Answer { write: usize, ambiguous: bool },
    /// One resolution step of a write that got no clear answer.
    Resolve { write: usize },
    /// The pod watch delivers its next event.
    Watch,
    /// The pod watch relists.
    Relist,
    /// The extender restarts (its reservations are gone; its writes are not).
    Restart,
    /// The standby replica takes over the Lease; the leader becomes the standby.
    Failover,
    /// The standby's pod watch delivers its next event.
    StandbyWatch,
    /// A user deletes a pod.
    Delete { pod: usize },
    /// A user creates the pod again (a new UID).
    Recreate { pod: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..POD_GIB.len(), 0..NODES.len()).prop_map(|(pod, node)| Op::Bind { pod, node }),
        3 => (0..16usize).prop_map(|write| Op::ServerApplies { write }),
        1 => (0..16usize).prop_map(|write| Op::ServerDrops { write }),
        3 => (0..16usize, any::<bool>()).prop_map(|(write, ambiguous)| Op::Answer { write, ambiguous }),
        2 => (0..16usize).prop_map(|write| Op::Resolve { write }),
        4 => Just(Op::Watch),
        1 => Just(Op::Relist),
        1 => Just(Op::Restart),
        1 => Just(Op::Failover),
        3 => Just(Op::StandbyWatch),
        1 => (0..POD_GIB.len()).prop_map(|pod| Op::Delete { pod }),
        1 => (0..POD_GIB.len()).prop_map(|pod| Op::Recreate { pod }),
    ]
}

/// A pod as the API server holds it.
#[derive(Debug, Clone)]
struct ServerPod {
    uid: String,
    bound: Option<(String, BTreeMap<String, String>)>,
}

/// What became of a Binding at the API server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Pending,
    Committed,
    /// Refused with 409: the pod was bound already or recreated.
    Conflict,
    Lost,
}

#[derive(Debug)]
struct Write {
    target: BindingTarget,
    uid: PodId,
    ticket: Ticket,
    instance: u32,
    /// The leadership term it was decided in.
    term: u32,
    fate: Fate,
    answered: bool,
    resolving: bool,
}

struct World {
    pods: Vec<Option<ServerPod>>,
    next_uid: u32,
    events: VecDeque<(Pod, bool)>,
    writes: Vec<Write>,
    view: View,
    instance: u32,
    /// True from a restart or a failover until the grace (or catch-up) is over.
    grace: bool,
    /// Writes sent before the last restart or failover: the fence waits for their fate.
    fenced: usize,
    /// Counts restarts and failovers: a new term of leadership each.
    term: u32,
    /// The other replica: its view, its watch's queue, and the instance whose writes it
    /// settles (a deposed leader's).
    standby: View,
    standby_events: VecDeque<(Pod, bool)>,
    standby_instance: u32,
}

fn settings() -> Settings {
    Settings::new(
        gpushare_contract::DEFAULT_RESOURCE,
        gpushare_contract::DEFAULT_DOMAIN,
        "gpushare=true",
    )
}

fn nodes() -> Vec<Node> {
    NODES
        .iter()
        .map(|(name, gpus)| node(name).gpushare().gpus(gpus).build())
        .collect()
}

fn pod_name(index: usize) -> String {
    format!("p{index}")
}

/// Position `n` among `len` writes, wrapped around; `None` when there are none.
fn pick(n: usize, len: usize) -> Option<usize> {
    (len > 0).then(|| n % len)
}

/// A watch delivers its next event, if one is queued, to `view`.
fn deliver(view: &mut View, events: &mut VecDeque<(Pod, bool)>) {
    if let Some((object, deleted)) = events.pop_front() {
        if deleted {
            view.delete_pod(&object);
        } else {
            view.apply_pod(&object);
        }
    }
}

impl World {
    fn new() -> Self {
        let mut world = World {
            pods: Vec::new(),
            next_uid: 0,
            events: VecDeque::new(),
            writes: Vec::new(),
            view: View::new(settings()),
            instance: 0,
            grace: false,
            fenced: 0,
            term: 0,
            standby: View::new(settings()),
            standby_events: VecDeque::new(),
            standby_instance: 1,
        };
        for _ in POD_GIB {
            let uid = world.fresh_uid();
            world.pods.push(Some(ServerPod { uid, bound: None }));
        }
        world.start_view();
        world.standby = world.fresh_view();
        world
    }

    fn fresh_uid(&mut self) -> String {
        self.next_uid += 1;
        format!("uid-{}", self.next_uid)
    }

    fn object(&self, index: usize) -> Option<Pod> {
        let server = self.pods[index].as_ref()?;
        let mut builder = pod(&pod_name(index)).gpu_mem(POD_GIB[index]);
        if let Some((node, annotations)) = &server.bound {
            builder = builder.on_node(node);
            for (key, value) in annotations {
                builder = builder.annotation(key, value);
            }
        }
        let mut object = builder.build();
        object.metadata.uid = Some(server.uid.clone());
        Some(object)
    }

    fn listed(&self) -> Vec<Pod> {
        (0..self.pods.len())
            .filter_map(|i| self.object(i))
            .collect()
    }

    fn fresh_view(&self) -> View {
        let mut view = View::new(settings());
        view.replace_nodes(&nodes());
        view.replace_pods(&self.listed());
        view
    }

    fn start_view(&mut self) {
        self.view = self.fresh_view();
        self.events.clear();
    }

    /// A pod change both replicas' watches will deliver.
    fn publish(&mut self, object: Pod, deleted: bool) {
        self.standby_events.push_back((object.clone(), deleted));
        self.events.push_back((object, deleted));
    }

    fn index_of(&self, target: &BindingTarget) -> usize {
        (0..self.pods.len())
            .find(|&i| pod_name(i) == target.name)
            .unwrap_or(usize::MAX)
    }

    /// The API server applies a Binding now: it lands if the pod is there and unbound.
    fn commit(&mut self, target: &BindingTarget) -> bool {
        let index = self.index_of(target);
        let Some(Some(server)) = self.pods.get_mut(index) else {
            return false;
        };
        if server.uid != target.uid || server.bound.is_some() {
            return false;
        }
        server.bound = Some((target.node.clone(), target.annotations.clone()));
        if let Some(object) = self.object(index) {
            self.publish(object, false);
        }
        true
    }

    fn read(&self, target: &BindingTarget) -> Option<PodOnServer> {
        let server = self.pods.get(self.index_of(target))?.as_ref()?;
        Some(PodOnServer {
            uid: server.uid.clone(),
            node: server.bound.as_ref().map(|(node, _)| node.clone()),
        })
    }

    fn settle(&mut self, write: usize, outcome: Outcome) {
        let Write {
            uid,
            ticket,
            instance,
            ..
        } = &self.writes[write];
        let view = if *instance == self.instance {
            &mut self.view
        } else if *instance == self.standby_instance {
            &mut self.standby
        } else {
            return; // its instance died; nobody settles it
        };
        let settled = view.settle_reservation(uid, *ticket, outcome);
        self.writes[write].resolving = settled == Settled::Resolving;
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Bind { pod, node } => self.bind(pod, node),
            Op::ServerApplies { write } => self.server_applies(write),
            Op::ServerDrops { write } => self.server_drops(write),
            Op::Answer { write, ambiguous } => self.answer(write, ambiguous),
            Op::Resolve { write } => {
                if let Some(i) = pick(write, self.writes.len()) {
                    self.resolve(i);
                }
            }
            Op::Watch => deliver(&mut self.view, &mut self.events),
            Op::StandbyWatch => deliver(&mut self.standby, &mut self.standby_events),
            Op::Relist => {
                self.events.clear();
                self.view.replace_pods(&self.listed());
            }
            Op::Restart => self.restart(),
            Op::Failover => self.failover(),
            Op::Delete { pod } => self.delete(pod),
            Op::Recreate { pod } => self.recreate(pod),
        }
    }

    /// kube-scheduler asks to bind pod `pod` to node `node`: the leader decides as
    /// `bind::decide` does, and a Binding is on its way.
    fn bind(&mut self, pod: usize, node: usize) {
        // The restart grace (`--bind-grace-ms`): a new instance binds once the old
        // one's writes have met their fate and the watch has shown them.
        if self.grace {
            let old_pending = self.writes[..self.fenced]
                .iter()
                .any(|w| w.fate == Fate::Pending);
            if old_pending || !self.events.is_empty() {
                return;
            }
            self.grace = false;
        }
        let Some(server) = self.pods[pod].as_ref() else {
            return;
        };
        let args = ExtenderBindingArgs {
            pod_name: pod_name(pod),
            pod_namespace: "default".into(),
            pod_uid: server.uid.clone(),
            node: NODES[node].0.into(),
        };
        let key = format!("default/{}", args.pod_name);
        if let Ok(Decision::Write(write)) = decide(&mut self.view, Policy::Binpack, &args, &key) {
            self.writes.push(Write {
                target: write.target,
                uid: write.uid,
                ticket: write.ticket,
                instance: self.instance,
                term: self.term,
                fate: Fate::Pending,
                answered: false,
                resolving: false,
            });
        }
    }

    /// A Binding still on its way commits now (or meets a conflict).
    fn server_applies(&mut self, write: usize) {
        let Some(i) = pick(write, self.writes.len()) else {
            return;
        };
        if self.writes[i].fate == Fate::Pending {
            let target = self.writes[i].target.clone();
            self.writes[i].fate = if self.commit(&target) {
                Fate::Committed
            } else {
                Fate::Conflict
            };
        }
    }

    /// A Binding still on its way is lost.
    fn server_drops(&mut self, write: usize) {
        if let Some(i) = pick(write, self.writes.len())
            && self.writes[i].fate == Fate::Pending
        {
            self.writes[i].fate = Fate::Lost;
        }
    }

    /// The first answer to a write reaches its task.
    fn answer(&mut self, write: usize, ambiguous: bool) {
        let Some(i) = pick(write, self.writes.len()) else {
            return;
        };
        let w = &self.writes[i];
        if w.answered || (w.fate == Fate::Pending && !ambiguous) {
            return;
        }
        let outcome = match (ambiguous, w.fate) {
            (true, _) | (_, Fate::Conflict) => Outcome::Unknown,
            (_, Fate::Committed) => Outcome::Landed,
            _ => Outcome::NotLanded,
        };
        self.writes[i].answered = true;
        self.settle(i, outcome);
    }

    /// The leader restarts: a new instance and term, a fresh view; its writes go on.
    fn restart(&mut self) {
        self.instance = self.instance.max(self.standby_instance) + 1;
        self.grace = true;
        self.fenced = self.writes.len();
        self.term += 1;
        self.start_view();
    }

    /// The standby takes over the Lease. The processes stay: each still settles its own
    /// writes, whichever leads.
    fn failover(&mut self) {
        std::mem::swap(&mut self.instance, &mut self.standby_instance);
        self.grace = true;
        self.fenced = self.writes.len();
        self.term += 1;
        std::mem::swap(&mut self.view, &mut self.standby);
        std::mem::swap(&mut self.events, &mut self.standby_events);
    }

    /// A user deletes pod `pod`.
    fn delete(&mut self, pod: usize) {
        if let Some(object) = self.object(pod) {
            self.pods[pod] = None;
            self.publish(object, true);
        }
    }

    /// A user creates pod `pod` again, with a new UID.
    fn recreate(&mut self, pod: usize) {
        if self.pods[pod].is_none() {
            let uid = self.fresh_uid();
            self.pods[pod] = Some(ServerPod { uid, bound: None });
            if let Some(object) = self.object(pod) {
                self.publish(object, false);
            }
        }
    }

    /// One step of the resolution of write `i`, as `bind::resolve_once` takes it.
    fn resolve(&mut self, i: usize) {
        let w = &self.writes[i];
        let leading = w.instance == self.instance;
        let same_term = leading && w.term == self.term;
        let view = if leading {
            &self.view
        } else if w.instance == self.standby_instance {
            &self.standby
        } else {
            return;
        };
        if !w.resolving || !view.reservation_is(&w.uid, w.ticket, Phase::Resolving) {
            return;
        }
        let target = w.target.clone();
        let outcome = match read_verdict(self.read(&target).as_ref(), &target, same_term) {
            Some(outcome) => outcome,
            // Unbound: re-post, which commits at once, or meets a conflict.
            None if self.commit(&target) => Outcome::Landed,
            None => Outcome::Unknown,
        };
        self.settle(i, outcome);
    }

    /// The API server's GiB per (node, GPU), from the bound pods' annotations.
    fn server_usage(&self) -> BTreeMap<(String, u32), u64> {
        let mut used = BTreeMap::new();
        for index in 0..self.pods.len() {
            let Some(object) = self.object(index) else {
                continue;
            };
            let Some(node) = object.spec.as_ref().and_then(|s| s.node_name.clone()) else {
                continue;
            };
            let keys = gpushare_contract::Keys::default();
            let annotations = object.metadata.annotations.clone().unwrap_or_default();
            if let Ok(Some(allocation)) =
                gpushare_contract::PodAllocation::from_annotations(&keys, &annotations)
            {
                *used.entry((node, allocation.gpu_index)).or_default() += allocation.pod_gib;
            }
        }
        used
    }

    fn check_invariants(&self) -> Result<(), TestCaseError> {
        for ((node, gpu), used) in self.server_usage() {
            let total = NODES
                .iter()
                .find(|(name, _)| *name == node)
                .map_or(0, |(_, gpus)| gpus[gpu as usize]);
            prop_assert!(
                used <= total,
                "GPU {gpu} of {node}: {used} of {total} GiB; writes {:?}",
                self.writes
            );
        }
        for view in [&self.view, &self.standby] {
            let mut seen = HashSet::new();
            for (_, node) in view.cluster.nodes() {
                for (uid, _) in node.pods() {
                    prop_assert!(seen.insert(uid.clone()), "pod {uid} booked on two nodes");
                }
            }
        }
        Ok(())
    }

    /// Every write meets its fate, every answer comes, every resolution runs, the watch
    /// catches up.
    fn quiesce(&mut self) {
        for i in 0..self.writes.len() {
            self.apply(&Op::ServerApplies { write: i });
            self.apply(&Op::Answer {
                write: i,
                ambiguous: false,
            });
        }
        for _ in 0..3 {
            for i in 0..self.writes.len() {
                self.resolve(i);
            }
        }
        while !self.events.is_empty() {
            self.apply(&Op::Watch);
        }
        while !self.standby_events.is_empty() {
            self.apply(&Op::StandbyWatch);
        }
    }

    fn usage(view: &View) -> BTreeMap<(String, u32), u64> {
        view.cluster
            .nodes()
            .flat_map(|(name, node)| {
                node.gpus()
                    .iter()
                    .map(move |g| ((name.to_owned(), g.gpu.index), g.used_gib))
            })
            .collect()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn reservations_end_and_never_over_commit(ops in prop::collection::vec(op(), 1..80)) {
        let mut world = World::new();
        for op in &ops {
            world.apply(op);
            world.check_invariants()?;
        }
        world.quiesce();
        world.check_invariants()?;
        prop_assert_eq!(world.view.reservation_count(), 0);
        // The standby may still be reading about pods its Bindings never reached; each such
        // pod is unbound, waiting for the leader to bind it (kube-scheduler retries).
        for i in 0..world.pods.len() {
            if let Some(server) = &world.pods[i] {
                let uid = PodId::from(server.uid.as_str());
                prop_assert!(
                    world.standby.reservation(&uid).is_none() || server.bound.is_none(),
                    "the standby still books bound pod {}", pod_name(i)
                );
            }
        }
        let mut rebuilt = View::new(settings());
        rebuilt.replace_nodes(&nodes());
        rebuilt.replace_pods(&world.listed());
        prop_assert_eq!(World::usage(&world.view), World::usage(&rebuilt));
    }
}
