//! `kubectl gpushare doctor`: checks an installation and says what to fix.
//!
//! The checks follow a pod's path: the extender must answer and one replica must lead (hold
//! its Lease: only the leader binds), a scheduler must call it, nodes
//! must be labelled, the device plugin must have registered on each of them, and no GPU pod
//! may have been bound around the extender. Each finding names the object and the command
//! that fixes it. [`diagnose`] is pure over a [`Snapshot`]; gathering lives in
//! [`crate::cluster`].
//!
//! [`check_enforcement`] reads how each device plugin DaemonSet enforces shares and, for the
//! NVIDIA toolkit's memory-limit hook, what the API shows of the nodes' driver and CUDA
//! versions; what only a node can show (toolkit version, cgroup v2, an MPS daemon) is named
//! with the command that checks it there.

use std::fmt::Write as _;

use gpushare_contract::env::Enforcement;
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

/// What sets `schedulerName` on new GPU pods: the chart's objects of each kind, by name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Routing {
    /// MutatingAdmissionPolicies (component `routing-policy`): the API server routes pods.
    pub policies: Vec<String>,
    /// MutatingWebhookConfigurations (component `webhook`): the extender's webhook does.
    pub webhooks: Vec<String>,
}

impl Routing {
    /// One line saying what routes GPU pods (`kubectl gpushare top` prints it); `None` when
    /// nothing does (DRA mode, default-scheduler mode, or `webhook.enabled=false`).
    pub fn describe(&self) -> Option<String> {
        match (self.policies.first(), self.webhooks.first()) {
            (Some(policy), _) => Some(format!(
                "GPU pods are routed to the gpushare scheduler by MutatingAdmissionPolicy {policy}"
            )),
            (None, Some(webhook)) => Some(format!(
                "GPU pods are routed to the gpushare scheduler by the admission webhook {webhook}"
            )),
            (None, None) => None,
        }
    }
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
    /// How pods are routed to the scheduler, or why that could not be read.
    pub routing: Option<Result<Routing, String>>,
}

