//! A container's accounting, prepared by the plugin before the container starts: its budget
//! file, and a read-only limits file that names it.
//!
//! Why: limits read from the environment are only as strong as the environment, which any
//! process of the container may change for its children (`GPUSHARE_CONTAINER_MEM_GIB=16`,
//! or another `GPUSHARE_ISOLATION_KEY` for a fresh budget). So the plugin writes the limits
//! to a file mounted read-only at [`LIMITS_FILE_IN_CONTAINER`], outside the read-write
//! accounting directory, and makes the budget file itself ([`prepare`]). Where that file
//! exists the interposer takes everything from it and opens the budget it names without
//! creating it: a missing or damaged budget refuses every allocation rather than passing
//! them.
//!
//! # Format, version 1
//!
//! UTF-8 text, one `key=value` a line; lines starting with `#` and empty lines are
//! comments. Every key at most once; unknown keys are errors (a newer plugin's file is not
//! half-read by an older interposer; it bumps `version`).
//!
//! ```text
//! # gpushare isolation limits: written by the plugin, read by libgpushare_isolation.so
//! version=1
//! budget=/var/run/gpushare/isolation/budget-container-2x4096MiB.v1
//! share_mib=4096,4096
//! uuid=GPU-…,GPU-…
//! context_mib=512           (optional: unset, a context is charged what it took)
//! managed_memory=charge     (optional: charge or ignore)
//! compute_percent=30        (optional: 1 to 100, the share of each GPU's SM time)
//! compute_mode=shared       (optional: shared, capped or off)
//! compute_dir=/var/run/gpushare/compute  (optional: the node-wide compute state directory)
//! ```
//!
//! `share_mib` lists each GPU's share in share order (1 to [`MAX_GPUS`]), `uuid` the GPUs
//! in the same order (may be empty: GPUs are then told apart by NVML index).
//!
//! The three `compute_*` lines are [`PreparedCompute`], written and read beside
//! [`PreparedLimits`] (a struct of their own, so that the plugins' existing
//! `PreparedLimits { .. }` stay as they are): [`prepare_with_compute`] writes both, and
//! [`PreparedCompute::parse`] reads them from a file [`PreparedLimits::parse`] accepted.

use std::fs::OpenOptions;
use std::io::{self, Write as _};
use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use crate::layout::{FILE_LEN, HEADER_LEN, Header, MAX_GPUS};

/// Where the plugins mount a container's limits file, read-only.
pub const LIMITS_FILE_IN_CONTAINER: &str = "/var/run/gpushare/limits";
/// Names a limits file, read only where [`LIMITS_FILE_IN_CONTAINER`] does not exist: tests,
/// `scripts/gpu-check.sh`, a program run outside Kubernetes.
pub const ENV_LIMITS_FILE: &str = "GPUSHARE_ISOLATION_LIMITS_FILE";
/// The format version this crate writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// The most MiB a context may be charged (as `GPUSHARE_CONTEXT_MIB`).
pub const MAX_CONTEXT_MIB: u64 = 1 << 20;

/// Why text is not a limits file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a version-{FORMAT_VERSION} gpushare limits file: {reason}")]
pub struct LimitsFormatError {
    /// What is wrong with it.
    pub reason: String,
}

fn bad(reason: impl Into<String>) -> LimitsFormatError {
    LimitsFormatError {
        reason: reason.into(),
    }
}

/// What a limits file holds; see the module doc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedLimits {
    /// The budget file's absolute path as the container sees it.
    pub budget: PathBuf,
    /// Bytes per GPU, in share order (whole MiB).
    pub shares: Vec<u64>,
    /// The GPUs' UUIDs, in share order (may be empty).
    pub uuids: Vec<String>,
    /// MiB charged per context; `None`: what each context took.
    pub context_mib: Option<u64>,
    /// `charge` or `ignore`; `None`: the interposer's default (`charge`).
    pub managed_memory: Option<String>,
}

