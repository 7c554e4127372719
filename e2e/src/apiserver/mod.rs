//! An in-process Kubernetes API server for the objects gpushare touches.
//!
//! Why not a mock: gpushare's correctness depends on the API server's rules — optimistic
//! concurrency (409 on a stale resourceVersion), the Binding subresource refusing a second
//! bind, watches that expire (410) and must be relisted, status written only through
//! `/status`. A mock that answers "200 OK" to everything lets a test pass that would fail
//! against a cluster. This server is a real HTTP server that speaks the real wire protocol
//! (JSON bodies, `metav1.Status` errors, newline-delimited watch streams) and enforces those
//! rules, so kube-rs clients, kube-runtime watchers and a real `kubectl` work against it.
//!
//! ```text
//!  kube::Client / kubectl ──HTTP──▶ axum fallback ──▶ faults (latency, errors) ──▶ handlers
//!                                                                                │
//!                                        writes: spawned ──▶ stall, write latency ┤
//!                                                                                ▼
//!                    watch streams ◀── history of changes ◀── store (one resourceVersion)
//! ```
//!
//! Writes outlive their clients, as on a real API server: once a write (create, the
//! `binding` subresource, update, patch, delete) is accepted it runs in a task of its own, so
//! a client that times out or hangs up does not cancel it. [`Faults::stall_writes`] holds every
//! write that arrives during the stall until it ends and then applies it (etcd frozen, then
//! thawed: the writes commit late, whoever still waits for them);
//! [`Faults::stall_writes_then_fail`] holds them the same way and then fails every one of
//! them unapplied (etcd lost its leader with the proposals). Reads and watches go on
//! answering. [`Faults::set_write_latency`] delays writes the same way.
//!
//! Served: core/v1 `pods` (+ `status`, `binding`), `nodes` (+ `status`), `events`,
//! `namespaces` (synthetic, read-only); `events.k8s.io/v1` `events`;
//! `coordination.k8s.io/v1` `leases`; `resource.k8s.io/v1` `resourceslices`,
//! `resourceclaims` (+ `status`), `resourceclaimtemplates`, `deviceclasses`; the discovery
//! documents kubectl reads; `Table` renderings of gets, lists and watches for `kubectl get`.
//! Feature gates are 1.36's defaults; [`ApiServer::set_dra_device_taints`] turns
//! `DRADeviceTaints` off, as older clusters have it (device taints are dropped on write).
//!
//! Who calls, and admission: a request without credentials acts as [`ADMIN_USER`]; a
//! kubeconfig from [`ApiServer::kubeconfig_yaml_as`] carries a bearer token this server maps
//! to the username given (a token it never issued gets 401). Writes are admitted by the
//! ValidatingAdmissionPolicies put in force with [`ApiServer::set_admission_policies`]
//! (loaded from the chart's rendered YAML, evaluated in CEL: [`admission`]). [`Stats`]
//! records each kind of request by who made it ([`Call`]: user, API group, resource, RBAC
//! verb), so a test can hold the chart's RBAC against the calls our binaries really make.
//!
//! Field managers: every create, update and patch records its manager in
//! `metadata.managedFields` ([`managed`]), so objects read and watched here are as large as on
//! a real server and clients pay the same to decode them; bindings record none, as upstream.
//!
//! Graceful pod deletion: deleting a pod that is bound to a node with a grace period > 0
//! (from the request, else the pod's `terminationGracePeriodSeconds`, defaulted to 30) first
//! sets `deletionTimestamp`/`deletionGracePeriodSeconds` (a MODIFIED event), then removes the
//! pod after `min(grace, 2s)` — there is no kubelet here to confirm. A delete with
//! `gracePeriodSeconds=0`, of an unbound pod, or of a pod in a terminal phase removes it at
//! once. A pod with finalizers is only marked; it goes once an update empties its finalizers.

pub mod admission;
mod discovery;
mod handlers;
mod managed;
mod objects;
mod patch;
mod resources;
mod selector;
mod status;
mod store;
mod table;
mod watch;
mod webhooks;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use self::admission::AdmissionPolicies;
use self::store::Store;

