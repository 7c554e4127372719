//! `gpushare-device-plugin`: parses flags and runs the plugin (see the library docs).

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let config = gpushare_device_plugin::Config::parse();
    gpushare_device_plugin::init_tracing(config.log_format);
    match gpushare_device_plugin::run(config, gpushare_device_plugin::shutdown_signal()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!(error = %err, "gpushare-device-plugin failed");
            eprintln!("gpushare-device-plugin: {err}");
            std::process::ExitCode::FAILURE
        }
    }
}
