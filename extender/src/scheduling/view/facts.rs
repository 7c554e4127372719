//! What the view reads of a pod, taken out of the watched object the moment it arrives
//! ([`PodFacts`], which says why): its request, its CPU and memory, and what its allocation
//! annotations say, checked against the extender's signature when a keyring is configured.
//!
//! Why the signature is checked here: whether an allocation may be trusted is a fact of the
//! object as delivered, and the booking (`pods.rs`, and across a relist `relist.rs`) acts on
//! that verdict, never on the raw annotations.

use std::collections::BTreeMap;
use std::sync::Arc;

use gpushare_allocator::fragmentation::Host;
use gpushare_allocator::{ModelFilter, PodId, PodPlacement, Request};
use gpushare_contract::allocation::classic;
use gpushare_contract::{Keys, PodAllocation, PodRequest, RequestError, host, pod_request_with};
use k8s_openapi::api::core::v1::{Node, Pod};

use super::{Settings, pod_key};

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

/// A pod's request as the contract reads it ([`pod_request_with`], which the view's facts
/// keep) in the allocator's form, with the pod's CPU and memory: what filter, prioritize
/// and preempt read of a pod the view does not hold as pending
/// ([`View::request_of`](super::View::request_of) reads a pod the view holds waiting from
/// [`CachedPod::pending_request`](super::CachedPod::pending_request) instead).
pub fn read_pod_request(
    pod: &Pod,
    settings: &Settings,
) -> Result<Option<(Request, PodRequest)>, RequestError> {
    let Some(read) = pod_request_with(pod, &settings.resource, &settings.keys)? else {
        return Ok(None);
    };
    let request = Request {
        host: pod_host(pod),
        ..to_request(&read)
    };
    Ok(Some((request, read)))
}

/// The allocator's form of a pod request, CPU and memory left out (see [`pod_host`]).
pub fn to_request(request: &PodRequest) -> Request {
    Request {
        models: ModelFilter::parse(request.models.iter().map(String::as_str)),
        gpus: request.gpus,
        exclusive: request.exclusive,
        pod_gib: request.pod_gib,
        containers: request.containers.iter().map(|c| c.gib).collect(),
        host: Host::default(),
        compute: request.compute_per_gpu(),
    }
}

/// The CPU and memory a pod requests, as kube-scheduler counts them (see
/// [`gpushare_contract::host::pod_requests`]), in the allocator's form.
pub fn pod_host(pod: &Pod) -> Host {
    let requested = host::pod_requests(pod);
    Host::new(requested.milli_cpu, requested.memory_mib)
}

/// A node's allocatable CPU and memory; `None` when it publishes neither (see
/// [`gpushare_contract::host::node_allocatable`]).
pub fn node_host(node: &Node) -> Option<Host> {
    host::node_allocatable(node).map(|offered| Host::new(offered.milli_cpu, offered.memory_mib))
}

/// What a pod's gpushare allocation annotations say.
#[derive(Debug, Clone)]
pub(super) enum AllocationFacts {
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

/// What a pod's own spec asks for, over all its GPUs: what an allocation that cannot be
/// trusted books instead of its own figures.
#[derive(Debug, Clone, Copy)]
struct SpecAsk {
    gib: u64,
    compute: u32,
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
        spec: Option<SpecAsk>,
    ) -> Self {
        let Some(annotations) = annotations else {
            return Self::Absent;
        };
        match PodAllocation::from_annotations(&settings.keys, annotations) {
            // A pod Alibaba's classic gpushare placed before the switch: counted on its GPU
            // as it was placed (never signed: it predates the keyring; docs/migrating.md).
            Ok(None) => match (node, classic::placement(annotations)) {
                (Some(_), Some(classic)) => Self::Readable(PodPlacement {
                    more_gpus: Vec::new(),
                    exclusive: false,
                    gpu: classic.gpu_index,
                    uuid: "".into(),
                    pod_gib: classic.pod_gib,
                    pending: Vec::new(),
                    assigned: true,
                    compute: 0,
                }),
                _ => Self::Absent,
            },
            Ok(Some(allocation)) => {
                if let (Some(keyring), Some(node)) = (&settings.keyring, node)
                    && let Err(why) = keyring.current().verify(uid, node, &allocation)
                {
                    return Self::untrusted(why.to_string(), &allocation, spec);
                }
                Self::Readable(PodPlacement {
                    more_gpus: more_gpus(&allocation),
                    exclusive: allocation.exclusive,
                    gpu: allocation.gpu_index,
                    uuid: allocation.gpu_uuid.as_str().into(),
                    pod_gib: allocation.pod_gib,
                    pending: allocation.pending_containers().map(|c| c.gib).collect(),
                    assigned: allocation.assigned,
                    compute: allocation.compute,
                })
            }
            Err(error) => Self::salvage(&settings.keys, annotations, error.to_string()),
        }
    }

