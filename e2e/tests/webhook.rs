//! The chart's `dedicated` scheduler mode end to end: the in-process API server calls the
//! extender's mutating webhook (registered by the chart's MutatingWebhookConfiguration, its
//! caBundle patched in by the extender) on every pod create, then evaluates the allocation
//! policy, as a real API server does.

use anyhow::{Context, ensure};
use gpushare_e2e::apiserver::Verb;
use gpushare_e2e::cluster::{
    ClusterSpec, DEDICATED_SCHEDULER, TestCluster, binaries, wait_for, with_cluster,
};
use gpushare_e2e::fixtures;
use gpushare_e2e::scenarios::{check_no_overcommit, check_pinned, create_gpu_pod, wait_running};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};

async fn with_dedicated_cluster(
    body: impl AsyncFnOnce(&mut TestCluster) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    with_cluster(ClusterSpec::labelled(&[("n1", &[16])]).dedicated(), body).await
}

fn scheduler_of(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref()?.scheduler_name.as_deref()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webhook_routes_gpu_pods_to_the_gpushare_scheduler() -> anyhow::Result<()> {
    with_dedicated_cluster(async |cluster| {
        // The extender patches its CA into the chart's configuration (helm left it empty),
        // from a task of its own: wait for it, as a real rollout would.
        let configs: Api<MutatingWebhookConfiguration> = Api::all(cluster.client.clone());
        wait_for(
            "the extender to patch the caBundle",
            std::time::Duration::from_secs(30),
            || async {
                let config = configs.get("gpushare-webhook").await.ok()?;
                let webhook = config.webhooks?.into_iter().next()?;
                webhook
                    .client_config
                    .ca_bundle
                    .is_some_and(|ca| !ca.0.is_empty())
                    .then_some(())
            },
        )
        .await?;

        // Created without a scheduler name: the webhook sets gpushare's, and it runs.
        let created = create_gpu_pod(cluster, "notebook", 4).await?;
        ensure!(
            scheduler_of(&created) == Some(DEDICATED_SCHEDULER),
            "{:?}",
            scheduler_of(&created)
        );
        let running = wait_running(cluster, "notebook").await?;
        check_pinned(cluster, &running).await?;

        // A pod that asks for no GPU is left to the default scheduler.
        let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), "default");
        let plain = fixtures::pod("plain").create(&cluster.client).await?;
        ensure!(scheduler_of(&plain) == Some("default-scheduler"));

        // A GPU pod that opts out of the webhook is refused by the policy, with what to do.
        let mut opted_out = fixtures::pod("opted-out").gpu_mem(4).build();
        opted_out.metadata.labels =
            Some([("gpushare.example.com/webhook".to_owned(), "skip".to_owned())].into());
        let refusal = pods
            .create(&PostParams::default(), &opted_out)
            .await
            .expect_err("a GPU pod for another scheduler was admitted");
        let kube::Error::Api(status) = refusal else {
            anyhow::bail!("expected the API server's refusal, got {refusal}");
        };
        ensure!(
            status.code == 403
                && status
                    .message
                    .contains("set spec.schedulerName: gpushare-scheduler"),
            "{status:?}"
        );
        check_no_overcommit(&cluster.client).await?;
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_webhook_is_down_gpu_pods_are_refused_not_left_pending() -> anyhow::Result<()> {
    with_dedicated_cluster(async |cluster| {
        // The webhook fails open (failurePolicy Ignore): the pod would be created for the
        // default scheduler, which gives it no GPU. The policy refuses it instead, saying why.
        cluster.kill_extender().await;
        let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), "default");
        let refusal = create_gpu_pod(cluster, "early", 4)
            .await
            .expect_err("a GPU pod was admitted for the default scheduler");
        let message = refusal.to_string();
        ensure!(
            message.contains("must be scheduled by gpushare-scheduler"),
            "{message}"
        );
        ensure!(pods.get_opt("early").await?.is_none());

        // Back up: once the API server routes GPU pods again (what the chart's install hook
        // waits for; the restarted extender is Ready a moment before its webhook's caBundle is
        // published), the same pod is routed and runs.
        cluster.restart_extender().await?;
        let routed = check_routing(cluster, 30).await?;
        ensure!(
            routed.status.success(),
            "GPU pods were not routed again: {}",
            String::from_utf8_lossy(&routed.stderr)
        );
        create_gpu_pod(cluster, "early", 4).await?;
        let running = wait_running(cluster, "early").await?;
        check_pinned(cluster, &running).await?;
        Ok(())
    })
    .await
}

/// The ServiceAccount the chart's install hook runs as.
const ROUTING_CHECK_USER: &str = "system:serviceaccount:kube-system:gpushare-routing-check";

