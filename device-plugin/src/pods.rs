//! The node's pods, as the plugin needs them to answer `Allocate` without an API call.
//!
//! A reflector watches only the pods bound to this node (`spec.nodeName=<node>`); every
//! decision reads that local store, each pod read once per resourceVersion
//! (`pod_views`). On top of it sits an *overlay* of the marks this plugin
//! has decided but the API server may not show yet (`allocated`, `assigned`): an Allocate
//! that marks a container is visible to the very next Allocate, even before our patch has
//! round-tripped through the watch. The overlay entry is dropped once the store shows the
//! same marks and no write is outstanding.
//!
//! With `--allocation-marks` the marks are written by one background worker
//! (`mark_writer`), so an Allocate answers in microseconds and never waits for the
//! API server. Without it (the default) the marks stay in the overlay: what
//! outlives this process is kubelet's own record, a `startTime` in the pod's status once
//! kubelet admitted the pod (and so allocated each of its containers), and its PodResources
//! listing; a pod with a `startTime` is never matched again ([`PodView::admitted`]).
//!
//! With a keyring, each pod's allocation is verified when it is read (once per resourceVersion
//! and keyring generation) and carried as [`Trust`]: matching considers only
//! allocations the extender signed, and when nothing else waits for a size, the pod that
//! would have matched is named in the refusal ([`ClaimError::Untrusted`]).
//!
//! Reconcile runs on every pod event and every two seconds. When kubelet's PodResources API
//! answered last time ([`PodCache::set_facts`], from [`crate::pod_resources`]), marks follow what
//! kubelet reports each container holds ([`crate::facts_plan::plan_from_facts`]); otherwise
//! [`crate::matching::plan_reconcile`] infers from pod phases which pod kubelet started and
//! moves the marks that landed on a same-sized twin back to it.
//!
//! Everything these decisions read and change sits behind one lock (`State` says why).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::{FutureExt, Stream, StreamExt};
use gpushare_contract::{ContainerRequest, Keys, PodAllocation, SharedKeyring};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, EvictParams, Preconditions};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::facts::{self, Finding, KubeletFacts};
use crate::facts_plan::{self, Intruder};
use crate::mark_writer::{MarkStore, MarkWriter};
use crate::matching;
use crate::metrics::Metrics;
use crate::pod_views::{KubeletContext, Reader, ViewCache};
use crate::view::{Marks, PodView, Trust};

/// An Eviction of exactly the pod with `uid`. Evictions name a pod, and a pod's name outlives
/// it: a StatefulSet's `web-0` (or any pod deleted and created again) comes back under the
/// same name, and an eviction decided for the old one must not take the new one with it. The
/// API server refuses the eviction with a conflict when the UID no longer matches.
pub fn eviction_of(uid: &str) -> EvictParams {
    EvictParams {
        delete_options: Some(DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(uid.to_owned()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        }),
        ..EvictParams::default()
    }
}

/// How often reconcile runs without pod events.
pub const RECONCILE_PERIOD: Duration = Duration::from_secs(2);
/// How long a pod must have been seen Running before its marks are reconciled (kubelet's
/// status writes lag its admissions; see [`matching::plan_reconcile`]).
pub const RECONCILE_AFTER_RUNNING: Duration = Duration::from_secs(5);
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

/// A pod's marks as decided here.
#[derive(Debug)]
struct Overlay {
    namespace: String,
    name: String,
    marks: Marks,
    /// Not yet written to the API server.
    dirty: bool,
}

/// What the cache's decisions read and change, behind one lock.
///
/// Why one lock: Allocate, preview, reconcile and the kubelet check each read the pods
/// through the parse cache with the overlay applied, and may change the overlay (and the
/// reconcile state) in the same breath. These were five locks, but every path that took one
/// of them held the overlay lock around it, or took it right after, so they bought no
/// concurrency and asked every change to keep their nesting order. One lock keeps that order
/// by construction. It is held for in-memory work only: no API call and no `.await` under it.
#[derive(Debug, Default)]
struct State {
    /// Our marks the API server may not show yet, by UID.
    overlay: HashMap<String, Overlay>,
    /// Pods already read: re-reading unchanged annotations on each Allocate would make its
    /// cost grow with the node's pod count.
    views: ViewCache,
    /// When each pod was first seen Running.
    running_since: HashMap<String, Instant>,
    /// kubelet's last PodResources listing; `None` when it could not be read.
    facts: Option<KubeletFacts>,
    /// Containers of pods without an allocation of their own whose stray mark has been given
    /// back (`(uid, container)`), so each is given back once.
    compensated: HashSet<(String, String)>,
}

