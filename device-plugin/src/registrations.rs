//! Refusing to start where another device plugin already serves our resource name.
//!
//! kubelet keeps one endpoint per resource name: a plugin that registers a name another
//! plugin registered replaces it, and the other takes the name back the next time it
//! registers. Alibaba's classic gpushare registers `aliyun.com/gpu-mem`, the name a
//! migration keeps; anyone can start a second plugin for `example.com/gpu-mem`. The two then
//! fight silently, and the pods one of them allocated lose their accounting. So, before it
//! serves anything, the plugin looks at what the node shows and stops with
//! [`Error::RegisteredElsewhere`] when another plugin holds the name:
//!
//! ```text
//!   <device plugin dir>/kubelet_internal_checkpoint ──▶ RegisteredDevices[our resource]
//!   (kubelet's record of the devices each                │ none recorded: nothing to fight over
//!    resource's plugin last listed)                      ▼
//!   <device plugin dir>/*.sock but kubelet.sock and ours ──ListAndWatch, first list (2 s)──▶
//!       served IDs ∩ RegisteredDevices[our resource] ≠ ∅ ──▶ refuse, naming that socket
//! ```
//!
//! Why both: the checkpoint alone cannot tell who is still there. After a migration (the
//! classic plugin removed first, docs/migrating.md) its devices stay recorded until we list
//! ours, and after our own restart the devices recorded are ours. A socket alone cannot tell
//! which resource it serves: the device plugin API carries no name. A live socket other than
//! ours that serves devices kubelet recorded for our name is a plugin that registered it.
//!
//! Everything here leans towards starting. A checkpoint that is absent, unreadable or not in
//! kubelet's format, a directory that cannot be listed, a socket that refuses or does not
//! list its devices within [`PROBE_TIMEOUT`]: none of these is a conflict (the unreadable ones
//! are logged). The check has a blind spot: when we registered last, kubelet's record is ours,
//! and another plugin still running is found only at a start after it registered again.
//!
//! Other plugins are asked only when the checkpoint records devices for our name, once, at
//! start-up: the question opens a `ListAndWatch` stream at the other plugin, and some
//! plugins keep serving a stream whose client has gone until their next device update.

use std::collections::HashSet;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpushare_proto::KUBELET_SOCKET;
use gpushare_proto::v1beta1::Empty;
use gpushare_proto::v1beta1::device_plugin_client::DevicePluginClient;
use serde::Deserialize;
use tokio::io::AsyncReadExt;

use crate::error::{Error, Result};

/// kubelet's device manager checkpoint, inside the device plugin directory.
pub const CHECKPOINT: &str = "kubelet_internal_checkpoint";
/// How long another plugin's socket has to list its devices; one that takes longer is not
/// taken for a conflict.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// How many shared device IDs the error shows.
const EXAMPLES: usize = 3;
/// The largest checkpoint read. kubelet's holds an entry per container with devices; one
/// larger than this is not kubelet's, and is skipped with a warning.
const MAX_CHECKPOINT_BYTES: u64 = 64 << 20;

/// Fails with [`Error::RegisteredElsewhere`] when a device plugin other than ours serves,
/// on a socket in `device_plugin_dir`, devices that kubelet's checkpoint records for
/// `resource`. `own_socket` (ours, or our predecessor's during a rollout) and kubelet's
/// `kubelet.sock` are not asked. Anything unreadable counts as no conflict.
pub async fn refuse_if_registered_elsewhere(
    device_plugin_dir: &Path,
    resource: &str,
    own_socket: &Path,
) -> Result<()> {
    check(device_plugin_dir, resource, own_socket, PROBE_TIMEOUT).await
}

