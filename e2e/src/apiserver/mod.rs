//! An in-process Kubernetes API server for the objects gpushare touches.
//!
//! Why not a mock: gpushare's correctness depends on the API server's rules — optimistic
//! concurrency (409 on a stale resourceVersion), the Binding subresource refusing a second
//! bind, watches that expire (410) and must be relisted, status written only through
//! `/status`. A mock that answers "200 OK" to everything lets a test pass that would fail
//! against a cluster. This server is a real HTTP server that speaks the real wire protocol
//! (JSON bodies, `metav1.Status` errors, newline-delimited watch streams) and enforces those
//! rules, so kube-rs clients and kube-runtime watchers work against it.
//!
//! ```text
//!  kube::Client ──────────HTTP──▶ axum fallback ──▶ faults (latency, errors) ──▶ handlers
//!                                                                                │
//!                                        writes: spawned ──▶ stall ──────────────┤
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
//! answering.
//!
//! Served: core/v1 `pods` (+ `status`, `binding`), `nodes` (+ `status`), `events`,
//! `namespaces` (synthetic, read-only); `events.k8s.io/v1` `events`;
//! `coordination.k8s.io/v1` `leases`; `resource.k8s.io/v1` `resourceslices` and
//! `resourceclaims` (+ `status`), for the DRA plugin's RBAC check; `/version`. No discovery
//! documents and no `Table` renderings: kubectl runs only against the real cluster.
//!
//! Who calls, and admission: a request without credentials acts as [`ADMIN_USER`]; a
//! kubeconfig from [`ApiServer::kubeconfig_yaml_as`] carries a bearer token this server maps
//! to the username given (a token it never issued gets 401). ValidatingAdmissionPolicies are
//! not evaluated here: the chart's allocation policy is held to the real API server's CEL by
//! the real tier (`e2e/tests/real/allocation_policy.rs`). [`Stats`]
//! records each kind of request by who made it ([`Call`]: user, API group, resource, RBAC
//! verb), so a test can hold the chart's RBAC against the calls our binaries really make.
//!
//! Field managers are not modelled: `metadata.managedFields` is stored as a client sends it
//! and never recorded by the server (the load harness sends the entries a real server would
//! list, so that the extender's relist pays what it pays on a real cluster).
//!
//! Graceful pod deletion: deleting a pod that is bound to a node with a grace period > 0
//! (from the request, else the pod's `terminationGracePeriodSeconds`, defaulted to 30) first
//! sets `deletionTimestamp`/`deletionGracePeriodSeconds` (a MODIFIED event), then removes the
//! pod after `min(grace, 2s)` — there is no kubelet here to confirm. A delete with
//! `gracePeriodSeconds=0`, of an unbound pod, or of a pod in a terminal phase removes it at
//! once. A pod with finalizers is only marked; it goes once an update empties its finalizers.

mod binding;
mod deletes;
mod discovery;
mod faults;
mod handlers;
mod objects;
mod patch;
mod reads;
mod request;
mod resources;
mod selector;
mod stats;
mod status;
mod store;
mod watch;
mod webhooks;
mod writes;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::Rng;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use self::store::Store;
use crate::locked;

pub use self::faults::Faults;
pub(crate) use self::faults::Release;
pub use self::stats::{Call, Stats};

/// The user a request without credentials acts as: the cluster admin.
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
    /// What its handlers share: the faults, stats and tokens this handle hands out too.
    app: App,
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

/// Who may call, and where the webhooks they meet are served. Cheap to clone.
#[derive(Clone, Default)]
pub(crate) struct Access {
    /// Bearer token → who holds it.
    tokens: Arc<Mutex<HashMap<String, Caller>>>,
    /// Where the Services that webhooks name are served.
    pub(crate) services: webhooks::ServiceRoutes,
}

impl Access {
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
        locked(&self.tokens).get(token).cloned()
    }

    fn issue(&self, username: &str, node: Option<&str>) -> String {
        let token = format!("kubesim-{:032x}", rand::rng().random::<u128>());
        let caller = Caller {
            name: username.to_owned(),
            node: node.map(str::to_owned),
        };
        locked(&self.tokens).insert(token.clone(), caller);
        token
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
        let addr = SocketAddr::from(([127, 0, 0, 1], 0));
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|err| anyhow::anyhow!("binding the API server to {addr}: {err}"))?;
        let addr = listener.local_addr()?;
        let store = Arc::new(Store::new());
        let app = App {
            faults: Faults::new(store.clone()),
            store,
            stats: Stats::default(),
            access: Access::default(),
            cancel: CancellationToken::new(),
        };
        let router = handlers::router(app.clone());
        let shutdown = app.cancel.clone().cancelled_owned();
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
            app,
            task: Some(task),
        })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
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

    /// A kubeconfig like [`ApiServer::write_kubeconfig`]'s whose user is `username` (a bearer
    /// token this server maps to it), e.g.
    /// `system:serviceaccount:kube-system:gpushare-extender`.
    pub fn kubeconfig_yaml_as(&self, username: &str) -> String {
        self.kubeconfig_yaml_and_token_as(username).0
    }

    /// A kubeconfig like [`ApiServer::kubeconfig_yaml_as`], and its bearer token (for
    /// [`Faults::cut`]): one client of `username` among several.
    pub fn kubeconfig_yaml_and_token_as(&self, username: &str) -> (String, String) {
        let token = self.app.access.issue(username, None);
        (kubeconfig_yaml(&self.url(), Some(&token)), token)
    }

    /// Writes [`ApiServer::kubeconfig_yaml_as`] to `path`.
    pub fn write_kubeconfig_as(&self, path: &Path, username: &str) -> std::io::Result<()> {
        std::fs::write(path, self.kubeconfig_yaml_as(username))
    }

    /// Calls to port `port` of Service `namespace/name` (a webhook's `clientConfig.service`)
    /// go to `addr` from now on, as the Service's endpoints would send them.
    pub fn route_service(&self, namespace: &str, name: &str, port: u16, addr: SocketAddr) {
        self.app.access.services.set(namespace, name, port, addr);
    }

    /// Hands out kubeconfigs of `username` as held by its pods on given nodes: a
    /// ServiceAccount token kubelet projects carries the node's name, and the API server
    /// shows it to admission as `request.userInfo.extra[NODE_NAME_CLAIM]`; cheap to clone, outlives no server.
    pub fn pod_identity(&self, username: &str) -> PodIdentity {
        PodIdentity {
            access: self.app.access.clone(),
            url: self.url(),
            username: username.to_owned(),
        }
    }

    /// Writes a kubeconfig for this server to `path`: plain http, a user without credentials
    /// (so [`ADMIN_USER`]), current-context set.
    pub fn write_kubeconfig(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, kubeconfig_yaml(&self.url(), None))
    }

    pub fn faults(&self) -> Faults {
        self.app.faults.clone()
    }

    pub fn stats(&self) -> Stats {
        self.app.stats.clone()
    }

    /// Stops serving: open watches end, in-flight requests finish, the port is released.
    pub async fn shutdown(mut self) {
        self.app.cancel.cancel();
        if let Some(task) = self.task.take() {
            // Keep-alive connections of clients that linger must not hold shutdown forever.
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.app.cancel.cancel();
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

/// A kubeconfig for this server's URL whose user holds `token`, or no credentials.
fn kubeconfig_yaml(url: &str, token: Option<&str>) -> String {
    let user = token.map_or("{}".to_owned(), |token| format!("{{token: {token}}}"));
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
        kubeconfig_yaml(&self.url, Some(&token))
    }
}
