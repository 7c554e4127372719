//! The real-Kubernetes tier: gpushare installed by `helm` on the real v1.36 cluster of
//! `../shared/realk8s` (see `gpushare_e2e::realk8s`), scenarios driven through the API.
//!
//! Its own runner (`harness = false`): the cluster uses fixed ports and `/var/lib/kubelet`, so
//! scenarios run one after another, grouped by install so each group brings the cluster up
//! once. Arguments that do not start with `-` select scenarios by substring. Without the kit
//! the tier is skipped with a loud message, except under `CI=true`, where that is a failure.
//! It ends with the plain `N passed, N failed` line.

use std::collections::BTreeSet;
use std::future::Future;
use std::pin::Pin;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use gpushare_contract::{Keys, env};
use gpushare_e2e::cluster::wait_for;
use gpushare_e2e::fixtures;
use gpushare_e2e::realk8s::{Kit, KitCluster, Mode};
use gpushare_e2e::scenarios::{
    Harness, allocation, check_no_overcommit, check_pinned, create_gpu_pod, delete_pod, phase,
    wait_running, wait_unschedulable,
};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};

type Outcome<'a> = Pin<Box<dyn Future<Output = anyhow::Result<()>> + 'a>>;
type Scenario = for<'a> fn(&'a KitCluster) -> Outcome<'a>;

/// One install of the chart and the scenarios that run on it, in order.
struct Group {
    mode: Mode,
    helm_args: &'static [&'static str],
    scenarios: &'static [(&'static str, Scenario)],
}

const GROUPS: &[Group] = &[
    Group {
        mode: Mode::Extender,
        helm_args: &[],
        scenarios: &[
            ("readme_story", readme_story),
            ("two_gpu_and_exclusive_pods", two_gpu_and_exclusive_pods),
            (
                "forged_allocations_are_refused",
                forged_allocations_are_refused,
            ),
            ("doctor_names_the_router", doctor_names_the_router),
            (
                "kubelet_restart_keeps_gpu_pods",
                kubelet_restart_keeps_gpu_pods,
            ),
            // After the kubelet restart: the device plugin rolled then must still take the
            // next pod (it once got "no healthy devices"; docs/testing.md).
            (
                "toolkit_enforcement_after_helm_upgrade",
                toolkit_enforcement_after_helm_upgrade,
            ),
            // Last: it adds Node objects with no kubelet behind them.
            ("leader_killed_in_a_burst", leader_killed_in_a_burst),
        ],
    },
    Group {
        mode: Mode::Dra,
        helm_args: &[],
        scenarios: &[("dra_claims_run_and_free", dra_claims_run_and_free)],
    },
];