impl PreparedLimits {
    /// The file's text.
    pub fn encode(&self) -> String {
        let list = |items: Vec<String>| items.join(",");
        let mut text = format!(
            "# gpushare isolation limits: written by the plugin, read by libgpushare_isolation.so\n\
             version={FORMAT_VERSION}\n\
             budget={}\n\
             share_mib={}\n\
             uuid={}\n",
            self.budget.display(),
            list(self.shares.iter().map(|s| (s >> 20).to_string()).collect()),
            list(self.uuids.clone()),
        );
        if let Some(mib) = self.context_mib {
            text.push_str(&format!("context_mib={mib}\n"));
        }
        if let Some(mode) = &self.managed_memory {
            text.push_str(&format!("managed_memory={mode}\n"));
        }
        text
    }

    /// Parses a limits file's text, strictly (its compute lines too, which
    /// [`PreparedCompute::parse`] returns).
    pub fn parse(text: &str) -> Result<Self, LimitsFormatError> {
        let fields = fields(text)?;
        let get = |key: &str| fields.iter().find(|(k, _)| *k == key).map(|(_, v)| *v);
        if let Some((key, _)) = fields.iter().find(|(k, _)| {
            ![
                "version",
                "budget",
                "share_mib",
                "uuid",
                "context_mib",
                "managed_memory",
                "compute_percent",
                "compute_mode",
                "compute_dir",
            ]
            .contains(k)
        }) {
            return Err(bad(format!("unknown key {key}")));
        }
        PreparedCompute::from_fields(&fields)?;
        match get("version") {
            Some(v) if v == FORMAT_VERSION.to_string() => {}
            Some(v) => return Err(bad(format!("version {v}"))),
            None => return Err(bad("no version")),
        }
        let budget = PathBuf::from(get("budget").ok_or_else(|| bad("no budget"))?);
        if !budget.is_absolute() {
            return Err(bad(format!("budget {} is not absolute", budget.display())));
        }
        let shares = get("share_mib")
            .ok_or_else(|| bad("no share_mib"))?
            .split(',')
            .map(|mib| {
                mib.trim()
                    .parse::<u64>()
                    .ok()
                    .and_then(|mib| mib.checked_mul(1 << 20))
                    .ok_or_else(|| bad(format!("share_mib {mib:?} is not a number of MiB")))
            })
            .collect::<Result<Vec<u64>, _>>()?;
        if !(1..=MAX_GPUS).contains(&shares.len()) {
            return Err(bad(format!("{} shares, not 1 to {MAX_GPUS}", shares.len())));
        }
        let uuids: Vec<String> = match get("uuid") {
            None | Some("") => Vec::new(),
            Some(list) => list.split(',').map(|u| u.trim().to_owned()).collect(),
        };
        if !uuids.is_empty() && uuids.len() != shares.len() {
            return Err(bad(format!(
                "{} UUIDs for {} shares",
                uuids.len(),
                shares.len()
            )));
        }
        let context_mib = get("context_mib")
            .map(|mib| {
                mib.parse::<u64>()
                    .ok()
                    .filter(|m| *m <= MAX_CONTEXT_MIB)
                    .ok_or_else(|| bad(format!("context_mib {mib:?} is not a number of MiB")))
            })
            .transpose()?;
        let managed_memory = match get("managed_memory") {
            None => None,
            Some(mode @ ("charge" | "ignore")) => Some(mode.to_owned()),
            Some(mode) => return Err(bad(format!("managed_memory {mode:?}"))),
        };
        Ok(Self {
            budget,
            shares,
            uuids,
            context_mib,
            managed_memory,
        })
    }
}

/// A limits file's `key=value` lines, each key at most once.
fn fields(text: &str) -> Result<Vec<(&str, &str)>, LimitsFormatError> {
    let mut fields: Vec<(&str, &str)> = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (key, value) = line
            .split_once('=')
            .ok_or_else(|| bad(format!("line {line:?} is not key=value")))?;
        let (key, value) = (key.trim(), value.trim());
        if fields.iter().any(|(k, _)| *k == key) {
            return Err(bad(format!("{key} given twice")));
        }
        fields.push((key, value));
    }
    Ok(fields)
}

