//! A real Prometheus (`.tools/bin/prometheus`, Debian's build, installed by
//! `scripts/install-tools.sh`) scraping the kit's pods as the Prometheus Operator would from
//! the chart's ServiceMonitors, with the chart's alert rules loaded.
//!
//! Why: metric names and labels in docs, alerts and the dashboard are promises; only queries
//! against what the components really export, discovered as a cluster discovers them, keep
//! them. [`scrape_config`] translates each rendered ServiceMonitor into the scrape job the
//! operator generates for it, so a ServiceMonitor the operator would scrape wrong fails here
//! too. Debian's Prometheus has no Kubernetes discovery, so [`discover`] plays it, labelling
//! each ready endpoint as Prometheus' `endpoints` role does for file discovery.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use serde_json::Value;
use tokio::task::JoinHandle;

use super::{items, text};

/// Where this Prometheus listens (a fixed port: the real tier runs one scenario at a time).
pub const LISTEN: &str = "127.0.0.1:19090";

/// A running Prometheus and the task keeping its discovery files current, both stopped when
/// dropped.
pub struct Prometheus {
    child: Child,
    discovery: JoinHandle<()>,
    _dir: tempfile::TempDir,
}

/// One sample of an instant query: its labels (`__name__` where the query keeps it), its value.
#[derive(Debug, Clone)]
pub struct Sample {
    pub labels: serde_json::Map<String, Value>,
    pub value: f64,
}

