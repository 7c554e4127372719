//! CDI specs: how a prepared claim reaches the container.
//!
//! kubelet hands the container runtime the CDI device names Prepare answered; the runtime
//! looks them up in the spec files of its CDI directory and applies their `containerEdits`.
//! One spec file per claim, named after the claim's UID, holding one device per GPU share,
//! each with the claim's whole environment as the device plugin gives it in extender mode
//! ([`gpushare_contract::env`], [`claim_env`]): `NVIDIA_VISIBLE_DEVICES` pins the container to the GPU, the
//! `GPUSHARE_*` variables tell the application its share, and the enforcement mode's
//! variables (and, for MPS, the daemon's pipe directory as a mount) carry the share to the
//! enforcer. Every container that uses the claim gets the claim's whole share: in DRA a claim,
//! not a container, is the unit of allocation.

use std::path::{Path, PathBuf};

use gpushare_contract::env::container_env;
use gpushare_contract::env::{self, Enforcement, EnforcerSettings, IsolationOptions};
use gpushare_contract::{ContainerRequest, GpuInfo};
use serde_json::{Value, json};

use crate::prepare::{PreparedDevice, cdi_name};

/// The CDI spec version written.
pub const CDI_VERSION: &str = "0.6.0";

/// How shares are enforced on this node (the plugin's `--enforcement`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EnforcementConfig {
    /// The mode.
    pub mode: Enforcement,
    /// The MPS control daemon's pipe directory (mode `mps`).
    pub mps_pipe_directory: String,
    /// The installed interposer (mode `preload`).
    pub isolation: Option<Isolation>,
}

/// The interposer as installed on this node (mode `preload`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Isolation {
    /// The library on the host, under its versioned name.
    pub library: PathBuf,
    /// The host directory holding `containers/<name>`, the accounting directories.
    pub host_dir: PathBuf,
    /// Namespaces whose claims' containers get no interposer.
    pub exempt_namespaces: std::collections::BTreeSet<String>,
    /// The interposer's settings, passed to every container it is loaded into.
    pub options: IsolationOptions,
}

impl EnforcementConfig {
    /// The enforcement for a claim in `namespace`: the node's, except none of the interposer
    /// in an exempt namespace.
    pub fn for_namespace(&self, namespace: &str) -> Self {
        match &self.isolation {
            Some(isolation)
                if self.mode == Enforcement::Preload
                    && isolation.exempt_namespaces.contains(namespace) =>
            {
                Self {
                    mode: Enforcement::None,
                    mps_pipe_directory: self.mps_pipe_directory.clone(),
                    isolation: None,
                }
            }
            _ => self.clone(),
        }
    }
}

/// The claim's shares for the interposer's budget, bytes per GPU (each device's GiB), and
/// the GPUs' UUIDs in the same order.
pub fn isolation_shares(devices: &[PreparedDevice]) -> (Vec<u64>, Vec<String>) {
    devices
        .iter()
        .map(|device| (device.gib.saturating_mul(1 << 30), device.gpu_uuid.clone()))
        .unzip()
}

/// Claim `uid`'s limits file on the host (written by
/// `gpushare_runtime::isolation::prepare_accounting`), mounted read-only at
/// [`env::ISOLATION_LIMITS_IN_CONTAINER`].
pub fn limits_file(host_dir: &Path, uid: &str) -> PathBuf {
    host_dir.join("limits").join(accounting_dir_name(uid))
}

/// The accounting directory's name of claim `uid`: every container using the claim shares
/// its budget, as they share its memory.
pub fn accounting_dir_name(uid: &str) -> String {
    format!("claim-{uid}")
}

