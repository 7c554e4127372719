//! Keeps the view in step with the API server: one watch over Nodes, one over Pods (all
//! namespaces, decoded lean: [`WatchedPod`]), and in DRA mode one over our driver's
//! ResourceSlices and one over ResourceClaims. A (re)list is buffered and swapped in whole at
//! `InitDone`, so the allocator is rebuilt from one consistent list, never from half of one.

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{
    Affinity, Node, NodeAffinity, NodeSelector, NodeSelectorTerm, NodeSpec, NodeStatus, PodSpec,
    Taint,
};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};

use crate::kube_io::watched_pod::WatchedPod;
use crate::scheduling::Scheduling;
use crate::scheduling::ports::PodEvent;
use crate::scheduling::view::{PodFacts, PodWarning, View};

/// Follows Nodes until the stream ends (it ends only if the watcher gives up).
pub async fn watch_nodes(client: kube::Client, state: Scheduling) {
    let api: Api<Node> = Api::all(client);
    let (resource, domain) = watched_names(&state);
    let stream = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .modify(move |node| trim_node(node, &resource, &domain));
    let how = Changes {
        replace: View::replace_nodes,
        apply: View::apply_node,
        delete: View::delete_node,
        gauges: false,
    };
    follow_objects(stream, "node", &state, how).await;
}

/// The pods the extender watches: those not finished, as kube-scheduler's own pod informer
/// selects them. A finished pod holds no GPU memory and no CPU or memory on its node, so the
/// view has nothing to keep of it; when a pod finishes, the API server sends it as DELETED
/// (it stops matching), which frees what it held, and a relist leaves finished pods out: on
/// clusters with many completed Job pods, a much smaller list and fewer events.
pub const UNFINISHED_PODS: &str = "status.phase!=Succeeded,status.phase!=Failed";

/// Follows Pods until the stream ends (it ends only if the watcher gives up). Pods are
/// decoded lean ([`WatchedPod`]), then cut to gpushare's annotations and node-label terms.
pub async fn watch_pods(client: kube::Client, state: Scheduling) {
    let api: Api<WatchedPod> = Api::all(client);
    let (_, domain) = watched_names(&state);
    let stream = watcher::watcher(api, watcher::Config::default().fields(UNFINISHED_PODS))
        .default_backoff()
        .modify(move |pod| {
            keep_domain_annotations(&mut pod.0.metadata, &domain);
            if let Some(spec) = pod.0.spec.as_mut() {
                keep_domain_pins(spec, &domain);
            }
        });
    let warn = |warnings: Vec<PodWarning>| {
        for warning in warnings {
            state.events().send(PodEvent {
                namespace: warning.namespace,
                name: warning.name,
                uid: warning.uid,
                warning: true,
                reason: "GpuAllocationUnreadable",
                note: warning.message,
            });
        }
    };
    let settings = state.view().settings().clone();
    follow(
        stream,
        "pods",
        |event, buffer: &mut Vec<PodFacts>| match event {
            Event::Init => buffer.clear(),
            Event::InitApply(WatchedPod(pod)) => buffer.extend(
                PodFacts::read(&pod, &settings)
                    .filter(|facts| facts.concerns_gpushare() || facts.books_host()),
            ),
            Event::InitDone => {
                let pods = std::mem::take(buffer);
                let count = pods.len();
                let warnings = {
                    let mut view = state.view_mut();
                    let warnings = view.replace_pod_facts(pods);
                    let synced = view.is_synced();
                    tracing::info!(pods = count, ready = synced, "pod watch synced");
                    warnings
                };
                warn(warnings);
            }
            Event::Apply(WatchedPod(pod)) => {
                let warning = state.view_mut().apply_pod(&pod);
                warn(warning.into_iter().collect());
            }
            Event::Delete(WatchedPod(pod)) => state.view_mut().delete_pod(&pod),
        },
    )
    .await;
}

/// Follows our driver's ResourceSlices (DRA mode) until the stream ends.
pub async fn watch_slices(client: kube::Client, state: Scheduling, driver: String) {
    let api: Api<ResourceSlice> = Api::all(client);
    let selector = format!("spec.driver={driver}");
    let stream = watcher::watcher(api, watcher::Config::default().fields(&selector))
        .default_backoff()
        .modify(|slice| slice.metadata.managed_fields = None);
    let how = Changes {
        replace: View::replace_slices,
        apply: View::apply_slice,
        delete: View::delete_slice,
        gauges: false,
    };
    follow_objects(stream, "ResourceSlice", &state, how).await;
}

