//! `gpushare-device-plugin`: parses flags (the old environment names read too, see `LEGACY_ENV`) and runs the
//! plugin (see the library docs).

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let (config, warnings) = gpushare_runtime::env::parse::<gpushare_device_plugin::Config>(
        gpushare_device_plugin::LEGACY_ENV,
    );
    gpushare_runtime::init_tracing(config.log_format);
    for warning in warnings {
        tracing::warn!("{warning}");
    }
    match gpushare_device_plugin::run(config, gpushare_runtime::shutdown_signal()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!(error = %err, "gpushare-device-plugin failed");
            eprintln!("gpushare-device-plugin: {err}");
            std::process::ExitCode::FAILURE
        }
    }
}
