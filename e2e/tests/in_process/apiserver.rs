//! The in-process API server is strict where the real one is: these tests pin that down with
//! an ordinary kube client, so every other test built on it can be trusted.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use gpushare_e2e::apiserver::{ApiServer, Verb};
use gpushare_e2e::fixtures::{node, pod};
use gpushare_e2e::scenarios::phase;
use k8s_openapi::api::core::v1::{Binding, Event, Node, Pod};
use kube::ResourceExt;
use kube::api::{
    Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

/// How long a test waits for what should come: only a hung test reaches it.
const DEADLINE: Duration = Duration::from_secs(60);

/// A write stall that outlasts any test: the test ends it, or the server's shutdown does.
const FOREVER: Duration = Duration::from_secs(3600);

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

/// Asserts that `result` is the API error `expected` ("CODE Reason").
#[track_caller]
fn refused<T: Debug>(result: kube::Result<T>, expected: &str) {
    match result {
        Err(kube::Error::Api(s)) => assert_eq!(format!("{} {}", s.code, s.reason), expected),
        other => panic!("expected the API error {expected}, got {other:?}"),
    }
}

/// A fresh server, a client of it, and its pods in `default`.
async fn start() -> (ApiServer, kube::Client, Api<Pod>) {
    let server = ApiServer::start().await.unwrap();
    let client = server.client();
    let pods = Api::default_namespaced(client.clone());
    (server, client, pods)
}

/// POSTs a Binding of `pod` to `node`, with the `uid` precondition and `annotations`.
async fn bind(
    pods: &Api<Pod>,
    pod: &str,
    node: &str,
    uid: Option<&str>,
    annotations: &[(&str, &str)],
) -> kube::Result<Value> {
    let annotations = BTreeMap::from_iter(annotations.iter().copied());
    let binding = json!({
        "metadata": {"name": pod, "uid": uid, "annotations": annotations},
        "target": {"kind": "Node", "name": node},
    });
    let binding: Binding = serde_json::from_value(binding).unwrap();
    let pp = PostParams::default();
    pods.create_subresource("binding", pod, &pp, &binding).await
}

async fn merge(pods: &Api<Pod>, name: &str, patch: Value) -> kube::Result<Pod> {
    let pp = PatchParams::default();
    pods.patch(name, &pp, &Patch::Merge(patch)).await
}

async fn patch_status(pods: &Api<Pod>, name: &str, patch: Patch<Value>) -> kube::Result<Pod> {
    pods.patch_status(name, &PatchParams::default(), &patch)
        .await
}

fn node_name(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref()?.node_name.as_deref()
}

fn has_condition(pod: &Pod, type_: &str, status: &str) -> bool {
    let conditions = pod.status.as_ref().and_then(|s| s.conditions.as_ref());
    conditions.is_some_and(|c| c.iter().any(|c| c.type_ == type_ && c.status == status))
}

/// A watch event in short: "ADDED b", "MODIFIED b (deleting)", "ERROR 410 Expired".
fn seen(event: Option<WatchEvent<Pod>>) -> String {
    let name = |p: &Pod| p.metadata.name.clone().unwrap_or_default();
    match event {
        Some(WatchEvent::Added(p)) => format!("ADDED {}", name(&p)),
        Some(WatchEvent::Modified(p)) if p.metadata.deletion_timestamp.is_some() => {
            format!("MODIFIED {} (deleting)", name(&p))
        }
        Some(WatchEvent::Deleted(p)) => format!("DELETED {}", name(&p)),
        Some(WatchEvent::Error(status)) => format!("ERROR {} {}", status.code, status.reason),
        other => format!("{other:?}"),
    }
}

#[tokio::test]
async fn crud_is_strict_about_versions_names_and_existence() {
    let (server, client, pods) = start().await;
    let pp = PostParams::default();

    let created = pod("a").gpu_mem(4).create(&client).await.unwrap();
    assert!(created.metadata.uid.is_some() && created.metadata.creation_timestamp.is_some());
    assert_eq!(phase(&created), "Pending");
    let again = pods.create(&pp, &pod("a").build()).await;
    refused(again, "409 AlreadyExists");
    refused(pods.get("nope").await, "404 NotFound");

    // Update with the current version works and bumps it; the old version is then stale.
    let mut first = pods.get("a").await.unwrap();
    let mut second = first.clone();
    first.metadata.labels = Some(BTreeMap::from([("x".to_owned(), "1".to_owned())]));
    let updated = pods.replace("a", &pp, &first).await.unwrap();
    let (old, new) = (&second.metadata, &updated.metadata);
    assert_ne!(new.resource_version, old.resource_version);
    assert_eq!(new.uid, old.uid);
    second.metadata.labels = Some(BTreeMap::from([("x".to_owned(), "2".to_owned())]));
    refused(pods.replace("a", &pp, &second).await, "409 Conflict");

    // The main resource ignores status; /status changes only status.
    let mut running = pods.get("a").await.unwrap();
    running.status.as_mut().unwrap().phase = Some("Running".to_owned());
    let ignored = pods.replace("a", &pp, &running).await.unwrap();
    assert_eq!(phase(&ignored), "Pending");
    let status_patch = json!({"status": {"phase": "Running"}, "metadata": {"labels": {"y": "1"}}});
    let via_status = patch_status(&pods, "a", Patch::Merge(status_patch)).await;
    let via_status = via_status.unwrap();
    assert_eq!(phase(&via_status), "Running");
    assert!(!via_status.metadata.labels.unwrap().contains_key("y"));

    // Pod spec is immutable apart from a few fields: binding by patching nodeName fails.
    let rebind = merge(&pods, "a", json!({"spec": {"nodeName": "n1"}})).await;
    refused(rebind, "422 Invalid");

    // Validation: bad name, no containers.
    let mut bad = pod("Bad_Name").build();
    refused(pods.create(&pp, &bad).await, "422 Invalid");
    bad.metadata.name = Some("ok".to_owned());
    bad.spec.as_mut().unwrap().containers.clear();
    refused(pods.create(&pp, &bad).await, "422 Invalid");

    // Nodes are cluster-scoped and keep their status on create.
    let n1 = node("n1").gpushare().gpus(&[16]).create(&client).await;
    let capacity = n1.unwrap().status.unwrap().capacity.unwrap();
    assert!(capacity.contains_key("example.com/gpu-mem"));
    let nodes = Api::<Node>::all(client.clone());
    let listed = nodes.list(&ListParams::default()).await.unwrap();
    assert_eq!(listed.items.len(), 1);
    server.shutdown().await;
}

#[tokio::test]
async fn binding_is_one_shot_and_copies_annotations() {
    let (server, client, pods) = start().await;
    let created = pod("a").gpu_mem(4).create(&client).await.unwrap();
    let uid = created.metadata.uid.clone().unwrap();

    // Wrong uid precondition: 409 and nothing changes.
    let wrong_uid = bind(&pods, "a", "n1", Some("not-the-uid"), &[]).await;
    refused(wrong_uid, "409 Conflict");
    assert_eq!(node_name(&pods.get("a").await.unwrap()), None);

    let status = bind(&pods, "a", "n1", Some(&uid), &[("example.com/gpu", "0")]).await;
    assert_eq!(status.unwrap()["status"], "Success");
    let bound = pods.get("a").await.unwrap();
    assert_eq!(node_name(&bound), Some("n1"));
    let annotations = bound.metadata.annotations.as_ref().unwrap();
    assert_eq!(annotations["example.com/gpu"], "0");
    assert!(has_condition(&bound, "PodScheduled", "True"));

    refused(bind(&pods, "a", "n2", None, &[]).await, "409 Conflict");
    refused(bind(&pods, "ghost", "n1", None, &[]).await, "404 NotFound");

    let stats = server.stats();
    assert_eq!(stats.count(Verb::Create, "pods/binding"), 4);
    assert_eq!(stats.count(Verb::Create, "pods"), 1);
    server.shutdown().await;
}

#[tokio::test]
async fn patches_merge_strategic_json_and_refuse_stale_versions() {
    let (server, client, pods) = start().await;
    let created = pod("a").annotation("keep", "me").create(&client).await;
    let created = created.unwrap();
    let pp = PatchParams::default();

    let out = merge(&pods, "a", json!({"metadata": {"annotations": {"m": "1"}}})).await;
    let annotations = out.unwrap().metadata.annotations.unwrap();
    assert_eq!([&annotations["keep"], &annotations["m"]], ["me", "1"]);

    let strategic = json!({"metadata": {"annotations": {"s": "2", "keep": null}}});
    let out = pods.patch("a", &pp, &Patch::Strategic(&strategic)).await;
    let annotations = out.unwrap().metadata.annotations.unwrap();
    assert!(!annotations.contains_key("keep") && annotations["s"] == "2");

    // Strategic merge of conditions by type on /status.
    let conditions = json!({"status": {"conditions": [
        {"type": "Ready", "status": "False"}, {"type": "Initialized", "status": "True"}]}});
    let conditions = patch_status(&pods, "a", Patch::Strategic(conditions)).await;
    conditions.unwrap();
    let ready = json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}});
    let out = patch_status(&pods, "a", Patch::Strategic(ready)).await;
    let out = out.unwrap();
    let conditions = out.status.as_ref().and_then(|s| s.conditions.as_ref());
    assert_eq!(conditions.map(Vec::len), Some(2));
    assert!(has_condition(&out, "Ready", "True"));

    let add = json!([{"op": "add", "path": "/metadata/annotations/j", "value": "3"}]);
    let json_patch: json_patch::Patch = serde_json::from_value(add).unwrap();
    let out = pods.patch("a", &pp, &Patch::<()>::Json(json_patch)).await;
    assert_eq!(out.unwrap().metadata.annotations.unwrap()["j"], "3");

    let stale = json!({"metadata": {
        "resourceVersion": created.metadata.resource_version.unwrap(),
        "annotations": {"late": "x"}}});
    refused(merge(&pods, "a", stale).await, "409 Conflict");
    // Server-side apply is not offered.
    let apply = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "a"}});
    let by_apply = PatchParams::apply("test");
    let applied = pods.patch("a", &by_apply, &Patch::Apply(&apply)).await;
    refused(applied, "415 UnsupportedMediaType");
    server.shutdown().await;
}

