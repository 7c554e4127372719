//! Who uses what of the GPU memory: the backend's measurement attributed to pods — pure
//! decisions, no kube or tonic ([`crate::usage`] is the I/O around them).
//!
//! **Allocated** is what kubelet's PodResources API says each pod's containers hold: our
//! device IDs name their GPU, one device per GiB ([`holdings`]). It is the same fact
//! [`crate::facts`] checks against the extender's decisions; where the two disagree, that is
//! reported there.
//!
//! **Used** needs a process → pod mapping. NVML names processes by PID in the host's PID
//! namespace and nothing else. A process's cgroup path carries its pod's UID (`pod<uid>` in
//! the kubepods hierarchy, `-` or `_` separated under the systemd driver), so the plugin
//! reads `/proc/<pid>/cgroup` ([`pod_uid_from_cgroup`]) and maps the UID to the pod through
//! its pod cache. PodResources alone cannot do it: it says which GPU a pod holds, and on a
//! shared GPU several pods hold the same one. Reading other containers' `/proc/<pid>` needs
//! the host's PID namespace, so the chart's DaemonSet runs with `hostPID: true` when usage
//! is on (`devicePlugin.usage.enabled`); `/proc/<pid>/cgroup` is world-readable, so no
//! capability is added. Without it the processes are not found: their memory is counted on
//! the GPU as *unattributed*, and the plugin says so once. A process outside any gpushare
//! pod (another resource's pod, a host process) is unattributed too. The proc root is a
//! parameter, so the mapping is tested against a fake `/proc` in a temp dir.
//!
//! Why a module of its own: the [`Report`] is what `/metrics` exports
//! ([`crate::metrics::Metrics::record_usage`]) and what the reader publishes; kept beside
//! the reader, the metrics imported the reader while the reader imported the metrics.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use gpushare_contract::GpuInfo;
use gpushare_contract::usage::{NodeMemoryUse, mib_from_bytes};
use gpushare_runtime::gpu::{MemoryUse, MemoryUser};

use crate::facts::{KubeletFacts, device_gpu};

/// Bytes in a GiB: one of our devices.
const GIB: u64 = 1 << 30;

/// The pod UID in one `/proc/<pid>/cgroup` file, if the process runs in a pod.
///
/// Every line is `hierarchy:controllers:path`; the path of a pod's container has a segment
/// `pod<uid>` (cgroupfs driver: `/kubepods/burstable/pod<uid>/<container>`) or
/// `kubepods[-<qos>]-pod<uid with _>.slice` (systemd driver). Under a private cgroup
/// namespace the path is relative (`/../../kubepods-…-pod<uid>.slice/…`), which still holds
/// the segment, so no `kubepods` prefix is required; a UID must have the 8-4-4-4-12 hex form.
pub fn pod_uid_from_cgroup(text: &str) -> Option<String> {
    text.lines()
        .filter_map(|line| line.splitn(3, ':').nth(2))
        .flat_map(|path| path.split('/'))
        .find_map(pod_uid_from_segment)
}

fn pod_uid_from_segment(segment: &str) -> Option<String> {
    let segment = segment.strip_suffix(".slice").unwrap_or(segment);
    let candidate = match segment.strip_prefix("pod") {
        Some(rest) => rest,
        None => &segment[segment.rfind("-pod")? + "-pod".len()..],
    };
    let uid = candidate.replace('_', "-");
    is_uid(&uid).then_some(uid)
}

fn is_uid(text: &str) -> bool {
    let groups: Vec<&str> = text.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(group, len)| group.len() == len && group.chars().all(|c| c.is_ascii_hexdigit()))
}

/// What `/proc/<pid>/cgroup` says about a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PidOwner {
    /// It runs in the pod with this UID.
    Pod(String),
    /// It runs outside any pod (a host process, a daemon).
    NoPod,
    /// There is no such process in this PID namespace (the plugin does not see the host's
    /// processes), or its cgroup file cannot be read.
    Unknown,
}

/// The pod a host PID runs in, read under `proc_root` (the host's `/proc` with `hostPID`).
pub fn pid_owner(proc_root: &Path, pid: u32) -> PidOwner {
    match std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup")) {
        Ok(text) => pod_uid_from_cgroup(&text).map_or(PidOwner::NoPod, PidOwner::Pod),
        Err(_) => PidOwner::Unknown,
    }
}

