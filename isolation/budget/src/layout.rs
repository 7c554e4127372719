//! The budget file's bytes and name: what the interposer writes and the [`reader`](crate::reader)
//! reads. How the interposer updates it (the protocol: creation under `flock`, CAS on the
//! totals, reclaiming the dead) is documented with its writer, `gpushare_isolation::budget`.
//!
//! # Layout, version 1
//!
//! Native-endian (little-endian on x86_64 and aarch64); every field is 8-byte aligned or a
//! `u32` pair within 8 bytes; the file is [`FILE_LEN`] bytes.
//!
//! ```text
//! header, HEADER_LEN = 512 bytes
//!   0  magic        [u8; 8]  b"GPUSHRBG"        written last, once the rest is in place
//!   8  version      u32      1
//!  12  header_len   u32      512
//!  16  gpu_count    u32      GPUs with a share (1..=16)
//!  20  slot_count   u32      1024
//!  24  slot_len     u32      144
//!  28  max_gpus     u32      16                 length of the per-GPU arrays below
//!  32  share        [u64; 16]  bytes each GPU may hold (by CUDA ordinal)
//! 160  used         [u64; 16]  bytes held on each GPU now: the sum over live slots (atomic)
//! 288  refused      [u64; 16]  allocations refused on each GPU so far (atomic)
//! 416  zero padding up to 512
//! slots, slot i at HEADER_LEN + i * SLOT_LEN (SLOT_LEN = 144)
//!   0  pid          u32      0: free; u32::MAX: being reclaimed; else the holder's pid (atomic)
//!   4  flags        u32      bit 0 (SLOT_LOCKED): the holder holds an open-file-description
//!                            lock (F_OFD_SETLK, F_WRLCK) on this slot's bytes; written before
//!                            the pid is, cleared before the slot is freed (atomic)
//!   8  start_time   u64      the holder's start (clock ticks after boot, /proc/PID/stat field
//!                            22), 0 unknown: tells a reused pid from its dead predecessor
//!  16  used         [u64; 16]  bytes this process holds on each GPU (atomic)
//! ```
//!
//! # Liveness
//!
//! A slot marked [`SLOT_LOCKED`] belongs to a live process exactly while someone holds a lock
//! on its byte range (`HEADER_LEN + i * SLOT_LEN`, `SLOT_LEN` bytes): the kernel drops an
//! open-file-description lock when its holder's last descriptor closes, that is when the
//! process dies or `exec`s, whatever PID namespace it lived in and whatever its PID is
//! reused for. A slot without the mark (a filesystem without OFD locks, or an earlier
//! interposer, which wrote 0 here) is judged by its pid and start time. Readers that only
//! read (the [`reader`](crate::reader)) ignore the flags. Version 1 either way: a version-1
//! file from before the flags has 0 there, which reads as "no lock".
//!
//! # Name
//!
//! One file per container and limits, in the directory `$GPUSHARE_ISOLATION_DIR` names:
//! `budget-KEY-COUNTxSHAREMiB.v1` ([`budget_path`]), where KEY is `$GPUSHARE_ISOLATION_KEY`
//! (default `default`) with every character but ASCII letters, digits, `-` and `_` replaced
//! by `_`. Processes with the same directory, key and limits share one budget.

use std::path::{Path, PathBuf};

use crate::limits::Limits;

/// The file's first 8 bytes.
pub const MAGIC: [u8; 8] = *b"GPUSHRBG";
/// The layout version this crate describes.
pub const VERSION: u32 = 1;
/// The most GPUs a container may have a share of.
pub const MAX_GPUS: usize = 16;
/// Process slots.
pub const SLOTS: usize = 1024;
/// Header bytes.
pub const HEADER_LEN: usize = 512;
/// Bytes per slot.
pub const SLOT_LEN: usize = 144;
/// The file's length.
pub const FILE_LEN: usize = HEADER_LEN + SLOTS * SLOT_LEN;

