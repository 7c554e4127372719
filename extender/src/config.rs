//! Command-line and environment configuration.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use gpushare_allocator::Policy;
use gpushare_contract::{DEFAULT_DOMAIN, DEFAULT_RESOURCE};

pub use gpushare_runtime::LogFormat;

/// The extender's configuration. Every flag can also be set through its environment variable.
#[derive(Debug, Clone, Parser)]
#[command(name = "gpushare-extender", version, about)]
pub struct Config {
    /// Address to serve the extender, health and metrics endpoints on.
    #[arg(long, env = "GPUSHARE_LISTEN", default_value = "0.0.0.0:39999")]
    pub listen: SocketAddr,
    /// URL prefix of the extender verbs (the `urlPrefix` path in KubeSchedulerConfiguration).
    #[arg(long, env = "GPUSHARE_PREFIX", default_value = "/gpushare-scheduler")]
    pub prefix: String,
    /// The extended resource pods ask for, in GiB.
    #[arg(long, env = "GPUSHARE_RESOURCE", default_value = DEFAULT_RESOURCE)]
    pub resource: String,
    /// Label (`key=value`, or a bare `key` meaning `key=true`) of the nodes that take part.
    #[arg(long, env = "GPUSHARE_NODE_LABEL", default_value = "gpushare=true")]
    pub node_label: String,
    /// Domain of gpushare's annotations and labels.
    #[arg(long, env = "GPUSHARE_DOMAIN", default_value = DEFAULT_DOMAIN)]
    pub domain: String,
    /// How to choose among nodes and GPUs that fit: binpack, spread or fragmentation.
    #[arg(long, env = "GPUSHARE_POLICY", default_value = "fragmentation")]
    pub policy: Policy,
    /// Filter passes only the N fitting nodes kube-scheduler would rank best (0: every
    /// fitting node): our score × --prioritize-weight × 10 plus its default CPU and memory
    /// scores. With 1, kube-scheduler has a single feasible node, so it skips scoring: no
    /// prioritize call and none of its own score plugins. A pod with soft preferences
    /// (preferred affinities, ScheduleAnyway spreading) or facing a PreferNoSchedule taint
    /// gets every fitting node instead, and is scored as usual. The one node's memory is held
    /// for the pod until its bind comes (at most 5 s), so the pods filtered before that bind
    /// are not all offered the same node.
    #[arg(long, env = "GPUSHARE_FILTER_KEEP_BEST", default_value_t = 0)]
    pub filter_keep_best: usize,
    /// The weight kube-scheduler's extender configuration gives our prioritize scores; the
    /// filter that keeps the best nodes ranks with it as kube-scheduler would.
    #[arg(long, env = "GPUSHARE_PRIORITIZE_WEIGHT", default_value_t = 1,
          value_parser = clap::value_parser!(i64).range(0..=1_000_000))]
    pub prioritize_weight: i64,
    /// Keep the `PreferNoSchedule` taint `<domain>/idle-gpu` on every node taking part that
    /// has a GPU nothing is booked on (and off the others), so that pods asking for no GPU
    /// prefer nodes whose GPUs are in use. Only the replica that binds writes it; with false,
    /// the taint is taken off the nodes that still carry it. Needs `get` and `patch` on
    /// nodes.
    #[arg(long, env = "GPUSHARE_IDLE_GPU_TAINT", default_value_t = false, action = clap::ArgAction::Set)]
    pub idle_gpu_taint: bool,
    /// DRA mode: the driver whose ResourceSlices describe the GPUs. With it the extender
    /// ranks nodes for kube-scheduler's DRA allocation (filter keeps the best node, prioritize
    /// scores; no bind): GPUs come from these slices, what is booked from the allocated
    /// ResourceClaims, a pod's request from its claims of `--dra-device-class`. Needs `list`
    /// and `watch` on resourceslices and resourceclaims.
    #[arg(long, env = "GPUSHARE_DRA_DRIVER", requires = "dra_device_class")]
    pub dra_driver: Option<String>,
    /// DRA mode: the DeviceClass whose claims are GPU shares (see `--dra-driver`).
    #[arg(long, env = "GPUSHARE_DRA_DEVICE_CLASS", requires = "dra_driver")]
    pub dra_device_class: Option<String>,
    /// Runtime worker threads (0: one per CPU the process may use, which honours the
    /// container's CPU limit: the chart's limit of 1 CPU gives one). Each call from
    /// kube-scheduler arrives alone in its serial scheduling cycle; with fewer threads it is
    /// handled without waking and handing work between them.
    #[arg(long, env = "GPUSHARE_WORKER_THREADS", default_value_t = 0)]
    pub worker_threads: usize,
    /// Also serve /healthz, /readyz and /metrics, and nothing else, over plain HTTP here:
    /// for probes, Prometheus and a NetworkPolicy that admits only the scheduler to --listen.
    #[arg(long, env = "GPUSHARE_MONITOR_LISTEN")]
    pub monitor_listen: Option<SocketAddr>,
    /// PEM certificate chain; with --tls-key, serve HTTPS on --listen (kube-scheduler's
    /// `enableHTTPS` with `tlsConfig` trusting its CA). Read once at start.
    #[arg(long, env = "GPUSHARE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert.
    #[arg(long, env = "GPUSHARE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// CA (PEM) of the client certificates --listen accepts: with it, filter, prioritize,
    /// bind, preempt, inspect and identity answer only callers presenting a certificate of
    /// this CA (kube-scheduler's `tlsConfig.certFile`, the replicas' --leader-forward-cert);
    /// others get a 403, and a certificate of another CA fails the handshake. Needs
    /// --tls-cert. Read once at start.
    #[arg(long, env = "GPUSHARE_CLIENT_CA", requires = "tls_cert")]
    pub client_ca: Option<PathBuf>,
    /// Until this instant (RFC 3339, e.g. `2026-11-27T18:00:00Z`), --client-ca also lets
    /// callers without a certificate through: for the upgrade that turns client
    /// certificates on, while the old scheduler still calls (see `http::callers`).
    #[arg(
        long,
        env = "GPUSHARE_ACCEPT_UNCERTIFIED_UNTIL",
        requires = "client_ca"
    )]
    pub accept_uncertified_until: Option<jiff::Timestamp>,
    /// Log format.
    #[arg(long, env = "GPUSHARE_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// After start-up, binds wait this long (ms) for Bindings a previous instance sent just
    /// before it stopped to show up in the watch, so their GPU memory is not handed out twice.
    #[arg(long, env = "GPUSHARE_BIND_GRACE_MS", default_value_t = 2000)]
    pub bind_grace_ms: u64,
    /// Bound (ms) on each API call of the bind path: the Binding, and the reads and re-posts
    /// that resolve one that got no clear answer. Keep it below kube-scheduler's
    /// `httpTimeout` for the extender, so the scheduler reads bind's answer.
    #[arg(long, env = "GPUSHARE_BIND_TIMEOUT_MS", default_value_t = 2500)]
    pub bind_timeout_ms: u64,
    /// Binding writes in flight at most (0: no limit). In a burst the others wait for a slot,
    /// their memory already booked: a busy API server commits no more for having more in
    /// flight, only answers each later.
    #[arg(long, env = "GPUSHARE_BIND_WRITES_IN_FLIGHT", default_value_t = 64)]
    pub bind_writes_in_flight: usize,
    /// How long (ms) a bind may wait for a write slot; then it is refused (nothing written,
    /// its memory released) and kube-scheduler retries. Keep it plus --bind-timeout-ms below
    /// kube-scheduler's `httpTimeout` for the extender.
    #[arg(long, env = "GPUSHARE_BIND_SLOT_WAIT_MS", default_value_t = 2000)]
    pub bind_slot_wait_ms: u64,
    /// Longest (ms) a filter call waits while as many binds wait for a write slot as there
    /// are slots, so kube-scheduler's cycle runs at the pace the API server commits Bindings
    /// instead of queueing binds until they are refused (0: filter never waits). Keep it
    /// below kube-scheduler's `httpTimeout` for the extender.
    #[arg(long, env = "GPUSHARE_FILTER_PACE_MAX_MS", default_value_t = 1000)]
    pub filter_pace_max_ms: u64,
    /// Largest request body (bytes) kube-scheduler may send; larger ones get a 413. Keep it
    /// well under the container's memory limit: a body is held, and parsed, in memory.
    #[arg(long, env = "GPUSHARE_MAX_REQUEST_BYTES", default_value_t = crate::http::DEFAULT_BODY_LIMIT)]
    pub max_request_bytes: usize,
    /// Serve the mutating admission webhook that routes GPU pods to the gpushare scheduler.
    #[arg(long, env = "GPUSHARE_WEBHOOK_ENABLED", default_value_t = false, action = clap::ArgAction::Set)]
    pub webhook_enabled: bool,
    /// HTTPS address of the admission webhook (TLS made and rotated by the extender itself).
    #[arg(long, env = "GPUSHARE_WEBHOOK_LISTEN", default_value = "0.0.0.0:9443")]
    pub webhook_listen: SocketAddr,
    /// Service name the webhook certificate is issued for (`<service>.<namespace>.svc`).
    #[arg(
        long,
        env = "GPUSHARE_WEBHOOK_SERVICE",
        default_value = "gpushare-extender"
    )]
    pub webhook_service: String,
    /// Namespace of that Service (the extender's own namespace in the chart).
    #[arg(long, env = "POD_NAMESPACE", default_value = "kube-system")]
    pub namespace: String,
    /// MutatingWebhookConfiguration whose caBundle the extender keeps current; empty: none.
    #[arg(long, env = "GPUSHARE_WEBHOOK_CONFIGURATION", default_value = "")]
    pub webhook_configuration: String,
    /// schedulerName the webhook sets on pods that ask for the resource.
    #[arg(long, env = "GPUSHARE_SCHEDULER_NAME", default_value = gpushare_admission::DEFAULT_SCHEDULER_NAME)]
    pub scheduler_name: String,
    /// Keyring to sign allocations with (`id:base64key` per line, the first signs; mount it
    /// from a Secret only the extender and the device plugin read). Re-read when it changes.
    /// Unset: allocations are NOT signed, and a device plugin that verifies refuses them.
    #[arg(long, env = "GPUSHARE_ALLOCATION_KEYS_FILE")]
    pub allocation_keys_file: Option<PathBuf>,
    /// Elect a leader over a Lease in --namespace: only the leader binds; other replicas
    /// answer filter and prioritize from their own view and pass binds on to the leader.
    /// Off: this instance binds alone (run exactly one).
    #[arg(long, env = "GPUSHARE_LEADER_ELECT", default_value_t = false, action = clap::ArgAction::Set)]
    pub leader_elect: bool,
    /// Name of the Lease.
    #[arg(
        long,
        env = "GPUSHARE_LEADER_LEASE",
        default_value = "gpushare-extender"
    )]
    pub leader_lease: String,
    /// This replica's name (its pod's name); the Lease holder is `<name>_<random>`.
    #[arg(long, env = "POD_NAME", default_value = "")]
    pub pod_name: String,
    /// How long (ms) a Lease stays valid after its last renewal: a dead leader is replaced
    /// this long after its last renewal, at the latest about a retry period later.
    #[arg(
        long,
        env = "GPUSHARE_LEADER_LEASE_DURATION_MS",
        default_value_t = 3000
    )]
    pub leader_lease_duration_ms: u64,
    /// The leader stops binding when it could not renew for this long (ms); below the lease
    /// duration.
    #[arg(
        long,
        env = "GPUSHARE_LEADER_RENEW_DEADLINE_MS",
        default_value_t = 2000
    )]
    pub leader_renew_deadline_ms: u64,
    /// How often (ms) every replica reads the Lease and the leader renews it.
    #[arg(long, env = "GPUSHARE_LEADER_RETRY_PERIOD_MS", default_value_t = 500)]
    pub leader_retry_period_ms: u64,
    /// After taking over, binds wait this long (ms) for the watch to show the previous
    /// leader's last Bindings (which have all ended by then).
    #[arg(long, env = "GPUSHARE_LEADER_CATCH_UP_MS", default_value_t = 500)]
    pub leader_catch_up_ms: u64,
    /// Take the Lease over at once, without waiting for it to expire, when the leader's
    /// published URL refuses connections (its process is gone; see `leader`).
    #[arg(long, env = "GPUSHARE_LEADER_PROBE_HOLDER", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_probe_holder: bool,
    /// The URL other replicas pass binds to while this one leads, e.g. `https://$(POD_IP):39999`
    /// (published on the Lease). Unset: followers refuse binds (kube-scheduler retries).
    #[arg(long, env = "GPUSHARE_ADVERTISE_URL")]
    pub advertise_url: Option<String>,
    /// CA (PEM) to verify the leader's certificate with when passing a bind on over HTTPS.
    #[arg(long, env = "GPUSHARE_LEADER_FORWARD_CA")]
    pub leader_forward_ca: Option<PathBuf>,
    /// Client certificate (PEM) presented to the leader when passing a bind on and when
    /// probing it, for a leader that asks for one (--client-ca). Read once at start.
    #[arg(
        long,
        env = "GPUSHARE_LEADER_FORWARD_CERT",
        requires = "leader_forward_key"
    )]
    pub leader_forward_cert: Option<PathBuf>,
    /// Private key (PEM) of --leader-forward-cert.
    #[arg(
        long,
        env = "GPUSHARE_LEADER_FORWARD_KEY",
        requires = "leader_forward_cert"
    )]
    pub leader_forward_key: Option<PathBuf>,
    /// The name the leader's certificate must carry (the Service's name).
    #[arg(
        long,
        env = "GPUSHARE_LEADER_FORWARD_SERVER_NAME",
        default_value = "gpushare-extender.kube-system.svc"
    )]
    pub leader_forward_server_name: String,
}

