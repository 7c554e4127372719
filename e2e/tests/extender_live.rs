//! The extender, run in-process as in production (watches, HTTP on 127.0.0.1:0, Binding
//! writes), against gpushare-e2e's in-process API server.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use gpushare_contract::{Keys, PodAllocation};
use gpushare_e2e::apiserver::{ApiServer, Verb};
use gpushare_e2e::cluster::wait_for;
use gpushare_e2e::scenarios::{allocation, check_no_overcommit, wait_bound};
use gpushare_extender::{Config, serve};
use gpushare_testkit::fixtures::{node, pod};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, ListParams};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

const PREFIX: &str = "/gpushare-scheduler";

/// How long a test waits for what should come: only a hung test reaches it.
const DEADLINE: Duration = Duration::from_secs(60);

/// A running extender; dropping it kills it (its task and every connection).
struct Extender {
    addr: SocketAddr,
    task: JoinHandle<Result<(), gpushare_extender::Error>>,
    http: Client<HttpConnector, Full<Bytes>>,
}

impl Drop for Extender {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Extender {
    async fn start(client: kube::Client) -> anyhow::Result<Self> {
        Self::start_with_grace(client, 0).await
    }

    /// Starts an extender that holds binds for `bind_grace_ms` after its first sync.
    async fn start_with_grace(client: kube::Client, bind_grace_ms: u64) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let config = Config {
            listen: addr,
            bind_grace_ms,
            ..Config::default()
        };
        let task = tokio::spawn(serve(config, client, listener, std::future::pending()));
        let http = Client::builder(TokioExecutor::new()).build_http();
        let extender = Self { addr, task, http };
        wait_for("the extender to be ready", DEADLINE, || async {
            (extender.get("/readyz").await.map(|(s, _)| s) == Ok(200)).then_some(())
        })
        .await?;
        Ok(extender)
    }

