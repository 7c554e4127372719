//! What the interposer reads from the container's environment besides the shares
//! ([`crate::Limits`]): which GPU each share is for, what a context costs, and what to do
//! with managed memory.
//!
//! Here rather than in the interposer so that the plugins, which write these variables
//! (`gpushare-contract`'s `env`), name them from this one place and test that what they
//! write reads back here.
//!
//! Where a limits file is mounted (or named: the interposer's `source` module) these come from its
//! `uuid`, `context_mib` and `managed_memory` lines instead, read by the same rules, and
//! the variables below are ignored.
//!
//! - `GPUSHARE_GPU_UUID`: the container's GPUs, comma-separated, in the order of its shares
//!   (the device plugin sets it). Budgets are keyed by these UUIDs, not by CUDA ordinals:
//!   `CUDA_VISIBLE_DEVICES` renumbers ordinals per process, so two processes may call the
//!   same GPU 0 and 1, or different GPUs 0. Without it (or with an entry that is not a
//!   `GPU-` UUID), NVML's index stands for the GPU, else the CUDA ordinal.
//! - `GPUSHARE_CONTEXT_MIB`: what each CUDA context costs the device (its code, stacks,
//!   heap), charged to the container when the context is made. Unset, a context is charged
//!   what the driver's free memory dropped by while it was made (NVML, read around the
//!   creation), and [`DEFAULT_CONTEXT_MIB`] where that cannot be read; set, exactly that.
//! - `GPUSHARE_MANAGED_MEMORY`: `charge` (default) counts `cuMemAllocManaged` in full on the
//!   current GPU; `ignore` lets it pass uncounted, for programs that oversubscribe on
//!   purpose (the driver pages managed memory out under pressure instead of failing).
//! - `GPUSHARE_COMPUTE_PERCENT`: the container's share of each of its GPUs' SM time, a whole
//!   percent from 1 to 100, the same on every GPU it has. Unset: no compute guarantee and no
//!   cap (kernel launches pass untouched).
//! - `GPUSHARE_COMPUTE_MODE`: how the share is held ([`ComputeMode`]): `shared` (default,
//!   work-conserving), `capped` (never above it) or `off` (not held).
//! - `GPUSHARE_COMPUTE_DIR`: the node-wide directory, shared by every container on the node
//!   and writable by them, where the per-GPU compute state lives ([`crate::compute`]). Unset:
//!   the budget file's directory.
//!
//! The limits file's `compute_percent`, `compute_mode` and `compute_dir` lines stand for the
//! three compute variables ([`crate::prepared::PreparedCompute`]).

use std::path::PathBuf;

use crate::prepared::MAX_CONTEXT_MIB;

/// The container's GPU UUIDs (`GPU-…`), in the order of its shares.
pub const ENV_GPU_UUID: &str = "GPUSHARE_GPU_UUID";
/// MiB each CUDA context is charged.
pub const ENV_CONTEXT_MIB: &str = "GPUSHARE_CONTEXT_MIB";
/// `charge` or `ignore`.
pub const ENV_MANAGED_MEMORY: &str = "GPUSHARE_MANAGED_MEMORY";
/// The container's share of each GPU's SM time, in percent (1 to 100).
pub const ENV_COMPUTE_PERCENT: &str = "GPUSHARE_COMPUTE_PERCENT";
/// `shared`, `capped` or `off`.
pub const ENV_COMPUTE_MODE: &str = "GPUSHARE_COMPUTE_MODE";
/// The node-wide directory of the per-GPU compute state files.
pub const ENV_COMPUTE_DIR: &str = "GPUSHARE_COMPUTE_DIR";
/// What a context is charged when `GPUSHARE_CONTEXT_MIB` is unset: about what a CUDA 13
/// context holds on a data-centre GPU (527-529 MiB measured on an H200, driver 580, by
/// `scripts/gpu-check.sh`; smaller GPUs hold less).
pub const DEFAULT_CONTEXT_MIB: u64 = 512;

/// What `cuMemAllocManaged` does to the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Managed {
    /// Counted in full on the current GPU, held to the share.
    #[default]
    Charge,
    /// Not counted.
    Ignore,
}

/// How a container's compute share is held at kernel launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ComputeMode {
    /// Work-conserving: the container may use SM time others leave idle, but under
    /// contention its launches are held while it is over its share and another container
    /// that wants time is under its own.
    #[default]
    Shared,
    /// Never above the share, even alone on the GPU (for chargeback).
    Capped,
    /// Not held: launches pass untouched.
    Off,
}

impl ComputeMode {
    /// The mode's name, as the variable and the limits file spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Shared => "shared",
            Self::Capped => "capped",
            Self::Off => "off",
        }
    }

    /// The mode a name (any case) spells, if any.
    pub fn parse(text: &str) -> Option<Self> {
        match text.trim().to_ascii_lowercase().as_str() {
            "shared" => Some(Self::Shared),
            "capped" => Some(Self::Capped),
            "off" => Some(Self::Off),
            _ => None,
        }
    }
}

