//! Device allocation for one pod, as kubelet's device manager does it: per container, init
//! containers first, pick devices (reusing what init containers held, asking the plugin's
//! GetPreferredAllocation when it offers one), call Allocate, and record the environment,
//! mounts and devices it answered.
//!
//! Separate from the admission loop because this is where kubelet's accounting lives: what
//! is free, what an init container hands on, what PodResources later reports.

use std::collections::{BTreeMap, HashMap, HashSet};

use gpushare_proto::v1beta1::device_plugin_client::DevicePluginClient;
use gpushare_proto::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest,
    PreferredAllocationRequest,
};
use k8s_openapi::api::core::v1::{Container, Pod};

use super::{GrantedMount, Shared};

/// Allocates every container's devices, init containers first. On error nothing stays
/// held (the devices were never recorded as the pod's).
pub(super) async fn allocate_pod(
    shared: &Shared,
    pod: &Pod,
    ns: &str,
    name: &str,
) -> Result<HashMap<String, Vec<String>>, String> {
    let Some(spec) = &pod.spec else {
        return Ok(HashMap::new());
    };
    let mut held: HashMap<String, Vec<String>> = HashMap::new();
    let mut reusable: HashMap<String, Vec<String>> = HashMap::new();
    let containers = spec
        .init_containers
        .iter()
        .flatten()
        .map(|c| (c, true, c.restart_policy.as_deref() == Some("Always")))
        .chain(spec.containers.iter().map(|c| (c, false, false)));
    for (container, init, sidecar) in containers {
        let mut env = BTreeMap::new();
        let mut mounts = Vec::new();
        let mut any = false;
        for (resource, quantity) in container_resources(container) {
            if !is_extended(&resource) {
                continue;
            }
            let count: usize = quantity.trim().parse().map_err(|_| {
                format!(
                    "container {} asks for {quantity:?} of {resource}, not a whole number",
                    container.name
                )
            })?;
            if count == 0 {
                continue;
            }
            any = true;
            let ids = devices_for(
                shared,
                &resource,
                count,
                &held,
                reusable.entry(resource.clone()).or_default(),
            )
            .await?;
            let (response, granted_mounts) = allocate(shared, &resource, &ids).await?;
            mounts.extend(granted_mounts);
            // As kubelet's device manager: the container's devices are recorded (and
            // reported by PodResources) once its Allocate succeeded.
            let uid = pod.metadata.uid.clone().unwrap_or_default();
            shared
                .lock()
                .container_devices
                .entry(uid)
                .or_default()
                .entry(container.name.clone())
                .or_default()
                .insert(resource.clone(), ids.clone());
            env.extend(response);
            add_new(
                held.entry(resource.clone()).or_default(),
                ids.iter().cloned(),
            );
            let reuse = reusable.entry(resource).or_default();
            if init && !sidecar {
                add_new(reuse, ids);
            } else {
                reuse.retain(|id| !ids.contains(id));
            }
        }
        if any {
            let key = (ns.to_owned(), name.to_owned(), container.name.clone());
            shared.lock().granted.insert(key, (env, mounts));
        }
    }
    Ok(held)
}