    /// An allocation whose signature does not verify (`why`): the fallback books what the
    /// `spec` asks (none when it asks for nothing) on the GPUs the annotations name.
    fn untrusted(why: String, allocation: &PodAllocation, spec: Option<SpecAsk>) -> Self {
        let gpus = allocation.gpu_count() as u64;
        Self::Untrusted {
            why,
            fallback: spec.filter(|ask| ask.gib > 0).map(|ask| PodPlacement {
                more_gpus: more_gpus(allocation),
                exclusive: false,
                gpu: allocation.gpu_index,
                uuid: allocation.gpu_uuid.as_str().into(),
                // The spec's total, spread over the GPUs the annotations name.
                pod_gib: ask.gib.div_ceil(gpus),
                pending: Vec::new(),
                assigned: true,
                compute: u32::try_from(u64::from(ask.compute).div_ceil(gpus)).unwrap_or(u32::MAX),
            }),
        }
    }

    /// Annotations that cannot be read (`error`): the GPU index and size, if those two still
    /// parse, are booked rather than nothing.
    fn salvage(keys: &Keys, annotations: &BTreeMap<String, String>, error: String) -> Self {
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
            error,
            salvaged: gpu.zip(pod_gib).map(|(gpu, pod_gib)| PodPlacement {
                more_gpus: Vec::new(),
                exclusive: false,
                gpu,
                uuid: salvaged_uuid.clone(),
                pod_gib,
                pending: Vec::new(),
                assigned: true,
                compute: 0,
            }),
        }
    }

    /// Whether the pod's annotations are there but cannot be used as they stand.
    pub(super) fn is_bad(&self) -> bool {
        matches!(self, Self::Unreadable { .. } | Self::Untrusted { .. })
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
    pub(super) key: Arc<str>,
    pub(super) uid: PodId,
    pub(super) node_name: Option<Box<str>>,
    pub(super) finished: bool,
    pub(super) ask: Ask,
    pub(super) allocation: AllocationFacts,
    pub(super) host: Host,
    /// `spec.priority` (0 when unset, as kube-scheduler reads it).
    pub(super) priority: i32,
    /// `status.nominatedNodeName` of a pod not bound yet: the node kube-scheduler evicted
    /// pods on for it.
    pub(super) nominated_node: Option<Box<str>>,
    /// Whether the pod may run only on some GPU models ([`pinned_to_gpu_models`]).
    pub(super) pinned: bool,
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
        let spec = request
            .as_ref()
            .ok()
            .and_then(|r| r.as_ref())
            .map(|r| SpecAsk {
                gib: r.pod_gib,
                compute: r.pod_compute,
            });
        let mut allocation = AllocationFacts::read(
            settings,
            uid,
            node_name.as_deref(),
            metadata.annotations.as_ref(),
            spec,
        );
        // kubelet sets `startTime` when it admits a pod, and admission is where it calls the
        // device plugin's Allocate for every container: nothing of the pod still waits for a
        // device, whatever marks the plugin wrote (by default it writes none).
        let admitted = pod.status.as_ref().is_some_and(|s| s.start_time.is_some());
        if admitted && let AllocationFacts::Readable(placement) = &mut allocation {
            placement.pending.clear();
            placement.assigned = true;
        }
        let pinned = request
            .as_ref()
            .ok()
            .and_then(|r| r.as_ref())
            .is_some_and(|r| !r.models.is_empty())
            || pinned_to_gpu_models(pod, &settings.keys);
        Some(Self {
            pinned,
            key: key.into(),
            uid: PodId::from(uid),
            finished: gpushare_contract::request::pod_is_finished(pod),
            ask: Ask::new(request, node_name.is_some()),
            nominated_node: pod
                .status
                .as_ref()
                .and_then(|s| s.nominated_node_name.as_deref())
                .filter(|n| !n.is_empty() && node_name.is_none())
                .map(Box::from),
            node_name,
            allocation,
            host: pod_host(pod),
            priority: pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0),
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

/// Whether `pod` may run only on nodes with some GPU models or GPU sizes: a `nodeSelector`, or
/// a term of its required node affinity, on the device plugin's `gpu-model.*` or `gpu-mem.*`
/// node labels. The demand mix counts such pods (`gpushare_allocator::demand_mix`).
pub(super) fn pinned_to_gpu_models(pod: &Pod, keys: &Keys) -> bool {
    let prefixes = [&keys.node_gpu_model_prefix, &keys.node_gpu_mem_prefix];
    let names_gpus = |key: &str| prefixes.iter().any(|p| key.starts_with(p.as_str()));
    let Some(spec) = pod.spec.as_ref() else {
        return false;
    };
    let selected = spec
        .node_selector
        .as_ref()
        .is_some_and(|s| s.keys().any(|k| names_gpus(k)));
    let required = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    let in_affinity = required.is_some_and(|r| {
        r.node_selector_terms.iter().any(|term| {
            term.match_expressions
                .iter()
                .flatten()
                .any(|e| names_gpus(&e.key))
        })
    });
    selected || in_affinity
}

#[cfg(test)]
mod tests {
    use gpushare_testkit::fixtures::{node, pod};

    use super::super::testing::{allocated, reserve, signed, signing_view, used, view, with_uid};
    use super::*;

    /// Pending GPU pods pinned by a `nodeSelector` or a required node affinity on the device
    /// plugin's GPU labels, or by the models annotation, count as pinned in the demand mix; a
    /// preferred affinity or another label does not pin.
    #[test]
    fn pods_pinned_to_gpu_labels_count_in_the_demand_mix() {
        use gpushare_allocator::demand_mix::ResourceScores;
        use k8s_openapi::api::core::v1::{
            Affinity, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm,
        };
        let mut view = view();
        let keys = view.settings().keys.clone();
        let model_label = keys.gpu_model_label("Tesla T4");
        let selecting = |label: &str| {
            let mut p = pod("sel").gpu_mem(4).build();
            p.spec.as_mut().unwrap().node_selector =
                Some([(label.to_owned(), "true".to_owned())].into());
            p
        };
        let requiring = |key: &str| {
            let mut p = pod("aff").gpu_mem(4).build();
            let term = NodeSelectorTerm {
                match_expressions: Some(vec![NodeSelectorRequirement {
                    key: key.to_owned(),
                    operator: "Exists".to_owned(),
                    values: None,
                }]),
                ..NodeSelectorTerm::default()
            };
            p.spec.as_mut().unwrap().affinity = Some(Affinity {
                node_affinity: Some(NodeAffinity {
                    required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                        node_selector_terms: vec![term],
                    }),
                    ..NodeAffinity::default()
                }),
                ..Affinity::default()
            });
            p
        };
        let gib_label = format!("{}16", keys.node_gpu_mem_prefix);
        let annotated = pod("ann")
            .gpu_mem(4)
            .annotation(&keys.request_models, "Tesla-T4")
            .build();
        for pinned in [selecting(&model_label), requiring(&gib_label), annotated] {
            let pinned = with_uid(pinned, "u-pinned");
            assert!(
                PodFacts::read(&pinned, view.settings()).unwrap().pinned,
                "{pinned:?}"
            );
        }
        for free in [
            selecting("zone"),
            requiring("kubernetes.io/hostname"),
            pod("p").gpu_mem(4).build(),
        ] {
            let free = with_uid(free, "u-free");
            assert!(
                !PodFacts::read(&free, view.settings()).unwrap().pinned,
                "{free:?}"
            );
        }
        // Every third pending GPU pod pinned: the ranking and the taint follow.
        for i in 0..300 {
            let mut p = if i % 3 == 0 {
                selecting(&model_label)
            } else {
                pod("x").gpu_mem(4).build()
            };
            p.metadata.name = Some(format!("p{i}"));
            view.apply_pod(&with_uid(p, &format!("u{i}")));
        }
        let demand = view.cluster.demand();
        assert!(
            (0.3..0.37).contains(&demand.pinned_share()),
            "{}",
            demand.pinned_share()
        );
        assert!(!demand.wants_idle_gpu_taint());
        assert_eq!(demand.resource_scores(), ResourceScores::Balanced);
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
    fn pods_the_classic_extender_placed_count_on_their_gpus() {
        let mut view = signing_view();
        view.apply_node(&node("n1").gpushare().gpus(&[16, 16]).build());
        let classic_pod = |name: &str, uid: &str, gpu: &str, gib: u64| {
            let built = pod(name)
                .gpu_mem(gib)
                .on_node("n1")
                .annotation(classic::GPU_INDEX, gpu)
                .annotation(classic::POD_MEM, &gib.to_string())
                .annotation(classic::ASSIGNED, "true")
                .build();
            with_uid(built, uid)
        };
        // Unsigned, yet booked as placed (they predate the keyring): no warning.
        assert!(
            view.apply_pod(&classic_pod("old-a", "u1", "1", 6))
                .is_none()
        );
        assert!(
            view.apply_pod(&classic_pod("old-b", "u2", "1", 4))
                .is_none()
        );
        assert_eq!(used(&view, 1), 10);
        assert_eq!(used(&view, 0), 0);
        // Not bound: nothing to count.
        let mut pending = classic_pod("old-c", "u3", "0", 4);
        pending.spec.as_mut().unwrap().node_name = None;
        view.apply_pod(&pending);
        assert_eq!(used(&view, 0), 0);
    }

    #[test]
    fn without_a_keyring_nothing_is_verified() {
        let mut view = view();
        view.apply_node(&node("n1").gpushare().gpus(&[16]).build());
        assert!(view.apply_pod(&allocated("a", "ua", 0, 4)).is_none());
        assert_eq!(used(&view, 0), 4);
    }
}
