//! The environment the device plugin hands each container at `Allocate`.
//!
//! `NVIDIA_VISIBLE_DEVICES` pins the container to its GPU (the NVIDIA container runtime reads
//! it; a multi-GPU pod's containers get the comma-separated list, as do `GPUSHARE_GPU_INDEX`
//! and `GPUSHARE_GPU_UUID`, and `GPUSHARE_GPU_COUNT` says how many); the `GPUSHARE_*` variables let an application cap its own memory use, for example
//! `torch.cuda.set_per_process_memory_fraction(GIB / TOTAL_GIB)`.
//!
//! [`container_env`] builds it, for the device plugin's `Allocate` and the DRA plugin's CDI
//! devices alike, so both modes hand a container the same variables.
//!
//! With [`Enforcement::Preload`], the interposer's own settings ride along when a plugin is
//! given them ([`IsolationOptions`], the chart's `isolation.contextMiB` and
//! `isolation.managedMemory`): `GPUSHARE_CONTEXT_MIB` and `GPUSHARE_MANAGED_MEMORY`.

use std::collections::HashMap;

// The interposer's side: every variable it reads is named there, once, and written here by
// those names (the tests read what `container_env` writes back through its parsers).
use gpushare_isolation_budget as reader_side;

use crate::{ContainerRequest, GpuInfo};

/// The GPU's UUID; read by the NVIDIA container runtime.
pub const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
/// Index of the GPU on the node.
pub const GPU_INDEX: &str = "GPUSHARE_GPU_INDEX";
/// UUID of the GPU (same as `NVIDIA_VISIBLE_DEVICES`); the interposer keys budgets by it.
pub const GPU_UUID: &str = reader_side::settings::ENV_GPU_UUID;
/// GiB granted to this container.
pub const CONTAINER_GIB: &str = reader_side::limits::ENV_MEM_GIB;
/// GiB the whole pod holds on the GPU.
pub const POD_GIB: &str = "GPUSHARE_POD_MEM_GIB";
/// Total GiB of the GPU (of the smallest, for a multi-GPU pod).
pub const GPU_TOTAL_GIB: &str = "GPUSHARE_GPU_MEM_GIB";
/// Number of GPUs the container sees; `GPUSHARE_CONTAINER_MEM_GIB` is spread evenly over them.
pub const GPU_COUNT: &str = reader_side::limits::ENV_GPU_COUNT;
/// GiB granted to this container on each of its GPUs.
pub const CONTAINER_GIB_PER_GPU: &str = reader_side::limits::ENV_MEM_GIB_PER_GPU;