/// Runs every check.
pub fn diagnose(snapshot: &Snapshot, settings: &Settings, install: &Install) -> Vec<Finding> {
    let mut findings = Vec::new();
    check_extender(snapshot, install, &mut findings);
    check_leader(snapshot, install, &mut findings);
    check_scheduler(snapshot, settings, install, &mut findings);
    check_routing(snapshot, install, &mut findings);
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

/// Which admission object routes new GPU pods to the dedicated scheduler, if any.
fn check_routing(snapshot: &Snapshot, install: &Install, out: &mut Vec<Finding>) {
    let name = &install.scheduler_name;
    let dedicated = matches!(&snapshot.schedulers, Some(Ok(d)) if !d.is_empty());
    match &snapshot.routing {
        None => {}
        Some(Err(why)) => out.push(Finding::warn(
            format!("cannot read what routes GPU pods to {name}: {why}"),
            "check that you may list mutatingadmissionpolicies and mutatingwebhookconfigurations",
        )),
        Some(Ok(routing)) => match (routing.policies.first(), routing.webhooks.first()) {
            (Some(policy), _) => out.push(Finding::ok(format!(
                "new GPU pods get schedulerName {name} from MutatingAdmissionPolicy {policy}: the API server sets it, no webhook endpoint involved"
            ))),
            (None, Some(webhook)) => out.push(Finding::ok(format!(
                "new GPU pods get schedulerName {name} from the extender's admission webhook {webhook} (fails open: a pod created while no extender replica is Ready keeps default-scheduler)"
            ))),
            (None, None) if dedicated => out.push(Finding::warn(
                format!("nothing routes GPU pods to {name}: each pod must set schedulerName itself"),
                "helm upgrade with webhook.enabled=true (webhook.routeWith=auto uses a MutatingAdmissionPolicy where the cluster serves admissionregistration.k8s.io/v1 ones, else the webhook)",
            )),
            (None, None) => {}
        },
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
                    "node {name}: the GPU inventory annotation {} is unreadable ({why}); the extender schedules on the node's capacity meanwhile",
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

/// A device plugin DaemonSet as read from the API: its name and enforcement mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevicePluginSpec {
    /// The DaemonSet's name.
    pub name: String,
    /// `--enforcement` from its container's args, else `GPUSHARE_ENFORCEMENT` from its env,
    /// else the plugin's default (`none`).
    pub enforcement: String,
}

/// The device plugin's default enforcement mode.
const DEFAULT_ENFORCEMENT: &str = "none";

/// The enforcement mode a device plugin container runs with: `--enforcement` in `args`
/// (either `--enforcement=X` or `--enforcement X`; the last one wins, as clap reads it), else
/// the `GPUSHARE_ENFORCEMENT` env value, else `none`.
pub fn enforcement_of(args: &[String], env: &[(String, String)]) -> String {
    let mut found = None;
    let mut words = args.iter();
    while let Some(word) = words.next() {
        if let Some(value) = word.strip_prefix("--enforcement=") {
            found = Some(value.to_owned());
        } else if word == "--enforcement" {
            found = words.next().cloned();
        }
    }
    found
        .or_else(|| {
            env.iter()
                .rev()
                .find(|(name, _)| name == "GPUSHARE_ENFORCEMENT")
                .map(|(_, value)| value.clone())
        })
        .unwrap_or_else(|| DEFAULT_ENFORCEMENT.to_owned())
}

/// The oldest driver branch the toolkit's memory-limit hook works with.
const TOOLKIT_MIN_DRIVER: u64 = 615;
/// The oldest CUDA version it works with.
const TOOLKIT_MIN_CUDA: (u64, u64) = (13, 4);

/// A label of NVIDIA GPU feature discovery, under its current name or the deprecated one.
fn gfd_label(node: &Node, names: &[&str]) -> Option<u64> {
    let labels = node.metadata.labels.as_ref()?;
    names
        .iter()
        .find_map(|name| labels.get(*name))
        .and_then(|value| value.trim().parse().ok())
}

/// Checks what the API shows of each device plugin's enforcement mode (`plugins`: its
/// DaemonSets, or why they could not be read) and, for `toolkit`, of the labelled GPU nodes'
/// driver and CUDA versions (NVIDIA GPU feature discovery's `nvidia.com/cuda.*` labels). The
/// toolkit's version, its CDI hook and cgroup v2 live on the node only: the finding says so,
/// and how to check them there.
pub fn check_enforcement(
    plugins: &Result<Vec<DevicePluginSpec>, String>,
    nodes: &[Node],
    settings: &Settings,
    install: &Install,
) -> Vec<Finding> {
    let ns = &install.namespace;
    let plugins = match plugins {
        Ok(plugins) if !plugins.is_empty() => plugins,
        Ok(_) => {
            return vec![Finding::warn(
                format!(
                    "no gpushare device plugin DaemonSet in namespace {ns}: the enforcement mode is unknown"
                ),
                "pass --namespace where gpushare is installed",
            )];
        }
        Err(why) => {
            return vec![Finding::warn(
                format!(
                    "cannot read the device plugin DaemonSets in {ns}: {why}; the enforcement mode is unknown"
                ),
                "run doctor with a user allowed to list daemonsets.apps there",
            )];
        }
    };
    let mut out = Vec::new();
    for plugin in plugins {
        let name = &plugin.name;
        match plugin.enforcement.parse::<Enforcement>() {
            Ok(Enforcement::None) => out.push(Finding::ok(format!(
                "enforcement: none ({ns}/{name}): containers are told their share and trusted to keep to it; `kubectl gpushare top -d` shows pods over their share"
            ))),
            Ok(Enforcement::Preload) => out.push(Finding::ok(format!(
                "enforcement: preload ({ns}/{name}): each GPU container gets gpushare's interposer preloaded and is held to its share (refused past it, shown its share as the GPU's memory); a program that talks to the driver's device files itself or links the driver statically passes by"
            ))),
            Ok(Enforcement::Mps) => out.push(Finding::ok(format!(
                "enforcement: mps ({ns}/{name}): the MPS control daemon on each GPU node cannot be seen from the API; on a node, `echo get_server_list | nvidia-cuda-mps-control` must answer"
            ))),
            Ok(Enforcement::Toolkit) => {
                out.push(Finding::ok(format!(
                    "enforcement: toolkit ({ns}/{name}): the NVIDIA container toolkit with the apply-cuda-memory-limits CDI hook and cgroup v2 cannot be seen from the API; on each GPU node check `nvidia-ctk --version` and that `stat -fc %T /sys/fs/cgroup` prints cgroup2fs"
                )));
                out.extend(check_toolkit_nodes(nodes, settings));
            }
            Err(_) => out.push(Finding::fail(
                format!(
                    "device plugin {ns}/{name} runs with --enforcement={}, which it does not accept: it cannot start",
                    plugin.enforcement
                ),
                "set devicePlugin.enforcement.mode to none, toolkit or mps",
            )),
        }
    }
    out
}

/// Driver and CUDA versions of the labelled GPU nodes against the toolkit hook's needs.
fn check_toolkit_nodes(nodes: &[Node], settings: &Settings) -> Vec<Finding> {
    let mut out = Vec::new();
    let mut unknown = Vec::new();
    for node in nodes.iter().filter(|n| usage::is_labelled(n, settings)) {
        let name = node.metadata.name.as_deref().unwrap_or("<unnamed>");
        let driver = gfd_label(
            node,
            &[
                "nvidia.com/cuda.driver-version.major",
                "nvidia.com/cuda.driver.major",
            ],
        );
        let cuda_major = gfd_label(
            node,
            &[
                "nvidia.com/cuda.runtime-version.major",
                "nvidia.com/cuda.runtime.major",
            ],
        );
        let cuda_minor = gfd_label(
            node,
            &[
                "nvidia.com/cuda.runtime-version.minor",
                "nvidia.com/cuda.runtime.minor",
            ],
        );
        let (Some(driver), Some(cuda_major)) = (driver, cuda_major) else {
            unknown.push(name.to_owned());
            continue;
        };
        let cuda = (cuda_major, cuda_minor.unwrap_or(0));
        if driver < TOOLKIT_MIN_DRIVER || cuda < TOOLKIT_MIN_CUDA {
            out.push(Finding::fail(
                format!(
                    "node {name}: driver R{driver}, CUDA {}.{} (GPU feature discovery labels): the toolkit's memory-limit hook needs driver R{TOOLKIT_MIN_DRIVER}+ and CUDA {}.{}+, so containers there run without a GPU memory limit",
                    cuda.0, cuda.1, TOOLKIT_MIN_CUDA.0, TOOLKIT_MIN_CUDA.1
                ),
                format!(
                    "upgrade the driver on {name}, or keep such nodes out of gpushare until then; devicePlugin.enforcement.mode applies to every node"
                ),
            ));
        } else {
            out.push(Finding::ok(format!(
                "node {name}: driver R{driver}, CUDA {}.{}: recent enough for the toolkit's memory-limit hook",
                cuda.0, cuda.1
            )));
        }
    }
    if !unknown.is_empty() {
        out.push(Finding::warn(
            format!(
                "node(s) {} carry no nvidia.com/cuda.driver-version / cuda.runtime-version labels (NVIDIA GPU feature discovery): their driver and CUDA versions cannot be checked from the API",
                unknown.join(", ")
            ),
            format!(
                "on each, `nvidia-smi` must show driver {TOOLKIT_MIN_DRIVER}+ and CUDA {}.{}+ (or deploy GPU feature discovery)",
                TOOLKIT_MIN_CUDA.0, TOOLKIT_MIN_CUDA.1
            ),
        ));
    }
    out
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

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_testkit::fixtures::node;

    fn install() -> Install {
        Install {
            namespace: "kube-system".into(),
            extender_service: "gpushare-extender".into(),
            scheduler_name: "gpushare-scheduler".into(),
        }
    }

    fn plugin(mode: &str) -> Result<Vec<DevicePluginSpec>, String> {
        Ok(vec![DevicePluginSpec {
            name: "gpushare-device-plugin".into(),
            enforcement: mode.into(),
        }])
    }

    fn strings(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| (*w).to_owned()).collect()
    }

    #[test]
    fn the_enforcement_mode_is_read_as_the_plugin_reads_it() {
        let env = [("GPUSHARE_ENFORCEMENT".to_owned(), "mps".to_owned())];
        assert_eq!(enforcement_of(&[], &[]), "none");
        assert_eq!(enforcement_of(&[], &env), "mps");
        assert_eq!(
            enforcement_of(&strings(&["--enforcement=toolkit"]), &env),
            "toolkit",
            "a flag wins over the environment"
        );
        assert_eq!(
            enforcement_of(
                &strings(&["--enforcement", "mps", "--enforcement=toolkit"]),
                &[]
            ),
            "toolkit",
            "the last flag wins"
        );
    }

    #[test]
    fn toolkit_mode_checks_driver_and_cuda_labels_and_says_what_it_cannot_see() {
        let nodes = vec![
            node("new")
                .gpushare()
                .label("nvidia.com/cuda.driver-version.major", "615")
                .label("nvidia.com/cuda.runtime-version.major", "13")
                .label("nvidia.com/cuda.runtime-version.minor", "4")
                .build(),
            node("old")
                .gpushare()
                .label("nvidia.com/cuda.driver.major", "550")
                .label("nvidia.com/cuda.runtime.major", "12")
                .label("nvidia.com/cuda.runtime.minor", "4")
                .build(),
            node("bare").gpushare().build(),
            node("cpu").build(),
        ];
        let findings =
            check_enforcement(&plugin("toolkit"), &nodes, &Settings::default(), &install());
        let text = render(&findings);
        let level_of = |needle: &str| {
            findings
                .iter()
                .find(|f| f.message.contains(needle))
                .map(|f| f.level)
                .unwrap_or_else(|| panic!("no finding about {needle:?} in\n{text}"))
        };
        assert_eq!(level_of("cannot be seen from the API"), Level::Ok);
        assert_eq!(level_of("node new: driver R615, CUDA 13.4"), Level::Ok);
        assert_eq!(level_of("node old: driver R550, CUDA 12.4"), Level::Fail);
        assert_eq!(level_of("node(s) bare carry no"), Level::Warn);
        assert!(!text.contains("cpu"), "{text}");
    }

    #[test]
    fn other_modes_and_unreadable_daemonsets_are_reported() {
        let nodes = vec![
            node("old")
                .gpushare()
                .label("nvidia.com/cuda.driver.major", "550")
                .build(),
        ];
        let settings = Settings::default();
        let none = check_enforcement(&plugin("none"), &nodes, &settings, &install());
        assert_eq!(none.len(), 1, "{none:?}");
        assert!(none[0].message.starts_with("enforcement: none"), "{none:?}");
        let mps = check_enforcement(&plugin("MPS"), &nodes, &settings, &install());
        assert!(mps[0].message.starts_with("enforcement: mps"), "{mps:?}");
        let bad = check_enforcement(&plugin("strict"), &nodes, &settings, &install());
        assert_eq!(bad[0].level, Level::Fail, "{bad:?}");
        let forbidden = check_enforcement(&Err("forbidden".into()), &nodes, &settings, &install());
        assert_eq!(forbidden[0].level, Level::Warn);
        assert!(forbidden[0].message.contains("forbidden"), "{forbidden:?}");
        let missing = check_enforcement(&Ok(vec![]), &nodes, &settings, &install());
        assert_eq!(missing[0].level, Level::Warn);
    }
}
