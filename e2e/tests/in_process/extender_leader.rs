//! Two extenders electing a leader, run in-process as in production (watches, HTTP on
//! 127.0.0.1:0, the Lease), against gpushare-e2e's in-process API server: only the leader
//! binds, a follower passes kube-scheduler's bind on to it, and never a bind that was itself
//! passed on.

use std::time::Duration;

use gpushare_e2e::apiserver::{ApiServer, Verb};
use gpushare_e2e::cluster::{http_get, http_post_json, wait_for};
use gpushare_extender::Config;
use gpushare_extender::leader::{ElectionConfig, Gate, Leadership, LeaseTiming, identity, run};
use gpushare_extender::metrics::Metrics;
use gpushare_testkit::fixtures::{node, pod};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::served::{PREFIX, Served as Replica, bind_body};

/// How long a test waits for what should come.
const WAIT: Duration = Duration::from_secs(20);

impl Replica {
    /// Starts replica `name`, the rest of its configuration from `base`, on `listener`
    /// (127.0.0.1:0 if none).
    async fn electing(
        client: &kube::Client,
        name: &str,
        base: Config,
        listener: Option<tokio::net::TcpListener>,
    ) -> anyhow::Result<Self> {
        Replica::serve(client, listener, |addr| Config {
            bind_grace_ms: 0,
            leader_elect: true,
            pod_name: name.to_owned(),
            advertise_url: Some(format!("http://{addr}")),
            ..base
        })
        .await
    }

    async fn leads(&self) -> bool {
        http_get(self.addr, "/metrics")
            .await
            .is_ok_and(|(_, body)| body.lines().any(|l| l == "gpushare_extender_leader 1"))
    }

