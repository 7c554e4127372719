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

use crate::prepared::MAX_CONTEXT_MIB;

/// The container's GPU UUIDs (`GPU-…`), in the order of its shares.
pub const ENV_GPU_UUID: &str = "GPUSHARE_GPU_UUID";
/// MiB each CUDA context is charged.
pub const ENV_CONTEXT_MIB: &str = "GPUSHARE_CONTEXT_MIB";
/// `charge` or `ignore`.
pub const ENV_MANAGED_MEMORY: &str = "GPUSHARE_MANAGED_MEMORY";
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
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            uuids: Vec::new(),
            context_bytes: DEFAULT_CONTEXT_MIB << 20,
            measure_context: true,
            managed: Managed::Charge,
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
        Ok(settings)
    }

    /// The budget index of the GPU with `uuid`, if the container was given it; `None` when
    /// no UUIDs are set too.
    pub fn gpu_of_uuid(&self, uuid: &Uuid) -> Option<usize> {
        self.uuids.iter().position(|u| u == uuid)
    }
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
}