/// [`refuse_if_registered_elsewhere`], with each socket given `timeout` to answer.
async fn check(dir: &Path, resource: &str, own_socket: &Path, timeout: Duration) -> Result<()> {
    let checkpoint = dir.join(CHECKPOINT);
    let recorded = match read_recorded(&checkpoint, resource).await {
        Ok(Some(recorded)) => recorded,
        Ok(None) => {
            tracing::debug!(checkpoint = %checkpoint.display(), "no kubelet device checkpoint: no other plugin registered anything here");
            return Ok(());
        }
        Err(error) => {
            tracing::warn!(checkpoint = %checkpoint.display(), %error, resource, "cannot read kubelet's device checkpoint; starting without checking whether another device plugin registered this resource");
            return Ok(());
        }
    };
    if recorded.is_empty() {
        return Ok(());
    }
    let sockets = foreign_sockets(dir, own_socket).await;
    let answers =
        futures::future::join_all(sockets.iter().map(|socket| served_ids(socket, timeout))).await;
    for (socket, answer) in sockets.into_iter().zip(answers) {
        match answer {
            Ok(served) => {
                let shared = shared_ids(&recorded, &served);
                if !shared.is_empty() {
                    return Err(Error::RegisteredElsewhere {
                        resource: resource.to_owned(),
                        socket,
                        shared: shared.len(),
                        examples: shared.into_iter().take(EXAMPLES).collect(),
                    });
                }
                tracing::debug!(socket = %socket.display(), devices = served.len(), resource, "another device plugin serves other devices");
            }
            Err(why) => {
                tracing::debug!(socket = %socket.display(), %why, "a socket in the device plugin directory did not list devices: not a conflict");
            }
        }
    }
    tracing::info!(
        resource,
        devices = recorded.len(),
        "kubelet's checkpoint records devices of this resource that no other running plugin serves (ours before a restart, or a plugin since removed)"
    );
    Ok(())
}

