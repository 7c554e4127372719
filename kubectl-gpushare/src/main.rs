//! `kubectl-gpushare`: parse arguments, run, print errors plainly.

use std::process::ExitCode;

use clap::Parser as _;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = kubectl_gpushare::Args::parse();
    match kubectl_gpushare::run(args).await {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::from(2)
        }
    }
}
