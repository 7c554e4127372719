//! The chart's allocation policy (`templates/allocation-policy.yaml`) as the real API server
//! evaluates it: rule by rule, in both scheduler modes, and its `matchConditions` (which only
//! spare the API server work) change no verdict on any kind of write.
//!
//! It runs in an install without the policy (`allocationPolicy.enabled=false`): each variant is
//! rendered by helm, applied under a name of its own, waited for until the API server enforces
//! it, exercised with dry-run writes only (nothing it admits is stored) and deleted again. The
//! callers are the kit's admin and users impersonated with the node claim that a projected
//! ServiceAccount token carries (`authentication.kubernetes.io/node-name`), so the device
//! plugin's own-node rule sees what a kubelet-issued token gives it. The pods opt out of the
//! chart's routing (`<domain>/webhook: skip`), so the policy sees them as written.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use futures::{StreamExt, TryStreamExt, stream};
use gpushare_contract::{DEFAULT_RESOURCE, Keys};
use gpushare_e2e::cluster::{DEVICE_PLUGIN_USER, EXTENDER_USER, wait_for};
use gpushare_e2e::realk8s::KitCluster;
use gpushare_e2e::scenarios::Harness as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde::Deserialize as _;
use serde_json::{Value, json};

use super::words;

/// Nodes named by the probe pods and the impersonated tokens; no kubelet runs them.
const N1: &str = "policy-n1";
const N2: &str = "policy-n2";
const ALICE: &str = "policy-alice";
const DOMAIN: &str = "gpushare.example.com";

/// Who writes: a user (`None`: the kit's admin, not impersonated) and the node its token names.
type Actor = (Option<&'static str>, Option<&'static str>);

/// An API status code and message, or admitted.
type Verdict = Result<(), (u16, String)>;

/// Every write of a variant's run, by `"<write> <pod> by <actor>"`.
type Verdicts = BTreeMap<String, Verdict>;

pub async fn the_allocation_policy_holds_rule_by_rule(c: &KitCluster) -> anyhow::Result<()> {
    let outcome = check(c).await;
    let grants = "rolebinding/gpushare-policy-probe role/gpushare-policy-probe";
    let cleanup = c.kubectl(&words(&format!(
        "delete -n default {grants} node/{N1} node/{N2} --ignore-not-found"
    )));
    outcome.and(cleanup.map(drop))
}

async fn check(c: &KitCluster) -> anyhow::Result<()> {
    grant_pod_writes_and_add_nodes(c)?;
    let mut apis = Vec::new();
    for actor in actors() {
        let api = Api::<Pod>::namespaced(client_for(c, actor).await?, "default");
        apis.push((label(actor), api));
    }
    let admin = apis[0].1.clone();
    let stored = store_old_pods(&admin).await?;
    let mut runs = BTreeMap::new();
    for (mode, sets) in [
        ("default", "scheduler.mode=default-scheduler"),
        ("dedicated", "scheduler.mode=dedicated"),
    ] {
        for (narrowed, scope) in [(true, "narrowed"), (false, "everything")] {
            let name = format!("policy-probe-{mode}-{scope}");
            enforce(c, &admin, sets, narrowed, &name).await?;
            let verdicts = run_writes(&apis, &stored).await;
            retire(c, &admin, &name).await?;
            runs.insert((mode, narrowed), (name, verdicts?));
        }
    }
    for mode in ["default", "dedicated"] {
        let (_, narrowed) = &runs[&(mode, true)];
        let (_, everything) = &runs[&(mode, false)];
        let code = |v: &Verdict| v.as_ref().map_err(|(code, _)| *code).err();
        let differing: Vec<_> = narrowed
            .iter()
            .filter(|(key, v)| everything.get(*key).map(code) != Some(code(v)))
            .map(|(key, v)| format!("{key}: {v:?} against {:?}", everything.get(key)))
            .collect();
        ensure!(
            differing.is_empty() && narrowed.len() == everything.len(),
            "{mode}: the matchConditions change {} verdicts: {differing:#?}",
            differing.len()
        );
    }
    let (default_name, default) = &runs[&("default", true)];
    let (dedicated_name, dedicated) = &runs[&("dedicated", true)];
    let rules = expect_rules(default_name, default, DEFAULT_RULES)?
        + expect_rules(dedicated_name, dedicated, DEDICATED_RULES)?;
    let writes = default.len();
    println!("  allocation policy: {writes} writes per variant, 4 variants; {rules} rules hold");
    Ok(())
}

