//! What kubelet really gave each container, and where that disagrees with the allocations
//! the plugin knows — pure decisions, no kube or tonic.
//!
//! kubelet's PodResources API (`List`) names, per pod and container, the device IDs it handed
//! out. Our device IDs name their GPU (`<gpu-uuid>-<slot>`, see [`crate::devices`]), so each
//! listing says which GPU's memory tokens a container holds. kubelet records a container's
//! devices only once our `Allocate` for it succeeded, so a container listed with devices has
//! been allocated: a fact, where the marks the plugin writes are its best guess of which
//! pod an Allocate was for ([`crate::matching`]).
//!
//! ```text
//!   kubelet List ──▶ KubeletFacts (pod → container → device IDs of our resource)
//!                          │
//!          ┌───────────────┴───────────────┐
//!          ▼                               ▼
//!   check(): findings, reported      facts_plan::plan_from_facts(): marks follow
//!   as Events and a metric           what kubelet holds, not guesses
//! ```
//!
//! Two findings are worth a person's attention ([`Finding`]):
//! - **wrong GPU**: a container of a pod the extender placed on GPU A holds devices of GPU B
//!   (for a multi-GPU pod: devices of a GPU outside its set; devices of each GPU of the set
//!   are what such a container holds by design).
//!   The devices follow the GPU the plugin previewed for the pod it matched, so either the
//!   container was answered with another pod's allocation on another GPU (it runs on B while
//!   every count says A), or kubelet had too few devices of A left to follow the preference
//!   (something holds devices of A that gpushare does not count, such as the next finding).
//! - **no allocation**: a pod with no allocation the plugin acts on (none at all, or one the
//!   extender did not sign) holds devices. kubelet admitted it (it was bound without the
//!   extender) and our Allocate matched a waiting pod of the same size: the pod holds another
//!   pod's allocation, and runs on that pod's GPU without being counted there.
//!
//! A same-sized twin taking another's marks on the same GPU is the design working
//! ([`crate::matching`]'s twin rule), not a finding: the marks are corrected silently.
//!
//! kubelet lists pods by namespace and name, not UID; a name listed twice is ambiguous and
//! left out. A pod the plugin first saw after the listing was taken is not judged by it (a
//! pod recreated under the same name must not inherit the old one's devices).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use crate::view::{PodView, Trust};

/// What kubelet reported for one pod: the containers that hold devices of our resource.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodFacts {
    /// Container name → device IDs held (deduplicated, sorted). Containers holding none of
    /// our devices are absent.
    pub containers: BTreeMap<String, Vec<String>>,
}

impl PodFacts {
    /// Whether any container of the pod holds devices.
    pub fn holds_any(&self) -> bool {
        !self.containers.is_empty()
    }
}

/// One `List` answer, reduced to our resource.
#[derive(Debug, Clone)]
pub struct KubeletFacts {
    /// When the listing was requested: it shows every Allocate that succeeded before then.
    pub taken_at: Instant,
    pods: HashMap<String, PodFacts>,
}

/// One container as listed: pod namespace, pod name, container name, device IDs of our
/// resource (possibly repeated, as kubelet repeats a device once per NUMA node).
pub type ListedContainer = (String, String, String, Vec<String>);

impl KubeletFacts {
    /// The facts from the pods kubelet listed (`pods`: namespace, name) and the containers
    /// holding our devices. A `namespace/name` listed more than once is left out.
    pub fn new(
        taken_at: Instant,
        pods: impl IntoIterator<Item = (String, String)>,
        containers: impl IntoIterator<Item = ListedContainer>,
    ) -> Self {
        let mut listed: HashMap<String, PodFacts> = HashMap::new();
        let mut ambiguous = HashSet::new();
        for (namespace, name) in pods {
            let key = format!("{namespace}/{name}");
            if listed.insert(key.clone(), PodFacts::default()).is_some() {
                ambiguous.insert(key);
            }
        }
        for (namespace, name, container, ids) in containers {
            let key = format!("{namespace}/{name}");
            let Some(pod) = listed.get_mut(&key) else {
                continue;
            };
            let held = pod.containers.entry(container).or_default();
            held.extend(ids);
            held.sort();
            held.dedup();
        }
        for key in &ambiguous {
            listed.remove(key);
        }
        listed.retain(|_, pod| {
            pod.containers.retain(|_, ids| !ids.is_empty());
            true
        });
        Self {
            taken_at,
            pods: listed,
        }
    }