    async fn request(
        &self,
        method: &str,
        path: &str,
        body: String,
    ) -> Result<(u16, Value), String> {
        let request = hyper::Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.addr))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let response = self
            .http
            .request(request)
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        let value = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        Ok((status, value))
    }

    async fn get(&self, path: &str) -> Result<(u16, Value), String> {
        self.request("GET", path, String::new()).await
    }

    /// Binds; the extender's `Error` ("" = bound), or the transport error.
    async fn bind(&self, pod: &Pod, node: &str) -> anyhow::Result<String> {
        let body = json!({
            "PodName": pod.metadata.name,
            "PodNamespace": pod.metadata.namespace,
            "PodUID": pod.metadata.uid,
            "Node": node,
        });
        let (status, answer) = self
            .request("POST", &format!("{PREFIX}/bind"), body.to_string())
            .await
            .map_err(anyhow::Error::msg)?;
        assert_eq!(status, 200, "{answer}");
        Ok(answer["Error"].as_str().unwrap_or_default().to_owned())
    }

    async fn filter(&self, pod: &Pod, nodes: &[&str]) -> Value {
        let body = json!({"Pod": pod, "Nodes": null, "NodeNames": nodes});
        let (status, answer) = self
            .request("POST", &format!("{PREFIX}/filter"), body.to_string())
            .await
            .unwrap();
        assert_eq!(status, 200);
        answer
    }

    /// Waits until inspect shows no reservation left (the watch caught up with every bind).
    async fn settled(&self) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let (_, all) = self
                .get(&format!("{PREFIX}/inspect"))
                .await
                .map_err(anyhow::Error::msg)?;
            let reserved = all.to_string().contains("\"reserved\":true");
            if !reserved {
                return Ok(());
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "reservations never confirmed: {all}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// GiB booked per (node, GPU) according to the pods' annotations in the API server.
async fn booked(client: &kube::Client) -> anyhow::Result<BTreeMap<(String, u32), u64>> {
    let keys = Keys::default();
    let pods = Api::<Pod>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    let mut booked = BTreeMap::new();
    for pod in pods {
        let (Some(node), Some(annotations)) =
            (pod.spec.and_then(|s| s.node_name), pod.metadata.annotations)
        else {
            continue;
        };
        if let Some(allocation) = PodAllocation::from_annotations(&keys, &annotations)? {
            *booked.entry((node, allocation.gpu_index)).or_default() += allocation.pod_gib;
        }
    }
    Ok(booked)
}

/// An API server with one gpushare node `n1` of `gpus`, and a client for it.
async fn server_with_node(gpus: &[u64]) -> anyhow::Result<(ApiServer, kube::Client)> {
    let server = ApiServer::start().await?;
    let client = server.client();
    node("n1").gpushare().gpus(gpus).create(&client).await?;
    Ok((server, client))
}

async fn create_pods(client: &kube::Client, sizes: &[u64]) -> anyhow::Result<Vec<Pod>> {
    let mut pods = Vec::new();
    for (i, &gib) in sizes.iter().enumerate() {
        pods.push(pod(&format!("p{i}")).gpu_mem(gib).create(client).await?);
    }
    Ok(pods)
}

#[tokio::test]
async fn bind_writes_once_and_the_watch_confirms() -> anyhow::Result<()> {
    let (server, client) = server_with_node(&[12, 16]).await?;
    let mut pods = create_pods(&client, &[4]).await?;
    // Design-doc style: GPU 1 has 8 free, GPU 0 has 12. Binpack would choose GPU 1; the
    // default fragmentation policy, which has seen an 8 GiB pod, chooses GPU 0 so that both
    // GPUs keep 8 GiB free for another one.
    pod("big")
        .gpu_mem(8)
        .on_node("n1")
        .annotation(&Keys::default().gpu_index, "1")
        .annotation(&Keys::default().pod_gib, "8")
        .annotation(&Keys::default().containers, r#"[{"name":"main","gib":8}]"#)
        .annotation(&Keys::default().assigned, "true")
        .create(&client)
        .await?;
    let extender = Extender::start(client.clone()).await?;
    let p = pods.remove(0);
    let answer = extender.filter(&p, &["ghost"]).await;
    assert_eq!(answer["NodeNames"], json!([]));
    assert_eq!(
        answer["FailedAndUnresolvableNodes"]["ghost"],
        "node ghost is unknown to the gpushare extender"
    );
    let answer = extender.filter(&p, &["n1", "ghost"]).await;
    assert_eq!(answer["NodeNames"], json!(["n1"]));

    server.stats().reset();
    assert_eq!(extender.bind(&p, "n1").await?, "");
    assert_eq!(server.stats().count(Verb::Create, "pods/binding"), 1);
    assert_eq!(server.stats().writes(), 1);
    let stored = Api::<Pod>::namespaced(client.clone(), "default")
        .get("p0")
        .await?;
    assert_eq!(
        stored.spec.as_ref().unwrap().node_name.as_deref(),
        Some("n1")
    );
    let allocation = allocation(&stored)?;
    assert_eq!(
        (
            allocation.gpu_index,
            allocation.gpu_uuid.as_str(),
            allocation.pod_gib
        ),
        (0, "GPU-n1-0", 4)
    );
    extender.settled().await?;
    // A successful bind writes no Event (the pod's annotations, kube-scheduler's own
    // Scheduled event and `inspect` tell that story); a refusal does, off the bind path.
    let mut ghost = pod("ghost").gpu_mem(4).build();
    ghost.metadata.uid = Some("uid-ghost".into());
    let refusal = extender.bind(&ghost, "n1").await?;
    assert!(refusal.contains("not found"), "{refusal}");
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), "default");
    let reasons = wait_for("the refusal's Event", DEADLINE, || {
        let events = events.clone();
        async move {
            let reasons: Vec<String> = events
                .list(&ListParams::default())
                .await
                .ok()?
                .into_iter()
                .filter_map(|e| e.reason)
                .collect();
            reasons
                .iter()
                .any(|r| r == "GpuBindRefused")
                .then_some(reasons)
        }
    })
    .await?;
    // Events are published in order: one for the earlier bind would be there by now.
    assert_eq!(reasons, ["GpuBindRefused"]);
    assert_eq!(server.stats().writes(), 1, "one Binding");
    assert_eq!(
        server.stats().count(Verb::Create, "events"),
        1,
        "one Event, for the refusal"
    );
    // A retry of the same bind succeeds without a second write.
    assert_eq!(extender.bind(&p, "n1").await?, "");
    assert_eq!(server.stats().writes(), 1);

    // A refusal that settles on retry (here: no GPU has room, as when another bind won the
    // race) writes no Event: kube-scheduler records FailedScheduling with the message anyway.
    let huge = pod("huge").gpu_mem(16).create(&client).await?;
    wait_for("the extender to see pod huge", DEADLINE, || async {
        let refusal = extender.bind(&huge, "n1").await.ok()?;
        refusal.contains("cannot bind").then_some(())
    })
    .await?;
    // A refusal a person should see does write one; it is published after the first.
    let mut stale = pod("ghost2").gpu_mem(4).build();
    stale.metadata.uid = Some("uid-ghost2".into());
    let refusal = extender.bind(&stale, "n1").await?;
    assert!(refusal.contains("not found"), "{refusal}");
    wait_for("the Event of ghost2", DEADLINE, || {
        let events = events.clone();
        async move {
            let listed = events.list(&ListParams::default()).await.ok()?;
            listed
                .iter()
                .any(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("ghost2"))
                .then_some(())
        }
    })
    .await?;
    assert_eq!(
        server.stats().count(Verb::Create, "events"),
        2,
        "Events for the two pods not found, none for the pod that did not fit"
    );
    Ok(())
}

