//! `top` in DRA mode: the same rows as in extender mode, read from ResourceSlices and
//! ResourceClaims instead of node and pod annotations.
//!
//! In DRA mode nothing of gpushare records placements: kube-scheduler allocates shares of
//! each GPU's consumable `memory` capacity to claims and writes them in the claim's status.
//! So the picture is built from what the cluster itself holds:
//!
//! ```text
//!  ResourceSlice (driver = ours), per device   ─▶ GPU row: index, model, uuid (attributes),
//!                                                  total = capacity.memory,
//!                                                  unhealthy = a NoSchedule/NoExecute taint
//!  ResourceClaim status.allocation, per result ─▶ GPU allocated += consumedCapacity.memory,
//!      (our driver)                                compute += consumedCapacity.compute
//!                         reservedFor pods     ─▶ pod row on that GPU, GiB = consumed
//! ```
//!
//! A claim's share counts on its GPU once, however many pods share the claim; each pod that
//! runs with it gets a row. There is no PENDING in DRA mode: kube-scheduler allocates before
//! it binds, so a bound pod without an allocation cannot happen. [`node_usage`] and
//! [`merge`] are pure; [`read`] does the I/O; [`add_rows`] is the hook `top` calls.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{Device, ResourceClaim, ResourceClaimStatus, ResourceSlice};
use kube::api::{Api, ListParams};

use crate::cluster::Cluster;
use crate::usage::{GpuSource, GpuUsage, NodeUsage, PodUsage, is_active};

use gpushare_contract::dra::{COMPUTE, MEMORY};
const GIB: u128 = 1 << 30;

/// What DRA mode holds: the slices and the claims.
#[derive(Debug, Clone, Default)]
pub struct DraObjects {
    /// Every ResourceSlice.
    pub slices: Vec<ResourceSlice>,
    /// Every ResourceClaim.
    pub claims: Vec<ResourceClaim>,
}

/// Reads slices and claims. `Ok(None)` when the cluster does not serve `resource.k8s.io/v1`
/// (DRA is GA since Kubernetes 1.34); any other refusal is an error for the caller to show.
pub async fn read(cluster: &Cluster) -> Result<Option<DraObjects>, kube::Error> {
    let client = cluster.client().clone();
    let (slices, claims, params) = (
        Api::<ResourceSlice>::all(client.clone()),
        Api::<ResourceClaim>::all(client),
        ListParams::default(),
    );
    let listed = tokio::try_join!(slices.list(&params), claims.list(&params));
    match listed {
        Ok((slices, claims)) => Ok(Some(DraObjects {
            slices: slices.items,
            claims: claims.items,
        })),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(None),
        Err(error) => Err(error),
    }
}

/// Bytes of a quantity (`4Gi`, `4294967296`, `1.5Gi`, `16G`), as the DRA plugin reads
/// capacities ([`gpushare_contract::quantity::bytes`]); `None` when unreadable.
pub fn quantity_bytes(text: &str) -> Option<u128> {
    gpushare_contract::quantity::bytes(text).ok()
}

fn whole_gib(bytes: u128, round_up: bool) -> u64 {
    let gib = if round_up {
        bytes.div_ceil(GIB)
    } else {
        bytes / GIB
    };
    u64::try_from(gib).unwrap_or(u64::MAX)
}

fn attribute_string(device: &Device, name: &str) -> String {
    device
        .attributes
        .as_ref()
        .and_then(|a| a.get(name))
        .and_then(|a| a.string.clone())
        .unwrap_or_default()
}

/// The GPU index of a device: its `index` attribute, else the number in `gpu-<N>`.
fn device_index(device: &Device) -> Option<u32> {
    device
        .attributes
        .as_ref()
        .and_then(|a| a.get("index"))
        .and_then(|a| a.int)
        .and_then(|i| u32::try_from(i).ok())
        .or_else(|| device.name.strip_prefix("gpu-")?.parse().ok())
}

/// Whether the device carries a taint that keeps new claims away.
fn tainted(device: &Device) -> bool {
    device
        .taints
        .iter()
        .flatten()
        .any(|t| matches!(t.effect.as_str(), "NoSchedule" | "NoExecute"))
}

fn internal_ip(node: Option<&Node>) -> String {
    let addresses = node
        .and_then(|n| n.status.as_ref())
        .and_then(|s| s.addresses.as_deref())
        .unwrap_or_default();
    addresses
        .iter()
        .find(|a| a.type_ == "InternalIP")
        .or_else(|| addresses.first())
        .map(|a| a.address.clone())
        .unwrap_or_default()
}