    /// What kubelet reported for the pod `namespace/name`; `None` when it did not list it
    /// (or listed the name twice).
    pub fn pod(&self, key: &str) -> Option<&PodFacts> {
        self.pods.get(key)
    }

    /// The devices kubelet reports `container` of pod `key` holds; `None` when none.
    pub fn held(&self, key: &str, container: &str) -> Option<&[String]> {
        self.pods
            .get(key)?
            .containers
            .get(container)
            .map(Vec::as_slice)
    }

    /// Every pod listed (`namespace/name`) with what it holds, in no particular order.
    pub fn pods(&self) -> impl Iterator<Item = (&str, &PodFacts)> {
        self.pods.iter().map(|(key, pod)| (key.as_str(), pod))
    }

    /// Number of pods listed.
    pub fn len(&self) -> usize {
        self.pods.len()
    }

    /// Whether kubelet listed no pod.
    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }
}

/// For each container of `view`'s allocation (in admission order), whether kubelet's facts
/// prove it was allocated. kubelet allocates a pod's containers in that order at admission
/// and records each one's devices when its Allocate succeeds, but lists only app and sidecar
/// containers: so a container is proven when it, or any container after it, holds devices
/// (an ordinary init container is never listed, yet came before).
pub fn proven(view: &PodView, facts: &KubeletFacts) -> Vec<bool> {
    let containers = &view.allocation.containers;
    let last_held = containers
        .iter()
        .rposition(|c| facts.held(&view.key, &c.name).is_some());
    (0..containers.len())
        .map(|i| last_held.is_some_and(|last| i <= last))
        .collect()
}

/// A pod on the node that has no allocation the plugin acts on (none, or unreadable).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BarePod {
    /// `namespace/name`.
    pub key: String,
    /// The pod's UID.
    pub uid: String,
}

/// A disagreement between kubelet's facts and the allocations the plugin knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// A container holds devices of a GPU its pod was not given.
    WrongGpu {
        /// `namespace/name`
        pod: String,
        /// the pod's UID
        uid: String,
        /// the container
        container: String,
        /// index and UUID of each GPU the extender gave the pod, the first one first
        given: Vec<(u32, String)>,
        /// UUIDs of the GPUs whose devices the container holds, none of `given`
        held: Vec<String>,
    },
    /// A pod without an allocation of its own holds devices: it was admitted with another
    /// pod's allocation.
    NoAllocation {
        /// `namespace/name`
        pod: String,
        /// the pod's UID
        uid: String,
        /// the container
        container: String,
        /// GiB (devices) it holds
        gib: u64,
        /// UUIDs of the GPUs whose devices it holds
        held: Vec<String>,
        /// why its allocation is not acted on
        why: String,
    },
}

