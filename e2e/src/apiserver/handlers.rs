//! Routing and dispatch: one fallback handler parses the path into a [`Target`]
//! (`request.rs`; the Kubernetes URL grammar reads better as a match on segments than as a
//! route table), applies injected faults, and dispatches to the verbs: reads in `reads.rs`;
//! create, update and patch in `writes.rs`; delete and eviction in `deletes.rs`; the pod
//! `binding` subresource in `binding.rs`.
//! Every write runs under the store's lock from "read the current object" to "store the new
//! one", so the resourceVersion checks are race-free; and in a task of its own, so that a
//! write, once accepted, is applied even if its client goes away (during a write stall too).

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, Method, Uri, header};
use serde_json::Value;

use super::Caller;
use super::binding::bind;
use super::deletes::{delete, evict};
use super::objects::{self, meta_mut, meta_str};
use super::request::{Params, Reply, Target, Write, parse_body};
use super::resources::Kind;
use super::status::{ApiError, ApiResult};
use super::writes::{create, patch_object, update};
use super::{App, Release, Verb, discovery, reads, watch};

pub(crate) fn router(app: App) -> Router {
    Router::new().fallback(handle).with_state(app)
}

enum Route {
    Json(Value),
    Namespace(String),
    Namespaces,
    Resource(Target),
    Health,
}

fn route(path: &str) -> ApiResult<Route> {
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let not_found = || ApiError::path_not_found(path);
    let (group_version, rest) = match segments.as_slice() {
        ["version"] => return Ok(Route::Json(discovery::version())),
        ["healthz" | "livez" | "readyz", ..] => return Ok(Route::Health),
        ["api", "v1", rest @ ..] => ("v1".to_owned(), rest),
        ["apis", group, version, rest @ ..] => (format!("{group}/{version}"), rest),
        _ => return Err(not_found()),
    };
    let target = |plural: &str, namespace: Option<&str>, name: Option<&str>, sub: Option<&str>| {
        let kind = Kind::lookup(&group_version, plural).ok_or_else(not_found)?;
        // A cluster-scoped resource under a namespace, or a namespaced object outside one.
        let misplaced = match namespace {
            Some(_) => !kind.namespaced(),
            None => name.is_some() && kind.namespaced(),
        };
        let served = matches!(
            (kind, sub),
            (_, None)
                | (Kind::Pod, Some("status" | "binding" | "eviction"))
                | (Kind::Node | Kind::ResourceClaim, Some("status"))
        );
        if misplaced || !served {
            return Err(not_found());
        }
        Ok(Route::Resource(Target {
            kind,
            namespace: namespace.map(str::to_owned),
            name: name.map(str::to_owned),
            subresource: sub.map(str::to_owned),
        }))
    };
    match (group_version.as_str(), rest) {
        ("v1", ["namespaces"]) => Ok(Route::Namespaces),
        ("v1", ["namespaces", ns]) => Ok(Route::Namespace((*ns).to_owned())),
        (_, ["namespaces", ns, plural]) => target(plural, Some(ns), None, None),
        (_, ["namespaces", ns, plural, name]) => target(plural, Some(ns), Some(name), None),
        (_, ["namespaces", ns, plural, name, sub]) => {
            target(plural, Some(ns), Some(name), Some(sub))
        }
        (_, [plural]) => target(plural, None, None, None),
        (_, [plural, name]) => target(plural, None, Some(name), None),
        (_, [plural, name, sub]) => target(plural, None, Some(name), Some(sub)),
        _ => Err(not_found()),
    }
}

fn verb_of(method: &Method, target: &Target, params: &Params) -> ApiResult<Verb> {
    let named = target.name.is_some();
    let verb = match (method.as_str(), named, target.subresource.as_deref()) {
        ("GET", true, None | Some("status")) => Verb::Get,
        ("GET", false, None) => {
            if matches!(params.get("watch").map(String::as_str), Some("true" | "1")) {
                Verb::Watch
            } else {
                Verb::List
            }
        }
        ("POST", false, None) if target.namespace.is_some() || !target.kind.namespaced() => {
            Verb::Create
        }
        ("POST", true, Some("binding" | "eviction")) => Verb::Create,
        ("PUT", true, None | Some("status")) => Verb::Update,
        ("PATCH", true, None | Some("status")) => Verb::Patch,
        ("DELETE", true, None) => Verb::Delete,
        _ => return Err(ApiError::method_not_allowed()),
    };
    Ok(verb)
}