#[tokio::test]
async fn faults_and_stats() {
    let (server, client, pods) = start().await;
    let (faults, stats) = (server.faults(), server.stats());

    faults.set_error_rate(Verb::Get, 1.0, 500);
    refused(pods.get("a").await, "500 InternalError");
    faults.clear();

    // 429 carries Retry-After, which kube's default client honours by retrying: the create
    // succeeds once the fault is lifted. (With no clear, kube retries for minutes, so tests
    // wanting a hard failure use 500.)
    faults.set_error_rate(Verb::Create, 1.0, 429);
    let retrying = tokio::spawn({
        let client = client.clone();
        async move { pod("a").create(&client).await }
    });
    let retried = || async { stats.count(Verb::Create, "pods") >= 2 };
    eventually("a retried create", retried).await;
    faults.clear();
    retrying.await.unwrap().unwrap();
    pods.delete("a", &DeleteParams::default()).await.unwrap();

    faults.set_latency(Duration::from_millis(200));
    let started = std::time::Instant::now();
    pod("a").create(&client).await.unwrap();
    // The latency is a delay the request cannot skip, not a performance measurement.
    assert!(started.elapsed() >= Duration::from_millis(200));
    faults.clear();

    stats.reset();
    let created = pod("b").create(&client).await.unwrap();
    let label = json!({"metadata": {"labels": {"a": "b"}}});
    merge(&pods, "b", label).await.unwrap();
    let current = pods.get("b").await.unwrap();
    let pp = PostParams::default();
    pods.replace("b", &pp, &current).await.unwrap();
    pods.delete("b", &DeleteParams::default()).await.unwrap();
    let events: Api<Event> = Api::default_namespaced(client.clone());
    let about_b = json!({"name": created.metadata.name});
    let event = json!({"metadata": {"name": "b.1"}, "involvedObject": about_b, "reason": "Test"});
    let event: Event = serde_json::from_value(event).unwrap();
    events.create(&pp, &event).await.unwrap();
    assert_eq!(stats.count(Verb::Create, "pods"), 1);
    assert_eq!(stats.count(Verb::Get, "pods"), 1);
    assert_eq!(stats.count(Verb::Create, "events"), 1);
    assert_eq!(stats.writes(), 4);
    let about_b = ListParams::default().fields("involvedObject.name=b");
    assert_eq!(events.list(&about_b).await.unwrap().items.len(), 1);
    server.shutdown().await;
}

