//! Applying what the pod watch delivers: a pod's booking in the allocator, the warning its
//! owner gets when its allocation annotations cannot be used, and the spare record the view
//! keeps of it ([`CachedPod`]).
//!
//! Why one function per case: a watched pod is one of a few things (not ours, waiting, bound,
//! finished), and a bound pod's annotations are one of four (readable, salvageable, absent,
//! not signed by us); each case books differently, and each is easier to check on its own
//! against the rules in the module doc of [`crate::scheduling::view`].

use std::sync::Arc;

use gpushare_allocator::fragmentation::Host;
use gpushare_allocator::{PodId, PodPlacement, Request};
use gpushare_contract::{PodRequest, RequestError};
use k8s_openapi::api::core::v1::Pod;

use super::facts::{AllocationFacts, Ask, PodFacts, read_pod_request, to_request};
use super::{View, pod_key, split_key};

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
    /// `spec.priority`: which pods a preemptor may displace.
    pub priority: i32,
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

/// What a bound pod's annotations do to its booking.
enum Booking {
    Book(PodPlacement),
    /// Not trusted to change it: what is booked stays, nothing new is booked.
    Keep,
    Nothing,
}

/// A bound pod whose booking is being decided: who, on which node, and whether its
/// annotations were bad already (its owner was warned, the logs said so).
struct Bound<'a> {
    key: &'a str,
    uid: &'a PodId,
    node: &'a str,
    was_bad: bool,
}

/// The warning for the owner of pod `key` whose `allocation` cannot be used, if it cannot.
fn allocation_warning(key: &str, uid: &PodId, allocation: &AllocationFacts) -> Option<PodWarning> {
    let (namespace, name) = split_key(key);
    let message = match allocation {
        AllocationFacts::Unreadable { error, .. } => {
            tracing::error!(pod = %key, %uid, %error, "unreadable allocation annotations");
            format!(
                "gpushare allocation annotations of pod {namespace}/{name} cannot be read: {error}"
            )
        }
        AllocationFacts::Untrusted { why, .. } => format!(
            "gpushare allocation annotations of pod {namespace}/{name} are not signed by the gpushare extender ({why}); the device plugin gives it no GPU. Delete the pod and let the scheduler place it."
        ),
        _ => return None,
    };
    Some(PodWarning {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        uid: uid.to_string(),
        message,
    })
}