/// Where each device of our driver is: (pool, device) → (node, GPU index).
type DeviceIndex = BTreeMap<(String, String), (String, u32)>;

/// The live pods by (namespace, name).
type LivePods<'a> = BTreeMap<(String, String), &'a Pod>;

/// The rows of every node with a slice of `driver`, sorted by name.
pub fn node_usage(
    objects: &DraObjects,
    nodes: &[Node],
    pods: &[Pod],
    driver: &str,
) -> Vec<NodeUsage> {
    let (mut by_node, devices) = slice_rows(objects, nodes, driver);
    let live = live_pods(pods);
    for claim in &objects.claims {
        add_claim(&mut by_node, &devices, &live, claim, driver);
    }
    let mut out: Vec<NodeUsage> = by_node.into_values().collect();
    for node in &mut out {
        node.gpus.sort_by_key(|g| g.index);
        node.pods
            .sort_by(|a, b| (&a.namespace, &a.name, a.gpu).cmp(&(&b.namespace, &b.name, b.gpu)));
    }
    out
}

/// A row for every node with a slice of `driver`, holding the GPUs its slices publish with
/// nothing allocated yet, and where each of those devices is.
fn slice_rows(
    objects: &DraObjects,
    nodes: &[Node],
    driver: &str,
) -> (BTreeMap<String, NodeUsage>, DeviceIndex) {
    let mut by_node: BTreeMap<String, NodeUsage> = BTreeMap::new();
    let mut devices = DeviceIndex::new();
    for slice in objects.slices.iter().filter(|s| s.spec.driver == driver) {
        let Some(node) = slice.spec.node_name.clone() else {
            continue;
        };
        let usage = by_node.entry(node.clone()).or_insert_with(|| NodeUsage {
            name: node.clone(),
            ip: internal_ip(
                nodes
                    .iter()
                    .find(|n| n.metadata.name.as_deref() == Some(&node)),
            ),
            gpus: Vec::new(),
            pods: Vec::new(),
            source: GpuSource::ResourceSlice,
            measured: false,
            counted: false,
        });
        for device in slice.spec.devices.iter().flatten() {
            let Some(gpu) = device_gpu(device) else {
                continue;
            };
            devices.insert(
                (slice.spec.pool.name.clone(), device.name.clone()),
                (node.clone(), gpu.index),
            );
            usage.gpus.push(gpu);
        }
    }
    (by_node, devices)
}

/// The GPU row of a published device, nothing allocated yet; `None` when the device names
/// no GPU index.
fn device_gpu(device: &Device) -> Option<GpuUsage> {
    let index = device_index(device)?;
    let total = device
        .capacity
        .as_ref()
        .and_then(|c| c.get(MEMORY))
        .and_then(|c| quantity_bytes(&c.value.0))
        .unwrap_or(0);
    Some(GpuUsage {
        index,
        model: attribute_string(device, "model"),
        uuid: attribute_string(device, "uuid"),
        total_gib: whole_gib(total, false),
        allocated_gib: 0,
        allocated_compute: 0,
        healthy: !tainted(device),
        used_mib: None,
    })
}

/// The pods that have not finished, by (namespace, name).
fn live_pods(pods: &[Pod]) -> LivePods<'_> {
    pods.iter()
        .filter(|p| is_active(p))
        .map(|p| {
            (
                (
                    p.metadata.namespace.clone().unwrap_or_default(),
                    p.metadata.name.clone().unwrap_or_default(),
                ),
                p,
            )
        })
        .collect()
}

/// Books each allocation result of `driver` in `claim`'s status on its GPU (once, however
/// many pods share the claim) and adds a row for each live pod the claim is reserved for.
fn add_claim(
    by_node: &mut BTreeMap<String, NodeUsage>,
    devices: &DeviceIndex,
    live: &LivePods<'_>,
    claim: &ResourceClaim,
    driver: &str,
) {
    let Some(status) = &claim.status else {
        return;
    };
    let results = status
        .allocation
        .as_ref()
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref());
    let namespace = claim.metadata.namespace.clone().unwrap_or_default();
    for result in results.into_iter().flatten().filter(|r| r.driver == driver) {
        let Some((node, index)) = devices.get(&(result.pool.clone(), result.device.clone())) else {
            continue;
        };
        let Some(usage) = by_node.get_mut(node) else {
            continue;
        };
        let consumed = result
            .consumed_capacity
            .as_ref()
            .and_then(|c| c.get(MEMORY))
            .and_then(|q| quantity_bytes(&q.0));
        let gpu = usage.gpus.iter_mut().find(|g| g.index == *index);
        // A device allocated whole (no consumed capacity) holds all of it.
        let gib = match (consumed, &gpu) {
            (Some(bytes), _) => whole_gib(bytes, true),
            (None, Some(gpu)) => gpu.total_gib,
            (None, None) => 0,
        };
        let compute = result
            .consumed_capacity
            .as_ref()
            .and_then(|c| c.get(COMPUTE))
            .and_then(|q| gpushare_contract::quantity::milli(&q.0).ok())
            .map_or(0, |milli| u32::try_from(milli / 1000).unwrap_or(u32::MAX));
        if let Some(gpu) = gpu {
            gpu.allocated_gib = gpu.allocated_gib.saturating_add(gib);
            gpu.allocated_compute = gpu.allocated_compute.saturating_add(compute);
        }
        push_reserved_pods(
            &mut usage.pods,
            (status, &namespace),
            live,
            *index,
            (gib, compute),
        );
    }
}