async fn burst(sizes: &[u64], gpus: &[u64]) -> anyhow::Result<(usize, ApiServer)> {
    let (server, client) = server_with_node(gpus).await?;
    let pods = create_pods(&client, sizes).await?;
    let extender = std::sync::Arc::new(Extender::start(client.clone()).await?);
    server.stats().reset();
    let mut tasks = Vec::new();
    for p in pods {
        let extender = extender.clone();
        tasks.push(tokio::spawn(async move { extender.bind(&p, "n1").await }));
    }
    let mut bound = 0;
    for task in tasks {
        match task.await??.as_str() {
            "" => bound += 1,
            reason => anyhow::ensure!(
                reason.contains("n1") && reason.contains("GiB"),
                "vague refusal: {reason}"
            ),
        }
    }
    assert_eq!(
        server.stats().count(Verb::Create, "pods/binding"),
        bound as u64
    );
    assert_eq!(server.stats().writes(), bound as u64);
    check_no_overcommit(&client).await?;
    // Every bound pod's allocation annotations parse (`check_no_overcommit` skips those
    // that do not).
    booked(&client).await?;
    Ok((bound, server))
}

#[tokio::test]
async fn sixty_four_concurrent_binds_with_room_for_all() -> anyhow::Result<()> {
    let (bound, _server) = burst(&[4; 64], &[256, 256]).await?;
    assert_eq!(bound, 64);
    Ok(())
}

#[tokio::test]
async fn sixty_four_concurrent_binds_without_room() -> anyhow::Result<()> {
    // Sizes 1..=8: 288 GiB asked, 32 GiB there.
    let sizes: Vec<u64> = (0..64).map(|i| i % 8 + 1).collect();
    let (bound, _server) = burst(&sizes, &[16, 16]).await?;
    assert!(bound > 0 && bound < 64, "{bound}");
    Ok(())
}

