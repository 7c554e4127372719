//! The in-process API server is strict where the real one is: these tests pin that down with
//! an ordinary kube client, so every other test built on it can be trusted.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use gpushare_e2e::apiserver::{ApiServer, Verb};
use gpushare_e2e::fixtures::{node, pod};
use k8s_openapi::api::core::v1::{Binding, Event, Node, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{
    Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use serde_json::json;

/// How long a test waits for what should come: only a hung test reaches it.
const DEADLINE: Duration = Duration::from_secs(60);

/// A write stall that lasts past any test: the test ends it, or the server's
/// shutdown does.
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

fn api_error(err: kube::Error) -> (u16, String) {
    match err {
        kube::Error::Api(status) => (status.code, status.reason.clone()),
        other => panic!("expected an API error, got {other:?}"),
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
) -> Result<serde_json::Value, kube::Error> {
    let binding = Binding {
        metadata: ObjectMeta {
            name: Some(pod.to_owned()),
            uid: uid.map(str::to_owned),
            annotations: Some(
                annotations
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..Default::default()
        },
        target: ObjectReference {
            kind: Some("Node".to_owned()),
            name: Some(node.to_owned()),
            ..Default::default()
        },
    };
    pods.create_subresource("binding", pod, &PostParams::default(), &binding)
        .await
}

#[tokio::test]
async fn crud_is_strict_about_versions_names_and_existence() {
    let (server, client, pods) = start().await;

    let created = pod("a").gpu_mem(4).create(&client).await.unwrap();
    let meta = &created.metadata;
    assert!(meta.uid.is_some() && meta.creation_timestamp.is_some());
    assert_eq!(created.status.unwrap().phase.as_deref(), Some("Pending"));

    // Create twice: 409 AlreadyExists.
    let again = pod("a").create(&client).await.unwrap_err();
    let err = again.downcast::<kube::Error>().unwrap();
    assert_eq!(api_error(err), (409, "AlreadyExists".to_owned()));

    // Missing: 404 NotFound, parsed by kube.
    assert_eq!(
        api_error(pods.get("nope").await.unwrap_err()),
        (404, "NotFound".to_owned())
    );

    // Update with the current version works and bumps it; the old version is then stale.
    let mut first = pods.get("a").await.unwrap();
    let mut second = first.clone();
    first.metadata.labels = Some(BTreeMap::from([("x".to_owned(), "1".to_owned())]));
    let updated = pods
        .replace("a", &PostParams::default(), &first)
        .await
        .unwrap();
    assert_ne!(
        updated.metadata.resource_version,
        second.metadata.resource_version
    );
    assert_eq!(updated.metadata.uid, second.metadata.uid);
    second.metadata.labels = Some(BTreeMap::from([("x".to_owned(), "2".to_owned())]));
    let stale = pods
        .replace("a", &PostParams::default(), &second)
        .await
        .unwrap_err();
    assert_eq!(api_error(stale), (409, "Conflict".to_owned()));

    // The main resource ignores status; /status changes only status.
    let mut running = pods.get("a").await.unwrap();
    running.status.as_mut().unwrap().phase = Some("Running".to_owned());
    let ignored = pods
        .replace("a", &PostParams::default(), &running)
        .await
        .unwrap();
    assert_eq!(ignored.status.unwrap().phase.as_deref(), Some("Pending"));
    let status_patch = json!({"status": {"phase": "Running"}, "metadata": {"labels": {"y": "1"}}});
    let via_status = pods
        .patch_status("a", &PatchParams::default(), &Patch::Merge(&status_patch))
        .await
        .unwrap();
    assert_eq!(via_status.status.unwrap().phase.as_deref(), Some("Running"));
    assert!(!via_status.metadata.labels.unwrap().contains_key("y"));

    // Pod spec is immutable apart from a few fields: binding by patching nodeName fails.
    let rebind = json!({"spec": {"nodeName": "n1"}});
    let err = pods
        .patch("a", &PatchParams::default(), &Patch::Merge(&rebind))
        .await
        .unwrap_err();
    assert_eq!(api_error(err), (422, "Invalid".to_owned()));

    // Validation: bad name, no containers.
    let mut bad = pod("Bad_Name").build();
    let err = pods.create(&PostParams::default(), &bad).await.unwrap_err();
    assert_eq!(api_error(err), (422, "Invalid".to_owned()));
    bad.metadata.name = Some("ok".to_owned());
    bad.spec.as_mut().unwrap().containers.clear();
    let err = pods.create(&PostParams::default(), &bad).await.unwrap_err();
    assert_eq!(api_error(err), (422, "Invalid".to_owned()));

    // Nodes are cluster-scoped and keep their status on create.
    let n = node("n1")
        .gpushare()
        .gpus(&[16])
        .create(&client)
        .await
        .unwrap();
    assert!(
        n.status
            .unwrap()
            .capacity
            .unwrap()
            .contains_key("example.com/gpu-mem")
    );
    let nodes: Api<Node> = Api::all(client.clone());
    assert_eq!(
        nodes
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        1
    );
    server.shutdown().await;
}

#[tokio::test]
async fn binding_is_one_shot_and_copies_annotations() {
    let (server, client, pods) = start().await;
    let created = pod("a").gpu_mem(4).create(&client).await.unwrap();
    let uid = created.metadata.uid.clone().unwrap();

    // Wrong uid precondition: 409 and nothing changes.
    let err = bind(&pods, "a", "n1", Some("not-the-uid"), &[])
        .await
        .unwrap_err();
    assert_eq!(api_error(err), (409, "Conflict".to_owned()));
    assert!(
        pods.get("a")
            .await
            .unwrap()
            .spec
            .unwrap()
            .node_name
            .is_none()
    );

    let status = bind(&pods, "a", "n1", Some(&uid), &[("example.com/gpu", "0")])
        .await
        .unwrap();
    assert_eq!(status["status"], "Success");
    let bound = pods.get("a").await.unwrap();
    assert_eq!(bound.spec.unwrap().node_name.as_deref(), Some("n1"));
    assert_eq!(bound.metadata.annotations.unwrap()["example.com/gpu"], "0");
    let conditions = bound.status.unwrap().conditions.unwrap();
    assert!(
        conditions
            .iter()
            .any(|c| c.type_ == "PodScheduled" && c.status == "True")
    );

    // A second bind is refused.
    let err = bind(&pods, "a", "n2", None, &[]).await.unwrap_err();
    assert_eq!(api_error(err), (409, "Conflict".to_owned()));
    // A missing pod: 404.
    let err = bind(&pods, "ghost", "n1", None, &[]).await.unwrap_err();
    assert_eq!(api_error(err), (404, "NotFound".to_owned()));

    let stats = server.stats();
    assert_eq!(stats.count(Verb::Create, "pods/binding"), 4);
    assert_eq!(stats.count(Verb::Create, "pods"), 1);
    server.shutdown().await;
}

/// Every write records its field manager in `metadata.managedFields`, as the real server's
/// does, so that what clients read and watch is as large as on a real cluster; the body's own
/// entries are never taken, and a binding records none.
#[tokio::test]
async fn writes_record_their_field_managers() {
    let (server, client, pods) = start().await;
    let created = pod("a").gpu_mem(4).create(&client).await.unwrap();
    let entries = created.metadata.managed_fields.clone().unwrap();
    let [entry] = entries.as_slice() else {
        panic!("one entry after a create: {entries:?}");
    };
    assert_eq!(entry.operation.as_deref(), Some("Update"));
    assert_eq!(entry.fields_type.as_deref(), Some("FieldsV1"));
    let owned = &entry.fields_v1.as_ref().unwrap().0;
    assert!(
        owned
            .pointer("/f:spec/f:containers")
            .and_then(|c| c.as_object())
            .is_some_and(|c| c.keys().any(|k| k.starts_with("k:{\"name\":"))),
        "{owned}"
    );
    assert!(owned.get("f:status").is_none(), "{owned}");

    let patched = pods
        .patch(
            "a",
            &PatchParams {
                field_manager: Some("annotator".to_owned()),
                ..PatchParams::default()
            },
            &Patch::Merge(json!({"metadata": {"annotations": {"x": "1"}}})),
        )
        .await
        .unwrap();
    let entries = patched.metadata.managed_fields.clone().unwrap();
    assert_eq!(entries.len(), 2);
    assert_eq!(entries[1].manager.as_deref(), Some("annotator"));
    assert_eq!(
        entries[1].fields_v1.as_ref().unwrap().0,
        json!({"f:metadata": {"f:annotations": {".": {}, "f:x": {}}}})
    );

    // A body carrying other entries does not replace the server's.
    let mut forged = patched.clone();
    forged.metadata.managed_fields = Some(Vec::new());
    forged
        .metadata
        .labels
        .get_or_insert_default()
        .insert("l".to_owned(), "v".to_owned());
    let replaced = pods
        .replace(
            "a",
            &PostParams {
                field_manager: Some("labeller".to_owned()),
                ..PostParams::default()
            },
            &forged,
        )
        .await
        .unwrap();
    let entries = replaced.metadata.managed_fields.unwrap();
    assert_eq!(entries.len(), 3);
    assert_eq!(
        entries[2].fields_v1.as_ref().unwrap().0,
        json!({"f:metadata": {"f:labels": {".": {}, "f:l": {}}}})
    );
    // The creating client's entry keeps the create's fields.
    assert!(
        entries[0]
            .fields_v1
            .as_ref()
            .is_some_and(|f| f.0.pointer("/f:spec/f:containers").is_some())
    );

    let uid = created.metadata.uid.clone().unwrap();
    bind(&pods, "a", "n1", Some(&uid), &[]).await.unwrap();
    let bound = pods.get("a").await.unwrap();
    assert_eq!(bound.metadata.managed_fields.unwrap().len(), 3);
    server.shutdown().await;
}

#[tokio::test]
async fn patches_merge_strategic_json_and_refuse_stale_versions() {
    let (server, client, pods) = start().await;
    let created = pod("a")
        .annotation("keep", "me")
        .create(&client)
        .await
        .unwrap();
    let pp = PatchParams::default();

    let merge = json!({"metadata": {"annotations": {"m": "1"}}});
    let out = pods.patch("a", &pp, &Patch::Merge(&merge)).await.unwrap();
    let annotations = out.metadata.annotations.unwrap();
    assert_eq!(
        (annotations["keep"].as_str(), annotations["m"].as_str()),
        ("me", "1")
    );

    let strategic = json!({"metadata": {"annotations": {"s": "2", "keep": null}}});
    let out = pods
        .patch("a", &pp, &Patch::Strategic(&strategic))
        .await
        .unwrap();
    let annotations = out.metadata.annotations.unwrap();
    assert!(!annotations.contains_key("keep") && annotations["s"] == "2");

    // Strategic merge of conditions by type on /status.
    let conditions = json!({"status": {"conditions": [
        {"type": "Ready", "status": "False"}, {"type": "Initialized", "status": "True"}]}});
    pods.patch_status("a", &pp, &Patch::Strategic(&conditions))
        .await
        .unwrap();
    let ready = json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}});
    let out = pods
        .patch_status("a", &pp, &Patch::Strategic(&ready))
        .await
        .unwrap();
    let conditions = out.status.unwrap().conditions.unwrap();
    assert_eq!(conditions.len(), 2);
    assert!(
        conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
    );

    let json_patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "add", "path": "/metadata/annotations/j", "value": "3"}
    ]))
    .unwrap();
    let out = pods
        .patch("a", &pp, &Patch::<()>::Json(json_patch))
        .await
        .unwrap();
    assert_eq!(out.metadata.annotations.unwrap()["j"], "3");

    // A patch that carries a stale resourceVersion: 409.
    let stale = json!({"metadata": {
        "resourceVersion": created.metadata.resource_version.unwrap(),
        "annotations": {"late": "x"}}});
    let err = pods
        .patch("a", &pp, &Patch::Merge(&stale))
        .await
        .unwrap_err();
    assert_eq!(api_error(err), (409, "Conflict".to_owned()));
    // Server-side apply is not offered: 415.
    let apply = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "a"}});
    let err = pods
        .patch("a", &PatchParams::apply("test"), &Patch::Apply(&apply))
        .await
        .unwrap_err();
    assert_eq!(api_error(err), (415, "UnsupportedMediaType".to_owned()));
    server.shutdown().await;
}

