//! The per-GPU compute state file: how the containers on one GPU hold each other to their
//! shares of its SM time. The interposer maps it and updates it with atomics
//! (`gpushare_isolation::compute` holds the protocol); this module is its bytes and name, and
//! a safe reader for a node agent.
//!
//! Why one file per GPU rather than per container: a share of SM time only means something
//! against the other containers on the same GPU, and each container's budget file is its
//! own. The files live in a node-wide directory every container on the node maps
//! (`compute_dir` in the limits file, `GPUSHARE_COMPUTE_DIR`, else the budget's directory).
//!
//! # Layout, version 1
//!
//! Native-endian; every field 8-byte aligned; [`FILE_LEN`] bytes.
//!
//! ```text
//! header, HEADER_LEN = 64 bytes
//!   0  magic       [u8; 8]  b"GPUSHRCP"        written last, once the rest is in place
//!   8  version     u32      1
//!  12  entries     u32      64
//!  16  entry_len   u32      64
//!  20  zero padding up to 64
//! entries, entry i at HEADER_LEN + i * ENTRY_LEN (ENTRY_LEN = 64), one per container
//!   0  id            u64   0: free; else the container (its budget file's device and inode)
//!   8  percent       u32   its share, 1 to 100
//!  12  mode          u32   0 shared, 1 capped
//!  16  vtime         u64   busy ns x 100 / percent: how far along its share it is (atomic)
//!  24  tat           u64   capped: monotonic ns by which its share has paid for what it ran
//!  32  active_until  u64   monotonic ns until which it counts as wanting the GPU (atomic)
//!  40  busy          u64   SM ns its kernels ran, measured (atomic)
//!  48  launches      u64   launches it made (atomic)
//!  56  held          u64   ns its launches were held back (atomic)
//! ```
//!
//! Times are `CLOCK_MONOTONIC` nanoseconds, which every container on the node shares (no
//! time namespaces).

use std::path::{Path, PathBuf};

/// The file's first 8 bytes.
pub const MAGIC: [u8; 8] = *b"GPUSHRCP";
/// The layout version.
pub const VERSION: u32 = 1;
/// Header bytes.
pub const HEADER_LEN: usize = 64;
/// Containers one GPU's file has room for.
pub const ENTRIES: usize = 64;
/// Bytes per entry.
pub const ENTRY_LEN: usize = 64;
/// The file's length.
pub const FILE_LEN: usize = HEADER_LEN + ENTRIES * ENTRY_LEN;

/// Header offset of `version` (`u32`).
pub const OFF_VERSION: usize = 8;
/// Header offset of `entries` (`u32`).
pub const OFF_ENTRIES: usize = 12;
/// Header offset of `entry_len` (`u32`).
pub const OFF_ENTRY_LEN: usize = 16;
/// Entry offset of `id` (`u64`).
pub const ENTRY_ID: usize = 0;
/// Entry offset of `percent` (`u32`).
pub const ENTRY_PERCENT: usize = 8;
/// Entry offset of `mode` (`u32`).
pub const ENTRY_MODE: usize = 12;
/// Entry offset of `vtime` (`u64`).
pub const ENTRY_VTIME: usize = 16;
/// Entry offset of `tat` (`u64`).
pub const ENTRY_TAT: usize = 24;
/// Entry offset of `active_until` (`u64`).
pub const ENTRY_ACTIVE_UNTIL: usize = 32;
/// Entry offset of `busy` (`u64`).
pub const ENTRY_BUSY: usize = 40;
/// Entry offset of `launches` (`u64`).
pub const ENTRY_LAUNCHES: usize = 48;
/// Entry offset of `held` (`u64`).
pub const ENTRY_HELD: usize = 56;

/// `mode` of a shared entry.
pub const MODE_SHARED: u32 = 0;
/// `mode` of a capped entry.
pub const MODE_CAPPED: u32 = 1;

/// The header of a version-1 file.
pub fn header() -> [u8; HEADER_LEN] {
    let mut bytes = [0u8; HEADER_LEN];
    bytes[..8].copy_from_slice(&MAGIC);
    bytes[OFF_VERSION..OFF_VERSION + 4].copy_from_slice(&VERSION.to_ne_bytes());
    bytes[OFF_ENTRIES..OFF_ENTRIES + 4].copy_from_slice(&(ENTRIES as u32).to_ne_bytes());
    bytes[OFF_ENTRY_LEN..OFF_ENTRY_LEN + 4].copy_from_slice(&(ENTRY_LEN as u32).to_ne_bytes());
    bytes
}

/// The compute state file of the GPU with `uuid` (`GPU-…`, as NVML writes it) in `dir`:
/// `compute-GPU-….v1`, every character of the UUID but ASCII letters, digits and `-`
/// replaced by `_`.
pub fn compute_path(dir: &Path, uuid: &str) -> PathBuf {
    let safe: String = uuid
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    dir.join(format!("compute-{safe}.v{VERSION}"))
}

