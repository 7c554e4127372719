//! How much of its GPUs' SM time each pod with a compute share used, from the interposer's
//! own measurement, for `kubectl gpushare top -d` (the `compute` of the usage annotation).
//!
//! ```text
//!   <isolation host dir>/containers/<ns>_<pod>_<container>_<n>/budget-….v1
//!        └─ stat: device and inode ──▶ container id (gpushare_isolation_budget::compute::container_id)
//!   <isolation host dir>/compute/compute-<GPU uuid>.v1          (one per GPU, every container's entry)
//!        └─ entries: id, busy ns (the SM time its kernels ran, from CUDA events)
//!   busy ns per pod, twice, a period apart ──▶ percent of the pod's GPUs' time
//! ```
//!
//! Why the interposer's figure and not NVML's per-process utilization: it is what holds the
//! share (the same number the throttle compares), it needs no host PIDs, and NVML samples
//! lag by a sixth of a second or more. The container's entry carries the id the interposer
//! derives from its budget file; the plugin made that file (at Allocate) and reads the same
//! device and inode on the host, so no name has to be trusted from inside the container.
//! A container restarted with a new budget file starts a new entry from 0: such a counter
//! going backwards counts from 0, never as a negative use.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Instant;

use gpushare_contract::GpuInfo;
use gpushare_isolation_budget::budgets_in;
use gpushare_isolation_budget::compute::{budget_container_id, compute_path};

use crate::isolation_usage::parse_dir_name;

/// SM nanoseconds of kernels, by (`namespace/name` of the pod, GPU UUID).
pub type BusyByPod = BTreeMap<(String, String), u64>;

/// SM nanoseconds each pod's kernels ran, summed over its containers, by (`namespace/name`,
/// GPU UUID): what the compute state files of `gpus` under `host_dir` say, for the pods of
/// `live` (`namespace/name`).
pub fn busy_by_pod(
    host_dir: &Path,
    live: &BTreeMap<String, Vec<u32>>,
    gpus: &[GpuInfo],
) -> BusyByPod {
    let mut pod_of_id: HashMap<u64, String> = HashMap::new();
    let containers = host_dir.join("containers");
    for entry in std::fs::read_dir(&containers)
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some((pod, _container)) = parse_dir_name(&name) else {
            continue;
        };
        if !live.contains_key(&pod) {
            continue;
        }
        for (path, _) in budgets_in(&entry.path()).unwrap_or_default() {
            if let Ok(id) = budget_container_id(&path) {
                pod_of_id.insert(id, pod.clone());
            }
        }
    }
    let mut busy = BTreeMap::new();
    if pod_of_id.is_empty() {
        return busy;
    }
    let dir = gpushare_runtime::isolation::compute_dir_path(host_dir);
    for gpu in gpus {
        let Ok(entries) = gpushare_isolation_budget::compute::read(&compute_path(&dir, &gpu.uuid))
        else {
            continue;
        };
        for entry in entries {
            if let Some(pod) = pod_of_id.get(&entry.id) {
                let total: &mut u64 = busy.entry((pod.clone(), gpu.uuid.clone())).or_default();
                *total = total.saturating_add(entry.busy_ns);
            }
        }
    }
    busy
}

/// Turns busy-time counters read a period apart into percents of the time in between.
#[derive(Debug, Default)]
pub struct ComputeMeter {
    last: Option<(Instant, BusyByPod)>,
}

impl ComputeMeter {
    /// The percent of its GPUs' time each pod's kernels ran since the last call (averaged
    /// over the GPUs it has an entry on); empty on the first call, which only sets the
    /// baseline. A pod seen for the first time counts from 0.
    pub fn observe(&mut self, now: Instant, busy: BusyByPod) -> BTreeMap<String, u32> {
        let mut used = BTreeMap::new();
        if let Some((then, before)) = &self.last {
            let wall = now.saturating_duration_since(*then).as_nanos();
            if wall > 0 {
                let mut per_pod: BTreeMap<&str, (u128, u128)> = BTreeMap::new();
                for ((pod, gpu), &ns) in &busy {
                    let earlier = before.get(&(pod.clone(), gpu.clone())).copied();
                    // A counter that went back is a new entry (a restarted container).
                    let ran = match earlier {
                        Some(earlier) if earlier <= ns => ns - earlier,
                        _ => ns,
                    };
                    let (sum, gpus) = per_pod.entry(pod).or_default();
                    *sum += u128::from(ran);
                    *gpus += 1;
                }
                for (pod, (ran, gpus)) in per_pod {
                    let percent = (ran * 100 + wall * gpus / 2) / (wall * gpus);
                    used.insert(pod.to_owned(), u32::try_from(percent).unwrap_or(u32::MAX));
                }
            }
        }
        self.last = Some((now, busy));
        used
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use gpushare_isolation_budget::compute::{
        ENTRY_BUSY, ENTRY_ID, ENTRY_LEN, ENTRY_PERCENT, FILE_LEN, HEADER_LEN, header,
    };
    use gpushare_isolation_budget::{Limits, budget_path};

    use super::*;

    fn gpu(index: u32) -> GpuInfo {
        GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            model: String::new(),
            mem_gib: 16,
            healthy: true,
            numa_node: None,
        }
    }

