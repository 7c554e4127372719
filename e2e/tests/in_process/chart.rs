//! The Helm chart, checked with the real helm: it lints; it renders with default and other
//! values; every object parses into its Kubernetes type without losing a field (a typo the API
//! server would silently drop); the scheduler configuration points at the extender; and RBAC
//! grants each ServiceAccount exactly the calls its real binary makes in the in-process cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use futures::TryFutureExt as _;
use gpushare_e2e::apiserver::{ADMIN_USER, ApiServer, Call, Stats, Verb};
use gpushare_e2e::cluster::{
    ClusterSpec, DEVICE_PLUGIN_USER, EXTENDER_USER, Process, RELEASE, RELEASE_NAMESPACE,
    TestCluster, binaries, dedicated_scheduler_configuration, wait_for,
};
use gpushare_e2e::fixtures::pod;
use gpushare_e2e::scenarios::{create_gpu_pod, delete_pod, wait_bound, wait_running};
use gpushare_e2e::scheduler::SchedulerConfig;
use gpushare_e2e::scheduler::framework::{FitScoring, FitStrategy, num_feasible_nodes_to_find_at};
use gpushare_e2e::scheduler::wire::ExtenderBindingArgs;
use gpushare_e2e::tools;
use gpushare_proto::dra::v1::dra_plugin_client::DraPluginClient;
use gpushare_proto::dra::v1::{Claim, NodePrepareResourcesRequest};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, PodSpec, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

const KUBE_VERSION: &str = "1.36.0";

/// `ensure!` on each condition in turn; a failure names the condition and shows `$shown`.
macro_rules! ensure_each {
    ($shown:expr, $($ok:expr),+ $(,)?) => {{
        $(ensure!($ok, "`{}` does not hold: {}", stringify!($ok), $shown);)+
    }};
}

fn chart_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../charts/gpushare")
        .canonicalize()
        .unwrap()
}

/// The text of the chart's file `path` (relative to the chart).
fn chart_file(path: &str) -> anyhow::Result<String> {
    let path = chart_dir().join(path);
    std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
}

/// Runs `tool` (helm, promtool: installed by scripts/install-tools.sh; one that cannot be
/// installed fails the test, it is never skipped) with `args`.
fn run<S: AsRef<OsStr>>(tool: &Path, args: &[S]) -> anyhow::Result<Output> {
    let output = Command::new(tool).args(args).output();
    output.with_context(|| format!("running {}", tool.display()))
}

/// Runs `tool` with `args`, which must succeed; what it printed, stdout then stderr.
fn run_ok(tool: &Path, args: &[&OsStr]) -> anyhow::Result<String> {
    let output = run(tool, args)?;
    let status = output.status;
    let text = String::from_utf8_lossy(&[output.stdout, output.stderr].concat()).into_owned();
    let tool = tool.display();
    ensure!(status.success(), "{tool} {args:?}: {status}\n{text}");
    Ok(text)
}

/// `helm template` of the chart as `release` for Kubernetes `kube`, with `extra` arguments, as
/// it printed it.
fn helm_template(release: &str, kube: &str, extra: &[&str]) -> anyhow::Result<String> {
    let chart = chart_dir();
    let args = ["template", release, chart.to_str().context("chart path")?];
    let args = [&args[..], &["--kube-version", kube], extra].concat();
    let output = run(&tools::helm()?, &args)?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(output.status.success(), "helm template failed: {stderr}");
    Ok(String::from_utf8(output.stdout)?)
}

/// `helm template` as `release` in `namespace` with `extra` arguments, as it printed it.
fn render_text(release: &str, namespace: &str, extra: &[&str]) -> anyhow::Result<String> {
    let args = [&["--namespace", namespace][..], extra].concat();
    helm_template(release, KUBE_VERSION, &args)
}

/// `helm template` with `extra` arguments; the documents as JSON.
fn render(release: &str, namespace: &str, extra: &[&str]) -> anyhow::Result<Rendered> {
    let text = render_text(release, namespace, extra)?;
    let docs = serde_yaml::Deserializer::from_str(&text).map(Value::deserialize);
    let docs = docs.filter(|doc| !matches!(doc, Ok(Value::Null)));
    let docs = docs.collect::<Result<_, _>>()?;
    let namespace = namespace.to_owned();
    Ok(Rendered { namespace, docs })
}

/// The chart as release gpushare in kube-system, with `extra` arguments.
fn render_args(extra: &[&str]) -> anyhow::Result<Rendered> {
    render(RELEASE, RELEASE_NAMESPACE, extra)
}

/// The chart as release gpushare in kube-system, with each of `sets` a `--set`.
fn render_sets(sets: &[&str]) -> anyhow::Result<Rendered> {
    let args: Vec<&str> = sets.iter().flat_map(|set| ["--set", set]).collect();
    render_args(&args)
}

/// The chart rendered in DRA mode, with `extra` arguments.
fn render_dra(extra: &[&str]) -> anyhow::Result<Rendered> {
    render_args(&[&["--set=mode=dra"][..], extra].concat())
}

struct Rendered {
    namespace: String,
    docs: Vec<Value>,
}

impl Rendered {
    fn of_kind(&self, kind: &str) -> Vec<&Value> {
        self.docs.iter().filter(|d| d["kind"] == kind).collect()
    }
    /// The object of `kind` named `name`.
    fn object(&self, kind: &str, name: &str) -> anyhow::Result<&Value> {
        let mut docs = self.docs.iter();
        let found = docs.find(|d| d["kind"] == kind && d["metadata"]["name"] == name);
        found.with_context(|| format!("no {kind} named {name} rendered"))
    }
    /// The object of `kind` named `name`, parsed into `T` (already checked for lost fields).
    fn get<T: DeserializeOwned>(&self, kind: &str, name: &str) -> anyhow::Result<T> {
        Ok(serde_json::from_value(self.object(kind, name)?.clone())?)
    }
    /// The pod spec of the workload (Deployment, DaemonSet, Job) of `kind` named `name`,
    /// checked to parse as one.
    fn pod_spec(&self, kind: &str, name: &str) -> anyhow::Result<&Value> {
        let spec = &self.object(kind, name)?["spec"]["template"]["spec"];
        let typed = serde_json::from_value::<PodSpec>(spec.clone());
        typed.with_context(|| format!("{kind} {name}: no pod spec"))?;
        Ok(spec)
    }
    /// `pod_spec`, which runs as its own ServiceAccount (named as the workload), every
    /// container locked down with resources set.
    fn hardened_pod_spec(&self, kind: &str, name: &str) -> anyhow::Result<&Value> {
        let spec = self.pod_spec(kind, name)?;
        let account = &spec["serviceAccountName"];
        ensure!(*account == name, "{kind} {name} runs as {account}");
        let locked = json!({"readOnlyRootFilesystem": true, "allowPrivilegeEscalation": false,
            "capabilities": {"drop": ["ALL"]}});
        for c in spec["containers"].as_array().into_iter().flatten() {
            let (sc, resources) = (&c["securityContext"], &c["resources"]);
            let what = format!("{name} container {}", c["name"]);
            ensure_matches(sc, &locked).with_context(|| format!("{what}: securityContext"))?;
            let set = resources["requests"].is_object() && resources["limits"].is_object();
            ensure_each!(what, sc["privileged"] != true, set);
        }
        Ok(spec)
    }
    fn kinds(&self) -> BTreeMap<String, usize> {
        let mut kinds = BTreeMap::new();
        for doc in &self.docs {
            let kind = doc["kind"].as_str().unwrap_or("?");
            *kinds.entry(kind.to_owned()).or_default() += 1;
        }
        kinds
    }
}

/// Counts of objects by kind, written `Kind=n Kind=n ...`, summed over `parts`.
fn counts(parts: &[&str]) -> BTreeMap<String, usize> {
    let mut kinds = BTreeMap::new();
    for entry in parts.iter().flat_map(|part| part.split_whitespace()) {
        let (kind, n) = entry.split_once('=').expect("Kind=n");
        *kinds.entry(kind.to_owned()).or_default() += n.parse::<usize>().expect("a count");
    }
    kinds
}

/// Parses `doc` as `T`, serializes it back and fails on every key the typed value lost.
fn round_trip<T: DeserializeOwned + serde::Serialize>(doc: &Value) -> anyhow::Result<()> {
    let (kind, name) = (&doc["kind"], &doc["metadata"]["name"]);
    let typed: T = serde_json::from_value(doc.clone())
        .with_context(|| format!("{kind} {name} does not parse"))?;
    let mut lost = Vec::new();
    lost_keys(doc, &serde_json::to_value(&typed)?, "", &mut lost);
    ensure!(lost.is_empty(), "{kind} {name}: unknown fields {lost:?}");
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

/// `round_trip_kind(kind, doc)`: `round_trip` as the k8s-openapi type named `kind`, if one of
/// these (Pod: `helm test`'s, templates/tests/check-install.yaml).
macro_rules! typed_kinds {
    ($($type:ident)+) => {
        fn round_trip_kind(kind: &str, doc: &Value) -> Option<anyhow::Result<()>> {
            match kind {
                $(stringify!($type) => Some(round_trip::<$type>(doc)),)+
                _ => None,
            }
        }
    };
}
typed_kinds!(Deployment DaemonSet Service ServiceAccount Secret NetworkPolicy ClusterRole
    ClusterRoleBinding Role RoleBinding PodDisruptionBudget ConfigMap Job Pod
    MutatingWebhookConfiguration ValidatingAdmissionPolicy ValidatingAdmissionPolicyBinding);

/// Every document parses into its type by kind without losing a field, and carries the
/// standard labels.
fn check_all_typed<'a>(docs: impl IntoIterator<Item = &'a Value>) -> anyhow::Result<()> {
    for doc in docs {
        let kind = doc["kind"].as_str().context("document without kind")?;
        let monitoring = doc["apiVersion"] == "monitoring.coreos.com/v1";
        match (round_trip_kind(kind, doc), kind) {
            (Some(typed), _) => typed?,
            (None, "ServiceMonitor") => ensure_each!(
                doc,
                monitoring,
                doc["spec"]["selector"]["matchLabels"].is_object(),
                doc["spec"]["endpoints"][0]["port"].is_string(),
            ),
            // Its rules are checked by promtool (`the_alerts_pass_promtool_and_their_unit_tests`).
            (None, "PrometheusRule") => {
                ensure_each!(doc, monitoring, doc["spec"]["groups"].is_array())
            }
            (None, other) => bail!("unexpected kind {other} rendered"),
        }
        let (labels, name) = (&doc["metadata"]["labels"], &doc["metadata"]["name"]);
        let keys = "name instance version component managed-by".split(' ');
        let keys = keys.map(|key| format!("app.kubernetes.io/{key}"));
        for key in keys.chain(["helm.sh/chart".to_owned()]) {
            ensure!(labels[&key].is_string(), "{kind} {name} lacks label {key}");
        }
    }
    Ok(())
}

/// The item of the array `list` named `name`, or `null`.
fn named<'v>(list: &'v Value, name: &str) -> &'v Value {
    let mut items = list.as_array().into_iter().flatten();
    let found = items.find(|item| item["name"] == name);
    found.unwrap_or(&Value::Null)
}

/// Container `name` of the pod spec `spec`.
fn container<'s>(spec: &'s Value, name: &str) -> anyhow::Result<&'s Value> {
    let c = named(&spec["containers"], name);
    ensure!(c.is_object(), "no container {name}");
    Ok(c)
}

/// The strings of the array `list` (a container's `args`, `command`); none if it is none.
fn strings(list: &Value) -> Vec<String> {
    serde_json::from_value(list.clone()).unwrap_or_default()
}

/// The args of the extender of release gpushare.
fn extender_args(rendered: &Rendered) -> anyhow::Result<Vec<String>> {
    let spec = rendered.pod_spec("Deployment", "gpushare-extender")?;
    Ok(strings(&container(spec, "extender")?["args"]))
}

/// The words of `line`, as a command line without quoting splits them.
fn words(line: &str) -> Vec<&str> {
    line.split_whitespace().collect()
}

/// Fails naming the first of `want` missing from `args`.
fn ensure_has(args: &[String], want: &[&str]) -> anyhow::Result<()> {
    if let Some(missing) = want.iter().find(|w| !args.iter().any(|a| a == *w)) {
        bail!("args {args:?} lack {missing}");
    }
    Ok(())
}

/// Fails naming the first of `args` that starts with one of `prefixes`.
fn ensure_lacks(args: &[String], prefixes: &[&str]) -> anyhow::Result<()> {
    let has = |arg: &&String| prefixes.iter().any(|p| arg.starts_with(p));
    if let Some(found) = args.iter().find(has) {
        bail!("args {args:?} have {found}");
    }
    Ok(())
}

/// The in-process scheduler's reading of a rendered KubeSchedulerConfiguration.
fn driver(text: &str) -> anyhow::Result<SchedulerConfig> {
    SchedulerConfig::from_kube_scheduler_configuration(text, SchedulerConfig::default())
}

/// The error `rendered` failed with, which names one of `why`; fails if `what` rendered or
/// the error names none.
fn refusal<T>(rendered: anyhow::Result<T>, what: &str, why: &[&str]) -> anyhow::Result<String> {
    let Err(err) = rendered else {
        bail!("{what} rendered");
    };
    let err = format!("{err:#}");
    ensure!(why.iter().any(|why| err.contains(why)), "{what}: {err}");
    Ok(err)
}

/// Fails naming every path where `actual` differs from `want`, which names only the keys it
/// checks (`null`: absent); an array must have as many items as `want`'s.
fn ensure_matches(actual: &Value, want: &Value) -> anyhow::Result<()> {
    fn differ(actual: &Value, want: &Value, path: &str, out: &mut Vec<String>) {
        let len = |v: &Value| v.as_array().map(Vec::len);
        match want {
            Value::Object(want) => {
                for (key, want) in want {
                    differ(&actual[key], want, &format!("{path}.{key}"), out);
                }
            }
            Value::Array(items) if len(actual) == Some(items.len()) => {
                for (i, want) in items.iter().enumerate() {
                    differ(&actual[i], want, &format!("{path}[{i}]"), out);
                }
            }
            _ if actual != want => out.push(format!("{path} is {actual}, not {want}")),
            _ => {}
        }
    }
    let mut differences = Vec::new();
    differ(actual, want, "", &mut differences);
    ensure!(differences.is_empty(), "{}", differences.join("; "));
    Ok(())
}