#[tokio::test]
async fn restart_mid_burst_does_not_over_commit() -> anyhow::Result<()> {
    let (server, client) = server_with_node(&[16, 16]).await?;
    let sizes: Vec<u64> = (0..40).map(|i| i % 5 + 1).collect();
    let pods = create_pods(&client, &sizes).await?;
    server.faults().set_latency(Duration::from_millis(5));
    let first = std::sync::Arc::new(Extender::start(client.clone()).await?);
    let mut tasks = Vec::new();
    for p in &pods[..20] {
        let (extender, p) = (first.clone(), p.clone());
        tasks.push(tokio::spawn(async move { extender.bind(&p, "n1").await }));
    }
    // Kill it while binds are in flight: once the first Binding landed.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while server.stats().count(Verb::Create, "pods/binding") == 0 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "no bind ever landed"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    for task in &tasks {
        task.abort();
    }
    drop(first);
    for task in tasks {
        let _ = task.await;
    }
    // The new instance holds binds briefly after it synced, so Bindings the killed one sent
    // can land first; kube-scheduler retries, and so do these binds.
    let second = Extender::start_with_grace(client.clone(), 300).await?;
    let held = second.bind(&pods[39], "n1").await?;
    assert!(
        held.contains("just started"),
        "binds are held after start: {held}"
    );
    let mut tasks = Vec::new();
    let second = std::sync::Arc::new(second);
    for p in &pods {
        let (extender, p) = (second.clone(), p.clone());
        tasks.push(tokio::spawn(async move {
            let name = p.metadata.name.clone().unwrap_or_default();
            let what = format!("the bind of {name} to get past the start-up hold");
            // Bound or refused (no room), or the transport's error: anything but the hold.
            wait_for(&what, DEADLINE, || async {
                match extender.bind(&p, "n1").await {
                    Ok(answer) if answer.contains("just started") => None,
                    answered => Some(answered),
                }
            })
            .await
        }));
    }
    for task in tasks {
        let _ = task.await??;
    }
    server.faults().clear();
    check_no_overcommit(&client).await?;
    let bound = booked(&client).await?.values().sum::<u64>();
    assert!(bound > 0);
    Ok(())
}