/// Adds a row on GPU `index` holding `gib` (and `compute` percent) for each pod `status` is reserved for that is
/// live, the very pod (same UID) and not one recreated under its name.
fn push_reserved_pods(
    rows: &mut Vec<PodUsage>,
    (status, namespace): (&ResourceClaimStatus, &str),
    live: &LivePods<'_>,
    index: u32,
    (gib, compute): (u64, u32),
) {
    for consumer in status.reserved_for.iter().flatten() {
        if consumer.resource != "pods" {
            continue;
        }
        let Some(pod) = live.get(&(namespace.to_owned(), consumer.name.clone())) else {
            continue;
        };
        if pod.metadata.uid.as_deref() != Some(consumer.uid.as_str()) {
            continue;
        }
        rows.push(PodUsage {
            namespace: namespace.to_owned(),
            name: consumer.name.clone(),
            gpu: Some(index),
            gib,
            scheduler: pod
                .spec
                .as_ref()
                .and_then(|s| s.scheduler_name.clone())
                .unwrap_or_else(|| "default-scheduler".to_owned()),
            used_mib: None,
            counted_mib: None,
            compute,
            compute_used: None,
        });
    }
}

/// Adds the DRA rows to `usage` (the extender-mode rows): a node that has GPUs in a slice
/// of `driver` is shown from its slice, unless the device plugin published GPUs for it too
/// (then its extender-mode row stays: one node serves one mode).
pub fn merge(
    usage: &mut Vec<NodeUsage>,
    objects: &DraObjects,
    nodes: &[Node],
    pods: &[Pod],
    driver: &str,
) {
    for row in node_usage(objects, nodes, pods, driver) {
        match usage.iter_mut().find(|n| n.name == row.name) {
            Some(existing) if existing.gpus.is_empty() => *existing = row,
            Some(_) => {}
            None => usage.push(row),
        }
    }
    usage.sort_by(|a, b| a.name.cmp(&b.name));
}

