//! Shared setup: an in-process API server, the test kubelet in a temp dir, and the plugin
//! running in-process over real unix sockets.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser as _;
use gpushare_contract::{ContainerRequest, DEFAULT_RESOURCE, GpuRef, Keys, PodAllocation};
use gpushare_device_plugin::Config;
use gpushare_e2e::apiserver::ApiServer;
use gpushare_e2e::kubelet::{AdmissionOrder, KubeletDriver};
use gpushare_proto::v1beta1::device_plugin_client::DevicePluginClient;
use gpushare_proto::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, ContainerAllocateResponse,
    ContainerPreferredAllocationRequest, Empty, ListAndWatchResponse, PreferredAllocationRequest,
};
use gpushare_testkit::fixtures::{PodBuilder, pod};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::{Api, Client};
use tempfile::TempDir;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic::{Code, Status, Streaming};

pub const NODE: &str = "n1";
pub const RESOURCE: &str = DEFAULT_RESOURCE;
pub const WAIT: Duration = Duration::from_secs(20);

/// A container of a test pod: `(name, gib, init)`.
pub type Container = (&'static str, u64, bool);

/// The simulated UUID of GPU `index` on [`NODE`].
pub fn uuid(index: u32) -> String {
    format!("GPU-sim-{NODE}-{index}")
}

/// How many of `devices` (`<uuid>-<slot>`) are on GPU `gpu`.
pub fn on_gpu(devices: &[String], gpu: u32) -> usize {
    let gpu_of = |id: &String| {
        id.rsplit_once('-')
            .map_or(id.clone(), |(uuid, _)| uuid.to_owned())
    };
    devices.iter().filter(|id| gpu_of(id) == uuid(gpu)).count()
}

/// The plugin's flags that turn the allocation marks on (they are off by default).
pub fn marks_on() -> Vec<String> {
    vec!["--allocation-marks".to_owned(), "true".to_owned()]
}

pub struct Plugin {
    pub stop: CancellationToken,
    pub task: JoinHandle<gpushare_device_plugin::Result<()>>,
}

impl Plugin {
    /// Starts the plugin in-process with simulated GPUs of `gpus` GiB, and `extra` flags
    /// (which replace the defaults of the same flags).
    pub fn start(
        client: Client,
        dir: &Path,
        health: &Path,
        gpus: &[u64],
        extra: &[String],
    ) -> anyhow::Result<Plugin> {
        let sizes = gpus
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let (dir, health) = (dir.display().to_string(), health.display().to_string());
        // Without a kubelet, a PodResources socket nobody serves: the plugin works without.
        let absent = format!("{dir}/pod-resources/absent.sock");
        let defaults = [
            ("--node-name", NODE),
            ("--device-plugin-dir", &dir),
            ("--gpu-backend", "simulated"),
            ("--simulate-gpus", &sizes),
            ("--simulate-health-file", &health),
            ("--metrics-listen", "127.0.0.1:0"),
            ("--pending-pod-wait-ms", "2000"),
            ("--pod-resources-socket", &absent),
        ];
        let kept = defaults
            .into_iter()
            .filter(|(flag, _)| !extra.iter().any(|e| e == flag));
        let kept = kept.flat_map(|(flag, value)| [flag.to_owned(), value.to_owned()]);
        let args = ["gpushare-device-plugin".to_owned()]
            .into_iter()
            .chain(kept);
        let config = Config::try_parse_from(args.chain(extra.iter().cloned()))?;
        let stop = CancellationToken::new();
        let run =
            gpushare_device_plugin::run_with_client(config, client, stop.clone().cancelled_owned());
        Ok(Plugin {
            stop,
            task: tokio::spawn(run),
        })
    }

    pub async fn stop(self) -> anyhow::Result<()> {
        self.stop.cancel();
        tokio::time::timeout(WAIT, self.task).await???;
        Ok(())
    }
}

pub struct Cluster {
    pub server: ApiServer,
    pub client: Client,
    pub dir: TempDir,
    pub health_dir: TempDir,
    pub kubelet: Option<KubeletDriver>,
    pub plugin: Option<Plugin>,
}

impl Cluster {
    /// API server + node; the kubelet (when `order` is given) and the plugin with `gpus`.
    pub async fn start(gpus: &[u64], order: Option<AdmissionOrder>) -> anyhow::Result<Cluster> {
        Self::start_with(gpus, order, &[]).await
    }

    /// [`Cluster::start`], the plugin started with `extra` flags.
    pub async fn start_with(
        gpus: &[u64],
        order: Option<AdmissionOrder>,
        extra: &[String],
    ) -> anyhow::Result<Cluster> {
        let server = ApiServer::start().await?;
        let client = server.client();
        gpushare_testkit::fixtures::node(NODE)
            .gpushare()
            .create(&client)
            .await?;
        let (dir, health_dir) = (tempfile::tempdir()?, tempfile::tempdir()?);
        let mut extra = extra.to_vec();
        let mut kubelet = None;
        if let Some(order) = order {
            let started = KubeletDriver::start(dir.path(), NODE, client.clone(), order).await?;
            if !extra.iter().any(|e| e == "--pod-resources-socket") {
                let socket = started.pod_resources_socket().display().to_string();
                extra.extend(["--pod-resources-socket".to_owned(), socket]);
            }
            kubelet = Some(started);
        }
        let (client, plugin) = (client.clone(), None);
        let mut cluster = Cluster {
            server,
            client,
            dir,
            health_dir,
            kubelet,
            plugin,
        };
        let health = cluster.health_file();
        let started = Plugin::start(
            cluster.client.clone(),
            cluster.dir.path(),
            &health,
            gpus,
            &extra,
        );
        cluster.plugin = Some(started?);
        if let Some(kubelet) = &cluster.kubelet {
            kubelet.wait_registered(RESOURCE, WAIT).await?;
        }
        Ok(cluster)
    }

    pub fn kubelet(&self) -> &KubeletDriver {
        self.kubelet.as_ref().expect("this cluster runs a kubelet")
    }

    /// The environment kubelet gave container `container` of pod `pod` (empty if none).
    pub fn env(&self, pod: &str, container: &str) -> BTreeMap<String, String> {
        (self.kubelet().container_env("default", pod, container)).unwrap_or_default()
    }

    /// The device IDs of our resource kubelet gave pod `pod`.
    pub fn devices(&self, pod: &str) -> Vec<String> {
        (self.kubelet().pod_devices("default", pod).remove(RESOURCE)).unwrap_or_default()
    }

    /// Waits until kubelet admitted (container `main`) or refused each of `pods`; fails
    /// unless every one was admitted.
    pub async fn wait_admitted(
        &self,
        timeout: Duration,
        pods: &[impl AsRef<str>],
    ) -> anyhow::Result<()> {
        let kubelet = self.kubelet();
        let settled = |k: &KubeletDriver| {
            let admitted = pods
                .iter()
                .filter(|p| k.container_env("default", p.as_ref(), "main").is_some());
            k.admission_errors().len() + admitted.count() == pods.len()
        };
        let what = "every pod admitted or refused";
        kubelet.wait_until(timeout, what, settled).await?;
        let errors = kubelet.admission_errors();
        anyhow::ensure!(errors.is_empty(), "{errors:?}");
        Ok(())
    }

    pub fn health_file(&self) -> PathBuf {
        self.health_dir.path().join("unhealthy")
    }

    pub fn plugin_socket(&self) -> PathBuf {
        self.dir
            .path()
            .join(gpushare_device_plugin::server::SOCKET_NAME)
    }

    pub fn set_unhealthy(&self, indices: &str) -> anyhow::Result<()> {
        std::fs::write(self.health_file(), indices).context("writing the health file")
    }

    pub async fn node(&self) -> anyhow::Result<Node> {
        Ok(Api::<Node>::all(self.client.clone()).get(NODE).await?)
    }

    pub async fn pod(&self, name: &str) -> anyhow::Result<Pod> {
        Ok(Api::<Pod>::default_namespaced(self.client.clone())
            .get(name)
            .await?)
    }

    pub async fn stop_plugin(&mut self) -> anyhow::Result<()> {
        let plugin = self.plugin.take().context("the plugin was stopped")?;
        plugin.stop().await
    }

    pub async fn stop(mut self) -> anyhow::Result<()> {
        if self.plugin.is_some() {
            self.stop_plugin().await?;
        }
        if let Some(kubelet) = self.kubelet.take() {
            kubelet.shutdown().await;
        }
        self.server.shutdown().await;
        Ok(())
    }
}

/// A pod's GiB: the larger of its app containers' sum and its largest init container.
pub fn pod_gib(containers: &[Container]) -> u64 {
    let app: u64 = containers.iter().filter(|c| !c.2).map(|c| c.1).sum();
    let init = containers.iter().filter(|c| c.2).map(|c| c.1).max();
    app.max(init.unwrap_or(0))
}

/// The allocation annotations the extender would write: GPU `gpu`, these containers,
/// bound `second` seconds into the test's timeline.
pub fn allocation(gpu: u32, containers: &[Container], second: u32) -> Vec<(String, String)> {
    allocation_on(&[gpu], containers, second)
}

/// [`allocation`] for a pod spread evenly over `gpus` (the first one first): each
/// container's GiB is its total, the pod holds `1 / gpus.len()` of its total on each GPU.
pub fn allocation_on(gpus: &[u32], containers: &[Container], second: u32) -> Vec<(String, String)> {
    let (&gpu, more) = gpus.split_first().expect("at least one GPU");
    let count = u64::try_from(gpus.len()).unwrap_or(1);
    let gpu_ref = |&index: &u32| GpuRef {
        index,
        uuid: uuid(index),
    };
    let (name, compute) = (|name: &str| name.to_owned(), 0);
    let request = |&(n, gib, init): &Container| ContainerRequest {
        name: name(n),
        gib,
        init,
        compute,
    };
    PodAllocation {
        more_gpus: more.iter().map(gpu_ref).collect(),
        exclusive: false,
        gpu_index: gpu,
        gpu_uuid: uuid(gpu),
        pod_gib: pod_gib(containers) / count,
        containers: containers.iter().map(request).collect(),
        bind_time: format!("2026-11-22T10:{:02}:{:02}Z", second / 60, second % 60),
        assigned: false,
        allocated: vec![],
        signature: None,
        compute: 0,
    }
    .to_annotations(&Keys::default())
    .into_iter()
    .collect()
}

/// `builder` with every annotation of `annotations`.
pub fn annotated(builder: PodBuilder, annotations: Vec<(String, String)>) -> PodBuilder {
    annotations
        .into_iter()
        .fold(builder, |builder, (k, v)| builder.annotation(&k, &v))
}

/// Pod `name` on [`NODE`], its one container `main` asking for `gib`, with the
/// [`allocation`] on GPU `gpu` bound `second` seconds into the test's timeline.
pub fn placed(name: &str, gpu: u32, gib: u64, second: u32) -> PodBuilder {
    annotated(
        pod(name).gpu_mem(gib).on_node(NODE),
        allocation(gpu, &[("main", gib, false)], second),
    )
}

/// `(allocated, assigned)` marks of pod `name` ("" where unset).
pub async fn marks(cluster: &Cluster, name: &str) -> anyhow::Result<(String, String)> {
    let (keys, pod) = (Keys::default(), cluster.pod(name).await?);
    let annotations = pod.metadata.annotations.unwrap_or_default();
    let get = |key: &str| annotations.get(key).cloned().unwrap_or_default();
    Ok((get(&keys.allocated), get(&keys.assigned)))
}

/// The marks of a pod the plugin allocated `allocated` (its containers, comma-separated).
pub fn marked(allocated: &str) -> (String, String) {
    (allocated.to_owned(), "true".to_owned())
}

/// Whether pod `name` is marked assigned.
pub async fn assigned(cluster: &Cluster, name: &str) -> anyhow::Result<bool> {
    Ok(marks(cluster, name).await?.1 == "true")
}

/// Waits until every one of `pods` is marked assigned.
pub async fn wait_all_assigned(
    cluster: &Cluster,
    timeout: Duration,
    pods: &[impl AsRef<str>],
) -> anyhow::Result<()> {
    eventually(timeout, "every pod marked assigned", || async {
        for name in pods {
            if !assigned(cluster, name.as_ref()).await? {
                return Ok(false);
            }
        }
        Ok(true)
    })
    .await
}

/// Polls `cond` every 50 ms until it holds or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, what: &str, mut cond: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    while !cond().await? {
        let waited = tokio::time::Instant::now() < deadline;
        anyhow::ensure!(waited, "timed out after {timeout:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Device IDs `slots` of each of `gpus` in turn, as the plugin advertises them.
pub fn ids(gpus: &[u32], slots: Range<u64>) -> Vec<String> {
    let of_gpu = |&gpu: &u32| {
        slots
            .clone()
            .map(move |slot| format!("{}-{slot}", uuid(gpu)))
    };
    gpus.iter().flat_map(of_gpu).collect()
}

/// An Allocate request for one container holding `devices`.
pub fn allocate(devices: Vec<String>) -> AllocateRequest {
    let container_requests = vec![ContainerAllocateRequest {
        devices_ids: devices,
    }];
    AllocateRequest { container_requests }
}

/// The plugin's answer to kubelet allocating one container GPU 0's devices `slots` (the plugin
/// goes by the waiting pod, not by which devices kubelet picked).
pub async fn allocate_slots(
    plugin: &mut DevicePluginClient<Channel>,
    slots: Range<u64>,
) -> Result<ContainerAllocateResponse, Status> {
    let response = plugin.allocate(allocate(ids(&[0], slots))).await?;
    Ok(response.into_inner().container_responses.swap_remove(0))
}

/// The error of a refused call, checked to carry `code` and every one of `parts`.
#[track_caller]
pub fn refused<T: Debug>(result: Result<T, Status>, code: Code, parts: &[&str]) -> Status {
    let err = result.expect_err("the plugin refused");
    assert_eq!(err.code(), code, "{}", err.message());
    for part in parts {
        assert!(err.message().contains(part), "{part}: {}", err.message());
    }
    err
}

/// The plugin's GetPreferredAllocation answer for one container of `size` devices.
pub async fn preferred(
    plugin: &mut DevicePluginClient<Channel>,
    available: Vec<String>,
    size: i32,
) -> anyhow::Result<Vec<String>> {
    let request = PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: available,
            must_include_device_i_ds: vec![],
            allocation_size: size,
        }],
    };
    let mut response = plugin.get_preferred_allocation(request).await?.into_inner();
    Ok(response.container_responses.swap_remove(0).device_i_ds)
}

/// A client of the plugin's socket, once it exists.
pub async fn client(cluster: &Cluster) -> anyhow::Result<DevicePluginClient<Channel>> {
    let socket = cluster.plugin_socket();
    eventually(WAIT, "the plugin socket", || async { Ok(socket.exists()) }).await?;
    let channel = gpushare_device_plugin::server::connect(&socket).await?;
    Ok(DevicePluginClient::new(channel))
}

/// Waits until ListAndWatch reports an unhealthy device; returns the stream, still open.
pub async fn wait_for_unhealthy_devices(
    plugin: &mut DevicePluginClient<Channel>,
) -> anyhow::Result<Streaming<ListAndWatchResponse>> {
    let mut devices = plugin.list_and_watch(Empty {}).await?.into_inner();
    tokio::time::timeout(WAIT, async {
        while let Some(list) = devices.message().await? {
            if list
                .devices
                .iter()
                .any(|d| d.health == gpushare_proto::UNHEALTHY)
            {
                return anyhow::Ok(());
            }
        }
        anyhow::bail!("ListAndWatch ended")
    })
    .await??;
    Ok(devices)
}
