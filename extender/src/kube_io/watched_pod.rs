//! The Pod as the extender's pod watch decodes it: only what the view reads, the rest of the
//! JSON skipped unparsed.
//!
//! Why: the pod watch sees every pod of the cluster, GPU or not, on every change (created,
//! bound, started, each status update), and each event carries the whole object:
//! `managedFields` (often as large as the rest), env, volumes, probes, container statuses. A
//! full `k8s_openapi` Pod builds all of that (thousands of small strings and maps) only for
//! the watch to throw it away. Decoding into the few fields the view reads is several times
//! cheaper per event (`cargo bench -p gpushare-perf --bench watch_decode`; figures in
//! docs/performance.md) and allocates only what is kept.
//!
//! What is kept is exactly what [`crate::kube_io::watch`] kept before by trimming a full Pod: the
//! metadata except labels, owner references and managed fields; the node name and the
//! priority (preemption weighs it); the node selector and the node affinity (whether the pod
//! is pinned to GPU models, which the demand mix counts); each container's and init container's name, resources
//! and restart policy; the phase, the start time (kubelet admitted the pod: see
//! [`crate::scheduling::view::PodFacts`]) and the node a preemption nominated the pod for. A test
//! holds the two equal on varied pods. Annotations are kept whole here and cut to gpushare's
//! domain by the watch, which knows the domain.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, Container, NodeAffinity, Pod, PodSpec, PodStatus, ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::{NamespaceResourceScope, Resource};
use serde::{Deserialize, Deserializer};

/// A Pod decoded for the view (see the module docs). Served as `pods` of core/v1, so
/// `kube::Api<WatchedPod>` lists and watches pods.
#[derive(Debug, Clone, PartialEq)]
pub struct WatchedPod(pub Pod);

impl Resource for WatchedPod {
    const API_VERSION: &'static str = Pod::API_VERSION;
    const GROUP: &'static str = Pod::GROUP;
    const KIND: &'static str = Pod::KIND;
    const VERSION: &'static str = Pod::VERSION;
    const URL_PATH_SEGMENT: &'static str = Pod::URL_PATH_SEGMENT;
    type Scope = NamespaceResourceScope;
}

