//! The extender's picture of the cluster: the allocator state plus what bind needs to know
//! about pods, fed by the node and pod watches and by bind's own reservations.
//!
//! Why reservations: between our Binding write and the watch delivering the bound pod, the
//! memory must already count, or a second bind could take it. A reservation is booked in the
//! allocator at the decision and ended by the watched pod (same UID) when it shows up bound,
//! by a definitive answer to the write, or by a read of the pod ([`crate::scheduling::view::reservations`]
//! draws the lifecycle). On a relist (restart, watch expiry) the allocator is rebuilt from
//! the listed pods, and the reservations of pods still listed and unbound are booked on top.
//!
//! Why the pod records are so spare: at 50,000 pods every byte per pod is 50 KB of the
//! extender's memory. A pod is kept as its `namespace/name` (one shared string), its UID
//! (shared with the allocator's indexes), its node (the allocator's own node name) and, only
//! while it waits to be bound, its request. Its allocation lives in the allocator alone. The
//! `view-memory` instrument in `perf/` measures the bytes per pod.
//!
//! Why a signature that does not verify keeps the booking: with a keyring configured, a
//! bound pod's allocation is checked against the extender's signature. One that does not
//! verify was hand-written or edited, so it is not trusted to *lower* what is booked: the
//! booking the extender already has for that UID stays (its own reservation, or what the
//! annotations said while they verified), also across a relist. A pod with none booked gets
//! what its own spec asks for (which no one can edit) on the GPU the annotations name: never
//! less than it may use, so pods bound before signing was turned on stay accounted, and a
//! forged claim of 0 GiB counts as the pod's real request (the device plugin refuses the
//! forged pod a GPU anyway; once it fails, the memory is free again).
//!
//! The work is split by job, one file each, all of it methods of the one [`View`]:
//! - `facts.rs`: what is read of a pod the moment the watch delivers it ([`PodFacts`]): its
//!   request, its CPU and memory, and its allocation annotations, checked against the keyring;
//! - `pods.rs`: applying a watched pod or its deletion: its booking, the warning its owner
//!   gets, the spare record kept ([`CachedPod`]);
//! - `relist.rs`: rebuilding the pods from a complete list, carrying over what must survive it;
//! - `nodes.rs`: applying nodes: GPUs, eligibility, allocatable CPU and memory, soft taints;
//! - `reservations.rs`: the view's side of bind's reservations and filter's holds ([`Hold`]);
//! - `preemption.rs`: which pods a preemptor may evict, and memory held for the pods preemption
//!   made room for.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_allocator::{Cluster, PodId, Unfit};
use gpushare_contract::{Scope, SharedKeyring};
use k8s_openapi::api::core::v1::Taint;

use reservations::Reservations;

mod dra;
mod facts;
mod nodes;
mod pods;
mod preemption;
mod relist;
pub mod reservations;
#[cfg(test)]
mod testing;

pub use dra::{ClaimAsk, DraNames};
pub use facts::{Ask, PodFacts, node_host, pod_host, read_pod_request, to_request};
pub use pods::{CachedPod, PodWarning};
pub use reservations::Hold;

/// What filter, prioritize and bind answer before the watches have listed everything.
pub const NOT_SYNCED: &str = "extender view not synced yet";

/// Why `node` cannot take the pod, as kube-scheduler and the pod's events will show it.
pub fn unfit_reason(settings: &Settings, node: &str, unfit: &Unfit) -> String {
    match unfit {
        Unfit::UnknownNode => format!("node {node} is unknown to the gpushare extender"),
        Unfit::NotEligible => format!(
            "node {node} does not take part in GPU sharing (label {}={} not set)",
            settings.label_key, settings.label_value
        ),
        other => other.to_string(),
    }
}

/// What the view needs to read nodes and pods: the [`Scope`] the extender serves (its
/// fields read through `Deref`), and the keyring allocations are signed and verified with.
#[derive(Debug, Clone)]
pub struct Settings {
    scope: Scope,
    /// The keyring the extender signs with; with one, allocations on pods are verified.
    pub keyring: Option<SharedKeyring>,
    /// DRA mode: GPUs come from these ResourceSlices and requests from claims of this class
    /// (`dra.rs`); `None` in extender mode.
    pub dra: Option<DraNames>,
}

