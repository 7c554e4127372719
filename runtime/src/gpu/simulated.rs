//! GPUs that exist only in configuration, for tests, demos and nodes without NVIDIA drivers.
//!
//! `--simulate-gpus 16,16,24` makes three GPUs `GPU-sim-<node>-<index>`. Health is driven by
//! a file (`--simulate-health-file`) holding comma-separated indices of unhealthy GPUs; it
//! is polled every 200 ms, and a missing or empty file means every GPU is healthy. That lets
//! a test break a GPU with one file write, the way an XID would on real hardware.
//!
//! What pods "use" comes from `--simulate-usage-file`, JSON mapping `namespace/name` to MiB
//! (a number) or to a size (`"512Mi"`, `"5Gi"`), re-read at every usage poll:
//! `{"default/a": "5Gi", "default/b": 512}`. A pod's use is spread over the GPUs it holds,
//! as kubelet lists them (the device plugin's `usage` module); a missing file means nothing is in use.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use gpushare_contract::GpuInfo;

use super::{BackendError, GpuBackend, MemoryUse, MemoryUser};

/// How often the health file is read.
pub const HEALTH_POLL: Duration = Duration::from_millis(200);

/// Simulated GPUs of the given sizes.
#[derive(Debug, Clone)]
pub struct SimulatedBackend {
    node: String,
    sizes_gib: Vec<u64>,
    health_file: Option<PathBuf>,
    model: String,
    usage_file: Option<PathBuf>,
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
            usage_file: None,
        }
    }

    /// Pods use the GPU memory `usage_file` says (see the module doc).
    pub fn with_usage_file(mut self, usage_file: Option<PathBuf>) -> Self {
        self.usage_file = usage_file;
        self
    }

    /// GPUs report `model` as their product name (a mixed fleet in tests). A `|`-separated
    /// list names each GPU's model in index order, the last repeating (`Tesla T4|NVIDIA A10G`:
    /// a node with GPUs of two models).
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

/// Reads a usage file's text: `namespace/name` → bytes.
pub fn parse_usage(text: &str) -> Result<Vec<(String, u64)>, String> {
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(text).map_err(|err| format!("not a JSON object: {err}"))?;
    map.into_iter()
        .map(|(pod, value)| {
            if !pod.contains('/') {
                return Err(format!("{pod:?} is not namespace/name"));
            }
            let bytes = match &value {
                serde_json::Value::Number(n) => n.as_u64().and_then(|mib| mib.checked_mul(1 << 20)),
                serde_json::Value::String(s) => parse_size(s),
                _ => None,
            };
            bytes.map(|bytes| (pod.clone(), bytes)).ok_or_else(|| {
                format!("{pod}: {value} is not MiB or a size like \"512Mi\", \"5Gi\"")
            })
        })
        .collect()
}

/// `"512Mi"`, `"512MiB"`, `"5Gi"`, `"5GiB"` in bytes.
fn parse_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let text = text.strip_suffix('B').unwrap_or(text);
    let (number, shift) = if let Some(n) = text.strip_suffix("Gi") {
        (n, 30)
    } else {
        (text.strip_suffix("Mi")?, 20)
    };
    number.trim().parse::<u64>().ok()?.checked_mul(1 << shift)
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
                model: self
                    .model
                    .split('|')
                    .nth(index as usize)
                    .or_else(|| self.model.split('|').next_back())
                    .unwrap_or_default()
                    .trim()
                    .to_owned(),
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

    fn memory_in_use(&self) -> Result<Option<Vec<MemoryUse>>, BackendError> {
        let Some(path) = &self.usage_file else {
            return Ok(None);
        };
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Some(Vec::new())),
            Err(err) => {
                return Err(BackendError::SimulatedUsage {
                    path: path.clone(),
                    why: err.to_string(),
                });
            }
        };
        if text.trim().is_empty() {
            return Ok(Some(Vec::new()));
        }
        let pods = parse_usage(&text).map_err(|why| BackendError::SimulatedUsage {
            path: path.clone(),
            why,
        })?;
        Ok(Some(
            pods.into_iter()
                .map(|(pod, bytes)| MemoryUse {
                    gpu: None,
                    user: MemoryUser::Pod(pod),
                    bytes,
                })
                .collect(),
        ))
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
    fn a_model_list_gives_each_gpu_its_own() {
        let gpus = SimulatedBackend::new("n1", vec![16, 24, 24], None)
            .with_model("Tesla T4 | NVIDIA A10G")
            .gpus()
            .unwrap();
        let models: Vec<&str> = gpus.iter().map(|g| g.model.as_str()).collect();
        assert_eq!(models, vec!["Tesla T4", "NVIDIA A10G", "NVIDIA A10G"]);
    }

    #[test]
    fn health_file_lists_unhealthy_indices() {
        assert_eq!(parse_indices(""), BTreeSet::new());
        assert_eq!(parse_indices("1, 3\n"), BTreeSet::from([1, 3]));
        assert_eq!(parse_indices("x,2"), BTreeSet::from([2]));
    }

    #[test]
    fn usage_file_names_pods_in_mib_or_sizes() {
        let mut pods =
            parse_usage(r#"{"default/a": "5Gi", "ml/b": 512, "c/d": "1536MiB"}"#).unwrap();
        pods.sort();
        assert_eq!(
            pods,
            [
                ("c/d".to_owned(), 1536 << 20),
                ("default/a".to_owned(), 5 << 30),
                ("ml/b".to_owned(), 512 << 20),
            ]
        );
        for bad in [
            r#"{"a": 1}"#,
            r#"{"n/a": -1}"#,
            r#"{"n/a": "5G"}"#,
            r#"{"n/a": true}"#,
            "[1]",
        ] {
            assert!(parse_usage(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn usage_is_read_from_the_file_each_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("usage.json");
        let backend = SimulatedBackend::new("n1", vec![16], None);
        assert_eq!(
            backend.memory_in_use().unwrap(),
            None,
            "no file given: cannot measure"
        );
        let backend = backend.with_usage_file(Some(path.clone()));
        assert_eq!(
            backend.memory_in_use().unwrap(),
            Some(vec![]),
            "file absent: nothing in use"
        );
        std::fs::write(&path, r#"{"default/a": "2Gi"}"#).unwrap();
        assert_eq!(
            backend.memory_in_use().unwrap(),
            Some(vec![MemoryUse {
                gpu: None,
                user: MemoryUser::Pod("default/a".into()),
                bytes: 2 << 30,
            }])
        );
        std::fs::write(&path, "{").unwrap();
        let err = backend.memory_in_use().unwrap_err();
        assert!(err.to_string().contains("usage.json"), "{err}");
    }
}