/// The hook `top` calls: adds the DRA rows of `driver` (the DRA plugin's driver name is
/// the domain, as the chart sets it) to `usage`. A cluster that does not let us list them
/// gets a note on stderr and the extender-mode rows alone.
pub async fn add_rows(
    cluster: &Cluster,
    usage: &mut Vec<NodeUsage>,
    nodes: &[Node],
    pods: &[Pod],
    driver: &str,
) {
    match read(cluster).await {
        Ok(Some(objects)) => merge(usage, &objects, nodes, pods, driver),
        Ok(None) => {}
        Err(error) => eprintln!(
            "note: DRA allocations are not shown: listing resourceslices and resourceclaims failed: {error}"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::serde_json::{self, json};

    const DRIVER: &str = "gpushare.example.com";

    fn slice() -> ResourceSlice {
        serde_json::from_value(json!({
            "metadata": {"name": "n1-gpushare"},
            "spec": {
                "driver": DRIVER,
                "nodeName": "n1",
                "pool": {"name": "n1", "generation": 1, "resourceSliceCount": 1},
                "devices": [
                    {"name": "gpu-0", "attributes": {"index": {"int": 0}, "uuid": {"string": "GPU-a"}, "model": {"string": "T4"}},
                     "capacity": {"memory": {"value": "15Gi"}}, "allowMultipleAllocations": true},
                    {"name": "gpu-1", "attributes": {"index": {"int": 1}, "uuid": {"string": "GPU-b"}, "model": {"string": "T4"}},
                     "capacity": {"memory": {"value": "16Gi"}}, "allowMultipleAllocations": true,
                     "taints": [{"key": "gpushare.example.com/unhealthy", "effect": "NoSchedule"}]}
                ]
            }
        }))
        .unwrap()
    }

    fn claim(name: &str, device: &str, memory: &str, pods: &[(&str, &str)]) -> ResourceClaim {
        let reserved: Vec<_> = pods
            .iter()
            .map(|(pod, uid)| json!({"resource": "pods", "name": pod, "uid": uid}))
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default"},
            "spec": {},
            "status": {
                "allocation": {"devices": {"results": [{
                    "request": "gpu", "driver": DRIVER, "pool": "n1", "device": device,
                    "consumedCapacity": {"memory": memory}
                }]}},
                "reservedFor": reserved
            }
        }))
        .unwrap()
    }

    fn pod(name: &str, uid: &str, phase: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default", "uid": uid},
            "spec": {"nodeName": "n1", "containers": [{"name": "main"}]},
            "status": {"phase": phase}
        }))
        .unwrap()
    }

    #[test]
    fn claims_and_slices_become_top_rows() {
        let objects = DraObjects {
            slices: vec![slice()],
            claims: vec![
                claim("a", "gpu-0", "4Gi", &[("nb-1", "u1")]),
                // Shared by two pods: counted once on the GPU, a row per pod.
                claim("b", "gpu-0", "3Gi", &[("nb-2", "u2"), ("nb-3", "u3")]),
                // Allocated, its pod finished: the GPU still holds it, the pod is no row.
                claim("c", "gpu-1", "2Gi", &[("done", "u4")]),
            ],
        };
        let mut objects = objects;
        // A compute share: the COMPUTE column of `top -d` reads it.
        let mut with_compute = serde_json::to_value(&objects.claims[0]).unwrap();
        with_compute["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"]["compute"] =
            json!("30");
        objects.claims[0] = serde_json::from_value(with_compute).unwrap();
        let pods = [
            pod("nb-1", "u1", "Running"),
            pod("nb-2", "u2", "Running"),
            pod("nb-3", "u3", "Pending"),
            pod("done", "u4", "Succeeded"),
        ];
        let rows = node_usage(&objects, &[], &pods, DRIVER);
        assert_eq!(rows.len(), 1);
        let n1 = &rows[0];
        assert_eq!(n1.source, GpuSource::ResourceSlice);
        let gpus: Vec<_> = n1
            .gpus
            .iter()
            .map(|g| {
                (
                    g.index,
                    g.uuid.as_str(),
                    g.allocated_gib,
                    g.total_gib,
                    g.healthy,
                    g.allocated_compute,
                )
            })
            .collect();
        assert_eq!(
            gpus,
            [(0, "GPU-a", 7, 15, true, 30), (1, "GPU-b", 2, 16, false, 0)]
        );
        let pods: Vec<_> = n1
            .pods
            .iter()
            .map(|p| (p.name.as_str(), p.gpu, p.gib))
            .collect();
        assert_eq!(
            pods,
            [
                ("nb-1", Some(0), 4),
                ("nb-2", Some(0), 3),
                ("nb-3", Some(0), 3)
            ]
        );
        assert_eq!(
            (n1.allocated_gib(), n1.total_gib(), n1.pending_gib()),
            (9, 31, 0)
        );
        // Another driver's slices are not ours.
        assert!(node_usage(&objects, &[], &[], "other.example.com").is_empty());
    }

    #[test]
    fn a_slice_replaces_an_empty_extender_row_only() {
        let objects = DraObjects {
            slices: vec![slice()],
            claims: Vec::new(),
        };
        let empty = NodeUsage {
            name: "n1".into(),
            ip: String::new(),
            gpus: Vec::new(),
            pods: Vec::new(),
            source: GpuSource::None,
            measured: false,
            counted: false,
        };
        let mut usage = vec![empty.clone()];
        merge(&mut usage, &objects, &[], &[], DRIVER);
        assert_eq!(usage[0].gpus.len(), 2);
        let mut with_gpus = empty;
        with_gpus.gpus = node_usage(&objects, &[], &[], DRIVER)[0].gpus[..1].to_vec();
        with_gpus.source = GpuSource::Inventory;
        let mut usage = vec![with_gpus.clone()];
        merge(&mut usage, &objects, &[], &[], DRIVER);
        assert_eq!(usage, [with_gpus]);
    }

    #[test]
    fn quantities() {
        assert_eq!(quantity_bytes("4Gi"), Some(4 << 30));
        assert_eq!(quantity_bytes("4294967296"), Some(4 << 30));
        assert_eq!(quantity_bytes("1.5Gi"), Some(3 << 29));
        assert_eq!(quantity_bytes("16G"), Some(16_000_000_000));
        for bad in ["", "Gi", "4Xi", "-1Gi", "."] {
            assert_eq!(quantity_bytes(bad), None, "{bad}");
        }
    }
}
