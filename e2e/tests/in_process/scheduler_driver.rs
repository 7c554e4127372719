//! The scheduler driver must treat an extender exactly as kube-scheduler v1.36 does. These tests
//! run it against the in-process API server and a fake extender (axum on 127.0.0.1:0) that
//! records every body it receives and answers as each test needs.
//!
//! Only what the in-process tests of our extender lean on is pinned here: the bytes on the
//! wire (the captured v1.36 bodies), binds overlapping the next cycles, the HTTP timeout. The
//! driver's retry and error paths are not: the real tier runs upstream's kube-scheduler.

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
use gpushare_e2e::cluster::wait_for;
use gpushare_e2e::fixtures::{node, pod};
use gpushare_e2e::scenarios::wait_bound;
use gpushare_e2e::scheduler::wire::{self, ExtenderArgs};
use gpushare_e2e::scheduler::{ExtenderConfig, SchedulerConfig, SchedulerDriver};
use k8s_openapi::api::core::v1::{Binding, Event, Pod};
use kube::Api;
use kube::api::{ListParams, PostParams};
use serde_json::{Value, json};

/// How long a test waits for what should come: only a hung test reaches it.
const DEADLINE: Duration = Duration::from_secs(60);

// ---- The fake extender ----

type Reply = (StatusCode, Value);
/// How the fake extender answers a call: (verb, body) to the reply.
type Handler = Arc<dyn Fn(String, Value) -> BoxFuture<'static, Reply> + Send + Sync>;
/// Each call received: verb, content type, body.
type Log = Arc<Mutex<Vec<(String, Option<String>, Value)>>>;

/// Aborted on drop.
struct FakeExtender {
    url_prefix: String,
    received: Log,
    task: tokio::task::JoinHandle<()>,
}

impl FakeExtender {
    async fn start(handler: Handler) -> anyhow::Result<FakeExtender> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url_prefix = format!("http://{}/gpushare-scheduler", listener.local_addr()?);
        let received = Log::default();
        let app = Router::new()
            .route("/gpushare-scheduler/{verb}", post(serve))
            .with_state((received.clone(), handler));
        let task = tokio::spawn(async move { drop(axum::serve(listener, app).await) });
        Ok(FakeExtender {
            url_prefix,
            received,
            task,
        })
    }

    /// The one call of `verb` received: its content type and body.
    #[track_caller]
    fn only(&self, verb: &str) -> (Option<String>, Value) {
        let log = self.received.lock().unwrap();
        let calls: Vec<_> = log.iter().filter(|(v, ..)| v == verb).collect();
        assert_eq!(calls.len(), 1, "{verb} calls: {calls:?}");
        (calls[0].1.clone(), calls[0].2.clone())
    }
}

