//! What each pod really uses of the GPU memory it was given.
//!
//! ```text
//!   every --usage-period-ms:
//!   backend.memory_in_use() ── NVML: (GPU, host PID, bytes) ──▶ /proc/<pid>/cgroup ─▶ pod UID ─┐
//!                           └─ simulated: (pod, bytes) from --simulate-usage-file ─────────────┤
//!   kubelet PodResources List ──▶ what each pod holds, per GPU (1 device = 1 GiB) ─────────────┤
//!   PodCache::pods_on_gpu ──▶ pod UID → namespace/name ────────────────────────────────────────┤
//!                                                                                              ▼
//!                                            attribute() ──▶ Report ──▶ /metrics (every period)
//!                                                                 └──▶ Node annotation <domain>/v1.usage
//!                                                                      (when it changed noticeably)
//! ```
//!
//! **Allocated** (what kubelet's PodResources API says each pod's containers hold) and
//! **used** (the backend's processes, traced to pods through their cgroups) are put together
//! in [`crate::attribution`], which says how and why; this module is the I/O around it:
//! reading the backend, kubelet and the pod cache every period, exporting, publishing, and
//! handing each measurement to the over-share watch ([`crate::over_share`]).
//!
//! **Two counts.** With the isolation interposer loaded (`--enforcement preload`) each
//! container also counts its own use, in its budget file. That count lives inside the
//! container, so a program that gets past the interposer (a static binary, one that drops
//! `LD_PRELOAD`, a rewritten budget) is missing from it; the driver's process lists are not.
//! So when the driver's figures are read (`--usage-period-ms` above 0, which needs the host's
//! PID namespace with NVML) they are each pod's use, and the interposer's count is published
//! beside them (`counted`); when they are not, the interposer's count is the use.
//!
//! **Publishing.** `kubectl gpushare top -d` reads the cluster through the API server only,
//! so the measurement must be on an object: the node annotation `<domain>/v1.usage`
//! ([`gpushare_contract::usage`]). It is one API write per node, never per pod, and it is
//! written only when a pod or GPU moved by at least `--usage-annotation-min-change-mib`, the
//! set of pods changed, or a pod crossed its share, and at most once per
//! `--usage-annotation-min-interval-ms`: GPU memory of a training job moves all the time, and
//! a write per poll per node would make every node a steady source of API-server load and
//! of watch events for every node watcher (the extender's included) for a number that is
//! only for people. `/metrics` carries the exact figures at every poll.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpushare_contract::usage::NodeMemoryUse;
use gpushare_runtime::gpu::{GpuBackend, MemoryUse, MemoryUser};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::attribution::{PidOwner, Report, attribute, holders, holdings, pid_owner};
use crate::metrics::{ExportedUsage, Metrics};
use crate::node::Inventory;
use crate::pods::PodCache;

/// Where the host's `/proc` is, unless told otherwise.
pub const DEFAULT_PROC_ROOT: &str = "/proc";

/// What was last written on the Node, to decide whether a new measurement is worth a write.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Published {
    /// The annotation's content.
    pub usage: NodeMemoryUse,
    /// Pods over their share then.
    pub over: BTreeSet<String>,
}

/// The smallest change, in points of a GPU's time, of a pod's compute use that is written
/// (a training loop's use wobbles by a point or two every period).
pub const COMPUTE_MIN_CHANGE: u64 = 5;

/// Whether `now` differs enough from `last` to be written: another set of GPUs or pods,
/// another set of pods over their share, a value moved by `min_change_mib` or more, or a
/// pod's compute use by [`COMPUTE_MIN_CHANGE`] points.
pub fn worth_writing(last: &Published, now: &Published, min_change_mib: u64) -> bool {
    fn moved<K: Ord>(a: &BTreeMap<K, u64>, b: &BTreeMap<K, u64>, min: u64) -> bool {
        !a.keys().eq(b.keys())
            || a.values()
                .zip(b.values())
                .any(|(x, y)| x.abs_diff(*y) >= min)
    }
    let percents = |map: &BTreeMap<String, u32>| -> BTreeMap<String, u64> {
        map.iter()
            .map(|(k, v)| (k.clone(), u64::from(*v)))
            .collect()
    };
    last.over != now.over
        || moved(&last.usage.gpus, &now.usage.gpus, min_change_mib.max(1))
        || moved(&last.usage.pods, &now.usage.pods, min_change_mib.max(1))
        || moved(
            &percents(&last.usage.compute),
            &percents(&now.usage.compute),
            COMPUTE_MIN_CHANGE,
        )
}

