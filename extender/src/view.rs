//! The extender's picture of the cluster: the allocator state plus what bind needs to know
//! about pods, fed by the node and pod watches and by bind's own reservations.
//!
//! Why reservations: between our Binding write and the watch delivering the bound pod, the
//! memory must already count, or a second bind could take it. A reservation is booked in the
//! allocator at the decision and ended by the watched pod (same UID) when it shows up bound,
//! by a definitive answer to the write, or by a read of the pod ([`crate::reservation`]
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

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_allocator::fragmentation::{Host, Shape};
use gpushare_allocator::{Cluster, Gpu, ModelFilter, PodId, PodPlacement, Policy, Request};

use crate::reservation::{Outcome, Phase, Reservation, Reservations, Settled, Ticket};
use gpushare_contract::{
    GpuInfo, PodAllocation, PodRequest, RequestError, Scope, SharedKeyring, inventory,
    pod_request_with,
};
use k8s_openapi::api::core::v1::{Container, Node, Pod, Taint};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// What the view needs to read nodes and pods: the [`Scope`] the extender serves (its
/// fields read through `Deref`), and the keyring allocations are signed and verified with.
#[derive(Debug, Clone)]
pub struct Settings {
    scope: Scope,
    /// The keyring the extender signs with; with one, allocations on pods are verified.
    pub keyring: Option<SharedKeyring>,
}

impl Settings {
    /// Settings for `resource`, annotation `domain` and participation label `key=value`.
    pub fn new(resource: &str, domain: &str, node_label: &str) -> Self {
        Self {
            scope: Scope::new(resource, domain, node_label),
            keyring: None,
        }
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

/// What the view keeps of a pod's request for GPU memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ask {
    /// The pod asks for none of the resource.
    Nothing,
    /// The pod asks (or its request is unreadable) and is bound: bind never reads the
    /// details again, so they are not kept.
    Bound,
    /// The pod waits to be bound: what bind will place, or why its request cannot be read.
    Pending(Box<Result<PodRequest, RequestError>>),
}

impl Ask {
    /// The request as read, reduced to what the view keeps for a pod that is (or is not yet)
    /// `bound`.
    fn new(request: Result<Option<PodRequest>, RequestError>, bound: bool) -> Self {
        match request {
            Ok(None) => Ask::Nothing,
            _ if bound => Ask::Bound,
            Ok(Some(request)) => Ask::Pending(Box::new(Ok(request))),
            Err(error) => Ask::Pending(Box::new(Err(error))),
        }
    }
}

/// A pod the extender cares about: it asks for the resource or carries an allocation.
#[derive(Debug, Clone)]
pub struct CachedPod {
    /// The pod's UID.
    pub uid: PodId,
    /// `spec.nodeName`, once bound (the allocator's shared node name).
    pub node_name: Option<Arc<str>>,
    /// What it asks for.
    pub ask: Ask,
    /// True while its allocation annotations cannot be read or, with a keyring, do not
    /// verify (warned once).
    pub bad_annotations: bool,
    /// The CPU and memory it requests (the fragmentation policy weighs them at bind).
    pub host: Host,
}

impl CachedPod {
    /// The pending pod's request, in the allocator's form and as read: `Ok(None)` for a pod
    /// that asks for nothing, or that is bound already.
    pub fn pending_request(&self) -> Result<Option<(Request, &PodRequest)>, RequestError> {
        match &self.ask {
            Ask::Nothing | Ask::Bound => Ok(None),
            Ask::Pending(request) => match request.as_ref() {
                Ok(request) => Ok(Some((
                    Request {
                        host: self.host,
                        ..to_request(request)
                    },
                    request,
                ))),
                Err(error) => Err(error.clone()),
            },
        }
    }
}

/// The allocator's form of a pod request (CPU and memory: see [`pod_host`]).
pub fn to_request(request: &PodRequest) -> Request {
    Request {
        models: ModelFilter::parse(request.models.iter().map(String::as_str)),
        gpus: request.gpus,
        exclusive: request.exclusive,
        pod_gib: request.pod_gib,
        containers: request.containers.iter().map(|c| c.gib).collect(),
        host: Host::default(),
    }
}

/// The CPU and memory a pod requests, as kube-scheduler counts them: its containers and
/// sidecars (restartable init containers) together, or its largest init container (with the
/// sidecars started before it) if that is more. Unreadable quantities count as zero.
pub fn pod_host(pod: &Pod) -> Host {
    let Some(spec) = pod.spec.as_ref() else {
        return Host::default();
    };
    let requests = |c: &Container| {
        let get = |name: &str| c.resources.as_ref()?.requests.as_ref()?.get(name);
        Host::new(
            get("cpu").and_then(millicores).unwrap_or(0),
            get("memory").and_then(mebibytes).unwrap_or(0),
        )
    };
    let max =
        |a: Host, b: Host| Host::new(a.milli_cpu.max(b.milli_cpu), a.memory_mib.max(b.memory_mib));
    let (mut sidecars, mut init) = (Host::default(), Host::default());
    for c in spec.init_containers.iter().flatten() {
        if c.restart_policy.as_deref() == Some("Always") {
            sidecars = sidecars.saturating_add(requests(c));
        } else {
            init = max(init, sidecars.saturating_add(requests(c)));
        }
    }
    let running = spec
        .containers
        .iter()
        .fold(sidecars, |sum, c| sum.saturating_add(requests(c)));
    max(running, init)
}

/// A node's allocatable CPU and memory; `None` when it publishes neither.
pub fn node_host(node: &Node) -> Option<Host> {
    let allocatable = node.status.as_ref()?.allocatable.as_ref()?;
    let cpu = allocatable.get("cpu").and_then(millicores);
    let memory = allocatable.get("memory").and_then(mebibytes);
    if cpu.is_none() && memory.is_none() {
        return None;
    }
    Some(Host::new(
        cpu.unwrap_or(u64::MAX),
        memory.unwrap_or(u64::MAX),
    ))
}

/// CPU in millicores, or `None` when unreadable.
fn millicores(quantity: &Quantity) -> Option<u64> {
    gpushare_contract::quantity::milli(&quantity.0)
        .ok()
        .map(|milli| u64::try_from(milli).unwrap_or(u64::MAX))
}

/// Memory in MiB, rounded up, or `None` when unreadable.
fn mebibytes(quantity: &Quantity) -> Option<u64> {
    gpushare_contract::quantity::mib(&quantity.0)
        .ok()
        .map(|mib| u64::try_from(mib).unwrap_or(u64::MAX))
}

/// Something the watch saw that the pod's owner should hear about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodWarning {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Pod UID.
    pub uid: String,
    /// What is wrong.
    pub message: String,
}

