//! The extender, run in-process as in production (watches, HTTP on 127.0.0.1:0, Binding
//! writes), against gpushare-e2e's in-process API server.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use gpushare_contract::{Keys, PodAllocation};
use gpushare_e2e::apiserver::{ApiServer, Verb};
use gpushare_e2e::cluster::{http_get, http_post_json, wait_for};
use gpushare_e2e::scenarios::{allocation, check_no_overcommit, wait_bound};
use gpushare_extender::{Config, serve};
use gpushare_testkit::fixtures::{node, pod};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use crate::served::{PREFIX, Served as Extender, bind_body};

/// How long a test waits for what should come: only a hung test reaches it.
const DEADLINE: Duration = Duration::from_secs(60);

impl Extender {
    /// Starts an extender that holds binds for `bind_grace_ms` after its first sync.
    async fn with_grace(client: kube::Client, bind_grace_ms: u64) -> anyhow::Result<Self> {
        let config = |_| Config {
            bind_grace_ms,
            ..Config::default()
        };
        Extender::serve(&client, None, config).await
    }

    async fn post(&self, verb: &str, body: Value) -> anyhow::Result<Value> {
        let path = format!("{PREFIX}/{verb}");
        let (status, answer) = http_post_json(self.addr, &path, &body.to_string()).await?;
        assert_eq!(status, 200, "{verb} answered {answer}");
        Ok(serde_json::from_str(&answer)?)
    }

    /// Binds; the extender's `Error` ("" = bound), or the transport error.
    async fn bind(&self, pod: &Pod, node: &str) -> anyhow::Result<String> {
        let answer = self.post("bind", bind_body(pod, node)).await?;
        Ok(answer["Error"].as_str().unwrap_or_default().to_owned())
    }

    /// The nodes filter keeps, and its whole answer.
    async fn filter(&self, pod: &Pod, nodes: &[&str]) -> (Value, Value) {
        let body = json!({"Pod": pod, "Nodes": null, "NodeNames": nodes});
        let answer = self.post("filter", body).await.unwrap();
        (answer["NodeNames"].clone(), answer)
    }

    async fn inspect(&self, path: &str) -> anyhow::Result<Value> {
        let (_, body) = http_get(self.addr, &format!("{PREFIX}/inspect{path}")).await?;
        Ok(serde_json::from_str(&body)?)
    }

    /// Waits until inspect shows no reservation left (the watch caught up with every bind).
    async fn settled(&self) -> anyhow::Result<()> {
        wait_for("every reservation to be confirmed", DEADLINE, || async {
            let all = self.inspect("").await.ok()?;
            (!all.to_string().contains("\"reserved\":true")).then_some(())
        })
        .await
    }
}

