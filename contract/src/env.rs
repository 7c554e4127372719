//! The environment the device plugin hands each container at `Allocate`.
//!
//! `NVIDIA_VISIBLE_DEVICES` pins the container to its GPU (the NVIDIA container runtime reads
//! it; a multi-GPU pod's containers get the comma-separated list, as do `GPUSHARE_GPU_INDEX`
//! and `GPUSHARE_GPU_UUID`, and `GPUSHARE_GPU_COUNT` says how many); the `GPUSHARE_*` variables let an application cap its own memory use, for example
//! `torch.cuda.set_per_process_memory_fraction(GIB / TOTAL_GIB)`.

/// The GPU's UUID; read by the NVIDIA container runtime.
pub const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
/// Index of the GPU on the node.
pub const GPU_INDEX: &str = "GPUSHARE_GPU_INDEX";
/// UUID of the GPU (same as `NVIDIA_VISIBLE_DEVICES`).
pub const GPU_UUID: &str = "GPUSHARE_GPU_UUID";
/// GiB granted to this container.
pub const CONTAINER_GIB: &str = "GPUSHARE_CONTAINER_MEM_GIB";
/// GiB the whole pod holds on the GPU.
pub const POD_GIB: &str = "GPUSHARE_POD_MEM_GIB";
/// Total GiB of the GPU (of the smallest, for a multi-GPU pod).
pub const GPU_TOTAL_GIB: &str = "GPUSHARE_GPU_MEM_GIB";
/// Number of GPUs the container sees; `GPUSHARE_CONTAINER_MEM_GIB` is spread evenly over them.
pub const GPU_COUNT: &str = "GPUSHARE_GPU_COUNT";
/// GiB granted to this container on each of its GPUs.
pub const CONTAINER_GIB_PER_GPU: &str = "GPUSHARE_CONTAINER_MEM_GIB_PER_GPU";

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

/// How a container's share of GPU memory is enforced (the device plugin's `--enforcement`).
///
/// Which to pick, and what each does not stop:
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
}

impl std::fmt::Display for Enforcement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Enforcement::None => "none",
            Enforcement::Toolkit => "toolkit",
            Enforcement::Mps => "mps",
        })
    }
}

/// An enforcement mode that is none of `none`, `toolkit`, `mps`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown enforcement mode {0:?}: use \"none\", \"toolkit\" or \"mps\"")]
pub struct UnknownEnforcement(pub String);

impl std::str::FromStr for Enforcement {
    type Err = UnknownEnforcement;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" => Ok(Enforcement::None),
            "toolkit" => Ok(Enforcement::Toolkit),
            "mps" => Ok(Enforcement::Mps),
            _ => Err(UnknownEnforcement(s.to_owned())),
        }
    }
}

impl Enforcement {
    /// The variables that carry a container's `gib` share to the enforcer; `mps_pipe_dir` is
    /// the MPS daemon's pipe directory (used in [`Enforcement::Mps`] only).
    pub fn env(self, gib: u64, mps_pipe_dir: &str) -> Vec<(&'static str, String)> {
        self.env_on(gib, 1, mps_pipe_dir)
    }

    /// As [`Enforcement::env`] for a container granted `gib_per_gpu` on each of `gpus` GPUs.
    /// The toolkit's limit applies to each visible device; MPS takes one `<ordinal>=<N>G` entry
    /// per device, numbered as the container sees them (0..gpus).
    pub fn env_on(
        self,
        gib_per_gpu: u64,
        gpus: usize,
        mps_pipe_dir: &str,
    ) -> Vec<(&'static str, String)> {
        let gib = gib_per_gpu;
        match self {
            Enforcement::None => Vec::new(),
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
                (CUDA_MPS_PIPE_DIRECTORY, mps_pipe_dir.to_owned()),
            ],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_mode_carries_the_share_its_enforcer_reads() {
        assert!(Enforcement::None.env(4, "/tmp/nvidia-mps").is_empty());
        assert_eq!(
            Enforcement::Toolkit.env(4, "/tmp/nvidia-mps"),
            vec![
                (NVIDIA_GPU_MEMORY_LIMIT, "4096".to_owned()),
                (NVIDIA_GPU_MEMORY_REQUEST, "4096".to_owned()),
            ]
        );
        assert_eq!(
            Enforcement::Mps.env(12, "/run/mps"),
            vec![
                (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, "0=12G".to_owned()),
                (CUDA_MPS_PIPE_DIRECTORY, "/run/mps".to_owned()),
            ]
        );
    }

    #[test]
    fn multi_gpu_limits_cover_every_visible_device() {
        assert_eq!(
            Enforcement::Mps.env_on(8, 2, "/run/mps")[0],
            (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, "0=8G,1=8G".to_owned())
        );
        assert_eq!(
            Enforcement::Toolkit.env_on(8, 2, "/run/mps")[0],
            (NVIDIA_GPU_MEMORY_LIMIT, "8192".to_owned())
        );
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
