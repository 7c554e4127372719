//! Who may call the scheduler port's verbs (filter, prioritize, bind, preempt, inspect,
//! identity).
//!
//! Any pod on the cluster network can reach the port. Without a check, such a pod could hold
//! GPU memory for nobody with a loop of filter calls, post binds, or read every pod's
//! placement from inspect. So, with `--client-ca`, the TLS handshake asks each client for a
//! certificate of that CA (the chart issues one to its kube-scheduler and one to the
//! replicas, for binds passed to the leader and its probe):
//! - a certificate of another CA fails the handshake (counted, `untrusted_certificate`);
//! - no certificate at all gets a 403 with a JSON error on each verb (counted,
//!   `no_client_certificate`), not a bare TLS alert, so a misconfigured scheduler's log says
//!   what is missing.
//!
//! One exception, bounded in time: `--accept-uncertified-until` lets callers without a
//! certificate through until that instant (counted apart). The chart sets it only on the
//! `helm upgrade` that first turns client certificates on, because the Deployments roll side
//! by side: for a few seconds the old kube-scheduler, which has no certificate yet, still
//! calls new replicas, and old replicas pass binds to a new leader. Past the instant the rule
//! holds again, with no restart.
//!
//! `/healthz`, `/readyz` and `/metrics` are not verbs: probes and Prometheus use the
//! monitoring port (`--monitor-listen`).

use axum::Json;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use gpushare_runtime::http::ClientCertificate;
use jiff::Timestamp;

use super::ErrorBody;
use crate::metrics::{Metrics, RefusalReason};

/// The rule for the scheduler port's callers, with the counters of its outcomes.
#[derive(Clone, Debug)]
pub struct Callers {
    rule: Rule,
    metrics: Metrics,
}

/// Who is let through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rule {
    /// Anyone who reaches the port (no `--client-ca`).
    Anyone,
    /// Callers with a certificate of the client CA; until `grace_ends`, if set, also callers
    /// with none.
    Certified { grace_ends: Option<Timestamp> },
}

/// What becomes of one call.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Admit,
    AdmitInGrace,
    Refuse,
}

impl Callers {
    /// Anyone may call (no client CA configured).
    pub fn anyone(metrics: &Metrics) -> Self {
        Self {
            rule: Rule::Anyone,
            metrics: metrics.clone(),
        }
    }

    /// Only callers with a certificate of the client CA; until `grace_ends` also callers
    /// with none.
    pub fn certified(grace_ends: Option<Timestamp>, metrics: &Metrics) -> Self {
        Self {
            rule: Rule::Certified { grace_ends },
            metrics: metrics.clone(),
        }
    }

    /// Counts a handshake refused for a certificate not of the client CA.
    pub fn count_untrusted_handshake(&self) {
        self.metrics
            .refuse_caller(RefusalReason::UntrustedCertificate);
    }

    fn verdict(&self, client: Option<ClientCertificate>, now: Timestamp) -> Verdict {
        match (self.rule, client) {
            (Rule::Anyone, _) | (Rule::Certified { .. }, Some(ClientCertificate::Verified)) => {
                Verdict::Admit
            }
            (
                Rule::Certified {
                    grace_ends: Some(end),
                },
                _,
            ) if now < end => Verdict::AdmitInGrace,
            (Rule::Certified { .. }, _) => Verdict::Refuse,
        }
    }
}

/// The middleware in front of every verb: passes the call on or answers 403.
pub async fn admit(State(callers): State<Callers>, request: Request, next: Next) -> Response {
    let client = request.extensions().get::<ClientCertificate>().copied();
    match callers.verdict(client, Timestamp::now()) {
        Verdict::Admit => next.run(request).await,
        Verdict::AdmitInGrace => {
            callers.metrics.uncertified_calls_in_grace.inc();
            next.run(request).await
        }
        Verdict::Refuse => {
            callers
                .metrics
                .refuse_caller(RefusalReason::NoClientCertificate);
            tracing::debug!(path = %request.uri().path(), "refused a call without a client certificate");
            let body = ErrorBody {
                error: "this port answers only kube-scheduler and the extender's replicas: \
                        present the client certificate the chart issues (the Secret \
                        <release>-extender-client-tls; README, \"Who may call the extender\")"
                    .to_owned(),
            };
            (StatusCode::FORBIDDEN, Json(body)).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::registry::Registry;

    fn metrics() -> Metrics {
        Metrics::register(&mut Registry::default())
    }

    #[test]
    fn without_a_client_ca_anyone_is_admitted() {
        let callers = Callers::anyone(&metrics());
        for client in [None, Some(ClientCertificate::Absent)] {
            assert_eq!(callers.verdict(client, Timestamp::now()), Verdict::Admit);
        }
    }

    #[test]
    fn with_a_client_ca_only_a_verified_certificate_is_admitted() {
        let callers = Callers::certified(None, &metrics());
        let now = Timestamp::now();
        assert_eq!(
            callers.verdict(Some(ClientCertificate::Verified), now),
            Verdict::Admit
        );
        assert_eq!(
            callers.verdict(Some(ClientCertificate::Absent), now),
            Verdict::Refuse
        );
        // Plain HTTP carries no certificate at all: refused as well.
        assert_eq!(callers.verdict(None, now), Verdict::Refuse);
    }

    #[test]
    fn the_grace_admits_callers_without_a_certificate_until_it_ends() {
        let now = Timestamp::now();
        let end = now + jiff::SignedDuration::from_secs(600);
        let callers = Callers::certified(Some(end), &metrics());
        assert_eq!(
            callers.verdict(Some(ClientCertificate::Absent), now),
            Verdict::AdmitInGrace
        );
        assert_eq!(
            callers.verdict(Some(ClientCertificate::Verified), now),
            Verdict::Admit
        );
        assert_eq!(
            callers.verdict(Some(ClientCertificate::Absent), end),
            Verdict::Refuse
        );
    }
}