/// How the annotation is written.
#[derive(Debug, Clone)]
pub struct PublishPolicy {
    /// The annotation key (`<domain>/v1.usage`).
    pub key: String,
    /// Smallest change, in MiB, of a pod or GPU that is written.
    pub min_change_mib: u64,
    /// Least time between two writes.
    pub min_interval: Duration,
}

/// The periodic measurement; see the module doc.
pub struct UsageReader {
    /// Where memory use is measured.
    pub backend: Arc<dyn GpuBackend>,
    /// Whether the backend's figures (NVML process lists, which need the host's PID
    /// namespace, or the simulated usage file) are read: `--usage-period-ms` above 0.
    pub driver: bool,
    /// `Some(isolation host dir)`: what each pod's interposers counted (the accounting
    /// directories, [`crate::isolation_usage`]) is read too. It is pods' use when the
    /// driver's figures are not read (no `hostPID` needed), and shown beside them when they
    /// are.
    pub interposer: Option<PathBuf>,
    /// What is done about a pod over its share ([`crate::over_share`]).
    pub over_share: crate::over_share::Policy,
    /// kubelet's PodResources socket.
    pub socket: PathBuf,
    /// The resource whose devices are ours.
    pub resource: String,
    /// The node's pods (UID → name).
    pub pods: Arc<PodCache>,
    /// The node's GPUs.
    pub inventory: Inventory,
    /// Metrics.
    pub metrics: Metrics,
    /// The host's `/proc` as seen by the plugin.
    pub proc_root: PathBuf,
    /// How often memory use is read.
    pub period: Duration,
    /// How the node annotation is written.
    pub publish: PublishPolicy,
}

impl std::fmt::Debug for UsageReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UsageReader")
            .field("socket", &self.socket)
            .field("proc_root", &self.proc_root)
            .field("period", &self.period)
            .finish_non_exhaustive()
    }
}

/// Each pod's use as its containers' interposers counted it: on its GPU, or spread over its
/// GPUs (a multi-GPU pod's ordinals are its own).
fn interposer_uses(pods: &PodCache, inventory: &Inventory, host_dir: &Path) -> Vec<MemoryUse> {
    let live = crate::isolation_usage::live_pods(pods, inventory);
    crate::isolation_usage::container_uses(host_dir, &live)
        .into_iter()
        .map(|usage| MemoryUse {
            gpu: match live.get(&usage.pod).map(Vec::as_slice) {
                Some([only]) => Some(*only),
                _ => None,
            },
            user: MemoryUser::Pod(usage.pod),
            bytes: usage.used,
        })
        .collect()
}

/// The outcome of one measurement.
#[derive(Debug)]
enum Measured {
    Report(Report),
    /// The backend cannot measure (simulated GPUs without a usage file).
    NotMeasurable,
    /// Reading failed this time (logged).
    Failed,
}

/// Log-once state: what was last said about each source.
#[derive(Debug, Default)]
struct Said {
    backend_error: Option<String>,
    kubelet_down: Option<bool>,
    pids_unknown: bool,
}

