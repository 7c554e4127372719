//! How much of its GPUs' SM time each pod with a compute share used, from the interposer's
//! own measurement, for `kubectl gpushare top -d` (the `compute` of the usage annotation).
//! Extender mode: DRA claims' accounting directories (`claim-<uid>`) name no pod.
//!
//! ```text
//!   <isolation host dir>/containers/<ns>_<pod>_<container>_<n>/budget-….v1
//!        └─ stat: device and inode ──▶ container id (gpushare_isolation_budget::compute::container_id)
//!   <isolation host dir>/compute/compute-<GPU uuid>.v1          (one per GPU, every container's entry)
//!        └─ entries: id, busy ns (the SM time its kernels ran, from CUDA events)
//!   each entry's busy ns, twice, a period apart ──▶ per pod and GPU ──▶ percent of the pod's GPUs' time
//! ```
//!
//! Why the interposer's figure and not NVML's per-process utilization: it is what holds the
//! share (the same number the throttle compares), it needs no host PIDs, and NVML samples
//! lag by a sixth of a second or more. The container's entry carries the id the interposer
//! derives from its budget file; the plugin made that file (at Allocate) and reads the same
//! device and inode on the host, so no name has to be trusted from inside the container.
//! Differences are taken per entry, never per pod: an entry the meter sees for the first time
//! (a restarted plugin, a new container, a pod back in the live list) only sets its baseline,
//! and one whose counter went back (an entry taken over by a container whose budget file
//! reuses a dead one's inode) too, so a counter's past never shows as one period's use.
//! The state files are read as the budget files are: no link followed, no FIFO waited on.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Instant;

use gpushare_contract::GpuInfo;
use gpushare_isolation_budget::budgets_in;
use gpushare_isolation_budget::compute::{budget_container_id, compute_path};

use crate::isolation_usage::parse_dir_name;

/// One container's entry in one GPU's compute state, as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryBusy {
    /// The pod, `namespace/name`.
    pub pod: String,
    /// How many GPUs the pod holds on the node.
    pub pod_gpus: usize,
    /// The GPU's UUID.
    pub gpu: String,
    /// The entry's container id.
    pub id: u64,
    /// SM nanoseconds the container's kernels ran on the GPU, since the entry was made.
    pub busy_ns: u64,
}

/// The entries of the compute state files of `gpus` under `host_dir` that belong to the
/// containers of the pods of `live` (`namespace/name` → the indexes of the GPUs it holds).
pub fn entries(
    host_dir: &Path,
    live: &BTreeMap<String, Vec<u32>>,
    gpus: &[GpuInfo],
) -> Vec<EntryBusy> {
    let mut pod_of_id: HashMap<u64, &str> = HashMap::new();
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
        let Some((pod, _)) = live.get_key_value(&pod) else {
            continue;
        };
        for (path, _) in budgets_in(&entry.path()).unwrap_or_default() {
            if let Ok(id) = budget_container_id(&path) {
                pod_of_id.insert(id, pod.as_str());
            }
        }
    }
    let mut found = Vec::new();
    if pod_of_id.is_empty() {
        return found;
    }
    let dir = gpushare_runtime::isolation::compute_dir_path(host_dir);
    for gpu in gpus {
        let Ok(state) = gpushare_isolation_budget::compute::read(&compute_path(&dir, &gpu.uuid))
        else {
            continue;
        };
        for entry in state {
            if let Some(&pod) = pod_of_id.get(&entry.id) {
                found.push(EntryBusy {
                    pod: pod.to_owned(),
                    pod_gpus: live.get(pod).map_or(1, Vec::len).max(1),
                    gpu: gpu.uuid.clone(),
                    id: entry.id,
                    busy_ns: entry.busy_ns,
                });
            }
        }
    }
    found
}

/// Each entry's busy ns, by (container id, GPU UUID).
type BusyByEntry = HashMap<(u64, String), u64>;

/// Turns busy-time counters read a period apart into percents of the time in between.
#[derive(Debug, Default)]
pub struct ComputeMeter {
    /// When the last entries were read, and what each had run.
    last: Option<(Instant, BusyByEntry)>,
}

