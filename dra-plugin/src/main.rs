//! `gpushare-dra-plugin`: parses flags (the old environment names read too, see `LEGACY_ENV`) and runs the
//! plugin (see the library docs).

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let (config, warnings) = gpushare_runtime::env::parse::<gpushare_dra_plugin::Config>(
        gpushare_dra_plugin::LEGACY_ENV,
    );
    gpushare_runtime::init_tracing(config.log_format);
    for warning in warnings {
        tracing::warn!("{warning}");
    }
    match gpushare_dra_plugin::run(config, gpushare_runtime::shutdown_signal()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!(error = %err, "gpushare-dra-plugin failed");
            eprintln!("gpushare-dra-plugin: {err}");
            std::process::ExitCode::FAILURE
        }
    }
}
