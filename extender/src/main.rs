//! `gpushare-extender`: parses its configuration and runs the extender until SIGTERM or ctrl-c.

use clap::Parser;

fn main() -> anyhow::Result<()> {
    let config = gpushare_extender::Config::parse();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    if config.worker_threads > 0 {
        runtime.worker_threads(config.worker_threads);
    }
    runtime.build()?.block_on(async {
        gpushare_extender::init_tracing(config.log_format);
        gpushare_extender::run(config, gpushare_extender::shutdown_signal()).await
    })?;
    Ok(())
}
