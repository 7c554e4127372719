//! The node's pods, as the plugin needs them to answer `Allocate` without an API call.
//!
//! A reflector watches only the pods bound to this node (`spec.nodeName=<node>`); every
//! decision reads that local store. On top of it sits an *overlay* of the marks this plugin
//! has decided but the API server may not show yet (`allocated`, `assigned`): an Allocate
//! that marks a container is visible to the very next Allocate, even before our patch has
//! round-tripped through the watch. The overlay entry is dropped once the store shows the
//! same marks and no write is outstanding.
//!
//! With `--allocation-marks` the marks are written in one background worker, in decision
//! order, with retries, so an Allocate answers in microseconds and never waits for the API
//! server. The worker always writes the *latest* marks of a pod, so a slow write can never
//! overwrite a newer decision. Without it (the default) the marks stay in the overlay: what
//! outlives this process is kubelet's own record, a `startTime` in the pod's status once
//! kubelet admitted the pod (and so allocated each of its containers), and its PodResources
//! listing; a pod with a `startTime` is never matched again ([`matching::PodView::admitted`]).
//!
//! With a keyring, each pod's allocation is verified when it is read (once per resourceVersion
//! and keyring generation) and carried as [`matching::Trust`]: matching considers only
//! allocations the extender signed, and when nothing else waits for a size, the pod that
//! would have matched is named in the refusal ([`ClaimError::Untrusted`]).
//!
//! Reconcile runs on every pod event and every two seconds. When kubelet's PodResources API
//! answered last time ([`PodCache::set_facts`], from [`crate::pod_resources`]), marks follow what
//! kubelet reports each container holds ([`crate::matching::plan_from_facts`]); otherwise
//! [`crate::matching::plan_reconcile`] infers from pod phases which pod kubelet started and
//! moves the marks that landed on a same-sized twin back to it.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::StreamExt;
use gpushare_contract::{ContainerRequest, Keys, PodAllocation, SharedKeyring};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::facts::{self, BarePod, Finding, KubeletFacts};
use crate::matching::{self, Intruder, Marks, PodView, Trust};
use crate::metrics::Metrics;

/// How often reconcile runs without pod events.
pub const RECONCILE_PERIOD: Duration = Duration::from_secs(2);
/// How long a pod must have been seen Running before its marks are reconciled (kubelet's
/// status writes lag its admissions; see [`matching::plan_reconcile`]).
pub const RECONCILE_AFTER_RUNNING: Duration = Duration::from_secs(5);
/// Attempts for one pod patch before waiting for the next reconcile.
const PATCH_ATTEMPTS: u32 = 6;

/// Why no container could be claimed.
#[derive(Debug)]
pub enum ClaimError<E> {
    /// No pod bound here waits for a container of this many GiB.
    NoPendingPod {
        /// the size asked for
        gib: u64,
    },
    /// A pod matched, but `check` refused it.
    Rejected(E),
    /// Nothing the extender signed waits for this size, but a pod whose allocation is not
    /// signed (or is forged) does: it gets no GPU.
    Untrusted {
        /// the size asked for
        gib: u64,
        /// `namespace/name` of that pod
        pod: String,
        /// why its allocation is refused
        why: String,
    },
}

/// One container matched to an Allocate request.
#[derive(Debug, Clone)]
pub struct Claim<T> {
    /// `namespace/name` of the pod.
    pub pod: String,
    /// The container.
    pub container: ContainerRequest,
    /// The pod's allocation, as recorded by the extender.
    pub allocation: PodAllocation,
    /// What `check` returned for it.
    pub checked: T,
}

#[derive(Debug)]
struct Overlay {
    namespace: String,
    name: String,
    marks: Marks,
    /// Not yet written to the API server.
    dirty: bool,
}

/// A pod as last read.
#[derive(Debug)]
struct ParsedPod {
    /// The resourceVersion it was read at.
    version: String,
    /// The keyring generation it was read at.
    generation: u64,
    /// Its view; `None` when it is not bound here or carries no readable allocation.
    view: Option<Arc<PodView>>,
    /// When this plugin first read the pod: kubelet listings older than that do not judge it.
    first_seen: std::time::Instant,
}

