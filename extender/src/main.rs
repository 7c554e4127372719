//! `gpushare-extender`: parses its configuration and runs the extender until SIGTERM or ctrl-c.
//! `gpushare-extender check-routing ...` runs the chart's install hook instead
//! (`gpushare_extender::routing_check`), `gpushare-extender cleanup-nodes ...` its uninstall
//! hook (`gpushare_extender::cleanup`).

use clap::Parser;
use gpushare_extender::{cleanup, routing_check};

fn main() -> anyhow::Result<()> {
    if std::env::args().nth(1).as_deref() == Some(routing_check::SUBCOMMAND) {
        // The subcommand stands where clap expects the program's name.
        let config = routing_check::RoutingCheckConfig::parse_from(std::env::args_os().skip(1));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        gpushare_runtime::init_tracing(config.log_format);
        runtime.block_on(routing_check::run(config))?;
        return Ok(());
    }
    if std::env::args().nth(1).as_deref() == Some(cleanup::SUBCOMMAND) {
        let config = cleanup::CleanupConfig::parse_from(std::env::args_os().skip(1));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        gpushare_runtime::init_tracing(config.log_format);
        runtime.block_on(cleanup::run(config))?;
        return Ok(());
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
