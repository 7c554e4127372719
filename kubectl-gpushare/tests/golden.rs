//! `top` and `doctor` output over fixed objects, compared with files in `tests/golden/`.

mod common;

use gpushare_testkit::fixtures::{node, pod};
use k8s_openapi::api::core::v1::PodStatus;
use std::time::Duration;

use kubectl_gpushare::doctor::{
    self, Install, LeaderLease, Level, Routing, SchedulerDeployment, Snapshot,
};
use kubectl_gpushare::render::{render_top, render_top_details};
use kubectl_gpushare::usage::{Settings, cluster_usage};

fn install() -> Install {
    Install {
        namespace: "kube-system".into(),
        extender_service: "gpushare-extender".into(),
        scheduler_name: "gpushare-scheduler".into(),
    }
}

#[test]
fn top_golden() {
    let (nodes, pods) = common::cluster();
    let usage = cluster_usage(&nodes, &pods, &Settings::default());
    common::assert_golden("top.txt", &render_top(&usage));
}

#[test]
fn top_details_golden() {
    let (nodes, pods) = common::cluster();
    let usage = cluster_usage(&nodes, &pods, &Settings::default());
    common::assert_golden("top-details.txt", &render_top_details(&usage));
}

#[test]
fn usage_counts_allocated_pending_and_skips_finished_pods() {
    let (nodes, mut pods) = common::cluster();
    let mut done = common::placed(pod("done").gpu_mem(10).on_node("n1"), 0, 10).build();
    done.status = Some(PodStatus {
        phase: Some("Succeeded".into()),
        ..Default::default()
    });
    pods.push(done);
    let usage = cluster_usage(&nodes, &pods, &Settings::default());
    let names: Vec<_> = usage.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["n1", "n2", "n3", "n4"]);
    let n1 = &usage[0];
    assert_eq!(n1.gpus[0].allocated_gib, 4);
    assert_eq!(n1.gpus[1].allocated_gib, 8);
    assert_eq!(n1.pending_gib(), 2);
    assert_eq!((n1.allocated_gib(), n1.total_gib()), (14, 32));
    // Capacity-only node: 32 GiB split over the 2 GPUs of the count label.
    let n2 = &usage[1];
    assert_eq!(
        n2.gpus.iter().map(|g| g.total_gib).collect::<Vec<_>>(),
        [16, 16]
    );
    assert_eq!(n2.gpus[1].allocated_gib, 6);
}

#[test]
fn unhealthy_gpus_are_marked() {
    let nodes = vec![node("n1").gpushare().gpus(&[16, 16]).unhealthy(1).build()];
    let text = render_top(&cluster_usage(&nodes, &[], &Settings::default()));
    assert!(text.contains("0/16*"), "{text}");
    assert!(text.contains("unhealthy GPU"), "{text}");
}

#[test]
fn doctor_golden_and_findings() {
    let (nodes, pods) = common::cluster();
    let snapshot = Snapshot {
        nodes,
        pods,
        extender: Some(Ok("GET http://127.0.0.1:39999/healthz: 200 OK".into())),
        schedulers: Some(Ok(vec![SchedulerDeployment {
            name: "gpushare-scheduler".into(),
            ready: 1,
            desired: 1,
        }])),
        leader: Some(Ok(Some(LeaderLease {
            holder: Some("gpushare-extender-7d9f6-x2x4q".into()),
            renewed_ago: Some(Duration::from_millis(400)),
            duration: Duration::from_secs(3),
        }))),
        routing: Some(Ok(Routing {
            policies: vec!["gpushare-route-pods".into()],
            webhooks: vec![],
        })),
    };
    let findings = doctor::diagnose(&snapshot, &Settings::default(), &install());
    let text = doctor::render(&findings);
    common::assert_golden("doctor.txt", &text);
    let fails: Vec<_> = findings
        .iter()
        .filter(|f| f.level == Level::Fail)
        .map(|f| f.message.as_str())
        .collect();
    assert!(
        fails
            .iter()
            .any(|m| m.starts_with("pod default/c on node n1")),
        "{text}"
    );
    assert!(
        fails.iter().any(|m| m.starts_with("node n4 is labelled")),
        "{text}"
    );
    assert!(
        findings
            .iter()
            .any(|f| f.level == Level::Warn && f.message.starts_with("node n3 advertises")),
        "{text}"
    );
}

