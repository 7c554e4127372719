//! A kubelet, as far as DRA plugins go: plugin registration, NodePrepareResources and
//! NodeUnprepareResources over the real unix sockets, and the container runtime's part of
//! CDI (applying the `containerEdits` of the devices Prepare named).
//!
//! ```text
//!   <registry>/*.sock ◀── plugin watcher (polls the directory, as kubelet's does):
//!        GetInfo (DRAPlugin, v1.DRAPlugin) ─▶ dial endpoint ─▶ NotifyRegistrationStatus
//!   pods bound to the node (watch) ─▶ per pod, its claims (named, or recorded in its
//!        status from a template and owned by it; must be reserved for it):
//!        NodePrepareResources per driver ─▶ CDI ids per container (resources.claims)
//!        ─▶ env from the CDI specs ─▶ status Running
//!   pod deleting / finished / gone ─▶ NodeUnprepareResources for claims no other live pod
//!        here uses ─▶ a deleting pod is then removed (delete, grace 0)
//! ```
//!
//! A failed Prepare is retried on the next sweep, and recorded ([`DraKubelet::errors`]), as
//! kubelet keeps a pod in ContainerCreating with an event.
//!
//! kubelet's start-up deletion of its node's ResourceSlices is not copied here: the real
//! tier's `dra_kubelet_restart_keeps_claimed_pods` restarts a real kubelet instead.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::Context as _;
use futures::StreamExt;
use gpushare_proto::dra::v1::dra_plugin_client::DraPluginClient;
use gpushare_proto::dra::v1::{Claim, NodePrepareResourcesRequest, NodeUnprepareResourcesRequest};
use gpushare_proto::pluginregistration::registration_client::RegistrationClient;
use gpushare_proto::pluginregistration::{InfoRequest, RegistrationStatus};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// How often the registry directory and the pods are looked at without a watch event.
const SWEEP: Duration = Duration::from_millis(100);

/// A prepared claim, as kubelet's claim info cache holds it.
#[derive(Clone, Debug)]
struct PreparedClaim {
    namespace: String,
    name: String,
    driver: String,
    /// CDI device ids per request name.
    devices: Vec<(String, Vec<String>)>,
    /// Pods on this node using the claim.
    pods: HashSet<String>,
}

#[derive(Default)]
struct State {
    plugins: HashMap<String, DraPluginClient<Channel>>,
    /// Registration sockets handled, with the file seen and the driver it registered: a
    /// plugin that restarts binds a new socket at the same path, and is registered again
    /// (kubelet sees the create); a socket that goes (or is replaced) deregisters its driver,
    /// as kubelet's plugin watcher does on the file's removal.
    registered_sockets: HashMap<PathBuf, ((u64, i64, i64), String)>,
    registrations: u64,
    claims: HashMap<String, PreparedClaim>,
    /// pod UID → container → env.
    env: HashMap<String, BTreeMap<String, BTreeMap<String, String>>>,
    /// pod UID → "namespace/name".
    admitted: HashMap<String, String>,
    errors: Vec<(String, String)>,
    prepare_calls: u64,
    unprepare_calls: u64,
}

