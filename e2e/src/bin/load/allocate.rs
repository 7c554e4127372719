//! Phase 2: the real `gpushare-device-plugin` answering kubelet's `Allocate` calls.
//!
//! ```text
//!  fresh API server ── node load-gpu-node ◀── plugin publishes its (simulated) GPU inventory
//!  <tmp>/device-plugins/kubelet.sock ◀── Register ── gpushare-device-plugin (8 simulated GPUs)
//!        (a KubeletDriver for node "nobody": accepts the registration, admits none of our pods)
//!  K pods bound to load-gpu-node, allocation annotations pending (size s → GPU s-1: the twin rule)
//!  harness, as kubelet ──Allocate(s device IDs)──▶ plugin socket, one call at a time
//!        ──▶ Allocate p50/p99, pod LISTs during the phase (expected 0), pod patches per Allocate
//! ```
//!
//! kubelet admits pods one at a time, so the calls are sequential. The plugin answers from its
//! watch cache and writes its marks in the background; the harness waits for those patches to
//! settle before counting them. Before measuring, it waits until the plugin's watch holds every
//! pod: a last *sentinel* pod of a size no other pod has is created after all the others, and
//! Allocate for that size succeeds only once the watch has delivered it (and so everything
//! created before it).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use gpushare_contract::{GpuInfo, Keys, inventory};
use gpushare_e2e::apiserver::{ApiServer, Verb};
use gpushare_e2e::cluster::{Binaries, Process, RESOURCE, free_port, wait_for};
use gpushare_e2e::kubelet::{AdmissionOrder, KubeletDriver};
use gpushare_proto::KUBELET_SOCKET;
use gpushare_proto::v1beta1::device_plugin_client::DevicePluginClient;
use gpushare_proto::v1beta1::{AllocateRequest, ContainerAllocateRequest};
use gpushare_testkit::fixtures::{PodBuilder, node};
use gpushare_testkit::workload::{Placed, allocated_pod};
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use tonic::transport::Channel;

use crate::report::{
    Latencies, figure, in_flight, proc_memory, quoted, ratio, secs, section, took,
};

/// The node the plugin serves.
const NODE: &str = "load-gpu-node";
/// The node the kubelet driver serves: not [`NODE`], so it admits none of our pods.
const KUBELET_NODE: &str = "nobody";
/// Simulated GPUs; pods of s GiB go to GPU s-1, so sizes are 1..=GPUS.
const GPUS: u64 = 8;
/// GiB of the sentinel pod, the last created: a size no other pod has.
const SENTINEL_GIB: u64 = GPUS + 1;

/// What phase 2 builds and drives.
#[derive(Debug, Clone)]
pub struct Config {
    /// Pods allocated, one Allocate each.
    pub pods: usize,
    /// GiB of each simulated GPU (raised when the pods would not fit): one device per GiB.
    pub gpu_gib: u64,
    /// API creates in flight at once during set-up.
    pub setup_concurrency: usize,
}

/// GiB of pod `i` (and so, by the twin rule, its GPU is `gib - 1`).
fn size(i: usize) -> u64 {
    1 + i as u64 % GPUS
}

/// GiB every GPU needs to hold its pods and the sentinel (an upper bound).
fn needed_gpu_gib(pods: usize) -> u64 {
    let per_gpu = u64::try_from(pods).unwrap_or(u64::MAX).div_ceil(GPUS);
    per_gpu.saturating_mul(GPUS).saturating_add(GPUS + 1)
}

/// A pod bound to [`NODE`] whose allocation the device plugin has not made yet.
fn pending_pod(
    name: &str,
    gib: u64,
    gpu: u32,
    gpus: &[GpuInfo],
    keys: &Keys,
    bind_time: &str,
) -> PodBuilder {
    let uuid = gpus
        .iter()
        .find(|g| g.index == gpu)
        .map(|g| g.uuid.clone())
        .unwrap_or_default();
    let placed = Placed {
        node: NODE,
        gpu,
        uuid: &uuid,
        gib,
    };
    allocated_pod(name, &placed, false, keys, bind_time)
}