/// Follows ResourceClaims (DRA mode, all namespaces) until the stream ends: what each asks,
/// and what the allocated ones book.
pub async fn watch_claims(client: kube::Client, state: Scheduling) {
    let api: Api<ResourceClaim> = Api::all(client);
    let stream = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .modify(|claim| claim.metadata.managed_fields = None);
    // A claim's allocation ends holds: the reservation gauges follow.
    let how = Changes {
        replace: View::replace_claims,
        apply: View::apply_claim,
        delete: View::delete_claim,
        gauges: true,
    };
    follow_objects(stream, "ResourceClaim", &state, how).await;
}

/// How a watch of `K` changes the view: the whole list once (re)listed, one object, its
/// deletion; `gauges`: the reservation gauges are set after each change.
struct Changes<K> {
    replace: fn(&mut View, &[K]),
    apply: fn(&mut View, &K),
    delete: fn(&mut View, &K),
    gauges: bool,
}

/// Follows a watch of `K` (`what`, for the logs) into the view until the stream ends: a
/// (re)list is buffered and applied whole at `InitDone`.
async fn follow_objects<K, S>(stream: S, what: &'static str, state: &Scheduling, how: Changes<K>)
where
    S: Stream<Item = Result<Event<K>, watcher::Error>>,
{
    let change = |event: Event<K>, buffer: &mut Vec<K>| {
        // The list is buffered without the lock; only changes to the view take it.
        let view = match event {
            Event::Init => return buffer.clear(),
            Event::InitApply(object) => return buffer.push(object),
            Event::InitDone => {
                let objects = std::mem::take(buffer);
                let mut view = state.view_mut();
                (how.replace)(&mut view, &objects);
                tracing::info!(objects = objects.len(), "{what} watch synced");
                view
            }
            Event::Apply(object) => {
                let mut view = state.view_mut();
                (how.apply)(&mut view, &object);
                view
            }
            Event::Delete(object) => {
                let mut view = state.view_mut();
                (how.delete)(&mut view, &object);
                view
            }
        };
        if how.gauges {
            state.update_reservation_gauges(&view);
        }
    };
    follow(stream, what, change).await;
}

/// The resource name and the annotation domain prefix (`<domain>/`) the view reads.
fn watched_names(state: &Scheduling) -> (String, String) {
    let view = state.view();
    let settings = view.settings();
    let domain = settings
        .keys
        .gpu_index
        .split_once('/')
        .map(|(domain, _)| format!("{domain}/"))
        .unwrap_or_default();
    (settings.resource.clone(), domain)
}

/// Keeps only gpushare's annotations (`<domain>/…`) of a watched pod, and the classic
/// gpushare's (`ALIYUN_COM_GPU_MEM_…`, pods it placed before the switch: docs/migrating.md):
/// the rest of what [`WatchedPod`] decodes is what the view reads.
///
/// Why: a relist of a large cluster is buffered until it is complete; other annotations
/// (`last-applied-configuration`, for one) can be KiBs per pod.
fn keep_domain_annotations(metadata: &mut ObjectMeta, domain: &str) {
    if let Some(annotations) = metadata.annotations.as_mut() {
        annotations.retain(|key, _| key.starts_with(domain) || key.starts_with(CLASSIC_PREFIX));
    }
}

/// Keeps of a watched pod's node selector and required node affinity only what names
/// gpushare's node labels (`<domain>/…`): whether the pod is pinned to GPU models
/// ([`crate::scheduling::view`] counts such pods in the demand mix) is all the view reads of
/// them. Why: most affinity is not ours (every DaemonSet pod's names its node), and the watch
/// keeps every pod of the cluster.
fn keep_domain_pins(spec: &mut PodSpec, domain: &str) {
    if let Some(selector) = spec.node_selector.as_mut() {
        selector.retain(|key, _| key.starts_with(domain));
    }
    if spec.node_selector.as_ref().is_some_and(|s| s.is_empty()) {
        spec.node_selector = None;
    }
    let required = (spec.affinity.take())
        .and_then(|a| a.node_affinity)
        .and_then(|n| n.required_during_scheduling_ignored_during_execution);
    let terms: Vec<NodeSelectorTerm> = (required.into_iter())
        .flat_map(|r| r.node_selector_terms)
        .filter_map(|term| {
            let ours: Vec<_> = (term.match_expressions.into_iter().flatten())
                .filter(|e| e.key.starts_with(domain))
                .collect();
            (!ours.is_empty()).then_some(NodeSelectorTerm {
                match_expressions: Some(ours),
                match_fields: None,
            })
        })
        .collect();
    spec.affinity = (!terms.is_empty()).then(|| Affinity {
        node_affinity: Some(NodeAffinity {
            required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                node_selector_terms: terms,
            }),
            ..NodeAffinity::default()
        }),
        ..Affinity::default()
    });
}