/// The user a request without credentials acts as: the cluster admin. Admission policies
/// still apply to it, as they do to a real cluster-admin.
pub const ADMIN_USER: &str = "system:admin";

/// The kind of request, as Kubernetes' audit and RBAC name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Verb {
    Get,
    List,
    Watch,
    Create,
    Update,
    Patch,
    Delete,
}

/// A running API server. Serves until [`ApiServer::shutdown`] or drop.
pub struct ApiServer {
    addr: SocketAddr,
    faults: Faults,
    stats: Stats,
    access: Access,
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
}

/// The key of the node claim a ServiceAccount token bound to a pod carries (in the token's
/// `kubernetes.io.node.name`); the real API server puts it in `request.userInfo.extra`.
pub const NODE_NAME_CLAIM: &str = "authentication.kubernetes.io/node-name";

/// Who is calling, as authentication found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Caller {
    /// `request.userInfo.username`.
    pub name: String,
    /// The node of the pod the token was issued to ([`NODE_NAME_CLAIM`]), if it was.
    pub node: Option<String>,
}

impl std::ops::Deref for Caller {
    type Target = str;

    fn deref(&self) -> &str {
        &self.name
    }
}

/// Who may call, and what admission applies to their writes. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Access {
    /// Bearer token → who holds it.
    tokens: Arc<Mutex<HashMap<String, Caller>>>,
    /// Where the Services that webhooks name are served.
    pub(crate) services: webhooks::ServiceRoutes,
    policies: Arc<RwLock<Arc<AdmissionPolicies>>>,
    /// The `DRADeviceTaints` feature gate (beta and on by default in 1.36).
    device_taints: Arc<std::sync::atomic::AtomicBool>,
}

impl Access {
    fn new() -> Self {
        Self {
            tokens: Arc::default(),
            services: webhooks::ServiceRoutes::default(),
            policies: Arc::new(RwLock::new(Arc::new(AdmissionPolicies::none()))),
            device_taints: Arc::new(std::sync::atomic::AtomicBool::new(true)),
        }
    }

    /// As the real server's `dropDisabledFields`: with `DRADeviceTaints` off, a ResourceSlice
    /// written loses its devices' `taints`, unless the stored one (`current`) uses them
    /// already. Every other kind and field is left alone.
    pub(crate) fn drop_disabled_fields(
        &self,
        kind: resources::Kind,
        object: &mut serde_json::Value,
        current: Option<&serde_json::Value>,
    ) {
        if kind != resources::Kind::ResourceSlice
            || self
                .device_taints
                .load(std::sync::atomic::Ordering::Relaxed)
        {
            return;
        }
        let uses_taints = |slice: &serde_json::Value| {
            slice
                .pointer("/spec/devices")
                .and_then(serde_json::Value::as_array)
                .is_some_and(|devices| devices.iter().any(|d| d.get("taints").is_some()))
        };
        if current.is_some_and(uses_taints) {
            return;
        }
        if let Some(devices) = object
            .pointer_mut("/spec/devices")
            .and_then(serde_json::Value::as_array_mut)
        {
            for device in devices {
                if let Some(device) = device.as_object_mut() {
                    device.remove("taints");
                }
            }
        }
    }

    /// The user behind an `Authorization` header: [`ADMIN_USER`] without one, `None` for a
    /// token this server never issued (the caller answers 401).
    pub(crate) fn user(&self, authorization: Option<&str>) -> Option<Caller> {
        let Some(header) = authorization else {
            return Some(Caller {
                name: ADMIN_USER.to_owned(),
                node: None,
            });
        };
        let token = header.strip_prefix("Bearer ")?.trim();
        self.tokens
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .get(token)
            .cloned()
    }

    fn issue(&self, username: &str, node: Option<&str>) -> String {
        let token = format!("kubesim-{:032x}", rand::rng().random::<u128>());
        self.tokens
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .insert(
                token.clone(),
                Caller {
                    name: username.to_owned(),
                    node: node.map(str::to_owned),
                },
            );
        token
    }

