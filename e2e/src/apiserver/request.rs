//! What every verb is handed: the resource the path names ([`Target`]), the query
//! ([`Params`]), an accepted [`Write`], the body parsed as JSON or YAML, and what a verb
//! answers ([`Reply`]).
//!
//! Parsed once by the router in `handlers.rs` and read by each verb (`reads.rs`, `writes.rs`,
//! `deletes.rs`, `binding.rs`); kept in a module of its own so that the verbs depend on the
//! request, never on the router that dispatches to them.

use std::collections::HashMap;

use axum::body::Bytes;
use http::StatusCode;
use serde_json::Value;

use super::objects::Part;
use super::resources::Kind;
use super::status::{ApiError, ApiResult};
use super::store::{Inner, Key};
use super::{Caller, Verb};

/// A request's query parameters.
pub(super) type Params = HashMap<String, String>;

/// A request for a served resource, parsed from the path.
#[derive(Debug, Clone)]
pub(super) struct Target {
    pub(super) kind: Kind,
    pub(super) namespace: Option<String>,
    pub(super) name: Option<String>,
    pub(super) subresource: Option<String>,
}

impl Target {
    pub(super) fn resource(&self) -> String {
        match &self.subresource {
            Some(sub) => format!("{}/{sub}", self.kind.plural()),
            None => self.kind.plural().to_owned(),
        }
    }

    pub(super) fn key(&self) -> Key {
        (
            self.namespace.clone().unwrap_or_default(),
            self.name.clone().unwrap_or_default(),
        )
    }

    pub(super) fn name(&self) -> &str {
        self.name.as_deref().unwrap_or("")
    }
}

/// An accepted write (create, update, patch, delete, and the `binding` and `eviction`
/// subresources), owned so that it can run to the end in a task of its own (`handlers.rs`).
pub(super) struct Write {
    pub(super) verb: Verb,
    /// Who asked (admission sees it as `request.userInfo`).
    pub(super) user: Caller,
    pub(super) target: Target,
    pub(super) params: Params,
    pub(super) content_type: String,
    pub(super) body: Bytes,
}

/// What a verb answers: the status code and the body, or the error.
pub(super) type Reply = ApiResult<(StatusCode, Value)>;

pub(super) fn part(target: &Target) -> Part {
    if target.subresource.as_deref() == Some("status") {
        Part::Status
    } else {
        Part::Main
    }
}

pub(super) fn parse_body(content_type: &str, body: &[u8]) -> ApiResult<Value> {
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

/// The query parameter `name`'s `value` as a `T`, or a 400 naming both.
pub(super) fn parse_param<T: std::str::FromStr>(name: &str, value: &str) -> ApiResult<T> {
    let invalid = || ApiError::bad_request(format!("invalid {name} {value:?}"));
    value.parse().map_err(|_| invalid())
}

pub(super) fn dry_run(params: &Params) -> bool {
    params.get("dryRun").is_some_and(|v| v == "All")
}

pub(super) fn current_or_404<'a>(store: &'a Inner, target: &Target) -> ApiResult<&'a Value> {
    store
        .get(target.kind, &target.key())
        .ok_or_else(|| ApiError::not_found(target.kind.plural(), target.name()))
}
