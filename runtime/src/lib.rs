//! What every gpushare binary runs on, in one place so the binaries cannot drift apart:
//!
//! ```text
//!   main ─ parse args (legacy env names read as flags: env::with_legacy_env)
//!        ─ logging::init_tracing(format)        RUST_LOG, text or JSON lines
//!        ─ run(config, signal::shutdown_signal())
//!             ├─ supervise::TaskSet             named tasks: the first to end before shutdown
//!             │                                 ends the process; stopped in the binary's order
//!             └─ http::Server::serve            every HTTP(S) port: TLS handshake timeout,
//!                                               graceful drain, GOAWAY on demand
//! ```
//!
//! Why a crate of its own: the extender, the device plugin and the DRA plugin each had their
//! own copy of the shutdown signal, of the logging set-up and of the HTTP accept loop, and the
//! DRA plugin borrowed the device plugin's. A fix made to one copy (a JSON format, a missed
//! SIGTERM, a TLS handshake with no timeout) missed the others.

pub mod env;
#[cfg(feature = "gpu")]
pub mod gpu;
pub mod http;
pub mod isolation;
pub mod logging;
pub mod metrics;
pub mod signal;
pub mod supervise;
#[cfg(feature = "kube")]
pub mod uninstall;

pub use logging::{LogFormat, init_tracing};
pub use signal::shutdown_signal;
pub use supervise::{TaskSet, TaskStopped};
