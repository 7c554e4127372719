//! The allocation the extender records on a pod, and the device plugin's progress on it.
//!
//! The extender writes these annotations on the `Binding` it posts, so the decision and the
//! bind are one API write (the API server copies a Binding's annotations onto the pod):
//!
//! | key (`<domain>/v1.…`) | written by | value |
//! |---|---|---|
//! | `gpu-index` | extender | `"1"`; a multi-GPU pod: `"1,3"` |
//! | `gpu-uuid` | extender | `"GPU-…"`, `"GPU-…,GPU-…"` (empty if the node has no inventory) |
//! | `pod-gib` | extender | `"8"`: GiB on each of the pod's GPUs |
//! | `exclusive` | extender | `"true"` when the pod holds its GPUs whole (absent otherwise) |
//! | `compute` | extender | `"30"`: percent of each of the pod's GPUs' compute (absent when it asked for none) |
//! | `containers` | extender | `[{"name":"main","gib":8,"init":false}]`, with `"compute":30` where a container asked for compute |
//! | `bind-time` | extender | RFC 3339 |
//! | `assigned` | extender `"false"`, device plugin `"true"` | every container allocated |
//! | `allocated` | device plugin | `"init,main"`: containers allocated so far |
//!
//! The device plugin writes `assigned` and `allocated` only with `--allocation-marks` (off by
//! default). Readers take a pod whose `status.startTime` is set as allocated whatever the
//! marks say: kubelet sets it when it admits the pod, and admission is where it calls
//! Allocate for every container.
//! | `signature` | extender (when it has a keyring) | `"k1:<base64>"`: HMAC of the decision |
//!
//! The signature is optional here: reading annotations never checks it. Whether a decision
//! is the extender's is a separate step, [`crate::signature::Keyring::verify`], taken by the
//! device plugin before it acts on one and by the extender before it lets one lower what it
//! has booked.

use std::collections::BTreeMap;

use crate::{ContainerRequest, Keys};

/// One more GPU of a multi-GPU pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuRef {
    /// Index of the GPU on the node.
    pub index: u32,
    /// Its UUID, or empty when the node published no inventory.
    pub uuid: String,
}

/// A pod's place on its GPUs, as recorded in its annotations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodAllocation {
    /// Index of the chosen GPU (the first one, for a multi-GPU pod).
    pub gpu_index: u32,
    /// UUID of the chosen GPU, or empty when the node published no inventory.
    pub gpu_uuid: String,
    /// The pod's other GPUs, in the annotation's order; empty for a one-GPU pod.
    pub more_gpus: Vec<GpuRef>,
    /// GiB the pod holds on each of its GPUs (for a one-GPU pod, its whole request).
    pub pod_gib: u64,
    /// True when the pod holds its GPUs whole: nothing else is placed on them.
    pub exclusive: bool,
    /// Percent of each of its GPUs' compute the pod holds; 0 when it asked for none.
    pub compute: u32,
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

/// Alibaba Cloud's gpushare (gpushare-scheduler-extender with gpushare-device-plugin): the
/// annotations its extender writes on each pod it binds. gpushare reads them on pods that were
/// placed before the switch (docs/migrating.md), so they count on their GPUs without a restart.
pub mod classic {
    use std::collections::BTreeMap;

    /// The index of the GPU the classic extender chose.
    pub const GPU_INDEX: &str = "ALIYUN_COM_GPU_MEM_IDX";
    /// The pod's GPU memory there, in the resource's unit (GiB, the classic default).
    pub const POD_MEM: &str = "ALIYUN_COM_GPU_MEM_POD";
    /// The GPU's total memory, in the same unit.
    pub const DEVICE_MEM: &str = "ALIYUN_COM_GPU_MEM_DEV";
    /// `true` once the classic device plugin allocated the pod.
    pub const ASSIGNED: &str = "ALIYUN_COM_GPU_MEM_ASSIGNED";

