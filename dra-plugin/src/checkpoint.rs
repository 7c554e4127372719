//! The plugin's memory across restarts: which claims it prepared, and how.
//!
//! kubelet may call Prepare again for a claim already prepared (after its own restart, or
//! ours) and Unprepare for one already unprepared; both must answer the same as the first
//! time. The checkpoint is a JSON file next to the plugin socket, rewritten atomically after
//! every change; a claim in it answers Prepare without asking the API server again, so the
//! devices a running container was given never change under it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::prepare::PreparedDevice;

/// The file's format version.
pub const VERSION: u32 = 1;

/// Why the checkpoint could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Reading or writing the file failed.
    #[error("checkpoint {path}: {source}")]
    Io {
        /// the file
        path: PathBuf,
        /// the I/O error
        #[source]
        source: std::io::Error,
    },
    /// The file is not a checkpoint this version can read.
    #[error(
        "checkpoint {path} cannot be read ({reason}); move it aside only after unpreparing its claims by hand (their CDI specs are in the CDI directory)"
    )]
    Corrupt {
        /// the file
        path: PathBuf,
        /// what is wrong
        reason: String,
    },
}

/// One prepared claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedClaim {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// What Prepare answered.
    pub devices: Vec<PreparedDevice>,
}

/// Prepared claims by UID.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// The format version ([`VERSION`]).
    pub version: u32,
    /// Claim UID → what was prepared.
    pub claims: BTreeMap<String, PreparedClaim>,
}

impl Checkpoint {
    /// Reads the checkpoint at `path`; none there means nothing was prepared yet.
    pub fn load(path: &Path) -> Result<Self, CheckpointError> {
        let text = match std::fs::read(path) {
            Ok(text) => text,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Self {
                    version: VERSION,
                    claims: BTreeMap::new(),
                });
            }
            Err(source) => {
                return Err(CheckpointError::Io {
                    path: path.to_owned(),
                    source,
                });
            }
        };
        let checkpoint: Self =
            serde_json::from_slice(&text).map_err(|err| CheckpointError::Corrupt {
                path: path.to_owned(),
                reason: err.to_string(),
            })?;
        if checkpoint.version != VERSION {
            return Err(CheckpointError::Corrupt {
                path: path.to_owned(),
                reason: format!(
                    "version {} (this plugin reads {VERSION})",
                    checkpoint.version
                ),
            });
        }
        Ok(checkpoint)
    }

    /// Writes the checkpoint to `path` atomically.
    pub fn save(&self, path: &Path) -> Result<(), CheckpointError> {
        let io = |source| CheckpointError::Io {
            path: path.to_owned(),
            source,
        };
        let text = serde_json::to_vec_pretty(self).map_err(|e| io(std::io::Error::other(e)))?;
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_starts_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        let mut checkpoint = Checkpoint::load(&path).unwrap();
        assert!(checkpoint.claims.is_empty());
        checkpoint.claims.insert(
            "u1".into(),
            PreparedClaim {
                namespace: "ns".into(),
                name: "c".into(),
                devices: vec![],
            },
        );
        checkpoint.save(&path).unwrap();
        assert_eq!(Checkpoint::load(&path).unwrap(), checkpoint);
        std::fs::write(&path, "{").unwrap();
        assert!(matches!(
            Checkpoint::load(&path),
            Err(CheckpointError::Corrupt { .. })
        ));
    }
}