impl Finding {
    /// Metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::WrongGpu { .. } => "wrong_gpu",
            Self::NoAllocation { .. } => "no_allocation",
        }
    }

    /// The Event reason (PascalCase).
    pub fn reason(&self) -> &'static str {
        match self {
            Self::WrongGpu { .. } => "GpuMemOnWrongGpu",
            Self::NoAllocation { .. } => "GpuMemWithoutAllocation",
        }
    }

    /// `namespace/name` and UID of the pod the finding is about.
    pub fn pod(&self) -> (&str, &str) {
        match self {
            Self::WrongGpu { pod, uid, .. } | Self::NoAllocation { pod, uid, .. } => (pod, uid),
        }
    }

    /// The container the finding is about.
    pub fn container(&self) -> &str {
        match self {
            Self::WrongGpu { container, .. } | Self::NoAllocation { container, .. } => container,
        }
    }

    /// The message a person reads on the pod's Event: what is wrong and what to do.
    pub fn note(&self, resource: &str) -> String {
        match self {
            Self::WrongGpu {
                container,
                given,
                held,
                ..
            } => {
                let plural = if given.len() > 1 { "s" } else { "" };
                let placed = given
                    .iter()
                    .map(|(index, uuid)| format!("{index} ({uuid})"))
                    .collect::<Vec<_>>()
                    .join(", ");
                let indices = given
                    .iter()
                    .map(|(index, _)| index.to_string())
                    .collect::<Vec<_>>()
                    .join(", ");
                let uuids = given
                    .iter()
                    .map(|(_, uuid)| uuid.as_str())
                    .collect::<Vec<_>>()
                    .join(",");
                format!(
                    "container {container} holds kubelet's {resource} devices of GPU {held}, but gpushare placed the pod on GPU{plural} {placed}: kubelet's device accounting and gpushare's disagree (the container was answered with another pod's allocation, or a pod without an allocation of its own holds devices of GPU{plural} {indices}); the container's GPUSHARE_GPU_UUID says which GPU{plural} it uses: if it is not {uuids}, its memory is counted on the wrong GPU, delete the pod so it is scheduled again",
                    held = held.join(", "),
                )
            }
            Self::NoAllocation {
                container,
                gib,
                held,
                why,
                ..
            } => format!(
                "container {container} holds {gib} {resource} devices of GPU {held}, but the pod has no gpushare allocation of its own ({why}): kubelet admitted it with the allocation of another pod waiting for the same size, so it uses GPU memory gpushare does not count; delete the pod and let the gpushare scheduler place it",
                held = held.join(", "),
            ),
        }
    }
}

/// The UUID a device ID of ours names (`<uuid>-<slot>`).
pub fn device_gpu(id: &str) -> Option<&str> {
    let (uuid, slot) = id.rsplit_once('-')?;
    slot.parse::<u64>().ok()?;
    (!uuid.is_empty()).then_some(uuid)
}

/// The findings in `facts` about the pods the plugin knows: `views` (pods with an
/// allocation, trusted or not) and `bare` (pods bound here without one). `gpu_uuid` maps a
/// GPU index of this node to its UUID (for allocations recorded without one); `judged`
/// says whether a pod was known before the listing was taken (see the module doc).
pub fn check(
    views: &[Arc<PodView>],
    bare: &[BarePod],
    facts: &KubeletFacts,
    gpu_uuid: impl Fn(u32) -> Option<String>,
    judged: impl Fn(&str) -> bool,
) -> Vec<Finding> {
    let gpus_of = |ids: &[String]| -> BTreeSet<String> {
        ids.iter()
            .filter_map(|id| device_gpu(id))
            .map(str::to_owned)
            .collect()
    };
    let mut findings = Vec::new();
    for view in views {
        if !judged(&view.uid) {
            continue;
        }
        let Some(pod) = facts.pod(&view.key) else {
            continue;
        };
        if !view.trusted() {
            let why = match &view.trust {
                Trust::Refused(why) => {
                    format!("its allocation is not signed by the gpushare extender: {why}")
                }
                _ => "its allocation is not trusted".to_owned(),
            };
            findings.extend(unallocated(&view.key, &view.uid, pod, &why, &gpus_of));
            continue;
        }
        // Every GPU of the pod: a multi-GPU container legitimately holds devices of each.
        let given: Option<Vec<(u32, String)>> = view
            .allocation
            .gpus()
            .map(|(index, uuid)| {
                if uuid.is_empty() {
                    gpu_uuid(index).map(|uuid| (index, uuid))
                } else {
                    Some((index, uuid.to_owned()))
                }
            })
            .collect();
        let Some(given) = given else {
            continue;
        };
        for (container, ids) in &pod.containers {
            let held: Vec<String> = gpus_of(ids)
                .into_iter()
                .filter(|g| !given.iter().any(|(_, uuid)| uuid == g))
                .collect();
            if !held.is_empty() {
                findings.push(Finding::WrongGpu {
                    pod: view.key.clone(),
                    uid: view.uid.clone(),
                    container: container.clone(),
                    given: given.clone(),
                    held,
                });
            }
        }
    }
    for pod in bare {
        if !judged(&pod.uid) {
            continue;
        }
        if let Some(listed) = facts.pod(&pod.key) {
            findings.extend(unallocated(
                &pod.key,
                &pod.uid,
                listed,
                "it carries no gpushare allocation annotations",
                &gpus_of,
            ));
        }
    }
    findings
}

