//! What a [`TestCluster`](super::TestCluster) is made of: its nodes, the order kubelets admit in, the
//! flags of our binaries and the chart's mode and values, with a builder per option.
//!
//! Separate because it is plain data: a scenario reads it to see what it runs on.

use std::time::Duration;

use crate::kubelet::AdmissionOrder;

/// The extender `httpTimeout` gpushare's chart configures.
pub const DEFAULT_HTTP_TIMEOUT: Duration = Duration::from_secs(5);

/// What a [`TestCluster`](super::TestCluster) is made of.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// The nodes: name, GPU sizes in GiB, whether it carries the `gpushare=true` label.
    pub nodes: Vec<(String, Vec<u64>, bool)>,
    /// The order kubelet drivers admit pods in.
    pub admission: AdmissionOrder,
    /// Extra flags for the extender.
    pub extender_args: Vec<String>,
    /// The scheduler's `httpTimeout` for the extender (the chart ships 5 s).
    pub http_timeout: Duration,
    /// Extra flags for every device plugin.
    pub device_plugin_args: Vec<String>,
    /// The chart's `dedicated` scheduler mode: the scheduler driver schedules only pods of
    /// [`DEDICATED_SCHEDULER`], the chart's MutatingWebhookConfiguration routes GPU pods to
    /// it (served by the extender, called by the API server). Default: `default-scheduler`
    /// mode.
    pub dedicated: bool,
    /// Chart values (`key=value`) the dedicated scheduler's configuration is rendered with.
    pub scheduler_values: Vec<String>,
    /// The scheduler driver's [`SchedulerConfig::binding_cycle_delay`](crate::scheduler::SchedulerConfig::binding_cycle_delay) (default none).
    pub binding_cycle_delay: Duration,
    /// How soon the scheduler driver retries an unschedulable pod with no cluster change
    /// (default [`SCHEDULER_UNSCHEDULABLE_RETRY`](super::SCHEDULER_UNSCHEDULABLE_RETRY), short so
    /// scenarios stay quick; kube-scheduler's is five minutes).
    pub unschedulable_retry: Duration,
}

/// The scheduler name of the chart's dedicated mode.
pub const DEDICATED_SCHEDULER: &str = "gpushare-scheduler";

impl ClusterSpec {
    /// One labelled node per entry, GPUs of the given sizes.
    pub fn labelled(nodes: &[(&str, &[u64])]) -> Self {
        Self {
            nodes: nodes
                .iter()
                .map(|(name, gpus)| ((*name).to_owned(), gpus.to_vec(), true))
                .collect(),
            admission: AdmissionOrder::CreationTime,
            extender_args: Vec::new(),
            http_timeout: DEFAULT_HTTP_TIMEOUT,
            device_plugin_args: Vec::new(),
            dedicated: false,
            scheduler_values: Vec::new(),
            binding_cycle_delay: Duration::ZERO,
            unschedulable_retry: super::SCHEDULER_UNSCHEDULABLE_RETRY,
        }
    }

    /// `count` labelled nodes `node-000`, `node-001`, …, each with GPUs of the given sizes.
    pub fn uniform(count: usize, gpus: &[u64]) -> Self {
        Self {
            nodes: (0..count)
                .map(|i| (format!("node-{i:03}"), gpus.to_vec(), true))
                .collect(),
            ..Self::labelled(&[])
        }
    }

    /// The scheduler's `httpTimeout` for the extender.
    pub fn with_http_timeout(mut self, timeout: Duration) -> Self {
        self.http_timeout = timeout;
        self
    }

    /// Passes `args` to every device plugin.
    pub fn with_device_plugin_args(mut self, args: &[&str]) -> Self {
        self.device_plugin_args = args.iter().map(|a| (*a).to_owned()).collect();
        self
    }

    /// Runs the chart's `dedicated` scheduler mode (see [`ClusterSpec::dedicated`]).
    pub fn dedicated(mut self) -> Self {
        self.dedicated = true;
        self
    }

    /// Renders the dedicated scheduler's configuration with these chart values (`key=value`).
    pub fn with_scheduler_values(mut self, values: &[&str]) -> Self {
        self.scheduler_values = values.iter().map(|v| (*v).to_owned()).collect();
        self
    }

    /// Makes every binding cycle take `delay` before its bind call, so the next pods' filters
    /// come first (see [`SchedulerConfig::binding_cycle_delay`](crate::scheduler::SchedulerConfig::binding_cycle_delay)).
    pub fn with_binding_cycle_delay(mut self, delay: Duration) -> Self {
        self.binding_cycle_delay = delay;
        self
    }

    /// Retries an unschedulable pod only on a cluster change or after `retry`: kube-scheduler's
    /// five minutes, for a scenario that must not pass on the short default's retries.
    pub fn with_unschedulable_retry(mut self, retry: Duration) -> Self {
        self.unschedulable_retry = retry;
        self
    }

    /// Adds a node that has GPUs and a device plugin but no participation label.
    pub fn with_unlabelled(mut self, name: &str, gpus: &[u64]) -> Self {
        self.nodes.push((name.to_owned(), gpus.to_vec(), false));
        self
    }
}
