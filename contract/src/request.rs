//! How much GPU memory a pod asks for, read from its spec the way kubelet counts it.
//!
//! Per container, the limit of the resource (or, without a limit, the request). Init
//! containers run one at a time before the app containers, so the pod needs
//! `max(sum over app containers and sidecars, largest plain init container)`. Native sidecars
//! (init containers with `restartPolicy: Always`) keep running beside the app containers and
//! count toward the sum.
//!
//! Only whole, non-negative GiB are valid: `4` is; `4.5`, `-1`, `10G`, `4Gi` and values over
//! [`crate::MAX_GIB`] are rejected with an error that names the pod, container and value.
//!
//! # More than one GPU
//!
//! The resource is always the pod's total. Two pod annotations, read by [`pod_request_with`],
//! say how that total is laid out:
//!
//! ```yaml
//! metadata:
//!   annotations:
//!     gpushare.example.com/gpus: "2"          # spread evenly over 2 GPUs of one node
//!     gpushare.example.com/exclusive: "true"  # optional: those GPUs are the pod's alone
//! spec:
//!   containers:
//!   - name: train
//!     resources:
//!       limits:
//!         example.com/gpu-mem: 16              # 8 GiB on each of the 2 GPUs
//! ```
//!
//! - Every container that asks for the resource sees all N GPUs and gets `gib / N` on each,
//!   so each container's GiB must be a multiple of N (an error says so otherwise).
//! - `exclusive` takes whole GPUs with at least `total / N` GiB each: the pod books every
//!   byte of them and no other pod is placed there. A whole-GPU pod on 2 × 24 GiB GPUs writes
//!   `gpu-mem: 48`; on nodes with larger GPUs it still takes them whole.
//! - Why the total and not a per-GPU amount: kube-scheduler and kubelet count the resource
//!   per node, and the node advertises its GPUs' total. The total keeps their fit right (an
//!   exclusive pod on GPUs larger than it asked for holds more than kubelet counts; the
//!   extender, which books the whole GPUs, is the one that keeps others off them).
//! - Limits: all of a pod's GPU containers share the same N GPUs with the same split; at most
//!   [`MAX_GPUS_PER_POD`] GPUs, all on one node.
//!
//! # Compute
//!
//! A container that asks for GPU memory may also ask for a share of its GPUs' SM time,
//! in percent of one GPU: `<domain of the memory resource>/gpu-compute` (for
//! `example.com/gpu-mem`, `example.com/gpu-compute`; see [`compute_resource_of`]). Read like
//! the memory: per container the limit (else the request), the pod's total
//! `max(sum over app containers and sidecars, largest plain init container)`, and, like the
//! memory, the total over all the pod's GPUs (the device plugin advertises 100 units per
//! GPU, so kube-scheduler's per-node count stays right): `gpu-compute: 60` with
//! `<domain>/gpus: "2"` is 30 % of each GPU. Only whole percents; a container asking for
//! compute without memory, a split that is not even, or more than 100 % of one GPU is
//! refused with an error that says so. A pod that asks for none gets no compute guarantee and
//! no cap.

use k8s_openapi::api::core::v1::{Container, Pod};
use serde::{Deserialize, Serialize};

use crate::{Keys, MAX_GIB};

/// The most GPUs one pod may spread over.
pub const MAX_GPUS_PER_POD: u32 = 16;

/// One container's share of the pod's request, in kubelet's admission order. Also the element
/// of the `<domain>/v1.containers` annotation: `{"name":"main","gib":4,"init":false}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerRequest {
    /// Container name (unique across init and app containers of a pod).
    pub name: String,
    /// Whole GiB requested; never zero (containers asking for nothing are left out).
    pub gib: u64,
    /// True for init containers (including sidecars).
    #[serde(default)]
    pub init: bool,
    /// Percent of one GPU's SM time over all the pod's GPUs (0: no compute share); absent
    /// from the annotation when 0, so allocations without compute read as they always did.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub compute: u32,
}

impl ContainerRequest {
    /// Percent of each of `gpus` GPUs the container is given (0: no compute share).
    pub fn compute_per_gpu(&self, gpus: usize) -> u32 {
        self.compute / u32::try_from(gpus.max(1)).unwrap_or(u32::MAX)
    }
}

fn is_zero(value: &u32) -> bool {
    *value == 0
}

/// The most percent of one GPU a pod may hold on each of its GPUs: the whole GPU.
pub const COMPUTE_PER_GPU: u32 = 100;

