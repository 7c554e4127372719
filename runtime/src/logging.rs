//! Logs: `tracing` with an `EnvFilter` from `RUST_LOG` (default `info`), as text or JSON lines.

/// How logs are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Installs the tracing subscriber for the process. Colours only on a terminal: log files
/// and collectors get plain text. A second call (a test that runs two `main`s) keeps the
/// first subscriber and says so on stderr.
pub fn init_tracing(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()));
    let installed = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    if let Err(error) = installed {
        eprintln!("tracing already initialised: {error}");
    }
}