#[tokio::test]
async fn faults_and_stats() {
    let (server, client, pods) = start().await;
    let faults = server.faults();
    let stats = server.stats();

    faults.set_error_rate(Verb::Get, 1.0, 500);
    let err = pods.get("a").await.unwrap_err();
    assert_eq!(api_error(err), (500, "InternalError".to_owned()));
    faults.clear();

    // 429 carries Retry-After, which kube's default client honours by retrying: the create
    // succeeds once the fault is lifted. (With rate 1.0 and no clear, kube retries 15 times
    // with exponential backoff — minutes — so tests wanting a hard failure use 500.)
    faults.set_error_rate(Verb::Create, 1.0, 429);
    let retrying = tokio::spawn({
        let client = client.clone();
        async move { pod("a").create(&client).await }
    });
    eventually("a retried create", || async {
        stats.count(Verb::Create, "pods") >= 2
    })
    .await;
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
    pods.patch(
        "b",
        &PatchParams::default(),
        &Patch::Merge(&json!({"metadata": {"labels": {"a": "b"}}})),
    )
    .await
    .unwrap();
    pods.replace("b", &PostParams::default(), &pods.get("b").await.unwrap())
        .await
        .unwrap();
    pods.delete("b", &DeleteParams::default()).await.unwrap();
    let events: Api<Event> = Api::default_namespaced(client.clone());
    events
        .create(
            &PostParams::default(),
            &Event {
                metadata: ObjectMeta {
                    name: Some("b.1".into()),
                    ..Default::default()
                },
                involved_object: ObjectReference {
                    name: created.metadata.name.clone(),
                    ..Default::default()
                },
                reason: Some("Test".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(stats.count(Verb::Create, "pods"), 1);
    assert_eq!(stats.count(Verb::Get, "pods"), 1);
    assert_eq!(stats.count(Verb::Create, "events"), 1);
    assert_eq!(stats.writes(), 4);
    let found = events
        .list(&ListParams::default().fields("involvedObject.name=b"))
        .await
        .unwrap();
    assert_eq!(found.items.len(), 1);
    server.shutdown().await;
}

#[tokio::test]
async fn raw_watch_replays_filters_and_expires() {
    let (server, client, pods) = start().await;
    let start = pods
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    pod("a").create(&client).await.unwrap();
    pod("b").create(&client).await.unwrap();
    bind(&pods, "b", "n1", None, &[]).await.unwrap();

    // From `start`: history replays; the field selector turns the bind of b into ADDED.
    let wp = WatchParams {
        bookmarks: false,
        ..WatchParams::default()
    }
    .fields("spec.nodeName=n1")
    .timeout(5);
    let mut stream = pods.watch(&wp, &start).await.unwrap().boxed();
    match stream.try_next().await.unwrap() {
        Some(WatchEvent::Added(p)) => assert_eq!(p.metadata.name.as_deref(), Some("b")),
        other => panic!("expected ADDED b, got {other:?}"),
    }
    // Deleting b (bound, so graceful) stays visible as MODIFIED and then DELETED.
    pods.delete("b", &DeleteParams::default()).await.unwrap();
    match stream.try_next().await.unwrap() {
        Some(WatchEvent::Modified(p)) => assert!(p.metadata.deletion_timestamp.is_some()),
        other => panic!("expected MODIFIED b, got {other:?}"),
    }
    match stream.try_next().await.unwrap() {
        Some(WatchEvent::Deleted(p)) => assert_eq!(p.metadata.name.as_deref(), Some("b")),
        other => panic!("expected DELETED b, got {other:?}"),
    }
    drop(stream);

    // After compaction, the old version is 410 Expired, delivered as an ERROR event.
    server.faults().compact();
    let wp = WatchParams {
        bookmarks: false,
        ..WatchParams::default()
    };
    let mut stream = pods.watch(&wp, &start).await.unwrap().boxed();
    match stream.try_next().await.unwrap() {
        Some(WatchEvent::Error(status)) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"));
        }
        other => panic!("expected a 410 ERROR event, got {other:?}"),
    }
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
        let mut names: Vec<String> = reader
            .state()
            .iter()
            .map(|p| p.metadata.name.clone().unwrap())
            .collect();
        names.sort();
        names
    };
    eventually("the initial list", || async { names() == ["a", "c"] }).await;

    // Keep the watcher from re-watching while history moves on and is compacted.
    let faults = server.faults();
    faults.set_error_rate(Verb::Watch, 1.0, 500);
    faults.drop_watches();
    pod("b").create(&client).await.unwrap();
    pods.delete("a", &DeleteParams::default()).await.unwrap();
    pods.patch(
        "c",
        &PatchParams::default(),
        &Patch::Merge(&json!({"metadata": {"labels": {"v": "2"}}})),
    )
    .await
    .unwrap();
    faults.compact();
    let stats = server.stats();
    let watches = stats.count(Verb::Watch, "pods");
    eventually("a failed re-watch", || async {
        stats.count(Verb::Watch, "pods") > watches
    })
    .await;
    faults.clear();

    eventually("the store to converge", || async {
        names() == ["b", "c"]
            && reader
                .get(&reflector::ObjectRef::new("c").within("default"))
                .is_some_and(|c| {
                    c.metadata
                        .labels
                        .as_ref()
                        .is_some_and(|l| l.get("v").is_some_and(|v| v == "2"))
                })
    })
    .await;
    assert!(
        expired.load(Ordering::SeqCst) >= 1,
        "the watcher saw 410 Expired"
    );
    assert!(stats.count(Verb::List, "pods") >= 2, "the watcher relisted");

    // And it keeps following live changes.
    pod("d").create(&client).await.unwrap();
    eventually("live changes", || async { names() == ["b", "c", "d"] }).await;
    task.abort();
    server.shutdown().await;
}

/// A kube client for `server` that gives up on any request after `timeout` (and, as any
/// HTTP client that gives up, closes the connection).
fn impatient_client(server: &ApiServer, timeout: Duration) -> kube::Client {
    let mut config = kube::Config::new(server.url().parse().unwrap());
    config.read_timeout = Some(timeout);
    config.write_timeout = Some(timeout);
    kube::Client::try_from(config).unwrap()
}

/// The stall lasts until the test ends it (by time: a zero-length stall from now), so what
/// happens during it does not race its end.
#[tokio::test(flavor = "multi_thread")]
async fn a_write_during_a_stall_hangs_then_lands_even_if_its_client_gave_up() {
    let (server, client, pods) = start().await;
    node("n1").create(&client).await.unwrap();
    pod("bound-later").create(&client).await.unwrap();
    let faults = server.faults();

    let stats = server.stats();

    faults.stall_writes(FOREVER);
    assert!(faults.writes_stalled());
    // A create, and a Binding, whose callers give up (drop the request, as a client that
    // timed out does) once the server has them.
    let creates = stats.count(Verb::Create, "pods");
    let create = tokio::spawn({
        let client = client.clone();
        async move { pod("created-later").create(&client).await }
    });
    eventually("the create to reach the server", || async {
        stats.count(Verb::Create, "pods") > creates
    })
    .await;
    assert!(!create.is_finished(), "the create should hang");
    create.abort();
    let binding_sent = tokio::spawn({
        let pods = pods.clone();
        async move { bind(&pods, "bound-later", "n1", None, &[]).await }
    });
    eventually("the binding to reach the server", || async {
        stats.count(Verb::Create, "pods/binding") > 0
    })
    .await;
    assert!(!binding_sent.is_finished(), "the binding should hang too");
    binding_sent.abort();

    // A consistent read (GET) needs etcd: it hangs too (here, past its client's timeout).
    // A list from the watch cache (`resourceVersion=0`) answers while the stall still holds.
    let impatient = impatient_client(&server, Duration::from_millis(200));
    let quorum_read = Api::<Pod>::default_namespaced(impatient)
        .get("bound-later")
        .await;
    assert!(quorum_read.is_err(), "a GET should hang during the stall");
    let cached = tokio::time::timeout(DEADLINE, pods.list(&ListParams::default().match_any()))
        .await
        .expect("a list from the watch cache should answer during the stall")
        .unwrap();
    assert_eq!(cached.items.len(), 1, "nothing is applied during the stall");
    assert_eq!(cached.items[0].spec.as_ref().unwrap().node_name, None);
    assert!(faults.writes_stalled());

    // Once the stall ends, both writes are applied though nobody waits for them any more.
    faults.stall_writes(Duration::ZERO);
    assert!(!faults.writes_stalled());
    eventually("the abandoned create and binding to land", || async {
        let created = pods.get_opt("created-later").await.unwrap().is_some();
        let bound = pods
            .get("bound-later")
            .await
            .unwrap()
            .spec
            .unwrap()
            .node_name;
        created && bound.as_deref() == Some("n1")
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

    let stats = server.stats();

    // The stall lasts until the test ends it, so what happens during it does not race its end.
    faults.stall_writes_then_fail(FOREVER);
    let creates = stats.count(Verb::Create, "pods");
    let abandoned = tokio::spawn({
        let client = client.clone();
        async move { pod("abandoned").create(&client).await }
    });
    eventually("the create of abandoned to reach the server", || async {
        stats.count(Verb::Create, "pods") > creates
    })
    .await;
    assert!(!abandoned.is_finished(), "the create should hang");
    abandoned.abort();
    let waiting = tokio::spawn({
        let pods = pods.clone();
        async move { bind(&pods, "unbound", "n1", None, &[]).await }
    });
    eventually("the binding to reach the server", || async {
        stats.count(Verb::Create, "pods/binding") > 0
    })
    .await;
    // The stall ends now (by time, as it would have): what it held fails.
    faults.stall_writes_then_fail(Duration::ZERO);
    let waited = waiting.await.unwrap();
    assert_eq!(
        api_error(waited.unwrap_err()),
        (500, "InternalError".to_owned()),
        "a client still waiting learns that its write failed"
    );
    assert!(!faults.writes_stalled());
    // Nothing held was applied, and writes go through again.
    assert_eq!(api_error(pods.get("abandoned").await.unwrap_err()).0, 404);
    let unbound = pods.get("unbound").await.unwrap();
    assert_eq!(unbound.spec.unwrap().node_name, None);
    bind(&pods, "unbound", "n1", None, &[]).await.unwrap();
    server.shutdown().await;
}

/// A client that authenticates with the kubeconfig `yaml`.
async fn client_from(yaml: &str) -> kube::Client {
    let kubeconfig = kube::config::Kubeconfig::from_yaml(yaml).unwrap();
    let config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .unwrap();
    kube::Client::try_from(config).unwrap()
}

/// A policy that lets only `keeper` put the label `locked` on a pod.
const LOCK_POLICY: &str = "apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicy
metadata: {name: lock}
spec:
  failurePolicy: Fail
  matchConstraints:
    resourceRules:
      - {apiGroups: [''], apiVersions: [v1], operations: [CREATE, UPDATE], resources: [pods]}
  variables:
    - {name: locked, expression: \"has(object.metadata.labels) && 'locked' in object.metadata.labels\"}
  validations:
    - expression: \"!variables.locked || request.userInfo.username == 'keeper'\"
      reason: Forbidden
      message: only the keeper locks pods
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicyBinding
metadata: {name: lock-binding}
spec: {policyName: lock, validationActions: [Deny]}
";

#[tokio::test]
async fn admission_policies_see_who_calls_and_the_patched_result() {
    let server = ApiServer::start().await.unwrap();
    server.set_admission_policies(
        gpushare_e2e::apiserver::admission::AdmissionPolicies::from_yaml(LOCK_POLICY).unwrap(),
    );
    let admin: Api<Pod> = Api::namespaced(server.client(), "default");
    let keeper_yaml = server.kubeconfig_yaml_as("keeper");
    let keeper: Api<Pod> = Api::namespaced(client_from(&keeper_yaml).await, "default");
    let mut locked = pod("a").build();
    locked.metadata.labels = Some(BTreeMap::from([("locked".to_owned(), "1".to_owned())]));

    // The admin (no credentials) is refused, with the real server's status and wording.
    let err = admin
        .create(&PostParams::default(), &locked)
        .await
        .unwrap_err();
    let kube::Error::Api(status) = err else {
        panic!("expected an API error, got {err:?}")
    };
    assert_eq!((status.code, status.reason.as_str()), (403, "Forbidden"));
    assert_eq!(
        status.message,
        "pods \"a\" is forbidden: ValidatingAdmissionPolicy 'lock' with binding 'lock-binding' denied request: only the keeper locks pods"
    );
    // The user its token names is let through.
    keeper
        .create(&PostParams::default(), &locked)
        .await
        .unwrap();

    // A patch is judged on its result: adding the label is refused, other changes are not
    // (even while the stored pod carries it: the rule is about who may set it).
    admin
        .create(&PostParams::default(), &pod("b").build())
        .await
        .unwrap();
    let lock = json!({"metadata": {"labels": {"locked": "1"}}});
    let err = admin
        .patch("b", &PatchParams::default(), &Patch::Merge(&lock))
        .await
        .unwrap_err();
    assert_eq!(api_error(err), (403, "Forbidden".to_owned()));
    keeper
        .patch("b", &PatchParams::default(), &Patch::Merge(&lock))
        .await
        .unwrap();
    // Subresources are not matched by `pods`: binding and status go through for anyone.
    bind(&admin, "b", "n1", None, &[]).await.unwrap();
    let status = json!({"status": {"phase": "Running"}});
    admin
        .patch_status("b", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();

    // A token this server never issued is not a user.
    let bogus = keeper_yaml.replace("token: kubesim-", "token: forged-");
    assert_ne!(bogus, keeper_yaml);
    let stranger: Api<Pod> = Api::namespaced(client_from(&bogus).await, "default");
    let err = stranger.get("a").await.unwrap_err();
    assert_eq!(api_error(err), (401, "Unauthorized".to_owned()));
    server.shutdown().await;
}
