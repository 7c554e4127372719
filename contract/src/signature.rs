//! Signed allocations: the extender signs its decision, the device plugin acts only on a
//! decision whose signature verifies.
//!
//! Why: the allocation annotations are plain pod annotations. Anyone who may create pods can
//! create one with `spec.nodeName` already set and hand-written `<domain>/v1.gpu-index`,
//! `pod-gib` and `containers`; it never meets the scheduler, the extender never books its
//! memory, and a device plugin that trusted the annotations would hand it the GPU they name.
//! Admission control can refuse such pods, but this check does not depend on it.
//!
//! ```text
//!   extender (bind)                                        device plugin (Allocate)
//!   decision ──canonical_v1(uid, node, decision)──▶ HMAC ──▶ <domain>/v1.signature = "k1:…"
//!                                                            │  (on the Binding, one write)
//!   pod annotations ──canonical_v1(pod's UID, its node, its annotations)──▶ HMAC ══? signature
//!                                                            └─ equal: a candidate; else refused
//! ```
//!
//! ## What is signed
//!
//! [`canonical_v1`]: the pod's UID, the node, the GPU index and UUID, the pod's GiB, and every
//! container (name, GiB, init), in a length-prefixed byte string that starts with a version
//! tag. Not signed: the bind time and the device plugin's progress marks (`allocated`,
//! `assigned`), which the plugin itself rewrites. The form is versioned: a later form gets a
//! new tag and a new function, verifiers learn it before signers use it, and the old one is
//! dropped once no live pod carries it.
//!
//! ## Why HMAC with a shared key
//!
//! The threat is a user who may create pods but holds no credentials of gpushare itself.
//! Against that, a secret shared by the two programs that take part (both ours, installed by
//! one chart, the key in a Secret only their pods mount) is the simplest thing that works:
//! HMAC-SHA256 is one small pure-Rust dependency, a key is 32 random bytes that Helm can
//! generate, there is one file format and one rotation procedure, and verifying costs
//! nanoseconds per pod update. An asymmetric pair (Ed25519) would keep the signing key off
//! the GPU nodes, so that root on one GPU node could not sign allocations for pods on other
//! nodes; with HMAC it can. We accept that for now: root on a node already controls every
//! GPU container of that node, and reaching further still needs the right to create pods
//! there. The form version is where an Ed25519 form would go if that line must be drawn.
//!
//! ## What it stops, and what it does not
//!
//! - A pod created with hand-written allocation annotations (no signature, or a made-up
//!   one): refused at Allocate, never a candidate, never a twin.
//! - Copying a signed allocation from another pod onto a new pod: the pod UID is signed, and
//!   the API server assigns UIDs, so the copy does not verify.
//! - Editing a signed allocation (another GPU, fewer GiB): the signature no longer matches,
//!   and the extender does not let an allocation that fails lower what it booked for the pod.
//! - It does **not** stop anyone who can read the Secret (or exec into the extender or the
//!   device plugin): they can sign anything. Keep the Secret readable only by them.
//! - It does **not** tell the device plugin which pod an Allocate call is for (kubelet does
//!   not say): a container of a pod that bypassed the scheduler may still be matched, by
//!   size, to an honest pod waiting on the same node (see the device plugin's `matching`).
//! - It does not bound what a container actually uses on the GPU; that stays cooperative.
//!
//! ## The keyring file
//!
//! One key per line, `id:base64key` (at least 16 random bytes; 32 recommended, e.g.
//! `head -c32 /dev/urandom | base64`). The first line signs, every line verifies. Blank lines
//! and lines starting with `#` are ignored. Rotation, each step rolled out to both programs
//! before the next (they re-read the file when it changes, no restart):
//!
//! 1. add the new key as the second line (everything still signs with the old one);
//! 2. move it to the first line (new decisions are signed with it; old ones still verify);
//! 3. once no live pod carries a signature with the old id, remove the old line.
//!    A pod signed with a removed key is refused if kubelet admits it again (node reboot),
//!    and a restarted extender no longer books its memory.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::PodAllocation;

/// The version tag that starts [`canonical_v1`].
pub const FORM_V1_TAG: &[u8] = b"gpushare/allocation-signature/v1\n";
/// The shortest key accepted, in bytes.
pub const MIN_KEY_BYTES: usize = 16;
/// The longest key id accepted.
pub const MAX_KEY_ID_LEN: usize = 32;

type HmacSha256 = Hmac<Sha256>;

