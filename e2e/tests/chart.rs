//! The Helm chart, checked with the real helm: it lints, it renders with default and with
//! non-default values, every rendered object parses into its Kubernetes type without losing
//! a field (a lost field is a typo the API server would silently drop), the embedded
//! KubeSchedulerConfiguration points at the extender, and RBAC grants exactly what the code
//! calls.

#![allow(clippy::unwrap_used)] // a test failing on unexpected data is the point

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Container, PodSpec, Secret, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

const KUBE_VERSION: &str = "1.36.0";

fn chart_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../charts/gpushare")
        .canonicalize()
        .unwrap()
}

fn helm(args: &[&str]) -> anyhow::Result<std::process::Output> {
    let helm = gpushare_e2e::tools::helm()?;
    Command::new(&helm)
        .args(args)
        .output()
        .with_context(|| format!("running {}", helm.display()))
}

/// `helm template` with `extra` arguments; the documents as JSON.
fn render(release: &str, namespace: &str, extra: &[&str]) -> anyhow::Result<Rendered> {
    let chart = chart_dir();
    let mut args = vec![
        "template",
        release,
        chart.to_str().context("chart path")?,
        "--namespace",
        namespace,
        "--kube-version",
        KUBE_VERSION,
    ];
    args.extend_from_slice(extra);
    let output = helm(&args)?;
    ensure!(
        output.status.success(),
        "helm template failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout)?;
    let mut docs = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let yaml = serde_yaml::Value::deserialize(doc)?;
        if yaml.is_null() {
            continue;
        }
        docs.push(serde_json::to_value(&yaml)?);
    }
    Ok(Rendered {
        release: release.to_owned(),
        namespace: namespace.to_owned(),
        docs,
    })
}

struct Rendered {
    release: String,
    namespace: String,
    docs: Vec<Value>,
}

impl Rendered {
    fn of_kind(&self, kind: &str) -> Vec<&Value> {
        self.docs.iter().filter(|d| d["kind"] == kind).collect()
    }

    /// The object of `kind` named `name`, parsed into `T` (already checked for lost fields).
    fn get<T: DeserializeOwned>(&self, kind: &str, name: &str) -> anyhow::Result<T> {
        let doc = self
            .of_kind(kind)
            .into_iter()
            .find(|d| d["metadata"]["name"] == name)
            .with_context(|| format!("no {kind} named {name} rendered"))?;
        Ok(serde_json::from_value(doc.clone())?)
    }

    fn kinds(&self) -> BTreeMap<String, usize> {
        let mut kinds = BTreeMap::new();
        for doc in &self.docs {
            *kinds
                .entry(doc["kind"].as_str().unwrap_or("?").to_owned())
                .or_insert(0) += 1;
        }
        kinds
    }
}

/// Parses `doc` as `T`, serializes it back and fails on every key the typed value lost.
fn round_trip<T: DeserializeOwned + serde::Serialize>(doc: &Value) -> anyhow::Result<()> {
    let typed: T = serde_json::from_value(doc.clone())
        .with_context(|| format!("{} {} does not parse", doc["kind"], doc["metadata"]["name"]))?;
    let back = serde_json::to_value(&typed)?;
    let mut lost = Vec::new();
    lost_keys(doc, &back, "", &mut lost);
    ensure!(
        lost.is_empty(),
        "{} {}: unknown fields (typos?) {lost:?}",
        doc["kind"],
        doc["metadata"]["name"]
    );
    Ok(())
}