/// The environment every device of a claim carries, as `NAME=value` strings: the claim's
/// GPUs as one container sees them, by extender mode's contract
/// ([`gpushare_contract::env::container_env`]): one GPU gets exactly the one-GPU
/// variables; N GPUs (a request with `count: N`, the same share of each, checked by
/// [`crate::prepare::plan`]) get the comma lists, `GPUSHARE_GPU_COUNT` and the per-GPU share.
/// Every device carries the same list, so however the runtime merges their edits, the
/// container sees the whole claim.
pub fn claim_env(devices: &[PreparedDevice], enforcement: &EnforcementConfig) -> Vec<String> {
    let gpus: Vec<GpuInfo> = devices
        .iter()
        .map(|device| GpuInfo {
            index: device.gpu_index,
            uuid: device.gpu_uuid.clone(),
            model: String::new(),
            mem_gib: device.gpu_mem_gib,
            healthy: true,
            numa_node: None,
        })
        .collect();
    let per_gpu = devices.first().map_or(0, |device| device.gib);
    let compute_per_gpu = claim_compute(devices);
    let count = devices.len().max(1);
    let request = ContainerRequest {
        name: String::new(),
        gib: per_gpu.saturating_mul(u64::try_from(count).unwrap_or(u64::MAX)),
        init: false,
        compute: compute_per_gpu.saturating_mul(u32::try_from(count).unwrap_or(u32::MAX)),
    };
    let settings = EnforcerSettings {
        mps_pipe_directory: &enforcement.mps_pipe_directory,
        isolation: enforcement
            .isolation
            .as_ref()
            .map(|isolation| isolation.options)
            .unwrap_or_default(),
    };
    let mut vars: Vec<String> =
        container_env(&gpus, &request, per_gpu, (enforcement.mode, &settings))
            .into_iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect();
    vars.sort();
    vars
}

/// The percent of each of its GPUs' compute the claim holds (0: no compute share); the same
/// on each, as [`crate::prepare::plan`] checks.
pub fn claim_compute(devices: &[PreparedDevice]) -> u32 {
    devices.first().map_or(0, |device| device.compute)
}

/// The CDI spec of claim `uid` with `devices`, of kind `kind` (`vendor/class`).
pub fn spec(
    kind: &str,
    uid: &str,
    devices: &[PreparedDevice],
    enforcement: &EnforcementConfig,
) -> Value {
    let mounts: Vec<Value> = match enforcement.mode {
        Enforcement::Mps => vec![json!({
            "hostPath": enforcement.mps_pipe_directory,
            "containerPath": enforcement.mps_pipe_directory,
            "options": ["rbind", "rw"],
        })],
        Enforcement::Preload => match &enforcement.isolation {
            Some(isolation) => [

                json!({
                    "hostPath": isolation.library,
                    "containerPath": env::ISOLATION_LIBRARY_IN_CONTAINER,
                    "options": ["bind", "ro"],
                }),
                json!({
                    "hostPath": isolation.host_dir.join("containers").join(accounting_dir_name(uid)),
                    "containerPath": env::ISOLATION_DIR_IN_CONTAINER,
                    "options": ["bind", "rw"],
                }),
                json!({
                    "hostPath": limits_file(&isolation.host_dir, uid),
                    "containerPath": env::ISOLATION_LIMITS_IN_CONTAINER,
                    "options": ["bind", "ro"],
                }),
            ]
            .into_iter()
            // A compute share: the node-wide compute state the interposers of every
            // container on the GPU hold one another to their shares with (made by
            // `gpushare_runtime::isolation::prepare_accounting_with_compute`).
            .chain((claim_compute(devices) > 0).then(|| {
                json!({
                    "hostPath": gpushare_runtime::isolation::compute_dir_path(&isolation.host_dir),
                    "containerPath": env::ISOLATION_COMPUTE_DIR_IN_CONTAINER,
                    "options": ["bind", "rw"],
                })
            }))
            .collect(),
            None => Vec::new(),
        },
        Enforcement::None | Enforcement::Toolkit => Vec::new(),
    };
    let env = claim_env(devices, enforcement);
    let devices: Vec<Value> = devices
        .iter()
        .map(|device| {
            let mut edits = json!({"env": env});
            if !mounts.is_empty() {
                edits["mounts"] = json!(mounts);
            }
            json!({"name": cdi_name(uid, &device.device), "containerEdits": edits})
        })
        .collect();
    json!({"cdiVersion": CDI_VERSION, "kind": kind, "devices": devices})
}

/// Where claim `uid`'s spec lives in `dir`.
pub fn spec_path(dir: &Path, driver: &str, uid: &str) -> PathBuf {
    dir.join(format!("{driver}-claim-{uid}.json"))
}

/// Writes `spec` to `path` atomically (a temp file renamed over it), so a runtime never
/// reads half a spec.
pub fn write(path: &Path, spec: &Value) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    let text = serde_json::to_vec_pretty(spec).map_err(std::io::Error::other)?;
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