/// Why kubelet's checkpoint could not be read.
#[derive(Debug, thiserror::Error)]
enum CheckpointError {
    /// The file could not be read.
    #[error("{0}")]
    Read(#[from] std::io::Error),
    /// The file is larger than any checkpoint kubelet writes.
    #[error("larger than {MAX_CHECKPOINT_BYTES} bytes")]
    TooLarge,
    /// The file is not in kubelet's format.
    #[error("not kubelet's checkpoint format: {0}")]
    Format(#[from] serde_json::Error),
}

/// The device IDs the checkpoint at `path` records for `resource`; `None` when there is no
/// checkpoint.
async fn read_recorded(
    path: &Path,
    resource: &str,
) -> Result<Option<HashSet<String>>, CheckpointError> {
    let file = match tokio::fs::File::open(path).await {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(error.into()),
    };
    let mut bytes = Vec::new();
    file.take(MAX_CHECKPOINT_BYTES + 1)
        .read_to_end(&mut bytes)
        .await?;
    if u64::try_from(bytes.len()).unwrap_or(u64::MAX) > MAX_CHECKPOINT_BYTES {
        return Err(CheckpointError::TooLarge);
    }
    Ok(Some(recorded_in(&bytes, resource)?))
}

/// kubelet's device manager checkpoint
/// (`pkg/kubelet/cm/devicemanager/checkpoint`), the part read here:
/// `{"Data": {"PodDeviceEntries": [...], "RegisteredDevices": {"<resource>": ["<id>", ...]}},
/// "Checksum": N}`. `RegisteredDevices` holds the healthy devices each resource's plugin
/// last listed. The rest (pod entries, whose shape changed across kubelet versions, the
/// checksum, the boot ID) is not needed and not parsed.
#[derive(Deserialize)]
struct Checkpoint {
    #[serde(rename = "Data")]
    data: CheckpointData,
}

/// `Data` of [`Checkpoint`]. Go writes a nil map or slice as `null`.
#[derive(Deserialize)]
struct CheckpointData {
    #[serde(rename = "RegisteredDevices", default)]
    registered_devices: Option<std::collections::HashMap<String, Option<Vec<String>>>>,
}

/// The device IDs kubelet's checkpoint `json` records for `resource` (none when it records
/// no such resource).
fn recorded_in(json: &[u8], resource: &str) -> Result<HashSet<String>, serde_json::Error> {
    let checkpoint: Checkpoint = serde_json::from_slice(json)?;
    Ok(checkpoint
        .data
        .registered_devices
        .and_then(|mut resources| resources.remove(resource))
        .flatten()
        .unwrap_or_default()
        .into_iter()
        .collect())
}

/// The sockets in `dir` other plugins may serve: every socket but kubelet's and ours, in
/// name order. A directory that cannot be listed has none (logged).
async fn foreign_sockets(dir: &Path, own_socket: &Path) -> Vec<PathBuf> {
    let mut entries = match tokio::fs::read_dir(dir).await {
        Ok(entries) => entries,
        Err(error) => {
            tracing::warn!(dir = %dir.display(), %error, "cannot list the device plugin directory; starting without checking for other plugins");
            return Vec::new();
        }
    };
    let mut sockets = Vec::new();
    loop {
        let entry = match entries.next_entry().await {
            Ok(Some(entry)) => entry,
            Ok(None) => break,
            Err(error) => {
                tracing::warn!(dir = %dir.display(), %error, "cannot list the whole device plugin directory");
                break;
            }
        };
        let path = entry.path();
        let is_socket = entry.file_type().await.is_ok_and(|kind| kind.is_socket());
        if is_socket && entry.file_name() != KUBELET_SOCKET && path != own_socket {
            sockets.push(path);
        }
    }
    sockets.sort();
    sockets
}

/// Why a socket listed no devices.
#[derive(Debug, thiserror::Error)]
enum ProbeError {
    #[error("cannot connect: {0}")]
    Connect(#[from] tonic::transport::Error),
    #[error("ListAndWatch failed: {0}")]
    Call(#[from] tonic::Status),
    #[error("ListAndWatch ended before listing devices")]
    Ended,
    #[error("no device list within {0:?}")]
    Timeout(Duration),
}

/// The device IDs the device plugin on `socket` lists first, as kubelet would see them.
async fn served_ids(socket: &Path, timeout: Duration) -> Result<Vec<String>, ProbeError> {
    let ask = async {
        let channel = gpushare_proto::connect_unix(socket).await?;
        let mut lists = DevicePluginClient::new(channel)
            .list_and_watch(Empty {})
            .await?
            .into_inner();
        let first = lists.message().await?.ok_or(ProbeError::Ended)?;
        Ok::<_, ProbeError>(first.devices.into_iter().map(|device| device.id).collect())
    };
    tokio::time::timeout(timeout, ask)
        .await
        .map_err(|_| ProbeError::Timeout(timeout))?
}

/// The IDs in `served` that kubelet recorded, sorted and once each.
fn shared_ids(recorded: &HashSet<String>, served: &[String]) -> Vec<String> {
    let mut shared: Vec<String> = served
        .iter()
        .filter(|id| recorded.contains(*id))
        .cloned()
        .collect();
    shared.sort();
    shared.dedup();
    shared
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::sync::{Arc, Mutex};

    use futures::{Stream, StreamExt};
    use gpushare_proto::HEALTHY;
    use gpushare_proto::v1beta1::device_plugin_server::{DevicePlugin, DevicePluginServer};
    use gpushare_proto::v1beta1::{
        AllocateRequest, AllocateResponse, Device, DevicePluginOptions, ListAndWatchResponse,
        PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
        PreferredAllocationResponse,
    };
    use tokio_stream::wrappers::UnixListenerStream;
    use tonic::{Request, Response, Status};

    use super::*;

    const CLASSIC: &str = "aliyun.com/gpu-mem";
    /// Our socket, as the server names it.
    const OURS: &str = crate::server::SOCKET_NAME;

    /// A device plugin that lists `ids` and then, as real plugins do, keeps the stream open.
    struct FakePlugin {
        ids: Vec<String>,
    }

    type Lists = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

    #[tonic::async_trait]
    impl DevicePlugin for FakePlugin {
        async fn get_device_plugin_options(
            &self,
            _: Request<Empty>,
        ) -> Result<Response<DevicePluginOptions>, Status> {
            Ok(Response::new(DevicePluginOptions::default()))
        }

        type ListAndWatchStream = Lists;

        async fn list_and_watch(
            &self,
            _: Request<Empty>,
        ) -> Result<Response<Self::ListAndWatchStream>, Status> {
            let devices = self
                .ids
                .iter()
                .map(|id| Device {
                    id: id.clone(),
                    health: HEALTHY.to_owned(),
                    topology: None,
                })
                .collect();
            let first = futures::stream::iter([Ok(ListAndWatchResponse { devices })]);
            Ok(Response::new(Box::pin(
                first.chain(futures::stream::pending()),
            )))
        }

        async fn get_preferred_allocation(
            &self,
            _: Request<PreferredAllocationRequest>,
        ) -> Result<Response<PreferredAllocationResponse>, Status> {
            Err(Status::unimplemented("not in this test"))
        }

        async fn allocate(
            &self,
            _: Request<AllocateRequest>,
        ) -> Result<Response<AllocateResponse>, Status> {
            Err(Status::unimplemented("not in this test"))
        }

        async fn pre_start_container(
            &self,
            _: Request<PreStartContainerRequest>,
        ) -> Result<Response<PreStartContainerResponse>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
    }

    /// The classic gpushare plugin's IDs for `n` GiB of GPU `uuid`.
    fn classic_ids(uuid: &str, n: u32) -> Vec<String> {
        (0..n).map(|i| format!("{uuid}-_-{i}")).collect()
    }

    /// Serves a fake plugin listing `ids` on `dir/name` until the test ends.
    fn serve(dir: &Path, name: &str, ids: Vec<String>) -> PathBuf {
        let path = dir.join(name);
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(DevicePluginServer::new(FakePlugin { ids }))
                .serve_with_incoming(UnixListenerStream::new(listener)),
        );
        path
    }

    /// A socket file nobody serves any more, as a removed plugin leaves it.
    fn dead_socket(dir: &Path, name: &str) {
        drop(std::os::unix::net::UnixListener::bind(dir.join(name)).unwrap());
        assert!(std::os::unix::net::UnixStream::connect(dir.join(name)).is_err());
    }

    /// Writes kubelet's checkpoint recording `registered` (resource, IDs), as kubelet does.
    fn write_checkpoint(dir: &Path, registered: &[(&str, &[String])]) {
        let registered: serde_json::Map<String, serde_json::Value> = registered
            .iter()
            .map(|(resource, ids)| ((*resource).to_owned(), serde_json::json!(ids)))
            .collect();
        let checkpoint = serde_json::json!({
            "Data": {
                "PodDeviceEntries": [{
                    "PodUID": "5e3c0a4e-0000-4000-8000-000000000001",
                    "ContainerName": "main",
                    "ResourceName": CLASSIC,
                    "DeviceIDs": {"-1": ["GPU-a-_-0"]},
                    "AllocResp": "CiQKFk5WSURJQV9WSVNJQkxFX0RFVklDRVMSCkdQVS1h",
                }],
                "RegisteredDevices": registered,
            },
            "Checksum": 2_839_461_120_u64,
        });
        std::fs::write(dir.join(CHECKPOINT), checkpoint.to_string()).unwrap();
    }

    async fn run_check(dir: &Path, resource: &str) -> Result<()> {
        refuse_if_registered_elsewhere(dir, resource, &dir.join(OURS)).await
    }

    /// What a subscriber installed with [`Logs::install`] wrote.
    #[derive(Clone, Default)]
    struct Logs(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Logs {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Logs {
        /// Captures this thread's logs (a `#[tokio::test]` runs on one) until the guard drops.
        fn install(&self) -> tracing::subscriber::DefaultGuard {
            let logs = self.clone();
            let subscriber = tracing_subscriber::fmt()
                .with_writer(move || logs.clone())
                .with_ansi(false)
                .finish();
            tracing::subscriber::set_default(subscriber)
        }

        fn text(&self) -> String {
            String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
        }
    }

    /// The classic plugin still runs and kubelet's record of our name is its devices: we
    /// refuse, naming the resource, its socket, some shared IDs and what to do.
    #[tokio::test]
    async fn a_live_plugin_serving_the_recorded_devices_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let ids = classic_ids("GPU-a", 16);
        write_checkpoint(dir.path(), &[(CLASSIC, &ids)]);
        let socket = serve(dir.path(), "aliyungpushare.sock", ids);
        serve(dir.path(), "nvidia-gpu.sock", vec!["GPU-b".to_owned()]);

        let err = run_check(dir.path(), CLASSIC).await.unwrap_err();

        let Error::RegisteredElsewhere {
            resource,
            socket: named,
            shared,
            examples,
        } = &err
        else {
            panic!("{err}");
        };
        assert_eq!((resource.as_str(), named), (CLASSIC, &socket));
        assert_eq!(*shared, 16);
        assert_eq!(examples, &["GPU-a-_-0", "GPU-a-_-1", "GPU-a-_-10"]);
        let message = err.to_string();
        for part in [
            CLASSIC,
            &socket.display().to_string(),
            "GPU-a-_-0",
            "Remove the other plugin",
            "--resource,",
            "charts/gpushare/README.md",
        ] {
            assert!(message.contains(part), "{part:?} not in {message}");
        }
    }

    /// The classic plugin was removed before we start (docs/migrating.md): kubelet still
    /// records its devices for our name and its socket file may linger, but nothing serves
    /// it.
    #[tokio::test]
    async fn a_stale_record_of_a_removed_plugin_does_not_block() {
        let dir = tempfile::tempdir().unwrap();
        write_checkpoint(dir.path(), &[(CLASSIC, &classic_ids("GPU-a", 16))]);
        dead_socket(dir.path(), "aliyungpushare.sock");
        serve(dir.path(), "nvidia-gpu.sock", vec!["GPU-b".to_owned()]);

        run_check(dir.path(), CLASSIC).await.unwrap();
    }

    /// NVIDIA's plugin on the same node serves `nvidia.com/gpu` (whole GPUs): other
    /// devices than the ones recorded for our name, not a conflict.
    #[tokio::test]
    async fn a_plugin_serving_other_devices_does_not_block() {
        let dir = tempfile::tempdir().unwrap();
        let ours = ["GPU-a-0", "GPU-a-1"].map(str::to_owned);
        let nvidia = ["GPU-a", "GPU-b"].map(str::to_owned);
        write_checkpoint(
            dir.path(),
            &[
                (gpushare_contract::DEFAULT_RESOURCE, &ours),
                ("nvidia.com/gpu", &nvidia),
            ],
        );
        serve(dir.path(), "nvidia-gpu.sock", nvidia.to_vec());

        run_check(dir.path(), gpushare_contract::DEFAULT_RESOURCE)
            .await
            .unwrap();
    }

    /// Our own earlier registration, on a restart or while a rollout's old pod still serves
    /// our socket, is not another plugin; neither is kubelet's socket.
    #[tokio::test]
    async fn our_own_socket_does_not_block_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let ours = ["GPU-a-0", "GPU-a-1"].map(str::to_owned);
        write_checkpoint(dir.path(), &[(CLASSIC, &ours)]);
        serve(dir.path(), OURS, ours.to_vec());
        serve(dir.path(), KUBELET_SOCKET, ours.to_vec());

        run_check(dir.path(), CLASSIC).await.unwrap();
    }

    /// A node where kubelet never recorded a device (or a directory that is not kubelet's):
    /// whatever serves sockets there registered nothing kubelet knows of.
    #[tokio::test]
    async fn without_a_checkpoint_nothing_blocks() {
        let dir = tempfile::tempdir().unwrap();
        serve(dir.path(), "aliyungpushare.sock", classic_ids("GPU-a", 4));

        run_check(dir.path(), CLASSIC).await.unwrap();
    }

    /// A checkpoint we cannot read is never a reason to stay down: it is logged, naming
    /// the file, and the plugin starts.
    #[tokio::test]
    async fn a_malformed_checkpoint_is_logged_and_does_not_block() {
        let dir = tempfile::tempdir().unwrap();
        serve(dir.path(), "aliyungpushare.sock", classic_ids("GPU-a", 4));
        for malformed in [
            "{\"Data\": {\"RegisteredDevices\": {\"aliyun.com/gpu-mem\": [\"GPU-a-_-0\"",
            "{\"Data\": {\"RegisteredDevices\": {\"aliyun.com/gpu-mem\": \"GPU-a-_-0\"}}}",
            "{\"RegisteredDevices\": {\"aliyun.com/gpu-mem\": [\"GPU-a-_-0\"]}}",
            "\u{0}\u{1}binary",
        ] {
            std::fs::write(dir.path().join(CHECKPOINT), malformed).unwrap();
            let logs = Logs::default();
            let outcome = {
                let _capture = logs.install();
                run_check(dir.path(), CLASSIC).await
            };
            assert!(outcome.is_ok(), "{malformed:?}: {outcome:?}");
            let text = logs.text();
            assert!(
                text.contains("WARN") && text.contains(CHECKPOINT),
                "{malformed:?}: {text}"
            );
        }
    }

    /// A socket whose process hangs (it never accepts) is given a deadline and is not a
    /// conflict; one beside it that does serve the recorded devices still is.
    #[tokio::test]
    async fn a_plugin_that_does_not_answer_is_not_a_conflict() {
        let dir = tempfile::tempdir().unwrap();
        let ids = classic_ids("GPU-a", 4);
        write_checkpoint(dir.path(), &[(CLASSIC, &ids)]);
        let _hung = std::os::unix::net::UnixListener::bind(dir.path().join("hung.sock")).unwrap();
        let deadline = Duration::from_secs(30);
        let timeout = Duration::from_secs(1);
        let own = dir.path().join(OURS);

        tokio::time::timeout(deadline, check(dir.path(), CLASSIC, &own, timeout))
            .await
            .expect("each socket has a deadline")
            .unwrap();

        let socket = serve(dir.path(), "aliyungpushare.sock", ids);
        let err = tokio::time::timeout(deadline, check(dir.path(), CLASSIC, &own, timeout))
            .await
            .expect("each socket has a deadline")
            .unwrap_err();
        assert!(
            matches!(&err, Error::RegisteredElsewhere { socket: named, .. } if named == &socket),
            "{err}"
        );
    }

    /// The checkpoint as kubelet writes it: pod entries in either kubelet's shape (IDs per
    /// NUMA node, or the older flat list), `null` for a resource without devices, fields
    /// added later (`BootID`); only our resource's IDs are taken.
    #[test]
    fn the_checkpoint_is_read_as_kubelet_writes_it() {
        let checkpoint = br#"{
            "Data": {
                "PodDeviceEntries": [
                    {"PodUID": "u1", "ContainerName": "a", "ResourceName": "aliyun.com/gpu-mem",
                     "DeviceIDs": {"0": ["GPU-a-_-0"], "-1": ["GPU-a-_-1"]}, "AllocResp": "CgA="},
                    {"PodUID": "u2", "ContainerName": "b", "ResourceName": "nvidia.com/gpu",
                     "DeviceIDs": ["GPU-b"], "AllocResp": null}
                ],
                "RegisteredDevices": {
                    "aliyun.com/gpu-mem": ["GPU-a-_-1", "GPU-a-_-0"],
                    "nvidia.com/gpu": ["GPU-b"],
                    "example.com/gpu-mem": null
                }
            },
            "Checksum": 1918129312,
            "BootID": "8d6f0c1e"
        }"#;
        let ids = |resource| {
            let mut ids: Vec<String> = recorded_in(checkpoint, resource)
                .unwrap()
                .into_iter()
                .collect();
            ids.sort();
            ids
        };
        assert_eq!(ids("aliyun.com/gpu-mem"), ["GPU-a-_-0", "GPU-a-_-1"]);
        assert!(ids("example.com/gpu-mem").is_empty());
        assert!(ids("example.com/other").is_empty());
        let empty =
            br#"{"Data": {"PodDeviceEntries": null, "RegisteredDevices": null}, "Checksum": 0}"#;
        assert!(recorded_in(empty, CLASSIC).unwrap().is_empty());
    }
}
