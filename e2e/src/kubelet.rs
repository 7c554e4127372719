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
//! Devices are tracked per pod and container and freed when the pod is deleted or finishes,
//! and devices of init containers are reused by the app containers after them, as kubelet
//! does. A restart ([`KubeletDriver::restart`]) removes every socket in the directory and
//! forgets every plugin, like a real kubelet restart: plugins must notice and register again.
//!
//! Like kubelet, it serves the PodResources API (`v1`: `List`, `Get`,
//! `GetAllocatableResources`) on `<dir>/pod-resources/kubelet.sock`
//! ([`KubeletDriver::pod_resources_socket`]), from the devices it really handed out:
//!
//! ```text
//!   List ─▶ every active pod bound here (not Succeeded/Failed, not rejected at admission),
//!           admitted or still waiting: sidecar init containers, then app containers
//!           (ordinary init containers are never listed), each with the devices recorded
//!           when its Allocate succeeded, one ContainerDevices per device and NUMA node
//! ```
//!
//! Admission order is kubelet's (creation time) or a seeded shuffle, to prove that the device
//! plugin gives every container the right GPU whatever order kubelet admits pods in.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::Context as _;
use futures::{FutureExt, StreamExt};
use gpushare_proto::v1beta1::device_plugin_client::DevicePluginClient;
use gpushare_proto::v1beta1::registration_server::{Registration, RegistrationServer};
use gpushare_proto::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest,
    DevicePluginOptions, Empty, PreferredAllocationRequest, RegisterRequest,
};
use gpushare_proto::{HEALTHY, KUBELET_SOCKET, VERSION};
use k8s_openapi::api::core::v1::{Container, Pod};
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};

/// A mount a device plugin's Allocate answered: (container path, host path, read-only).
pub type GrantedMount = (String, String, bool);

/// The order in which pods seen in one sweep are admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdmissionOrder {
    /// Oldest first, as kubelet does.
    CreationTime,
    /// A shuffle from this seed: any order kubelet might produce under load.
    Shuffled(u64),
}

/// How often pods are swept even without events.
const SWEEP: Duration = Duration::from_millis(500);

/// A registered plugin, as the device manager keeps it.
struct Plugin {
    generation: u64,
    /// The socket the plugin registered.
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
    envs: HashMap<(String, String, String), BTreeMap<String, String>>,
    /// Mounts each container got from Allocate, by (namespace, pod, container).
    mounts: HashMap<(String, String, String), Vec<GrantedMount>>,
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
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n += 1);
    }
}

