//! Fixtures the view's unit tests share: a view, pods with allocation annotations (signed or
//! not), a reservation booked as bind books one.

use gpushare_allocator::fragmentation::Host;
use gpushare_allocator::{PodPlacement, Request};
use gpushare_contract::{Keys, PodAllocation, SharedKeyring};
use gpushare_testkit::fixtures::{node, pod};
use k8s_openapi::api::core::v1::Pod;

use super::{Settings, View};
use crate::scheduling::view::reservations::Ticket;

/// An empty view with the default settings and no keyring.
pub(super) fn view() -> View {
    View::new(Settings::new(
        gpushare_contract::DEFAULT_RESOURCE,
        gpushare_contract::DEFAULT_DOMAIN,
        "gpushare=true",
    ))
}

/// `pod` with UID `uid`.
pub(super) fn with_uid(mut pod: Pod, uid: &str) -> Pod {
    pod.metadata.uid = Some(uid.to_owned());
    pod
}

/// Pod `name` (UID `uid`) bound to n1 asking for `gib`, with unsigned allocation annotations
/// for GPU `gpu`, not yet assigned.
pub(super) fn allocated(name: &str, uid: &str, gpu: u32, gib: u64) -> Pod {
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

/// GiB booked on GPU `gpu` of n1.
pub(super) fn used(view: &View, gpu: usize) -> u64 {
    view.cluster.node("n1").unwrap().gpus()[gpu].used_gib
}

/// Books a 4 GiB reservation for pod `name` (UID `uid`) on n1 and returns its ticket.
pub(super) fn reserve(view: &mut View, uid: &str, name: &str) -> Ticket {
    let request = Request {
        models: Default::default(),
        gpus: 1,
        exclusive: false,
        pod_gib: 4,
        containers: vec![4],
        host: Host::default(),
        compute: 0,
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
            compute: 0,
        },
    )
}

/// The keyring of [`signing_view`] and [`signed`].
pub(super) const KEYRING: &str = "k1:AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";

/// A view with node n1 (one 16 GiB GPU) that verifies allocations with [`KEYRING`].
pub(super) fn signing_view() -> View {
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
pub(super) fn signed(name: &str, uid: &str, gpu: u32, gib: u64) -> Pod {
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