impl Settings {
    /// Settings for `resource`, annotation `domain` and participation label `key=value`.
    pub fn new(resource: &str, domain: &str, node_label: &str) -> Self {
        Self {
            scope: Scope::new(resource, domain, node_label),
            keyring: None,
            dra: None,
        }
    }

    /// These settings in DRA mode, reading `names`' slices and claims.
    pub fn with_dra(mut self, names: DraNames) -> Self {
        self.dra = Some(names);
        self
    }

    /// These settings, signing and verifying allocations with `keyring`.
    pub fn with_keyring(mut self, keyring: SharedKeyring) -> Self {
        self.keyring = Some(keyring);
        self
    }
}

impl std::ops::Deref for Settings {
    type Target = Scope;

    fn deref(&self) -> &Scope {
        &self.scope
    }
}

/// The index key of a pod: `namespace/name` (neither may contain a slash).
fn pod_key(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

/// Namespace and name back out of a [`pod_key`].
fn split_key(key: &str) -> (&str, &str) {
    key.split_once('/').unwrap_or(("", key))
}

/// The cluster as the extender sees it.
#[derive(Debug)]
pub struct View {
    settings: Settings,
    /// The allocation state, nodes included (a relist of pods rebuilds it from them).
    pub cluster: Cluster,
    /// Pods we care about, by `namespace/name`.
    pods: HashMap<Arc<str>, CachedPod>,
    /// The `namespace/name` of those pods, by UID (the same shared string).
    pod_keys: HashMap<PodId, Arc<str>>,
    /// Bookings made by bind that the watch has not shown yet (see [`crate::scheduling::view::reservations`]).
    reservations: Reservations,
    nodes_synced: bool,
    pods_synced: bool,
    /// When both watches had first listed everything.
    synced_at: Option<Instant>,
    /// How long after that binds are refused (see [`View::bind_hold`]).
    bind_grace: Duration,
    /// The `PreferNoSchedule` taints of the nodes that have any: kube-scheduler's
    /// TaintToleration score reads them, so the filter that keeps the best node steps aside
    /// where one could move the choice ([`crate::scheduling::keep_best`]).
    prefer_no_schedule: HashMap<Arc<str>, Vec<Taint>>,
    /// Each node's taints and resourceVersion as the watch last showed them: the idle-GPU
    /// taint is written from them, with no read first ([`crate::kube_io::idle_gpu_taint`]).
    node_taints: HashMap<Arc<str>, NodeTaints>,
    /// Unbound pods nominated for a node by preemption (see `preemption.rs`).
    nominations: HashMap<PodId, preemption::Nomination>,
    /// True while a relist replays the listed pods: nominations wait for the end of it.
    replaying: bool,
    /// DRA mode's slices, claims and their bookings (`dra.rs`).
    dra: dra::DraState,
}

/// A node's taints and the resourceVersion they were read at, from the node watch.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeTaints {
    /// The node's resourceVersion when the watch showed it.
    pub resource_version: String,
    /// Its taints then, every effect.
    pub taints: Vec<Taint>,
}

/// A node whose idle-GPU taint is not what it should be.
#[derive(Debug, Clone, PartialEq)]
pub struct TaintDrift {
    /// The node.
    pub node: Arc<str>,
    /// Whether it should carry the taint.
    pub wanted: bool,
    /// Its taints as the watch last showed them: the write starts from these and fails (409)
    /// if the node changed since.
    pub seen: NodeTaints,
}

impl View {
    /// An empty, unsynced view.
    pub fn new(settings: Settings) -> Self {
        Self {
            settings,
            cluster: Cluster::new(),
            pods: HashMap::new(),
            pod_keys: HashMap::new(),
            reservations: Reservations::new(),
            nodes_synced: false,
            pods_synced: false,
            synced_at: None,
            bind_grace: Duration::ZERO,
            prefer_no_schedule: HashMap::new(),
            node_taints: HashMap::new(),
            nominations: HashMap::new(),
            replaying: false,
            dra: dra::DraState::default(),
        }
    }

    /// The `PreferNoSchedule` taints of `node` (none when it has none or is unknown).
    pub fn prefer_no_schedule_taints(&self, node: &str) -> &[Taint] {
        self.prefer_no_schedule
            .get(node)
            .map_or(&[], |taints| taints.as_slice())
    }

