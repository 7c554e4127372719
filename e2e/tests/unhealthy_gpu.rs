//! A GPU that turns unhealthy under running pods: each pod gets a Warning Event and a pod
//! condition, and, opted in, is evicted so that it is placed again.

use std::time::Duration;

use anyhow::ensure;
use gpushare_e2e::cluster::{ClusterSpec, TestCluster, wait_for, with_cluster};
use gpushare_e2e::scenarios::{allocation, create_gpu_pod, wait_running};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};

const CONDITION: &str = "gpushare.example.com/GpuHealthy";
const WAIT: Duration = Duration::from_secs(30);

/// `status` of the pod's GPU health condition, if it has one.
async fn gpu_condition(pods: &Api<Pod>, name: &str) -> Option<String> {
    let pod = pods.get_opt(name).await.ok()??;
    pod.status?
        .conditions?
        .into_iter()
        .find(|c| c.type_ == CONDITION)
        .map(|c| c.status)
}

/// Waits until the pod's GPU health condition reads `status`.
async fn wait_condition(pods: &Api<Pod>, name: &str, status: &str) -> anyhow::Result<()> {
    wait_for(
        &format!("{name}'s condition to be {status}"),
        WAIT,
        || async { (gpu_condition(pods, name).await.as_deref() == Some(status)).then_some(()) },
    )
    .await
}

/// Two 8 GiB pods, one on each of n1's two GPUs; returns the name of the one on GPU 0.
async fn one_pod_per_gpu(cluster: &TestCluster) -> anyhow::Result<String> {
    let mut on_gpu0 = None;
    for name in ["a", "b"] {
        create_gpu_pod(cluster, name, 8).await?;
        let pod = wait_running(cluster, name).await?;
        if allocation(&pod)?.gpu_index == 0 {
            on_gpu0 = Some(name.to_owned());
        }
    }
    on_gpu0.ok_or_else(|| anyhow::anyhow!("no pod landed on GPU 0"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_on_a_gpu_that_turns_unhealthy_are_told_and_see_it_recover() -> anyhow::Result<()> {
    with_cluster(ClusterSpec::labelled(&[("n1", &[8, 8])]), async |cluster| {
        let victim = one_pod_per_gpu(cluster).await?;
        let other = if victim == "a" { "b" } else { "a" };
        let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), "default");
        cluster.set_unhealthy("n1", &[0])?;
        wait_condition(&pods, &victim, "False").await?;
        let events: Api<k8s_openapi::api::events::v1::Event> =
            Api::namespaced(cluster.client.clone(), "default");
        let told = wait_for("the GpuUnhealthy Event", WAIT, || async {
            let listed = events.list(&ListParams::default()).await.ok()?;
            let about: Vec<String> = listed
                .into_iter()
                .filter(|e| e.reason.as_deref() == Some("GpuUnhealthy"))
                .filter_map(|e| e.regarding?.name)
                .collect();
            (!about.is_empty()).then_some(about)
        })
        .await?;
        ensure!(told == [victim.clone()], "Events about {told:?}");
        // Without --evict-on-unhealthy the pod keeps running; the other GPU's pod is untouched.
        ensure!(pods.get_opt(&victim).await?.is_some());
        ensure!(gpu_condition(&pods, other).await.is_none());

        cluster.set_unhealthy("n1", &[])?;
        wait_condition(&pods, &victim, "True").await?;
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opted_in_pods_of_an_unhealthy_gpu_are_evicted() -> anyhow::Result<()> {
    let spec = ClusterSpec::labelled(&[("n1", &[8, 8])])
        .with_device_plugin_args(&["--evict-on-unhealthy", "true"]);
    with_cluster(spec, async |cluster| {
        let victim = one_pod_per_gpu(cluster).await?;
        let other = if victim == "a" { "b" } else { "a" };
        let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), "default");
        cluster.set_unhealthy("n1", &[0])?;
        wait_for("the victim to be evicted", WAIT, || async {
            pods.get_opt(&victim).await.ok()?.is_none().then_some(())
        })
        .await?;
        let stats = cluster.api.stats();
        ensure!(
            stats.count(gpushare_e2e::apiserver::Verb::Create, "pods/eviction") == 1,
            "one eviction"
        );
        ensure!(
            pods.get_opt(other).await?.is_some(),
            "the healthy GPU's pod stays"
        );
        Ok(())
    })
    .await
}