// ---------------------------------------------------------------------------------------
// RBAC, the shape: each component's ClusterRole bound to its own ServiceAccount (what the
// roles grant: `rbac_grants_exactly_what_each_binary_calls`).

fn check_rbac_bindings(rendered: &Rendered, prefix: &str) -> anyhow::Result<()> {
    let namespace = Some(rendered.namespace.as_str());
    let extender = format!("{prefix}-extender");
    // Its one namespaced Role: leader election on its own Lease (get/update by name; create
    // cannot be narrowed by name), bound to its ServiceAccount in the release namespace.
    let lease_role: Role = rendered.get("Role", &extender)?;
    ensure!(lease_role.metadata.namespace.as_deref() == namespace);
    let its_lease = std::slice::from_ref(&extender);
    for rule in lease_role.rules.iter().flatten() {
        let leases = rule.resources.as_deref() == Some(&["leases".to_owned()]);
        let named = rule.verbs == ["create"] || rule.resource_names.as_deref() == Some(its_lease);
        ensure!(leases && named, "not restricted to its Lease: {rule:?}");
    }
    let lease_binding: RoleBinding = rendered.get("RoleBinding", &extender)?;
    ensure!(lease_binding.role_ref.name == extender);
    // The webhook rule only on our configuration.
    let rules = &rendered.object("ClusterRole", &extender)?["rules"];
    for rule in rules.as_array().into_iter().flatten() {
        let other = rule["apiGroups"] != json!(["admissionregistration.k8s.io"]);
        let named = other || rule["resourceNames"] == json!([format!("{prefix}-webhook")]);
        ensure!(named, "not restricted by resourceNames: {rule}");
    }
    // Each ClusterRole is bound to its component's ServiceAccount, in the release namespace.
    for name in [&extender, &format!("{prefix}-device-plugin")] {
        let _: ClusterRole = rendered.get("ClusterRole", name)?;
        let _: ServiceAccount = rendered.get("ServiceAccount", name)?;
        let binding = rendered.object("ClusterRoleBinding", name)?;
        let subject = json!({"name": name, "namespace": rendered.namespace});
        let want = json!({"roleRef": {"name": name}, "subjects": [subject]});
        ensure_matches(binding, &want).with_context(|| binding.to_string())?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// RBAC from facts: each ServiceAccount's grants against the calls its binary made.

/// What an RBAC rule grants and what a request needs, as `verb group/resource` (the core
/// group is `core`).
fn grant(group: &str, resource: &str, verb: &str) -> String {
    let group = if group.is_empty() { "core" } else { group };
    format!("{verb} {group}/{resource}")
}

/// The grant `call` needs.
fn needs(call: &Call) -> String {
    grant(&call.group, &call.resource, call.verb.rbac())
}

/// Every grant of the rules; a wildcard or a non-resource URL cannot be held against calls,
/// so it fails. `resourceNames` are not recorded in calls (only the webhook's rule has them).
fn expand(rules: &[PolicyRule]) -> anyhow::Result<BTreeSet<String>> {
    let mut grants = BTreeSet::new();
    for rule in rules {
        let urls = rule.non_resource_urls.is_none();
        ensure!(urls, "a rule grants nonResourceURLs: {rule:?}");
        let groups = rule.api_groups.clone().unwrap_or_default();
        let resources = rule.resources.clone().unwrap_or_default();
        for field in [&groups, &resources, &rule.verbs] {
            let wildcard = field.iter().any(|item| item.contains('*'));
            ensure!(!wildcard, "a rule grants a wildcard: {rule:?}");
        }
        for group in &groups {
            for resource in &resources {
                grants.extend(rule.verbs.iter().map(|verb| grant(group, resource, verb)));
            }
        }
    }
    Ok(grants)
}

/// What the rendered chart grants the ServiceAccount `namespace/name`, through every
/// RoleBinding and ClusterRoleBinding that names it.
fn granted_to(chart: &Rendered, namespace: &str, name: &str) -> anyhow::Result<BTreeSet<String>> {
    let account = json!({ "kind": "ServiceAccount", "name": name, "namespace": namespace });
    let names_it = |s: &Value| ensure_matches(s, &account).is_ok();
    let mut grants = BTreeSet::new();
    for role_kind in ["Role", "ClusterRole"] {
        let kind = format!("{role_kind}Binding");
        for binding in chart.of_kind(&kind) {
            let mut subjects = binding["subjects"].as_array().into_iter().flatten();
            if !subjects.any(names_it) {
                continue;
            }
            let (metadata, role_ref) = (&binding["metadata"], &binding["roleRef"]);
            let what = format!("{kind} {} binds {namespace}/{name}", metadata["name"]);
            let to_role = role_ref["kind"] == role_kind;
            ensure!(to_role, "{what} to a {}", role_ref["kind"]);
            let role = chart.object(role_kind, role_ref["name"].as_str().unwrap_or_default());
            let role = role.with_context(|| format!("{what} to an unrendered role"))?;
            // Calls are recorded without their namespace: a Role counts only in the account's
            // own, where the binaries make their namespaced calls (the Lease, POD_NAMESPACE).
            let spaces = [metadata, &role["metadata"]].map(|m| &m["namespace"]);
            let local = role_kind == "ClusterRole" || spaces == [namespace; 2];
            ensure!(local, "{what} outside its namespace");
            let rules: Option<Vec<PolicyRule>> = serde_json::from_value(role["rules"].clone())?;
            grants.extend(expand(rules.as_deref().unwrap_or_default())?);
        }
    }
    Ok(grants)
}

/// The ServiceAccount of the chart's workload `kind`/`name`, as the username its token
/// carries.
fn service_account_user(rendered: &Rendered, kind: &str, name: &str) -> anyhow::Result<String> {
    let account = rendered.pod_spec(kind, name)?["serviceAccountName"].as_str();
    let account = account.with_context(|| format!("{kind} {name} names no serviceAccountName"))?;
    let namespace = &rendered.namespace;
    Ok(format!("system:serviceaccount:{namespace}:{account}"))
}

/// What `rendered` (described as `render`) grants `user`'s ServiceAccount, held against its
/// `calls` (printed for the log): every call granted, every grant used; problems one a line.
fn rbac_problems(
    rendered: &Rendered,
    render: &str,
    what: &str,
    user: &str,
    calls: &BTreeMap<Call, u64>,
) -> anyhow::Result<Vec<String>> {
    let account = user.strip_prefix("system:serviceaccount:");
    let account = account.and_then(|rest| rest.split_once(':'));
    let (namespace, account) = account.with_context(|| format!("{user} is no ServiceAccount"))?;
    let granted = granted_to(rendered, namespace, account)?;
    let used: BTreeSet<String> = calls.keys().map(needs).collect();
    let context = format!("{what} ({user}), chart rendered with {render}");
    eprintln!("{context}, made:");
    for (call, n) in calls {
        eprintln!("  {}: {n}", needs(call));
    }
    let only_on_uninstall = uninstall_only_grants(what);
    let unused = granted.difference(&used);
    let unused = unused.filter(|g| !only_on_uninstall.contains(*g)).collect();
    let not_granted: Vec<&String> = used.difference(&granted).collect();
    let found = [
        ("used but not granted", not_granted),
        ("granted but unused", unused),
    ];
    let found = found.into_iter().filter(|(_, grants)| !grants.is_empty());
    let problems = found.map(|(problem, grants)| {
        let grants: Vec<&str> = grants.into_iter().map(String::as_str).collect();
        format!("{context}: {problem}: {}", grants.join(", "))
    });
    Ok(problems.collect())
}

/// Grants for a path no in-process cluster walks (it runs plugins outside any DaemonSet): a
/// node plugin watches its DaemonSet to tell `helm uninstall` from a restart; the real tier's
/// `gpu_pods_right_after_helm_install` fails without them (the plugin keeps its files).
fn uninstall_only_grants(what: &str) -> BTreeSet<String> {
    let plugin = matches!(what, "device-plugin" | "dra-plugin");
    let verbs = if plugin { &["list", "watch"][..] } else { &[] };
    let grants = verbs.iter().map(|verb| grant("apps", "daemonsets", verb));
    grants.collect()
}

/// Runs a small cluster through every path that needs a permission and returns the calls
/// its API server recorded (by username: `Stats::calls_by`).
async fn record_calls(mut spec: ClusterSpec) -> anyhow::Result<Stats> {
    // As the chart runs it: electing a leader over its Lease (get, create, then update), and
    // keeping the idle-GPU taint as its default values do (get, then patch).
    spec.extender_args.push("--leader-elect=true".to_owned());
    spec.extender_args.push("--idle-gpu-taint=true".to_owned());
    let cluster = TestCluster::start(spec).await?;
    let result = exercise(&cluster).await;
    let result = result.inspect_err(|_| eprintln!("{}", cluster.log_tail(40)));
    let stats = cluster.api.stats();
    cluster.shutdown().await;
    result.map(|()| stats)
}

/// Waits until `user` has made a call that needs `grant` (`patch core/pods/status`).
async fn wait_called(api: &ApiServer, user: &str, grant: &str) -> anyhow::Result<()> {
    let what = format!("{user} to {grant}");
    wait_for(&what, Duration::from_secs(60), || {
        let calls = api.stats().calls_by(user);
        let made = calls.keys().any(|call| needs(call) == grant);
        std::future::ready(made.then_some(()))
    })
    .await
}

/// Pods scheduled, run and deleted; a Binding that gets no clear answer (so the extender
/// reads the pod back); a bind refused twice (an Event, then its series patched); a pod
/// holding another pod's allocation (the device plugin's Event).
async fn exercise(cluster: &TestCluster) -> anyhow::Result<()> {
    const WAIT: Duration = Duration::from_secs(30);
    let api = &cluster.api;
    let bind_args = |pod_name: &str, pod_uid: String| ExtenderBindingArgs {
        pod_name: pod_name.to_owned(),
        pod_namespace: "default".to_owned(),
        pod_uid,
        node: "gpu-node-1".to_owned(),
    };
    // The node's one idle GPU: tainted, and untainted once pods hold memory there.
    let idle_gpu_taint = |wanted: bool| async move {
        let nodes = kube::Api::<k8s_openapi::api::core::v1::Node>::all(cluster.client.clone());
        let node = nodes.get("gpu-node-1").await.ok()?;
        let taints = node.spec?.taints.unwrap_or_default();
        let (key, effect) = ("gpushare.example.com/idle-gpu", "PreferNoSchedule");
        let carries = taints.iter().any(|t| t.key == key && t.effect == effect);
        (carries == wanted).then_some(())
    };
    let tainted = "the extender to taint the node with an idle GPU";
    wait_for(tainted, WAIT, || idle_gpu_taint(true)).await?;
    // Scheduled, bound, allocated and run: watches, Bindings, Events, the plugin's patches.
    create_gpu_pod(cluster, "a", 4).await?;
    create_gpu_pod(cluster, "b", 4).await?;
    let a = wait_running(cluster, "a").await?;
    wait_running(cluster, "b").await?;
    let untainted = "the extender to take the idle-GPU taint off the node";
    wait_for(untainted, WAIT, || idle_gpu_taint(false)).await?;
    // A Binding answered 500: the extender cannot tell whether it landed and reads the pod.
    // The pod is for a scheduler nobody runs, so only this test's bind call places it.
    let manual = pod("manual").gpu_mem(4).scheduler_name("manual-scheduler");
    let manual = manual.create(&cluster.client).await?;
    let args = bind_args("manual", manual.metadata.uid.clone().unwrap_or_default());
    let bindings_posted = || {
        let calls = api.stats().calls_by(EXTENDER_USER).into_iter();
        let posted = calls.filter(|(c, _)| needs(c) == "create core/pods/binding");
        posted.map(|(_, n)| n).sum::<u64>()
    };
    let before = bindings_posted();
    let faults = api.faults();
    faults.set_error_rate(Verb::Create, 1.0, 500);
    let extender = cluster.extender()?;
    // Until its watch shows the pod, the extender refuses without posting a Binding.
    let posted = wait_for("the extender to post the Binding", WAIT, || async {
        let _ = extender.bind(&args).await;
        (bindings_posted() > before).then_some(())
    });
    let read_back = posted.and_then(|()| wait_called(api, EXTENDER_USER, "get core/pods"));
    let posted = read_back.await;
    faults.set_error_rate(Verb::Create, 0.0, 500);
    posted?;
    wait_running(cluster, "manual").await?;
    // A bind refused twice (the pod is not the one asked for): an Event, then its series.
    let stale = bind_args("a", "not-the-uid-of-a".to_owned());
    ensure!(a.metadata.uid.as_deref() != Some(stale.pod_uid.as_str()));
    let first = extender.bind(&stale).await?;
    ensure!(first.is_some(), "a bind of a stale pod uid was accepted");
    wait_called(api, EXTENDER_USER, "create events.k8s.io/events").await?;
    ensure!(extender.bind(&stale).await?.is_some());
    wait_called(api, EXTENDER_USER, "patch events.k8s.io/events").await?;
    // Without the allocation policy, a pod bound straight to the node is admitted while a
    // scheduled pod of its size waits (kubelet sees it late): the device plugin reads in
    // PodResources that the intruder holds that pod's allocation, and says so in an Event.
    let kubelet = &cluster.nodes["gpu-node-1"].kubelet;
    kubelet.hold("default", "waiting");
    create_gpu_pod(cluster, "waiting", 2).await?;
    let pods = Api::namespaced(cluster.client.clone(), "default");
    wait_bound(&pods, "waiting").await?;
    let intruder = pod("intruder").gpu_mem(2).on_node("gpu-node-1");
    intruder.create(&cluster.client).await?;
    wait_called(api, DEVICE_PLUGIN_USER, "create events.k8s.io/events").await?;
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
    let condition_set = wait_called(api, DEVICE_PLUGIN_USER, "patch core/pods/status").await;
    cluster.set_unhealthy("gpu-node-1", &[])?;
    condition_set
}

/// Each ServiceAccount is granted exactly what its binary calls (recorded by the in-process
/// API server by username), with the chart rendered with the webhook (default values, run in
/// dedicated mode) and without it: a call not granted and a grant never used both fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_grants_exactly_what_each_binary_calls() -> anyhow::Result<()> {
    let node = ClusterSpec::labelled(&[("gpu-node-1", &[16][..])]);
    // Dedicated, without the allocation policy (this API server enforces none): `exercise`
    // places a pod of a scheduler nobody runs by calling bind itself, which the policy
    // refuses in dedicated mode.
    let dedicated = node.clone().dedicated();
    // Default values: the dedicated scheduler and the webhook; without the webhook.
    let no_webhook = "scheduler.mode=default-scheduler";
    let renders = [
        ("default values", render_args(&[])?, dedicated),
        (no_webhook, render_sets(&[no_webhook])?, node),
    ];
    let identities = [
        ("extender", "Deployment", EXTENDER_USER),
        ("device-plugin", "DaemonSet", DEVICE_PLUGIN_USER),
    ];
    let mut problems = Vec::new();
    for (render, rendered, spec) in renders {
        // The harness runs each binary as the ServiceAccount the chart gives it.
        for (what, kind, user) in identities {
            let chart_user = service_account_user(&rendered, kind, &format!("{RELEASE}-{what}"))?;
            let same = chart_user == user;
            ensure!(same, "{what} runs as {chart_user}, not {user}");
        }
        let stats = record_calls(spec).await?;
        let users: BTreeSet<String> = stats.calls().into_keys().map(|call| call.user).collect();
        for user in &users {
            if user != ADMIN_USER && !identities.iter().any(|(_, _, u)| u == user) {
                problems.push(format!("calls from an unexpected identity {user}"));
            }
        }
        for (what, _, user) in identities {
            let calls = stats.calls_by(user);
            problems.extend(rbac_problems(&rendered, render, what, user, &calls)?);
        }
    }
    let problems = problems.join("\n");
    ensure!(problems.is_empty(), "RBAC differs:\n{problems}");
    Ok(())
}

/// DRA mode: the DRA plugin is granted exactly what the real plugin calls as it publishes and
/// watches its slice, re-publishes it when a GPU turns unhealthy, and prepares a claim (called
/// as kubelet would); its DaemonSet watch is in `uninstall_only_grants`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_grants_the_dra_plugin_exactly_what_it_calls() -> anyhow::Result<()> {
    let rendered = render_dra(&[])?;
    let user = service_account_user(&rendered, "DaemonSet", &format!("{RELEASE}-dra-plugin"))?;
    let api = ApiServer::start().await?;
    let dir = tempfile::tempdir()?;
    let path = |name: &str| dir.path().join(name);
    let (kubeconfig, log) = (path("kubeconfig"), path("dra-plugin.log"));
    api.write_kubeconfig_as(&kubeconfig, &user)?;
    let plain = "--node-name=gpu-node-1 --gpu-backend=simulated --simulate-gpus=16,16 \
                 --probe-addr=127.0.0.1:0";
    let mut args: Vec<String> = words(plain).into_iter().map(str::to_owned).collect();
    let in_dir = "simulate-health-file=unhealthy-gpus plugin-dir=plugin registry-dir=registry \
                  cdi-dir=cdi";
    for (flag, name) in words(in_dir).iter().filter_map(|w| w.split_once('=')) {
        args.push(format!("--{flag}={}", path(name).display()));
    }
    let binary = &binaries()?.dra_plugin;
    let plugin = Process::spawn("gpushare-dra-plugin", binary, &args, &kubeconfig, &log)?;
    let exercised = exercise_dra_plugin(&api, &user, dir.path()).await;
    plugin.stop().await;
    exercised.with_context(|| format!("see {}", log.display()))?;
    let calls = api.stats().calls_by(&user);
    let problems = rbac_problems(&rendered, "mode=dra", "dra-plugin", &user, &calls)?;
    let problems = problems.join("\n");
    ensure!(problems.is_empty(), "RBAC differs:\n{problems}");
    Ok(())
}

