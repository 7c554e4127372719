//! `kubectl gpushare doctor`: checks an installation and says what to fix.
//!
//! The checks follow a pod's path: the extender must answer and one replica must lead (hold
//! its Lease: only the leader binds), a scheduler must call it, nodes
//! must be labelled, the device plugin must have registered on each of them, and no GPU pod
//! may have been bound around the extender. Each finding names the object and the command
//! that fixes it. [`diagnose`] is pure over a [`Snapshot`]; gathering lives in
//! [`crate::cluster`].

use std::fmt::Write as _;

use k8s_openapi::api::core::v1::{Node, Pod};

use crate::usage::{self, GpuSource, Settings};

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Working as intended.
    Ok,
    /// Probably wrong, or wrong for some pods.
    Warn,
    /// Broken: GPU pods will not be placed or pinned correctly.
    Fail,
}

/// One check's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// Severity.
    pub level: Level,
    /// What was found.
    pub message: String,
    /// What to do about it.
    pub fix: Option<String>,
}

impl Finding {
    fn ok(message: impl Into<String>) -> Self {
        Self {
            level: Level::Ok,
            message: message.into(),
            fix: None,
        }
    }

    fn warn(message: impl Into<String>, fix: impl Into<String>) -> Self {
        Self {
            level: Level::Warn,
            message: message.into(),
            fix: Some(fix.into()),
        }
    }

    fn fail(message: impl Into<String>, fix: impl Into<String>) -> Self {
        Self {
            level: Level::Fail,
            message: message.into(),
            fix: Some(fix.into()),
        }
    }
}

/// Where gpushare is installed and what it is called.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Install {
    /// Namespace of the chart.
    pub namespace: String,
    /// The extender's Service.
    pub extender_service: String,
    /// The scheduler profile name pods use.
    pub scheduler_name: String,
}

/// A scheduler Deployment found in the install namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerDeployment {
    /// Its name.
    pub name: String,
    /// Ready replicas.
    pub ready: i32,
    /// Desired replicas.
    pub desired: i32,
}

/// The extender's Lease as read: who holds it and how fresh it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderLease {
    /// The holder's pod name (`holderIdentity` without its per-process suffix); `None` when
    /// released.
    pub holder: Option<String>,
    /// How long ago it was last renewed (by this machine's clock against the record's).
    pub renewed_ago: Option<std::time::Duration>,
    /// `leaseDurationSeconds`.
    pub duration: std::time::Duration,
}

/// Everything the checks look at.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// All nodes.
    pub nodes: Vec<Node>,
    /// All pods, every namespace.
    pub pods: Vec<Pod>,
    /// The extender's `/healthz`: `Ok(how it was reached)` or `Err(why not)`.
    pub extender: Option<Result<String, String>>,
    /// gpushare scheduler Deployments, or why they could not be listed.
    pub schedulers: Option<Result<Vec<SchedulerDeployment>, String>>,
    /// The extender's Lease (`None` inside: there is none), or why it could not be read.
    pub leader: Option<Result<Option<LeaderLease>, String>>,
}

/// Runs every check.
pub fn diagnose(snapshot: &Snapshot, settings: &Settings, install: &Install) -> Vec<Finding> {
    let mut findings = Vec::new();
    check_extender(snapshot, install, &mut findings);
    check_leader(snapshot, install, &mut findings);
    check_scheduler(snapshot, settings, install, &mut findings);
    check_nodes(snapshot, settings, install, &mut findings);
    check_bypass(snapshot, settings, install, &mut findings);
    findings
}

fn check_extender(snapshot: &Snapshot, install: &Install, out: &mut Vec<Finding>) {
    let ns = &install.namespace;
    let svc = &install.extender_service;
    match &snapshot.extender {
        None => {}
        Some(Ok(how)) => out.push(Finding::ok(format!("extender answers /healthz ({how})"))),
        Some(Err(why)) => out.push(Finding::fail(
            format!("extender {ns}/{svc} does not answer /healthz: {why}"),
            format!(
                "kubectl -n {ns} get pods -l app.kubernetes.io/component=extender; kubectl -n {ns} logs deploy/{svc} (or pass --namespace/--extender-service if installed elsewhere)"
            ),
        )),
    }
}

