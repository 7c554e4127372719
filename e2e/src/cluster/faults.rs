//! What a scenario does to a running [`TestCluster`]: the extender killed and restarted in
//! place (once or repeatedly), a device plugin rolled as a DaemonSet rolls it, GPUs marked
//! unhealthy. (Restarts of a plain plugin or of kubelet run on the real cluster.)
//!
//! Separate from starting and stopping the cluster: each fault is a story of its own,
//! written against the same handles.

use std::time::Duration;

use anyhow::{Context, bail, ensure};

use super::node::wait_reregistered;
use super::{RESOURCE, TestCluster};

impl TestCluster {
    /// SIGKILLs the extender, as an OOM kill or a node failure would. The scheduler driver
    /// keeps running and calling the extender's address: its calls fail with a transport
    /// error until [`TestCluster::restart_extender`], and the pods are requeued.
    pub async fn kill_extender(&mut self) {
        if let Some(old) = self.extender.take() {
            old.process.crash().await;
        }
    }

    /// Starts the extender again on the same port (as kubelet restarts the container behind
    /// the same Service) and waits until it is ready.
    pub async fn restart_extender(&mut self) -> anyhow::Result<()> {
        if self.extender.is_some() {
            bail!("the extender is running; kill it first");
        }
        self.start_extender().await
    }

    /// SIGKILLs the extender `times` times, `gap` apart, starting a fresh one on the same port
    /// right after each kill, as kubelet restarts a crashed container: a later kill may hit
    /// the new process while it is still starting up. Returns once the last one is ready.
    pub async fn kill_extender_repeatedly(
        &mut self,
        times: usize,
        gap: Duration,
    ) -> anyhow::Result<()> {
        for round in 0..times {
            let killed_at = tokio::time::Instant::now();
            self.kill_extender().await;
            self.spawn_extender()?;
            if round + 1 < times {
                tokio::time::sleep_until(killed_at + gap).await;
            }
        }
        self.extender
            .as_mut()
            .context("the extender was not started")?
            .wait_ready()
            .await
    }

    /// Rolls a node's device plugin as a DaemonSet rollout does, with the overlap made
    /// certain: the new pod starts while the old one is still shutting down, on the same
    /// socket paths. The old process is frozen (SIGSTOP) with its SIGTERM pending, the new one
    /// started, and the old one resumed only once the new one registered or logged that it
    /// waits for the old one to let go. Fails if the old one's exit took the new one's socket
    /// away.
    pub async fn roll_device_plugin(&mut self, node: &str) -> anyhow::Result<()> {
        let log = self.dir.path().join(format!("device-plugin-{node}.log"));
        let host = self.host();
        let sim = self.nodes.get_mut(node).context("no such node")?;
        let before = sim.kubelet.registrations(RESOURCE);
        let old = sim.plugin.take().context("no device plugin running")?;
        let waits_logged = || {
            let text = std::fs::read(&log).unwrap_or_default();
            String::from_utf8_lossy(&text)
                .matches(gpushare_proto::socket_file::WAITING_FOR_PREDECESSOR)
                .count()
        };
        old.signal("STOP").await;
        old.signal("TERM").await;
        let waits_before = waits_logged();
        let new = host.spawn_plugin(sim)?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while sim.kubelet.registrations(RESOURCE) <= before && waits_logged() == waits_before {
            ensure!(
                tokio::time::Instant::now() < deadline,
                "the new plugin neither registered nor waited for the old one; see {}",
                log.display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        old.signal("CONT").await;
        old.wait_stopped().await;
        sim.plugin = Some(new);
        wait_reregistered(&sim.kubelet, before).await?;
        let socket = sim
            .kubelet
            .plugin_socket(RESOURCE)
            .context("no plugin registered")?;
        ensure!(
            socket.exists(),
            "the old device plugin's exit removed the new one's socket {}",
            socket.display()
        );
        Ok(())
    }

    /// Marks GPUs of a node unhealthy in the simulated backend (empty: all healthy again).
    pub fn set_unhealthy(&self, node: &str, gpus: &[u32]) -> anyhow::Result<()> {
        let sim = self.nodes.get(node).context("no such node")?;
        let list: Vec<String> = gpus.iter().map(u32::to_string).collect();
        std::fs::write(&sim.health_file, list.join(","))?;
        Ok(())
    }
}