/// A limits file's compute lines: the container's share of its GPUs' SM time (see
/// [`crate::settings`] for what each means). All `None`: no compute share.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PreparedCompute {
    /// `compute_percent`: 1 to 100.
    pub percent: Option<u8>,
    /// `compute_mode`: `shared`, `capped` or `off`; `None`: `shared`.
    pub mode: Option<String>,
    /// `compute_dir`: the node-wide compute state directory as the container sees it;
    /// `None`: the budget file's directory.
    pub dir: Option<PathBuf>,
}

impl PreparedCompute {
    /// The compute lines of a limits file's text (read as strictly as
    /// [`PreparedLimits::parse`] does; other keys are not looked at).
    pub fn parse(text: &str) -> Result<Self, LimitsFormatError> {
        Self::from_fields(&fields(text)?)
    }

    fn from_fields(fields: &[(&str, &str)]) -> Result<Self, LimitsFormatError> {
        let get = |key: &str| fields.iter().find(|(k, _)| *k == key).map(|(_, v)| *v);
        let percent = get("compute_percent")
            .map(|p| {
                crate::settings::parse_percent(p)
                    .ok_or_else(|| bad(format!("compute_percent {p:?} is not 1 to 100")))
            })
            .transpose()?;
        let mode = get("compute_mode")
            .map(|m| {
                crate::settings::ComputeMode::parse(m)
                    .filter(|parsed| parsed.as_str() == m)
                    .map(|_| m.to_owned())
                    .ok_or_else(|| bad(format!("compute_mode {m:?}")))
            })
            .transpose()?;
        let dir = get("compute_dir")
            .map(|d| {
                Some(PathBuf::from(d))
                    .filter(|d| d.is_absolute())
                    .ok_or_else(|| bad(format!("compute_dir {d} is not absolute")))
            })
            .transpose()?;
        Ok(Self { percent, mode, dir })
    }

    /// Its lines of the file's text (none for the default).
    pub fn encode(&self) -> String {
        let mut text = String::new();
        if let Some(percent) = self.percent {
            text.push_str(&format!("compute_percent={percent}\n"));
        }
        if let Some(mode) = &self.mode {
            text.push_str(&format!("compute_mode={mode}\n"));
        }
        if let Some(dir) = &self.dir {
            text.push_str(&format!("compute_dir={}\n", dir.display()));
        }
        text
    }
}

/// Prepares a container's accounting: the budget file at `budget_file` (its header for
/// `limits.shares`, mode 0666 whatever the umask, so that whatever user the container runs
/// as can map it) and the limits file at `limits_file` (written beside and renamed into
/// place, mode 0444). A budget already there with the same shares is kept as it is: a
/// restarted container keeps what its live processes hold. One of other shares, or
/// damaged, is made anew.
pub fn prepare(budget_file: &Path, limits_file: &Path, limits: &PreparedLimits) -> io::Result<()> {
    prepare_with_compute(
        budget_file,
        limits_file,
        limits,
        &PreparedCompute::default(),
    )
}

/// As [`prepare`], with the container's compute lines in the limits file.
pub fn prepare_with_compute(
    budget_file: &Path,
    limits_file: &Path,
    limits: &PreparedLimits,
    compute: &PreparedCompute,
) -> io::Result<()> {
    if !(1..=MAX_GPUS).contains(&limits.shares.len()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} shares, not 1 to {MAX_GPUS}", limits.shares.len()),
        ));
    }
    let header = Header {
        shares: limits.shares.clone(),
    };
    if !holds_budget(budget_file, &header) {
        write_budget(budget_file, &header)?;
    }
    std::fs::set_permissions(budget_file, std::fs::Permissions::from_mode(0o666))?;

    let dir = limits_file.parent().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} has no directory", limits_file.display()),
        )
    })?;
    let name = limits_file
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let partial = dir.join(format!(".{name}.{}.partial", std::process::id()));
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&partial)?;
    file.write_all(limits.encode().as_bytes())?;
    file.write_all(compute.encode().as_bytes())?;
    file.sync_all()?;
    drop(file);
    std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o444))?;
    std::fs::rename(&partial, limits_file)
}