impl Prometheus {
    /// Starts `prometheus` (in `tools`) scraping what `monitors` (rendered ServiceMonitors, as
    /// JSON) select, as the operator would ([`scrape_config`]), with the rule files `rules`,
    /// scraping and evaluating every second. Discovery follows the EndpointSlices as
    /// Prometheus' own Kubernetes discovery does ([`discover`]): a task rewrites the
    /// file-discovery files every second, so a replica that turns ready after the start, often
    /// the leader, is scraped too.
    pub async fn start(
        tools: &Path,
        client: &kube::Client,
        monitors: Vec<Value>,
        rules: &[PathBuf],
    ) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let mut scrape_configs = Vec::new();
        let mut monitored = Vec::new();
        for monitor in monitors {
            let targets = dir.path().join(format!("targets-{}.json", monitored.len()));
            scrape_configs.push(scrape_config(&monitor, 0, &targets)?);
            monitored.push((monitor, targets));
        }
        // Just after an install the monitored replicas may not be ready yet: their endpoints
        // are waited for, as Prometheus itself would keep looking.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            write_discovery(client, &monitored).await?;
            let empty = monitored.iter().find(|(_, targets)| {
                std::fs::read_to_string(targets).ok().as_deref() == Some("[]")
            });
            let Some((monitor, _)) = empty else { break };
            ensure!(
                tokio::time::Instant::now() < deadline,
                "no ready endpoint after 60 s for {monitor}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let config = serde_json::json!({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": rules,
            "scrape_configs": scrape_configs,
        });
        let config_file = dir.path().join("prometheus.yml");
        std::fs::write(&config_file, serde_yaml::to_string(&config)?)?;
        let log = std::fs::File::create(dir.path().join("prometheus.log"))?;
        let data = dir.path().join("data");
        let child = Command::new(tools.join("prometheus"))
            .arg(format!("--config.file={}", config_file.display()))
            .arg(format!("--storage.tsdb.path={}", data.display()))
            .arg(format!("--web.listen-address={LISTEN}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", tools.join("prometheus").display()))?;
        let client = client.clone();
        let discovery = tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                if let Err(error) = write_discovery(&client, &monitored).await {
                    eprintln!("  Prometheus discovery: {error:#}");
                }
            }
        });
        // Held from here, so that a failure below stops the process and the task with it.
        let prometheus = Self {
            child,
            discovery,
            _dir: dir,
        };
        for _ in 0..100 {
            if prometheus.get("/-/ready", &[]).is_ok() {
                return Ok(prometheus);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        bail!("prometheus did not become ready:\n{}", prometheus.log())
    }

    /// Prometheus' own log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// `GET path` with `query` (url-encoded by curl); the body.
    fn get(&self, path: &str, query: &[(&str, &str)]) -> anyhow::Result<String> {
        let mut curl = Command::new("curl");
        curl.args(["-sS", "--fail-with-body", "-G", "--max-time", "10"])
            .arg(format!("http://{LISTEN}{path}"));
        for (key, value) in query {
            curl.arg("--data-urlencode").arg(format!("{key}={value}"));
        }
        let output = curl.output().context("running curl")?;
        let body = String::from_utf8_lossy(&output.stdout).into_owned();
        ensure!(
            output.status.success(),
            "GET {path} {query:?}: {body}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(body)
    }

    /// An instant query; an error when Prometheus refuses it (a parse error, an unknown
    /// function) or the result is not a vector.
    pub fn query(&self, expr: &str) -> anyhow::Result<Vec<Sample>> {
        let body: Value = serde_json::from_str(&self.get("/api/v1/query", &[("query", expr)])?)?;
        ensure!(body["status"] == "success", "{expr}: {body}");
        let data = &body["data"];
        let samples = match data["resultType"].as_str() {
            Some("vector") => data["result"].as_array().cloned().unwrap_or_default(),
            Some("scalar") => vec![serde_json::json!({"metric": {}, "value": data["result"]})],
            other => bail!("{expr}: a {other:?}, not a vector"),
        };
        let sample = |s: &Value| {
            let value = s["value"][1].as_str().context("sample value")?.parse()?;
            let labels = s["metric"].as_object().cloned().unwrap_or_default();
            anyhow::Ok(Sample { labels, value })
        };
        samples.iter().map(sample).collect()
    }

    /// Every loaded rule's health, as `(group/name, health, last error)`.
    pub fn rules(&self) -> anyhow::Result<Vec<(String, String, String)>> {
        let body: Value = serde_json::from_str(&self.get("/api/v1/rules", &[])?)?;
        let mut rules = Vec::new();
        for group in items(&body["data"]["groups"]) {
            for rule in items(&group["rules"]) {
                let name = format!("{}/{}", text(&group["name"]), text(&rule["name"]));
                rules.push(health(name, rule));
            }
        }
        Ok(rules)
    }

    /// The scrape targets' `(job, health, last error)`.
    pub fn targets(&self) -> anyhow::Result<Vec<(String, String, String)>> {
        let body: Value = serde_json::from_str(&self.get("/api/v1/targets", &[])?)?;
        Ok(items(&body["data"]["activeTargets"])
            .map(|target| health(text(&target["labels"]["job"]).into(), target))
            .collect())
    }
}

/// Aborting takes effect at the discovery task's next await: a write in progress on another
/// worker may still finish, or fail on the folder being removed (at worst one printed error).
impl Drop for Prometheus {
    fn drop(&mut self) {
        self.discovery.abort();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Each monitor's ready endpoints written to its discovery file, through a rename so that
/// Prometheus never reads half a file; an unchanged file is left alone.
async fn write_discovery(
    client: &kube::Client,
    monitors: &[(Value, PathBuf)],
) -> anyhow::Result<()> {
    for (monitor, targets) in monitors {
        let groups = discover(client, monitor, 0).await?;
        let text = serde_json::to_string(&groups)?;
        if std::fs::read_to_string(targets).ok().as_deref() == Some(text.as_str()) {
            continue;
        }
        let fresh = targets.with_extension("json.new");
        std::fs::write(&fresh, &text)?;
        std::fs::rename(&fresh, targets)?;
    }
    Ok(())
}

/// The targets of endpoint `index` of `monitor` (a rendered ServiceMonitor, as JSON), as
/// file discovery reads them: one group per ready endpoint address and port, labelled as
/// Prometheus' Kubernetes `endpoints` role labels it.
async fn discover(
    client: &kube::Client,
    monitor: &Value,
    index: usize,
) -> anyhow::Result<Vec<Value>> {
    use k8s_openapi::api::core::v1::Service;
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use kube::api::{Api, ListParams};
    let spec = &monitor["spec"];
    let namespace = text(&monitor["metadata"]["namespace"]);
    let namespaces: Vec<&str> = match spec["namespaceSelector"]["matchNames"].as_array() {
        Some(names) => names.iter().filter_map(Value::as_str).collect(),
        None => vec![namespace],
    };
    let selector: Vec<String> = fields(&spec["selector"]["matchLabels"])
        .map(|(k, v)| format!("{k}={}", text(v)))
        .collect();
    let port = text(&spec["endpoints"][index]["port"]);
    let mut groups = Vec::new();
    for namespace in &namespaces {
        let services = Api::<Service>::namespaced(client.clone(), namespace)
            .list(&ListParams::default().labels(&selector.join(",")))
            .await?;
        for service in services {
            let name = service.metadata.name.clone().unwrap_or_default();
            let mut service_labels = serde_json::Map::new();
            for (key, value) in service.metadata.labels.iter().flatten() {
                service_labels.insert(
                    format!("__meta_kubernetes_service_label_{}", sanitize(key)),
                    Value::from(value.as_str()),
                );
            }
            let slices = Api::<EndpointSlice>::namespaced(client.clone(), namespace)
                .list(&ListParams::default().labels(&format!("kubernetes.io/service-name={name}")))
                .await?;
            for slice in slices {
                let mut ports = slice.ports.iter().flatten();
                let named = ports.find(|p| p.name.as_deref() == Some(port));
                let Some(number) = named.and_then(|p| p.port) else {
                    continue;
                };
                for endpoint in slice.endpoints.iter().flatten() {
                    if endpoint.conditions.as_ref().and_then(|c| c.ready) == Some(false) {
                        continue;
                    }
                    let mut labels = service_labels.clone();
                    let pod = endpoint.target_ref.as_ref().and_then(|r| r.name.as_deref());
                    for (key, value) in [
                        ("__meta_kubernetes_namespace", Some(*namespace)),
                        ("__meta_kubernetes_service_name", Some(name.as_str())),
                        ("__meta_kubernetes_endpoint_port_name", Some(port)),
                        ("__meta_kubernetes_pod_name", pod),
                        (
                            "__meta_kubernetes_pod_node_name",
                            endpoint.node_name.as_deref(),
                        ),
                    ] {
                        if let Some(value) = value {
                            labels.insert(key.to_owned(), Value::from(value));
                        }
                    }
                    for address in &endpoint.addresses {
                        groups.push(serde_json::json!({
                            "targets": [format!("{address}:{number}")],
                            "labels": labels,
                        }));
                    }
                }
            }
        }
    }
    Ok(groups)
}

/// The scrape job the Prometheus Operator generates for endpoint `index` of `monitor` (a
/// rendered ServiceMonitor, as JSON); `targets` is the file [`discover`]'s groups are in.
fn scrape_config(monitor: &Value, index: usize, targets: &Path) -> anyhow::Result<Value> {
    let namespace = monitor["metadata"]["namespace"]
        .as_str()
        .context("ServiceMonitor namespace")?;
    let name = monitor["metadata"]["name"]
        .as_str()
        .context("ServiceMonitor name")?;
    let spec = &monitor["spec"];
    let endpoint = &spec["endpoints"][index];
    let mut relabel = Vec::new();
    for (key, value) in fields(&spec["selector"]["matchLabels"]) {
        relabel.push(serde_json::json!({
            "source_labels": [format!("__meta_kubernetes_service_label_{}", sanitize(key))],
            "regex": text(value),
            "action": "keep",
        }));
    }
    let port = endpoint["port"]
        .as_str()
        .context("ServiceMonitor endpoint port name")?;
    relabel.push(serde_json::json!({
        "source_labels": ["__meta_kubernetes_endpoint_port_name"], "regex": port, "action": "keep",
    }));
    for (source, target) in [
        ("__meta_kubernetes_namespace", "namespace"),
        ("__meta_kubernetes_service_name", "service"),
        ("__meta_kubernetes_pod_name", "pod"),
        ("__meta_kubernetes_pod_container_name", "container"),
        ("__meta_kubernetes_service_name", "job"),
    ] {
        relabel.push(serde_json::json!({"source_labels": [source], "target_label": target}));
    }
    relabel.push(serde_json::json!({"target_label": "endpoint", "replacement": port}));
    for user in items(&endpoint["relabelings"]) {
        let mut rule = serde_json::Map::new();
        for (key, value) in fields(user) {
            let key = match key.as_str() {
                "sourceLabels" => "source_labels",
                "targetLabel" => "target_label",
                other => other,
            };
            rule.insert(key.to_lowercase(), value.clone());
        }
        relabel.push(Value::Object(rule));
    }
    Ok(serde_json::json!({
        "job_name": format!("serviceMonitor/{namespace}/{name}/{index}"),
        "honor_labels": endpoint["honorLabels"].as_bool().unwrap_or(false),
        "metrics_path": endpoint["path"].as_str().unwrap_or("/metrics"),
        "scrape_interval": "1s",
        "file_sd_configs": [{"files": [targets], "refresh_interval": "1s"}],
        "relabel_configs": relabel,
    }))
}

/// The fields of `value` when it is an object.
fn fields(value: &Value) -> impl Iterator<Item = (&String, &Value)> {
    value.as_object().into_iter().flatten()
}

/// `(name, health, last error)` of a rule or target `of`.
fn health(name: String, of: &Value) -> (String, String, String) {
    (
        name,
        text(&of["health"]).into(),
        text(&of["lastError"]).into(),
    )
}

/// A label name as Prometheus' discovery writes it: every character outside `[a-zA-Z0-9_]`
/// becomes `_`.
fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_monitor_becomes_the_operators_scrape_job() {
        let monitor = serde_json::json!({
            "metadata": {"name": "g-device-plugin", "namespace": "kube-system"},
            "spec": {
                "namespaceSelector": {"matchNames": ["kube-system"]},
                "selector": {"matchLabels": {"app.kubernetes.io/component": "device-plugin"}},
                "endpoints": [{
                    "port": "metrics", "path": "/metrics", "honorLabels": true,
                    "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}],
                }],
            },
        });
        let job = scrape_config(&monitor, 0, Path::new("targets.json")).unwrap();
        assert_eq!(job["file_sd_configs"][0]["files"][0], "targets.json");
        assert_eq!(job["honor_labels"], true);
        let relabel = job["relabel_configs"].as_array().unwrap();
        assert_eq!(
            relabel[0]["source_labels"][0],
            "__meta_kubernetes_service_label_app_kubernetes_io_component"
        );
        assert_eq!(relabel[1]["regex"], "metrics");
        let last = relabel.last().unwrap();
        assert_eq!(last["source_labels"][0], "__meta_kubernetes_pod_node_name");
        assert_eq!(last["target_label"], "node");
    }
}