fn main() -> ExitCode {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|arg| !arg.starts_with('-'))
        .collect();
    if std::env::args().any(|arg| arg == "--list") {
        for group in GROUPS {
            for (name, _) in group.scenarios {
                println!("real::{name}: test");
            }
        }
        return ExitCode::SUCCESS;
    }
    let in_ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let kit = match Kit::locate() {
        Ok(Some(kit)) => kit,
        Ok(None) if in_ci => {
            eprintln!("real tier: FAILED: CI=true but the kit ../shared/realk8s is absent");
            println!("0 passed, 1 failed");
            return ExitCode::FAILURE;
        }
        Ok(None) => {
            eprintln!(
                "\n!!!!!!!!!! real tier SKIPPED: no ../shared/realk8s beside the repository (or \
                 GPUSHARE_REALK8S_KIT). Nothing was checked against real Kubernetes. !!!!!!!!!!\n"
            );
            println!("0 passed, 0 failed, 1 skipped");
            return ExitCode::SUCCESS;
        }
        Err(error) => {
            eprintln!("real tier: FAILED to set up the kit: {error:#}");
            println!("0 passed, 1 failed");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("real tier: no tokio runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let selected = |name: &str| filters.is_empty() || filters.iter().any(|f| name.contains(f));
    let (mut passed, mut failed) = (0, 0);
    let started = Instant::now();
    for group in GROUPS {
        let chosen: Vec<_> = group
            .scenarios
            .iter()
            .filter(|(name, _)| selected(name))
            .collect();
        if chosen.is_empty() {
            continue;
        }
        let up_started = Instant::now();
        let cluster = match runtime.block_on(kit.up(group.mode, group.helm_args)) {
            Ok(cluster) => cluster,
            Err(error) => {
                for (name, _) in &chosen {
                    println!("test real::{name} ... FAILED (the cluster did not come up)");
                }
                eprintln!("{error:#}");
                failed += chosen.len();
                continue;
            }
        };
        println!(
            "real tier: {:?} install up in {:.1} s",
            group.mode,
            up_started.elapsed().as_secs_f64()
        );
        for (name, scenario) in chosen {
            let t0 = Instant::now();
            let result = runtime.block_on(async {
                let outcome = scenario(&cluster).await;
                // Every scenario leaves free GPUs behind, whatever happened.
                let cleanup = cluster.delete_all_pods("default").await;
                outcome.and(cleanup)
            });
            let seconds = t0.elapsed().as_secs_f64();
            match result {
                Ok(()) => {
                    passed += 1;
                    println!("test real::{name} ... ok ({seconds:.1} s)");
                }
                Err(error) => {
                    failed += 1;
                    println!("test real::{name} ... FAILED ({seconds:.1} s)\n{error:#}");
                }
            }
        }
        drop(cluster);
    }
    println!("real tier: {:.1} s in all", started.elapsed().as_secs_f64());
    println!("{passed} passed, {failed} failed");
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The README's story as a user types it: plain pods (no `schedulerName`) of 4 GiB on the
/// node's two GPUs (15 and 16 GiB): the first three share one GPU, the others go where they
/// fit, the one that fits nowhere waits with its reason, and a deleted pod frees its share.
fn readme_story(c: &KitCluster) -> Outcome<'_> {
    Box::pin(async move {
        // On 1.36 the chart's `auto` routing is the API server's own policy, not the webhook.
        let routing = c.kubectl(&[
            "get",
            "mutatingadmissionpolicies,mutatingwebhookconfigurations",
            "-o",
            "name",
        ])?;
        ensure!(
            routing.trim()
                == "mutatingadmissionpolicy.admissionregistration.k8s.io/gpushare-route-pods",
            "expected the routing policy and no webhook: {routing}"
        );
        for i in 1..=3 {
            create_gpu_pod(c, &format!("notebook-{i}"), 4).await?;
        }
        let mut first_gpu = BTreeSet::new();
        for i in 1..=3 {
            let pod = wait_running(c, &format!("notebook-{i}")).await?;
            ensure!(
                pod.spec.as_ref().and_then(|s| s.scheduler_name.as_deref())
                    == Some("gpushare-scheduler"),
                "the webhook did not route notebook-{i} to gpushare's scheduler"
            );
            check_pinned(c, &pod).await?;
            first_gpu.insert(allocation(&pod)?.gpu_uuid);
        }
        ensure!(
            first_gpu.len() == 1,
            "the first three pods should share one GPU: {first_gpu:?}"
        );
        // 15 + 16 GiB hold seven pods of 4 GiB; the eighth fits nowhere.
        for i in 4..=7 {
            create_gpu_pod(c, &format!("notebook-{i}"), 4).await?;
        }
        for i in 4..=7 {
            let pod = wait_running(c, &format!("notebook-{i}")).await?;
            check_pinned(c, &pod).await?;
        }
        create_gpu_pod(c, "notebook-8", 4).await?;
        let reason = wait_unschedulable(c, "notebook-8").await?;
        // kube-scheduler's own fit already sees the node's 31 GiB less the 28 held.
        ensure!(
            reason.contains("Insufficient example.com/gpu-mem"),
            "the pending pod's reason should name the resource: {reason}"
        );
        let usage = check_no_overcommit(&c.client()).await?;
        ensure!(
            usage.values().map(|(used, _)| used).sum::<u64>() == 28,
            "seven pods of 4 GiB should hold 28 GiB: {usage:?}"
        );
        let pods: Api<Pod> = Api::namespaced(c.client(), "default");
        let freed = allocation(&pods.get("notebook-1").await?)?.gpu_uuid;
        delete_pod(c, "notebook-1").await?;
        let eighth = wait_running(c, "notebook-8").await?;
        check_pinned(c, &eighth).await?;
        ensure!(
            allocation(&eighth)?.gpu_uuid == freed,
            "notebook-8 should take the share notebook-1 left on {freed}"
        );
        check_no_overcommit(&c.client()).await?;
        Ok(())
    })
}

/// A pod spread over both GPUs (`gpus: "2"`) sees both; an exclusive pod takes a whole,
/// empty GPU and nobody shares it.
fn two_gpu_and_exclusive_pods(c: &KitCluster) -> Outcome<'_> {
    Box::pin(async move {
        let pods: Api<Pod> = Api::namespaced(c.client(), "default");
        let two = fixtures::pod("two-gpus")
            .gpu_mem(8)
            .annotation("gpushare.example.com/gpus", "2")
            .build();
        pods.create(&PostParams::default(), &c.prepare(two)).await?;
        let two = wait_running(c, "two-gpus").await?;
        check_pinned(c, &two).await?;
        let alloc = allocation(&two)?;
        ensure!(
            alloc.gpus().count() == 2 && alloc.pod_gib == 4,
            "two-gpus should hold 4 GiB on each of 2 GPUs: {alloc:?}"
        );
        let env = c.container_env("two-gpus", "main").await?;
        ensure!(
            env.get(env::NVIDIA_VISIBLE_DEVICES)
                .map(|v| v.split(',').count())
                == Some(2),
            "two-gpus should see two GPUs: {env:?}"
        );
        delete_pod(c, "two-gpus").await?;

        let whole = fixtures::pod("whole")
            .gpu_mem(15)
            .annotation("gpushare.example.com/exclusive", "true")
            .build();
        pods.create(&PostParams::default(), &c.prepare(whole))
            .await?;
        let whole = wait_running(c, "whole").await?;
        check_pinned(c, &whole).await?;
        let taken = allocation(&whole)?;
        ensure!(
            taken.exclusive,
            "the whole-GPU pod is not exclusive: {taken:?}"
        );
        // A small pod must go to the other GPU, even though the exclusive pod's GPU may be
        // larger than it asked for.
        create_gpu_pod(c, "small", 1).await?;
        let small = wait_running(c, "small").await?;
        check_pinned(c, &small).await?;
        ensure!(
            allocation(&small)?.gpu_uuid != taken.gpu_uuid,
            "a shared pod landed on the exclusive pod's GPU {}",
            taken.gpu_uuid
        );
        check_no_overcommit(&c.client()).await?;
        Ok(())
    })
}

/// A user the chart does not trust.
const ATTACKER: &str = "system:serviceaccount:default:notebook";

/// The write was refused by the chart's allocation policy (403, naming it), saying `hint`.
fn refused<T: std::fmt::Debug>(result: Result<T, kube::Error>, hint: &str) -> anyhow::Result<()> {
    match result {
        Err(kube::Error::Api(status)) => {
            ensure!(
                status.code == 403
                    && status
                        .message
                        .contains("ValidatingAdmissionPolicy 'gpushare-allocations'")
                    && status.message.contains(hint),
                "expected a 403 from the allocation policy saying {hint:?}, got {status:?}"
            );
            Ok(())
        }
        Err(other) => bail!("expected the allocation policy to refuse, got {other}"),
        Ok(admitted) => bail!("the write was admitted: {admitted:?}"),
    }
}

/// The forgeries found on a real cluster, refused by the API server itself: a hand-written
/// allocation with `nodeName`, `nodeName` alone, and a patch of a running pod's allocation.
fn forged_allocations_are_refused(c: &KitCluster) -> Outcome<'_> {
    Box::pin(async move {
        let keys = Keys::default();
        create_gpu_pod(c, "victim", 6).await?;
        let victim = wait_running(c, "victim").await?;
        check_pinned(c, &victim).await?;
        // The attacker may create and patch pods in its namespace, as a notebook user can.
        c.kubectl(&[
            "create",
            "rolebinding",
            "notebook-edit",
            "-n",
            "default",
            "--clusterrole=edit",
            "--serviceaccount=default:notebook",
            "--dry-run=client",
            "-o",
            "yaml",
        ])
        .and_then(|yaml| c.kubectl_stdin(&["apply", "-f", "-"], &yaml))?;
        let pods: Api<Pod> = Api::namespaced(c.client_as(ATTACKER).await?, "default");

        let forged = fixtures::pod("forged")
            .gpu_mem(6)
            .on_node("node-k")
            .annotation(&keys.gpu_index, "0")
            .annotation(&keys.pod_gib, "0")
            .annotation(&keys.assigned, "true")
            .build();
        refused(
            pods.create(&PostParams::default(), &c.prepare(forged))
                .await,
            "",
        )?;
        let bypass = fixtures::pod("bypass")
            .gpu_mem(16)
            .on_node("node-k")
            .build();
        refused(
            pods.create(&PostParams::default(), &c.prepare(bypass))
                .await,
            "remove spec.nodeName",
        )?;
        let gpu = allocation(&victim)?.gpu_index;
        for patch in [
            serde_json::json!({"metadata": {"annotations": {keys.gpu_index.clone(): (1 - gpu).to_string()}}}),
            serde_json::json!({"metadata": {"annotations": {keys.pod_gib.clone(): "1"}}}),
            serde_json::json!({"metadata": {"annotations": {keys.assigned.clone(): null}}}),
        ] {
            refused(
                pods.patch("victim", &PatchParams::default(), &Patch::Merge(&patch))
                    .await,
                "cannot be set, changed or removed by hand",
            )?;
        }
        let admin: Api<Pod> = Api::namespaced(c.client(), "default");
        for name in ["forged", "bypass"] {
            ensure!(admin.get_opt(name).await?.is_none(), "{name} exists");
        }
        let victim = admin.get("victim").await?;
        ensure!(phase(&victim) == "Running", "the victim stopped");
        check_pinned(c, &victim).await?;
        check_no_overcommit(&c.client()).await?;
        Ok(())
    })
}

