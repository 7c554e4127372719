//! The allocation the extender records on a pod, and the device plugin's progress on it.
//!
//! The extender writes these annotations on the `Binding` it posts, so the decision and the
//! bind are one API write (the API server copies a Binding's annotations onto the pod):
//!
//! | key (`<domain>/v1.…`) | written by | value |
//! |---|---|---|
//! | `gpu-index` | extender | `"1"` |
//! | `gpu-uuid` | extender | `"GPU-…"` (empty if the node has no inventory) |
//! | `pod-gib` | extender | `"8"` |
//! | `containers` | extender | `[{"name":"main","gib":8,"init":false}]` |
//! | `bind-time` | extender | RFC 3339 |
//! | `assigned` | extender `"false"`, device plugin `"true"` | every container allocated |
//! | `allocated` | device plugin | `"init,main"`: containers allocated so far |
//! | `signature` | extender (when it has a keyring) | `"k1:<base64>"`: HMAC of the decision |
//!
//! The signature is optional here: reading annotations never checks it. Whether a decision
//! is the extender's is a separate step, [`crate::signature::Keyring::verify`], taken by the
//! device plugin before it acts on one and by the extender before it lets one lower what it
//! has booked.

use std::collections::BTreeMap;

use crate::{ContainerRequest, Keys};

/// A pod's place on a GPU, as recorded in its annotations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodAllocation {
    /// Index of the chosen GPU.
    pub gpu_index: u32,
    /// UUID of the chosen GPU, or empty when the node published no inventory.
    pub gpu_uuid: String,
    /// GiB the pod holds on the GPU.
    pub pod_gib: u64,
    /// The containers that asked for GPU memory, in admission order.
    pub containers: Vec<ContainerRequest>,
    /// When the extender decided (RFC 3339).
    pub bind_time: String,
    /// True once the device plugin has allocated every container.
    pub assigned: bool,
    /// Containers the device plugin has allocated so far.
    pub allocated: Vec<String>,
    /// The extender's signature of the decision (`<key-id>:<base64>`), if it signed it.
    pub signature: Option<String>,
}

/// Why allocation annotations could not be read.
#[derive(Debug, thiserror::Error)]
pub enum AllocationError {
    /// An annotation that must be a number is not.
    #[error("annotation {key} is {value:?}, not a number")]
    NotANumber {
        /// the annotation key
        key: String,
        /// its value
        value: String,
    },
    /// The containers annotation is not the documented JSON list.
    #[error("annotation {key} is not a JSON list of containers: {source}")]
    Containers {
        /// the annotation key
        key: String,
        /// the parse error
        #[source]
        source: serde_json::Error,
    },
    /// One of the annotations the extender always writes together is missing.
    #[error("annotation {0} is missing")]
    Missing(String),
}

impl PodAllocation {
    /// The annotations the extender puts on the Binding: the whole decision, not yet assigned,
    /// and its signature when there is one.
    pub fn to_annotations(&self, keys: &Keys) -> BTreeMap<String, String> {
        let containers =
            serde_json::to_string(&self.containers).unwrap_or_else(|_| "[]".to_owned());
        let mut annotations = BTreeMap::from([
            (keys.gpu_index.clone(), self.gpu_index.to_string()),
            (keys.gpu_uuid.clone(), self.gpu_uuid.clone()),
            (keys.pod_gib.clone(), self.pod_gib.to_string()),
            (keys.containers.clone(), containers),
            (keys.bind_time.clone(), self.bind_time.clone()),
            (keys.assigned.clone(), self.assigned.to_string()),
            (keys.allocated.clone(), self.allocated.join(",")),
        ]);
        if let Some(signature) = &self.signature {
            annotations.insert(keys.signature.clone(), signature.clone());
        }
        annotations
    }