impl View {
    /// What `pod` asks for, in the allocator's form: the view's own reading while the pod
    /// waits to be bound (the one bind places, so filter, prioritize and preempt judge the
    /// request bind will act on), or, for a pod the view does not hold as waiting (not seen
    /// yet, or bound already), [`read_pod_request`] of the object given.
    pub fn request_of(&self, pod: &Pod) -> Result<Option<Request>, RequestError> {
        let held = pod
            .metadata
            .namespace
            .as_deref()
            .zip(pod.metadata.name.as_deref())
            .and_then(|(namespace, name)| self.pod(namespace, name))
            .filter(|cached| {
                matches!(cached.ask, Ask::Pending(_))
                    && pod.metadata.uid.as_deref() == Some(cached.uid.as_str())
            });
        match held {
            Some(cached) => cached
                .pending_request()
                .map(|r| r.map(|(request, _)| request)),
            None => read_pod_request(pod, &self.settings).map(|r| r.map(|(request, _)| request)),
        }
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
            priority,
            nominated_node,
            pinned,
        } = facts;
        let (key, uid) = self.shared_ids(key, uid);
        self.forget_if_recreated(&key, &uid);
        if ask == Ask::Nothing && matches!(allocation, AllocationFacts::Absent) {
            // Not ours (anymore), but its CPU and memory count on its node.
            self.forget_pod(&key, &uid);
            self.book_host(&uid, node_name.as_deref(), finished, host);
            return None;
        }
        self.book_host(&uid, node_name.as_deref(), finished, host);
        if node_name.is_none() {
            self.observe_if_newly_waiting(&key, &ask, host, pinned);
        }
        let was_bad = self.pods.get(&key).is_some_and(|p| p.bad_annotations);
        let bad_annotations = allocation.is_bad();
        let warning = match was_bad {
            true => None,
            false => allocation_warning(&key, &uid, &allocation),
        };
        self.follow_nomination(
            &uid,
            nominated_node.as_deref(),
            finished,
            &ask,
            host,
            priority,
        );
        match node_name.as_deref() {
            _ if finished => {
                self.cluster.remove_pod(&uid);
                self.reservations.remove(&uid);
            }
            Some(node) => {
                let bound = Bound {
                    key: &key,
                    uid: &uid,
                    node,
                    was_bad,
                };
                self.book_bound(&bound, allocation);
            }
            // A pending pod (no node yet) keeps any reservation: its Binding is still being
            // written or resolved.
            None => {}
        }
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
                priority,
            },
        );
        self.book_nominations();
        warning
    }

    /// Starts, moves or ends the pod's nomination (see `preemption.rs`): only an unbound,
    /// unfinished pod with a readable request is held for.
    fn follow_nomination(
        &mut self,
        uid: &PodId,
        nominated: Option<&str>,
        finished: bool,
        ask: &Ask,
        host: Host,
        priority: i32,
    ) {
        let request = match ask {
            Ask::Pending(request) if !finished => request.as_ref().as_ref().ok(),
            _ => None,
        };
        match (nominated, request) {
            (Some(node), Some(request)) => {
                let request = Request {
                    host,
                    ..to_request(request)
                };
                self.nominate(uid, node, request, priority);
            }
            _ => self.end_nomination(uid),
        }
    }

    /// The pod's key and UID as the view already holds them, if it does: keep sharing the
    /// strings already held, or an update of a known pod would leave the indexes holding two
    /// copies of its name and UID.
    fn shared_ids(&self, key: Arc<str>, uid: PodId) -> (Arc<str>, PodId) {
        let key = self
            .pods
            .get_key_value(&key)
            .map_or(key, |(known, _)| known.clone());
        let uid = self
            .pod_keys
            .get_key_value(&uid)
            .map_or(uid, |(known, _)| known.clone());
        (key, uid)
    }

    /// Forgets the pod known as `key` if it had another UID: a pod recreated under the same
    /// name is a different pod.
    fn forget_if_recreated(&mut self, key: &str, uid: &PodId) {
        if let Some(old) = self.pods.get(key)
            && old.uid != *uid
        {
            let old_uid = old.uid.clone();
            self.forget_pod(key, &old_uid);
        }
    }

    /// A GPU pod seen waiting for the first time: its demand joins the recent demand mix the
    /// ranking follows (`gpushare_allocator::demand_mix`), and its shape (one-GPU, or
    /// multi-GPU shared slices) the workload the fragmentation policy measures against
    /// (`gpushare_allocator::Cluster::observe_arrival`).
    fn observe_if_newly_waiting(&mut self, key: &str, ask: &Ask, host: Host, pinned: bool) {
        if let Ask::Pending(request) = ask
            && let Ok(request) = request.as_ref()
            && self
                .pods
                .get(key)
                .is_none_or(|known| known.node_name.is_none() && known.ask == Ask::Nothing)
        {
            self.cluster.observe_arrival(
                (request.gpus, request.gib_per_gpu()),
                request.exclusive,
                host,
                pinned,
            );
        }
    }

    /// Books a bound pod by what its annotations say; whatever bind reserved for it ends.
    fn book_bound(&mut self, pod: &Bound<'_>, allocation: AllocationFacts) {
        let bad_annotations = allocation.is_bad();
        let booking = self.booking(pod, allocation);
        // The pod is bound: whatever bind reserved has served its purpose. From here on
        // the pod's own annotations (the Binding's, written in the same write as the
        // node) say where its memory is.
        let reserved = self.reservations.remove(pod.uid).is_some();
        match booking {
            Booking::Book(placement) => {
                self.cluster
                    .upsert_pod(pod.uid.clone(), pod.node, placement)
            }
            Booking::Keep => {}
            Booking::Nothing => {
                if (reserved || self.cluster.pod(pod.uid).is_none()) && !bad_annotations {
                    tracing::warn!(
                        pod = %pod.key,
                        node = %pod.node,
                        "pod asking for GPU memory is bound without a gpushare allocation; its memory is not accounted"
                    );
                }
                self.cluster.remove_pod(pod.uid);
            }
        }
    }

    /// What a bound pod's annotations do to its booking.
    fn booking(&self, pod: &Bound<'_>, allocation: AllocationFacts) -> Booking {
        match allocation {
            AllocationFacts::Readable(placement) => Booking::Book(placement),
            AllocationFacts::Unreadable { salvaged: None, .. } => {
                tracing::error!(
                    pod = %pod.key,
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
                self.untrusted_booking(pod, &why, fallback)
            }
        }
    }

    /// The booking of a bound pod whose allocation is not signed by us (`why`): what is
    /// booked for it stays; with nothing booked, its spec's request (`fallback`) is booked on
    /// the GPU the annotations name ("Why a signature that does not verify keeps the
    /// booking" in [`crate::scheduling::view`]).
    fn untrusted_booking(
        &self,
        pod: &Bound<'_>,
        why: &str,
        fallback: Option<PodPlacement>,
    ) -> Booking {
        let Bound {
            key, node, was_bad, ..
        } = *pod;
        match (self.cluster.pod(pod.uid), fallback) {
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

    /// Drops everything the view knows of pod `key` with `uid`: its record, its reservation,
    /// its bookings.
    fn forget_pod(&mut self, key: &str, uid: &PodId) {
        if self.pods.get(key).is_some_and(|p| p.uid == *uid) {
            self.pods.remove(key);
        }
        self.pod_keys.remove(uid);
        self.nominations.remove(uid);
        self.reservations.remove(uid);
        self.cluster.remove_pod(uid);
        self.cluster.remove_pod_host(uid);
        self.book_nominations();
    }
}

#[cfg(test)]
mod tests {
    use gpushare_contract::Keys;
    use gpushare_testkit::fixtures::{node, pod};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    use super::super::testing::{allocated, reserve, used, view, with_uid};
    use super::*;

    #[test]
    fn filter_reads_the_request_bind_will_place() {
        let mut view = view();
        let keys = Keys::default();
        let waiting = |gib: u64, gpus: &str| {
            let mut pod = with_uid(pod("train").gpu_mem(gib).build(), "u-train");
            pod.metadata.annotations = Some([(keys.request_gpus.clone(), gpus.to_owned())].into());
            pod
        };
        // Not seen yet: read from the object kube-scheduler sent.
        let sent = waiting(8, "2");
        let read = view.request_of(&sent).unwrap().unwrap();
        assert_eq!((read.pod_gib, read.gpus), (8, 2));
        // Once the view holds it waiting, its reading wins over a different copy.
        view.apply_pod(&waiting(16, "4"));
        let read = view.request_of(&sent).unwrap().unwrap();
        assert_eq!((read.pod_gib, read.gpus), (16, 4));
        let (bind_reads, _) = view
            .pod("default", "train")
            .unwrap()
            .pending_request()
            .unwrap()
            .unwrap();
        assert_eq!(read, bind_reads);
        // A recreated pod (another UID) is read from what was sent.
        let recreated = with_uid(waiting(8, "2"), "u-other");
        assert_eq!(view.request_of(&recreated).unwrap().unwrap().gpus, 2);
        // So is an unreadable one the view does not hold.
        let bad = with_uid(waiting(8, "x"), "u-bad");
        let mut bad_named = bad.clone();
        bad_named.metadata.name = Some("other".into());
        assert!(view.request_of(&bad_named).is_err());
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
}