/// MiB the container may allocate on its GPU, for the NVIDIA container toolkit's
/// `apply-cuda-memory-limits` CDI hook (sets the limit through NVML on the container's
/// cgroup; needs cgroup v2, driver R615+ and CUDA 13.4+).
pub const NVIDIA_GPU_MEMORY_LIMIT: &str = "NVIDIA_GPU_MEMORY_LIMIT";
/// MiB requested for the container, read by the same hook.
pub const NVIDIA_GPU_MEMORY_REQUEST: &str = "NVIDIA_GPU_MEMORY_REQUEST";
/// The MPS pinned-memory limit of the container's CUDA clients: `0=<N>G` (device 0 is the
/// container's only visible GPU).
pub const CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";
/// Where the MPS control daemon's pipes are (the same path inside and outside).
pub const CUDA_MPS_PIPE_DIRECTORY: &str = "CUDA_MPS_PIPE_DIRECTORY";
/// The dynamic loader's list of libraries loaded into every program before its own.
pub const LD_PRELOAD: &str = "LD_PRELOAD";
/// Where the isolation interposer keeps the container's budget file (its accounting
/// directory, see `isolation/`).
pub const ISOLATION_DIR: &str = reader_side::ENV_DIR;
/// Where the isolation interposer is mounted in a container ([`Enforcement::Preload`]).
pub const ISOLATION_LIBRARY_IN_CONTAINER: &str = "/usr/local/lib/gpushare/libgpushare_isolation.so";
/// Where a container's accounting directory is mounted ([`Enforcement::Preload`]).
pub const ISOLATION_DIR_IN_CONTAINER: &str = "/var/run/gpushare/isolation";
/// Where a container's limits file is mounted, read-only ([`Enforcement::Preload`]): the
/// interposer takes its limits and its budget's path from it, not from the environment.
pub const ISOLATION_LIMITS_IN_CONTAINER: &str = reader_side::LIMITS_FILE_IN_CONTAINER;
/// MiB the interposer charges each CUDA context of the container
/// ([`IsolationOptions::context_mib`]); the interposer's `isolation::settings` reads it.
pub const ISOLATION_CONTEXT_MIB: &str = reader_side::settings::ENV_CONTEXT_MIB;
/// What the interposer does with `cuMemAllocManaged`, `charge` or `ignore`
/// ([`ManagedMemory`]).
pub const ISOLATION_MANAGED_MEMORY: &str = reader_side::settings::ENV_MANAGED_MEMORY;
/// Percent of each of its GPUs' SM time the container is given (only where its pod asked for
/// compute; see [`crate::request`]): the interposer holds it ([`ISOLATION_COMPUTE_MODE`]).
pub const COMPUTE_PERCENT: &str = reader_side::settings::ENV_COMPUTE_PERCENT;
/// How the interposer holds [`COMPUTE_PERCENT`]: `shared` (its default), `capped` or `off`.
pub const ISOLATION_COMPUTE_MODE: &str = reader_side::settings::ENV_COMPUTE_MODE;
/// The node-wide directory where the interposers of every container on a GPU share its
/// compute state ([`Enforcement::Preload`]).
pub const ISOLATION_COMPUTE_DIR: &str = reader_side::settings::ENV_COMPUTE_DIR;
/// Where the node-wide compute directory is mounted in a container ([`Enforcement::Preload`]).
pub const ISOLATION_COMPUTE_DIR_IN_CONTAINER: &str = "/var/run/gpushare/compute";
/// MPS's own share of a GPU's threads for the container's CUDA clients
/// ([`Enforcement::Mps`]): the container's compute percent.
pub const CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";
/// The largest [`ISOLATION_CONTEXT_MIB`] the interposer accepts (1 TiB); it refuses more.
pub const MAX_CONTEXT_MIB: u64 = reader_side::prepared::MAX_CONTEXT_MIB;

/// How a container's share of GPU memory is enforced (the device plugin's `--enforcement`).
///
/// Which to pick, and what each does not stop:
/// - [`Enforcement::Preload`]: gpushare's interposer (`libgpushare_isolation.so`, mounted
///   and preloaded into every process of the container) counts every allocation through the
///   CUDA driver API and NVML and refuses those past the share; programs see the share as
///   the GPU's memory. Works on today's drivers. It cannot stop a program that talks to the
///   driver's device files itself or links the driver statically.
/// - [`Enforcement::None`]: the container is told its share (`GPUSHARE_CONTAINER_MEM_GIB`) and
///   trusted to keep to it. Nothing stops it from taking more.
/// - [`Enforcement::Toolkit`]: the driver enforces the limit on the container's cgroup, set
///   by the toolkit's CDI hook from [`NVIDIA_GPU_MEMORY_LIMIT`]. Needs the new stack on every
///   GPU node; a node without it runs the container unlimited (the variables are ignored).
/// - [`Enforcement::Mps`]: the MPS server caps what the container's CUDA clients allocate.
///   Needs an MPS control daemon per GPU node; it does not cover memory allocated outside
///   CUDA (e.g. by the graphics stack), and a container that bypasses MPS is not capped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Enforcement {
    /// Tell, do not enforce.
    #[default]
    None,
    /// The NVIDIA container toolkit's memory-limit hook.
    Toolkit,
    /// MPS pinned device memory limits.
    Mps,
    /// gpushare's interposer, preloaded into the container.
    Preload,
}

impl std::fmt::Display for Enforcement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Enforcement::None => "none",
            Enforcement::Toolkit => "toolkit",
            Enforcement::Mps => "mps",
            Enforcement::Preload => "preload",
        })
    }
}