/// Removes the spec at `path`; a missing file is fine (already removed).
pub fn remove(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Err(err) if err.kind() != std::io::ErrorKind::NotFound => Err(err),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_cdi_device_per_share_with_the_contract_env() {
        let device = PreparedDevice {
            request: "gpu".into(),
            pool: "n1".into(),
            device: "gpu-1".into(),
            gpu_index: 1,
            gpu_uuid: "GPU-1".into(),
            gpu_mem_gib: 16,
            gib: 4,
            compute: 0,
            cdi_device_id: "k/c=claim-u1-gpu-1".into(),
        };
        let spec = spec(
            "k/c",
            "u1",
            std::slice::from_ref(&device),
            &EnforcementConfig::default(),
        );
        assert_eq!(spec["kind"], "k/c");
        assert_eq!(spec["devices"][0]["name"], "claim-u1-gpu-1");
        let env: Vec<&str> = spec["devices"][0]["containerEdits"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert!(env.contains(&"NVIDIA_VISIBLE_DEVICES=GPU-1"));
        assert!(env.contains(&"GPUSHARE_CONTAINER_MEM_GIB=4"));
        assert!(env.contains(&"GPUSHARE_GPU_MEM_GIB=16"));
        assert!(spec["devices"][0]["containerEdits"].get("mounts").is_none());

        let mps = EnforcementConfig {
            mode: Enforcement::Mps,
            mps_pipe_directory: "/run/mps".into(),
            isolation: None,
        };
        let spec = spec_mps(&device, &mps);
        let edits = &spec["devices"][0]["containerEdits"];
        assert!(
            edits["env"]
                .as_array()
                .unwrap()
                .contains(&json!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4G"))
        );
        assert_eq!(edits["mounts"][0]["hostPath"], "/run/mps");
    }

    #[test]
    fn preload_mounts_the_interposer_and_the_claims_accounting_directory() {
        let device = PreparedDevice {
            request: "gpu".into(),
            pool: "n1".into(),
            device: "gpu-0".into(),
            gpu_index: 0,
            gpu_uuid: "GPU-0".into(),
            gpu_mem_gib: 16,
            gib: 4,
            compute: 0,
            cdi_device_id: "k/c=claim-u1-gpu-0".into(),
        };
        let preload = EnforcementConfig {
            mode: Enforcement::Preload,
            mps_pipe_directory: String::new(),
            isolation: Some(Isolation {
                library: "/var/lib/gpushare/isolation/lib/libgpushare_isolation-1-2.so".into(),
                host_dir: "/var/lib/gpushare/isolation".into(),
                exempt_namespaces: ["trusted".to_owned()].into(),
                options: IsolationOptions {
                    context_mib: Some(300),
                    managed_memory: env::ManagedMemory::Ignore,
                    compute_mode: Default::default(),
                },
            }),
        };
        let exempt = spec(
            "k/c",
            "u1",
            std::slice::from_ref(&device),
            &preload.for_namespace("trusted"),
        );
        assert!(
            exempt["devices"][0]["containerEdits"]
                .get("mounts")
                .is_none()
        );
        for name in [
            env::LD_PRELOAD,
            env::ISOLATION_CONTEXT_MIB,
            env::ISOLATION_MANAGED_MEMORY,
        ] {
            assert!(
                !exempt["devices"][0]["containerEdits"]["env"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|v| v
                        .as_str()
                        .is_some_and(|v| v.starts_with(&format!("{name}=")))),
                "{name} in an exempt namespace"
            );
        }
        let spec = spec("k/c", "u1", &[device], &preload);
        let edits = &spec["devices"][0]["containerEdits"];
        let env = edits["env"].as_array().unwrap();
        assert!(env.contains(&json!(format!(
            "LD_PRELOAD={}",
            env::ISOLATION_LIBRARY_IN_CONTAINER
        ))));
        assert!(env.contains(&json!("GPUSHARE_CONTAINER_MEM_GIB=4")));
        assert!(env.contains(&json!("GPUSHARE_CONTEXT_MIB=300")), "{env:?}");
        assert!(
            env.contains(&json!("GPUSHARE_MANAGED_MEMORY=ignore")),
            "{env:?}"
        );
        assert_eq!(
            edits["mounts"],
            json!([
                {"hostPath": "/var/lib/gpushare/isolation/lib/libgpushare_isolation-1-2.so",
                 "containerPath": env::ISOLATION_LIBRARY_IN_CONTAINER, "options": ["bind", "ro"]},
                {"hostPath": "/var/lib/gpushare/isolation/containers/claim-u1",
                 "containerPath": env::ISOLATION_DIR_IN_CONTAINER, "options": ["bind", "rw"]},
                {"hostPath": "/var/lib/gpushare/isolation/limits/claim-u1",
                 "containerPath": env::ISOLATION_LIMITS_IN_CONTAINER, "options": ["bind", "ro"]},
            ])
        );
    }

    /// GPU `index` of a claim of 4 GiB and `compute` percent of each of its GPUs.
    fn claim_device(index: u32, compute: u32) -> PreparedDevice {
        PreparedDevice {
            request: "gpus".into(),
            pool: "n1".into(),
            device: format!("gpu-{index}"),
            gpu_index: index,
            gpu_uuid: format!("GPU-{index}"),
            gpu_mem_gib: 16,
            gib: 4,
            compute,
            cdi_device_id: format!("k/c=claim-u1-gpu-{index}"),
        }
    }

    #[test]
    fn every_device_of_a_two_gpu_claim_carries_both_gpus() {
        let device = |index: u32| claim_device(index, 0);
        let toolkit = EnforcementConfig {
            mode: Enforcement::Toolkit,
            mps_pipe_directory: String::new(),
            isolation: None,
        };
        let spec = spec("k/c", "u1", &[device(1), device(0)], &toolkit);
        let envs: Vec<&Value> = (0..2)
            .map(|i| &spec["devices"][i]["containerEdits"]["env"])
            .collect();
        assert_eq!(
            envs[0], envs[1],
            "both devices carry the claim's environment"
        );
        let env: Vec<&str> = envs[0]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        for wanted in [
            "NVIDIA_VISIBLE_DEVICES=GPU-1,GPU-0",
            "GPUSHARE_GPU_INDEX=1,0",
            "GPUSHARE_GPU_COUNT=2",
            "GPUSHARE_CONTAINER_MEM_GIB=8",
            "GPUSHARE_CONTAINER_MEM_GIB_PER_GPU=4",
            "GPUSHARE_POD_MEM_GIB=8",
            "NVIDIA_GPU_MEMORY_LIMIT=4096",
        ] {
            assert!(env.contains(&wanted), "{wanted} missing from {env:?}");
        }
    }

    #[test]
    fn a_compute_share_reaches_the_interposer_and_mps() {
        let device = |index: u32| claim_device(index, 30);
        let preload = EnforcementConfig {
            mode: Enforcement::Preload,
            mps_pipe_directory: String::new(),
            isolation: Some(Isolation {
                library: "/i/lib/l.so".into(),
                host_dir: "/i".into(),
                exempt_namespaces: Default::default(),
                options: IsolationOptions {
                    compute_mode: env::ComputeMode::Capped,
                    ..IsolationOptions::default()
                },
            }),
        };
        let both = spec("k/c", "u1", &[device(0), device(1)], &preload);
        let edits = &both["devices"][1]["containerEdits"];
        let env = edits["env"].as_array().unwrap();
        // Per GPU, as in extender mode, on both GPUs of the claim.
        assert!(
            env.contains(&json!("GPUSHARE_COMPUTE_PERCENT=30")),
            "{env:?}"
        );
        assert!(
            env.contains(&json!("GPUSHARE_COMPUTE_MODE=capped")),
            "{env:?}"
        );
        assert!(
            edits["mounts"].as_array().unwrap().contains(&json!(
                {"hostPath": "/i/compute", "containerPath": env::ISOLATION_COMPUTE_DIR_IN_CONTAINER,
                 "options": ["bind", "rw"]}
            )),
            "{edits}"
        );
        let mps = EnforcementConfig {
            mode: Enforcement::Mps,
            mps_pipe_directory: "/run/mps".into(),
            isolation: None,
        };
        let env = spec_mps(&device(0), &mps)["devices"][0]["containerEdits"]["env"].clone();
        assert!(
            env.as_array()
                .unwrap()
                .contains(&json!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30")),
            "{env}"
        );
        // Without a compute share, none of it.
        let plain = claim_device(0, 0);
        let memory_only = spec("k/c", "u1", &[plain], &preload);
        let edits = &memory_only["devices"][0]["containerEdits"];
        assert!(!edits.to_string().contains("COMPUTE"), "{edits}");
        assert_eq!(edits["mounts"].as_array().unwrap().len(), 3);
    }

    fn spec_mps(device: &PreparedDevice, mps: &EnforcementConfig) -> Value {
        super::spec("k/c", "u1", std::slice::from_ref(device), mps)
    }
}
