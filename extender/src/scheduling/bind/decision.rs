//! What bind decides under the view's write lock, before anything is written: whether the
//! pod may be bound to the node now, and if so which GPU it gets, booked at once as a
//! reservation with the Binding (annotations, signature) to write for it.
//!
//! Why all of it under one lock: the check that the memory is free and the booking of it
//! must be one step, or two binds could both see the same GiB free. Nothing here waits on
//! the network; the write runs afterwards, in its own task ([`super`]).

use std::sync::Arc;

use gpushare_allocator::{Placement, PodId, PodPlacement, Policy, Refusal, Request};
use gpushare_contract::{ContainerRequest, GpuRef, PodAllocation, RequestError};

use super::Write;
use crate::scheduling::ports::BindingTarget;
use crate::scheduling::view::reservations::Phase;
use crate::scheduling::view::{NOT_SYNCED, View, unfit_reason};
use crate::wire::ExtenderBindingArgs;

/// What bind decided under the lock.
pub(super) enum Decision {
    /// Already bound there: answer success without writing.
    AlreadyBound,
    /// Write this Binding; the reservation is booked.
    Write(Write),
}

/// A refused bind: the metric's reason and the text kube-scheduler reports.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refused {
    /// The `reason` label it is counted under (`gpushare_extender_binds_total`).
    pub reason: &'static str,
    /// What kube-scheduler reports.
    pub message: String,
}

impl Refused {
    /// A refusal counted under `reason`, reported as `message`.
    pub(super) fn new(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
        }
    }
}

/// What a pod waiting to be bound asks for: the allocator's request and the containers as
/// read (recorded in the allocation).
type Asked = (Request, Vec<ContainerRequest>);

/// Decides the bind of `args`' pod (`pod_key`, for messages) to its node with `policy`, and
/// books it; the write's leadership term is left 0 for the caller to set.
pub(super) fn decide(
    view: &mut View,
    policy: Policy,
    args: &ExtenderBindingArgs,
    pod_key: &str,
) -> Result<Decision, Refused> {
    may_bind_now(view)?;
    let node = args.node.as_str();
    let uid = PodId::from(args.pod_uid.as_str());
    // What filter held for the pod ends here: the bind decides anew, and books the same GPU
    // unless something changed since. Holds of other pods whose bind never came end too (a
    // bind passed on from a follower reaches the leader with no filter before it).
    view.release_lapsed_holds(std::time::Instant::now());
    view.release_hold(&uid);
    let ToBind { bound_to, asked } = the_pod(view, args, &uid, pod_key)?;
    // Retries: the same pod already placed, by the watch or by an earlier bind.
    if let Some(retried) = retry(view, &uid, node, bound_to.as_deref(), pod_key) {
        return retried;
    }
    if let Some(bound_to) = bound_to {
        return Err(Refused::new(
            "conflict",
            format!("pod {pod_key} is already bound to node {bound_to}"),
        ));
    }
    let asked = match asked {
        Ok(Some(asked)) => asked,
        Ok(None) => {
            return Err(Refused::new(
                "no_request",
                format!(
                    "pod {pod_key} asks for no {}; the gpushare extender binds only pods that do",
                    view.settings().resource
                ),
            ));
        }
        Err(error) => return Err(Refused::new("no_request", error.to_string())),
    };
    book(view, policy, args, uid, asked, pod_key)
}

/// Refuses every bind until the view is synced and the start-up grace is over
/// ([`View::bind_hold`]).
fn may_bind_now(view: &View) -> Result<(), Refused> {
    if !view.is_synced() {
        return Err(Refused::new("not_synced", NOT_SYNCED.to_owned()));
    }
    if let Some(wait) = view.bind_hold() {
        return Err(Refused::new(
            "starting",
            format!(
                "extender just started; binds resume in {} ms, once binds sent by a previous instance have landed",
                wait.as_millis()
            ),
        ));
    }
    Ok(())
}

/// The pod to bind, as the view knows it.
struct ToBind {
    /// The node it is bound to, if it is.
    bound_to: Option<Arc<str>>,
    /// What it asks for, read while it waits to be bound.
    asked: Result<Option<Asked>, RequestError>,
}

/// The pod to bind as the view knows it, if it is the same one (UID) kube-scheduler means.
fn the_pod(
    view: &View,
    args: &ExtenderBindingArgs,
    uid: &PodId,
    pod_key: &str,
) -> Result<ToBind, Refused> {
    let Some(cached) = view.pod(&args.pod_namespace, &args.pod_name) else {
        return Err(Refused::new(
            "pod_not_found",
            format!("pod {pod_key} (uid {uid}) not found"),
        ));
    };
    if cached.uid != *uid {
        return Err(Refused::new(
            "pod_recreated",
            format!(
                "pod {pod_key} (uid {uid}) was recreated (now uid {}); not binding the old one",
                cached.uid
            ),
        ));
    }
    Ok(ToBind {
        bound_to: cached.node_name.clone(),
        asked: cached
            .pending_request()
            .map(|r| r.map(|(request, read)| (request, read.containers.clone()))),
    })
}