/// The compute resource that goes with the memory resource `memory_resource`: the same
/// domain, named `gpu-compute` (`example.com/gpu-mem` → `example.com/gpu-compute`).
pub fn compute_resource_of(memory_resource: &str) -> String {
    match memory_resource.split_once('/') {
        Some((domain, _)) => format!("{domain}/gpu-compute"),
        None => "gpu-compute".to_owned(),
    }
}

/// What a pod asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRequest {
    /// The containers that ask for the resource, init containers first, in spec order.
    pub containers: Vec<ContainerRequest>,
    /// GiB the pod holds while it runs, over all its GPUs.
    pub pod_gib: u64,
    /// How many GPUs of one node the memory is spread over, evenly (1 unless the pod's
    /// `<domain>/gpus` annotation says more; see the module doc).
    pub gpus: u32,
    /// Whether the pod takes its GPUs whole (`<domain>/exclusive: "true"`).
    pub exclusive: bool,
    /// GPU models allowed (`name`) or refused (`!name`), as written in `<domain>/gpu-model`;
    /// empty for any model.
    pub models: Vec<String>,
    /// Percent of one GPU's SM time the pod holds while it runs, over all its GPUs (0: no
    /// compute share; see the module doc).
    pub pod_compute: u32,
}

impl PodRequest {
    /// Percent of each of its GPUs the pod holds (0: no compute share).
    pub fn compute_per_gpu(&self) -> u32 {
        self.pod_compute / self.gpus.max(1)
    }

    /// GiB the pod holds on each of its GPUs.
    pub fn gib_per_gpu(&self) -> u64 {
        self.pod_gib / u64::from(self.gpus.max(1))
    }

    /// Whether the pod needs anything but a shared slice of one GPU.
    pub fn is_multi(&self) -> bool {
        self.gpus > 1 || self.exclusive
    }
}

/// Why a pod's request cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The quantity is not a whole number of GiB.
    #[error(
        "pod {pod}: container {container} asks for {resource}: {value:?}, which is not a whole number of GiB (write e.g. \"4\")"
    )]
    NotWholeGib {
        /// namespace/name
        pod: String,
        /// container name
        container: String,
        /// the resource name
        resource: String,
        /// the value as written
        value: String,
    },
    /// The quantity is larger than any GPU could be.
    #[error(
        "pod {pod}: container {container} asks for {value} GiB of {resource}, more than the {max} GiB limit"
    )]
    TooLarge {
        /// namespace/name
        pod: String,
        /// container name
        container: String,
        /// the resource name
        resource: String,
        /// the value as written
        value: String,
        /// the limit
        max: u64,
    },
    /// An annotation that shapes the request is malformed.
    #[error("pod {pod}: annotation {key} is {value:?}; {expected}")]
    BadAnnotation {
        /// namespace/name
        pod: String,
        /// the annotation key
        key: String,
        /// its value
        value: String,
        /// what it should be
        expected: String,
    },
    /// A container's GiB cannot be split evenly over the pod's GPUs.
    #[error(
        "pod {pod}: container {container} asks for {gib} GiB spread over {gpus} GPUs; with {key} the GiB of every container must be a multiple of {gpus}"
    )]
    Uneven {
        /// namespace/name
        pod: String,
        /// container name
        container: String,
        /// its GiB
        gib: u64,
        /// number of GPUs
        gpus: u32,
        /// the annotation key
        key: String,
    },
    /// A compute quantity is not a whole percent within what a pod may hold.
    #[error(
        "pod {pod}: container {container} asks for {resource}: {value:?}, which is not a whole percent from 0 to {max} (write e.g. \"30\" for 30 % of a GPU)"
    )]
    NotWholePercent {
        /// namespace/name
        pod: String,
        /// container name
        container: String,
        /// the resource name
        resource: String,
        /// the value as written
        value: String,
        /// the most a container may write (a whole GPU on each of the most GPUs a pod may have)
        max: u32,
    },
    /// A container asks for compute but no GPU memory: compute is a share of the GPUs its
    /// memory is placed on.
    #[error(
        "pod {pod}: container {container} asks for {compute_resource} without {resource}; compute is a share of the GPU its memory is on, so ask for both"
    )]
    ComputeWithoutMemory {
        /// namespace/name
        pod: String,
        /// container name
        container: String,
        /// the memory resource
        resource: String,
        /// the compute resource
        compute_resource: String,
    },
    /// A container's compute cannot be split evenly over the pod's GPUs.
    #[error(
        "pod {pod}: container {container} asks for {compute} % of GPU compute spread over {gpus} GPUs; with {key} the compute of every container must be a multiple of {gpus}"
    )]
    UnevenCompute {
        /// namespace/name
        pod: String,
        /// container name
        container: String,
        /// its percent
        compute: u32,
        /// number of GPUs
        gpus: u32,
        /// the annotation key
        key: String,
    },
    /// The pod asks for more than a whole GPU's compute on each of its GPUs.
    #[error(
        "pod {pod} asks for {per_gpu} % of the compute of each of its GPUs ({resource}: {total} over {gpus} GPUs); at most {COMPUTE_PER_GPU} % of a GPU can be given"
    )]
    ComputeTooLarge {
        /// namespace/name
        pod: String,
        /// the compute resource
        resource: String,
        /// the pod's total
        total: u32,
        /// number of GPUs
        gpus: u32,
        /// the total per GPU
        per_gpu: u32,
    },
}