/// Header offset of `version` (`u32`).
pub const OFF_VERSION: usize = 8;
/// Header offset of `header_len` (`u32`).
pub const OFF_HEADER_LEN: usize = 12;
/// Header offset of `gpu_count` (`u32`).
pub const OFF_GPU_COUNT: usize = 16;
/// Header offset of `slot_count` (`u32`).
pub const OFF_SLOT_COUNT: usize = 20;
/// Header offset of `slot_len` (`u32`).
pub const OFF_SLOT_LEN: usize = 24;
/// Header offset of `max_gpus` (`u32`).
pub const OFF_MAX_GPUS: usize = 28;
/// Header offset of `share` (`[u64; MAX_GPUS]`).
pub const OFF_SHARE: usize = 32;
/// Header offset of `used` (`[u64; MAX_GPUS]`).
pub const OFF_USED: usize = OFF_SHARE + 8 * MAX_GPUS;
/// Header offset of `refused` (`[u64; MAX_GPUS]`).
pub const OFF_REFUSED: usize = OFF_USED + 8 * MAX_GPUS;
/// Slot offset of `pid` (`u32`).
pub const SLOT_PID: usize = 0;
/// Slot offset of `flags` (`u32`).
pub const SLOT_FLAGS: usize = 4;
/// `flags` bit: the slot's holder holds an OFD lock on the slot's bytes (see the module doc).
pub const SLOT_LOCKED: u32 = 1;
/// Slot offset of `start_time` (`u64`).
pub const SLOT_START: usize = 8;
/// Slot offset of `used` (`[u64; MAX_GPUS]`).
pub const SLOT_USED: usize = 16;
/// A slot's pid while it is being reclaimed.
pub const RECLAIMING: u32 = u32::MAX;

/// The environment variable naming the budget files' directory.
pub const ENV_DIR: &str = "GPUSHARE_ISOLATION_DIR";
/// The environment variable naming the budget (default `default`): processes with the same
/// directory, key and limits share one budget.
pub const ENV_KEY: &str = "GPUSHARE_ISOLATION_KEY";

const NAME_PREFIX: &str = "budget-";

/// Why bytes are not a budget file of this layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a version-{VERSION} budget file: {reason}")]
pub struct FormatError {
    /// What is wrong with them.
    pub reason: String,
}

impl FormatError {
    pub(crate) fn new(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
        }
    }
}

/// The budget file for `limits` in `dir` under `key`:
/// `budget-KEY-COUNTxSHAREMiB.v1`, e.g. `budget-default-2x2048MiB.v1`.
pub fn budget_path(dir: &Path, key: &str, limits: &Limits) -> PathBuf {
    let key: String = key
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let share_mib = limits.share(0) >> 20;
    dir.join(format!(
        "{NAME_PREFIX}{key}-{}x{share_mib}MiB.v{VERSION}",
        limits.shares().len()
    ))
}

/// The key in the name of a budget file of this version (as [`budget_path`] wrote it, with
/// its characters replaced), `None` if `path` is not named like one.
pub fn budget_key(path: &Path) -> Option<&str> {
    let name = path.file_name()?.to_str()?;
    let rest = name
        .strip_prefix(NAME_PREFIX)?
        .strip_suffix(&format!(".v{VERSION}"))?;
    let (key, shape) = rest.rsplit_once('-')?;
    let (count, share) = shape.strip_suffix("MiB")?.split_once('x')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (digits(count) && digits(share)).then_some(key)
}

/// A budget file's header: what it was made for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Each GPU's share, bytes, by CUDA ordinal (1 to [`MAX_GPUS`] of them).
    pub shares: Vec<u64>,
}

impl Header {
    /// The header of a budget for `limits`.
    pub fn of(limits: &Limits) -> Self {
        Self {
            shares: limits.shares().to_vec(),
        }
    }