/// kubelet restarts while GPU pods run: they keep running on their GPUs, the device plugin
/// registers again, and a new pod is placed and pinned as before.
fn kubelet_restart_keeps_gpu_pods(c: &KitCluster) -> Outcome<'_> {
    Box::pin(async move {
        for name in ["before-1", "before-2"] {
            create_gpu_pod(c, name, 5).await?;
        }
        let mut before = Vec::new();
        for name in ["before-1", "before-2"] {
            before.push(wait_running(c, name).await?);
        }
        c.script("kubelet.sh", &["restart"])?;
        let pods: Api<Pod> = Api::namespaced(c.client(), "default");
        for pod in &before {
            let name = pod.metadata.name.as_deref().unwrap_or_default();
            let now = pods.get(name).await?;
            ensure!(
                now.metadata.uid == pod.metadata.uid && phase(&now) == "Running",
                "{name} did not survive the kubelet restart: {}",
                phase(&now)
            );
            ensure!(
                allocation(&now)? == allocation(pod)?,
                "{name}'s allocation changed"
            );
        }
        create_gpu_pod(c, "after", 5).await?;
        let after = wait_running(c, "after").await?;
        check_pinned(c, &after).await?;
        check_no_overcommit(&c.client()).await?;
        Ok(())
    })
}

