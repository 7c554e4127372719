//! Where the GPUs come from: NVML on a real node, a simulation in tests and demos (feature
//! `gpu`; the two plugins turn it on).
//!
//! Both plugins see GPUs only through [`GpuBackend`], so every path above it (devices,
//! Allocate, ResourceSlices, inventory publishing, health) runs unchanged on a laptop without
//! a GPU, and the device plugin and the DRA plugin read the same GPUs the same way.
//! Health is reported as changes (`index`, `healthy`) from a blocking watch loop, because
//! NVML's event API is blocking; the loop runs on a blocking thread and stops when asked.
//!
//! GPU memory in use ([`GpuBackend::memory_in_use`]) is reported by whoever the backend can
//! name: NVML knows processes (host PIDs), which the device plugin's `usage` module traces to pods through their
//! cgroups; the simulation is told per pod, so the same path is tested without a GPU.

use std::sync::atomic::AtomicBool;

use gpushare_contract::GpuInfo;

pub mod nvml;
pub mod simulated;

/// Where GPUs come from (the plugins' `--gpu-backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// Real GPUs through NVML.
    Nvml,
    /// GPUs from `--simulate-gpus`.
    Simulated,
}

/// Why the GPUs could not be listed or watched.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// NVML could not be loaded or initialised (no driver, no `libnvidia-ml.so`).
    #[error(
        "cannot initialise NVML ({0}); is the NVIDIA driver installed and libnvidia-ml.so.1 visible to this container? Use --gpu-backend simulated to run without GPUs"
    )]
    NvmlInit(#[source] nvml_wrapper::error::NvmlError),
    /// An NVML query failed.
    #[error("NVML {what} failed: {source}")]
    Nvml {
        /// the query
        what: String,
        /// the NVML error
        #[source]
        source: nvml_wrapper::error::NvmlError,
    },
    /// The simulated usage file could not be read.
    #[error(
        "--simulate-usage-file {path}: {why}; write JSON like {{\"default/a\": \"5Gi\", \"default/b\": 512}} (MiB, or a string ending in Mi or Gi)"
    )]
    SimulatedUsage {
        /// the file
        path: std::path::PathBuf,
        /// what is wrong with it
        why: String,
    },
    /// The simulated backend was chosen without any GPU sizes.
    #[error("--gpu-backend simulated needs --simulate-gpus, e.g. --simulate-gpus 16,16,24")]
    NoSimulatedGpus,
}

/// Who uses some GPU memory, as far as the backend can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemoryUser {
    /// A process, by its PID in the host's PID namespace (NVML's view).
    Process(u32),
    /// A pod, by `namespace/name` (the simulation's view).
    Pod(String),
}

/// Some GPU memory in use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryUse {
    /// The GPU's index; `None`: whichever GPUs the pod holds (simulation only).
    pub gpu: Option<u32>,
    /// Who uses it.
    pub user: MemoryUser,
    /// Bytes in use.
    pub bytes: u64,
}

/// A source of GPUs and their health.
pub trait GpuBackend: Send + Sync + 'static {
    /// The GPUs on this node, all healthy, sorted by index. Called once at start.
    fn gpus(&self) -> Result<Vec<GpuInfo>, BackendError>;

    /// Blocks, calling `report(index, healthy)` whenever a GPU's health changes, until `stop`
    /// is set (checked at least every second). Returns early only on an error that makes
    /// further health checking impossible.
    fn watch_health(
        &self,
        stop: &AtomicBool,
        report: &mut dyn FnMut(u32, bool),
    ) -> Result<(), BackendError>;

    /// The GPU memory in use now, by user; `None` when this backend cannot measure it
    /// (simulated GPUs without `--simulate-usage-file`). Called every usage period from a
    /// blocking thread.
    fn memory_in_use(&self) -> Result<Option<Vec<MemoryUse>>, BackendError> {
        Ok(None)
    }
}