    /// Reads an allocation back; `Ok(None)` when the pod carries none (no `gpu-index`).
    pub fn from_annotations(
        keys: &Keys,
        annotations: &BTreeMap<String, String>,
    ) -> Result<Option<Self>, AllocationError> {
        let Some(index) = annotations.get(&keys.gpu_index) else {
            return Ok(None);
        };
        let number = |key: &str, value: &str| -> Result<u64, AllocationError> {
            value
                .trim()
                .parse()
                .map_err(|_| AllocationError::NotANumber {
                    key: key.to_owned(),
                    value: value.to_owned(),
                })
        };
        let required = |key: &String| {
            annotations
                .get(key)
                .ok_or_else(|| AllocationError::Missing(key.clone()))
        };
        let gpu_index = number(&keys.gpu_index, index)?;
        let gpu_index = u32::try_from(gpu_index).map_err(|_| AllocationError::NotANumber {
            key: keys.gpu_index.clone(),
            value: index.clone(),
        })?;
        let pod_gib = number(&keys.pod_gib, required(&keys.pod_gib)?)?;
        let containers: Vec<ContainerRequest> = serde_json::from_str(required(&keys.containers)?)
            .map_err(|source| AllocationError::Containers {
            key: keys.containers.clone(),
            source,
        })?;
        let allocated = annotations
            .get(&keys.allocated)
            .map(|list| {
                list.split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        Ok(Some(Self {
            gpu_index,
            gpu_uuid: annotations.get(&keys.gpu_uuid).cloned().unwrap_or_default(),
            pod_gib,
            containers,
            bind_time: annotations
                .get(&keys.bind_time)
                .cloned()
                .unwrap_or_default(),
            assigned: annotations.get(&keys.assigned).is_some_and(|v| v == "true"),
            allocated,
            signature: annotations
                .get(&keys.signature)
                .filter(|v| !v.trim().is_empty())
                .cloned(),
        }))
    }

    /// Containers still waiting for the device plugin, in admission order.
    pub fn pending_containers(&self) -> impl Iterator<Item = &ContainerRequest> {
        self.containers
            .iter()
            .filter(|c| !self.assigned && !self.allocated.iter().any(|a| a == &c.name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> PodAllocation {
        PodAllocation {
            gpu_index: 2,
            gpu_uuid: "GPU-abc".into(),
            pod_gib: 6,
            containers: vec![
                ContainerRequest {
                    name: "init".into(),
                    gib: 6,
                    init: true,
                },
                ContainerRequest {
                    name: "main".into(),
                    gib: 4,
                    init: false,
                },
            ],
            bind_time: "2026-11-22T10:00:00Z".into(),
            assigned: false,
            allocated: vec![],
            signature: None,
        }
    }

    #[test]
    fn round_trips_through_annotations() {
        let keys = Keys::default();
        let alloc = sample();
        let annotations = alloc.to_annotations(&keys);
        assert_eq!(annotations[&keys.gpu_index], "2");
        assert_eq!(annotations[&keys.assigned], "false");
        assert_eq!(
            PodAllocation::from_annotations(&keys, &annotations).unwrap(),
            Some(alloc.clone())
        );
        assert!(!annotations.contains_key(&keys.signature));
        // With a signature: written and read back, never checked here.
        let signed = PodAllocation {
            signature: Some("k1:bm90IGNoZWNrZWQ=".into()),
            ..alloc
        };
        let annotations = signed.to_annotations(&keys);
        assert_eq!(annotations[&keys.signature], "k1:bm90IGNoZWNrZWQ=");
        assert_eq!(
            PodAllocation::from_annotations(&keys, &annotations).unwrap(),
            Some(signed)
        );
    }

    #[test]
    fn absent_means_none_and_garbage_is_an_error() {
        let keys = Keys::default();
        assert_eq!(
            PodAllocation::from_annotations(&keys, &BTreeMap::new()).unwrap(),
            None
        );
        let mut annotations = sample().to_annotations(&keys);
        annotations.insert(keys.gpu_index.clone(), "one".into());
        let err = PodAllocation::from_annotations(&keys, &annotations).unwrap_err();
        assert!(err.to_string().contains("\"one\""), "{err}");
        let mut annotations = sample().to_annotations(&keys);
        annotations.insert(keys.containers.clone(), "{".into());
        assert!(PodAllocation::from_annotations(&keys, &annotations).is_err());
    }

    #[test]
    fn pending_containers_skip_allocated_ones() {
        let mut alloc = sample();
        alloc.allocated = vec!["init".into()];
        let pending: Vec<_> = alloc
            .pending_containers()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(pending, vec!["main"]);
        alloc.assigned = true;
        assert_eq!(alloc.pending_containers().count(), 0);
    }
}
