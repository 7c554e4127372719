//! The CPU and memory a pod requests and a node offers, counted the way kube-scheduler
//! counts them.
//!
//! Why here: this is arithmetic over the pod spec and node status, like the GPU-memory
//! request in [`crate::request`], and it must match kubelet's and kube-scheduler's reading
//! of init containers and sidecars exactly, or the fragmentation policy weighs a node's CPU
//! and memory differently from the scheduler that places the pod. Nothing here knows of the
//! allocator; the extender turns [`HostResources`] into the allocator's form.

use k8s_openapi::api::core::v1::{Container, Node, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// CPU in millicores and memory in MiB.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostResources {
    /// CPU in millicores.
    pub milli_cpu: u64,
    /// Memory in MiB.
    pub memory_mib: u64,
}

impl HostResources {
    /// `self + other`, each capped.
    fn saturating_add(self, other: Self) -> Self {
        Self {
            milli_cpu: self.milli_cpu.saturating_add(other.milli_cpu),
            memory_mib: self.memory_mib.saturating_add(other.memory_mib),
        }
    }

    /// The larger of each.
    fn max(self, other: Self) -> Self {
        Self {
            milli_cpu: self.milli_cpu.max(other.milli_cpu),
            memory_mib: self.memory_mib.max(other.memory_mib),
        }
    }
}

/// The CPU and memory a pod requests, as kube-scheduler counts them: its containers and
/// sidecars (restartable init containers) together, or its largest init container (with the
/// sidecars started before it) if that is more. Unreadable quantities count as zero.
pub fn pod_requests(pod: &Pod) -> HostResources {
    let Some(spec) = pod.spec.as_ref() else {
        return HostResources::default();
    };
    let (mut sidecars, mut init) = (HostResources::default(), HostResources::default());
    for c in spec.init_containers.iter().flatten() {
        if c.restart_policy.as_deref() == Some("Always") {
            sidecars = sidecars.saturating_add(container_requests(c));
        } else {
            init = init.max(sidecars.saturating_add(container_requests(c)));
        }
    }
    let running = spec
        .containers
        .iter()
        .fold(sidecars, |sum, c| sum.saturating_add(container_requests(c)));
    running.max(init)
}

/// One container's CPU and memory requests; unreadable quantities count as zero.
fn container_requests(c: &Container) -> HostResources {
    let get = |name: &str| c.resources.as_ref()?.requests.as_ref()?.get(name);
    HostResources {
        milli_cpu: get("cpu").and_then(millicores).unwrap_or(0),
        memory_mib: get("memory").and_then(mebibytes).unwrap_or(0),
    }
}

/// A node's allocatable CPU and memory; `None` when it publishes neither. A node that
/// publishes only one of them has the other read as `u64::MAX` (never the constraint).
pub fn node_allocatable(node: &Node) -> Option<HostResources> {
    let allocatable = node.status.as_ref()?.allocatable.as_ref()?;
    let cpu = allocatable.get("cpu").and_then(millicores);
    let memory = allocatable.get("memory").and_then(mebibytes);
    if cpu.is_none() && memory.is_none() {
        return None;
    }
    Some(HostResources {
        milli_cpu: cpu.unwrap_or(u64::MAX),
        memory_mib: memory.unwrap_or(u64::MAX),
    })
}

/// CPU in millicores (capped at `u64::MAX`), or `None` when unreadable.
pub fn millicores(quantity: &Quantity) -> Option<u64> {
    crate::quantity::milli(&quantity.0)
        .ok()
        .map(|milli| u64::try_from(milli).unwrap_or(u64::MAX))
}

/// Memory in MiB, rounded up (capped at `u64::MAX`), or `None` when unreadable.
pub fn mebibytes(quantity: &Quantity) -> Option<u64> {
    crate::quantity::mib(&quantity.0)
        .ok()
        .map(|mib| u64::try_from(mib).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_requests_count_sidecars_and_the_largest_init_container() {
        let spec = serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {
                "initContainers": [
                    {"name": "setup", "resources": {"requests": {"cpu": "4", "memory": "1Gi"}}},
                    {"name": "proxy", "restartPolicy": "Always", "resources": {"requests": {"cpu": "250m", "memory": "128Mi"}}}
                ],
                "containers": [
                    {"name": "a", "resources": {"requests": {"cpu": "1", "memory": "2G"}}},
                    {"name": "b", "resources": {"requests": {"cpu": "500m", "memory": "1.5e9"}}}
                ]
            }
        });
        let pod: Pod = serde_json::from_value(spec).unwrap();
        // Running: 1 + 0.5 + 0.25 cores; the 4-core init container is larger.
        let host = pod_requests(&pod);
        assert_eq!(host.milli_cpu, 4_000);
        // Memory: 2e9 + 1.5e9 bytes + 128 MiB, more than the init container's 1 GiB.
        assert_eq!(host.memory_mib, 1908 + 1431 + 128);
        assert_eq!(millicores(&Quantity("bogus".into())), None);
    }
}
