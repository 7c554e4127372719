//! CDI specs: how a prepared claim reaches the container.
//!
//! kubelet hands the container runtime the CDI device names Prepare answered; the runtime
//! looks them up in the spec files of its CDI directory and applies their `containerEdits`.
//! One spec file per claim, named after the claim's UID, holding one device per GPU share
//! with the environment the device plugin gives in extender mode
//! ([`gpushare_contract::env`]): `NVIDIA_VISIBLE_DEVICES` pins the container to the GPU, the
//! `GPUSHARE_*` variables tell the application its share, and the enforcement mode's
//! variables (and, for MPS, the daemon's pipe directory as a mount) carry the share to the
//! enforcer. Every container that uses the claim gets the claim's whole share: in DRA a claim,
//! not a container, is the unit of allocation.

use std::path::{Path, PathBuf};

use gpushare_contract::env::{self, Enforcement};
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
}

/// The environment of one prepared device, as `NAME=value` strings. `claim_gib` is what the
/// whole claim holds on the device's GPU (what extender mode calls the pod's GiB).
pub fn env_for(
    device: &PreparedDevice,
    claim_gib: u64,
    enforcement: &EnforcementConfig,
) -> Vec<String> {
    let enforced = enforcement
        .mode
        .env(device.gib, &enforcement.mps_pipe_directory)
        .into_iter()
        .map(|(name, value)| format!("{name}={value}"));
    let mut vars = vec![
        format!("{}={}", env::NVIDIA_VISIBLE_DEVICES, device.gpu_uuid),
        format!("{}={}", env::GPU_INDEX, device.gpu_index),
        format!("{}={}", env::GPU_UUID, device.gpu_uuid),
        format!("{}={}", env::CONTAINER_GIB, device.gib),
        format!("{}={claim_gib}", env::POD_GIB),
        format!("{}={}", env::GPU_TOTAL_GIB, device.gpu_mem_gib),
    ];
    vars.extend(enforced);
    vars
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
        Enforcement::None | Enforcement::Toolkit => Vec::new(),
    };
    let devices: Vec<Value> = devices
        .iter()
        .map(|device| {
            let claim_gib = devices
                .iter()
                .filter(|other| other.gpu_index == device.gpu_index)
                .map(|other| other.gib)
                .sum();
            let mut edits = json!({"env": env_for(device, claim_gib, enforcement)});
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

    fn spec_mps(device: &PreparedDevice, mps: &EnforcementConfig) -> Value {
        super::spec("k/c", "u1", std::slice::from_ref(device), mps)
    }
}
