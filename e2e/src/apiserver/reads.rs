//! The read verbs: get, list (with `limit`/`continue` pages and selectors), the namespace
//! list, and a watch request read from the query.
//!
//! Reads never change the store, so they live apart from the writes: what a client sees of
//! the state, and how pages and watches line up on one resourceVersion, is here in one place.

use std::collections::BTreeSet;
use std::time::Duration;

use http::StatusCode;
use serde_json::{Value, json};

use super::request::{Params, Reply, Target, current_or_404, parse_param};
use super::resources::Kind;
use super::selector::Selector;
use super::status::{ApiError, ApiResult};
use super::store::Key;
use super::watch::{Start, WatchRequest};
use super::{App, discovery};

/// Watch length when the client gives no `timeoutSeconds`.
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);

pub(super) fn get(app: &App, target: &Target) -> Reply {
    app.store
        .read(|store| Ok((StatusCode::OK, current_or_404(store, target)?.clone())))
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
pub(super) fn list(app: &App, target: &Target, params: &Params) -> Reply {
    let selector = selector(target, params)?;
    let limit = params
        .get("limit")
        .filter(|l| !l.is_empty())
        .map(|limit| parse_param::<usize>("limit", limit))
        .transpose()?
        .filter(|l| *l > 0);
    let after = params
        .get("continue")
        .filter(|c| !c.is_empty())
        .map(|token| decode_continue(token))
        .transpose()?;
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
        let mut items: Vec<Value> = Vec::new();
        let mut metadata = json!({"resourceVersion": list_rv.to_string()});
        let mut last = None;
        let matching = store
            .list(target.kind, target.namespace.as_deref())
            .filter(|(key, _)| after.as_ref().is_none_or(|(_, last)| *key > last))
            .filter(|(_, object)| selector.matches(object));
        for (key, object) in matching {
            if limit.is_some_and(|limit| items.len() == limit) {
                let token = encode_continue(list_rv, last.unwrap_or(key));
                metadata["continue"] = json!(token);
                break;
            }
            items.push(object.clone());
            last = Some(key);
        }
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

pub(super) fn namespace_list(app: &App) -> Value {
    let mut names: BTreeSet<String> = ["default", "kube-system", "kube-public", "kube-node-lease"]
        .map(str::to_owned)
        .into();
    let rv = app.store.read(|store| {
        for kind in Kind::ALL.into_iter().filter(|k| k.namespaced()) {
            names.extend(store.list(kind, None).map(|((ns, _), _)| ns.clone()));
        }
        store.resource_version()
    });
    json!({
        "kind": "NamespaceList",
        "apiVersion": "v1",
        "metadata": {"resourceVersion": rv.to_string()},
        "items": names.iter().map(|n| discovery::namespace(n)).collect::<Vec<_>>(),
    })
}

pub(super) fn watch_request(target: &Target, params: &Params) -> ApiResult<WatchRequest> {
    let selector = selector(target, params)?;
    let start = match params.get("resourceVersion").map(String::as_str) {
        None | Some("") | Some("0") => Start::Current,
        Some(rv) => Start::After(parse_param("resourceVersion", rv)?),
    };
    let flag = |name: &str| params.get(name).is_some_and(|v| v == "true" || v == "1");
    let timeout = match params.get("timeoutSeconds") {
        Some(secs) => Duration::from_secs(parse_param("timeoutSeconds", secs)?),
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
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continue_tokens_round_trip() {
        let key = ("ns".to_owned(), "a\nb".to_owned());
        let token = encode_continue(42, &key);
        assert_eq!(decode_continue(&token).unwrap(), (42, key));
        assert!(decode_continue("zz").is_err());
        assert!(decode_continue("abc").is_err());
    }
}
