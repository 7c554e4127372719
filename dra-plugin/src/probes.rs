//! `/healthz` and `/readyz` over HTTP, for kubelet's liveness and readiness probes.
//!
//! A started container is not yet a usable plugin. kubelet's plugin watcher has to find the
//! registration socket and call `GetInfo`; only then does kubelet register the driver and
//! say so with `NotifyRegistrationStatus`. A claim kubelet prepares in between fails with
//! "DRA driver … is not registered", and kubelet tries that pod again only about a minute
//! later. So the pod is ready when kubelet says the registration succeeded, not when the
//! process starts: `/readyz` answers 200 from then on and 503 with the reason before (or
//! after a refusal), which makes `kubectl rollout status` and a rolling update's
//! `maxUnavailable` wait for the registration.
//!
//! `/healthz` answers 200 while the plugin runs; the server stops with the gRPC servers, on
//! the same shutdown.

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::service::RegistrationState;

/// The liveness path.
pub const HEALTHZ: &str = "/healthz";
/// The readiness path.
pub const READYZ: &str = "/readyz";

/// The probe routes; `/readyz` follows `registration`.
pub fn router(registration: watch::Receiver<RegistrationState>) -> Router {
    Router::new()
        .route(HEALTHZ, get(|| async { "ok" }))
        .route(READYZ, get(readyz))
        .with_state(registration)
}

/// Serves the probes on `listener` until `stop`, on the accept loop every gpushare server
/// runs (`gpushare_runtime::http`).
pub async fn serve(
    listener: TcpListener,
    registration: watch::Receiver<RegistrationState>,
    stop: CancellationToken,
) -> std::io::Result<()> {
    gpushare_runtime::http::Server::new(listener, router(registration))
        .serve(stop.cancelled_owned())
        .await;
    Ok(())
}

/// Ready only once kubelet registered the plugin; otherwise why not, for whoever reads the
/// probe's failure in the pod's Events.
pub fn readiness(state: &RegistrationState) -> Result<(), String> {
    match state {
        RegistrationState::Registered => Ok(()),
        RegistrationState::Pending => Err("not registered with kubelet yet".to_owned()),
        RegistrationState::Refused(error) if error.is_empty() => {
            Err("kubelet reported registration failed (no reason given)".to_owned())
        }
        RegistrationState::Refused(error) => {
            Err(format!("kubelet reported registration failed: {error}"))
        }
    }
}

async fn readyz(
    State(registration): State<watch::Receiver<RegistrationState>>,
) -> (StatusCode, String) {
    // The verdict is copied out: no borrow of the channel is held while responding.
    let verdict = readiness(&registration.borrow());
    match verdict {
        Ok(()) => (StatusCode::OK, "registered with kubelet".to_owned()),
        Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, reason),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    async fn get(app: &Router, path: &str) -> (StatusCode, String) {
        let response = app
            .clone()
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn ready_only_while_kubelet_says_registered() {
        let (registration, seen) = watch::channel(RegistrationState::default());
        let app = router(seen);

        assert_eq!(
            get(&app, READYZ).await,
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "not registered with kubelet yet".to_owned()
            )
        );

        registration.send_replace(RegistrationState::Registered);
        assert_eq!(get(&app, READYZ).await.0, StatusCode::OK);

        registration.send_replace(RegistrationState::Refused(
            "plugin gpushare.example.com already registered".to_owned(),
        ));
        assert_eq!(
            get(&app, READYZ).await,
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "kubelet reported registration failed: plugin gpushare.example.com already registered"
                    .to_owned()
            )
        );

        registration.send_replace(RegistrationState::Registered);
        assert_eq!(get(&app, READYZ).await.0, StatusCode::OK);
    }

    #[tokio::test]
    async fn a_refusal_without_a_reason_still_says_what_happened() {
        let (_registration, seen) = watch::channel(RegistrationState::Refused(String::new()));
        assert_eq!(
            get(&router(seen), READYZ).await,
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "kubelet reported registration failed (no reason given)".to_owned()
            )
        );
    }

    #[tokio::test]
    async fn live_whatever_kubelet_says() {
        for state in [
            RegistrationState::Pending,
            RegistrationState::Registered,
            RegistrationState::Refused("no".to_owned()),
        ] {
            let (_registration, seen) = watch::channel(state);
            assert_eq!(
                get(&router(seen), HEALTHZ).await,
                (StatusCode::OK, "ok".to_owned())
            );
        }
    }

    #[tokio::test]
    async fn other_paths_are_not_found() {
        let (_registration, seen) = watch::channel(RegistrationState::Registered);
        assert_eq!(
            get(&router(seen), "/metrics").await.0,
            StatusCode::NOT_FOUND
        );
    }
}