    /// The nodes whose idle-GPU taint is not what it should be, each with whether it should
    /// carry it and its taints as the watch last showed them: a present node taking part, with
    /// a healthy GPU nothing is booked on (reservations count), should while `enabled` and
    /// the recent demand is not pinned heavy (`gpushare_allocator::demand_mix`); no other node
    /// should. Nodes not present are left alone. In name order: a pass capped at a number of
    /// writes takes the first, and the next pass those still left.
    pub fn idle_gpu_taint_drift(&self, enabled: bool) -> Vec<TaintDrift> {
        let enabled = enabled && self.cluster.demand().wants_idle_gpu_taint();
        let mut drift: Vec<TaintDrift> = self
            .cluster
            .nodes()
            .filter(|(_, node)| node.is_present())
            .filter_map(|(name, node)| {
                let idle = node
                    .gpus()
                    .iter()
                    .any(|usage| usage.gpu.healthy && usage.used_gib == 0);
                let wanted = enabled && node.is_eligible() && idle;
                (wanted != self.carries_idle_gpu_taint(name)).then(|| TaintDrift {
                    node: self.cluster.node_name(name),
                    wanted,
                    seen: self.node_taints.get(name).cloned().unwrap_or_default(),
                })
            })
            .collect();
        drift.sort_unstable_by(|a, b| a.node.cmp(&b.node));
        drift
    }

    /// Whether `node` carries the idle-GPU taint ([`crate::kube_io::idle_gpu_taint`]), as the node
    /// watch last showed it.
    fn carries_idle_gpu_taint(&self, node: &str) -> bool {
        let key = &self.settings.keys.node_idle_gpu_taint;
        self.prefer_no_schedule_taints(node)
            .iter()
            .any(|taint| taint.key == *key)
    }

    /// How many nodes carry the idle-GPU taint, as the node watch last showed them.
    pub fn idle_gpu_tainted_nodes(&self) -> usize {
        let key = &self.settings.keys.node_idle_gpu_taint;
        let tainted = |taints: &&Vec<Taint>| taints.iter().any(|taint| taint.key == *key);
        self.prefer_no_schedule.values().filter(tainted).count()
    }

    /// The settings the view reads objects with.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// True once the watches have listed everything (in DRA mode, slices and claims too).
    pub fn is_synced(&self) -> bool {
        self.nodes_synced
            && self.pods_synced
            && (self.settings.dra.is_none() || self.dra.is_synced())
    }

    /// Marks the node watch as listed.
    pub fn set_nodes_synced(&mut self) {
        self.nodes_synced = true;
        self.mark_synced_at();
    }

    /// Marks the pod watch as listed.
    pub fn set_pods_synced(&mut self) {
        self.pods_synced = true;
        self.mark_synced_at();
    }

    fn mark_synced_at(&mut self) {
        if self.is_synced() && self.synced_at.is_none() {
            self.synced_at = Some(Instant::now());
        }
    }

    /// Sets how long binds wait after the first sync (see [`View::bind_hold`]).
    pub fn set_bind_grace(&mut self, grace: Duration) {
        self.bind_grace = grace;
    }

    /// How much longer binds must wait after start-up, if at all.
    ///
    /// Why: an extender killed in the middle of a bind may have sent a Binding that the API
    /// server applies only after this instance listed the pods. Until such a late write shows
    /// up in the watch, its GPU memory looks free, and binding into it could over-commit the
    /// GPU. Holding binds for a short grace after the first sync lets those writes land.
    /// Filter and prioritize are not held: only bind books memory.
    pub fn bind_hold(&self) -> Option<Duration> {
        let since = self.synced_at?.elapsed();
        (since < self.bind_grace).then(|| self.bind_grace - since)
    }

    /// A cached pod by namespace and name.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<&CachedPod> {
        self.pods.get(pod_key(namespace, name).as_str())
    }

    /// Namespace and name of a pod by UID (watched or reserved).
    pub fn pod_key(&self, uid: &PodId) -> Option<(&str, &str)> {
        self.pod_keys
            .get(uid)
            .map(|key| split_key(key))
            .or_else(|| {
                self.reservations
                    .get(uid)
                    .map(|r| (r.namespace.as_str(), r.name.as_str()))
            })
    }
}
