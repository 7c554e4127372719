//! The plugin checks its bookkeeping against kubelet's PodResources API, over a real unix
//! socket: a container holding devices of a GPU its pod was not given becomes a Warning
//! Event on the pod and `gpushare_device_plugin_kubelet_mismatches_total`; the allocation
//! marks follow what kubelet reports. Without the socket the plugin works as before and
//! picks it up later. A pod holding GPU memory without an allocation of its own runs against
//! the kubelet driver in `pod_resources.rs`.

use crate::device_plugin_common as common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use common::{Cluster, WAIT, eventually, ids, marked, marks, placed};
use gpushare_contract::Keys;
use gpushare_e2e::cluster::{http_get, service_port};
use gpushare_proto::podresources::v1::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use gpushare_proto::podresources::v1::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices,
    ContainerResources, GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest,
    ListPodResourcesResponse, PodResources,
};
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use tempfile::TempDir;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// A kubelet PodResources endpoint answering `List` with whatever the test sets.
#[derive(Clone, Default)]
struct FakePodResources {
    answer: Arc<Mutex<ListPodResourcesResponse>>,
}

#[tonic::async_trait]
impl PodResourcesLister for FakePodResources {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        Ok(Response::new(self.answer.lock().unwrap().clone()))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        Err(Status::unimplemented("not used"))
    }

    async fn get(
        &self,
        _: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented("not used"))
    }
}

impl FakePodResources {
    fn serve(&self, path: &Path, stop: CancellationToken) -> anyhow::Result<()> {
        std::fs::create_dir_all(path.parent().unwrap())?;
        let listener = UnixListener::bind(path)?;
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(PodResourcesListerServer::new(self.clone()))
                .serve_with_incoming_shutdown(
                    UnixListenerStream::new(listener),
                    stop.cancelled_owned(),
                ),
        );
        Ok(())
    }

    /// kubelet's answer: these pods (all in `default`), each with one container `main`
    /// holding these devices, reported as kubelet does: one entry per device.
    fn set(&self, pods: &[(&str, Vec<String>)]) {
        let device = |id: &String| ContainerDevices {
            resource_name: common::RESOURCE.to_owned(),
            device_ids: vec![id.clone()],
            topology: None,
        };
        let pod = |(name, ids): &(&str, Vec<String>)| PodResources {
            name: (*name).to_owned(),
            namespace: "default".to_owned(),
            containers: vec![ContainerResources {
                name: "main".to_owned(),
                devices: ids.iter().map(device).collect(),
                ..ContainerResources::default()
            }],
        };
        let pod_resources = pods.iter().map(pod).collect();
        *self.answer.lock().unwrap() = ListPodResourcesResponse { pod_resources };
    }
}

/// A temp dir for kubelet's socket, the socket's path, and the plugin's metrics address.
fn endpoints() -> anyhow::Result<(TempDir, PathBuf, SocketAddr)> {
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("pod-resources/kubelet.sock");
    let metrics = format!("127.0.0.1:{}", service_port()?).parse()?;
    Ok((dir, socket, metrics))
}

/// Flags for a plugin reading kubelet at `socket` often, serving metrics on `metrics`.
/// These tests watch the allocation marks follow kubelet, so the marks are on.
fn flags(socket: &Path, metrics: SocketAddr) -> Vec<String> {
    let (socket, metrics) = (socket.display().to_string(), metrics.to_string());
    let flags = [
        ("--allocation-marks", "true"),
        ("--pod-resources-socket", &socket),
    ];
    let more = [
        ("--pod-resources-period-ms", "100"),
        ("--metrics-listen", &metrics),
    ];
    let pairs = flags.into_iter().chain(more);
    pairs
        .flat_map(|(flag, value)| [flag.to_owned(), value.to_owned()])
        .collect()
}

/// Event reasons by pod name.
async fn event_reasons(cluster: &Cluster) -> anyhow::Result<BTreeMap<String, Vec<String>>> {
    let events: Api<Event> = Api::namespaced(cluster.client.clone(), "default");
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for event in events.list(&Default::default()).await? {
        let name = event.regarding.and_then(|r| r.name).unwrap_or_default();
        let reasons = out.entry(name).or_default();
        reasons.push(event.reason.unwrap_or_default());
    }
    Ok(out)
}