/// What kubelet's node status manager does with device plugin lists: the node's capacity of
/// each resource is its plugin's device count, allocatable the healthy ones. Patched on the
/// `nodes/status` subresource whenever a list changes.
async fn sync_node_capacity(
    shared: Arc<Shared>,
    client: Client,
    node: String,
    stop: CancellationToken,
) {
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client);
    let mut changes = shared.changes.subscribe();
    let mut written: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    loop {
        let wanted: BTreeMap<String, (usize, usize)> = shared
            .lock()
            .plugins
            .iter()
            .filter(|(_, plugin)| plugin.listed)
            .map(|(resource, plugin)| {
                let healthy = plugin
                    .devices
                    .iter()
                    .filter(|(_, healthy)| *healthy)
                    .count();
                (resource.clone(), (plugin.devices.len(), healthy))
            })
            .collect();
        let stale: BTreeMap<_, _> = wanted
            .iter()
            .filter(|(r, v)| written.get(*r) != Some(v))
            .collect();
        if !stale.is_empty() {
            let capacity: serde_json::Map<_, _> = stale
                .iter()
                .map(|(r, (total, _))| ((*r).clone(), total.to_string().into()))
                .collect();
            let allocatable: serde_json::Map<_, _> = stale
                .iter()
                .map(|(r, (_, healthy))| ((*r).clone(), healthy.to_string().into()))
                .collect();
            let patch =
                serde_json::json!({"status": {"capacity": capacity, "allocatable": allocatable}});
            match nodes
                .patch_status(&node, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => written.extend(stale.into_iter().map(|(r, v)| (r.clone(), *v))),
                Err(error) => {
                    tracing::warn!(%node, %error, "node capacity update failed; retrying")
                }
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            _ = changes.changed() => {}
            () = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
}

use gpushare_proto::connect_unix as connect;

mod pod_resources;

struct RegistrationService {
    shared: Arc<Shared>,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let request = request.into_inner();
        if request.version != VERSION {
            return Err(Status::invalid_argument(format!(
                "unsupported device plugin API version {:?}; kubelet speaks {VERSION}",
                request.version
            )));
        }
        if request.resource_name.is_empty() || request.endpoint.is_empty() {
            return Err(Status::invalid_argument(
                "resource_name and endpoint are required",
            ));
        }
        let resource = request.resource_name.clone();
        let path = self.shared.dir.join(&request.endpoint);
        let mut state = self.shared.lock();
        state.next_generation += 1;
        let generation = state.next_generation;
        *state.registrations.entry(resource.clone()).or_default() += 1;
        // Like kubelet, connect to the plugin after answering the registration.
        let task = tokio::spawn(run_plugin(
            self.shared.clone(),
            resource.clone(),
            path.clone(),
            generation,
        ));
        let old = state.plugins.insert(
            resource.clone(),
            Plugin {
                generation,
                endpoint: path,
                options: request.options,
                channel: None,
                devices: Vec::new(),
                numa: HashMap::new(),
                listed: false,
                task,
            },
        );
        if let Some(old) = old {
            state.replaced.retain(|task| !task.is_finished());
            state.replaced.push(old.task);
        }
        drop(state);
        tracing::info!(%resource, endpoint = %request.endpoint, "device plugin registered");
        self.shared.changed();
        Ok(Response::new(Empty {}))
    }
}

/// Dials a registered plugin and keeps its device list current from ListAndWatch.
async fn run_plugin(shared: Arc<Shared>, resource: String, path: PathBuf, generation: u64) {
    let result: anyhow::Result<()> = async {
        let channel = connect(&path)
            .await
            .with_context(|| format!("dialing plugin {}", path.display()))?;
        let mut client = DevicePluginClient::new(channel.clone());
        let options = client
            .get_device_plugin_options(Empty {})
            .await
            .context("GetDevicePluginOptions")?
            .into_inner();
        let mut stream = client
            .list_and_watch(Empty {})
            .await
            .context("ListAndWatch")?
            .into_inner();
        {
            let mut state = shared.lock();
            let Some(plugin) = state.plugins.get_mut(&resource) else {
                return Ok(());
            };
            if plugin.generation != generation {
                return Ok(());
            }
            plugin.options = Some(options);
            plugin.channel = Some(channel);
        }
        // Like kubelet's PluginListAndWatchReceiver, a list updates the resource's devices
        // whichever client it came from.
        while let Some(list) = stream.message().await.context("ListAndWatch stream")? {
            let mut state = shared.lock();
            let Some(plugin) = state.plugins.get_mut(&resource) else {
                return Ok(());
            };
            plugin.numa = list
                .devices
                .iter()
                .filter_map(|device| {
                    let nodes: Vec<i64> = device
                        .topology
                        .as_ref()?
                        .nodes
                        .iter()
                        .map(|n| n.id)
                        .collect();
                    (!nodes.is_empty()).then(|| (device.id.clone(), nodes))
                })
                .collect();
            plugin.devices = list
                .devices
                .into_iter()
                .map(|device| (device.id, device.health == HEALTHY))
                .collect();
            plugin.listed = true;
            drop(state);
            shared.changed();
        }
        Ok(())
    }
    .await;
    if let Err(err) = result {
        tracing::warn!(%resource, error = format!("{err:#}"), "device plugin connection failed");
    }
    // As kubelet does when any client's stream ends (PluginDisconnected is per resource): the
    // resource's devices become unusable, even when the stream was that of a plugin a newer
    // registration already replaced. Only a later list makes them healthy again.
    let mut state = shared.lock();
    if let Some(plugin) = state.plugins.get_mut(&resource) {
        if plugin.generation != generation {
            tracing::info!(%resource, "a replaced plugin's stream ended: devices marked unhealthy, as kubelet does");
        }
        for device in &mut plugin.devices {
            device.1 = false;
        }
    }
    drop(state);
    shared.changed();
}

/// A socket being served: registration, or PodResources.
struct ServedSocket {
    stop: CancellationToken,
    task: JoinHandle<Result<(), tonic::transport::Error>>,
}

async fn serve_registration(shared: Arc<Shared>) -> anyhow::Result<ServedSocket> {
    let path = shared.dir.join(KUBELET_SOCKET);
    let _ = std::fs::remove_file(&path);
    let listener =
        UnixListener::bind(&path).with_context(|| format!("binding {}", path.display()))?;
    let stop = CancellationToken::new();
    let task = tokio::spawn(
        Server::builder()
            .add_service(RegistrationServer::new(RegistrationService { shared }))
            .serve_with_incoming_shutdown(
                UnixListenerStream::new(listener),
                stop.clone().cancelled_owned(),
            ),
    );
    Ok(ServedSocket { stop, task })
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
    pub fn container_env(
        &self,
        ns: &str,
        pod: &str,
        container: &str,
    ) -> Option<BTreeMap<String, String>> {
        self.shared
            .lock()
            .envs
            .get(&(ns.to_owned(), pod.to_owned(), container.to_owned()))
            .cloned()
    }

    /// Mounts each container got from Allocate: (container path, host path, read-only).
    pub fn container_mounts(&self, ns: &str, pod: &str, container: &str) -> Vec<GrantedMount> {
        self.shared
            .lock()
            .mounts
            .get(&(ns.to_owned(), pod.to_owned(), container.to_owned()))
            .cloned()
            .unwrap_or_default()
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

    /// kubelet restart: stop serving, remove the sockets (kubelet.sock and the plugins'),
    /// forget every plugin, and serve a new kubelet.sock. Plugins must register again. The
    /// PodResources socket is served anew; the devices handed out survive, as kubelet
    /// restores them from its checkpoint.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        if let Some(registration) = self.registration.take() {
            registration.stop.cancel();
            let _ = registration.task.await;
        }
        if let Some(pod_resources) = self.pod_resources.take() {
            pod_resources.stop.cancel();
            let _ = pod_resources.task.await;
        }
        {
            let mut state = self.shared.lock();
            for (_, plugin) in std::mem::take(&mut state.plugins) {
                plugin.task.abort();
            }
            for task in std::mem::take(&mut state.replaced) {
                task.abort();
            }
        }
        for entry in std::fs::read_dir(&self.shared.dir)?.flatten() {
            if entry.path().extension().is_some_and(|ext| ext == "sock") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        self.shared.changed();
        self.registration = Some(serve_registration(self.shared.clone()).await?);
        self.pod_resources =
            Some(pod_resources::serve(self.shared.clone(), self.pods.clone()).await?);
        Ok(())
    }

    /// Stops serving and admitting.
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        if let Some(registration) = self.registration.take() {
            registration.stop.cancel();
            let _ = registration.task.await;
        }
        if let Some(pod_resources) = self.pod_resources.take() {
            pod_resources.stop.cancel();
            let _ = pod_resources.task.await;
            let _ = std::fs::remove_file(self.pod_resources_socket());
        }
        {
            let mut state = self.shared.lock();
            for (_, plugin) in std::mem::take(&mut state.plugins) {
                plugin.task.abort();
            }
            for task in std::mem::take(&mut state.replaced) {
                task.abort();
            }
        }
        let _ = (&mut self.admission).await;
        let _ = std::fs::remove_file(self.shared.dir.join(KUBELET_SOCKET));
    }
}

