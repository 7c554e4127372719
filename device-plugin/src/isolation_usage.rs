//! What the interposer counted in each container (`--enforcement preload`), on `/metrics`, and
//! the accounting directories of pods that are gone, removed.
//!
//! ```text
//!   every period:  <isolation host dir>/containers/<namespace>_<pod>_<container>_<n>/budget-….v1
//!                     └─ gpushare-isolation-budget's safe reader (never the interposer's code)
//!                  ──▶ share, used, refused allocations per container and GPU (gauges)
//!                  ──▶ a directory whose pod holds no allocation here twice in a row: removed
//! ```
//!
//! The interposer writes these files from inside the containers; the plugin owns the
//! directories (it made them at Allocate), so it reads each container's real use without
//! `hostPID` or NVML process lists. A file being created, or one a container left in a state
//! the reader cannot parse, is skipped for that pass.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gpushare_isolation_budget::budgets_in;
use tokio_util::sync::CancellationToken;

use crate::metrics::{ContainerGpuLabels, Metrics};
use crate::node::Inventory;
use crate::pods::PodCache;

/// One container's use of one GPU, as its interposer counted it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerUse {
    /// The pod, `namespace/name`.
    pub pod: String,
    /// The container.
    pub container: String,
    /// The GPU, as the container numbers it (CUDA ordinal).
    pub gpu: usize,
    /// Its share, bytes.
    pub share: u64,
    /// Bytes it holds.
    pub used: u64,
    /// Allocations refused so far.
    pub refused: u64,
}

/// Reads the accounting directories under `<host_dir>/containers`.
pub struct IsolationReader {
    /// `--isolation-host-dir`.
    pub host_dir: PathBuf,
    /// Where the figures go.
    pub metrics: Metrics,
    /// The node's pods, to tell a directory whose pod is gone.
    pub pods: Arc<PodCache>,
    /// The node's GPUs (pods are found by the GPUs their allocation names).
    pub inventory: Inventory,
    /// How often.
    pub period: Duration,
}

impl IsolationReader {
    /// Reads every period until `token` is cancelled.
    pub async fn run(self, token: CancellationToken) {
        let mut absent_before = BTreeSet::new();
        loop {
            let (uses, absent) = self.pass(&absent_before);
            self.export(&uses);
            absent_before = absent;
            tokio::select! {
                () = token.cancelled() => return,
                () = tokio::time::sleep(self.period) => {}
            }
        }
    }

    /// One pass: every container's figures, and the directories whose pod holds no
    /// allocation here now (those already absent in `absent_before` are removed).
    pub fn pass(&self, absent_before: &BTreeSet<String>) -> (Vec<ContainerUse>, BTreeSet<String>) {
        let root = self.host_dir.join("containers");
        let live = self.live_pods();
        let mut uses = Vec::new();
        let mut absent = BTreeSet::new();
        let Ok(entries) = std::fs::read_dir(&root) else {
            return (uses, absent);
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some((pod, container)) = parse_dir_name(&name) else {
                continue;
            };
            if !live.contains(&pod) {
                if absent_before.contains(&name) {
                    match gpushare_runtime::isolation::remove_accounting_dir(&self.host_dir, &name)
                    {
                        Ok(()) => {
                            tracing::debug!(%pod, %container, "removed the accounting directory of a pod that is gone")
                        }
                        Err(error) => {
                            tracing::warn!(%pod, %container, %error, "cannot remove an accounting directory")
                        }
                    }
                } else {
                    absent.insert(name);
                }
                continue;
            }
            let Ok(budgets) = budgets_in(&entry.path()) else {
                continue;
            };
            for (_, snapshot) in budgets {
                let Ok(snapshot) = snapshot else { continue };
                uses.extend(snapshot.gpus.iter().map(|gpu| ContainerUse {
                    pod: pod.clone(),
                    container: container.clone(),
                    gpu: gpu.gpu,
                    share: gpu.share,
                    used: gpu.used,
                    refused: gpu.refused,
                }));
            }
        }
        (uses, absent)
    }

    /// The pods (`namespace/name`) holding an allocation on one of this node's GPUs.
    fn live_pods(&self) -> BTreeSet<String> {
        let gpus = self.inventory.borrow().clone();
        gpus.iter()
            .flat_map(|gpu| self.pods.pods_on_gpu(&gpu.uuid))
            .map(|(key, _)| key)
            .collect()
    }

    fn export(&self, uses: &[ContainerUse]) {
        let metrics = &self.metrics;
        metrics.isolated_share_bytes.clear();
        metrics.isolated_used_bytes.clear();
        metrics.isolated_refused_allocations.clear();
        // Several budget files of one container and GPU (a container restarted with other
        // limits) add up.
        let mut sums: BTreeMap<ContainerGpuLabels, (u64, u64, u64)> = BTreeMap::new();
        for usage in uses {
            let (namespace, pod) = usage.pod.split_once('/').unwrap_or(("", &usage.pod));
            let labels = ContainerGpuLabels {
                namespace: namespace.to_owned(),
                pod: pod.to_owned(),
                container: usage.container.clone(),
                gpu: u32::try_from(usage.gpu).unwrap_or(u32::MAX),
            };
            let sum = sums.entry(labels).or_default();
            sum.0 = sum.0.max(usage.share);
            sum.1 = sum.1.saturating_add(usage.used);
            sum.2 = sum.2.saturating_add(usage.refused);
        }
        let gauge = |value: u64| i64::try_from(value).unwrap_or(i64::MAX);
        for (labels, (share, used, refused)) in sums {
            metrics
                .isolated_share_bytes
                .get_or_create(&labels)
                .set(gauge(share));
            metrics
                .isolated_used_bytes
                .get_or_create(&labels)
                .set(gauge(used));
            metrics
                .isolated_refused_allocations
                .get_or_create(&labels)
                .set(gauge(refused));
        }
    }
}

/// `<namespace>_<pod>_<container>_<n>` (as [`crate::service::Isolation::mounts`] names them)
/// → (`namespace/pod`, container). Kubernetes names hold no `_`.
pub fn parse_dir_name(name: &str) -> Option<(String, String)> {
    let mut parts = name.split('_');
    let (namespace, pod, container, _stamp) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || namespace.is_empty() || pod.is_empty() || container.is_empty() {
        return None;
    }
    Some((format!("{namespace}/{pod}"), container.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directory_names_give_the_pod_and_container() {
        assert_eq!(
            parse_dir_name("default_notebook-1_main_18b2f"),
            Some(("default/notebook-1".to_owned(), "main".to_owned()))
        );
        for bad in ["claim-u1", "a_b_c", "a_b_c_d_e", "_b_c_d", ".partial"] {
            assert_eq!(parse_dir_name(bad), None, "{bad}");
        }
    }
}