    /// A compute state file with one entry per `(id, busy ns)`.
    fn state(entries: &[(u64, u64)]) -> Vec<u8> {
        let mut bytes = vec![0u8; FILE_LEN];
        bytes[..HEADER_LEN].copy_from_slice(&header());
        for (i, (id, busy)) in entries.iter().enumerate() {
            let at = HEADER_LEN + i * ENTRY_LEN;
            bytes[at + ENTRY_ID..at + ENTRY_ID + 8].copy_from_slice(&id.to_ne_bytes());
            bytes[at + ENTRY_PERCENT..at + ENTRY_PERCENT + 4].copy_from_slice(&30u32.to_ne_bytes());
            bytes[at + ENTRY_BUSY..at + ENTRY_BUSY + 8].copy_from_slice(&busy.to_ne_bytes());
        }
        bytes
    }

    /// An accounting directory for `pod`'s `container` with a budget file in it; its id.
    fn container(host: &Path, pod: &str, container: &str) -> u64 {
        let (namespace, name) = pod.split_once('/').unwrap();
        let dir = host
            .join("containers")
            .join(format!("{namespace}_{name}_{container}_1"));
        std::fs::create_dir_all(&dir).unwrap();
        let path = budget_path(&dir, "container", &Limits::new(vec![4 << 30]));
        std::fs::write(&path, b"").unwrap();
        budget_container_id(&path).unwrap()
    }

    #[test]
    fn each_pods_busy_time_is_found_by_its_budget_files_identity() {
        let host = tempfile::tempdir().unwrap();
        let a = container(host.path(), "default/a", "main");
        let a_side = container(host.path(), "default/a", "side");
        let b = container(host.path(), "default/b", "main");
        let gone = container(host.path(), "default/gone", "main");
        let dir = gpushare_runtime::isolation::compute_dir_path(host.path());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            compute_path(&dir, "GPU-0"),
            state(&[(a, 1_000), (a_side, 500), (b, 7_000), (gone, 9), (12345, 9)]),
        )
        .unwrap();
        std::fs::write(compute_path(&dir, "GPU-1"), b"not a state file").unwrap();
        let live = BTreeMap::from([
            ("default/a".to_owned(), vec![0]),
            ("default/b".to_owned(), vec![0]),
        ]);
        let busy = busy_by_pod(host.path(), &live, &[gpu(0), gpu(1)]);
        assert_eq!(
            busy,
            BTreeMap::from([
                (("default/a".to_owned(), "GPU-0".to_owned()), 1_500),
                (("default/b".to_owned(), "GPU-0".to_owned()), 7_000),
            ])
        );
    }

    #[test]
    fn counters_a_period_apart_become_percents() {
        let key = |pod: &str, gpu: &str| (pod.to_owned(), gpu.to_owned());
        let mut meter = ComputeMeter::default();
        let start = Instant::now();
        let first = BTreeMap::from([(key("ns/a", "GPU-0"), 1_000_000_000)]);
        assert!(meter.observe(start, first).is_empty(), "a baseline only");
        let second = BTreeMap::from([
            // 300 ms of a second: 30 %.
            (key("ns/a", "GPU-0"), 1_300_000_000),
            // New this period, on two GPUs: 500 + 100 ms over two GPU-seconds.
            (key("ns/b", "GPU-0"), 500_000_000),
            (key("ns/b", "GPU-1"), 100_000_000),
        ]);
        let used = meter.observe(start + Duration::from_secs(1), second);
        assert_eq!(
            used,
            BTreeMap::from([("ns/a".to_owned(), 30), ("ns/b".to_owned(), 30)])
        );
        // A counter that went back (a restarted container's new entry) counts from 0.
        let third = BTreeMap::from([(key("ns/a", "GPU-0"), 200_000_000)]);
        let used = meter.observe(start + Duration::from_secs(2), third);
        assert_eq!(used, BTreeMap::from([("ns/a".to_owned(), 20)]));
    }
}