impl UsageReader {
    /// Measures every period until `shutdown`; never fails (errors are logged and retried).
    /// A backend that cannot measure (simulated GPUs without a usage file) is said once and
    /// the loop idles.
    pub async fn run(self, client: Client, node: String, shutdown: CancellationToken) {
        let api: Api<Node> = Api::all(client.clone());
        let mut tracker = crate::over_share::Tracker::new(self.over_share);
        let actor = crate::over_share::Actor {
            client,
            node: node.clone(),
            pods: self.pods.clone(),
            metrics: self.metrics.clone(),
        };
        let mut said = Said::default();
        let mut published: Option<(Published, Instant)> = None;
        let mut exported = ExportedUsage::default();
        let mut compute = crate::compute_usage::ComputeMeter::default();
        loop {
            match self.measure(&mut said).await {
                Measured::Report(report) => {
                    exported = self.metrics.record_usage(&report, exported);
                    let actions = tracker.observe(&report, Instant::now());
                    actor.act(actions, &report, &mut tracker).await;
                    let mut usage = report.annotation();
                    usage.compute = self.compute_used(&mut compute).await;
                    let now = Published {
                        usage,
                        over: report.over_share(),
                    };
                    let due = match &published {
                        None => true,
                        Some((last, at)) => {
                            at.elapsed() >= self.publish.min_interval
                                && worth_writing(last, &now, self.publish.min_change_mib)
                        }
                    };
                    if due && self.write(&api, &node, &now.usage).await {
                        published = Some((now, Instant::now()));
                    }
                }
                Measured::Failed => {}
                Measured::NotMeasurable => {
                    tracing::info!(
                        "GPU memory use is not measured (simulated GPUs without --simulate-usage-file)"
                    );
                    shutdown.cancelled().await;
                    return;
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(self.period) => {}
            }
        }
    }

    /// The percent of their GPUs' time the kernels of each pod with a compute share ran
    /// since the last call, as the interposer measured it
    /// ([`crate::compute_usage`]); empty without the interposer.
    async fn compute_used(
        &self,
        meter: &mut crate::compute_usage::ComputeMeter,
    ) -> BTreeMap<String, u32> {
        let Some(host_dir) = self.interposer.clone() else {
            return BTreeMap::new();
        };
        let (pods, inventory) = (self.pods.clone(), self.inventory.clone());
        let read = tokio::task::spawn_blocking(move || {
            let live = crate::isolation_usage::live_pods(&pods, &inventory);
            let gpus = inventory.borrow().clone();
            crate::compute_usage::entries(&host_dir, &live, &gpus)
        });
        // The files are read without blocking; a period is still the most one pass may take.
        match tokio::time::timeout(self.period.max(Duration::from_secs(1)), read).await {
            Ok(Ok(entries)) => meter.observe(std::time::Instant::now(), entries),
            Ok(Err(_)) | Err(_) => {
                tracing::warn!(
                    "reading the compute state files failed or took a whole period; compute use is left out this time"
                );
                BTreeMap::new()
            }
        }
    }

    /// One measurement; a failure is said once.
    async fn measure(&self, said: &mut Said) -> Measured {
        let counted = match &self.interposer {
            Some(host_dir) => {
                let (pods, inventory, host_dir) =
                    (self.pods.clone(), self.inventory.clone(), host_dir.clone());
                tokio::task::spawn_blocking(move || interposer_uses(&pods, &inventory, &host_dir))
                    .await
                    .ok()
            }
            None => None,
        };
        let driver = if self.driver {
            let backend = self.backend.clone();
            match tokio::task::spawn_blocking(move || backend.memory_in_use()).await {
                Ok(Ok(uses)) => {
                    said.backend_error = None;
                    uses
                }
                Ok(Err(err)) => {
                    let text = err.to_string();
                    if said.backend_error.as_deref() != Some(&text) {
                        tracing::warn!(error = %text, "cannot read GPU memory use; retrying");
                    }
                    said.backend_error = Some(text);
                    return Measured::Failed;
                }
                Err(join) => {
                    tracing::warn!(error = %join, "GPU memory read crashed; retrying");
                    said.backend_error = Some(join.to_string());
                    return Measured::Failed;
                }
            }
        } else {
            None
        };
        // The driver's figures when there are any; else what the interposer counted, which
        // is then the only figure (and is not shown twice).
        let (uses, counted) = match (driver, counted) {
            (Some(driver), counted) => (driver, counted),
            (None, Some(counted)) => (counted, None),
            (None, None) if self.interposer.is_some() => return Measured::Failed,
            (None, None) => return Measured::NotMeasurable,
        };
        let listed = match crate::pod_resources::list(&self.socket, &self.resource).await {
            Ok(facts) => {
                said.kubelet_down = Some(false);
                Some((holdings(&facts), holders(&facts)))
            }
            Err(err) => {
                if said.kubelet_down != Some(true) {
                    tracing::warn!(error = %err, "GPU memory use is measured per GPU only: what each pod holds comes from kubelet's PodResources API");
                }
                said.kubelet_down = Some(true);
                None
            }
        };
        let gpus = self.inventory.borrow().clone();
        let key_of_uid: HashMap<String, String> = gpus
            .iter()
            .flat_map(|gpu| self.pods.pods_on_gpu(&gpu.uuid))
            .map(|(key, uid)| (uid, key))
            .collect();
        let proc_root = self.proc_root.clone();
        let report = tokio::task::spawn_blocking(move || {
            let held = listed.as_ref().map(|(held, _)| held);
            let mut report = attribute(&gpus, held, &key_of_uid, &uses, |pid| {
                pid_owner(&proc_root, pid)
            });
            if let Some(counted) = counted {
                let counted = attribute(&gpus, held, &key_of_uid, &counted, |_| PidOwner::Unknown);
                report = report.with_counted(&counted);
            }
            match &listed {
                Some((_, holders)) => report.with_holders(holders),
                None => report,
            }
        })
        .await;
        let Ok(report) = report else {
            return Measured::Failed;
        };
        if report.unknown_pids > 0 && !said.pids_unknown {
            tracing::warn!(proc_root = %self.proc_root.display(), processes = report.unknown_pids, "GPU processes not found under the proc root: their memory cannot be traced to pods and is counted as unattributed; run the device plugin with hostPID: true (the chart does when devicePlugin.usage.enabled)");
        }
        said.pids_unknown = report.unknown_pids > 0;
        Measured::Report(report)
    }

    /// Writes the annotation; returns whether it was written.
    async fn write(&self, api: &Api<Node>, node: &str, usage: &NodeMemoryUse) -> bool {
        let patch = serde_json::json!({
            "metadata": { "annotations": { self.publish.key.as_str(): usage.encode() } }
        });
        let written = match api
            .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {
                tracing::debug!(%node, pods = usage.pods.len(), "published GPU memory use");
                true
            }
            Err(err) => {
                tracing::warn!(%node, error = %err, "cannot publish GPU memory use on the node; retrying");
                false
            }
        };
        Metrics::patch(&self.metrics.usage_patches, written);
        written
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn published(pods: &[(&str, u64)], over: &[&str]) -> Published {
        Published {
            usage: NodeMemoryUse {
                gpus: BTreeMap::from([(0, pods.iter().map(|p| p.1).sum())]),
                pods: pods.iter().map(|&(k, v)| (k.to_owned(), v)).collect(),
                counted: BTreeMap::new(),
                compute: Default::default(),
            },
            over: over.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    #[test]
    fn the_annotation_is_written_only_for_noticeable_changes() {
        let last = published(&[("default/a", 1000), ("default/b", 0)], &[]);
        // Small drift: not worth a write.
        assert!(!worth_writing(
            &last,
            &published(&[("default/a", 1100), ("default/b", 50)], &[]),
            256
        ));
        // A big move, a pod gone or new, a pod crossing its share: written.
        assert!(worth_writing(
            &last,
            &published(&[("default/a", 1300), ("default/b", 0)], &[]),
            256
        ));
        assert!(worth_writing(
            &last,
            &published(&[("default/a", 1000)], &[]),
            256
        ));
        assert!(worth_writing(
            &last,
            &published(
                &[("default/a", 1000), ("default/b", 0), ("default/c", 0)],
                &[]
            ),
            256
        ));
        assert!(worth_writing(
            &last,
            &published(&[("default/a", 1100), ("default/b", 0)], &["default/a"]),
            256
        ));
        assert!(
            !worth_writing(&last, &last, 0),
            "an unchanged measurement is never written"
        );
        // Compute use: a wobble of a point or two is not written, five points are.
        let with_compute = |percent: u32| {
            let mut usage = last.clone();
            usage.usage.compute = BTreeMap::from([("default/a".to_owned(), percent)]);
            usage
        };
        assert!(worth_writing(&last, &with_compute(30), 256), "a pod starts");
        assert!(!worth_writing(&with_compute(30), &with_compute(32), 256));
        assert!(worth_writing(&with_compute(30), &with_compute(35), 256));
    }
}
