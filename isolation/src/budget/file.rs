//! Making, opening and mapping the budget file, and its whole-file lock.
//!
//! Where the file comes from decides how it is opened:
//!
//! - Made by the plugin, before the container starts (`gpushare_isolation_budget::prepare`,
//!   mode 0666, in a directory the container cannot replace it in), where a limits file
//!   names it: opened as it is ([`Budget::open_prepared`]), never created, and anything but
//!   a finished budget of the limits file's shares is refused (the process then refuses
//!   every allocation, see [`Budget::closed`]).
//! - Made by the container, where the limits come from the environment ([`Budget::open`]):
//!   `open(O_CREAT)`, `flock(LOCK_EX)`, an empty file (or one whose creator died before
//!   writing the magic) gets its size and header, magic last; `flock(LOCK_UN)`. The lock is
//!   only taken at open, never on allocation.
//!
//! [`Budget::exclusive`] takes the same `flock` later, for the container's processes to take
//! turns (a context is measured while no other one is being made).

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Instant;

use gpushare_isolation_budget::Limits;
use gpushare_isolation_budget::layout::{
    ENV_DIR, ENV_KEY, FILE_LEN, HEADER_LEN, Header, MAX_GPUS, SLOTS, VERSION, budget_path,
};

use super::{Budget, Error, Result, SeenAlive};

/// The budget file this process's environment names: `$GPUSHARE_ISOLATION_DIR` (default
/// `$TMPDIR/gpushare-isolation-UID`), key `$GPUSHARE_ISOLATION_KEY` (default `default`).
pub fn path_from_env(limits: &Limits) -> PathBuf {
    let dir = std::env::var_os(ENV_DIR)
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            // SAFETY: getuid has no preconditions and cannot fail.
            let uid = unsafe { libc::getuid() };
            std::env::temp_dir().join(format!("gpushare-isolation-{uid}"))
        });
    let key = std::env::var(ENV_KEY)
        .ok()
        .filter(|k| !k.is_empty())
        .unwrap_or_else(|| "default".into());
    budget_path(&dir, &key, limits)
}

impl Budget {
    /// Opens (creating it if need be) the budget file at `path` for `limits`: limits from
    /// the environment, where the first process of the container makes its budget.
    pub fn open(path: &Path, limits: &Limits) -> Result<Self> {
        let io = |what| Error::io(path, what);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io("creating its directory"))?;
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o666)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(io("opening"))?;
        let want = Self::header_for(path, limits)?;

        // A file already made is only checked: its magic is written last, so a full header
        // is a finished one, and no lock is needed (every process of the container opens
        // it, and none should wait on another to start). Only a file still to be made is
        // made under the lock.
        if !is_made(&file) {
            flock(&file, libc::LOCK_EX).map_err(io("locking"))?;
            let checked = init_or_check(&file, path, &want);
            let unlocked = flock(&file, libc::LOCK_UN).map_err(io("unlocking"));
            checked?;
            unlocked?;
        } else {
            init_or_check(&file, path, &want)?;
        }
        Self::map_file(file, path, limits)
    }

    /// Opens the budget file the plugin prepared at `path` for `limits` (a limits file named
    /// it): never created here, and used only if it is a finished budget of exactly these
    /// shares. Anything else is an error, and the caller refuses every allocation.
    pub fn open_prepared(path: &Path, limits: &Limits) -> Result<Self> {
        let io = |what| Error::io(path, what);
        let mismatch = |reason: String| Error::mismatch(path, reason);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
            .map_err(io("opening the prepared budget"))?;
        let meta = file.metadata().map_err(io("reading its size"))?;
        if !meta.is_file() {
            return Err(mismatch("not a regular file".into()));
        }
        if meta.len() != FILE_LEN as u64 {
            return Err(mismatch(format!(
                "{} bytes, not {FILE_LEN}: not a version-{VERSION} budget",
                meta.len()
            )));
        }
        let want = Self::header_for(path, limits)?;
        check_header(&file, path, &want, "the limits file's")?;
        Self::map_file(file, path, limits)
    }

    /// A budget that refuses every allocation and shows every GPU full: for a process
    /// whose limits are set but cannot be applied (fail closed). `limits`: the shares, if
    /// they are known (queries then answer the share as total and nothing free); `None`:
    /// no GPU has a share, and queries answer the driver's total and nothing free.
    ///
    /// Backed by an anonymous shared mapping (shared with fork children, like a file),
    /// whose totals stand at the shares.
    pub fn closed(limits: Option<&Limits>) -> Result<Self> {
        let path = PathBuf::from("(closed)");
        let shares = limits.map(Limits::shares).unwrap_or(&[]);
        let gpu_count = shares.len().min(MAX_GPUS);
        // SAFETY: a fresh anonymous shared mapping of FILE_LEN bytes (zeroed by the
        // kernel); the kernel picks the address.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                FILE_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(Error::Io {
                path,
                what: "mapping a closed budget",
                source: std::io::Error::last_os_error(),
            });
        }
        let map = NonNull::new(map.cast::<u8>()).ok_or_else(|| Error::Mismatch {
            path: path.clone(),
            reason: "mapped at address 0".into(),
        })?;
        let mut share_array = [0u64; MAX_GPUS];
        share_array[..gpu_count].copy_from_slice(&shares[..gpu_count]);
        let budget = Self {
            map,
            gpu_count,
            shares: share_array,
            seen_alive: (0..SLOTS).map(|_| SeenAlive::default()).collect(),
            epoch: Instant::now(),
            path,
            file: None,
            lock_fd: AtomicI32::new(-1),
            closed: true,
        };
        for (gpu, share) in share_array[..gpu_count].iter().enumerate() {
            budget.total(gpu).store(*share, Ordering::Release);
        }
        Ok(budget)
    }

    /// Whether this budget refuses everything ([`Budget::closed`]).
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// The header a budget for `limits` has.
    fn header_for(path: &Path, limits: &Limits) -> Result<Header> {
        if limits.shares().is_empty() {
            return Err(Error::Mismatch {
                path: path.to_path_buf(),
                reason: "limits name no GPU".into(),
            });
        }
        Ok(Header::of(limits))
    }

    /// Maps `file`, a finished budget for `limits` (checked by the caller).
    fn map_file(file: File, path: &Path, limits: &Limits) -> Result<Self> {
        let gpu_count = limits.shares().len();
        let mut shares = [0u64; MAX_GPUS];
        shares[..gpu_count].copy_from_slice(limits.shares());
        // SAFETY: a fresh shared read-write mapping of FILE_LEN bytes of a file that is that
        // long (checked by the caller); the kernel picks the address.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                FILE_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(Error::Io {
                path: path.to_path_buf(),
                what: "mapping",
                source: std::io::Error::last_os_error(),
            });
        }
        let map = NonNull::new(map.cast::<u8>()).ok_or_else(|| Error::Mismatch {
            path: path.to_path_buf(),
            reason: "mapped at address 0".into(),
        })?;
        Ok(Self {
            map,
            gpu_count,
            shares,
            seen_alive: (0..SLOTS).map(|_| SeenAlive::default()).collect(),
            epoch: Instant::now(),
            path: path.to_path_buf(),
            file: Some(file),
            lock_fd: AtomicI32::new(-1),
            closed: false,
        })
    }

    /// The file's lock, held until the guard goes, so that the container's processes and
    /// threads take turns (a context is measured while no other one is being made). The
    /// lock is taken on a descriptor of its own (threads and fork children share the
    /// budget's), and waited for at most `patience`: `None` when it could not be taken
    /// (its holder may be stuck in the driver), and the caller goes on without its turn.
    pub fn exclusive(&self, patience: std::time::Duration) -> Option<Exclusive> {
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&self.path)
            .ok()?;
        let deadline = Instant::now() + patience;
        loop {
            match flock(&file, libc::LOCK_EX | libc::LOCK_NB) {
                Ok(()) => return Some(Exclusive { _file: file }),
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                Err(_) => return None,
            }
        }
    }
}

