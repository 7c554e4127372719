//! Routing and the REST verbs: get, list, watch, create, update, patch, delete, and the pod
//! `binding` subresource.
//!
//! One fallback handler parses the path itself (the Kubernetes URL grammar is easier to read
//! as a match on segments than as a route table), applies injected faults, and dispatches.
//! Every write runs under the store's lock from "read the current object" to "store the new
//! one", so the resourceVersion checks are race-free; and in a task of its own, so that a
//! write, once accepted, is applied even if its client goes away (during a write stall too).

use std::collections::HashMap;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, Method, StatusCode, Uri, header};
use serde_json::{Value, json};

use super::Caller;
use super::admission::{AdmissionRequest, Operation};
use super::objects::{self, DEFAULT_GRACE_SECONDS, Part, meta_mut, meta_str};
use super::patch::{self, PatchKind};
use super::resources::Kind;
use super::selector::Selector;
use super::status::{self, ApiError, ApiResult};
use super::store::Key;
use super::watch::{self, Start, WatchRequest};
use super::{App, Release, Verb, discovery, managed, table};

/// The longest a graceful deletion waits before the pod is removed (no kubelet confirms here).
const MAX_GRACE: Duration = Duration::from_secs(2);
/// Watch length when the client gives no `timeoutSeconds`.
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);

pub(crate) fn router(app: App) -> Router {
    Router::new().fallback(handle).with_state(app)
}

type Params = HashMap<String, String>;

/// A request for a served resource, parsed from the path.
#[derive(Debug, Clone)]
struct Target {
    kind: Kind,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
}

impl Target {
    fn resource(&self) -> String {
        match &self.subresource {
            Some(sub) => format!("{}/{sub}", self.kind.plural()),
            None => self.kind.plural().to_owned(),
        }
    }

    fn key(&self) -> Key {
        (
            self.namespace.clone().unwrap_or_default(),
            self.name.clone().unwrap_or_default(),
        )
    }

    fn name(&self) -> &str {
        self.name.as_deref().unwrap_or("")
    }
}

enum Route {
    Json(Value),
    Namespace(String),
    Namespaces,
    Resource(Target),
    Health,
}