/// Runs phase 2 and prints its section of the report.
pub async fn run(cfg: &Config, bins: &Binaries, log_dir: &Path) -> anyhow::Result<()> {
    section("device plugin Allocate (real gpushare-device-plugin, simulated GPUs)");
    let api = ApiServer::start().await?;
    let client = api.client();
    let kubeconfig = log_dir.join("allocate-kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    node(NODE).gpushare().create(&client).await?;
    // The kubelet driver's own node: it only accepts the registration and admits nothing here.
    node(KUBELET_NODE).create(&client).await?;

    let plugin_dir = log_dir.join("device-plugins");
    std::fs::create_dir_all(&plugin_dir)?;
    let kubelet = KubeletDriver::start(
        &plugin_dir,
        KUBELET_NODE,
        client.clone(),
        AdmissionOrder::CreationTime,
    )
    .await?;
    let gib = needed_gpu_gib(cfg.pods).max(cfg.gpu_gib);
    figure("simulated GPUs", format!("{GPUS} × {gib} GiB"));
    let plugin = spawn_plugin(
        bins,
        &plugin_dir,
        gib,
        &kubeconfig,
        &log_dir.join("device-plugin.log"),
    )?;
    let pid = plugin.id();
    let result = measure(cfg, &api, &kubelet, &plugin_dir, pid).await;
    kubelet.shutdown().await;
    plugin.crash().await;
    api.shutdown().await;
    result
}

/// Waits for the plugin, creates the pods, then times one Allocate per pod and prints the
/// results.
async fn measure(
    cfg: &Config,
    api: &ApiServer,
    kubelet: &KubeletDriver,
    plugin_dir: &Path,
    pid: Option<u32>,
) -> anyhow::Result<()> {
    let client = api.client();
    let devices = registered_devices(kubelet).await?;
    let gpus = published_gpus(&client).await?;
    create_pods(cfg, &client, &gpus).await?;

    let socket = plugin_socket(plugin_dir)?;
    let channel = gpushare_proto::connect_unix(&socket).await;
    let mut plugin =
        DevicePluginClient::new(channel.context("connecting to the device plugin's socket")?);
    let mut ids = devices.iter().cycle();
    let mut take = |n: u64| -> Vec<String> { ids.by_ref().take(n as usize).cloned().collect() };

    wait_for_sentinel(&mut plugin, take(SENTINEL_GIB)).await?;
    let stats = api.stats();
    // The sentinel's mark is the first pod patch; let it land before counting.
    let _ = wait_for("the sentinel's mark", Duration::from_secs(10), || async {
        (stats.count(Verb::Patch, "pods") >= 1).then_some(())
    })
    .await;

    // Measure: one Allocate per pod, in creation order, as kubelet admits.
    let lists_before = stats.count(Verb::List, "pods");
    let patches_before = stats.count(Verb::Patch, "pods");
    let mut latencies = Latencies::default();
    let mut errors = Vec::new();
    let started = Instant::now();
    for i in 0..cfg.pods {
        let request = allocate_request(take(size(i)));
        let call = Instant::now();
        match plugin.allocate(request).await {
            Ok(_) => latencies.push(call.elapsed()),
            Err(status) => errors.push(format!("alloc-{i:05}: {}", status.message())),
        }
    }
    let elapsed = started.elapsed();
    let allocated = u64::try_from(latencies.len()).unwrap_or(u64::MAX);
    let patches = settle(
        || stats.count(Verb::Patch, "pods"),
        patches_before + allocated,
    )
    .await
        - patches_before;
    let lists = stats.count(Verb::List, "pods") - lists_before;

    figure(
        "Allocate calls answered",
        format!("{allocated} of {}", cfg.pods),
    );
    figure("Allocate phase wall time", secs(elapsed));
    latencies.summary().print("Allocate");
    figure("API pod LISTs during Allocate phase", lists);
    figure("API pod patches per Allocate", ratio(patches, allocated));
    quoted("Allocate errors", "error", &errors);
    figure("device plugin peak RSS (VmHWM)", proc_memory(pid, "VmHWM"));
    Ok(())
}

/// Waits until the plugin has registered and kubelet listed its devices; the healthy ones.
async fn registered_devices(kubelet: &KubeletDriver) -> anyhow::Result<Vec<String>> {
    let started = Instant::now();
    kubelet
        .wait_registered(RESOURCE, Duration::from_secs(60))
        .await?;
    took("plugin start → registered and listed", started);
    let devices: Vec<String> = kubelet
        .devices(RESOURCE)
        .into_iter()
        .filter(|(_, healthy)| *healthy)
        .map(|(id, _)| id)
        .collect();
    figure("devices advertised (1 per GiB)", devices.len());
    if devices.is_empty() {
        bail!("the device plugin advertised no healthy devices");
    }
    Ok(devices)
}

/// Set-up: the pods, then the sentinel.
async fn create_pods(cfg: &Config, client: &kube::Client, gpus: &[GpuInfo]) -> anyhow::Result<()> {
    let keys = Keys::default();
    let base = jiff::Timestamp::now();
    let started = Instant::now();
    let creates = (0..cfg.pods).map(|i| {
        let bind_time =
            base + jiff::SignedDuration::from_millis(i64::try_from(i).unwrap_or(i64::MAX));
        let gib = size(i);
        pending_pod(
            &format!("alloc-{i:05}"),
            gib,
            gpu_of(gib),
            gpus,
            &keys,
            &bind_time.to_string(),
        )
        .create(client)
    });
    in_flight(cfg.setup_concurrency, creates).await?;
    pending_pod(
        "alloc-sentinel",
        SENTINEL_GIB,
        0,
        gpus,
        &keys,
        &base.to_string(),
    )
    .create(client)
    .await?;
    took("set-up: pods created", started);
    Ok(())
}

/// Retries Allocate for the sentinel (`devices`) until it succeeds: the plugin's watch then
/// holds every pod created before it.
async fn wait_for_sentinel(
    plugin: &mut DevicePluginClient<Channel>,
    devices: Vec<String>,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let sentinel = allocate_request(devices);
    let deadline = Instant::now() + Duration::from_secs(120);
    while let Err(status) = plugin.allocate(sentinel.clone()).await {
        if Instant::now() >= deadline {
            bail!(
                "the device plugin never allocated the sentinel pod: {}",
                status.message()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    took("plugin watch caught up (sentinel allocated)", started);
    Ok(())
}

/// GPU `gib - 1`: same-sized pods share a GPU (the twin rule).
fn gpu_of(gib: u64) -> u32 {
    u32::try_from(gib.saturating_sub(1)).unwrap_or(0)
}

fn allocate_request(devices_ids: Vec<String>) -> AllocateRequest {
    AllocateRequest {
        container_requests: vec![ContainerAllocateRequest { devices_ids }],
    }
}

/// Waits until `count` reaches `target` or stops moving for a second (writes may coalesce).
async fn settle(count: impl Fn() -> u64, target: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = count();
    let mut still_since = Instant::now();
    while last < target
        && Instant::now() < deadline
        && still_since.elapsed() < Duration::from_secs(1)
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = count();
        if now != last {
            last = now;
            still_since = Instant::now();
        }
    }
    last
}

/// The GPU inventory the plugin published on its node.
async fn published_gpus(client: &kube::Client) -> anyhow::Result<Vec<GpuInfo>> {
    let nodes: Api<Node> = Api::all(client.clone());
    let keys = Keys::default();
    let keys = &keys;
    let nodes = &nodes;
    wait_for(
        "the plugin to publish its GPU inventory",
        Duration::from_secs(30),
        || async move {
            let node = nodes.get(NODE).await.ok()?;
            let text = node.metadata.annotations.as_ref()?.get(&keys.node_gpus)?;
            inventory::decode(text).ok().filter(|gpus| !gpus.is_empty())
        },
    )
    .await
}

/// The plugin's socket: the one socket in the directory that is not kubelet's.
fn plugin_socket(dir: &Path) -> anyhow::Result<PathBuf> {
    std::fs::read_dir(dir)?
        .flatten()
        .map(|entry| entry.path())
        .find(|path| {
            path.extension().is_some_and(|ext| ext == "sock")
                && path.file_name().is_some_and(|name| name != KUBELET_SOCKET)
        })
        .with_context(|| format!("no device plugin socket in {}", dir.display()))
}

/// Starts the real plugin on simulated GPUs; its output goes to `log`; killed on drop.
fn spawn_plugin(
    bins: &Binaries,
    dir: &Path,
    gpu_gib: u64,
    kubeconfig: &Path,
    log: &Path,
) -> anyhow::Result<Process> {
    let sizes = vec![gpu_gib.to_string(); GPUS as usize].join(",");
    let args = [
        "--node-name".to_owned(),
        NODE.to_owned(),
        "--device-plugin-dir".to_owned(),
        dir.display().to_string(),
        "--gpu-backend".to_owned(),
        "simulated".to_owned(),
        "--simulate-gpus".to_owned(),
        sizes,
        "--metrics-listen".to_owned(),
        format!("127.0.0.1:{}", free_port()?),
    ];
    Process::spawn(
        "gpushare-device-plugin",
        &bins.device_plugin,
        &args,
        kubeconfig,
        log,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_the_twin_rule_and_fit() {
        let pods = 1000;
        let gib = needed_gpu_gib(pods);
        let mut used = [0u64; GPUS as usize];
        for i in 0..pods {
            used[gpu_of(size(i)) as usize] += size(i);
        }
        used[0] += GPUS + 1;
        assert!(used.iter().all(|&u| u <= gib), "{used:?} on {gib} GiB GPUs");
        assert_eq!(
            (1..=GPUS).map(gpu_of).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4, 5, 6, 7]
        );
        assert!(needed_gpu_gib(100_000) >= 100_000);
    }
}
