//! What a drain costs, measured from outside the schedulers: the first moment each pod was
//! seen bound ([`BindClock`]), each process's CPU time and memory from `/proc`, and the API
//! server's request counters by verb. Apart from the drain, so the measuring reads in one place.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::KitCluster;

/// The first moment each pod of a namespace was seen bound, from a pod watch.
pub struct BindClock {
    task: JoinHandle<()>,
    bound: Arc<Mutex<HashMap<String, Instant>>>,
    changed: Arc<Notify>,
}

impl BindClock {
    /// Starts watching the pods of `namespace` that carry `selector`.
    pub fn start(client: Client, namespace: &str, selector: &str) -> Self {
        let bound = Arc::new(Mutex::new(HashMap::new()));
        let changed = Arc::new(Notify::new());
        let pods: Api<Pod> = Api::namespaced(client, namespace);
        let config = watcher::Config::default().labels(selector);
        let task = tokio::spawn({
            let (bound, changed) = (bound.clone(), changed.clone());
            async move {
                let mut events = watcher(pods, config)
                    .default_backoff()
                    .applied_objects()
                    .boxed();
                while let Some(event) = events.next().await {
                    let Ok(pod) = event else { continue };
                    let bound_to = pod.spec.as_ref().and_then(|s| s.node_name.as_ref());
                    if bound_to.is_none() {
                        continue;
                    }
                    if let Ok(mut bound) = bound.lock() {
                        bound.entry(pod.name_any()).or_insert_with(Instant::now);
                    }
                    changed.notify_waiters();
                }
            }
        });
        Self {
            task,
            bound,
            changed,
        }
    }

    /// How many pods were seen bound.
    pub fn count(&self) -> usize {
        self.bound.lock().map(|b| b.len()).unwrap_or_default()
    }

    /// Waits until `pods` were seen bound, at most `timeout`; the moments, earliest first.
    pub async fn wait_for(&self, pods: usize, timeout: Duration) -> anyhow::Result<Vec<Instant>> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            if self.count() >= pods {
                break;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                let (bound, seconds) = (self.count(), timeout.as_secs());
                anyhow::bail!("{bound} of {pods} pods bound after {seconds} s");
            }
        }
        let mut moments: Vec<Instant> = self
            .bound
            .lock()
            .map(|b| b.values().copied().collect())
            .unwrap_or_default();
        moments.sort();
        Ok(moments)
    }
}

impl Drop for BindClock {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Where a process of the drain is: a name for the report and a host pid.
fn processes(cluster: &KitCluster) -> Vec<(String, u32)> {
    let mut found = Vec::new();
    let state = cluster.kit().root().join("harness/state/pids");
    for name in [
        "kube-apiserver",
        "etcd",
        "kube-scheduler",
        "kube-controller-manager",
    ] {
        let pid = std::fs::read_to_string(state.join(name)).ok();
        if let Some(pid) = pid.and_then(|text| text.trim().parse().ok()) {
            let name = match name {
                "kube-scheduler" => "kube-scheduler (kit)",
                other => other,
            };
            found.push((name.to_owned(), pid));
        }
    }
    found.extend(chart_processes(cluster));
    found
}

/// The host pids of the chart's extender and scheduler containers, by pod name.
pub fn chart_processes(cluster: &KitCluster) -> Vec<(String, u32)> {
    let names = "jsonpath={range .items[*]}{.metadata.name}{\"\\n\"}{end}";
    let pods = cluster
        .system(&["get", "pods", "-o", names])
        .unwrap_or_default();
    pods.lines()
        .filter_map(|pod| {
            let container = if pod.starts_with("gpushare-extender-") {
                "extender"
            } else if pod.starts_with("gpushare-scheduler-") {
                "kube-scheduler"
            } else {
                return None;
            };
            Some((pod.to_owned(), container_pid(cluster, pod, container)?))
        })
        .collect()
}

/// The host pid the kit's runtime started for `pod`'s `container` (its latest start).
pub(super) fn container_pid(cluster: &KitCluster, pod: &str, container: &str) -> Option<u32> {
    cluster
        .script("chart-cluster.sh", &["pid", pod, container])
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Field `number` (1-based, as `man proc` counts) of `/proc/<pid>/stat`, in clock ticks
/// where it is a time: 100 a second on Linux.
pub(super) fn stat_field(pid: u32, number: usize) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command (which may hold spaces) in parentheses start at field 3.
    let rest = stat.rsplit_once(')')?.1;
    rest.split_whitespace()
        .nth(number.checked_sub(3)?)?
        .parse()
        .ok()
}

/// User plus system CPU seconds of `pid` so far (`utime` and `stime`, fields 14 and 15).
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    Some((stat_field(pid, 14)? + stat_field(pid, 15)?) / 100.0)
}

/// Peak and current resident memory of `pid` (`VmHWM`, `VmRSS`), in MiB.
pub fn rss_mib(pid: u32) -> Option<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |key: &str| -> Option<f64> {
        let line = status.lines().find(|l| l.starts_with(key))?;
        let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib / 1024.0)
    };
    Some((field("VmHWM:")?, field("VmRSS:")?))
}

/// The API server's `apiserver_request_total`, summed by verb and resource (`PATCH nodes`,
/// `POST pods/binding`; watches and lists by verb alone).
pub(super) async fn api_requests(client: &Client) -> anyhow::Result<BTreeMap<String, f64>> {
    let text = apiserver_metrics(client).await?;
    let mut by_call = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|l| l.strip_prefix(name)?.strip_prefix("=\""))
                .map(|v| v.trim_end_matches('"'))
                .unwrap_or_default()
        };
        let verb = label("verb");
        let call = match (verb, label("resource"), label("subresource")) {
            ("WATCH" | "LIST" | "GET", _, _) | (_, "", _) => verb.to_owned(),
            (_, resource, "") => format!("{verb} {resource}"),
            (_, resource, sub) => format!("{verb} {resource}/{sub}"),
        };
        *by_call.entry(call).or_insert(0.0) += value.parse::<f64>().unwrap_or(0.0);
    }
    Ok(by_call)
}

/// The API server's own `/metrics`.
pub(super) async fn apiserver_metrics(client: &Client) -> anyhow::Result<String> {
    let request = http::Request::get("/metrics").body(Vec::new())?;
    Ok(client.request_text(request).await?)
}

/// CPU seconds so far of every process of the drain, by pid.
pub(super) fn cpu_by_pid(cluster: &KitCluster) -> HashMap<u32, f64> {
    processes(cluster)
        .into_iter()
        .filter_map(|(_, pid)| Some((pid, cpu_seconds(pid)?)))
        .collect()
}

/// CPU seconds every process of the drain used since `before` (from [`cpu_by_pid`]), by
/// name; a process started since counts whole.
pub(super) fn cpu_since(cluster: &KitCluster, before: &HashMap<u32, f64>) -> BTreeMap<String, f64> {
    processes(cluster)
        .into_iter()
        .filter_map(|(name, pid)| {
            let before = before.get(&pid).copied().unwrap_or(0.0);
            Some((name, cpu_seconds(pid)? - before))
        })
        .collect()
}
