//! Mutating admission webhooks, called as the real API server calls them.
//!
//! ```text
//!  create (defaulted) ──▶ for each MutatingWebhookConfiguration in the store
//!     (by name), each webhook in order, that matches:
//!        rules (operation, group, version, resource[/subresource], scope)
//!        namespaceSelector (the namespace's labels: `kubernetes.io/metadata.name`)
//!        objectSelector (the object's labels)
//!     ──POST AdmissionReview v1 (HTTPS, caBundle, `<svc>.<ns>.svc`, ?timeout=Ns)──▶ webhook
//!     ◀── allowed + JSONPatch ── applied; allowed: false ─▶ refused with its status
//!     unreachable / slow / malformed ─▶ failurePolicy Fail (default): 500, Ignore: skipped
//!  ──▶ store (ValidatingAdmissionPolicies are the real tier's: see `mod.rs`)
//! ```
//!
//! Without kube-proxy here, a webhook's `clientConfig.service` reaches a process through
//! [`ServiceRoutes`], which tests fill in (`ApiServer::route_service`) as the Service's
//! endpoints would be. TLS is verified exactly as the real server does: against `caBundle`
//! only, for the name `<service>.<namespace>.svc`, so a webhook with a missing or stale
//! caBundle fails here as it would on a cluster. `reinvocationPolicy: IfNeeded` and
//! `matchConditions` are not evaluated: a configuration that uses them is refused at call
//! time (failing the write) rather than silently run differently.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};

use super::objects::meta_str;
use super::resources::Kind;
use super::status::ApiError;
use super::store::Store;
use super::{Caller, locked};

/// A Service port: (namespace, name, port).
type ServicePort = (String, String, u16);

/// Where a Service's port is served: (namespace, name, port) → address. Cheap to clone.
#[derive(Clone, Default)]
pub struct ServiceRoutes(Arc<Mutex<HashMap<ServicePort, SocketAddr>>>);

impl ServiceRoutes {
    /// Sends calls to `namespace/name:port` to `addr` from now on.
    pub fn set(&self, namespace: &str, name: &str, port: u16, addr: SocketAddr) {
        locked(&self.0).insert((namespace.to_owned(), name.to_owned(), port), addr);
    }

    fn get(&self, namespace: &str, name: &str, port: u16) -> Option<SocketAddr> {
        let key = (namespace.to_owned(), name.to_owned(), port);
        locked(&self.0).get(&key).copied()
    }
}

/// The write admission sees.
pub(crate) struct Review<'a> {
    pub caller: &'a Caller,
    pub kind: Kind,
    pub subresource: &'a str,
    pub namespace: &'a str,
    /// The object as it would be stored (defaulted).
    pub object: Value,
    pub old_object: Option<&'a Value>,
}

/// Runs every matching mutating webhook on `review.object`, in order, and returns the object
/// as they left it.
pub(crate) async fn mutate(
    store: &Store,
    routes: &ServiceRoutes,
    review: Review<'_>,
) -> Result<Value, ApiError> {
    let configurations: Vec<Value> = store.read(|store| {
        store
            .list(Kind::MutatingWebhookConfiguration, None)
            .map(|(_, config)| config.clone())
            .collect()
    });
    let mut object = review.object.clone();
    for config in &configurations {
        for webhook in config["webhooks"].as_array().into_iter().flatten() {
            if !matches(webhook, &review, &object) {
                continue;
            }
            let name = webhook["name"].as_str().unwrap_or("");
            let fail_open = webhook["failurePolicy"].as_str() == Some("Ignore");
            match call(routes, webhook, &review, &object).await {
                Ok(Answer::Allowed(Some(patched))) => object = patched,
                Ok(Answer::Allowed(None)) => {}
                Ok(Answer::Denied(error)) => return Err(error),
                Err(why) if fail_open => {
                    tracing::debug!(webhook = name, %why, "webhook failed; failurePolicy Ignore");
                }
                Err(why) => {
                    return Err(ApiError::new(
                        500,
                        "InternalError",
                        format!(
                            "Internal error occurred: failed calling webhook \"{name}\": {why}"
                        ),
                    ));
                }
            }
        }
    }
    Ok(object)
}