impl std::fmt::Display for ComputeMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A container's share of its GPUs' SM time and how it is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ComputeShare {
    /// Percent of each GPU's SM time, 1 to 100.
    pub percent: u8,
    /// How it is held.
    pub mode: ComputeMode,
}

impl ComputeShare {
    /// Whether launches are held at all (`off` is not).
    pub fn throttles(&self) -> bool {
        self.mode != ComputeMode::Off
    }
}

/// A GPU's UUID, its 16 bytes (`CUuuid`).
pub type Uuid = [u8; 16];

/// See the module doc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The container's GPUs in share order; empty: identify GPUs by NVML index or ordinal.
    pub uuids: Vec<Uuid>,
    /// Bytes charged per context (when measured: until the measure is in).
    pub context_bytes: u64,
    /// Whether a context is charged what the driver's free memory dropped by while it was
    /// made (`GPUSHARE_CONTEXT_MIB` unset) rather than `context_bytes`.
    pub measure_context: bool,
    /// Managed memory.
    pub managed: Managed,
    /// The compute share; `None`: no guarantee and no cap.
    pub compute: Option<ComputeShare>,
    /// Where the per-GPU compute state lives; `None`: the budget file's directory.
    pub compute_dir: Option<PathBuf>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            uuids: Vec::new(),
            context_bytes: DEFAULT_CONTEXT_MIB << 20,
            measure_context: true,
            managed: Managed::Charge,
            compute: None,
            compute_dir: None,
        }
    }
}

/// Why the environment's settings cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{name}={value:?} is not {expected}")]
pub struct Invalid {
    name: &'static str,
    value: String,
    expected: &'static str,
}

impl Settings {
    /// The settings the process environment holds.
    pub fn from_env() -> Result<Self, Invalid> {
        Self::parse(|name| std::env::var(name).ok())
    }

    /// The settings that `var` (an environment lookup) holds.
    pub fn parse(var: impl Fn(&str) -> Option<String>) -> Result<Self, Invalid> {
        let set = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let mut settings = Self::default();
        if let Some(list) = set(ENV_GPU_UUID) {
            let parsed: Option<Vec<Uuid>> = list.split(',').map(parse_uuid).collect();
            settings.uuids = parsed.unwrap_or_default();
        }
        if let Some(mib) = set(ENV_CONTEXT_MIB) {
            let mib: u64 = mib
                .trim()
                .parse()
                .ok()
                .filter(|m| *m <= MAX_CONTEXT_MIB)
                .ok_or(Invalid {
                    name: ENV_CONTEXT_MIB,
                    value: mib,
                    expected: "a whole number of MiB",
                })?;
            settings.context_bytes = mib << 20;
            settings.measure_context = false;
        }
        if let Some(mode) = set(ENV_MANAGED_MEMORY) {
            settings.managed = match mode.trim().to_ascii_lowercase().as_str() {
                "charge" => Managed::Charge,
                "ignore" => Managed::Ignore,
                _ => {
                    return Err(Invalid {
                        name: ENV_MANAGED_MEMORY,
                        value: mode,
                        expected: "charge or ignore",
                    });
                }
            };
        }
        let mode = match set(ENV_COMPUTE_MODE) {
            None => ComputeMode::default(),
            Some(mode) => ComputeMode::parse(&mode).ok_or(Invalid {
                name: ENV_COMPUTE_MODE,
                value: mode,
                expected: "shared, capped or off",
            })?,
        };
        if let Some(percent) = set(ENV_COMPUTE_PERCENT) {
            let percent = parse_percent(&percent).ok_or(Invalid {
                name: ENV_COMPUTE_PERCENT,
                value: percent,
                expected: "a whole percent from 1 to 100",
            })?;
            settings.compute = Some(ComputeShare { percent, mode });
        }
        if let Some(dir) = set(ENV_COMPUTE_DIR) {
            let dir = PathBuf::from(dir.trim());
            if !dir.is_absolute() {
                return Err(Invalid {
                    name: ENV_COMPUTE_DIR,
                    value: dir.display().to_string(),
                    expected: "an absolute path",
                });
            }
            settings.compute_dir = Some(dir);
        }
        Ok(settings)
    }

    /// The budget index of the GPU with `uuid`, if the container was given it; `None` when
    /// no UUIDs are set too.
    pub fn gpu_of_uuid(&self, uuid: &Uuid) -> Option<usize> {
        self.uuids.iter().position(|u| u == uuid)
    }
}