/// `helm upgrade` turns on toolkit enforcement: the device plugin rolls, and a new
/// container gets `NVIDIA_GPU_MEMORY_LIMIT` (MiB) for its share.
fn toolkit_enforcement_after_helm_upgrade(c: &KitCluster) -> Outcome<'_> {
    Box::pin(async move {
        let chart = c
            .kit()
            .root()
            .join("project")
            .join("charts")
            .join("gpushare");
        let chart = chart.to_string_lossy();
        c.helm(&[
            "upgrade",
            "gpushare",
            &chart,
            "-n",
            "kube-system",
            "--reuse-values",
            "--set",
            "devicePlugin.enforcement.mode=toolkit",
        ])?;
        c.kubectl(&[
            "-n",
            "kube-system",
            "rollout",
            "status",
            "ds/gpushare-device-plugin",
            "--timeout=120s",
        ])?;
        create_gpu_pod(c, "limited", 3).await?;
        let pod = wait_running(c, "limited").await?;
        check_pinned(c, &pod).await?;
        let env = c.container_env("limited", "main").await?;
        ensure!(
            env.get("NVIDIA_GPU_MEMORY_LIMIT").map(String::as_str) == Some("3072"),
            "the container should get NVIDIA_GPU_MEMORY_LIMIT=3072: {env:?}"
        );
        Ok(())
    })
}