/// Clock difference tolerated between this machine and the cluster before a Lease counts
/// as expired.
const LEASE_SLACK: std::time::Duration = std::time::Duration::from_secs(2);

fn check_leader(snapshot: &Snapshot, install: &Install, out: &mut Vec<Finding>) {
    let ns = &install.namespace;
    let lease = &install.extender_service;
    let logs = format!(
        "kubectl -n {ns} get pods -l app.kubernetes.io/component=extender; kubectl -n {ns} logs -l app.kubernetes.io/component=extender --prefix | grep -i lease"
    );
    match &snapshot.leader {
        None => {}
        Some(Err(why)) => out.push(Finding::warn(
            format!("cannot read the extender's Lease {ns}/{lease}: {why}"),
            format!("check that you may get leases in {ns}"),
        )),
        Some(Ok(None)) => out.push(Finding::warn(
            format!(
                "no extender Lease {ns}/{lease}: no replica has ever led (an extender without --leader-elect binds alone; run exactly one)"
            ),
            logs,
        )),
        Some(Ok(Some(record))) => match (&record.holder, record.renewed_ago) {
            (Some(holder), Some(ago)) if ago <= record.duration + LEASE_SLACK => {
                out.push(Finding::ok(format!(
                    "extender replica {holder} leads (Lease {ns}/{lease} renewed {:.1} s ago)",
                    ago.as_secs_f64()
                )));
            }
            (Some(holder), ago) => out.push(Finding::warn(
                format!(
                    "no extender replica leads: the Lease {ns}/{lease} of {holder} expired{}; binds are refused (the scheduler retries) until a replica takes it",
                    ago.map(|ago| format!(" ({:.0} s since its last renewal)", ago.as_secs_f64()))
                        .unwrap_or_default()
                ),
                logs,
            )),
            (None, _) => out.push(Finding::warn(
                format!(
                    "no extender replica leads: the Lease {ns}/{lease} was released; binds are refused (the scheduler retries) until a replica takes it"
                ),
                logs,
            )),
        },
    }
}

fn has_allocation(pod: &Pod, settings: &Settings) -> bool {
    pod.metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(&settings.keys.gpu_index))
}

fn check_scheduler(
    snapshot: &Snapshot,
    settings: &Settings,
    install: &Install,
    out: &mut Vec<Finding>,
) {
    let ns = &install.namespace;
    let placed = snapshot
        .pods
        .iter()
        .filter(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_some()))
        .filter(|p| has_allocation(p, settings))
        .count();
    let deployments = match &snapshot.schedulers {
        None => return,
        Some(Ok(deployments)) => deployments.as_slice(),
        Some(Err(why)) => {
            out.push(Finding::warn(
                format!("cannot list scheduler Deployments in {ns}: {why}"),
                format!("check that you may list deployments in {ns}, or pass --namespace"),
            ));
            &[]
        }
    };
    for d in deployments {
        if d.ready > 0 {
            out.push(Finding::ok(format!(
                "scheduler Deployment {ns}/{} is ready ({}/{})",
                d.name, d.ready, d.desired
            )));
        } else {
            out.push(Finding::fail(
                format!(
                    "scheduler Deployment {ns}/{} has no ready replica ({}/{})",
                    d.name, d.ready, d.desired
                ),
                format!(
                    "kubectl -n {ns} describe deploy/{0}; kubectl -n {ns} logs deploy/{0}",
                    d.name
                ),
            ));
        }
    }
    if deployments.is_empty() {
        if placed > 0 {
            out.push(Finding::ok(format!(
                "no gpushare scheduler Deployment in {ns}, but {placed} pod(s) were placed by the extender: a scheduler calls it"
            )));
        } else {
            out.push(Finding::warn(
                format!(
                    "no gpushare scheduler Deployment in {ns} and no pod placed by the extender yet"
                ),
                format!(
                    "install the chart with scheduler.mode=dedicated, or add the extender stanza to your kube-scheduler configuration (chart README, \"default-scheduler mode\"); pods must use schedulerName {} in dedicated mode",
                    install.scheduler_name
                ),
            ));
        }
    }
}