impl Config {
    /// The DRA names from `--dra-driver` and `--dra-device-class`: DRA mode when both are set.
    pub fn dra_names(&self) -> Option<crate::scheduling::view::DraNames> {
        Some(crate::scheduling::view::DraNames {
            driver: self.dra_driver.clone()?,
            device_class: self.dra_device_class.clone()?,
        })
    }

    /// The Lease timing from the flags.
    pub fn lease_timing(&self) -> crate::leader::LeaseTiming {
        use std::time::Duration;
        crate::leader::LeaseTiming {
            duration: Duration::from_millis(self.leader_lease_duration_ms),
            renew_deadline: Duration::from_millis(self.leader_renew_deadline_ms),
            retry_period: Duration::from_millis(self.leader_retry_period_ms.max(1)),
            catch_up: Duration::from_millis(self.leader_catch_up_ms),
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], 39999)),
            prefix: "/gpushare-scheduler".to_owned(),
            resource: DEFAULT_RESOURCE.to_owned(),
            node_label: "gpushare=true".to_owned(),
            domain: DEFAULT_DOMAIN.to_owned(),
            policy: Policy::Fragmentation,
            filter_keep_best: 0,
            prioritize_weight: 1,
            idle_gpu_taint: false,
            dra_driver: None,
            dra_device_class: None,
            worker_threads: 0,
            monitor_listen: None,
            tls_cert: None,
            tls_key: None,
            client_ca: None,
            accept_uncertified_until: None,
            log_format: LogFormat::Text,
            bind_grace_ms: 2000,
            bind_timeout_ms: 2500,
            bind_writes_in_flight: 64,
            bind_slot_wait_ms: 2000,
            filter_pace_max_ms: 1000,
            max_request_bytes: crate::http::DEFAULT_BODY_LIMIT,
            webhook_enabled: false,
            webhook_listen: SocketAddr::from(([0, 0, 0, 0], 9443)),
            webhook_service: "gpushare-extender".to_owned(),
            namespace: "kube-system".to_owned(),
            webhook_configuration: String::new(),
            scheduler_name: gpushare_admission::DEFAULT_SCHEDULER_NAME.to_owned(),
            allocation_keys_file: None,
            leader_elect: false,
            leader_lease: "gpushare-extender".to_owned(),
            pod_name: String::new(),
            leader_lease_duration_ms: 3000,
            leader_renew_deadline_ms: 2000,
            leader_retry_period_ms: 500,
            leader_catch_up_ms: 500,
            leader_probe_holder: true,
            advertise_url: None,
            leader_forward_ca: None,
            leader_forward_cert: None,
            leader_forward_key: None,
            leader_forward_server_name: "gpushare-extender.kube-system.svc".to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_flags() {
        let parsed = Config::try_parse_from(["gpushare-extender"]).unwrap();
        let default = Config::default();
        // Every field, not a chosen few: a flag added with a default that `Default` does not
        // share fails here.
        assert_eq!(format!("{parsed:#?}"), format!("{default:#?}"));
        let shortlist = Config::try_parse_from(["x", "--filter-keep-best", "1"]).unwrap();
        assert_eq!(shortlist.filter_keep_best, 1);
        assert!(Config::try_parse_from(["x", "--filter-keep-best", "-1"]).is_err());
        let spread = Config::try_parse_from(["x", "--policy", "spread"]).unwrap();
        assert_eq!(spread.policy, Policy::Spread);
        let fragmentation = Config::try_parse_from(["x", "--policy", "fragmentation"]).unwrap();
        assert_eq!(fragmentation.policy, Policy::Fragmentation);
        assert!(Config::try_parse_from(["x", "--policy", "random"]).is_err());
        assert!(Config::try_parse_from(["x", "--tls-cert", "c.pem"]).is_err());
        assert!(Config::try_parse_from(["x", "--client-ca", "ca.pem"]).is_err());
        let grace = Config::try_parse_from([
            "x",
            "--tls-cert=c",
            "--tls-key=k",
            "--client-ca=ca",
            "--accept-uncertified-until=2026-11-27T18:00:00Z",
        ])
        .unwrap();
        assert_eq!(
            grace.accept_uncertified_until.map(|t| t.to_string()),
            Some("2026-11-27T18:00:00Z".to_owned())
        );
        assert!(
            Config::try_parse_from([
                "x",
                "--tls-cert=c",
                "--tls-key=k",
                "--client-ca=ca",
                "--accept-uncertified-until=soon",
            ])
            .is_err()
        );
        assert!(!parsed.webhook_enabled);
        let webhook = Config::try_parse_from(["x", "--webhook-enabled", "true"]).unwrap();
        assert!(webhook.webhook_enabled);
        assert_eq!(parsed.allocation_keys_file, None);
        let signing =
            Config::try_parse_from(["x", "--allocation-keys-file", "/keys/keys"]).unwrap();
        assert_eq!(
            signing.allocation_keys_file,
            Some(PathBuf::from("/keys/keys"))
        );
        assert!(!parsed.leader_elect);
        assert_eq!(parsed.lease_timing(), default.lease_timing());
        assert_eq!(
            default.lease_timing(),
            crate::leader::LeaseTiming::default()
        );
    }

    /// The binary run without flags places as the chart does: the chart passes its
    /// `policy` value, and tests that start the extender without `--policy` rely on the two
    /// agreeing.
    #[test]
    fn the_default_policy_is_the_charts() {
        let values = include_str!("../../charts/gpushare/values.yaml");
        let chart = values
            .lines()
            .find_map(|line| line.strip_prefix("policy:"))
            .expect("values.yaml sets policy")
            .trim();
        let parsed = Config::try_parse_from(["gpushare-extender"]).unwrap();
        assert_eq!(parsed.policy, chart.parse::<Policy>().unwrap());
        assert_eq!(Config::default().policy, Policy::Fragmentation);
    }
}