/// Drives the DRA plugin started in `dir`: its slice and watch, GPU 0's taint once unhealthy,
/// then a claim of 4 GiB of GPU 1 (allocated by hand, as kube-scheduler would) prepared.
async fn exercise_dra_plugin(api: &ApiServer, user: &str, dir: &Path) -> anyhow::Result<()> {
    let wait = Duration::from_secs(60);
    let slices = &Api::<ResourceSlice>::all(api.client());
    let tainted = |taints: bool| async move {
        let items = slices.list(&ListParams::default()).await.ok()?.items;
        let mut devices = items.iter().flat_map(|s| s.spec.devices.iter().flatten());
        let has = devices.any(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty()));
        (!items.is_empty() && has == taints).then_some(())
    };
    wait_for("the plugin's slice", wait, || tainted(false)).await?;
    wait_called(api, user, "watch resource.k8s.io/resourceslices").await?;
    std::fs::write(dir.join("unhealthy-gpus"), "0")?;
    wait_for("GPU 0's taint in the slice", wait, || tainted(true)).await?;
    let claims = Api::<ResourceClaim>::namespaced(api.client(), "default");
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "gpu-4g", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu-mem"}}]}}
    }))?;
    let claim = claims.create(&PostParams::default(), &claim).await?;
    let allocation = json!({"status": {"allocation": {"devices": {"results": [{
        "request": "gpu", "driver": gpushare_contract::DEFAULT_DOMAIN, "pool": "gpu-node-1",
        "device": "gpu-1", "consumedCapacity": {"memory": "4Gi"}}]}}}});
    let (params, allocation) = (PatchParams::default(), Patch::Merge(allocation));
    claims.patch_status("gpu-4g", &params, &allocation).await?;
    let uid = claim.metadata.uid.context("a claim without a UID")?;
    let socket = dir.join("plugin").join(gpushare_dra_plugin::DRA_SOCKET);
    let mut plugin = DraPluginClient::new(gpushare_proto::connect_unix(&socket).await?);
    let claims = vec![Claim {
        namespace: "default".to_owned(),
        uid: uid.clone(),
        name: "gpu-4g".to_owned(),
    }];
    let request = NodePrepareResourcesRequest { claims };
    let mut answer = plugin.node_prepare_resources(request).await?.into_inner();
    let prepared = answer.claims.remove(&uid);
    let error = prepared.context("no answer for the claim")?.error;
    ensure!(error.is_empty(), "prepare failed: {error}");
    Ok(())
}