impl Drop for KubeletDriver {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(registration) = &self.registration {
            registration.stop.cancel();
        }
        if let Some(pod_resources) = &self.pod_resources {
            pod_resources.stop.cancel();
        }
    }
}

/// Resource names a container asks for (limits win over requests), with whole quantities.
fn container_resources(container: &Container) -> BTreeMap<String, String> {
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

/// `namespace/name` of a pod.
fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

/// Names kubelet hands to device plugins: vendor-domain extended resources.
fn is_extended(name: &str) -> bool {
    name.contains('/') && !name.starts_with("kubernetes.io/") && !name.starts_with("requests.")
}

struct Admission {
    shared: Arc<Shared>,
    client: Client,
    node: String,
    order: AdmissionOrder,
    rng: StdRng,
}

impl Admission {
    async fn run(mut self, writer: reflector::store::Writer<Pod>, stop: CancellationToken) {
        let api: Api<Pod> = Api::all(self.client.clone());
        let store = writer.as_reader();
        let config = watcher::Config::default().fields(&format!("spec.nodeName={}", self.node));
        let stream = reflector::reflector(writer, watcher(api, config).default_backoff());
        let mut stream = std::pin::pin!(stream);
        let mut changes = self.shared.changes.subscribe();
        let mut synced = false;
        let mut tick = tokio::time::interval(SWEEP);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                event = stream.next() => {
                    let mut next = Some(event);
                    // Take every event already waiting, so one sweep sees them all.
                    while let Some(event) = next {
                        match event {
                            Some(Ok(watcher::Event::InitDone)) => synced = true,
                            Some(Ok(_)) => {}
                            Some(Err(err)) => tracing::warn!(error = %err, "kubelet pod watch failed"),
                            None => return,
                        }
                        next = stream.next().now_or_never();
                    }
                }
                _ = changes.changed() => {}
                _ = tick.tick() => {}
            }
            if synced {
                self.sweep(&store).await;
            }
        }
    }

    /// Frees devices of gone or finished pods, then admits new ones one at a time.
    async fn sweep(&mut self, store: &Store<Pod>) {
        let pods = store.state();
        let by_uid: HashMap<String, &Pod> = pods
            .iter()
            .filter_map(|pod| pod.metadata.uid.clone().map(|uid| (uid, pod.as_ref())))
            .collect();
        {
            let mut state = self.shared.lock();
            let live = |uid: &String| {
                by_uid.get(uid).is_some_and(|pod| {
                    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
                    !matches!(phase, Some("Succeeded" | "Failed"))
                })
            };
            state.admitted.retain(|uid, _| live(uid));
            state.container_devices.retain(|uid, _| live(uid));
        }
        let mut batch: Vec<&Pod> = {
            let state = self.shared.lock();
            by_uid
                .iter()
                .filter(|(uid, pod)| {
                    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
                    pod.spec.as_ref().and_then(|s| s.node_name.as_deref())
                        == Some(self.node.as_str())
                        && matches!(phase, None | Some("Pending"))
                        && pod.metadata.deletion_timestamp.is_none()
                        && !state.admitted.contains_key(uid.as_str())
                        && !state.rejected.contains(uid.as_str())
                        && !state.held.contains(&pod_key(pod))
                        && self.plugins_ready(&state, pod)
                })
                .map(|(_, pod)| *pod)
                .collect()
        };
        batch.sort_by(|a, b| {
            a.metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0)
                .cmp(&b.metadata.creation_timestamp.as_ref().map(|t| t.0))
                .then_with(|| a.metadata.name.cmp(&b.metadata.name))
        });
        if let AdmissionOrder::Shuffled(_) = self.order {
            batch.shuffle(&mut self.rng);
        }
        for pod in batch {
            self.admit(pod).await;
        }
    }

    /// A pod asking for an extended resource waits until its plugin is registered.
    fn plugins_ready(&self, state: &State, pod: &Pod) -> bool {
        let Some(spec) = &pod.spec else { return true };
        spec.init_containers
            .iter()
            .flatten()
            .chain(&spec.containers)
            .flat_map(container_resources)
            .filter(|(name, _)| is_extended(name))
            .all(|(name, _)| {
                state
                    .plugins
                    .get(&name)
                    .is_some_and(|p| p.listed && p.channel.is_some())
            })
    }

    async fn admit(&mut self, pod: &Pod) {
        let ns = pod
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let name = pod.metadata.name.clone().unwrap_or_default();
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let key = format!("{ns}/{name}");
        match self.allocate_pod(pod, &ns, &name).await {
            Ok(devices) => {
                self.shared
                    .lock()
                    .admitted
                    .insert(uid, (key.clone(), devices));
                tracing::debug!(pod = %key, "admitted");
                self.write_status(&ns, &name, running_status(pod));
            }
            Err(message) => {
                let message = format!("Pod was rejected: {message}");
                tracing::info!(pod = %key, %message, "admission failed");
                {
                    let mut state = self.shared.lock();
                    state.errors.push((key, message.clone()));
                    // A rejected pod is not active: kubelet drops what its containers held.
                    state.container_devices.remove(&uid);
                    state.rejected.insert(uid);
                }
                self.write_status(
                    &ns,
                    &name,
                    serde_json::json!({
                        "phase": "Failed",
                        "reason": "UnexpectedAdmissionError",
                        "message": message,
                    }),
                );
            }
        }
        self.shared.changed();
    }

    /// Allocates every container's devices, init containers first. On error nothing stays
    /// held (the devices were never recorded as the pod's).
    async fn allocate_pod(
        &mut self,
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
                let ids = self
                    .devices_for(
                        &resource,
                        count,
                        &held,
                        reusable.entry(resource.clone()).or_default(),
                    )
                    .await?;
                let (response, granted_mounts) = self.allocate(&resource, &ids).await?;
                mounts.extend(granted_mounts);
                // As kubelet's device manager: the container's devices are recorded (and
                // reported by PodResources) once its Allocate succeeded.
                let uid = pod.metadata.uid.clone().unwrap_or_default();
                self.shared
                    .lock()
                    .container_devices
                    .entry(uid)
                    .or_default()
                    .entry(container.name.clone())
                    .or_default()
                    .insert(resource.clone(), ids.clone());
                env.extend(response);
                let pod_held = held.entry(resource.clone()).or_default();
                for id in &ids {
                    if !pod_held.contains(id) {
                        pod_held.push(id.clone());
                    }
                }
                let reuse = reusable.entry(resource).or_default();
                if init && !sidecar {
                    for id in ids {
                        if !reuse.contains(&id) {
                            reuse.push(id);
                        }
                    }
                } else {
                    reuse.retain(|id| !ids.contains(id));
                }
            }
            if any {
                let key = (ns.to_owned(), name.to_owned(), container.name.clone());
                let mut shared = self.shared.lock();
                shared.mounts.insert(key.clone(), mounts);
                shared.envs.insert(key, env);
            }
        }
        Ok(held)
    }

    /// Picks `count` devices of `resource`: reusable init-container devices first, then
    /// free healthy ones as the plugin prefers.
    async fn devices_for(
        &self,
        resource: &str,
        count: usize,
        held: &HashMap<String, Vec<String>>,
        reusable: &mut Vec<String>,
    ) -> Result<Vec<String>, String> {
        let take = count.min(reusable.len());
        let reused: Vec<String> = reusable.drain(..take).collect();
        let (free, channel, preferred_available) = {
            let state = self.shared.lock();
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
                for id in ids {
                    if available.contains(&id) && !unique.contains(&id) {
                        unique.push(id);
                    }
                }
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
        &self,
        resource: &str,
        ids: &[String],
    ) -> Result<(BTreeMap<String, String>, Vec<GrantedMount>), String> {
        let channel = self
            .shared
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

    /// Writes the pod's status without waiting, as kubelet's status manager does: until it
    /// lands or the pod is gone. (kubelet retries a failed write at its next status sync; the
    /// extender and the device plugin read a pod's `startTime` as "admitted", so a status
    /// that is given up on would leave the pod looking unadmitted for good.)
    fn write_status(&self, ns: &str, name: &str, status: serde_json::Value) {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let name = name.to_owned();
        tokio::spawn(async move {
            let patch = serde_json::json!({ "status": status });
            for attempt in 0u32.. {
                match api
                    .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => return,
                    Err(kube::Error::Api(status)) if status.code == 404 => return,
                    Err(err) => {
                        tracing::warn!(pod = %name, error = %err, attempt, "pod status write failed; retrying");
                        let backoff = Duration::from_millis(50 << attempt.min(4));
                        tokio::time::sleep(backoff.min(Duration::from_secs(1))).await;
                    }
                }
            }
        });
    }
}

