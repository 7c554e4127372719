//! DELETE and the pod `eviction` subresource: preconditions, a pod's graceful deletion
//! (marked, then removed after its grace period, capped since no kubelet confirms here),
//! finalizers that keep an object until they are gone.
//!
//! An eviction is a delete with the Eviction's `deleteOptions`, so both live here.

use std::time::Duration;

use http::StatusCode;
use serde_json::{Value, json};

use super::App;
use super::objects::{self, DEFAULT_GRACE_SECONDS, meta_mut, meta_str, str_at};
use super::request::{Params, Reply, Target, current_or_404, dry_run, parse_body, parse_param};
use super::resources::Kind;
use super::status::{ApiError, ApiResult};

/// The longest a graceful deletion waits before the pod is removed (no kubelet confirms here).
const MAX_GRACE: Duration = Duration::from_secs(2);

/// `DeleteOptions`, from the body (kube, kubectl) or the query.
struct DeleteOptions {
    grace: Option<i64>,
    uid: Option<String>,
    resource_version: Option<String>,
}

fn delete_options(params: &Params, body: &[u8]) -> ApiResult<DeleteOptions> {
    let body: Value = if body.iter().all(u8::is_ascii_whitespace) {
        json!({})
    } else {
        serde_json::from_slice(body)
            .map_err(|err| ApiError::bad_request(format!("invalid DeleteOptions: {err}")))?
    };
    let query_grace = params
        .get("gracePeriodSeconds")
        .map(|g| parse_param::<i64>("gracePeriodSeconds", g))
        .transpose()?;
    Ok(DeleteOptions {
        grace: body
            .get("gracePeriodSeconds")
            .and_then(Value::as_i64)
            .or(query_grace),
        uid: str_at(&body, "/preconditions/uid").map(str::to_owned),
        resource_version: str_at(&body, "/preconditions/resourceVersion").map(str::to_owned),
    })
}

pub(super) fn delete(app: &App, target: &Target, params: &Params, body: &[u8]) -> Reply {
    let options = delete_options(params, body)?;
    let plural = target.kind.plural();
    let name = target.name();
    let (reply, schedule) = app.store.write(|store| {
        let current = current_or_404(store, target)?.clone();
        let uid = meta_str(&current, "uid").unwrap_or("");
        if let Some(want) = options.uid.as_deref().filter(|u| *u != uid) {
            return Err(ApiError::conflict(plural, name, format!(
                "Precondition failed: UID in precondition: {want}, UID in object meta: {uid}"
            )));
        }
        let rv = meta_str(&current, "resourceVersion").unwrap_or("");
        if let Some(want) = options.resource_version.as_deref().filter(|r| *r != rv) {
            return Err(ApiError::conflict(plural, name, format!(
                "Precondition failed: ResourceVersion in precondition: {want}, ResourceVersion in object meta: {rv}"
            )));
        }
        let has_finalizers = objects::has_finalizers(&current);
        let grace = if target.kind == Kind::Pod {
            let bound = str_at(&current, "/spec/nodeName").is_some_and(|n| !n.is_empty());
            let terminal = matches!(str_at(&current, "/status/phase"), Some("Succeeded" | "Failed"));
            let requested = options.grace.unwrap_or_else(|| {
                current
                    .pointer("/spec/terminationGracePeriodSeconds")
                    .and_then(Value::as_i64)
                    .unwrap_or(DEFAULT_GRACE_SECONDS)
            });
            if bound && !terminal { requested.max(0) } else { 0 }
        } else {
            0
        };
        if dry_run(params) {
            return Ok(((StatusCode::OK, current), None));
        }
        let already = current.pointer("/metadata/deletionGracePeriodSeconds").and_then(Value::as_i64);
        if grace == 0 && !has_finalizers {
            let deleted = store.delete(target.kind, &target.key()).unwrap_or(current);
            return Ok(((StatusCode::OK, deleted), None));
        }
        if already.is_some_and(|already| already <= grace) {
            // Already terminating at least as fast: nothing changes, as upstream.
            return Ok(((StatusCode::OK, current), None));
        }
        let mut marked = current.clone();
        let meta = meta_mut(&mut marked);
        meta.insert("deletionTimestamp".into(), json!(objects::now_plus(grace)));
        meta.insert("deletionGracePeriodSeconds".into(), json!(grace));
        let stored = store.update(target.kind, target.key(), marked);
        let schedule = (!has_finalizers).then(|| (uid.to_owned(), grace));
        Ok(((StatusCode::OK, stored), schedule))
    })?;
    if let Some((uid, grace)) = schedule {
        let wait = Duration::from_secs(grace.unsigned_abs()).min(MAX_GRACE);
        let app = app.clone();
        let target = target.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = app.cancel.cancelled() => {}
                _ = tokio::time::sleep(wait) => {
                    app.store.write(|store| {
                        let same = store.get(target.kind, &target.key()).is_some_and(|pod| {
                            meta_str(pod, "uid") == Some(uid.as_str())
                                && pod.pointer("/metadata/deletionTimestamp").is_some()
                        });
                        if same {
                            store.delete(target.kind, &target.key());
                        }
                    });
                }
            }
        });
    }
    Ok(reply)
}

/// `POST pods/NAME/eviction` (`policy/v1` Eviction): deletes the pod as a DELETE with the
/// Eviction's `deleteOptions` would, answering a `Success` Status with 201 as the real
/// server does. No PodDisruptionBudget exists here, so none can refuse it.
pub(super) fn evict(app: &App, target: &Target, params: &Params, body: &[u8]) -> Reply {
    let eviction = parse_body("application/json", body)?;
    let pod_name = target.name();
    let kind = eviction["kind"].as_str().unwrap_or("Eviction");
    let version = eviction["apiVersion"].as_str().unwrap_or("policy/v1");
    if kind != "Eviction" || !matches!(version, "policy/v1" | "policy/v1beta1") {
        return Err(ApiError::bad_request(format!(
            "the body of an eviction must be a policy/v1 Eviction, not {version} {kind}"
        )));
    }
    let name = meta_str(&eviction, "name").unwrap_or("");
    if name != pod_name {
        return Err(ApiError::bad_request(format!(
            "name in URL does not match name in Eviction object ({name} ≠ {pod_name})"
        )));
    }
    let options = eviction
        .get("deleteOptions")
        .map(Value::to_string)
        .unwrap_or_default();
    let pod = Target {
        subresource: None,
        ..target.clone()
    };
    delete(app, &pod, params, options.as_bytes())?;
    Ok((
        StatusCode::CREATED,
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}),
    ))
}
