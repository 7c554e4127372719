//! The local demo: gpushare's classic notebook story, on the in-process cluster, with our real
//! binaries, in a few seconds.
//!
//! ```sh
//! cargo run -p gpushare-e2e --bin demo
//! ```
//!
//! A debug build, on purpose: the story runs in seconds either way, and the first run builds
//! what it needs once (our binaries in the demo's own profile, sharing every dependency with
//! it: `cluster::cargo_build`). On a clean clone on 2 cores the first table printed 138 s
//! after the command (docs/testing.md).
//!
//! It starts an API server, the real `gpushare-extender`, the real `gpushare-device-plugin` on
//! one simulated 15 GiB GPU, a kubelet and a scheduler that calls the extender as
//! kube-scheduler does; then three 4 GiB notebooks share the GPU, a fourth waits with its
//! reason, and starts once one is deleted. After each step it prints who holds which GPU, the
//! same table `kubectl gpushare top -d` prints. Everything it started is stopped at the end.

use std::time::Instant;

use anyhow::Context;
use gpushare_e2e::cluster::{ClusterSpec, TestCluster, binaries};
use gpushare_e2e::scenarios::{Narrator, notebook};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, ListParams};
use kubectl_gpushare::render::render_top_details;
use kubectl_gpushare::usage::{Settings, cluster_usage};

/// Prints the story and the GPU table.
struct Printer {
    client: Client,
    started: Instant,
}

impl Narrator for Printer {
    async fn say(&self, text: &str) {
        println!("[{:>5.1}s] {text}", self.started.elapsed().as_secs_f64());
    }

    async fn show(&self) {
        match table(&self.client).await {
            Ok(text) => println!("\n{text}"),
            Err(error) => println!("(cannot read the cluster: {error:#})"),
        }
    }
}

async fn table(client: &Client) -> anyhow::Result<String> {
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let pods = Api::<Pod>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    Ok(render_top_details(&cluster_usage(
        &nodes,
        &pods,
        &Settings::default(),
    )))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let started = Instant::now();
    println!(
        "gpushare demo: GPU memory shared between pods, on an in-process Kubernetes cluster.\n\
         Building and starting: API server, gpushare-extender, gpushare-device-plugin on node\n\
         gpu-node-1 (labelled gpushare=true, one simulated 15 GiB GPU), kubelet, kube-scheduler driver.\n"
    );
    tokio::task::spawn_blocking(binaries)
        .await?
        .context("building gpushare-extender and gpushare-device-plugin")?;
    println!(
        "[{:>5.1}s] Binaries built.",
        started.elapsed().as_secs_f64()
    );
    let cluster = TestCluster::start(ClusterSpec::labelled(&[("gpu-node-1", &[15])]))
        .await
        .context("starting the in-process cluster")?;
    let printer = Printer {
        client: cluster.client.clone(),
        started,
    };
    printer.say("Cluster ready.").await;
    let outcome = notebook(&cluster, &printer).await;
    if outcome.is_err() {
        eprintln!("Our binaries' last log lines:\n{}", cluster.log_tail(30));
    }
    cluster.shutdown().await;
    let outcome = outcome.context("the story did not go as expected")?;
    println!(
        "Done in {:.1}s: {} pods shared GPU {}, the fourth waited and then ran on GPU {}. Nothing is left running.",
        started.elapsed().as_secs_f64(),
        outcome.sharing.len(),
        outcome.sharing[0].1,
        outcome.fourth_gpu
    );
    Ok(())
}