/// `namespace/name` → GPU UUID → bytes held, from kubelet's listing: one device per GiB.
pub type Holdings = BTreeMap<String, BTreeMap<String, u64>>;

/// `namespace/name` → GPU UUID → the containers holding devices of it, from kubelet's listing.
pub type Holders = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

/// Which containers of each pod hold devices of each GPU in kubelet's listing `facts`: the
/// driver names processes, not containers, so a pod's use of a GPU is labelled with the
/// containers that were given it (one, in all but multi-container GPU pods).
pub fn holders(facts: &KubeletFacts) -> Holders {
    let mut holders = Holders::new();
    for (key, pod) in facts.pods() {
        for (container, ids) in &pod.containers {
            for uuid in ids.iter().filter_map(|id| device_gpu(id)) {
                holders
                    .entry(key.to_owned())
                    .or_default()
                    .entry(uuid.to_owned())
                    .or_default()
                    .insert(container.clone());
            }
        }
    }
    holders
}

/// What each pod holds per GPU in kubelet's listing `facts`.
pub fn holdings(facts: &KubeletFacts) -> Holdings {
    let mut held = Holdings::new();
    for (key, pod) in facts.pods() {
        // A device counts once per pod, whichever containers list it.
        let ids: BTreeSet<&str> = pod
            .containers
            .values()
            .flatten()
            .map(String::as_str)
            .collect();
        for uuid in ids.into_iter().filter_map(device_gpu) {
            let bytes = held
                .entry(key.to_owned())
                .or_default()
                .entry(uuid.to_owned())
                .or_default();
            *bytes = bytes.saturating_add(GIB);
        }
    }
    held
}

/// One pod's memory on one GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    /// Bytes kubelet gave it there.
    pub allocated: u64,
    /// Bytes its processes use there: the driver's figures (NVML, or the simulated usage
    /// file) when the plugin measures them, else what the interposer counted.
    pub used: u64,
    /// Bytes the isolation interposer counted for it there, when it is loaded and the driver's
    /// figures are `used` ([`Report::with_counted`]): the two differ for a program the interposer does
    /// not see (a static binary, one that dropped `LD_PRELOAD`) or a tampered budget.
    pub counted: Option<u64>,
}

impl Held {
    /// Bytes used past the allocation (0 within it).
    pub fn over_share(&self) -> u64 {
        self.used.saturating_sub(self.allocated)
    }
}

/// One GPU's memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuMemory {
    /// Index on the node.
    pub index: u32,
    /// UUID.
    pub uuid: String,
    /// Bytes kubelet gave pods on it.
    pub allocated: u64,
    /// Bytes every process on it uses.
    pub used: u64,
    /// Of `used`, bytes no gpushare pod could be named for.
    pub unattributed: u64,
}

/// One measurement of the node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Every GPU, by index.
    pub gpus: Vec<GpuMemory>,
    /// `namespace/name` → GPU index → memory; empty when kubelet's listing is unavailable.
    pub pods: BTreeMap<String, BTreeMap<u32, Held>>,
    /// GPU processes whose `/proc/<pid>` could not be read.
    pub unknown_pids: usize,
    /// `(namespace/name, GPU index)` → the containers given that GPU, joined with `+`
    /// (see [`holders`]); absent where kubelet's listing names none.
    pub containers: BTreeMap<(String, u32), String>,
}

impl Report {
    /// Adds the containers that hold each pod's GPUs (kubelet's listing, [`holders`]).
    pub fn with_holders(mut self, holders: &Holders) -> Self {
        let index_of: HashMap<&str, u32> = self
            .gpus
            .iter()
            .map(|g| (g.uuid.as_str(), g.index))
            .collect();
        for (key, by_uuid) in holders {
            for (uuid, containers) in by_uuid {
                if let Some(&index) = index_of.get(uuid.as_str()) {
                    let names: Vec<&str> = containers.iter().map(String::as_str).collect();
                    self.containers
                        .insert((key.clone(), index), names.join("+"));
                }
            }
        }
        self
    }