fn route(path: &str, server: &str) -> ApiResult<Route> {
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let not_found = || ApiError::path_not_found(path);
    let (group_version, rest) = match segments.as_slice() {
        ["version"] => return Ok(Route::Json(discovery::version())),
        ["healthz" | "livez" | "readyz", ..] => return Ok(Route::Health),
        ["api"] => return Ok(Route::Json(discovery::core_versions(server))),
        ["apis"] => return Ok(Route::Json(discovery::groups())),
        ["api", "v1"] => {
            return discovery::resources("v1")
                .map(Route::Json)
                .ok_or_else(not_found);
        }
        ["apis", group] => {
            return discovery::group_doc(group)
                .map(Route::Json)
                .ok_or_else(not_found);
        }
        ["apis", group, version] => {
            return discovery::resources(&format!("{group}/{version}"))
                .map(Route::Json)
                .ok_or_else(not_found);
        }
        ["api", "v1", rest @ ..] => ("v1".to_owned(), rest),
        ["apis", group, version, rest @ ..] => (format!("{group}/{version}"), rest),
        _ => return Err(not_found()),
    };
    let target = |plural: &str, namespace: Option<&str>, name: Option<&str>, sub: Option<&str>| {
        let kind = Kind::lookup(&group_version, plural).ok_or_else(not_found)?;
        if name.is_none() && namespace.is_some() && !kind.namespaced() {
            return Err(not_found());
        }
        if namespace.is_some() != kind.namespaced() && name.is_some() {
            return Err(not_found());
        }
        let sub_ok = matches!(
            (kind, sub),
            (_, None)
                | (Kind::Pod, Some("status" | "binding" | "eviction"))
                | (Kind::Node | Kind::ResourceClaim, Some("status"))
        );
        if !sub_ok {
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
    let server = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("127.0.0.1")
        .to_owned();
    let route = match route(uri.path(), &server) {
        Ok(route) => route,
        Err(err) => return err.into_response(),
    };
    let authorization = headers
        .get(header::AUTHORIZATION)
        .map(|h| h.to_str().unwrap_or(""));
    if app.faults.hold_if_cut(authorization, &app.cancel).await {
        return ApiError::injected(503).into_response();
    }
    let (target, user) = match (route, app.access.user(authorization)) {
        // Discovery and health need no credentials here.
        (Route::Json(doc), _) => return axum::Json(doc).into_response(),
        (Route::Health, _) => return "ok".into_response(),
        (_, None) => return ApiError::new(401, "Unauthorized", "Unauthorized").into_response(),
        (Route::Namespace(name), Some(user)) => {
            if method != Method::GET {
                return ApiError::method_not_allowed().into_response();
            }
            app.stats.record(&user, Verb::Get, "", "namespaces");
            return axum::Json(discovery::namespace(&name)).into_response();
        }
        (Route::Namespaces, Some(user)) => {
            if method != Method::GET {
                return ApiError::method_not_allowed().into_response();
            }
            app.stats.record(&user, Verb::List, "", "namespaces");
            return axum::Json(namespace_list(&app)).into_response();
        }
        (Route::Resource(target), Some(user)) => (target, user),
    };
    let verb = match verb_of(&method, &target, &params) {
        Ok(verb) => verb,
        Err(err) => return err.into_response(),
    };
    app.stats
        .record(&user, verb, target.kind.group(), &target.resource());
    if matches!(verb, Verb::List | Verb::Watch)
        && let Some(selector) = params.get("fieldSelector").filter(|s| !s.is_empty())
    {
        app.stats
            .record_field_selector(&target.resource(), selector);
    }
    if let Some(code) = app.faults.draw_error(verb) {
        tracing::debug!(?verb, resource = %target.resource(), code, "injecting a failure");
        return ApiError::injected(code).into_response();
    }
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let as_table = table::requested(&headers, params.get("includeObject").map(String::as_str));
    // A GET, and a list without `resourceVersion=0`, are consistent reads: etcd answers them,
    // so a stalled etcd holds them too. Lists from the watch cache and watches go on.
    let from_cache =
        verb == Verb::List && params.get("resourceVersion").map(String::as_str) == Some("0");
    if matches!(verb, Verb::Get | Verb::List)
        && !from_cache
        && !app.faults.hold_consistent_read(&app.cancel).await
    {
        return ApiError::injected(503).into_response();
    }
    let result = match verb {
        Verb::Get => get(&app, &target).map(|(code, object)| match as_table {
            Some(include) => {
                let metadata = json!({"resourceVersion": meta_str(&object, "resourceVersion")});
                (
                    code,
                    table::table(target.kind, &[object], metadata, include),
                )
            }
            None => (code, object),
        }),
        Verb::List => list(&app, &target, &params).map(|(code, list)| match as_table {
            Some(include) => {
                let items = list["items"].as_array().cloned().unwrap_or_default();
                (
                    code,
                    table::table(target.kind, &items, list["metadata"].clone(), include),
                )
            }
            None => (code, list),
        }),
        Verb::Watch => match watch_request(&target, &params, as_table) {
            Ok(request) => return watch::serve(app, request),
            Err(err) => Err(err),
        },
        Verb::Create | Verb::Update | Verb::Patch | Verb::Delete => {
            // Accepted: from here on the write goes through even if the client hangs up
            // (dropping this handler), as on a real API server.
            let manager = managed::manager(
                params.get("fieldManager").map(String::as_str),
                headers
                    .get(header::USER_AGENT)
                    .and_then(|h| h.to_str().ok()),
            );
            let write = Write {
                verb,
                user,
                manager,
                target,
                params,
                content_type,
                body,
            };
            let task = tokio::spawn(async move {
                match app.faults.hold_write(&app.cancel).await {
                    Some(Release::Apply) => match write.mutate(&app).await {
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
    };
    match result {
        Ok((code, value)) => (code, axum::Json(value)).into_response(),
        Err(err) => err.into_response(),
    }
}

/// An accepted write, owned so that it can run to the end in a task of its own.
struct Write {
    verb: Verb,
    /// Who asked (admission sees it as `request.userInfo`).
    user: Caller,
    /// The field manager its changes are recorded under (`managedFields`).
    manager: String,
    target: Target,
    params: Params,
    content_type: String,
    body: Bytes,
}

impl Write {
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
            operation: Operation::Create,
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
        let Write {
            verb,
            user,
            manager,
            target,
            params,
            content_type,
            body,
        } = self;
        match verb {
            Verb::Create if target.subresource.as_deref() == Some("binding") => {
                bind(app, target, body)
            }
            Verb::Create if target.subresource.as_deref() == Some("eviction") => {
                evict(app, target, params, body)
            }
            Verb::Create => create(app, (user, manager), target, params, content_type, body),
            Verb::Update => update(app, (user, manager), target, params, content_type, body),
            Verb::Patch => patch_object(app, (user, manager), target, params, content_type, body),
            Verb::Delete => delete(app, target, params, body),
            Verb::Get | Verb::List | Verb::Watch => Err(ApiError::method_not_allowed()),
        }
    }
}

type Reply = ApiResult<(StatusCode, Value)>;

fn part(target: &Target) -> Part {
    if target.subresource.as_deref() == Some("status") {
        Part::Status
    } else {
        Part::Main
    }
}

fn parse_body(content_type: &str, body: &[u8]) -> ApiResult<Value> {
    let media = content_type.split(';').next().unwrap_or("").trim();
    if !media.is_empty() && media != "application/json" && media != "*/*" {
        if media == "application/yaml" {
            return serde_yaml::from_slice(body)
                .map_err(|err| ApiError::bad_request(format!("error decoding YAML: {err}")));
        }
        return Err(ApiError::unsupported_media_type(content_type));
    }
    let value: Value = serde_json::from_slice(body).map_err(|err| {
        ApiError::bad_request(format!(
            "couldn't get version/kind; json parse error: {err}"
        ))
    })?;
    if !value.is_object() {
        return Err(ApiError::bad_request(
            "the body of the request must be a JSON object",
        ));
    }
    Ok(value)
}

fn dry_run(params: &Params) -> bool {
    params.get("dryRun").is_some_and(|v| v == "All")
}

fn get(app: &App, target: &Target) -> Reply {
    app.store.read(|store| {
        store
            .get(target.kind, &target.key())
            .cloned()
            .map(|object| (StatusCode::OK, object))
            .ok_or_else(|| ApiError::not_found(target.kind.plural(), target.name()))
    })
}

fn selector(target: &Target, params: &Params) -> ApiResult<Selector> {
    Selector::parse(
        target.kind,
        params.get("labelSelector").map(String::as_str),
        params.get("fieldSelector").map(String::as_str),
    )
}

/// A continue token: the list's resourceVersion and the last key it returned, hex-encoded so
/// it survives any URL handling.
fn encode_continue(rv: u64, key: &Key) -> String {
    let raw = format!("{rv}\n{}\n{}", key.0, key.1);
    raw.bytes().map(|b| format!("{b:02x}")).collect()
}

fn decode_continue(token: &str) -> ApiResult<(u64, Key)> {
    let invalid = || ApiError::bad_request(format!("invalid continue token {token:?}"));
    if !token.len().is_multiple_of(2) || !token.is_ascii() {
        return Err(invalid());
    }
    let bytes: Vec<u8> = (0..token.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&token[i..i + 2], 16))
        .collect::<Result<_, _>>()
        .map_err(|_| invalid())?;
    let text = String::from_utf8(bytes).map_err(|_| invalid())?;
    let mut parts = text.splitn(3, '\n');
    let rv = parts
        .next()
        .and_then(|rv| rv.parse().ok())
        .ok_or_else(invalid)?;
    let ns = parts.next().ok_or_else(invalid)?.to_owned();
    let name = parts.next().ok_or_else(invalid)?.to_owned();
    Ok((rv, (ns, name)))
}

/// Lists. Pages (`limit`/`continue`) are cut from the current state after the last key
/// returned; every page reports the first page's resourceVersion, so a client that then
/// watches from it replays whatever changed meanwhile and converges.
fn list(app: &App, target: &Target, params: &Params) -> Reply {
    let selector = selector(target, params)?;
    let limit = match params.get("limit").filter(|l| !l.is_empty()) {
        Some(limit) => Some(
            limit
                .parse::<usize>()
                .map_err(|_| ApiError::bad_request(format!("invalid limit {limit:?}")))?,
        ),
        None => None,
    }
    .filter(|l| *l > 0);
    let after = match params.get("continue").filter(|c| !c.is_empty()) {
        Some(token) => Some(decode_continue(token)?),
        None => None,
    };
    app.store.read(|store| {
        let list_rv = match &after {
            Some((rv, _)) => {
                if store.is_expired(*rv).is_some() {
                    return Err(ApiError::expired(
                        "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
                    ));
                }
                *rv
            }
            None => store.resource_version(),
        };
        let mut items = Vec::new();
        let mut next = None;
        let matching = store
            .list(target.kind, target.namespace.as_deref())
            .filter(|(key, _)| after.as_ref().is_none_or(|(_, last)| *key > last))
            .filter(|(_, object)| selector.matches(object));
        for (key, object) in matching {
            if limit.is_some_and(|limit| items.len() == limit) {
                next = Some(encode_continue(list_rv, &items_last_key(&items, key)));
                break;
            }
            items.push((key.clone(), object.clone()));
        }
        let mut metadata = json!({"resourceVersion": list_rv.to_string()});
        if let Some(token) = next {
            metadata["continue"] = json!(token);
        }
        let items: Vec<Value> = items.into_iter().map(|(_, object)| object).collect();
        Ok((
            StatusCode::OK,
            json!({
                "kind": format!("{}List", target.kind.kind()),
                "apiVersion": target.kind.api_version(),
                "metadata": metadata,
                "items": items,
            }),
        ))
    })
}

fn items_last_key(items: &[(Key, Value)], fallback: &Key) -> Key {
    items
        .last()
        .map(|(key, _)| key.clone())
        .unwrap_or_else(|| fallback.clone())
}

fn namespace_list(app: &App) -> Value {
    let mut names: Vec<String> = ["default", "kube-system", "kube-public", "kube-node-lease"]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    app.store.read(|store| {
        for kind in Kind::ALL.into_iter().filter(|k| k.namespaced()) {
            for ((ns, _), _) in store.list(kind, None) {
                if !names.contains(ns) {
                    names.push(ns.clone());
                }
            }
        }
    });
    names.sort();
    let rv = app.store.read(|store| store.resource_version());
    json!({
        "kind": "NamespaceList",
        "apiVersion": "v1",
        "metadata": {"resourceVersion": rv.to_string()},
        "items": names.iter().map(|n| discovery::namespace(n)).collect::<Vec<_>>(),
    })
}

fn watch_request(
    target: &Target,
    params: &Params,
    as_table: Option<table::Include>,
) -> ApiResult<WatchRequest> {
    let selector = selector(target, params)?;
    let start = match params.get("resourceVersion").map(String::as_str) {
        None | Some("") | Some("0") => Start::Current,
        Some(rv) => Start::After(
            rv.parse()
                .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {rv:?}")))?,
        ),
    };
    let flag = |name: &str| params.get(name).is_some_and(|v| v == "true" || v == "1");
    let timeout = match params.get("timeoutSeconds") {
        Some(secs) => Duration::from_secs(
            secs.parse()
                .map_err(|_| ApiError::bad_request(format!("invalid timeoutSeconds {secs:?}")))?,
        ),
        None => DEFAULT_WATCH_TIMEOUT,
    };
    Ok(WatchRequest {
        kind: target.kind,
        namespace: target.namespace.clone(),
        selector,
        start,
        bookmarks: flag("allowWatchBookmarks"),
        initial_events_end: flag("sendInitialEvents") && flag("allowWatchBookmarks"),
        timeout,
        as_table,
    })
}

/// Runs the admission policies in force on a create or update of `target`, on `object` as it
/// would be stored (defaulted; an update's patched or replaced result).
fn admit(
    app: &App,
    user: &Caller,
    target: &Target,
    operation: Operation,
    object: &Value,
    old_object: Option<&Value>,
) -> ApiResult<()> {
    let policies = app.access.policies();
    if policies.is_empty() {
        return Ok(());
    }
    let api_version = target.kind.api_version();
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    // As upstream names a refused object: its name, else its generateName.
    let name = meta_str(object, "name")
        .filter(|n| !n.is_empty())
        .or_else(|| meta_str(object, "generateName"))
        .unwrap_or("");
    let request = AdmissionRequest {
        operation,
        username: &user.name,
        node_claim: user.node.as_deref(),
        group,
        version,
        resource: target.kind.plural(),
        subresource: target.subresource.as_deref().unwrap_or(""),
        kind: target.kind.kind(),
        namespace: target.namespace.as_deref().unwrap_or(""),
        name,
        object,
        old_object,
    };
    policies.admit(&request).map_err(|denial| {
        tracing::debug!(user = %user.name, resource = %target.resource(), name, policy = %denial.policy, "admission denied");
        ApiError::new(
            denial.code(),
            denial.status_reason(),
            denial.status_message(target.kind.plural(), name),
        )
        .with_details(target.kind.plural(), name)
    })
}

fn create(
    app: &App,
    (user, manager): (&Caller, &str),
    target: &Target,
    params: &Params,
    content_type: &str,
    body: &[u8],
) -> Reply {
    let object = parse_body(content_type, body)?;
    let mut object = objects::prepare_create(target.kind, object, target.namespace.as_deref())?;
    app.access
        .drop_disabled_fields(target.kind, &mut object, None);
    admit(app, user, target, Operation::Create, &object, None)?;
    managed::track_create(&mut object, manager, target.kind.has_status());
    let name = meta_str(&object, "name").unwrap_or("").to_owned();
    let key = (target.namespace.clone().unwrap_or_default(), name.clone());
    app.store.write(|store| {
        if store.get(target.kind, &key).is_some() {
            return Err(ApiError::already_exists(target.kind.plural(), &name));
        }
        if dry_run(params) {
            return Ok((StatusCode::CREATED, object));
        }
        Ok((StatusCode::CREATED, store.create(target.kind, key, object)))
    })
}

/// Shared by update and patch: store `new` over the current object, unless nothing changed.
fn store_update(
    store: &mut super::store::Inner,
    (app, user, manager): (&App, &Caller, &str),
    target: &Target,
    current: &Value,
    new: Value,
    params: &Params,
) -> Reply {
    let mut prepared = objects::prepare_update(target.kind, current, new, part(target))?;
    app.access
        .drop_disabled_fields(target.kind, &mut prepared, Some(current));
    // The body's managedFields are not taken: the server records who changed what.
    managed::keep_entries(current, &mut prepared);
    admit(
        app,
        user,
        target,
        Operation::Update,
        &prepared,
        Some(current),
    )?;
    if &prepared == current || dry_run(params) {
        return Ok((StatusCode::OK, prepared));
    }
    managed::track_update(
        current,
        &mut prepared,
        manager,
        target.subresource.as_deref(),
    );
    let finished = prepared.pointer("/metadata/deletionTimestamp").is_some()
        && prepared
            .pointer("/metadata/finalizers")
            .and_then(Value::as_array)
            .is_none_or(|f| f.is_empty())
        && target.kind == Kind::Pod
        && current
            .pointer("/metadata/finalizers")
            .and_then(Value::as_array)
            .is_some_and(|f| !f.is_empty());
    let stored = store.update(target.kind, target.key(), prepared);
    if finished {
        // The last finalizer is gone from an object being deleted: it goes now.
        store.delete(target.kind, &target.key());
    }
    Ok((StatusCode::OK, stored))
}

fn current_or_404<'a>(store: &'a super::store::Inner, target: &Target) -> ApiResult<&'a Value> {
    store
        .get(target.kind, &target.key())
        .ok_or_else(|| ApiError::not_found(target.kind.plural(), target.name()))
}

fn update(
    app: &App,
    (user, manager): (&Caller, &str),
    target: &Target,
    params: &Params,
    content_type: &str,
    body: &[u8],
) -> Reply {
    let new = parse_body(content_type, body)?;
    let body_name = meta_str(&new, "name").unwrap_or("");
    if body_name != target.name() {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({body_name}) does not match the name on the URL ({})",
            target.name()
        )));
    }
    app.store.write(|store| {
        let current = current_or_404(store, target)?.clone();
        let body_rv = meta_str(&new, "resourceVersion").unwrap_or("");
        if !body_rv.is_empty() && Some(body_rv) != meta_str(&current, "resourceVersion") {
            return Err(ApiError::stale(target.kind.plural(), target.name()));
        }
        store_update(store, (app, user, manager), target, &current, new, params)
    })
}