/// The bytes signed for `allocation` of pod `pod_uid` on `node`, form 1.
///
/// ```text
/// "gpushare/allocation-signature/v1\n"
/// str(pod_uid) str(node) u32(gpu_index) str(gpu_uuid) u64(pod_gib)
/// u64(number of containers) { str(name) u64(gib) u8(init) }*
/// ```
/// A multi-GPU, exclusive or compute allocation appends `u64(number of more GPUs) { u32(index)
/// str(uuid) }* u8(exclusive)`, and a compute allocation then `u32(compute) { u32(container
/// compute) }*` (one per container, in order). Only those allocations carry the tail, so
/// every signature made before multi-GPU pods (or compute) existed still verifies; and since
/// the container list's length is counted, the tail cannot be mistaken for a container.
/// `str(s)` is `u64(len(s))` then the UTF-8 bytes; integers are big-endian. Lengths make the
/// encoding unambiguous: no two different inputs give the same bytes.
pub fn canonical_v1(pod_uid: &str, node: &str, allocation: &PodAllocation) -> Vec<u8> {
    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_be_bytes());
        out.extend_from_slice(s.as_bytes());
    }
    let mut out = Vec::with_capacity(128);
    out.extend_from_slice(FORM_V1_TAG);
    string(&mut out, pod_uid);
    string(&mut out, node);
    out.extend_from_slice(&allocation.gpu_index.to_be_bytes());
    string(&mut out, &allocation.gpu_uuid);
    out.extend_from_slice(&allocation.pod_gib.to_be_bytes());
    out.extend_from_slice(&(allocation.containers.len() as u64).to_be_bytes());
    for container in &allocation.containers {
        string(&mut out, &container.name);
        out.extend_from_slice(&container.gib.to_be_bytes());
        out.push(u8::from(container.init));
    }
    let compute = allocation.compute > 0 || allocation.containers.iter().any(|c| c.compute > 0);
    if !allocation.more_gpus.is_empty() || allocation.exclusive || compute {
        out.extend_from_slice(&(allocation.more_gpus.len() as u64).to_be_bytes());
        for gpu in &allocation.more_gpus {
            out.extend_from_slice(&gpu.index.to_be_bytes());
            string(&mut out, &gpu.uuid);
        }
        out.push(u8::from(allocation.exclusive));
    }
    if compute {
        out.extend_from_slice(&allocation.compute.to_be_bytes());
        for container in &allocation.containers {
            out.extend_from_slice(&container.compute.to_be_bytes());
        }
    }
    out
}

/// One key of a [`Keyring`].
struct Key {
    id: String,
    secret: Vec<u8>,
}

impl Key {
    fn mac(&self, message: &[u8]) -> HmacSha256 {
        // HMAC takes keys of any length; `new_from_slice` cannot fail for it.
        let mut mac = <HmacSha256 as Mac>::new_from_slice(&self.secret)
            .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
        mac.update(message);
        mac
    }
}

/// The keys allocations are signed and verified with: the first signs, all verify.
pub struct Keyring {
    keys: Vec<Key>,
}

impl std::fmt::Debug for Keyring {
    /// Key ids only: the keys themselves never reach a log.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keyring")
            .field("ids", &self.ids().collect::<Vec<_>>())
            .finish()
    }
}

/// Why a keyring cannot be used. Messages never contain key material.
#[derive(Debug, thiserror::Error)]
pub enum KeyringError {
    /// The file cannot be read.
    #[error("cannot read the allocation keyring {}: {source}", path.display())]
    Read {
        /// the file
        path: PathBuf,
        /// the cause
        #[source]
        source: std::io::Error,
    },
    /// A line is not a usable `id:base64key`.
    #[error("allocation keyring{}: line {line}: {problem}", in_file(path.as_deref()))]
    Line {
        /// the file, when read from one
        path: Option<PathBuf>,
        /// 1-based line number
        line: usize,
        /// what is wrong with it
        problem: String,
    },
    /// No key at all.
    #[error(
        "allocation keyring{} holds no key; write one `id:base64key` per line, the first one signs",
        in_file(path.as_deref())
    )]
    Empty {
        /// the file, when read from one
        path: Option<PathBuf>,
    },
}

fn in_file(path: Option<&Path>) -> String {
    path.map(|p| format!(" {}", p.display()))
        .unwrap_or_default()
}