/// The check itself: a call the chart does not grant and a grant nobody used are both
/// named, for the identity and the render.
#[test]
fn rbac_check_names_calls_not_granted_and_grants_not_used() -> anyhow::Result<()> {
    // With the marks on, the device plugin is granted pod patches.
    let values = "devicePlugin.allocationMarks=true";
    let rendered = render_sets(&[values])?;
    // All the device plugin's calls but its pod patches, and a delete it is not granted.
    let calls = [
        (Verb::Get, "", "nodes"),
        (Verb::Patch, "", "nodes"),
        (Verb::Patch, "", "pods/status"),
        (Verb::List, "", "pods"),
        (Verb::Watch, "", "pods"),
        (Verb::Delete, "", "pods"),
        (Verb::Create, "events.k8s.io", "events"),
    ];
    let user = DEVICE_PLUGIN_USER;
    let calls = calls.into_iter().map(|(verb, group, resource)| {
        let (user, group, resource) = (user.to_owned(), group.to_owned(), resource.to_owned());
        let call = Call {
            user,
            group,
            resource,
            verb,
        };
        (call, 1)
    });
    let calls: BTreeMap<Call, u64> = calls.collect();
    let problems = rbac_problems(&rendered, values, "device-plugin", user, &calls)?;
    let context = format!("device-plugin ({user}), chart rendered with {values}");
    let want = [
        format!("{context}: used but not granted: delete core/pods"),
        format!("{context}: granted but unused: patch core/pods"),
    ];
    assert_eq!(problems, want);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The dedicated scheduler's configuration, with the real v1 field names and types: each
// struct refuses a field it does not know (most values are compared as JSON, hence unread).

macro_rules! v1_config {
    ($(struct $name:ident { $($field:tt)* })+) => {$(
        #[derive(Debug, Deserialize)]
        #[allow(dead_code)]
        #[serde(deny_unknown_fields, rename_all = "camelCase")]
        struct $name { $($field)* }
    )+};
}

v1_config! {
    struct KubeSchedulerConfiguration {
        api_version: String,
        kind: String,
        client_connection: ClientConnection,
        parallelism: i32,
        leader_election: LeaderElection,
        profiles: Vec<Profile>,
        extenders: Vec<Extender>,
    }
    struct ClientConnection { qps: f32, burst: i32 }
    struct LeaderElection {
        leader_elect: bool,
        resource_lock: String,
        resource_name: String,
        resource_namespace: String,
    }
    struct Profile {
        scheduler_name: String,
        percentage_of_nodes_to_score: i32,
        /// Checked by `keep_best_matches_the_profile_it_ranks_for`.
        plugins: Option<serde_yaml::Value>,
        plugin_config: Option<serde_yaml::Value>,
    }
    struct Extender {
        url_prefix: String,
        filter_verb: String,
        preempt_verb: Option<String>,
        prioritize_verb: Option<String>,
        weight: Option<i64>,
        bind_verb: String,
        #[serde(rename = "enableHTTPS")]
        enable_https: bool,
        tls_config: Option<ExtenderTlsConfig>,
        http_timeout: String,
        node_cache_capable: bool,
        managed_resources: Vec<ManagedResource>,
        ignorable: bool,
    }
    struct ExtenderTlsConfig {
        ca_file: String,
        cert_file: Option<String>,
        key_file: Option<String>,
    }
    struct ManagedResource { name: String, ignored_by_scheduler: bool }
}

/// The dedicated scheduler's `scheduler-config.yaml`, from the ConfigMap of scheduler `name`.
fn scheduler_config_text(rendered: &Rendered, name: &str) -> anyhow::Result<String> {
    let config_map: ConfigMap = rendered.get("ConfigMap", &format!("{name}-config"))?;
    let mut data = config_map.data.unwrap_or_default();
    let text = data.remove("scheduler-config.yaml");
    text.context("no scheduler-config.yaml")
}

/// The JSON patch expression of MutatingAdmissionPolicy `name`'s mutation `i`, its whitespace
/// runs made single spaces.
fn policy_patch(rendered: &Rendered, name: &str, i: usize) -> anyhow::Result<String> {
    let policy = rendered.object("MutatingAdmissionPolicy", name)?;
    let patch = policy["spec"]["mutations"][i]["jsonPatch"]["expression"].as_str();
    Ok(words(patch.unwrap_or_default()).join(" "))
}

/// The policy that routes pods naming a claim template of our class: it reads templates as
/// params, every one in the pod's namespace but the chart's own (whose pods the gpu-mem policy
/// routes), tests the class, and sets the chart's scheduler; a miss only loses ranking.
fn check_template_routing(rendered: &Rendered) -> anyhow::Result<()> {
    let name = "gpushare-claim-templates";
    let policy = &rendered.object("MutatingAdmissionPolicy", name)?["spec"];
    let conditions = policy["matchConditions"].to_string();
    ensure_each!(
        policy,
        policy["paramKind"]["kind"] == "ResourceClaimTemplate",
        policy["failurePolicy"] == "Ignore",
        conditions.contains("deviceClassName == 'gpu-mem.gpushare.example.com'"),
        policy_patch(rendered, name, 0)?.contains(r#"value: "gpushare-scheduler""#),
    );
    let param = &rendered.object("MutatingAdmissionPolicyBinding", name)?["spec"]["paramRef"];
    let excluded = &param["selector"]["matchExpressions"][0];
    ensure_each!(
        param,
        param["parameterNotFoundAction"] == "Allow",
        // The pod's namespace.
        param.get("namespace").is_none(),
        excluded["operator"] == "NotIn",
    );
    let key = excluded["key"].as_str().unwrap_or_default();
    let values = excluded["values"].as_array();
    for template in rendered.of_kind("ResourceClaimTemplate") {
        let metadata = &template["metadata"];
        let (label, name) = (&metadata["labels"][key], &metadata["name"]);
        let out = values.is_some_and(|v| v.contains(label));
        ensure!(out, "template {name} not excluded by {key}: {label}");
    }
    Ok(())
}

/// Whether both DRA policies that route GPU pods to the chart's scheduler (the gpu-mem one,
/// the claim-template one) give them a toleration of the idle-GPU taint: `wanted` where the
/// extender runs (it ranks) and keeps the taint, else neither carries one.
fn check_dra_idle_gpu_toleration(rendered: &Rendered, wanted: bool) -> anyhow::Result<()> {
    let toleration =
        "key: 'gpushare.example.com/idle-gpu', operator: 'Exists', effect: 'PreferNoSchedule'";
    for name in ["gpushare-gpu-mem-claims", "gpushare-claim-templates"] {
        let mutations = &rendered.object("MutatingAdmissionPolicy", name)?["spec"]["mutations"];
        let tolerates = mutations.as_array().into_iter().flatten().any(|m| {
            let patch = m["jsonPatch"]["expression"].as_str().unwrap_or_default();
            patch.contains("path: '/spec/tolerations/-'") && patch.contains(toleration)
        });
        let as_wanted = tolerates == wanted;
        ensure!(as_wanted, "{name}: toleration {tolerates}: {mutations}");
    }
    Ok(())
}

/// DRA mode's profile: MostAllocated on CPU and memory, the spreading scores off, a short
/// walk, a client fast enough for a claim and a Binding per pod; with `ranking`, an ignorable
/// extender that filters and prioritizes only, else none.
fn check_dra_scheduler(rendered: &Rendered, ranking: bool) -> anyhow::Result<()> {
    let text = scheduler_config_text(rendered, "gpushare-scheduler")?;
    let config: Value = serde_yaml::from_str(&text)?;
    let url = "https://gpushare-extender.kube-system.svc:39999/gpushare-scheduler";
    let extender = json!({"urlPrefix": url, "filterVerb": "filter", "prioritizeVerb": "prioritize",
        "ignorable": true, "bindVerb": null, "preemptVerb": null, "managedResources": null});
    let disabled = json!([{"name": "NodeResourcesBalancedAllocation"}, {"name": "ImageLocality"}]);
    let want = json!({"extenders": ranking.then_some([extender]), "clientConnection": {"qps": 400},
        "profiles": [{"schedulerName": "gpushare-scheduler", "percentageOfNodesToScore": 1,
            "plugins": {"score": {"disabled": disabled}}}]});
    ensure_matches(&config, &want).with_context(|| text.clone())?;
    let fit = named(&config["profiles"][0]["pluginConfig"], "NodeResourcesFit");
    let strategy = &fit["args"]["scoringStrategy"];
    let want = json!({"type": "MostAllocated", "resources": [{"name": "cpu"}, {"name": "memory"}]});
    ensure_matches(strategy, &want).context(text)
}

/// The extender in DRA mode: it reads our driver's slices and claims of the chart's class,
/// may list and watch them, and can neither bind nor read pods one by one.
fn check_dra_extender(rendered: &Rendered) -> anyhow::Result<()> {
    let args = extender_args(rendered)?;
    let want = "--dra-driver=gpushare.example.com --dra-device-class=gpu-mem.gpushare.example.com";
    ensure_has(&args, &words(want))?;
    ensure_lacks(&args, &["--allocation-keys-file"])?;
    let rules = rendered.object("ClusterRole", "gpushare-extender")?["rules"].to_string();
    ensure_each!(
        rules,
        rules.contains(r#""resources":["resourceslices","resourceclaims"]"#),
        !rules.contains("pods/binding"),
        !rules.contains(r#""verbs":["get"]"#),
    );
    Ok(())
}

/// The dedicated scheduler of release `prefix`, reaching the extender for `resource`.
fn check_scheduler(rendered: &Rendered, prefix: &str, resource: &str) -> anyhow::Result<()> {
    let ns = &rendered.namespace;
    let (name, service) = (format!("{prefix}-scheduler"), format!("{prefix}-extender"));
    let text = scheduler_config_text(rendered, &name)?;
    let config: KubeSchedulerConfiguration = serde_yaml::from_str(&text)?;
    // Preemption victims are chosen per GPU by the extender, unless turned off (below). HTTPS,
    // verified against the extender's CA, mounted alone (without tlsConfig it trusts any
    // certificate); it presents the client certificate the extender asks for, mounted
    // without the replicas' key.
    let url = format!("https://{service}.{ns}.svc:39999/gpushare-scheduler");
    let want = json!({
        "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"qps": 50, "burst": 100}, "parallelism": 16,
        "leaderElection": {"leaderElect": true, "resourceLock": "leases",
            "resourceName": name, "resourceNamespace": ns},
        "profiles": [{"schedulerName": "gpushare-scheduler", "percentageOfNodesToScore": 1}],
        "extenders": [{"urlPrefix": url, "filterVerb": "filter", "prioritizeVerb": "prioritize",
            "bindVerb": "bind", "preemptVerb": "preempt", "ignorable": false,
            "enableHTTPS": true, "httpTimeout": "5s", "nodeCacheCapable": true,
            "tlsConfig": {"caFile": "/etc/gpushare/extender-ca/ca.crt",
                "certFile": "/etc/gpushare/scheduler-client/tls.crt",
                "keyFile": "/etc/gpushare/scheduler-client/tls.key"}}]
    });
    ensure_matches(&serde_yaml::from_str(&text)?, &want).with_context(|| text.clone())?;
    // One extender (checked above).
    let (extender, profile) = (&config.extenders[0], &config.profiles[0]);
    let plugin_config = serde_yaml::to_string(&profile.plugin_config)?;
    let mut managed = extender.managed_resources.iter();
    ensure_each!(
        text,
        // Default values: the extender ranks nodes (in filter, keeping the best, and in
        // prioritize for pods with soft preferences); the profile keeps upstream's resource
        // scoring (what `keep_best_matches_the_profile_it_ranks_for` checks it turns off).
        extender.weight.is_some_and(|w| w > 0),
        !plugin_config.contains("NodeResourcesFit"),
        managed.any(|r| r.name == resource && !r.ignored_by_scheduler),
    );
    let without = render(prefix, ns, &["--set=scheduler.extender.preempt=false"])?;
    let text = scheduler_config_text(&without, &name)?;
    let config: KubeSchedulerConfiguration = serde_yaml::from_str(&text)?;
    ensure!(config.extenders[0].preempt_verb.is_none(), "{text}");
    let spec = rendered.hardened_pod_spec("Deployment", &name)?;
    let client = json!([{"key": "scheduler.crt", "path": "tls.crt"},
        {"key": "scheduler.key", "path": "tls.key"}]);
    let ca = json!([{"key": "ca.crt", "path": "ca.crt"}]);
    for (volume, secret, items) in [
        ("client-certificate", "extender-client-tls", client),
        ("extender-ca", "extender-tls", ca),
    ] {
        let want = json!({"secretName": format!("{prefix}-{secret}"), "items": items});
        let mounted = &named(&spec["volumes"], volume)["secret"];
        ensure_matches(mounted, &want).with_context(|| format!("the scheduler's {volume}"))?;
    }
    // The URL's service and port exist.
    let ports = &rendered.object("Service", &service)?["spec"]["ports"];
    ensure!(has_port(ports, "scheduler", 39999), "{ports}");
    let c = container(spec, "kube-scheduler")?;
    let image = format!("registry.k8s.io/kube-scheduler:v{KUBE_VERSION}");
    ensure!(c["image"] == image, "{}, not {image}", c["image"]);
    let config = "--config=/etc/gpushare-scheduler/scheduler-config.yaml";
    ensure_has(&strings(&c["command"]), &[config])?;
    for role in ["system:kube-scheduler", "system:volume-scheduler"] {
        let binding = format!("{name}-{}", role.trim_start_matches("system:"));
        let binding: ClusterRoleBinding = rendered.get("ClusterRoleBinding", &binding)?;
        ensure!(binding.role_ref.name == role, "{binding:?}");
    }
    let reader = rendered.object("RoleBinding", &format!("{name}-authentication-reader"))?;
    let want = json!({"metadata": {"namespace": "kube-system"},
        "roleRef": {"name": "extension-apiserver-authentication-reader"}});
    ensure_matches(reader, &want).context("its authentication reader binding")
}

/// Whether `ports` (a Service's or a container's) hold port `port` named `name`.
fn has_port(ports: &Value, name: &str, port: u16) -> bool {
    let mut ports = ports.as_array().into_iter().flatten();
    ports.any(|p| p["name"] == name && (p["port"] == port || p["containerPort"] == port))
}

/// `c`'s readiness and liveness probes are plain HTTP GETs of `paths` on its port `port`.
fn check_probes(c: &Value, port: &str, [readyz, healthz]: [&str; 2]) -> anyhow::Result<()> {
    for (probe, path) in [("readinessProbe", readyz), ("livenessProbe", healthz)] {
        let plain = json!({"httpGet": {"path": path, "port": port, "scheme": null}});
        ensure_matches(&c[probe], &plain).context(probe)?;
    }
    Ok(())
}

fn check_webhook(rendered: &Rendered, prefix: &str) -> anyhow::Result<()> {
    let (extender, webhook) = (format!("{prefix}-extender"), format!("{prefix}-webhook"));
    let config = rendered.object("MutatingWebhookConfiguration", &webhook)?;
    let service = json!({"name": extender, "namespace": rendered.namespace,
        "path": "/mutate-pods", "port": 443});
    // One webhook, on pod creates; the caBundle is set at runtime.
    let want = json!({"webhooks": [{"failurePolicy": "Ignore", "sideEffects": "None",
        "admissionReviewVersions": ["v1"], "clientConfig": {"service": service, "caBundle": null},
        "rules": [{"operations": ["CREATE"], "resources": ["pods"]}]}]});
    ensure_matches(config, &want).with_context(|| config.to_string())?;
    // Not for kube-system's pods.
    let expressions = &config["webhooks"][0]["namespaceSelector"]["matchExpressions"];
    let excludes = |e: &Value| {
        let mut values = e["values"].as_array().into_iter().flatten();
        let kube_system = values.any(|v| v == "kube-system");
        e["operator"] == "NotIn" && e["key"] == "kubernetes.io/metadata.name" && kube_system
    };
    let excluded = expressions.as_array().into_iter().flatten().any(excludes);
    ensure!(excluded, "kube-system's pods not excluded: {expressions}");
    // The Service's 443 reaches a container port named webhook.
    let ports = &rendered.object("Service", &extender)?["spec"]["ports"];
    let mut service_ports = ports.as_array().into_iter().flatten();
    ensure!(service_ports.any(|p| p["port"] == 443), "{ports}");
    let c = container(rendered.pod_spec("Deployment", &extender)?, "extender")?;
    ensure!(named(&c["ports"], "webhook").is_object(), "{}", c["ports"]);
    Ok(())
}

/// The post-install/post-upgrade hook, deleted once it passed: a locked-down Job running
/// `check-routing` as webhook.rs's `the_install_hook_passes_only_once_gpu_pods_are_routed`
/// does, with a Role granting pod creates in the checked namespace only.
fn check_routing_hook(rendered: &Rendered, prefix: &str) -> anyhow::Result<()> {
    let name = format!("{prefix}-routing-check");
    let hook = json!({"helm.sh/hook": "post-install,post-upgrade",
        "helm.sh/hook-delete-policy": "before-hook-creation,hook-succeeded"});
    for kind in ["ServiceAccount", "Role", "RoleBinding", "Job"] {
        let annotations = &rendered.object(kind, &name)?["metadata"]["annotations"];
        ensure_matches(annotations, &hook).with_context(|| format!("{kind} {name}"))?;
    }
    let retries = &rendered.object("Job", &name)?["spec"]["backoffLimit"];
    ensure!(*retries == 0, "{name}: backoffLimit {retries}");
    let check = container(rendered.hardened_pod_spec("Job", &name)?, "check-routing")?;
    let command = strings(&check["command"]);
    assert_eq!(command, ["gpushare-extender", "check-routing"]);
    let want = "--namespace=default --resource=example.com/gpu-mem \
                --scheduler-name=gpushare-scheduler \
                --forged-annotation=gpushare.example.com/v1.routing-check \
                --probe-image=registry.k8s.io/pause:3.10 --timeout-seconds=240 --log-format=text";
    assert_eq!(strings(&check["args"]), words(want));
    let role: Role = rendered.get("Role", &name)?;
    ensure!(role.metadata.namespace.as_deref() == Some("default"));
    let grants = expand(role.rules.as_deref().unwrap_or_default())?;
    let creates = grants == BTreeSet::from([grant("", "pods", "create")]);
    ensure!(creates, "the hook's Role grants more: {grants:?}");
    Ok(())
}

fn check_extender(rendered: &Rendered, prefix: &str, expect_args: &[&str]) -> anyhow::Result<()> {
    let name = format!("{prefix}-extender");
    let spec = rendered.hardened_pod_spec("Deployment", &name)?;
    let c = container(spec, "extender")?;
    ensure_each!(
        name,
        spec["securityContext"]["runAsNonRoot"] == true,
        c["image"] == "ghcr.io/example/gpushare-extender:0.1.0",
    );
    ensure_has(&strings(&c["args"]), expect_args).context("the extender's args")?;
    // Probes, Prometheus and kubectl gpushare use the plain monitoring port (named `http`),
    // whose only routes are health and metrics; the scheduler's port is `scheduler`.
    check_probes(c, "http", ["/readyz", "/healthz"])?;
    // The container's ports, and the Service's.
    let service_ports = &rendered.object("Service", &name)?["spec"]["ports"];
    for ports in [&c["ports"], service_ports] {
        let both = has_port(ports, "http", 9090) && has_port(ports, "scheduler", 39999);
        ensure!(both, "{ports}");
    }
    Ok(())
}

fn check_device_plugin<'r>(
    rendered: &'r Rendered,
    prefix: &str,
    (label, value): (&str, &str),
    expect_args: &[&str],
) -> anyhow::Result<&'r Value> {
    let name = format!("{prefix}-device-plugin");
    let spec = rendered.hardened_pod_spec("DaemonSet", &name)?;
    let c = container(spec, "device-plugin")?;
    let host_path = |volume| &named(&spec["volumes"], volume)["hostPath"]["path"];
    let env = |var| named(&c["env"], var);
    let mut tolerations = spec["tolerations"].as_array().into_iter().flatten();
    ensure_each!(
        format!("{name}: {spec}"),
        spec["nodeSelector"][label] == value,
        spec["priorityClassName"] == "system-node-critical",
        tolerations.any(|t| t["key"] == "nvidia.com/gpu"),
        *host_path("device-plugins") == "/var/lib/kubelet/device-plugins",
        // kubelet's PodResources API: mounted read-only, its socket passed.
        *host_path("pod-resources") == "/var/lib/kubelet/pod-resources",
        named(&c["volumeMounts"], "pod-resources")["readOnly"] == true,
        // From the downward API.
        env("GPUSHARE_NODE_NAME")["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName",
        env("NVIDIA_VISIBLE_DEVICES")["value"] == "all",
        env("NVIDIA_DRIVER_CAPABILITIES")["value"] == "utility",
    );
    let socket = "--pod-resources-socket=/var/lib/kubelet/pod-resources/kubelet.sock";
    let want = [expect_args, &[socket]].concat();
    ensure_has(&strings(&c["args"]), &want).context("the device plugin's args")?;
    Ok(spec)
}

/// The Secret the chart generates for the extender's HTTPS: a CA, and a certificate that
/// chains to it and names the Service as the scheduler dials it.
#[test]
fn the_generated_extender_certificate_verifies_for_the_service_name() -> anyhow::Result<()> {
    use rustls::client::{WebPkiServerVerifier, danger::ServerCertVerifier as _};
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    let rendered = render("gpushare", "gpu-system", &[])?;
    let secret: Secret = rendered.get("Secret", "gpushare-extender-tls")?;
    ensure!(secret.type_.as_deref() == Some("kubernetes.io/tls"));
    let data = secret.data.context("no data")?;
    // `data` is base64 on the wire; k8s-openapi hands back the PEM bytes.
    let pem = |key: &str| -> anyhow::Result<Vec<u8>> {
        let bytes = data.get(key).with_context(|| format!("no {key}"))?;
        ensure!(bytes.0.starts_with(b"-----BEGIN"), "{key} is not PEM");
        Ok(bytes.0.clone())
    };
    let (ca, cert, _key) = (pem("ca.crt")?, pem("tls.crt")?, pem("tls.key")?);
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&ca) {
        roots.add(c?)?;
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let verifier = WebPkiServerVerifier::builder_with_provider(roots.into(), provider);
    let (verifier, leaf) = (verifier.build()?, CertificateDer::from_pem_slice(&cert)?);
    // And not for another Service: the name is checked, not just the chain.
    for (name, valid) in [
        ("gpushare-extender.gpu-system.svc", true),
        ("gpushare-extender.gpu-system.svc.cluster.local", true),
        ("attacker.gpu-system.svc", false),
    ] {
        let server = ServerName::try_from(name)?;
        let verified = verifier.verify_server_cert(&leaf, &[], &server, &[], UnixTime::now());
        ensure!(verified.is_ok() == valid, "{name}: {verified:?}");
    }
    Ok(())
}

#[test]
fn the_network_policy_admits_only_the_scheduler_to_the_scheduler_port() -> anyhow::Result<()> {
    let component =
        |peer: &Value| peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"].clone();
    let rendered = render_sets(&["networkPolicy.enabled=true"])?;
    check_all_typed(&rendered.docs)?;
    let spec = &rendered.object("NetworkPolicy", "gpushare-extender")?["spec"];
    assert_eq!(component(spec), "extender");
    let rules = spec["ingress"].as_array().context("ingress")?;
    let rule_for = |port: &str| {
        let rule = rules.iter().find(|r| r["ports"][0]["port"] == port);
        rule.with_context(|| format!("no rule for port {port}"))
    };
    let from = rule_for("scheduler")?["from"].as_array();
    let from = from.context("the scheduler port admits anyone")?;
    // The scheduler, and the other extender replicas (a follower passes binds on).
    let components: Vec<Value> = from.iter().map(component).collect();
    assert_eq!(components, ["extender", "scheduler"], "{from:?}");
    let monitoring = rule_for("http")?.get("from");
    assert_eq!(monitoring, None, "monitoring is open by default");
    rule_for("webhook")?;
    // default-scheduler mode: the peers are the admin's to name.
    let peers = "networkPolicy.enabled=true scheduler.mode=default-scheduler \
                 networkPolicy.schedulerPeers[0].ipBlock.cidr=10.0.0.0/24";
    let rendered = render_sets(&words(peers))?;
    let from = &rendered.of_kind("NetworkPolicy")[0]["spec"]["ingress"][0]["from"];
    assert_eq!(from[1], json!({"ipBlock": {"cidr": "10.0.0.0/24"}}));
    assert_eq!(component(&from[0]), "extender");
    Ok(())
}

#[test]
fn chart_lints() -> anyhow::Result<()> {
    let chart = chart_dir();
    let args = ["lint".as_ref(), "--strict".as_ref(), chart.as_os_str()];
    run_ok(&tools::helm()?, &args)?;
    Ok(())
}

#[test]
fn default_values_render_a_dedicated_scheduler_install() -> anyhow::Result<()> {
    let rendered = render_args(&[])?;
    check_all_typed(&rendered.docs)?;
    // With the uninstall cleanup hook's ServiceAccount, ClusterRole and binding, Role and
    // binding (the test pod's deletion), and Job; `helm test`'s ServiceAccount, ClusterRole
    // and binding, two Roles and bindings (the Lease, the routing namespace) and Pod; and the
    // device plugin's Role and binding to watch its own DaemonSet.
    let want = "ClusterRole=4 ClusterRoleBinding=6 ConfigMap=1 DaemonSet=1 Deployment=2 Job=2 \
                MutatingWebhookConfiguration=1 Pod=1 PodDisruptionBudget=1 Role=7 RoleBinding=8 \
                Secret=3 Service=2 ServiceAccount=6 ValidatingAdmissionPolicy=1 \
                ValidatingAdmissionPolicyBinding=1";
    assert_eq!(rendered.kinds(), counts(&[want]));
    let extender_args = words(
        "--listen=0.0.0.0:39999 --prefix=/gpushare-scheduler --resource=example.com/gpu-mem \
         --node-label=gpushare=true --domain=gpushare.example.com --policy=fragmentation \
         --bind-timeout-ms=2500 --bind-grace-ms=2000 --max-request-bytes=33554432 \
         --filter-keep-best=1 --prioritize-weight=1 --monitor-listen=0.0.0.0:9090 \
         --tls-cert=/etc/gpushare/extender-tls/tls.crt \
         --tls-key=/etc/gpushare/extender-tls/tls.key \
         --allocation-keys-file=/etc/gpushare/allocation-keys/keys \
         --leader-elect=true --leader-lease=gpushare-extender \
         --advertise-url=https://$(POD_IP):39999 \
         --leader-forward-ca=/etc/gpushare/extender-tls/ca.crt \
         --leader-forward-server-name=gpushare-extender.kube-system.svc \
         --client-ca=/etc/gpushare/client-tls/ca.crt \
         --leader-forward-cert=/etc/gpushare/client-tls/extender.crt \
         --leader-forward-key=/etc/gpushare/client-tls/extender.key",
    );
    check_extender(&rendered, "gpushare", &extender_args)?;
    // Two replicas, one binder (the Lease holder): old and new pods may overlap in an update.
    let strategy = &rendered.object("Deployment", "gpushare-extender")?["spec"]["strategy"];
    ensure!(strategy["type"] == "RollingUpdate", "{strategy}");
    let pdb = &rendered.object("PodDisruptionBudget", "gpushare-extender")?["spec"];
    ensure!(pdb["minAvailable"] == 1, "{pdb}");
    let plugin_args = words(
        "--gpu-backend=nvml --resource=example.com/gpu-mem --domain=gpushare.example.com \
         --allocation-keys-file=/etc/gpushare/allocation-keys/keys",
    );
    check_device_plugin(&rendered, "gpushare", ("gpushare", "true"), &plugin_args)?;
    check_scheduler(&rendered, "gpushare", "example.com/gpu-mem")?;
    check_webhook(&rendered, "gpushare")?;
    check_routing_hook(&rendered, "gpushare")?;
    check_rbac_bindings(&rendered, "gpushare")
}

#[test]
fn non_default_values_render_a_default_scheduler_install() -> anyhow::Result<()> {
    let values = words(
        "--api-versions=monitoring.coreos.com/v1 --set=scheduler.mode=default-scheduler \
         --set=nodeLabel.key=acme.io/gpu-share --set-string=nodeLabel.value=yes \
         --set=resourceName=acme.io/vram --set=domain=gpu.acme.io --set=policy=spread \
         --set=metrics.serviceMonitor.enabled=true --set=devicePlugin.runtimeClassName=nvidia \
         --set=extender.image.tag=dev",
    );
    let rendered = render("prod", "gpu-system", &values)?;
    check_all_typed(&rendered.docs)?;
    let kinds = rendered.kinds();
    let count = |kind: &str| kinds.get(kind).copied().unwrap_or_default();
    ensure_each!(
        format!("{kinds:?}"),
        count("ConfigMap") == 0,
        count("MutatingWebhookConfiguration") == 0,
        // Only the extender.
        count("Deployment") == 1,
        count("ServiceMonitor") == 2,
    );
    let spec = rendered.pod_spec("Deployment", "prod-gpushare-extender")?;
    let c = container(spec, "extender")?;
    assert_eq!(c["image"], "ghcr.io/example/gpushare-extender:dev");
    let want = "--resource=acme.io/vram --node-label=acme.io/gpu-share=yes --domain=gpu.acme.io";
    let want = format!("{want} --policy=spread");
    ensure_has(&strings(&c["args"]), &words(&want))?;
    let webhook = &named(&c["env"], "GPUSHARE_WEBHOOK_ENABLED")["value"];
    assert_eq!(webhook, "false", "{}", c["env"]);
    // No webhook port without the webhook.
    let ports = &rendered.object("Service", "prod-gpushare-extender")?["spec"]["ports"];
    let mut service_ports = ports.as_array().into_iter().flatten();
    assert!(service_ports.all(|p| p["port"] != 443), "{ports}");
    let label = ("acme.io/gpu-share", "yes");
    let plugin_args = ["--resource=acme.io/vram", "--domain=gpu.acme.io"];
    let spec = check_device_plugin(&rendered, "prod-gpushare", label, &plugin_args)?;
    assert_eq!(spec["runtimeClassName"], "nvidia");
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
    // install has; the claim templates are one per GiB, and one per GiB and compute percent
    // (12 by default): 80 × 13.
    let driver_only = "ClusterRole=3 ClusterRoleBinding=3 DaemonSet=1 DeviceClass=1 Job=1 \
                       MutatingAdmissionPolicy=1 MutatingAdmissionPolicyBinding=1 Pod=1 \
                       ResourceClaimTemplate=1040 Role=2 RoleBinding=2 ServiceAccount=3 \
                       ValidatingAdmissionPolicy=1 ValidatingAdmissionPolicyBinding=1";
    // The chart's own kube-scheduler (scheduler.mode=dedicated, the default) comes too: its
    // ServiceAccount, three bindings, its leader-election Role and binding, config, Deployment;
    // and the policy that routes pods naming a claim template of our class to it.
    let scheduler = "MutatingAdmissionPolicy=1 MutatingAdmissionPolicyBinding=1 ServiceAccount=1 \
                     ClusterRoleBinding=2 Role=1 RoleBinding=2 ConfigMap=1 Deployment=1";
    // dra.scheduler.ranking (the default) adds the extender, which ranks only: its
    // ServiceAccount, Service, TLS Secret, Deployment, PodDisruptionBudget, ClusterRole and
    // binding, Lease Role and binding; and the test's Role and binding to read that Lease.
    let ranking = "ServiceAccount=1 Service=1 Secret=1 Deployment=1 PodDisruptionBudget=1 \
                   ClusterRole=1 ClusterRoleBinding=1 Role=2 RoleBinding=2";
    let rendered = render_dra(&[])?;
    assert_eq!(rendered.kinds(), counts(&[driver_only, scheduler, ranking]));
    // Its one DaemonSet, the plugin.
    rendered.object("DaemonSet", "gpushare-dra-plugin")?;
    check_dra_scheduler(&rendered, true)?;
    check_dra_extender(&rendered)?;
    check_template_routing(&rendered)?;
    check_dra_idle_gpu_toleration(&rendered, true)?;
    let without_taint = render_dra(&["--set=extender.idleGpuTaint=false"])?;
    check_dra_idle_gpu_toleration(&without_taint, false)?;
    // The claims policy sends the pods it turns to the chart's scheduler; with the operator's
    // own kube-scheduler, only the driver is rendered, and pods keep their scheduler.
    let to_ours = r#"path: "/spec/schedulerName", value: "gpushare-scheduler""#;
    let no_ranking = "dra.scheduler.ranking=false";
    let operators_scheduler = "scheduler.mode=default-scheduler";
    for (set, kinds, sends) in [
        (no_ranking, counts(&[driver_only, scheduler]), Some(to_ours)),
        (operators_scheduler, counts(&[driver_only]), None),
    ] {
        let rendered = render_dra(&[&format!("--set={set}")])?;
        assert_eq!(rendered.kinds(), kinds, "{set}");
        if sends.is_some() {
            check_dra_scheduler(&rendered, false)?;
            check_dra_idle_gpu_toleration(&rendered, false)?;
        }
        let patch = policy_patch(&rendered, "gpushare-gpu-mem-claims", 0)?;
        let named = patch.contains(sends.unwrap_or("schedulerName"));
        ensure!(named == sends.is_some(), "{set}: {patch}");
    }
    // `example.com/gpu-mem: N` in DRA mode: one template per GiB, in each namespace named,
    // asking the chart's DeviceClass for N GiB of one GPU (the real tier runs the README's
    // pod through them), and one per GiB and compute percent, asking for both.
    let rendered = render_dra(&[
        "--set=dra.gpuMem.maxGiB=3",
        r#"--set-json=dra.gpuMem.namespaces=["team-a","team-b"]"#,
        "--set-json=dra.gpuMem.computePercents=[50]",
    ])?;
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    let mut templates = Vec::new();
    for template in rendered.of_kind("ResourceClaimTemplate") {
        let request = &template["spec"]["spec"]["devices"]["requests"][0]["exactly"];
        let class = &request["deviceClassName"];
        ensure!(*class == "gpu-mem.gpushare.example.com", "{template}");
        let (metadata, capacity) = (&template["metadata"], &request["capacity"]["requests"]);
        let (namespace, name) = (text(&metadata["namespace"]), text(&metadata["name"]));
        let (memory, compute) = (text(&capacity["memory"]), text(&capacity["compute"]));
        let template = format!("{namespace}/{name}: memory={memory} compute={compute}");
        templates.push(template);
    }
    templates.sort();
    let mut want = Vec::new();
    for ns in ["team-a", "team-b"] {
        for gib in 1..=3 {
            let name = format!("{ns}/gpushare-gpu-mem-{gib}");
            want.push(format!("{name}: memory={gib}Gi compute="));
            want.push(format!("{name}-c50: memory={gib}Gi compute=50"));
        }
    }
    want.sort();
    assert_eq!(templates, want);
    let policy = &rendered.of_kind("MutatingAdmissionPolicy")[0]["spec"]["matchConstraints"];
    let namespaces = &policy["namespaceSelector"]["matchExpressions"][0]["values"];
    assert_eq!(*namespaces, json!(["team-a", "team-b"]));
    let without = render_dra(&["--set=dra.gpuMem.enabled=false"])?;
    for kind in ["ResourceClaimTemplate", "ValidatingAdmissionPolicy"] {
        let none = without.of_kind(kind).is_empty();
        ensure!(none, "{kind} rendered with dra.gpuMem.enabled=false");
    }
    // Pods naming templates of their own are still routed to the chart's scheduler.
    let policies = without.of_kind("MutatingAdmissionPolicy");
    let policies: Vec<&Value> = policies.iter().map(|p| &p["metadata"]["name"]).collect();
    ensure!(policies == ["gpushare-claim-templates"], "{policies:?}");
    Ok(())
}

/// `logFormat` reaches every binary the chart runs, each in the form it reads.
#[test]
fn log_format_reaches_every_binary() -> anyhow::Result<()> {
    for (mode, name) in [("extender", "device-plugin"), ("dra", "dra-plugin")] {
        let rendered = render_sets(&[&format!("mode={mode}"), "logFormat=json"])?;
        let spec = rendered.pod_spec("DaemonSet", &format!("gpushare-{name}"))?;
        let c = container(spec, name)?;
        let format = &named(&c["env"], "GPUSHARE_LOG_FORMAT")["value"];
        assert_eq!(format, "json", "{name}'s GPUSHARE_LOG_FORMAT");
        if mode == "extender" {
            ensure_has(&extender_args(&rendered)?, &["--log-format=json"])?;
        }
    }
    Ok(())
}

/// The args of the node plugin of `mode` (extender, dra) as its binary reads them, with the
/// node name the downward API gives.
fn plugin_argv(rendered: &Rendered, mode: &str) -> anyhow::Result<Vec<String>> {
    let name = format!("{}-plugin", if mode == "dra" { "dra" } else { "device" });
    let spec = rendered.pod_spec("DaemonSet", &format!("gpushare-{name}"))?;
    let argv = vec![format!("gpushare-{name}"), "--node-name=n1".to_owned()];
    Ok([argv, strings(&container(spec, &name)?["args"])].concat())
}

/// `isolation.contextMiB` and `.managedMemory` reach both plugins as flags, in `preload` mode
/// only and only when set off the interposer's default; the binaries pass them on to containers.
#[test]
fn the_interposers_settings_reach_both_plugins_in_preload_mode() -> anyhow::Result<()> {
    use clap::Parser as _;
    use gpushare_contract::env::{
        self, Enforcement, EnforcerSettings, IsolationOptions, ManagedMemory,
    };
    const SETTINGS: [&str; 2] = ["--isolation-context-mib", "--isolation-managed-memory"];
    type Parsed = (Vec<String>, Enforcement, IsolationOptions);
    /// The plugin's args, and its binary's reading: enforcement mode and interposer settings.
    fn parsed(rendered: &Rendered, mode: &str) -> anyhow::Result<Parsed> {
        let argv = plugin_argv(rendered, mode)?;
        let refused = || format!("the {mode} node plugin refuses {argv:?}");
        let (enforcement, isolation) = if mode == "dra" {
            let config = gpushare_dra_plugin::Config::try_parse_from(&argv);
            let config = config.with_context(refused)?;
            (config.enforcement, config.isolation.options())
        } else {
            let config = gpushare_device_plugin::Config::try_parse_from(&argv);
            let config = config.with_context(refused)?;
            (config.enforcement, config.isolation.options())
        };
        Ok((argv, enforcement, isolation))
    }
    // A values file gives numbers as floats, --set as integers: both render the same.
    let values = tempfile::NamedTempFile::new()?;
    std::fs::write(&values, "isolation:\n  contextMiB: 0\n")?;
    let zero = values.path().to_str().context("path")?;
    for mode in ["extender", "dra"] {
        let set_mode = format!("mode={mode}");
        // Not set: no flags; the interposer's defaults, so containers get no variable.
        let (argv, enforcement, options) = parsed(&render_sets(&[&set_mode])?, mode)?;
        ensure_lacks(&argv, &SETTINGS).context(mode)?;
        let defaults = (Enforcement::Preload, IsolationOptions::default());
        ensure!((enforcement, options) == defaults, "{mode}: {argv:?}");
        // Set: both flags, read back as set, and carried into the container's environment.
        let [context_mib, managed] = ["isolation.contextMiB=640", "isolation.managedMemory=ignore"];
        let rendered = render_sets(&[&set_mode, context_mib, managed])?;
        let (argv, enforcement, options) = parsed(&rendered, mode)?;
        let want = words("--isolation-context-mib=640 --isolation-managed-memory=ignore");
        ensure_has(&argv, &want).context(mode)?;
        let set = IsolationOptions {
            context_mib: Some(640),
            managed_memory: ManagedMemory::Ignore,
            compute_mode: Default::default(),
        };
        ensure!(options == set, "{mode}: {options:?}");
        let settings = EnforcerSettings {
            mps_pipe_directory: "",
            isolation: options,
        };
        let vars = enforcement.env(4, &settings);
        let carried = |want: (&str, &str)| vars.iter().any(|(k, v)| (*k, v.as_str()) == want);
        ensure_each!(
            format!("{mode}: {vars:?}"),
            carried((env::ISOLATION_CONTEXT_MIB, "640")),
            carried((env::ISOLATION_MANAGED_MEMORY, "ignore")),
        );
        let (argv, _, options) = parsed(&render_args(&["--set", &set_mode, "-f", zero])?, mode)?;
        ensure_has(&argv, &["--isolation-context-mib=0"]).context(mode)?;
        ensure!(options.context_mib == Some(0), "{mode}");
        // Another isolation mode: the settings are the interposer's, so no flags.
        for other in ["none", "mps", "toolkit"] {
            let isolation = format!("isolation.mode={other}");
            let rendered = render_sets(&[&set_mode, &isolation, context_mib, managed])?;
            let argv = plugin_argv(&rendered, mode)?;
            ensure_lacks(&argv, &SETTINGS).with_context(|| format!("{mode}/{other}"))?;
        }
    }
    Ok(())
}

/// DRA mode: the plugin is probed on its own paths on the port it listens on (it is ready
/// once kubelet registered the driver); the binary accepts the chart's args, and
/// `dra.probePort` moves the flag and the port together.
#[test]
fn the_dra_plugin_is_probed_where_it_listens() -> anyhow::Result<()> {
    use clap::Parser as _;
    use gpushare_dra_plugin::probes::{HEALTHZ, READYZ};
    for (sets, port) in [("mode=dra", 9402), ("mode=dra dra.probePort=9555", 9555)] {
        let rendered = render_sets(&words(sets))?;
        let spec = rendered.hardened_pod_spec("DaemonSet", "gpushare-dra-plugin")?;
        let c = container(spec, "dra-plugin")?;
        // NODE_NAME comes from the downward API; everything else from the chart.
        let argv = plugin_argv(&rendered, "dra")?;
        let config = gpushare_dra_plugin::Config::try_parse_from(&argv);
        let config = config.with_context(|| format!("the binary refuses {argv:?}"))?;
        let addr = config.probe_addr;
        // kubelet probes the pod IP, not loopback.
        let listens = addr.port() == port && addr.ip().is_unspecified();
        ensure!(listens, "{addr:?}");
        ensure!(has_port(&c["ports"], "probes", port), "{}", c["ports"]);
        check_probes(c, "probes", [READYZ, HEALTHZ])?;
        // Readiness notices the registration within seconds: the rollout waits no longer.
        let readiness = &c["readinessProbe"];
        let period = readiness["periodSeconds"].as_u64().unwrap_or(10);
        ensure!(period <= 5, "{readiness}");
    }
    Ok(())
}

/// Cases `--set value => what the error says`: the schema refuses most first, naming the path;
/// the templates' messages stay for `--skip-schema-validation`.
#[test]
fn impossible_values_fail_with_a_clear_message() -> anyhow::Result<()> {
    for case in [
        "scheduler.mode=both => scheduler.mode must be",
        "policy=random => policy must be",
        r#"mode=both => mode must be "extender" or "dra""#,
        "devicePlugin.enforcement.mode=cgroup => enforcement.mode must be",
        "extender.replicas=0 => extender.replicas must be at least 1",
        "extender.filterKeepBest=-1 => extender.filterKeepBest must be 0",
        "networkPolicy.enabled=true,scheduler.mode=default-scheduler => needs networkPolicy.schedulerPeers",
        "metrics.serviceMonitor.enabled=true => monitoring.coreos.com/v1",
        "isolation.contextMiB=1048577 => isolation.contextMiB must be empty",
        "isolation.contextMiB=1.5 => isolation.contextMiB must be empty",
        r#"isolation.managedMemory=off => isolation.managedMemory must be "charge" or "ignore""#,
    ] {
        let (set, needle) = case.split_once(" => ").context("a case")?;
        let key = set.split_once('=').map_or(set, |(key, _)| key);
        let by_schema = format!("at '/{}'", key.replace('.', "/"));
        let rendered = helm_template("x", KUBE_VERSION, &["--set", set]);
        refusal(rendered, set, &[needle, &by_schema])?;
    }
    Ok(())
}

#[test]
fn a_misspelt_field_is_reported_with_its_path() {
    let container = json!({"name": "c", "securityContext": {"readOnlyRootFileSystem": true}});
    let doc = json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
        "spec": {"selector": {"matchLabels": {"a": "b"}},
            "template": {"spec": {"containers": [container]}}}});
    let err = round_trip::<Deployment>(&doc).unwrap_err().to_string();
    let path = ".spec.template.spec.containers[0].securityContext.readOnlyRootFileSystem";
    assert!(err.contains(path), "{err}");
}

/// The values of values.yaml, by dotted path: maps of settings are walked; lists and
/// free-form maps such as `resources` are one entry.
fn value_leaves() -> anyhow::Result<Vec<String>> {
    fn leaves(prefix: &str, value: &Value, out: &mut Vec<String>) {
        match value {
            Value::Object(map) if !map.is_empty() && !prefix.ends_with("resources") => {
                for (key, child) in map {
                    let path = format!("{prefix}.{key}");
                    leaves(path.trim_start_matches('.'), child, out);
                }
            }
            _ => out.push(prefix.to_owned()),
        }
    }
    let values = chart_file("values.yaml")?;
    let mut keys = Vec::new();
    leaves("", &serde_yaml::from_str(&values)?, &mut keys);
    Ok(keys)
}

/// Every value in values.yaml is in values.schema.json (so helm checks it) and the README's
/// table; a typo'd key or a value of the wrong type fails `helm template`, naming it.
#[test]
fn every_value_is_in_the_schema_and_the_readme_and_typos_fail_by_name() -> anyhow::Result<()> {
    let schema: Value = serde_json::from_str(&chart_file("values.schema.json")?)?;
    ensure!(schema["additionalProperties"] == false, "top level is open");
    let readme = chart_file("README.md")?;
    let paths = value_leaves()?;
    let checked = |path: &&String| {
        let mut keys = path.split('.');
        let node = keys.try_fold(&schema, |node, key| node["properties"].get(key));
        node.is_some_and(|node| !node["type"].is_null())
    };
    let unchecked: Vec<_> = paths.iter().filter(|path| !checked(path)).collect();
    ensure!(unchecked.is_empty(), "no schema for {unchecked:?}");
    let documented = |path: &&String| readme.contains(&format!("| `{path}` |"));
    let undocumented: Vec<_> = paths.iter().filter(|path| !documented(path)).collect();
    ensure!(undocumented.is_empty(), "README lacks {undocumented:?}");
    for (set, named) in [
        ("extender.replica=3", "'replica' not allowed"),
        ("extender.replicas=two", "/extender/replicas"),
        ("isolation.overShare=kill", "/isolation/overShare"),
        ("devicePlugin.usage.enabledd=true", "'enabledd' not allowed"),
    ] {
        refusal(render_sets(&[set]), &format!("--set {set}"), &[named])?;
    }
    Ok(())
}

/// The chart renders for the Kubernetes it states (its allocation policy is the GA
/// ValidatingAdmissionPolicy of 1.30) and refuses older ones, naming the minimum.
#[test]
fn the_chart_renders_for_the_kubernetes_it_states_and_refuses_older() -> anyhow::Result<()> {
    let oldest = helm_template("x", "1.30.0", &[]).context("1.30")?;
    let policy = "apiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingAdmissionPolicy";
    let rendered = oldest.contains(policy);
    ensure!(rendered, "the allocation policy does not render on 1.30");
    let older = helm_template("x", "1.29.9", &[]);
    let what = "1.29 (to be refused naming the minimum)";
    refusal(older, what, &[">=1.30.0"])?;
    Ok(())
}

/// GitOps tools (Argo CD, Flux) render the chart without cluster access, so `lookup` finds
/// nothing and generated keys would change on every sync. With every Secret supplied, two
/// renders are byte-identical and hold no key material, and the Secrets named are mounted.
#[test]
fn with_existing_secrets_two_renders_are_identical() -> anyhow::Result<()> {
    let supplied = words(
        "--set=extender.tls.existingSecret=serving --set=allocationSigning.existingSecret=signing \
         --set=extender.tls.clientAuth.existingSecret=callers",
    );
    let text = |extra: &[&str]| render_text(RELEASE, RELEASE_NAMESPACE, extra);
    // Without them, keys are generated: the renders differ (the test can tell).
    ensure!(text(&[])? != text(&[])?, "generated keys differ per render");
    let first = text(&supplied)?;
    ensure!(first == text(&supplied)?, "two renders differ");
    let secrets = render_args(&supplied)?.of_kind("Secret").len();
    ensure!(secrets == 0, "no Secret is generated, got {secrets}");
    for name in ["serving", "callers", "signing"] {
        let mounted = first.contains(&format!("secretName: {name}\n"));
        ensure!(mounted, "Secret {name} is not mounted");
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
            let lists = ["containers", "initContainers"].map(|list| spec[list].as_array());
            for container in lists.into_iter().flatten().flatten() {
                images.push(container["image"].as_str().unwrap_or_default());
                let args = container["args"].as_array().into_iter().flatten();
                images.extend(args.filter_map(|arg| arg.as_str()?.strip_prefix("--probe-image=")));
            }
        }
        ensure!(images.len() >= 3, "{mode}: {images:?}");
        let moved = |image: &&str| image.starts_with("mirror.corp:5000/");
        let elsewhere: Vec<&str> = images.iter().copied().filter(|i| !moved(i)).collect();
        ensure!(elsewhere.is_empty(), "{mode}: not moved: {elsewhere:?}");
        // The registry host is replaced, not prefixed.
        let replaced = images.contains(&"mirror.corp:5000/kube-scheduler:v1.36.0");
        ensure!(replaced, "{mode}: {images:?}");
    }
    Ok(())
}

