//! Real GPUs through NVML (`libnvidia-ml.so`, loaded at run time by `nvml-wrapper`).
//!
//! Health follows the NVIDIA device plugin: a GPU turns unhealthy on a critical XID event,
//! except for the XIDs that an application causes by itself (13, 31, 43, 45, 68, 109): those
//! kill one process, not the GPU. An XID on a device NVML cannot name marks every GPU
//! unhealthy, since we cannot tell which one failed. Unhealthy GPUs stay so until the plugin
//! restarts, as in the NVIDIA plugin. GPUs too old for events are never health-checked.
//!
//! Memory in use comes from NVML's running compute and graphics process lists of each GPU
//! (a process using both APIs is listed in both with the same figure, so it is counted once).
//! The PIDs are the host's: tracing them to pods needs the host's `/proc`
//! (the device plugin's `usage` module).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

use gpushare_contract::GpuInfo;
use gpushare_contract::inventory::gib_from_bytes;
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;

use super::{BackendError, GpuBackend, MemoryUse, MemoryUser};

/// XIDs an application triggers on its own; they do not make the GPU unhealthy.
pub const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// How long one NVML event wait blocks before checking the stop flag.
const WAIT_MS: u32 = 1000;

/// GPUs from NVML.
pub struct NvmlBackend {
    nvml: Nvml,
}

impl std::fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlBackend").finish_non_exhaustive()
    }
}

fn nvml_err(what: impl Into<String>) -> impl FnOnce(NvmlError) -> BackendError {
    let what = what.into();
    move |source| BackendError::Nvml { what, source }
}

/// Whether an XID makes the GPU unusable.
pub fn is_critical_xid(xid: &XidError) -> bool {
    match xid {
        XidError::Value(value) => !APPLICATION_XIDS.contains(value),
        XidError::Unknown => true,
    }
}

/// NUMA node of a PCI device from sysfs; NVML's bus id has an 8-digit domain, sysfs 4.
fn numa_node(bus_id: &str) -> Option<i64> {
    let short = bus_id.get(4..)?.to_ascii_lowercase();
    let text = std::fs::read_to_string(format!("/sys/bus/pci/devices/{short}/numa_node")).ok()?;
    let node: i64 = text.trim().parse().ok()?;
    (node >= 0).then_some(node)
}

/// Bytes each process uses on one GPU, from its compute and graphics process lists: a PID
/// in both counts once (the larger figure); entries without a figure (not available under
/// some drivers) count nothing.
pub fn per_process(lists: &[&[ProcessInfo]]) -> BTreeMap<u32, u64> {
    let mut by_pid = BTreeMap::new();
    for info in lists.iter().flat_map(|list| list.iter()) {
        if let UsedGpuMemory::Used(bytes) = info.used_gpu_memory {
            let seen: &mut u64 = by_pid.entry(info.pid).or_default();
            *seen = (*seen).max(bytes);
        }
    }
    by_pid
}

/// A process list, or an empty one where the GPU does not support listing it.
fn listed(
    result: Result<Vec<ProcessInfo>, NvmlError>,
    what: String,
) -> Result<Vec<ProcessInfo>, BackendError> {
    match result {
        Ok(list) => Ok(list),
        Err(NvmlError::NotSupported) => Ok(Vec::new()),
        Err(err) => Err(nvml_err(what)(err)),
    }
}

impl NvmlBackend {
    /// Loads NVML; fails with a clear message when the driver library is absent.
    pub fn new() -> Result<Self, BackendError> {
        Ok(Self {
            nvml: Nvml::init().map_err(BackendError::NvmlInit)?,
        })
    }
}

impl GpuBackend for NvmlBackend {
    fn gpus(&self) -> Result<Vec<GpuInfo>, BackendError> {
        let count = self.nvml.device_count().map_err(nvml_err("device count"))?;
        let mut gpus = Vec::new();
        for index in 0..count {
            let device = self
                .nvml
                .device_by_index(index)
                .map_err(nvml_err(format!("device {index}")))?;
            let memory = device
                .memory_info()
                .map_err(nvml_err(format!("memory info of GPU {index}")))?;
            gpus.push(GpuInfo {
                index,
                uuid: device
                    .uuid()
                    .map_err(nvml_err(format!("uuid of GPU {index}")))?,
                model: device.name().unwrap_or_default(),
                mem_gib: gib_from_bytes(memory.total),
                healthy: true,
                numa_node: device
                    .pci_info()
                    .ok()
                    .and_then(|pci| numa_node(&pci.bus_id)),
            });
        }
        Ok(gpus)
    }

