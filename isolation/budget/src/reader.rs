//! Reading budget files from outside the container, without unsafe code: what a node agent
//! (the device plugin) needs to report each container's used bytes and refused allocations.
//!
//! A [`Snapshot`] is read with plain `read()`, not a mapping: each field is one aligned
//! 8-byte word, so no value is torn, but fields may come from slightly different instants.
//! Reading never changes the file (dead processes are not reclaimed from here: their bytes
//! still count until a process of the container allocates or asks for memory).
//! [`budgets_in`] reads every budget file of a directory.

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::layout::{
    FILE_LEN, FormatError, HEADER_LEN, Header, OFF_REFUSED, OFF_USED, RECLAIMING, SLOT_LEN,
    SLOT_PID, SLOT_START, SLOT_USED, SLOTS, budget_key, u32_at, u64_at,
};

/// Why a budget file, or a directory of them, cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file could not be read.
    #[error("reading budget file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The directory could not be listed.
    #[error("listing budget directory {path}: {source}")]
    Dir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Its magic, version or shape is not this crate's layout.
    #[error(transparent)]
    Format(#[from] FormatError),
}

/// `Result` with this module's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// One GPU's line in a [`Snapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuUsage {
    /// CUDA ordinal.
    pub gpu: usize,
    /// The container's share, bytes.
    pub share: u64,
    /// Bytes the container holds.
    pub used: u64,
    /// Allocations refused so far.
    pub refused: u64,
}

/// A process that holds a slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessUsage {
    /// Its pid (in the container's pid namespace).
    pub pid: u32,
    /// Its start time, clock ticks after boot (0 unknown).
    pub start_time: u64,
    /// Bytes it holds, by GPU.
    pub used: Vec<u64>,
}

/// A budget file's content at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// Per GPU, by ordinal.
    pub gpus: Vec<GpuUsage>,
    /// The processes that hold slots (dead ones included until reclaimed).
    pub processes: Vec<ProcessUsage>,
}

/// Opens `path` for reading (and writing, with `write`) without following a link and without
/// blocking: files in directories containers can write are opened so, and what the open
/// file is gets checked afterwards.
pub(crate) fn open_unfollowed(path: &Path, write: bool) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(path)
}

impl Snapshot {
    /// Reads the budget file at `path`. Only a regular file of [`FILE_LEN`] bytes is read:
    /// the directory is writable from containers, so the file is opened without following a
    /// link and without blocking (a FIFO planted there, or swapped in after the listing,
    /// cannot hang the reader), and what it turns out to be is checked on the open file.
    pub fn read(path: &Path) -> Result<Self> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = open_unfollowed(path, false).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(FormatError::new("not a regular file").into());
        }
        if meta.len() != FILE_LEN as u64 {
            return Err(FormatError::new(format!("{} bytes, not {FILE_LEN}", meta.len())).into());
        }
        let mut bytes = Vec::with_capacity(FILE_LEN);
        file.take(FILE_LEN as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(io)?;
        Self::parse(&bytes)
    }

    /// Parses a budget file's bytes.
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        if bytes.len() != FILE_LEN {
            return Err(FormatError::new(format!("{} bytes, not {FILE_LEN}", bytes.len())).into());
        }
        let header = Header::parse(&bytes[..HEADER_LEN])?;
        let gpus = (0..header.shares.len())
            .map(|gpu| GpuUsage {
                gpu,
                share: header.shares[gpu],
                used: u64_at(bytes, OFF_USED + 8 * gpu),
                refused: u64_at(bytes, OFF_REFUSED + 8 * gpu),
            })
            .collect();
        let processes = (0..SLOTS)
            .filter_map(|slot| {
                let base = HEADER_LEN + slot * SLOT_LEN;
                let pid = u32_at(bytes, base + SLOT_PID);
                (pid != 0 && pid != RECLAIMING).then(|| ProcessUsage {
                    pid,
                    start_time: u64_at(bytes, base + SLOT_START),
                    used: (0..header.shares.len())
                        .map(|gpu| u64_at(bytes, base + SLOT_USED + 8 * gpu))
                        .collect(),
                })
            })
            .collect();
        Ok(Self { gpus, processes })
    }
}