#[tokio::test]
async fn raw_watch_replays_filters_and_expires() {
    let (server, client, pods) = start().await;
    let list = pods.list(&ListParams::default()).await.unwrap();
    let start = list.metadata.resource_version.unwrap();
    pod("a").create(&client).await.unwrap();
    pod("b").create(&client).await.unwrap();
    bind(&pods, "b", "n1", None, &[]).await.unwrap();
    let no_bookmarks = WatchParams {
        bookmarks: false,
        ..WatchParams::default()
    };

    // From `start`: history replays; the field selector turns the bind of b into ADDED.
    let on_n1 = no_bookmarks.clone().fields("spec.nodeName=n1").timeout(5);
    let mut stream = pods.watch(&on_n1, &start).await.unwrap().boxed();
    assert_eq!(seen(stream.try_next().await.unwrap()), "ADDED b");
    // Deleting b (bound, so graceful) stays visible as MODIFIED and then DELETED.
    pods.delete("b", &DeleteParams::default()).await.unwrap();
    let deleting = seen(stream.try_next().await.unwrap());
    assert_eq!(deleting, "MODIFIED b (deleting)");
    assert_eq!(seen(stream.try_next().await.unwrap()), "DELETED b");
    drop(stream);

    // After compaction, the old version is 410 Expired, delivered as an ERROR event.
    server.faults().compact();
    let mut stream = pods.watch(&no_bookmarks, &start).await.unwrap().boxed();
    assert_eq!(seen(stream.try_next().await.unwrap()), "ERROR 410 Expired");
    assert!(stream.try_next().await.unwrap().is_none());
    server.shutdown().await;
}