#[tokio::test]
async fn recreated_pod_is_not_confused_with_the_old_one() -> anyhow::Result<()> {
    let (_server, client) = server_with_node(&[16]).await?;
    let old = pod("same").gpu_mem(4).create(&client).await?;
    let extender = Extender::start(client.clone()).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    pods.delete("same", &DeleteParams::default()).await?;
    let new = pod("same").gpu_mem(4).create(&client).await?;
    assert_ne!(old.metadata.uid, new.metadata.uid);
    // Until the watch shows the new pod, the old UID may still be cached: the API server
    // refuses the stale Binding (UID precondition) and the reservation is released.
    let answer = extender.bind(&old, "n1").await?;
    assert!(!answer.is_empty());
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let answer = extender.bind(&new, "n1").await?;
        if answer.is_empty() {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "new pod never bound: {answer}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let answer = extender.bind(&old, "n1").await?;
    assert!(
        answer.contains("was recreated") || answer.contains("not found"),
        "{answer}"
    );
    extender.settled().await?;
    let booked = booked(&client).await?;
    assert_eq!(booked.get(&("n1".to_owned(), 0)), Some(&4));
    Ok(())
}

/// One node with one 8 GiB GPU, two pending 8 GiB pods named `first` and `next`, and an
/// extender that has seen them all.
async fn one_gpu_two_pods(
    first: &str,
) -> anyhow::Result<(ApiServer, kube::Client, Pod, Pod, Extender)> {
    let (server, client) = server_with_node(&[8]).await?;
    let first = pod(first).gpu_mem(8).create(&client).await?;
    let next = pod("next").gpu_mem(8).create(&client).await?;
    let extender = Extender::start(client.clone()).await?;
    Ok((server, client, first, next, extender))
}

/// The pod watch selects unfinished pods only (as kube-scheduler's informer does): a pod that
/// finishes leaves it as a DELETED event, which frees its GPU for the next pod, and an
/// extender started afterwards finds the GPU free.
#[tokio::test]
async fn a_finished_pod_leaves_the_watch_and_frees_its_gpu() -> anyhow::Result<()> {
    let (server, client, done, next, extender) = one_gpu_two_pods("done").await?;
    assert_eq!(extender.bind(&done, "n1").await?, "");
    extender.settled().await?;
    assert_eq!(
        extender.filter(&next, &["n1"]).await["NodeNames"],
        json!([])
    );

    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    pods.patch_status(
        "done",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(json!({"status": {"phase": "Succeeded"}})),
    )
    .await?;
    wait_for("the finished pod's GPU to be free", DEADLINE, || async {
        (extender.filter(&next, &["n1"]).await["NodeNames"] == json!(["n1"])).then_some(())
    })
    .await?;
    // The pod watch asked for unfinished pods only.
    let selected = server.stats().field_selectors("pods");
    assert!(
        selected
            .iter()
            .any(|s| s == gpushare_extender::kube_io::watch::UNFINISHED_PODS),
        "{selected:?}"
    );
    drop(extender);

    // A fresh extender lists the node with its GPU free.
    let extender = Extender::start(client.clone()).await?;
    assert_eq!(extender.bind(&next, "n1").await?, "");
    Ok(())
}

#[tokio::test]
async fn pod_deleted_between_filter_and_bind_releases_the_reservation() -> anyhow::Result<()> {
    let (_server, client, gone, next, extender) = one_gpu_two_pods("gone").await?;
    assert_eq!(
        extender.filter(&gone, &["n1"]).await["NodeNames"],
        json!(["n1"])
    );
    Api::<Pod>::namespaced(client.clone(), "default")
        .delete("gone", &DeleteParams::default())
        .await?;
    let answer = extender.bind(&gone, "n1").await?;
    assert!(answer.contains("gone"), "{answer}");
    // The whole GPU is free again for the next pod.
    assert_eq!(extender.bind(&next, "n1").await?, "");
    Ok(())
}

#[tokio::test]
async fn api_server_500_on_binding_keeps_the_memory_until_the_pod_shows_it_landed()
-> anyhow::Result<()> {
    let (server, client) = server_with_node(&[8]).await?;
    let p = pod("p").gpu_mem(8).create(&client).await?;
    let extender = Extender::start(client.clone()).await?;
    // A 500 may come after the write was committed: not a reason to hand the memory out.
    server.faults().set_error_rate(Verb::Create, 1.0, 500);
    let answer = extender.bind(&p, "n1").await?;
    assert!(
        answer.contains("500")
            && answer.contains("default/p")
            && answer.contains("no clear answer"),
        "{answer}"
    );
    let (_, inspect) = extender
        .get(&format!("{PREFIX}/inspect/n1"))
        .await
        .map_err(anyhow::Error::msg)?;
    assert_eq!(inspect["gpus"][0]["usedGiB"], 8);
    // The server recovers: the extender re-posts the Binding by itself, and the watch shows
    // the pod bound; kube-scheduler's retry to the same node answers success.
    server.faults().clear();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    assert_eq!(wait_bound(&pods, "p").await?, "n1");
    assert_eq!(extender.bind(&p, "n1").await?, "");
    let names: BTreeSet<String> = booked(&client)
        .await?
        .keys()
        .map(|(n, _)| n.clone())
        .collect();
    assert_eq!(names, BTreeSet::from(["n1".to_owned()]));
    Ok(())
}

#[tokio::test]
async fn a_bad_certificate_path_stops_startup_with_a_clear_error() -> anyhow::Result<()> {
    let server = ApiServer::start().await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let config = Config {
        tls_cert: Some("/nonexistent/cert.pem".into()),
        tls_key: Some("/nonexistent/key.pem".into()),
        ..Config::default()
    };
    let error = serve(config, server.client(), listener, std::future::pending())
        .await
        .unwrap_err();
    assert!(
        error.to_string().contains("/nonexistent/cert.pem"),
        "{error}"
    );
    Ok(())
}

#[tokio::test]
async fn a_malformed_keyring_stops_startup_with_a_clear_error() -> anyhow::Result<()> {
    let server = ApiServer::start().await?;
    let dir = tempfile::tempdir()?;
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "k1:AQEBAQEBAQEBAQEBAQEBAQ==\nk2 no-colon\n")?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let config = Config {
        allocation_keys_file: Some(keys.clone()),
        ..Config::default()
    };
    let error = serve(config, server.client(), listener, std::future::pending())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("--allocation-keys-file")
            && error.contains(&keys.display().to_string())
            && error.contains("line 2: expected `id:base64key`"),
        "{error}"
    );
    Ok(())
}