async fn handle(
    State(app): State<App>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    params: Result<Query<Params>, axum::extract::rejection::QueryRejection>,
    body: Bytes,
) -> Response {
    let latency = app.faults.latency();
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    let params = match params {
        Ok(Query(params)) => params,
        Err(err) => return ApiError::bad_request(format!("invalid query: {err}")).into_response(),
    };
    let (target, user) = match resolve(&app, &method, &uri, &headers).await {
        Ok(resolved) => resolved,
        Err(response) => return response,
    };
    let verb = match verb_of(&method, &target, &params) {
        Ok(verb) => verb,
        Err(err) => return err.into_response(),
    };
    record(&app, &user, verb, &target, &params);
    if let Some(code) = app.faults.draw_error(verb) {
        tracing::debug!(?verb, resource = %target.resource(), code, "injecting a failure");
        return ApiError::injected(code).into_response();
    }
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("")
        .to_owned();
    if !hold_consistent_read(&app, verb, &params).await {
        return ApiError::injected(503).into_response();
    }
    let result = match verb {
        Verb::Get => reads::get(&app, &target),
        Verb::List => reads::list(&app, &target, &params),
        Verb::Watch => match reads::watch_request(&target, &params) {
            Ok(request) => return watch::serve(app, request),
            Err(err) => Err(err),
        },
        Verb::Create | Verb::Update | Verb::Patch | Verb::Delete => {
            let write = Write {
                verb,
                user,
                target,
                params,
                content_type,
                body,
            };
            write.run(app).await
        }
    };
    match result {
        Ok((code, value)) => (code, axum::Json(value)).into_response(),
        Err(err) => err.into_response(),
    }
}

/// Routes the request and finds who sends it: the resource it is for and the caller, or the
/// whole response when there is nothing more to do (version, health, namespaces, a fault,
/// no credentials, a path that does not exist).
async fn resolve(
    app: &App,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
) -> Result<(Target, Caller), Response> {
    let route = route(uri.path()).map_err(IntoResponse::into_response)?;
    let authorization = headers
        .get(header::AUTHORIZATION)
        .map(|h| h.to_str().unwrap_or(""));
    if app.faults.hold_if_cut(authorization, &app.cancel).await {
        return Err(ApiError::injected(503).into_response());
    }
    match (route, app.access.user(authorization)) {
        // `/version` and health need no credentials here.
        (Route::Json(doc), _) => Err(axum::Json(doc).into_response()),
        (Route::Health, _) => Err("ok".into_response()),
        (_, None) => Err(ApiError::new(401, "Unauthorized", "Unauthorized").into_response()),
        (Route::Resource(target), Some(user)) => Ok((target, user)),
        (_, Some(_)) if method != Method::GET => {
            Err(ApiError::method_not_allowed().into_response())
        }
        (Route::Namespace(name), Some(user)) => {
            app.stats.record(&user.name, Verb::Get, "", "namespaces");
            Err(axum::Json(discovery::namespace(&name)).into_response())
        }
        (Route::Namespaces, Some(user)) => {
            app.stats.record(&user.name, Verb::List, "", "namespaces");
            Err(axum::Json(reads::namespace_list(app)).into_response())
        }
    }
}

/// Counts the call (and a list's or watch's field selector) in the server's stats.
fn record(app: &App, user: &Caller, verb: Verb, target: &Target, params: &Params) {
    app.stats
        .record(&user.name, verb, target.kind.group(), &target.resource());
    if matches!(verb, Verb::List | Verb::Watch)
        && let Some(selector) = params.get("fieldSelector").filter(|s| !s.is_empty())
    {
        app.stats
            .record_field_selector(&target.resource(), selector);
    }
}

/// Waits out an injected etcd stall where it applies; `false` when the read must fail.
/// A GET, and a list without `resourceVersion=0`, are consistent reads: etcd answers them,
/// so a stalled etcd holds them too. Lists from the watch cache and watches go on.
async fn hold_consistent_read(app: &App, verb: Verb, params: &Params) -> bool {
    let from_cache =
        verb == Verb::List && params.get("resourceVersion").map(String::as_str) == Some("0");
    !(matches!(verb, Verb::Get | Verb::List)
        && !from_cache
        && !app.faults.hold_consistent_read(&app.cancel).await)
}

