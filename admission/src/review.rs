//! The `admission.k8s.io/v1` AdmissionReview wire types, defined here with serde.
//!
//! We only need a handful of fields and want full control over how a malformed request is
//! reported, so these mirror the real API (camelCase keys) instead of pulling in kube's
//! admission feature. Unknown fields are ignored, missing optional ones default.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The API version this webhook speaks (and the only one the chart registers).
pub const API_VERSION: &str = "admission.k8s.io/v1";
/// The kind of the envelope, in both directions.
pub const KIND: &str = "AdmissionReview";
/// The only patch type the admission API defines.
pub const PATCH_TYPE_JSON_PATCH: &str = "JSONPatch";

/// The envelope the API server posts and expects back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionReview {
    /// `admission.k8s.io/v1`.
    #[serde(default)]
    pub api_version: String,
    /// `AdmissionReview`.
    #[serde(default)]
    pub kind: String,
    /// Set by the API server on the way in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<AdmissionRequest>,
    /// Set by the webhook on the way out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<AdmissionResponse>,
}

/// Group, version and kind of the object under admission.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupVersionKind {
    /// API group; empty for the core group.
    #[serde(default)]
    pub group: String,
    /// API version, e.g. `v1`.
    #[serde(default)]
    pub version: String,
    /// Kind, e.g. `Pod`.
    #[serde(default)]
    pub kind: String,
}

/// Group, version and resource of the object under admission.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupVersionResource {
    /// API group; empty for the core group.
    #[serde(default)]
    pub group: String,
    /// API version, e.g. `v1`.
    #[serde(default)]
    pub version: String,
    /// Resource, e.g. `pods`.
    #[serde(default)]
    pub resource: String,
}

/// What the API server asks about.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionRequest {
    /// Identifies this request; the response must carry the same value.
    pub uid: String,
    /// Kind of the object.
    #[serde(default)]
    pub kind: GroupVersionKind,
    /// Resource being operated on.
    #[serde(default)]
    pub resource: GroupVersionResource,
    /// Subresource, e.g. `status`, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sub_resource: Option<String>,
    /// Name of the object; empty on CREATE with `generateName`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Namespace of the object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// `CREATE`, `UPDATE`, `DELETE` or `CONNECT`.
    #[serde(default)]
    pub operation: String,
    /// Who is asking (kept opaque: we only log it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_info: Option<Value>,
    /// The object as it would be stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object: Option<Value>,
    /// The existing object on UPDATE and DELETE.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_object: Option<Value>,
    /// True when the request will not be persisted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dry_run: Option<bool>,
    /// Operation options (CreateOptions, …), opaque.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub options: Option<Value>,
}

/// The webhook's answer.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionResponse {
    /// Copied from the request.
    pub uid: String,
    /// Whether the object may be admitted.
    pub allowed: bool,
    /// Why not, when `allowed` is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<ResponseStatus>,
    /// Base64 of an RFC 6902 JSON Patch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patch: Option<String>,
    /// `JSONPatch` whenever `patch` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patch_type: Option<String>,
    /// Warnings shown to the client (kubectl prints them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// The subset of `metav1.Status` an admission response uses.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResponseStatus {
    /// HTTP-like code shown to the user, e.g. 400.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<u16>,
    /// Human readable reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Machine readable reason, e.g. `BadRequest`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl AdmissionResponse {
    /// Admit unchanged.
    pub fn allow(uid: &str) -> Self {
        Self {
            uid: uid.to_owned(),
            allowed: true,
            ..Self::default()
        }
    }

    /// Refuse with `code` and a message the user will read in kubectl's output.
    pub fn deny(uid: &str, code: u16, reason: &str, message: impl Into<String>) -> Self {
        Self {
            uid: uid.to_owned(),
            allowed: false,
            status: Some(ResponseStatus {
                code: Some(code),
                message: Some(message.into()),
                reason: Some(reason.to_owned()),
            }),
            ..Self::default()
        }
    }

    /// Wraps the response in the envelope the API server expects.
    pub fn into_review(self) -> AdmissionReview {
        AdmissionReview {
            api_version: API_VERSION.to_owned(),
            kind: KIND.to_owned(),
            request: None,
            response: Some(self),
        }
    }
}
