//! A scheduler for the in-process cluster that places pods the way kube-scheduler does when an
//! HTTP extender is configured.
//!
//! Why not run kube-scheduler itself? Our end-to-end tests run without a cluster or Go binaries,
//! yet they must exercise the extender exactly as production will: the same request bodies, the
//! same choice of which pods reach the extender, the same reasons in `FailedScheduling`, binds
//! running concurrently with the next cycle. This module reproduces that behaviour, checked
//! against request bodies captured from kube-scheduler v1.36.
//!
//! ```text
//!  watch Pods ─┐                      ┌─► built-in filters (readiness, selector/affinity,
//!  watch Nodes ┴► state (cache+queue) │     resource fit) + default scores
//!                       │ pop         │
//!                       ▼             ├─► extender filter  (interested pods only)
//!                 scheduling cycle ───┼─► extender prioritize (≥ 2 feasible nodes)
//!                       │ assume      └─► pick the best total, ties at random
//!                       ▼
//!                 bind task (spawned; many in flight) ─► extender bind | pods/binding
//!                       │ failure: forget, backoff; FitError: PodScheduled=False + Event
//! ```
//!
//! - [`wire`]: the extender JSON (PascalCase keys, Go's case-insensitive decoding).
//! - `framework`: the default profile's filters and the FitError message, with the paths of
//!   `gpushare-scheduler-model` (what pods request and nodes hold, scores, host pick) and
//!   `scoring` (what extender answers add).
//! - `configuration`: a `KubeSchedulerConfiguration` file (as the chart renders it) read into a
//!   [`SchedulerConfig`].
//! - `state`: the cache (bound + assumed pods per node) and the scheduling queue.
//! - `extender`: the HTTP client for one extender.
//! - `driver`: the scheduling loop and the bind tasks; `watches`: the Pod and Node watches;
//!   `shared`: what all their tasks hold. There is no PostFilter: preemption runs only on the
//!   real cluster (`e2e/tests/real.rs`), whose kube-scheduler is upstream's own.

mod configuration;
mod driver;
mod extender;
pub mod framework;
mod scoring;
mod shared;
mod state;
mod stats;
mod watches;
pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

pub use extender::ExtenderError;
pub use extender::tls_client;
pub use stats::SchedulerStats;

/// One `extenders:` entry of a `KubeSchedulerConfiguration`.
#[derive(Clone, Debug)]
pub struct ExtenderConfig {
    /// e.g. `http://127.0.0.1:39999/gpushare-scheduler`; calls go to `{url_prefix}/{verb}`.
    pub url_prefix: String,
    pub filter_verb: Option<String>,
    pub prioritize_verb: Option<String>,
    pub bind_verb: Option<String>,
    /// Multiplies the extender's 0..=10 scores (then scaled ×10 to the scheduler's 0..=100).
    pub weight: i64,
    /// Send `NodeNames` instead of full `Nodes`.
    pub node_cache_capable: bool,
    /// Only pods requesting one of these reach the extender; empty = every pod.
    pub managed_resources: Vec<String>,
    /// Errors from this extender are skipped instead of failing the pod.
    pub ignorable: bool,
    /// Bound on each call (upstream's default is 30 s).
    pub http_timeout: Duration,
    /// `enableHTTPS`: upstream then trusts any certificate unless `tlsConfig` names a CA.
    /// This driver never skips verification: it refuses to start without a CA instead.
    pub enable_https: bool,
    /// `tlsConfig` (`caData`, `serverName`): how an `https://` URL prefix is verified.
    pub tls: Option<ExtenderTlsConfig>,
}

/// The part of upstream's `ExtenderTLSConfig` the chart uses.
#[derive(Clone, Debug, Default)]
pub struct ExtenderTlsConfig {
    /// `caData`/`caFile`: PEM certificates the extender's certificate must chain to.
    pub ca_pem: String,
    /// `serverName`: the name checked against the certificate; empty means the URL's host.
    pub server_name: String,
    /// `certData`/`certFile`: the client certificate presented (PEM); empty: none.
    pub cert_pem: String,
    /// `keyData`/`keyFile`: its private key (PEM).
    pub key_pem: String,
}