impl k8s_openapi::Metadata for WatchedPod {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.0.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.0.metadata
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct LeanPod {
    api_version: Option<String>,
    kind: Option<String>,
    #[serde(default)]
    metadata: Option<LeanMeta>,
    #[serde(default)]
    spec: Option<LeanSpec>,
    #[serde(default)]
    status: Option<LeanStatus>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct LeanMeta {
    annotations: Option<BTreeMap<String, String>>,
    creation_timestamp: Option<Time>,
    deletion_grace_period_seconds: Option<i64>,
    deletion_timestamp: Option<Time>,
    finalizers: Option<Vec<String>>,
    generate_name: Option<String>,
    generation: Option<i64>,
    name: Option<String>,
    namespace: Option<String>,
    resource_version: Option<String>,
    self_link: Option<String>,
    uid: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct LeanSpec {
    node_name: Option<String>,
    priority: Option<i32>,
    node_selector: Option<BTreeMap<String, String>>,
    affinity: Option<LeanAffinity>,
    #[serde(default)]
    containers: Option<Vec<LeanContainer>>,
    init_containers: Option<Vec<LeanContainer>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct LeanAffinity {
    node_affinity: Option<NodeAffinity>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct LeanContainer {
    name: String,
    resources: Option<ResourceRequirements>,
    restart_policy: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct LeanStatus {
    phase: Option<String>,
    start_time: Option<Time>,
    nominated_node_name: Option<String>,
}

impl LeanContainer {
    fn into_container(self) -> Container {
        Container {
            name: self.name,
            resources: self.resources,
            restart_policy: self.restart_policy,
            ..Container::default()
        }
    }
}

impl<'de> Deserialize<'de> for WatchedPod {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let lean = LeanPod::deserialize(deserializer)?;
        // As the full Pod's decoding does: a body of another kind is refused, not misread.
        for (field, value, expected) in [
            ("apiVersion", &lean.api_version, Pod::API_VERSION),
            ("kind", &lean.kind, Pod::KIND),
        ] {
            if let Some(value) = value
                && value != expected
            {
                return Err(serde::de::Error::custom(format!(
                    "{field} {value:?}: expected {expected:?}"
                )));
            }
        }
        let metadata = lean
            .metadata
            .map_or_else(ObjectMeta::default, |m| ObjectMeta {
                annotations: m.annotations,
                creation_timestamp: m.creation_timestamp,
                deletion_grace_period_seconds: m.deletion_grace_period_seconds,
                deletion_timestamp: m.deletion_timestamp,
                finalizers: m.finalizers,
                generate_name: m.generate_name,
                generation: m.generation,
                name: m.name,
                namespace: m.namespace,
                resource_version: m.resource_version,
                self_link: m.self_link,
                uid: m.uid,
                ..ObjectMeta::default()
            });
        let spec = lean.spec.map(|s| PodSpec {
            node_name: s.node_name,
            priority: s.priority,
            node_selector: s.node_selector,
            affinity: s.affinity.map(|a| Affinity {
                node_affinity: a.node_affinity,
                ..Affinity::default()
            }),
            containers: s
                .containers
                .unwrap_or_default()
                .into_iter()
                .map(LeanContainer::into_container)
                .collect(),
            init_containers: s.init_containers.map(|init| {
                init.into_iter()
                    .map(LeanContainer::into_container)
                    .collect()
            }),
            ..PodSpec::default()
        });
        let status = lean.status.map(|s| PodStatus {
            phase: s.phase,
            start_time: s.start_time,
            nominated_node_name: s.nominated_node_name,
            ..PodStatus::default()
        });
        Ok(WatchedPod(Pod {
            metadata,
            spec,
            status,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    /// What the watch kept before: a full Pod, trimmed field by field.
    fn trimmed_full(value: &Value) -> Pod {
        let mut pod: Pod = serde_json::from_value(value.clone()).unwrap();
        let metadata = &mut pod.metadata;
        metadata.managed_fields = None;
        metadata.labels = None;
        metadata.owner_references = None;
        let trim = |c: &mut Container| Container {
            name: std::mem::take(&mut c.name),
            resources: c.resources.take(),
            restart_policy: c.restart_policy.take(),
            ..Container::default()
        };
        if let Some(spec) = pod.spec.as_mut() {
            *spec = PodSpec {
                node_name: spec.node_name.take(),
                priority: spec.priority.take(),
                node_selector: spec.node_selector.take(),
                affinity: spec.affinity.take().map(|a| Affinity {
                    node_affinity: a.node_affinity,
                    ..Affinity::default()
                }),
                containers: spec.containers.iter_mut().map(trim).collect(),
                init_containers: spec
                    .init_containers
                    .as_mut()
                    .map(|init| init.iter_mut().map(trim).collect()),
                ..PodSpec::default()
            };
        }
        if let Some(status) = pod.status.as_mut() {
            *status = PodStatus {
                phase: status.phase.take(),
                start_time: status.start_time.take(),
                nominated_node_name: status.nominated_node_name.take(),
                ..PodStatus::default()
            };
        }
        pod
    }

    fn rich_pod() -> Value {
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "trainer-7f9c", "generateName": "trainer-", "namespace": "ml",
                "uid": "0b3c2a1e-7d4f-4a55-9e0b-1c2d3e4f5a6b", "resourceVersion": "4711",
                "generation": 2, "creationTimestamp": "2026-11-23T21:40:00Z",
                "deletionTimestamp": "2026-11-23T22:40:00Z", "deletionGracePeriodSeconds": 30,
                "finalizers": ["example.com/keep"],
                "labels": {"app": "trainer"},
                "annotations": {"gpushare.example.com/v1.gpu-index": "1", "note": "x"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "trainer",
                                     "uid": "u-rs", "controller": true}],
                "managedFields": [{"manager": "kube-controller-manager", "operation": "Update",
                                   "apiVersion": "v1", "time": "2026-11-23T21:40:00Z",
                                   "fieldsType": "FieldsV1",
                                   "fieldsV1": {"f:metadata": {"f:labels": {".": {}, "f:app": {}}}}}]
            },
            "spec": {
                "nodeName": "gpu-node-3",
                "schedulerName": "gpushare-scheduler",
                "priority": 1000,
                "containers": [
                    {"name": "main", "image": "img", "env": [{"name": "A", "value": "1"}],
                     "resources": {"limits": {"example.com/gpu-mem": "4", "cpu": "2"},
                                   "requests": {"cpu": "1500m", "memory": "8Gi"}},
                     "volumeMounts": [{"name": "v", "mountPath": "/data"}]},
                    {"name": "sidecar", "image": "img2"}
                ],
                "initContainers": [{"name": "init", "image": "img", "restartPolicy": "Always",
                                    "resources": {"requests": {"memory": "1Gi"}}}],
                "volumes": [{"name": "v", "emptyDir": {}}],
                "tolerations": [{"key": "k", "operator": "Exists"}],
                "nodeSelector": {"gpushare.example.com/gpu-model.Tesla-T4": "true"},
                "affinity": {
                    "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [
                            {"key": "gpushare.example.com/gpu-mem.16", "operator": "Exists"}]}]}},
                    "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 1, "podAffinityTerm": {"topologyKey": "zone"}}]}
                }
            },
            "status": {
                "phase": "Running", "podIP": "10.0.0.1", "qosClass": "Burstable",
                "nominatedNodeName": "gpu-node-3",
                "startTime": "2026-11-23T21:40:02Z",
                "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [{"name": "main", "ready": true, "restartCount": 0,
                                       "image": "img", "imageID": "", "state": {"running": {}}}]
            }
        })
    }

    #[test]
    fn decodes_exactly_what_the_trimmed_full_pod_kept() {
        let rich = rich_pod();
        let mut bare = json!({"metadata": {"name": "b", "namespace": "d", "uid": "u"}});
        let mut no_status = rich.clone();
        no_status.as_object_mut().unwrap().remove("status");
        let mut nulls = rich.clone();
        nulls["metadata"]["annotations"] = Value::Null;
        nulls["spec"]["initContainers"] = Value::Null;
        nulls["status"]["phase"] = Value::Null;
        let mut unbound = rich.clone();
        unbound["spec"].as_object_mut().unwrap().remove("nodeName");
        bare["spec"] = json!({"containers": [{"name": "c"}]});
        let fixture: Value = serde_json::from_str(include_str!(
            "../../tests/fixtures/filter-request-nodenames.json"
        ))
        .unwrap();
        for value in [
            rich,
            bare,
            no_status,
            nulls,
            unbound,
            fixture["Pod"].clone(),
        ] {
            let lean: WatchedPod = serde_json::from_value(value.clone()).unwrap();
            assert_eq!(lean.0, trimmed_full(&value), "{value}");
            let from_text: WatchedPod = serde_json::from_str(&value.to_string()).unwrap();
            assert_eq!(from_text, lean);
        }
    }

    #[test]
    fn another_kind_is_refused() {
        let mut node = rich_pod();
        node["kind"] = json!("Node");
        let err = serde_json::from_value::<WatchedPod>(node).unwrap_err();
        assert!(err.to_string().contains("expected \"Pod\""), "{err}");
        let mut apps = rich_pod();
        apps["apiVersion"] = json!("apps/v1");
        assert!(serde_json::from_value::<WatchedPod>(apps).is_err());
    }
}