async fn metric(addr: SocketAddr, line: &str) -> anyhow::Result<bool> {
    let (status, body) = http_get(addr, "/metrics").await?;
    anyhow::ensure!(status == 200, "/metrics answered {status}");
    Ok(body.lines().any(|l| l == line))
}

#[tokio::test]
async fn mismatches_kubelet_reports_become_events_and_metrics_and_marks_follow_it()
-> anyhow::Result<()> {
    let (_dir, socket, metrics) = endpoints()?;
    let kubelet = FakePodResources::default();
    let stop = CancellationToken::new();
    kubelet.serve(&socket, stop.clone())?;
    let cluster = Cluster::start_with(&[8, 8], None, &flags(&socket, metrics)).await?;

    // All on GPU 0. kubelet gave right devices of GPU 0, wrong devices of GPU 1; twin-a
    // carries the mark of an Allocate kubelet made for its twin twin-b.
    let keys = Keys::default();
    let pods = [
        ("right", 2, true),
        ("wrong", 2, true),
        ("twin-a", 4, true),
        ("twin-b", 4, false),
    ];
    for (second, (name, gib, allocated)) in (1..).zip(pods) {
        let mut builder = placed(name, 0, gib, second);
        if allocated {
            builder = builder
                .annotation(&keys.allocated, "main")
                .annotation(&keys.assigned, "true");
        }
        builder.create(&cluster.client).await?;
    }
    kubelet.set(&[
        ("right", ids(&[0], 0..2)),
        ("wrong", ids(&[1], 0..2)),
        ("twin-a", vec![]),
        ("twin-b", ids(&[0], 2..6)),
    ]);

    let expected = BTreeMap::from([("wrong".to_owned(), vec!["GpuMemOnWrongGpu".to_owned()])]);
    let reported = || async { Ok(event_reasons(&cluster).await? == expected) };
    eventually(WAIT, "an Event on the mismatching pod", reported).await?;
    eventually(WAIT, "the marks to follow kubelet", || async {
        Ok(marks(&cluster, "twin-b").await? == marked("main")
            && marks(&cluster, "twin-a").await? == (String::new(), "false".into()))
    })
    .await?;
    for line in [
        "gpushare_device_plugin_kubelet_mismatches_total{kind=\"wrong_gpu\"} 1",
        "gpushare_device_plugin_pod_resources_up 1",
    ] {
        eventually(WAIT, line, || metric(metrics, line)).await?;
    }
    // Honest pods kept their marks; the finding was reported once.
    for name in ["right", "wrong"] {
        assert_eq!(marks(&cluster, name).await?, marked("main"), "{name}");
    }
    assert_eq!(event_reasons(&cluster).await?, expected);
    stop.cancel();
    cluster.stop().await
}

#[tokio::test]
async fn without_the_socket_the_plugin_works_and_uses_it_once_it_appears() -> anyhow::Result<()> {
    let (_dir, socket, metrics) = endpoints()?;
    let order = Some(gpushare_e2e::kubelet::AdmissionOrder::CreationTime);
    let cluster = Cluster::start_with(&[8], order, &flags(&socket, metrics)).await?;
    let up = |value: u8| format!("gpushare_device_plugin_pod_resources_up {value}");
    let down = up(0);
    let no_socket = || metric(metrics, &down);
    eventually(WAIT, "the plugin to notice there is no socket", no_socket).await?;
    // Pods run as before.
    placed("a", 0, 4, 1).create(&cluster.client).await?;
    eventually(WAIT, "pod a to run with its marks", || async {
        let status = cluster.pod("a").await?.status;
        let running = status.and_then(|s| s.phase).as_deref() == Some("Running");
        Ok(running && marks(&cluster, "a").await? == marked("main"))
    })
    .await?;

    // The socket appears (kubelet upgraded, mount fixed): used from then on.
    let kubelet = FakePodResources::default();
    kubelet.set(&[("a", ids(&[0], 0..4))]);
    let stop = CancellationToken::new();
    kubelet.serve(&socket, stop.clone())?;
    let up = up(1);
    eventually(WAIT, "the plugin to read the socket", || {
        metric(metrics, &up)
    })
    .await?;
    assert!(event_reasons(&cluster).await?.is_empty());
    stop.cancel();
    cluster.stop().await
}