    pub(crate) fn policies(&self) -> Arc<AdmissionPolicies> {
        self.policies
            .read()
            .unwrap_or_else(|poison| poison.into_inner())
            .clone()
    }
}

/// Shared by every request handler.
#[derive(Clone)]
pub(crate) struct App {
    pub store: Arc<Store>,
    pub faults: Faults,
    pub stats: Stats,
    pub access: Access,
    pub cancel: CancellationToken,
}

impl ApiServer {
    /// Binds 127.0.0.1 on a free port and serves until shutdown or drop.
    pub async fn start() -> anyhow::Result<ApiServer> {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0))).await
    }

    /// Binds `addr` and serves until shutdown or drop.
    pub async fn start_on(addr: SocketAddr) -> anyhow::Result<ApiServer> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|err| anyhow::anyhow!("binding the API server to {addr}: {err}"))?;
        let addr = listener.local_addr()?;
        let store = Arc::new(Store::new());
        let faults = Faults::new(store.clone());
        let stats = Stats::default();
        let access = Access::new();
        let cancel = CancellationToken::new();
        let app = App {
            store,
            faults: faults.clone(),
            stats: stats.clone(),
            access: access.clone(),
            cancel: cancel.clone(),
        };
        let router = handlers::router(app);
        let shutdown = cancel.clone().cancelled_owned();
        let task = tokio::spawn(async move {
            if let Err(err) = axum::serve(listener, router)
                .with_graceful_shutdown(shutdown)
                .await
            {
                tracing::error!(error = %err, "API server stopped with an error");
            }
        });
        tracing::debug!(%addr, "API server listening");
        Ok(ApiServer {
            addr,
            faults,
            stats,
            access,
            cancel,
            task: Some(task),
        })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A plain `kube::Client` for [`ApiServer::url`], built as any program would build one
    /// from a `kube::Config`. Must be called inside a Tokio runtime (the client spawns its
    /// request buffer there).
    pub fn client(&self) -> kube::Client {
        let uri = http::Uri::try_from(self.url())
            .unwrap_or_else(|_| http::Uri::from_static("http://127.0.0.1"));
        let config = kube::Config::new(uri);
        match kube::Client::try_from(config) {
            Ok(client) => client,
            // Building a client for a plain-http URL with no credentials cannot fail; if
            // kube ever changes that, tests must fail loudly rather than talk to nothing.
            Err(err) => panic!("building a kube client for {}: {err}", self.url()),
        }
    }

    /// A kubeconfig for this server: plain http, a user without credentials (so
    /// [`ADMIN_USER`]), current-context set.
    pub fn kubeconfig_yaml(&self) -> String {
        self.kubeconfig_with_user("{}")
    }

    /// A kubeconfig like [`ApiServer::kubeconfig_yaml`] whose user is `username` (a bearer
    /// token this server maps to it), e.g.
    /// `system:serviceaccount:kube-system:gpushare-extender`.
    pub fn kubeconfig_yaml_as(&self, username: &str) -> String {
        let token = self.access.issue(username, None);
        self.kubeconfig_with_user(&format!("{{token: {token}}}"))
    }

    /// A kubeconfig like [`ApiServer::kubeconfig_yaml_as`], and its bearer token (for
    /// [`Faults::cut`]): one client of `username` among several.
    pub fn kubeconfig_yaml_and_token_as(&self, username: &str) -> (String, String) {
        let token = self.access.issue(username, None);
        let yaml = self.kubeconfig_with_user(&format!("{{token: {token}}}"));
        (yaml, token)
    }

    /// Writes [`ApiServer::kubeconfig_yaml_as`] to `path`.
    pub fn write_kubeconfig_as(&self, path: &Path, username: &str) -> std::io::Result<()> {
        std::fs::write(path, self.kubeconfig_yaml_as(username))
    }

    /// Calls to port `port` of Service `namespace/name` (a webhook's `clientConfig.service`)
    /// go to `addr` from now on, as the Service's endpoints would send them.
    pub fn route_service(&self, namespace: &str, name: &str, port: u16, addr: SocketAddr) {
        self.access.services.set(namespace, name, port, addr);
    }

    /// Puts `policies` in force for every write from now on (replacing any before).
    pub fn set_admission_policies(&self, policies: AdmissionPolicies) {
        *self
            .access
            .policies
            .write()
            .unwrap_or_else(|poison| poison.into_inner()) = Arc::new(policies);
    }

    /// Turns the `DRADeviceTaints` feature gate on (the 1.36 default) or off (as before
    /// 1.36: ResourceSlices written lose their devices' taints).
    pub fn set_dra_device_taints(&self, enabled: bool) {
        self.access
            .device_taints
            .store(enabled, std::sync::atomic::Ordering::Relaxed);
    }

    /// Hands out kubeconfigs of `username` as held by its pods on given nodes: a
    /// ServiceAccount token kubelet projects carries the node's name, and the API server
    /// shows it to admission as `request.userInfo.extra[NODE_NAME_CLAIM]`; cheap to clone, outlives no server.
    pub fn pod_identity(&self, username: &str) -> PodIdentity {
        PodIdentity {
            access: self.access.clone(),
            url: self.url(),
            username: username.to_owned(),
        }
    }

    fn kubeconfig_with_user(&self, user: &str) -> String {
        kubeconfig_yaml(&self.url(), user)
    }

    pub fn write_kubeconfig(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, self.kubeconfig_yaml())
    }

    pub fn faults(&self) -> Faults {
        self.faults.clone()
    }

    pub fn stats(&self) -> Stats {
        self.stats.clone()
    }

    /// Stops serving: open watches end, in-flight requests finish, the port is released.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            // Keep-alive connections of clients that linger must not hold shutdown forever.
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl Verb {
    /// Create, Update, Patch or Delete: the verbs that change the store.
    pub fn is_write(self) -> bool {
        matches!(
            self,
            Verb::Create | Verb::Update | Verb::Patch | Verb::Delete
        )
    }

    /// The verb RBAC checks for this request: `get` for one object, `list` for a collection,
    /// `watch` for a watch, `create` for a POST (the `binding` subresource too), `update`,
    /// `patch`, `delete`.
    pub fn rbac(self) -> &'static str {
        match self {
            Verb::Get => "get",
            Verb::List => "list",
            Verb::Watch => "watch",
            Verb::Create => "create",
            Verb::Update => "update",
            Verb::Patch => "patch",
            Verb::Delete => "delete",
        }
    }
}