/// The DRA side of one node's kubelet.
pub struct DraKubelet {
    node: String,
    state: Arc<Mutex<State>>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl DraKubelet {
    /// Starts watching `registry_dir` for plugins and the pods bound to `node`; CDI specs
    /// are read from `cdi_dir`.
    pub fn start(client: Client, node: &str, registry_dir: PathBuf, cdi_dir: PathBuf) -> Self {
        let state = Arc::new(Mutex::new(State::default()));
        let stop = CancellationToken::new();
        let worker = Worker {
            client,
            node: node.to_owned(),
            registry_dir,
            cdi_dir,
            state: state.clone(),
        };
        let task = tokio::spawn(worker.run(stop.clone()));
        Self {
            node: node.to_owned(),
            state,
            stop,
            task,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The node.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Drivers registered so far.
    pub fn drivers(&self) -> Vec<String> {
        let mut drivers: Vec<_> = self.lock().plugins.keys().cloned().collect();
        drivers.sort();
        drivers
    }

    /// Waits until `driver` is registered.
    pub async fn wait_registered(&self, driver: &str, timeout: Duration) -> anyhow::Result<()> {
        tokio::time::timeout(timeout, async {
            while !self.lock().plugins.contains_key(driver) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .with_context(|| format!("DRA driver {driver} did not register on node {}", self.node))
    }

    /// The environment the CDI devices gave `container` of pod `namespace/name`.
    pub fn container_env(
        &self,
        namespace: &str,
        name: &str,
        container: &str,
    ) -> Option<BTreeMap<String, String>> {
        let state = self.lock();
        let wanted = format!("{namespace}/{name}");
        let uid = state.admitted.iter().find(|(_, key)| **key == wanted)?.0;
        state.env.get(uid)?.get(container).cloned()
    }

    /// Claims prepared now (UIDs).
    pub fn prepared_claims(&self) -> Vec<String> {
        self.lock().claims.keys().cloned().collect()
    }

    /// Plugin registrations so far (a restarted plugin registers again).
    pub fn registrations(&self) -> u64 {
        self.lock().registrations
    }

    /// Prepare failures so far: (pod, message).
    pub fn errors(&self) -> Vec<(String, String)> {
        self.lock().errors.clone()
    }

    /// NodePrepareResources and NodeUnprepareResources calls so far.
    pub fn calls(&self) -> (u64, u64) {
        let state = self.lock();
        (state.prepare_calls, state.unprepare_calls)
    }

    /// Stops the driver and waits until it has.
    pub async fn shutdown(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

struct Worker {
    client: Client,
    node: String,
    registry_dir: PathBuf,
    cdi_dir: PathBuf,
    state: Arc<Mutex<State>>,
}

fn pod_done(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some()
        || matches!(
            pod.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Succeeded" | "Failed")
        )
}

impl Worker {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn run(self, stop: CancellationToken) {
        let api: Api<Pod> = Api::all(self.client.clone());
        let (store, writer) = reflector::store();
        let config = watcher::Config::default().fields(&format!("spec.nodeName={}", self.node));
        let stream = watcher(api, config).default_backoff().reflect(writer);
        let mut stream = std::pin::pin!(stream);
        let mut tick = tokio::time::interval(SWEEP);
        let mut synced = false;
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                event = stream.next() => match event {
                    Some(Ok(watcher::Event::InitDone)) => synced = true,
                    Some(Ok(_)) => {}
                    Some(Err(err)) => tracing::warn!(error = %err, "DRA kubelet pod watch failed"),
                    None => return,
                },
                _ = tick.tick() => {}
            }
            self.discover_plugins().await;
            if synced {
                self.sweep(&store).await;
            }
        }
    }

    /// kubelet's plugin watcher: every new socket in the registry directory is asked who it
    /// is; a DRA plugin speaking v1 is dialled and told it is registered.
    async fn discover_plugins(&self) {
        let Ok(entries) = std::fs::read_dir(&self.registry_dir) else {
            return;
        };
        let sockets: Vec<(PathBuf, (u64, i64, i64))> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "sock"))
            .filter_map(|p| {
                use std::os::unix::fs::MetadataExt as _;
                let meta = std::fs::metadata(&p).ok()?;
                // The inode number alone may be reused by a socket bound right after the
                // old one was removed; with the change time it tells files apart.
                let identity = (meta.ino(), meta.ctime(), meta.ctime_nsec());
                Some((p, identity))
            })
            .collect();
        {
            let mut state = self.lock();
            let gone: Vec<(PathBuf, String)> = state
                .registered_sockets
                .iter()
                .filter(|(path, (seen, _))| !sockets.contains(&((*path).clone(), *seen)))
                .map(|(path, (_, driver))| (path.clone(), driver.clone()))
                .collect();
            for (path, driver) in gone {
                state.registered_sockets.remove(&path);
                state.plugins.remove(&driver);
                tracing::info!(%driver, socket = %path.display(), node = %self.node, "DRA plugin socket gone: driver deregistered");
            }
        }
        for (socket, identity) in sockets {
            if self.lock().registered_sockets.contains_key(&socket) {
                continue;
            }
            match register(&socket).await {
                Ok((driver, client)) => {
                    tracing::info!(%driver, node = %self.node, "DRA plugin registered");
                    let mut state = self.lock();
                    state
                        .registered_sockets
                        .insert(socket, (identity, driver.clone()));
                    state.registrations += 1;
                    state.plugins.insert(driver, client);
                }
                Err(err) => {
                    tracing::debug!(socket = %socket.display(), error = %format!("{err:#}"), "plugin registration failed; retrying");
                }
            }
        }
    }

    async fn sweep(&self, store: &Store<Pod>) {
        let pods = store.state();
        // Release first: claims of pods gone, finished or deleting.
        let live: HashSet<String> = pods
            .iter()
            .filter(|pod| !pod_done(pod))
            .filter_map(|pod| pod.metadata.uid.clone())
            .collect();
        self.release(&live).await;
        for pod in &pods {
            let uid = pod.metadata.uid.clone().unwrap_or_default();
            if pod_done(pod) {
                if pod.metadata.deletion_timestamp.is_some() && self.holds_nothing_for(&uid) {
                    self.finish_deletion(pod).await;
                }
                continue;
            }
            if self.lock().admitted.contains_key(&uid) {
                continue;
            }
            let has_claims = pod
                .spec
                .as_ref()
                .and_then(|s| s.resource_claims.as_ref())
                .is_some_and(|c| !c.is_empty());
            if !has_claims {
                continue;
            }
            let key = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
            match self.admit(pod).await {
                Ok(()) => {}
                Err(err) => {
                    let message = format!("{err:#}");
                    tracing::info!(pod = %key, error = %message, "preparing the pod's claims failed; retrying");
                    let mut state = self.lock();
                    if state
                        .errors
                        .last()
                        .is_none_or(|(p, m)| *p != key || *m != message)
                    {
                        state.errors.push((key, message));
                    }
                }
            }
        }
    }

    fn holds_nothing_for(&self, uid: &str) -> bool {
        !self.lock().claims.values().any(|c| c.pods.contains(uid))
    }

    async fn finish_deletion(&self, pod: &Pod) {
        let api: Api<Pod> =
            Api::namespaced(self.client.clone(), &pod.namespace().unwrap_or_default());
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: pod.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        if let Err(err) = api.delete(&pod.name_any(), &params).await {
            tracing::debug!(pod = %pod.name_any(), error = %err, "removing the deleted pod failed");
        }
    }

    /// Unprepares claims no live pod here uses any more.
    async fn release(&self, live: &HashSet<String>) {
        let done: Vec<(String, PreparedClaim)> = {
            let mut state = self.lock();
            state.env.retain(|uid, _| live.contains(uid));
            state.admitted.retain(|uid, _| live.contains(uid));
            for claim in state.claims.values_mut() {
                claim.pods.retain(|uid| live.contains(uid));
            }
            state
                .claims
                .iter()
                .filter(|(_, c)| c.pods.is_empty())
                .map(|(uid, c)| (uid.clone(), c.clone()))
                .collect()
        };
        for (uid, claim) in done {
            let Some(mut plugin) = self.lock().plugins.get(&claim.driver).cloned() else {
                continue;
            };
            self.lock().unprepare_calls += 1;
            let request = NodeUnprepareResourcesRequest {
                claims: vec![Claim {
                    namespace: claim.namespace.clone(),
                    uid: uid.clone(),
                    name: claim.name.clone(),
                }],
            };
            match plugin.node_unprepare_resources(request).await {
                Ok(answer) => {
                    let answer = answer.into_inner();
                    match answer.claims.get(&uid) {
                        Some(r) if r.error.is_empty() => {
                            self.lock().claims.remove(&uid);
                        }
                        Some(r) => {
                            tracing::warn!(claim = %uid, error = %r.error, "unprepare failed; retrying")
                        }
                        None => {
                            tracing::warn!(claim = %uid, "unprepare answered nothing for the claim; retrying")
                        }
                    }
                }
                Err(status) => {
                    tracing::warn!(claim = %uid, error = %status.message(), "unprepare failed; retrying")
                }
            }
        }
    }

    /// Admits a pod with claims, as kubelet does: prepares its claims
    /// ([`Self::prepare_claims`]), applies their CDI devices to its containers
    /// ([`Self::cdi_env`]), and writes it Running.
    async fn admit(&self, pod: &Pod) -> anyhow::Result<()> {
        let namespace = pod.namespace().unwrap_or_default();
        let pod_uid = pod.metadata.uid.clone().unwrap_or_default();
        let by_name = self.prepare_claims(pod).await?;
        let env = self.cdi_env(pod, &by_name)?;
        let key = format!("{namespace}/{}", pod.name_any());
        {
            let mut state = self.lock();
            state.env.insert(pod_uid.clone(), env);
            state.admitted.insert(pod_uid, key.clone());
        }
        self.set_running(pod, &key).await
    }

    /// Finds each claim of `pod` (it must be reserved for the pod) and prepares those not
    /// prepared here yet; one prepared already gains the pod as a user. Returns each claim's
    /// UID by its name in the pod.
    async fn prepare_claims(&self, pod: &Pod) -> anyhow::Result<HashMap<String, String>> {
        let namespace = pod.namespace().unwrap_or_default();
        let pod_uid = pod.metadata.uid.clone().unwrap_or_default();
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &namespace);
        // Pod claim name → (claim UID).
        let mut by_name: HashMap<String, String> = HashMap::new();
        for entry in pod
            .spec
            .iter()
            .flat_map(|s| s.resource_claims.iter().flatten())
        {
            // As kubelet: the claim is the one upstream's resourceclaim.Name finds, and a
            // generated one must be controlled by this pod.
            let Some((name, check_owner)) = crate::resourceclaim::claim_name(pod, entry)? else {
                continue;
            };
            let claim = api
                .get(&name)
                .await
                .with_context(|| format!("reading ResourceClaim {namespace}/{name}"))?;
            if check_owner {
                crate::resourceclaim::is_for_pod(pod, &claim).map_err(anyhow::Error::msg)?;
            }
            let uid = claim.metadata.uid.clone().unwrap_or_default();
            let reserved = claim
                .status
                .as_ref()
                .and_then(|s| s.reserved_for.as_ref())
                .is_some_and(|r| r.iter().any(|r| r.uid == pod_uid));
            anyhow::ensure!(
                reserved,
                "ResourceClaim {namespace}/{name} is not reserved for the pod"
            );
            by_name.insert(entry.name.clone(), uid.clone());
            if self.lock().claims.contains_key(&uid) {
                self.lock().claims.entry(uid).and_modify(|c| {
                    c.pods.insert(pod_uid.clone());
                });
                continue;
            }
            self.prepare_claim(&claim, (&namespace, &name), uid, &pod_uid)
                .await?;
        }
        Ok(by_name)
    }

    /// NodePrepareResources for the claim `namespace/name` (UID `uid`), not prepared here
    /// yet, with the driver of its devices (a claim without devices needs none); the claim is
    /// then held for the pod `pod_uid`.
    async fn prepare_claim(
        &self,
        claim: &ResourceClaim,
        (namespace, name): (&str, &str),
        uid: String,
        pod_uid: &str,
    ) -> anyhow::Result<()> {
        let drivers: HashSet<String> = claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.as_ref())
            .into_iter()
            .flatten()
            .map(|r| r.driver.clone())
            .collect();
        anyhow::ensure!(
            drivers.len() <= 1,
            "ResourceClaim {namespace}/{name} has devices of several drivers; this kubelet prepares one driver per claim"
        );
        let Some(driver) = drivers.into_iter().next() else {
            return Ok(());
        };
        let mut plugin = self.lock().plugins.get(&driver).cloned().with_context(|| {
            format!(
                "DRA driver {driver} is not registered on node {}",
                self.node
            )
        })?;
        self.lock().prepare_calls += 1;
        let answer = plugin
            .node_prepare_resources(NodePrepareResourcesRequest {
                claims: vec![Claim {
                    namespace: namespace.to_owned(),
                    uid: uid.clone(),
                    name: name.to_owned(),
                }],
            })
            .await
            .map_err(|status| anyhow::anyhow!("NodePrepareResources: {}", status.message()))?
            .into_inner();
        let result = answer.claims.get(&uid).with_context(|| {
            format!("NodePrepareResources answered nothing for claim {namespace}/{name}")
        })?;
        anyhow::ensure!(
            result.error.is_empty(),
            "NodePrepareResources for claim {namespace}/{name}: {}",
            result.error
        );
        let devices = result
            .devices
            .iter()
            .flat_map(|d| {
                let requests = if d.request_names.is_empty() {
                    vec![String::new()]
                } else {
                    d.request_names.clone()
                };
                requests.into_iter().map(|r| (r, d.cdi_device_ids.clone()))
            })
            .collect();
        self.lock().claims.insert(
            uid,
            PreparedClaim {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                driver,
                devices,
                pods: HashSet::from([pod_uid.to_owned()]),
            },
        );
        Ok(())
    }

    /// The runtime's part: each container's CDI devices, from the prepared claims it uses
    /// (`by_name`: claim UID by pod claim name), their env applied in order.
    fn cdi_env(
        &self,
        pod: &Pod,
        by_name: &HashMap<String, String>,
    ) -> anyhow::Result<BTreeMap<String, BTreeMap<String, String>>> {
        let specs = read_cdi_specs(&self.cdi_dir);
        let mut env: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
        for container in pod.spec.iter().flat_map(|s| s.containers.iter()) {
            let mut vars = BTreeMap::new();
            for reference in container
                .resources
                .iter()
                .flat_map(|r| r.claims.iter().flatten())
            {
                let uid = by_name.get(&reference.name).with_context(|| {
                    format!(
                        "container {} uses claim {}, which the pod does not list",
                        container.name, reference.name
                    )
                })?;
                let state = self.lock();
                let Some(prepared) = state.claims.get(uid) else {
                    continue;
                };
                for (request, ids) in &prepared.devices {
                    let wanted = reference
                        .request
                        .as_deref()
                        .is_none_or(|r| r.is_empty() || request.is_empty() || r == request);
                    if !wanted {
                        continue;
                    }
                    for id in ids {
                        let edits = specs.get(id).with_context(|| {
                            format!(
                                "CDI device {id} is in no spec under {}",
                                self.cdi_dir.display()
                            )
                        })?;
                        for (k, v) in edits {
                            vars.insert(k.clone(), v.clone());
                        }
                    }
                }
            }
            env.insert(container.name.clone(), vars);
        }
        Ok(env)
    }

    /// Writes the pod `key` Running, as kubelet does once its containers started.
    async fn set_running(&self, pod: &Pod, key: &str) -> anyhow::Result<()> {
        let namespace = pod.namespace().unwrap_or_default();
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
        let now = jiff::Timestamp::now().to_string();
        let status = serde_json::json!({"status": {
            "phase": "Running",
            "startTime": now,
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
        }});
        pods.patch_status(
            &pod.name_any(),
            &PatchParams::default(),
            &Patch::Merge(status),
        )
        .await
        .with_context(|| format!("setting pod {key} Running"))?;
        Ok(())
    }
}

/// kubelet's side of plugin registration for one socket. kubelet's plugin watcher dials the
/// registration socket with grpc-go and no `WithAuthority`, so the HTTP/2 `:authority` it
/// sends is the socket path, which a plain tonic server resets (PROTOCOL_ERROR): dial the same.
async fn register(socket: &Path) -> anyhow::Result<(String, DraPluginClient<Channel>)> {
    use std::os::unix::ffi::OsStrExt as _;
    let channel =
        gpushare_proto::authority::connect_with_authority(socket, socket.as_os_str().as_bytes())
            .await?;
    let mut registration = RegistrationClient::new(channel);
    let info = registration.get_info(InfoRequest {}).await?.into_inner();
    let refuse = |error: String| {
        let mut registration = registration.clone();
        async move {
            let _ = registration
                .notify_registration_status(RegistrationStatus {
                    plugin_registered: false,
                    error: error.clone(),
                })
                .await;
            anyhow::anyhow!(error)
        }
    };
    if info.r#type != gpushare_proto::dra::PLUGIN_TYPE {
        return Err(refuse(format!(
            "plugin type {:?} is not handled by this kubelet",
            info.r#type
        ))
        .await);
    }
    if !info
        .supported_versions
        .iter()
        .any(|v| v == gpushare_proto::dra::V1_SERVICE)
    {
        return Err(refuse(format!(
            "DRA plugin {} supports none of [v1.DRAPlugin]: {:?}",
            info.name, info.supported_versions
        ))
        .await);
    }
    let endpoint = if info.endpoint.is_empty() {
        socket.to_owned()
    } else {
        PathBuf::from(&info.endpoint)
    };
    let plugin = match gpushare_proto::connect_unix(&endpoint).await {
        Ok(channel) => DraPluginClient::new(channel),
        Err(err) => return Err(refuse(format!("cannot dial {}: {err}", endpoint.display())).await),
    };
    registration
        .notify_registration_status(RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await?;
    Ok((info.name, plugin))
}

/// Every CDI device in the specs under `dir`: `kind=name` → env edits (`NAME` → value).
fn read_cdi_specs(dir: &Path) -> HashMap<String, Vec<(String, String)>> {
    let mut devices = HashMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return devices;
    };
    for path in entries.filter_map(Result::ok).map(|e| e.path()) {
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let Ok(text) = std::fs::read(&path) else {
            continue;
        };
        let Ok(spec) = serde_json::from_slice::<serde_json::Value>(&text) else {
            continue;
        };
        let kind = spec["kind"].as_str().unwrap_or_default();
        for device in spec["devices"].as_array().into_iter().flatten() {
            let name = device["name"].as_str().unwrap_or_default();
            let env = device["containerEdits"]["env"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str())
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect();
            devices.insert(format!("{kind}={name}"), env);
        }
    }
    devices
}