/// `kubectl gpushare doctor` (and `top`) name what routes GPU pods: on 1.36 with the chart's
/// defaults, its MutatingAdmissionPolicy and no webhook.
fn doctor_names_the_router(c: &KitCluster) -> Outcome<'_> {
    Box::pin(async move {
        let kubeconfig = c.kit().admin_kubeconfig();
        let cluster = kubectl_gpushare::cluster::Cluster::connect(Some(&kubeconfig)).await?;
        let routing = cluster.routing().await.map_err(anyhow::Error::msg)?;
        ensure!(
            routing.policies == ["gpushare-route-pods"] && routing.webhooks.is_empty(),
            "the chart should route with its MutatingAdmissionPolicy alone: {routing:?}"
        );
        let line = routing.describe().unwrap_or_default();
        ensure!(
            line.contains("MutatingAdmissionPolicy gpushare-route-pods"),
            "{line}"
        );
        Ok(())
    })
}

const CLAIM_TEMPLATE: &str = r#"{
  "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
  "metadata": {"name": "gpu-4g", "namespace": "default"},
  "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
    "deviceClassName": "gpu-mem.gpushare.example.com",
    "capacity": {"requests": {"memory": "4Gi"}}}}]}}}
}"#;

fn dra_pod(name: &str) -> anyhow::Result<Pod> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu-4g"}],
            "containers": [{"name": "main", "image": "busybox:1.36",
                            "resources": {"claims": [{"name": "gpu"}]}}]
        }
    }))?)
}

/// DRA mode on the real kubelet: pods from a ResourceClaimTemplate run with their claim's
/// CDI device, three share the 15 GiB GPU's neighbour or it, a plugin restart keeps them,
/// and a deleted pod's share goes to the next one.
fn dra_claims_run_and_free(c: &KitCluster) -> Outcome<'_> {
    Box::pin(async move {
        let templates: Api<kube::api::DynamicObject> = Api::namespaced_with(
            c.client(),
            "default",
            &kube::api::ApiResource::from_gvk(&kube::api::GroupVersionKind::gvk(
                "resource.k8s.io",
                "v1",
                "ResourceClaimTemplate",
            )),
        );
        let template: kube::api::DynamicObject = serde_json::from_str(CLAIM_TEMPLATE)?;
        templates.create(&PostParams::default(), &template).await?;
        let pods: Api<Pod> = Api::namespaced(c.client(), "default");
        for i in 1..=3 {
            pods.create(&PostParams::default(), &dra_pod(&format!("dra-{i}"))?)
                .await?;
        }
        for i in 1..=3 {
            let name = format!("dra-{i}");
            let pod = wait_running(c, &name).await?;
            let uid = pod.metadata.uid.clone().unwrap_or_default();
            let created = c
                .created(&uid, "main")?
                .with_context(|| format!("no CreateContainer recorded for {name}"))?;
            let cdi = created.cdi.unwrap_or_default();
            ensure!(
                cdi.len() == 1 && cdi[0].starts_with("gpushare.example.com/"),
                "{name} should get one CDI device of ours: {cdi:?}"
            );
        }
        // The plugin restarts (its pod deleted; the DaemonSet makes a new one): running
        // pods stay, and new claims are prepared by the new plugin.
        c.kubectl(&[
            "-n",
            "kube-system",
            "delete",
            "pod",
            "-l",
            "app.kubernetes.io/component=dra-plugin",
            "--wait=true",
        ])?;
        c.kubectl(&[
            "-n",
            "kube-system",
            "rollout",
            "status",
            "ds/gpushare-dra-plugin",
            "--timeout=120s",
        ])?;
        for i in 1..=3 {
            let pod = pods.get(&format!("dra-{i}")).await?;
            ensure!(
                phase(&pod) == "Running",
                "dra-{i} stopped after a plugin restart"
            );
        }
        delete_pod(c, "dra-1").await?;
        pods.create(&PostParams::default(), &dra_pod("dra-4")?)
            .await?;
        wait_running(c, "dra-4").await?;
        let claims = wait_for(
            "dra-1's claim to be deleted",
            Duration::from_secs(60),
            || async {
                let list = c
                    .kubectl(&["get", "resourceclaims", "-n", "default", "-o", "name"])
                    .ok()?;
                (!list.contains("dra-1-")).then_some(list)
            },
        )
        .await?;
        ensure!(claims.lines().count() == 3, "claims left: {claims}");
        let _ = pods.list(&ListParams::default()).await?;
        Ok(())
    })
}