/// GiB booked per (node, GPU) according to the pods' annotations in the API server.
async fn booked(client: &kube::Client) -> anyhow::Result<BTreeMap<(String, u32), u64>> {
    let keys = Keys::default();
    let pods = Api::<Pod>::all(client.clone());
    let mut booked = BTreeMap::new();
    for pod in pods.list(&ListParams::default()).await? {
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

/// (the pod it is about, reason) of each Event in `default`.
async fn events(client: &kube::Client) -> Option<Vec<(String, String)>> {
    let events = Api::<Event>::namespaced(client.clone(), "default");
    let listed = events.list(&ListParams::default()).await.ok()?;
    let about = |e: Event| Some((e.regarding?.name?, e.reason.unwrap_or_default()));
    Some(listed.into_iter().filter_map(about).collect())
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

/// A pod with no UID the server knows.
fn ghost(name: &str) -> Pod {
    let mut ghost = pod(name).gpu_mem(4).build();
    ghost.metadata.uid = Some(format!("uid-{name}"));
    ghost
}

#[tokio::test]
async fn bind_writes_once_and_the_watch_confirms() -> anyhow::Result<()> {
    let (server, client) = server_with_node(&[12, 16]).await?;
    let stats = server.stats();
    let p = pod("p0").gpu_mem(4).create(&client).await?;
    // GPU 1 has 8 free, GPU 0 has 12. Binpack would choose GPU 1; the default fragmentation
    // policy, which has seen an 8 GiB pod, chooses GPU 0 so that both GPUs keep 8 GiB free.
    let keys = Keys::default();
    pod("big")
        .gpu_mem(8)
        .on_node("n1")
        .annotation(&keys.gpu_index, "1")
        .annotation(&keys.pod_gib, "8")
        .annotation(&keys.containers, r#"[{"name":"main","gib":8}]"#)
        .annotation(&keys.assigned, "true")
        .create(&client)
        .await?;
    let extender = Extender::with_grace(client.clone(), 0).await?;
    let (kept, answer) = extender.filter(&p, &["ghost"]).await;
    assert_eq!(kept, json!([]));
    assert_eq!(
        answer["FailedAndUnresolvableNodes"]["ghost"],
        "node ghost is unknown to the gpushare extender"
    );
    assert_eq!(extender.filter(&p, &["n1", "ghost"]).await.0, json!(["n1"]));

    stats.reset();
    assert_eq!(extender.bind(&p, "n1").await?, "");
    assert_eq!(stats.count(Verb::Create, "pods/binding"), 1);
    assert_eq!(stats.writes(), 1);
    let stored: Pod = Api::default_namespaced(client.clone()).get("p0").await?;
    assert_eq!(stored.spec.as_ref().unwrap().node_name, Some("n1".into()));
    let a = allocation(&stored)?;
    assert_eq!(
        (a.gpu_index, a.gpu_uuid.as_str(), a.pod_gib),
        (0, "GPU-n1-0", 4)
    );
    extender.settled().await?;

    // A successful bind writes no Event (the pod's annotations, kube-scheduler's own
    // Scheduled event and `inspect` tell that story); a refusal does, off the bind path.
    let refusal = extender.bind(&ghost("ghost"), "n1").await?;
    assert!(refusal.contains("not found"), "{refusal}");
    let seen = wait_for("the refusal's Event", DEADLINE, || async {
        let seen = events(&client).await?;
        seen.iter()
            .any(|(_, reason)| reason == "GpuBindRefused")
            .then_some(seen)
    })
    .await?;
    // Events are published in order: one for the earlier bind would be there by now.
    assert_eq!(seen, [("ghost".to_owned(), "GpuBindRefused".to_owned())]);
    assert_eq!(stats.writes(), 1, "one Binding");
    let events_written = || stats.count(Verb::Create, "events");
    assert_eq!(events_written(), 1, "one Event, for the refusal");
    // A retry of the same bind succeeds without a second write.
    assert_eq!(extender.bind(&p, "n1").await?, "");
    assert_eq!(stats.writes(), 1);

    // A refusal that settles on retry (here: no GPU has room, as when another bind won the
    // race) writes no Event: kube-scheduler records FailedScheduling with the message anyway.
    let huge = pod("huge").gpu_mem(16).create(&client).await?;
    wait_for("the extender to see pod huge", DEADLINE, || async {
        let refusal = extender.bind(&huge, "n1").await.ok()?;
        refusal.contains("cannot bind").then_some(())
    })
    .await?;
    // A refusal a person should see does write one; it is published after the first.
    let refusal = extender.bind(&ghost("ghost2"), "n1").await?;
    assert!(refusal.contains("not found"), "{refusal}");
    wait_for("the Event of ghost2", DEADLINE, || async {
        let seen = events(&client).await?;
        seen.iter().any(|(pod, _)| pod == "ghost2").then_some(())
    })
    .await?;
    // Events for the two pods not found, none for the pod that did not fit.
    assert_eq!(events_written(), 2);
    Ok(())
}

/// Binds each of `pods` to n1 in a task of its own; with `past_hold`, again while the answer
/// is the start-up hold (then any other answer, or a transport error, ends the task well).
fn spawn_binds(
    extender: &Arc<Extender>,
    pods: &[Pod],
    past_hold: bool,
) -> Vec<JoinHandle<anyhow::Result<String>>> {
    async fn bind(extender: Arc<Extender>, p: Pod, past_hold: bool) -> anyhow::Result<String> {
        if !past_hold {
            return extender.bind(&p, "n1").await;
        }
        let what = format!("the bind of {} to get past the start-up hold", p.name_any());
        let answered = wait_for(&what, DEADLINE, || async {
            match extender.bind(&p, "n1").await {
                Ok(answer) if answer.contains("just started") => None,
                answered => Some(answered),
            }
        });
        Ok(answered.await?.unwrap_or_else(|error| error.to_string()))
    }
    let tasks = pods
        .iter()
        .map(|p| tokio::spawn(bind(extender.clone(), p.clone(), past_hold)));
    tasks.collect()
}

/// Many concurrent binds to one node: each bound pod written once, each refusal naming the
/// node and the GiB, no GPU over-committed.
#[tokio::test]
async fn sixty_four_concurrent_binds() -> anyhow::Result<()> {
    // Sizes 1..=8: 288 GiB asked, 32 GiB there.
    let cycling: Vec<u64> = (0..64).map(|i| i % 8 + 1).collect();
    let cases: [(&str, &[u64], &[u64], _); 2] = [
        ("with room for all", &[4; 64], &[256, 256], 64..=64),
        ("without room", &cycling, &[16, 16], 1..=63),
    ];
    for (case, sizes, gpus, expected) in cases {
        let (server, client) = server_with_node(gpus).await?;
        let pods = create_pods(&client, sizes).await?;
        let extender = Arc::new(Extender::with_grace(client.clone(), 0).await?);
        server.stats().reset();
        let mut bound = 0;
        for task in spawn_binds(&extender, &pods, false) {
            match task.await??.as_str() {
                "" => bound += 1,
                reason => anyhow::ensure!(
                    reason.contains("n1") && reason.contains("GiB"),
                    "{case}: vague refusal: {reason}"
                ),
            }
        }
        assert!(expected.contains(&bound), "{case}: {bound} bound");
        let stats = server.stats();
        let written = (stats.count(Verb::Create, "pods/binding"), stats.writes());
        assert_eq!(written, (bound, bound), "{case}: Bindings and writes");
        check_no_overcommit(&client).await.context(case)?;
        // Every bound pod's allocation annotations parse (`check_no_overcommit` skips those
        // that do not).
        booked(&client).await.context(case)?;
    }
    Ok(())
}

#[tokio::test]
async fn restart_mid_burst_does_not_over_commit() -> anyhow::Result<()> {
    let (server, client) = server_with_node(&[16, 16]).await?;
    let sizes: Vec<u64> = (0..40).map(|i| i % 5 + 1).collect();
    let pods = create_pods(&client, &sizes).await?;
    server.faults().set_latency(Duration::from_millis(5));
    let first = Arc::new(Extender::with_grace(client.clone(), 0).await?);
    let tasks = spawn_binds(&first, &pods[..20], false);
    // Kill it while binds are in flight: once the first Binding landed.
    let stats = server.stats();
    let landed = async {
        while stats.count(Verb::Create, "pods/binding") == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    let landed = tokio::time::timeout(DEADLINE, landed).await;
    landed.context("no bind ever landed")?;
    tasks.iter().for_each(JoinHandle::abort);
    drop(first);
    for task in tasks {
        let _ = task.await;
    }
    // The new instance holds binds briefly after it synced, so Bindings the killed one sent
    // can land first; kube-scheduler retries, and so do these binds.
    let second = Arc::new(Extender::with_grace(client.clone(), 300).await?);
    let held = second.bind(&pods[39], "n1").await?;
    assert!(held.contains("just started"), "held after start: {held}");
    for task in spawn_binds(&second, &pods, true) {
        task.await??;
    }
    server.faults().clear();
    check_no_overcommit(&client).await?;
    assert!(booked(&client).await?.values().sum::<u64>() > 0);
    Ok(())
}

#[tokio::test]
async fn recreated_pod_is_not_confused_with_the_old_one() -> anyhow::Result<()> {
    let (_server, client) = server_with_node(&[16]).await?;
    let old = pod("same").gpu_mem(4).create(&client).await?;
    let extender = Extender::with_grace(client.clone(), 0).await?;
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    pods.delete("same", &DeleteParams::default()).await?;
    let new = pod("same").gpu_mem(4).create(&client).await?;
    assert_ne!(old.metadata.uid, new.metadata.uid);
    // Until the watch shows the new pod, the old UID may still be cached: the API server
    // refuses the stale Binding (UID precondition) and the reservation is released.
    assert!(!extender.bind(&old, "n1").await?.is_empty());
    let bound = || async {
        extender
            .bind(&new, "n1")
            .await
            .ok()?
            .is_empty()
            .then_some(())
    };
    wait_for("the new pod to bind", DEADLINE, bound).await?;
    let answer = extender.bind(&old, "n1").await?;
    let refused = answer.contains("was recreated") || answer.contains("not found");
    assert!(refused, "{answer}");
    extender.settled().await?;
    assert_eq!(booked(&client).await?.get(&("n1".to_owned(), 0)), Some(&4));
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
    let extender = Extender::with_grace(client.clone(), 0).await?;
    Ok((server, client, first, next, extender))
}

/// The pod watch selects unfinished pods only (as kube-scheduler's informer does): a finished
/// pod leaves it as a DELETED event, freeing its GPU, also for an extender started later.
#[tokio::test]
async fn a_finished_pod_leaves_the_watch_and_frees_its_gpu() -> anyhow::Result<()> {
    let (server, client, done, next, extender) = one_gpu_two_pods("done").await?;
    assert_eq!(extender.bind(&done, "n1").await?, "");
    extender.settled().await?;
    assert_eq!(extender.filter(&next, &["n1"]).await.0, json!([]));

    let succeeded = Patch::Merge(json!({"status": {"phase": "Succeeded"}}));
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    pods.patch_status("done", &PatchParams::default(), &succeeded)
        .await?;
    let free =
        || async { (extender.filter(&next, &["n1"]).await.0 == json!(["n1"])).then_some(()) };
    wait_for("the finished pod's GPU to be free", DEADLINE, free).await?;
    let selected = server.stats().field_selectors("pods");
    let unfinished = gpushare_extender::kube_io::watch::UNFINISHED_PODS;
    assert!(selected.iter().any(|s| s == unfinished), "{selected:?}");
    drop(extender);

    // A fresh extender lists the node with its GPU free.
    let extender = Extender::with_grace(client.clone(), 0).await?;
    assert_eq!(extender.bind(&next, "n1").await?, "");
    Ok(())
}

#[tokio::test]
async fn pod_deleted_between_filter_and_bind_releases_the_reservation() -> anyhow::Result<()> {
    let (_server, client, gone, next, extender) = one_gpu_two_pods("gone").await?;
    assert_eq!(extender.filter(&gone, &["n1"]).await.0, json!(["n1"]));
    let pods = Api::<Pod>::default_namespaced(client.clone());
    pods.delete("gone", &DeleteParams::default()).await?;
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
    let extender = Extender::with_grace(client.clone(), 0).await?;
    // A 500 may come after the write was committed: not a reason to hand the memory out.
    server.faults().set_error_rate(Verb::Create, 1.0, 500);
    let answer = extender.bind(&p, "n1").await?;
    let said = ["500", "default/p", "no clear answer"];
    assert!(said.iter().all(|s| answer.contains(s)), "{answer}");
    assert_eq!(extender.inspect("/n1").await?["gpus"][0]["usedGiB"], 8);
    // The server recovers: the extender re-posts the Binding by itself, and the watch shows
    // the pod bound; kube-scheduler's retry to the same node answers success.
    server.faults().clear();
    let pods = Api::default_namespaced(client.clone());
    assert_eq!(wait_bound(&pods, "p").await?, "n1");
    assert_eq!(extender.bind(&p, "n1").await?, "");
    let booked = booked(&client).await?;
    let nodes: BTreeSet<&str> = booked.keys().map(|(n, _)| n.as_str()).collect();
    assert_eq!(nodes, BTreeSet::from(["n1"]));
    Ok(())
}

/// A setting the extender cannot use stops it at start, with an error naming the setting.
#[tokio::test]
async fn a_bad_setting_stops_startup_with_a_clear_error() -> anyhow::Result<()> {
    let server = ApiServer::start().await?;
    let dir = tempfile::tempdir()?;
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "k1:AQEBAQEBAQEBAQEBAQEBAQ==\nk2 no-colon\n")?;
    let keys_path = keys.display().to_string();
    let cases = [
        (
            "a bad certificate path",
            Config {
                tls_cert: Some("/nonexistent/cert.pem".into()),
                tls_key: Some("/nonexistent/key.pem".into()),
                ..Config::default()
            },
            vec!["/nonexistent/cert.pem"],
        ),
        (
            "a malformed keyring",
            Config {
                allocation_keys_file: Some(keys.clone()),
                ..Config::default()
            },
            vec![
                "--allocation-keys-file",
                &keys_path,
                "line 2: expected `id:base64key`",
            ],
        ),
    ];
    for (case, config, said) in cases {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let started = serve(config, server.client(), listener, std::future::pending()).await;
        let error = started.expect_err(case).to_string();
        assert!(said.iter().all(|s| error.contains(s)), "{case}: {error}");
    }
    Ok(())
}
