//! Reading a budget file from outside the container, without unsafe code: what a node agent
//! (the device plugin) needs to report each container's used bytes and refused allocations.
//!
//! A [`Snapshot`] is read with plain `read()`, not a mapping: each field is one aligned
//! 8-byte word, so no value is torn, but fields may come from slightly different instants.
//! Reading never changes the file (dead processes are not reclaimed from here: their bytes
//! still count until a process of the container allocates or asks for memory).

use std::path::Path;

use crate::budget::{
    FILE_LEN, HEADER_LEN, MAGIC, MAX_GPUS, OFF_GPU_COUNT, OFF_HEADER_LEN, OFF_MAX_GPUS,
    OFF_REFUSED, OFF_SHARE, OFF_SLOT_COUNT, OFF_SLOT_LEN, OFF_USED, OFF_VERSION, RECLAIMING,
    SLOT_LEN, SLOT_PID, SLOT_START, SLOT_USED, SLOTS, VERSION,
};

/// Why a file is not a readable budget.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// It could not be read.
    #[error("reading budget file {path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Its magic, version or shape is not this crate's layout.
    #[error("not a version-{VERSION} budget file: {0}")]
    Format(String),
}

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

impl Snapshot {
    /// Reads the budget file at `path`.
    pub fn read(path: &Path) -> Result<Self, Error> {
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&bytes)
    }

    /// Parses a budget file's bytes.
    pub fn parse(bytes: &[u8]) -> Result<Self, Error> {
        if bytes.len() != FILE_LEN {
            return Err(Error::Format(format!(
                "{} bytes, not {FILE_LEN}",
                bytes.len()
            )));
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

/// A budget file's header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Header {
    /// Each GPU's share.
    pub shares: Vec<u64>,
}

impl Header {
    pub(crate) fn parse(bytes: &[u8]) -> Result<Self, Error> {
        if bytes.len() < HEADER_LEN {
            return Err(Error::Format("short header".into()));
        }
        if bytes[..8] != MAGIC {
            return Err(Error::Format("bad magic (or still being created)".into()));
        }
        let field = |off, want: usize, name: &str| {
            let got = u32_at(bytes, off);
            if got as usize == want {
                Ok(())
            } else {
                Err(Error::Format(format!("{name} {got}, not {want}")))
            }
        };
        field(OFF_VERSION, VERSION as usize, "version")?;
        field(OFF_HEADER_LEN, HEADER_LEN, "header length")?;
        field(OFF_SLOT_COUNT, SLOTS, "slot count")?;
        field(OFF_SLOT_LEN, SLOT_LEN, "slot length")?;
        field(OFF_MAX_GPUS, MAX_GPUS, "GPU array length")?;
        let gpu_count = u32_at(bytes, OFF_GPU_COUNT) as usize;
        if !(1..=MAX_GPUS).contains(&gpu_count) {
            return Err(Error::Format(format!("GPU count {gpu_count}")));
        }
        Ok(Self {
            shares: (0..gpu_count)
                .map(|gpu| u64_at(bytes, OFF_SHARE + 8 * gpu))
                .collect(),
        })
    }
}

fn u64_at(bytes: &[u8], off: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[off..off + 8]);
    u64::from_ne_bytes(word)
}

fn u32_at(bytes: &[u8], off: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[off..off + 4]);
    u32::from_ne_bytes(word)
}
