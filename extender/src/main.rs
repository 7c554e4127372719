//! `gpushare-extender`: parses its configuration and runs the extender until SIGTERM or ctrl-c.
//! `gpushare-extender check-routing ...` runs the chart's install hook instead
//! (`gpushare_extender::routing_check`), `gpushare-extender cleanup-nodes ...` its uninstall
//! hook (`gpushare_extender::cleanup`), `gpushare-extender check-install ...` its `helm test`
//! (`gpushare_extender::install_check`).

use clap::Parser;
use gpushare_extender::{cleanup, install_check, routing_check};

fn main() -> anyhow::Result<()> {
    match std::env::args().nth(1).as_deref() {
        Some(routing_check::SUBCOMMAND) => {
            return job(
                |c: &routing_check::RoutingCheckConfig| c.log_format,
                routing_check::run,
            );
        }
        Some(cleanup::SUBCOMMAND) => {
            return job(|c: &cleanup::CleanupConfig| c.log_format, cleanup::run);
        }
        Some(install_check::SUBCOMMAND) => {
            return job(
                |c: &install_check::InstallCheckConfig| c.log_format,
                install_check::run,
            );
        }
        _ => {}
    }
    let config = gpushare_extender::Config::parse();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    if config.worker_threads > 0 {
        runtime.worker_threads(config.worker_threads);
    }
    runtime.build()?.block_on(async {
        gpushare_runtime::init_tracing(config.log_format);
        gpushare_extender::run(config, gpushare_runtime::shutdown_signal()).await
    })?;
    Ok(())
}

/// Runs one of the chart's hook jobs: its configuration parsed from the arguments after the
/// subcommand (which stands where clap expects the program's name), on a single thread.
fn job<C, F, E>(
    log_format: impl FnOnce(&C) -> gpushare_extender::config::LogFormat,
    run: impl FnOnce(C) -> F,
) -> anyhow::Result<()>
where
    C: Parser,
    F: std::future::Future<Output = Result<(), E>>,
    E: std::error::Error + Send + Sync + 'static,
{
    let config = C::parse_from(std::env::args_os().skip(1));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    gpushare_runtime::init_tracing(log_format(&config));
    runtime.block_on(run(config))?;
    Ok(())
}
