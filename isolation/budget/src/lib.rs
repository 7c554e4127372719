//! gpushare-isolation-budget: the isolation interposer's budget file, for those who read it.
//!
//! The interposer (`gpushare-isolation`, `LD_PRELOAD`ed into a container's processes) keeps
//! what the container holds on each GPU in one shared file, its budget. This crate is that
//! file without the interposer: safe code only and no exported symbols, so that a node agent
//! (the device plugin, for `/metrics`) can link it. Linking `gpushare-isolation` itself would
//! bring in its `#[no_mangle]` `dlsym`, `cuMemAlloc_v2`, `nvmlDeviceGetMemoryInfo`, … and
//! put the program's own driver calls through them.
//!
//! ```text
//!   container processes ── libgpushare_isolation.so ──(mmap, atomics)──> budget file
//!                                                                            │
//!   device plugin ── budgets_in(dir) / Snapshot::read(path) ──(read)─────────┘
//! ```
//!
//! - [`layout`]: the bytes (versioned) and the file's name ([`budget_path`], [`budget_key`]),
//!   and the environment variables naming the directory and the key.
//! - [`limits`]: the container's shares, from the environment the plugin sets.
//! - [`prepared`]: what the plugin prepares before a container starts: its budget file and
//!   the read-only limits file that names it ([`PreparedLimits`], [`prepare`]).
//! - [`settings`]: the interposer's other settings (GPU UUIDs, a context's charge, managed
//!   memory, the compute share), from the environment or the limits file.
//! - [`compute`]: the per-GPU compute state file that the containers on one GPU share to hold
//!   each other to their shares of its SM time (layout and name).
//! - [`reader`]: a [`Snapshot`] of one file, or of every file in a directory ([`budgets_in`]):
//!   per GPU the share, the bytes held and the allocations refused; per process its bytes.

pub mod compute;
pub mod layout;
pub mod limits;
pub mod prepared;
pub mod reader;
pub mod settings;

pub use layout::{ENV_DIR, ENV_KEY, budget_key, budget_path};
pub use limits::Limits;
pub use prepared::{
    ENV_LIMITS_FILE, LIMITS_FILE_IN_CONTAINER, LimitsFormatError, PreparedCompute, PreparedLimits,
    prepare, prepare_with_compute,
};
pub use reader::{GpuUsage, ProcessUsage, Snapshot, budgets_in};

/// An environment lookup over `pairs`, for the parsers' tests.
#[cfg(test)]
fn test_env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
    move |name| {
        pairs
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.to_string())
    }
}
