//! Fake nodes for load on the real cluster: Node objects in bulk with no kubelet behind them,
//! GPUs published as the device plugin publishes them and, in DRA mode, a ResourceSlice each.
//! Why: a thousand-node cluster for the real schedulers while the kit runs one real kubelet;
//! [`super::load::NodeStandIn`] plays the kubelets they lack.

use std::future::Future;

use anyhow::Context;
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaimTemplate, ResourceSlice};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

use crate::fixtures;

/// The label every fake node carries (`fake=true`), so they can be deleted in one call.
pub const FAKE_LABEL: &str = "fake";
/// How many API calls the harness keeps in flight when it creates objects in bulk.
pub(super) const BULK_CALLS: usize = 16;

/// Runs `call` for each of `0..count`, [`BULK_CALLS`] at a time; the first error ends it.
pub(super) async fn in_bulk<F, Fut>(count: usize, call: F) -> anyhow::Result<()>
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    stream::iter(0..count)
        .map(call)
        .buffer_unordered(BULK_CALLS)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Node objects `<prefix>-0` .. `<prefix>-<count - 1>`, opted in, with the GPUs of `gpus` (GiB
/// each) published as the device plugin publishes them and `extra` extended resources beside.
/// Pods bound there never run.
pub async fn create_fake_gpu_nodes(
    client: &Client,
    prefix: &str,
    count: usize,
    gpus: &[u64],
    extra: &[(&str, u64)],
) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    in_bulk(count, |i| {
        let nodes = nodes.clone();
        async move {
            let name = format!("{prefix}-{i}");
            let mut node = fixtures::node(&name)
                .gpushare()
                .gpus(gpus)
                .cpu("64")
                .memory("512Gi")
                .label(FAKE_LABEL, "true")
                .build();
            let status = node.status.get_or_insert_default();
            for resources in [&mut status.capacity, &mut status.allocatable] {
                let resources = resources.get_or_insert_default();
                resources.insert("pods".to_owned(), Quantity("500".to_owned()));
                for (resource, amount) in extra {
                    resources.insert((*resource).to_owned(), Quantity(amount.to_string()));
                }
            }
            let created = nodes
                .create(&PostParams::default(), &node)
                .await
                .with_context(|| format!("creating node {name}"))?;
            // The API server drops a new node's status: write it.
            let params = PatchParams::default();
            let status = Patch::Merge(json!({ "status": node.status }));
            let written = nodes.patch_status(&name, &params, &status).await;
            written.with_context(|| format!("writing the status of node {name}"))?;
            // Admission taints a new node not-ready until its kubelet says otherwise;
            // none will.
            let taints = created.spec.and_then(|s| s.taints).unwrap_or_default();
            if !taints.is_empty() {
                let kept: Vec<_> = taints
                    .into_iter()
                    .filter(|t| t.key != "node.kubernetes.io/not-ready")
                    .collect();
                let taints = Patch::Merge(json!({ "spec": { "taints": kept } }));
                let untainted = nodes.patch(&name, &params, &taints).await;
                untainted.with_context(|| format!("untainting node {name}"))?;
            }
            anyhow::Ok(())
        }
    })
    .await
}

/// Deletes every fake node (not waiting for them to go).
pub async fn delete_fake_nodes(client: &Client) -> anyhow::Result<()> {
    Api::<Node>::all(client.clone())
        .delete_collection(&DeleteParams::default(), &fake())
        .await?;
    Ok(())
}

/// Selects what carries [`FAKE_LABEL`].
fn fake() -> ListParams {
    ListParams::default().labels(&format!("{FAKE_LABEL}=true"))
}