/// Runs the chart's install hook (`gpushare-extender check-routing`, with the arguments the
/// chart renders) against `cluster` as its ServiceAccount.
async fn check_routing(
    cluster: &TestCluster,
    timeout_seconds: u64,
) -> anyhow::Result<std::process::Output> {
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("routing-check.kubeconfig");
    cluster
        .api
        .write_kubeconfig_as(&kubeconfig, ROUTING_CHECK_USER)?;
    let output = tokio::process::Command::new(binaries()?.extender)
        .args([
            "check-routing",
            "--namespace=default",
            "--resource=example.com/gpu-mem",
            "--scheduler-name=gpushare-scheduler",
            "--forged-annotation=gpushare.example.com/v1.routing-check",
            &format!("--timeout-seconds={timeout_seconds}"),
        ])
        .env("KUBECONFIG", &kubeconfig)
        .output()
        .await?;
    Ok(output)
}

/// The chart's post-install hook passes only once the API server routes GPU pods: while no
/// extender serves the webhook it fails, saying so; once one does, it passes. It stores
/// nothing and makes no call but dry-run pod creates (all its Role grants).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_install_hook_passes_only_once_gpu_pods_are_routed() -> anyhow::Result<()> {
    with_dedicated_cluster(async |cluster| {
        cluster.kill_extender().await;
        let down = check_routing(cluster, 2).await?;
        let stderr = String::from_utf8_lossy(&down.stderr);
        ensure!(
            !down.status.success() && stderr.contains("still not routed"),
            "the hook passed with no extender serving the webhook: {stderr}"
        );
        ensure!(
            stderr.contains("must be scheduled by gpushare-scheduler"),
            "the hook should name the refusal it saw: {stderr}"
        );

        cluster.restart_extender().await?;
        let up = check_routing(cluster, 60).await?;
        ensure!(
            up.status.success(),
            "the hook failed with the webhook serving: {}",
            String::from_utf8_lossy(&up.stderr)
        );
        let calls = cluster.api.stats().calls_by(ROUTING_CHECK_USER);
        ensure!(
            !calls.is_empty()
                && calls
                    .keys()
                    .all(|call| call.verb == Verb::Create && call.resource == "pods"),
            "the hook made calls other than pod creates: {calls:?}"
        );
        let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), "default");
        ensure!(
            pods.list(&ListParams::default()).await?.items.is_empty(),
            "the hook's dry-run pods were stored"
        );
        Ok(())
    })
    .await
}

/// Four 4 GiB pods through the dedicated scheduler: each after the first lands on the node
/// the first took, pinned to its annotated GPU, nothing over-committed, and the scheduler
/// never called prioritize.
async fn four_pods_fill_the_fuller_node_without_prioritize(
    cluster: &TestCluster,
) -> anyhow::Result<()> {
    let first = create_gpu_pod(cluster, "first", 4).await?;
    ensure!(scheduler_of(&first) == Some(DEDICATED_SCHEDULER));
    let first = wait_running(cluster, "first").await?;
    let full_node = first.spec.and_then(|s| s.node_name).unwrap_or_default();
    for name in ["second", "third", "fourth"] {
        create_gpu_pod(cluster, name, 4).await?;
        let running = wait_running(cluster, name).await?;
        check_pinned(cluster, &running).await?;
        let node = running.spec.and_then(|s| s.node_name).unwrap_or_default();
        ensure!(
            node == full_node,
            "{name} went to {node}, not the fuller {full_node}"
        );
    }
    check_no_overcommit(&cluster.client).await?;
    let stats = cluster
        .scheduler
        .as_ref()
        .map(|s| s.stats())
        .context("scheduler not running")?;
    ensure!(
        stats.prioritize_calls == 0,
        "prioritize called {} times",
        stats.prioritize_calls
    );
    ensure!(stats.filter_calls >= 4 && stats.binds_ok >= 4, "{stats:?}");
    // Over HTTPS, as kube-scheduler's transport does with an extender offering h2 by ALPN.
    ensure!(
        stats.answers_by_version.keys().eq(["HTTP/2.0"]),
        "{:?}",
        stats.answers_by_version
    );
    Ok(())
}

/// With `extender.filterKeepBest: 1` the extender's filter passes one node, the one its policy
/// scores best, so the scheduler binds it without scoring: no prioritize call at all, and
/// every pod still packs onto the fuller node, pinned, with nothing over-committed. Without
/// the flag the same cluster has two feasible nodes per pod and prioritize is called.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keeping_the_best_node_in_filter_skips_scoring() -> anyhow::Result<()> {
    let mut spec = ClusterSpec::labelled(&[("n1", &[16, 16]), ("n2", &[16, 16])]).dedicated();
    spec.extender_args.push("--filter-keep-best=1".to_owned());
    with_cluster(spec, async |cluster| {
        four_pods_fill_the_fuller_node_without_prioritize(cluster).await
    })
    .await
}