fn unallocated(
    key: &str,
    uid: &str,
    pod: &PodFacts,
    why: &str,
    gpus_of: &impl Fn(&[String]) -> BTreeSet<String>,
) -> Vec<Finding> {
    pod.containers
        .iter()
        .map(|(container, ids)| Finding::NoAllocation {
            pod: key.to_owned(),
            uid: uid.to_owned(),
            container: container.clone(),
            gib: u64::try_from(ids.len()).unwrap_or(u64::MAX),
            held: gpus_of(ids).into_iter().collect(),
            why: why.to_owned(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_contract::{ContainerRequest, PodAllocation};

    fn view(name: &str, gpu: u32, containers: &[(&str, u64, bool)]) -> Arc<PodView> {
        Arc::new(PodView {
            key: format!("default/{name}"),
            uid: format!("uid-{name}"),
            node: Some("n1".into()),
            phase: Some("Pending".into()),
            deleting: false,
            admitted: false,
            allocation: PodAllocation {
                more_gpus: Vec::new(),
                exclusive: false,
                gpu_index: gpu,
                gpu_uuid: format!("GPU-{gpu}"),
                pod_gib: containers.iter().map(|c| c.1).sum(),
                containers: containers
                    .iter()
                    .map(|&(name, gib, init)| ContainerRequest {
                        name: name.into(),
                        gib,
                        init,
                        compute: 0,
                    })
                    .collect(),
                bind_time: "2026-11-22T10:00:00Z".into(),
                assigned: false,
                allocated: vec![],
                signature: None,
                compute: 0,
            },
            trust: Trust::Verified,
        })
    }

    /// A pod's containers and the devices each holds.
    type Held<'a> = &'a [(&'a str, Vec<String>)];

    fn ids(gpu: u32, slots: std::ops::Range<u64>) -> Vec<String> {
        slots.map(|s| format!("GPU-{gpu}-{s}")).collect()
    }

    fn facts(pods: &[(&str, Held<'_>)]) -> KubeletFacts {
        KubeletFacts::new(
            Instant::now(),
            pods.iter()
                .map(|(name, _)| ("default".to_owned(), (*name).to_owned())),
            pods.iter().flat_map(|(name, containers)| {
                containers.iter().map(|(c, ids)| {
                    (
                        "default".to_owned(),
                        (*name).to_owned(),
                        (*c).to_owned(),
                        ids.clone(),
                    )
                })
            }),
        )
    }

    fn everyone(_: &str) -> bool {
        true
    }

    fn uuid(index: u32) -> Option<String> {
        Some(format!("GPU-{index}"))
    }

    #[test]
    fn facts_dedupe_devices_and_drop_ambiguous_names() {
        let mut repeated = ids(0, 0..2);
        repeated.extend(ids(0, 1..2));
        let facts = KubeletFacts::new(
            Instant::now(),
            [
                ("default".to_owned(), "a".to_owned()),
                ("default".to_owned(), "twice".to_owned()),
                ("default".to_owned(), "twice".to_owned()),
                ("default".to_owned(), "idle".to_owned()),
            ],
            [
                ("default".into(), "a".into(), "main".into(), repeated),
                (
                    "default".into(),
                    "twice".into(),
                    "main".into(),
                    ids(0, 2..3),
                ),
                ("default".into(), "idle".into(), "main".into(), vec![]),
                (
                    "default".into(),
                    "unlisted".into(),
                    "main".into(),
                    ids(0, 3..4),
                ),
            ],
        );
        assert_eq!(facts.held("default/a", "main"), Some(&ids(0, 0..2)[..]));
        assert!(facts.pod("default/twice").is_none(), "ambiguous");
        assert!(facts.pod("default/unlisted").is_none());
        let idle = facts.pod("default/idle").unwrap();
        assert!(!idle.holds_any());
        assert_eq!(facts.len(), 2);
    }

    #[test]
    fn device_ids_name_their_gpu() {
        assert_eq!(device_gpu("GPU-abc-def-12"), Some("GPU-abc-def"));
        for bad in ["", "-1", "GPU", "GPU-x", "GPU-1-"] {
            assert_eq!(device_gpu(bad), None, "{bad}");
        }
    }

    #[test]
    fn proven_covers_every_container_up_to_the_last_one_held() {
        let pod = view(
            "p",
            0,
            &[("init", 4, true), ("main", 2, false), ("side", 1, false)],
        );
        // Nothing listed: nothing proven.
        assert_eq!(proven(&pod, &facts(&[])), [false, false, false]);
        // main holds devices: the init container before it was allocated too.
        let f = facts(&[("p", &[("main", ids(0, 0..2))])]);
        assert_eq!(proven(&pod, &f), [true, true, false]);
        let f = facts(&[("p", &[("side", ids(0, 0..1))])]);
        assert_eq!(proven(&pod, &f), [true, true, true]);
    }

    #[test]
    fn devices_of_another_gpu_are_a_finding() {
        let views = vec![
            view("right", 0, &[("main", 2, false)]),
            view("wrong", 0, &[("main", 2, false)]),
            view("unlisted", 1, &[("main", 2, false)]),
        ];
        let mut mixed = ids(0, 2..3);
        mixed.extend(ids(1, 0..1));
        let f = facts(&[
            ("right", &[("main", ids(0, 0..2))]),
            ("wrong", &[("main", mixed)]),
        ]);
        let findings = check(&views, &[], &f, uuid, everyone);
        assert_eq!(
            findings,
            [Finding::WrongGpu {
                pod: "default/wrong".into(),
                uid: "uid-wrong".into(),
                container: "main".into(),
                given: vec![(0, "GPU-0".into())],
                held: vec!["GPU-1".into()],
            }]
        );
        assert_eq!(findings[0].kind(), "wrong_gpu");
        let note = findings[0].note("example.com/gpu-mem");
        assert!(
            note.contains("GPU GPU-1") && note.contains("GPU 0 (GPU-0)"),
            "{note}"
        );
    }

    /// `view` spread over `gpus` (the first one first).
    fn spread(name: &str, gpus: &[u32], containers: &[(&str, u64, bool)]) -> Arc<PodView> {
        let mut pod = (*view(name, gpus[0], containers)).clone();
        pod.allocation.more_gpus = gpus[1..]
            .iter()
            .map(|&index| gpushare_contract::GpuRef {
                index,
                uuid: format!("GPU-{index}"),
            })
            .collect();
        Arc::new(pod)
    }

    #[test]
    fn a_multi_gpu_container_holds_devices_of_each_of_its_gpus_legitimately() {
        // 2 × 4 GiB on GPUs 2 and 0; main holds 4 devices of each.
        let views = vec![
            spread("legit", &[2, 0], &[("main", 8, false)]),
            spread("stray", &[2, 0], &[("main", 8, false)]),
        ];
        let mut both = ids(2, 0..4);
        both.extend(ids(0, 0..4));
        let mut outside = ids(2, 4..8);
        outside.extend(ids(0, 4..7));
        outside.extend(ids(1, 0..1));
        let f = facts(&[
            ("legit", &[("main", both)]),
            ("stray", &[("main", outside)]),
        ]);
        let findings = check(&views, &[], &f, uuid, everyone);
        assert_eq!(
            findings,
            [Finding::WrongGpu {
                pod: "default/stray".into(),
                uid: "uid-stray".into(),
                container: "main".into(),
                given: vec![(2, "GPU-2".into()), (0, "GPU-0".into())],
                held: vec!["GPU-1".into()],
            }]
        );
        let note = findings[0].note("example.com/gpu-mem");
        assert!(
            note.contains(
                "devices of GPU GPU-1, but gpushare placed the pod on GPUs 2 (GPU-2), 0 (GPU-0)"
            ) && note.contains("if it is not GPU-2,GPU-0"),
            "{note}"
        );
        // Recorded without UUIDs: every GPU of the set is looked up by index.
        let mut bare = (*views[0]).clone();
        bare.allocation.gpu_uuid.clear();
        for gpu in &mut bare.allocation.more_gpus {
            gpu.uuid.clear();
        }
        let mut both = ids(2, 0..4);
        both.extend(ids(0, 0..4));
        let f = facts(&[("legit", &[("main", both)])]);
        assert!(check(&[Arc::new(bare)], &[], &f, uuid, everyone).is_empty());
    }

    #[test]
    fn an_allocation_recorded_without_uuid_is_compared_by_index() {
        let mut pod = (*view("p", 1, &[("main", 2, false)])).clone();
        pod.allocation.gpu_uuid.clear();
        let f = facts(&[("p", &[("main", ids(0, 0..2))])]);
        let findings = check(&[Arc::new(pod)], &[], &f, uuid, everyone);
        assert_eq!(findings.len(), 1);
        assert!(matches!(&findings[0], Finding::WrongGpu { given, .. } if given[0].1 == "GPU-1"));
    }

    #[test]
    fn pods_holding_devices_without_their_own_allocation_are_findings() {
        let mut forged = (*view("forged", 0, &[("main", 4, false)])).clone();
        forged.trust = Trust::Refused("it carries no signature".into());
        let bare = [
            BarePod {
                key: "default/intruder".into(),
                uid: "uid-intruder".into(),
            },
            BarePod {
                key: "default/cpu-only".into(),
                uid: "uid-cpu-only".into(),
            },
        ];
        let f = facts(&[
            ("forged", &[("main", ids(1, 0..4))]),
            ("intruder", &[("main", ids(0, 0..4))]),
            ("cpu-only", &[]),
        ]);
        let findings = check(&[Arc::new(forged)], &bare, &f, uuid, everyone);
        let summary: Vec<(&str, &str, u64)> = findings
            .iter()
            .map(|f| match f {
                Finding::NoAllocation { pod, held, gib, .. } => {
                    (pod.as_str(), held[0].as_str(), *gib)
                }
                Finding::WrongGpu { .. } => panic!("{f:?}"),
            })
            .collect();
        assert_eq!(
            summary,
            [
                ("default/forged", "GPU-1", 4),
                ("default/intruder", "GPU-0", 4)
            ]
        );
        assert!(
            findings[0].note("r").contains("not signed"),
            "{:?}",
            findings[0]
        );
        assert!(
            findings[1]
                .note("r")
                .contains("no gpushare allocation annotations")
        );
    }

    #[test]
    fn pods_first_seen_after_the_listing_are_not_judged_by_it() {
        // A pod recreated under the name of one kubelet still listed.
        let views = vec![view("p", 0, &[("main", 2, false)])];
        let bare = [BarePod {
            key: "default/q".into(),
            uid: "uid-q".into(),
        }];
        let f = facts(&[
            ("p", &[("main", ids(1, 0..2))]),
            ("q", &[("main", ids(0, 0..2))]),
        ]);
        assert!(check(&views, &bare, &f, uuid, |_| false).is_empty());
        assert_eq!(check(&views, &bare, &f, uuid, everyone).len(), 2);
    }
}
