//! High availability: two real `gpushare-extender` replicas behind a round-robin front (the
//! chart's Service), electing a leader over the chart's Lease. Only the leader binds; the
//! follower answers filter and prioritize from its own view and passes binds on.
//!
//! The scenario cuts the leader off from the API server mid-burst (a fault only the in-process
//! API server can make), then checks what a user sees: every pod (they all fit) bound, running
//! and pinned, no GPU over-committed, no reservation left. The time to the new leader's first
//! bind is printed, not asserted. SIGKILLs of the leader and rolling restarts run on the real
//! cluster (`leader_killed_in_a_burst`, `helm_upgrade_in_a_burst` in `e2e/tests/real.rs`).
//! `GPUSHARE_E2E_HA_REFUSE=1` runs the replicas without `--advertise-url` (followers refuse
//! binds), for comparing the two.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, ensure};
use futures::{StreamExt, TryStreamExt};
use gpushare_e2e::cluster::{
    ClusterSpec, EXTENDER_USER, Extender, TestCluster, free_port, http_get, wait_for,
};
use gpushare_e2e::front::Front;
use gpushare_e2e::scenarios::{
    allocation, check_no_overcommit, check_pinned, create_gpu_pod, phase,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;

use crate::bursts::{PodWatch, node_of, reservations_left, reserved_in};

/// One HA cluster at a time: each runs 2 extenders and 8 device plugins.
static SLOT: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);

const NODES: usize = 8;
const GPUS: [u64; 2] = [16, 16];
const REPLICAS: usize = 2;
/// The Lease, as the chart names it here (`--leader-lease`, `POD_NAMESPACE`).
const LEASE: &str = "gpushare-extender";
const LEASE_NAMESPACE: &str = "kube-system";
/// How long every pod gets to be bound and running after the last fault.
const DRAIN: Duration = Duration::from_secs(60);
/// How long a new leader gets to bind after a fault before the test gives up.
const FAILOVER_LIMIT: Duration = Duration::from_secs(30);

/// One extender replica: a pod of the chart's Deployment.
struct Replica {
    name: String,
    ports: (u16, u16),
    kubeconfig: PathBuf,
    /// Its API token: cutting it off is the partition.
    token: String,
    extender: Option<Extender>,
}

/// The cluster, the replicas and their front.
struct Ha {
    cluster: TestCluster,
    _front: Arc<Front>,
    replicas: Vec<Replica>,
    endpoints: tokio::task::JoinHandle<()>,
}

impl Ha {
    async fn start() -> anyhow::Result<Self> {
        let spec = ClusterSpec::uniform(NODES, &GPUS).with_http_timeout(Duration::from_secs(5));
        let mut cluster = TestCluster::start(spec).await?;
        // The cluster's single extender makes way for the replicas and their front, on the
        // port the scheduler driver calls.
        cluster.kill_extender().await;
        let service = SocketAddr::from(([127, 0, 0, 1], cluster.extender_port()));
        let front = Arc::new(Front::start(service, Vec::new()).await?);
        let mut taken = BTreeSet::from([cluster.extender_port()]);
        let mut port = || -> anyhow::Result<u16> {
            loop {
                let port = free_port()?;
                if taken.insert(port) {
                    return Ok(port);
                }
            }
        };
        let mut replicas = Vec::new();
        for i in 0..REPLICAS {
            let (yaml, token) = cluster.api.kubeconfig_yaml_and_token_as(EXTENDER_USER);
            let kubeconfig = cluster.log_dir().join(format!("replica-{i}.kubeconfig"));
            std::fs::write(&kubeconfig, yaml)?;
            let (name, ports) = (format!("gpushare-extender-{i}"), (port()?, port()?));
            replicas.push(Replica {
                name,
                ports,
                kubeconfig,
                token,
                extender: None,
            });
        }
        let ports = replicas.iter().map(|r| r.ports).collect();
        let endpoints = tokio::spawn(endpoints(front.clone(), ports));
        let mut ha = Self {
            cluster,
            _front: front,
            replicas,
            endpoints,
        };
        (0..REPLICAS).try_for_each(|i| ha.spawn(i))?;
        for i in 0..REPLICAS {
            ha.wait_ready(i).await?;
        }
        Ok(ha)
    }

    /// Starts replica `i` as the chart does (without waiting for it).
    fn spawn(&mut self, i: usize) -> anyhow::Result<()> {
        let (r, cluster) = (&self.replicas[i], &self.cluster);
        let ca = cluster.extender_ca_file();
        let mut args = vec![
            "--leader-elect=true".to_owned(),
            format!("--pod-name={}", r.name),
            format!("--leader-forward-ca={}", ca.display()),
        ];
        if std::env::var_os("GPUSHARE_E2E_HA_REFUSE").is_none() {
            args.push(format!("--advertise-url=https://127.0.0.1:{}", r.ports.0));
        }
        let extender = cluster.spawn_extender_replica(&r.name, &r.kubeconfig, r.ports, &args)?;
        self.replicas[i].extender = Some(extender);
        Ok(())
    }