/// What reading the pods collects for comparing them with a kubelet listing taken at
/// `taken_at`.
#[derive(Debug)]
struct KubeletContext {
    taken_at: std::time::Instant,
    /// UIDs of pods first read before the listing was taken.
    judged: HashSet<String>,
    /// Pods bound here, not finished, without an allocation the plugin can read.
    bare: Vec<BarePod>,
    /// UIDs of every pod in the cache.
    live: HashSet<String>,
}

impl KubeletContext {
    fn new(taken_at: std::time::Instant) -> Self {
        Self {
            taken_at,
            judged: HashSet::new(),
            bare: Vec::new(),
            live: HashSet::new(),
        }
    }
}

/// The node-scoped pod cache with our pending marks.
pub struct PodCache {
    node: String,
    keys: Keys,
    /// Verifies the extender's signatures; `None`: allocations are not verified.
    keyring: Option<SharedKeyring>,
    store: Store<Pod>,
    synced: AtomicBool,
    overlay: Mutex<HashMap<String, Overlay>>,
    /// Pods already read, by UID, with the resourceVersion they were read at: each Allocate
    /// looks at every pod on the node, and re-reading unchanged annotations each time would
    /// make Allocate cost grow with the node's pod count.
    parsed: Mutex<HashMap<String, ParsedPod>>,
    /// When each pod was first seen Running.
    running_since: Mutex<HashMap<String, std::time::Instant>>,
    /// kubelet's last PodResources listing; `None` when it could not be read.
    facts: Mutex<Option<Arc<KubeletFacts>>>,
    /// Containers of pods without an allocation of their own whose stray mark has been given
    /// back (`(uid, container)`), so each is given back once.
    compensated: Mutex<HashSet<(String, String)>>,
    metrics: Metrics,
    changes: watch::Sender<u64>,
    patches: mpsc::UnboundedSender<String>,
    /// Whether marks are written to the API server (`--allocation-marks`); off, they live
    /// in the overlay only, until the pod leaves the node.
    write_marks: bool,
}