/// Why an allocation is not taken as the extender's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unverified {
    /// There is no signature annotation.
    #[error("it carries no signature")]
    Unsigned,
    /// The signature is not `key-id:base64` of an HMAC-SHA256.
    #[error("its signature is not `key-id:base64-of-32-bytes`")]
    Malformed,
    /// The signature names a key the keyring does not hold.
    #[error("its signature names key {0:?}, which is not in the keyring")]
    UnknownKey(String),
    /// The signature does not match the allocation, the pod's UID or its node.
    #[error(
        "its signature does not match its allocation (edited, copied from another pod, or signed with another key)"
    )]
    Mismatch,
}

fn check_key_id(id: &str) -> Result<(), String> {
    let valid = !id.is_empty()
        && id.len() <= MAX_KEY_ID_LEN
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if valid {
        Ok(())
    } else {
        Err(format!(
            "key id {id:?} must be 1 to {MAX_KEY_ID_LEN} characters of A-Z, a-z, 0-9, '.', '_', '-'"
        ))
    }
}

impl Keyring {
    /// Reads a keyring: one `id:base64key` per line; blank lines and `#` comments ignored.
    pub fn parse(text: &str) -> Result<Self, KeyringError> {
        let mut keys: Vec<(usize, Key)> = Vec::new();
        for (index, raw) in text.lines().enumerate() {
            let line = index + 1;
            let entry = raw.trim();
            if entry.is_empty() || entry.starts_with('#') {
                continue;
            }
            let problem = |problem: String| KeyringError::Line {
                path: None,
                line,
                problem,
            };
            let Some((id, encoded)) = entry.split_once(':') else {
                return Err(problem("expected `id:base64key`, found no ':'".to_owned()));
            };
            let id = id.trim();
            check_key_id(id).map_err(problem)?;
            if let Some((first, _)) = keys.iter().find(|(_, key)| key.id == id) {
                return Err(problem(format!(
                    "key id {id:?} is already used on line {first}"
                )));
            }
            let secret = STANDARD.decode(encoded.trim()).map_err(|_| {
                problem(format!(
                    "the key of {id:?} is not standard base64 (A-Z a-z 0-9 + /, '=' padding)"
                ))
            })?;
            if secret.len() < MIN_KEY_BYTES {
                return Err(problem(format!(
                    "the key of {id:?} is {} bytes; use at least {MIN_KEY_BYTES} random bytes (32 recommended: `head -c32 /dev/urandom | base64`)",
                    secret.len()
                )));
            }
            keys.push((
                line,
                Key {
                    id: id.to_owned(),
                    secret,
                },
            ));
        }
        if keys.is_empty() {
            return Err(KeyringError::Empty { path: None });
        }
        Ok(Self {
            keys: keys.into_iter().map(|(_, key)| key).collect(),
        })
    }

    /// Reads the keyring file at `path`.
    pub fn load(path: &Path) -> Result<Self, KeyringError> {
        let text = std::fs::read_to_string(path).map_err(|source| KeyringError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text).map_err(|error| with_path(error, path))
    }

    /// The id of the key that signs (the first line).
    pub fn signing_id(&self) -> &str {
        // `parse` refuses an empty keyring.
        self.keys.first().map_or("", |key| key.id.as_str())
    }

    /// Every key id, the signing one first.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.keys.iter().map(|key| key.id.as_str())
    }

    /// The signature annotation's value for `allocation` of pod `pod_uid` on `node`:
    /// `<key-id>:<base64 HMAC-SHA256 of canonical_v1>`.
    pub fn sign(&self, pod_uid: &str, node: &str, allocation: &PodAllocation) -> String {
        let Some(key) = self.keys.first() else {
            return String::new();
        };
        let tag = key
            .mac(&canonical_v1(pod_uid, node, allocation))
            .finalize()
            .into_bytes();
        format!("{}:{}", key.id, STANDARD.encode(tag))
    }

    /// Checks `allocation.signature` for pod `pod_uid` on `node`; the id of the key that
    /// verified it.
    pub fn verify(
        &self,
        pod_uid: &str,
        node: &str,
        allocation: &PodAllocation,
    ) -> Result<&str, Unverified> {
        let signature = allocation
            .signature
            .as_deref()
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .ok_or(Unverified::Unsigned)?;
        let (id, encoded) = signature.split_once(':').ok_or(Unverified::Malformed)?;
        check_key_id(id).map_err(|_| Unverified::Malformed)?;
        let tag = STANDARD
            .decode(encoded)
            .ok()
            .filter(|tag| tag.len() == 32)
            .ok_or(Unverified::Malformed)?;
        let key = self
            .keys
            .iter()
            .find(|key| key.id == id)
            .ok_or_else(|| Unverified::UnknownKey(id.to_owned()))?;
        // Constant-time comparison.
        key.mac(&canonical_v1(pod_uid, node, allocation))
            .verify_slice(&tag)
            .map_err(|_| Unverified::Mismatch)?;
        Ok(&key.id)
    }
}

