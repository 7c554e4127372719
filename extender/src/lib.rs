//! gpushare's kube-scheduler HTTP extender: filter, prioritize and bind pods by GPU memory on
//! one GPU, not by the node-wide sum kube-scheduler sees.
//!
//! ```text
//!  kube-scheduler ──POST {prefix}/filter, /prioritize, /bind──▶ http (axum: decode, encode;
//!                                                                 │  a follower's bind passed
//!                                                                 │  on to the leader: forward)
//!                                                                 │ one method call each
//!                                                     scheduling::Scheduling (the domain:
//!                                                      filter, prioritize, preempt, bind)
//!                                                                 │ read / short write lock
//!  API server ──watch Nodes, Pods──▶ kube_io::watch ──apply──▶ scheduling::view::View
//!                                                     (allocator::Cluster inside, and
//!                                                      view::reservations)
//!                         scheduling::bind: decide + reserve ─────┘
//!                                    │ spawn: one task per Binding, runs to a settled end
//!  API server ◀──POST pods/{name}/binding (annotations = decision)── scheduling::ports::Binder
//!  API server ◀──GET pod, re-POST binding (only if the answer was ambiguous)    (kube_io::writes)
//!  API server ◀──Events (background task, bounded queue)──── kube_io::writes::record_events
//! ```
//!
//! The rooms, each importing only those named before it:
//! - `wire`: the protocol's types, kube-scheduler's JSON.
//! - `scheduling`: the domain. Its state is `scheduling::view` (nodes, GPUs, bookings and,
//!   in `view::reservations`, what bind and filter book before the watch shows it); its
//!   ranking is `scheduling::keep_best`; what it needs of the API server is the narrow ports
//!   of `scheduling::ports`. It never imports the rooms below.
//! - `leader`: the Lease election, the write fence the domain asks before it binds, and the
//!   client that reaches the leader (`leader::forward`).
//! - `metrics`: what every room counts.
//! - `kube_io`: the Kubernetes I/O: the watches that feed the view, the writes behind the
//!   ports, the idle-GPU taint's node patches.
//! - `http`: the adapter for kube-scheduler, `kubectl gpushare` and probes; it passes a
//!   follower's binds on to the leader.
//! - at the top, `server`, `config` and this file, which wire them together; `cleanup`,
//!   `install_check` and `routing_check` are the binary's other subcommands.
//!
//! Why this shape: every decision is made by the pure allocator on an in-memory view that the
//! watches keep current, so `filter` and `prioritize` never call the API server. `bind`
//! decides and books the GPU under a short lock (a reservation, counted at once), then writes
//! the decision and the bind as ONE API write: a Binding whose annotations the API server
//! copies onto the pod. The write runs in a task of its own, so kube-scheduler cutting the
//! call at its `httpTimeout` cannot strand the reservation; a clear refusal releases it, an
//! ambiguous answer is settled by reading the pod, and the watched pod replaces it when it
//! arrives (the lifecycle is drawn in [`scheduling::view::reservations`]). After a restart the view is rebuilt
//! from the pods' annotations before the extender answers (`/readyz` stays 503 until then).
//!
//! With `--leader-elect`, several replicas run behind one Service and only the holder of a
//! Lease binds ([`leader`]: election, and the fence that ends every write of a leader within
//! its lease); the others keep their views warm, answer filter and prioritize, and pass bind
//! on to the leader ([`leader::forward`]). `/readyz` then also says whether the replica reaches the
//! API server.
//!
//! With `--allocation-keys-file`, each decision carries an HMAC signature
//! (`<domain>/v1.signature`, see [`gpushare_contract::signature`]) that the device plugin
//! checks before it hands out a GPU; and an allocation on a pod that does not verify is not
//! trusted to lower what the extender has booked ([`scheduling::view`]).