/// The dedicated profile stops kube-scheduler's filtering at 1 % of the nodes (its floor of
/// 100) by default, so the extender gets a quarter of the names of the adaptive walk at 1,000
/// nodes; 0 gives the adaptive walk back, and values kube-scheduler would refuse fail to render.
#[tokio::test]
async fn the_dedicated_profile_scores_a_share_of_the_nodes() -> anyhow::Result<()> {
    let share = |value: &str| vec![format!("scheduler.percentageOfNodesToScore={value}")];
    for (values, walk) in [(vec![], 100), (share("0"), 420), (share("50"), 500)] {
        let text = dedicated_scheduler_configuration(&[], &values).await?;
        let percentage = driver(&text)?.percentage_of_nodes_to_score;
        let walked = num_feasible_nodes_to_find_at(1000, percentage);
        ensure!(walked == walk, "{values:?}: walks {walked}\n{text}");
    }
    // The schema refuses these first, naming the value; the template's own check stays for
    // `--skip-schema-validation`.
    let why = [
        "must be a whole number from 0",
        "at '/scheduler/percentageOfNodesToScore'",
    ];
    for bad in ["101", "-1", "2.5", "many"] {
        let rendered = dedicated_scheduler_configuration(&[], &share(bad)).await;
        refusal(rendered, &format!("share {bad}"), &why)?;
    }
    Ok(())
}