fn lost_keys(original: &Value, back: &Value, path: &str, lost: &mut Vec<String>) {
    match (original, back) {
        (Value::Object(a), Value::Object(b)) => {
            for (key, value) in a {
                let here = format!("{path}.{key}");
                match b.get(key) {
                    None if !value.is_null() => lost.push(here),
                    None => {}
                    Some(other) => lost_keys(value, other, &here, lost),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                lost_keys(x, y, &format!("{path}[{i}]"), lost);
            }
            if a.len() != b.len() {
                lost.push(format!("{path}: {} items became {}", a.len(), b.len()));
            }
        }
        _ => {}
    }
}

/// Every document parses into its type by kind without losing a field.
fn check_all_typed(rendered: &Rendered) -> anyhow::Result<()> {
    for doc in &rendered.docs {
        let kind = doc["kind"].as_str().context("document without kind")?;
        match kind {
            "Deployment" => round_trip::<Deployment>(doc)?,
            "DaemonSet" => round_trip::<DaemonSet>(doc)?,
            "Service" => round_trip::<Service>(doc)?,
            "ServiceAccount" => round_trip::<ServiceAccount>(doc)?,
            "Secret" => round_trip::<Secret>(doc)?,
            "ClusterRole" => round_trip::<ClusterRole>(doc)?,
            "ClusterRoleBinding" => round_trip::<ClusterRoleBinding>(doc)?,
            "Role" => round_trip::<Role>(doc)?,
            "RoleBinding" => round_trip::<RoleBinding>(doc)?,
            "ConfigMap" => round_trip::<ConfigMap>(doc)?,
            "MutatingWebhookConfiguration" => round_trip::<MutatingWebhookConfiguration>(doc)?,
            "ValidatingAdmissionPolicy" => round_trip::<ValidatingAdmissionPolicy>(doc)?,
            "ValidatingAdmissionPolicyBinding" => {
                round_trip::<ValidatingAdmissionPolicyBinding>(doc)?
            }
            "ServiceMonitor" => {
                ensure!(doc["apiVersion"] == "monitoring.coreos.com/v1");
                ensure!(doc["spec"]["selector"]["matchLabels"].is_object());
                ensure!(doc["spec"]["endpoints"][0]["port"].is_string());
            }
            other => bail!("unexpected kind {other} rendered"),
        }
        // Standard labels on every object.
        let labels = &doc["metadata"]["labels"];
        for key in [
            "app.kubernetes.io/name",
            "app.kubernetes.io/instance",
            "app.kubernetes.io/version",
            "app.kubernetes.io/component",
            "app.kubernetes.io/managed-by",
            "helm.sh/chart",
        ] {
            ensure!(
                labels[key].is_string(),
                "{kind} {} lacks label {key}",
                doc["metadata"]["name"]
            );
        }
    }
    Ok(())
}

/// Every container runs locked down with resources set.
fn check_hardened(name: &str, spec: &PodSpec) -> anyhow::Result<()> {
    for c in &spec.containers {
        let sc = c.security_context.as_ref().context("no securityContext")?;
        ensure!(
            sc.read_only_root_filesystem == Some(true),
            "{name}/{}: writable root",
            c.name
        );
        ensure!(
            sc.allow_privilege_escalation == Some(false),
            "{name}/{}",
            c.name
        );
        ensure!(
            sc.privileged != Some(true),
            "{name}/{} is privileged",
            c.name
        );
        let drop = sc
            .capabilities
            .as_ref()
            .and_then(|c| c.drop.clone())
            .unwrap_or_default();
        ensure!(
            drop == ["ALL"],
            "{name}/{}: capabilities not dropped",
            c.name
        );
        let resources = c.resources.as_ref().context("no resources")?;
        ensure!(
            resources.requests.is_some() && resources.limits.is_some(),
            "{name}/{}",
            c.name
        );
    }
    Ok(())
}

fn container<'a>(spec: &'a PodSpec, name: &str) -> anyhow::Result<&'a Container> {
    spec.containers
        .iter()
        .find(|c| c.name == name)
        .with_context(|| format!("no container {name}"))
}

fn args(c: &Container) -> Vec<String> {
    c.args.clone().unwrap_or_default()
}

// ---------------------------------------------------------------------------------------
// RBAC: exactly what the code calls. One entry per (apiGroup, resource, verb), with the call.

