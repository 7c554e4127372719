//! GPU memory measured in use, as the device plugin publishes it on its Node for people's
//! tools (`kubectl gpushare top -d`): annotation `<domain>/v1.usage`.
//!
//! ```json
//! {"gpus":{"0":6144,"1":512},"pods":{"default/a":5120,"ml/b":0}}
//! ```
//!
//! - `gpus`: GPU index → MiB every process on it uses, whether or not it could be traced to
//!   a pod.
//! - `pods`: `namespace/name` → MiB the pod's processes use, over all its GPUs. Every pod
//!   that holds GPU memory devices on the node is listed, so `0` (measured, nothing in use)
//!   differs from absent (not measured).
//! - `counted` (optional): `namespace/name` → MiB the isolation interposer counted for the
//!   pod, when it is loaded and `pods` holds the driver's own figures:
//!   `{"gpus":{"0":6144},"pods":{"default/a":6144},"counted":{"default/a":3072}}`.
//!
//! - `compute` (optional): `namespace/name` → percent of its GPUs' SM time its kernels ran
//!   over the plugin's last period, as the interposer measured it, for pods with a compute
//!   share (`gpu-compute`), extender mode: `{"compute":{"default/a":28}}`; over all the GPUs
//!   it holds, at most 100. A pod using idle time in `shared` mode may pass its share.
//!
//! It is for people, not for scheduling: the extender does not read it, and it is written
//! only when a value moved noticeably (see the device plugin's `usage` module), so it can
//! lag the truth by that much. MiB, because GiB would hide a 600 MiB overrun of a 1 GiB share.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// MiB in a GiB.
pub const MIB_PER_GIB: u64 = 1024;

/// What one node's device plugin measured.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeMemoryUse {
    /// GPU index → MiB in use on it.
    #[serde(default)]
    pub gpus: BTreeMap<u32, u64>,
    /// `namespace/name` → MiB its processes use.
    #[serde(default)]
    pub pods: BTreeMap<String, u64>,
    /// `namespace/name` → MiB the isolation interposer counted for it, where the interposer
    /// is loaded and `pods` holds the driver's figures; absent otherwise. A pod whose driver
    /// figure is well above its counted one runs something the interposer does not see.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub counted: BTreeMap<String, u64>,
    /// `namespace/name` → percent of its GPUs' SM time its kernels ran over the last period
    /// (the interposer's compute measurement); pods with a compute share only.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub compute: BTreeMap<String, u32>,
}

/// Why a usage annotation could not be read.
#[derive(Debug, thiserror::Error)]
#[error(
    "the GPU usage annotation is not valid JSON of the form {{\"gpus\":{{\"0\":MiB}},\"pods\":{{\"ns/name\":MiB}}}}: {0}"
)]
pub struct UsageError(#[source] serde_json::Error);

impl NodeMemoryUse {
    /// The annotation's value (compact JSON).
    pub fn encode(&self) -> String {
        // A map of numbers and strings always serialises.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Reads an annotation's value.
    pub fn decode(text: &str) -> Result<Self, UsageError> {
        serde_json::from_str(text).map_err(UsageError)
    }
}

/// MiB in `bytes`, rounded down.
pub fn mib_from_bytes(bytes: u64) -> u64 {
    bytes / (1 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_in_the_documented_form() {
        let usage = NodeMemoryUse {
            gpus: BTreeMap::from([(0, 6144), (1, 512)]),
            pods: BTreeMap::from([("default/a".to_owned(), 5120), ("ml/b".to_owned(), 0)]),
            counted: BTreeMap::new(),
            compute: Default::default(),
        };
        let text = usage.encode();
        assert_eq!(
            text,
            r#"{"gpus":{"0":6144,"1":512},"pods":{"default/a":5120,"ml/b":0}}"#
        );
        assert_eq!(NodeMemoryUse::decode(&text).unwrap(), usage);
        assert_eq!(
            NodeMemoryUse::decode("{}").unwrap(),
            NodeMemoryUse::default()
        );
        assert!(NodeMemoryUse::decode(r#"{"pods":{"a":-1}}"#).is_err());
        let counted = NodeMemoryUse {
            counted: BTreeMap::from([("default/a".to_owned(), 3072)]),
            ..usage
        };
        let text = counted.encode();
        assert!(
            text.ends_with(r#","counted":{"default/a":3072}}"#),
            "{text}"
        );
        assert_eq!(NodeMemoryUse::decode(&text).unwrap(), counted);
        assert!(NodeMemoryUse::decode("nope").is_err());
        assert_eq!(mib_from_bytes(3 << 20 | 5), 3);
    }
}
