//! `kubesim`: the in-process API server as a standalone program, for demos and for poking at
//! gpushare's binaries by hand with kubectl.
//!
//! ```text
//! kubesim --listen 127.0.0.1:6443 --kubeconfig-out /tmp/kubesim.yaml --nodes 2 --gpus 16,16
//! kubectl --kubeconfig /tmp/kubesim.yaml get nodes
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use gpushare_e2e::apiserver::ApiServer;
use gpushare_e2e::fixtures;

/// A Kubernetes API server simulator for gpushare (nodes, pods, bindings, events, leases).
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Address to serve the API on.
    #[arg(long, env = "KUBESIM_LISTEN", default_value = "127.0.0.1:6443")]
    listen: SocketAddr,
    /// Where to write a kubeconfig for this server.
    #[arg(
        long,
        env = "KUBESIM_KUBECONFIG_OUT",
        default_value = "kubesim.kubeconfig"
    )]
    kubeconfig_out: PathBuf,
    /// Number of GPU nodes to create (sim-node-1, sim-node-2, ...), labelled gpushare=true.
    #[arg(long, env = "KUBESIM_NODES", default_value_t = 0)]
    nodes: u32,
    /// GPU sizes in GiB for every created node, comma-separated.
    #[arg(
        long,
        env = "KUBESIM_GPUS",
        value_delimiter = ',',
        default_value = "16,16"
    )]
    gpus: Vec<u64>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    gpushare_runtime::init_tracing(gpushare_runtime::LogFormat::Text);
    let args = Args::parse();
    let server = ApiServer::start_on(args.listen).await?;
    server
        .write_kubeconfig(&args.kubeconfig_out)
        .with_context(|| format!("writing {}", args.kubeconfig_out.display()))?;
    let client = server.client();
    for i in 1..=args.nodes {
        fixtures::node(&format!("sim-node-{i}"))
            .gpushare()
            .gpus(&args.gpus)
            .create(&client)
            .await?;
    }
    let kubeconfig = std::fs::canonicalize(&args.kubeconfig_out).unwrap_or(args.kubeconfig_out);
    println!("kubesim serving at {}", server.url());
    println!("kubeconfig written to {}", kubeconfig.display());
    println!(
        "try: kubectl --kubeconfig {} get nodes",
        kubeconfig.display()
    );
    println!("     (kubectl create/apply need --validate=false: no OpenAPI schema is served)");
    gpushare_runtime::shutdown_signal().await;
    tracing::info!("shutting down");
    server.shutdown().await;
    Ok(())
}
