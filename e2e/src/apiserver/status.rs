//! `metav1.Status`: the one shape every failure (and a few successes) takes on the wire.
//!
//! Clients branch on `code` and `reason` (kube turns them into `kube::Error::Api`), so every
//! error here carries the reason string the real API server would send for the same situation.

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use serde_json::{Value, json};

/// A request the server refuses, rendered as a `metav1.Status`.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    /// `details.name` and `details.kind` (the resource's plural, as the real server sends).
    pub details: Option<(String, String)>,
}

impl ApiError {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }

    pub fn with_details(mut self, plural: &str, name: &str) -> Self {
        self.details = Some((name.to_owned(), plural.to_owned()));
        self
    }

    pub fn not_found(plural: &str, name: &str) -> Self {
        Self::new(404, "NotFound", format!("{plural} \"{name}\" not found"))
            .with_details(plural, name)
    }

    pub fn already_exists(plural: &str, name: &str) -> Self {
        Self::new(
            409,
            "AlreadyExists",
            format!("{plural} \"{name}\" already exists"),
        )
        .with_details(plural, name)
    }

    /// The optimistic-concurrency failure: the caller's resourceVersion is stale.
    pub fn stale(plural: &str, name: &str) -> Self {
        Self::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {plural} \"{name}\": the object has been modified; \
                 please apply your changes to the latest version and try again"
            ),
        )
        .with_details(plural, name)
    }

    pub fn conflict(plural: &str, name: &str, message: impl Into<String>) -> Self {
        Self::new(409, "Conflict", message).with_details(plural, name)
    }

    pub fn invalid(kind: &str, name: &str, causes: &[String]) -> Self {
        let message = format!("{kind} \"{name}\" is invalid: {}", causes.join(", "));
        Self::new(422, "Invalid", message).with_details(kind, name)
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    pub fn method_not_allowed() -> Self {
        Self::new(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )
    }

    pub fn unsupported_media_type(content_type: &str) -> Self {
        Self::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json; got {content_type:?}"
            ),
        )
    }

    pub fn expired(message: impl Into<String>) -> Self {
        Self::new(410, "Expired", message)
    }

    pub fn path_not_found(path: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("the server could not find the requested resource ({path})"),
        )
    }

    /// An injected failure, with the reason the real server pairs with `code`.
    pub fn injected(code: u16) -> Self {
        let (reason, message) = match code {
            429 => (
                "TooManyRequests",
                "Too many requests, please try again later.",
            ),
            500 => ("InternalError", "Internal error occurred: injected fault"),
            503 => (
                "ServiceUnavailable",
                "The service is unavailable: injected fault",
            ),
            504 => ("Timeout", "Timeout: injected fault"),
            409 => ("Conflict", "Operation cannot be fulfilled: injected fault"),
            410 => ("Expired", "too old resource version: injected fault"),
            401 => ("Unauthorized", "Unauthorized"),
            403 => ("Forbidden", "forbidden: injected fault"),
            404 => (
                "NotFound",
                "the server could not find the requested resource: injected fault",
            ),
            _ => ("InternalError", "injected fault"),
        };
        Self::new(code, reason, message)
    }

    /// The `metav1.Status` body.
    pub fn to_status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some((name, kind)) = &self.details {
            status["details"] = json!({ "name": name, "kind": kind });
        }
        status
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (code, axum::Json(self.to_status())).into_response();
        if self.code == 429 {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

/// `{"kind":"Status","status":"Success","code":N}`, as binding returns.
pub(crate) fn success(code: u16) -> Value {
    json!({ "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": code })
}

pub(crate) type ApiResult<T> = Result<T, ApiError>;
