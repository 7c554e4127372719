//! A kubelet, as far as device plugins and pod admission go.
//!
//! It does what kubelet's device manager does, over the same unix sockets and gRPC API:
//!
//! ```text
//!   <dir>/kubelet.sock ◀── Register ── plugin
//!        │ dial <dir>/<endpoint>: GetDevicePluginOptions, ListAndWatch (kept open)
//!        ▼
//!   pods bound to the node (watch) ─▶ admit one at a time:
//!        per container (init first): GetPreferredAllocation ─▶ Allocate ─▶ record env
//!        ok ─▶ status Running          error ─▶ status Failed / UnexpectedAdmissionError
//! ```
//!
//! Devices are tracked per pod and container, freed when the pod is deleted or finishes, and
//! those of init containers are reused by the app containers after them, as kubelet does.
//! (Restarts of kubelet itself are the real tier's.) The PodResources API (`v1`) is served on
//! [`KubeletDriver::pod_resources_socket`] from the devices really handed out.
//!
//! Admission order is kubelet's (creation time) or a seeded shuffle, to prove that the device
//! plugin gives every container the right GPU whatever order kubelet admits pods in.
//!
//! The module is split by job, each in its own file:
//! - `registration`: the Registration server on `kubelet.sock`;
//! - `plugin`: the client side of one registered plugin (options, ListAndWatch);
//! - `capacity`: node capacity and allocatable from the device lists;
//! - `admission`: the pod watch and the admission sweep;
//! - `allocation`: picking devices and calling GetPreferredAllocation and Allocate;
//! - `status`: the pod status writer;
//! - `pod_resources`: the PodResources API.
//!
//! This file holds the state they share and [`KubeletDriver`], the handle tests use.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::Context as _;
use gpushare_proto::KUBELET_SOCKET;
use gpushare_proto::v1beta1::DevicePluginOptions;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::runtime::reflector::{self, Store};
use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

mod admission;
mod allocation;
mod capacity;
mod plugin;
mod pod_resources;
mod registration;
mod status;

use admission::Admission;
use capacity::sync_node_capacity;
use registration::serve_registration;

/// A mount a device plugin's Allocate answered: (container path, host path, read-only).
pub type GrantedMount = (String, String, bool);

/// What a container got from Allocate: its environment and mounts.
type Granted = (BTreeMap<String, String>, Vec<GrantedMount>);

/// The order in which pods seen in one sweep are admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdmissionOrder {
    /// Oldest first, as kubelet does.
    CreationTime,
    /// A shuffle from this seed: any order kubelet might produce under load.
    Shuffled(u64),
}

/// A registered plugin, as the device manager keeps it.
struct Plugin {
    generation: u64,
    endpoint: PathBuf,
    options: Option<DevicePluginOptions>,
    channel: Option<Channel>,
    devices: Vec<(String, bool)>,
    /// NUMA nodes of each device that reported a topology.
    numa: HashMap<String, Vec<i64>>,
    /// The first ListAndWatch answer arrived.
    listed: bool,
    task: JoinHandle<()>,
}

/// What the admission loop and the tests share.
#[derive(Default)]
struct State {
    plugins: BTreeMap<String, Plugin>,
    /// Clients of plugins a newer registration replaced: kubelet keeps them running until
    /// their stream ends (then marks the resource unhealthy, as for any client).
    replaced: Vec<JoinHandle<()>>,
    registrations: HashMap<String, u64>,
    next_generation: u64,
    /// The environment and mounts each container got from Allocate, by (namespace, pod,
    /// container).
    granted: HashMap<(String, String, String), Granted>,
    errors: Vec<(String, String)>,
    /// Admitted pods by UID: `namespace/name` and devices held per resource.
    admitted: HashMap<String, (String, HashMap<String, Vec<String>>)>,
    /// Devices per pod (by UID), container and resource, recorded as each container's
    /// Allocate succeeds (kubelet's `podDevices`): what PodResources reports.
    container_devices: HashMap<String, ContainerDevices>,
    /// Pods (`namespace/name`) not admitted until released, as if kubelet saw them late.
    held: HashSet<String>,
    /// Pods whose admission failed (by UID); never retried.
    rejected: HashSet<String>,
}

/// Container name → resource → device IDs.
pub type ContainerDevices = BTreeMap<String, BTreeMap<String, Vec<String>>>;

