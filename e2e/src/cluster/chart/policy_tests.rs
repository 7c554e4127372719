//! The chart's own rendered allocation policy, rule by rule, as the in-process API server
//! evaluates it ([`crate::apiserver::admission`]).
//!
//! Here, beside the chart's rendering, rather than in the API server: the server evaluates
//! whatever policy it is given and knows nothing of the chart or the harness.

use std::sync::OnceLock;

use serde_json::{Value, json};

use super::{DEVICE_PLUGIN_USER, EXTENDER_USER, render_allocation_policy};
use crate::apiserver::admission::{AdmissionPolicies, AdmissionRequest, Denial, Operation};

const ADMIN: &str = "system:admin";
const INDEX: &str = "gpushare.example.com/v1.gpu-index";
const ASSIGNED: &str = "gpushare.example.com/v1.assigned";

/// The harness's mode (`default-scheduler`), rendered once.
fn policies() -> &'static AdmissionPolicies {
    static POLICIES: OnceLock<AdmissionPolicies> = OnceLock::new();
    POLICIES.get_or_init(|| {
        let yaml = render_allocation_policy(&[]).expect("helm renders the chart");
        AdmissionPolicies::from_yaml(&yaml).expect("the chart's policy loads")
    })
}

/// The chart's default mode (`dedicated`).
fn dedicated() -> &'static AdmissionPolicies {
    static POLICIES: OnceLock<AdmissionPolicies> = OnceLock::new();
    POLICIES.get_or_init(|| {
        let yaml = render_allocation_policy(&["scheduler.mode=dedicated"])
            .expect("helm renders the chart");
        AdmissionPolicies::from_yaml(&yaml).expect("the chart's policy loads")
    })
}

fn gpu_pod(gib: u64) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": "default", "uid": "u1"},
        "spec": {
            "schedulerName": "default-scheduler",
            "containers": [{"name": "main", "image": "x",
                "resources": {"limits": {"example.com/gpu-mem": gib}}}],
        },
    })
}

fn plain_pod() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": "default"},
        "spec": {"schedulerName": "default-scheduler", "containers": [{"name": "main", "image": "x"}]},
    })
}

fn annotate(mut pod: Value, key: &str, value: &str) -> Value {
    pod["metadata"]["annotations"][key] = json!(value);
    pod
}

fn request<'a>(
    operation: Operation,
    user: &'a str,
    subresource: &'a str,
    object: &'a Value,
    old_object: Option<&'a Value>,
) -> AdmissionRequest<'a> {
    AdmissionRequest {
        operation,
        username: user,
        node_claim: None,
        group: "",
        version: "v1",
        resource: "pods",
        subresource,
        kind: "Pod",
        namespace: "default",
        name: "p",
        object,
        old_object,
    }
}

fn create(policies: &AdmissionPolicies, user: &str, pod: &Value) -> Result<(), Denial> {
    policies.admit(&request(Operation::Create, user, "", pod, None))
}

fn update(user: &str, old: &Value, new: &Value) -> Result<(), Denial> {
    policies().admit(&request(Operation::Update, user, "", new, Some(old)))
}

/// An update from `user` holding the token of a pod on `node`.
fn update_from_node(node: &str, user: &str, old: &Value, new: &Value) -> Result<(), Denial> {
    policies().admit(&AdmissionRequest {
        node_claim: Some(node),
        ..request(Operation::Update, user, "", new, Some(old))
    })
}

fn on_node(mut pod: Value, node: &str) -> Value {
    pod["spec"]["nodeName"] = json!(node);
    pod
}

#[test]
fn the_chart_binds_its_policy_to_deny() {
    let policies = policies();
    let bound: Vec<_> = policies.bindings().collect();
    assert_eq!(
        bound,
        [("gpushare-allocations", "gpushare-allocations", true)],
        "{policies:?}"
    );
}

#[test]
fn an_honest_gpu_pod_is_admitted_from_anyone() {
    for user in [ADMIN, "alice", EXTENDER_USER] {
        assert_eq!(create(policies(), user, &gpu_pod(4)), Ok(()), "{user}");
    }
}