/// Reads `pod`'s request for `resource` with its layout over GPUs: the one parse of a pod's
/// request, which the webhook, the extender (its view, whose reading bind and filter use, and
/// preempt) and `kubectl gpushare` all call, so they never read a pod differently (the `<domain>/gpus` and
/// `<domain>/exclusive` annotations, see the module doc); `Ok(None)` when it asks for none.
pub fn pod_request_with(
    pod: &Pod,
    resource: &str,
    keys: &Keys,
) -> Result<Option<PodRequest>, RequestError> {
    let Some(mut request) = pod_request(pod, resource)? else {
        return Ok(None);
    };
    let annotations = pod.metadata.annotations.as_ref();
    let annotation = |key: &str| annotations.and_then(|a| a.get(key)).map(|v| v.trim());
    let bad = |key: &str, value: &str, expected: &str| RequestError::BadAnnotation {
        pod: pod_key(pod),
        key: key.to_owned(),
        value: value.to_owned(),
        expected: expected.to_owned(),
    };
    if let Some(value) = annotation(&keys.request_gpus) {
        request.gpus = value
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=MAX_GPUS_PER_POD).contains(n))
            .ok_or_else(|| {
                bad(
                    &keys.request_gpus,
                    value,
                    &format!("write a whole number of GPUs from 1 to {MAX_GPUS_PER_POD}"),
                )
            })?;
    }
    if let Some(value) = annotation(&keys.request_exclusive) {
        request.exclusive = match value {
            "true" => true,
            "false" => false,
            _ => {
                return Err(bad(
                    &keys.request_exclusive,
                    value,
                    "write \"true\" or \"false\"",
                ));
            }
        };
    }
    if let Some(value) = annotation(&keys.request_models) {
        request.models = value
            .split(',')
            .map(str::trim)
            .filter(|name| !name.is_empty())
            .map(str::to_owned)
            .collect();
        if request.models.is_empty() || request.models.iter().any(|m| m == "!") {
            return Err(bad(
                &keys.request_models,
                value,
                "write GPU model names separated by commas, e.g. \"NVIDIA-A10G\" or \"!Tesla-T4\"",
            ));
        }
    }
    if let Some(container) = request
        .containers
        .iter()
        .find(|c| c.gib % u64::from(request.gpus) != 0)
    {
        return Err(RequestError::Uneven {
            pod: pod_key(pod),
            container: container.name.clone(),
            gib: container.gib,
            gpus: request.gpus,
            key: keys.request_gpus.clone(),
        });
    }
    if let Some(container) = request
        .containers
        .iter()
        .find(|c| c.compute % request.gpus != 0)
    {
        return Err(RequestError::UnevenCompute {
            pod: pod_key(pod),
            container: container.name.clone(),
            compute: container.compute,
            gpus: request.gpus,
            key: keys.request_gpus.clone(),
        });
    }
    if request.compute_per_gpu() > COMPUTE_PER_GPU {
        return Err(RequestError::ComputeTooLarge {
            pod: pod_key(pod),
            resource: compute_resource_of(resource),
            total: request.pod_compute,
            gpus: request.gpus,
            per_gpu: request.compute_per_gpu(),
        });
    }
    Ok(Some(request))
}