/// kube-runtime's watcher (list + watch) survives compaction and dropped watches: it gets
/// 410, relists, and its store converges on the server's state.
#[tokio::test(flavor = "multi_thread")]
async fn reflector_recovers_from_compaction() {
    let (server, client, pods) = start().await;
    pod("a").create(&client).await.unwrap();
    pod("c").create(&client).await.unwrap();

    let (reader, writer) = reflector::store::<Pod>();
    let expired = Arc::new(AtomicUsize::new(0));
    let seen_expired = expired.clone();
    let stream = watcher(pods.clone(), watcher::Config::default())
        .default_backoff()
        .inspect(move |event| {
            if let Err(watcher::Error::WatchError(status)) = event
                && status.code == 410
            {
                seen_expired.fetch_add(1, Ordering::SeqCst);
            }
        })
        .reflect(writer)
        .applied_objects();
    let task = tokio::spawn(stream.for_each(|_| async {}));

    let names = || {
        let mut names: Vec<String> = reader.state().iter().map(|p| p.name_any()).collect();
        names.sort();
        names
    };
    eventually("the initial list", || async { names() == ["a", "c"] }).await;

    // Keep the watcher from re-watching while history moves on and is compacted.
    let (faults, stats) = (server.faults(), server.stats());
    faults.set_error_rate(Verb::Watch, 1.0, 500);
    faults.drop_watches();
    pod("b").create(&client).await.unwrap();
    pods.delete("a", &DeleteParams::default()).await.unwrap();
    let label = json!({"metadata": {"labels": {"v": "2"}}});
    merge(&pods, "c", label).await.unwrap();
    faults.compact();
    let watches = stats.count(Verb::Watch, "pods");
    let rewatched = || async { stats.count(Verb::Watch, "pods") > watches };
    eventually("a failed re-watch", rewatched).await;
    faults.clear();

    let c = reflector::ObjectRef::new("c").within("default");
    eventually("the store to converge", || async {
        let labelled = |c: Arc<Pod>| c.labels().get("v").is_some_and(|v| v == "2");
        names() == ["b", "c"] && reader.get(&c).is_some_and(labelled)
    })
    .await;
    let expired = expired.load(Ordering::SeqCst);
    assert!(expired >= 1, "the watcher saw 410 Expired");
    assert!(stats.count(Verb::List, "pods") >= 2, "the watcher relisted");

    // And it keeps following live changes.
    pod("d").create(&client).await.unwrap();
    eventually("live changes", || async { names() == ["b", "c", "d"] }).await;
    task.abort();
    server.shutdown().await;
}

/// Sends a create of pod `create` and a Binding of pod `bind` to n1 while writes are stalled:
/// the create's caller gives up (as a client that timed out does) once the server holds it;
/// the binding's caller is returned once the server holds it too.
async fn hold_writes(
    server: &ApiServer,
    pods: &Api<Pod>,
    create: &'static str,
    bind_of: &'static str,
) -> JoinHandle<kube::Result<Value>> {
    let stats = server.stats();
    let creates = stats.count(Verb::Create, "pods");
    let created = tokio::spawn({
        let (pods, pod) = (pods.clone(), pod(create).build());
        async move { pods.create(&PostParams::default(), &pod).await }
    });
    let held = || async { stats.count(Verb::Create, "pods") > creates };
    eventually(&format!("the create of {create} to reach the server"), held).await;
    assert!(!created.is_finished(), "the create should hang");
    created.abort();
    let binding = tokio::spawn({
        let pods = pods.clone();
        async move { bind(&pods, bind_of, "n1", None, &[]).await }
    });
    let held = || async { stats.count(Verb::Create, "pods/binding") > 0 };
    eventually("the binding to reach the server", held).await;
    binding
}

