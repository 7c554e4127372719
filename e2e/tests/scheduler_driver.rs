//! The scheduler driver must treat an extender exactly as kube-scheduler v1.36 does. These tests
//! run it against the in-process API server and a fake extender (axum on 127.0.0.1:0) that
//! records every body it receives and answers as each test needs.
//!
//! Only what the in-process tests of our extender lean on is pinned here: the bytes on the
//! wire (the captured v1.36 bodies), binds overlapping the next cycles, the HTTP timeout. The
//! driver's retry and error paths are not: the real tier runs upstream's kube-scheduler.

// A test that cannot unwrap has failed; the panic message is the report.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use futures::future::BoxFuture;
use gpushare_e2e::apiserver::ApiServer;
use gpushare_e2e::fixtures::{node, pod};
use gpushare_e2e::scheduler::wire::{self, ExtenderArgs};
use gpushare_e2e::scheduler::{ExtenderConfig, SchedulerConfig, SchedulerDriver};
use k8s_openapi::api::core::v1::{Binding, Event, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::{ListParams, PostParams};
use serde_json::{Value, json};

/// How long a test waits for what should come: only a hung test reaches it.
const DEADLINE: Duration = Duration::from_secs(60);

/// Waits until `check` holds, failing the test after [`DEADLINE`].
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let holds = || {
        let check = check();
        async move { check.await.then_some(()) }
    };
    let waited = gpushare_e2e::cluster::wait_for(what, DEADLINE, holds).await;
    waited.unwrap_or_else(|error| panic!("{error}"));
}

// ---- The fake extender ----

#[derive(Clone, Debug)]
struct Received {
    verb: String,
    content_type: Option<String>,
    body: Value,
}

type Reply = (StatusCode, Value);
type Handler = Arc<dyn Fn(String, Value) -> BoxFuture<'static, Reply> + Send + Sync>;

#[derive(Clone)]
struct FakeState {
    received: Arc<Mutex<Vec<Received>>>,
    handler: Handler,
}

struct FakeExtender {
    url_prefix: String,
    received: Arc<Mutex<Vec<Received>>>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeExtender {
    async fn start(handler: Handler) -> anyhow::Result<FakeExtender> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let received = Arc::new(Mutex::new(Vec::new()));
        let state = FakeState {
            received: received.clone(),
            handler,
        };
        let app = Router::new()
            .route("/gpushare-scheduler/{verb}", post(serve))
            .with_state(state);
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(FakeExtender {
            url_prefix: format!("http://{addr}/gpushare-scheduler"),
            received,
            task,
        })
    }

    fn received(&self, verb: &str) -> Vec<Received> {
        self.received
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.verb == verb)
            .cloned()
            .collect()
    }
}

