//! `gpushare-extender`: parses its configuration and runs the extender until SIGTERM or ctrl-c.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = gpushare_extender::Config::parse();
    gpushare_extender::init_tracing(config.log_format);
    gpushare_extender::run(config, gpushare_extender::shutdown_signal()).await?;
    Ok(())
}