/// The chart's rules in the harness mode (`default-scheduler`), one a line:
/// `<write> <pod> by <actor> | admitted`, or `| <what the 403's message says>`.
const DEFAULT_RULES: &str = "
# An honest GPU pod is admitted from anyone.
create gpu by admin                                      | admitted
create gpu by policy-alice                               | admitted
create gpu by extender                                   | admitted
# Allocation annotations on create only from gpushare, whatever the pod asks for.
create routed-indexed by admin                           | remove them from the pod
create plain-indexed by policy-alice                     | remove them from the pod
create routed-indexed by extender                        | admitted
# Other keys of the domain, and other domains, are anyone's.
create gpu-own-note by admin                             | admitted
create gpu-other-domain by admin                         | admitted
# A GPU pod (containers or init containers) is never created on a node; a plain one may be.
create gpu-on-node by admin                              | remove spec.nodeName
create init-gpu-on-node by policy-alice                  | remove spec.nodeName
create plain-on-node by admin                            | admitted
# Allocation annotations are not set, changed or removed by hand ...
update index routed-indexed by admin                     | Delete and recreate the pod
update assigned routed-indexed by admin                  | Delete and recreate the pod
update unannotated routed-indexed by admin               | Delete and recreate the pod
update index plain by policy-alice                       | Delete and recreate the pod
# ... while anything else may change.
update other routed-indexed by admin                     | admitted
# gpushare writes them: the extender for any node, the device plugin from its own only.
update unannotated routed-indexed by extender            | admitted
update assigned routed-indexed by extender@policy-n2     | admitted
update index routed-indexed by device-plugin@policy-n1   | admitted
update assigned routed-indexed by device-plugin@policy-n1 | admitted
update assigned routed-indexed by device-plugin@policy-n2 | the gpushare device plugin on node policy-n2 may change only pods bound to that node
update assigned routed-indexed by device-plugin          | this token names none
update assigned unbound by device-plugin@policy-n1       | may change only pods bound
# A status write can change annotations on a real server: the policy sees it.
status index routed-indexed by admin                     | Delete and recreate the pod
status phase routed-indexed by admin                     | admitted
status phase gpu by policy-alice                         | admitted
status other plain by policy-alice                       | admitted
";

/// The chart's default mode (`dedicated`) adds one rule: GPU pods go to gpushare's scheduler.
const DEDICATED_RULES: &str = "
create gpu by admin                                      | set spec.schedulerName: gpushare-scheduler
create init-gpu by policy-alice                          | set spec.schedulerName: gpushare-scheduler
create routed by admin                                   | admitted
create plain by admin                                    | admitted
";

/// Holds `verdicts` to `rules` (a table as [`DEFAULT_RULES`]); returns how many there were.
fn expect_rules(policy: &str, verdicts: &Verdicts, rules: &str) -> anyhow::Result<usize> {
    // The real server's wording, which the docs quote.
    let denied = format!(
        "is forbidden: ValidatingAdmissionPolicy '{policy}' with binding '{policy}' denied request: "
    );
    let rules = rules
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'));
    let mut count = 0;
    for rule in rules {
        let (key, expect) = rule.split_once('|').context("a rule without '|'")?;
        let (key, expect) = (key.trim(), expect.trim());
        let verdict = verdicts
            .get(key)
            .with_context(|| format!("no write {key:?}"))?;
        let holds = match verdict {
            Ok(()) => expect == "admitted",
            Err((403, message)) => message.contains(&denied) && message.contains(expect),
            Err(_) => false,
        };
        ensure!(
            holds,
            "{policy}: {key}: expected {expect:?}, got {verdict:?}"
        );
        count += 1;
    }
    Ok(count)
}

