//! Command line and the `run()` entry point.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::cluster::{self, Cluster};
use crate::doctor::{self, Install, Level, Snapshot};
use crate::dra;
use crate::render;
use crate::usage::{self, Settings};

/// See and check gpushare GPU-memory sharing.
#[derive(Debug, Parser)]
#[command(name = "kubectl-gpushare", bin_name = "kubectl gpushare", version)]
pub struct Args {
    /// Kubeconfig to use instead of the usual KUBECONFIG / ~/.kube/config / in-cluster.
    #[arg(long, env = "GPUSHARE_KUBECONFIG", global = true)]
    pub kubeconfig: Option<PathBuf>,
    /// Extended resource pods ask for.
    #[arg(long, env = "GPUSHARE_RESOURCE", default_value = gpushare_contract::DEFAULT_RESOURCE, global = true)]
    pub resource: String,
    /// Domain of gpushare's annotations and labels.
    #[arg(long, env = "GPUSHARE_DOMAIN", default_value = gpushare_contract::DEFAULT_DOMAIN, global = true)]
    pub domain: String,
    /// Label (`key=value`, or a bare `key` meaning `key=true`) that marks participating
    /// nodes, read as the extender reads its `--node-label`.
    #[arg(
        long,
        env = "GPUSHARE_NODE_LABEL",
        default_value = "gpushare=true",
        global = true
    )]
    pub node_label: String,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// GPU memory allocated per node and GPU.
    Top {
        /// Show only this node.
        node: Option<String>,
        /// Per node, list pods per GPU and a per-GPU summary.
        #[arg(
            short = 'd',
            long = "details",
            env = "GPUSHARE_TOP_DETAILS",
            default_value_t = false
        )]
        details: bool,
    },
    /// Check the installation and say what to fix (exit code 1 on failure).
    Doctor {
        /// Namespace gpushare is installed in.
        #[arg(
            long,
            short = 'n',
            env = "GPUSHARE_NAMESPACE",
            default_value = "kube-system"
        )]
        namespace: String,
        /// The extender's Service (port named `http`).
        #[arg(
            long,
            env = "GPUSHARE_EXTENDER_SERVICE",
            default_value = "gpushare-extender"
        )]
        extender_service: String,
        /// Probe the extender at this URL instead of through the API server proxy (e.g.
        /// http://127.0.0.1:39999 after `kubectl port-forward`). Empty: use the proxy.
        #[arg(long, env = "GPUSHARE_EXTENDER_URL", default_value = "")]
        extender_url: String,
        /// Scheduler name GPU pods should use.
        #[arg(
            long,
            env = "GPUSHARE_SCHEDULER_NAME",
            default_value = "gpushare-scheduler"
        )]
        scheduler_name: String,
    },
}

impl Args {
    fn settings(&self) -> Settings {
        Settings::new(&self.resource, &self.domain, &self.node_label)
    }
}

/// Runs the command, printing to stdout; the exit code is 1 when `doctor` found a failure.
pub async fn run(args: Args) -> anyhow::Result<ExitCode> {
    let settings = args.settings();
    let cluster = Cluster::connect(args.kubeconfig.as_deref()).await?;
    match args.command {
        Command::Top { node, details } => {
            let (nodes, pods) = tokio::try_join!(cluster.nodes(), cluster.pods())?;
            let mut usage = usage::cluster_usage(&nodes, &pods, &settings);
            dra::add_rows(&cluster, &mut usage, &nodes, &pods, &args.domain).await;
            if let Some(name) = node {
                usage.retain(|n| n.name == name);
                if usage.is_empty() {
                    anyhow::bail!(
                        "node {name} is not a GPU node (no label {}={}, no {} capacity) or does not exist",
                        settings.label_key,
                        settings.label_value,
                        settings.resource
                    );
                }
            }
            let text = if details {
                render::render_top_details(&usage)
            } else {
                render::render_top(&usage)
            };
            print!("{text}");
            // Best effort: a user who may not list admission objects still gets the table.
            if let Ok(routing) = cluster.routing().await
                && let Some(line) = routing.describe()
            {
                println!("{line}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Doctor {
            namespace,
            extender_service,
            extender_url,
            scheduler_name,
        } => {
            let install = Install {
                namespace,
                extender_service,
                scheduler_name,
            };
            // Reading nodes and pods must work; everything else becomes a finding.
            let (nodes, pods) = tokio::try_join!(cluster.nodes(), cluster.pods())?;
            let extender = if extender_url.is_empty() {
                cluster.extender_health_via_proxy(&install).await
            } else {
                cluster::extender_health_direct(&extender_url).await
            };
            let schedulers = cluster.scheduler_deployments(&install).await;
            let leader = cluster.extender_lease(&install).await;
            let routing = cluster.routing().await;
            let snapshot = Snapshot {
                nodes,
                pods,
                extender: Some(extender),
                schedulers: Some(schedulers),
                leader: Some(leader),
                routing: Some(routing),
            };
            let mut findings = doctor::diagnose(&snapshot, &settings, &install);
            let plugins = cluster.device_plugin_daemonsets(&install).await;
            findings.extend(doctor::check_enforcement(
                &plugins,
                &snapshot.nodes,
                &settings,
                &install,
            ));
            print!("{}", doctor::render(&findings));
            Ok(if findings.iter().any(|f| f.level == Level::Fail) {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            })
        }
    }
}
