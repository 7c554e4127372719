//! A GPU that turns unhealthy under running pods: each pod gets a Warning Event and a pod
//! condition, and, opted in, is evicted so that it is placed again.

use std::time::Duration;

use anyhow::ensure;
use gpushare_e2e::apiserver::Verb;
use gpushare_e2e::cluster::{ClusterSpec, TestCluster, wait_for, with_cluster};
use gpushare_e2e::scenarios::{allocation, create_gpu_pod, events_with_reason, wait_running};
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;

const CONDITION: &str = "gpushare.example.com/GpuHealthy";
const WAIT: Duration = Duration::from_secs(30);

/// `status` of the pod's GPU health condition, if it has one.
async fn gpu_condition(pods: &Api<Pod>, name: &str) -> Option<String> {
    let conditions = pods.get_opt(name).await.ok()??.status?.conditions?;
    let condition = conditions.into_iter().find(|c| c.type_ == CONDITION);
    condition.map(|c| c.status)
}

/// Waits until the pod's GPU health condition reads `status`.
async fn wait_condition(pods: &Api<Pod>, name: &str, status: &str) -> anyhow::Result<()> {
    let what = format!("{name}'s condition to be {status}");
    wait_for(&what, WAIT, || async {
        (gpu_condition(pods, name).await.as_deref() == Some(status)).then_some(())
    })
    .await
}

/// Runs two 8 GiB pods, one on each of n1's two GPUs, then breaks GPU 0; returns the pods,
/// the one on GPU 0 and the other.
async fn break_the_gpu_of_one_pod(
    cluster: &TestCluster,
) -> anyhow::Result<(Api<Pod>, String, String)> {
    let mut on_gpu0 = Vec::new();
    for name in ["a", "b"] {
        create_gpu_pod(cluster, name, 8).await?;
        let pod = wait_running(cluster, name).await?;
        on_gpu0.push(allocation(&pod)?.gpu_index == 0);
    }
    let (victim, other) = match on_gpu0[..] {
        [true, false] => ("a", "b"),
        [false, true] => ("b", "a"),
        _ => anyhow::bail!("not one pod per GPU: {on_gpu0:?}"),
    };
    cluster.set_unhealthy("n1", &[0])?;
    let pods = Api::namespaced(cluster.client.clone(), "default");
    Ok((pods, victim.to_owned(), other.to_owned()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_on_a_gpu_that_turns_unhealthy_are_told_and_see_it_recover() -> anyhow::Result<()> {
    with_cluster(ClusterSpec::labelled(&[("n1", &[8, 8])]), async |cluster| {
        let (pods, victim, other) = break_the_gpu_of_one_pod(cluster).await?;
        wait_condition(&pods, &victim, "False").await?;
        let told = wait_for("the GpuUnhealthy Event", WAIT, || {
            events_with_reason(&cluster.client, "default", "GpuUnhealthy")
        })
        .await?;
        let about: Vec<&str> = told.iter().map(|(name, _)| name.as_str()).collect();
        ensure!(about == [victim.as_str()], "Events about {about:?}");
        // Without --evict-on-unhealthy the pod keeps running; the other GPU's pod is untouched.
        ensure!(pods.get_opt(&victim).await?.is_some());
        ensure!(gpu_condition(&pods, &other).await.is_none());

        cluster.set_unhealthy("n1", &[])?;
        wait_condition(&pods, &victim, "True").await
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opted_in_pods_of_an_unhealthy_gpu_are_evicted() -> anyhow::Result<()> {
    let spec = ClusterSpec::labelled(&[("n1", &[8, 8])])
        .with_device_plugin_args(&["--evict-on-unhealthy", "true"]);
    with_cluster(spec, async |cluster| {
        let (pods, victim, other) = break_the_gpu_of_one_pod(cluster).await?;
        wait_for("the victim to be evicted", WAIT, || async {
            pods.get_opt(&victim).await.ok()?.is_none().then_some(())
        })
        .await?;
        let evictions = cluster.api.stats().count(Verb::Create, "pods/eviction");
        ensure!(evictions == 1, "{evictions} evictions, not one");
        let stays = pods.get_opt(&other).await?.is_some();
        ensure!(stays, "the healthy GPU's pod stays");
        Ok(())
    })
    .await
}