/// Fake GPU nodes (Node objects only; pods bound there never run) for load scenarios.
const FAKE_NODES: usize = 70;
const BURST_PODS: usize = 1000;

/// The extender leader SIGKILLed three times while a burst of GPU pods is created: no create
/// is refused, every pod is bound with an allocation, no GPU is over-committed. Prints how
/// long binding stopped after each kill.
fn leader_killed_in_a_burst(c: &KitCluster) -> Outcome<'_> {
    Box::pin(async move {
        let inventory: Vec<serde_json::Value> = (0..4)
            .map(|i| serde_json::json!({"index": i, "uuid": format!("GPU-fake-{i}"), "model": "Fake", "memGiB": 16, "healthy": true}))
            .collect();
        let annotations = serde_json::json!({
            "gpushare.example.com/v1.gpus": serde_json::to_string(&inventory)?,
        });
        let mut nodes = c.kit().script("realk8s.sh");
        let status = nodes
            .args([
                "nodes",
                &FAKE_NODES.to_string(),
                "4",
                "16",
                "example.com/gpu-mem",
                "gpushare=true",
            ])
            .env("NODE_ANNOTATIONS_JSON", annotations.to_string())
            .env("NODE_PREFIX", "fake")
            .status()?;
        ensure!(status.success(), "creating fake nodes failed");
        // No kubelet runs behind a fake node: the stand-in writes each bound pod's status
        // there (a startTime) as the node's kubelet would on admitting it.
        let kubelets = gpushare_e2e::realk8s::load::NodeStandIn::start(
            c.client(),
            "default",
            gpushare_e2e::realk8s::load::StandInConfig {
                node_prefix: "fake-".to_owned(),
                delay: Duration::from_millis(200),
                marks_as: None,
            },
        );
        let result = burst_with_kills(c).await;
        let refused = kubelets.refused();
        drop(kubelets);
        ensure!(
            refused.is_empty(),
            "{} pod status writes refused, the first: {}",
            refused.len(),
            refused[0]
        );
        let _ = c.kubectl(&["delete", "nodes", "-l", "fake=true", "--wait=false"]);
        result
    })
}

/// The chart's `extender.leaderElection.leaseDurationMs`, in seconds.
const LEASE_SECONDS: f64 = 3.0;