impl Drop for FakeExtender {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(
    State(state): State<FakeState>,
    Path(verb): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, axum::Json<Value>) {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    state.received.lock().unwrap().push(Received {
        verb: verb.clone(),
        content_type: headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
        body: body.clone(),
    });
    let (status, reply) = (state.handler)(verb, body).await;
    (status, axum::Json(reply))
}

/// Names of the nodes a filter/prioritize body offers, whichever form it uses.
fn offered(body: &Value) -> Vec<String> {
    let args = wire::decode_extender_args(body.to_string().as_bytes()).expect("ExtenderArgs");
    match (args.node_names, args.nodes) {
        (Some(names), _) => names,
        (None, Some(list)) => list
            .items
            .into_iter()
            .filter_map(|n| n.metadata.name)
            .collect(),
        (None, None) => Vec::new(),
    }
}

/// A filter answer keeping every offered node, in the form the request used.
fn pass_all(body: &Value) -> Value {
    if body["NodeNames"].is_null() {
        json!({"Nodes": body["Nodes"], "FailedNodes": {}, "Error": ""})
    } else {
        json!({"NodeNames": body["NodeNames"], "FailedNodes": {}, "Error": ""})
    }
}

/// What gpushare's extender does at bind: POST pods/{name}/binding.
async fn bind_via_api(client: &kube::Client, body: &Value) -> Reply {
    let args = match wire::decode_binding_args(body.to_string().as_bytes()) {
        Ok(args) => args,
        Err(e) => return (StatusCode::OK, json!({"Error": e.to_string()})),
    };
    let binding = Binding {
        metadata: ObjectMeta {
            name: Some(args.pod_name.clone()),
            namespace: Some(args.pod_namespace.clone()),
            uid: Some(args.pod_uid.clone()),
            ..ObjectMeta::default()
        },
        target: ObjectReference {
            kind: Some("Node".to_owned()),
            name: Some(args.node.clone()),
            ..ObjectReference::default()
        },
    };
    let api: Api<Pod> = Api::namespaced(client.clone(), &args.pod_namespace);
    match api
        .create_subresource::<_, Value>("binding", &args.pod_name, &PostParams::default(), &binding)
        .await
    {
        Ok(_) => (StatusCode::OK, json!({"Error": ""})),
        Err(e) => (StatusCode::OK, json!({"Error": e.to_string()})),
    }
}

/// An extender that keeps every node, scores nothing, and binds through the API.
fn permissive(client: kube::Client) -> Handler {
    Arc::new(move |verb, body| {
        let client = client.clone();
        Box::pin(async move {
            match verb.as_str() {
                "filter" => (StatusCode::OK, pass_all(&body)),
                "prioritize" => (StatusCode::OK, json!([])),
                "bind" => bind_via_api(&client, &body).await,
                _ => (StatusCode::NOT_FOUND, Value::Null),
            }
        })
    })
}

fn config(extender: ExtenderConfig) -> SchedulerConfig {
    SchedulerConfig {
        extenders: vec![extender],
        backoff_initial: Duration::from_millis(50),
        backoff_max: Duration::from_millis(500),
        seed: Some(1),
        ..SchedulerConfig::default()
    }
}

async fn node_of(client: &kube::Client, name: &str) -> Option<String> {
    let api: Api<Pod> = Api::namespaced(client.clone(), "default");
    api.get(name)
        .await
        .ok()
        .and_then(|p| p.spec)
        .and_then(|s| s.node_name)
}

async fn wait_bound(client: &kube::Client, name: &str) -> String {
    eventually(&format!("pod {name} to be bound"), || async {
        node_of(client, name).await.is_some()
    })
    .await;
    node_of(client, name).await.unwrap_or_default()
}

async fn events_for(client: &kube::Client, pod: &str) -> Vec<Event> {
    let api: Api<Event> = Api::namespaced(client.clone(), "default");
    api.list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some(pod))
        .collect()
}