/// A write stall: until when, and what becomes of the writes it held.
#[derive(Clone, Copy, Debug)]
struct Stall {
    until: Instant,
    /// Fail the held writes (unapplied) instead of applying them.
    fail: bool,
}

/// What becomes of an accepted write once faults let it go.
pub(crate) enum Release {
    /// Apply it.
    Apply,
    /// Answer with this error, unapplied.
    Fail(status::ApiError),
}

/// Fault injection, shared by every request. Cheap to clone.
#[derive(Clone)]
pub struct Faults {
    inner: Arc<Mutex<FaultState>>,
    drop_watches: Arc<tokio::sync::watch::Sender<u64>>,
    /// The current write stall, if any.
    stall: Arc<tokio::sync::watch::Sender<Option<Stall>>>,
    /// Bearer tokens cut off from the server (a network partition of one client).
    cut: Arc<tokio::sync::watch::Sender<std::collections::BTreeSet<String>>>,
    store: Arc<Store>,
}

struct FaultState {
    latency: Duration,
    write_latency: Duration,
    errors: HashMap<Verb, (f64, u16)>,
    rng: StdRng,
}

impl Faults {
    fn new(store: Arc<Store>) -> Self {
        let (drop_watches, _) = tokio::sync::watch::channel(0);
        let (stall, _) = tokio::sync::watch::channel(None);
        let (cut, _) = tokio::sync::watch::channel(std::collections::BTreeSet::new());
        Self {
            inner: Arc::new(Mutex::new(FaultState {
                latency: Duration::ZERO,
                write_latency: Duration::ZERO,
                errors: HashMap::new(),
                // Seeded: a failing run can be replayed.
                rng: StdRng::seed_from_u64(0x6770_7573_6861_7265),
            })),
            drop_watches: Arc::new(drop_watches),
            stall: Arc::new(stall),
            cut: Arc::new(cut),
            store,
        }
    }