fn actors() -> Vec<Actor> {
    let mut all = vec![(None, None)];
    for user in [ALICE, EXTENDER_USER, DEVICE_PLUGIN_USER] {
        for node in [None, Some(N1), Some(N2)] {
            all.push((Some(user), node));
        }
    }
    all
}

fn label((user, node): Actor) -> String {
    let user = match user {
        None => "admin",
        Some(EXTENDER_USER) => "extender",
        Some(DEVICE_PLUGIN_USER) => "device-plugin",
        Some(other) => other,
    };
    node.map_or(user.to_owned(), |node| format!("{user}@{node}"))
}

async fn client_for(c: &KitCluster, (user, node): Actor) -> anyhow::Result<kube::Client> {
    match user {
        None => Ok(c.client()),
        Some(user) => c.client_as(user, node).await,
    }
}

/// RBAC lets the impersonated users write pods in `default`, so admission alone decides; and
/// nodes [`N1`] and [`N2`] exist (cordoned and tainted, no kubelet behind them), so that the
/// pod garbage collector leaves the pods stored on them alone.
fn grant_pod_writes_and_add_nodes(c: &KitCluster) -> anyhow::Result<()> {
    let subject =
        |user: &str| json!({"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": user});
    let subjects = [ALICE, EXTENDER_USER, DEVICE_PLUGIN_USER].map(subject);
    let meta = json!({"name": "gpushare-policy-probe", "namespace": "default"});
    let taint = json!({"key": "gpushare.example.com/policy-probe", "effect": "NoSchedule"});
    let node = |name: &str| {
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
               "spec": {"unschedulable": true, "taints": [taint]}})
    };
    let objects = json!({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
         "rules": [{"apiGroups": [""], "resources": ["pods", "pods/status"],
                    "verbs": ["get", "create", "update", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                     "name": "gpushare-policy-probe"},
         "subjects": subjects},
        node(N1),
        node(N2),
    ]});
    c.kubectl_stdin(&["apply", "-f", "-"], &objects.to_string())?;
    Ok(())
}

/// The pods the writes create, by name: every shape the rules tell apart.
fn shapes() -> Vec<(&'static str, Value)> {
    let keys = Keys::default();
    let asks = json!({"limits": {DEFAULT_RESOURCE: "4"}});
    let pod = |containers: Value| {
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"labels": {format!("{DOMAIN}/webhook"): "skip"}},
               "spec": {"containers": containers}})
    };
    let plain = pod(json!([{"name": "main", "image": "probe"}]));
    let gpu = pod(json!([{"name": "main", "image": "probe", "resources": asks}]));
    let mut init_gpu = plain.clone();
    init_gpu["spec"]["initContainers"] =
        json!([{"name": "init", "image": "probe", "resources": asks}]);
    // Indexing a JSON object by a missing key (here, `annotations`) adds it.
    let with = |pod: &Value, change: &dyn Fn(&mut Value)| {
        let mut pod = pod.clone();
        change(&mut pod);
        pod
    };
    let annotated =
        |pod: &Value, key: &str| with(pod, &|p| p["metadata"]["annotations"][key] = json!("0"));
    let on_node = |pod: &Value| with(pod, &|p| p["spec"]["nodeName"] = json!(N1));
    let routed = with(&gpu, &|p| {
        p["spec"]["schedulerName"] = json!("gpushare-scheduler")
    });
    vec![
        ("plain-on-node", on_node(&plain)),
        ("gpu-on-node", on_node(&gpu)),
        ("routed-on-node", on_node(&routed)),
        ("init-gpu-on-node", on_node(&init_gpu)),
        ("plain-indexed", annotated(&plain, &keys.gpu_index)),
        ("routed-indexed", annotated(&routed, &keys.gpu_index)),
        (
            "gpu-other-domain",
            annotated(&gpu, "other.example.com/v1.gpu-index"),
        ),
        ("gpu-own-note", annotated(&gpu, &format!("{DOMAIN}/note"))),
        ("plain-other", annotated(&plain, "example.com/other")),
        ("plain", plain),
        ("gpu", gpu),
        ("routed", routed),
        ("init-gpu", init_gpu),
    ]
}