/// What the classic gpushare's pod annotations start with
/// ([`gpushare_contract::allocation::classic`]).
const CLASSIC_PREFIX: &str = "ALIYUN_COM_GPU_MEM_";

/// Keeps only what the view reads of a Node: name, labels, gpushare's annotations, its
/// `PreferNoSchedule` taints (the filter that keeps the best steps aside for them, and the
/// idle-GPU taint is among them), the capacity of the resource (the fallback when no
/// inventory is published) and the allocatable CPU and memory (the fragmentation policy
/// weighs them).
fn trim_node(node: &mut Node, resource: &str, domain: &str) {
    node.metadata.managed_fields = None;
    if let Some(annotations) = node.metadata.annotations.as_mut() {
        annotations.retain(|key, _| key.starts_with(domain));
    }
    node.spec = node.spec.take().and_then(|spec| {
        let soft: Vec<Taint> = (spec.taints.into_iter().flatten())
            .filter(|taint| taint.effect == "PreferNoSchedule")
            .collect();
        (!soft.is_empty()).then(|| NodeSpec {
            taints: Some(soft),
            ..NodeSpec::default()
        })
    });
    if let Some(status) = node.status.as_mut() {
        let capacity = status.capacity.take().map(|mut capacity| {
            capacity.retain(|key, _| key == resource);
            capacity
        });
        let allocatable = status.allocatable.take().map(|mut allocatable| {
            allocatable.retain(|key, _| key == "cpu" || key == "memory");
            allocatable
        });
        *status = NodeStatus {
            capacity,
            allocatable,
            ..NodeStatus::default()
        };
    }
}