impl Drop for FakeExtender {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(
    State((received, handler)): State<(Log, Handler)>,
    Path(verb): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, axum::Json<Value>) {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let content_type = headers.get("content-type").and_then(|v| v.to_str().ok());
    let call = (verb.clone(), content_type.map(str::to_owned), body.clone());
    received.lock().unwrap().push(call);
    let (status, reply) = handler(verb, body).await;
    (status, axum::Json(reply))
}

/// A filter answer keeping every offered node, in the form the request used.
fn pass_all(body: &Value) -> Reply {
    let nodes = (&body["Nodes"], &body["NodeNames"]);
    let answer = json!({"Nodes": nodes.0, "NodeNames": nodes.1, "FailedNodes": {}, "Error": ""});
    (StatusCode::OK, answer)
}

/// What gpushare's extender does at bind: POST pods/{name}/binding.
async fn bind_via_api(client: &kube::Client, body: &Value) -> Reply {
    let answer = async {
        let args = wire::decode_binding_args(body.to_string().as_bytes())?;
        let binding: Binding = serde_json::from_value(json!({
            "metadata": {"name": args.pod_name, "namespace": args.pod_namespace, "uid": args.pod_uid},
            "target": {"kind": "Node", "name": args.node},
        }))?;
        let api: Api<Pod> = Api::namespaced(client.clone(), &args.pod_namespace);
        let pp = PostParams::default();
        api.create_subresource::<_, Value>("binding", &args.pod_name, &pp, &binding)
            .await?;
        anyhow::Ok(())
    };
    let error = answer.await.err().map_or(String::new(), |e| e.to_string());
    (StatusCode::OK, json!({ "Error": error }))
}

/// An extender that keeps every node, scores nothing, and binds through the API.
fn permissive(client: kube::Client) -> Handler {
    Arc::new(move |verb, body| {
        let client = client.clone();
        Box::pin(async move {
            match verb.as_str() {
                "filter" => pass_all(&body),
                "prioritize" => (StatusCode::OK, json!([])),
                "bind" => bind_via_api(&client, &body).await,
                _ => (StatusCode::NOT_FOUND, Value::Null),
            }
        })
    })
}

/// An API server with gpushare `nodes`, a fake extender answering with what `handler` makes
/// of a client, and the driver calling it as `extender` configures it.
async fn start(
    nodes: &[(&str, &[u64])],
    handler: impl FnOnce(kube::Client) -> Handler,
    extender: impl FnOnce(&str) -> ExtenderConfig,
) -> anyhow::Result<(ApiServer, kube::Client, FakeExtender, SchedulerDriver)> {
    let server = ApiServer::start().await?;
    let client = server.client();
    for (name, gpus) in nodes {
        node(name).gpushare().gpus(gpus).create(&client).await?;
    }
    let fake = FakeExtender::start(handler(client.clone())).await?;
    let config = SchedulerConfig {
        extenders: vec![extender(&fake.url_prefix)],
        backoff_initial: Duration::from_millis(50),
        backoff_max: Duration::from_millis(500),
        seed: Some(1),
        ..SchedulerConfig::default()
    };
    let driver = SchedulerDriver::start(client.clone(), config).await?;
    Ok((server, client, fake, driver))
}

fn keys(value: &Value) -> BTreeSet<&str> {
    value
        .as_object()
        .into_iter()
        .flat_map(|m| m.keys().map(String::as_str))
        .collect()
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
    let node_names = Some(vec!["node-a".into(), "node-b".into()]);
    let names = ExtenderArgs {
        pod: args.pod.clone(),
        nodes: None,
        node_names,
    };
    let encoded = serde_json::to_value(&names).unwrap();
    let fields = ["Pod", "Nodes", "NodeNames"].map(|field| &encoded[field]);
    assert_eq!(
        fields,
        [&captured["Pod"], &Value::Null, &json!(["node-a", "node-b"])]
    );
    let text = serde_json::to_string(&names).unwrap();
    assert_eq!(text.find("\"Pod\""), Some(1));

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
    let (host, score) = ("node-a".into(), 10);
    let priority = serde_json::to_value(wire::HostPriority { host, score }).unwrap();
    assert_eq!(priority, json!({"Host":"node-a","Score":10}));
}

#[test]
fn answers_decode_case_insensitively_like_go() {
    let names =
        br#"{"failednodes":{"node-b":"reason"},"nodeNAMES":["node-a"],"error":"","Unknown":1}"#;
    let result = wire::decode_filter_result(names).unwrap();
    assert_eq!(result.node_names, Some(vec!["node-a".to_owned()]));
    assert_eq!(result.failed_nodes["node-b"], "reason");

    let nodes =
        br#"{"FailedNodes":{},"Nodes":{"metadata":{},"items":[{"metadata":{"name":"node-a"}}]}}"#;
    let nodes = wire::decode_filter_result(nodes)
        .unwrap()
        .nodes
        .unwrap()
        .items;
    let names: Vec<_> = nodes.into_iter().filter_map(|n| n.metadata.name).collect();
    assert_eq!(names, ["node-a"]);

    let priorities = br#"[{"host":"a","score":3},{"HOST":"b","Score":10}]"#;
    let priorities = wire::decode_host_priorities(priorities).unwrap();
    let (host, score) = ("b".into(), 10);
    assert_eq!(priorities[1], wire::HostPriority { host, score });
    assert!(wire::decode_host_priorities(b"null").unwrap().is_empty());
    assert!(wire::decode_host_priorities(br#"[{"Host":"a","Score":"high"}]"#).is_err());

    let bound = |body: &[u8]| wire::decode_binding_result(body).map(|r| r.error);
    assert_eq!(bound(b"{}").unwrap(), "");
    assert_eq!(bound(br#"{"error":"no"}"#).unwrap(), "no");
    assert!(bound(b"not json").is_err());
}

// ---- The driver against the in-process cluster ----

#[tokio::test]
async fn filter_prioritize_and_bind_bodies_have_the_captured_shape() -> anyhow::Result<()> {
    let nodes: [(&str, &[u64]); 2] = [("n1", &[16, 16]), ("n2", &[8])];
    let (_server, client, fake, driver) =
        start(&nodes, permissive, ExtenderConfig::gpushare).await?;
    pod("a").gpu_mem(4).create(&client).await?;
    let chosen = wait_bound(&Api::default_namespaced(client.clone()), "a").await?;

    let (content_type, body) = fake.only("filter");
    assert_eq!(content_type.as_deref(), Some("application/json"));
    assert_eq!(keys(&body), BTreeSet::from(["Pod", "Nodes", "NodeNames"]));
    assert_eq!(
        body["Nodes"],
        Value::Null,
        "nodeCacheCapable sends names only"
    );
    let args = wire::decode_extender_args(body.to_string().as_bytes())?;
    let names: BTreeSet<String> = args.node_names.into_iter().flatten().collect();
    assert_eq!(names, BTreeSet::from(["n1".into(), "n2".into()]));
    assert_eq!(body["Pod"]["metadata"]["name"], "a");
    assert!(body["Pod"].get("kind").is_none() && body["Pod"].get("apiVersion").is_none());
    // Two feasible nodes: prioritize is called.
    assert_eq!(keys(&fake.only("prioritize").1), keys(&body));
    let (_, bind) = fake.only("bind");
    let bind_keys = BTreeSet::from(["PodName", "PodNamespace", "PodUID", "Node"]);
    assert_eq!(keys(&bind), bind_keys);
    assert_eq!(
        [&bind["Node"], &bind["PodNamespace"]],
        [chosen.as_str(), "default"]
    );

    let events: Api<Event> = Api::default_namespaced(client.clone());
    let scheduled = format!("Successfully assigned default/a to {chosen}");
    fn fields(e: &Event) -> [Option<&str>; 3] {
        [&e.involved_object.name, &e.reason, &e.message].map(Option::as_deref)
    }
    let want = [Some("a"), Some("Scheduled"), Some(scheduled.as_str())];
    wait_for("the Scheduled event", DEADLINE, || async {
        let events = events.list(&ListParams::default()).await.ok()?;
        events.iter().any(|e| fields(e) == want).then_some(())
    })
    .await?;
    let stats = driver.stats();
    let calls = (stats.filter_calls, stats.prioritize_calls, stats.bind_calls);
    assert_eq!(calls, (1, 1, 1));
    assert_eq!(stats.binds_ok, 1);
    driver.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn binds_run_concurrently_with_the_next_cycles() -> anyhow::Result<()> {
    const N: usize = 4;
    // Answers a bind only once N binds are in flight together.
    let handler = |client: kube::Client| -> Handler {
        let barrier = Arc::new(tokio::sync::Barrier::new(N));
        Arc::new(move |verb, body| {
            let (client, barrier) = (client.clone(), barrier.clone());
            Box::pin(async move {
                match verb.as_str() {
                    "filter" => pass_all(&body),
                    "bind" => match tokio::time::timeout(DEADLINE, barrier.wait()).await {
                        Ok(_) => bind_via_api(&client, &body).await,
                        Err(_) => (
                            StatusCode::OK,
                            json!({"Error": "binds were not concurrent"}),
                        ),
                    },
                    _ => (StatusCode::OK, json!([])),
                }
            })
        })
    };
    let nodes: [(&str, &[u64]); 1] = [("n1", &[16, 16])];
    let (_server, client, _fake, driver) = start(&nodes, handler, ExtenderConfig::gpushare).await?;
    for i in 0..N {
        pod(&format!("p{i}")).gpu_mem(4).create(&client).await?;
    }
    let pods = Api::default_namespaced(client.clone());
    for i in 0..N {
        wait_bound(&pods, &format!("p{i}")).await?;
    }
    let stats = driver.stats();
    assert_eq!(stats.bind_errors, 0);
    let peak = stats.peak_binds_in_flight;
    assert!(peak >= N, "peak {peak}");
    driver.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn http_timeout_bounds_each_call() -> anyhow::Result<()> {
    let hangs = |_| -> Handler { Arc::new(|_, _| Box::pin(futures::future::pending())) };
    let extender = |url_prefix: &str| ExtenderConfig {
        http_timeout: Duration::from_millis(100),
        ..ExtenderConfig::gpushare(url_prefix)
    };
    let nodes: [(&str, &[u64]); 1] = [("n1", &[16])];
    let (_server, client, fake, driver) = start(&nodes, hangs, extender).await?;
    pod("a").gpu_mem(4).create(&client).await?;
    let url = &fake.url_prefix;
    let expected = format!(
        "Post \"{url}/filter\": context deadline exceeded (Client.Timeout exceeded while awaiting headers)"
    );
    wait_for("the timeout to fail the cycle", DEADLINE, || async {
        let reason = driver.pending_reason("default", "a");
        (reason.as_deref() == Some(expected.as_str())).then_some(())
    })
    .await?;
    let a = Api::<Pod>::default_namespaced(client.clone())
        .get("a")
        .await?;
    assert_eq!(a.spec.and_then(|s| s.node_name), None);
    driver.shutdown().await;
    Ok(())
}