/// Every budget file in `dir` (named as [`budget_path`](crate::budget_path) names them, of
/// this layout version; links and other non-files are passed over), sorted by path, each
/// with its snapshot or why it could not be read. A file still being created reads as a
/// [`FormatError`] ("bad magic") for a moment. A directory that does not exist holds none:
/// no container with limits has started yet.
pub fn budgets_in(dir: &Path) -> Result<Vec<(PathBuf, Result<Snapshot>)>> {
    let listing = |source| Error::Dir {
        path: dir.to_path_buf(),
        source,
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(listing(e)),
    };
    let mut paths = Vec::new();
    for entry in entries {
        let entry = entry.map_err(listing)?;
        let path = entry.path();
        // The entry's own type: a link is not followed.
        if budget_key(&path).is_some() && entry.file_type().is_ok_and(|t| t.is_file()) {
            paths.push(path);
        }
    }
    paths.sort();
    Ok(paths
        .into_iter()
        .map(|path| {
            let snapshot = Snapshot::read(&path);
            (path, snapshot)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A FIFO or a link where a budget file should be is refused at once, never waited on.
    #[test]
    fn a_planted_fifo_or_link_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("budget-default-1x4096MiB.v1");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let link = dir.path().join("budget-other-1x4096MiB.v1");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        let (done, answer) = std::sync::mpsc::channel();
        let paths = [fifo, link];
        std::thread::spawn(move || {
            let results: Vec<bool> = paths.iter().map(|p| Snapshot::read(p).is_err()).collect();
            let _ = done.send(results);
        });
        let results = answer
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("reading a planted FIFO blocked");
        assert_eq!(results, [true, true]);
    }
    use crate::Limits;
    use crate::layout::budget_path;

    const MIB: u64 = 1 << 20;

    /// A budget file's bytes, as the interposer leaves them.
    struct Budget(Vec<u8>);

    fn budget(shares: &[u64]) -> Budget {
        let mut bytes = vec![0u8; FILE_LEN];
        let header = Header {
            shares: shares.to_vec(),
        };
        bytes[..HEADER_LEN].copy_from_slice(&header.encode());
        Budget(bytes)
    }

    impl Budget {
        fn put(mut self, off: usize, word: &[u8]) -> Self {
            self.0[off..off + word.len()].copy_from_slice(word);
            self
        }

        fn used(self, gpu: usize, bytes: u64) -> Self {
            self.put(OFF_USED + 8 * gpu, &bytes.to_ne_bytes())
        }

        fn refused(self, gpu: usize, count: u64) -> Self {
            self.put(OFF_REFUSED + 8 * gpu, &count.to_ne_bytes())
        }

        fn slot(mut self, slot: usize, pid: u32, start_time: u64, used: &[u64]) -> Self {
            let base = HEADER_LEN + slot * SLOT_LEN;
            self = self
                .put(base + SLOT_PID, &pid.to_ne_bytes())
                .put(base + SLOT_START, &start_time.to_ne_bytes());
            for (gpu, bytes) in used.iter().enumerate() {
                self = self.put(base + SLOT_USED + 8 * gpu, &bytes.to_ne_bytes());
            }
            self
        }

        fn write(&self, path: &Path) {
            std::fs::write(path, &self.0).unwrap();
        }
    }

    #[test]
    fn a_snapshot_shows_each_gpu_and_each_process_holding_a_slot() {
        let bytes = budget(&[4096 * MIB, 2048 * MIB])
            .used(1, 1500 * MIB)
            .refused(1, 3)
            .slot(0, 41, 1000, &[0, 1000 * MIB])
            .slot(5, RECLAIMING, 900, &[0, 7 * MIB])
            .slot(1023, 42, 0, &[0, 500 * MIB]);
        assert_eq!(
            Snapshot::parse(&bytes.0).unwrap(),
            Snapshot {
                gpus: vec![
                    GpuUsage {
                        gpu: 0,
                        share: 4096 * MIB,
                        used: 0,
                        refused: 0
                    },
                    GpuUsage {
                        gpu: 1,
                        share: 2048 * MIB,
                        used: 1500 * MIB,
                        refused: 3
                    },
                ],
                processes: vec![
                    ProcessUsage {
                        pid: 41,
                        start_time: 1000,
                        used: vec![0, 1000 * MIB]
                    },
                    ProcessUsage {
                        pid: 42,
                        start_time: 0,
                        used: vec![0, 500 * MIB]
                    },
                ],
            }
        );
    }

    #[test]
    fn what_is_not_a_budget_is_an_error() {
        let format = |r: Result<Snapshot>| matches!(r, Err(Error::Format(_)));
        assert!(format(Snapshot::parse(b"short")));
        // Sized, but its creator has not written the magic yet (or died first).
        let unborn = budget(&[MIB]).put(0, &[0; 8]);
        assert!(format(Snapshot::parse(&unborn.0)));
        let mut long = budget(&[MIB]).0;
        long.push(0);
        assert!(format(Snapshot::parse(&long)));

        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            Snapshot::read(&dir.path().join("missing")),
            Err(Error::Io { .. })
        ));
        assert!(format(Snapshot::read(dir.path())));
        std::fs::write(dir.path().join("long"), &long).unwrap();
        assert!(format(Snapshot::read(&dir.path().join("long"))));
    }

    #[test]
    fn every_budget_file_of_a_directory_is_read_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let limits = Limits::new(vec![2048 * MIB]);
        let b = budget_path(dir.path(), "b", &limits);
        let a = budget_path(dir.path(), "a", &limits);
        let unborn = budget_path(dir.path(), "c", &limits);
        budget(&[2048 * MIB]).used(0, MIB).write(&b);
        budget(&[2048 * MIB]).refused(0, 2).write(&a);
        std::fs::write(&unborn, vec![0u8; FILE_LEN]).unwrap();
        // Not budgets: another name, another version, a directory and a link named like one.
        budget(&[MIB]).write(&dir.path().join("notes"));
        budget(&[MIB]).write(&dir.path().join("budget-d-1x1MiB.v2"));
        std::fs::create_dir(budget_path(dir.path(), "e", &limits)).unwrap();
        std::os::unix::fs::symlink(&a, budget_path(dir.path(), "f", &limits)).unwrap();

        let found = budgets_in(dir.path()).unwrap();
        let paths: Vec<_> = found.iter().map(|(path, _)| path.clone()).collect();
        assert_eq!(paths, [a, b, unborn]);
        let snapshots: Vec<_> = found.iter().map(|(_, s)| s.as_ref().ok()).collect();
        assert_eq!(snapshots[0].unwrap().gpus[0].refused, 2);
        assert_eq!(snapshots[1].unwrap().gpus[0].used, MIB);
        assert!(matches!(&found[2].1, Err(Error::Format(e)) if e.reason.contains("magic")));
    }

    #[test]
    fn a_directory_not_made_yet_holds_no_budget() {
        let dir = tempfile::tempdir().unwrap();
        assert!(budgets_in(&dir.path().join("later")).unwrap().is_empty());
        let file = dir.path().join("file");
        std::fs::write(&file, b"").unwrap();
        assert!(matches!(budgets_in(&file), Err(Error::Dir { .. })));
    }
}
