//! `gpushare-dra-plugin`: parses flags and runs the plugin (see the library docs).

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let config = gpushare_dra_plugin::Config::parse();
    gpushare_dra_plugin::init_tracing(config.log_format);
    match gpushare_dra_plugin::run(config, gpushare_dra_plugin::shutdown_signal()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!(error = %err, "gpushare-dra-plugin failed");
            eprintln!("gpushare-dra-plugin: {err}");
            std::process::ExitCode::FAILURE
        }
    }
}