impl ComputeMeter {
    /// The percent of its GPUs' time each pod's kernels ran since the last call: per GPU its
    /// containers' busy time (at most the time that passed), over all the GPUs it holds.
    /// An entry seen for the first time, or whose counter went back (another container took
    /// it over), only sets its baseline; a pod with no entry measured over the period is not
    /// in the answer. At most 100.
    pub fn observe(&mut self, now: Instant, entries: Vec<EntryBusy>) -> BTreeMap<String, u32> {
        let mut used = BTreeMap::new();
        if let Some((then, before)) = &self.last {
            let wall = now.saturating_duration_since(*then).as_nanos();
            if wall > 0 {
                let mut per_gpu: BTreeMap<(&str, &str), (u128, usize)> = BTreeMap::new();
                for entry in &entries {
                    let Some(&earlier) = before.get(&(entry.id, entry.gpu.clone())) else {
                        continue;
                    };
                    let Some(ran) = entry.busy_ns.checked_sub(earlier) else {
                        continue;
                    };
                    let slot = per_gpu
                        .entry((&entry.pod, &entry.gpu))
                        .or_insert((0, entry.pod_gpus));
                    slot.0 = (slot.0 + u128::from(ran)).min(wall);
                }
                let mut per_pod: BTreeMap<&str, (u128, usize)> = BTreeMap::new();
                for ((pod, _), (ran, gpus)) in per_gpu {
                    let slot = per_pod.entry(pod).or_insert((0, gpus));
                    slot.0 += ran;
                }
                for (pod, (ran, gpus)) in per_pod {
                    let of = wall * gpus as u128;
                    let percent = ((ran * 100 + of / 2) / of).min(100);
                    used.insert(pod.to_owned(), u32::try_from(percent).unwrap_or(100));
                }
            }
        }
        let read = entries
            .into_iter()
            .map(|entry| ((entry.id, entry.gpu), entry.busy_ns))
            .collect();
        self.last = Some((now, read));
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
    fn each_containers_entry_is_found_by_its_budget_files_identity() {
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
            ("default/b".to_owned(), vec![0, 1]),
        ]);
        let mut found: Vec<(String, usize, u64, u64)> =
            entries(host.path(), &live, &[gpu(0), gpu(1)])
                .into_iter()
                .map(|e| (e.pod, e.pod_gpus, e.id, e.busy_ns))
                .collect();
        found.sort();
        let mut want = vec![
            ("default/a".to_owned(), 1, a, 1_000),
            ("default/a".to_owned(), 1, a_side, 500),
            ("default/b".to_owned(), 2, b, 7_000),
        ];
        want.sort();
        assert_eq!(found, want);
    }

    fn busy(pod: &str, pod_gpus: usize, gpu: &str, id: u64, busy_ns: u64) -> EntryBusy {
        EntryBusy {
            pod: pod.to_owned(),
            pod_gpus,
            gpu: gpu.to_owned(),
            id,
            busy_ns,
        }
    }

    #[test]
    fn counters_a_period_apart_become_percents_of_the_pods_gpus() {
        const S: u64 = 1_000_000_000;
        let mut meter = ComputeMeter::default();
        let start = Instant::now();
        let at = |seconds: u64| start + Duration::from_secs(seconds);
        let first = vec![
            busy("ns/a", 1, "GPU-0", 1, S),
            busy("ns/b", 2, "GPU-0", 2, 10 * S),
            busy("ns/b", 2, "GPU-1", 3, 10 * S),
        ];
        assert!(meter.observe(at(0), first).is_empty(), "a baseline only");
        let second = vec![
            // 300 ms of a second: 30 %.
            busy("ns/a", 1, "GPU-0", 1, S + 300_000_000),
            // Two containers of one pod on one GPU, the new one a baseline only.
            busy("ns/a", 1, "GPU-0", 7, 40 * S),
            // 500 + 100 ms over two GPU-seconds.
            busy("ns/b", 2, "GPU-0", 2, 10 * S + 500_000_000),
            busy("ns/b", 2, "GPU-1", 3, 10 * S + 100_000_000),
            // New to the meter with a long past (a restarted plugin, a pod back in the
            // live list): not a figure yet, whatever its counter says.
            busy("ns/c", 1, "GPU-1", 4, 99 * S),
        ];
        let used = meter.observe(at(1), second);
        assert_eq!(
            used,
            BTreeMap::from([("ns/a".to_owned(), 30), ("ns/b".to_owned(), 30)])
        );
        let third = vec![
            // Its counter went back (another container took the entry over): a baseline.
            busy("ns/a", 1, "GPU-0", 1, 200_000_000),
            // More than the time that passed (two containers' events overlapping): 100 % at most.
            busy("ns/a", 1, "GPU-0", 7, 42 * S),
            busy("ns/c", 1, "GPU-1", 4, 99 * S + 250_000_000),
        ];
        let used = meter.observe(at(2), third);
        assert_eq!(
            used,
            BTreeMap::from([("ns/a".to_owned(), 100), ("ns/c".to_owned(), 25)])
        );
    }
}