/// The `id` of a container's entries: its budget file's device and inode, mixed (never 0,
/// which marks a free entry). The interposer takes them from the file it has open, a node
/// agent from the same file on the host (a bind mount keeps both), so the agent can tell
/// whose entry is whose without asking the container.
pub fn container_id(dev: u64, ino: u64) -> u64 {
    (dev.rotate_left(32) ^ ino).max(1)
}

/// [`container_id`] of the budget file at `path`.
pub fn budget_container_id(path: &Path) -> std::io::Result<u64> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(path)?;
    Ok(container_id(meta.dev(), meta.ino()))
}

/// One container's line of a GPU's compute state, as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ComputeUsage {
    /// The container (its budget file's device and inode, hashed).
    pub id: u64,
    /// Its share in percent.
    pub percent: u32,
    /// Whether it is capped.
    pub capped: bool,
    /// SM nanoseconds its kernels ran.
    pub busy_ns: u64,
    /// Launches it made.
    pub launches: u64,
    /// Nanoseconds its launches were held back.
    pub held_ns: u64,
    /// Monotonic ns until which it counts as wanting the GPU.
    pub active_until: u64,
}

/// Why bytes are not a compute state file.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// Reading it failed.
    #[error("compute state {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// It is not a version-1 compute state file.
    #[error("compute state {path}: not a version-{VERSION} compute state file")]
    Format {
        /// The file.
        path: PathBuf,
    },
}

/// The containers in the compute state file at `path` (a copy of its bytes, read without
/// locking: each figure is one aligned word).
pub fn read(path: &Path) -> Result<Vec<ComputeUsage>, ReadError> {
    let bytes = std::fs::read(path).map_err(|source| ReadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&bytes).ok_or_else(|| ReadError::Format {
        path: path.to_path_buf(),
    })
}

/// The containers in a compute state file's bytes; `None` if they are not one.
pub fn parse(bytes: &[u8]) -> Option<Vec<ComputeUsage>> {
    if bytes.len() != FILE_LEN || bytes[..HEADER_LEN] != header() {
        return None;
    }
    let u64_at = |at: usize| {
        let mut word = [0u8; 8];
        word.copy_from_slice(&bytes[at..at + 8]);
        u64::from_ne_bytes(word)
    };
    let u32_at = |at: usize| {
        let mut word = [0u8; 4];
        word.copy_from_slice(&bytes[at..at + 4]);
        u32::from_ne_bytes(word)
    };
    Some(
        (0..ENTRIES)
            .map(|i| HEADER_LEN + i * ENTRY_LEN)
            .filter(|&at| u64_at(at + ENTRY_ID) != 0)
            .map(|at| ComputeUsage {
                id: u64_at(at + ENTRY_ID),
                percent: u32_at(at + ENTRY_PERCENT),
                capped: u32_at(at + ENTRY_MODE) == MODE_CAPPED,
                busy_ns: u64_at(at + ENTRY_BUSY),
                launches: u64_at(at + ENTRY_LAUNCHES),
                held_ns: u64_at(at + ENTRY_HELD),
                active_until: u64_at(at + ENTRY_ACTIVE_UNTIL),
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_reads_back_its_entries() {
        let mut bytes = vec![0u8; FILE_LEN];
        bytes[..HEADER_LEN].copy_from_slice(&header());
        assert_eq!(parse(&bytes), Some(Vec::new()));
        let at = HEADER_LEN + 3 * ENTRY_LEN;
        bytes[at..at + 8].copy_from_slice(&7u64.to_ne_bytes());
        bytes[at + ENTRY_PERCENT..at + ENTRY_PERCENT + 4].copy_from_slice(&30u32.to_ne_bytes());
        bytes[at + ENTRY_MODE..at + ENTRY_MODE + 4].copy_from_slice(&MODE_CAPPED.to_ne_bytes());
        bytes[at + ENTRY_BUSY..at + ENTRY_BUSY + 8].copy_from_slice(&5_000u64.to_ne_bytes());
        let read = parse(&bytes).unwrap();
        assert_eq!(read.len(), 1);
        assert_eq!((read[0].id, read[0].percent), (7, 30));
        assert!(read[0].capped);
        assert_eq!(read[0].busy_ns, 5_000);
        assert_eq!(parse(&bytes[1..]), None);
        bytes[0] = b'X';
        assert_eq!(parse(&bytes), None);
    }

    #[test]
    fn the_name_is_the_uuid_made_safe() {
        let path = compute_path(Path::new("/c"), "GPU-00000000-0000-0000-0000-000000000001");
        assert_eq!(
            path,
            Path::new("/c/compute-GPU-00000000-0000-0000-0000-000000000001.v1")
        );
        assert_eq!(
            compute_path(Path::new("/c"), "../x"),
            Path::new("/c/compute-___x.v1")
        );
    }
}
