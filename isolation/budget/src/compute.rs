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
/// locking: each figure is one aligned word). Only a regular file of [`FILE_LEN`] bytes is
/// read: the directory is writable from every container with a compute share, so the file
/// is opened without following a link and without blocking (a FIFO or a link to
/// `/dev/zero` planted there cannot hang the reader or fill its memory), what it is is
/// checked on the open file, and no more than [`FILE_LEN`] + 1 bytes are read.
pub fn read(path: &Path) -> Result<Vec<ComputeUsage>, ReadError> {
    let (_, bytes) = open_state(path, false)?;
    parse(&bytes).ok_or_else(|| ReadError::Format {
        path: path.to_path_buf(),
    })
}

/// The state file at `path`, opened as [`read`] says (for writing too, with `write`), and its
/// bytes, checked to be a state file's.
fn open_state(path: &Path, write: bool) -> Result<(std::fs::File, Vec<u8>), ReadError> {
    use std::io::Read as _;
    let io = |source| ReadError::Io {
        path: path.to_path_buf(),
        source,
    };
    let format = || ReadError::Format {
        path: path.to_path_buf(),
    };
    let mut file = crate::reader::open_unfollowed(path, write).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() || meta.len() != FILE_LEN as u64 {
        return Err(format());
    }
    let mut bytes = Vec::with_capacity(FILE_LEN);
    (&mut file)
        .take(FILE_LEN as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if parse(&bytes).is_none() {
        return Err(format());
    }
    Ok((file, bytes))
}

/// Frees the entries of the containers `ids` in the compute state file at `path` (their `id`
/// set to 0, one aligned 8-byte write each), for a node agent removing those containers'
/// budget files: a budget file made later may get a freed inode, hence a gone container's id,
/// and would otherwise find that container's entry as its own, counters included. An
/// interposer that claims a freed entry starts it afresh. Opened as [`read`] opens, for
/// writing. Returns how many entries were freed.
pub fn release(path: &Path, ids: &[u64]) -> Result<usize, ReadError> {
    use std::os::unix::fs::FileExt as _;
    let (file, bytes) = open_state(path, true)?;
    let mut freed = 0;
    for at in (0..ENTRIES).map(|i| HEADER_LEN + i * ENTRY_LEN + ENTRY_ID) {
        let mut word = [0u8; 8];
        word.copy_from_slice(&bytes[at..at + 8]);
        if ids.contains(&u64::from_ne_bytes(word)) {
            file.write_at(&0u64.to_ne_bytes(), at as u64)
                .map_err(|source| ReadError::Io {
                    path: path.to_path_buf(),
                    source,
                })?;
            freed += 1;
        }
    }
    Ok(freed)
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

    /// A FIFO, a link to `/dev/zero` or a file of the wrong size where a state file should be
    /// is refused at once, never waited on or read whole; a real one reads back.
    #[test]
    fn a_planted_fifo_or_link_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = compute_path(dir.path(), "GPU-fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let link = compute_path(dir.path(), "GPU-zero");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        let short = compute_path(dir.path(), "GPU-short");
        std::fs::write(&short, header()).unwrap();
        let real = compute_path(dir.path(), "GPU-real");
        let mut bytes = vec![0u8; FILE_LEN];
        bytes[..HEADER_LEN].copy_from_slice(&header());
        std::fs::write(&real, &bytes).unwrap();
        let (done, answer) = std::sync::mpsc::channel();
        let paths = [fifo, link, short, real];
        std::thread::spawn(move || {
            let results: Vec<bool> = paths.iter().map(|p| read(p).is_ok()).collect();
            let _ = done.send(results);
        });
        let results = answer
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("reading a planted FIFO blocked");
        assert_eq!(results, [false, false, false, true]);
    }

    #[test]
    fn released_entries_are_free_and_the_others_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let path = compute_path(dir.path(), "GPU-0");
        let mut bytes = vec![0u8; FILE_LEN];
        bytes[..HEADER_LEN].copy_from_slice(&header());
        for (i, id) in [11u64, 22, 33].into_iter().enumerate() {
            let at = HEADER_LEN + i * ENTRY_LEN;
            bytes[at + ENTRY_ID..at + ENTRY_ID + 8].copy_from_slice(&id.to_ne_bytes());
            bytes[at + ENTRY_BUSY..at + ENTRY_BUSY + 8].copy_from_slice(&7u64.to_ne_bytes());
        }
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(release(&path, &[22, 33, 44]).unwrap(), 2);
        let left: Vec<(u64, u64)> = read(&path)
            .unwrap()
            .iter()
            .map(|e| (e.id, e.busy_ns))
            .collect();
        assert_eq!(left, [(11, 7)]);
        assert!(release(&dir.path().join("missing"), &[11]).is_err());
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
