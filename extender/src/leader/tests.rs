use k8s_openapi::api::coordination::v1::LeaseSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use tokio::time::Instant;

use super::*;

fn spec(holder: &str, seconds: i32, renewed: &str) -> LeaseSpec {
    LeaseSpec {
        holder_identity: (!holder.is_empty()).then(|| holder.to_owned()),
        lease_duration_seconds: Some(seconds),
        renew_time: Some(MicroTime(renewed.parse().unwrap())),
        lease_transitions: Some(0),
        ..LeaseSpec::default()
    }
}

#[test]
fn identities_differ_per_process_start_and_name_the_pod() {
    let a = identity("gpushare-extender-7d9f-abcde");
    assert_eq!(pod_of(&a), "gpushare-extender-7d9f-abcde");
    assert!(a.starts_with("gpushare-extender-7d9f-abcde_"));
    assert_eq!(pod_of(&identity("")), "gpushare-extender");
}

#[tokio::test]
async fn a_follower_takes_over_only_after_the_record_stood_still_a_lease_duration() {
    let mut observed = Observed::default();
    let t0 = Instant::now();
    assert_eq!(step(None, "b", &mut observed, t0), Step::Create);
    let held = spec("a", 3, "2026-01-01T00:00:00Z");
    assert_eq!(
        step(Some(&held), "b", &mut observed, t0),
        Step::Follow { holder: "a".into() }
    );
    let later = t0 + Duration::from_millis(2900);
    assert!(matches!(
        step(Some(&held), "b", &mut observed, later),
        Step::Follow { .. }
    ));
    // A renewal resets the count, whatever its timestamp says.
    let renewed = spec("a", 3, "2026-01-01T00:00:01Z");
    assert!(matches!(
        step(Some(&renewed), "b", &mut observed, later),
        Step::Follow { .. }
    ));
    let expired = later + Duration::from_secs(3);
    assert_eq!(
        step(Some(&renewed), "b", &mut observed, expired),
        Step::Take
    );
    // Ours: renew; released (no holder): take at once.
    assert_eq!(step(Some(&renewed), "a", &mut observed, later), Step::Renew);
    let released = spec("", 1, "2026-01-01T00:00:02Z");
    assert_eq!(step(Some(&released), "b", &mut observed, later), Step::Take);
}

#[tokio::test]
async fn writes_fit_in_the_lease_and_stop_at_the_renew_deadline() {
    let timing = LeaseTiming::default();
    let leadership = Leadership::default();
    let timeout = Duration::from_millis(2500);
    // No election: always bind, with the full timeout.
    assert!(leadership.reaches_api());
    assert_eq!(
        leadership.gate(Instant::now(), timeout),
        Gate::Bind {
            budget: timeout,
            term: 0
        }
    );
    leadership.elect(timing, "solo");
    assert!(!leadership.reaches_api());
    leadership.answered(Instant::now());
    assert!(leadership.reaches_api());
    assert!(matches!(
        leadership.gate(Instant::now(), timeout),
        Gate::Refuse {
            reason: "no_leader",
            ..
        }
    ));
    leadership.follow(Some((
        "pod-a".into(),
        Some("https://10.0.0.1:39999".into()),
    )));
    assert!(matches!(
        leadership.gate(Instant::now(), timeout),
        Gate::Forward { .. }
    ));
    let t0 = Instant::now();
    assert!(leadership.renewed(t0));
    // Catching up first.
    assert!(matches!(
        leadership.gate(t0, timeout),
        Gate::Refuse {
            reason: "starting",
            ..
        }
    ));
    let t1 = t0 + timing.catch_up;
    assert_eq!(
        leadership.gate(t1, timeout),
        Gate::Bind {
            budget: timeout,
            term: 1
        }
    );
    // A renewal that keeps coming later shrinks the budget: every write ends before
    // t0 + lease duration.
    let t2 = t0 + Duration::from_millis(1000);
    assert_eq!(
        leadership.gate(t2, timeout),
        Gate::Bind {
            budget: Duration::from_millis(2000),
            term: 1
        }
    );
    assert!(!leadership.check_deadline(t0 + timing.renew_deadline));
    let t3 = t0 + timing.renew_deadline + Duration::from_millis(1);
    assert!(leadership.check_deadline(t3));
    assert!(!leadership.is_leader_at(t3));
    assert!(matches!(
        leadership.gate(t3, timeout),
        Gate::Refuse { .. } | Gate::Forward { .. }
    ));
    // Leading again means catching up again, in a new term.
    assert!(leadership.renewed(t3));
    assert!(matches!(
        leadership.gate(t3, timeout),
        Gate::Refuse {
            reason: "starting",
            ..
        }
    ));
    assert!(matches!(
        leadership.gate(t3 + timing.catch_up, timeout),
        Gate::Bind { term: 2, .. }
    ));
    // Stepping down refuses at once and reports when the last write ends.
    let write = leadership.write_started(t3 + timeout);
    assert_eq!(leadership.step_down(), (true, Some(t3 + timeout)));
    let waiting = tokio::spawn({
        let leadership = leadership.clone();
        async move { leadership.writes_ended(None).await }
    });
    tokio::task::yield_now().await;
    assert!(!waiting.is_finished());
    drop(write);
    waiting.await.unwrap();
    assert!(matches!(
        leadership.gate(t3 + timing.catch_up, timeout),
        Gate::Refuse {
            reason: "not_leader",
            ..
        }
    ));
}