    fn watch_health(
        &self,
        stop: &AtomicBool,
        report: &mut dyn FnMut(u32, bool),
    ) -> Result<(), BackendError> {
        let count = self.nvml.device_count().map_err(nvml_err("device count"))?;
        let mut set = self
            .nvml
            .create_event_set()
            .map_err(nvml_err("create event set"))?;
        let mut registered = 0;
        for index in 0..count {
            let device = self
                .nvml
                .device_by_index(index)
                .map_err(nvml_err(format!("device {index}")))?;
            let supported = device
                .supported_event_types()
                .is_ok_and(|types| types.contains(EventTypes::CRITICAL_XID_ERROR));
            if !supported {
                tracing::warn!(
                    gpu = index,
                    "GPU does not support XID events; it will not be health-checked"
                );
                continue;
            }
            set = device
                .register_events(EventTypes::CRITICAL_XID_ERROR, set)
                .map_err(|err| {
                    nvml_err(format!("XID event registration of GPU {index}"))(err.error)
                })?;
            registered += 1;
        }
        if registered == 0 {
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(u64::from(WAIT_MS)));
            }
            return Ok(());
        }
        while !stop.load(Ordering::Relaxed) {
            let event = match set.wait(WAIT_MS) {
                Ok(event) => event,
                Err(NvmlError::Timeout) => continue,
                Err(err) => return Err(nvml_err("event wait")(err)),
            };
            let Some(xid) = event.event_data else {
                continue;
            };
            if !is_critical_xid(&xid) {
                tracing::info!(?xid, "ignoring application XID");
                continue;
            }
            match event.device.index() {
                Ok(index) => {
                    tracing::warn!(gpu = index, ?xid, "critical XID: marking GPU unhealthy");
                    report(index, false);
                }
                Err(_) => {
                    tracing::warn!(
                        ?xid,
                        "critical XID on an unknown GPU: marking every GPU unhealthy"
                    );
                    for index in 0..count {
                        report(index, false);
                    }
                }
            }
        }
        Ok(())
    }

    fn memory_in_use(&self) -> Result<Option<Vec<MemoryUse>>, BackendError> {
        let count = self.nvml.device_count().map_err(nvml_err("device count"))?;
        let mut uses = Vec::new();
        for index in 0..count {
            let device = self
                .nvml
                .device_by_index(index)
                .map_err(nvml_err(format!("device {index}")))?;
            let compute = listed(
                device.running_compute_processes(),
                format!("compute processes of GPU {index}"),
            )?;
            let graphics = listed(
                device.running_graphics_processes(),
                format!("graphics processes of GPU {index}"),
            )?;
            uses.extend(
                per_process(&[&compute, &graphics])
                    .into_iter()
                    .map(|(pid, bytes)| MemoryUse {
                        gpu: Some(index),
                        user: MemoryUser::Process(pid),
                        bytes,
                    }),
            );
        }
        Ok(Some(uses))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn application_xids_are_not_critical() {
        assert!(!is_critical_xid(&XidError::Value(13)));
        assert!(!is_critical_xid(&XidError::Value(109)));
        assert!(is_critical_xid(&XidError::Value(79)));
        assert!(is_critical_xid(&XidError::Unknown));
    }

    fn process(pid: u32, used: UsedGpuMemory) -> ProcessInfo {
        ProcessInfo {
            pid,
            used_gpu_memory: used,
            gpu_instance_id: None,
            compute_instance_id: None,
        }
    }

    #[test]
    fn a_process_in_both_lists_counts_once() {
        let compute = [
            process(10, UsedGpuMemory::Used(300)),
            process(11, UsedGpuMemory::Unavailable),
        ];
        let graphics = [
            process(10, UsedGpuMemory::Used(300)),
            process(12, UsedGpuMemory::Used(50)),
        ];
        assert_eq!(
            per_process(&[&compute, &graphics]),
            BTreeMap::from([(10, 300), (12, 50)])
        );
    }
}