    /// Adds what the interposer counted (`counted`, a report over the same GPUs made from its
    /// budget files) beside the driver's figures.
    pub fn with_counted(mut self, counted: &Report) -> Self {
        for (key, gpus) in &mut self.pods {
            for (index, held) in gpus.iter_mut() {
                held.counted = Some(
                    counted
                        .pods
                        .get(key)
                        .and_then(|gpus| gpus.get(index))
                        .map_or(0, |c| c.used),
                );
            }
        }
        self
    }

    /// The containers given GPU `index` of pod `key`, joined with `+`; empty if unknown.
    pub fn containers_of(&self, key: &str, index: u32) -> &str {
        self.containers
            .get(&(key.to_owned(), index))
            .map_or("", String::as_str)
    }

    /// Pods whose processes use more than they hold on some GPU.
    pub fn over_share(&self) -> BTreeSet<String> {
        self.pods
            .iter()
            .filter(|(_, gpus)| gpus.values().any(|held| held.used > held.allocated))
            .map(|(key, _)| key.clone())
            .collect()
    }

    /// The node annotation's content (MiB).
    pub fn annotation(&self) -> NodeMemoryUse {
        NodeMemoryUse {
            gpus: self
                .gpus
                .iter()
                .map(|gpu| (gpu.index, mib_from_bytes(gpu.used)))
                .collect(),
            pods: self
                .pods
                .iter()
                .map(|(key, gpus)| {
                    let used = gpus.values().map(|held| held.used).sum::<u64>();
                    (key.clone(), mib_from_bytes(used))
                })
                .collect(),
            counted: self
                .pods
                .iter()
                .filter_map(|(key, gpus)| {
                    let counted = gpus
                        .values()
                        .map(|held| held.counted)
                        .sum::<Option<u64>>()?;
                    Some((key.clone(), mib_from_bytes(counted)))
                })
                .collect(),
            compute: Default::default(),
        }
    }
}

/// Who uses what: `uses` from the backend, attributed to pods.
///
/// - `held`: what each pod holds per GPU UUID (kubelet's listing); `None` when it could not
///   be read: GPU totals are still measured, pods are not reported.
/// - `key_of_uid`: pod UID → `namespace/name` for the gpushare pods on the node.
/// - `owner`: which pod a host PID runs in.
///
/// A process in a gpushare pod counts for that pod on the GPU it runs on, even one the pod
/// holds nothing of (that is over its share there). A simulated pod's use is spread over the
/// GPUs it holds in proportion; a pod holding nothing is not on this node and is ignored.
pub fn attribute(
    gpus: &[GpuInfo],
    held: Option<&Holdings>,
    key_of_uid: &HashMap<String, String>,
    uses: &[MemoryUse],
    mut owner: impl FnMut(u32) -> PidOwner,
) -> Report {
    let index_of: HashMap<&str, u32> = gpus.iter().map(|g| (g.uuid.as_str(), g.index)).collect();
    let mut report = Report {
        gpus: gpus
            .iter()
            .map(|gpu| GpuMemory {
                index: gpu.index,
                uuid: gpu.uuid.clone(),
                allocated: 0,
                used: 0,
                unattributed: 0,
            })
            .collect(),
        ..Report::default()
    };
    for (key, by_uuid) in held.into_iter().flatten() {
        for (uuid, &bytes) in by_uuid {
            let Some(&index) = index_of.get(uuid.as_str()) else {
                continue;
            };
            report
                .pods
                .entry(key.clone())
                .or_default()
                .entry(index)
                .or_default()
                .allocated += bytes;
        }
    }
    for gpu in &mut report.gpus {
        gpu.allocated = report
            .pods
            .values()
            .filter_map(|held| held.get(&gpu.index))
            .map(|held| held.allocated)
            .sum();
    }
    let add = |report: &mut Report, index: u32, pod: Option<&str>, bytes: u64| {
        let Some(gpu) = report.gpus.iter_mut().find(|gpu| gpu.index == index) else {
            return;
        };
        gpu.used = gpu.used.saturating_add(bytes);
        match pod.filter(|_| held.is_some()) {
            Some(key) => {
                let slot = report
                    .pods
                    .entry(key.to_owned())
                    .or_default()
                    .entry(index)
                    .or_default();
                slot.used = slot.used.saturating_add(bytes);
            }
            None => gpu.unattributed = gpu.unattributed.saturating_add(bytes),
        }
    };
    for use_ in uses {
        match (&use_.user, use_.gpu) {
            (MemoryUser::Process(pid), Some(index)) => {
                let key = match owner(*pid) {
                    PidOwner::Pod(uid) => key_of_uid.get(&uid).map(String::as_str),
                    PidOwner::NoPod => None,
                    PidOwner::Unknown => {
                        report.unknown_pids += 1;
                        None
                    }
                };
                add(&mut report, index, key, use_.bytes);
            }
            (MemoryUser::Pod(key), Some(index)) => {
                add(&mut report, index, Some(key), use_.bytes);
            }
            (MemoryUser::Pod(key), None) => {
                let Some(shares) = report.pods.get(key) else {
                    continue;
                };
                let shares: Vec<(u32, u64)> = shares
                    .iter()
                    .map(|(&i, held)| (i, held.allocated))
                    .collect();
                for (index, bytes) in spread(use_.bytes, &shares) {
                    add(&mut report, index, Some(key), bytes);
                }
            }
            // A process without a GPU is not something NVML reports.
            (MemoryUser::Process(_), None) => {}
        }
    }
    report
}

