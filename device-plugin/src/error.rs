//! Why the plugin stopped: one error type for the start-up checks, the servers and the
//! supervisor ([`crate::run`] returns it; `main` prints it).
//!
//! Why a module of its own: the device plugin server ([`crate::server`]) fails with it too;
//! defined in the crate root, which runs that server, it had the server import the root
//! that imports the server.

use std::net::SocketAddr;
use std::path::PathBuf;

use gpushare_contract::KeyringError;
use gpushare_runtime::gpu::BackendError;

/// Why the plugin stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is unusable.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The allocation keyring cannot be read.
    #[error("--allocation-keys-file: {0}")]
    Keyring(#[from] KeyringError),
    /// The GPUs could not be listed or watched.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// No Kubernetes client could be built.
    #[error("cannot build a Kubernetes client (in-cluster service account or KUBECONFIG): {0}")]
    Kube(#[source] kube::Error),
    /// The metrics address could not be bound.
    #[error("cannot listen on {addr} for metrics: {source}")]
    MetricsBind {
        /// the address
        addr: SocketAddr,
        /// the cause
        #[source]
        source: std::io::Error,
    },
    /// The plugin socket could not be created.
    #[error(
        "cannot create the plugin socket {path}: {source}; is --device-plugin-dir kubelet's device plugin directory and writable?"
    )]
    Socket {
        /// the socket path
        path: PathBuf,
        /// the cause
        #[source]
        source: std::io::Error,
    },
    /// The isolation library could not be installed (`--enforcement preload`).
    #[error(
        "cannot install the isolation library into --isolation-host-dir: {0}; fix the path or run with --enforcement none"
    )]
    Isolation(#[source] std::io::Error),
    /// Another device plugin on this node serves devices that kubelet recorded for our
    /// resource name ([`crate::registrations`]): registering too would have the two replace
    /// each other at kubelet.
    #[error(
        "another device plugin already registered {resource} on this node: {} serves {shared} of the devices kubelet's checkpoint lists for {resource} (e.g. {}); \
         two plugins registering one resource name replace each other at kubelet on every registration, and the pods of one lose their accounting. \
         Remove the other plugin from this node (Alibaba's classic gpushare: delete its DaemonSet, docs/migrating.md step 3), \
         or give gpushare another resource name (--resource, the chart's resourceName, the same in the extender); \
         see charts/gpushare/README.md, \"Next to NVIDIA's device plugin or the GPU Operator\"",
        socket.display(),
        examples.join(", ")
    )]
    RegisteredElsewhere {
        /// our resource name
        resource: String,
        /// the other plugin's socket
        socket: PathBuf,
        /// how many of the devices it serves kubelet recorded for `resource`
        shared: usize,
        /// a few of those device IDs
        examples: Vec<String>,
    },
    /// A supervised task returned or panicked before shutdown.
    #[error(transparent)]
    Task(#[from] gpushare_runtime::TaskStopped),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