pub mod cleanup;
pub mod config;
pub mod http;
pub mod install_check;
pub mod kube_io;
pub mod leader;
pub mod metrics;
pub mod routing_check;
pub mod scheduling;
pub mod server;
pub mod wire;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use gpushare_contract::{KeyringError, KeyringFile};
use gpushare_runtime::TaskSet;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use config::{Config, LogFormat};
pub use http::callers::Callers;
pub use http::{DEFAULT_BODY_LIMIT, router, scheduler_router};
pub use kube_io::writes::KubeBinder;

use kube_io::{idle_gpu_taint, watch};
use leader::forward;
pub use scheduling::bind::BindTiming;
pub use scheduling::ports::{BindError, Binder, BindingTarget, EventSink, PodOnServer};
pub use scheduling::view::{NOT_SYNCED, Settings, View};
pub use scheduling::{Ranking, Scheduling};

/// Why the extender stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No kube client could be configured.
    #[error("cannot configure a Kubernetes client: {0}")]
    Client(#[source] kube::Error),
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// the address
        addr: std::net::SocketAddr,
        /// the cause
        #[source]
        source: std::io::Error,
    },
    /// The HTTP server failed.
    #[error("HTTP server failed: {0}")]
    Serve(#[source] std::io::Error),
    /// The TLS certificate or key could not be loaded.
    #[error(transparent)]
    Tls(#[from] server::TlsError),
    /// Only one of --tls-cert and --tls-key was given.
    #[error("--tls-cert and --tls-key must be given together")]
    TlsIncomplete,
    /// The allocation keyring cannot be read.
    #[error("--allocation-keys-file: {0}")]
    Keyring(#[from] KeyringError),
    /// The leader election flags do not make sense together.
    #[error("leader election: {0}")]
    LeaderTiming(&'static str),
    /// The forwarding client cannot be configured.
    #[error(transparent)]
    Forward(#[from] forward::Error),
    /// A background task ended although it should run until shutdown.
    #[error("the {0} task ended unexpectedly")]
    TaskEnded(&'static str),
}

/// Runs the extender with the standard kube client configuration until `shutdown` resolves.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let client = kube::Client::try_default().await.map_err(Error::Client)?;
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|source| Error::Listen {
            addr: config.listen,
            source,
        })?;
    serve(config, client, listener, shutdown).await
}

/// Runs the extender on an already bound listener with a given client (tests bind
/// 127.0.0.1:0 and pass the in-process API server's client). Ends on `shutdown`, gracefully,
/// or with an error when a supervised task dies.
pub async fn serve(
    config: Config,
    client: kube::Client,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let tls = tls_from_flags(&config)?;
    let (settings, keyring_file) = settings_and_keyring(&config)?;
    let (events, event_rx) = EventSink::channel();
    let state = app_state(&config, settings, &client, events);
    let (election, forwarder) = match config.leader_elect {
        true => {
            let (election, forwarder) = election_config(&config, &state)?;
            (Some(election), Some(forwarder))
        }
        false => (None, None),
    };
    let callers = match config.client_ca {
        Some(_) => Callers::certified(config.accept_uncertified_until, state.metrics()),
        None => Callers::anyone(state.metrics()),
    };
    if let Some(until) = config.accept_uncertified_until {
        tracing::warn!(%until, "until {until}, callers without a client certificate are let through (--accept-uncertified-until)");
    }
    let adapter = http::Adapter {
        domain: state.clone(),
        forwarder,
    };
    let app = http::scheduler_router(
        adapter,
        &config.prefix,
        config.max_request_bytes,
        callers.clone(),
    );
    let addr = listener.local_addr().map_err(Error::Serve)?;
    // The scheduler port stays bound until this function ends, after the Lease is released
    // and the last write ended, even if the HTTP server's task dies first: a follower takes a
    // refused connection at the leader's address as proof that its process is gone
    // ("Why a refused connection ends a lease early" in `leader`).
    let listener = listener.into_std().map_err(Error::Serve)?;
    let _bound_until_the_end = listener.try_clone().map_err(Error::Serve)?;
    let listener = TcpListener::from_std(listener).map_err(Error::Serve)?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    tracing::info!(%addr, %scheme, prefix = %config.prefix, policy = %config.policy, "listening on {addr}");

    let stop = CancellationToken::new();
    let mut tasks = TaskSet::default();
    tasks.spawn(
        SCHEDULER_SERVER,
        server::serve_http(
            listener,
            app,
            tls,
            stop.clone(),
            election.is_some().then(|| state.leadership().clone()),
            Some(callers),
        ),
    );
    if let Some(addr) = config.monitor_listen {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| Error::Listen { addr, source })?;
        tracing::info!(%addr, "serving /healthz, /readyz and /metrics over plain HTTP on {addr}");
        let monitor = http::monitor_router(state.clone());
        let serving = server::serve_http(listener, monitor, None, stop.clone(), None, None);
        tasks.spawn("monitoring HTTP server", serving);
    }
    let background = Background {
        client,
        state: state.clone(),
        event_rx,
        keyring_file,
        election,
    };
    let elect_stop = background.spawn(&mut tasks, &config, &stop);

    let result = tokio::select! {
        () = shutdown => {
            tracing::info!("shutting down");
            Ok(())
        }
        task = tasks.first_ended() => Err(Error::TaskEnded(task)),
    };
    let lease_handover = state.bind_timing().timeout + config.lease_timing().renew_deadline;
    let stopping = Stopping {
        elect_stop,
        stop,
        lease_handover,
    };
    stopping.run(tasks, result.is_ok()).await;
    if let Err(error) = &result {
        tracing::error!(%error, "extender stopping");
    }
    result
}

/// The extender's tasks beside its servers: the watches that keep the view, the idle-GPU
/// taint pass, the event recorder, the keyring watch, the election and the webhook.
struct Background {
    client: kube::Client,
    state: Scheduling,
    event_rx: tokio::sync::mpsc::Receiver<scheduling::ports::PodEvent>,
    keyring_file: Option<KeyringFile>,
    election: Option<leader::ElectionConfig>,
}

impl Background {
    /// Spawns them into `tasks`; the webhook stops with `stop`. Returns the token that stops
    /// the election (first, at shutdown: see [`Stopping`]).
    fn spawn(
        self,
        tasks: &mut TaskSet,
        config: &Config,
        stop: &CancellationToken,
    ) -> CancellationToken {
        tasks.spawn(
            "node watch",
            watch::watch_nodes(self.client.clone(), self.state.clone()),
        );
        tasks.spawn(
            "pod watch",
            watch::watch_pods(self.client.clone(), self.state.clone()),
        );
        if let Some(names) = config.dra_names() {
            tasks.spawn(
                "ResourceSlice watch",
                watch::watch_slices(self.client.clone(), self.state.clone(), names.driver),
            );
            tasks.spawn(
                "ResourceClaim watch",
                watch::watch_claims(self.client.clone(), self.state.clone()),
            );
        }
        tasks.spawn(
            "idle-GPU taint",
            idle_gpu_taint::keep_idle_gpu_taints(
                self.client.clone(),
                self.state.clone(),
                config.idle_gpu_taint,
            ),
        );
        tasks.spawn(
            "event recorder",
            kube_io::writes::record_events(self.client.clone(), self.event_rx),
        );
        if let Some(file) = self.keyring_file {
            tasks.spawn("keyring watch", watch_keyring(file));
        }
        let elect_stop = CancellationToken::new();
        if let Some(election) = self.election {
            let leadership = self.state.leadership().clone();
            let elector = leader::run(
                self.client.clone(),
                election,
                leadership,
                self.state.metrics().clone(),
                elect_stop.clone(),
            );
            tasks.spawn(ELECTOR, elector);
        }
        if config.webhook_enabled {
            tasks.spawn(
                "admission webhook",
                serve_webhook(config.clone(), self.client, stop.clone()),
            );
        }
        elect_stop
    }
}

/// The extender's shutdown, in order: stop binding and hand the Lease over once the last
/// write has ended (bounded: a write's budget, then one Lease update), then stop the servers
/// and, on a clean shutdown, let in-flight requests finish.
struct Stopping {
    elect_stop: CancellationToken,
    stop: CancellationToken,
    lease_handover: Duration,
}

impl Stopping {
    async fn run(self, mut tasks: TaskSet, drain: bool) {
        self.elect_stop.cancel();
        if let Some(elector) = tasks.take(ELECTOR) {
            let _ = tokio::time::timeout(self.lease_handover, elector).await;
        }
        self.stop.cancel();
        if let (true, Some(server)) = (drain, tasks.take(SCHEDULER_SERVER)) {
            let _ = server.await;
        }
    }
}

/// The task serving kube-scheduler's calls, drained last on shutdown.
const SCHEDULER_SERVER: &str = "HTTP server";
/// The leader election task, stopped first on shutdown so the Lease is handed over.
const ELECTOR: &str = "leader election";

/// The scheduler port's TLS from `--tls-cert` and `--tls-key` (both or neither), asking
/// clients for a certificate of `--client-ca` when set.
fn tls_from_flags(config: &Config) -> Result<Option<server::TlsAcceptor>, Error> {
    match (&config.tls_cert, &config.tls_key) {
        (Some(cert), Some(key)) => Ok(Some(match &config.client_ca {
            Some(ca) => server::tls_acceptor_asking_clients(cert, key, ca)?,
            None => server::tls_acceptor(cert, key)?,
        })),
        (None, None) => Ok(None),
        _ => Err(Error::TlsIncomplete),
    }
}

/// The extender's settings from the flags, with the allocation keyring when one is given.
fn settings_and_keyring(config: &Config) -> Result<(Settings, Option<KeyringFile>), Error> {
    let mut settings = Settings::new(&config.resource, &config.domain, &config.node_label);
    if let Some(names) = config.dra_names() {
        tracing::info!(driver = %names.driver, device_class = %names.device_class, "DRA mode: GPUs from the driver's ResourceSlices, requests and bookings from ResourceClaims of the class; no bind");
        settings = settings.with_dra(names);
    }
    let Some(path) = &config.allocation_keys_file else {
        tracing::warn!(
            "no --allocation-keys-file: allocations are NOT signed, so the device plugin cannot tell them from hand-written annotations (and one that verifies refuses them)"
        );
        return Ok((settings, None));
    };
    let file = KeyringFile::open(path)?;
    let keyring = file.keyring().current();
    tracing::info!(file = %path.display(), signing = keyring.signing_id(), keys = ?keyring.ids().collect::<Vec<_>>(), "allocations are signed");
    Ok((settings.with_keyring(file.keyring()), Some(file)))
}

/// The shared state every handler and task works on, configured from the flags.
fn app_state(
    config: &Config,
    settings: Settings,
    client: &kube::Client,
    events: EventSink,
) -> Scheduling {
    let ranking = Ranking {
        policy: config.policy,
        filter_keep_best: config.filter_keep_best,
        prioritize_weight: config.prioritize_weight,
    };
    let state = Scheduling::new(
        settings,
        ranking,
        Arc::new(KubeBinder::new(client.clone())),
        BindTiming {
            timeout: Duration::from_millis(config.bind_timeout_ms),
            writes_in_flight: config.bind_writes_in_flight,
            slot_wait: Duration::from_millis(config.bind_slot_wait_ms),
            pace_max: Duration::from_millis(config.filter_pace_max_ms),
            ..BindTiming::default()
        },
        events,
        Registry::default(),
    );
    state
        .view_mut()
        .set_bind_grace(Duration::from_millis(config.bind_grace_ms));
    state
}

/// The election settings from the flags, and the follower's forwarding client.
fn election_config(
    config: &Config,
    state: &Scheduling,
) -> Result<(leader::ElectionConfig, forward::Forwarder), Error> {
    let timing = config.lease_timing();
    if timing.renew_deadline >= timing.duration {
        return Err(Error::LeaderTiming(
            "--leader-renew-deadline-ms must be below --leader-lease-duration-ms",
        ));
    }
    if timing.retry_period >= timing.renew_deadline {
        return Err(Error::LeaderTiming(
            "--leader-retry-period-ms must be below --leader-renew-deadline-ms",
        ));
    }
    let identity = config
        .leader_forward_cert
        .as_deref()
        .zip(config.leader_forward_key.as_deref());
    let forwarder = forward::Forwarder::new(
        &config.prefix,
        config.leader_forward_ca.as_deref(),
        identity,
        &config.leader_forward_server_name,
    )?;
    let identity = leader::identity(&config.pod_name);
    state.leadership().elect(timing, &identity);
    state.metrics().leader.set(0);
    let election = leader::ElectionConfig {
        holder_probe: config.leader_probe_holder.then(|| forwarder.clone()),
        probe_after: Duration::from_millis(config.bind_grace_ms),
        namespace: config.namespace.clone(),
        lease_name: config.leader_lease.clone(),
        identity,
        url: config.advertise_url.clone().filter(|url| !url.is_empty()),
        url_annotation: format!("{}/leader-url", config.domain),
        timing,
    };
    if election.url.is_none() {
        tracing::warn!(
            "no --advertise-url: while this replica leads, the others refuse binds instead of passing them on (kube-scheduler retries)"
        );
    }
    Ok((election, forwarder))
}

/// Serves the mutating admission webhook over HTTPS with a certificate the extender makes
/// and rotates itself, keeping the MutatingWebhookConfiguration's caBundle current.
async fn serve_webhook(config: Config, client: kube::Client, stop: CancellationToken) {
    use gpushare_admission::{AdmissionState, CaBundlePatcher, CertConfig, CertRotator};
    let rotator =
        match CertRotator::new(CertConfig::new(&config.webhook_service, &config.namespace)) {
            Ok(rotator) => rotator,
            Err(error) => {
                tracing::error!(%error, "cannot create the admission webhook's certificate");
                return;
            }
        };
    let patcher = (!config.webhook_configuration.is_empty())
        .then(|| CaBundlePatcher::new(client, config.webhook_configuration.clone()));
    // Rotation runs inside this task, not beside it: should it end before `stop` (or
    // panic), the webhook task ends and the extender stops loudly, instead of serving a
    // certificate nobody renews any more.
    let rotation = rotator.clone().run(
        patcher,
        Duration::from_secs(3600),
        stop.clone().cancelled_owned(),
    );
    let router = gpushare_admission::router(
        AdmissionState::new(&config.resource, &config.scheduler_name)
            .with_domain(&config.domain)
            .with_idle_gpu_toleration(config.idle_gpu_taint),
    );
    tracing::info!(addr = %config.webhook_listen, "admission webhook listening");
    let serving = gpushare_admission::serve_tls(
        config.webhook_listen,
        router,
        rotator,
        stop.clone().cancelled_owned(),
    );
    tokio::pin!(rotation, serving);
    let served = tokio::select! {
        served = &mut serving => served,
        () = &mut rotation => {
            if !stop.is_cancelled() {
                tracing::error!("the admission webhook's certificate rotation stopped; stopping the webhook");
                return;
            }
            // Shutting down: let the webhook's in-flight requests finish.
            serving.await
        }
    };
    if let Err(error) = served {
        tracing::error!(%error, "admission webhook stopped");
    }
}

/// How often the keyring file is checked for changes.
pub const KEYRING_POLL: Duration = Duration::from_secs(5);

/// Re-reads the keyring file every [`KEYRING_POLL`], so a Secret update (key rotation)
/// applies without a restart. A file that became unreadable or malformed is reported once
/// and the keys in use stay. Runs until aborted.
async fn watch_keyring(mut file: KeyringFile) {
    let mut tick = tokio::time::interval(KEYRING_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        file.reload_logged();
    }
}