enum Answer {
    /// Allowed, with the patched object when the webhook sent a patch.
    Allowed(Option<Value>),
    Denied(ApiError),
}

/// Whether `webhook` wants this write: its rules, namespace and object selectors.
fn matches(webhook: &Value, review: &Review<'_>, object: &Value) -> bool {
    let resource = if review.subresource.is_empty() {
        review.kind.plural().to_owned()
    } else {
        format!("{}/{}", review.kind.plural(), review.subresource)
    };
    let (group, version) = review.kind.group_version();
    let scope = if review.kind.namespaced() {
        "Namespaced"
    } else {
        "Cluster"
    };
    let listed = |list: &Value, want: &str| {
        list.as_array()
            .is_some_and(|items| items.iter().any(|i| i == "*" || i == want))
    };
    let rule_matches = webhook["rules"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|rule| {
            listed(&rule["operations"], "CREATE")
                && listed(&rule["apiGroups"], group)
                && listed(&rule["apiVersions"], version)
                && (listed(&rule["resources"], &resource)
                    || (review.subresource.is_empty()
                        && listed(&rule["resources"], review.kind.plural())))
                && rule["scope"]
                    .as_str()
                    .is_none_or(|s| s == "*" || s == scope)
        });
    if !rule_matches {
        return false;
    }
    let namespace_labels = json!({"kubernetes.io/metadata.name": review.namespace});
    if review.kind.namespaced() && !selects(&webhook["namespaceSelector"], &namespace_labels) {
        return false;
    }
    // The object selector is matched against the new object, or the old one on a delete.
    let labels = object
        .pointer("/metadata/labels")
        .cloned()
        .unwrap_or(json!({}));
    selects(&webhook["objectSelector"], &labels)
}

/// A `metav1.LabelSelector` (absent or empty selects everything) against `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    let label = |key: &str| labels.get(key).and_then(Value::as_str);
    let by_labels = selector["matchLabels"]
        .as_object()
        .into_iter()
        .flatten()
        .all(|(k, v)| label(k) == v.as_str());
    let by_expressions = selector["matchExpressions"]
        .as_array()
        .into_iter()
        .flatten()
        .all(|expr| {
            let key = expr["key"].as_str().unwrap_or("");
            let values: Vec<&str> = expr["values"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            match (expr["operator"].as_str(), label(key)) {
                (Some("In"), Some(v)) => values.contains(&v),
                (Some("In"), None) => false,
                (Some("NotIn"), Some(v)) => !values.contains(&v),
                (Some("NotIn"), None) => true,
                (Some("Exists"), found) => found.is_some(),
                (Some("DoesNotExist"), found) => found.is_none(),
                // An operator the server does not know selects nothing, as upstream refuses it.
                _ => false,
            }
        });
    by_labels && by_expressions
}

/// One AdmissionReview round trip; `Err` is why the webhook could not be called or answered
/// in a way the server cannot use (the failure policy decides what that means).
async fn call(
    routes: &ServiceRoutes,
    webhook: &Value,
    review: &Review<'_>,
    object: &Value,
) -> Result<Answer, String> {
    if webhook.get("matchConditions").is_some_and(|c| !c.is_null()) {
        return Err("matchConditions are not evaluated by the e2e API server".to_owned());
    }
    if webhook["reinvocationPolicy"].as_str() == Some("IfNeeded") {
        return Err(
            "reinvocationPolicy IfNeeded is not supported by the e2e API server".to_owned(),
        );
    }
    let timeout = Duration::from_secs(webhook["timeoutSeconds"].as_u64().unwrap_or(10));
    let config = &webhook["clientConfig"];
    let service = &config["service"];
    if !service.is_object() {
        return Err("only clientConfig.service is supported by the e2e API server".to_owned());
    }
    let text = |field: &str, default| service[field].as_str().unwrap_or(default);
    let (name, namespace, path) = (text("name", ""), text("namespace", ""), text("path", "/"));
    let port = service["port"]
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .unwrap_or(443);
    let host = format!("{name}.{namespace}.svc");
    let url = format!("https://{host}:{port}{path}?timeout={}s", timeout.as_secs());
    let failed = |why: &str| format!("failed to call webhook: Post \"{url}\": {why}");
    let addr = routes
        .get(namespace, name, port)
        .ok_or_else(|| failed(&format!("service \"{namespace}/{name}\" has no endpoints")))?;
    let ca = config["caBundle"]
        .as_str()
        .and_then(|b64| base64::engine::general_purpose::STANDARD.decode(b64).ok())
        .unwrap_or_default();
    let uid = super::objects::new_uid();
    let body = review_body(&uid, review, object);
    let answer = tokio::time::timeout(timeout, post(addr, &host, path, &ca, &body))
        .await
        .unwrap_or_else(|_| Err("context deadline exceeded".to_owned()))
        .map_err(|why| failed(&why))?;
    let webhook_name = webhook["name"].as_str().unwrap_or("");
    read_answer(&uid, webhook_name, object, &answer)
}