/// An enforcement mode that is none of `none`, `toolkit`, `mps`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown enforcement mode {0:?}: use \"preload\", \"none\", \"toolkit\" or \"mps\"")]
pub struct UnknownEnforcement(pub String);

impl std::str::FromStr for Enforcement {
    type Err = UnknownEnforcement;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" => Ok(Enforcement::None),
            "toolkit" => Ok(Enforcement::Toolkit),
            "mps" => Ok(Enforcement::Mps),
            "preload" => Ok(Enforcement::Preload),
            _ => Err(UnknownEnforcement(s.to_owned())),
        }
    }
}

/// What the interposer ([`Enforcement::Preload`]) does with managed memory
/// (`cuMemAllocManaged`), [`ISOLATION_MANAGED_MEMORY`] in the container.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ManagedMemory {
    /// Counted in full on the current GPU and held to the share, like device memory: the
    /// wall stays for programs that use managed memory within their share.
    #[default]
    Charge,
    /// Not counted: for programs that oversubscribe on purpose (RAPIDS managed mode), whose
    /// pages the driver moves to the host under pressure. They may then hold device memory
    /// past the share while the GPU has it free.
    Ignore,
}

impl std::fmt::Display for ManagedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ManagedMemory::Charge => "charge",
            ManagedMemory::Ignore => "ignore",
        })
    }
}

/// A managed-memory choice that is neither `charge` nor `ignore`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown managed-memory choice {0:?}: use \"charge\" or \"ignore\"")]
pub struct UnknownManagedMemory(pub String);

impl std::str::FromStr for ManagedMemory {
    type Err = UnknownManagedMemory;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // As the interposer reads it: trimmed, any case.
        match s.trim().to_ascii_lowercase().as_str() {
            "charge" => Ok(ManagedMemory::Charge),
            "ignore" => Ok(ManagedMemory::Ignore),
            _ => Err(UnknownManagedMemory(s.to_owned())),
        }
    }
}

/// The interposer's settings for every container of a node ([`Enforcement::Preload`] only;
/// the plugins' `--isolation-context-mib` and `--isolation-managed-memory`).
///
/// A setting left at its default adds no variable: the interposer then applies its own
/// default (a context charged what it took, managed memory charged), so a node that was not
/// asked for these hands containers exactly the environment it did before, and the
/// interposer's defaults stay the one place they are written down.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IsolationOptions {
    /// MiB charged per CUDA context ([`ISOLATION_CONTEXT_MIB`]); `None`: the interposer's
    /// default. A value given is passed even when it equals that default.
    pub context_mib: Option<u64>,
    /// Managed memory ([`ISOLATION_MANAGED_MEMORY`]); passed only when not
    /// [`ManagedMemory::Charge`].
    pub managed_memory: ManagedMemory,
    /// How compute shares are held ([`ISOLATION_COMPUTE_MODE`], the chart's
    /// `isolation.compute`); passed only when not [`ComputeMode::Shared`], and only to
    /// containers with a compute share.
    pub compute_mode: ComputeMode,
}

/// How the interposer holds a container's compute share (the interposer's own type).
pub use reader_side::settings::ComputeMode;

impl IsolationOptions {
    /// The variables that carry these settings to the interposer; none for the defaults.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let mut vars = Vec::new();
        if let Some(mib) = self.context_mib {
            vars.push((ISOLATION_CONTEXT_MIB, mib.to_string()));
        }
        if self.managed_memory != ManagedMemory::Charge {
            vars.push((ISOLATION_MANAGED_MEMORY, self.managed_memory.to_string()));
        }
        vars
    }
}

/// What a node's enforcer is configured with besides each container's share (the plugins'
/// flags): read by the mode it belongs to, ignored by the others.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EnforcerSettings<'a> {
    /// The MPS control daemon's pipe directory ([`Enforcement::Mps`]).
    pub mps_pipe_directory: &'a str,
    /// The interposer's settings ([`Enforcement::Preload`]).
    pub isolation: IsolationOptions,
}

