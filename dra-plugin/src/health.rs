//! GPU health in DRA mode: a GPU that turns unhealthy stops being offered to new claims.
//!
//! ```text
//!  backend.watch_health (blocking thread) ──(index, healthy)──▶ Health::run
//!     GPU's health changed ─▶ slice::publish (taint, or withdraw where taints are dropped)
//!     our slice deleted    ─▶ slice::publish (kubelet deletes its node's slices at start)
//!     the write failed     ─▶ retried every RETRY until it lands
//! ```
//!
//! The claims already on the GPU keep their allocation and their pods keep running, as in
//! the device plugin's mode: kube-scheduler only stops choosing the device. The backend is
//! the device plugin's, so NVML's critical XID events and the simulated health file mean
//! the same here.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use gpushare_contract::GpuInfo;
use gpushare_runtime::gpu::GpuBackend;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::slice::{self, Published, Unhealthy};

/// How soon a failed slice write is tried again.
const RETRY: Duration = Duration::from_secs(1);

/// Follows the GPUs' health and keeps the node's slice in step.
pub struct Health {
    /// Where health comes from.
    pub backend: Arc<dyn GpuBackend>,
    /// The slices API.
    pub slices: Api<ResourceSlice>,
    /// This node.
    pub node: String,
    /// The driver name.
    pub driver: String,
    /// The GPUs as published at start (all healthy).
    pub gpus: Vec<GpuInfo>,
}

/// Applies a health report; true when it changed something.
pub fn apply(gpus: &mut [GpuInfo], index: u32, healthy: bool) -> bool {
    match gpus.iter_mut().find(|gpu| gpu.index == index) {
        Some(gpu) if gpu.healthy != healthy => {
            gpu.healthy = healthy;
            true
        }
        _ => false,
    }
}

impl Health {
    /// Runs until `stop`. A backend that can no longer watch health is logged, and the
    /// slice stays as it was last published.
    pub async fn run(mut self, stop: CancellationToken) {
        /// Stops the blocking loop however this future ends.
        struct StopOnDrop(Arc<AtomicBool>);
        impl Drop for StopOnDrop {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let halt = Arc::new(AtomicBool::new(false));
        let _guard = StopOnDrop(halt.clone());
        let (reports, mut received) = mpsc::unbounded_channel();
        let backend = self.backend.clone();
        let blocking_halt = halt.clone();
        let mut health_watch = tokio::task::spawn_blocking(move || {
            backend.watch_health(&blocking_halt, &mut |index, healthy| {
                let _ = reports.send((index, healthy));
            })
        });
        let mut watching = true;
        let mut open = true;
        let mut unhealthy = Unhealthy::Taint;
        let mut dirty = false;
        // Our own slice, watched: kubelet deletes every ResourceSlice of its node when it
        // starts (and a driver's slices once it has been gone a while), so a kubelet restart
        // would leave the node offering nothing (seen on the real cluster: "cannot allocate
        // all claims" for every new pod). A deletion, or a relist that no longer finds the
        // slice, publishes it again. Updates are not acted on: the slice is ours, and
        // re-checking our own writes could loop on a field the API server normalizes.
        let name = slice::slice_name(&self.node, &self.driver);
        let mut slice_events = watcher(
            self.slices.clone(),
            watcher::Config::default().fields(&format!("metadata.name={name}")),
        )
        .default_backoff()
        .boxed();
        let mut in_relist = false;
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                event = slice_events.next() => match event {
                    Some(Ok(watcher::Event::Delete(_))) => {
                        tracing::warn!(slice = %name, "our ResourceSlice was deleted (kubelet deletes its node's slices when it starts); publishing it again");
                        dirty = true;
                    }
                    Some(Ok(watcher::Event::Init)) => in_relist = false,
                    Some(Ok(watcher::Event::InitApply(_))) => in_relist = true,
                    Some(Ok(watcher::Event::InitDone)) if !in_relist => {
                        tracing::warn!(slice = %name, "our ResourceSlice is gone; publishing it again");
                        dirty = true;
                    }
                    Some(Ok(_)) => {}
                    Some(Err(error)) => tracing::debug!(%error, "watching our ResourceSlice; retrying"),
                    // The backoff keeps the watch going for as long as it is polled.
                    None => {}
                },
                report = received.recv(), if open => match report {
                    Some((index, healthy)) => {
                        if apply(&mut self.gpus, index, healthy) {
                            if healthy {
                                tracing::info!(gpu = index, "GPU is healthy again; offering it to claims");
                            } else {
                                tracing::warn!(gpu = index, "GPU is unhealthy; no new claim gets it");
                            }
                            dirty = true;
                        }
                    }
                    // The watcher ended (see below): no more reports.
                    None => open = false,
                },
                ended = &mut health_watch, if watching => {
                    watching = false;
                    match ended {
                        Ok(Ok(())) => {}
                        Ok(Err(error)) => tracing::error!(%error, "GPU health can no longer be watched; the slice keeps the health last seen"),
                        Err(join) => tracing::error!(error = %join, "the GPU health watch crashed; the slice keeps the health last seen"),
                    }
                }
                () = tokio::time::sleep(RETRY), if dirty => {}
            }
            if dirty {
                dirty = !self.publish(&mut unhealthy).await;
            }
        }
    }

    /// Publishes the slice; false when it must be tried again.
    async fn publish(&self, unhealthy: &mut Unhealthy) -> bool {
        match slice::publish(
            &self.slices,
            &self.node,
            &self.driver,
            &self.gpus,
            *unhealthy,
        )
        .await
        {
            Ok(Published::AsBuilt) => true,
            Ok(Published::TaintsDropped) => {
                *unhealthy = Unhealthy::Withdraw;
                false
            }
            Err(error) => {
                tracing::warn!(node = %self.node, %error, "updating the ResourceSlice after a health change failed; retrying");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_changes_count() {
        let mut gpus = vec![GpuInfo {
            index: 3,
            uuid: "GPU-3".into(),
            model: "T4".into(),
            mem_gib: 16,
            healthy: true,
            numa_node: None,
        }];
        assert!(!apply(&mut gpus, 3, true));
        assert!(
            !apply(&mut gpus, 9, false),
            "an unknown GPU changes nothing"
        );
        assert!(apply(&mut gpus, 3, false));
        assert!(!gpus[0].healthy);
        assert!(apply(&mut gpus, 3, true));
    }
}