impl std::fmt::Debug for PodCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodCache")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl PodCache {
    /// Starts watching the pods bound to `node`, the patch worker and the reconcile loop;
    /// all stop on `shutdown`. With `keyring`, only allocations it verifies are acted on;
    /// with `write_marks`, the marks are written on the pods. Returns the cache and those
    /// tasks, for the caller to supervise: should one end before `shutdown`, Allocate would
    /// answer from a frozen view.
    pub fn start(
        client: Client,
        node: &str,
        keys: Keys,
        keyring: Option<SharedKeyring>,
        metrics: Metrics,
        write_marks: bool,
        shutdown: CancellationToken,
    ) -> (Arc<Self>, Vec<(&'static str, JoinHandle<()>)>) {
        let (store, writer) = reflector::store();
        let (patches, patch_rx) = mpsc::unbounded_channel();
        let cache = Arc::new(Self {
            node: node.to_owned(),
            keys,
            keyring,
            store,
            synced: AtomicBool::new(false),
            overlay: Mutex::new(HashMap::new()),
            parsed: Mutex::new(HashMap::new()),
            running_since: Mutex::new(HashMap::new()),
            facts: Mutex::new(None),
            compensated: Mutex::new(HashSet::new()),
            metrics: metrics.clone(),
            changes: watch::Sender::new(0),
            patches,
            write_marks,
        });
        let api: Api<Pod> = Api::all(client.clone());
        let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let stream = reflector::reflector(writer, watcher(api, config).default_backoff());
        let tasks = vec![
            (
                "pod watch",
                tokio::spawn(cache.clone().watch_pods(stream, shutdown.clone())),
            ),
            (
                "pod patch worker",
                tokio::spawn(cache.clone().patch_worker(
                    client,
                    patch_rx,
                    metrics,
                    shutdown.clone(),
                )),
            ),
            (
                "pod reconcile loop",
                tokio::spawn(cache.clone().reconcile_loop(shutdown)),
            ),
        ];
        (cache, tasks)
    }

    async fn watch_pods(
        self: Arc<Self>,
        stream: impl futures::Stream<Item = Result<watcher::Event<Pod>, watcher::Error>>,
        shutdown: CancellationToken,
    ) {
        let mut stream = std::pin::pin!(stream);
        loop {
            let item = tokio::select! {
                () = shutdown.cancelled() => return,
                item = stream.next() => item,
            };
            match item {
                Some(Ok(event)) => {
                    if matches!(event, watcher::Event::InitDone) {
                        self.synced.store(true, Ordering::Relaxed);
                    }
                    self.changes.send_modify(|n| *n += 1);
                }
                Some(Err(err)) => {
                    tracing::warn!(node = %self.node, error = %err, "pod watch failed; retrying");
                }
                None => return,
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Overlay>> {
        // A poisoned lock only means another thread panicked mid-update of plain data.
        self.overlay
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Pods bound here that carry an allocation, with our marks applied.
    fn views(&self, overlay: &HashMap<String, Overlay>) -> Vec<Arc<PodView>> {
        self.collect_views(overlay, None, None)
    }

    /// Pods bound here that carry an allocation, with our marks applied; with `stored`, also
    /// the marks as the API server has them, by UID; with `kubelet`, what comparing them
    /// with a kubelet listing needs.
    ///
    /// Why shared views: Allocate runs this over every pod on the node (1,000 in the load
    /// harness); a cache hit costs a reference count, and only views our unsaved marks
    /// change are copied.
    fn collect_views(
        &self,
        overlay: &HashMap<String, Overlay>,
        mut stored: Option<&mut HashMap<String, Marks>>,
        mut kubelet: Option<&mut KubeletContext>,
    ) -> Vec<Arc<PodView>> {
        let mut views = Vec::new();
        let mut parsed = self
            .parsed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let pods = self.store.state();
        let generation = self.keyring.as_ref().map_or(0, SharedKeyring::generation);
        // Forget pods that left the store, so the cache stays the size of the node.
        if parsed.len() > pods.len() {
            let live: std::collections::HashSet<&str> = pods
                .iter()
                .filter_map(|pod| pod.metadata.uid.as_deref())
                .collect();
            parsed.retain(|uid, _| live.contains(uid.as_str()));
        }
        let now = std::time::Instant::now();
        for pod in &pods {
            let uid = pod.metadata.uid.as_deref().unwrap_or_default();
            let version = pod.metadata.resource_version.as_deref().unwrap_or_default();
            let (view, first_seen) = match parsed.get(uid) {
                Some(entry) if entry.version == version && entry.generation == generation => {
                    (entry.view.clone(), entry.first_seen)
                }
                entry => {
                    let first_seen = entry.map_or(now, |entry| entry.first_seen);
                    let view = self.read_view(pod).map(Arc::new);
                    parsed.insert(
                        uid.to_owned(),
                        ParsedPod {
                            version: version.to_owned(),
                            generation,
                            view: view.clone(),
                            first_seen,
                        },
                    );
                    (view, first_seen)
                }
            };
            if let Some(kubelet) = kubelet.as_deref_mut() {
                kubelet.live.insert(uid.to_owned());
                if first_seen < kubelet.taken_at {
                    kubelet.judged.insert(uid.to_owned());
                }
                let here = pod.spec.as_ref().and_then(|spec| spec.node_name.as_deref())
                    == Some(self.node.as_str());
                let phase = pod
                    .status
                    .as_ref()
                    .and_then(|status| status.phase.as_deref());
                if view.is_none() && here && !gpushare_contract::request::phase_is_finished(phase) {
                    kubelet.bare.push(BarePod {
                        key: gpushare_contract::request::pod_key(pod),
                        uid: uid.to_owned(),
                    });
                }
            }
            let Some(mut view) = view else {
                continue;
            };
            if let Some(stored) = stored.as_deref_mut() {
                stored.insert(uid.to_owned(), view.marks());
            }
            if let Some(entry) = overlay.get(uid)
                && view.marks() != entry.marks
            {
                Arc::make_mut(&mut view).set_marks(&entry.marks);
            }
            views.push(view);
        }
        views
    }

    /// A pod bound here with a readable allocation, as the matching logic sees it, its
    /// signature checked.
    fn read_view(&self, pod: &Pod) -> Option<PodView> {
        let node = pod.spec.as_ref().and_then(|spec| spec.node_name.clone());
        if node.as_deref() != Some(self.node.as_str()) {
            return None;
        }
        let annotations = pod.metadata.annotations.as_ref()?;
        let key = gpushare_contract::request::pod_key(pod);
        let allocation = match PodAllocation::from_annotations(&self.keys, annotations) {
            Ok(allocation) => allocation?,
            Err(err) => {
                tracing::debug!(pod = %key, error = %err, "ignoring pod with unreadable allocation annotations");
                return None;
            }
        };
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let trust = match &self.keyring {
            None => Trust::Unchecked,
            Some(keyring) => match keyring.current().verify(&uid, &self.node, &allocation) {
                Ok(_) => Trust::Verified,
                Err(why) => {
                    tracing::warn!(pod = %key, %uid, %why, "pod carries a gpushare allocation the extender did not sign; it will get no GPU");
                    Trust::Refused(why.to_string())
                }
            },
        };
        Some(PodView {
            key,
            uid,
            node,
            phase: pod.status.as_ref().and_then(|status| status.phase.clone()),
            deleting: pod.metadata.deletion_timestamp.is_some(),
            admitted: pod
                .status
                .as_ref()
                .is_some_and(|status| status.start_time.is_some()),
            allocation,
            trust,
        })
    }

    fn record(&self, overlay: &mut HashMap<String, Overlay>, view: &PodView, marks: Marks) {
        let (namespace, name) = view.key.split_once('/').unwrap_or(("default", &view.key));
        overlay.insert(
            view.uid.clone(),
            Overlay {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                marks,
                dirty: self.write_marks,
            },
        );
        if self.write_marks {
            // The worker only ends at shutdown; a failed send then loses nothing we need.
            let _ = self.patches.send(view.uid.clone());
        }
    }

    /// Live pods (not finished, not being deleted) whose allocation, trusted, is on the GPU
    /// with `uuid` (a multi-GPU pod: on any of its GPUs): `(namespace/name, uid)`.
    pub fn pods_on_gpu(&self, uuid: &str) -> Vec<(String, String)> {
        let overlay = self.lock();
        self.views(&overlay)
            .iter()
            .filter(|view| {
                view.allocation.gpus().any(|(_, gpu)| gpu == uuid)
                    && !view.deleting
                    && !gpushare_contract::request::phase_is_finished(view.phase.as_deref())
                    && matches!(
                        view.trust,
                        matching::Trust::Verified | matching::Trust::Unchecked
                    )
            })
            .map(|view| (view.key.clone(), view.uid.clone()))
            .collect()
    }

    /// Matches each size in `sizes` (one per container request) to a pending container,
    /// runs `check` on it, and marks it allocated. All or nothing: if one size has no match
    /// or `check` refuses, nothing is marked.
    pub fn try_claim<T, E>(
        &self,
        sizes: &[u64],
        mut check: impl FnMut(&PodView, &ContainerRequest) -> Result<T, E>,
    ) -> Result<Vec<Claim<T>>, ClaimError<E>> {
        let mut overlay = self.lock();
        let mut views = self.views(&overlay);
        let mut claims = Vec::with_capacity(sizes.len());
        let mut changed = Vec::new();
        for &gib in sizes {
            let Some((index, container)) = matching::find_pending(&views, &self.node, gib) else {
                return Err(ClaimError::NoPendingPod { gib });
            };
            let container = container.clone();
            let checked = check(&views[index], &container).map_err(ClaimError::Rejected)?;
            claims.push(Claim {
                pod: views[index].key.clone(),
                container: container.clone(),
                allocation: views[index].allocation.clone(),
                checked,
            });
            Arc::make_mut(&mut views[index]).mark_allocated(&container.name);
            if !changed.contains(&index) {
                changed.push(index);
            }
        }
        for index in changed {
            let marks = views[index].marks();
            self.record(&mut overlay, &views[index], marks);
        }
        Ok(claims)
    }

    /// Like [`Self::try_claim`], but when no pod waits for a size yet, waits up to `wait`
    /// for the watch to bring one (kubelet may see a pod a moment before we do).
    ///
    /// Only then, if a pod whose allocation is not the extender's waits for that size, is it
    /// named ([`ClaimError::Untrusted`]): refusing at once could refuse an honest pod that
    /// kubelet admits before our watch shows it.
    pub async fn claim<T, E>(
        &self,
        sizes: &[u64],
        mut check: impl FnMut(&PodView, &ContainerRequest) -> Result<T, E>,
        wait: Duration,
    ) -> Result<Vec<Claim<T>>, ClaimError<E>> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut changes = self.changes.subscribe();
        loop {
            changes.borrow_and_update();
            match self.try_claim(sizes, &mut check) {
                Err(ClaimError::NoPendingPod { gib }) => {
                    let changed = tokio::time::timeout_at(deadline, changes.changed()).await;
                    if !matches!(changed, Ok(Ok(()))) {
                        return Err(match self.untrusted(gib) {
                            Some((pod, why)) => ClaimError::Untrusted { gib, pod, why },
                            None => ClaimError::NoPendingPod { gib },
                        });
                    }
                }
                other => return other,
            }
        }
    }

    /// The pod whose allocation is not the extender's that an Allocate of `gib` devices
    /// would have matched, and why it is refused.
    fn untrusted(&self, gib: u64) -> Option<(String, String)> {
        let overlay = self.lock();
        let views = self.views(&overlay);
        matching::find_untrusted(&views, &self.node, gib)
            .map(|(index, why)| (views[index].key.clone(), why.to_owned()))
    }

    /// The GPU indices (the first one first) of the pod an Allocate of `gib` devices would be
    /// matched to, waiting up to `wait` for the watch to bring one; empty when none comes.
    pub async fn preview(&self, gib: u64, wait: Duration) -> Vec<u32> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut changes = self.changes.subscribe();
        loop {
            changes.borrow_and_update();
            let found = {
                let overlay = self.lock();
                let views = self.views(&overlay);
                matching::find_pending(&views, &self.node, gib).map(|(i, _)| {
                    views[i]
                        .allocation
                        .gpus()
                        .map(|(index, _)| index)
                        .collect::<Vec<_>>()
                })
            };
            if let Some(found) = found {
                return found;
            }
            let changed = tokio::time::timeout_at(deadline, changes.changed()).await;
            if !matches!(changed, Ok(Ok(()))) {
                return Vec::new();
            }
        }
    }

    /// Fixes marks from what kubelet reports the containers hold when its PodResources API
    /// answered ([`matching::plan_from_facts`]), else from pod phases
    /// ([`matching::plan_reconcile`]); re-queues unwritten marks and forgets overlay entries
    /// the API server has caught up with.
    pub fn reconcile(&self) {
        let facts = self.facts();
        let mut overlay = self.lock();
        let mut stored = HashMap::new();
        let mut kubelet = facts
            .as_ref()
            .map(|facts| KubeletContext::new(facts.taken_at));
        let mut views = self.collect_views(&overlay, Some(&mut stored), kubelet.as_mut());
        let settled = {
            let mut since = self
                .running_since
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let now = std::time::Instant::now();
            since.retain(|uid, _| views.iter().any(|v| v.uid == *uid && v.running()));
            for view in views.iter().filter(|v| v.running()) {
                since.entry(view.uid.clone()).or_insert(now);
            }
            since
                .iter()
                .filter(|(_, at)| now.duration_since(**at) >= RECONCILE_AFTER_RUNNING)
                .map(|(uid, _)| uid.clone())
                .collect::<HashSet<String>>()
        };
        let plan = match (&facts, &kubelet) {
            (Some(facts), Some(kubelet)) => {
                let intruders = self.intruders(&views, facts, kubelet);
                let plan = matching::plan_from_facts(
                    &mut views,
                    &self.node,
                    facts,
                    |view| kubelet.judged.contains(&view.uid),
                    &intruders,
                );
                self.lock_compensated().extend(plan.compensated);
                for (index, marks) in &plan.marks {
                    tracing::info!(pod = %views[*index].key, allocated = ?marks.allocated, assigned = marks.assigned, "corrected allocation marks from what kubelet reports the pod's containers hold");
                }
                self.metrics
                    .marks_from_kubelet
                    .inc_by(plan.marks.len() as u64);
                plan.marks
            }
            _ => {
                let plan = matching::plan_reconcile(&mut views, &self.node, |view| {
                    settled.contains(&view.uid)
                });
                for (index, marks) in &plan {
                    tracing::info!(pod = %views[*index].key, allocated = ?marks.allocated, assigned = marks.assigned, "reconciled allocation marks");
                }
                plan
            }
        };
        let moved = !plan.is_empty();
        for (index, marks) in plan {
            self.record(&mut overlay, &views[index], marks);
        }
        if moved {
            // An Allocate waiting for a pending pod of this size (`claim`) looks again: a mark
            // given back makes its pod pending, and without marks on the pods (the default)
            // no pod event would come to wake it.
            self.changes.send_modify(|n| *n += 1);
        }
        let synced = self.synced.load(Ordering::Relaxed);
        let present: HashSet<&String> = stored.keys().collect();
        overlay.retain(|uid, entry| {
            if !present.contains(uid) {
                return !synced;
            }
            if entry.dirty {
                let _ = self.patches.send(uid.clone());
                return true;
            }
            stored.get(uid) != Some(&entry.marks)
        });
    }

    /// Takes kubelet's latest PodResources listing (`None`: it could not be read, marks are
    /// reconciled from pod phases again) and reconciles with it.
    pub fn set_facts(&self, facts: Option<KubeletFacts>) {
        *self
            .facts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = facts.map(Arc::new);
        self.reconcile();
    }

    fn facts(&self) -> Option<Arc<KubeletFacts>> {
        self.facts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn lock_compensated(&self) -> MutexGuard<'_, HashSet<(String, String)>> {
        self.compensated
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Containers of pods here without an allocation the plugin acts on that kubelet reports
    /// holding devices, not yet accounted for (see [`matching::plan_from_facts`]).
    fn intruders(
        &self,
        views: &[Arc<PodView>],
        facts: &KubeletFacts,
        kubelet: &KubeletContext,
    ) -> Vec<Intruder> {
        let mut compensated = self.lock_compensated();
        let live: HashSet<&str> = views
            .iter()
            .map(|view| view.uid.as_str())
            .chain(kubelet.bare.iter().map(|pod| pod.uid.as_str()))
            .collect();
        compensated.retain(|(uid, _)| live.contains(uid.as_str()));
        let untrusted = views
            .iter()
            .filter(|view| !view.trusted())
            .map(|view| (view.key.as_str(), view.uid.as_str()));
        let bare = kubelet
            .bare
            .iter()
            .map(|pod| (pod.key.as_str(), pod.uid.as_str()));
        let mut intruders = Vec::new();
        for (key, uid) in untrusted.chain(bare) {
            if !kubelet.judged.contains(uid) {
                continue;
            }
            let Some(pod) = facts.pod(key) else { continue };
            for (container, ids) in &pod.containers {
                if !compensated.contains(&(uid.to_owned(), container.clone())) {
                    intruders.push(Intruder {
                        uid: uid.to_owned(),
                        container: container.clone(),
                        gib: u64::try_from(ids.len()).unwrap_or(u64::MAX),
                    });
                }
            }
        }
        intruders
    }

    /// Where kubelet's `facts` disagree with the allocations here (see [`facts::check`]),
    /// and the UIDs of every pod in the cache; `gpu_uuid` maps this node's GPU indices to
    /// UUIDs.
    pub fn findings(
        &self,
        facts: &KubeletFacts,
        gpu_uuid: impl Fn(u32) -> Option<String>,
    ) -> (Vec<Finding>, HashSet<String>) {
        let overlay = self.lock();
        let mut kubelet = KubeletContext::new(facts.taken_at);
        let views = self.collect_views(&overlay, None, Some(&mut kubelet));
        drop(overlay);
        let findings = facts::check(&views, &kubelet.bare, facts, gpu_uuid, |uid| {
            kubelet.judged.contains(uid)
        });
        (findings, kubelet.live)
    }

    async fn reconcile_loop(self: Arc<Self>, shutdown: CancellationToken) {
        let mut changes = self.changes.subscribe();
        let mut tick = tokio::time::interval(RECONCILE_PERIOD);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                changed = changes.changed() => if changed.is_err() { return },
                _ = tick.tick() => {}
            }
            self.reconcile();
        }
    }

    /// The latest unwritten marks of `uid`, marked as being written.
    fn take_dirty(&self, uid: &str) -> Option<(String, String, Marks)> {
        let mut overlay = self.lock();
        let entry = overlay.get_mut(uid)?;
        if !entry.dirty {
            return None;
        }
        entry.dirty = false;
        Some((
            entry.namespace.clone(),
            entry.name.clone(),
            entry.marks.clone(),
        ))
    }

    fn set_dirty(&self, uid: &str) {
        if let Some(entry) = self.lock().get_mut(uid) {
            entry.dirty = true;
        }
    }

    fn forget(&self, uid: &str) {
        self.lock().remove(uid);
    }

    async fn patch_worker(
        self: Arc<Self>,
        client: Client,
        mut queue: mpsc::UnboundedReceiver<String>,
        metrics: Metrics,
        shutdown: CancellationToken,
    ) {
        loop {
            let uid = tokio::select! {
                () = shutdown.cancelled() => return,
                uid = queue.recv() => match uid { Some(uid) => uid, None => return },
            };
            let Some((namespace, name, marks)) = self.take_dirty(&uid) else {
                continue;
            };
            let api: Api<Pod> = Api::namespaced(client.clone(), &namespace);
            // The UID is a precondition: a pod recreated under the same name (a different
            // pod) answers 409 instead of taking the old pod's marks.
            let patch = serde_json::json!({
                "metadata": {
                    "uid": uid.as_str(),
                    "annotations": {
                        self.keys.allocated.as_str(): marks.allocated.join(","),
                        self.keys.assigned.as_str(): marks.assigned.to_string(),
                    }
                }
            });
            let mut attempt = 0;
            loop {
                match api
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => {
                        Metrics::patch(&metrics.pod_patches, true);
                        tracing::debug!(pod = %format!("{namespace}/{name}"), allocated = ?marks.allocated, assigned = marks.assigned, "wrote allocation marks");
                        break;
                    }
                    Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {
                        tracing::debug!(pod = %format!("{namespace}/{name}"), %uid, reason = %status.message, "pod gone or recreated; its marks are dropped");
                        Metrics::patch(&metrics.pod_patches, false);
                        self.forget(&uid);
                        break;
                    }
                    Err(err) => {
                        Metrics::patch(&metrics.pod_patches, false);
                        attempt += 1;
                        if attempt >= PATCH_ATTEMPTS {
                            tracing::error!(pod = %format!("{namespace}/{name}"), error = %err, "cannot write allocation marks; will retry at the next reconcile");
                            self.set_dirty(&uid);
                            break;
                        }
                        tracing::warn!(pod = %format!("{namespace}/{name}"), error = %err, attempt, "writing allocation marks failed; retrying");
                        let backoff = Duration::from_millis(100 << attempt);
                        tokio::select! {
                            () = shutdown.cancelled() => return,
                            () = tokio::time::sleep(backoff) => {}
                        }
                    }
                }
            }
        }
    }
}
