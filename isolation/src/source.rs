//! Where this process's limits come from: the plugin's read-only limits file where there is
//! one, else the environment; and what to do when they are set but cannot be applied.
//!
//! # The limits file wins
//!
//! If [`LIMITS_FILE_IN_CONTAINER`] exists (the plugins mount it read-only), or else
//! `$GPUSHARE_ISOLATION_LIMITS_FILE` names a file ([`ENV_LIMITS_FILE`]: tests,
//! `scripts/gpu-check.sh`, a program run outside Kubernetes), the shares, the UUIDs, the
//! context charge, the managed-memory mode and the budget's path all come from it
//! ([`PreparedLimits`]), and the environment's `GPUSHARE_CONTAINER_MEM_GIB*`,
//! `GPUSHARE_GPU_COUNT`, `GPUSHARE_ISOLATION_DIR`/`KEY`, `GPUSHARE_GPU_UUID`,
//! `GPUSHARE_CONTEXT_MIB`, `GPUSHARE_MANAGED_MEMORY` and `GPUSHARE_COMPUTE_*` are ignored: a process cannot give
//! its children a bigger share or another budget. The budget it names must already exist
//! (the plugin made it): it is never created here.
//!
//! Without a limits file, everything comes from the environment, as before the file existed.
//!
//! # Fail closed
//!
//! Limits set (by the file, or by the environment) that cannot be read, or a budget that
//! cannot be opened, mapped or validated, is a [`Failure`]: the process then refuses every
//! allocation (see [`crate::Budget::closed`]) and says why, once, on stderr.

use std::io::Read as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use gpushare_isolation_budget::prepared::{
    ENV_LIMITS_FILE, LIMITS_FILE_IN_CONTAINER, LimitsFormatError, PreparedCompute, PreparedLimits,
};
use gpushare_isolation_budget::{Limits, limits};

use crate::budget::{self, Budget};
use crate::settings::{
    self, ENV_COMPUTE_DIR, ENV_COMPUTE_MODE, ENV_COMPUTE_PERCENT, ENV_CONTEXT_MIB, ENV_GPU_UUID,
    ENV_MANAGED_MEMORY, Settings,
};

/// The longest limits file read (a real one is a few hundred bytes).
const MAX_LIMITS_FILE: u64 = 64 << 10;