/// Reads `pod`'s containers' requests for `resource`, laid out on one shared GPU; `Ok(None)`
/// when it asks for none. The layout annotations are [`pod_request_with`]'s, the one reader
/// every component calls.
fn pod_request(pod: &Pod, resource: &str) -> Result<Option<PodRequest>, RequestError> {
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(None);
    };
    let pod_key = pod_key(pod);
    let compute_resource = compute_resource_of(resource);
    let mut containers = Vec::new();
    // (memory, compute) summed over app containers and sidecars, and the largest plain init.
    let mut running = (0u64, 0u32);
    let mut largest_init = (0u64, 0u32);
    let init = spec.init_containers.iter().flatten().map(|c| (c, true));
    for (container, is_init) in init.chain(spec.containers.iter().map(|c| (c, false))) {
        let gib = container_gib(&pod_key, container, resource)?;
        let compute = container_compute(&pod_key, container, &compute_resource)?;
        let Some(gib) = gib else {
            if compute.is_some() {
                return Err(RequestError::ComputeWithoutMemory {
                    pod: pod_key,
                    container: container.name.clone(),
                    resource: resource.to_owned(),
                    compute_resource,
                });
            }
            continue;
        };
        let compute = compute.unwrap_or(0);
        if is_init && container.restart_policy.as_deref() != Some("Always") {
            largest_init = (largest_init.0.max(gib), largest_init.1.max(compute));
        } else {
            running = (running.0 + gib, running.1.saturating_add(compute));
        }
        containers.push(ContainerRequest {
            name: container.name.clone(),
            gib,
            init: is_init,
            compute,
        });
    }
    if containers.is_empty() {
        return Ok(None);
    }
    Ok(Some(PodRequest {
        containers,
        pod_gib: running.0.max(largest_init.0),
        gpus: 1,
        exclusive: false,
        models: Vec::new(),
        pod_compute: running.1.max(largest_init.1),
    }))
}

/// Whether a pod in `phase` has finished (`Succeeded` or `Failed`): its containers are gone
/// and the GPU memory it held is free again, whatever its allocation says.
pub fn phase_is_finished(phase: Option<&str>) -> bool {
    matches!(phase, Some("Succeeded" | "Failed"))
}

/// Whether `pod` has finished ([`phase_is_finished`]).
pub fn pod_is_finished(pod: &Pod) -> bool {
    phase_is_finished(pod.status.as_ref().and_then(|s| s.phase.as_deref()))
}

/// `namespace/name` of a pod, for messages.
pub fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or("<unnamed>")
    )
}

/// The container's limit for `resource`, else its request, as written.
fn container_quantity<'a>(container: &'a Container, resource: &str) -> Option<&'a str> {
    let resources = container.resources.as_ref()?;
    let quantity = resources
        .limits
        .as_ref()
        .and_then(|limits| limits.get(resource))
        .or_else(|| {
            resources
                .requests
                .as_ref()
                .and_then(|requests| requests.get(resource))
        })?;
    Some(quantity.0.trim())
}

fn container_gib(
    pod: &str,
    container: &Container,
    resource: &str,
) -> Result<Option<u64>, RequestError> {
    let Some(value) = container_quantity(container, resource) else {
        return Ok(None);
    };
    let gib = parse_whole_gib(value).ok_or_else(|| RequestError::NotWholeGib {
        pod: pod.to_owned(),
        container: container.name.clone(),
        resource: resource.to_owned(),
        value: value.to_owned(),
    })?;
    if gib > MAX_GIB {
        return Err(RequestError::TooLarge {
            pod: pod.to_owned(),
            container: container.name.clone(),
            resource: resource.to_owned(),
            value: value.to_owned(),
            max: MAX_GIB,
        });
    }
    Ok((gib > 0).then_some(gib))
}

/// The container's compute percent (over all the pod's GPUs), `None` for none or 0. At most
/// a whole GPU for each GPU a pod may have; the per-GPU limit is checked on the pod.
fn container_compute(
    pod: &str,
    container: &Container,
    resource: &str,
) -> Result<Option<u32>, RequestError> {
    let Some(value) = container_quantity(container, resource) else {
        return Ok(None);
    };
    let max = COMPUTE_PER_GPU * MAX_GPUS_PER_POD;
    let percent = parse_whole_gib(value)
        .and_then(|p| u32::try_from(p).ok())
        .filter(|&p| p <= max)
        .ok_or_else(|| RequestError::NotWholePercent {
            pod: pod.to_owned(),
            container: container.name.clone(),
            resource: resource.to_owned(),
            value: value.to_owned(),
            max,
        })?;
    Ok((percent > 0).then_some(percent))
}

/// A plain decimal integer, as the API server canonicalises whole quantities. Digits only:
/// signs, fractions, exponents and suffixes are refused.
fn parse_whole_gib(value: &str) -> Option<u64> {
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // Only digits: the parse fails only on overflow, which is absurdly large.
    Some(value.parse().unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests;