/// The extender's permissions (its ClusterRole).
const EXTENDER_RBAC: &[(&str, &str, &str, &str)] = &[
    (
        "",
        "pods",
        "list",
        "extender/src/watch.rs: watcher(Api::<Pod>::all) initial list",
    ),
    (
        "",
        "pods",
        "watch",
        "extender/src/watch.rs: watcher(Api::<Pod>::all)",
    ),
    (
        "",
        "nodes",
        "list",
        "extender/src/watch.rs: watcher(Api::<Node>::all) initial list",
    ),
    (
        "",
        "nodes",
        "watch",
        "extender/src/watch.rs: watcher(Api::<Node>::all)",
    ),
    (
        "",
        "pods",
        "get",
        "extender/src/kube_io.rs: KubeBinder::read_pod get_opt (resolving a Binding that got no clear answer)",
    ),
    (
        "",
        "pods/binding",
        "create",
        "extender/src/kube_io.rs: KubeBinder::bind create_subresource(\"binding\")",
    ),
    (
        "events.k8s.io",
        "events",
        "create",
        "extender/src/kube_io.rs: record_events, kube::runtime::events::Recorder::publish",
    ),
    (
        "events.k8s.io",
        "events",
        "patch",
        "extender/src/kube_io.rs: Recorder::publish updating a repeated event's series",
    ),
];

/// Only with the webhook (dedicated mode).
const EXTENDER_WEBHOOK_RBAC: &[(&str, &str, &str, &str)] = &[
    (
        "admissionregistration.k8s.io",
        "mutatingwebhookconfigurations",
        "get",
        "admission/src/tls.rs: CaBundlePatcher::patch reads the configuration",
    ),
    (
        "admissionregistration.k8s.io",
        "mutatingwebhookconfigurations",
        "patch",
        "admission/src/tls.rs: CaBundlePatcher::patch writes caBundle",
    ),
];

/// The device plugin's permissions.
const DEVICE_PLUGIN_RBAC: &[(&str, &str, &str, &str)] = &[
    (
        "",
        "nodes",
        "get",
        "device plugin: reads its own Node (NODE_NAME) at start",
    ),
    (
        "",
        "nodes",
        "patch",
        "device-plugin/src/node.rs: Patch::Merge of the inventory annotation and gpu-count label",
    ),
    (
        "",
        "pods",
        "list",
        "device-plugin/src/pods.rs: reflector(watcher(fieldSelector spec.nodeName)) initial list",
    ),
    (
        "",
        "pods",
        "watch",
        "device-plugin/src/pods.rs: reflector(watcher(fieldSelector spec.nodeName))",
    ),
    (
        "",
        "pods",
        "patch",
        "device-plugin/src/pods.rs: patch_worker Patch::Merge of allocation progress",
    ),
];

type Grant = (String, String, String);

fn expand(rules: &[PolicyRule]) -> BTreeSet<Grant> {
    let mut grants = BTreeSet::new();
    for rule in rules {
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    grants.insert((group.clone(), resource.clone(), verb.clone()));
                }
            }
        }
    }
    grants
}

fn expected(lists: &[&[(&str, &str, &str, &str)]]) -> BTreeSet<Grant> {
    lists
        .iter()
        .flat_map(|list| list.iter())
        .map(|(g, r, v, _why)| (g.to_string(), r.to_string(), v.to_string()))
        .collect()
}