#[test]
fn allocation_annotations_on_create_are_refused_unless_gpushare_writes_them() {
    let forged = annotate(gpu_pod(4), INDEX, "0");
    let denial = create(policies(), ADMIN, &forged).unwrap_err();
    assert_eq!(denial.code(), 403);
    assert_eq!(denial.status_reason(), "Forbidden");
    assert_eq!(denial.binding, "gpushare-allocations");
    assert!(
        denial.message.contains("remove them from the pod"),
        "{denial:?}"
    );
    assert_eq!(
        denial.status_message("pods", "p"),
        format!(
            "pods \"p\" is forbidden: ValidatingAdmissionPolicy 'gpushare-allocations' with binding 'gpushare-allocations' denied request: {}",
            denial.message
        )
    );
    // On a pod that asks for no GPU too: the keys are gpushare's, whatever the pod.
    assert!(
        create(
            policies(),
            "alice",
            &annotate(plain_pod(), ASSIGNED, "true")
        )
        .is_err()
    );
    assert_eq!(create(policies(), EXTENDER_USER, &forged), Ok(()));
    // Other keys of the domain, and other domains, are anyone's.
    let other = annotate(gpu_pod(4), "gpushare.example.com/note", "x");
    assert_eq!(create(policies(), ADMIN, &other), Ok(()));
    let other = annotate(gpu_pod(4), "other.example.com/v1.gpu-index", "0");
    assert_eq!(create(policies(), ADMIN, &other), Ok(()));
}

#[test]
fn a_gpu_pod_created_on_a_node_is_refused() {
    let mut pod = gpu_pod(4);
    pod["spec"]["nodeName"] = json!("n1");
    let denial = create(policies(), ADMIN, &pod).unwrap_err();
    assert_eq!(denial.code(), 403);
    assert!(
        denial.message.contains("remove spec.nodeName"),
        "{denial:?}"
    );
    // Asking through requests only, or from an init container, counts the same.
    let mut requests = pod.clone();
    requests["spec"]["containers"][0]["resources"] =
        json!({"requests": {"example.com/gpu-mem": 2}});
    assert!(create(policies(), ADMIN, &requests).is_err());
    let mut init = plain_pod();
    init["spec"]["nodeName"] = json!("n1");
    init["spec"]["initContainers"] = json!([{"name": "i", "image": "x",
        "resources": {"limits": {"example.com/gpu-mem": 1}}}]);
    assert!(create(policies(), ADMIN, &init).is_err());
    // A pod that asks for no GPU may name its node; so may an empty nodeName.
    let mut plain = plain_pod();
    plain["spec"]["nodeName"] = json!("n1");
    assert_eq!(create(policies(), ADMIN, &plain), Ok(()));
    let mut empty = gpu_pod(4);
    empty["spec"]["nodeName"] = json!("");
    assert_eq!(create(policies(), ADMIN, &empty), Ok(()));
}