/// Why limits that are set cannot be applied.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The limits file could not be read.
    #[error("limits file {path}: {source}")]
    ReadLimits {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The limits file is not one.
    #[error("limits file {path}: {source}")]
    LimitsFormat {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: LimitsFormatError,
    },
    /// The limits file's settings are not the interposer's.
    #[error("limits file {path}: {source}")]
    FileSettings {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: settings::Invalid,
    },
    /// The environment's limits are malformed.
    #[error(transparent)]
    EnvLimits(#[from] limits::Error),
    /// The environment's settings are malformed.
    #[error(transparent)]
    EnvSettings(#[from] settings::Invalid),
    /// The budget could not be opened, mapped or validated.
    #[error(transparent)]
    Budget(#[from] budget::Error),
}

/// Where the limits were found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// The limits file at this path.
    File(PathBuf),
    /// The environment.
    Env,
}

/// Limits that are set, and where from.
#[derive(Debug)]
pub struct Resolved {
    /// The shares.
    pub limits: Limits,
    /// The rest of the settings.
    pub settings: Settings,
    /// The budget file.
    pub budget: PathBuf,
    /// Where they were found.
    pub origin: Origin,
}

/// Limits that are set but cannot be applied: what is known of them, and why.
#[derive(Debug)]
pub struct Failure {
    /// The shares, when they could be read.
    pub limits: Option<Limits>,
    /// The settings, as far as they could be read.
    pub settings: Settings,
    /// Where the limits were found.
    pub origin: Origin,
    /// Why they cannot be applied.
    pub error: Error,
}

impl Failure {
    /// The one line said on stderr: what failed and what to do.
    pub fn message(&self) -> String {
        let fix = match &self.origin {
            Origin::File(_) => {
                "the plugin prepares the budget and the limits file before the container \
                 starts: restart the pod (and check the plugin's --isolation-host-dir)"
            }
            Origin::Env => {
                "fix the container's GPUSHARE_* variables, and check that \
                 $GPUSHARE_ISOLATION_DIR is writable and holds only budget files"
            }
        };
        format!(
            "gpushare-isolation: refusing all GPU memory: {}; {fix}",
            self.error
        )
    }
}

/// The limits file this process reads, if any: [`LIMITS_FILE_IN_CONTAINER`] where it
/// exists, else what `$GPUSHARE_ISOLATION_LIMITS_FILE` names.
pub fn limits_file() -> Option<PathBuf> {
    let mounted = Path::new(LIMITS_FILE_IN_CONTAINER);
    if mounted.exists() {
        return Some(mounted.to_path_buf());
    }
    std::env::var_os(ENV_LIMITS_FILE)
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

/// This process's limits: `Ok(None)` when none are set.
pub fn resolve() -> Result<Option<Resolved>, Box<Failure>> {
    match limits_file() {
        Some(path) => from_file(&path).map(Some),
        None => from_env(),
    }
}

/// The limits in the file at `path`.
fn from_file(path: &Path) -> Result<Resolved, Box<Failure>> {
    let origin = Origin::File(path.to_path_buf());
    let fail = |limits: Option<Limits>, settings: Settings, error| {
        Box::new(Failure {
            limits,
            settings: closed_settings(settings),
            origin: origin.clone(),
            error,
        })
    };
    let text = read_limits_file(path).map_err(|source| {
        fail(
            None,
            Settings::default(),
            Error::ReadLimits {
                path: path.to_path_buf(),
                source,
            },
        )
    })?;
    let prepared = PreparedLimits::parse(&text).map_err(|source| {
        fail(
            None,
            Settings::default(),
            Error::LimitsFormat {
                path: path.to_path_buf(),
                source,
            },
        )
    })?;
    // Parsed with the rest above: only the lines are taken here.
    let compute = PreparedCompute::parse(&text).unwrap_or_default();
    let limits = Limits::new(prepared.shares.clone());
    let settings = settings_of(&prepared, &compute).map_err(|source| {
        let uuids = settings_of(
            &PreparedLimits {
                context_mib: None,
                managed_memory: None,
                ..prepared.clone()
            },
            &PreparedCompute::default(),
        )
        .unwrap_or_default();
        fail(
            Some(limits.clone()),
            uuids,
            Error::FileSettings {
                path: path.to_path_buf(),
                source,
            },
        )
    })?;
    Ok(Resolved {
        limits,
        settings,
        budget: prepared.budget,
        origin,
    })
}

/// The settings a limits file holds, read as the environment's are.
fn settings_of(
    prepared: &PreparedLimits,
    compute: &PreparedCompute,
) -> Result<Settings, settings::Invalid> {
    Settings::parse(|name| match name {
        ENV_GPU_UUID => Some(prepared.uuids.join(",")),
        ENV_CONTEXT_MIB => prepared.context_mib.map(|mib| mib.to_string()),
        ENV_MANAGED_MEMORY => prepared.managed_memory.clone(),
        ENV_COMPUTE_PERCENT => compute.percent.map(|p| p.to_string()),
        ENV_COMPUTE_MODE => compute.mode.clone(),
        ENV_COMPUTE_DIR => compute.dir.as_ref().map(|d| d.display().to_string()),
        _ => None,
    })
}

/// Reads the limits file: a regular file, never waited on (a FIFO planted there does not
/// hang the program), at most [`MAX_LIMITS_FILE`] bytes.
fn read_limits_file(path: &Path) -> std::io::Result<String> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a regular file",
        ));
    }
    let mut text = String::new();
    file.take(MAX_LIMITS_FILE).read_to_string(&mut text)?;
    Ok(text)
}

/// The limits the environment sets.
fn from_env() -> Result<Option<Resolved>, Box<Failure>> {
    let fail = |limits: Option<Limits>, error| {
        Box::new(Failure {
            limits,
            settings: closed_settings(Settings::from_env().unwrap_or_default()),
            origin: Origin::Env,
            error,
        })
    };
    let limits = match Limits::from_env() {
        Ok(Some(limits)) => limits,
        Ok(None) => return Ok(None),
        Err(e) => return Err(fail(None, e.into())),
    };
    let settings = Settings::from_env().map_err(|e| fail(Some(limits.clone()), e.into()))?;
    let budget = budget::path_from_env(&limits);
    Ok(Some(Resolved {
        limits,
        settings,
        budget,
        origin: Origin::Env,
    }))
}

/// Settings for a process that refuses everything: managed memory is refused too.
fn closed_settings(mut settings: Settings) -> Settings {
    settings.managed = settings::Managed::Charge;
    settings
}

impl Resolved {
    /// Opens the budget: the prepared one for a limits file (never created), else the
    /// environment's (made if need be).
    pub fn open(&self) -> Result<Budget, Box<Failure>> {
        let opened = match self.origin {
            Origin::File(_) => Budget::open_prepared(&self.budget, &self.limits),
            Origin::Env => Budget::open(&self.budget, &self.limits),
        };
        opened.map_err(|e| {
            Box::new(Failure {
                limits: Some(self.limits.clone()),
                settings: closed_settings(self.settings.clone()),
                origin: self.origin.clone(),
                error: e.into(),
            })
        })
    }
}