/// The budget file's lock, held: see [`Budget::exclusive`]. Closing its descriptor lets
/// it go.
pub struct Exclusive {
    _file: File,
}

fn flock(file: &File, op: libc::c_int) -> std::io::Result<()> {
    loop {
        // SAFETY: flock on a descriptor that `file` keeps open.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Whether the file is a finished budget file: its length, and its magic in place (the
/// header's last write).
fn is_made(file: &File) -> bool {
    let mut magic = [0u8; 8];
    file.metadata().is_ok_and(|m| m.len() == FILE_LEN as u64)
        && file.read_exact_at(&mut magic, 0).is_ok()
        && magic == gpushare_isolation_budget::layout::MAGIC
}

/// Reads the finished header of the budget at `path` and checks it is `want`'s (`whose`
/// names where `want` came from, for the message).
fn check_header(file: &File, path: &Path, want: &Header, whose: &str) -> Result<()> {
    let mut header = vec![0u8; HEADER_LEN];
    file.read_exact_at(&mut header, 0)
        .map_err(Error::io(path, "reading its header"))?;
    let header = Header::parse(&header).map_err(|e| Error::mismatch(path, e.to_string()))?;
    if header.shares != want.shares {
        return Err(Error::mismatch(
            path,
            format!(
                "made for shares {:?}, not {whose} {:?}",
                header.shares, want.shares
            ),
        ));
    }
    Ok(())
}

/// Under the file lock: writes the header of an empty file, or checks an existing one.
fn init_or_check(file: &File, path: &Path, want: &Header) -> Result<()> {
    let io = |what| Error::io(path, what);
    let mismatch = |reason: String| Error::mismatch(path, reason);
    let len = file.metadata().map_err(io("reading its size"))?.len();
    let mut magic = [0u8; 8];
    if len == FILE_LEN as u64 {
        file.read_exact_at(&mut magic, 0)
            .map_err(io("reading its header"))?;
    }
    // Empty, or sized by a creator that died before its magic: (re)write the header.
    if len == 0 || (len == FILE_LEN as u64 && magic == [0; 8]) {
        // Writable by every user of the container whatever the creator's umask: an image
        // whose root entrypoint queries the GPU before it starts the application as another
        // user must not lock that user out of the budget. Best effort: only the owner may.
        let _ = file.set_permissions(std::fs::Permissions::from_mode(0o666));
        file.set_len(FILE_LEN as u64).map_err(io("sizing"))?;
        let header = want.encode();
        file.write_all_at(&header[8..], 8)
            .map_err(io("writing its header"))?;
        file.write_all_at(&header[..8], 0)
            .map_err(io("writing its header"))?;
        return Ok(());
    }
    if len != FILE_LEN as u64 {
        return Err(mismatch(format!(
            "{len} bytes, not {FILE_LEN}: not a version-{VERSION} budget"
        )));
    }
    check_header(file, path, want, "this key's")?;
    Ok(())
}