/// kube-scheduler binds in goroutines of its own while its next cycles already run, so with
/// `extender.filterKeepBest: 1` the filters of the next pods come before this pod's bind. On
/// nodes whose pods no device plugin has allocated yet (the twin rule keeps same-size pods
/// waiting for their device on one GPU: four 4 GiB pods a node here), the extender once
/// passed the same best node to every one of them; their binds found it full and the pods
/// backed off (the real cluster drained at 40.8 pods/s where the default drained at 205.7).
/// Filter now holds the memory of the one node it passes until the bind comes: a burst of
/// as many pods as the nodes can take binds every pod at its first attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keeping_the_best_node_holds_it_until_the_bind_comes() -> anyhow::Result<()> {
    // n1's one GPU is taken whole, so only the bare nodes are left.
    burst_on_bare_nodes_binds_at_first_attempt(&["--filter-keep-best=1"], &[16], &[16]).await
}

/// The same race with the default (filter passes every fitting node, prioritize scores them):
/// packing scores n1, whose first GPU already holds 12 GiB, best alone, so the first burst
/// pod goes there and fills that GPU; the next pods' prioritize, before that bind, scored n1
/// best again, and their binds found only n1's second GPU, which the twin rule refuses while
/// the first pod waits for its device. Prioritize now holds the node it scores best alone
/// until the bind comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_best_scored_node_is_held_until_the_bind_comes() -> anyhow::Result<()> {
    burst_on_bare_nodes_binds_at_first_attempt(&[], &[16, 16], &[4, 4, 4]).await
}

/// A burst of as many 4 GiB pods as six nodes with no kubelet can take (their pods wait for
/// their device for good, so the twin rule keeps each node's pods on one GPU), scheduled with
/// each binding cycle 200 ms behind its scheduling cycle, on top of a kubelet node n1 with
/// `n1_gpus` running `residents`: every pod must bind at its first attempt, and no GPU be
/// over-committed.
async fn burst_on_bare_nodes_binds_at_first_attempt(
    extender_args: &[&str],
    n1_gpus: &[u64],
    residents: &[u64],
) -> anyhow::Result<()> {
    const BARE_NODES: usize = 6;
    const PODS: usize = BARE_NODES * 4;
    let mut spec = ClusterSpec::labelled(&[("n1", n1_gpus)])
        .dedicated()
        .with_binding_cycle_delay(std::time::Duration::from_millis(200));
    spec.extender_args
        .extend(extender_args.iter().map(|a| (*a).to_owned()));
    with_cluster(spec, async |cluster| {
        // The residents first, while n1 is the only node they can go to.
        for (i, gib) in residents.iter().enumerate() {
            let name = format!("resident-{i}");
            create_gpu_pod(cluster, &name, *gib).await?;
            wait_running(cluster, &name).await?;
        }
        // No kubelet behind these: pods bound there wait for their device for good.
        for i in 0..BARE_NODES {
            fixtures::node(&format!("bare-{i}"))
                .gpushare()
                .gpus(&[16, 16])
                .create(&cluster.client)
                .await?;
        }
        let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), "default");
        futures::future::try_join_all((0..PODS).map(|i| {
            fixtures::pod(&format!("burst-{i}"))
                .gpu_mem(4)
                .create(&cluster.client)
        }))
        .await?;
        wait_for(
            "every burst pod to be bound",
            std::time::Duration::from_secs(60),
            || async {
                let list = pods.list(&Default::default()).await.ok()?;
                let bound = list
                    .items
                    .iter()
                    .filter(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_some()))
                    .count();
                (bound == PODS + residents.len()).then_some(())
            },
        )
        .await?;
        check_no_overcommit(&cluster.client).await?;
        // The driver counts a bind when the extender's answer arrives, which may be after
        // the watch showed the pod bound.
        let scheduler = cluster
            .scheduler
            .as_ref()
            .context("scheduler not running")?;
        let stats = wait_for(
            "the scheduler to count every bind",
            std::time::Duration::from_secs(10),
            || async {
                let stats = scheduler.stats();
                (stats.binds_ok >= (PODS + residents.len()) as u64).then_some(stats)
            },
        )
        .await?;
        ensure!(
            stats.bind_errors == 0,
            "{} binds failed: the burst's filters passed nodes its binds found full",
            stats.bind_errors
        );
        Ok(())
    })
    .await
}

/// With `scheduler.nativeGpuScoring` the chart's dedicated profile scores GPU memory itself
/// (`NodeResourcesFit` MostAllocated on the resource) and does not call prioritize: pods still
/// fill the node that already holds GPU memory before the empty one. With the upstream default
/// scoring (LeastAllocated on cpu and memory) and no prioritize, they would alternate nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_native_gpu_scoring_profile_packs_without_prioritize() -> anyhow::Result<()> {
    let spec = ClusterSpec::labelled(&[("n1", &[16, 16]), ("n2", &[16, 16])])
        .dedicated()
        .with_scheduler_values(&["policy=binpack", "scheduler.nativeGpuScoring=true"]);
    with_cluster(spec, async |cluster| {
        four_pods_fill_the_fuller_node_without_prioritize(cluster).await
    })
    .await
}