/// The node-scoped pod cache with our pending marks.
pub struct PodCache {
    node: String,
    keys: Keys,
    /// Verifies the extender's signatures; `None`: allocations are not verified.
    keyring: Option<SharedKeyring>,
    store: Store<Pod>,
    /// Whether the watch has listed the node's pods once (a flag, not worth the lock).
    synced: AtomicBool,
    state: Mutex<State>,
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

/// The cache's long-lived tasks, named, for the caller to spawn and supervise.
type Tasks = Vec<(&'static str, BoxFuture<'static, ()>)>;

impl PodCache {
    /// The cache of the pods bound to `node`, and the tasks that keep it (the watch, the
    /// patch worker and the reconcile loop), all stopping on `shutdown`, for the caller to
    /// spawn and supervise: should one end before `shutdown`, Allocate would answer from a
    /// frozen view. With `keyring`, only allocations it verifies are acted on; with
    /// `write_marks`, the marks are written on the pods.
    pub fn start(
        client: Client,
        node: &str,
        keys: Keys,
        keyring: Option<SharedKeyring>,
        metrics: Metrics,
        write_marks: bool,
        shutdown: CancellationToken,
    ) -> (Arc<Self>, Tasks) {
        let (store, writer) = reflector::store();
        let (cache, patch_queue) = Self::new(node, keys, keyring, metrics, write_marks, store);
        let api: Api<Pod> = Api::all(client.clone());
        let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let events = reflector::reflector(writer, watcher(api, config).default_backoff());
        let tasks = cache.tasks(events, client, patch_queue, shutdown);
        (cache, tasks)
    }

    /// A cache reading `store`, and the queue of pods whose marks are to be written.
    fn new(
        node: &str,
        keys: Keys,
        keyring: Option<SharedKeyring>,
        metrics: Metrics,
        write_marks: bool,
        store: Store<Pod>,
    ) -> (Arc<Self>, mpsc::UnboundedReceiver<String>) {
        let (patches, patch_queue) = mpsc::unbounded_channel();
        let cache = Arc::new(Self {
            node: node.to_owned(),
            keys,
            keyring,
            store,
            synced: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            metrics,
            changes: watch::Sender::new(0),
            patches,
            write_marks,
        });
        (cache, patch_queue)
    }

    /// The watch over `events` (which fill the store), the patch worker and the reconcile
    /// loop.
    fn tasks(
        self: &Arc<Self>,
        events: impl Stream<Item = Result<watcher::Event<Pod>, watcher::Error>> + Send + 'static,
        client: Client,
        patch_queue: mpsc::UnboundedReceiver<String>,
        shutdown: CancellationToken,
    ) -> Tasks {
        let writer = MarkWriter {
            cache: self.clone(),
            client,
            keys: self.keys.clone(),
            metrics: self.metrics.clone(),
        };
        vec![
            (
                "pod watch",
                self.clone().watch_pods(events, shutdown.clone()).boxed(),
            ),
            (
                "pod patch worker",
                writer.run(patch_queue, shutdown.clone()).boxed(),
            ),
            (
                "pod reconcile loop",
                self.clone().reconcile_loop(shutdown).boxed(),
            ),
        ]
    }

