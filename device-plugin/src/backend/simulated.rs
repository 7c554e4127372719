//! GPUs that exist only in configuration, for tests, demos and nodes without NVIDIA drivers.
//!
//! `--simulate-gpus 16,16,24` makes three GPUs `GPU-sim-<node>-<index>`. Health is driven by
//! a file (`--simulate-health-file`) holding comma-separated indices of unhealthy GPUs; it
//! is polled every 200 ms, and a missing or empty file means every GPU is healthy. That lets
//! a test break a GPU with one file write, the way an XID would on real hardware.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use gpushare_contract::GpuInfo;

use super::{BackendError, GpuBackend};

/// How often the health file is read.
pub const HEALTH_POLL: Duration = Duration::from_millis(200);

/// Simulated GPUs of the given sizes.
#[derive(Debug, Clone)]
pub struct SimulatedBackend {
    node: String,
    sizes_gib: Vec<u64>,
    health_file: Option<PathBuf>,
    model: String,
}

/// The product name simulated GPUs report unless told otherwise.
pub const SIMULATED_MODEL: &str = "Simulated GPU";

impl SimulatedBackend {
    /// GPUs of `sizes_gib` on `node`; health read from `health_file` when given.
    pub fn new(node: &str, sizes_gib: Vec<u64>, health_file: Option<PathBuf>) -> Self {
        Self {
            node: node.to_owned(),
            sizes_gib,
            health_file,
            model: SIMULATED_MODEL.to_owned(),
        }
    }

    /// Every GPU reports `model` as its product name (a mixed fleet in tests).
    pub fn with_model(mut self, model: &str) -> Self {
        self.model = model.to_owned();
        self
    }

    fn unhealthy_now(&self) -> BTreeSet<u32> {
        let Some(path) = &self.health_file else {
            return BTreeSet::new();
        };
        match std::fs::read_to_string(path) {
            Ok(text) => parse_indices(&text),
            Err(_) => BTreeSet::new(),
        }
    }
}

/// Reads `"1, 3"` as {1, 3}; anything that is not an index is ignored with a warning.
pub fn parse_indices(text: &str) -> BTreeSet<u32> {
    text.split([',', '\n', ' ', '\t', '\r'])
        .filter(|token| !token.is_empty())
        .filter_map(|token| match token.parse() {
            Ok(index) => Some(index),
            Err(_) => {
                tracing::warn!(
                    token,
                    "ignoring a non-numeric entry in the simulated health file"
                );
                None
            }
        })
        .collect()
}

impl GpuBackend for SimulatedBackend {
    fn gpus(&self) -> Result<Vec<GpuInfo>, BackendError> {
        if self.sizes_gib.is_empty() {
            return Err(BackendError::NoSimulatedGpus);
        }
        Ok(self
            .sizes_gib
            .iter()
            .zip(0u32..)
            .map(|(&mem_gib, index)| GpuInfo {
                index,
                uuid: format!("GPU-sim-{}-{index}", self.node),
                model: self.model.clone(),
                mem_gib,
                healthy: true,
                numa_node: None,
            })
            .collect())
    }

    fn watch_health(
        &self,
        stop: &AtomicBool,
        report: &mut dyn FnMut(u32, bool),
    ) -> Result<(), BackendError> {
        let count = u32::try_from(self.sizes_gib.len()).unwrap_or(u32::MAX);
        let mut unhealthy = BTreeSet::new();
        while !stop.load(Ordering::Relaxed) {
            let now: BTreeSet<u32> = self
                .unhealthy_now()
                .into_iter()
                .filter(|&index| index < count)
                .collect();
            for &index in now.difference(&unhealthy) {
                report(index, false);
            }
            for &index in unhealthy.difference(&now) {
                report(index, true);
            }
            unhealthy = now;
            std::thread::sleep(HEALTH_POLL);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_gpus_with_stable_uuids() {
        let backend = SimulatedBackend::new("n1", vec![16, 24], None);
        let gpus = backend.gpus().unwrap();
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[1].uuid, "GPU-sim-n1-1");
        assert_eq!(gpus[1].mem_gib, 24);
        assert!(gpus.iter().all(|gpu| gpu.healthy));
        let empty = SimulatedBackend::new("n1", vec![], None);
        assert!(matches!(empty.gpus(), Err(BackendError::NoSimulatedGpus)));
    }

    #[test]
    fn health_file_lists_unhealthy_indices() {
        assert_eq!(parse_indices(""), BTreeSet::new());
        assert_eq!(parse_indices("1, 3\n"), BTreeSet::from([1, 3]));
        assert_eq!(parse_indices("x,2"), BTreeSet::from([2]));
    }
}