    async fn bind_count(&self, reason: &str) -> u64 {
        let (_, body) = http_get(self.addr, "/metrics").await.unwrap();
        let prefix = format!("gpushare_extender_binds_total{{reason=\"{reason}\"}} ");
        body.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .map_or(0, |n| n.trim().parse().unwrap())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leader_binds_and_a_follower_passes_binds_on() -> anyhow::Result<()> {
    let server = ApiServer::start().await?;
    let client = server.client();
    node("n1").gpushare().gpus(&[16]).create(&client).await?;
    for name in ["p0", "p1"] {
        pod(name).gpu_mem(4).create(&client).await?;
    }
    let a = Replica::electing(&client, "extender-a", Config::default(), None).await?;
    let b = Replica::electing(&client, "extender-b", Config::default(), None).await?;
    let (leader, follower) = wait_for("a leader", WAIT, || async {
        match (a.leads().await, b.leads().await) {
            (true, false) => Some((&a, &b)),
            (false, true) => Some((&b, &a)),
            _ => None,
        }
    })
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    // The leader's catch-up after acquiring: binds are refused (retryably) until it is over.
    let p0 = pods.get("p0").await?;
    let (path, body) = (format!("{PREFIX}/bind"), bind_body(&p0, "n1").to_string());
    let passed_on = "the follower to pass a bind on";
    let answer = wait_for(passed_on, Duration::from_secs(10), || async {
        let (status, body) = http_post_json(follower.addr, &path, &body).await.ok()?;
        assert_eq!(status, 200);
        let value: serde_json::Value = serde_json::from_str(&body).ok()?;
        let error = value["Error"].as_str().unwrap_or_default().to_owned();
        (!error.contains("just took over")).then_some(error)
    })
    .await?;
    assert_eq!(answer, "", "the leader bound it");
    let bound = pods.get("p0").await?;
    assert_eq!(bound.spec.unwrap().node_name.as_deref(), Some("n1"));
    // Every call passed on and answered counts, the refusals during the catch-up too.
    assert!(follower.bind_count("forwarded").await >= 1);
    assert_eq!(leader.bind_count("bound").await, 1);
    assert_eq!(follower.bind_count("bound").await, 0);

    // A bind that was itself passed on is not passed on again: refused, and the connection
    // closed so the scheduler's retry may reach another replica.
    server.stats().reset();
    let p1 = pods.get("p1").await?;
    let body = bind_body(&p1, "n1").to_string();
    let request = format!(
        "POST {PREFIX}/bind HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nx-gpushare-forwarded: 1\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut stream = tokio::net::TcpStream::connect(follower.addr).await?;
    stream.write_all(request.as_bytes()).await?;
    let mut answer = String::new();
    // Read to the end: the follower closes the connection after its answer.
    stream.read_to_string(&mut answer).await?;
    let lower = answer.to_ascii_lowercase();
    assert!(lower.contains("connection: close"), "{answer}");
    assert!(answer.contains("does not lead"), "{answer}");
    assert_eq!(server.stats().count(Verb::Create, "pods/binding"), 0);
    assert_eq!(follower.bind_count("not_leader").await, 1);
    server.shutdown().await;
    Ok(())
}

/// The leader renews by writing its last Lease back (compare-and-swap on its own last
/// resourceVersion), not reading it first: one call per renewal, so a slow API server does not
/// push it past its deadline. After someone else's change the write gets a 409 and the round
/// reads the Lease instead: the leader keeps leading.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_renews_with_one_write_and_reads_only_after_a_conflict() -> anyhow::Result<()> {
    use k8s_openapi::api::coordination::v1::Lease;

    let server = ApiServer::start().await?;
    let client = server.client();
    node("n1").gpushare().gpus(&[16]).create(&client).await?;
    let only = Replica::electing(&client, "extender-a", Config::default(), None).await?;
    wait_for("it to lead", WAIT, || async {
        only.leads().await.then_some(())
    })
    .await?;
    // At least `n` calls of `verb` to the Lease since the last reset.
    let calls = |verb, n| {
        let stats = server.stats();
        async move { (stats.count(verb, "leases") >= n).then_some(()) }
    };
    server.stats().reset();
    wait_for("three renewals", WAIT, || calls(Verb::Update, 3)).await?;
    let reads = server.stats().count(Verb::Get, "leases");
    assert_eq!(
        reads, 0,
        "the leader read the Lease {reads} times to renew it"
    );

    // Someone else writes the Lease: the next optimistic renewal conflicts, the round reads.
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-system");
    let mut lease = leases.get("gpushare-extender").await?;
    let labels = lease.metadata.labels.get_or_insert_with(Default::default);
    labels.insert("touched".into(), "yes".into());
    leases
        .replace("gpushare-extender", &Default::default(), &lease)
        .await?;
    server.stats().reset();
    wait_for("a read after the conflict", WAIT, || calls(Verb::Get, 1)).await?;
    // The round that read renews from what it read; the renewals after it write again.
    wait_for("renewals after the conflict", WAIT, || {
        calls(Verb::Update, 2)
    })
    .await?;
    assert!(only.leads().await, "the conflict cost the leadership");
    Ok(())
}

/// A leader whose process is gone loses the Lease before its 10 s record expires: when its
/// address refuses connections, and when another process serves there (the container
/// restarted in the same pod) and answers `/identity` with an identity not the holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_of_a_leader_whose_process_is_gone_is_taken_over_at_once() -> anyhow::Result<()> {
    let server = ApiServer::start().await?;
    let client = server.client();
    let long_lease = || Config {
        leader_lease_duration_ms: 10_000,
        leader_renew_deadline_ms: 8_000,
        ..Config::default()
    };
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), "kube-system");
    let mut replicas = vec![
        Replica::electing(&client, "extender-a", long_lease(), None).await?,
        Replica::electing(&client, "extender-b", long_lease(), None).await?,
    ];
    for restart_in_place in [false, true] {
        let leader = wait_for("a leader", WAIT, || async {
            let mut leading = Vec::new();
            for (i, replica) in replicas.iter().enumerate() {
                if replica.leads().await {
                    leading.push(i);
                }
            }
            (leading.len() == 1).then(|| leading[0])
        })
        .await?;
        let before = leases.get("gpushare-extender").await?.spec.unwrap();
        // Killed: its task, its listener and its API connections end at once, nothing
        // released.
        let dead = replicas.remove(leader);
        let addr = dead.addr;
        drop(dead);
        if restart_in_place {
            // The aborted tasks let go of the address a moment later.
            let listener = wait_for("the address to be free", Duration::from_secs(5), || async {
                tokio::net::TcpListener::bind(addr).await.ok()
            })
            .await?;
            let restarted = Replica::electing(&client, "extender-a", long_lease(), Some(listener));
            replicas.push(restarted.await?);
        }
        let after = wait_for("another holder", Duration::from_secs(8), || async {
            let spec = leases.get("gpushare-extender").await.ok()?.spec?;
            (spec.holder_identity != before.holder_identity).then_some(spec)
        })
        .await?;
        let case = format!("restarted in place: {restart_in_place}");
        let transitions = before.lease_transitions.map(|n| n + 1);
        assert_eq!(after.lease_transitions, transitions, "{case}");
        // Taken while the dead leader's last renewal was still valid.
        let lasts = i64::from(before.lease_duration_seconds.unwrap());
        let valid_until = before.renew_time.unwrap().0 + jiff::SignedDuration::from_secs(lasts);
        let acquired = after.acquire_time.unwrap().0;
        let late =
            format!("taken over at {acquired}, after the old lease expired at {valid_until}");
        assert!(acquired < valid_until, "{case}: {late}");
    }
    server.shutdown().await;
    Ok(())
}

