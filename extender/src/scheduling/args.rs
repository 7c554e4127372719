//! What filter and prioritize read of kube-scheduler's arguments: the candidate nodes, the
//! pod's UID, and its request in the allocator's form.
//!
//! Why one place: both verbs are sent the same `ExtenderArgs` and must read the pod alike, or
//! a node prioritize scores could be one filter would have refused.

use std::borrow::Cow;

use gpushare_allocator::{PodId, Request};
use gpushare_contract::pod_request_with;
use serde_json::value::RawValue;

use crate::view::{View, pod_host, to_request};
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

/// The pod's request, or the reason every node fails. In DRA mode it is read from the pod's
/// claims ([`View::dra_request`]), and a pod the extender cannot size is passed on unranked.
pub(super) fn read_request(
    args: &ExtenderArgs<'_>,
    view: &View,
) -> Result<Option<Request>, String> {
    let Some(pod) = args.pod.as_ref() else {
        return Err("the request carries no Pod".to_owned());
    };
    let settings = view.settings();
    if settings.dra.is_some() {
        return Ok(view.dra_request(pod));
    }
    pod_request_with(pod, &settings.resource, &settings.keys)
        .map(|r| {
            r.map(|r| Request {
                host: pod_host(pod),
                ..to_request(&r)
            })
        })
        .map_err(|e| e.to_string())
}