fn check_rbac(rendered: &Rendered, prefix: &str, webhook: bool) -> anyhow::Result<()> {
    let extender = format!("{prefix}-extender");
    let cluster_role: ClusterRole = rendered.get("ClusterRole", &extender)?;
    ensure!(
        rendered.get::<Role>("Role", &extender).is_err(),
        "the extender needs no namespaced Role"
    );
    let granted = expand(cluster_role.rules.as_deref().unwrap_or_default());
    let want = if webhook {
        expected(&[EXTENDER_RBAC, EXTENDER_WEBHOOK_RBAC])
    } else {
        expected(&[EXTENDER_RBAC])
    };
    ensure!(
        granted == want,
        "extender RBAC differs: extra {:?}, missing {:?}",
        granted.difference(&want).collect::<Vec<_>>(),
        want.difference(&granted).collect::<Vec<_>>()
    );
    // The webhook rule only on our configuration.
    for rule in cluster_role.rules.iter().flatten() {
        if rule.api_groups.as_deref() == Some(&["admissionregistration.k8s.io".to_owned()]) {
            ensure!(
                rule.resource_names.as_deref() == Some(&[format!("{prefix}-webhook")]),
                "mutatingwebhookconfigurations not restricted by resourceNames"
            );
        }
    }

    let plugin = format!("{prefix}-device-plugin");
    let cluster_role: ClusterRole = rendered.get("ClusterRole", &plugin)?;
    let granted = expand(cluster_role.rules.as_deref().unwrap_or_default());
    let want = expected(&[DEVICE_PLUGIN_RBAC]);
    ensure!(
        granted == want,
        "device plugin RBAC differs: extra {:?}, missing {:?}",
        granted.difference(&want).collect::<Vec<_>>(),
        want.difference(&granted).collect::<Vec<_>>()
    );

    // Each ClusterRole is bound to its component's ServiceAccount, in the release namespace.
    for name in [&extender, &plugin] {
        let binding: ClusterRoleBinding = rendered.get("ClusterRoleBinding", name)?;
        ensure!(binding.role_ref.name == *name);
        let subject = &binding.subjects.as_deref().unwrap_or_default()[0];
        ensure!(subject.name == *name);
        ensure!(subject.namespace.as_deref() == Some(rendered.namespace.as_str()));
        let _: ServiceAccount = rendered.get("ServiceAccount", name)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The dedicated scheduler's configuration, with the real v1 field names.

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct KubeSchedulerConfiguration {
    api_version: String,
    kind: String,
    leader_election: LeaderElection,
    profiles: Vec<Profile>,
    extenders: Vec<Extender>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct LeaderElection {
    leader_elect: bool,
    resource_lock: String,
    resource_name: String,
    resource_namespace: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Profile {
    scheduler_name: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Extender {
    url_prefix: String,
    filter_verb: String,
    #[serde(default)]
    preempt_verb: Option<String>,
    prioritize_verb: String,
    weight: i64,
    bind_verb: String,
    #[serde(rename = "enableHTTPS")]
    enable_https: bool,
    http_timeout: String,
    node_cache_capable: bool,
    managed_resources: Vec<ManagedResource>,
    ignorable: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ManagedResource {
    name: String,
    ignored_by_scheduler: bool,
}

fn check_scheduler(rendered: &Rendered, prefix: &str, resource: &str) -> anyhow::Result<()> {
    let ns = &rendered.namespace;
    let name = format!("{prefix}-scheduler");
    let config_map: ConfigMap = rendered.get("ConfigMap", &format!("{name}-config"))?;
    let text = config_map
        .data
        .as_ref()
        .and_then(|d| d.get("scheduler-config.yaml"))
        .context("no scheduler-config.yaml")?;
    let config: KubeSchedulerConfiguration = serde_yaml::from_str(text)?;
    ensure!(config.api_version == "kubescheduler.config.k8s.io/v1");
    ensure!(config.kind == "KubeSchedulerConfiguration");
    ensure!(config.profiles[0].scheduler_name == "gpushare-scheduler");
    let le = &config.leader_election;
    ensure!(le.leader_elect && le.resource_lock == "leases");
    ensure!(le.resource_name == name && le.resource_namespace == *ns);

    let [extender] = config.extenders.as_slice() else {
        bail!("expected one extender, got {:?}", config.extenders);
    };
    let service = format!("{prefix}-extender");
    ensure!(
        extender.url_prefix == format!("http://{service}.{ns}.svc:39999/gpushare-scheduler"),
        "{}",
        extender.url_prefix
    );
    ensure!(extender.filter_verb == "filter");
    ensure!(extender.prioritize_verb == "prioritize");
    ensure!(extender.bind_verb == "bind");
    ensure!(extender.preempt_verb.is_none());
    ensure!(extender.weight > 0 && !extender.enable_https && !extender.ignorable);
    ensure!(extender.http_timeout == "5s");
    ensure!(extender.node_cache_capable);
    ensure!(
        extender
            .managed_resources
            .iter()
            .any(|r| r.name == resource && !r.ignored_by_scheduler)
    );
    // The URL's service and port exist.
    let svc: Service = rendered.get("Service", &service)?;
    let ports = svc.spec.and_then(|s| s.ports).unwrap_or_default();
    ensure!(
        ports
            .iter()
            .any(|p| p.name.as_deref() == Some("http") && p.port == 39999)
    );

    let deployment: Deployment = rendered.get("Deployment", &name)?;
    let spec = deployment
        .spec
        .and_then(|s| s.template.spec)
        .context("no pod spec")?;
    check_hardened(&name, &spec)?;
    let c = container(&spec, "kube-scheduler")?;
    ensure!(
        c.image.as_deref() == Some(&format!("registry.k8s.io/kube-scheduler:v{KUBE_VERSION}")),
        "scheduler image {:?} does not match the cluster version",
        c.image
    );
    let command = c.command.clone().unwrap_or_default();
    ensure!(command.contains(&"--config=/etc/gpushare-scheduler/scheduler-config.yaml".to_owned()));
    ensure!(spec.service_account_name.as_deref() == Some(name.as_str()));
    for role in ["system:kube-scheduler", "system:volume-scheduler"] {
        let suffix = role.trim_start_matches("system:");
        let binding: ClusterRoleBinding =
            rendered.get("ClusterRoleBinding", &format!("{name}-{suffix}"))?;
        ensure!(binding.role_ref.name == role);
    }
    let reader: RoleBinding =
        rendered.get("RoleBinding", &format!("{name}-authentication-reader"))?;
    ensure!(reader.metadata.namespace.as_deref() == Some("kube-system"));
    ensure!(reader.role_ref.name == "extension-apiserver-authentication-reader");
    Ok(())
}

fn check_webhook(rendered: &Rendered, prefix: &str) -> anyhow::Result<()> {
    let config: MutatingWebhookConfiguration =
        rendered.get("MutatingWebhookConfiguration", &format!("{prefix}-webhook"))?;
    let webhooks = config.webhooks.unwrap_or_default();
    let [webhook] = webhooks.as_slice() else {
        bail!("expected one webhook");
    };
    ensure!(webhook.failure_policy.as_deref() == Some("Ignore"));
    ensure!(webhook.side_effects == "None");
    ensure!(webhook.admission_review_versions == ["v1"]);
    ensure!(
        webhook.client_config.ca_bundle.is_none(),
        "caBundle is set at runtime"
    );
    let service = webhook
        .client_config
        .service
        .as_ref()
        .context("no service")?;
    ensure!(
        service.name == format!("{prefix}-extender") && service.namespace == rendered.namespace
    );
    ensure!(service.path.as_deref() == Some("/mutate-pods") && service.port == Some(443));
    let rules = webhook.rules.clone().unwrap_or_default();
    ensure!(rules.len() == 1);
    ensure!(rules[0].operations.clone().unwrap_or_default() == ["CREATE"]);
    ensure!(rules[0].resources.clone().unwrap_or_default() == ["pods"]);
    let excluded = webhook
        .namespace_selector
        .as_ref()
        .and_then(|s| s.match_expressions.clone())
        .unwrap_or_default();
    ensure!(excluded.iter().any(|e| e.operator == "NotIn"
        && e.key == "kubernetes.io/metadata.name"
        && e.values.iter().flatten().any(|v| v == "kube-system")));
    // The Service's 443 reaches a container port named webhook.
    let svc: Service = rendered.get("Service", &format!("{prefix}-extender"))?;
    let ports = svc.spec.and_then(|s| s.ports).unwrap_or_default();
    ensure!(ports.iter().any(|p| p.port == 443));
    let deployment: Deployment = rendered.get("Deployment", &format!("{prefix}-extender"))?;
    let spec = deployment
        .spec
        .and_then(|s| s.template.spec)
        .context("no pod spec")?;
    let c = container(&spec, "extender")?;
    ensure!(
        c.ports
            .iter()
            .flatten()
            .any(|p| p.name.as_deref() == Some("webhook"))
    );
    Ok(())
}

fn check_extender(rendered: &Rendered, prefix: &str, expect_args: &[&str]) -> anyhow::Result<()> {
    let name = format!("{prefix}-extender");
    let deployment: Deployment = rendered.get("Deployment", &name)?;
    let spec = deployment
        .spec
        .and_then(|s| s.template.spec)
        .context("no pod spec")?;
    check_hardened(&name, &spec)?;
    let pod_security = spec
        .security_context
        .as_ref()
        .context("no pod securityContext")?;
    ensure!(pod_security.run_as_non_root == Some(true));
    ensure!(spec.service_account_name.as_deref() == Some(name.as_str()));
    let c = container(&spec, "extender")?;
    ensure!(c.image.as_deref() == Some("ghcr.io/example/gpushare-extender:0.1.0"));
    let args = args(c);
    for want in expect_args {
        ensure!(
            args.iter().any(|a| a == want),
            "extender args {args:?} lack {want}"
        );
    }
    let live = c
        .liveness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
        .context("liveness")?;
    ensure!(live.path.as_deref() == Some("/healthz"));
    let ready = c
        .readiness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
        .context("readiness")?;
    ensure!(ready.path.as_deref() == Some("/readyz"));
    Ok(())
}

fn check_device_plugin(
    rendered: &Rendered,
    prefix: &str,
    label: (&str, &str),
    expect_args: &[&str],
) -> anyhow::Result<DaemonSet> {
    let name = format!("{prefix}-device-plugin");
    let ds: DaemonSet = rendered.get("DaemonSet", &name)?;
    let spec = ds
        .spec
        .clone()
        .and_then(|s| s.template.spec)
        .context("no pod spec")?;
    check_hardened(&name, &spec)?;
    let selector = spec.node_selector.clone().unwrap_or_default();
    ensure!(
        selector.get(label.0).map(String::as_str) == Some(label.1),
        "{selector:?}"
    );
    ensure!(spec.priority_class_name.as_deref() == Some("system-node-critical"));
    ensure!(spec.service_account_name.as_deref() == Some(name.as_str()));
    let tolerations = spec.tolerations.clone().unwrap_or_default();
    ensure!(
        tolerations
            .iter()
            .any(|t| t.key.as_deref() == Some("nvidia.com/gpu"))
    );
    let volume = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "device-plugins")
        .context("volume")?;
    let host = volume.host_path.as_ref().context("hostPath")?;
    ensure!(host.path == "/var/lib/kubelet/device-plugins");
    let c = container(&spec, "device-plugin")?;
    let env = c.env.clone().unwrap_or_default();
    let node_name = env
        .iter()
        .find(|e| e.name == "NODE_NAME")
        .context("NODE_NAME")?;
    let field = node_name
        .value_from
        .as_ref()
        .and_then(|v| v.field_ref.as_ref())
        .context("NODE_NAME from the downward API")?;
    ensure!(field.field_path == "spec.nodeName");
    for (key, value) in [
        ("NVIDIA_VISIBLE_DEVICES", "all"),
        ("NVIDIA_DRIVER_CAPABILITIES", "utility"),
    ] {
        ensure!(
            env.iter()
                .any(|e| e.name == key && e.value.as_deref() == Some(value))
        );
    }
    let args = args(c);
    for want in expect_args {
        ensure!(
            args.iter().any(|a| a == want),
            "device plugin args {args:?} lack {want}"
        );
    }
    Ok(ds)
}

#[test]
fn chart_lints() -> anyhow::Result<()> {
    let chart = chart_dir();
    let output = helm(&["lint", "--strict", chart.to_str().context("path")?])?;
    ensure!(
        output.status.success(),
        "helm lint failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

#[test]
fn default_values_render_a_dedicated_scheduler_install() -> anyhow::Result<()> {
    let rendered = render("gpushare", "kube-system", &[])?;
    check_all_typed(&rendered)?;
    let kinds = rendered.kinds();
    let want: BTreeMap<String, usize> = [
        ("ClusterRole", 2),
        ("ClusterRoleBinding", 4),
        ("ConfigMap", 1),
        ("DaemonSet", 1),
        ("Deployment", 2),
        ("MutatingWebhookConfiguration", 1),
        ("Role", 1),
        ("RoleBinding", 2),
        ("Secret", 1),
        ("Service", 2),
        ("ServiceAccount", 3),
        ("ValidatingAdmissionPolicy", 1),
        ("ValidatingAdmissionPolicyBinding", 1),
    ]
    .into_iter()
    .map(|(k, n)| (k.to_owned(), n))
    .collect();
    assert_eq!(kinds, want);
    check_extender(
        &rendered,
        "gpushare",
        &[
            "--listen=0.0.0.0:39999",
            "--prefix=/gpushare-scheduler",
            "--resource=example.com/gpu-mem",
            "--node-label=gpushare=true",
            "--domain=gpushare.example.com",
            "--policy=binpack",
            "--bind-timeout-ms=2500",
            "--bind-grace-ms=2000",
            "--max-request-bytes=33554432",
            "--allocation-keys-file=/etc/gpushare/allocation-keys/keys",
        ],
    )?;
    let deployment: k8s_openapi::api::apps::v1::Deployment =
        rendered.get("Deployment", "gpushare-extender")?;
    let strategy = deployment
        .spec
        .and_then(|s| s.strategy)
        .and_then(|s| s.type_);
    ensure!(
        strategy.as_deref() == Some("Recreate"),
        "the extender must never run twice during an update: {strategy:?}"
    );
    check_device_plugin(
        &rendered,
        "gpushare",
        ("gpushare", "true"),
        &[
            "--gpu-backend=nvml",
            "--resource=example.com/gpu-mem",
            "--domain=gpushare.example.com",
            "--allocation-keys-file=/etc/gpushare/allocation-keys/keys",
        ],
    )?;
    check_scheduler(&rendered, "gpushare", "example.com/gpu-mem")?;
    check_webhook(&rendered, "gpushare")?;
    check_rbac(&rendered, "gpushare", true)?;
    assert_eq!(rendered.release, "gpushare");
    Ok(())
}

#[test]
fn non_default_values_render_a_default_scheduler_install() -> anyhow::Result<()> {
    let rendered = render(
        "prod",
        "gpu-system",
        &[
            "--api-versions",
            "monitoring.coreos.com/v1",
            "--set",
            "scheduler.mode=default-scheduler",
            "--set",
            "nodeLabel.key=acme.io/gpu-share",
            "--set-string",
            "nodeLabel.value=yes",
            "--set",
            "resourceName=acme.io/vram",
            "--set",
            "domain=gpu.acme.io",
            "--set",
            "policy=spread",
            "--set",
            "metrics.serviceMonitor.enabled=true",
            "--set",
            "devicePlugin.runtimeClassName=nvidia",
            "--set",
            "extender.image.tag=dev",
        ],
    )?;
    check_all_typed(&rendered)?;
    let kinds = rendered.kinds();
    assert_eq!(kinds.get("ConfigMap"), None, "{kinds:?}");
    assert_eq!(kinds.get("MutatingWebhookConfiguration"), None, "{kinds:?}");
    assert_eq!(
        kinds.get("Deployment"),
        Some(&1),
        "only the extender: {kinds:?}"
    );
    assert_eq!(kinds.get("ServiceMonitor"), Some(&2), "{kinds:?}");

    let deployment: Deployment = rendered.get("Deployment", "prod-gpushare-extender")?;
    let spec = deployment
        .spec
        .and_then(|s| s.template.spec)
        .context("pod spec")?;
    let c = container(&spec, "extender")?;
    assert_eq!(
        c.image.as_deref(),
        Some("ghcr.io/example/gpushare-extender:dev")
    );
    let args = args(c);
    for want in [
        "--resource=acme.io/vram",
        "--node-label=acme.io/gpu-share=yes",
        "--domain=gpu.acme.io",
        "--policy=spread",
    ] {
        assert!(args.iter().any(|a| a == want), "{args:?} lacks {want}");
    }
    let env = c.env.clone().unwrap_or_default();
    assert!(
        env.iter()
            .any(|e| e.name == "GPUSHARE_WEBHOOK_ENABLED" && e.value.as_deref() == Some("false"))
    );
    // No webhook port without the webhook.
    let svc: Service = rendered.get("Service", "prod-gpushare-extender")?;
    assert!(
        svc.spec
            .and_then(|s| s.ports)
            .unwrap_or_default()
            .iter()
            .all(|p| p.port != 443)
    );

    let ds = check_device_plugin(
        &rendered,
        "prod-gpushare",
        ("acme.io/gpu-share", "yes"),
        &["--resource=acme.io/vram", "--domain=gpu.acme.io"],
    )?;
    let spec = ds.spec.and_then(|s| s.template.spec).context("pod spec")?;
    assert_eq!(spec.runtime_class_name.as_deref(), Some("nvidia"));

    check_rbac(&rendered, "prod-gpushare", false)?;
    for monitor in rendered.of_kind("ServiceMonitor") {
        assert_eq!(monitor["metadata"]["namespace"], "gpu-system");
        assert_eq!(monitor["spec"]["endpoints"][0]["path"], "/metrics");
    }
    Ok(())
}

#[test]
fn impossible_values_fail_with_a_clear_message() -> anyhow::Result<()> {
    let chart = chart_dir();
    let chart = chart.to_str().context("path")?;
    for (set, needle) in [
        ("scheduler.mode=both", "scheduler.mode must be"),
        ("policy=random", "policy must be"),
        ("extender.replicas=2", "no leader election"),
        (
            "metrics.serviceMonitor.enabled=true",
            "monitoring.coreos.com/v1",
        ),
    ] {
        let output = helm(&[
            "template",
            "x",
            chart,
            "--kube-version",
            KUBE_VERSION,
            "--set",
            set,
        ])?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{set} rendered");
        assert!(stderr.contains(needle), "{set}: {stderr}");
    }
    Ok(())
}

#[test]
fn a_misspelt_field_is_reported_with_its_path() {
    let doc = serde_json::json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {
            "selector": {"matchLabels": {"a": "b"}},
            "template": {"spec": {"containers": [{
                "name": "c",
                "securityContext": {"readOnlyRootFileSystem": true},
            }]}},
        },
    });
    let err = round_trip::<Deployment>(&doc).unwrap_err().to_string();
    assert!(
        err.contains(".spec.template.spec.containers[0].securityContext.readOnlyRootFileSystem"),
        "{err}"
    );
}

/// Every value in values.yaml is documented in the README's table (maps of settings are
/// walked; lists and free-form maps such as `resources` are one entry).
#[test]
fn every_value_is_documented_in_the_readme() -> anyhow::Result<()> {
    fn leaves(prefix: &str, value: &serde_yaml::Value, out: &mut Vec<String>) {
        match value {
            serde_yaml::Value::Mapping(map)
                if !map.is_empty() && !prefix.ends_with("resources") =>
            {
                for (key, child) in map {
                    let key = key.as_str().unwrap_or("?");
                    let path = if prefix.is_empty() {
                        key.to_owned()
                    } else {
                        format!("{prefix}.{key}")
                    };
                    leaves(&path, child, out);
                }
            }
            _ => out.push(prefix.to_owned()),
        }
    }
    let dir = chart_dir();
    let values: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(dir.join("values.yaml"))?)?;
    let readme = std::fs::read_to_string(dir.join("README.md"))?;
    let mut keys = Vec::new();
    leaves("", &values, &mut keys);
    let missing: Vec<_> = keys
        .iter()
        .filter(|k| !readme.contains(&format!("| `{k}` |")))
        .collect();
    ensure!(
        missing.is_empty(),
        "values missing from README.md's table: {missing:?}"
    );
    Ok(())
}