    /// Cuts the client holding `token` off, as a network partition would: its requests hang
    /// until [`Faults::heal`] (or until it gives up), then fail with a 503, unapplied; its open
    /// watches end now (every client's do; the others reconnect at once).
    pub fn cut(&self, token: &str) {
        self.cut.send_modify(|cut| {
            cut.insert(token.to_owned());
        });
        self.drop_watches();
    }

    /// Ends the cut of `token`.
    pub fn heal(&self, token: &str) {
        self.cut.send_modify(|cut| {
            cut.remove(token);
        });
    }

    /// If the request's bearer token is cut off: waits until it is healed or the server shuts
    /// down, and returns true (the request is then refused, unapplied).
    pub(crate) async fn hold_if_cut(
        &self,
        authorization: Option<&str>,
        cancel: &CancellationToken,
    ) -> bool {
        let Some(token) = authorization.and_then(|h| h.strip_prefix("Bearer ")) else {
            return false;
        };
        let mut cut = self.cut.subscribe();
        if !cut.borrow_and_update().contains(token) {
            return false;
        }
        loop {
            tokio::select! {
                () = cancel.cancelled() => return true,
                changed = cut.changed() => {
                    if changed.is_err() || !cut.borrow_and_update().contains(token) {
                        return true;
                    }
                }
            }
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, FaultState> {
        self.inner
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// Delay added before every request is handled.
    pub fn set_latency(&self, d: Duration) {
        self.state().latency = d;
    }

    /// Delay added to every write once it is accepted (after any stall). The write is applied
    /// after the delay even if its client gave up meanwhile.
    pub fn set_write_latency(&self, d: Duration) {
        self.state().write_latency = d;
    }

    /// Freezes writes for `d` from now, as a frozen etcd would: every write arriving before
    /// the returned instant hangs until then and is applied afterwards, in whatever order the
    /// held writes wake up, even if its client timed out or hung up meanwhile (so a client
    /// that retries may find its first attempt already applied). Consistent reads (a GET, a
    /// list without `resourceVersion=0`) wait for the end of the stall too, and are then
    /// answered; watches and lists served from the watch cache answer as usual. Calling it again moves the end of the stall to `d` from now; `Duration::ZERO`
    /// ends a stall at once.
    pub fn stall_writes(&self, d: Duration) -> Instant {
        self.start_stall(d, false)
    }

    /// Like [`Faults::stall_writes`], but when the stall ends every write it held fails,
    /// unapplied, with a 500 `etcdserver: leader changed` (as when etcd loses its leader with
    /// the uncommitted proposals): a client that gave up meanwhile never learns that its write
    /// did not happen.
    pub fn stall_writes_then_fail(&self, d: Duration) -> Instant {
        self.start_stall(d, true)
    }

    fn start_stall(&self, d: Duration, fail: bool) -> Instant {
        let until = Instant::now() + d;
        self.stall.send_replace(Some(Stall { until, fail }));
        until
    }

    /// Whether writes arriving now are held.
    pub fn writes_stalled(&self) -> bool {
        self.stall
            .borrow()
            .is_some_and(|stall| stall.until > Instant::now())
    }

    /// Answers `rate` (0.0..=1.0) of the requests with `verb` with `status` as a real
    /// `metav1.Status` (429 carries `Retry-After: 1`). A rate of 0 removes the fault.
    pub fn set_error_rate(&self, verb: Verb, rate: f64, status: u16) {
        let mut state = self.state();
        if rate <= 0.0 {
            state.errors.remove(&verb);
        } else {
            state.errors.insert(verb, (rate.min(1.0), status));
        }
    }

    /// Ends every open watch stream now (as an API server restart or a load balancer would).
    pub fn drop_watches(&self) {
        self.drop_watches.send_modify(|generation| *generation += 1);
    }

    /// Forgets history: a watch from any older resourceVersion gets a 410 Expired event.
    pub fn compact(&self) {
        self.store.write(store::Inner::compact);
    }

    /// No latency, no errors, no write stall.
    pub fn clear(&self) {
        let mut state = self.state();
        state.latency = Duration::ZERO;
        state.write_latency = Duration::ZERO;
        state.errors.clear();
        drop(state);
        self.stall.send_replace(None);
    }

    pub(crate) fn latency(&self) -> Duration {
        self.state().latency
    }

    /// Holds a read that etcd itself must answer (a GET, or a list that is not served from the
    /// watch cache) until the current stall ends: with etcd frozen, a quorum read waits like a
    /// write. False when the server shuts down meanwhile.
    pub(crate) async fn hold_consistent_read(&self, cancel: &CancellationToken) -> bool {
        let mut stall = self.stall.subscribe();
        loop {
            let current = *stall.borrow_and_update();
            let Some(current) = current.filter(|s| s.until > Instant::now()) else {
                return true;
            };
            tokio::select! {
                () = cancel.cancelled() => return false,
                () = tokio::time::sleep_until(current.until) => {}
                _ = stall.changed() => {}
            }
        }
    }

    /// Holds an accepted write through the current stall, then its write latency, and says
    /// what becomes of it. `None` if the server shut down meanwhile (nothing is applied).
    pub(crate) async fn hold_write(&self, cancel: &CancellationToken) -> Option<Release> {
        let mut stall = self.stall.subscribe();
        // The stall that held the write, as it was when the write was let go.
        let mut held_by: Option<Stall> = None;
        loop {
            let current = *stall.borrow_and_update();
            let Some(current) = current.filter(|s| s.until > Instant::now()) else {
                // Ended by time: the stall decides; ended by `clear`: the write goes through.
                if current.is_none() {
                    held_by = None;
                }
                break;
            };
            held_by = Some(current);
            tokio::select! {
                () = cancel.cancelled() => return None,
                () = tokio::time::sleep_until(current.until) => {}
                // The stall was moved or ended: look again.
                _ = stall.changed() => {}
            }
        }
        if held_by.is_some_and(|s| s.fail) {
            return Some(Release::Fail(status::ApiError::new(
                500,
                "InternalError",
                "Internal error occurred: etcdserver: leader changed",
            )));
        }
        let latency = self.state().write_latency;
        if !latency.is_zero() {
            tokio::select! {
                () = cancel.cancelled() => return None,
                () = tokio::time::sleep(latency) => {}
            }
        }
        Some(Release::Apply)
    }

    /// The status code to fail this request with, if the dice say so.
    pub(crate) fn draw_error(&self, verb: Verb) -> Option<u16> {
        let mut state = self.state();
        let (rate, status) = *state.errors.get(&verb)?;
        (state.rng.random::<f64>() < rate).then_some(status)
    }

    pub(crate) fn drop_signal(&self) -> tokio::sync::watch::Receiver<u64> {
        self.drop_watches.subscribe()
    }
}

/// One kind of request, in the terms an RBAC authorizer decides on: who asked
/// (the username this server resolved from the credentials), for which API group and
/// resource (with its subresource: `pods/binding`, `nodes/status`), with which verb.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Call {
    /// The username, e.g. `system:serviceaccount:kube-system:gpushare-extender`.
    pub user: String,
    /// The API group: `""` for the core group, `events.k8s.io`, `coordination.k8s.io`.
    pub group: String,
    /// The resource, `resource/subresource` for a subresource.
    pub resource: String,
    /// What was asked; [`Verb::rbac`] is the verb RBAC checks.
    pub verb: Verb,
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let group = if self.group.is_empty() {
            "core"
        } else {
            &self.group
        };
        write!(
            f,
            "{} {} {group}/{}",
            self.user,
            self.verb.rbac(),
            self.resource
        )
    }
}

/// Request counters, by caller. Every request this server routes to a resource counts,
/// failed ones (injected faults, refusals) included: a call the caller made is a call it
/// needs permission for. Cheap to clone.
#[derive(Clone, Default)]
pub struct Stats {
    calls: Arc<Mutex<BTreeMap<Call, u64>>>,
    /// The field selectors lists and watches asked for, by resource.
    field_selectors: Arc<Mutex<BTreeMap<String, BTreeSet<String>>>>,
}

impl Stats {
    fn calls_mut(&self) -> std::sync::MutexGuard<'_, BTreeMap<Call, u64>> {
        self.calls
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    pub(crate) fn record(&self, user: &str, verb: Verb, group: &str, resource: &str) {
        let call = Call {
            user: user.to_owned(),
            group: group.to_owned(),
            resource: resource.to_owned(),
            verb,
        };
        *self.calls_mut().entry(call).or_default() += 1;
    }