struct Shared {
    dir: PathBuf,
    state: Mutex<State>,
    changes: watch::Sender<u64>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        crate::locked(&self.state)
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n += 1);
    }
}

/// A socket being served: registration, or PodResources.
struct ServedSocket {
    stop: CancellationToken,
    task: JoinHandle<Result<(), tonic::transport::Error>>,
}

impl ServedSocket {
    /// Serves `router` on a fresh unix socket at `path` (a stale one is removed first).
    fn serve(path: &Path, router: tonic::transport::server::Router) -> anyhow::Result<Self> {
        let _ = std::fs::remove_file(path);
        let listener = tokio::net::UnixListener::bind(path)
            .with_context(|| format!("binding {}", path.display()))?;
        let stop = CancellationToken::new();
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
        let shutdown = stop.clone().cancelled_owned();
        let task = tokio::spawn(router.serve_with_incoming_shutdown(incoming, shutdown));
        Ok(Self { stop, task })
    }

    async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// Oldest first, then by name: the order kubelet takes pods in.
fn by_creation(a: &Pod, b: &Pod) -> std::cmp::Ordering {
    let created = |pod: &Pod| pod.metadata.creation_timestamp.as_ref().map(|t| t.0);
    let by_name = || a.metadata.name.cmp(&b.metadata.name);
    created(a).cmp(&created(b)).then_with(by_name)
}

/// The test kubelet of one node.
pub struct KubeletDriver {
    shared: Arc<Shared>,
    registration: Option<ServedSocket>,
    pod_resources: Option<ServedSocket>,
    pods: Store<Pod>,
    stop: CancellationToken,
    admission: JoinHandle<()>,
}

impl KubeletDriver {
    /// Serves Registration on `<dir>/kubelet.sock`; accepts plugin registrations; for each
    /// registered plugin dials `<dir>/<endpoint>`, calls GetDevicePluginOptions and consumes
    /// ListAndWatch; also watches pods bound to `node_name` through `client` and admits them.
    pub async fn start(
        dir: &Path,
        node_name: &str,
        client: Client,
        order: AdmissionOrder,
    ) -> anyhow::Result<KubeletDriver> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let shared = Arc::new(Shared {
            dir: dir.to_owned(),
            state: Mutex::new(State::default()),
            changes: watch::Sender::new(0),
        });
        let registration = serve_registration(shared.clone()).await?;
        let (pods, writer) = reflector::store();
        let pod_resources = pod_resources::serve(shared.clone(), pods.clone()).await?;
        let stop = CancellationToken::new();
        tokio::spawn(sync_node_capacity(
            shared.clone(),
            client.clone(),
            node_name.to_owned(),
            stop.clone(),
        ));
        let admission = tokio::spawn(
            Admission {
                shared: shared.clone(),
                client,
                node: node_name.to_owned(),
                order,
                rng: StdRng::seed_from_u64(match order {
                    AdmissionOrder::Shuffled(seed) => seed,
                    AdmissionOrder::CreationTime => 0,
                }),
            }
            .run(writer, stop.clone()),
        );
        Ok(KubeletDriver {
            shared,
            registration: Some(registration),
            pod_resources: Some(pod_resources),
            pods,
            stop,
            admission,
        })
    }

    /// Resources whose plugin is registered and has sent its device list.
    pub fn registered_resources(&self) -> Vec<String> {
        self.shared
            .lock()
            .plugins
            .iter()
            .filter(|(_, plugin)| plugin.listed)
            .map(|(resource, _)| resource.clone())
            .collect()
    }

    /// How many times a plugin registered `resource` since start.
    pub fn registrations(&self, resource: &str) -> u64 {
        self.shared
            .lock()
            .registrations
            .get(resource)
            .copied()
            .unwrap_or(0)
    }

    /// The socket the plugin of `resource` registered last.
    pub fn plugin_socket(&self, resource: &str) -> Option<PathBuf> {
        let state = self.shared.lock();
        state.plugins.get(resource).map(|p| p.endpoint.clone())
    }

    /// The last device list of `resource`: (ID, healthy).
    pub fn devices(&self, resource: &str) -> Vec<(String, bool)> {
        self.shared
            .lock()
            .plugins
            .get(resource)
            .map(|plugin| plugin.devices.clone())
            .unwrap_or_default()
    }