/// Picks `count` devices of `resource`: reusable init-container devices first, then
/// free healthy ones as the plugin prefers.
async fn devices_for(
    shared: &Shared,
    resource: &str,
    count: usize,
    held: &HashMap<String, Vec<String>>,
    reusable: &mut Vec<String>,
) -> Result<Vec<String>, String> {
    let take = count.min(reusable.len());
    let reused: Vec<String> = reusable.drain(..take).collect();
    let (free, channel, preferred_available) = {
        let state = shared.lock();
        let Some(plugin) = state.plugins.get(resource) else {
            return Err(format!("no device plugin registered for {resource}"));
        };
        let used: HashSet<&String> = state
            .admitted
            .values()
            .flat_map(|(_, devices)| devices.get(resource).into_iter().flatten())
            .chain(held.get(resource).into_iter().flatten())
            .collect();
        let free: Vec<String> = plugin
            .devices
            .iter()
            .filter(|(id, healthy)| *healthy && !used.contains(id) && !reused.contains(id))
            .map(|(id, _)| id.clone())
            .collect();
        let preferred = plugin
            .options
            .as_ref()
            .is_some_and(|o| o.get_preferred_allocation_available);
        (free, plugin.channel.clone(), preferred)
    };
    let needed = count - reused.len();
    if needed == 0 {
        return Ok(reused);
    }
    if free.len() < needed {
        return Err(format!(
            "Allocate failed due to requested number of devices unavailable for {resource}. Requested: {needed}, Available: {}, which is unexpected",
            free.len()
        ));
    }
    let fallback = || {
        let mut ids = reused.clone();
        ids.extend(free.iter().take(needed).cloned());
        ids
    };
    let (Some(channel), true) = (channel, preferred_available) else {
        return Ok(fallback());
    };
    let mut available = reused.clone();
    available.extend(free.iter().cloned());
    let request = PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: available.clone(),
            must_include_device_i_ds: reused.clone(),
            allocation_size: i32::try_from(count).unwrap_or(i32::MAX),
        }],
    };
    match DevicePluginClient::new(channel)
        .get_preferred_allocation(request)
        .await
    {
        Ok(response) => {
            let ids: Vec<String> = response
                .into_inner()
                .container_responses
                .into_iter()
                .next()
                .map(|c| c.device_i_ds)
                .unwrap_or_default();
            let mut unique: Vec<String> = Vec::new();
            add_new(
                &mut unique,
                ids.into_iter().filter(|id| available.contains(id)),
            );
            let complete = unique.len() == count && reused.iter().all(|id| unique.contains(id));
            Ok(if complete { unique } else { fallback() })
        }
        Err(status) => {
            tracing::warn!(%resource, error = %status, "GetPreferredAllocation failed; picking devices myself");
            Ok(fallback())
        }
    }
}

/// One Allocate for one container: the environment and the mounts it answered.
async fn allocate(
    shared: &Shared,
    resource: &str,
    ids: &[String],
) -> Result<(BTreeMap<String, String>, Vec<GrantedMount>), String> {
    let channel = shared
        .lock()
        .plugins
        .get(resource)
        .and_then(|plugin| plugin.channel.clone())
        .ok_or_else(|| format!("no device plugin registered for {resource}"))?;
    let request = AllocateRequest {
        container_requests: vec![ContainerAllocateRequest {
            devices_ids: ids.to_vec(),
        }],
    };
    let response = DevicePluginClient::new(channel)
        .allocate(request)
        .await
        .map_err(|status| {
            format!(
                "Allocate failed due to rpc error: code = {:?} desc = {}, which is unexpected",
                status.code(),
                status.message()
            )
        })?;
    Ok(response
        .into_inner()
        .container_responses
        .into_iter()
        .next()
        .map(|c| {
            let mounts = c
                .mounts
                .into_iter()
                .map(|m| (m.container_path, m.host_path, m.read_only))
                .collect();
            (c.envs.into_iter().collect(), mounts)
        })
        .unwrap_or_default())
}

/// Appends the `ids` that `list` does not hold yet.
fn add_new(list: &mut Vec<String>, ids: impl IntoIterator<Item = String>) {
    for id in ids {
        if !list.contains(&id) {
            list.push(id);
        }
    }
}

/// Resource names a container asks for (limits win over requests), with whole quantities.
pub(super) fn container_resources(container: &Container) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    if let Some(resources) = &container.resources {
        for map in [&resources.requests, &resources.limits]
            .into_iter()
            .flatten()
        {
            for (name, quantity) in map {
                out.insert(name.clone(), quantity.0.clone());
            }
        }
    }
    out
}

/// Names kubelet hands to device plugins: vendor-domain extended resources.
pub(super) fn is_extended(name: &str) -> bool {
    name.contains('/') && !name.starts_with("kubernetes.io/") && !name.starts_with("requests.")
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ResourceRequirements;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    #[test]
    fn limits_win_and_only_extended_resources_go_to_plugins() {
        let container = Container {
            name: "c".into(),
            resources: Some(ResourceRequirements {
                requests: Some(BTreeMap::from([
                    ("cpu".to_owned(), Quantity("1".into())),
                    ("example.com/gpu-mem".to_owned(), Quantity("2".into())),
                ])),
                limits: Some(BTreeMap::from([(
                    "example.com/gpu-mem".to_owned(),
                    Quantity("4".into()),
                )])),
                ..Default::default()
            }),
            ..Default::default()
        };
        let resources = container_resources(&container);
        assert_eq!(resources["example.com/gpu-mem"], "4");
        assert!(is_extended("example.com/gpu-mem"));
        assert!(!is_extended("cpu"));
        assert!(!is_extended("kubernetes.io/batch"));
    }
}