/// Each shape stored on node `policy-n1` (before any policy is enforced), plus `unbound`, a
/// GPU pod with an allocation annotation that no scheduler will place. Returns each as the
/// API server keeps it, by shape.
async fn store_old_pods(admin: &Api<Pod>) -> anyhow::Result<Vec<(String, Value)>> {
    let mut old = shapes();
    for (_, pod) in &mut old {
        pod["spec"]["nodeName"] = json!(N1);
    }
    let mut unbound = routed_indexed();
    unbound["spec"]["schedulerName"] = json!("policy-nobody");
    old.push(("unbound", unbound));
    let mut stored = Vec::new();
    for (shape, mut pod) in old {
        pod["metadata"]["name"] = json!(format!("old-{shape}"));
        let pod: Pod = serde_json::from_value(pod)?;
        let created = admin.create(&PostParams::default(), &pod).await?;
        stored.push((shape.to_owned(), serde_json::to_value(created)?));
    }
    Ok(stored)
}

/// A change made to a stored pod.
type Change = fn(&mut Value, &Keys);

/// One write: a create of a shape, or a replace (of the pod or its status) of a stored pod.
struct Write {
    key: String,
    pod: Pod,
    replace: Option<(String, bool)>,
}

/// The writes each actor makes: a create of every shape, and five changes of every stored pod,
/// through the pod and through its status.
fn writes(stored: &[(String, Value)]) -> anyhow::Result<Vec<Write>> {
    let keys = Keys::default();
    let mut all = Vec::new();
    for (shape, mut pod) in shapes() {
        pod["metadata"]["name"] = json!(format!("probe-{shape}"));
        all.push(Write {
            key: format!("create {shape}"),
            pod: serde_json::from_value(pod)?,
            replace: None,
        });
    }
    for (shape, old) in stored {
        let name = old["metadata"]["name"]
            .as_str()
            .context("stored pod name")?
            .to_owned();
        let changes: [(&str, Change); 5] = [
            ("phase", |pod, _| pod["status"]["phase"] = json!("Running")),
            ("index", |pod, keys| {
                pod["metadata"]["annotations"][&keys.gpu_index] = json!("1")
            }),
            ("assigned", |pod, keys| {
                pod["metadata"]["annotations"][&keys.assigned] = json!("true")
            }),
            ("other", |pod, _| {
                pod["metadata"]["annotations"]["example.com/other"] = json!("y")
            }),
            ("unannotated", |pod, _| {
                if let Some(meta) = pod["metadata"].as_object_mut() {
                    meta.remove("annotations");
                }
            }),
        ];
        for (change, apply) in changes {
            let mut new = old.clone();
            apply(&mut new, &keys);
            for (verb, status) in [("update", false), ("status", true)] {
                all.push(Write {
                    key: format!("{verb} {change} {shape}"),
                    pod: serde_json::from_value(new.clone())?,
                    replace: Some((name.clone(), status)),
                });
            }
        }
    }
    Ok(all)
}

/// Every write by every actor, as dry runs, 16 at a time.
async fn run_writes(
    apis: &[(String, Api<Pod>)],
    stored: &[(String, Value)],
) -> anyhow::Result<Verdicts> {
    let writes = writes(stored)?;
    let jobs = apis
        .iter()
        .flat_map(|(actor, api)| writes.iter().map(move |w| (actor, api, w)));
    stream::iter(jobs)
        .map(|(actor, api, write)| async move {
            let verdict = dry_run(api, write).await?;
            anyhow::Ok((format!("{} by {actor}", write.key), verdict))
        })
        .buffer_unordered(16)
        .try_collect()
        .await
}

