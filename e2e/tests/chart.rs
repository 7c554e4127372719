//! The Helm chart, checked with the real helm: it lints, it renders with default and with
//! non-default values, every rendered object parses into its Kubernetes type without losing
//! a field (a lost field is a typo the API server would silently drop), the embedded
//! KubeSchedulerConfiguration points at the extender, and RBAC grants each ServiceAccount
//! exactly what its binary calls: the calls our real binaries make against the in-process
//! cluster, recorded by its API server by caller.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use gpushare_e2e::apiserver::{ADMIN_USER, ApiServer, Call, Verb};
use gpushare_e2e::cluster::{
    ClusterSpec, DEVICE_PLUGIN_USER, EXTENDER_USER, Process, RELEASE, RELEASE_NAMESPACE,
    TestCluster, binaries, dedicated_scheduler_configuration, wait_for,
};
use gpushare_e2e::fixtures::pod;
use gpushare_e2e::scenarios::{create_gpu_pod, delete_pod, wait_running};
use gpushare_e2e::scheduler::SchedulerConfig;
use gpushare_e2e::scheduler::framework::{FitScoring, FitStrategy};
use gpushare_e2e::scheduler::wire::ExtenderBindingArgs;
use gpushare_proto::dra::v1::dra_plugin_client::DraPluginClient;
use gpushare_proto::dra::v1::{Claim, NodePrepareResourcesRequest};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Pod, PodSpec, Secret, Service, ServiceAccount,
};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
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
    let text = render_text(release, namespace, extra)?;
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

/// The chart as release gpushare in kube-system, with each of `sets` a `--set`.
fn render_sets(sets: &[&str]) -> anyhow::Result<Rendered> {
    let args: Vec<&str> = sets.iter().flat_map(|set| ["--set", set]).collect();
    render("gpushare", "kube-system", &args)
}

