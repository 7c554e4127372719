//! The checks `realload --resident N` runs once the chart has bound a cluster's worth of pods:
//! how long a restarted extender takes from its start to Ready, and how long binding stops
//! when the leader is killed mid-drain. Measured from outside: Ready is the replica's
//! `/readyz` answering 200, the start the new process's own in `/proc`, so neither kubelet's
//! restart delay nor the probe period is in the figure.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};

use super::KitCluster;
use super::drain_cost::{BindClock, container_pid, stat_field};
use crate::cluster::{http_get, wait_for};

/// The chart's `extender.monitorPort` default: `/readyz` over plain HTTP.
pub(super) const EXTENDER_MONITOR_PORT: u16 = 9090;

/// The pod name of the extender Lease's holder (`<pod>_<suffix>`).
pub fn leader_pod(cluster: &KitCluster) -> anyhow::Result<String> {
    let holder = cluster.extender_lease_holder()?;
    ensure!(!holder.is_empty(), "no extender holds the Lease");
    let (pod, _) = holder.rsplit_once('_').unwrap_or((&holder, ""));
    Ok(pod.to_owned())
}

/// The host pid of `pod`'s extender container (its latest start).
fn extender_pid(cluster: &KitCluster, pod: &str) -> Option<u32> {
    container_pid(cluster, pod, "extender")
}

/// SIGKILLs `pod`'s extender, waits until kubelet has started it again and its `/readyz`
/// answers 200, and returns the seconds from the new process's start to that answer.
pub async fn restart_to_ready(cluster: &KitCluster, pod: &str) -> anyhow::Result<f64> {
    let old = extender_pid(cluster, pod).with_context(|| format!("no host pid for {pod}"))?;
    let ip = (cluster.system_pod_ip(pod).await?).with_context(|| format!("{pod} has no pod IP"))?;
    let readyz: SocketAddr = format!("{ip}:{EXTENDER_MONITOR_PORT}").parse()?;
    kill(old)?;
    let what = format!("kubelet to start {pod}'s extender again");
    let new = wait_for(&what, Duration::from_secs(180), || async {
        extender_pid(cluster, pod).filter(|pid| *pid != old)
    })
    .await?;
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        if matches!(http_get(readyz, "/readyz").await, Ok((200, _))) {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "{pod}'s extender not Ready 180 s after its restart"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ready_at = seconds_since_boot()?;
    Ok(ready_at - process_start(new)?)
}

/// What a leader kill in the middle of a drain cost.
#[derive(Debug, Clone, Copy)]
pub struct Takeover {
    pub killed_at_pods: usize,
    /// Seconds from the kill until another replica held the Lease.
    pub lease_s: f64,
    /// Seconds from the kill until a pod was bound after that takeover.
    pub resumed_s: f64,
}

/// The extender replica to kill: who held the Lease, its pod and its host pid, read before
/// the drain starts (the kubectl calls take longer than a small drain does).
#[derive(Debug, Clone)]
pub struct Leader {
    holder: String,
    pid: u32,
}

impl Leader {
    /// The Lease's holder now.
    pub fn find(cluster: &KitCluster) -> anyhow::Result<Self> {
        let holder = cluster.extender_lease_holder()?;
        let pod = leader_pod(cluster)?;
        let pid = extender_pid(cluster, &pod).with_context(|| format!("no pid for {pod}"))?;
        Ok(Leader { holder, pid })
    }

    /// SIGKILLs the leader and waits (30 s at most) until another replica holds the Lease;
    /// returns the moment of the kill.
    pub async fn kill(&self, cluster: &KitCluster) -> anyhow::Result<Instant> {
        let killed = Instant::now();
        kill(self.pid)?;
        let what = "another replica to take the Lease";
        wait_for(what, Duration::from_secs(30), || async {
            let now = cluster.extender_lease_holder().ok()?;
            (!now.is_empty() && now != self.holder).then_some(())
        })
        .await?;
        Ok(killed)
    }
}

/// Once `clock` has seen `after_pods` of the drain's `pods` bound, SIGKILLs `leader`; waits
/// until another replica holds the Lease and binds a pod. A bind the dead leader wrote just
/// before dying does not count: only binds seen after the takeover do.
pub async fn kill_leader_after(
    cluster: &KitCluster,
    clock: Arc<BindClock>,
    leader: Leader,
    after_pods: usize,
    pods: usize,
) -> anyhow::Result<Takeover> {
    let what = format!("{after_pods} binds before the leader kill");
    wait_for(&what, Duration::from_secs(600), || async {
        (clock.count() >= after_pods).then_some(())
    })
    .await?;
    let killed_at_pods = clock.count();
    ensure!(
        killed_at_pods < pods,
        "all {pods} pods were bound before the leader kill: drain a larger backlog"
    );
    let killed = leader.kill(cluster).await?;
    let lease_s = killed.elapsed().as_secs_f64();
    let at_takeover = clock.count();
    wait_for("binding to resume", Duration::from_secs(60), || async {
        (clock.count() > at_takeover).then_some(())
    })
    .await
    .with_context(|| {
        let now = clock.count();
        format!("{killed_at_pods} pods bound when the leader was killed, {at_takeover} at the takeover, {now} now")
    })?;
    Ok(Takeover {
        killed_at_pods,
        lease_s,
        resumed_s: killed.elapsed().as_secs_f64(),
    })
}

fn kill(pid: u32) -> anyhow::Result<()> {
    let status = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()?;
    ensure!(status.success(), "kill -9 {pid}: {status}");
    Ok(())
}

/// `/proc/uptime`'s first field.
fn seconds_since_boot() -> anyhow::Result<f64> {
    let uptime = std::fs::read_to_string("/proc/uptime")?;
    uptime
        .split_whitespace()
        .next()
        .and_then(|s| s.parse().ok())
        .context("unreadable /proc/uptime")
}

/// When `pid` started, in seconds since boot (`starttime`, field 22 of `/proc/<pid>/stat`).
fn process_start(pid: u32) -> anyhow::Result<f64> {
    let ticks = stat_field(pid, 22).with_context(|| format!("no start time for pid {pid}"))?;
    Ok(ticks / 100.0)
}