    /// The header's bytes, magic included (a writer puts the magic in place last). Shares
    /// past [`MAX_GPUS`] are left out.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut header = [0u8; HEADER_LEN];
        let shares = &self.shares[..self.shares.len().min(MAX_GPUS)];
        let mut put32 =
            |off: usize, v: usize| header[off..off + 4].copy_from_slice(&(v as u32).to_ne_bytes());
        put32(OFF_VERSION, VERSION as usize);
        put32(OFF_HEADER_LEN, HEADER_LEN);
        put32(OFF_GPU_COUNT, shares.len());
        put32(OFF_SLOT_COUNT, SLOTS);
        put32(OFF_SLOT_LEN, SLOT_LEN);
        put32(OFF_MAX_GPUS, MAX_GPUS);
        for (gpu, share) in shares.iter().enumerate() {
            let off = OFF_SHARE + 8 * gpu;
            header[off..off + 8].copy_from_slice(&share.to_ne_bytes());
        }
        header[..8].copy_from_slice(&MAGIC);
        header
    }

    /// Parses the first [`HEADER_LEN`] bytes of a budget file.
    pub fn parse(bytes: &[u8]) -> Result<Self, FormatError> {
        if bytes.len() < HEADER_LEN {
            return Err(FormatError::new("short header"));
        }
        if bytes[..8] != MAGIC {
            return Err(FormatError::new("bad magic (or still being created)"));
        }
        let field = |off, want: usize, name: &str| {
            let got = u32_at(bytes, off);
            if got as usize == want {
                Ok(())
            } else {
                Err(FormatError::new(format!("{name} {got}, not {want}")))
            }
        };
        field(OFF_VERSION, VERSION as usize, "version")?;
        field(OFF_HEADER_LEN, HEADER_LEN, "header length")?;
        field(OFF_SLOT_COUNT, SLOTS, "slot count")?;
        field(OFF_SLOT_LEN, SLOT_LEN, "slot length")?;
        field(OFF_MAX_GPUS, MAX_GPUS, "GPU array length")?;
        let gpu_count = u32_at(bytes, OFF_GPU_COUNT) as usize;
        if !(1..=MAX_GPUS).contains(&gpu_count) {
            return Err(FormatError::new(format!("GPU count {gpu_count}")));
        }
        Ok(Self {
            shares: (0..gpu_count)
                .map(|gpu| u64_at(bytes, OFF_SHARE + 8 * gpu))
                .collect(),
        })
    }
}

/// The native-endian `u64` at `off`.
pub(crate) fn u64_at(bytes: &[u8], off: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[off..off + 8]);
    u64::from_ne_bytes(word)
}

/// The native-endian `u32` at `off`.
pub(crate) fn u32_at(bytes: &[u8], off: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[off..off + 4]);
    u32::from_ne_bytes(word)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_header_reads_back_as_written() {
        let header = Header::of(&Limits::new(vec![4096 * MIB, 2048 * MIB]));
        let bytes = header.encode();
        assert_eq!(bytes[..8], MAGIC);
        assert_eq!(Header::parse(&bytes), Ok(header));
    }

    #[test]
    fn a_header_of_another_shape_is_refused() {
        let good = Header::of(&Limits::new(vec![MIB])).encode();
        let with = |off: usize, v: u32| {
            let mut bytes = good;
            bytes[off..off + 4].copy_from_slice(&v.to_ne_bytes());
            Header::parse(&bytes)
        };
        assert!(with(OFF_VERSION, 2).is_err());
        assert!(with(OFF_SLOT_COUNT, 512).is_err());
        assert!(with(OFF_SLOT_LEN, 136).is_err());
        assert!(with(OFF_MAX_GPUS, 8).is_err());
        assert!(with(OFF_GPU_COUNT, 0).is_err());
        assert!(with(OFF_GPU_COUNT, 17).is_err());
        assert!(with(0, 0).is_err(), "no magic yet");
        assert!(Header::parse(&good[..HEADER_LEN - 1]).is_err());
    }

    #[test]
    fn the_key_is_read_back_from_the_name() {
        let dir = Path::new("/run/gpushare");
        let limits = Limits::new(vec![2048 * MIB, 2048 * MIB]);
        let path = budget_path(dir, "pod-a_main", &limits);
        assert_eq!(path, dir.join("budget-pod-a_main-2x2048MiB.v1"));
        assert_eq!(budget_key(&path), Some("pod-a_main"));
        // Characters a file name should not carry are replaced, so the key is what was written.
        let path = budget_path(dir, "ns/pod:c", &limits);
        assert_eq!(budget_key(&path), Some("ns_pod_c"));
        for other in [
            "budget-default-1x1024MiB.v2",
            "budget-default-1x1024MiB.v1.tmp",
            "budget-default.v1",
            "budget-default-1xMiB.v1",
            "default-1x1024MiB.v1",
        ] {
            assert_eq!(budget_key(&dir.join(other)), None, "{other}");
        }
    }
}