/// `extender.filterKeepBest` (1 by default) reaches the extender with prioritize's weight and
/// turns off the score plugins its ranking ignores; under a kube-scheduler the chart does not
/// configure, or with `scheduler.nativeGpuScoring`, the extender keeps every fitting node.
#[tokio::test]
async fn keep_best_matches_the_profile_it_ranks_for() -> anyhow::Result<()> {
    let default = extender_args(&render_sets(&["scheduler.extender.weight=3"])?)?;
    ensure_has(&default, &["--filter-keep-best=1", "--prioritize-weight=3"])?;
    let profile = dedicated_scheduler_configuration(&[], &[]).await?;
    let want = json!({"profiles": [{"plugins": {"score": {"disabled": [{"name": "ImageLocality"}]}},
        "pluginConfig": [{"name": "PodTopologySpread",
            "args": {"defaultingType": "List", "defaultConstraints": null}}]}]});
    ensure_matches(&serde_yaml::from_str(&profile)?, &want).context(profile)?;
    let off = ["extender.filterKeepBest=0".to_owned()];
    let off = dedicated_scheduler_configuration(&[], &off).await?;
    for plugin in ["ImageLocality", "PodTopologySpread"] {
        ensure!(!off.contains(plugin), "{plugin}: {off}");
    }
    for sets in [
        &["policy=binpack", "scheduler.nativeGpuScoring=true"][..],
        &["scheduler.mode=default-scheduler"][..],
    ] {
        let args = extender_args(&render_sets(sets)?)?;
        ensure_has(&args, &["--filter-keep-best=0"]).with_context(|| format!("{sets:?}"))?;
    }
    Ok(())
}