    pub(crate) fn record_field_selector(&self, resource: &str, selector: &str) {
        self.field_selectors
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .entry(resource.to_owned())
            .or_default()
            .insert(selector.to_owned());
    }

    /// The distinct field selectors lists and watches of `resource` asked for.
    pub fn field_selectors(&self, resource: &str) -> BTreeSet<String> {
        self.field_selectors
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .get(resource)
            .cloned()
            .unwrap_or_default()
    }

    /// Requests seen so far with `verb` on `resource` ("pods", "nodes", "events", "leases",
    /// "pods/binding", "pods/status", "nodes/status"), by anyone, in any API group, failed
    /// ones included.
    pub fn count(&self, verb: Verb, resource: &str) -> u64 {
        self.calls_mut()
            .iter()
            .filter(|(call, _)| call.verb == verb && call.resource == resource)
            .map(|(_, n)| n)
            .sum()
    }

    /// Create + Update + Patch + Delete requests on every resource except events.
    pub fn writes(&self) -> u64 {
        self.calls_mut()
            .iter()
            .filter(|(call, _)| call.verb.is_write() && call.resource != "events")
            .map(|(_, n)| n)
            .sum()
    }

    /// Create + Update + Patch + Delete requests on every resource, events included.
    pub fn writes_including_events(&self) -> u64 {
        self.calls_mut()
            .iter()
            .filter(|(call, _)| call.verb.is_write())
            .map(|(_, n)| n)
            .sum()
    }

