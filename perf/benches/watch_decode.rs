//! What one pod watch event costs the extender to decode: a full `k8s_openapi` Pod (what the
//! watch decoded until it read pods lean) against [`WatchedPod`], which keeps only what the
//! view reads and skips the rest unparsed.
//!
//! ```sh
//! cargo bench -p gpushare-perf --bench watch_decode
//! ```
//!
//! The pod is a running GPU pod as a real API server sends it in a watch event: created by a
//! ReplicaSet, bound, its allocation annotations patched by the device plugin, its status
//! written by kubelet, with the `managedFields` entry each of those writers leaves.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use gpushare_extender::kube_io::watched_pod::WatchedPod;
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

fn running_gpu_pod() -> String {
    let fields = |spec: serde_json::Value| {
        json!({"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1",
               "time": "2026-11-23T21:40:00Z", "fieldsType": "FieldsV1", "fieldsV1": spec})
    };
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": "trainer-5d8f7c9b6-x2x7q", "generateName": "trainer-5d8f7c9b6-",
            "namespace": "ml", "uid": "0b3c2a1e-7d4f-4a55-9e0b-1c2d3e4f5a6b",
            "resourceVersion": "1234567", "creationTimestamp": "2026-11-23T21:40:00Z",
            "labels": {"app": "trainer", "pod-template-hash": "5d8f7c9b6"},
            "annotations": {"gpushare.example.com/v1.gpu-index": "1",
                            "gpushare.example.com/v1.gpu-uuid": "GPU-8a6c1f2e-3b4d-4e5f-9a0b-1c2d3e4f5a6b",
                            "gpushare.example.com/v1.assigned": "true",
                            "gpushare.example.com/v1.pod-gib": "4"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                 "name": "trainer-5d8f7c9b6", "uid": "9f8e7d6c-5b4a-4392-8170-6f5e4d3c2b1a",
                                 "controller": true, "blockOwnerDeletion": true}],
            "managedFields": [
                fields(json!({"f:metadata": {"f:generateName": {}, "f:labels": {".": {}, "f:app": {}, "f:pod-template-hash": {}},
                    "f:ownerReferences": {".": {}, "k:{\"uid\":\"9f8e7d6c-5b4a-4392-8170-6f5e4d3c2b1a\"}": {}}},
                    "f:spec": {"f:containers": {"k:{\"name\":\"main\"}": {".": {}, "f:args": {}, "f:command": {},
                        "f:env": {".": {}, "k:{\"name\":\"NCCL_DEBUG\"}": {".": {}, "f:name": {}, "f:value": {}},
                                  "k:{\"name\":\"POD_NAME\"}": {".": {}, "f:name": {}, "f:valueFrom": {".": {}, "f:fieldRef": {}}}},
                        "f:image": {}, "f:imagePullPolicy": {}, "f:name": {},
                        "f:resources": {".": {}, "f:limits": {".": {}, "f:cpu": {}, "f:example.com/gpu-mem": {}, "f:memory": {}},
                                        "f:requests": {".": {}, "f:cpu": {}, "f:example.com/gpu-mem": {}, "f:memory": {}}},
                        "f:terminationMessagePath": {}, "f:terminationMessagePolicy": {},
                        "f:volumeMounts": {".": {}, "k:{\"mountPath\":\"/data\"}": {".": {}, "f:mountPath": {}, "f:name": {}}}}},
                        "f:dnsPolicy": {}, "f:enableServiceLinks": {}, "f:restartPolicy": {}, "f:schedulerName": {},
                        "f:securityContext": {}, "f:terminationGracePeriodSeconds": {},
                        "f:volumes": {".": {}, "k:{\"name\":\"data\"}": {".": {}, "f:emptyDir": {}, "f:name": {}}}}})),
                fields(json!({"f:metadata": {"f:annotations": {".": {}, "f:gpushare.example.com/v1.assigned": {},
                    "f:gpushare.example.com/v1.gpu-uuid": {}}}})),
                fields(json!({"f:status": {"f:conditions": {"k:{\"type\":\"ContainersReady\"}": {".": {}, "f:lastProbeTime": {}, "f:lastTransitionTime": {}, "f:status": {}, "f:type": {}},
                    "k:{\"type\":\"Initialized\"}": {".": {}, "f:lastProbeTime": {}, "f:lastTransitionTime": {}, "f:status": {}, "f:type": {}},
                    "k:{\"type\":\"Ready\"}": {".": {}, "f:lastProbeTime": {}, "f:lastTransitionTime": {}, "f:status": {}, "f:type": {}}},
                    "f:containerStatuses": {}, "f:hostIP": {}, "f:hostIPs": {}, "f:phase": {}, "f:podIP": {}, "f:podIPs": {".": {}, "k:{\"ip\":\"10.244.3.17\"}": {".": {}, "f:ip": {}}}, "f:startTime": {}}}))
            ]
        },
        "spec": {
            "volumes": [{"name": "data", "emptyDir": {}},
                        {"name": "kube-api-access-x7k2p", "projected": {"sources": [
                            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                            {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}],
                            "defaultMode": 420}}],
            "containers": [{
                "name": "main", "image": "nvcr.io/nvidia/pytorch:24.08-py3",
                "command": ["python", "train.py"], "args": ["--epochs", "10"],
                "env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "POD_NAME",
                         "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}}],
                "resources": {"limits": {"example.com/gpu-mem": "4", "cpu": "2", "memory": "8Gi"},
                              "requests": {"example.com/gpu-mem": "4", "cpu": "2", "memory": "8Gi"}},
                "volumeMounts": [{"name": "data", "mountPath": "/data"},
                                 {"name": "kube-api-access-x7k2p", "readOnly": true,
                                  "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}],
                "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
                "imagePullPolicy": "IfNotPresent"
            }],
            "restartPolicy": "Always", "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst",
            "serviceAccountName": "default", "serviceAccount": "default", "nodeName": "gpu-node-17",
            "securityContext": {}, "schedulerName": "gpushare-scheduler",
            "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
                            {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}],
            "priority": 0, "enableServiceLinks": true, "preemptionPolicy": "PreemptLowerPriority"
        },
        "status": {
            "phase": "Running",
            "conditions": [
                {"type": "Initialized", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2026-11-23T21:40:02Z"},
                {"type": "Ready", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2026-11-23T21:40:09Z"},
                {"type": "ContainersReady", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2026-11-23T21:40:09Z"},
                {"type": "PodScheduled", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2026-11-23T21:40:01Z"}],
            "hostIP": "10.0.3.17", "hostIPs": [{"ip": "10.0.3.17"}], "podIP": "10.244.3.17", "podIPs": [{"ip": "10.244.3.17"}],
            "startTime": "2026-11-23T21:40:02Z",
            "containerStatuses": [{"name": "main", "state": {"running": {"startedAt": "2026-11-23T21:40:08Z"}},
                "lastState": {}, "ready": true, "restartCount": 0, "image": "nvcr.io/nvidia/pytorch:24.08-py3",
                "imageID": "nvcr.io/nvidia/pytorch@sha256:4b2f8e1c9d0a7b6c5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d",
                "containerID": "containerd://6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a1b0c9d8e7f6a5b", "started": true}],
            "qosClass": "Guaranteed"
        }
    })
    .to_string()
}

fn decode(c: &mut Criterion) {
    let event = running_gpu_pod();
    let mut group = c.benchmark_group(format!("watch_decode/running_gpu_pod_{}B", event.len()));
    group.bench_function("full_pod", |b| {
        b.iter(|| serde_json::from_str::<Pod>(black_box(&event)).map(|p| p.metadata.uid))
    });
    group.bench_function("watched_pod", |b| {
        b.iter(|| serde_json::from_str::<WatchedPod>(black_box(&event)).map(|p| p.0.metadata.uid))
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(50);
    targets = decode
}
criterion_main!(benches);