impl<'a> EnforcerSettings<'a> {
    /// Settings with the MPS pipe directory `dir` and the interposer's defaults.
    pub fn mps(dir: &'a str) -> Self {
        Self {
            mps_pipe_directory: dir,
            isolation: IsolationOptions::default(),
        }
    }
}

impl Enforcement {
    /// The variables that carry a container's `gib` share to the enforcer, configured with
    /// `settings`.
    pub fn env(self, gib: u64, settings: &EnforcerSettings<'_>) -> Vec<(&'static str, String)> {
        self.env_on(gib, 1, settings)
    }

    /// As [`Enforcement::env`] for a container granted `gib_per_gpu` on each of `gpus` GPUs.
    /// The toolkit's limit applies to each visible device; MPS takes one `<ordinal>=<N>G` entry
    /// per device, numbered as the container sees them (0..gpus).
    pub fn env_on(
        self,
        gib_per_gpu: u64,
        gpus: usize,
        settings: &EnforcerSettings<'_>,
    ) -> Vec<(&'static str, String)> {
        let gib = gib_per_gpu;
        match self {
            Enforcement::None => Vec::new(),
            // The share itself is read from GPUSHARE_CONTAINER_MEM_GIB(_PER_GPU), which every
            // container gets; the mounts are the device plugin's (host paths).
            Enforcement::Preload => {
                let mut vars = vec![
                    (LD_PRELOAD, ISOLATION_LIBRARY_IN_CONTAINER.to_owned()),
                    (ISOLATION_DIR, ISOLATION_DIR_IN_CONTAINER.to_owned()),
                ];
                vars.extend(settings.isolation.env());
                vars
            }
            Enforcement::Toolkit => {
                let mib = gib.saturating_mul(1024).to_string();
                vec![
                    (NVIDIA_GPU_MEMORY_LIMIT, mib.clone()),
                    (NVIDIA_GPU_MEMORY_REQUEST, mib),
                ]
            }
            Enforcement::Mps => vec![
                (
                    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT,
                    (0..gpus.max(1))
                        .map(|ordinal| format!("{ordinal}={gib}G"))
                        .collect::<Vec<_>>()
                        .join(","),
                ),
                (
                    CUDA_MPS_PIPE_DIRECTORY,
                    settings.mps_pipe_directory.to_owned(),
                ),
            ],
        }
    }
}