/// The AdmissionReview v1 request body.
fn review_body(uid: &str, review: &Review<'_>, object: &Value) -> Value {
    let (group, version) = review.kind.group_version();
    let kind = json!({"group": group, "version": version, "kind": review.kind.kind()});
    let resource = json!({"group": group, "version": version, "resource": review.kind.plural()});
    let mut user_info = json!({"username": review.caller.name});
    if let Some(node) = &review.caller.node {
        user_info["extra"] = json!({ super::NODE_NAME_CLAIM: [node] });
    }
    let mut request = json!({
        "uid": uid,
        "kind": kind,
        "resource": resource,
        "requestKind": kind,
        "requestResource": resource,
        "name": meta_str(object, "name").unwrap_or(""),
        "operation": "CREATE",
        "userInfo": user_info,
        "object": object,
        "oldObject": review.old_object.cloned().unwrap_or(Value::Null),
        "dryRun": false,
    });
    if review.kind.namespaced() {
        request["namespace"] = json!(review.namespace);
    }
    if !review.subresource.is_empty() {
        request["subResource"] = json!(review.subresource);
        request["requestSubResource"] = json!(review.subresource);
    }
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": request,
    })
}

/// Checks the answer as the real server does and applies its patch.
fn read_answer(uid: &str, name: &str, object: &Value, answer: &Value) -> Result<Answer, String> {
    if answer["apiVersion"] != "admission.k8s.io/v1" || answer["kind"] != "AdmissionReview" {
        return Err(format!(
            "expected webhook response of admission.k8s.io/v1, Kind=AdmissionReview, got {}, Kind={}",
            answer["apiVersion"], answer["kind"]
        ));
    }
    let response = &answer["response"];
    if !response.is_object() {
        return Err("webhook response was absent".to_owned());
    }
    if response["uid"].as_str() != Some(uid) {
        return Err(format!(
            "expected response.uid=\"{uid}\", got \"{}\"",
            response["uid"].as_str().unwrap_or("")
        ));
    }
    if response["allowed"].as_bool() != Some(true) {
        return Ok(Answer::Denied(denial(name, &response["status"])));
    }
    let Some(patch) = response["patch"].as_str() else {
        return Ok(Answer::Allowed(None));
    };
    if response["patchType"].as_str() != Some("JSONPatch") {
        return Err(format!(
            "unsupported patch type \"{}\"",
            response["patchType"].as_str().unwrap_or("")
        ));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(patch)
        .map_err(|e| format!("the patch is not base64: {e}"))?;
    let patch: json_patch::Patch = serde_json::from_slice(&bytes)
        .map_err(|e| format!("the patch is not a JSON patch: {e}"))?;
    let mut patched = object.clone();
    json_patch::patch(&mut patched, &patch).map_err(|e| format!("applying the patch: {e}"))?;
    Ok(Answer::Allowed(Some(patched)))
}

/// `admission webhook "NAME" denied the request: MESSAGE`, with the webhook's code (≥ 400).
fn denial(name: &str, status: &Value) -> ApiError {
    let code = status["code"]
        .as_u64()
        .and_then(|c| u16::try_from(c).ok())
        .filter(|c| *c >= 400)
        .unwrap_or(400);
    let denied = format!("admission webhook \"{name}\" denied the request");
    let message = match (status["message"].as_str(), status["reason"].as_str()) {
        (Some(m), _) if !m.is_empty() => format!("{denied}: {m}"),
        (_, Some(r)) if !r.is_empty() => format!("{denied}: {r}"),
        _ => format!("{denied} without explanation"),
    };
    let reason = match code {
        403 => "Forbidden",
        404 => "NotFound",
        409 => "Conflict",
        422 => "Invalid",
        429 => "TooManyRequests",
        400 => "BadRequest",
        _ => "",
    };
    ApiError::new(code, reason, message)
}

/// POSTs `body` over HTTPS to `addr`, verifying the certificate against `ca` for `host`.
async fn post(
    addr: SocketAddr,
    host: &str,
    path: &str,
    ca: &[u8],
    body: &Value,
) -> Result<Value, String> {
    let ca = String::from_utf8_lossy(ca);
    let config =
        crate::cluster::tls_client_config(&ca, None).map_err(|e| format!("caBundle: {e}"))?;
    let name =
        rustls::pki_types::ServerName::try_from(host.to_owned()).map_err(|e| e.to_string())?;
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("dial tcp {addr}: {e}"))?;
    let stream = tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .map_err(|e| format!("tls: {e}"))?;
    let payload = body.to_string();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nAccept: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{payload}",
        payload.len()
    );
    let (status, body) = crate::cluster::exchange_on(stream, &request)
        .await
        .map_err(|e| e.to_string())?;
    if status != 200 {
        return Err(format!("the server responded with status {status}"));
    }
    serde_json::from_str(&body).map_err(|e| format!("decoding the response: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_follow_label_selector_semantics() {
        let labels = json!({"app": "x", "tier": "gpu"});
        assert!(selects(&Value::Null, &labels));
        assert!(selects(&json!({}), &labels));
        assert!(selects(&json!({"matchLabels": {"app": "x"}}), &labels));
        assert!(!selects(&json!({"matchLabels": {"app": "y"}}), &labels));
        let expr = |op: &str, values: &[&str]| json!({"matchExpressions": [{"key": "tier", "operator": op, "values": values}]});
        assert!(selects(&expr("In", &["gpu", "cpu"]), &labels));
        assert!(!selects(&expr("NotIn", &["gpu"]), &labels));
        assert!(selects(&expr("NotIn", &["gpu"]), &json!({})));
        assert!(selects(&expr("Exists", &[]), &labels));
        assert!(!selects(&expr("DoesNotExist", &[]), &labels));
        assert!(!selects(&expr("Near", &["gpu"]), &labels));
    }

    #[test]
    fn a_denial_names_the_webhook_and_keeps_a_client_error_code() {
        let error = denial("pods.example.com", &json!({"code": 200, "message": "no"}));
        assert_eq!(error.code, 400);
        assert_eq!(
            error.message,
            "admission webhook \"pods.example.com\" denied the request: no"
        );
        let error = denial("w", &json!({"code": 403}));
        assert_eq!((error.code, error.reason), (403, "Forbidden"));
        assert_eq!(
            error.message,
            "admission webhook \"w\" denied the request without explanation"
        );
    }

    #[test]
    fn an_answer_for_another_request_is_not_used() {
        let object = json!({"spec": {}});
        let answer = json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "response": {"uid": "other", "allowed": true},
        });
        assert!(read_answer("mine", "w", &object, &answer).is_err());
        let patch = base64::engine::general_purpose::STANDARD
            .encode(r#"[{"op":"add","path":"/spec/schedulerName","value":"s"}]"#);
        let answer = json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "response": {"uid": "mine", "allowed": true, "patchType": "JSONPatch", "patch": patch},
        });
        let Ok(Answer::Allowed(Some(patched))) = read_answer("mine", "w", &object, &answer) else {
            panic!("the patch was not applied");
        };
        assert_eq!(patched["spec"]["schedulerName"], "s");
    }
}