impl Write {
    /// Accepted: from here on the write goes through even if the client hangs up (dropping
    /// the handler), as on a real API server. Runs mutating admission, then the write, in a
    /// task of its own, once the injected write stall (if any) releases it.
    async fn run(self, app: App) -> Reply {
        let task = tokio::spawn(async move {
            match app.faults.hold_write(&app.cancel).await {
                Some(Release::Apply) => match self.mutate(&app).await {
                    Ok(write) => write.apply(&app),
                    Err(error) => Err(error),
                },
                Some(Release::Fail(error)) => Err(error),
                None => Err(ApiError::injected(503)),
            }
        });
        match task.await {
            Ok(result) => result,
            Err(err) => Err(ApiError::new(
                500,
                "InternalError",
                format!("the write failed: {err}"),
            )),
        }
    }

    /// Mutating admission: a create passes the webhooks that match it, which may rewrite the
    /// body (see `webhooks.rs`). They see the object defaulted, but without the UID, creation
    /// time and generated name that storing it adds, as on the real server. Other writes are
    /// not sent to webhooks (gpushare's registers for pod creates only).
    async fn mutate(mut self, app: &App) -> ApiResult<Self> {
        let has_webhooks = app.store.read(|store| {
            store
                .list(Kind::MutatingWebhookConfiguration, None)
                .next()
                .is_some()
        });
        if self.verb != Verb::Create || self.target.subresource.is_some() || !has_webhooks {
            return Ok(self);
        }
        let object = parse_body(&self.content_type, &self.body)?;
        let named = meta_str(&object, "name").is_some_and(|n| !n.is_empty());
        let mut object =
            objects::prepare_create(self.target.kind, object, self.target.namespace.as_deref())?;
        let meta = meta_mut(&mut object);
        for stored in ["uid", "creationTimestamp", "generation"] {
            meta.remove(stored);
        }
        if !named {
            meta.remove("name");
        }
        let review = super::webhooks::Review {
            caller: &self.user,
            kind: self.target.kind,
            subresource: "",
            namespace: self.target.namespace.as_deref().unwrap_or(""),
            object,
            old_object: None,
        };
        let mutated = super::webhooks::mutate(&app.store, &app.access.services, review).await?;
        self.body = Bytes::from(mutated.to_string());
        self.content_type = "application/json".to_owned();
        Ok(self)
    }

    fn apply(&self, app: &App) -> Reply {
        let (target, params, body) = (&self.target, &self.params, &self.body);
        match self.verb {
            Verb::Create if target.subresource.as_deref() == Some("binding") => {
                bind(app, target, body)
            }
            Verb::Create if target.subresource.as_deref() == Some("eviction") => {
                evict(app, target, params, body)
            }
            Verb::Create => create(app, self),
            Verb::Update => update(app, self),
            Verb::Patch => patch_object(app, self),
            Verb::Delete => delete(app, target, params, body),
            Verb::Get | Verb::List | Verb::Watch => Err(ApiError::method_not_allowed()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_parse() {
        let r = route;
        assert!(
            matches!(r("/api/v1/namespaces/default/pods/x/binding"), Ok(Route::Resource(t)) if t.subresource.as_deref() == Some("binding"))
        );
        assert!(
            matches!(r("/api/v1/pods"), Ok(Route::Resource(t)) if t.namespace.is_none() && t.kind == Kind::Pod)
        );
        assert!(
            matches!(r("/api/v1/nodes/n1/status"), Ok(Route::Resource(t)) if t.kind == Kind::Node)
        );
        assert!(
            matches!(r("/apis/coordination.k8s.io/v1/namespaces/a/leases/l"), Ok(Route::Resource(t)) if t.kind == Kind::Lease)
        );
        assert!(
            matches!(r("/api/v1/namespaces/default"), Ok(Route::Namespace(n)) if n == "default")
        );
        assert!(r("/api/v1/namespaces/default/nodes/x").is_err());
        assert!(r("/api/v1/pods/x").is_err());
        assert!(r("/api/v1/namespaces/a/pods/x/exec").is_err());
        assert!(r("/apis/apps/v1/deployments").is_err());
    }
}