/// `helm template` with `extra` arguments, as it printed it.
fn render_text(release: &str, namespace: &str, extra: &[&str]) -> anyhow::Result<String> {
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
    Ok(String::from_utf8(output.stdout)?)
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

    /// The object of `kind` named `name`.
    fn object(&self, kind: &str, name: &str) -> anyhow::Result<&Value> {
        self.docs
            .iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .with_context(|| format!("no {kind} named {name} rendered"))
    }

    /// The object of `kind` named `name`, parsed into `T` (already checked for lost fields).
    fn get<T: DeserializeOwned>(&self, kind: &str, name: &str) -> anyhow::Result<T> {
        Ok(serde_json::from_value(self.object(kind, name)?.clone())?)
    }

    /// The pod spec of the workload (Deployment, DaemonSet, Job) of `kind` named `name`.
    fn pod_spec(&self, kind: &str, name: &str) -> anyhow::Result<PodSpec> {
        let spec = &self.object(kind, name)?["spec"]["template"]["spec"];
        serde_json::from_value(spec.clone()).with_context(|| format!("{kind} {name}: no pod spec"))
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

/// Counts of objects by kind: `base` with `more` of each kind added.
fn plus(base: &BTreeMap<String, usize>, more: &[(&str, usize)]) -> BTreeMap<String, usize> {
    let mut kinds = base.clone();
    for (kind, n) in more {
        *kinds.entry((*kind).to_owned()).or_default() += n;
    }
    kinds
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
fn check_all_typed<'a>(docs: impl IntoIterator<Item = &'a Value>) -> anyhow::Result<()> {
    for doc in docs {
        let kind = doc["kind"].as_str().context("document without kind")?;
        match kind {
            "Deployment" => round_trip::<Deployment>(doc)?,
            "DaemonSet" => round_trip::<DaemonSet>(doc)?,
            "Service" => round_trip::<Service>(doc)?,
            "ServiceAccount" => round_trip::<ServiceAccount>(doc)?,
            "Secret" => round_trip::<Secret>(doc)?,
            "NetworkPolicy" => round_trip::<NetworkPolicy>(doc)?,
            "ClusterRole" => round_trip::<ClusterRole>(doc)?,
            "ClusterRoleBinding" => round_trip::<ClusterRoleBinding>(doc)?,
            "Role" => round_trip::<Role>(doc)?,
            "RoleBinding" => round_trip::<RoleBinding>(doc)?,
            "PodDisruptionBudget" => {
                round_trip::<k8s_openapi::api::policy::v1::PodDisruptionBudget>(doc)?
            }
            "ConfigMap" => round_trip::<ConfigMap>(doc)?,
            "Job" => round_trip::<k8s_openapi::api::batch::v1::Job>(doc)?,
            // `helm test` (templates/tests/check-install.yaml).
            "Pod" => round_trip::<Pod>(doc)?,
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
            // Its rules are checked by promtool (`the_alerts_pass_promtool_and_their_unit_tests`).
            "PrometheusRule" => {
                ensure!(doc["apiVersion"] == "monitoring.coreos.com/v1");
                ensure!(doc["spec"]["groups"].is_array());
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

/// The args of the extender of release gpushare.
fn extender_args(rendered: &Rendered) -> anyhow::Result<Vec<String>> {
    let spec = rendered.pod_spec("Deployment", "gpushare-extender")?;
    Ok(args(container(&spec, "extender")?))
}

/// Fails naming the first of `want` missing from `args`.
fn ensure_has(args: &[String], want: &[&str]) -> anyhow::Result<()> {
    match want.iter().find(|w| !args.iter().any(|a| a == *w)) {
        Some(missing) => bail!("args {args:?} lack {missing}"),
        None => Ok(()),
    }
}

/// Fails naming the first of `args` that starts with one of `prefixes`.
fn ensure_lacks(args: &[String], prefixes: &[&str]) -> anyhow::Result<()> {
    match args
        .iter()
        .find(|a| prefixes.iter().any(|p| a.starts_with(p)))
    {
        Some(found) => bail!("args {args:?} have {found}"),
        None => Ok(()),
    }
}

// ---------------------------------------------------------------------------------------
// RBAC, the shape: each component's ClusterRole bound to its own ServiceAccount. What the
// roles grant is held against the calls our binaries make in
// `rbac_grants_exactly_what_each_binary_calls`.

fn check_rbac_bindings(rendered: &Rendered, prefix: &str) -> anyhow::Result<()> {
    let extender = format!("{prefix}-extender");
    // Its one namespaced Role: leader election on its own Lease (get/update by name; create
    // cannot be narrowed by name), bound to its ServiceAccount in the release namespace.
    let lease_role: Role = rendered.get("Role", &extender)?;
    ensure!(lease_role.metadata.namespace.as_deref() == Some(rendered.namespace.as_str()));
    for rule in lease_role.rules.iter().flatten() {
        ensure!(
            rule.resources.as_deref() == Some(&["leases".to_owned()]),
            "{rule:?}"
        );
        if rule.verbs != ["create"] {
            ensure!(
                rule.resource_names.as_deref() == Some(std::slice::from_ref(&extender)),
                "Lease get/update not restricted to the extender's Lease: {rule:?}"
            );
        }
    }
    let lease_binding: RoleBinding = rendered.get("RoleBinding", &extender)?;
    ensure!(lease_binding.role_ref.name == extender);
    // The webhook rule only on our configuration.
    let cluster_role: ClusterRole = rendered.get("ClusterRole", &extender)?;
    for rule in cluster_role.rules.iter().flatten() {
        if rule.api_groups.as_deref() == Some(&["admissionregistration.k8s.io".to_owned()]) {
            ensure!(
                rule.resource_names.as_deref() == Some(&[format!("{prefix}-webhook")]),
                "mutatingwebhookconfigurations not restricted by resourceNames"
            );
        }
    }
    // Each ClusterRole is bound to its component's ServiceAccount, in the release namespace.
    let plugin = format!("{prefix}-device-plugin");
    for name in [&extender, &plugin] {
        let _: ClusterRole = rendered.get("ClusterRole", name)?;
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
// RBAC from facts: what the chart grants each ServiceAccount, against the calls its binary
// made to the in-process API server (which records who asked for what).

/// (apiGroup, resource, verb): what an RBAC rule grants and what a request needs.
type Grant = (String, String, String);

fn grant(group: &str, resource: &str, verb: &str) -> Grant {
    (group.to_owned(), resource.to_owned(), verb.to_owned())
}

/// Every (apiGroup, resource, verb) the rules grant. A wildcard or a non-resource URL cannot
/// be held against calls, so it fails the check. `resourceNames` narrow a grant further than
/// calls are recorded (the webhook's rule is the only one that has them).
fn expand(rules: &[PolicyRule]) -> anyhow::Result<BTreeSet<Grant>> {
    let mut grants = BTreeSet::new();
    for rule in rules {
        ensure!(
            rule.non_resource_urls.is_none(),
            "a rule grants nonResourceURLs: {rule:?}"
        );
        let groups = rule.api_groups.clone().unwrap_or_default();
        let resources = rule.resources.clone().unwrap_or_default();
        for field in [&groups, &resources, &rule.verbs] {
            ensure!(
                !field.iter().any(|item| item.contains('*')),
                "a rule grants a wildcard: {rule:?}"
            );
        }
        for group in &groups {
            for resource in &resources {
                for verb in &rule.verbs {
                    grants.insert(grant(group, resource, verb));
                }
            }
        }
    }
    Ok(grants)
}

/// What the rendered chart grants the ServiceAccount `namespace/name`, through every
/// ClusterRoleBinding that names it.
fn granted_to(rendered: &Rendered, namespace: &str, name: &str) -> anyhow::Result<BTreeSet<Grant>> {
    let names_it = |subjects: Option<&[k8s_openapi::api::rbac::v1::Subject]>| {
        subjects.unwrap_or_default().iter().any(|s| {
            s.kind == "ServiceAccount"
                && s.name == name
                && s.namespace.as_deref() == Some(namespace)
        })
    };
    let mut grants = BTreeSet::new();
    // Calls are recorded without their namespace, so a Role counts only in the
    // ServiceAccount's own namespace, where the binaries make their namespaced calls (the
    // extender's Lease, in POD_NAMESPACE).
    for doc in rendered.of_kind("RoleBinding") {
        let binding: RoleBinding = serde_json::from_value(doc.clone())?;
        if !names_it(binding.subjects.as_deref()) {
            continue;
        }
        ensure!(
            binding.metadata.namespace.as_deref() == Some(namespace)
                && binding.role_ref.kind == "Role",
            "RoleBinding {:?} grants {namespace}/{name} permissions outside its namespace",
            binding.metadata.name
        );
        let role: Role = rendered.get("Role", &binding.role_ref.name)?;
        ensure!(role.metadata.namespace.as_deref() == Some(namespace));
        grants.extend(expand(role.rules.as_deref().unwrap_or_default())?);
    }
    for doc in rendered.of_kind("ClusterRoleBinding") {
        let binding: ClusterRoleBinding = serde_json::from_value(doc.clone())?;
        if !names_it(binding.subjects.as_deref()) {
            continue;
        }
        ensure!(
            binding.role_ref.kind == "ClusterRole",
            "{:?}",
            binding.role_ref
        );
        let role: ClusterRole = rendered
            .get("ClusterRole", &binding.role_ref.name)
            .with_context(|| {
                format!(
                    "ClusterRoleBinding {:?} binds {namespace}/{name} to a ClusterRole the chart \
                     does not render",
                    binding.metadata.name
                )
            })?;
        grants.extend(expand(role.rules.as_deref().unwrap_or_default())?);
    }
    Ok(grants)
}

/// The ServiceAccount of the chart's workload `kind`/`name`, as the username its token
/// carries.
fn service_account_user(rendered: &Rendered, kind: &str, name: &str) -> anyhow::Result<String> {
    let account = rendered.object(kind, name)?["spec"]["template"]["spec"]["serviceAccountName"]
        .as_str()
        .with_context(|| format!("{kind} {name} names no serviceAccountName"))?;
    Ok(format!(
        "system:serviceaccount:{}:{account}",
        rendered.namespace
    ))
}

/// Holds what `rendered` (described as `render`) grants the ServiceAccount behind `user`
/// against `calls` (that user's, printed for the log): every call granted, every grant used.
/// The problems, one line each.
fn rbac_problems(
    rendered: &Rendered,
    render: &str,
    what: &str,
    user: &str,
    calls: &BTreeMap<Call, u64>,
) -> anyhow::Result<Vec<String>> {
    let (namespace, account) = user
        .strip_prefix("system:serviceaccount:")
        .and_then(|rest| rest.split_once(':'))
        .with_context(|| format!("{user} is not a ServiceAccount"))?;
    let granted = granted_to(rendered, namespace, account)?;
    let used: BTreeSet<Grant> = calls
        .keys()
        .map(|call| grant(&call.group, &call.resource, call.verb.rbac()))
        .collect();
    let show_one = |(g, r, v): &Grant| {
        let g = if g.is_empty() { "core" } else { g };
        format!("{v} {g}/{r}")
    };
    let show = |set: Vec<&Grant>| set.into_iter().map(show_one).collect::<Vec<_>>().join(", ");
    let context = format!("{what} ({user}), chart rendered with {render}");
    eprintln!("{context}, made:");
    for (call, n) in calls {
        let made = grant(&call.group, &call.resource, call.verb.rbac());
        eprintln!("  {}: {n}", show_one(&made));
    }
    let mut problems = Vec::new();
    let not_granted: Vec<&Grant> = used.difference(&granted).collect();
    if !not_granted.is_empty() {
        problems.push(format!(
            "{context}: used but not granted: {}",
            show(not_granted)
        ));
    }
    let only_on_uninstall = uninstall_only_grants(what);
    let unused: Vec<&Grant> = granted
        .difference(&used)
        .filter(|grant| !only_on_uninstall.contains(grant))
        .collect();
    if !unused.is_empty() {
        problems.push(format!("{context}: granted but unused: {}", show(unused)));
    }
    Ok(problems)
}

/// What `what` is granted for a path no in-process cluster walks: a node plugin watches its
/// own DaemonSet, named by the chart, to tell `helm uninstall` from a restart as it stops
/// (`gpushare_runtime::uninstall`); the in-process harness runs the plugins outside any
/// DaemonSet. The real tier's `gpu_pods_right_after_helm_install` shows the grants suffice:
/// without them the plugin keeps its files, and that scenario fails on what it finds under
/// the isolation host directory.
fn uninstall_only_grants(what: &str) -> BTreeSet<Grant> {
    match what {
        "device-plugin" | "dra-plugin" => BTreeSet::from([
            grant("apps", "daemonsets", "list"),
            grant("apps", "daemonsets", "watch"),
        ]),
        _ => BTreeSet::new(),
    }
}

/// Runs a small cluster through every path that needs a permission and returns the calls
/// each of our binaries made, by username.
async fn record_calls(
    mut spec: ClusterSpec,
) -> anyhow::Result<BTreeMap<String, BTreeMap<Call, u64>>> {
    // As the chart runs it: electing a leader over its Lease (get, create, then update).
    spec.extender_args.push("--leader-elect=true".to_owned());
    // As the chart's default values run it: keeping the idle-GPU taint (get, then patch).
    spec.extender_args.push("--idle-gpu-taint=true".to_owned());
    let cluster = TestCluster::start(spec).await?;
    let result = exercise(&cluster).await;
    if result.is_err() {
        eprintln!("{}", cluster.log_tail(40));
    }
    let stats = cluster.api.stats();
    cluster.shutdown().await;
    result?;
    let mut by_user: BTreeMap<String, BTreeMap<Call, u64>> = BTreeMap::new();
    for (call, n) in stats.calls() {
        by_user
            .entry(call.user.clone())
            .or_default()
            .insert(call, n);
    }
    Ok(by_user)
}

/// Whether `user` has called `verb` on `group`/`resource` (the core group is ""), for
/// `wait_for` to poll.
fn called(
    api: &ApiServer,
    user: &str,
    verb: Verb,
    group: &str,
    resource: &str,
) -> std::future::Ready<Option<()>> {
    let calls = api.stats().calls_by(user);
    let made = calls
        .keys()
        .any(|c| c.verb == verb && c.group == group && c.resource == resource);
    std::future::ready(made.then_some(()))
}

/// Pods scheduled, run and deleted; a Binding that gets no clear answer (so the extender
/// reads the pod back); a bind refused twice (an Event, then its series patched); a pod
/// holding another pod's allocation (the device plugin's Event).
async fn exercise(cluster: &TestCluster) -> anyhow::Result<()> {
    let extender_calls =
        |verb, group, resource| called(&cluster.api, EXTENDER_USER, verb, group, resource);

    // The node's one GPU is idle: the extender taints it, and takes the taint off once pods
    // hold memory there.
    let idle_gpu_taint = |wanted: bool| async move {
        let node: k8s_openapi::api::core::v1::Node = kube::Api::all(cluster.client.clone())
            .get("gpu-node-1")
            .await
            .ok()?;
        let taints = node.spec?.taints.unwrap_or_default();
        let carries = taints
            .iter()
            .any(|t| t.key == "gpushare.example.com/idle-gpu" && t.effect == "PreferNoSchedule");
        (carries == wanted).then_some(())
    };
    wait_for(
        "the extender to taint the node with an idle GPU",
        Duration::from_secs(30),
        || idle_gpu_taint(true),
    )
    .await?;

    // Scheduled, bound, allocated and run: watches, Bindings, Events, the plugin's patches.
    for name in ["a", "b"] {
        create_gpu_pod(cluster, name, 4).await?;
    }
    let a = wait_running(cluster, "a").await?;
    wait_running(cluster, "b").await?;
    wait_for(
        "the extender to take the idle-GPU taint off the node",
        Duration::from_secs(30),
        || idle_gpu_taint(false),
    )
    .await?;

    // A Binding answered 500: the extender cannot tell whether it landed and reads the pod.
    // The pod is for a scheduler nobody runs, so only this test's bind call places it.
    pod("manual")
        .gpu_mem(4)
        .scheduler_name("manual-scheduler")
        .create(&cluster.client)
        .await?;
    let manual: Pod = cluster.pod("default", "manual").await?;
    let args = ExtenderBindingArgs {
        pod_name: "manual".to_owned(),
        pod_namespace: "default".to_owned(),
        pod_uid: manual.metadata.uid.clone().unwrap_or_default(),
        node: "gpu-node-1".to_owned(),
    };
    let bindings_posted = || {
        cluster
            .api
            .stats()
            .calls_by(EXTENDER_USER)
            .iter()
            .filter(|(c, _)| c.verb == Verb::Create && c.resource == "pods/binding")
            .map(|(_, n)| n)
            .sum::<u64>()
    };
    let before = bindings_posted();
    let faults = cluster.api.faults();
    faults.set_error_rate(Verb::Create, 1.0, 500);
    let extender = cluster.extender()?;
    // Until its watch shows the pod, the extender refuses without posting a Binding.
    let posted = wait_for(
        "the extender to post the Binding of pod manual",
        Duration::from_secs(30),
        || async {
            let _ = extender.bind(&args).await;
            (bindings_posted() > before).then_some(())
        },
    )
    .await;
    if posted.is_err() {
        faults.set_error_rate(Verb::Create, 0.0, 500);
    }
    posted?;
    let read = wait_for(
        "the extender to read pod manual back",
        Duration::from_secs(30),
        || extender_calls(Verb::Get, "", "pods"),
    )
    .await;
    faults.set_error_rate(Verb::Create, 0.0, 500);
    read?;
    wait_running(cluster, "manual").await?;

    // A bind refused twice (the pod is not the one asked for): an Event, then its series.
    let stale = ExtenderBindingArgs {
        pod_name: "a".to_owned(),
        pod_namespace: "default".to_owned(),
        pod_uid: "not-the-uid-of-a".to_owned(),
        node: "gpu-node-1".to_owned(),
    };
    ensure!(a.metadata.uid.as_deref() != Some(stale.pod_uid.as_str()));
    let first = extender.bind(&stale).await?;
    ensure!(first.is_some(), "a bind of a stale pod uid was accepted");
    wait_for(
        "the extender to record the refusal",
        Duration::from_secs(30),
        || extender_calls(Verb::Create, "events.k8s.io", "events"),
    )
    .await?;
    ensure!(extender.bind(&stale).await?.is_some());
    wait_for(
        "the extender to count the repeated refusal on its Event",
        Duration::from_secs(30),
        || extender_calls(Verb::Patch, "events.k8s.io", "events"),
    )
    .await?;

    // Without the allocation policy, a pod bound straight to the node is admitted while a
    // scheduled pod of its size waits (kubelet sees it late): the device plugin reads in
    // kubelet's PodResources that the intruder holds that pod's allocation and says so in
    // an Event on it.
    cluster
        .api
        .set_admission_policies(gpushare_e2e::apiserver::admission::AdmissionPolicies::none());
    let kubelet = &cluster.nodes["gpu-node-1"].kubelet;
    kubelet.hold("default", "waiting");
    create_gpu_pod(cluster, "waiting", 2).await?;
    wait_for(
        "pod waiting to be bound",
        Duration::from_secs(30),
        || async {
            let pod = cluster.pod("default", "waiting").await.ok()?;
            pod.spec?.node_name.map(|_| ())
        },
    )
    .await?;
    pod("intruder")
        .gpu_mem(2)
        .on_node("gpu-node-1")
        .create(&cluster.client)
        .await?;
    let plugin_calls =
        |verb, group, resource| called(&cluster.api, DEVICE_PLUGIN_USER, verb, group, resource);
    wait_for(
        "the device plugin to report the intruder",
        Duration::from_secs(30),
        || plugin_calls(Verb::Create, "events.k8s.io", "events"),
    )
    .await?;
    delete_pod(cluster, "intruder").await?;
    delete_pod(cluster, "waiting").await?;
    kubelet.release("default", "waiting");

    // A deleted pod: its GPU memory comes back (8 GiB fit only once b's 4 GiB are free).
    delete_pod(cluster, "b").await?;
    create_gpu_pod(cluster, "c", 8).await?;
    wait_running(cluster, "c").await?;

    // The GPU turns unhealthy under running pods: the device plugin sets their GPU health
    // condition (a pods/status patch), and again when it recovers.
    cluster.set_unhealthy("gpu-node-1", &[0])?;
    let condition_set = wait_for(
        "the device plugin to set a pod's GPU health condition",
        Duration::from_secs(30),
        || plugin_calls(Verb::Patch, "", "pods/status"),
    )
    .await;
    cluster.set_unhealthy("gpu-node-1", &[])?;
    condition_set?;
    Ok(())
}

/// Each ServiceAccount is granted exactly what its binary calls: the calls our real
/// binaries make against the in-process cluster (recorded by the API server by username),
/// held against the chart's ClusterRoles bound to each ServiceAccount, rendered with the
/// webhook (default values, run in the dedicated mode: the API server calls the webhook
/// and the extender keeps its caBundle) and without it. Fails on a call not granted and on
/// a grant never used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_grants_exactly_what_each_binary_calls() -> anyhow::Result<()> {
    let node = [("gpu-node-1", &[16][..])];
    let renders = [
        (
            "default values (dedicated scheduler, webhook)",
            render(RELEASE, RELEASE_NAMESPACE, &[])?,
            // Without the allocation policy: `exercise` places a pod of a scheduler nobody
            // runs by calling bind itself, which the policy refuses in dedicated mode.
            ClusterSpec::labelled(&node)
                .dedicated()
                .without_allocation_policy(),
        ),
        (
            "scheduler.mode=default-scheduler (no webhook)",
            render(
                RELEASE,
                RELEASE_NAMESPACE,
                &["--set", "scheduler.mode=default-scheduler"],
            )?,
            ClusterSpec::labelled(&node),
        ),
    ];
    let identities = [
        ("extender", "Deployment", EXTENDER_USER),
        ("device-plugin", "DaemonSet", DEVICE_PLUGIN_USER),
    ];
    // The harness runs each binary as the ServiceAccount the chart gives it.
    for (_, rendered, _) in &renders {
        for (what, kind, user) in identities {
            let chart_user = service_account_user(rendered, kind, &format!("{RELEASE}-{what}"))?;
            ensure!(
                chart_user == user,
                "the chart runs the {what} as {chart_user}, the e2e cluster as {user}"
            );
        }
    }

    let mut problems = Vec::new();
    for (render, rendered, spec) in renders {
        let by_user = record_calls(spec).await?;
        for user in by_user.keys() {
            if user != ADMIN_USER && !identities.iter().any(|(_, _, u)| u == user) {
                problems.push(format!("calls from an unexpected identity {user}"));
            }
        }
        let empty = BTreeMap::new();
        for (what, _, user) in identities {
            let calls = by_user.get(user).unwrap_or(&empty);
            problems.extend(rbac_problems(&rendered, render, what, user, calls)?);
        }
    }
    ensure!(
        problems.is_empty(),
        "RBAC differs from the calls made:\n{}",
        problems.join("\n")
    );
    Ok(())
}

/// DRA mode: what the chart (`mode=dra`) grants the DRA plugin's ServiceAccount, against
/// the calls the real `gpushare-dra-plugin`, run as that ServiceAccount on the in-process
/// API server, makes as it publishes its slice and watches it, re-publishes it when a GPU
/// turns unhealthy, and prepares an allocated claim (the test calls NodePrepareResources as
/// kubelet does; no scheduler, no kubelet run). The watch of its own DaemonSet, which tells
/// `helm uninstall` from a restart, is not walked here (`uninstall_only_grants`).
/// Fails on a call not granted and on a grant never used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_grants_the_dra_plugin_exactly_what_it_calls() -> anyhow::Result<()> {
    let values = "mode=dra";
    let rendered = render(RELEASE, RELEASE_NAMESPACE, &["--set", values])?;
    let user = service_account_user(&rendered, "DaemonSet", &format!("{RELEASE}-dra-plugin"))?;
    let api = ApiServer::start().await?;
    let dir = tempfile::tempdir()?;
    let path = |name: &str| dir.path().join(name);
    api.write_kubeconfig_as(&path("kubeconfig"), &user)?;
    let arg = |name: &str| path(name).display().to_string();
    let args = [
        "--node-name",
        "gpu-node-1",
        "--gpu-backend",
        "simulated",
        "--simulate-gpus",
        "16,16",
        "--simulate-health-file",
        &arg("unhealthy-gpus"),
        "--plugin-dir",
        &arg("plugin"),
        "--registry-dir",
        &arg("registry"),
        "--cdi-dir",
        &arg("cdi"),
        "--probe-addr",
        "127.0.0.1:0",
    ]
    .map(str::to_owned);
    let plugin = Process::spawn(
        "gpushare-dra-plugin",
        &binaries()?.dra_plugin,
        &args,
        &path("kubeconfig"),
        &path("dra-plugin.log"),
    )?;
    let exercised = exercise_dra_plugin(&api, &user, dir.path()).await;
    plugin.stop().await;
    exercised.with_context(|| format!("see {}", path("dra-plugin.log").display()))?;
    let calls = api.stats().calls_by(&user);
    let problems = rbac_problems(&rendered, values, "dra-plugin", &user, &calls)?;
    ensure!(
        problems.is_empty(),
        "RBAC differs from the calls made:\n{}",
        problems.join("\n")
    );
    Ok(())
}

/// Drives the DRA plugin started in `dir` by the test above: waits for its slice and its
/// slice watch, turns GPU 0 unhealthy until the slice carries the taint, then has it prepare
/// a claim allocated 4 GiB of the healthy GPU 1 (by hand, as kube-scheduler would).
async fn exercise_dra_plugin(api: &ApiServer, user: &str, dir: &Path) -> anyhow::Result<()> {
    let wait = Duration::from_secs(60);
    let slices = Api::<ResourceSlice>::all(api.client());
    let tainted = |taints: bool| {
        let slices = slices.clone();
        async move {
            let items = slices.list(&ListParams::default()).await.ok()?.items;
            let has = items
                .iter()
                .flat_map(|s| s.spec.devices.iter().flatten())
                .any(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty()));
            (!items.is_empty() && has == taints).then_some(())
        }
    };
    wait_for("the plugin's slice", wait, || tainted(false)).await?;
    wait_for("the plugin's slice watch", wait, || {
        called(api, user, Verb::Watch, "resource.k8s.io", "resourceslices")
    })
    .await?;
    std::fs::write(dir.join("unhealthy-gpus"), "0")?;
    wait_for("GPU 0's taint in the slice", wait, || tainted(true)).await?;

    let claims = Api::<ResourceClaim>::namespaced(api.client(), "default");
    let claim: ResourceClaim = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "gpu-4g", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu-mem"}}]}}
    }))?;
    let claim = claims.create(&PostParams::default(), &claim).await?;
    let allocation = serde_json::json!({"status": {"allocation": {"devices": {"results": [{
        "request": "gpu", "driver": gpushare_contract::DEFAULT_DOMAIN, "pool": "gpu-node-1",
        "device": "gpu-1", "consumedCapacity": {"memory": "4Gi"}
    }]}}}});
    claims
        .patch_status("gpu-4g", &PatchParams::default(), &Patch::Merge(allocation))
        .await?;
    let uid = claim.metadata.uid.context("a claim without a UID")?;
    let socket = dir.join("plugin").join(gpushare_dra_plugin::DRA_SOCKET);
    let mut plugin = DraPluginClient::new(gpushare_proto::connect_unix(&socket).await?);
    let request = NodePrepareResourcesRequest {
        claims: vec![Claim {
            namespace: "default".to_owned(),
            uid: uid.clone(),
            name: "gpu-4g".to_owned(),
        }],
    };
    let mut answer = plugin.node_prepare_resources(request).await?.into_inner();
    let prepared = answer
        .claims
        .remove(&uid)
        .context("no answer for the claim")?;
    ensure!(
        prepared.error.is_empty(),
        "prepare failed: {}",
        prepared.error
    );
    Ok(())
}

/// The check itself: a call the chart does not grant and a grant nobody used are both
/// named, for the identity and the render.
#[test]
fn rbac_check_names_calls_not_granted_and_grants_not_used() -> anyhow::Result<()> {
    // With the marks on, the device plugin is granted pod patches.
    let rendered = render(
        RELEASE,
        RELEASE_NAMESPACE,
        &["--set", "devicePlugin.allocationMarks=true"],
    )?;
    let call = |verb: Verb, resource: &str| {
        let call = Call {
            user: DEVICE_PLUGIN_USER.to_owned(),
            group: String::new(),
            resource: resource.to_owned(),
            verb,
        };
        (call, 1)
    };
    // All the device plugin's calls but its pod patches, and a delete it is not granted.
    let calls: BTreeMap<Call, u64> = [
        call(Verb::Get, "nodes"),
        call(Verb::Patch, "nodes"),
        call(Verb::Patch, "pods/status"),
        call(Verb::List, "pods"),
        call(Verb::Watch, "pods"),
        call(Verb::Delete, "pods"),
        (
            Call {
                group: "events.k8s.io".to_owned(),
                ..call(Verb::Create, "events").0
            },
            1,
        ),
    ]
    .into_iter()
    .collect();
    let problems = rbac_problems(
        &rendered,
        "devicePlugin.allocationMarks=true",
        "device-plugin",
        DEVICE_PLUGIN_USER,
        &calls,
    )?;
    let context = format!(
        "device-plugin ({DEVICE_PLUGIN_USER}), chart rendered with devicePlugin.allocationMarks=true"
    );
    assert_eq!(
        problems,
        [
            format!("{context}: used but not granted: delete core/pods"),
            format!("{context}: granted but unused: patch core/pods"),
        ]
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The dedicated scheduler's configuration, with the real v1 field names.

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct KubeSchedulerConfiguration {
    api_version: String,
    kind: String,
    client_connection: ClientConnection,
    parallelism: i32,
    leader_election: LeaderElection,
    profiles: Vec<Profile>,
    extenders: Vec<Extender>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ClientConnection {
    qps: f32,
    burst: i32,
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
    percentage_of_nodes_to_score: i32,
    /// Checked by `keep_best_matches_the_profile_it_ranks_for`.
    #[serde(default)]
    #[allow(dead_code)] // read by serde only: accepted, checked elsewhere
    plugins: Option<serde_yaml::Value>,
    #[serde(default)]
    plugin_config: Option<serde_yaml::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Extender {
    url_prefix: String,
    filter_verb: String,
    #[serde(default)]
    preempt_verb: Option<String>,
    #[serde(default)]
    prioritize_verb: Option<String>,
    #[serde(default)]
    weight: Option<i64>,
    bind_verb: String,
    #[serde(rename = "enableHTTPS")]
    enable_https: bool,
    #[serde(default)]
    tls_config: Option<ExtenderTlsConfig>,
    http_timeout: String,
    node_cache_capable: bool,
    managed_resources: Vec<ManagedResource>,
    ignorable: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ExtenderTlsConfig {
    ca_file: String,
    #[serde(default)]
    cert_file: Option<String>,
    #[serde(default)]
    key_file: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ManagedResource {
    name: String,
    ignored_by_scheduler: bool,
}

/// The dedicated scheduler's `scheduler-config.yaml`, from the ConfigMap of scheduler `name`.
fn scheduler_config_text(rendered: &Rendered, name: &str) -> anyhow::Result<String> {
    let config_map: ConfigMap = rendered.get("ConfigMap", &format!("{name}-config"))?;
    config_map
        .data
        .and_then(|mut d| d.remove("scheduler-config.yaml"))
        .context("no scheduler-config.yaml")
}

/// The chart rendered in DRA mode, with `extra` arguments.
fn render_dra(extra: &[&str]) -> anyhow::Result<Rendered> {
    let mut args = vec!["--set", "mode=dra"];
    args.extend_from_slice(extra);
    render("gpushare", "kube-system", &args)
}

/// The JSON patch expression of the `dra.gpuMem` MutatingAdmissionPolicy, its whitespace
/// runs made single spaces.
fn claims_policy_patch(rendered: &Rendered) -> anyhow::Result<String> {
    let policy = rendered.object("MutatingAdmissionPolicy", "gpushare-gpu-mem-claims")?;
    Ok(policy["spec"]["mutations"][0]["jsonPatch"]["expression"]
        .as_str()
        .unwrap_or_default()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" "))
}

/// The policy that routes pods naming a claim template of our class: it reads templates as
/// params, every one in the pod's namespace but the chart's own (whose pods the gpu-mem policy
/// routes), tests the class, and sets the chart's scheduler; a miss only loses ranking.
fn check_template_routing(rendered: &Rendered) -> anyhow::Result<()> {
    let name = "gpushare-claim-templates";
    let policy = &rendered.object("MutatingAdmissionPolicy", name)?["spec"];
    ensure!(
        policy["paramKind"]["kind"] == "ResourceClaimTemplate",
        "{policy}"
    );
    ensure!(policy["failurePolicy"] == "Ignore", "{policy}");
    let conditions = policy["matchConditions"].to_string();
    ensure!(
        conditions.contains("deviceClassName == 'gpu-mem.gpushare.example.com'"),
        "{conditions}"
    );
    let patch = policy["mutations"][0]["jsonPatch"]["expression"].to_string();
    ensure!(
        patch.contains(r#"value: \"gpushare-scheduler\""#),
        "{patch}"
    );
    let param = &rendered.object("MutatingAdmissionPolicyBinding", name)?["spec"]["paramRef"];
    ensure!(param["parameterNotFoundAction"] == "Allow", "{param}");
    ensure!(
        param.get("namespace").is_none(),
        "the pod's namespace: {param}"
    );
    let excluded = &param["selector"]["matchExpressions"][0];
    ensure!(excluded["operator"] == "NotIn", "{param}");
    let key = excluded["key"].as_str().unwrap_or_default();
    for template in rendered.of_kind("ResourceClaimTemplate") {
        let label = &template["metadata"]["labels"][key];
        ensure!(
            excluded["values"]
                .as_array()
                .is_some_and(|v| v.contains(label)),
            "the chart's own template {} is excluded by {key}: {label}",
            template["metadata"]["name"]
        );
    }
    Ok(())
}

/// Whether both DRA policies that route GPU pods to the chart's scheduler (the gpu-mem one,
/// the claim-template one) give them a toleration of the idle-GPU taint: `wanted` where the
/// extender runs (it ranks) and keeps the taint, else neither carries one.
fn check_dra_idle_gpu_toleration(rendered: &Rendered, wanted: bool) -> anyhow::Result<()> {
    for name in ["gpushare-gpu-mem-claims", "gpushare-claim-templates"] {
        let mutations = &rendered.object("MutatingAdmissionPolicy", name)?["spec"]["mutations"];
        let tolerates = mutations.as_array().is_some_and(|all| {
            all.iter().any(|m| {
                let patch = m["jsonPatch"]["expression"].as_str().unwrap_or_default();
                patch.contains("path: '/spec/tolerations/-'")
                    && patch.contains("key: 'gpushare.example.com/idle-gpu', operator: 'Exists', effect: 'PreferNoSchedule'")
            })
        });
        ensure!(
            tolerates == wanted,
            "{name}: toleration {tolerates}, wanted {wanted}: {mutations}"
        );
    }
    Ok(())
}

/// DRA mode's profile: MostAllocated on CPU and memory (the score that packs), the spreading
/// scores off, a short walk, and a client that can write a claim and a Binding per pod; with
/// `ranking`, it calls the extender to rank (filter and prioritize, no bind, no preempt,
/// ignorable, every pod of the profile), else no extender.
fn check_dra_scheduler(rendered: &Rendered, ranking: bool) -> anyhow::Result<()> {
    let text = scheduler_config_text(rendered, "gpushare-scheduler")?;
    let config: serde_yaml::Value = serde_yaml::from_str(&text)?;
    if ranking {
        let extender = &config["extenders"][0];
        ensure!(
            extender["urlPrefix"]
                == "https://gpushare-extender.kube-system.svc:39999/gpushare-scheduler",
            "{text}"
        );
        ensure!(extender["filterVerb"] == "filter", "{text}");
        ensure!(extender["prioritizeVerb"] == "prioritize", "{text}");
        ensure!(extender["ignorable"].as_bool() == Some(true), "{text}");
        for absent in ["bindVerb", "preemptVerb", "managedResources"] {
            ensure!(extender.get(absent).is_none(), "{absent}: {text}");
        }
        ensure!(config["extenders"].as_sequence().map(Vec::len) == Some(1));
    } else {
        ensure!(config.get("extenders").is_none(), "{text}");
    }
    ensure!(
        config["clientConnection"]["qps"].as_f64() == Some(400.0),
        "{text}"
    );
    let profile = &config["profiles"][0];
    ensure!(profile["schedulerName"] == "gpushare-scheduler");
    ensure!(
        profile["percentageOfNodesToScore"].as_u64() == Some(1),
        "{text}"
    );
    let disabled: Vec<&str> = profile["plugins"]["score"]["disabled"]
        .as_sequence()
        .context("no disabled score plugins")?
        .iter()
        .filter_map(|p| p["name"].as_str())
        .collect();
    ensure!(disabled == ["NodeResourcesBalancedAllocation", "ImageLocality"]);
    let fit = profile["pluginConfig"]
        .as_sequence()
        .context("no pluginConfig")?
        .iter()
        .find(|c| c["name"] == "NodeResourcesFit")
        .context("no NodeResourcesFit args")?;
    let strategy = &fit["args"]["scoringStrategy"];
    ensure!(strategy["type"] == "MostAllocated", "{text}");
    let scored: Vec<&str> = strategy["resources"]
        .as_sequence()
        .context("no scored resources")?
        .iter()
        .filter_map(|r| r["name"].as_str())
        .collect();
    ensure!(scored == ["cpu", "memory"]);
    Ok(())
}

/// The extender in DRA mode: it reads our driver's slices and claims of the chart's class,
/// may list and watch them, and can neither bind nor read pods one by one.
fn check_dra_extender(rendered: &Rendered) -> anyhow::Result<()> {
    let args = extender_args(rendered)?;
    ensure_has(
        &args,
        &[
            "--dra-driver=gpushare.example.com",
            "--dra-device-class=gpu-mem.gpushare.example.com",
        ],
    )?;
    ensure_lacks(&args, &["--allocation-keys-file"])?;
    let rules = rendered.object("ClusterRole", "gpushare-extender")?["rules"].to_string();
    ensure!(
        rules.contains(r#""resources":["resourceslices","resourceclaims"]"#),
        "{rules}"
    );
    ensure!(!rules.contains("pods/binding"), "{rules}");
    ensure!(!rules.contains(r#""verbs":["get"]"#), "{rules}");
    Ok(())
}

fn check_scheduler(rendered: &Rendered, prefix: &str, resource: &str) -> anyhow::Result<()> {
    let ns = &rendered.namespace;
    let name = format!("{prefix}-scheduler");
    let text = scheduler_config_text(rendered, &name)?;
    let config: KubeSchedulerConfiguration = serde_yaml::from_str(&text)?;
    ensure!(config.api_version == "kubescheduler.config.k8s.io/v1");
    ensure!(config.kind == "KubeSchedulerConfiguration");
    ensure!(config.profiles[0].scheduler_name == "gpushare-scheduler");
    ensure!(config.profiles[0].percentage_of_nodes_to_score == 1);
    ensure!(
        config.client_connection.qps == 50.0 && config.client_connection.burst == 100,
        "{:?}",
        config.client_connection
    );
    ensure!(config.parallelism == 16);
    let le = &config.leader_election;
    ensure!(le.leader_elect && le.resource_lock == "leases");
    ensure!(le.resource_name == name && le.resource_namespace == *ns);

    let [extender] = config.extenders.as_slice() else {
        bail!("expected one extender, got {:?}", config.extenders);
    };
    let service = format!("{prefix}-extender");
    ensure!(
        extender.url_prefix == format!("https://{service}.{ns}.svc:39999/gpushare-scheduler"),
        "{}",
        extender.url_prefix
    );
    ensure!(extender.filter_verb == "filter");
    // Default values: the extender ranks nodes (in filter, keeping the best, and in
    // prioritize for pods with soft preferences); the profile keeps upstream's resource
    // scoring (what `keep_best_matches_the_profile_it_ranks_for` checks it turns off).
    ensure!(extender.prioritize_verb.as_deref() == Some("prioritize"));
    ensure!(extender.weight.is_some_and(|w| w > 0));
    let plugin_config = config.profiles[0].plugin_config.as_ref();
    ensure!(
        !serde_yaml::to_string(&plugin_config)?.contains("NodeResourcesFit"),
        "{plugin_config:?}"
    );
    ensure!(extender.bind_verb == "bind");
    // Preemption victims are chosen per GPU by the extender, unless turned off.
    ensure!(extender.preempt_verb.as_deref() == Some("preempt"));
    let without = render(prefix, ns, &["--set", "scheduler.extender.preempt=false"])?;
    let text = scheduler_config_text(&without, &name)?;
    let config: KubeSchedulerConfiguration = serde_yaml::from_str(&text)?;
    ensure!(config.extenders[0].preempt_verb.is_none(), "{text}");
    ensure!(!extender.ignorable);
    // HTTPS, verified against the CA of the extender's certificate, mounted alone.
    ensure!(extender.enable_https);
    let tls = extender
        .tls_config
        .as_ref()
        .context("enableHTTPS without tlsConfig trusts any certificate")?;
    ensure!(tls.ca_file == "/etc/gpushare/extender-ca/ca.crt", "{tls:?}");
    // It presents the client certificate the extender asks for, mounted from the client
    // Secret without the replicas' key.
    ensure!(
        tls.cert_file.as_deref() == Some("/etc/gpushare/scheduler-client/tls.crt")
            && tls.key_file.as_deref() == Some("/etc/gpushare/scheduler-client/tls.key"),
        "{tls:?}"
    );
    let spec = rendered.pod_spec("Deployment", &name)?;
    let (secret, items) = secret_volume(&spec, "client-certificate")?;
    ensure!(
        secret == format!("{prefix}-extender-client-tls"),
        "{secret}"
    );
    ensure!(
        items == ["scheduler.crt -> tls.crt", "scheduler.key -> tls.key"],
        "the scheduler must get its own certificate only, got {items:?}"
    );
    let (secret, items) = secret_volume(&spec, "extender-ca")?;
    ensure!(secret == format!("{prefix}-extender-tls"), "{secret}");
    ensure!(
        items == ["ca.crt -> ca.crt"],
        "the scheduler must get the CA only, got {items:?}"
    );
    ensure!(extender.http_timeout == "5s");
    ensure!(extender.node_cache_capable);
    ensure!(
        extender
            .managed_resources
            .iter()
            .any(|r| r.name == resource && !r.ignored_by_scheduler)
    );
    // The URL's service and port exist.
    let ports = service_ports(rendered, &service)?;
    ensure!(
        ports.contains(&("scheduler".to_owned(), 39999)),
        "{ports:?}"
    );

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

/// Volume `name` of `spec`: the Secret it mounts, and its items as `key -> path`.
fn secret_volume(spec: &PodSpec, name: &str) -> anyhow::Result<(String, Vec<String>)> {
    let secret = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == name)
        .and_then(|v| v.secret.as_ref())
        .with_context(|| format!("no Secret volume {name}"))?;
    let items = secret.items.iter().flatten();
    Ok((
        secret.secret_name.clone().unwrap_or_default(),
        items.map(|i| format!("{} -> {}", i.key, i.path)).collect(),
    ))
}

/// The ports of Service `name`, as (name, port).
fn service_ports(rendered: &Rendered, name: &str) -> anyhow::Result<Vec<(String, i32)>> {
    let svc: Service = rendered.get("Service", name)?;
    let ports = svc.spec.and_then(|s| s.ports).unwrap_or_default();
    Ok(ports
        .into_iter()
        .map(|p| (p.name.unwrap_or_default(), p.port))
        .collect())
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
    let extender = format!("{prefix}-extender");
    let ports = service_ports(rendered, &extender)?;
    ensure!(ports.iter().any(|(_, port)| *port == 443), "{ports:?}");
    let spec = rendered.pod_spec("Deployment", &extender)?;
    let c = container(&spec, "extender")?;
    ensure!(
        c.ports
            .iter()
            .flatten()
            .any(|p| p.name.as_deref() == Some("webhook"))
    );
    Ok(())
}

/// The post-install/post-upgrade hook: a locked-down Job running the extender image's
/// `check-routing` with the arguments `the_install_hook_passes_only_once_gpu_pods_are_routed`
/// (webhook.rs) runs it with, and a Role that grants pod creates in the checked namespace
/// only, all of it deleted once the hook passed.
fn check_routing_hook(rendered: &Rendered, prefix: &str) -> anyhow::Result<()> {
    let name = format!("{prefix}-routing-check");
    let job: k8s_openapi::api::batch::v1::Job = rendered.get("Job", &name)?;
    for kind in ["ServiceAccount", "Role", "RoleBinding", "Job"] {
        let annotations = &rendered.object(kind, &name)?["metadata"]["annotations"];
        ensure!(
            annotations["helm.sh/hook"] == "post-install,post-upgrade"
                && annotations["helm.sh/hook-delete-policy"]
                    == "before-hook-creation,hook-succeeded",
            "{kind} {name} is not a post-install/post-upgrade hook deleted on success: {annotations}"
        );
    }
    let spec = job.spec.context("Job spec")?;
    ensure!(spec.backoff_limit == Some(0));
    let pod = spec.template.spec.context("Job pod spec")?;
    check_hardened(&name, &pod)?;
    ensure!(pod.service_account_name.as_deref() == Some(name.as_str()));
    let check = container(&pod, "check-routing")?;
    ensure!(
        check.command.as_deref()
            == Some(&["gpushare-extender".to_owned(), "check-routing".to_owned()][..]),
        "{:?}",
        check.command
    );
    assert_eq!(
        args(check),
        [
            "--namespace=default",
            "--resource=example.com/gpu-mem",
            "--scheduler-name=gpushare-scheduler",
            "--forged-annotation=gpushare.example.com/v1.routing-check",
            "--probe-image=registry.k8s.io/pause:3.10",
            "--timeout-seconds=240",
            "--log-format=text",
        ]
    );
    let role: Role = rendered.get("Role", &name)?;
    ensure!(role.metadata.namespace.as_deref() == Some("default"));
    ensure!(
        expand(role.rules.as_deref().unwrap_or_default())?
            == BTreeSet::from([grant("", "pods", "create")]),
        "the hook's Role grants more than pod creates: {:?}",
        role.rules
    );
    Ok(())
}

fn check_extender(rendered: &Rendered, prefix: &str, expect_args: &[&str]) -> anyhow::Result<()> {
    let name = format!("{prefix}-extender");
    let spec = rendered.pod_spec("Deployment", &name)?;
    check_hardened(&name, &spec)?;
    let pod_security = spec
        .security_context
        .as_ref()
        .context("no pod securityContext")?;
    ensure!(pod_security.run_as_non_root == Some(true));
    ensure!(spec.service_account_name.as_deref() == Some(name.as_str()));
    let c = container(&spec, "extender")?;
    ensure!(c.image.as_deref() == Some("ghcr.io/example/gpushare-extender:0.1.0"));
    ensure_has(&args(c), expect_args).context("the extender's args")?;
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
    // Probes, Prometheus and kubectl gpushare use the plain monitoring port (named `http`),
    // whose only routes are health and metrics; the scheduler's port is `scheduler`.
    for probe in [live, ready] {
        ensure!(
            probe.port == IntOrString::String("http".into()) && probe.scheme.is_none(),
            "{probe:?}"
        );
    }
    let container_ports = c.ports.iter().flatten();
    let container_ports =
        container_ports.map(|p| (p.name.clone().unwrap_or_default(), p.container_port));
    // The container's ports, and the Service's.
    for ports in [container_ports.collect(), service_ports(rendered, &name)?] {
        ensure!(
            ports.contains(&("http".to_owned(), 9090))
                && ports.contains(&("scheduler".to_owned(), 39999)),
            "{ports:?}"
        );
    }
    Ok(())
}

/// The Secret the chart generates for the extender's HTTPS: a CA, and a certificate that
/// chains to it and names the Service as the scheduler dials it.
#[test]
fn the_generated_extender_certificate_verifies_for_the_service_name() -> anyhow::Result<()> {
    use rustls::client::danger::ServerCertVerifier as _;
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    let rendered = render("gpushare", "gpu-system", &[])?;
    let secret: Secret = rendered.get("Secret", "gpushare-extender-tls")?;
    ensure!(secret.type_.as_deref() == Some("kubernetes.io/tls"));
    let data = secret.data.context("no data")?;
    // `data` is base64 on the wire; k8s-openapi hands back the PEM bytes.
    let pem = |key: &str| -> anyhow::Result<Vec<u8>> {
        let bytes = data
            .get(key)
            .with_context(|| format!("no {key}"))?
            .0
            .clone();
        ensure!(bytes.starts_with(b"-----BEGIN"), "{key} is not PEM");
        Ok(bytes)
    };
    let (ca, cert) = (pem("ca.crt")?, pem("tls.crt")?);
    ensure!(pem("tls.key")?.starts_with(b"-----BEGIN"));
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&ca) {
        roots.add(c?)?;
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let verifier =
        rustls::client::WebPkiServerVerifier::builder_with_provider(roots.into(), provider)
            .build()?;
    let leaf = CertificateDer::from_pem_slice(&cert)?;
    for name in [
        "gpushare-extender.gpu-system.svc",
        "gpushare-extender.gpu-system.svc.cluster.local",
    ] {
        verifier
            .verify_server_cert(
                &leaf,
                &[],
                &ServerName::try_from(name)?,
                &[],
                UnixTime::now(),
            )
            .with_context(|| format!("the certificate does not verify for {name}"))?;
    }
    // And not for another Service: the name is checked, not just the chain.
    ensure!(
        verifier
            .verify_server_cert(
                &leaf,
                &[],
                &ServerName::try_from("attacker.gpu-system.svc")?,
                &[],
                UnixTime::now()
            )
            .is_err()
    );
    Ok(())
}

#[test]
fn the_network_policy_admits_only_the_scheduler_to_the_scheduler_port() -> anyhow::Result<()> {
    let rendered = render_sets(&["networkPolicy.enabled=true"])?;
    check_all_typed(&rendered.docs)?;
    let spec = &rendered.object("NetworkPolicy", "gpushare-extender")?["spec"];
    assert_eq!(
        spec["podSelector"]["matchLabels"]["app.kubernetes.io/component"],
        "extender"
    );
    let rules = spec["ingress"].as_array().context("ingress")?;
    let rule_for = |port: &str| {
        rules
            .iter()
            .find(|r| r["ports"][0]["port"] == port)
            .with_context(|| format!("no rule for port {port}"))
    };
    let scheduler = rule_for("scheduler")?;
    let from = scheduler["from"]
        .as_array()
        .context("the scheduler port admits anyone")?;
    // The scheduler, and the other extender replicas (a follower passes binds on).
    let components: Vec<&Value> = from
        .iter()
        .map(|peer| &peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"])
        .collect();
    assert_eq!(components, ["extender", "scheduler"], "{from:?}");
    assert_eq!(
        rule_for("http")?.get("from"),
        None,
        "monitoring is open by default"
    );
    assert!(rule_for("webhook").is_ok());

    // default-scheduler mode: the peers are the admin's to name.
    let rendered = render_sets(&[
        "networkPolicy.enabled=true",
        "scheduler.mode=default-scheduler",
        "networkPolicy.schedulerPeers[0].ipBlock.cidr=10.0.0.0/24",
    ])?;
    let policy = rendered.of_kind("NetworkPolicy")[0].clone();
    assert_eq!(
        policy["spec"]["ingress"][0]["from"][1],
        serde_json::json!({"ipBlock": {"cidr": "10.0.0.0/24"}})
    );
    assert_eq!(
        policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"],
        "extender"
    );
    Ok(())
}

fn check_device_plugin(
    rendered: &Rendered,
    prefix: &str,
    label: (&str, &str),
    expect_args: &[&str],
) -> anyhow::Result<PodSpec> {
    let name = format!("{prefix}-device-plugin");
    let spec = rendered.pod_spec("DaemonSet", &name)?;
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
    let host_path = |volume: &str| {
        let mut volumes = spec.volumes.iter().flatten();
        let found = volumes
            .find(|v| v.name == volume)
            .and_then(|v| v.host_path.as_ref());
        found.with_context(|| format!("no hostPath volume {volume}"))
    };
    ensure!(host_path("device-plugins")?.path == "/var/lib/kubelet/device-plugins");
    let c = container(&spec, "device-plugin")?;
    let env = c.env.clone().unwrap_or_default();
    let node_name = env
        .iter()
        .find(|e| e.name == "GPUSHARE_NODE_NAME")
        .context("GPUSHARE_NODE_NAME")?;
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
    // kubelet's PodResources API: mounted read-only, its socket passed.
    ensure!(host_path("pod-resources")?.path == "/var/lib/kubelet/pod-resources");
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "pod-resources")
        .context("pod-resources mount")?;
    ensure!(mount.read_only == Some(true), "{mount:?}");
    let socket = "--pod-resources-socket=/var/lib/kubelet/pod-resources/kubelet.sock";
    ensure_has(&args(c), &[expect_args, &[socket]].concat()).context("the device plugin's args")?;
    Ok(spec)
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
    check_all_typed(&rendered.docs)?;
    let kinds = rendered.kinds();
    // With the uninstall cleanup hook's ServiceAccount, ClusterRole and binding, Role and
    // binding (the test pod's deletion), and Job; `helm test`'s ServiceAccount, ClusterRole
    // and binding, two Roles and bindings (the Lease, the routing namespace) and Pod; and the
    // device plugin's Role and binding to watch its own DaemonSet.
    let want = plus(
        &BTreeMap::new(),
        &[
            ("ClusterRole", 4),
            ("ClusterRoleBinding", 6),
            ("ConfigMap", 1),
            ("DaemonSet", 1),
            ("Deployment", 2),
            ("Job", 2),
            ("MutatingWebhookConfiguration", 1),
            ("Pod", 1),
            ("PodDisruptionBudget", 1),
            ("Role", 7),
            ("RoleBinding", 8),
            ("Secret", 3),
            ("Service", 2),
            ("ServiceAccount", 6),
            ("ValidatingAdmissionPolicy", 1),
            ("ValidatingAdmissionPolicyBinding", 1),
        ],
    );
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
            "--policy=fragmentation",
            "--bind-timeout-ms=2500",
            "--bind-grace-ms=2000",
            "--max-request-bytes=33554432",
            "--filter-keep-best=1",
            "--prioritize-weight=1",
            "--monitor-listen=0.0.0.0:9090",
            "--tls-cert=/etc/gpushare/extender-tls/tls.crt",
            "--tls-key=/etc/gpushare/extender-tls/tls.key",
            "--allocation-keys-file=/etc/gpushare/allocation-keys/keys",
            "--leader-elect=true",
            "--leader-lease=gpushare-extender",
            "--advertise-url=https://$(POD_IP):39999",
            "--leader-forward-ca=/etc/gpushare/extender-tls/ca.crt",
            "--leader-forward-server-name=gpushare-extender.kube-system.svc",
            "--client-ca=/etc/gpushare/client-tls/ca.crt",
            "--leader-forward-cert=/etc/gpushare/client-tls/extender.crt",
            "--leader-forward-key=/etc/gpushare/client-tls/extender.key",
        ],
    )?;
    let deployment: Deployment = rendered.get("Deployment", "gpushare-extender")?;
    let strategy = deployment
        .spec
        .and_then(|s| s.strategy)
        .and_then(|s| s.type_);
    // Two replicas, one binder: old and new pods may overlap in an update because only the
    // Lease holder binds.
    ensure!(
        strategy.as_deref() == Some("RollingUpdate"),
        "the extender's replicas roll: {strategy:?}"
    );
    let pdb: k8s_openapi::api::policy::v1::PodDisruptionBudget =
        rendered.get("PodDisruptionBudget", "gpushare-extender")?;
    ensure!(pdb.spec.and_then(|s| s.min_available) == Some(IntOrString::Int(1)));
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
    check_routing_hook(&rendered, "gpushare")?;
    check_rbac_bindings(&rendered, "gpushare")?;
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
    check_all_typed(&rendered.docs)?;
    let kinds = rendered.kinds();
    assert_eq!(kinds.get("ConfigMap"), None, "{kinds:?}");
    assert_eq!(kinds.get("MutatingWebhookConfiguration"), None, "{kinds:?}");
    assert_eq!(
        kinds.get("Deployment"),
        Some(&1),
        "only the extender: {kinds:?}"
    );
    assert_eq!(kinds.get("ServiceMonitor"), Some(&2), "{kinds:?}");

    let spec = rendered.pod_spec("Deployment", "prod-gpushare-extender")?;
    let c = container(&spec, "extender")?;
    assert_eq!(
        c.image.as_deref(),
        Some("ghcr.io/example/gpushare-extender:dev")
    );
    let want = [
        "--resource=acme.io/vram",
        "--node-label=acme.io/gpu-share=yes",
        "--domain=gpu.acme.io",
        "--policy=spread",
    ];
    ensure_has(&args(c), &want)?;
    let env = c.env.clone().unwrap_or_default();
    assert!(
        env.iter()
            .any(|e| e.name == "GPUSHARE_WEBHOOK_ENABLED" && e.value.as_deref() == Some("false"))
    );
    // No webhook port without the webhook.
    let ports = service_ports(&rendered, "prod-gpushare-extender")?;
    assert!(ports.iter().all(|(_, port)| *port != 443), "{ports:?}");

    let spec = check_device_plugin(
        &rendered,
        "prod-gpushare",
        ("acme.io/gpu-share", "yes"),
        &["--resource=acme.io/vram", "--domain=gpu.acme.io"],
    )?;
    assert_eq!(spec.runtime_class_name.as_deref(), Some("nvidia"));

    check_rbac_bindings(&rendered, "prod-gpushare")?;
    for monitor in rendered.of_kind("ServiceMonitor") {
        assert_eq!(monitor["metadata"]["namespace"], "gpu-system");
        assert_eq!(monitor["spec"]["endpoints"][0]["path"], "/metrics");
    }
    Ok(())
}

#[test]
fn dra_mode_installs_the_dra_driver_its_scheduler_and_the_extender_that_ranks() -> anyhow::Result<()>
{
    // The driver (with the Role to watch its own DaemonSet), the uninstall cleanup hook
    // (ServiceAccount, ClusterRole and binding, the Role and binding that delete the test
    // pod, Job), and `helm test` (ServiceAccount, ClusterRole and binding, Pod), which every
    // install has.
    let driver_only = plus(
        &BTreeMap::new(),
        &[
            ("ClusterRole", 3),
            ("ClusterRoleBinding", 3),
            ("DaemonSet", 1),
            ("DeviceClass", 1),
            ("Job", 1),
            ("MutatingAdmissionPolicy", 1),
            ("MutatingAdmissionPolicyBinding", 1),
            ("Pod", 1),
            // One per GiB, and one per GiB and compute percent (12 by default).
            ("ResourceClaimTemplate", 80 * 13),
            ("Role", 2),
            ("RoleBinding", 2),
            ("ServiceAccount", 3),
            ("ValidatingAdmissionPolicy", 1),
            ("ValidatingAdmissionPolicyBinding", 1),
        ],
    );
    // The chart's own kube-scheduler (scheduler.mode=dedicated, the default) comes too: its
    // ServiceAccount, three bindings, its leader-election Role and binding, config, Deployment;
    // and the policy that routes pods naming a claim template of our class to it.
    let with_scheduler = plus(
        &driver_only,
        &[
            ("MutatingAdmissionPolicy", 1),
            ("MutatingAdmissionPolicyBinding", 1),
            ("ServiceAccount", 1),
            ("ClusterRoleBinding", 2),
            ("Role", 1),
            ("RoleBinding", 2),
            ("ConfigMap", 1),
            ("Deployment", 1),
        ],
    );
    // dra.scheduler.ranking (the default) adds the extender, which ranks only: its
    // ServiceAccount, Service, TLS Secret, Deployment, PodDisruptionBudget, ClusterRole and
    // binding, Lease Role and binding; and the test's Role and binding to read that Lease.
    let with_ranking = plus(
        &with_scheduler,
        &[
            ("ServiceAccount", 1),
            ("Service", 1),
            ("Secret", 1),
            ("Deployment", 1),
            ("PodDisruptionBudget", 1),
            ("ClusterRole", 1),
            ("ClusterRoleBinding", 1),
            ("Role", 2),
            ("RoleBinding", 2),
        ],
    );
    let rendered = render_dra(&[])?;
    assert_eq!(rendered.kinds(), with_ranking);
    let ds = rendered.of_kind("DaemonSet")[0];
    assert_eq!(ds["metadata"]["name"], "gpushare-dra-plugin");
    check_dra_scheduler(&rendered, true)?;
    check_dra_extender(&rendered)?;

    check_template_routing(&rendered)?;
    check_dra_idle_gpu_toleration(&rendered, true)?;
    let without_taint = render_dra(&["--set", "extender.idleGpuTaint=false"])?;
    check_dra_idle_gpu_toleration(&without_taint, false)?;

    let rendered = render_dra(&["--set", "dra.scheduler.ranking=false"])?;
    assert_eq!(rendered.kinds(), with_scheduler);
    check_dra_scheduler(&rendered, false)?;
    check_dra_idle_gpu_toleration(&rendered, false)?;
    let expression = claims_policy_patch(&rendered)?;
    assert!(
        expression.contains(r#"path: "/spec/schedulerName", value: "gpushare-scheduler""#),
        "the claims policy sends the pods it turns to the chart's scheduler: {expression}"
    );

    // With the operator's own kube-scheduler, only the driver, and pods keep their scheduler.
    let rendered = render_dra(&["--set", "scheduler.mode=default-scheduler"])?;
    assert_eq!(rendered.kinds(), driver_only);
    let expression = claims_policy_patch(&rendered)?;
    assert!(!expression.contains("schedulerName"), "{expression}");

    // `example.com/gpu-mem: N` in DRA mode: one template per GiB, in each namespace named,
    // asking the chart's DeviceClass for N GiB of one GPU (the real tier runs the README's
    // pod through them), and one per GiB and compute percent, asking for both.
    let rendered = render_dra(&[
        "--set",
        "dra.gpuMem.maxGiB=3",
        "--set-json",
        r#"dra.gpuMem.namespaces=["team-a","team-b"]"#,
        "--set-json",
        "dra.gpuMem.computePercents=[50]",
    ])?;
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    let mut templates: Vec<String> = rendered
        .of_kind("ResourceClaimTemplate")
        .into_iter()
        .map(|t| {
            let request = &t["spec"]["spec"]["devices"]["requests"][0]["exactly"];
            ensure!(request["deviceClassName"] == "gpu-mem.gpushare.example.com");
            let (metadata, capacity) = (&t["metadata"], &request["capacity"]["requests"]);
            Ok(format!(
                "{}/{}: memory={} compute={}",
                text(&metadata["namespace"]),
                text(&metadata["name"]),
                text(&capacity["memory"]),
                text(&capacity["compute"]),
            ))
        })
        .collect::<anyhow::Result<_>>()?;
    templates.sort();
    let mut want: Vec<String> = ["team-a", "team-b"]
        .into_iter()
        .flat_map(|ns| {
            (1..=3).flat_map(move |gib| {
                [
                    format!("{ns}/gpushare-gpu-mem-{gib}: memory={gib}Gi compute="),
                    format!("{ns}/gpushare-gpu-mem-{gib}-c50: memory={gib}Gi compute=50"),
                ]
            })
        })
        .collect();
    want.sort();
    assert_eq!(templates, want);
    let policy = &rendered.of_kind("MutatingAdmissionPolicy")[0];
    assert_eq!(
        policy["spec"]["matchConstraints"]["namespaceSelector"]["matchExpressions"][0]["values"],
        serde_json::json!(["team-a", "team-b"])
    );
    let without = render_dra(&["--set", "dra.gpuMem.enabled=false"])?;
    for kind in ["ResourceClaimTemplate", "ValidatingAdmissionPolicy"] {
        ensure!(
            without.of_kind(kind).is_empty(),
            "{kind} rendered with dra.gpuMem.enabled=false"
        );
    }
    // Pods naming templates of their own are still routed to the chart's scheduler.
    let policies: Vec<&serde_json::Value> = without
        .of_kind("MutatingAdmissionPolicy")
        .into_iter()
        .map(|p| &p["metadata"]["name"])
        .collect();
    ensure!(policies == ["gpushare-claim-templates"], "{policies:?}");
    Ok(())
}

/// `logFormat` reaches every binary the chart runs, each in the form it reads.
#[test]
fn log_format_reaches_every_binary() -> anyhow::Result<()> {
    /// The `GPUSHARE_LOG_FORMAT` of the DaemonSet's container `name`.
    fn log_format(rendered: &Rendered, daemonset: &str, name: &str) -> anyhow::Result<String> {
        let spec = rendered.pod_spec("DaemonSet", daemonset)?;
        let mut env = container(&spec, name)?.env.iter().flatten();
        env.find(|e| e.name == "GPUSHARE_LOG_FORMAT")
            .and_then(|e| e.value.clone())
            .with_context(|| format!("{name} has no GPUSHARE_LOG_FORMAT"))
    }
    let rendered = render_sets(&["logFormat=json"])?;
    assert_eq!(
        log_format(&rendered, "gpushare-device-plugin", "device-plugin")?,
        "json"
    );
    ensure_has(&extender_args(&rendered)?, &["--log-format=json"])?;
    let rendered = render_sets(&["mode=dra", "logFormat=json"])?;
    assert_eq!(
        log_format(&rendered, "gpushare-dra-plugin", "dra-plugin")?,
        "json"
    );
    Ok(())
}

/// `isolation.contextMiB` and `isolation.managedMemory` reach both plugins as flags, in
/// `preload` mode only and only when set away from the interposer's default; the binaries
/// accept what the chart renders, and the settings they read are the ones each container's
/// environment carries (`GPUSHARE_CONTEXT_MIB`, `GPUSHARE_MANAGED_MEMORY`).
#[test]
fn the_interposers_settings_reach_both_plugins_in_preload_mode() -> anyhow::Result<()> {
    use clap::Parser as _;
    use gpushare_contract::env::{
        self, Enforcement, EnforcerSettings, IsolationOptions, ManagedMemory,
    };
    const SETTINGS: [&str; 2] = ["--isolation-context-mib", "--isolation-managed-memory"];

    /// The plugin's args as its binary reads them, with the node name the downward API gives.
    fn plugin_args(rendered: &Rendered, mode: &str) -> anyhow::Result<Vec<String>> {
        let (daemonset, name) = match mode {
            "dra" => ("gpushare-dra-plugin", "dra-plugin"),
            _ => ("gpushare-device-plugin", "device-plugin"),
        };
        let spec = rendered.pod_spec("DaemonSet", daemonset)?;
        let argv = [format!("gpushare-{name}"), "--node-name=n1".to_owned()];
        Ok(argv
            .into_iter()
            .chain(args(container(&spec, name)?))
            .collect())
    }
    /// What the plugin's binary makes of `argv`: its enforcement mode and the interposer's
    /// settings.
    fn parsed(mode: &str, argv: &[String]) -> anyhow::Result<(Enforcement, IsolationOptions)> {
        Ok(if mode == "dra" {
            let config = gpushare_dra_plugin::Config::try_parse_from(argv)
                .context("the DRA plugin refuses the chart's args")?;
            (config.enforcement, config.isolation.options())
        } else {
            let config = gpushare_device_plugin::Config::try_parse_from(argv)
                .context("the device plugin refuses the chart's args")?;
            (config.enforcement, config.isolation.options())
        })
    }

    let values = tempfile::tempdir()?;
    let zero = values.path().join("zero.yaml");
    // A values file gives numbers as floats, --set as integers: both render the same.
    std::fs::write(&zero, "isolation:\n  contextMiB: 0\n")?;
    let zero = zero.to_str().context("path")?;
    for mode in ["extender", "dra"] {
        let set_mode = format!("mode={mode}");

        // Not set: no flags; the interposer's defaults, so containers get no variable.
        let argv = plugin_args(&render_sets(&[&set_mode])?, mode)?;
        ensure_lacks(&argv, &SETTINGS).context(mode)?;
        ensure!(
            parsed(mode, &argv)? == (Enforcement::Preload, IsolationOptions::default()),
            "{mode}: {argv:?}"
        );

        // Set: both flags, read back as set, and carried into the container's environment.
        let [context_mib, managed] = ["isolation.contextMiB=640", "isolation.managedMemory=ignore"];
        let argv = plugin_args(&render_sets(&[&set_mode, context_mib, managed])?, mode)?;
        let want = [
            "--isolation-context-mib=640",
            "--isolation-managed-memory=ignore",
        ];
        ensure_has(&argv, &want).context(mode)?;
        let (enforcement, options) = parsed(mode, &argv)?;
        ensure!(
            options
                == IsolationOptions {
                    context_mib: Some(640),
                    managed_memory: ManagedMemory::Ignore,
                    compute_mode: Default::default(),
                },
            "{mode}: {options:?}"
        );
        let vars = enforcement.env(
            4,
            &EnforcerSettings {
                mps_pipe_directory: "",
                isolation: options,
            },
        );
        for want in [
            (env::ISOLATION_CONTEXT_MIB, "640"),
            (env::ISOLATION_MANAGED_MEMORY, "ignore"),
        ] {
            ensure!(
                vars.iter().any(|(k, v)| (*k, v.as_str()) == want),
                "{mode}: {vars:?} lacks {want:?}"
            );
        }

        let rendered = render("gpushare", "kube-system", &["--set", &set_mode, "-f", zero])?;
        let argv = plugin_args(&rendered, mode)?;
        ensure_has(&argv, &["--isolation-context-mib=0"]).context(mode)?;
        ensure!(parsed(mode, &argv)?.1.context_mib == Some(0), "{mode}");

        // Another isolation mode: the settings are the interposer's, so no flags.
        for other in ["none", "mps", "toolkit"] {
            let isolation = format!("isolation.mode={other}");
            let rendered = render_sets(&[&set_mode, &isolation, context_mib, managed])?;
            let argv = plugin_args(&rendered, mode)?;
            ensure_lacks(&argv, &SETTINGS).with_context(|| format!("{mode}/{other}"))?;
        }
    }
    Ok(())
}

/// DRA mode: the plugin's pod is ready only once kubelet has registered the driver, through
/// the binary's own probe paths on the port it is told to listen on; the args the chart
/// passes are ones the binary accepts, and `dra.probePort` moves the flag and the port
/// together.
#[test]
fn the_dra_plugin_is_probed_where_it_listens() -> anyhow::Result<()> {
    use clap::Parser as _;
    use gpushare_dra_plugin::probes::{HEALTHZ, READYZ};
    for (sets, port) in [
        (&["mode=dra"][..], 9402),
        (&["mode=dra", "dra.probePort=9555"], 9555),
    ] {
        let spec = render_sets(sets)?.pod_spec("DaemonSet", "gpushare-dra-plugin")?;
        check_hardened("gpushare-dra-plugin", &spec)?;
        let c = container(&spec, "dra-plugin")?;

        // NODE_NAME comes from the downward API; everything else from the chart.
        let argv = [
            "gpushare-dra-plugin".to_owned(),
            "--node-name=n1".to_owned(),
        ]
        .into_iter()
        .chain(args(c));
        let config = gpushare_dra_plugin::Config::try_parse_from(argv)
            .context("the binary refuses the chart's args")?;
        ensure!(config.probe_addr.port() == port, "{:?}", config.probe_addr);
        ensure!(
            config.probe_addr.ip().is_unspecified(),
            "kubelet probes the pod IP, not loopback: {:?}",
            config.probe_addr
        );

        let probes = c
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some("probes"))
            .context("no port named probes")?;
        ensure!(probes.container_port == i32::from(port), "{probes:?}");
        for (name, probe, path) in [
            ("readiness", &c.readiness_probe, READYZ),
            ("liveness", &c.liveness_probe, HEALTHZ),
        ] {
            let get = probe
                .as_ref()
                .and_then(|p| p.http_get.as_ref())
                .with_context(|| format!("no {name} httpGet probe"))?;
            ensure!(get.path.as_deref() == Some(path), "{name}: {get:?}");
            ensure!(
                get.port == IntOrString::String("probes".to_owned()),
                "{name}: {get:?}"
            );
        }
        // Readiness notices the registration within seconds: the rollout waits for it, not
        // much longer.
        let readiness = c.readiness_probe.as_ref().context("readiness")?;
        ensure!(readiness.period_seconds.unwrap_or(10) <= 5, "{readiness:?}");
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
        ("mode=both", "mode must be \"extender\" or \"dra\""),
        (
            "devicePlugin.enforcement.mode=cgroup",
            "enforcement.mode must be",
        ),
        (
            "extender.replicas=0",
            "extender.replicas must be at least 1",
        ),
        (
            "extender.filterKeepBest=-1",
            "extender.filterKeepBest must be 0",
        ),
        (
            "networkPolicy.enabled=true,scheduler.mode=default-scheduler",
            "needs networkPolicy.schedulerPeers",
        ),
        (
            "metrics.serviceMonitor.enabled=true",
            "monitoring.coreos.com/v1",
        ),
        (
            "isolation.contextMiB=1048577",
            "isolation.contextMiB must be empty",
        ),
        (
            "isolation.contextMiB=1.5",
            "isolation.contextMiB must be empty",
        ),
        (
            "isolation.managedMemory=off",
            "isolation.managedMemory must be \"charge\" or \"ignore\"",
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
        // values.schema.json refuses most of these before the templates do, naming the value
        // by its path; the templates' messages stay for `--skip-schema-validation`.
        let key = set.split_once('=').map_or(set, |(key, _)| key);
        let by_schema = format!("at '/{}'", key.replace('.', "/"));
        assert!(
            stderr.contains(needle) || stderr.contains(&by_schema),
            "{set}: {stderr}"
        );
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

/// The values of values.yaml, by dotted path: maps of settings are walked; lists and
/// free-form maps such as `resources` are one entry.
fn value_leaves() -> anyhow::Result<Vec<String>> {
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
    let values: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(chart_dir().join("values.yaml"))?)?;
    let mut keys = Vec::new();
    leaves("", &values, &mut keys);
    Ok(keys)
}

/// Every value in values.yaml is in values.schema.json (so helm checks it), and a typo'd
/// key or a value of the wrong type fails `helm template`, naming it.
#[test]
fn every_value_is_in_the_schema_and_typos_fail_by_name() -> anyhow::Result<()> {
    let schema: Value = serde_json::from_str(&std::fs::read_to_string(
        chart_dir().join("values.schema.json"),
    )?)?;
    ensure!(
        schema["additionalProperties"] == false,
        "top level is closed"
    );
    let missing: Vec<String> = value_leaves()?
        .into_iter()
        .filter(|path| {
            let node = path
                .split('.')
                .try_fold(&schema, |node, key| node["properties"].get(key));
            node.is_none_or(|node| node["type"].is_null())
        })
        .collect();
    ensure!(missing.is_empty(), "values without a schema: {missing:?}");
    for (set, named) in [
        ("extender.replica=3", "'replica' not allowed"),
        ("extender.replicas=two", "/extender/replicas"),
        ("isolation.overShare=kill", "/isolation/overShare"),
        ("devicePlugin.usage.enabledd=true", "'enabledd' not allowed"),
    ] {
        let err = render_sets(&[set])
            .err()
            .with_context(|| format!("--set {set} rendered"))?
            .to_string();
        ensure!(err.contains(named), "--set {set}: {err}");
    }
    Ok(())
}

/// The chart renders for the Kubernetes it states (its allocation policy is the GA
/// ValidatingAdmissionPolicy of 1.30) and refuses older clusters with a message naming the
/// minimum, rather than rendering objects the API server does not serve.
#[test]
fn the_chart_renders_for_the_kubernetes_it_states_and_refuses_older() -> anyhow::Result<()> {
    let chart = chart_dir();
    let chart = chart.to_str().context("chart path")?;
    let oldest = helm(&["template", "x", chart, "--kube-version", "1.30.0"])?;
    ensure!(
        oldest.status.success(),
        "1.30: {}",
        String::from_utf8_lossy(&oldest.stderr)
    );
    let text = String::from_utf8_lossy(&oldest.stdout);
    ensure!(
        text.contains(
            "apiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingAdmissionPolicy"
        ),
        "the allocation policy renders on 1.30"
    );
    let older = helm(&["template", "x", chart, "--kube-version", "1.29.9"])?;
    let stderr = String::from_utf8_lossy(&older.stderr);
    ensure!(
        !older.status.success() && stderr.contains(">=1.30.0"),
        "1.29 must be refused naming the minimum: {stderr}"
    );
    Ok(())
}

/// GitOps tools (Argo CD, Flux) render the chart without cluster access, so `lookup` finds
/// nothing and generated keys would change on every sync. With every Secret supplied, two
/// renders are byte-identical and hold no key material, and the Secrets named are mounted.
#[test]
fn with_existing_secrets_two_renders_are_identical() -> anyhow::Result<()> {
    let supplied = [
        "--set",
        "extender.tls.existingSecret=serving",
        "--set",
        "extender.tls.clientAuth.existingSecret=callers",
        "--set",
        "allocationSigning.existingSecret=signing",
    ];
    let text = |extra: &[&str]| render_text("gpushare", "kube-system", extra);
    // Without them, keys are generated: the renders differ (the test can tell).
    ensure!(text(&[])? != text(&[])?, "generated keys differ per render");
    let first = text(&supplied)?;
    ensure!(first == text(&supplied)?, "two renders differ");
    let rendered = render("gpushare", "kube-system", &supplied)?;
    ensure!(
        rendered.of_kind("Secret").is_empty(),
        "no Secret is generated"
    );
    for name in ["serving", "callers", "signing"] {
        ensure!(
            first.contains(&format!("secretName: {name}\n")),
            "Secret {name} is not mounted"
        );
    }
    Ok(())
}

/// `global.imageRegistry` moves every image the chart names, in both modes: the containers of
/// every workload and hook, and the routing check's dry-run probe image.
#[test]
fn global_image_registry_moves_every_image() -> anyhow::Result<()> {
    for mode in ["extender", "dra"] {
        let mode_set = format!("mode={mode}");
        let rendered = render_sets(&[&mode_set, "global.imageRegistry=mirror.corp:5000"])?;
        let mut images = Vec::new();
        for doc in &rendered.docs {
            let spec = &doc["spec"]["template"]["spec"];
            for list in ["containers", "initContainers"] {
                for container in spec[list].as_array().into_iter().flatten() {
                    images.push(container["image"].as_str().unwrap_or_default().to_owned());
                    for arg in container["args"].as_array().into_iter().flatten() {
                        if let Some(image) =
                            arg.as_str().and_then(|a| a.strip_prefix("--probe-image="))
                        {
                            images.push(image.to_owned());
                        }
                    }
                }
            }
        }
        ensure!(images.len() >= 3, "{mode}: {images:?}");
        let elsewhere: Vec<&String> = images
            .iter()
            .filter(|image| !image.starts_with("mirror.corp:5000/"))
            .collect();
        ensure!(elsewhere.is_empty(), "{mode}: not moved: {elsewhere:?}");
        ensure!(
            images
                .iter()
                .any(|i| i == "mirror.corp:5000/kube-scheduler:v1.36.0"),
            "{mode}: the registry host is replaced, not prefixed: {images:?}"
        );
    }
    Ok(())
}

/// Every value in values.yaml is documented in the README's table.
#[test]
fn every_value_is_documented_in_the_readme() -> anyhow::Result<()> {
    let readme = std::fs::read_to_string(chart_dir().join("README.md"))?;
    let keys = value_leaves()?;
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

/// The dedicated profile stops kube-scheduler's filtering at 1 % of the nodes (its floor of
/// 100) by default, so the extender gets a quarter of the names of the adaptive walk at 1,000
/// nodes; 0 gives the adaptive walk back, and values kube-scheduler would refuse fail to render.
#[tokio::test]
async fn the_dedicated_profile_scores_a_share_of_the_nodes() -> anyhow::Result<()> {
    let walk = |text: &str| -> anyhow::Result<usize> {
        let driver =
            SchedulerConfig::from_kube_scheduler_configuration(text, SchedulerConfig::default())?;
        Ok(
            gpushare_e2e::scheduler::framework::num_feasible_nodes_to_find_at(
                1000,
                driver.percentage_of_nodes_to_score,
            ),
        )
    };
    let default = dedicated_scheduler_configuration(&[], &[]).await?;
    ensure!(walk(&default)? == 100, "{default}");
    let adaptive = dedicated_scheduler_configuration(
        &[],
        &["scheduler.percentageOfNodesToScore=0".to_owned()],
    )
    .await?;
    ensure!(walk(&adaptive)? == 420, "{adaptive}");
    let half = dedicated_scheduler_configuration(
        &[],
        &["scheduler.percentageOfNodesToScore=50".to_owned()],
    )
    .await?;
    ensure!(walk(&half)? == 500, "{half}");
    for bad in ["101", "-1", "2.5", "many"] {
        let refused = dedicated_scheduler_configuration(
            &[],
            &[format!("scheduler.percentageOfNodesToScore={bad}")],
        )
        .await;
        // The schema refuses it first, naming the value; the template's own check stays for
        // `--skip-schema-validation`.
        ensure!(
            refused.is_err_and(|e| {
                let e = format!("{e:#}");
                e.contains("must be a whole number from 0")
                    || e.contains("at '/scheduler/percentageOfNodesToScore'")
            }),
            "percentageOfNodesToScore={bad} must fail to render"
        );
    }
    Ok(())
}

/// `extender.filterKeepBest` (1 by default) reaches the extender with the weight the
/// profile gives prioritize, and turns off the dedicated profile's score plugins the
/// extender's ranking does not read. Under a kube-scheduler the chart does not configure, or
/// with `scheduler.nativeGpuScoring`, the extender keeps every fitting node.
#[tokio::test]
async fn keep_best_matches_the_profile_it_ranks_for() -> anyhow::Result<()> {
    let default = extender_args(&render_sets(&["scheduler.extender.weight=3"])?)?;
    ensure_has(&default, &["--filter-keep-best=1", "--prioritize-weight=3"])?;
    let profile = dedicated_scheduler_configuration(&[], &[]).await?;
    let config: serde_yaml::Value = serde_yaml::from_str(&profile)?;
    let profile0 = &config["profiles"][0];
    ensure!(
        profile0["plugins"]["score"]["disabled"][0]["name"].as_str() == Some("ImageLocality"),
        "{profile}"
    );
    let spread = &profile0["pluginConfig"][0];
    ensure!(
        spread["name"].as_str() == Some("PodTopologySpread")
            && spread["args"]["defaultingType"].as_str() == Some("List")
            && spread["args"].get("defaultConstraints").is_none(),
        "{profile}"
    );

    let off =
        dedicated_scheduler_configuration(&[], &["extender.filterKeepBest=0".to_owned()]).await?;
    ensure!(!off.contains("ImageLocality"), "{off}");
    ensure!(!off.contains("PodTopologySpread"), "{off}");
    for sets in [
        &["policy=binpack", "scheduler.nativeGpuScoring=true"][..],
        &["scheduler.mode=default-scheduler"][..],
    ] {
        ensure_has(
            &extender_args(&render_sets(sets)?)?,
            &["--filter-keep-best=0"],
        )
        .with_context(|| format!("{sets:?}"))?;
    }
    Ok(())
}

/// `scheduler.nativeGpuScoring` (binpack only) makes the dedicated profile score GPU memory
/// with `NodeResourcesFit` MostAllocated and drops the prioritize call; without it, every
/// policy ranks nodes through the extender with upstream's resource scoring; the value with
/// another policy is refused at render time.
#[tokio::test]
async fn native_gpu_scoring_replaces_prioritize_for_binpack_only() -> anyhow::Result<()> {
    let native_values = ["scheduler.nativeGpuScoring=true".to_owned()];
    let binpack = ["--policy=binpack".to_owned()];
    let native = dedicated_scheduler_configuration(&binpack, &native_values).await?;
    let driver =
        SchedulerConfig::from_kube_scheduler_configuration(&native, SchedulerConfig::default())?;
    ensure!(
        driver.fit_scoring
            == FitScoring {
                strategy: FitStrategy::MostAllocated,
                resources: vec![("example.com/gpu-mem".to_owned(), 1)],
            },
        "{native}"
    );
    ensure!(
        driver.extenders.iter().all(|e| e.prioritize_verb.is_none()),
        "{native}"
    );

    for policy in ["binpack", "spread", "fragmentation"] {
        let text = dedicated_scheduler_configuration(&[format!("--policy={policy}")], &[]).await?;
        let driver =
            SchedulerConfig::from_kube_scheduler_configuration(&text, SchedulerConfig::default())?;
        ensure!(
            driver.fit_scoring == FitScoring::default(),
            "{policy}: {text}"
        );
        let [extender] = driver.extenders.as_slice() else {
            bail!("{policy}: one extender expected: {text}");
        };
        ensure!(
            extender.prioritize_verb.as_deref() == Some("prioritize") && extender.weight == 1,
            "{policy}: {text}"
        );
    }
    let refused =
        dedicated_scheduler_configuration(&["--policy=fragmentation".to_owned()], &native_values)
            .await;
    ensure!(
        refused.is_err_and(|e| format!("{e:#}").contains("needs the extender's prioritize")),
        "nativeGpuScoring with fragmentation must fail to render"
    );
    Ok(())
}

/// `extender.tls.clientAuth`: the replicas mount the client CA and their own certificate (not
/// the scheduler's key); the upgrade grace is rendered only on an upgrade that finds no client
/// Secret yet (`helm template --is-upgrade` finds none), ten minutes from now; turned off,
/// nothing of it is rendered and the scheduler presents no certificate.
#[test]
fn client_certificates_guard_the_scheduler_port() -> anyhow::Result<()> {
    let installed = render_sets(&[])?;
    ensure_lacks(&extender_args(&installed)?, &["--accept-uncertified-until"])
        .context("an install needs no grace")?;
    let pod = installed.pod_spec("Deployment", "gpushare-extender")?;
    let (_, items) = secret_volume(&pod, "client-tls")?;
    ensure!(
        items
            == [
                "ca.crt -> ca.crt",
                "extender.crt -> extender.crt",
                "extender.key -> extender.key"
            ],
        "{items:?}"
    );
    let secret: Secret = installed.get("Secret", "gpushare-extender-client-tls")?;
    let data = secret.data.unwrap_or_default();
    let names: Vec<&String> = data.keys().collect();
    ensure!(
        names
            == [
                "ca.crt",
                "extender.crt",
                "extender.key",
                "scheduler.crt",
                "scheduler.key"
            ],
        "{names:?}"
    );

    let upgraded = render("gpushare", "kube-system", &["--is-upgrade"])?;
    let upgraded_args = extender_args(&upgraded)?;
    let until = upgraded_args
        .iter()
        .find_map(|a| a.strip_prefix("--accept-uncertified-until="))
        .context("the first upgrade with client certificates renders the grace")?;
    let until: jiff::Timestamp = until.parse()?;
    let minutes = until.duration_since(jiff::Timestamp::now()).as_secs() / 60;
    ensure!((8..=10).contains(&minutes), "grace ends in {minutes} min");

    let off = render_sets(&["extender.tls.clientAuth.enabled=false"])?;
    ensure!(
        off.get::<Secret>("Secret", "gpushare-extender-client-tls")
            .is_err()
    );
    ensure_lacks(
        &extender_args(&off)?,
        &["--client-ca", "--leader-forward-cert"],
    )?;
    let text = scheduler_config_text(&off, "gpushare-scheduler")?;
    ensure!(!text.contains("certFile"), "{text}");
    Ok(())
}

/// Runs the real promtool (installed like helm, by scripts/install-tools.sh: a promtool that
/// cannot be installed fails the test, it is never skipped) with `args`; its output.
fn promtool(args: &[&std::ffi::OsStr]) -> anyhow::Result<String> {
    let promtool = gpushare_e2e::tools::promtool()?;
    let output = Command::new(&promtool)
        .args(args)
        .output()
        .with_context(|| format!("running {}", promtool.display()))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    ensure!(
        output.status.success(),
        "promtool {args:?} failed ({}):\n{text}",
        output.status
    );
    Ok(text)
}

/// The chart's alerts, rendered as a PrometheusRule, pass `promtool check rules`, and the unit
/// tests of tests/alerts.test.yaml pass against the rendered groups (laid out where the tests
/// look for files/alerts.yaml): each alert fires on the series that should fire it, with the
/// labels and annotations written there, and not on the others. Every alert has a severity, a
/// summary and a description, and unit tests that fire it and that must not.
#[test]
fn the_alerts_pass_promtool_and_their_unit_tests() -> anyhow::Result<()> {
    let rendered = render(
        "prod",
        "gpu-system",
        &[
            "--api-versions",
            "monitoring.coreos.com/v1",
            "--set",
            "monitoring.prometheusRule.enabled=true",
            "--set-string",
            "monitoring.prometheusRule.labels.release=kps",
            "--set",
            "metrics.serviceMonitor.enabled=true",
        ],
    )?;
    // The alerts name a device plugin's node by the `node` label its ServiceMonitor adds, and
    // a workload's pod by the series' own `pod` (honorLabels keeps it from `exported_pod`).
    let plugin_monitor = rendered.object("ServiceMonitor", "prod-gpushare-device-plugin")?;
    let endpoint = &plugin_monitor["spec"]["endpoints"][0];
    ensure!(endpoint["honorLabels"] == true, "{endpoint}");
    ensure!(
        endpoint["relabelings"]
            .as_array()
            .into_iter()
            .flatten()
            .any(
                |r| r["sourceLabels"] == serde_json::json!(["__meta_kubernetes_pod_node_name"])
                    && r["targetLabel"] == "node"
            ),
        "{endpoint}"
    );
    let rule = check_alerts(&rendered, "alerts.yaml", "alerts.test.yaml")?;
    ensure!(rule["metadata"]["name"] == "prod-gpushare-alerts");
    ensure!(rule["metadata"]["namespace"] == "gpu-system");
    ensure!(
        rule["metadata"]["labels"]["release"] == "kps",
        "monitoring.prometheusRule.labels reach the rule: {}",
        rule["metadata"]["labels"]
    );
    Ok(())
}

/// Checks the one PrometheusRule of `rendered`, and returns it: it parses, its groups are
/// those of `files/{rules}` (what promtool's unit tests read from the chart is what the chart
/// renders); every alert has a severity (critical or warning), a summary and a description,
/// and a unique name; laid out as `files/{rules}` beside the chart's `tests/{tests}` in a
/// temporary directory, the groups pass `promtool check rules` and the unit tests, and every
/// alert has a test that fires it and one where it must not.
fn check_alerts<'r>(rendered: &'r Rendered, rules: &str, tests: &str) -> anyhow::Result<&'r Value> {
    let found = rendered.of_kind("PrometheusRule");
    ensure!(found.len() == 1, "one PrometheusRule, not {}", found.len());
    let prometheus_rule = found[0];
    check_all_typed([prometheus_rule])?;
    let groups = &prometheus_rule["spec"]["groups"];
    let source = std::fs::read_to_string(chart_dir().join("files").join(rules))?;
    let source: serde_yaml::Value = serde_yaml::from_str(&source)?;
    ensure!(
        serde_json::to_value(&source)?["groups"] == *groups,
        "the rendered groups differ from files/{rules}"
    );
    let mut alerts = BTreeSet::new();
    for group in groups.as_array().context("groups")? {
        for rule in group["rules"].as_array().context("rules")? {
            let name = rule["alert"].as_str().context("a rule that is no alert")?;
            ensure!(
                ["critical", "warning"]
                    .contains(&rule["labels"]["severity"].as_str().unwrap_or("")),
                "{name}: severity must be critical or warning: {}",
                rule["labels"]
            );
            for annotation in ["summary", "description"] {
                ensure!(
                    rule["annotations"][annotation]
                        .as_str()
                        .is_some_and(|text| !text.trim().is_empty()),
                    "{name} has no {annotation}"
                );
            }
            ensure!(alerts.insert(name.to_owned()), "{name} twice");
        }
    }

    let dir = tempfile::tempdir()?;
    for sub in ["files", "tests"] {
        std::fs::create_dir(dir.path().join(sub))?;
    }
    let rules_file = dir.path().join("files").join(rules);
    std::fs::write(
        &rules_file,
        serde_yaml::to_string(&serde_json::json!({ "groups": groups }))?,
    )?;
    let tests_file = dir.path().join("tests").join(tests);
    std::fs::copy(chart_dir().join("tests").join(tests), &tests_file)?;
    let checked = promtool(&["check".as_ref(), "rules".as_ref(), rules_file.as_os_str()])?;
    ensure!(
        checked.contains(&format!("SUCCESS: {} rules found", alerts.len())),
        "{checked}"
    );
    promtool(&["test".as_ref(), "rules".as_ref(), tests_file.as_os_str()])?;

    let cases: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(&tests_file)?)?;
    let (mut fired, mut quiet) = (BTreeSet::new(), BTreeSet::new());
    for group in cases["tests"].as_sequence().context("tests")? {
        for case in group["alert_rule_test"].as_sequence().into_iter().flatten() {
            let name = case["alertname"].as_str().context("alertname")?.to_owned();
            ensure!(alerts.contains(&name), "tests name an unknown alert {name}");
            match case["exp_alerts"].as_sequence() {
                Some(expected) if !expected.is_empty() => fired.insert(name),
                _ => quiet.insert(name),
            };
        }
    }
    let never_fired: Vec<_> = alerts.difference(&fired).collect();
    let never_quiet: Vec<_> = alerts.difference(&quiet).collect();
    ensure!(
        never_fired.is_empty() && never_quiet.is_empty(),
        "alerts without a test that fires them: {never_fired:?}; without one where they must not: {never_quiet:?}"
    );
    Ok(prometheus_rule)
}

/// files/`file` names at least `at_least` gpushare metrics, and only ones in `exported`.
fn ensure_exported(file: &str, at_least: usize, exported: &BTreeSet<String>) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(chart_dir().join("files").join(file))?;
    let used = metric_names_in(&text);
    ensure!(
        used.len() >= at_least,
        "files/{file} names fewer than {at_least} metrics: {used:?}"
    );
    let unknown: Vec<_> = used.difference(exported).collect();
    ensure!(
        unknown.is_empty(),
        "files/{file} alerts on metrics nobody exports: {unknown:?}"
    );
    Ok(())
}

/// The metric names the extender and the device plugin export, as PromQL sees them: counters
/// with `_total`, histograms as `_bucket`, `_sum` and `_count`. A labelled family is encoded
/// only once it has a series, so each gets one here; a family registered and not given one is
/// caught by counting the registry's descriptors.
fn exported_metrics() -> anyhow::Result<BTreeSet<String>> {
    use gpushare_device_plugin::metrics::{
        ContainerGpuLabels, ContainerUseLabels, GpuLabels, GpuModelLabels, PodGpuLabels,
    };
    let mut registry = prometheus_client::registry::Registry::default();
    let extender = gpushare_extender::metrics::Metrics::register(&mut registry);
    extender.observe("filter", std::time::Instant::now());
    extender.bind("bound");
    extender.resolution("landed");
    extender.keep_best_stepped_aside("soft_topology_spread");
    extender.record_idle_gpu_taint("added");
    // The domain starts this family at 0 for each reason; here, one series.
    extender.unschedulable("fragmentation");
    extender.preempt_answer("victims");
    extender.preempt_victims(1, 1);
    extender.set_nominations((1, 1));
    extender.refuse_caller(gpushare_extender::metrics::RefusalReason::NoClientCertificate);
    let plugin = gpushare_device_plugin::metrics::Metrics::new(&mut registry);
    plugin.allocate_error("no_pending_pod");
    for family in [
        &plugin.pod_patches,
        &plugin.node_patches,
        &plugin.usage_patches,
    ] {
        gpushare_device_plugin::metrics::Metrics::patch(family, true);
    }
    plugin.kubelet_mismatch("wrong_gpu");
    let gpu = GpuLabels {
        gpu: "0".into(),
        uuid: "GPU-0".into(),
    };
    for family in [
        &plugin.gpu_allocated_bytes,
        &plugin.gpu_used_bytes,
        &plugin.gpu_unattributed_bytes,
        &plugin.gpu_healthy,
    ] {
        family.get_or_create(&gpu).set(0);
    }
    let model = GpuModelLabels {
        gpu: "0".into(),
        uuid: "GPU-0".into(),
        model: "Tesla T4".into(),
    };
    plugin.gpu_capacity_bytes.get_or_create(&model).set(0);
    let pod = PodGpuLabels {
        namespace: "ml".into(),
        pod: "a".into(),
        gpu: "0".into(),
    };
    for family in [&plugin.pod_allocated_bytes, &plugin.pod_used_bytes] {
        family.get_or_create(&pod).set(0);
    }
    let isolated = ContainerGpuLabels {
        namespace: "ml".into(),
        pod: "a".into(),
        container: "main".into(),
        gpu: 0,
    };
    for family in [
        &plugin.isolated_share_bytes,
        &plugin.isolated_used_bytes,
        &plugin.isolated_refused_allocations,
    ] {
        family.get_or_create(&isolated).set(0);
    }
    let container = ContainerUseLabels {
        namespace: "ml".into(),
        pod: "a".into(),
        container: "main".into(),
        gpu: "0".into(),
    };
    for family in [
        &plugin.container_used_bytes,
        &plugin.container_over_share_bytes,
    ] {
        family.get_or_create(&container).set(0);
    }
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry)?;
    let registered = format!("{registry:?}").matches("Descriptor {").count();
    let encoded = text.lines().filter(|l| l.starts_with("# TYPE ")).count();
    ensure!(
        registered == encoded,
        "{registered} metrics registered, {encoded} encoded: give the new labelled family a series in exported_metrics()"
    );
    // The extender's per-GPU gauges are computed from its view on each scrape (a collector,
    // not registered families): described with or without series, so counted apart.
    let mut from_view = prometheus_client::registry::Registry::default();
    let view = gpushare_extender::View::new(gpushare_extender::Settings::new(
        gpushare_contract::DEFAULT_RESOURCE,
        gpushare_contract::DEFAULT_DOMAIN,
        "gpushare=true",
    ));
    gpushare_extender::scheduling::gauges::GpuGauges::register(
        &mut from_view,
        std::sync::Arc::new(std::sync::RwLock::new(view)),
    );
    prometheus_client::encoding::text::encode(&mut text, &from_view)?;
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let Some(described) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let (name, kind) = described.split_once(' ').context("a TYPE line")?;
        match kind {
            "counter" => {
                names.insert(format!("{name}_total"));
            }
            "histogram" => {
                for suffix in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{suffix}"));
                }
            }
            _ => {
                names.insert(name.to_owned());
            }
        }
    }
    ensure!(names.len() > 40, "too few metrics found: {names:?}");
    Ok(names)
}

/// The `gpushare_…` metric names in `text`: words of PromQL's name characters starting with
/// `gpushare_`, but Rust paths (`gpushare_runtime::…`) and `*` patterns (`gpushare_container_*`).
fn metric_names_in(text: &str) -> BTreeSet<String> {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("gpushare_") {
        let starts_word = !rest[..at].ends_with(is_name);
        let word_len = rest[at..]
            .find(|c: char| !is_name(c))
            .unwrap_or(rest.len() - at);
        let word = &rest[at..at + word_len];
        let after = &rest[at + word_len..];
        if starts_word && !after.starts_with("::") && !after.starts_with('*') {
            names.insert(word.to_owned());
        }
        rest = after;
    }
    names
}

/// The alerts use only metrics the binaries export, and docs/operating.md's tables list every
/// one of them and name no other.
#[test]
fn the_alerts_and_the_operating_guide_name_only_metrics_that_exist() -> anyhow::Result<()> {
    let exported = exported_metrics()?;
    ensure_exported("alerts.yaml", 10, &exported)?;

    let guide = std::fs::read_to_string(chart_dir().join("../../docs/operating.md"))?;
    let named = metric_names_in(&guide);
    let unlisted: Vec<_> = exported
        .iter()
        .filter(|name| !listed_in_guide(&guide, name))
        .collect();
    ensure!(
        unlisted.is_empty(),
        "exported but not in docs/operating.md's metric tables: {unlisted:?}"
    );
    let histograms: BTreeSet<String> = exported
        .iter()
        .filter_map(|name| name.strip_suffix("_bucket").map(str::to_owned))
        .collect();
    let not_exported: Vec<_> = named
        .iter()
        .filter(|name| !exported.contains(*name) && !histograms.contains(*name))
        .collect();
    ensure!(
        not_exported.is_empty(),
        "docs/operating.md names metrics nobody exports: {not_exported:?}"
    );
    Ok(())
}

/// Every component that serves /metrics gets a ServiceMonitor in both modes, each selecting
/// its component's one Service and naming a port that Service has: in extender mode the
/// extender and the device plugin; in DRA mode the extender that ranks (the DRA plugin serves
/// no /metrics: dra-plugin's `other_paths_are_not_found`). In DRA mode the PrometheusRule holds
/// files/alerts-dra.yaml, which passes promtool and its unit tests and uses only exported
/// metrics. DRA mode without the ranking has nothing to scrape or alert on, and says so
/// rather than rendering nothing.
#[test]
fn both_modes_monitor_every_component_that_serves_metrics() -> anyhow::Result<()> {
    let monitoring = [
        "--api-versions",
        "monitoring.coreos.com/v1",
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "monitoring.prometheusRule.enabled=true",
    ];
    let extender_mode = render("gpushare", "kube-system", &monitoring)?;
    ensure!(
        monitored(&extender_mode)? == ["gpushare-device-plugin", "gpushare-extender"],
        "extender mode"
    );

    let dra = render_dra(&monitoring)?;
    check_all_typed(dra.of_kind("ServiceMonitor"))?;
    ensure!(monitored(&dra)? == ["gpushare-extender"], "DRA mode");
    check_alerts(&dra, "alerts-dra.yaml", "alerts-dra.test.yaml")?;
    ensure_exported("alerts-dra.yaml", 1, &exported_metrics()?)?;

    for key in [
        "metrics.serviceMonitor.enabled",
        "monitoring.prometheusRule.enabled",
    ] {
        let set = format!("{key}=true");
        let err = render_dra(&[
            "--api-versions",
            "monitoring.coreos.com/v1",
            "--set",
            "dra.scheduler.ranking=false",
            "--set",
            &set,
        ])
        .err()
        .with_context(|| format!("DRA mode without ranking rendered {key}"))?
        .to_string();
        ensure!(
            err.contains(&format!("{key}: nothing to")) && err.contains("dra.scheduler.ranking"),
            "{key}: {err}"
        );
    }
    Ok(())
}

/// The names of the rendered ServiceMonitors, sorted, each checked to select exactly one
/// rendered Service of the namespaces it watches, by labels, and to scrape `/metrics` on a
/// port that Service names.
fn monitored(rendered: &Rendered) -> anyhow::Result<Vec<String>> {
    let mut names = Vec::new();
    for monitor in rendered.of_kind("ServiceMonitor") {
        let name = monitor["metadata"]["name"].as_str().context("unnamed")?;
        let labels = monitor["spec"]["selector"]["matchLabels"]
            .as_object()
            .with_context(|| format!("{name}: no matchLabels"))?;
        let namespaces = monitor["spec"]["namespaceSelector"]["matchNames"]
            .as_array()
            .with_context(|| format!("{name}: no namespaces"))?;
        let services: Vec<&Value> = rendered
            .of_kind("Service")
            .into_iter()
            .filter(|s| {
                namespaces.contains(&s["metadata"]["namespace"])
                    && labels
                        .iter()
                        .all(|(key, value)| s["metadata"]["labels"][key] == *value)
            })
            .collect();
        ensure!(
            services.len() == 1,
            "{name} selects {} Services",
            services.len()
        );
        let endpoint = &monitor["spec"]["endpoints"][0];
        ensure!(endpoint["path"] == "/metrics", "{name}: {endpoint}");
        ensure!(
            services[0]["spec"]["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|port| port["name"] == endpoint["port"]),
            "{name}: Service {} has no port {}",
            services[0]["metadata"]["name"],
            endpoint["port"]
        );
        names.push(name.to_owned());
    }
    names.sort();
    Ok(names)
}

/// Grafana's own variables the dashboard may refer to, with a value Grafana could give each
/// (`None`: not one to use in a query).
const GRAFANA_BUILTINS: [(&str, Option<&str>); 4] = [
    ("__rate_interval", Some("2m")),
    ("__interval", Some("30s")),
    ("__range", Some("6h")),
    ("__all", None),
];

/// files/dashboard.json, parsed.
fn dashboard() -> anyhow::Result<Value> {
    let path = chart_dir().join("files/dashboard.json");
    serde_json::from_str(&std::fs::read_to_string(&path)?)
        .with_context(|| format!("{} is no JSON", path.display()))
}

/// The dashboard's panels and rows, with the panels inside collapsed rows.
fn dashboard_panels(dashboard: &Value) -> Vec<&Value> {
    let mut panels = Vec::new();
    for panel in dashboard["panels"].as_array().into_iter().flatten() {
        panels.push(panel);
        panels.extend(panel["panels"].as_array().into_iter().flatten());
    }
    panels
}

/// The dashboard's variables, by name.
fn dashboard_variables(dashboard: &Value) -> BTreeMap<&str, &Value> {
    dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|variable| Some((variable["name"].as_str()?, variable)))
        .collect()
}

/// Every PromQL expression of the dashboard, named: each panel target's `expr`, and the
/// series selector of each query variable, which must be `label_values(selector, label)`.
fn dashboard_queries(dashboard: &Value) -> anyhow::Result<Vec<(String, String)>> {
    let mut queries = Vec::new();
    for panel in dashboard_panels(dashboard) {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"]
                .as_str()
                .with_context(|| format!("panel {}: a target without expr", panel["title"]))?;
            let ref_id = target["refId"].as_str().unwrap_or("?");
            queries.push((format!("panel_{}_{ref_id}", panel["id"]), expr.to_owned()));
        }
    }
    for (name, variable) in dashboard_variables(dashboard) {
        if variable["type"] != "query" {
            continue;
        }
        let query = variable["query"]["query"]
            .as_str()
            .or(variable["query"].as_str())
            .with_context(|| format!("variable {name} has no query"))?;
        let selector = query
            .trim()
            .strip_prefix("label_values(")
            .and_then(|args| args.strip_suffix(')'))
            .and_then(|args| args.rsplit_once(','))
            .map(|(selector, _label)| selector.trim())
            .with_context(|| {
                format!("variable {name}: {query} is no label_values(selector, label)")
            })?;
        queries.push((format!("variable_{name}"), selector.to_owned()));
    }
    Ok(queries)
}

/// A Grafana variable reference at the start of `text` (just after a `$`): `name`,
/// `{name}` or `{name:format}`; the name and the length of the reference after the `$`.
fn variable_reference(text: &str) -> Option<(&str, usize)> {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let (name, len) = match text.strip_prefix('{') {
        Some(braced) => {
            let end = braced.find('}')?;
            (braced[..end].split(':').next()?, end + 2)
        }
        None => {
            let end = text.find(|c: char| !is_name(c)).unwrap_or(text.len());
            (&text[..end], end)
        }
    };
    // `$1` and the like are no variables (label_replace's groups).
    (!name.is_empty() && !name.starts_with(|c: char| c.is_ascii_digit())).then_some((name, len))
}

/// Every string anywhere in `value`.
fn strings_in<'v>(value: &'v Value, out: &mut Vec<&'v str>) {
    match value {
        Value::String(text) => out.push(text),
        Value::Array(items) => items.iter().for_each(|item| strings_in(item, out)),
        Value::Object(map) => map.values().for_each(|item| strings_in(item, out)),
        _ => {}
    }
}

/// `expr` with the dashboard's variables replaced by what Grafana could put there: a query
/// variable's value for "All" (a regex), a duration for the built-in intervals. Fails on a
/// reference to anything else.
fn with_legal_values(expr: &str, variables: &BTreeMap<&str, &Value>) -> anyhow::Result<String> {
    let mut out = String::new();
    let mut rest = expr;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let Some((name, len)) = variable_reference(after) else {
            out.push('$');
            rest = after;
            continue;
        };
        let builtin = GRAFANA_BUILTINS
            .iter()
            .find(|(builtin, _)| *builtin == name)
            .and_then(|(_, value)| *value);
        let value = match (builtin, variables.get(name)) {
            (Some(value), _) => value,
            (None, Some(variable)) if variable["type"] == "query" => {
                variable["allValue"].as_str().unwrap_or(".*")
            }
            _ => bail!("{expr}: ${name} is no query variable of the dashboard"),
        };
        out.push_str(value);
        rest = &after[len..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Whether docs/operating.md's metric tables list `name`: in a row of its own, or for a
/// histogram's `_bucket`, `_sum` and `_count`, in the histogram's row.
fn listed_in_guide(guide: &str, name: &str) -> bool {
    guide.contains(&format!("| `{name}` |"))
        || ["_bucket", "_sum", "_count"]
            .iter()
            .filter_map(|suffix| name.strip_suffix(suffix))
            .any(|histogram| guide.contains(&format!("| `{histogram}` | histogram |")))
}

/// With `monitoring.dashboards.enabled` the chart renders files/dashboard.json, as it is, in a
/// ConfigMap carrying the label (and value) Grafana's sidecar loads and the annotations given;
/// without it, none.
#[test]
fn the_dashboard_renders_for_grafanas_sidecar() -> anyhow::Result<()> {
    let source = dashboard()?;
    let name = "prod-gpushare-dashboard";
    ensure!(
        render("prod", "gpu-system", &[])?
            .object("ConfigMap", name)
            .is_err(),
        "a dashboard without monitoring.dashboards.enabled"
    );
    let sidecar_defaults = vec!["--set", "monitoring.dashboards.enabled=true"];
    let mut sidecar_settings = sidecar_defaults.clone();
    sidecar_settings.extend([
        "--set",
        "monitoring.dashboards.label=gpu_dashboards",
        "--set-string",
        "monitoring.dashboards.labelValue=yes",
        "--set-string",
        "monitoring.dashboards.annotations.grafana_folder=GPU",
    ]);
    for (extra, label, value, annotations) in [
        (sidecar_defaults, "grafana_dashboard", "1", Value::Null),
        (
            sidecar_settings,
            "gpu_dashboards",
            "yes",
            serde_json::json!({ "grafana_folder": "GPU" }),
        ),
    ] {
        let rendered = render("prod", "gpu-system", &extra)?;
        let config_map = rendered.object("ConfigMap", name)?;
        check_all_typed([config_map])?;
        let metadata = &config_map["metadata"];
        ensure!(metadata["namespace"] == "gpu-system", "{metadata}");
        ensure!(metadata["labels"][label] == value, "{metadata}");
        ensure!(metadata["annotations"] == annotations, "{metadata}");
        let data = config_map["data"]["gpushare.json"]
            .as_str()
            .context("no gpushare.json in the ConfigMap")?;
        let rendered_dashboard: Value =
            serde_json::from_str(data).context("the ConfigMap's dashboard is no JSON")?;
        ensure!(
            rendered_dashboard == source,
            "the ConfigMap's dashboard differs from files/dashboard.json"
        );
    }
    Ok(())
}

/// Every panel of the dashboard queries Prometheus through the `datasource` variable, with at
/// least one expression; the variables operators filter by (node, namespace, GPU model) are
/// `label_values` queries through that data source; every variable referred to anywhere in
/// the dashboard is one it defines or one of Grafana's; it has the four rows.
#[test]
fn every_dashboard_panel_has_queries_and_every_reference_resolves() -> anyhow::Result<()> {
    let dashboard = dashboard()?;
    ensure!(
        dashboard["schemaVersion"].as_u64().is_some_and(|v| v >= 36),
        "schemaVersion {}",
        dashboard["schemaVersion"]
    );
    let variables = dashboard_variables(&dashboard);
    let datasource = variables
        .get("datasource")
        .context("no datasource variable")?;
    ensure!(
        datasource["type"] == "datasource" && datasource["query"] == "prometheus",
        "{datasource}"
    );
    let through_variable = serde_json::json!({ "type": "prometheus", "uid": "${datasource}" });
    for name in ["node", "namespace", "model"] {
        let variable = variables
            .get(name)
            .with_context(|| format!("no variable {name}"))?;
        ensure!(
            variable["type"] == "query" && variable["datasource"] == through_variable,
            "{name}: {variable}"
        );
    }
    // Checks that each query variable is a label_values query.
    dashboard_queries(&dashboard)?;

    let mut ids = BTreeSet::new();
    let mut rows = Vec::new();
    for panel in dashboard_panels(&dashboard) {
        let title = panel["title"].as_str().unwrap_or_default();
        ensure!(!title.is_empty(), "panel {} has no title", panel["id"]);
        let id = panel["id"]
            .as_u64()
            .with_context(|| format!("{title}: no id"))?;
        ensure!(ids.insert(id), "panel id {id} twice");
        let grid = &panel["gridPos"];
        let (x, w) = (grid["x"].as_u64(), grid["w"].as_u64());
        ensure!(
            x.zip(w).is_some_and(|(x, w)| w > 0 && x + w <= 24) && grid["h"].as_u64() > Some(0),
            "{title}: gridPos {grid}"
        );
        if panel["type"] == "row" {
            rows.push(title);
            continue;
        }
        ensure!(
            panel["datasource"] == through_variable,
            "{title}: datasource {}",
            panel["datasource"]
        );
        let targets = panel["targets"]
            .as_array()
            .filter(|targets| !targets.is_empty())
            .with_context(|| format!("{title}: no targets"))?;
        let mut ref_ids = BTreeSet::new();
        for target in targets {
            ensure!(
                target["expr"]
                    .as_str()
                    .is_some_and(|e| !e.trim().is_empty()),
                "{title}: a target without expr: {target}"
            );
            ensure!(
                ref_ids.insert(target["refId"].as_str().unwrap_or_default()),
                "{title}: refId {} twice, or none",
                target["refId"]
            );
            ensure!(
                target["datasource"].is_null() || target["datasource"] == through_variable,
                "{title}: target datasource {}",
                target["datasource"]
            );
        }
    }
    for row in [
        "Cluster",
        "Nodes and GPUs",
        "Namespaces and pods",
        "Control plane",
    ] {
        ensure!(
            rows.iter().any(|title| title.starts_with(row)),
            "no row {row}: {rows:?}"
        );
    }

    let mut strings = Vec::new();
    strings_in(&dashboard, &mut strings);
    let mut unresolved = BTreeSet::new();
    for text in strings {
        for (at, _) in text.match_indices('$') {
            if let Some((name, _)) = variable_reference(&text[at + 1..])
                && !variables.contains_key(name)
                && !GRAFANA_BUILTINS.iter().any(|(builtin, _)| *builtin == name)
            {
                unresolved.insert(name.to_owned());
            }
        }
        ensure!(
            !text.contains("[["),
            "deprecated [[variable]] syntax: {text}"
        );
    }
    ensure!(
        unresolved.is_empty(),
        "references to variables the dashboard does not define: {unresolved:?}"
    );
    Ok(())
}

/// Every expression of the dashboard (panel targets and the variables' series selectors), its
/// variables given values Grafana could give them, parses as PromQL: written as recording
/// rules, they pass `promtool check rules` (which does refuse a broken expression, as the
/// first check shows).
#[test]
fn every_dashboard_expression_parses_as_promql() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let check = |name: &str, rules: &[Value]| -> anyhow::Result<String> {
        let file = dir.path().join(name);
        std::fs::write(
            &file,
            serde_yaml::to_string(
                &serde_json::json!({ "groups": [{ "name": "dashboard", "rules": rules }] }),
            )?,
        )?;
        promtool(&["check".as_ref(), "rules".as_ref(), file.as_os_str()])
    };
    let broken = [
        serde_json::json!({ "record": "dashboard:broken", "expr": "sum(gpushare_extender_leader" }),
    ];
    ensure!(
        check("broken.yaml", &broken).is_err(),
        "promtool passed a broken expression"
    );

    let dashboard = dashboard()?;
    let variables = dashboard_variables(&dashboard);
    let rules = dashboard_queries(&dashboard)?
        .into_iter()
        .map(|(name, expr)| {
            Ok(serde_json::json!({
                "record": format!("dashboard:{name}"),
                "expr": with_legal_values(&expr, &variables)?,
            }))
        })
        .collect::<anyhow::Result<Vec<Value>>>()?;
    ensure!(!rules.is_empty(), "the dashboard has no expression");
    let checked = check("dashboard.yaml", &rules)?;
    ensure!(
        checked.contains(&format!("SUCCESS: {} rules found", rules.len())),
        "{checked}"
    );
    Ok(())
}

/// Every expression of the dashboard names a gpushare metric, and each it names is one
/// docs/operating.md's tables list.
#[test]
fn the_dashboard_names_only_metrics_the_operating_guide_lists() -> anyhow::Result<()> {
    let guide = std::fs::read_to_string(chart_dir().join("../../docs/operating.md"))?;
    let mut used = BTreeSet::new();
    for (name, expr) in dashboard_queries(&dashboard()?)? {
        let names = metric_names_in(&expr);
        ensure!(!names.is_empty(), "{name} names no gpushare metric: {expr}");
        used.extend(names);
    }
    let unlisted: Vec<_> = used
        .iter()
        .filter(|name| !listed_in_guide(&guide, name))
        .collect();
    ensure!(
        unlisted.is_empty(),
        "the dashboard uses metrics docs/operating.md does not list: {unlisted:?}"
    );
    Ok(())
}