async fn burst_with_kills(c: &KitCluster) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(c.client(), "default");
    let refused = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    // Four creators, about 25 pods/s in all, for about 40 s.
    let creators: Vec<_> = (0..4)
        .map(|worker| {
            let pods = pods.clone();
            let refused = refused.clone();
            tokio::spawn(async move {
                let mut errors = Vec::new();
                for i in (worker..BURST_PODS).step_by(4) {
                    let pod = fixtures::pod(&format!("burst-{i}")).gpu_mem(4).build();
                    if let Err(error) = pods.create(&PostParams::default(), &pod).await {
                        refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        errors.push(format!("burst-{i}: {error}"));
                    }
                    tokio::time::sleep(Duration::from_millis(160)).await;
                }
                errors
            })
        })
        .collect();
    let bound = |pods: Api<Pod>| async move {
        let list = pods.list(&ListParams::default().labels("")).await.ok()?;
        Some(
            list.items
                .iter()
                .filter(|p| {
                    p.metadata
                        .name
                        .as_deref()
                        .is_some_and(|n| n.starts_with("burst-"))
                        && p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some()
                })
                .count(),
        )
    };
    let mut gaps = Vec::new();
    let mut takeovers = Vec::new();
    for kill_at in [2.0, 5.5, 9.0] {
        tokio::time::sleep(Duration::from_secs_f64(kill_at).saturating_sub(started.elapsed()))
            .await;
        let holder = c.extender_lease_holder()?;
        let pod = holder
            .rsplit_once('_')
            .map_or(holder.as_str(), |(pod, _)| pod);
        let pid = c.script("chart-cluster.sh", &["pid", pod, "extender"])?;
        let pid = pid.trim();
        ensure!(!pid.is_empty(), "no host pid for the leader {pod}");
        let killed = Instant::now();
        std::process::Command::new("kill")
            .args(["-9", pid])
            .status()?;
        // Binding resumed when another replica holds the Lease and a pod was bound after it
        // took over: a bind the killed leader wrote just before dying does not count.
        let resumed = async {
            wait_for(
                "another replica to take the Lease",
                Duration::from_secs(30),
                || async {
                    let now = c.extender_lease_holder().ok()?;
                    (!now.is_empty() && now != holder).then_some(())
                },
            )
            .await?;
            takeovers.push(killed.elapsed().as_secs_f64());
            let at_takeover = bound(pods.clone()).await.unwrap_or(0);
            wait_for("binding to resume", Duration::from_secs(30), || {
                let pods = pods.clone();
                async move { (bound(pods).await? > at_takeover).then_some(()) }
            })
            .await
        }
        .await;
        gaps.push(resumed.map(|()| killed.elapsed().as_secs_f64()));
    }
    let mut refusals = Vec::new();
    for creator in creators {
        refusals.extend(creator.await?);
    }
    let created = BURST_PODS - refusals.len();
    let all_bound = wait_for(
        "every burst pod to be bound",
        Duration::from_secs(120),
        || {
            let pods = pods.clone();
            async move { (bound(pods).await? == created).then_some(()) }
        },
    )
    .await;
    let gaps: Vec<String> = gaps
        .iter()
        .map(|g| {
            g.as_ref()
                .map_or_else(|e| format!("{e}"), |s| format!("{s:.2} s"))
        })
        .collect();
    let takeover_seconds = takeovers;
    let takeovers: Vec<String> = takeover_seconds
        .iter()
        .map(|s| format!("{s:.2} s"))
        .collect();
    println!(
        "  leader kills: Lease taken over after {}; binding resumed after {}; {} creates refused; burst of {BURST_PODS} done in {:.1} s",
        takeovers.join(", "),
        gaps.join(", "),
        refusals.len(),
        started.elapsed().as_secs_f64()
    );
    ensure!(
        refusals.is_empty(),
        "{} creates refused, the first: {}",
        refusals.len(),
        refusals[0]
    );
    // A follower saw the dead leader's address refuse (or another process answer there) and
    // took the Lease over, instead of waiting the chart's 3 s Lease out.
    ensure!(
        takeovers.len() == 3 && gaps.iter().all(|g| !g.contains("timed out")),
        "a takeover or a resumption did not happen: {takeovers:?}, {gaps:?}"
    );
    ensure!(
        takeover_seconds.iter().all(|s| *s < LEASE_SECONDS),
        "a Lease was waited out instead of taken over when its holder died: {takeovers:?}"
    );
    let listed = pods.list(&ListParams::default()).await?;
    if let Err(error) = all_bound {
        let unbound: Vec<String> = listed
            .items
            .iter()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_none())
            .map(|p| {
                format!(
                    "{} ({}): {}",
                    p.metadata.name.as_deref().unwrap_or_default(),
                    p.spec
                        .as_ref()
                        .and_then(|s| s.scheduler_name.as_deref())
                        .unwrap_or_default(),
                    gpushare_e2e::scenarios::scheduling_message(p).unwrap_or_default()
                )
            })
            .collect();
        bail!(
            "{error}: {} unbound, e.g. {:?}",
            unbound.len(),
            &unbound[..unbound.len().min(3)]
        );
    }
    for pod in listed.items.iter().filter(|p| {
        p.metadata
            .name
            .as_deref()
            .is_some_and(|n| n.starts_with("burst-"))
    }) {
        allocation(pod)?;
    }
    check_no_overcommit(&c.client()).await?;
    Ok(())
}