/// `scheduler.nativeGpuScoring` (binpack only; refused with another policy) scores GPU memory
/// with `NodeResourcesFit` MostAllocated instead of prioritize; without it, every policy ranks
/// through the extender with upstream's resource scoring.
#[tokio::test]
async fn native_gpu_scoring_replaces_prioritize_for_binpack_only() -> anyhow::Result<()> {
    let native_values = ["scheduler.nativeGpuScoring=true".to_owned()];
    let policy = |name: &str| [format!("--policy={name}")];
    let native = dedicated_scheduler_configuration(&policy("binpack"), &native_values).await?;
    let config = driver(&native)?;
    let most_allocated = FitScoring {
        strategy: FitStrategy::MostAllocated,
        resources: vec![("example.com/gpu-mem".to_owned(), 1)],
    };
    ensure_each!(
        native,
        config.fit_scoring == most_allocated,
        config.extenders.iter().all(|e| e.prioritize_verb.is_none()),
    );
    for name in ["binpack", "spread", "fragmentation"] {
        let text = dedicated_scheduler_configuration(&policy(name), &[]).await?;
        let config = driver(&text)?;
        let extenders = &config.extenders;
        ensure_each!(
            format!("{name}: {text}"),
            config.fit_scoring == FitScoring::default(),
            extenders.len() == 1,
            extenders[0].prioritize_verb.as_deref() == Some("prioritize"),
            extenders[0].weight == 1,
        );
    }
    let fragmentation = policy("fragmentation");
    let rendered = dedicated_scheduler_configuration(&fragmentation, &native_values).await;
    let why = ["needs the extender's prioritize"];
    refusal(rendered, "fragmentation", &why)?;
    Ok(())
}

/// `extender.tls.clientAuth`: the replicas mount the client CA and their own certificate; an
/// upgrade that finds no client Secret (`--is-upgrade` finds none) renders a ten-minute grace;
/// turned off, nothing of it is rendered and the scheduler presents no certificate.
#[test]
fn client_certificates_guard_the_scheduler_port() -> anyhow::Result<()> {
    let installed = render_sets(&[])?;
    ensure_lacks(&extender_args(&installed)?, &["--accept-uncertified-until"])
        .context("an install needs no grace")?;
    let pod = installed.pod_spec("Deployment", "gpushare-extender")?;
    let items = &named(&pod["volumes"], "client-tls")["secret"]["items"];
    let item = |file| json!({"key": file, "path": file});
    let own = json!([item("ca.crt"), item("extender.crt"), item("extender.key")]);
    ensure_matches(items, &own).context("the client-tls volume")?;
    let secret: Secret = installed.get("Secret", "gpushare-extender-client-tls")?;
    let data = secret.data.unwrap_or_default();
    let names: Vec<&String> = data.keys().collect();
    let all = words("ca.crt extender.crt extender.key scheduler.crt scheduler.key");
    ensure!(names == all, "{names:?}");
    let upgraded = extender_args(&render_args(&["--is-upgrade"])?)?;
    let grace = "--accept-uncertified-until=";
    let until = upgraded.iter().find_map(|a| a.strip_prefix(grace));
    let until = until.context("the first upgrade with client certificates renders the grace")?;
    let until: jiff::Timestamp = until.parse()?;
    let minutes = until.duration_since(jiff::Timestamp::now()).as_secs() / 60;
    ensure!((8..=10).contains(&minutes), "grace ends in {minutes} min");
    let off = render_sets(&["extender.tls.clientAuth.enabled=false"])?;
    let secret = off.object("Secret", "gpushare-extender-client-tls");
    ensure!(secret.is_err(), "the client Secret is rendered: {secret:?}");
    let client = ["--client-ca", "--leader-forward-cert"];
    ensure_lacks(&extender_args(&off)?, &client)?;
    let text = scheduler_config_text(&off, "gpushare-scheduler")?;
    ensure!(!text.contains("certFile"), "{text}");
    Ok(())
}

/// `promtool check rules` of `file`: its output, which must count `rules` rules.
fn check_rules(file: &Path, rules: usize) -> anyhow::Result<String> {
    let args = ["check".as_ref(), "rules".as_ref(), file.as_os_str()];
    let checked = run_ok(&tools::promtool()?, &args)?;
    let counted = checked.contains(&format!("SUCCESS: {rules} rules found"));
    ensure!(counted, "{checked}");
    Ok(checked)
}

/// The chart's alerts, rendered as a PrometheusRule, pass `promtool check rules` and the unit
/// tests of tests/alerts.test.yaml (see `check_alerts`), with the labels given.
#[test]
fn the_alerts_pass_promtool_and_their_unit_tests() -> anyhow::Result<()> {
    let values = words(
        "--api-versions=monitoring.coreos.com/v1 --set=monitoring.prometheusRule.enabled=true \
         --set-string=monitoring.prometheusRule.labels.release=kps \
         --set=metrics.serviceMonitor.enabled=true",
    );
    let rendered = render("prod", "gpu-system", &values)?;
    // The alerts name a device plugin's node by the `node` label its ServiceMonitor adds, and
    // a workload's pod by the series' own `pod` (honorLabels keeps it from `exported_pod`).
    let plugin_monitor = rendered.object("ServiceMonitor", "prod-gpushare-device-plugin")?;
    let endpoint = &plugin_monitor["spec"]["endpoints"][0];
    let mut relabelings = endpoint["relabelings"].as_array().into_iter().flatten();
    let node = json!(["__meta_kubernetes_pod_node_name"]);
    ensure_each!(
        endpoint,
        endpoint["honorLabels"] == true,
        relabelings.any(|r| r["sourceLabels"] == node && r["targetLabel"] == "node"),
    );
    let rule = check_alerts(&rendered, "alerts.yaml", "alerts.test.yaml")?;
    // monitoring.prometheusRule.labels reach the rule.
    let want = json!({"name": "prod-gpushare-alerts", "namespace": "gpu-system",
        "labels": {"release": "kps"}});
    ensure_matches(&rule["metadata"], &want)
}

/// The one PrometheusRule of `rendered`: its groups are `files/{rules}`; each alert is named
/// once, with a critical or warning severity, a summary and a description; beside
/// `tests/{tests}` they pass promtool's checks and tests, each alert fired by one, quiet in one.
fn check_alerts<'r>(rendered: &'r Rendered, rules: &str, tests: &str) -> anyhow::Result<&'r Value> {
    let found = rendered.of_kind("PrometheusRule");
    ensure!(found.len() == 1, "one PrometheusRule, not {}", found.len());
    let prometheus_rule = found[0];
    check_all_typed([prometheus_rule])?;
    let groups = &prometheus_rule["spec"]["groups"];
    let (rules_file, tests_file) = (format!("files/{rules}"), format!("tests/{tests}"));
    let same = serde_yaml::from_str::<Value>(&chart_file(&rules_file)?)?["groups"] == *groups;
    ensure!(same, "the rendered groups differ from files/{rules}");
    let mut alerts = BTreeSet::new();
    for group in groups.as_array().context("groups")? {
        for rule in group["rules"].as_array().context("rules")? {
            let name = rule["alert"].as_str().context("a rule that is no alert")?;
            let severity = rule["labels"]["severity"].as_str();
            let known = matches!(severity, Some("critical" | "warning"));
            ensure!(known, "{name}: severity {severity:?}");
            for annotation in ["summary", "description"] {
                let text = rule["annotations"][annotation].as_str();
                let text = text.is_some_and(|text| !text.trim().is_empty());
                ensure!(text, "{name} has no {annotation}");
            }
            ensure!(alerts.insert(name.to_owned()), "{name} twice");
        }
    }
    // The rendered groups being files/{rules}'s, promtool reads them there, beside the tests.
    check_rules(&chart_dir().join(rules_file), alerts.len())?;
    let tests_path = chart_dir().join(&tests_file);
    let args = ["test".as_ref(), "rules".as_ref(), tests_path.as_os_str()];
    run_ok(&tools::promtool()?, &args)?;
    let cases: serde_yaml::Value = serde_yaml::from_str(&chart_file(&tests_file)?)?;
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
    ensure!(never_fired.is_empty(), "no test fires {never_fired:?}");
    ensure!(never_quiet.is_empty(), "no quiet test for {never_quiet:?}");
    Ok(prometheus_rule)
}

/// files/`file` names at least `at_least` gpushare metrics, and only ones in `exported`.
fn ensure_exported(file: &str, at_least: usize, exported: &BTreeSet<String>) -> anyhow::Result<()> {
    let used = metric_names_in(&chart_file(&format!("files/{file}"))?);
    let enough = used.len() >= at_least;
    ensure!(enough, "files/{file}: under {at_least} metrics: {used:?}");
    let unknown: Vec<_> = used.difference(exported).collect();
    let known = unknown.is_empty();
    ensure!(known, "files/{file}: metrics nobody exports: {unknown:?}");
    Ok(())
}

/// The metric names the binaries export as PromQL sees them (counters with `_total`, histograms
/// as `_bucket`, `_sum`, `_count`). A labelled family is encoded only with a series, so each
/// gets one; one forgotten is caught by counting the registry's descriptors.
fn exported_metrics() -> anyhow::Result<BTreeSet<String>> {
    use gpushare_contract::{DEFAULT_DOMAIN, DEFAULT_RESOURCE};
    use gpushare_device_plugin::metrics::{
        ContainerGpuLabels, ContainerUseLabels, GpuLabels, GpuModelLabels, PodGpuLabels,
    };
    use gpushare_extender::{Settings, View, scheduling::gauges};
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
    let p = &gpushare_device_plugin::metrics::Metrics::new(&mut registry);
    p.allocate_error("no_pending_pod");
    for family in [&p.pod_patches, &p.node_patches, &p.usage_patches] {
        gpushare_device_plugin::metrics::Metrics::patch(family, true);
    }
    p.kubelet_mismatch("wrong_gpu");
    // One series in each labelled family: `labels => families;`.
    macro_rules! one_series {
        ($($labels:expr => $($family:ident)+;)+) => {
            $($(p.$family.get_or_create(&$labels).set(0);)+)+
        };
    }
    let s = |value: &str| value.to_owned();
    one_series! {
        GpuLabels { gpu: s("0"), uuid: s("GPU-0") } =>
            gpu_allocated_bytes gpu_used_bytes gpu_unattributed_bytes gpu_healthy;
        GpuModelLabels { gpu: s("0"), uuid: s("GPU-0"), model: s("Tesla T4") } =>
            gpu_capacity_bytes;
        PodGpuLabels { namespace: s("ml"), pod: s("a"), gpu: s("0") } =>
            pod_allocated_bytes pod_used_bytes;
        ContainerGpuLabels { namespace: s("ml"), pod: s("a"), container: s("main"), gpu: 0 } =>
            isolated_share_bytes isolated_used_bytes isolated_refused_allocations;
        ContainerUseLabels { namespace: s("ml"), pod: s("a"), container: s("main"), gpu: s("0") } =>
            container_used_bytes container_over_share_bytes;
    }
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry)?;
    let registered = format!("{registry:?}").matches("Descriptor {").count();
    let encoded = text.lines().filter(|l| l.starts_with("# TYPE ")).count();
    ensure!(
        registered == encoded,
        "{registered} metrics registered, {encoded} encoded: give the new labelled family a series in exported_metrics()"
    );
    // The extender's per-GPU gauges are written from its view at scrape time, not registered
    // families: described with or without series, so counted apart.
    let settings = Settings::new(DEFAULT_RESOURCE, DEFAULT_DOMAIN, "gpushare=true");
    let view = std::sync::RwLock::new(View::new(settings));
    let empty = prometheus_client::registry::Registry::default();
    text.extend(gauges::exposition(&empty, &view)?);
    let mut names = BTreeSet::new();
    for described in text.lines().filter_map(|line| line.strip_prefix("# TYPE ")) {
        let (name, kind) = described.split_once(' ').context("a TYPE line")?;
        let suffixes: &[&str] = match kind {
            "counter" => &["_total"],
            "histogram" => &["_bucket", "_sum", "_count"],
            _ => &[""],
        };
        names.extend(suffixes.iter().map(|suffix| format!("{name}{suffix}")));
    }
    ensure!(names.len() > 40, "too few metrics found: {names:?}");
    Ok(names)
}

/// The `gpushare_…` metric names in `text`: words of PromQL's name characters starting with
/// `gpushare_`, but Rust paths (`gpushare_runtime::…`) and `*` patterns (`gpushare_container_*`).
fn metric_names_in(text: &str) -> BTreeSet<String> {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut names = BTreeSet::new();
    for (at, _) in text.match_indices("gpushare_") {
        let (before, word) = text.split_at(at);
        let (word, after) = word.split_at(word.find(|c: char| !is_name(c)).unwrap_or(word.len()));
        let path_or_pattern = after.starts_with("::") || after.starts_with('*');
        if !before.ends_with(is_name) && !path_or_pattern {
            names.insert(word.to_owned());
        }
    }
    names
}