impl ExtenderConfig {
    /// The configuration gpushare's chart installs (less its preempt verb, which this driver
    /// does not act on): filter, prioritize and bind, weight 1,
    /// `nodeCacheCapable: true`, managing `example.com/gpu-mem`.
    pub fn gpushare(url_prefix: &str) -> Self {
        ExtenderConfig {
            url_prefix: url_prefix.to_owned(),
            filter_verb: Some("filter".to_owned()),
            prioritize_verb: Some("prioritize".to_owned()),
            bind_verb: Some("bind".to_owned()),
            weight: 1,
            node_cache_capable: true,
            managed_resources: vec![gpushare_contract::DEFAULT_RESOURCE.to_owned()],
            ignorable: false,
            http_timeout: Duration::from_secs(5),
            enable_https: false,
            tls: None,
        }
    }
}

/// How the driver behaves; defaults follow kube-scheduler where a test does not need otherwise.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Pods whose `spec.schedulerName` is this are ours (default `default-scheduler`).
    pub scheduler_name: String,
    pub extenders: Vec<ExtenderConfig>,
    /// How many binds may run at once (upstream: unbounded goroutines).
    pub parallel_binds: usize,
    /// How long each binding cycle runs before its bind call: kube-scheduler's Permit and
    /// PreBind (volume binding, DRA, API latency). The next scheduling cycles run meanwhile,
    /// so their filters come before this pod's bind, as on a real cluster under load.
    pub binding_cycle_delay: Duration,
    /// Backoff after a failed attempt: `initial * 2^(attempts-1)` up to `max` (upstream 1 s/10 s).
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// How long an unschedulable pod waits for a cluster change before it is retried anyway.
    pub unschedulable_retry: Duration,
    /// Seeds the tie-breaking RNG, for reproducible placements.
    pub seed: Option<u64>,
    /// The profile's `NodeResourcesFit` `scoringStrategy` (upstream default: LeastAllocated
    /// on cpu and memory).
    pub fit_scoring: framework::FitScoring,
    /// `percentageOfNodesToScore` (0: upstream's adaptive percentage): filtering stops once
    /// this share of the nodes, never fewer than 100, has passed.
    pub percentage_of_nodes_to_score: u32,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            scheduler_name: "default-scheduler".to_owned(),
            extenders: Vec::new(),
            parallel_binds: 64,
            binding_cycle_delay: Duration::ZERO,
            backoff_initial: Duration::from_secs(1),
            backoff_max: Duration::from_secs(10),
            unschedulable_retry: Duration::from_secs(1),
            seed: None,
            fit_scoring: framework::FitScoring::default(),
            percentage_of_nodes_to_score: 0,
        }
    }
}

/// A running scheduler. Dropping it stops its tasks; [`shutdown`](Self::shutdown) also waits.
pub struct SchedulerDriver {
    shared: Arc<shared::Shared>,
    tasks: Vec<JoinHandle<()>>,
}

impl SchedulerDriver {
    /// Starts watching Pods and Nodes through `client`, waits until both are listed, then
    /// schedules pending pods until shut down.
    pub async fn start(
        client: kube::Client,
        config: SchedulerConfig,
    ) -> anyhow::Result<SchedulerDriver> {
        let (shared, tasks) = driver::start(client, config).await?;
        Ok(SchedulerDriver { shared, tasks })
    }

    /// Why a pod is still pending (the last FitError or error message), if known.
    pub fn pending_reason(&self, namespace: &str, name: &str) -> Option<String> {
        self.shared.pending_reason(&format!("{namespace}/{name}"))
    }

    /// Counters and latencies so far.
    pub fn stats(&self) -> SchedulerStats {
        self.shared.stats.snapshot()
    }

    /// Stops the watches, the scheduling loop and in-flight binds, and waits for them.
    pub async fn shutdown(mut self) {
        self.shared.cancel.cancel();
        for task in std::mem::take(&mut self.tasks) {
            if let Err(error) = task.await
                && error.is_panic()
            {
                tracing::error!(%error, "scheduler task panicked");
            }
        }
    }
}

impl Drop for SchedulerDriver {
    fn drop(&mut self) {
        self.shared.cancel.cancel();
    }
}
