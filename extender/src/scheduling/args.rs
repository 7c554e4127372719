//! What filter and prioritize read of kube-scheduler's arguments: the candidate nodes, the
//! pod's UID, and its request in the allocator's form.
//!
//! Why one place: both verbs are sent the same `ExtenderArgs` and must read the pod alike, or
//! a node prioritize scores could be one filter would have refused.

use std::borrow::Cow;

use gpushare_allocator::{PodId, Request};
use gpushare_contract::RequestError;
use serde_json::value::RawValue;

use crate::scheduling::view::View;
use crate::wire::{ExtenderArgs, raw_node_name};

/// A candidate node: its name, with its raw object when kube-scheduler sent objects.
pub(super) type Candidate<'a> = (Cow<'a, str>, Option<&'a RawValue>);

/// The candidate nodes of a request: names, each with its raw object when sent as objects.
pub(super) fn candidates<'a>(args: &'a ExtenderArgs<'a>) -> Vec<Candidate<'a>> {
    if let Some(names) = &args.node_names {
        names.iter().map(|n| (n.clone(), None)).collect()
    } else if let Some(nodes) = &args.nodes {
        nodes
            .items
            .iter()
            .map(|raw| (raw_node_name(raw).unwrap_or_default(), Some(*raw)))
            .collect()
    } else {
        Vec::new()
    }
}

/// The UID of the pod a filter or prioritize call is about, when kube-scheduler sent one.
pub(super) fn pod_uid(args: &ExtenderArgs<'_>) -> Option<PodId> {
    args.pod
        .as_ref()
        .and_then(|pod| pod.metadata.uid.as_deref())
        .map(PodId::from)
}

/// Why a filter or prioritize call's pod cannot be sized: the reason every node fails.
#[derive(Debug, thiserror::Error)]
pub(super) enum Unsized {
    /// kube-scheduler sent no pod.
    #[error("the request carries no Pod")]
    NoPod,
    /// The pod's request cannot be read.
    #[error(transparent)]
    Request(#[from] RequestError),
}

/// The pod's request, or why every node fails. In DRA mode it is read from the pod's claims
/// ([`View::dra_request`]), and a pod the extender cannot size is passed on unranked.
pub(super) fn read_request(
    args: &ExtenderArgs<'_>,
    view: &View,
) -> Result<Option<Request>, Unsized> {
    let Some(pod) = args.pod.as_ref() else {
        return Err(Unsized::NoPod);
    };
    let settings = view.settings();
    if settings.dra.is_some() {
        return Ok(view.dra_request(pod));
    }
    Ok(view.request_of(pod)?)
}