fn patch_object(
    app: &App,
    (user, manager): (&Caller, &str),
    target: &Target,
    params: &Params,
    content_type: &str,
    body: &[u8],
) -> Reply {
    let kind = PatchKind::from_content_type(content_type)?;
    app.store.write(|store| {
        let current = current_or_404(store, target)?.clone();
        let patched = patch::apply(kind, &current, body)?;
        if patched.pointer("/metadata/resourceVersion")
            != current.pointer("/metadata/resourceVersion")
        {
            return Err(ApiError::stale(target.kind.plural(), target.name()));
        }
        let patched_name = patched.pointer("/metadata/name").and_then(Value::as_str);
        if patched_name != Some(target.name()) {
            return Err(ApiError::bad_request(
                "a patch may not change metadata.name",
            ));
        }
        store_update(
            store,
            (app, user, manager),
            target,
            &current,
            patched,
            params,
        )
    })
}

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
    let query_grace = match params.get("gracePeriodSeconds") {
        Some(g) => Some(
            g.parse::<i64>()
                .map_err(|_| ApiError::bad_request(format!("invalid gracePeriodSeconds {g:?}")))?,
        ),
        None => None,
    };
    Ok(DeleteOptions {
        grace: body
            .get("gracePeriodSeconds")
            .and_then(Value::as_i64)
            .or(query_grace),
        uid: body
            .pointer("/preconditions/uid")
            .and_then(Value::as_str)
            .map(str::to_owned),
        resource_version: body
            .pointer("/preconditions/resourceVersion")
            .and_then(Value::as_str)
            .map(str::to_owned),
    })
}