/// A ResourceSlice for each fake node `<prefix>-0` .., as the DRA plugin publishes one for its
/// node (`gpushare_dra_plugin::slice::build`): one device per GPU of `gpus` (GiB each), with
/// consumable `memory`.
pub async fn publish_fake_slices(
    client: &Client,
    prefix: &str,
    count: usize,
    gpus: &[u64],
    driver: &str,
) -> anyhow::Result<()> {
    use gpushare_contract::inventory::GpuInfo;
    use gpushare_dra_plugin::slice::{self, Unhealthy};
    create_slices(client, prefix, count, |node| {
        let infos: Vec<GpuInfo> = gpus
            .iter()
            .zip(0u32..)
            .map(|(gib, index)| GpuInfo {
                index,
                uuid: format!("GPU-{node}-{index}"),
                model: "Fake".to_owned(),
                mem_gib: *gib,
                healthy: true,
                numa_node: None,
            })
            .collect();
        Ok(slice::build(node, driver, &infos, 1, Unhealthy::Taint))
    })
    .await
}

/// Creates the slice `build` makes for each fake node `<prefix>-0` .., labelled as the fake
/// nodes are, [`BULK_CALLS`] at a time.
async fn create_slices(
    client: &Client,
    prefix: &str,
    count: usize,
    build: impl Fn(&str) -> anyhow::Result<ResourceSlice>,
) -> anyhow::Result<()> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let build = &build;
    in_bulk(count, |i| {
        let slices = slices.clone();
        async move {
            let node = format!("{prefix}-{i}");
            let mut built = build(&node)?;
            built
                .labels_mut()
                .insert(FAKE_LABEL.to_owned(), "true".to_owned());
            slices
                .create(&PostParams::default(), &built)
                .await
                .with_context(|| format!("creating the ResourceSlice of {node}"))?;
            anyhow::Ok(())
        }
    })
    .await
}

/// The driver of the plain DRA baseline ([`publish_plain_slices`]): whole devices, no
/// capacity, as a vendor's GPU driver publishes them.
pub const PLAIN_DRIVER: &str = "plain.gpushare-load.example.com";
/// The DeviceClass and ResourceClaimTemplate (in `default`) of the plain baseline.
pub const PLAIN_CLASS: &str = "plain-gpu";

/// The plain DRA baseline on the fake nodes `<prefix>-0` ..: a DeviceClass of [`PLAIN_DRIVER`],
/// a ResourceClaimTemplate asking for one whole device of it, and a ResourceSlice per node
/// with `gpus` devices `gpu-<i>` (no capacity), labelled as the fake nodes are.
pub async fn publish_plain_slices(
    client: &Client,
    prefix: &str,
    count: usize,
    gpus: usize,
) -> anyhow::Result<()> {
    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": {"name": PLAIN_CLASS, "labels": {FAKE_LABEL: "true"}},
        "spec": {"selectors": [{"cel": {
            "expression": format!("device.driver == '{PLAIN_DRIVER}'")
        }}]}
    }))?;
    Api::<DeviceClass>::all(client.clone())
        .create(&PostParams::default(), &class)
        .await
        .context("creating the plain DeviceClass")?;
    let template: ResourceClaimTemplate = serde_json::from_value(json!({
        "metadata": {"name": PLAIN_CLASS, "labels": {FAKE_LABEL: "true"}},
        "spec": {"spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": PLAIN_CLASS}}
        ]}}}
    }))?;
    Api::<ResourceClaimTemplate>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &template)
        .await
        .context("creating the plain ResourceClaimTemplate")?;
    create_slices(client, prefix, count, |node| {
        let devices: Vec<_> = (0..gpus)
            .map(|d| json!({"name": format!("gpu-{d}")}))
            .collect();
        Ok(serde_json::from_value(json!({
            "metadata": {"name": format!("{node}-plain")},
            "spec": {
                "driver": PLAIN_DRIVER,
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": devices,
            }
        }))?)
    })
    .await
}

/// Deletes the slices [`publish_fake_slices`] and [`publish_plain_slices`] made, and the
/// plain baseline's class and template.
pub async fn delete_fake_slices(client: &Client) -> anyhow::Result<()> {
    let fake = fake();
    Api::<ResourceSlice>::all(client.clone())
        .delete_collection(&DeleteParams::default(), &fake)
        .await?;
    Api::<DeviceClass>::all(client.clone())
        .delete_collection(&DeleteParams::default(), &fake)
        .await?;
    Api::<ResourceClaimTemplate>::namespaced(client.clone(), "default")
        .delete_collection(&DeleteParams::default(), &fake)
        .await?;
    Ok(())
}