#[test]
fn doctor_on_a_healthy_install_has_no_failure() {
    let nodes = vec![node("n1").gpushare().gpus(&[16]).build()];
    let pods = vec![common::placed(pod("a").gpu_mem(4).on_node("n1"), 0, 4).build()];
    let snapshot = Snapshot {
        nodes,
        pods,
        extender: Some(Ok("via proxy".into())),
        schedulers: Some(Ok(vec![])),
        leader: Some(Ok(Some(LeaderLease {
            holder: Some("gpushare-extender-7d9f6-x2x4q".into()),
            renewed_ago: Some(Duration::from_secs(1)),
            duration: Duration::from_secs(3),
        }))),
        routing: Some(Ok(Routing {
            policies: vec![],
            webhooks: vec!["gpushare-webhook".into()],
        })),
    };
    let findings = doctor::diagnose(&snapshot, &Settings::default(), &install());
    assert!(
        findings.iter().all(|f| f.level == Level::Ok),
        "{}",
        doctor::render(&findings)
    );
}

#[test]
fn doctor_names_what_routes_gpu_pods() {
    let dedicated = || {
        Some(Ok(vec![SchedulerDeployment {
            name: "gpushare-scheduler".into(),
            ready: 1,
            desired: 1,
        }]))
    };
    let names = |names: &[&str]| names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>();
    for (schedulers, routing, level, says) in [
        (
            dedicated(),
            Ok(Routing {
                policies: names(&["gpushare-route-pods"]),
                webhooks: names(&["gpushare-webhook"]),
            }),
            Some(Level::Ok),
            "from MutatingAdmissionPolicy gpushare-route-pods",
        ),
        (
            dedicated(),
            Ok(Routing {
                policies: vec![],
                webhooks: names(&["gpushare-webhook"]),
            }),
            Some(Level::Ok),
            "from the extender's admission webhook gpushare-webhook",
        ),
        (
            dedicated(),
            Ok(Routing::default()),
            Some(Level::Warn),
            "nothing routes GPU pods to gpushare-scheduler",
        ),
        (
            Some(Ok(vec![])),
            Ok(Routing::default()),
            None,
            "routes GPU pods",
        ),
        (
            dedicated(),
            Err("forbidden".to_owned()),
            Some(Level::Warn),
            "cannot read what routes GPU pods",
        ),
    ] {
        let snapshot = Snapshot {
            schedulers,
            routing: Some(routing),
            ..Snapshot::default()
        };
        let findings = doctor::diagnose(&snapshot, &Settings::default(), &install());
        let found = findings.iter().find(|f| f.message.contains(says));
        assert_eq!(found.map(|f| f.level), level, "{says:?}: {findings:?}");
    }
}

#[test]
fn doctor_warns_when_no_extender_replica_leads() {
    let lease = |holder: Option<&str>, ago: u64| LeaderLease {
        holder: holder.map(str::to_owned),
        renewed_ago: Some(Duration::from_secs(ago)),
        duration: Duration::from_secs(3),
    };
    for (leader, says) in [
        (
            Ok(Some(lease(Some("gpushare-extender-a"), 30))),
            "of gpushare-extender-a expired (30 s since its last renewal)",
        ),
        (Ok(Some(lease(None, 0))), "was released"),
        (Ok(None), "no replica has ever led"),
        (
            Err("forbidden".to_owned()),
            "cannot read the extender's Lease",
        ),
    ] {
        let snapshot = Snapshot {
            leader: Some(leader),
            ..Snapshot::default()
        };
        let findings = doctor::diagnose(&snapshot, &Settings::default(), &install());
        let warning = findings
            .iter()
            .find(|f| f.message.contains(says))
            .unwrap_or_else(|| panic!("no finding saying {says:?}: {findings:?}"));
        assert_eq!(warning.level, Level::Warn);
        assert!(warning.fix.is_some());
    }
}
