//! gpushare's mutating admission webhook, as a library the extender mounts.
//!
//! ```text
//!  kubectl create pod ──▶ API server ──AdmissionReview (HTTPS, caBundle)──▶ /mutate-pods
//!                                   ◀── JSONPatch: /spec/schedulerName = gpushare-scheduler
//!                                       (+ /spec/tolerations: the idle-GPU taint, when on)
//! ```
//!
//! Why: a pod asking for GPU memory must be scheduled through the gpushare extender, or no
//! GPU is chosen for it. The webhook routes such pods to the gpushare scheduler profile so
//! users need not remember `schedulerName`. The chart registers it with
//! `failurePolicy: Ignore`, so an unavailable webhook never blocks pod creation; pods that
//! slip through show up in `kubectl gpushare top` (PENDING) and `kubectl gpushare doctor`.
//!
//! - [`webhook`]: the decision and the axum [`router`].
//! - [`review`]: the AdmissionReview wire types.
//! - [`tls`]: a self-made CA and serving certificate, rotated without restart
//!   ([`CertRotator`]), the caBundle patch ([`CaBundlePatcher`]) and the HTTPS server
//!   ([`serve_tls`]).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

pub mod review;
pub mod tls;
pub mod webhook;

pub use review::{AdmissionRequest, AdmissionResponse, AdmissionReview};
pub use tls::{
    CaBundlePatcher, CertConfig, CertRotator, SelfSignedCa, merge_ca_bundle, serve_tls,
    serve_tls_on,
};
pub use webhook::{AdmissionState, DEFAULT_SCHEDULER_NAME, MUTATE_PODS_PATH, review_pod, router};

/// Why the webhook's TLS could not be set up or kept current.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// rcgen could not generate a key or certificate.
    #[error("cannot generate the webhook's TLS certificate: {0}")]
    Certificate(#[source] rcgen::Error),
    /// The requested certificate lifetime cannot be represented.
    #[error("certificate validity {0:?} is too long")]
    Validity(Duration),
    /// rustls refused the generated key.
    #[error("the generated TLS key is unusable: {0}")]
    Key(#[source] rustls::Error),
    /// Writing PEM files failed.
    #[error("cannot write {path}: {source}")]
    Write {
        /// the file or directory
        path: PathBuf,
        /// the I/O error
        #[source]
        source: std::io::Error,
    },
    /// The HTTPS listener could not bind.
    #[error("cannot listen for admission requests on {addr}: {source}")]
    Bind {
        /// the address
        addr: SocketAddr,
        /// the I/O error
        #[source]
        source: std::io::Error,
    },
    /// Reading or patching the MutatingWebhookConfiguration failed.
    #[error(
        "cannot update caBundle of MutatingWebhookConfiguration {name} (does it exist, and may the extender get/patch it?): {source}"
    )]
    PatchCaBundle {
        /// the configuration's name
        name: String,
        /// the API error
        #[source]
        source: kube::Error,
    },
    /// The configuration exists but declares no webhooks.
    #[error("MutatingWebhookConfiguration {0} has no webhooks whose caBundle could be set")]
    NoWebhooks(String),
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