    async fn wait_ready(&mut self, i: usize) -> anyhow::Result<()> {
        let extender = self.replicas[i].extender.as_mut();
        extender.context("replica not started")?.wait_ready().await
    }

    fn running(&self, i: usize) -> anyhow::Result<&Extender> {
        self.replicas[i]
            .extender
            .as_ref()
            .context("replica not running")
    }

    /// SIGKILL, as an OOM kill or a node failure would.
    async fn kill(&mut self, i: usize) {
        if let Some(extender) = self.replicas[i].extender.take() {
            extender.process.crash().await;
        }
    }

    /// The replica holding the Lease, by the pod name in its `holderIdentity`.
    async fn leader(&self) -> Option<usize> {
        let leases: Api<Lease> = Api::namespaced(self.cluster.client.clone(), LEASE_NAMESPACE);
        let holder = leases.get_opt(LEASE).await.ok()??.spec?.holder_identity?;
        let pod = holder
            .rsplit_once('_')
            .map_or(holder.as_str(), |(pod, _)| pod);
        self.replicas.iter().position(|r| r.name == pod)
    }

    /// Waits for a leader other than `not`.
    async fn wait_leader(&self, not: Option<usize>) -> anyhow::Result<usize> {
        wait_for("a leader", FAILOVER_LIMIT, || async {
            self.leader().await.filter(|&i| Some(i) != not)
        })
        .await
    }

    async fn metrics(&self, i: usize) -> anyhow::Result<String> {
        let (status, body) = self.running(i)?.get_health("/metrics").await?;
        ensure!(status == 200, "/metrics answered {status}");
        Ok(body)
    }

    /// Bind outcomes the running replicas counted (since their last start), by reason.
    async fn bind_counts(&self) -> String {
        let mut counts = BTreeMap::<String, u64>::new();
        for i in 0..REPLICAS {
            let text = self.metrics(i).await.unwrap_or_default();
            for line in text.lines() {
                if let Some(rest) = line.strip_prefix("gpushare_extender_binds_total{reason=\"")
                    && let Some((reason, value)) = rest.split_once("\"} ")
                {
                    let value = value.trim().parse::<u64>().unwrap_or(0);
                    *counts.entry(reason.to_owned()).or_default() += value;
                }
            }
        }
        let counts: Vec<String> = counts.iter().map(|(r, n)| format!("{r}={n}")).collect();
        counts.join(" ")
    }

    /// Pods a running replica still shows as reserved by a bind.
    async fn reserved(&self) -> anyhow::Result<Vec<String>> {
        let mut out = Vec::new();
        for extender in self.replicas.iter().filter_map(|r| r.extender.as_ref()) {
            reserved_in(&extender.inspect().await?, &mut out);
        }
        Ok(out)
    }
}