/// `bytes` split over `shares` (GPU index, weight) in proportion, the remainder on the last.
fn spread(bytes: u64, shares: &[(u32, u64)]) -> Vec<(u32, u64)> {
    let total: u128 = shares.iter().map(|&(_, w)| u128::from(w)).sum();
    let Some(((last, _), rest)) = shares.split_last() else {
        return Vec::new();
    };
    if total == 0 {
        return vec![(*last, bytes)];
    }
    let mut out: Vec<(u32, u64)> = rest
        .iter()
        .map(|&(index, weight)| {
            let part = u128::from(bytes) * u128::from(weight) / total;
            (index, u64::try_from(part).unwrap_or(bytes))
        })
        .collect();
    let given: u64 = out.iter().map(|&(_, b)| b).sum();
    out.push((*last, bytes.saturating_sub(given)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID_A: &str = "0f3c8e42-1b6d-4f0a-9c1e-2d7b5a9e8c41";
    const UID_B: &str = "7a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9";

    fn gpu(index: u32) -> GpuInfo {
        GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            model: "T".into(),
            mem_gib: 16,
            healthy: true,
            numa_node: None,
        }
    }

    #[test]
    fn pod_uids_are_found_under_every_cgroup_layout() {
        let underscored = UID_A.replace('-', "_");
        for (text, want) in [
            // cgroup v1, cgroupfs driver.
            (
                format!(
                    "12:memory:/kubepods/burstable/pod{UID_A}/4e1a9c\n11:cpu:/kubepods/burstable/pod{UID_A}/4e1a9c\n"
                ),
                Some(UID_A),
            ),
            // cgroup v2, systemd driver.
            (
                format!(
                    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{underscored}.slice/cri-containerd-4e1a9c.scope\n"
                ),
                Some(UID_A),
            ),
            // Guaranteed QoS, systemd.
            (
                format!(
                    "0::/kubepods.slice/kubepods-pod{underscored}.slice/cri-containerd-4e1a9c.scope\n"
                ),
                Some(UID_A),
            ),
            // Guaranteed QoS, cgroupfs, v2.
            (format!("0::/kubepods/pod{UID_B}/abc\n"), Some(UID_B)),
            // A private cgroup namespace: relative to the reader's own cgroup.
            (
                format!("0::/../../besteffort/pod{UID_B}/abc\n"),
                Some(UID_B),
            ),
            // Nested: a kind node inside docker.
            (
                format!("0::/system.slice/docker-1234.scope/kubepods/besteffort/pod{UID_B}/abc\n"),
                Some(UID_B),
            ),
            // Not a pod.
            (
                "0::/system.slice/nvidia-persistenced.service\n".to_owned(),
                None,
            ),
            ("0::/\n".to_owned(), None),
            ("0::/kubepods/burstable/podnot-a-uid/abc\n".to_owned(), None),
            ("".to_owned(), None),
            ("garbage without colons".to_owned(), None),
        ] {
            assert_eq!(pod_uid_from_cgroup(&text).as_deref(), want, "{text}");
        }
    }

    #[test]
    fn pids_are_read_under_the_proc_root() {
        let proc_root = tempfile::tempdir().unwrap();
        let write = |pid: u32, text: String| {
            let dir = proc_root.path().join(pid.to_string());
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("cgroup"), text).unwrap();
        };
        write(100, format!("0::/kubepods/burstable/pod{UID_A}/c1\n"));
        write(200, "0::/system.slice/sshd.service\n".to_owned());
        assert_eq!(
            pid_owner(proc_root.path(), 100),
            PidOwner::Pod(UID_A.into())
        );
        assert_eq!(pid_owner(proc_root.path(), 200), PidOwner::NoPod);
        assert_eq!(pid_owner(proc_root.path(), 300), PidOwner::Unknown);
    }

    fn holdings_of(pods: &[(&str, &[(u32, u64)])]) -> Holdings {
        pods.iter()
            .map(|(key, gpus)| {
                let by_uuid = gpus
                    .iter()
                    .map(|&(index, gib)| (format!("GPU-{index}"), gib * GIB))
                    .collect();
                ((*key).to_owned(), by_uuid)
            })
            .collect()
    }

    fn process(gpu: u32, pid: u32, gib: u64) -> MemoryUse {
        MemoryUse {
            gpu: Some(gpu),
            user: MemoryUser::Process(pid),
            bytes: gib * GIB,
        }
    }

    #[test]
    fn holdings_count_one_gib_per_device_per_gpu() {
        let facts = KubeletFacts::new(
            std::time::Instant::now(),
            [("default".to_owned(), "a".to_owned())],
            [
                (
                    "default".to_owned(),
                    "a".to_owned(),
                    "main".to_owned(),
                    vec!["GPU-0-0".into(), "GPU-0-1".into(), "GPU-1-7".into()],
                ),
                (
                    "default".to_owned(),
                    "a".to_owned(),
                    "side".to_owned(),
                    // GPU-0-1 listed again: counted once.
                    vec!["GPU-0-2".into(), "GPU-0-1".into(), "garbage".into()],
                ),
            ],
        );
        assert_eq!(
            holdings(&facts),
            holdings_of(&[("default/a", &[(0, 3), (1, 1)])])
        );
        // Which containers were given each GPU: the label of the pod's use there.
        let report = attribute(
            &[gpu(0), gpu(1)],
            Some(&holdings(&facts)),
            &HashMap::new(),
            &[],
            |_| PidOwner::Unknown,
        )
        .with_holders(&holders(&facts));
        assert_eq!(report.containers_of("default/a", 0), "main+side");
        assert_eq!(report.containers_of("default/a", 1), "main");
        assert_eq!(report.containers_of("default/b", 0), "");
    }

    #[test]
    fn the_interposers_count_is_shown_beside_the_drivers() {
        let gpus = [gpu(0)];
        let held = holdings_of(&[("default/a", &[(0, 4)]), ("default/b", &[(0, 2)])]);
        let driver = [
            MemoryUse {
                gpu: Some(0),
                user: MemoryUser::Pod("default/a".into()),
                bytes: 6 * GIB,
            },
            MemoryUse {
                gpu: Some(0),
                user: MemoryUser::Pod("default/b".into()),
                bytes: GIB,
            },
        ];
        let counted = [MemoryUse {
            gpu: Some(0),
            user: MemoryUser::Pod("default/a".into()),
            bytes: 3 * GIB,
        }];
        let none = |_| PidOwner::Unknown;
        let counted = attribute(&gpus, Some(&held), &HashMap::new(), &counted, none);
        let report =
            attribute(&gpus, Some(&held), &HashMap::new(), &driver, none).with_counted(&counted);
        let a = report.pods["default/a"][&0];
        assert_eq!(
            (a.used, a.counted, a.over_share()),
            (6 * GIB, Some(3 * GIB), 2 * GIB)
        );
        // b's interposer counted nothing: 0, not unknown.
        assert_eq!(report.pods["default/b"][&0].counted, Some(0));
        let annotation = report.annotation();
        assert_eq!(annotation.pods["default/a"], 6144);
        assert_eq!(annotation.counted["default/a"], 3072);
        assert_eq!(annotation.counted["default/b"], 0);
    }

    #[test]
    fn processes_are_traced_to_their_pods_through_cgroups() {
        let gpus = [gpu(0), gpu(1)];
        let held = holdings_of(&[("default/a", &[(0, 4)]), ("default/b", &[(0, 2)])]);
        let key_of_uid = HashMap::from([
            (UID_A.to_owned(), "default/a".to_owned()),
            (UID_B.to_owned(), "default/b".to_owned()),
        ]);
        let uses = [
            process(0, 10, 3),
            process(0, 11, 1),
            process(0, 20, 5), // b: over its 2 GiB
            process(1, 21, 1), // b on a GPU it holds nothing of
            process(0, 30, 1), // a host process
            process(1, 40, 2), // not visible: no hostPID
        ];
        let owner = |pid| match pid {
            10 | 11 => PidOwner::Pod(UID_A.into()),
            20 | 21 => PidOwner::Pod(UID_B.into()),
            30 => PidOwner::NoPod,
            _ => PidOwner::Unknown,
        };
        let report = attribute(&gpus, Some(&held), &key_of_uid, &uses, owner);
        let a = &report.pods["default/a"];
        assert_eq!(
            a[&0],
            Held {
                allocated: 4 * GIB,
                used: 4 * GIB,
                counted: None,
            }
        );
        let b = &report.pods["default/b"];
        assert_eq!(
            b[&0],
            Held {
                allocated: 2 * GIB,
                used: 5 * GIB,
                counted: None,
            }
        );
        assert_eq!(
            b[&1],
            Held {
                allocated: 0,
                used: GIB,
                counted: None,
            }
        );
        assert_eq!(
            report.over_share(),
            BTreeSet::from(["default/b".to_owned()])
        );
        assert_eq!(
            report.gpus[0],
            GpuMemory {
                index: 0,
                uuid: "GPU-0".into(),
                allocated: 6 * GIB,
                used: 10 * GIB,
                unattributed: GIB,
            }
        );
        assert_eq!(
            (report.gpus[1].used, report.gpus[1].unattributed),
            (3 * GIB, 2 * GIB)
        );
        assert_eq!(report.unknown_pids, 1);
        let annotation = report.annotation();
        assert_eq!(
            annotation.pods,
            BTreeMap::from([
                ("default/a".to_owned(), 4096),
                ("default/b".to_owned(), 6144)
            ])
        );
        assert_eq!(annotation.gpus, BTreeMap::from([(0, 10240), (1, 3072)]));
    }

    #[test]
    fn without_kubelets_listing_only_gpu_totals_are_reported() {
        let key_of_uid = HashMap::from([(UID_A.to_owned(), "default/a".to_owned())]);
        let report = attribute(&[gpu(0)], None, &key_of_uid, &[process(0, 10, 3)], |_| {
            PidOwner::Pod(UID_A.into())
        });
        assert!(report.pods.is_empty());
        assert_eq!(
            (report.gpus[0].used, report.gpus[0].unattributed),
            (3 * GIB, 3 * GIB)
        );
    }

    #[test]
    fn simulated_pod_use_is_spread_over_the_gpus_the_pod_holds() {
        let held = holdings_of(&[("default/a", &[(0, 3), (1, 1)]), ("default/b", &[(1, 2)])]);
        let uses = [
            MemoryUse {
                gpu: None,
                user: MemoryUser::Pod("default/a".into()),
                bytes: 8 * GIB,
            },
            MemoryUse {
                gpu: None,
                user: MemoryUser::Pod("default/elsewhere".into()),
                bytes: GIB,
            },
        ];
        let report = attribute(
            &[gpu(0), gpu(1)],
            Some(&held),
            &HashMap::new(),
            &uses,
            |_| PidOwner::Unknown,
        );
        let a = &report.pods["default/a"];
        assert_eq!((a[&0].used, a[&1].used), (6 * GIB, 2 * GIB));
        assert_eq!(report.pods["default/b"][&1].used, 0);
        assert!(!report.pods.contains_key("default/elsewhere"));
        assert_eq!(
            report.over_share(),
            BTreeSet::from(["default/a".to_owned()])
        );
        assert_eq!(report.unknown_pids, 0);
        assert_eq!(spread(10, &[(0, 1), (1, 2)]), [(0, 3), (1, 7)]);
        assert_eq!(spread(10, &[(0, 0)]), [(0, 10)]);
        assert!(spread(10, &[]).is_empty());
    }
}