fn delete(app: &App, target: &Target, params: &Params, body: &[u8]) -> Reply {
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
        let has_finalizers = current
            .pointer("/metadata/finalizers")
            .and_then(Value::as_array)
            .is_some_and(|f| !f.is_empty());
        let grace = if target.kind == Kind::Pod {
            let bound = current.pointer("/spec/nodeName").and_then(Value::as_str).is_some_and(|n| !n.is_empty());
            let terminal = matches!(
                current.pointer("/status/phase").and_then(Value::as_str),
                Some("Succeeded" | "Failed")
            );
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

/// `POST .../pods/{name}/binding`: assigns the pod to a node, copying the Binding's
/// annotations onto the pod, exactly once.
/// `POST pods/NAME/eviction` (`policy/v1` Eviction): deletes the pod as a DELETE with the
/// Eviction's `deleteOptions` would, answering a `Success` Status with 201 as the real
/// server does. No PodDisruptionBudget exists here, so none can refuse it.
fn evict(app: &App, target: &Target, params: &Params, body: &[u8]) -> Reply {
    let eviction = parse_body("application/json", body)?;
    let pod_name = target.name();
    let kind = eviction
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or("Eviction");
    let version = eviction
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or("policy/v1");
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

fn bind(app: &App, target: &Target, body: &[u8]) -> Reply {
    let binding = parse_body("application/json", body)?;
    let pod_name = target.name();
    let binding_name = meta_str(&binding, "name").unwrap_or("");
    if binding_name != pod_name {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({binding_name}) does not match the name on the URL ({pod_name})"
        )));
    }
    if let Some(ns) = meta_str(&binding, "namespace").filter(|ns| !ns.is_empty())
        && Some(ns) != target.namespace.as_deref()
    {
        return Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    let target_kind = binding
        .pointer("/target/kind")
        .and_then(Value::as_str)
        .unwrap_or("");
    let node = binding
        .pointer("/target/name")
        .and_then(Value::as_str)
        .unwrap_or("");
    let mut causes = Vec::new();
    if !target_kind.is_empty() && target_kind != "Node" {
        causes.push(format!(
            "target.kind: Invalid value: {target_kind:?}: must be empty or 'Node'"
        ));
    }
    if node.is_empty() {
        causes.push("target.name: Required value".to_owned());
    }
    if !causes.is_empty() {
        return Err(ApiError::invalid("Binding", pod_name, &causes));
    }
    let annotations = binding.pointer("/metadata/annotations").cloned();
    let uid = meta_str(&binding, "uid")
        .filter(|u| !u.is_empty())
        .map(str::to_owned);
    app.store.write(|store| {
        let current = current_or_404(store, target)?.clone();
        let pod_uid = meta_str(&current, "uid").unwrap_or("");
        if let Some(uid) = uid.as_deref().filter(|u| *u != pod_uid) {
            return Err(ApiError::conflict("pods", pod_name, format!(
                "Operation cannot be fulfilled on pods/binding \"{pod_name}\": Precondition failed: UID in precondition: {uid}, UID in object meta: {pod_uid}"
            )));
        }
        if current.pointer("/metadata/deletionTimestamp").is_some() {
            return Err(ApiError::conflict("pods", pod_name, format!(
                "Operation cannot be fulfilled on pods/binding \"{pod_name}\": pod {pod_name} is being deleted, cannot be assigned to a host"
            )));
        }
        if let Some(bound) = current.pointer("/spec/nodeName").and_then(Value::as_str).filter(|n| !n.is_empty()) {
            return Err(ApiError::conflict("pods", pod_name, format!(
                "Operation cannot be fulfilled on pods/binding \"{pod_name}\": pod {pod_name} is already assigned to node \"{bound}\""
            )));
        }
        let mut pod = current;
        pod["spec"]["nodeName"] = json!(node);
        if let Some(Value::Object(annotations)) = annotations {
            let meta = meta_mut(&mut pod);
            let existing = objects::as_map(meta.entry("annotations").or_insert(Value::Null));
            for (key, value) in annotations {
                existing.insert(key, value);
            }
        }
        set_condition(&mut pod, "PodScheduled", "True");
        objects::validate(Kind::Pod, &pod)?;
        store.update(Kind::Pod, target.key(), pod);
        Ok((StatusCode::CREATED, status::success(201)))
    })
}

fn set_condition(pod: &mut Value, kind: &str, status: &str) {
    let condition = json!({"type": kind, "status": status, "lastProbeTime": null, "lastTransitionTime": objects::now()});
    let pod_status = objects::as_map(objects::as_map(pod).entry("status").or_insert(Value::Null));
    let conditions = pod_status.entry("conditions").or_insert(json!([]));
    if !conditions.is_array() {
        *conditions = json!([]);
    }
    if let Value::Array(list) = conditions {
        match list
            .iter_mut()
            .find(|c| c.get("type").and_then(Value::as_str) == Some(kind))
        {
            Some(existing) => *existing = condition,
            None => list.push(condition),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_parse() {
        let r = |p: &str| route(p, "h");
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

    #[test]
    fn continue_tokens_round_trip() {
        let key = ("ns".to_owned(), "a\nb".to_owned());
        let token = encode_continue(42, &key);
        assert_eq!(decode_continue(&token).unwrap(), (42, key));
        assert!(decode_continue("zz").is_err());
        assert!(decode_continue("abc").is_err());
    }
}