/// A compute share in percent: a whole number from 1 to 100.
pub fn parse_percent(text: &str) -> Option<u8> {
    text.trim()
        .parse::<u8>()
        .ok()
        .filter(|p| (1..=100).contains(p))
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (any case) as 16 bytes.
pub fn parse_uuid(text: &str) -> Option<Uuid> {
    let hex: Vec<u8> = text
        .trim()
        .strip_prefix("GPU-")?
        .bytes()
        .filter(|b| *b != b'-')
        .collect();
    if hex.len() != 32 {
        return None;
    }
    let mut uuid = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        let digit = |b: u8| (b as char).to_digit(16);
        uuid[i] = (digit(pair[0])? * 16 + digit(pair[1])?) as u8;
    }
    Some(uuid)
}

/// The 16 bytes as NVML writes them: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn format_uuid(uuid: &Uuid) -> String {
    let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_env as env;

    #[test]
    fn uuids_read_back_as_written_in_share_order() {
        let a = "GPU-0a1b2c3d-0000-1111-2222-333344445555";
        let b = "GPU-FFFFFFFF-0000-1111-2222-333344445556";
        let settings = Settings::parse(env(&[(ENV_GPU_UUID, &format!("{a},{b}"))])).unwrap();
        assert_eq!(settings.uuids.len(), 2);
        assert_eq!(format_uuid(&settings.uuids[0]), a);
        assert_eq!(
            format_uuid(&settings.uuids[1]),
            "GPU-ffffffff-0000-1111-2222-333344445556"
        );
        assert_eq!(settings.gpu_of_uuid(&settings.uuids[1]), Some(1));
        assert_eq!(settings.gpu_of_uuid(&[0; 16]), None);
    }

    #[test]
    fn a_list_that_is_not_all_uuids_is_not_used() {
        let settings = Settings::parse(env(&[(ENV_GPU_UUID, "GPU-1,MIG-abc")])).unwrap();
        assert!(settings.uuids.is_empty());
    }

    #[test]
    fn context_charge_and_managed_mode() {
        let settings = Settings::parse(env(&[])).unwrap();
        assert_eq!(settings.context_bytes, DEFAULT_CONTEXT_MIB << 20);
        assert!(settings.measure_context);
        assert_eq!(settings.managed, Managed::Charge);
        let settings = Settings::parse(env(&[
            (ENV_CONTEXT_MIB, "0"),
            (ENV_MANAGED_MEMORY, "Ignore"),
        ]))
        .unwrap();
        assert_eq!(settings.context_bytes, 0);
        assert!(!settings.measure_context);
        assert_eq!(settings.managed, Managed::Ignore);
        assert!(Settings::parse(env(&[(ENV_CONTEXT_MIB, "-1")])).is_err());
        assert!(Settings::parse(env(&[(ENV_MANAGED_MEMORY, "evict")])).is_err());
    }

    #[test]
    fn compute_share_and_mode() {
        assert_eq!(Settings::parse(env(&[])).unwrap().compute, None);
        let settings = Settings::parse(env(&[(ENV_COMPUTE_PERCENT, "30")])).unwrap();
        assert_eq!(
            settings.compute,
            Some(ComputeShare {
                percent: 30,
                mode: ComputeMode::Shared
            })
        );
        let settings = Settings::parse(env(&[
            (ENV_COMPUTE_PERCENT, " 100 "),
            (ENV_COMPUTE_MODE, "Capped"),
            (ENV_COMPUTE_DIR, "/var/run/gpushare/compute"),
        ]))
        .unwrap();
        let compute = settings.compute.unwrap();
        assert_eq!((compute.percent, compute.mode), (100, ComputeMode::Capped));
        assert!(compute.throttles());
        assert_eq!(
            settings.compute_dir.as_deref(),
            Some(std::path::Path::new("/var/run/gpushare/compute"))
        );
        let off = Settings::parse(env(&[
            (ENV_COMPUTE_PERCENT, "5"),
            (ENV_COMPUTE_MODE, "off"),
        ]))
        .unwrap()
        .compute
        .unwrap();
        assert!(!off.throttles());
        // A mode alone asks for nothing.
        let settings = Settings::parse(env(&[(ENV_COMPUTE_MODE, "capped")])).unwrap();
        assert_eq!(settings.compute, None);
        for (name, value) in [
            (ENV_COMPUTE_PERCENT, "0"),
            (ENV_COMPUTE_PERCENT, "101"),
            (ENV_COMPUTE_PERCENT, "30%"),
            (ENV_COMPUTE_PERCENT, "12.5"),
            (ENV_COMPUTE_MODE, "hard"),
            (ENV_COMPUTE_DIR, "relative/dir"),
        ] {
            assert!(
                Settings::parse(env(&[(name, value), (ENV_COMPUTE_PERCENT, "30")])).is_err(),
                "{name}={value} accepted"
            );
        }
    }
}