    /// Every kind of request seen so far, with how many times each was made.
    pub fn calls(&self) -> BTreeMap<Call, u64> {
        self.calls_mut().clone()
    }

    /// The kinds of request `user` made so far, with how many times each was made.
    pub fn calls_by(&self, user: &str) -> BTreeMap<Call, u64> {
        self.calls_mut()
            .iter()
            .filter(|(call, _)| call.user == user)
            .map(|(call, n)| (call.clone(), *n))
            .collect()
    }

    pub fn reset(&self) {
        self.calls_mut().clear();
    }
}

/// A kubeconfig for this server's URL whose user entry is `user` (YAML flow mapping).
fn kubeconfig_yaml(url: &str, user: &str) -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: kubesim
  cluster:
    server: {url}
contexts:
- name: kubesim
  context:
    cluster: kubesim
    user: kubesim
    namespace: default
current-context: kubesim
users:
- name: kubesim
  user: {user}
preferences: {{}}
"
    )
}

/// A ServiceAccount whose pods run on many nodes (a DaemonSet's): each pod's token names
/// its node, as kubelet's projected tokens do.
#[derive(Clone)]
pub struct PodIdentity {
    access: Access,
    url: String,
    username: String,
}

impl PodIdentity {
    /// The kubeconfig of this ServiceAccount's pod on `node`, with a token of its own.
    pub fn kubeconfig_on(&self, node: &str) -> String {
        let token = self.access.issue(&self.username, Some(node));
        kubeconfig_yaml(&self.url, &format!("{{token: {token}}}"))
    }
}