/// The stall lasts until the test ends it (by time: a zero-length stall from now), so what
/// happens during it does not race its end.
#[tokio::test(flavor = "multi_thread")]
async fn a_write_during_a_stall_hangs_then_lands_even_if_its_client_gave_up() {
    let (server, client, pods) = start().await;
    node("n1").create(&client).await.unwrap();
    pod("bound-later").create(&client).await.unwrap();
    let faults = server.faults();

    faults.stall_writes(FOREVER);
    assert!(faults.writes_stalled());
    let binding = hold_writes(&server, &pods, "created-later", "bound-later").await;
    assert!(!binding.is_finished(), "the binding should hang too");
    binding.abort();

    // A consistent read (GET) needs etcd: it hangs too (here, past its client's timeout).
    // A list from the watch cache (`resourceVersion=0`) answers while the stall still holds.
    let mut config = kube::Config::new(server.url().parse().unwrap());
    config.read_timeout = Some(Duration::from_millis(200));
    config.write_timeout = config.read_timeout;
    let impatient = Api::<Pod>::default_namespaced(kube::Client::try_from(config).unwrap());
    let quorum_read = impatient.get("bound-later").await;
    assert!(quorum_read.is_err(), "a GET should hang during the stall");
    let cached = tokio::time::timeout(DEADLINE, pods.list(&ListParams::default().match_any()))
        .await
        .expect("a list from the watch cache should answer during the stall")
        .unwrap();
    assert_eq!(cached.items.len(), 1, "nothing is applied during the stall");
    assert_eq!(node_name(&cached.items[0]), None);
    assert!(faults.writes_stalled());

    // Once the stall ends, both writes are applied though nobody waits for them any more.
    faults.stall_writes(Duration::ZERO);
    assert!(!faults.writes_stalled());
    eventually("the abandoned create and binding to land", || async {
        let created = pods.get_opt("created-later").await.unwrap().is_some();
        created && node_name(&pods.get("bound-later").await.unwrap()) == Some("n1")
    })
    .await;
    // Writes after the stall go through at once.
    pod("after").create(&client).await.unwrap();
    server.shutdown().await;
}

/// A stall that ends with etcd losing its leader: every write it held fails unapplied, those
/// whose clients still wait get a 500, those whose clients gave up are simply gone.
#[tokio::test(flavor = "multi_thread")]
async fn writes_held_by_a_failing_stall_are_never_applied() {
    let (server, client, pods) = start().await;
    node("n1").create(&client).await.unwrap();
    pod("unbound").create(&client).await.unwrap();
    let faults = server.faults();

    faults.stall_writes_then_fail(FOREVER);
    let waiting = hold_writes(&server, &pods, "abandoned", "unbound").await;
    // The stall ends now (by time, as it would have): what it held fails.
    faults.stall_writes_then_fail(Duration::ZERO);
    // A client still waiting learns that its write failed.
    refused(waiting.await.unwrap(), "500 InternalError");
    assert!(!faults.writes_stalled());
    // Nothing held was applied, and writes go through again.
    refused(pods.get("abandoned").await, "404 NotFound");
    assert_eq!(node_name(&pods.get("unbound").await.unwrap()), None);
    bind(&pods, "unbound", "n1", None, &[]).await.unwrap();
    server.shutdown().await;
}

/// A client that authenticates with the kubeconfig `yaml`.
async fn client_from(yaml: &str) -> Api<Pod> {
    let kubeconfig = kube::config::Kubeconfig::from_yaml(yaml).unwrap();
    let options = kube::config::KubeConfigOptions::default();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options).await;
    Api::namespaced(kube::Client::try_from(config.unwrap()).unwrap(), "default")
}

/// A kubeconfig this server issued acts as its user; a token it never issued is not a user.
#[tokio::test]
async fn only_tokens_it_issued_are_users() {
    let (server, _, admin) = start().await;
    admin
        .create(&PostParams::default(), &pod("a").build())
        .await
        .unwrap();
    let keeper_yaml = server.kubeconfig_yaml_as("keeper");
    client_from(&keeper_yaml).await.get("a").await.unwrap();
    // A token this server never issued is not a user.
    let bogus = keeper_yaml.replace("token: kubesim-", "token: forged-");
    assert_ne!(bogus, keeper_yaml);
    refused(client_from(&bogus).await.get("a").await, "401 Unauthorized");
    server.shutdown().await;
}