    /// Waits until `cond` holds, re-checking on every change (and at least every 100 ms).
    pub async fn wait_until(
        &self,
        timeout: Duration,
        what: &str,
        cond: impl Fn(&Self) -> bool,
    ) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut changes = self.shared.changes.subscribe();
        loop {
            changes.borrow_and_update();
            if cond(self) {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                anyhow::bail!("timed out after {timeout:?} waiting for {what}");
            }
            let _ = tokio::time::timeout(Duration::from_millis(100), changes.changed()).await;
        }
    }

    /// Waits until a plugin for `resource` is registered and has listed its devices.
    pub async fn wait_registered(&self, resource: &str, timeout: Duration) -> anyhow::Result<()> {
        self.wait_until(timeout, &format!("a device plugin for {resource}"), |k| {
            k.registered_resources().iter().any(|r| r == resource)
        })
        .await
    }

    /// Environment each container got from Allocate, keyed by (namespace, pod, container).
    pub fn container_env(&self, ns: &str, pod: &str, c: &str) -> Option<BTreeMap<String, String>> {
        self.granted(ns, pod, c).map(|(env, _)| env)
    }

    /// Mounts each container got from Allocate: (container path, host path, read-only).
    pub fn container_mounts(&self, ns: &str, pod: &str, c: &str) -> Vec<GrantedMount> {
        self.granted(ns, pod, c).unwrap_or_default().1
    }

    fn granted(&self, ns: &str, pod: &str, c: &str) -> Option<Granted> {
        let key = (ns.to_owned(), pod.to_owned(), c.to_owned());
        self.shared.lock().granted.get(&key).cloned()
    }

    /// Device IDs held by the admitted pod `ns/pod`, per resource.
    pub fn pod_devices(&self, ns: &str, pod: &str) -> HashMap<String, Vec<String>> {
        let key = format!("{ns}/{pod}");
        self.shared
            .lock()
            .admitted
            .values()
            .find(|(k, _)| *k == key)
            .map(|(_, devices)| devices.clone())
            .unwrap_or_default()
    }

    /// Pods whose admission failed: (`namespace/name`, message).
    pub fn admission_errors(&self) -> Vec<(String, String)> {
        self.shared.lock().errors.clone()
    }

    /// Where this kubelet serves the PodResources API (`<dir>/pod-resources/kubelet.sock`,
    /// as kubelet's `/var/lib/kubelet/pod-resources/kubelet.sock`).
    pub fn pod_resources_socket(&self) -> PathBuf {
        pod_resources::socket(&self.shared.dir)
    }

    /// Devices each container of the pod `ns/pod` holds, per resource, as PodResources
    /// reports them (recorded when each container's Allocate succeeded).
    pub fn container_devices(&self, ns: &str, pod: &str) -> ContainerDevices {
        self.pods
            .state()
            .iter()
            .filter(|p| p.metadata.namespace.as_deref() == Some(ns))
            .filter(|p| p.metadata.name.as_deref() == Some(pod))
            .find_map(|p| {
                let uid = p.metadata.uid.as_deref()?;
                self.shared.lock().container_devices.get(uid).cloned()
            })
            .unwrap_or_default()
    }

    /// Keeps the pod `ns/pod` from being admitted until [`Self::release`]: a kubelet that
    /// learns of a pod late (its watch lags), while it admits others bound after it.
    pub fn hold(&self, ns: &str, pod: &str) {
        self.shared.lock().held.insert(format!("{ns}/{pod}"));
    }

    /// Admits the pod `ns/pod` again from the next sweep (see [`Self::hold`]).
    pub fn release(&self, ns: &str, pod: &str) {
        self.shared.lock().held.remove(&format!("{ns}/{pod}"));
        self.shared.changed();
    }

    /// Stops serving and admitting, and drops every plugin's client.
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        for socket in [self.registration.take(), self.pod_resources.take()]
            .into_iter()
            .flatten()
        {
            socket.stop().await;
        }
        {
            let mut state = self.shared.lock();
            let plugins = std::mem::take(&mut state.plugins).into_values();
            for task in plugins.map(|p| p.task).chain(state.replaced.drain(..)) {
                task.abort();
            }
        }
        let _ = std::fs::remove_file(self.pod_resources_socket());
        let _ = (&mut self.admission).await;
        let _ = std::fs::remove_file(self.shared.dir.join(KUBELET_SOCKET));
    }
}

impl Drop for KubeletDriver {
    fn drop(&mut self) {
        self.stop.cancel();
        for socket in [&self.registration, &self.pod_resources]
            .into_iter()
            .flatten()
        {
            socket.stop.cancel();
        }
    }
}
