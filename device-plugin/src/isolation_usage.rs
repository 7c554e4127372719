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
use std::path::{Path, PathBuf};
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
    /// Reads every period until `token` is cancelled. The files are read on a blocking
    /// thread, off the plugin's async workers.
    pub async fn run(self, token: CancellationToken) {
        let reader = Arc::new(self);
        let mut absent_before = BTreeSet::new();
        loop {
            let (pass, before) = (reader.clone(), absent_before.clone());
            let Ok((uses, absent)) = tokio::task::spawn_blocking(move || pass.pass(&before)).await
            else {
                tracing::warn!("reading the isolation budget files crashed; retrying");
                tokio::time::sleep(reader.period).await;
                continue;
            };
            reader.export(&uses);
            absent_before = absent;
            tokio::select! {
                () = token.cancelled() => return,
                () = tokio::time::sleep(reader.period) => {}
            }
        }
    }

    /// One pass: every container's figures, and the directories whose pod holds no
    /// allocation here now (those already absent in `absent_before` are removed).
    pub fn pass(&self, absent_before: &BTreeSet<String>) -> (Vec<ContainerUse>, BTreeSet<String>) {
        let live = live_pods(&self.pods, &self.inventory);
        let mut absent = BTreeSet::new();
        for (name, pod, container) in accounting_dirs(&self.host_dir) {
            if live.contains_key(&pod) {
                continue;
            }
            if !absent_before.contains(&name) {
                absent.insert(name);
                continue;
            }
            match gpushare_runtime::isolation::remove_accounting_dir(&self.host_dir, &name) {
                Ok(()) => {
                    tracing::debug!(%pod, %container, "removed the accounting directory of a pod that is gone")
                }
                Err(error) => {
                    tracing::warn!(%pod, %container, %error, "cannot remove an accounting directory")
                }
            }
        }
        (container_uses(&self.host_dir, &live), absent)
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

/// The pods (`namespace/name`) holding an allocation on one of this node's GPUs, with the
/// indexes of those GPUs.
pub fn live_pods(pods: &PodCache, inventory: &Inventory) -> BTreeMap<String, Vec<u32>> {
    let gpus = inventory.borrow().clone();
    let mut live: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for gpu in gpus.iter() {
        for (key, _) in pods.pods_on_gpu(&gpu.uuid) {
            live.entry(key).or_default().push(gpu.index);
        }
    }
    live
}

/// The accounting directories under `<host_dir>/containers`: (name, `namespace/pod`,
/// container).
fn accounting_dirs(host_dir: &Path) -> Vec<(String, String, String)> {
    let Ok(entries) = std::fs::read_dir(host_dir.join("containers")) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let (pod, container) = parse_dir_name(&name)?;
            Some((name, pod, container))
        })
        .collect()
}

/// What the interposers of the containers of `live` pods counted, per GPU.
pub fn container_uses(host_dir: &Path, live: &BTreeMap<String, Vec<u32>>) -> Vec<ContainerUse> {
    let mut uses = Vec::new();
    for (name, pod, container) in accounting_dirs(host_dir) {
        if !live.contains_key(&pod) {
            continue;
        }
        let Ok(budgets) = budgets_in(&host_dir.join("containers").join(&name)) else {
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
    uses
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