/// The index key of a pod: `namespace/name` (neither may contain a slash).
fn pod_key(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

/// Namespace and name back out of a [`pod_key`].
fn split_key(key: &str) -> (&str, &str) {
    key.split_once('/').unwrap_or(("", key))
}

/// What a pod's gpushare allocation annotations say.
#[derive(Debug, Clone)]
enum AllocationFacts {
    /// There are none (no GPU index).
    Absent,
    /// Where the pod sits.
    Readable(PodPlacement),
    /// They are there but cannot be read: why, and the GPU and size if those still parse.
    Unreadable {
        error: String,
        salvaged: Option<PodPlacement>,
    },
    /// Readable, but a keyring is configured and their signature does not verify: why, and
    /// what to book when nothing is booked for the pod yet: its own spec request (which no
    /// one can edit, and which kubelet charges anyway) on the GPU the annotations name.
    Untrusted {
        why: String,
        fallback: Option<PodPlacement>,
    },
}

/// The allocator's form of an allocation's GPUs after the first.
fn more_gpus(allocation: &PodAllocation) -> Vec<(u32, Arc<str>)> {
    allocation
        .more_gpus
        .iter()
        .map(|gpu| (gpu.index, Arc::from(gpu.uuid.as_str())))
        .collect()
}

impl AllocationFacts {
    /// Reads the annotations of pod `uid`, bound to `node` (if it is); with a keyring in
    /// `settings`, a bound pod's allocation must carry the extender's signature.
    fn read(
        settings: &Settings,
        uid: &str,
        node: Option<&str>,
        annotations: Option<&BTreeMap<String, String>>,
        spec_gib: Option<u64>,
    ) -> Self {
        let keys = &settings.keys;
        let Some(annotations) = annotations else {
            return Self::Absent;
        };
        match PodAllocation::from_annotations(keys, annotations) {
            Ok(None) => Self::Absent,
            Ok(Some(allocation)) => {
                if let (Some(keyring), Some(node)) = (&settings.keyring, node)
                    && let Err(why) = keyring.current().verify(uid, node, &allocation)
                {
                    return Self::Untrusted {
                        why: why.to_string(),
                        fallback: spec_gib.filter(|gib| *gib > 0).map(|pod_gib| PodPlacement {
                            more_gpus: more_gpus(&allocation),
                            exclusive: false,
                            gpu: allocation.gpu_index,
                            uuid: allocation.gpu_uuid.as_str().into(),
                            // The spec's total, spread over the GPUs the annotations name.
                            pod_gib: pod_gib.div_ceil(allocation.gpu_count() as u64),
                            pending: Vec::new(),
                            assigned: true,
                        }),
                    };
                }
                Self::Readable(PodPlacement {
                    more_gpus: more_gpus(&allocation),
                    exclusive: allocation.exclusive,
                    gpu: allocation.gpu_index,
                    uuid: allocation.gpu_uuid.as_str().into(),
                    pod_gib: allocation.pod_gib,
                    pending: allocation.pending_containers().map(|c| c.gib).collect(),
                    assigned: allocation.assigned,
                })
            }
            Err(error) => {
                let gpu = annotations
                    .get(&keys.gpu_index)
                    .and_then(|v| v.trim().parse::<u32>().ok());
                let pod_gib = annotations
                    .get(&keys.pod_gib)
                    .and_then(|v| v.trim().parse::<u64>().ok());
                let salvaged_uuid: Arc<str> = annotations
                    .get(&keys.gpu_uuid)
                    .map_or("", |v| v.trim())
                    .into();
                Self::Unreadable {
                    error: error.to_string(),
                    salvaged: gpu.zip(pod_gib).map(|(gpu, pod_gib)| PodPlacement {
                        more_gpus: Vec::new(),
                        exclusive: false,
                        gpu,
                        uuid: salvaged_uuid.clone(),
                        pod_gib,
                        pending: Vec::new(),
                        assigned: true,
                    }),
                }
            }
        }
    }
}

/// What the view reads of a pod, taken out of the watched object at once.
///
/// Why: a relist is buffered until it is complete, and even a trimmed `Pod` is kilobytes of
/// mostly empty fields; these facts are the few hundred bytes the view keeps anyway, so a
/// relist of 50,000 pods stays small. Pods that neither ask for the resource nor carry an
/// allocation are not read at all.
#[derive(Debug, Clone)]
pub struct PodFacts {
    /// `namespace/name`.
    key: Arc<str>,
    uid: PodId,
    node_name: Option<Box<str>>,
    finished: bool,
    ask: Ask,
    allocation: AllocationFacts,
    host: Host,
}

impl PodFacts {
    /// Reads a pod; `None` without namespace, name or UID.
    pub fn read(pod: &Pod, settings: &Settings) -> Option<Self> {
        let metadata = &pod.metadata;
        let node_name: Option<Box<str>> = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_deref())
            .filter(|n| !n.is_empty())
            .map(Box::from);
        let key = pod_key(metadata.namespace.as_deref()?, metadata.name.as_deref()?);
        let uid = metadata.uid.as_deref()?;
        let request = pod_request_with(pod, &settings.resource, &settings.keys);
        let spec_gib = request
            .as_ref()
            .ok()
            .and_then(|r| r.as_ref())
            .map(|r| r.pod_gib);
        let mut allocation = AllocationFacts::read(
            settings,
            uid,
            node_name.as_deref(),
            metadata.annotations.as_ref(),
            spec_gib,
        );
        // kubelet sets `startTime` when it admits a pod, and admission is where it calls the
        // device plugin's Allocate for every container: nothing of the pod still waits for a
        // device, whatever marks the plugin wrote (by default it writes none).
        let admitted = pod.status.as_ref().is_some_and(|s| s.start_time.is_some());
        if admitted && let AllocationFacts::Readable(placement) = &mut allocation {
            placement.pending.clear();
            placement.assigned = true;
        }
        Some(Self {
            key: key.into(),
            uid: PodId::from(uid),
            finished: gpushare_contract::request::pod_is_finished(pod),
            ask: Ask::new(request, node_name.is_some()),
            node_name,
            allocation,
            host: pod_host(pod),
        })
    }

    /// Whether the view keeps this pod at all: it asks for the resource or carries an
    /// allocation (a pod that dropped both must still be applied, to be forgotten).
    pub fn concerns_gpushare(&self) -> bool {
        self.ask != Ask::Nothing || !matches!(self.allocation, AllocationFacts::Absent)
    }

    /// Whether the view books this pod's CPU and memory on its node: any bound, running pod
    /// that requests some (the fragmentation policy weighs what GPU nodes have left). Only
    /// its UID, node and the two numbers are kept.
    pub fn books_host(&self) -> bool {
        self.node_name.is_some() && !self.finished && self.host != Host::default()
    }
}

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
    /// Bookings made by bind that the watch has not shown yet (see [`crate::reservation`]).
    reservations: Reservations,
    nodes_synced: bool,
    pods_synced: bool,
    /// When both watches had first listed everything.
    synced_at: Option<Instant>,
    /// How long after that binds are refused (see [`View::bind_hold`]).
    bind_grace: Duration,
    /// The `PreferNoSchedule` taints of the nodes that have any: kube-scheduler's
    /// TaintToleration score reads them, so the filter that keeps the best node steps aside
    /// where one could move the choice ([`crate::keep_best`]).
    prefer_no_schedule: HashMap<Arc<str>, Vec<Taint>>,
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
        }
    }

    /// The `PreferNoSchedule` taints of `node` (none when it has none or is unknown).
    pub fn prefer_no_schedule_taints(&self, node: &str) -> &[Taint] {
        self.prefer_no_schedule
            .get(node)
            .map_or(&[], |taints| taints.as_slice())
    }

    /// The settings the view reads objects with.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// True once both watches have listed everything.
    pub fn is_synced(&self) -> bool {
        self.nodes_synced && self.pods_synced
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

    /// Records the reservation of `placement` that [`Cluster::reserve`] just booked, its
    /// Binding about to be written; the ticket settles it.
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
    /// bind must see the memory taken ([`crate::reservation`], "Why holds"). A hold the pod
    /// already had is given back first; a pod already booked otherwise (its bind under way or
    /// its Binding written) gets none. False when nothing was held.
    pub fn hold(&mut self, hold: Hold<'_>, request: &Request, policy: Policy) -> bool {
        let Hold {
            uid,
            namespace,
            name,
            node,
            until,
        } = hold;
        self.release_hold(&uid);
        if self.reservations.get(&uid).is_some()
            || self
                .cluster
                .reserve(uid.clone(), node, request, policy)
                .is_err()
        {
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
    pub fn release_hold(&mut self, uid: &PodId) -> bool {
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
        lapsed.len()
    }

    /// Applies what the API server said about `ticket`'s Binding; a released reservation
    /// gives its memory back at once.
    pub fn settle_reservation(&mut self, uid: &PodId, ticket: Ticket, outcome: Outcome) -> Settled {
        let settled = self.reservations.settle(uid, ticket, outcome);
        if settled == Settled::Released {
            self.cluster.release(uid);
        }
        settled
    }

    /// Applies a node from the node watch.
    pub fn apply_node(&mut self, node: &Node) {
        let Some(name) = node.metadata.name.as_deref() else {
            return;
        };
        let (gpus, eligible) = self.read_node(node);
        self.cluster.set_node(name, gpus, eligible);
        self.cluster.set_node_host(name, node_host(node));
        let soft_taints: Vec<Taint> = node
            .spec
            .as_ref()
            .and_then(|spec| spec.taints.as_ref())
            .into_iter()
            .flatten()
            .filter(|taint| taint.effect == "PreferNoSchedule")
            .cloned()
            .collect();
        if soft_taints.is_empty() {
            self.prefer_no_schedule.remove(name);
        } else {
            self.prefer_no_schedule
                .insert(self.cluster.node_name(name), soft_taints);
        }
    }

    /// Applies a node deletion.
    pub fn delete_node(&mut self, node: &Node) {
        if let Some(name) = node.metadata.name.as_deref() {
            self.cluster.remove_node(name);
            self.prefer_no_schedule.remove(name);
        }
    }

    /// Replaces every node with a fresh list (after the watch relisted).
    pub fn replace_nodes(&mut self, nodes: &[Node]) {
        let listed: std::collections::HashSet<&str> = nodes
            .iter()
            .filter_map(|n| n.metadata.name.as_deref())
            .collect();
        let gone: Vec<Arc<str>> = self
            .cluster
            .nodes()
            .filter(|(name, node)| node.is_present() && !listed.contains(name))
            .map(|(name, _)| self.cluster.node_name(name))
            .collect();
        for name in gone {
            self.cluster.remove_node(&name);
            self.prefer_no_schedule.remove(&name);
        }
        for node in nodes {
            self.apply_node(node);
        }
        self.set_nodes_synced();
    }

    /// GPUs and eligibility of a node: the inventory annotation, or else capacity split
    /// evenly over the `gpu-count` label (1 when absent).
    fn read_node(&self, node: &Node) -> (Vec<Gpu>, bool) {
        let name = node.metadata.name.as_deref().unwrap_or_default();
        let eligible = node
            .metadata
            .labels
            .as_ref()
            .and_then(|labels| labels.get(&self.settings.label_key))
            .is_some_and(|value| *value == self.settings.label_value);
        let to_gpu = |g: GpuInfo| Gpu {
            index: g.index,
            uuid: g.uuid,
            model: g.model,
            numa: g.numa_node,
            total_gib: g.mem_gib,
            healthy: g.healthy,
        };
        let (gpus, source) = inventory::read(node, &self.settings.keys, &self.settings.resource);
        if let inventory::Source::Unreadable(error) = source {
            tracing::warn!(
                node = %name,
                %error,
                "cannot read the GPU inventory annotation; falling back to capacity"
            );
        }
        (gpus.into_iter().map(to_gpu).collect(), eligible)
    }

    /// Applies a pod from the pod watch. Returns a warning for the pod's owner when its
    /// allocation annotations became unreadable.
    pub fn apply_pod(&mut self, pod: &Pod) -> Option<PodWarning> {
        self.apply_facts(PodFacts::read(pod, &self.settings)?)
    }

    /// Applies what the watch saw of a pod (see [`PodFacts`]).
    pub fn apply_facts(&mut self, facts: PodFacts) -> Option<PodWarning> {
        let PodFacts {
            key,
            uid,
            node_name,
            finished,
            ask,
            allocation,
            host,
        } = facts;
        // Keep sharing the strings already held: an update of a known pod would otherwise
        // leave the indexes holding two copies of its name and UID.
        let key = self
            .pods
            .get_key_value(&key)
            .map_or(key, |(known, _)| known.clone());
        let uid = self
            .pod_keys
            .get_key_value(&uid)
            .map_or(uid, |(known, _)| known.clone());
        // A pod recreated under the same name is a different pod.
        if let Some(old) = self.pods.get(&key)
            && old.uid != uid
        {
            let old_uid = old.uid.clone();
            self.forget_pod(&key, &old_uid);
        }
        if ask == Ask::Nothing && matches!(allocation, AllocationFacts::Absent) {
            // Not ours (anymore), but its CPU and memory count on its node.
            self.forget_pod(&key, &uid);
            self.book_host(&uid, node_name.as_deref(), finished, host);
            return None;
        }
        self.book_host(&uid, node_name.as_deref(), finished, host);
        // A GPU pod seen waiting for the first time: its shape joins the workload the
        // fragmentation policy measures against (one-GPU shapes only: multi-GPU pods are
        // placed per slice, see `gpushare_allocator::Cluster::scores`).
        if node_name.is_none()
            && let Ask::Pending(request) = &ask
            && let Ok(request) = request.as_ref()
            && !request.is_multi()
            && self
                .pods
                .get(&key)
                .is_none_or(|known| known.node_name.is_none() && known.ask == Ask::Nothing)
        {
            self.cluster.observe(Shape {
                gpu_gib: request.pod_gib,
                host,
            });
        }
        let (namespace, name) = split_key(&key);
        let was_bad = self.pods.get(&key).is_some_and(|p| p.bad_annotations);
        let bad_annotations = matches!(
            allocation,
            AllocationFacts::Unreadable { .. } | AllocationFacts::Untrusted { .. }
        );
        let message = match &allocation {
            _ if was_bad => None,
            AllocationFacts::Unreadable { error, .. } => {
                tracing::error!(pod = %key, %uid, %error, "unreadable allocation annotations");
                Some(format!(
                    "gpushare allocation annotations of pod {namespace}/{name} cannot be read: {error}"
                ))
            }
            AllocationFacts::Untrusted { why, .. } => Some(format!(
                "gpushare allocation annotations of pod {namespace}/{name} are not signed by the gpushare extender ({why}); the device plugin gives it no GPU. Delete the pod and let the scheduler place it."
            )),
            _ => None,
        };
        let warning = message.map(|message| PodWarning {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            uid: uid.to_string(),
            message,
        });

        if finished {
            self.cluster.remove_pod(&uid);
            self.reservations.remove(&uid);
        } else if let Some(node) = node_name.as_deref() {
            /// What the pod's annotations do to its booking.
            enum Booking {
                Book(PodPlacement),
                /// Not trusted to change it: what is booked stays, nothing new is booked.
                Keep,
                Nothing,
            }
            let booking = match allocation {
                AllocationFacts::Readable(placement) => Booking::Book(placement),
                AllocationFacts::Unreadable { salvaged: None, .. } => {
                    tracing::error!(
                        pod = %key,
                        "pod's gpu-index or pod-gib annotation is unreadable: its GPU memory is NOT accounted and may be over-committed"
                    );
                    Booking::Nothing
                }
                AllocationFacts::Unreadable {
                    salvaged: Some(placement),
                    ..
                } => Booking::Book(placement),
                AllocationFacts::Absent => Booking::Nothing,
                AllocationFacts::Untrusted { why, fallback } => {
                    match (self.cluster.pod(&uid), fallback) {
                        (Some((booked_on, placement)), _) => {
                            if !was_bad {
                                tracing::warn!(
                                    pod = %key, node = %node, %why, booked_on = %booked_on, gpu = placement.gpu, gib = placement.pod_gib,
                                    "pod's gpushare allocation is not signed by the extender; keeping the GPU memory already booked for it"
                                );
                            }
                            Booking::Keep
                        }
                        (None, Some(fallback)) => {
                            if !was_bad {
                                tracing::warn!(
                                    pod = %key, node = %node, %why, gpu = fallback.gpu, gib = fallback.pod_gib,
                                    "pod's gpushare allocation is not signed by the extender; booking what its spec asks for on the GPU it names"
                                );
                            }
                            Booking::Book(fallback)
                        }
                        (None, None) => {
                            if !was_bad {
                                tracing::error!(
                                    pod = %key, node = %node, %why,
                                    "pod is bound with a gpushare allocation the extender did not sign and asks for no GPU memory: nothing is booked; the device plugin refuses to give it a GPU"
                                );
                            }
                            Booking::Nothing
                        }
                    }
                }
            };
            // The pod is bound: whatever bind reserved has served its purpose. From here on
            // the pod's own annotations (the Binding's, written in the same write as the
            // node) say where its memory is.
            let reserved = self.reservations.remove(&uid).is_some();
            match booking {
                Booking::Book(placement) => self.cluster.upsert_pod(uid.clone(), node, placement),
                Booking::Keep => {}
                Booking::Nothing => {
                    if (reserved || self.cluster.pod(&uid).is_none()) && !bad_annotations {
                        tracing::warn!(
                            pod = %key,
                            node = %node,
                            "pod asking for GPU memory is bound without a gpushare allocation; its memory is not accounted"
                        );
                    }
                    self.cluster.remove_pod(&uid);
                }
            }
        }
        // A pending pod (no node yet) keeps any reservation: its Binding is still being
        // written or resolved.

        // Taken after the booking, so a node first known through this pod shares its name too.
        let node_name = node_name.map(|node| self.cluster.node_name(&node));
        self.pod_keys.insert(uid.clone(), key.clone());
        self.pods.insert(
            key,
            CachedPod {
                uid,
                node_name,
                ask,
                bad_annotations,
                host,
            },
        );
        warning
    }

    /// Books (or, once it finished or left its node, forgets) a pod's CPU and memory.
    fn book_host(&mut self, uid: &PodId, node: Option<&str>, finished: bool, host: Host) {
        match node {
            Some(node) if !finished => self.cluster.set_pod_host(uid.clone(), node, host),
            _ => self.cluster.remove_pod_host(uid),
        }
    }

    /// Applies a pod deletion.
    pub fn delete_pod(&mut self, pod: &Pod) {
        let (Some(namespace), Some(name), Some(uid)) = (
            pod.metadata.namespace.as_deref(),
            pod.metadata.name.as_deref(),
            pod.metadata.uid.as_deref(),
        ) else {
            return;
        };
        self.forget_pod(&pod_key(namespace, name), &PodId::from(uid));
    }

    fn forget_pod(&mut self, key: &str, uid: &PodId) {
        if self.pods.get(key).is_some_and(|p| p.uid == *uid) {
            self.pods.remove(key);
        }
        self.pod_keys.remove(uid);
        self.reservations.remove(uid);
        self.cluster.remove_pod(uid);
        self.cluster.remove_pod_host(uid);
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
        // Allocations that do not verify keep what was booked for their pods (see the
        // module doc): carried over the rebuild.
        let kept: Vec<(PodId, Arc<str>, PodPlacement)> = pods
            .iter()
            .filter(|facts| {
                !facts.finished
                    && facts.node_name.is_some()
                    && matches!(facts.allocation, AllocationFacts::Untrusted { .. })
            })
            .filter_map(|facts| {
                let (node, placement) = self.cluster.pod(&facts.uid)?;
                Some((facts.uid.clone(), Arc::from(node), placement.clone()))
            })
            .collect();
        self.pods.clear();
        self.pod_keys.clear();
        self.cluster.forget_pods();
        for (uid, node, placement) in kept {
            self.cluster.upsert_pod(uid, &node, placement);
        }
        let warnings = pods
            .into_iter()
            .filter_map(|facts| self.apply_facts(facts))
            .collect();
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
        // The first list after a start: the fragmentation policy learns the shapes of the
        // pods bound before (a restarted extender scores like the one it replaces).
        if !self.pods_synced {
            self.cluster.relearn_workload();
        }
        self.set_pods_synced();
        warnings
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_contract::Keys;
    use gpushare_e2e::fixtures::{node, pod};

    fn view() -> View {
        View::new(Settings::new(
            gpushare_contract::DEFAULT_RESOURCE,
            gpushare_contract::DEFAULT_DOMAIN,
            "gpushare=true",
        ))
    }

    fn with_uid(mut pod: Pod, uid: &str) -> Pod {
        pod.metadata.uid = Some(uid.to_owned());
        pod
    }

    fn allocated(name: &str, uid: &str, gpu: u32, gib: u64) -> Pod {
        let keys = Keys::default();
        let mut builder = pod(name).gpu_mem(gib).on_node("n1");
        for (k, v) in [
            (keys.gpu_index.clone(), gpu.to_string()),
            (keys.pod_gib.clone(), gib.to_string()),
            (
                keys.containers.clone(),
                format!(r#"[{{"name":"main","gib":{gib}}}]"#),
            ),
            (keys.assigned.clone(), "false".to_owned()),
        ] {
            builder = builder.annotation(&k, &v);
        }
        with_uid(builder.build(), uid)
    }

    fn used(view: &View, gpu: usize) -> u64 {
        view.cluster.node("n1").unwrap().gpus()[gpu].used_gib
    }

    #[test]
    fn every_bound_pods_cpu_and_memory_count_on_its_node() {
        let mut view = view();
        view.replace_nodes(&[node("n1")
            .gpushare()
            .gpus(&[16])
            .cpu("8")
            .memory("32Gi")
            .build()]);
        let free = |view: &View| view.cluster.node("n1").unwrap().host_free();
        assert_eq!(free(&view), Host::new(8_000, 32 * 1024));
        // A pod that asks for no GPU memory is not kept as a gpushare pod, but its CPU counts.
        let web = with_uid(pod("web").cpu("1500m").on_node("n1").build(), "u-web");
        view.apply_pod(&web);
        assert!(view.pod("default", "web").is_none());
        assert_eq!(free(&view).milli_cpu, 6_500);
        // A GPU pod's too, and both go when the pods finish or leave.
        let mut gpu = with_uid(allocated("train", "u-train", 0, 4), "u-train");
        gpu.spec.as_mut().unwrap().containers[0]
            .resources
            .as_mut()
            .unwrap()
            .requests = Some(
            [
                ("cpu".to_owned(), Quantity("2".to_owned())),
                ("memory".to_owned(), Quantity("8Gi".to_owned())),
            ]
            .into(),
        );
        view.apply_pod(&gpu);
        assert_eq!(free(&view), Host::new(4_500, 24 * 1024));
        let mut done = web.clone();
        done.status = Some(k8s_openapi::api::core::v1::PodStatus {
            phase: Some("Succeeded".to_owned()),
            ..Default::default()
        });
        view.apply_pod(&done);
        assert_eq!(free(&view).milli_cpu, 6_000);
        view.delete_pod(&gpu);
        assert_eq!(free(&view), Host::new(8_000, 32 * 1024));
        // A relist rebuilds the same bookings from the listed pods.
        view.replace_pods(&[web.clone(), gpu.clone()]);
        assert_eq!(free(&view), Host::new(4_500, 24 * 1024));
    }

    #[test]
    fn waiting_gpu_pods_feed_the_workload_and_carry_their_cpu_to_bind() {
        let mut view = view();
        view.replace_nodes(&[node("n1").gpushare().gpus(&[16]).build()]);
        let waiting = with_uid(pod("nb").gpu_mem(4).cpu("3").build(), "u-nb");
        view.apply_pod(&waiting);
        view.apply_pod(&waiting);
        let shapes = view.cluster.workload().shapes();
        assert_eq!(shapes.len(), 1, "observed once, not per update");
        assert_eq!(
            (shapes[0].0.gpu_gib, shapes[0].0.host.milli_cpu),
            (4, 3_000)
        );
        let (request, _) = view
            .pod("default", "nb")
            .unwrap()
            .pending_request()
            .unwrap()
            .unwrap();
        assert_eq!(request.host.milli_cpu, 3_000);
    }

    #[test]
    fn pod_host_counts_sidecars_and_the_largest_init_container() {
        let spec = serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {
                "initContainers": [
                    {"name": "setup", "resources": {"requests": {"cpu": "4", "memory": "1Gi"}}},
                    {"name": "proxy", "restartPolicy": "Always", "resources": {"requests": {"cpu": "250m", "memory": "128Mi"}}}
                ],
                "containers": [
                    {"name": "a", "resources": {"requests": {"cpu": "1", "memory": "2G"}}},
                    {"name": "b", "resources": {"requests": {"cpu": "500m", "memory": "1.5e9"}}}
                ]
            }
        });
        let pod: Pod = serde_json::from_value(spec).unwrap();
        // Running: 1 + 0.5 + 0.25 cores; the 4-core init container is larger.
        let host = pod_host(&pod);
        assert_eq!(host.milli_cpu, 4_000);
        // Memory: 2e9 + 1.5e9 bytes + 128 MiB, more than the init container's 1 GiB.
        assert_eq!(host.memory_mib, 1908 + 1431 + 128);
        assert_eq!(millicores(&Quantity("bogus".into())), None);
    }

    #[test]
    fn capacity_fallback_splits_over_the_gpu_count() {
        let mut view = view();
        view.apply_node(&node("n1").gpushare().capacity_only(32, 2).build());
        let gpus = view.cluster.node("n1").unwrap().gpus();
        assert_eq!(gpus.len(), 2);
        assert!(
            gpus.iter()
                .all(|g| g.gpu.total_gib == 16 && g.gpu.uuid.is_empty())
        );
        view.apply_node(&node("n2").capacity_only(8, 0).build());
        assert!(!view.cluster.node("n2").unwrap().is_eligible());
    }

    #[test]
    fn finished_and_deleted_pods_free_their_memory() {
        let mut view = view();
        view.apply_node(&node("n1").gpushare().gpus(&[16]).build());
        let mut p = allocated("a", "u1", 0, 4);
        view.apply_pod(&p);
        assert_eq!(used(&view, 0), 4);
        p.status = Some(k8s_openapi::api::core::v1::PodStatus {
            phase: Some("Succeeded".into()),
            ..Default::default()
        });
        view.apply_pod(&p);
        assert_eq!(used(&view, 0), 0);
        let q = allocated("b", "u2", 0, 6);
        view.apply_pod(&q);
        view.delete_pod(&q);
        assert_eq!(used(&view, 0), 0);
        assert!(view.pod("default", "b").is_none());
    }

    #[test]
    fn a_pod_kubelet_admitted_waits_for_no_device_without_marks() {
        let mut view = view();
        view.apply_node(&node("n1").gpushare().gpus(&[16, 16]).build());
        let mut p = allocated("a", "u1", 1, 4);
        view.apply_pod(&p);
        let pending = |view: &View| -> Vec<(u64, Vec<u32>)> {
            let node = view.cluster.node("n1").unwrap();
            node.pending()
                .map(|(gib, gpus, _)| (gib, gpus.to_vec()))
                .collect()
        };
        // Bound, not admitted: the twin rule pins the next 4 GiB pod to GPU 1.
        assert_eq!(pending(&view), vec![(4, vec![1])]);
        // kubelet's status write, with no device-plugin mark: admitted, so no longer pending.
        p.status = Some(k8s_openapi::api::core::v1::PodStatus {
            phase: Some("Pending".into()),
            start_time: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                jiff::Timestamp::UNIX_EPOCH,
            )),
            ..Default::default()
        });
        view.apply_pod(&p);
        assert_eq!(pending(&view), vec![]);
        assert_eq!(used(&view, 1), 4);
    }

    #[test]
    fn a_recreated_pod_replaces_the_old_uid() {
        let mut view = view();
        view.apply_node(&node("n1").gpushare().gpus(&[16]).build());
        view.apply_pod(&allocated("a", "old", 0, 4));
        view.apply_pod(&with_uid(pod("a").gpu_mem(4).build(), "new"));
        assert_eq!(used(&view, 0), 0);
        assert_eq!(view.pod("default", "a").unwrap().uid, PodId::from("new"));
    }

    #[test]
    fn updates_keep_sharing_one_name_and_one_uid() {
        let mut view = view();
        view.apply_node(&node("n1").gpushare().gpus(&[16]).build());
        let p = allocated("a", "u1", 0, 4);
        view.apply_pod(&p);
        view.apply_pod(&p);
        let (key, cached) = view.pods.get_key_value("default/a").unwrap();
        let (uid, indexed_key) = view.pod_keys.get_key_value(&cached.uid).unwrap();
        assert!(Arc::ptr_eq(key, indexed_key));
        assert!(std::ptr::eq(uid.as_str(), cached.uid.as_str()));
        let node_name = cached.node_name.as_ref().unwrap();
        assert!(std::ptr::eq(
            node_name.as_ptr(),
            view.cluster.node_name("n1").as_ptr()
        ));
    }

    #[test]
    fn node_relists_drop_missing_nodes_and_pod_relists_their_ghosts() {
        let mut view = view();
        view.replace_nodes(&[
            node("n1").gpushare().gpus(&[16]).build(),
            node("n2").gpushare().gpus(&[16]).build(),
        ]);
        let on_n2 = {
            let mut p = allocated("b", "u2", 0, 4);
            p.spec.as_mut().unwrap().node_name = Some("n2".into());
            p
        };
        view.replace_pods(&[allocated("a", "u1", 0, 4), on_n2.clone()]);
        // n2 leaves the node list while its pod is still there: it stays, not present, with
        // the pod's memory booked until the pod goes.
        view.replace_nodes(&[node("n1").gpushare().gpus(&[16]).build()]);
        assert!(view.cluster.node("n2").is_some_and(|n| !n.is_present()));
        view.replace_pods(std::slice::from_ref(&on_n2));
        assert!(view.cluster.node("n2").is_some_and(|n| !n.is_present()));
        assert_eq!(view.cluster.pod_count(), 1);
        assert!(view.pod("default", "a").is_none());
        // Once its pod is gone too, so is the node.
        view.replace_pods(&[]);
        assert!(view.cluster.node("n2").is_none());
        assert!(view.cluster.node("n1").is_some_and(|n| n.is_present()));
    }

    #[test]
    fn unreadable_annotations_warn_once_and_count_what_can_be_salvaged() {
        let keys = Keys::default();
        // (annotation broken, its value, GiB still booked, text the warning names)
        let cases = [
            (keys.containers.clone(), "{broken", 4, "default/a"),
            (keys.gpu_index.clone(), "first", 0, "first"),
        ];
        for (key, value, booked, named) in cases {
            let mut view = view();
            view.apply_node(&node("n1").gpushare().gpus(&[16]).build());
            let mut p = allocated("a", "u1", 0, 4);
            p.metadata
                .annotations
                .as_mut()
                .unwrap()
                .insert(key.clone(), value.into());
            let warning = view.apply_pod(&p).unwrap();
            assert!(
                warning.message.contains(named),
                "{key}: {}",
                warning.message
            );
            assert_eq!(used(&view, 0), booked, "{key}");
            assert!(view.pod("default", "a").unwrap().bad_annotations);
            assert!(view.apply_pod(&p).is_none(), "{key}: warned twice");
        }
    }

    /// Books a 4 GiB reservation for pod `name` (UID `uid`) on n1 and returns its ticket.
    fn reserve(view: &mut View, uid: &str, name: &str) -> Ticket {
        let request = Request {
            models: Default::default(),
            gpus: 1,
            exclusive: false,
            pod_gib: 4,
            containers: vec![4],
            host: Host::default(),
        };
        let placed = view
            .cluster
            .reserve(
                uid.into(),
                "n1",
                &request,
                gpushare_allocator::Policy::Binpack,
            )
            .unwrap();
        view.add_reservation(
            uid.into(),
            "default",
            name,
            "n1",
            PodPlacement {
                more_gpus: Vec::new(),
                exclusive: false,
                gpu: placed.gpu,
                uuid: placed.uuid.as_str().into(),
                pod_gib: 4,
                pending: vec![4],
                assigned: false,
            },
        )
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

    #[test]
    fn a_pod_bound_without_our_annotations_ends_its_reservation() {
        let mut view = view();
        view.replace_nodes(&[node("n1").gpushare().gpus(&[16]).build()]);
        let a = with_uid(pod("a").gpu_mem(4).build(), "ua");
        view.replace_pods(std::slice::from_ref(&a));
        reserve(&mut view, "ua", "a");
        view.apply_pod(&with_uid(pod("a").gpu_mem(4).on_node("n1").build(), "ua"));
        assert_eq!(view.reservation_count(), 0);
        assert_eq!(used(&view, 0), 0);
    }

    const KEYRING: &str = "k1:AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";

    fn signing_view() -> View {
        let keyring = gpushare_contract::Keyring::parse(KEYRING).unwrap();
        let mut view = View::new(
            Settings::new(
                gpushare_contract::DEFAULT_RESOURCE,
                gpushare_contract::DEFAULT_DOMAIN,
                "gpushare=true",
            )
            .with_keyring(SharedKeyring::new(keyring)),
        );
        view.replace_nodes(&[node("n1").gpushare().gpus(&[16]).build()]);
        view
    }

    /// [`allocated`], signed by the extender for pod `uid` on n1.
    fn signed(name: &str, uid: &str, gpu: u32, gib: u64) -> Pod {
        let keys = Keys::default();
        let mut pod = allocated(name, uid, gpu, gib);
        let annotations = pod.metadata.annotations.as_mut().unwrap();
        let allocation = PodAllocation::from_annotations(&keys, annotations)
            .unwrap()
            .unwrap();
        let keyring = gpushare_contract::Keyring::parse(KEYRING).unwrap();
        annotations.insert(keys.signature, keyring.sign(uid, "n1", &allocation));
        pod
    }

    #[test]
    fn with_a_keyring_unsigned_allocations_book_the_spec_request_not_their_claim() {
        let mut view = signing_view();
        assert!(view.apply_pod(&signed("a", "ua", 0, 4)).is_none());
        assert_eq!(used(&view, 0), 4);
        // Hand-written annotations, or another pod's signed ones: what the pod's spec asks for
        // is booked on the GPU they name (never what they claim), and the owner hears why.
        for forged in [allocated("f", "uf", 0, 4), {
            let mut copy = signed("a", "ua", 0, 4);
            copy.metadata.name = Some("f".into());
            with_uid(copy, "uf")
        }] {
            let mut view = signing_view();
            let warning = view.apply_pod(&forged).unwrap();
            assert!(
                warning.message.contains("default/f")
                    && warning
                        .message
                        .contains("not signed by the gpushare extender"),
                "{}",
                warning.message
            );
            assert_eq!(used(&view, 0), 4);
            assert!(view.pod("default", "f").unwrap().bad_annotations);
            assert!(view.apply_pod(&forged).is_none(), "warned twice");
        }
        // The forgery found on a real cluster: 12 GiB asked for, `pod-gib: 0` claimed.
        let mut view = signing_view();
        let mut forged = allocated("f", "uf", 0, 12);
        forged
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(Keys::default().pod_gib, "0".into());
        view.apply_pod(&forged);
        assert_eq!(used(&view, 0), 12);
    }

    #[test]
    fn an_allocation_that_stops_verifying_cannot_lower_the_booking() {
        let mut view = signing_view();
        view.apply_pod(&signed("a", "ua", 0, 8));
        assert_eq!(used(&view, 0), 8);
        // The owner edits pod-gib down to 1: the signature no longer matches.
        let mut edited = signed("a", "ua", 0, 8);
        edited
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(Keys::default().pod_gib, "1".into());
        assert!(view.apply_pod(&edited).is_some());
        assert_eq!(used(&view, 0), 8, "the booking stays");
        // Nor does a relist (watch expiry) drop it.
        view.replace_pods(std::slice::from_ref(&edited));
        assert_eq!(used(&view, 0), 8);
        // The pod's end still frees it.
        view.delete_pod(&edited);
        assert_eq!(used(&view, 0), 0);
    }

    #[test]
    fn a_reservation_stays_booked_when_the_bound_pod_does_not_verify() {
        let mut view = signing_view();
        let a = with_uid(pod("a").gpu_mem(4).build(), "ua");
        view.replace_pods(std::slice::from_ref(&a));
        reserve(&mut view, "ua", "a");
        assert_eq!(used(&view, 0), 4);
        // The watch shows the pod bound with an allocation that claims less and is unsigned.
        view.apply_pod(&allocated("a", "ua", 0, 1));
        assert_eq!(view.reservation_count(), 0);
        assert_eq!(used(&view, 0), 4);
    }

    #[test]
    fn without_a_keyring_nothing_is_verified() {
        let mut view = view();
        view.apply_node(&node("n1").gpushare().gpus(&[16]).build());
        assert!(view.apply_pod(&allocated("a", "ua", 0, 4)).is_none());
        assert_eq!(used(&view, 0), 4);
    }
}