fn keys(value: &Value) -> BTreeSet<String> {
    value
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

// ---- Wire format, checked against the kube-scheduler v1.36 capture ----

/// `filter-request-nodes.json` from /work/shared/fixtures/kube-scheduler-v1.36, compacted.
const CAPTURED_FILTER_NODES: &str = r#"{"Pod":{"metadata":{"name":"gpu-pod-3","namespace":"default","uid":"647c79bc-629b-49c7-a3dd-034bd088a0ab","resourceVersion":"377","generation":1,"creationTimestamp":"2026-11-22T05:27:01Z","annotations":{"capture":"yes"}},"spec":{"containers":[{"name":"c","image":"registry.invalid/pause:3.10","resources":{"limits":{"example.com/gpu-mem":"4"},"requests":{"example.com/gpu-mem":"4"}},"terminationMessagePath":"/dev/termination-log","terminationMessagePolicy":"File","imagePullPolicy":"IfNotPresent"}],"restartPolicy":"Always","terminationGracePeriodSeconds":30,"dnsPolicy":"ClusterFirst","serviceAccountName":"default","serviceAccount":"default","automountServiceAccountToken":false,"securityContext":{},"schedulerName":"default-scheduler","tolerations":[{"key":"node.kubernetes.io/not-ready","operator":"Exists","effect":"NoExecute","tolerationSeconds":300},{"key":"node.kubernetes.io/unreachable","operator":"Exists","effect":"NoExecute","tolerationSeconds":300}],"priority":0,"enableServiceLinks":true,"preemptionPolicy":"PreemptLowerPriority"},"status":{"phase":"Pending","qosClass":"BestEffort"}},"Nodes":{"metadata":{},"items":[{"metadata":{"name":"node-a","uid":"000618b6-1d91-4f6d-af2c-33924241ad6a","resourceVersion":"245","creationTimestamp":"2026-11-22T05:20:56Z","labels":{"fake":"true","kubernetes.io/hostname":"node-a"},"managedFields":[{"manager":"kubectl-create","operation":"Update","apiVersion":"v1","time":"2026-11-22T05:20:56Z","fieldsType":"FieldsV1","fieldsV1":{"f:metadata":{"f:labels":{".":{},"f:fake":{},"f:kubernetes.io/hostname":{}}}}}]},"spec":{},"status":{"capacity":{"cpu":"8","example.com/gpu-mem":"16","memory":"32Gi","pods":"110"},"allocatable":{"cpu":"8","example.com/gpu-mem":"16","memory":"32Gi","pods":"110"},"conditions":[{"type":"Ready","status":"True","lastHeartbeatTime":"2026-01-01T00:00:00Z","lastTransitionTime":"2026-01-01T00:00:00Z","reason":"Fake","message":"fake node"}],"daemonEndpoints":{"kubeletEndpoint":{"Port":0}},"nodeInfo":{"machineID":"","systemUUID":"","bootID":"","kernelVersion":"","osImage":"","containerRuntimeVersion":"","kubeletVersion":"","kubeProxyVersion":"","operatingSystem":"","architecture":""}}},{"metadata":{"name":"node-b","uid":"30c1810b-859f-4dda-a9e6-1a99e626ce5d","resourceVersion":"246","creationTimestamp":"2026-11-22T05:20:56Z","labels":{"fake":"true","kubernetes.io/hostname":"node-b"},"managedFields":[{"manager":"kubectl-create","operation":"Update","apiVersion":"v1","time":"2026-11-22T05:20:56Z","fieldsType":"FieldsV1","fieldsV1":{"f:metadata":{"f:labels":{".":{},"f:fake":{},"f:kubernetes.io/hostname":{}}}}}]},"spec":{},"status":{"capacity":{"cpu":"8","example.com/gpu-mem":"8","memory":"32Gi","pods":"110"},"allocatable":{"cpu":"8","example.com/gpu-mem":"8","memory":"32Gi","pods":"110"},"conditions":[{"type":"Ready","status":"True","lastHeartbeatTime":"2026-01-01T00:00:00Z","lastTransitionTime":"2026-01-01T00:00:00Z","reason":"Fake","message":"fake node"}],"daemonEndpoints":{"kubeletEndpoint":{"Port":0}},"nodeInfo":{"machineID":"","systemUUID":"","bootID":"","kernelVersion":"","osImage":"","containerRuntimeVersion":"","kubeletVersion":"","kubeProxyVersion":"","operatingSystem":"","architecture":""}}}]},"NodeNames":null}"#;

#[test]
fn wire_encoding_reproduces_the_captured_bodies() {
    let captured: Value = serde_json::from_str(CAPTURED_FILTER_NODES).unwrap();
    let args = wire::decode_extender_args(CAPTURED_FILTER_NODES.as_bytes()).unwrap();
    // Nodes form (nodeCacheCapable: false): identical JSON, including no kind/apiVersion.
    assert_eq!(serde_json::to_value(&args).unwrap(), captured);

    // NodeNames form (nodeCacheCapable: true), as in filter-request-nodenames.json.
    let names = ExtenderArgs {
        pod: args.pod.clone(),
        nodes: None,
        node_names: Some(vec!["node-a".into(), "node-b".into()]),
    };
    let encoded = serde_json::to_value(&names).unwrap();
    assert_eq!(encoded["Pod"], captured["Pod"]);
    assert_eq!(encoded["Nodes"], Value::Null);
    assert_eq!(encoded["NodeNames"], json!(["node-a", "node-b"]));
    assert_eq!(
        serde_json::to_string(&names).unwrap().find("\"Pod\""),
        Some(1)
    );

    let bind = wire::ExtenderBindingArgs {
        pod_name: "gpu-pod-3".into(),
        pod_namespace: "default".into(),
        pod_uid: "647c79bc-629b-49c7-a3dd-034bd088a0ab".into(),
        node: "node-a".into(),
    };
    assert_eq!(
        serde_json::to_value(&bind).unwrap(),
        json!({"PodName":"gpu-pod-3","PodNamespace":"default","PodUID":"647c79bc-629b-49c7-a3dd-034bd088a0ab","Node":"node-a"})
    );
    assert_eq!(
        serde_json::to_value(wire::HostPriority {
            host: "node-a".into(),
            score: 10
        })
        .unwrap(),
        json!({"Host":"node-a","Score":10})
    );
}

#[test]
fn answers_decode_case_insensitively_like_go() {
    let result = wire::decode_filter_result(
        br#"{"failednodes":{"node-b":"reason"},"nodeNAMES":["node-a"],"error":"","Unknown":1}"#,
    )
    .unwrap();
    assert_eq!(result.node_names, Some(vec!["node-a".to_owned()]));
    assert_eq!(
        result.failed_nodes.get("node-b").map(String::as_str),
        Some("reason")
    );

    let with_nodes = wire::decode_filter_result(
        br#"{"FailedNodes":{},"Nodes":{"metadata":{},"items":[{"metadata":{"name":"node-a"}}]}}"#,
    )
    .unwrap();
    let names: Vec<_> = with_nodes
        .nodes
        .unwrap()
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect();
    assert_eq!(names, ["node-a"]);

    let priorities =
        wire::decode_host_priorities(br#"[{"host":"a","score":3},{"HOST":"b","Score":10}]"#)
            .unwrap();
    assert_eq!(
        priorities[1],
        wire::HostPriority {
            host: "b".into(),
            score: 10
        }
    );
    assert!(wire::decode_host_priorities(b"null").unwrap().is_empty());
    assert!(wire::decode_host_priorities(br#"[{"Host":"a","Score":"high"}]"#).is_err());

    assert_eq!(wire::decode_binding_result(b"{}").unwrap().error, "");
    assert_eq!(
        wire::decode_binding_result(br#"{"error":"no"}"#)
            .unwrap()
            .error,
        "no"
    );
    assert!(wire::decode_binding_result(b"not json").is_err());
}

// ---- The driver against the in-process cluster ----

#[tokio::test]
async fn filter_prioritize_and_bind_bodies_have_the_captured_shape() -> anyhow::Result<()> {
    let server = ApiServer::start().await?;
    let client = server.client();
    node("n1")
        .gpushare()
        .gpus(&[16, 16])
        .create(&client)
        .await?;
    node("n2").gpushare().gpus(&[8]).create(&client).await?;
    let fake = FakeExtender::start(permissive(client.clone())).await?;
    let driver = SchedulerDriver::start(
        client.clone(),
        config(ExtenderConfig::gpushare(&fake.url_prefix)),
    )
    .await?;

    pod("a").gpu_mem(4).create(&client).await?;
    let chosen = wait_bound(&client, "a").await;

    let filter = fake.received("filter");
    assert_eq!(filter.len(), 1);
    let body = &filter[0].body;
    assert_eq!(filter[0].content_type.as_deref(), Some("application/json"));
    assert_eq!(
        keys(body),
        BTreeSet::from(["Pod".into(), "Nodes".into(), "NodeNames".into()])
    );
    assert_eq!(
        body["Nodes"],
        Value::Null,
        "nodeCacheCapable sends names only"
    );
    let mut names = offered(body);
    names.sort();
    assert_eq!(names, ["n1", "n2"]);
    assert_eq!(body["Pod"]["metadata"]["name"], "a");
    assert!(body["Pod"].get("kind").is_none() && body["Pod"].get("apiVersion").is_none());

    let prioritize = fake.received("prioritize");
    assert_eq!(
        prioritize.len(),
        1,
        "two feasible nodes: prioritize is called"
    );
    assert_eq!(keys(&prioritize[0].body), keys(body));

    let bind = fake.received("bind");
    assert_eq!(bind.len(), 1);
    assert_eq!(
        keys(&bind[0].body),
        BTreeSet::from([
            "PodName".into(),
            "PodNamespace".into(),
            "PodUID".into(),
            "Node".into()
        ])
    );
    assert_eq!(bind[0].body["Node"], chosen.as_str());
    assert_eq!(bind[0].body["PodNamespace"], "default");

    eventually("the Scheduled event", || async {
        events_for(&client, "a").await.iter().any(|e| {
            e.reason.as_deref() == Some("Scheduled")
                && e.message.as_deref()
                    == Some(&format!("Successfully assigned default/a to {chosen}"))
        })
    })
    .await;
    let stats = driver.stats();
    assert_eq!(
        (stats.filter_calls, stats.prioritize_calls, stats.bind_calls),
        (1, 1, 1)
    );
    assert_eq!(stats.binds_ok, 1);
    driver.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn binds_run_concurrently_with_the_next_cycles() -> anyhow::Result<()> {
    const N: usize = 4;
    let server = ApiServer::start().await?;
    let client = server.client();
    node("n1")
        .gpushare()
        .gpus(&[16, 16])
        .create(&client)
        .await?;
    let barrier = Arc::new(tokio::sync::Barrier::new(N));
    let handler: Handler = {
        let client = client.clone();
        Arc::new(move |verb, body| {
            let client = client.clone();
            let barrier = barrier.clone();
            Box::pin(async move {
                match verb.as_str() {
                    "filter" => (StatusCode::OK, pass_all(&body)),
                    "bind" => {
                        // Answers only once N binds are in flight together.
                        if tokio::time::timeout(DEADLINE, barrier.wait())
                            .await
                            .is_err()
                        {
                            return (
                                StatusCode::OK,
                                json!({"Error": "binds were not concurrent"}),
                            );
                        }
                        bind_via_api(&client, &body).await
                    }
                    _ => (StatusCode::OK, json!([])),
                }
            })
        })
    };
    let fake = FakeExtender::start(handler).await?;
    let driver = SchedulerDriver::start(
        client.clone(),
        config(ExtenderConfig::gpushare(&fake.url_prefix)),
    )
    .await?;

    for i in 0..N {
        pod(&format!("p{i}")).gpu_mem(4).create(&client).await?;
    }
    for i in 0..N {
        wait_bound(&client, &format!("p{i}")).await;
    }
    let stats = driver.stats();
    assert_eq!(stats.bind_errors, 0);
    assert!(
        stats.peak_binds_in_flight >= N,
        "peak {}",
        stats.peak_binds_in_flight
    );
    driver.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn http_timeout_bounds_each_call() -> anyhow::Result<()> {
    let server = ApiServer::start().await?;
    let client = server.client();
    node("n1").gpushare().gpus(&[16]).create(&client).await?;
    let handler: Handler = Arc::new(|_, _| Box::pin(futures::future::pending()));
    let fake = FakeExtender::start(handler).await?;
    let extender = ExtenderConfig {
        http_timeout: Duration::from_millis(100),
        ..ExtenderConfig::gpushare(&fake.url_prefix)
    };
    let driver = SchedulerDriver::start(client.clone(), config(extender)).await?;
    pod("a").gpu_mem(4).create(&client).await?;
    let expected = format!(
        "Post \"{}/filter\": context deadline exceeded (Client.Timeout exceeded while awaiting headers)",
        fake.url_prefix
    );
    eventually("the timeout to fail the cycle", || async {
        driver.pending_reason("default", "a").as_deref() == Some(expected.as_str())
    })
    .await;
    assert_eq!(node_of(&client, "a").await, None);
    driver.shutdown().await;
    Ok(())
}