/// Whether `path` is a regular budget file of [`FILE_LEN`] bytes with `header`'s shares.
fn holds_budget(path: &Path, header: &Header) -> bool {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return false;
    };
    if !meta.is_file() || meta.len() != FILE_LEN as u64 {
        return false;
    }
    let mut bytes = vec![0u8; HEADER_LEN];
    std::fs::File::open(path)
        .and_then(|f| f.read_exact_at(&mut bytes, 0))
        .is_ok()
        && Header::parse(&bytes).is_ok_and(|h| h.shares == header.shares)
}

/// Writes a fresh budget file (beside, then renamed into place: no process ever maps a
/// half-made one).
fn write_budget(path: &Path, header: &Header) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let partial = dir.join(format!(".{name}.{}.partial", std::process::id()));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&partial)?;
    file.set_len(FILE_LEN as u64)?;
    file.write_all_at(&header.encode(), 0)?;
    file.sync_all()?;
    file.set_permissions(std::fs::Permissions::from_mode(0o666))?;
    drop(file);
    std::fs::rename(&partial, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reader::Snapshot;

    const MIB: u64 = 1 << 20;

    fn limits(budget: &Path) -> PreparedLimits {
        PreparedLimits {
            budget: budget.to_owned(),
            shares: vec![4096 * MIB, 2048 * MIB],
            uuids: vec![
                "GPU-00000000-0000-0000-0000-000000000001".into(),
                "GPU-00000000-0000-0000-0000-000000000002".into(),
            ],
            context_mib: Some(512),
            managed_memory: Some("ignore".into()),
        }
    }

    #[test]
    fn a_limits_file_reads_back_as_written() {
        let written = limits(Path::new("/var/run/gpushare/isolation/budget"));
        let text = written.encode();
        assert!(text.starts_with('#'), "{text}");
        assert!(text.contains("\nshare_mib=4096,2048\n"), "{text}");
        assert_eq!(PreparedLimits::parse(&text), Ok(written));
        let bare = PreparedLimits {
            uuids: Vec::new(),
            context_mib: None,
            managed_memory: None,
            ..limits(Path::new("/b"))
        };
        assert_eq!(PreparedLimits::parse(&bare.encode()), Ok(bare));
    }

    #[test]
    fn a_limits_file_is_parsed_strictly() {
        let good = "version=1\nbudget=/b\nshare_mib=4096\n";
        assert!(PreparedLimits::parse(good).is_ok());
        for bad in [
            "budget=/b\nshare_mib=4096\n",
            "version=2\nbudget=/b\nshare_mib=4096\n",
            "version=1\nshare_mib=4096\n",
            "version=1\nbudget=b\nshare_mib=4096\n",
            "version=1\nbudget=/b\n",
            "version=1\nbudget=/b\nshare_mib=4G\n",
            "version=1\nbudget=/b\nshare_mib=\n",
            "version=1\nbudget=/b\nshare_mib=1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1\n",
            "version=1\nbudget=/b\nshare_mib=4096\nuuid=GPU-1,GPU-2\n",
            "version=1\nbudget=/b\nshare_mib=4096\ncontext_mib=-1\n",
            "version=1\nbudget=/b\nshare_mib=4096\ncontext_mib=1048577\n",
            "version=1\nbudget=/b\nshare_mib=4096\nmanaged_memory=evict\n",
            "version=1\nbudget=/b\nshare_mib=4096\nshare_mib=8192\n",
            "version=1\nbudget=/b\nshare_mib=4096\nmem_gib=16\n",
            "version=1\nbudget=/b\nshare_mib=4096\njunk\n",
            "version=1\nbudget=/b\nshare_mib=4096\ncompute_percent=0\n",
            "version=1\nbudget=/b\nshare_mib=4096\ncompute_percent=101\n",
            "version=1\nbudget=/b\nshare_mib=4096\ncompute_mode=hard\n",
            "version=1\nbudget=/b\nshare_mib=4096\ncompute_mode=Shared\n",
            "version=1\nbudget=/b\nshare_mib=4096\ncompute_dir=compute\n",
            "version=1\nbudget=/b\nshare_mib=4096\ncompute_percent=30\ncompute_percent=40\n",
        ] {
            assert!(PreparedLimits::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn prepare_makes_a_budget_every_user_can_map_and_a_read_only_limits_file() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let budget = dir.path().join("budget-container-2x4096MiB.v1");
        let limits_file = dir.path().join("limits");
        let limits = limits(&budget);
        prepare(&budget, &limits_file, &limits).unwrap();

        let snapshot = Snapshot::read(&budget).unwrap();
        let shares: Vec<u64> = snapshot.gpus.iter().map(|g| g.share).collect();
        assert_eq!(shares, limits.shares);
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&budget), 0o666);
        assert_eq!(mode(&limits_file), 0o444);
        let text = std::fs::read_to_string(&limits_file).unwrap();
        assert_eq!(PreparedLimits::parse(&text), Ok(limits.clone()));
        let leftovers = std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".partial"))
            })
            .count();
        assert_eq!(leftovers, 0);
    }

    #[test]
    fn a_restart_keeps_a_good_budget_and_remakes_a_damaged_one() {
        let dir = tempfile::tempdir().unwrap();
        let budget = dir.path().join("budget");
        let limits_file = dir.path().join("limits");
        let limits = limits(&budget);
        prepare(&budget, &limits_file, &limits).unwrap();
        // A live process's holding, as the interposer would have written it.
        let used = crate::layout::OFF_USED as u64;
        let file = OpenOptions::new().write(true).open(&budget).unwrap();
        file.write_all_at(&(7 * MIB).to_ne_bytes(), used).unwrap();
        prepare(&budget, &limits_file, &limits).unwrap();
        assert_eq!(Snapshot::read(&budget).unwrap().gpus[0].used, 7 * MIB);

        // Other shares, or a damaged header: made anew.
        let other = PreparedLimits {
            shares: vec![1024 * MIB],
            ..limits.clone()
        };
        prepare(&budget, &limits_file, &other).unwrap();
        let snapshot = Snapshot::read(&budget).unwrap();
        assert_eq!(snapshot.gpus.len(), 1);
        assert_eq!(snapshot.gpus[0].used, 0);
        std::fs::write(&budget, b"junk").unwrap();
        prepare(&budget, &limits_file, &other).unwrap();
        assert!(Snapshot::read(&budget).is_ok());
    }

    #[test]
    fn compute_lines_read_back_as_written() {
        let dir = tempfile::tempdir().unwrap();
        let budget = dir.path().join("budget");
        let limits_file = dir.path().join("limits");
        let compute = PreparedCompute {
            percent: Some(30),
            mode: Some("capped".into()),
            dir: Some("/var/run/gpushare/compute".into()),
        };
        prepare_with_compute(&budget, &limits_file, &limits(&budget), &compute).unwrap();
        let text = std::fs::read_to_string(&limits_file).unwrap();
        assert!(
            text.contains("\ncompute_percent=30\ncompute_mode=capped\n"),
            "{text}"
        );
        assert_eq!(PreparedLimits::parse(&text), Ok(limits(&budget)));
        assert_eq!(PreparedCompute::parse(&text), Ok(compute));
        // Without compute lines, none come back.
        let plain = limits(&budget).encode();
        assert_eq!(
            PreparedCompute::parse(&plain),
            Ok(PreparedCompute::default())
        );
        assert_eq!(PreparedCompute::default().encode(), "");
    }
}