    async fn watch_pods(
        self: Arc<Self>,
        events: impl Stream<Item = Result<watcher::Event<Pod>, watcher::Error>>,
        shutdown: CancellationToken,
    ) {
        let mut events = std::pin::pin!(events);
        loop {
            let item = tokio::select! {
                () = shutdown.cancelled() => return,
                item = events.next() => item,
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

    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means another thread panicked mid-update of plain data.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn reader(&self) -> Reader<'_> {
        Reader {
            node: &self.node,
            keys: &self.keys,
            keyring: self.keyring.as_ref(),
        }
    }

    /// Pods bound here that carry an allocation, with our marks applied.
    fn views(&self, state: &mut State) -> Vec<Arc<PodView>> {
        self.collect_views(state, None, None)
    }

    /// Pods bound here that carry an allocation, with our marks applied; with `stored`, also
    /// the marks as the API server has them, by UID; with `kubelet`, what comparing them
    /// with a kubelet listing needs.
    fn collect_views(
        &self,
        state: &mut State,
        stored: Option<&mut HashMap<String, Marks>>,
        kubelet: Option<&mut KubeletContext>,
    ) -> Vec<Arc<PodView>> {
        let State { overlay, views, .. } = state;
        let ours = |uid: &str| overlay.get(uid).map(|entry| &entry.marks);
        self.reader()
            .views(&self.store.state(), views, ours, stored, kubelet)
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
        let views = self.views(&mut self.lock());
        views
            .iter()
            .filter(|view| {
                view.allocation.gpus().any(|(_, gpu)| gpu == uuid)
                    && !view.deleting
                    && !gpushare_contract::request::phase_is_finished(view.phase.as_deref())
                    && matches!(view.trust, Trust::Verified | Trust::Unchecked)
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
        let mut state = self.lock();
        let mut views = self.views(&mut state);
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
            self.record(&mut state.overlay, &views[index], marks);
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
        let views = self.views(&mut self.lock());
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
                let views = self.views(&mut self.lock());
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
    /// answered ([`facts_plan::plan_from_facts`]), else from pod phases
    /// ([`matching::plan_reconcile`]); re-queues unwritten marks and forgets overlay entries
    /// the API server has caught up with.
    pub fn reconcile(&self) {
        self.reconcile_locked(&mut self.lock());
    }

    fn reconcile_locked(&self, state: &mut State) {
        let mut stored = HashMap::new();
        let mut kubelet = state
            .facts
            .as_ref()
            .map(|facts| KubeletContext::new(facts.taken_at));
        let mut views = self.collect_views(state, Some(&mut stored), kubelet.as_mut());
        // Kept up to date with facts too, so that phases can take over at once without them.
        let settled = settled(&mut state.running_since, &views);
        let plan = match kubelet {
            Some(kubelet) => self.plan_from_facts(state, &mut views, &kubelet),
            None => {
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
            self.record(&mut state.overlay, &views[index], marks);
        }
        if moved {
            // An Allocate waiting for a pending pod of this size (`claim`) looks again: a mark
            // given back makes its pod pending, and without marks on the pods (the default)
            // no pod event would come to wake it.
            self.changes.send_modify(|n| *n += 1);
        }
        self.settle_overlay(&mut state.overlay, &stored);
    }

    /// The marks [`facts_plan::plan_from_facts`] corrects from kubelet's listing, logged and
    /// counted; remembers the intruders it compensated.
    fn plan_from_facts(
        &self,
        state: &mut State,
        views: &mut [Arc<PodView>],
        kubelet: &KubeletContext,
    ) -> Vec<(usize, Marks)> {
        let State {
            facts: Some(facts),
            compensated,
            ..
        } = state
        else {
            return Vec::new();
        };
        let intruders = intruders(compensated, views, facts, kubelet);
        let plan = facts_plan::plan_from_facts(
            views,
            &self.node,
            facts,
            |view| kubelet.judged.contains(&view.uid),
            &intruders,
        );
        compensated.extend(plan.compensated);
        for (index, marks) in &plan.marks {
            tracing::info!(pod = %views[*index].key, allocated = ?marks.allocated, assigned = marks.assigned, "corrected allocation marks from what kubelet reports the pod's containers hold");
        }
        self.metrics
            .marks_from_kubelet
            .inc_by(plan.marks.len() as u64);
        plan.marks
    }

    /// Re-queues the unwritten marks and forgets the entries the API server shows as
    /// `stored` (and, once the watch has synced, those of pods gone from the node).
    fn settle_overlay(
        &self,
        overlay: &mut HashMap<String, Overlay>,
        stored: &HashMap<String, Marks>,
    ) {
        let synced = self.synced.load(Ordering::Relaxed);
        overlay.retain(|uid, entry| {
            if !stored.contains_key(uid) {
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
        let mut state = self.lock();
        state.facts = facts;
        self.reconcile_locked(&mut state);
    }

    /// Where kubelet's `facts` disagree with the allocations here (see [`facts::check`]),
    /// and the UIDs of every pod in the cache; `gpu_uuid` maps this node's GPU indices to
    /// UUIDs.
    pub fn findings(
        &self,
        facts: &KubeletFacts,
        gpu_uuid: impl Fn(u32) -> Option<String>,
    ) -> (Vec<Finding>, HashSet<String>) {
        let mut kubelet = KubeletContext::new(facts.taken_at);
        let views = self.collect_views(&mut self.lock(), None, Some(&mut kubelet));
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
}

/// The overlay is where the mark writer finds the marks to write, and learns how each write
/// went.
impl MarkStore for PodCache {
    fn take_dirty(&self, uid: &str) -> Option<(String, String, Marks)> {
        let mut state = self.lock();
        let entry = state.overlay.get_mut(uid)?;
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
        if let Some(entry) = self.lock().overlay.get_mut(uid) {
            entry.dirty = true;
        }
    }

    fn forget(&self, uid: &str) {
        self.lock().overlay.remove(uid);
    }
}

/// The UIDs of pods that have been Running for [`RECONCILE_AFTER_RUNNING`], keeping
/// `running_since` to the pods of `views` Running now.
fn settled(
    running_since: &mut HashMap<String, Instant>,
    views: &[Arc<PodView>],
) -> HashSet<String> {
    let now = Instant::now();
    running_since.retain(|uid, _| views.iter().any(|v| v.uid == *uid && v.running()));
    for view in views.iter().filter(|v| v.running()) {
        running_since.entry(view.uid.clone()).or_insert(now);
    }
    running_since
        .iter()
        .filter(|(_, at)| now.duration_since(**at) >= RECONCILE_AFTER_RUNNING)
        .map(|(uid, _)| uid.clone())
        .collect()
}

/// Containers of pods here without an allocation the plugin acts on that kubelet reports
/// holding devices, not yet accounted for in `compensated` (see
/// [`facts_plan::plan_from_facts`]); forgets the compensations of pods gone.
fn intruders(
    compensated: &mut HashSet<(String, String)>,
    views: &[Arc<PodView>],
    facts: &KubeletFacts,
    kubelet: &KubeletContext,
) -> Vec<Intruder> {
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

#[cfg(test)]
mod tests {
    use gpushare_contract::DEFAULT_DOMAIN;
    use gpushare_runtime::TaskSet;
    use prometheus_client::registry::Registry;

    use super::*;

    /// A client that is never called: these tests never write marks.
    fn unused_client() -> Client {
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        Client::try_from(config).unwrap()
    }

    /// The pod watch is one of the tasks the caller supervises: if its stream ends, the
    /// supervisor names it and stops the others, rather than Allocate answering from a
    /// store nothing fills any more.
    #[tokio::test]
    async fn the_supervisor_notices_the_pod_watch_ending() {
        let (store, _writer) = reflector::store();
        let metrics = Metrics::new(&mut Registry::default());
        let keys = Keys::new(DEFAULT_DOMAIN);
        let (cache, patch_queue) = PodCache::new("n1", keys, None, metrics, true, store);
        let token = CancellationToken::new();
        let ended = futures::stream::empty();
        let mut tasks = TaskSet::default();
        for (name, task) in cache.tasks(ended, unused_client(), patch_queue, token) {
            tasks.spawn(name, task);
        }
        // The deadline only bounds a failure: the watch ends at once.
        let ended = tokio::time::timeout(Duration::from_secs(30), tasks.first_ended())
            .await
            .expect("the supervisor noticed nothing");
        assert_eq!(ended, "pod watch");
    }
}