/// Two replicas on the in-process API server: one leads; when it stops it hands the
/// Lease over, and the other leads. The lease lasts 30 s, so the other can only lead
/// within the test's 10 s if the Lease was released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_two_leads_and_a_graceful_stop_hands_the_lease_over() {
    let api = ApiServer::start().await.unwrap();
    let timing = LeaseTiming {
        duration: Duration::from_secs(30),
        renew_deadline: Duration::from_secs(20),
        retry_period: Duration::from_millis(100),
        catch_up: Duration::ZERO,
    };
    let start = |name: &str| {
        let leadership = Leadership::default();
        leadership.elect(timing, name);
        let stop = CancellationToken::new();
        let config = ElectionConfig {
            holder_probe: None,
            probe_after: Duration::ZERO,
            namespace: "kube-system".into(),
            lease_name: "gpushare-extender".into(),
            identity: identity(name),
            url: Some(format!("https://{name}:39999")),
            url_annotation: "gpushare.example.com/leader-url".into(),
            timing,
        };
        let metrics = Metrics::register(&mut prometheus_client::registry::Registry::default());
        let running = run(
            api.client(),
            config,
            leadership.clone(),
            metrics,
            stop.clone(),
        );
        (leadership, stop, tokio::spawn(running))
    };
    let (a, stop_a, task_a) = start("a");
    let (b, stop_b, _task_b) = start("b");
    // Until one leads and the other knows where to pass binds, never both lead.
    let knows_the_leader = |follower: &Leadership| {
        let gate = follower.gate(Instant::now(), Duration::from_secs(1));
        matches!(gate, Gate::Forward { .. })
    };
    let ten_seconds = Duration::from_secs(10);
    let (leader, follower, stop_leader) = wait_for("a known leader", ten_seconds, || async {
        let (a_leads, b_leads) = (a.is_leader(), b.is_leader());
        assert!(!(a_leads && b_leads), "both replicas lead");
        let known = (
            a_leads && knows_the_leader(&b),
            b_leads && knows_the_leader(&a),
        );
        match known {
            (true, _) => Some((&a, &b, &stop_a)),
            (_, true) => Some((&b, &a, &stop_b)),
            _ => None,
        }
    })
    .await
    .unwrap();
    stop_leader.cancel();
    let follower_leads = || async { follower.is_leader().then_some(()) };
    let _ = wait_for("the follower to lead", ten_seconds, follower_leads).await;
    assert!(follower.is_leader() && !leader.is_leader());
    assert_eq!(follower.term(Instant::now()), Some(1));
    drop(task_a);
    api.shutdown().await;
}