/// The alerts use only metrics the binaries export, and docs/operating.md's tables list every
/// one of them and name no other.
#[test]
fn the_alerts_and_the_operating_guide_name_only_metrics_that_exist() -> anyhow::Result<()> {
    let exported = exported_metrics()?;
    ensure_exported("alerts.yaml", 10, &exported)?;
    let guide = chart_file("../../docs/operating.md")?;
    let unlisted = exported.iter().filter(|n| !listed_in_guide(&guide, n));
    let unlisted: Vec<_> = unlisted.collect();
    ensure!(unlisted.is_empty(), "docs/operating.md lacks {unlisted:?}");
    let histogram = |n: &String| exported.contains(&format!("{n}_bucket"));
    let mut not_exported = metric_names_in(&guide);
    not_exported.retain(|n| !exported.contains(n) && !histogram(n));
    let none = not_exported.is_empty();
    ensure!(none, "the guide names unexported {not_exported:?}");
    Ok(())
}

/// Every component serving /metrics gets a ServiceMonitor (`monitored`): the extender and the
/// device plugin, or in DRA mode the extender, whose alerts-dra.yaml passes promtool and uses
/// exported metrics only; DRA mode without ranking says it has nothing to monitor.
#[test]
fn both_modes_monitor_every_component_that_serves_metrics() -> anyhow::Result<()> {
    let monitoring = words(
        "--api-versions=monitoring.coreos.com/v1 --set=metrics.serviceMonitor.enabled=true \
         --set=monitoring.prometheusRule.enabled=true",
    );
    let extender_mode = monitored(&render_args(&monitoring)?)?;
    let want = ["gpushare-device-plugin", "gpushare-extender"];
    ensure!(extender_mode == want, "extender mode: {extender_mode:?}");
    let dra = render_dra(&monitoring)?;
    check_all_typed(dra.of_kind("ServiceMonitor"))?;
    let dra_mode = monitored(&dra)?;
    ensure!(dra_mode == ["gpushare-extender"], "DRA mode: {dra_mode:?}");
    check_alerts(&dra, "alerts-dra.yaml", "alerts-dra.test.yaml")?;
    ensure_exported("alerts-dra.yaml", 1, &exported_metrics()?)?;
    for key in ["metrics.serviceMonitor", "monitoring.prometheusRule"] {
        let key = format!("{key}.enabled");
        let set = format!("--set={key}=true");
        let ranking = "--set=dra.scheduler.ranking=false";
        let rendered = render_dra(&["--api-versions=monitoring.coreos.com/v1", ranking, &set]);
        let what = format!("DRA mode without ranking with {key}");
        let err = refusal(rendered, &what, &[&format!("{key}: nothing to")])?;
        ensure!(err.contains("dra.scheduler.ranking"), "{key}: {err}");
    }
    Ok(())
}

/// The rendered ServiceMonitors' names, sorted; each selects exactly one rendered Service and
/// scrapes `/metrics` on a port it names.
fn monitored(rendered: &Rendered) -> anyhow::Result<Vec<String>> {
    let mut names = Vec::new();
    for monitor in rendered.of_kind("ServiceMonitor") {
        let name = monitor["metadata"]["name"].as_str().context("unnamed")?;
        let spec = &monitor["spec"];
        let labels = spec["selector"]["matchLabels"].as_object();
        let labels = labels.with_context(|| format!("{name}: no matchLabels"))?;
        let namespaces = spec["namespaceSelector"]["matchNames"].as_array();
        let namespaces = namespaces.with_context(|| format!("{name}: no namespaces"))?;
        let selects = |s: &&Value| {
            let labelled = |(key, value): (&String, &Value)| s["metadata"]["labels"][key] == *value;
            labels.iter().all(labelled) && namespaces.contains(&s["metadata"]["namespace"])
        };
        let mut services = rendered.of_kind("Service");
        services.retain(selects);
        let count = services.len();
        ensure!(count == 1, "{name} selects {count} Services");
        let endpoint = &spec["endpoints"][0];
        ensure!(endpoint["path"] == "/metrics", "{name}: {endpoint}");
        let (port, service) = (endpoint["port"].as_str().unwrap_or_default(), services[0]);
        let has_port = named(&service["spec"]["ports"], port).is_object();
        let service = &service["metadata"]["name"];
        ensure!(has_port, "{name}: Service {service} has no port {port}");
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
    let text = chart_file("files/dashboard.json")?;
    serde_json::from_str(&text).context("files/dashboard.json is no JSON")
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
    let variables = dashboard["templating"]["list"].as_array();
    let variables = variables.into_iter().flatten();
    let named = variables.filter_map(|variable| Some((variable["name"].as_str()?, variable)));
    named.collect()
}

/// Every PromQL expression of the dashboard, named: each panel target's `expr`, and the
/// series selector of each query variable, which must be `label_values(selector, label)`.
fn dashboard_queries(dashboard: &Value) -> anyhow::Result<Vec<(String, String)>> {
    let mut queries = Vec::new();
    for panel in dashboard_panels(dashboard) {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str();
            let expr =
                expr.with_context(|| format!("panel {}: a target without expr", panel["title"]))?;
            let ref_id = target["refId"].as_str().unwrap_or("?");
            queries.push((format!("panel_{}_{ref_id}", panel["id"]), expr.to_owned()));
        }
    }
    let variables = dashboard_variables(dashboard).into_iter();
    for (name, variable) in variables.filter(|(_, v)| v["type"] == "query") {
        let query = &variable["query"];
        let query = query["query"].as_str().or(query.as_str());
        let query = query.with_context(|| format!("variable {name} has no query"))?;
        let args = query.trim().strip_prefix("label_values(");
        let selector = args.and_then(|args| Some(args.strip_suffix(')')?.rsplit_once(',')?.0));
        let what = "is no label_values(selector, label)";
        let selector = selector.with_context(|| format!("variable {name}: {query} {what}"))?;
        queries.push((format!("variable_{name}"), selector.trim().to_owned()));
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

/// `expr` with the dashboard's variables replaced by what Grafana could put there ("All"'s
/// regex, a duration for the built-in intervals); fails on a reference to anything else.
fn with_legal_values(expr: &str, variables: &BTreeMap<&str, &Value>) -> anyhow::Result<String> {
    let mut parts = expr.split('$');
    let mut out = parts.next().unwrap_or_default().to_owned();
    for part in parts {
        let Some((name, len)) = variable_reference(part) else {
            out.extend(["$", part]);
            continue;
        };
        let builtin = GRAFANA_BUILTINS.iter().find(|(b, _)| *b == name);
        let value = match (builtin.and_then(|(_, value)| *value), variables.get(name)) {
            (Some(value), _) => value,
            (None, Some(variable)) if variable["type"] == "query" => {
                variable["allValue"].as_str().unwrap_or(".*")
            }
            _ => bail!("{expr}: ${name} is no query variable of the dashboard"),
        };
        out.extend([value, &part[len..]]);
    }
    Ok(out)
}

/// Whether docs/operating.md's metric tables list `name`: in a row of its own, or for a
/// histogram's `_bucket`, `_sum` and `_count`, in the histogram's row.
fn listed_in_guide(guide: &str, name: &str) -> bool {
    let suffixes = ["_bucket", "_sum", "_count"];
    let histogram = suffixes.iter().find_map(|s| name.strip_suffix(s));
    let in_histogram_row = |h| guide.contains(&format!("| `{h}` | histogram |"));
    guide.contains(&format!("| `{name}` |")) || histogram.is_some_and(in_histogram_row)
}

/// `monitoring.dashboards.enabled` renders files/dashboard.json as it is in a ConfigMap with
/// the label Grafana's sidecar loads and the annotations given; without it, none.
#[test]
fn the_dashboard_renders_for_grafanas_sidecar() -> anyhow::Result<()> {
    let source = dashboard()?;
    let name = "prod-gpushare-dashboard";
    let rendered = render("prod", "gpu-system", &[])?;
    let absent = rendered.object("ConfigMap", name).is_err();
    ensure!(absent, "a dashboard without monitoring.dashboards.enabled");
    let enabled = "--set=monitoring.dashboards.enabled=true";
    let labelled = "--set=monitoring.dashboards.enabled=true \
                    --set=monitoring.dashboards.label=gpu_dashboards \
                    --set-string=monitoring.dashboards.labelValue=yes \
                    --set-string=monitoring.dashboards.annotations.grafana_folder=GPU";
    let folder = json!({ "grafana_folder": "GPU" });
    for (values, label, value, annotations) in [
        (enabled, "grafana_dashboard", "1", Value::Null),
        (labelled, "gpu_dashboards", "yes", folder),
    ] {
        let rendered = render("prod", "gpu-system", &words(values))?;
        let config_map = rendered.object("ConfigMap", name)?;
        check_all_typed([config_map])?;
        let metadata = &config_map["metadata"];
        ensure_each!(
            metadata,
            metadata["namespace"] == "gpu-system",
            metadata["labels"][label] == value,
            metadata["annotations"] == annotations,
        );
        let data = config_map["data"]["gpushare.json"].as_str();
        let data = data.context("no gpushare.json in the ConfigMap")?;
        let rendered: Value =
            serde_json::from_str(data).context("the ConfigMap's dashboard is no JSON")?;
        ensure!(rendered == source, "not files/dashboard.json");
    }
    Ok(())
}

/// Every panel queries Prometheus through the `datasource` variable, as do the node, namespace
/// and model `label_values` variables; every variable referred to is defined; four rows.
#[test]
fn every_dashboard_panel_has_queries_and_every_reference_resolves() -> anyhow::Result<()> {
    let dashboard = dashboard()?;
    let version = &dashboard["schemaVersion"];
    let recent = version.as_u64().is_some_and(|v| v >= 36);
    ensure!(recent, "schemaVersion {version}");
    let variables = dashboard_variables(&dashboard);
    let datasource = variables.get("datasource");
    let datasource = datasource.context("no datasource variable")?;
    let prometheus = datasource["type"] == "datasource" && datasource["query"] == "prometheus";
    ensure!(prometheus, "{datasource}");
    let through_variable = json!({ "type": "prometheus", "uid": "${datasource}" });
    for name in ["node", "namespace", "model"] {
        let variable = variables.get(name);
        let variable = variable.with_context(|| format!("no variable {name}"))?;
        let query = variable["type"] == "query" && variable["datasource"] == through_variable;
        ensure!(query, "{name}: {variable}");
    }
    // Checks that each query variable is a label_values query.
    dashboard_queries(&dashboard)?;
    let mut ids = BTreeSet::new();
    let mut rows = Vec::new();
    for panel in dashboard_panels(&dashboard) {
        let title = panel["title"].as_str().unwrap_or_default();
        ensure!(!title.is_empty(), "panel {} has no title", panel["id"]);
        let id = panel["id"].as_u64();
        let id = id.with_context(|| format!("{title}: no id"))?;
        ensure!(ids.insert(id), "panel id {id} twice");
        let grid = &panel["gridPos"];
        let (x, w) = (grid["x"].as_u64(), grid["w"].as_u64());
        let fits = x.zip(w).is_some_and(|(x, w)| w > 0 && x + w <= 24);
        let fits = fits && grid["h"].as_u64() > Some(0);
        ensure!(fits, "{title}: gridPos {grid}");
        if panel["type"] == "row" {
            rows.push(title);
            continue;
        }
        let datasource = &panel["datasource"];
        let through = *datasource == through_variable;
        ensure!(through, "{title}: datasource {datasource}");
        let targets = panel["targets"].as_array().filter(|t| !t.is_empty());
        let targets = targets.with_context(|| format!("{title}: no targets"))?;
        let mut ref_ids = BTreeSet::new();
        for target in targets {
            let (expr, datasource) = (target["expr"].as_str(), &target["datasource"]);
            let ref_id = target["refId"].as_str().unwrap_or_default();
            ensure_each!(
                format!("{title}: {target}"),
                expr.is_some_and(|e| !e.trim().is_empty()),
                // A refId, and each once.
                ref_ids.insert(ref_id),
                datasource.is_null() || *datasource == through_variable,
            );
        }
    }
    for row in "Cluster|Nodes and GPUs|Namespaces and pods|Control plane".split('|') {
        let found = rows.iter().any(|title| title.starts_with(row));
        ensure!(found, "no row {row}: {rows:?}");
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
        let deprecated = text.contains("[[");
        ensure!(!deprecated, "deprecated [[variable]]: {text}");
    }
    let none = unresolved.is_empty();
    ensure!(none, "references to variables not defined: {unresolved:?}");
    Ok(())
}

/// Every dashboard expression, its variables given values Grafana could give, passes `promtool
/// check rules` as a recording rule (which refuses a broken one, as the first check shows).
#[test]
fn every_dashboard_expression_parses_as_promql() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let check = |name: &str, rules: &[Value]| -> anyhow::Result<String> {
        let file = dir.path().join(name);
        let groups = json!({ "groups": [{ "name": "dashboard", "rules": rules }] });
        std::fs::write(&file, serde_yaml::to_string(&groups)?)?;
        check_rules(&file, rules.len())
    };
    let broken = json!({ "record": "dashboard:broken", "expr": "sum(gpushare_extender_leader" });
    let refused = check("broken.yaml", &[broken]).is_err();
    ensure!(refused, "promtool passed a broken expression");
    let dashboard = dashboard()?;
    let variables = dashboard_variables(&dashboard);
    let mut rules = Vec::new();
    for (name, expr) in dashboard_queries(&dashboard)? {
        let expr = with_legal_values(&expr, &variables)?;
        rules.push(json!({ "record": format!("dashboard:{name}"), "expr": expr }));
    }
    ensure!(!rules.is_empty(), "the dashboard has no expression");
    check("dashboard.yaml", &rules)?;
    Ok(())
}

/// Every expression of the dashboard names a gpushare metric, and each it names is one
/// docs/operating.md's tables list.
#[test]
fn the_dashboard_names_only_metrics_the_operating_guide_lists() -> anyhow::Result<()> {
    let guide = chart_file("../../docs/operating.md")?;
    let mut used = BTreeSet::new();
    for (name, expr) in dashboard_queries(&dashboard()?)? {
        let names = metric_names_in(&expr);
        ensure!(!names.is_empty(), "{name} names no gpushare metric: {expr}");
        used.extend(names);
    }
    used.retain(|name| !listed_in_guide(&guide, name));
    ensure!(used.is_empty(), "docs/operating.md does not list {used:?}");
    Ok(())
}