    /// A pod the classic extender placed: on GPU `gpu_index`, holding `pod_gib`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct ClassicPlacement {
        /// The GPU's index on its node.
        pub gpu_index: u32,
        /// GiB it holds there.
        pub pod_gib: u64,
    }

    impl ClassicPlacement {
        /// The placement as gpushare records one (one GPU, shared, allocated, unsigned), for
        /// readers that book allocations: a classic pod counts where it was placed.
        pub fn as_allocation(&self) -> super::PodAllocation {
            super::PodAllocation {
                gpu_index: self.gpu_index,
                gpu_uuid: String::new(),
                more_gpus: Vec::new(),
                pod_gib: self.pod_gib,
                exclusive: false,
                compute: 0,
                containers: Vec::new(),
                bind_time: String::new(),
                assigned: true,
                allocated: Vec::new(),
                signature: None,
            }
        }
    }

    /// The classic placement in `annotations`, if they hold one: a GPU index and the pod's
    /// memory, both whole numbers (a pod the classic extender never placed has neither; a
    /// negative or malformed index, as written for a pod it could not place, is none).
    pub fn placement(annotations: &BTreeMap<String, String>) -> Option<ClassicPlacement> {
        let number = |key: &str| annotations.get(key)?.trim().parse::<u64>().ok();
        let gpu_index = u32::try_from(number(GPU_INDEX)?).ok()?;
        let pod_gib = number(POD_MEM).filter(|gib| *gib > 0)?;
        Some(ClassicPlacement { gpu_index, pod_gib })
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        fn annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        }

        #[test]
        fn a_classic_placement_is_read_and_anything_else_is_none() {
            let placed = annotations(&[
                (GPU_INDEX, "1"),
                (POD_MEM, "6"),
                (DEVICE_MEM, "16"),
                (ASSIGNED, "true"),
            ]);
            assert_eq!(
                placement(&placed),
                Some(ClassicPlacement {
                    gpu_index: 1,
                    pod_gib: 6
                })
            );
            for bad in [
                annotations(&[]),
                annotations(&[(GPU_INDEX, "1")]),
                annotations(&[(GPU_INDEX, "-1"), (POD_MEM, "6")]),
                annotations(&[(GPU_INDEX, "one"), (POD_MEM, "6")]),
                annotations(&[(GPU_INDEX, "0"), (POD_MEM, "0")]),
            ] {
                assert_eq!(placement(&bad), None, "{bad:?}");
            }
        }
    }
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
    /// The GPU index and UUID lists name different numbers of GPUs, or a GPU twice.
    #[error(
        "annotations {indices_key} ({indices:?}) and {uuids_key} ({uuids:?}) do not name the same distinct GPUs"
    )]
    GpuLists {
        /// the index annotation key
        indices_key: String,
        /// its value
        indices: String,
        /// the UUID annotation key
        uuids_key: String,
        /// its value
        uuids: String,
    },
}

impl PodAllocation {
    /// The annotations the extender puts on the Binding: the whole decision, not yet assigned,
    /// and its signature when there is one.
    pub fn to_annotations(&self, keys: &Keys) -> BTreeMap<String, String> {
        let containers =
            serde_json::to_string(&self.containers).unwrap_or_else(|_| "[]".to_owned());
        let mut indices = self.gpu_index.to_string();
        let mut uuids = self.gpu_uuid.clone();
        for gpu in &self.more_gpus {
            indices.push_str(&format!(",{}", gpu.index));
            if !uuids.is_empty() {
                uuids.push(',');
                uuids.push_str(&gpu.uuid);
            }
        }
        let mut annotations = BTreeMap::from([
            (keys.gpu_index.clone(), indices),
            (keys.gpu_uuid.clone(), uuids),
            (keys.pod_gib.clone(), self.pod_gib.to_string()),
            (keys.containers.clone(), containers),
            (keys.bind_time.clone(), self.bind_time.clone()),
            (keys.assigned.clone(), self.assigned.to_string()),
            (keys.allocated.clone(), self.allocated.join(",")),
        ]);
        if let Some(signature) = &self.signature {
            annotations.insert(keys.signature.clone(), signature.clone());
        }
        if self.exclusive {
            annotations.insert(keys.exclusive.clone(), "true".to_owned());
        }
        if self.compute > 0 {
            annotations.insert(keys.compute.clone(), self.compute.to_string());
        }
        annotations
    }

    /// Every GPU of the pod, `(index, uuid)`, the first one first.
    pub fn gpus(&self) -> impl Iterator<Item = (u32, &str)> {
        std::iter::once((self.gpu_index, self.gpu_uuid.as_str())).chain(
            self.more_gpus
                .iter()
                .map(|gpu| (gpu.index, gpu.uuid.as_str())),
        )
    }