async fn dry_run(api: &Api<Pod>, write: &Write) -> anyhow::Result<Verdict> {
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let result = match &write.replace {
        None => api.create(&dry, &write.pod).await,
        Some((name, false)) => api.replace(name, &dry, &write.pod).await,
        Some((name, true)) => api.replace_status(name, &dry, &write.pod).await,
    };
    match result {
        Ok(_) => Ok(Ok(())),
        Err(kube::Error::Api(status)) => Ok(Err((status.code, status.message))),
        Err(other) => bail!("{}: {other}", write.key),
    }
}

/// A GPU pod routed to gpushare's scheduler, with an allocation annotation.
fn routed_indexed() -> Value {
    let mut shapes = shapes().into_iter();
    let found = shapes.find(|(shape, _)| *shape == "routed-indexed");
    found.expect("a routed-indexed shape").1
}

/// A create only gpushare may make: refused by a policy once it is enforced.
async fn forged_create(admin: &Api<Pod>) -> anyhow::Result<Verdict> {
    let mut pod = routed_indexed();
    pod["metadata"]["name"] = json!("probe-enforced");
    let pod = serde_json::from_value(pod)?;
    let write = Write {
        key: "forged".into(),
        pod,
        replace: None,
    };
    dry_run(admin, &write).await
}

/// The chart's policy rendered with `sets`, its `matchConditions` dropped unless `narrowed`,
/// applied as `name` (policy and binding), once the API server enforces it.
async fn enforce(
    c: &KitCluster,
    admin: &Api<Pod>,
    sets: &str,
    narrowed: bool,
    name: &str,
) -> anyhow::Result<()> {
    let only = "--show-only templates/allocation-policy.yaml --set allocationPolicy.enabled=true";
    let rendered = c.release("template", &words(&format!("{only} --set {sets}")))?;
    let mut items = Vec::new();
    for document in serde_yaml::Deserializer::from_str(&rendered) {
        let mut doc = serde_json::to_value(serde_yaml::Value::deserialize(document)?)?;
        if doc.is_null() {
            continue;
        }
        doc["metadata"]["name"] = json!(name);
        if doc["kind"] == "ValidatingAdmissionPolicyBinding" {
            doc["spec"]["policyName"] = json!(name);
        } else if !narrowed {
            let spec = doc["spec"].as_object_mut().context("policy spec")?;
            ensure!(
                spec.remove("matchConditions").is_some(),
                "no matchConditions in {rendered}"
            );
        }
        items.push(doc);
    }
    ensure!(
        items.len() == 2,
        "expected a policy and its binding: {rendered}"
    );
    let list = json!({"apiVersion": "v1", "kind": "List", "items": items});
    c.kubectl_stdin(&["apply", "-f", "-"], &list.to_string())?;
    let by_it = format!("ValidatingAdmissionPolicy '{name}'");
    wait_for(&format!("the API server to enforce {name}"), Duration::from_secs(60), || async {
        matches!(forged_create(admin).await, Ok(Err((403, message))) if message.contains(&by_it))
            .then_some(())
    })
    .await
}

/// Deletes the policy `name` and its binding, and waits until nothing refuses a forged create.
async fn retire(c: &KitCluster, admin: &Api<Pod>, name: &str) -> anyhow::Result<()> {
    let kinds = "validatingadmissionpolicybinding,validatingadmissionpolicy";
    c.kubectl(&["delete", kinds, name])?;
    let what = format!("the API server to drop {name}");
    wait_for(&what, Duration::from_secs(60), || async {
        matches!(forged_create(admin).await, Ok(Ok(()))).then_some(())
    })
    .await
}