/// The answer to a bind of pod `uid`, bound to `bound_to` (if it is), to `node` when the
/// view already places the pod: a retry of a bind that succeeded, one still under way, or a
/// conflict. `None` when the pod is placed nowhere yet.
fn retry(
    view: &View,
    uid: &PodId,
    node: &str,
    bound_to: Option<&str>,
    pod_key: &str,
) -> Option<Result<Decision, Refused>> {
    let (placed_on, _) = view.cluster.pod(uid)?;
    let phase = view.reservation(uid).map(|r| r.phase);
    Some(match (placed_on == node, bound_to, phase) {
        (true, Some(n), _) if n == node => Ok(Decision::AlreadyBound),
        (true, None, Some(Phase::Written)) => Ok(Decision::AlreadyBound),
        (true, None, Some(Phase::Writing | Phase::Resolving)) => Err(Refused::new(
            "in_progress",
            format!("a bind of pod {pod_key} to node {node} is already under way; retry shortly"),
        )),
        (false, None, Some(Phase::Writing | Phase::Resolving)) => Err(Refused::new(
            "in_progress",
            format!(
                "pod {pod_key} holds GPU memory on node {placed_on} while it is resolved whether its earlier Binding there landed; not binding it to {node} now, retry shortly"
            ),
        )),
        _ => Err(Refused::new(
            "conflict",
            format!(
                "pod {pod_key} already holds GPU memory on node {placed_on}; not binding it to {node}"
            ),
        )),
    })
}

/// Books what the pod `asked` for on its node with `policy` (a reservation, phase Writing)
/// and returns the Binding to write for it.
fn book(
    view: &mut View,
    policy: Policy,
    args: &ExtenderBindingArgs,
    uid: PodId,
    (request, containers): Asked,
    pod_key: &str,
) -> Result<Decision, Refused> {
    let node = args.node.as_str();
    let placement = view
        .cluster
        .reserve(uid.clone(), node, &request, policy)
        .map_err(|refusal| match refusal {
            Refusal::Unfit { reason } => Refused::new(
                "unfit",
                format!(
                    "cannot bind pod {pod_key} to node {node}: {}",
                    unfit_reason(view.settings(), node, &reason)
                ),
            ),
            other => Refused::new("conflict", format!("pod {pod_key}: {other}")),
        })?;
    let allocation = signed_allocation(view, &uid, node, &placement, containers);
    let annotations = allocation.to_annotations(&view.settings().keys);
    let ticket = view.add_reservation(
        uid.clone(),
        &args.pod_namespace,
        &args.pod_name,
        node,
        PodPlacement {
            more_gpus: placement
                .more_gpus
                .iter()
                .map(|(index, uuid)| (*index, Arc::from(uuid.as_str())))
                .collect(),
            exclusive: placement.exclusive,
            gpu: placement.gpu,
            uuid: placement.uuid.as_str().into(),
            pod_gib: placement.pod_gib,
            pending: request.containers.clone(),
            assigned: false,
            compute: placement.compute,
        },
    );
    Ok(Decision::Write(Write {
        target: BindingTarget {
            namespace: args.pod_namespace.clone(),
            name: args.pod_name.clone(),
            uid: uid.to_string(),
            node: node.to_owned(),
            annotations,
        },
        uid,
        ticket,
        gpu: placement.gpu,
        uuid: placement.uuid,
        gib: placement.pod_gib,
        term: 0,
    }))
}

/// The allocation recorded on the pod for `placement`, signed for pod `uid` on `node` when a
/// keyring is configured: the device plugin acts only on what verifies.
fn signed_allocation(
    view: &View,
    uid: &PodId,
    node: &str,
    placement: &Placement,
    containers: Vec<ContainerRequest>,
) -> PodAllocation {
    let mut allocation = PodAllocation {
        more_gpus: placement
            .more_gpus
            .iter()
            .map(|(index, uuid)| GpuRef {
                index: *index,
                uuid: uuid.clone(),
            })
            .collect(),
        exclusive: placement.exclusive,
        gpu_index: placement.gpu,
        gpu_uuid: placement.uuid.clone(),
        pod_gib: placement.pod_gib,
        containers,
        bind_time: jiff::Timestamp::now().to_string(),
        assigned: false,
        allocated: Vec::new(),
        signature: None,
        compute: placement.compute,
    };
    if let Some(keyring) = &view.settings().keyring {
        allocation.signature = Some(keyring.current().sign(uid.as_str(), node, &allocation));
    }
    allocation
}