#[test]
fn allocation_annotations_cannot_be_set_changed_or_removed_by_hand() {
    let running = annotate(annotate(gpu_pod(4), INDEX, "0"), ASSIGNED, "true");
    let changed = annotate(running.clone(), INDEX, "1");
    let added = annotate(running.clone(), "gpushare.example.com/v1.pod-gib", "1");
    let mut removed = running.clone();
    removed["metadata"]["annotations"]
        .as_object_mut()
        .unwrap()
        .remove(INDEX);
    let mut all_removed = running.clone();
    all_removed["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("annotations");
    for new in [&changed, &added, &removed, &all_removed] {
        let denial = update(ADMIN, &running, new).unwrap_err();
        assert_eq!(denial.code(), 403);
        assert!(
            denial.message.contains("Delete and recreate the pod"),
            "{denial:?}"
        );
    }
    // Setting them on a pod that had none.
    assert!(update("alice", &gpu_pod(4), &annotate(gpu_pod(4), INDEX, "0")).is_err());
    // Anything else may change while they stay as they are.
    let labelled = {
        let mut pod = running.clone();
        pod["metadata"]["labels"] = json!({"team": "a"});
        annotate(pod, "note", "hello")
    };
    assert_eq!(update(ADMIN, &running, &labelled), Ok(()));
    // gpushare itself writes them: the device plugin from its own node.
    let (running, changed) = (on_node(running, "n1"), on_node(changed, "n1"));
    assert_eq!(
        update_from_node("n1", DEVICE_PLUGIN_USER, &running, &changed),
        Ok(())
    );
    assert_eq!(update(EXTENDER_USER, &running, &removed), Ok(()));
}

#[test]
fn the_device_plugin_changes_only_pods_on_its_own_node() {
    let running = on_node(annotate(gpu_pod(4), INDEX, "0"), "n1");
    let marked = annotate(running.clone(), ASSIGNED, "true");
    assert_eq!(
        update_from_node("n1", DEVICE_PLUGIN_USER, &running, &marked),
        Ok(())
    );
    // The plugin of another node, say one whose host was taken over.
    let denial = update_from_node("n2", DEVICE_PLUGIN_USER, &running, &marked).unwrap_err();
    assert_eq!(denial.code(), 403);
    assert_eq!(
        denial.message,
        "the gpushare device plugin on node n2 may change only pods bound to that node"
    );
    // Its ServiceAccount's token without the node claim (a token minted by hand).
    let denial = update(DEVICE_PLUGIN_USER, &running, &marked).unwrap_err();
    assert!(denial.message.contains("names none"), "{denial:?}");
    // Nor a pod not bound anywhere yet.
    let unbound = annotate(gpu_pod(4), INDEX, "0");
    let unbound_marked = annotate(unbound.clone(), ASSIGNED, "true");
    assert!(update_from_node("n1", DEVICE_PLUGIN_USER, &unbound, &unbound_marked).is_err());
    // Everyone else is unaffected by the claim rule: the extender writes for any node.
    assert_eq!(update(EXTENDER_USER, &running, &marked), Ok(()));
    assert_eq!(
        update_from_node("n2", EXTENDER_USER, &running, &marked),
        Ok(())
    );
}

#[test]
fn status_writes_are_matched_and_bindings_are_not() {
    let running = annotate(gpu_pod(4), INDEX, "0");
    let changed = annotate(running.clone(), INDEX, "1");
    // A status write can change annotations on a real server: the policy sees it.
    let status = request(Operation::Update, ADMIN, "status", &changed, Some(&running));
    assert_eq!(policies().admit(&status).unwrap_err().code(), 403);
    let mut reported = running.clone();
    reported["status"] = json!({"phase": "Running"});
    let status = request(
        Operation::Update,
        ADMIN,
        "status",
        &reported,
        Some(&running),
    );
    assert_eq!(policies().admit(&status), Ok(()));
    let binding = request(
        Operation::Update,
        ADMIN,
        "binding",
        &changed,
        Some(&running),
    );
    assert_eq!(policies().admit(&binding), Ok(()));
    let mut other = request(Operation::Create, ADMIN, "", &changed, None);
    other.resource = "configmaps";
    assert_eq!(policies().admit(&other), Ok(()));
}

#[test]
fn an_evaluation_error_denies() {
    // No containers: `object.spec.containers` does not exist, so `asksForResource` fails.
    let mut broken = gpu_pod(4);
    broken["spec"].as_object_mut().unwrap().remove("containers");
    // Where the rest of an `||` decides without it, the error does not matter (CEL's
    // commutative `||`), as on the real server ...
    assert_eq!(create(policies(), ADMIN, &broken), Ok(()));
    // ... where nothing else decides, failurePolicy Fail denies.
    broken["spec"]["nodeName"] = json!("n1");
    let denial = create(policies(), ADMIN, &broken).unwrap_err();
    assert_eq!(denial.code(), 422);
    assert!(denial.message.contains("resulted in error"), "{denial:?}");
}

#[test]
fn dedicated_mode_requires_the_gpushare_scheduler() {
    let denial = create(dedicated(), ADMIN, &gpu_pod(4)).unwrap_err();
    assert_eq!(denial.code(), 403);
    assert!(
        denial
            .message
            .contains("set spec.schedulerName: gpushare-scheduler"),
        "{denial:?}"
    );
    let mut routed = gpu_pod(4);
    routed["spec"]["schedulerName"] = json!("gpushare-scheduler");
    assert_eq!(create(dedicated(), ADMIN, &routed), Ok(()));
    assert_eq!(create(dedicated(), ADMIN, &plain_pod()), Ok(()));
    // The harness's mode has no such rule.
    assert_eq!(create(policies(), ADMIN, &gpu_pod(4)), Ok(()));
}

/// The policy without its `matchConditions`: every matched request evaluated.
fn unnarrowed(sets: &[&str]) -> AdmissionPolicies {
    let yaml = render_allocation_policy(sets).expect("helm renders the chart");
    let mut documents = Vec::new();
    for document in serde_yaml::Deserializer::from_str(&yaml) {
        let mut doc = <serde_yaml::Value as serde::Deserialize>::deserialize(document).unwrap();
        if let Some(spec) = doc
            .get_mut("spec")
            .and_then(serde_yaml::Value::as_mapping_mut)
        {
            spec.remove("matchConditions");
        }
        documents.push(serde_yaml::to_string(&doc).unwrap());
    }
    AdmissionPolicies::from_yaml(&documents.join("---\n")).expect("the policy loads")
}

/// The `matchConditions` only spare the API server work (a status write that leaves the
/// annotations alone, a pod asking for no GPU, a routed GPU pod): on every kind of request
/// the chart's policy decides as the same policy evaluating everything.
#[test]
fn the_match_conditions_change_no_verdict() {
    let with_status = |pod: &Value| {
        let mut pod = pod.clone();
        pod["status"] = json!({"phase": "Running"});
        pod
    };
    let routed = {
        let mut pod = gpu_pod(4);
        pod["spec"]["schedulerName"] = json!("gpushare-scheduler");
        pod
    };
    let mut no_scheduler_named = gpu_pod(4);
    no_scheduler_named["spec"]
        .as_object_mut()
        .unwrap()
        .remove("schedulerName");
    let mut init_only = plain_pod();
    init_only["spec"]["initContainers"] = json!([{"name": "i", "image": "x",
        "resources": {"requests": {"example.com/gpu-mem": 2}}}]);
    let pods = [
        plain_pod(),
        gpu_pod(4),
        routed.clone(),
        no_scheduler_named,
        init_only,
        on_node(gpu_pod(4), "n1"),
        on_node(routed.clone(), "n1"),
        on_node(plain_pod(), "n1"),
        annotate(plain_pod(), INDEX, "0"),
        annotate(routed.clone(), INDEX, "0"),
        annotate(plain_pod(), "example.com/other", "x"),
    ];
    let users = [
        ADMIN,
        "alice",
        "system:node:n1",
        EXTENDER_USER,
        DEVICE_PLUGIN_USER,
    ];
    for sets in [&[][..], &["scheduler.mode=dedicated"][..]] {
        let narrowed = if sets.is_empty() {
            policies()
        } else {
            dedicated()
        };
        let everything = unnarrowed(sets);
        let verdict = |policies: &AdmissionPolicies, request: &AdmissionRequest<'_>| {
            policies.admit(request).map_err(|denial| denial.code())
        };
        for user in users {
            for node in [None, Some("n1"), Some("n2")] {
                for pod in &pods {
                    let mut created = request(Operation::Create, user, "", pod, None);
                    created.node_claim = node;
                    assert_eq!(
                        verdict(narrowed, &created),
                        verdict(&everything, &created),
                        "{sets:?} create by {user} ({node:?}): {pod}"
                    );
                    let old = on_node(pod.clone(), "n1");
                    let changes = [
                        with_status(&old),
                        annotate(old.clone(), INDEX, "1"),
                        annotate(old.clone(), ASSIGNED, "true"),
                        annotate(old.clone(), "example.com/other", "y"),
                        {
                            let mut removed = old.clone();
                            removed["metadata"]
                                .as_object_mut()
                                .unwrap()
                                .remove("annotations");
                            removed
                        },
                    ];
                    for new in &changes {
                        for subresource in ["", "status"] {
                            let mut updated =
                                request(Operation::Update, user, subresource, new, Some(&old));
                            updated.node_claim = node;
                            assert_eq!(
                                verdict(narrowed, &updated),
                                verdict(&everything, &updated),
                                "{sets:?} update of {subresource:?} by {user} ({node:?}): {old} -> {new}"
                            );
                        }
                    }
                }
            }
        }
    }
}