fn check_nodes(
    snapshot: &Snapshot,
    settings: &Settings,
    install: &Install,
    out: &mut Vec<Finding>,
) {
    let label = format!("{}={}", settings.label_key, settings.label_value);
    let resource = &settings.resource;
    let ns = &install.namespace;
    let mut labelled = 0;
    let mut registered = 0;
    for node in &snapshot.nodes {
        let name = node.metadata.name.as_deref().unwrap_or("<unnamed>");
        let capacity = usage::capacity_gib(node, resource).unwrap_or(0);
        if !usage::is_labelled(node, settings) {
            if capacity > 0 {
                out.push(Finding::warn(
                    format!(
                        "node {name} advertises {capacity} GiB of {resource} but lacks the label {label}: the extender will not place pods there"
                    ),
                    format!("kubectl label node {name} {label}"),
                ));
            }
            continue;
        }
        labelled += 1;
        if capacity == 0 {
            out.push(Finding::fail(
                format!(
                    "node {name} is labelled {label} but advertises no {resource}: the device plugin has not registered there"
                ),
                format!(
                    "kubectl -n {ns} get pods -o wide -l app.kubernetes.io/component=device-plugin --field-selector spec.nodeName={name}; check its logs, the node's GPU driver and the NVIDIA container runtime"
                ),
            ));
            continue;
        }
        let usage = usage::cluster_usage(std::slice::from_ref(node), &[], settings);
        match usage.first().map(|u| &u.source) {
            Some(GpuSource::Inventory) => registered += 1,
            Some(GpuSource::BadInventory(why)) => out.push(Finding::fail(
                format!(
                    "node {name}: the GPU inventory annotation {} is unreadable: {why}",
                    settings.keys.node_gpus
                ),
                format!(
                    "check that the device plugin on {name} and the extender run the same gpushare version (--domain must match)"
                ),
            )),
            _ => out.push(Finding::warn(
                format!(
                    "node {name} advertises {capacity} GiB of {resource} but no GPU inventory (annotation {}): GPU UUIDs are unknown",
                    settings.keys.node_gpus
                ),
                format!(
                    "check the device plugin's logs on {name}: it may not be allowed to patch its Node, or runs with another --domain"
                ),
            )),
        }
    }
    if labelled == 0 {
        out.push(Finding::fail(
            format!("no node carries the label {label}"),
            format!("kubectl label node <gpu-node> {label}"),
        ));
    } else {
        out.push(Finding::ok(format!(
            "{labelled} node(s) labelled {label}, {registered} with the device plugin registered and a GPU inventory"
        )));
    }
}

fn check_bypass(
    snapshot: &Snapshot,
    settings: &Settings,
    install: &Install,
    out: &mut Vec<Finding>,
) {
    let usage = usage::cluster_usage(&snapshot.nodes, &snapshot.pods, settings);
    let mut bypassed = 0;
    for node in &usage {
        for pod in node.pods.iter().filter(|p| p.gpu.is_none()) {
            bypassed += 1;
            out.push(Finding::fail(
                format!(
                    "pod {}/{} on node {} asks for {} GiB of {} but carries no gpushare allocation: scheduler {:?} bound it without the extender, so no GPU was chosen for it",
                    pod.namespace, pod.name, node.name, pod.gib, settings.resource, pod.scheduler
                ),
                format!(
                    "recreate it with schedulerName: {} (the chart's admission webhook sets it on new pods when enabled)",
                    install.scheduler_name
                ),
            ));
        }
    }
    if bypassed == 0 {
        out.push(Finding::ok("no GPU pod bypassed the extender"));
    }
}

/// `[OK]`, `[WARN]` and `[FAIL]` lines, each problem followed by its fix.
pub fn render(findings: &[Finding]) -> String {
    let mut out = String::new();
    for finding in findings {
        let tag = match finding.level {
            Level::Ok => "[OK]  ",
            Level::Warn => "[WARN]",
            Level::Fail => "[FAIL]",
        };
        let _ = writeln!(out, "{tag} {}", finding.message);
        if let Some(fix) = &finding.fix {
            let _ = writeln!(out, "       fix: {fix}");
        }
    }
    let fails = findings.iter().filter(|f| f.level == Level::Fail).count();
    let warns = findings.iter().filter(|f| f.level == Level::Warn).count();
    let _ = writeln!(out, "{fails} failure(s), {warns} warning(s)");
    out
}