/// Status of a pod whose containers all started.
fn running_status(pod: &Pod) -> serde_json::Value {
    let now = jiff::Timestamp::now().to_string();
    let Some(spec) = &pod.spec else {
        return serde_json::json!({ "phase": "Running", "startTime": now });
    };
    let image = |c: &Container| c.image.clone().unwrap_or_default();
    let containers: Vec<serde_json::Value> = spec
        .containers
        .iter()
        .map(|c| {
            serde_json::json!({
                "name": c.name, "image": image(c), "imageID": "", "ready": true,
                "restartCount": 0, "started": true,
                "state": { "running": { "startedAt": now } },
            })
        })
        .collect();
    let init: Vec<serde_json::Value> = spec
        .init_containers
        .iter()
        .flatten()
        .map(|c| {
            serde_json::json!({
                "name": c.name, "image": image(c), "imageID": "", "ready": true,
                "restartCount": 0,
                "state": { "terminated": { "exitCode": 0, "reason": "Completed", "startedAt": now, "finishedAt": now } },
            })
        })
        .collect();
    serde_json::json!({
        "phase": "Running",
        "startTime": now,
        "conditions": [{ "type": "Ready", "status": "True", "lastTransitionTime": now }],
        "containerStatuses": containers,
        "initContainerStatuses": init,
    })
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