/// The Service's endpoints: every 500 ms, the replicas whose `/readyz` answers 200 (all of
/// them when none does, so that an outage shows as failed calls, not as no calls).
async fn endpoints(front: Arc<Front>, ports: Vec<(u16, u16)>) {
    let local = |port| SocketAddr::from(([127, 0, 0, 1], port));
    loop {
        let mut ready = Vec::new();
        for &(port, monitor) in &ports {
            if matches!(http_get(local(monitor), "/readyz").await, Ok((200, _))) {
                ready.push(local(port));
            }
        }
        if ready.is_empty() {
            ready = ports.iter().map(|&(port, _)| local(port)).collect();
        }
        front.set_backends(ready);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

impl PodWatch {
    /// Time from `since` until a pod shows up bound with a decision made after `wall` (so by
    /// a replica alive after the fault, not a Binding the old leader sent before it).
    async fn first_bind_after(
        &self,
        wall: jiff::Timestamp,
        since: tokio::time::Instant,
    ) -> anyhow::Result<Duration> {
        let decided_after = |p: &Pod| {
            let time = allocation(p)
                .ok()?
                .bind_time
                .parse::<jiff::Timestamp>()
                .ok()?;
            Some(node_of(p).is_some() && time > wall)
        };
        wait_for("a bind after the fault", FAILOVER_LIMIT, || async {
            (self.pods().iter().any(|p| decided_after(p) == Some(true))).then(|| since.elapsed())
        })
        .await
    }
}

/// Watches the pods, waits for a leader, creates 80 pods at once (16 requests in flight;
/// 180 GiB of 256, so every one fits) and waits until 20 are bound: the moment of the fault.
async fn mid_burst(ha: &Ha) -> anyhow::Result<(PodWatch, usize)> {
    let watch = PodWatch::start(&ha.cluster.client).await?;
    let leader = ha.wait_leader(None).await?;
    let create = |i: usize| {
        let gib = [1, 2, 2, 4][i % 4];
        async move { create_gpu_pod(&ha.cluster, &format!("burst-{i}-{gib}g"), gib).await }
    };
    let created = futures::stream::iter(0..80).map(create);
    created.buffer_unordered(16).try_collect::<Vec<_>>().await?;
    wait_for("20 pods bound", Duration::from_secs(60), || async {
        (watch.bound() >= 20).then_some(())
    })
    .await?;
    Ok((watch, leader))
}

/// Every pod bound, running and pinned; no GPU over-committed; no reservation left.
async fn drain_and_check(test: &str, ha: &Ha, watch: &PodWatch) -> anyhow::Result<()> {
    let started = tokio::time::Instant::now();
    let done = wait_for("every pod bound and running", DRAIN, || async {
        let pods = watch.pods();
        pods.iter()
            .all(|p| phase(p) == "Running")
            .then_some(pods.len())
    })
    .await;
    let pods = watch.pods();
    let waiting: Vec<String> = (pods.iter().filter(|p| phase(p) != "Running").take(5))
        .map(|p| {
            let name = p.metadata.name.as_deref().unwrap_or("?");
            format!("{name} ({}, node {:?})", phase(p), node_of(p))
        })
        .collect();
    let total = done.with_context(|| format!("not every pod runs; first waiting: {waiting:?}"))?;
    eprintln!(
        "[{test}] all {total} pods bound and running {:.1?} after the last fault; binds by reason (running replicas, since their start): {}",
        started.elapsed(),
        ha.bind_counts().await
    );
    check_no_overcommit(&ha.cluster.client).await?;
    for pod in &pods {
        check_pinned(&ha.cluster, pod).await?;
    }
    let reserved = reservations_left(Duration::from_secs(10), async || ha.reserved().await).await?;
    ensure!(
        reserved.is_empty(),
        "a replica still holds reservations for bound pods: {reserved:?}"
    );
    Ok(())
}

/// Runs `body` on a fresh HA cluster; on failure prints the tail of every log.
async fn with_ha(body: impl AsyncFnOnce(&mut Ha) -> anyhow::Result<()>) -> anyhow::Result<()> {
    let _slot = SLOT.acquire().await?;
    let mut ha = Ha::start().await?;
    let result = body(&mut ha).await;
    if result.is_err() {
        eprintln!("{}", ha.cluster.log_tail(40));
    }
    ha.endpoints.abort();
    for i in 0..REPLICAS {
        ha.kill(i).await;
    }
    ha.cluster.shutdown().await;
    result
}

/// What `kubectl gpushare doctor` prints about this cluster.
async fn doctor_says(ha: &Ha) -> anyhow::Result<String> {
    use kubectl_gpushare::doctor::{self, Install, Snapshot};
    let kubeconfig = Some(ha.cluster.kubeconfig());
    let cluster = kubectl_gpushare::cluster::Cluster::connect(kubeconfig).await?;
    let install = Install {
        namespace: LEASE_NAMESPACE.to_owned(),
        extender_service: LEASE.to_owned(),
        scheduler_name: "gpushare-scheduler".to_owned(),
    };
    let leader = Some(cluster.extender_lease(&install).await);
    let snapshot = Snapshot {
        leader,
        ..Snapshot::default()
    };
    let settings = kubectl_gpushare::usage::Settings::default();
    let diagnosis = doctor::diagnose(&snapshot, &settings, &install);
    Ok(doctor::render(&diagnosis))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_the_api_server_stops_binding_and_is_replaced() -> anyhow::Result<()>
{
    let test = "a_leader_cut_off_from_the_api_server_stops_binding_and_is_replaced";
    with_ha(async |ha| {
        let (watch, leader) = mid_burst(ha).await?;
        let (faults, token) = (ha.cluster.api.faults(), &ha.replicas[leader].token);
        faults.cut(token);
        let (wall, cut) = (jiff::Timestamp::now(), tokio::time::Instant::now());
        let result = async {
            let new = ha.wait_leader(Some(leader)).await?;
            let first = watch.first_bind_after(wall, cut).await?;
            let (old, new) = (&ha.replicas[leader].name, &ha.replicas[new].name);
            eprintln!(
                "[{test}] leader {old} cut off with {} of 80 bound: {new} took over, first bind {first:.2?} after the cut",
                watch.bound(),
            );
            // `kubectl gpushare doctor` reads the Lease and names the replica that leads.
            let doctor = doctor_says(ha).await?;
            let leads = format!("[OK]   extender replica {new} leads");
            ensure!(doctor.contains(&leads), "{doctor}");
            // The cut-off replica knows it no longer leads, and leaves the Service.
            wait_for("the cut-off replica to stop leading", FAILOVER_LIMIT, || async {
                let metrics = ha.metrics(leader).await.ok()?;
                metrics.lines().any(|l| l == "gpushare_extender_leader 0").then_some(())
            })
            .await?;
            let extender = ha.running(leader).context("the cut-off replica died")?;
            wait_for("the cut-off replica to be unready", FAILOVER_LIMIT, || async {
                matches!(extender.get_health("/readyz").await, Ok((503, _))).then_some(())
            })
            .await?;
            anyhow::Ok(())
        }
        .await;
        faults.heal(token);
        result?;
        drain_and_check(test, ha, &watch).await
    })
    .await
}