fn with_path(error: KeyringError, file: &Path) -> KeyringError {
    match error {
        KeyringError::Line { line, problem, .. } => KeyringError::Line {
            path: Some(file.to_owned()),
            line,
            problem,
        },
        KeyringError::Empty { .. } => KeyringError::Empty {
            path: Some(file.to_owned()),
        },
        other => other,
    }
}

/// A keyring shared by everything that signs or verifies, replaced whole when its file
/// changes. Cheap to clone; readers take an `Arc` of the current keyring and never wait on
/// a reload.
#[derive(Debug, Clone)]
pub struct SharedKeyring {
    current: Arc<RwLock<Arc<Keyring>>>,
    generation: Arc<AtomicU64>,
}

impl SharedKeyring {
    /// Shares `keyring`.
    pub fn new(keyring: Keyring) -> Self {
        Self {
            current: Arc::new(RwLock::new(Arc::new(keyring))),
            generation: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The keyring now.
    pub fn current(&self) -> Arc<Keyring> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Bumped by every [`SharedKeyring::replace`]: a verdict cached at an older generation
    /// must be computed again.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Replaces the keyring.
    pub fn replace(&self, keyring: Keyring) {
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(keyring);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }
}

/// What [`KeyringFile::reload`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reload {
    /// The file has not changed since it was last read.
    Unchanged,
    /// The file changed and its keys are in use now: their ids, the signing one first.
    Replaced(Vec<String>),
}

/// A keyring file and the [`SharedKeyring`] it feeds.
///
/// Why the content and not the modification time: a Secret volume is updated by swapping a
/// symlink to a new directory, and two updates within a second can carry equal times; a
/// digest of the content misses nothing, and the file is a few hundred bytes.
#[derive(Debug)]
pub struct KeyringFile {
    path: PathBuf,
    keyring: SharedKeyring,
    /// SHA-256 of the content last read, good or bad (a bad file is reported once).
    seen: [u8; 32],
    /// The last read failed (reported once until it succeeds again).
    unreadable: bool,
}

impl KeyringFile {
    /// Loads the keyring at `path`; an unreadable or malformed file is an error.
    pub fn open(path: &Path) -> Result<Self, KeyringError> {
        let text = std::fs::read_to_string(path).map_err(|source| KeyringError::Read {
            path: path.to_owned(),
            source,
        })?;
        let keyring = Keyring::parse(&text).map_err(|error| with_path(error, path))?;
        Ok(Self {
            path: path.to_owned(),
            keyring: SharedKeyring::new(keyring),
            seen: Sha256::digest(text.as_bytes()).into(),
            unreadable: false,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The keyring this file feeds.
    pub fn keyring(&self) -> SharedKeyring {
        self.keyring.clone()
    }

    /// [`KeyringFile::reload`], logging what changed or failed (what both binaries' polling
    /// loops do every few seconds).
    pub fn reload_logged(&mut self) {
        match self.reload() {
            Ok(Reload::Unchanged) => {}
            Ok(Reload::Replaced(ids)) => {
                tracing::info!(file = %self.path.display(), keys = ?ids, "allocation keyring reloaded; the first key signs");
            }
            Err(error) => {
                tracing::error!(%error, "cannot reload the allocation keyring; keeping the keys in use");
            }
        }
    }

    /// Reads the file again and, if it changed and parses, replaces the shared keyring.
    /// On an error the keys in use stay in use; each failure is returned once (polling an
    /// unchanged bad file answers [`Reload::Unchanged`]).
    pub fn reload(&mut self) -> Result<Reload, KeyringError> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(_) if self.unreadable => return Ok(Reload::Unchanged),
            Err(source) => {
                self.unreadable = true;
                return Err(KeyringError::Read {
                    path: self.path.clone(),
                    source,
                });
            }
        };
        self.unreadable = false;
        let digest: [u8; 32] = Sha256::digest(text.as_bytes()).into();
        if digest == self.seen {
            return Ok(Reload::Unchanged);
        }
        self.seen = digest;
        let keyring = Keyring::parse(&text).map_err(|error| with_path(error, &self.path))?;
        let ids = keyring.ids().map(str::to_owned).collect();
        self.keyring.replace(keyring);
        Ok(Reload::Replaced(ids))
    }
}

#[cfg(test)]
mod tests;