/// `items` joined with commas: how the environment lists a multi-GPU container's GPUs.
pub fn comma_list<T: ToString>(items: impl IntoIterator<Item = T>) -> String {
    items
        .into_iter()
        .map(|item| item.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The environment of a container pinned to `gpus` (the pod's GPUs, the first one first):
/// the placement, and what the enforcer of `enforcement`, configured with `settings`, reads
/// (see this module).
/// `pod_gib_per_gpu` is what the pod holds on each GPU ([`PodAllocation::pod_gib`]).
///
/// A one-GPU container gets exactly the variables it always got. A container spread over N
/// GPUs sees them all: comma lists of UUIDs and indices, `GPUSHARE_GPU_COUNT`, its total
/// (`GPUSHARE_CONTAINER_MEM_GIB`) and its share of each GPU
/// (`GPUSHARE_CONTAINER_MEM_GIB_PER_GPU`), the pod's total, the smallest GPU's size (what a
/// per-device fraction must be computed against), and the enforcer's limit on every device.
///
/// [`PodAllocation::pod_gib`]: crate::PodAllocation::pod_gib
pub fn container_env(
    gpus: &[GpuInfo],
    container: &ContainerRequest,
    pod_gib_per_gpu: u64,
    (enforcement, settings): (Enforcement, &EnforcerSettings<'_>),
) -> HashMap<String, String> {
    let count = gpus.len().max(1);
    let count_u64 = u64::try_from(count).unwrap_or(u64::MAX);
    let uuids = comma_list(gpus.iter().map(|gpu| gpu.uuid.as_str()));
    let gib_per_gpu = container.gib / count_u64;
    let mut vars = HashMap::from([
        (NVIDIA_VISIBLE_DEVICES.to_owned(), uuids.clone()),
        (
            GPU_INDEX.to_owned(),
            comma_list(gpus.iter().map(|gpu| gpu.index)),
        ),
        (GPU_UUID.to_owned(), uuids),
        (CONTAINER_GIB.to_owned(), container.gib.to_string()),
        (
            POD_GIB.to_owned(),
            pod_gib_per_gpu.saturating_mul(count_u64).to_string(),
        ),
        (
            GPU_TOTAL_GIB.to_owned(),
            gpus.iter()
                .map(|gpu| gpu.mem_gib)
                .min()
                .unwrap_or_default()
                .to_string(),
        ),
    ]);
    if count > 1 {
        vars.insert(GPU_COUNT.to_owned(), count.to_string());
        vars.insert(CONTAINER_GIB_PER_GPU.to_owned(), gib_per_gpu.to_string());
    }
    for (name, value) in enforcement.env_on(gib_per_gpu, count, settings) {
        vars.insert(name.to_owned(), value);
    }
    let compute_per_gpu = container.compute_per_gpu(count);
    if compute_per_gpu > 0 {
        vars.insert(COMPUTE_PERCENT.to_owned(), compute_per_gpu.to_string());
        match enforcement {
            Enforcement::Preload if settings.isolation.compute_mode != ComputeMode::Shared => {
                let mode = settings.isolation.compute_mode.as_str();
                vars.insert(ISOLATION_COMPUTE_MODE.to_owned(), mode.to_owned());
            }
            Enforcement::Mps => {
                vars.insert(
                    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE.to_owned(),
                    compute_per_gpu.to_string(),
                );
            }
            Enforcement::Preload | Enforcement::None | Enforcement::Toolkit => {}
        }
    }
    vars
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env;

    fn gpu(index: u32, mem_gib: u64, healthy: bool) -> GpuInfo {
        GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            model: String::new(),
            mem_gib,
            healthy,
            numa_node: None,
        }
    }

    fn container(gib: u64) -> ContainerRequest {
        ContainerRequest {
            name: "main".into(),
            gib,
            init: false,
            compute: 0,
        }
    }

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn a_one_gpu_container_gets_the_variables_it_always_got() {
        let env = container_env(
            &[gpu(2, 24, true)],
            &container(4),
            6,
            (Enforcement::Mps, &EnforcerSettings::mps("/run/mps")),
        );
        assert_eq!(
            env,
            vars(&[
                (env::NVIDIA_VISIBLE_DEVICES, "GPU-2"),
                (env::GPU_INDEX, "2"),
                (env::GPU_UUID, "GPU-2"),
                (env::CONTAINER_GIB, "4"),
                (env::POD_GIB, "6"),
                (env::GPU_TOTAL_GIB, "24"),
                (env::CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, "0=4G"),
                (env::CUDA_MPS_PIPE_DIRECTORY, "/run/mps"),
            ])
        );
    }

    #[test]
    fn a_two_gpu_container_sees_both_gpus_and_its_share_of_each() {
        // 16 GiB spread over GPUs 3 and 1 (the extender's order), 8 GiB on each.
        let env = container_env(
            &[gpu(3, 24, true), gpu(1, 16, true)],
            &container(16),
            8,
            (Enforcement::Mps, &EnforcerSettings::mps("/run/mps")),
        );
        assert_eq!(
            env,
            vars(&[
                (env::NVIDIA_VISIBLE_DEVICES, "GPU-3,GPU-1"),
                (env::GPU_INDEX, "3,1"),
                (env::GPU_UUID, "GPU-3,GPU-1"),
                (env::GPU_COUNT, "2"),
                (env::CONTAINER_GIB, "16"),
                (env::CONTAINER_GIB_PER_GPU, "8"),
                (env::POD_GIB, "16"),
                (env::GPU_TOTAL_GIB, "16"),
                (env::CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, "0=8G,1=8G"),
                (env::CUDA_MPS_PIPE_DIRECTORY, "/run/mps"),
            ])
        );
    }

    #[test]
    fn an_exclusive_container_is_limited_to_its_share_of_each_whole_gpu() {
        // A whole-GPU pod on 2 × 24 GiB: gpu-mem 48, 24 booked on each GPU.
        let env = container_env(
            &[gpu(0, 24, true), gpu(1, 24, true)],
            &container(48),
            24,
            (Enforcement::Toolkit, &EnforcerSettings::mps("/run/mps")),
        );
        assert_eq!(env[env::NVIDIA_VISIBLE_DEVICES], "GPU-0,GPU-1");
        assert_eq!(env[env::GPU_COUNT], "2");
        assert_eq!(env[env::CONTAINER_GIB], "48");
        assert_eq!(env[env::CONTAINER_GIB_PER_GPU], "24");
        assert_eq!(env[env::POD_GIB], "48");
        assert_eq!(env[env::GPU_TOTAL_GIB], "24");
        assert_eq!(env[env::NVIDIA_GPU_MEMORY_LIMIT], "24576");
    }

    #[test]
    fn each_mode_carries_the_share_its_enforcer_reads() {
        assert!(
            Enforcement::None
                .env(4, &EnforcerSettings::mps("/tmp/nvidia-mps"))
                .is_empty()
        );
        assert_eq!(
            Enforcement::Toolkit.env(4, &EnforcerSettings::mps("/tmp/nvidia-mps")),
            vec![
                (NVIDIA_GPU_MEMORY_LIMIT, "4096".to_owned()),
                (NVIDIA_GPU_MEMORY_REQUEST, "4096".to_owned()),
            ]
        );
        assert_eq!(
            Enforcement::Mps.env(12, &EnforcerSettings::mps("/run/mps")),
            vec![
                (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, "0=12G".to_owned()),
                (CUDA_MPS_PIPE_DIRECTORY, "/run/mps".to_owned()),
            ]
        );
    }

    #[test]
    fn multi_gpu_limits_cover_every_visible_device() {
        assert_eq!(
            Enforcement::Mps.env_on(8, 2, &EnforcerSettings::mps("/run/mps"))[0],
            (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, "0=8G,1=8G".to_owned())
        );
        assert_eq!(
            Enforcement::Toolkit.env_on(8, 2, &EnforcerSettings::mps("/run/mps"))[0],
            (NVIDIA_GPU_MEMORY_LIMIT, "8192".to_owned())
        );
    }

    #[test]
    fn preload_passes_the_interposers_settings_only_when_given() {
        let preload = |isolation: IsolationOptions| {
            container_env(
                &[gpu(2, 24, true)],
                &container(4),
                6,
                (
                    Enforcement::Preload,
                    &EnforcerSettings {
                        mps_pipe_directory: "/run/mps",
                        isolation,
                    },
                ),
            )
        };
        let today = vars(&[
            (env::NVIDIA_VISIBLE_DEVICES, "GPU-2"),
            (env::GPU_INDEX, "2"),
            (env::GPU_UUID, "GPU-2"),
            (env::CONTAINER_GIB, "4"),
            (env::POD_GIB, "6"),
            (env::GPU_TOTAL_GIB, "24"),
            (env::LD_PRELOAD, ISOLATION_LIBRARY_IN_CONTAINER),
            (env::ISOLATION_DIR, ISOLATION_DIR_IN_CONTAINER),
        ]);
        // Not asked: the environment containers always got; the interposer's defaults apply.
        assert_eq!(preload(IsolationOptions::default()), today);

        let asked = preload(IsolationOptions {
            context_mib: Some(640),
            managed_memory: ManagedMemory::Ignore,
            compute_mode: Default::default(),
        });
        let mut want = today.clone();
        want.insert("GPUSHARE_CONTEXT_MIB".into(), "640".into());
        want.insert("GPUSHARE_MANAGED_MEMORY".into(), "ignore".into());
        assert_eq!(asked, want);

        // Each on its own; a context figure equal to the default is still passed (asked for).
        let context_only = preload(IsolationOptions {
            context_mib: Some(512),
            ..IsolationOptions::default()
        });
        assert_eq!(
            context_only.get("GPUSHARE_CONTEXT_MIB").map(String::as_str),
            Some("512")
        );
        assert!(!context_only.contains_key("GPUSHARE_MANAGED_MEMORY"));
        let zero = preload(IsolationOptions {
            context_mib: Some(0),
            ..IsolationOptions::default()
        });
        assert_eq!(
            zero.get("GPUSHARE_CONTEXT_MIB").map(String::as_str),
            Some("0")
        );
        let managed_only = preload(IsolationOptions {
            managed_memory: ManagedMemory::Ignore,
            ..IsolationOptions::default()
        });
        assert_eq!(
            managed_only
                .get("GPUSHARE_MANAGED_MEMORY")
                .map(String::as_str),
            Some("ignore")
        );
        assert!(!managed_only.contains_key("GPUSHARE_CONTEXT_MIB"));
    }

    #[test]
    fn a_multi_gpu_preload_container_gets_the_settings_once() {
        let env = container_env(
            &[gpu(3, 24, true), gpu(1, 16, true)],
            &container(16),
            8,
            (
                Enforcement::Preload,
                &EnforcerSettings {
                    mps_pipe_directory: "",
                    isolation: IsolationOptions {
                        context_mib: Some(300),
                        managed_memory: ManagedMemory::Ignore,
                        compute_mode: Default::default(),
                    },
                },
            ),
        );
        assert_eq!(env[ISOLATION_CONTEXT_MIB], "300");
        assert_eq!(env[ISOLATION_MANAGED_MEMORY], "ignore");
        assert_eq!(env[env::GPU_UUID], "GPU-3,GPU-1");
    }

    #[test]
    fn other_modes_carry_no_interposer_settings() {
        let asked = EnforcerSettings {
            mps_pipe_directory: "/run/mps",
            isolation: IsolationOptions {
                context_mib: Some(640),
                managed_memory: ManagedMemory::Ignore,
                compute_mode: Default::default(),
            },
        };
        for mode in [Enforcement::None, Enforcement::Toolkit, Enforcement::Mps] {
            let with = container_env(&[gpu(0, 16, true)], &container(4), 4, (mode, &asked));
            let without = container_env(
                &[gpu(0, 16, true)],
                &container(4),
                4,
                (mode, &EnforcerSettings::mps("/run/mps")),
            );
            assert_eq!(with, without, "{mode}");
            assert!(!with.contains_key(ISOLATION_CONTEXT_MIB), "{mode}");
            assert!(!with.contains_key(ISOLATION_MANAGED_MEMORY), "{mode}");
        }
    }

    #[test]
    fn managed_memory_parses_as_the_interposer_reads_it() {
        for choice in [ManagedMemory::Charge, ManagedMemory::Ignore] {
            assert_eq!(choice.to_string().parse::<ManagedMemory>(), Ok(choice));
        }
        assert_eq!(
            " IGNORE ".parse::<ManagedMemory>(),
            Ok(ManagedMemory::Ignore)
        );
        let err = "off".parse::<ManagedMemory>().unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"unknown managed-memory choice "off": use "charge" or "ignore""#
        );
    }

    /// What a container is handed reads back, through the interposer's own parsers, as the
    /// share and the settings it was granted.
    #[test]
    fn a_compute_share_reaches_the_interposer_and_mps_per_gpu() {
        use reader_side::settings::Settings;
        let gpus = [gpu(0, 16, true), gpu(1, 16, true)];
        let asked = ContainerRequest {
            compute: 60,
            ..container(8)
        };
        let capped = EnforcerSettings {
            mps_pipe_directory: "",
            isolation: IsolationOptions {
                compute_mode: ComputeMode::Capped,
                ..IsolationOptions::default()
            },
        };
        let vars = container_env(&gpus, &asked, 4, (Enforcement::Preload, &capped));
        assert_eq!(vars[COMPUTE_PERCENT], "30", "{vars:?}");
        let read = Settings::parse(|name| vars.get(name).cloned()).unwrap();
        let share = read.compute.expect("a compute share");
        assert_eq!((share.percent, share.mode), (30, ComputeMode::Capped));
        // The interposer's default mode is not written.
        let shared = container_env(
            &gpus,
            &asked,
            4,
            (Enforcement::Preload, &EnforcerSettings::default()),
        );
        assert!(!shared.contains_key(ISOLATION_COMPUTE_MODE));
        // MPS holds the share with its own thread percentage.
        let mps = container_env(
            &gpus,
            &asked,
            4,
            (Enforcement::Mps, &EnforcerSettings::mps("/run/mps")),
        );
        assert_eq!(mps[CUDA_MPS_ACTIVE_THREAD_PERCENTAGE], "30");
        // A container without compute gets none of these.
        let plain = container_env(&gpus, &container(8), 4, (Enforcement::Mps, &capped));
        for name in [
            COMPUTE_PERCENT,
            ISOLATION_COMPUTE_MODE,
            CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
        ] {
            assert!(!plain.contains_key(name), "{name}");
        }
    }

    #[test]
    fn the_interposer_reads_what_a_container_is_handed() {
        use reader_side::settings::{Managed, Settings, format_uuid};
        use reader_side::{Limits, settings::parse_uuid};
        let uuid = |i: u32| format!("GPU-{i:08x}-0000-1111-2222-333344445555");
        let on = |indices: &[u32]| -> Vec<GpuInfo> {
            indices
                .iter()
                .map(|&i| GpuInfo {
                    uuid: uuid(i),
                    ..gpu(i, 16, true)
                })
                .collect()
        };
        let preload = |context_mib, managed_memory| EnforcerSettings {
            mps_pipe_directory: "",
            isolation: IsolationOptions {
                context_mib,
                managed_memory,
                compute_mode: Default::default(),
            },
        };
        let charge = preload(None, ManagedMemory::Charge);
        let ignore = preload(Some(640), ManagedMemory::Ignore);
        for (gpus, gib, settings) in [
            (on(&[3]), 4, &charge),
            (on(&[1, 0]), 8, &charge),
            (on(&[2]), 1, &ignore),
            (on(&[0, 1, 2, 3]), 64, &ignore),
        ] {
            let vars = container_env(
                &gpus,
                &container(gib),
                gib,
                (Enforcement::Preload, settings),
            );
            let lookup = |name: &str| vars.get(name).cloned();
            let count = gpus.len() as u64;
            let limits = Limits::parse(lookup).unwrap().expect("limits set");
            assert_eq!(
                limits.shares(),
                vec![(gib / count) << 30; gpus.len()],
                "{vars:?}"
            );
            let read = Settings::parse(lookup).unwrap();
            let uuids: Vec<String> = read.uuids.iter().map(format_uuid).collect();
            let granted: Vec<String> = gpus.iter().map(|g| g.uuid.clone()).collect();
            assert_eq!(uuids, granted, "{vars:?}");
            assert!(granted.iter().all(|u| parse_uuid(u).is_some()));
            let isolation = settings.isolation;
            assert_eq!(read.measure_context, isolation.context_mib.is_none());
            if let Some(mib) = isolation.context_mib {
                assert_eq!(read.context_bytes, mib << 20);
            }
            let managed = match isolation.managed_memory {
                ManagedMemory::Charge => Managed::Charge,
                ManagedMemory::Ignore => Managed::Ignore,
            };
            assert_eq!(read.managed, managed);
        }
        // The largest context charge the plugins accept is one the interposer takes.
        let largest = preload(Some(MAX_CONTEXT_MIB), ManagedMemory::Charge);
        let vars = container_env(
            &on(&[0]),
            &container(1),
            1,
            (Enforcement::Preload, &largest),
        );
        let read = Settings::parse(|name: &str| vars.get(name).cloned()).unwrap();
        assert_eq!(read.context_bytes, MAX_CONTEXT_MIB << 20);
    }

    #[test]
    fn modes_parse_from_their_names_only() {
        for mode in [Enforcement::None, Enforcement::Toolkit, Enforcement::Mps] {
            assert_eq!(mode.to_string().parse::<Enforcement>(), Ok(mode));
        }
        assert_eq!(" MPS ".parse::<Enforcement>(), Ok(Enforcement::Mps));
        assert!("hami".parse::<Enforcement>().is_err());
    }
}
