//! Reading the node's pods into the views matching decides on ([`PodView`]).
//!
//! Why a cache: each Allocate looks at every pod on the node (1,000 in the load harness),
//! and re-reading unchanged annotations (and re-checking their signatures) each time would
//! make its cost grow with the node's pod count. A pod is read once per resourceVersion and
//! keyring generation; a cache hit costs a reference count, and only the views our unsaved
//! marks change are copied (those marks live in [`crate::pods`]).
//!
//! Reading also collects what comparing the pods with a kubelet PodResources listing needs
//! ([`KubeletContext`]): which pods the listing can judge (first read before it was taken),
//! and which pods bound here carry no allocation the plugin can read.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use gpushare_contract::request::{phase_is_finished, pod_key};
use gpushare_contract::{Keys, PodAllocation, SharedKeyring};
use k8s_openapi::api::core::v1::Pod;

use crate::facts::BarePod;
use crate::view::{Marks, PodView, Trust};

/// What a pod is read against.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Reader<'a> {
    /// This node: pods bound elsewhere have no view.
    pub(crate) node: &'a str,
    /// The annotation keys.
    pub(crate) keys: &'a Keys,
    /// Verifies the extender's signatures; `None`: allocations are not verified.
    pub(crate) keyring: Option<&'a SharedKeyring>,
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
    first_seen: Instant,
}

/// Pods already read, by UID, with the resourceVersion and keyring generation they were
/// read at.
#[derive(Debug, Default)]
pub(crate) struct ViewCache {
    parsed: HashMap<String, ParsedPod>,
}

/// What reading the pods collects for comparing them with a kubelet listing taken at
/// `taken_at`.
#[derive(Debug)]
pub(crate) struct KubeletContext {
    taken_at: Instant,
    /// UIDs of pods first read before the listing was taken.
    pub(crate) judged: HashSet<String>,
    /// Pods bound here, not finished, without an allocation the plugin can read.
    pub(crate) bare: Vec<BarePod>,
    /// UIDs of every pod in the cache.
    pub(crate) live: HashSet<String>,
}

impl KubeletContext {
    /// Nothing collected yet, for a listing taken at `taken_at`.
    pub(crate) fn new(taken_at: Instant) -> Self {
        Self {
            taken_at,
            judged: HashSet::new(),
            bare: Vec::new(),
            live: HashSet::new(),
        }
    }

    /// Notes `pod` (UID `uid`, first read at `first_seen`; `has_view`: it carries an
    /// allocation the plugin can read).
    fn note(&mut self, node: &str, pod: &Pod, uid: &str, first_seen: Instant, has_view: bool) {
        self.live.insert(uid.to_owned());
        if first_seen < self.taken_at {
            self.judged.insert(uid.to_owned());
        }
        let here = pod.spec.as_ref().and_then(|spec| spec.node_name.as_deref()) == Some(node);
        let phase = pod
            .status
            .as_ref()
            .and_then(|status| status.phase.as_deref());
        if !has_view && here && !phase_is_finished(phase) {
            self.bare.push(BarePod {
                key: pod_key(pod),
                uid: uid.to_owned(),
            });
        }
    }
}

impl Reader<'_> {
    /// The pods of `pods` bound here that carry an allocation, with `ours` (our unsaved
    /// marks, by UID) applied; with `stored`, also the marks as the API server has them, by
    /// UID; with `kubelet`, what comparing them with a kubelet listing needs.
    pub(crate) fn views<'m>(
        &self,
        pods: &[Arc<Pod>],
        cache: &mut ViewCache,
        ours: impl Fn(&str) -> Option<&'m Marks>,
        mut stored: Option<&mut HashMap<String, Marks>>,
        mut kubelet: Option<&mut KubeletContext>,
    ) -> Vec<Arc<PodView>> {
        let generation = self.keyring.map_or(0, SharedKeyring::generation);
        cache.forget_gone(pods);
        let now = Instant::now();
        let mut views = Vec::new();
        for pod in pods {
            let uid = pod.metadata.uid.as_deref().unwrap_or_default();
            let (view, first_seen) = cache.read(self, pod, generation, now);
            if let Some(kubelet) = kubelet.as_deref_mut() {
                kubelet.note(self.node, pod, uid, first_seen, view.is_some());
            }
            let Some(mut view) = view else {
                continue;
            };
            if let Some(stored) = stored.as_deref_mut() {
                stored.insert(uid.to_owned(), view.marks());
            }
            if let Some(marks) = ours(uid)
                && view.marks() != *marks
            {
                Arc::make_mut(&mut view).set_marks(marks);
            }
            views.push(view);
        }
        views
    }

    /// A pod bound here with a readable allocation, as the matching logic sees it, its
    /// signature checked.
    fn read(&self, pod: &Pod) -> Option<PodView> {
        let node = pod.spec.as_ref().and_then(|spec| spec.node_name.clone());
        if node.as_deref() != Some(self.node) {
            return None;
        }
        let annotations = pod.metadata.annotations.as_ref()?;
        let key = pod_key(pod);
        let allocation = match PodAllocation::from_annotations(self.keys, annotations) {
            Ok(allocation) => allocation?,
            Err(err) => {
                tracing::debug!(pod = %key, error = %err, "ignoring pod with unreadable allocation annotations");
                return None;
            }
        };
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let trust = match self.keyring {
            None => Trust::Unchecked,
            Some(keyring) => match keyring.current().verify(&uid, self.node, &allocation) {
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
}

impl ViewCache {
    /// Forgets pods that left `pods`, so the cache stays the size of the node.
    fn forget_gone(&mut self, pods: &[Arc<Pod>]) {
        if self.parsed.len() > pods.len() {
            let live: HashSet<&str> = pods
                .iter()
                .filter_map(|pod| pod.metadata.uid.as_deref())
                .collect();
            self.parsed.retain(|uid, _| live.contains(uid.as_str()));
        }
    }

    /// The view of `pod` (read again only when its resourceVersion or the keyring's
    /// `generation` changed) and when it was first read.
    fn read(
        &mut self,
        reader: &Reader<'_>,
        pod: &Pod,
        generation: u64,
        now: Instant,
    ) -> (Option<Arc<PodView>>, Instant) {
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        let version = pod.metadata.resource_version.as_deref().unwrap_or_default();
        match self.parsed.get(uid) {
            Some(entry) if entry.version == version && entry.generation == generation => {
                (entry.view.clone(), entry.first_seen)
            }
            entry => {
                let first_seen = entry.map_or(now, |entry| entry.first_seen);
                let view = reader.read(pod).map(Arc::new);
                self.parsed.insert(
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
        }
    }
}
