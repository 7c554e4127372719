//! Plugin socket files handed from one process to the next.
//!
//! A DaemonSet rollout starts a plugin's new pod while the old one is still shutting down, and
//! both use the same socket paths under `/var/lib/kubelet`. Two rules keep the hand-over clean:
//!
//! ```text
//!   old pod: SIGTERM ─ streams end ─ server stops ─ remove its file (only if still its own) ─ exit
//!   new pod:   start ─ wait_until_released (nobody answers on the path) ─ bind ─ register
//! ```
//!
//! Without them, the old process's exit deleted the file its successor had just bound: kubelet
//! then lost the DRA driver (its plugin watcher deregisters on the file's removal), or the
//! device plugin registered twice and kubelet marked its devices unhealthy.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};

/// How long a starting plugin waits for its predecessor to let go of a socket path: a pod's
/// default termination grace period.
pub const PREDECESSOR_WAIT: Duration = Duration::from_secs(30);
/// How often it checks.
pub const PREDECESSOR_POLL: Duration = Duration::from_millis(100);
/// What [`wait_for_predecessor`] logs when it starts waiting (tests look for it).
pub const WAITING_FOR_PREDECESSOR: &str = "another plugin still serves this socket";

/// Which file a path names: device, inode and modification time (an inode number alone is
/// reused as soon as a file is deleted).
pub type FileIdentity = (u64, u64, i64, i64);

/// The identity of the file at `path`, if there is one: it changes when the file is
/// recreated.
pub fn identity(path: &Path) -> Option<FileIdentity> {
    std::fs::metadata(path)
        .ok()
        .map(|meta| (meta.dev(), meta.ino(), meta.mtime(), meta.mtime_nsec()))
}

/// A socket file this process bound.
#[derive(Debug, Clone)]
pub struct BoundSocket {
    path: PathBuf,
    identity: Option<FileIdentity>,
}

impl BoundSocket {
    /// Removes whatever file is at `path` (a stale socket), binds a listener there and
    /// remembers which file that made.
    pub fn bind(path: &Path) -> std::io::Result<(UnixListener, Self)> {
        match std::fs::remove_file(path) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => return Err(err),
            _ => {}
        }
        let listener = UnixListener::bind(path)?;
        let bound = Self {
            path: path.to_owned(),
            identity: identity(path),
        };
        Ok((listener, bound))
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the path still names the file this process bound (kubelet deletes plugin
    /// sockets when it restarts; a successor replaces it).
    pub fn in_place(&self) -> bool {
        self.identity.is_some() && identity(&self.path) == self.identity
    }

    /// Removes the file if it is still the one this process bound; a successor's file at the
    /// same path is left alone. Returns whether it removed anything.
    pub fn remove(&self) -> std::io::Result<bool> {
        if !self.in_place() {
            return Ok(false);
        }
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(true),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(err) => Err(err),
        }
    }
}

/// How waiting for a predecessor ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    /// Nobody answered on the path, at first or after waiting this long.
    Free(Duration),
    /// Somebody still answered after the longest wait.
    StillServed,
}

/// Whether a process accepts connections on the socket at `path`.
pub async fn served(path: &Path) -> bool {
    UnixStream::connect(path).await.is_ok()
}

/// Waits, logging why, while a predecessor (a rollout's old pod, still shutting down) serves
/// `socket`: at most [`PREDECESSOR_WAIT`]. The caller then takes the path over
/// ([`BoundSocket::bind`]) either way; it selects this against its own shutdown.
pub async fn wait_for_predecessor(socket: &Path) -> Released {
    if !served(socket).await {
        return Released::Free(Duration::ZERO);
    }
    tracing::info!(socket = %socket.display(), "{WAITING_FOR_PREDECESSOR} (a rollout's old pod?); waiting for it to stop");
    let released = wait_until_released(socket, PREDECESSOR_WAIT, PREDECESSOR_POLL).await;
    match released {
        Released::Free(waited) => {
            tracing::info!(socket = %socket.display(), ?waited, "the previous plugin let go of the socket")
        }
        Released::StillServed => {
            tracing::warn!(socket = %socket.display(), "another process still serves the socket after {PREDECESSOR_WAIT:?}; taking it over")
        }
    }
    released
}

/// Waits while another process accepts connections on `path`, checking every `poll`, at
/// most `longest`. The caller then takes the path over ([`BoundSocket::bind`]) either way.
pub async fn wait_until_released(path: &Path, longest: Duration, poll: Duration) -> Released {
    let start = tokio::time::Instant::now();
    while served(path).await {
        if start.elapsed() >= longest {
            return Released::StillServed;
        }
        tokio::time::sleep(poll).await;
    }
    Released::Free(start.elapsed())
}