    /// Number of GPUs the pod holds.
    pub fn gpu_count(&self) -> usize {
        1 + self.more_gpus.len()
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
        let mut indices = Vec::new();
        for part in index.split(',') {
            let value = number(&keys.gpu_index, part)?;
            indices.push(
                u32::try_from(value).map_err(|_| AllocationError::NotANumber {
                    key: keys.gpu_index.clone(),
                    value: index.clone(),
                })?,
            );
        }
        let uuid_list = annotations.get(&keys.gpu_uuid).cloned().unwrap_or_default();
        let uuids: Vec<String> = if uuid_list.trim().is_empty() {
            vec![String::new(); indices.len()]
        } else {
            uuid_list.split(',').map(|u| u.trim().to_owned()).collect()
        };
        let distinct = |list: &[String]| {
            list.iter().all(|u| u.is_empty())
                || list.iter().collect::<std::collections::BTreeSet<_>>().len() == list.len()
        };
        let distinct_indices = indices
            .iter()
            .collect::<std::collections::BTreeSet<_>>()
            .len()
            == indices.len();
        if uuids.len() != indices.len() || !distinct(&uuids) || !distinct_indices {
            return Err(AllocationError::GpuLists {
                indices_key: keys.gpu_index.clone(),
                indices: index.clone(),
                uuids_key: keys.gpu_uuid.clone(),
                uuids: uuid_list,
            });
        }
        let mut gpus = indices.into_iter().zip(uuids);
        let Some((gpu_index, gpu_uuid)) = gpus.next() else {
            return Err(AllocationError::Missing(keys.gpu_index.clone()));
        };
        let more_gpus = gpus.map(|(index, uuid)| GpuRef { index, uuid }).collect();
        let pod_gib = number(&keys.pod_gib, required(&keys.pod_gib)?)?;
        let compute = match annotations.get(&keys.compute) {
            None => 0,
            Some(value) => u32::try_from(number(&keys.compute, value)?)
                .ok()
                .filter(|&percent| percent <= crate::request::COMPUTE_PER_GPU)
                .ok_or_else(|| AllocationError::NotANumber {
                    key: keys.compute.clone(),
                    value: value.clone(),
                })?,
        };
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
            gpu_uuid,
            more_gpus,
            pod_gib,
            exclusive: annotations
                .get(&keys.exclusive)
                .is_some_and(|v| v == "true"),
            compute,
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
            more_gpus: vec![],
            pod_gib: 6,
            exclusive: false,
            containers: vec![
                ContainerRequest {
                    name: "init".into(),
                    gib: 6,
                    init: true,
                    compute: 0,
                },
                ContainerRequest {
                    name: "main".into(),
                    gib: 4,
                    init: false,
                    compute: 0,
                },
            ],
            bind_time: "2026-11-22T10:00:00Z".into(),
            assigned: false,
            allocated: vec![],
            signature: None,
            compute: 0,
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
    fn compute_round_trips_and_is_absent_when_none() {
        let keys = Keys::default();
        assert!(!sample().to_annotations(&keys).contains_key(&keys.compute));
        let mut with = sample();
        with.compute = 30;
        with.containers[0].compute = 30;
        let annotations = with.to_annotations(&keys);
        assert_eq!(annotations[&keys.compute], "30");
        assert!(annotations[&keys.containers].contains("\"compute\":30"));
        assert_eq!(
            PodAllocation::from_annotations(&keys, &annotations).unwrap(),
            Some(with)
        );
        let mut bad = annotations.clone();
        bad.insert(keys.compute.clone(), "101".into());
        assert!(PodAllocation::from_annotations(&keys, &bad).is_err());
    }

    #[test]
    fn multi_gpu_allocations_round_trip_as_lists() {
        let keys = Keys::default();
        let alloc = PodAllocation {
            more_gpus: vec![GpuRef {
                index: 0,
                uuid: "GPU-def".into(),
            }],
            exclusive: true,
            ..sample()
        };
        let annotations = alloc.to_annotations(&keys);
        assert_eq!(annotations[&keys.gpu_index], "2,0");
        assert_eq!(annotations[&keys.gpu_uuid], "GPU-abc,GPU-def");
        assert_eq!(annotations[&keys.exclusive], "true");
        let back = PodAllocation::from_annotations(&keys, &annotations)
            .unwrap()
            .unwrap();
        assert_eq!(back, alloc);
        assert_eq!(
            back.gpus().collect::<Vec<_>>(),
            vec![(2, "GPU-abc"), (0, "GPU-def")]
        );
        assert_eq!(back.gpu_count(), 2);
        assert!(!sample().to_annotations(&keys).contains_key(&keys.exclusive));
        // Without inventory: indices only.
        let bare = PodAllocation {
            gpu_uuid: String::new(),
            more_gpus: vec![GpuRef {
                index: 1,
                uuid: String::new(),
            }],
            ..sample()
        };
        let annotations = bare.to_annotations(&keys);
        assert_eq!(annotations[&keys.gpu_uuid], "");
        assert_eq!(
            PodAllocation::from_annotations(&keys, &annotations).unwrap(),
            Some(bare)
        );
        // Lists that disagree, or name a GPU twice, are errors.
        for (indices, uuids) in [
            ("2,0", "GPU-a"),
            ("2,2", "GPU-a,GPU-b"),
            ("1,2", "GPU-a,GPU-a"),
            ("1,", ""),
        ] {
            let mut annotations = sample().to_annotations(&keys);
            annotations.insert(keys.gpu_index.clone(), indices.into());
            annotations.insert(keys.gpu_uuid.clone(), uuids.into());
            assert!(
                PodAllocation::from_annotations(&keys, &annotations).is_err(),
                "{indices} / {uuids}"
            );
        }
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