async fn follow<K, B, S, F>(stream: S, what: &'static str, mut apply: F)
where
    S: Stream<Item = Result<Event<K>, watcher::Error>>,
    F: FnMut(Event<K>, &mut Vec<B>),
{
    let mut stream = std::pin::pin!(stream);
    let mut buffer = Vec::new();
    while let Some(item) = stream.next().await {
        match item {
            Ok(event) => apply(event, &mut buffer),
            Err(error) => tracing::warn!(watch = what, %error, "watch error; retrying"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn the_watch_keeps_only_the_node_label_terms_that_name_ours() {
        let pod = |spec: serde_json::Value| {
            let WatchedPod(pod) = serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p", "namespace": "ns", "uid": "u1"}, "spec": spec,
            }))
            .unwrap();
            let mut spec = pod.spec.unwrap();
            keep_domain_pins(&mut spec, "gpushare.example.com/");
            serde_json::to_value((spec.node_selector, spec.affinity)).unwrap()
        };
        let required = |terms: serde_json::Value| {
            serde_json::json!({"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}})
        };
        // A DaemonSet pod names its node; a pod selects a zone: nothing of ours, nothing kept.
        let daemon = required(serde_json::json!([{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]));
        let kept = pod(serde_json::json!({"containers": [], "affinity": daemon,
            "nodeSelector": {"zone": "a"}}));
        assert_eq!(kept, serde_json::json!([null, null]));
        // A pin on a GPU model keeps its own term and selector entry, nothing else.
        let pinned = required(serde_json::json!([{"matchExpressions": [
            {"key": "gpushare.example.com/gpu-model.Tesla-T4", "operator": "Exists"},
            {"key": "zone", "operator": "In", "values": ["a"]}]}]));
        let kept = pod(serde_json::json!({"containers": [], "affinity": pinned,
            "nodeSelector": {"zone": "a", "gpushare.example.com/gpu-mem.16": "true"}}));
        assert_eq!(
            kept,
            serde_json::json!([
                {"gpushare.example.com/gpu-mem.16": "true"},
                required(serde_json::json!([{"matchExpressions": [
                    {"key": "gpushare.example.com/gpu-model.Tesla-T4", "operator": "Exists"}]}])),
            ])
        );
    }

    #[test]
    fn the_watch_keeps_what_the_view_reads() {
        let WatchedPod(mut pod) = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "p", "namespace": "ns", "uid": "u1",
                "labels": {"app": "x"},
                "annotations": {"gpushare.example.com/v1.gpu-index": "1", "ALIYUN_COM_GPU_MEM_IDX": "0", "kubectl.kubernetes.io/last-applied-configuration": "{…}"},
                "managedFields": [{"manager": "kubectl"}]
            },
            "spec": {
                "nodeName": "n1",
                "containers": [{"name": "main", "image": "img", "env": [{"name": "A", "value": "1"}],
                    "resources": {"limits": {"example.com/gpu-mem": "4"}}}],
                "initContainers": [{"name": "init", "image": "img", "restartPolicy": "Always"}],
                "volumes": [{"name": "v", "emptyDir": {}}]
            },
            "status": {"phase": "Running", "podIP": "10.0.0.1"}
        }))
        .unwrap();
        keep_domain_annotations(&mut pod.metadata, "gpushare.example.com/");
        assert!(gpushare_contract::allocation::classic::GPU_INDEX.starts_with(CLASSIC_PREFIX));
        let annotations: BTreeMap<_, _> = pod.metadata.annotations.clone().unwrap();
        assert_eq!(
            annotations.keys().collect::<Vec<_>>(),
            vec![
                "ALIYUN_COM_GPU_MEM_IDX",
                "gpushare.example.com/v1.gpu-index"
            ]
        );
        assert!(pod.metadata.labels.is_none() && pod.metadata.managed_fields.is_none());
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("n1"));
        assert!(
            spec.volumes.is_none()
                && spec.containers[0].image.is_none()
                && spec.containers[0].env.is_none()
        );
        assert!(spec.containers[0].resources.is_some());
        assert_eq!(
            spec.init_containers.as_ref().unwrap()[0]
                .restart_policy
                .as_deref(),
            Some("Always")
        );
        assert_eq!(
            pod.status.as_ref().unwrap().phase.as_deref(),
            Some("Running")
        );
        assert!(pod.status.as_ref().unwrap().pod_ip.is_none());
        assert_eq!(
            gpushare_contract::pod_request_with(
                &pod,
                "example.com/gpu-mem",
                &gpushare_contract::Keys::default()
            )
            .unwrap()
            .unwrap()
            .pod_gib,
            4
        );
    }

    #[test]
    fn the_node_watch_keeps_the_soft_taints_and_nothing_else_of_the_spec() {
        let node = |taints: serde_json::Value| -> Node {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "n1"},
                "spec": {"podCIDR": "10.0.0.0/24", "providerID": "x://n1", "taints": taints}
            }))
            .unwrap()
        };
        let mut tainted = node(serde_json::json!([
            {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"},
            {"key": "gpushare.example.com/idle-gpu", "effect": "PreferNoSchedule"}
        ]));
        trim_node(&mut tainted, "example.com/gpu-mem", "gpushare.example.com/");
        let spec = tainted.spec.unwrap();
        assert_eq!(spec.pod_cidr, None);
        assert_eq!(spec.provider_id, None);
        let kept: Vec<&str> = spec
            .taints
            .iter()
            .flatten()
            .map(|t| t.key.as_str())
            .collect();
        assert_eq!(kept, ["gpushare.example.com/idle-gpu"]);
        let mut hard = node(serde_json::json!([{"key": "k", "effect": "NoExecute"}]));
        trim_node(&mut hard, "example.com/gpu-mem", "gpushare.example.com/");
        assert_eq!(hard.spec, None);
    }
}
