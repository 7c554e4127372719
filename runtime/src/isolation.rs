//! The node side of isolation (`--enforcement preload`): putting the interposer
//! (`libgpushare_isolation.so`, see `isolation/`) where containers can mount it, and making
//! each container's accounting directory.
//!
//! Both plugins do this, the device plugin for Allocate's mounts and the DRA plugin for its
//! CDI specs. The library is copied from the plugin's image to a host directory under a
//! versioned name (its size and a hash of its bytes), written beside and renamed into
//! place: a container started earlier keeps the file it mounted, byte for byte, while a
//! plugin upgrade installs its own next to it.

use std::io;
use std::path::{Path, PathBuf};

use gpushare_contract::env::{IsolationOptions, MAX_CONTEXT_MIB, ManagedMemory};

/// The plugins' flags for `--enforcement preload` (flattened into each one's `Config`).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct IsolationArgs {
    /// The interposer in this plugin's image, installed on the host at start
    /// (`--enforcement preload`).
    #[arg(
        long,
        env = "GPUSHARE_ISOLATION_LIBRARY",
        default_value = "/usr/lib/gpushare/libgpushare_isolation.so"
    )]
    pub isolation_library: PathBuf,
    /// The host directory (mounted at the same path) the interposer is installed in and each
    /// container's or claim's accounting directory is made in (`--enforcement preload`).
    #[arg(
        long,
        env = "GPUSHARE_ISOLATION_HOST_DIR",
        default_value = "/var/lib/gpushare/isolation"
    )]
    pub isolation_host_dir: PathBuf,
    /// Namespaces whose containers get no interposer (`--enforcement preload`): an admin's
    /// way out for workloads that must reach the whole GPU.
    #[arg(
        long,
        env = "GPUSHARE_ISOLATION_EXEMPT_NAMESPACES",
        value_delimiter = ','
    )]
    pub isolation_exempt_namespaces: Vec<String>,
    /// MiB the interposer charges each CUDA context, passed to every container as
    /// `GPUSHARE_CONTEXT_MIB` (`--enforcement preload`). Unset: not passed, and the
    /// interposer charges what each context took (measured through NVML; 527-529 MiB on an
    /// H200), or 512 MiB where it cannot tell.
    #[arg(
        long,
        env = "GPUSHARE_ISOLATION_CONTEXT_MIB",
        value_parser = clap::value_parser!(u64).range(..=MAX_CONTEXT_MIB)
    )]
    pub isolation_context_mib: Option<u64>,
    /// What the interposer does with `cuMemAllocManaged` (`--enforcement preload`):
    /// `charge` counts it in full on the current GPU, held to the share; `ignore` lets it
    /// pass uncounted, for programs that oversubscribe on purpose. `ignore` is passed to
    /// every container as `GPUSHARE_MANAGED_MEMORY`; `charge` is the interposer's default
    /// and is not passed.
    #[arg(
        long,
        env = "GPUSHARE_ISOLATION_MANAGED_MEMORY",
        default_value = "charge"
    )]
    pub isolation_managed_memory: ManagedMemory,
}

impl IsolationArgs {
    /// `--isolation-exempt-namespaces`, trimmed, without empty names.
    pub fn exempt_namespaces(&self) -> std::collections::BTreeSet<String> {
        self.isolation_exempt_namespaces
            .iter()
            .map(|ns| ns.trim().to_owned())
            .filter(|ns| !ns.is_empty())
            .collect()
    }

    /// The interposer's settings every container is given
    /// (`--isolation-context-mib`, `--isolation-managed-memory`).
    pub fn options(&self) -> IsolationOptions {
        IsolationOptions {
            context_mib: self.isolation_context_mib,
            managed_memory: self.isolation_managed_memory,
        }
    }

    /// Installs the interposer ([`install_library`]); returns its host path.
    pub fn install(&self) -> io::Result<PathBuf> {
        let library = install_library(&self.isolation_library, &self.isolation_host_dir)?;
        tracing::info!(library = %library.display(), "isolation: GPU containers get this interposer preloaded and are held to their share");
        Ok(library)
    }
}

/// The interposer's file name in the plugin image and, versioned, on the host.
pub const LIBRARY_NAME: &str = "libgpushare_isolation";

/// Copies the library at `source` into `<host_dir>/lib/` under a name of its content
/// (`libgpushare_isolation-<size>-<hash>.so`) and returns that path. An identical file
/// already there is kept as is (containers may have it mounted).
pub fn install_library(source: &Path, host_dir: &Path) -> io::Result<PathBuf> {
    let bytes = std::fs::read(source).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!(
                "reading the isolation library {} (the plugin image ships it; --isolation-library names it): {e}",
                source.display()
            ),
        )
    })?;
    let dir = host_dir.join("lib");
    std::fs::create_dir_all(&dir)?;
    let name = format!("{LIBRARY_NAME}-{}-{:016x}.so", bytes.len(), fnv1a(&bytes));
    let target = dir.join(name);
    if std::fs::read(&target).is_ok_and(|existing| existing == bytes) {
        return Ok(target);
    }
    let partial = dir.join(format!(".{LIBRARY_NAME}-{}.partial", std::process::id()));
    std::fs::write(&partial, &bytes)?;
    set_mode(&partial, 0o755)?;
    std::fs::rename(&partial, &target)?;
    Ok(target)
}

/// Makes (or keeps) the accounting directory `name` under `<host_dir>/containers/`, writable
/// by whatever user the container runs as (only that container mounts it).
pub fn accounting_dir(host_dir: &Path, name: &str) -> io::Result<PathBuf> {
    if name.is_empty() || name.contains('/') || name.starts_with('.') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} cannot name an accounting directory"),
        ));
    }
    let dir = host_dir.join("containers").join(name);
    std::fs::create_dir_all(&dir)?;
    set_mode(&dir, 0o777)?;
    Ok(dir)
}

/// Removes accounting directory `name`; a missing one is fine.
pub fn remove_accounting_dir(host_dir: &Path, name: &str) -> io::Result<()> {
    match std::fs::remove_dir_all(host_dir.join("containers").join(name)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

fn set_mode(path: &Path, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

/// FNV-1a, 64 bits: a name for the library's content (not a security measure: the host
/// directory is the plugin's own).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    #[derive(Debug, clap::Parser)]
    struct Flags {
        #[command(flatten)]
        isolation: IsolationArgs,
    }

    fn options(args: &[&str]) -> Result<IsolationOptions, clap::Error> {
        let argv = std::iter::once("plugin").chain(args.iter().copied());
        Flags::try_parse_from(argv).map(|flags| flags.isolation.options())
    }

    #[test]
    fn the_interposers_settings_default_to_its_own_and_parse_from_flags() {
        assert_eq!(options(&[]).unwrap(), IsolationOptions::default());
        assert_eq!(
            options(&[
                "--isolation-context-mib=640",
                "--isolation-managed-memory=ignore"
            ])
            .unwrap(),
            IsolationOptions {
                context_mib: Some(640),
                managed_memory: ManagedMemory::Ignore,
            }
        );
        assert_eq!(
            options(&["--isolation-context-mib", "0"])
                .unwrap()
                .context_mib,
            Some(0)
        );
        assert_eq!(
            options(&["--isolation-context-mib=1048576"])
                .unwrap()
                .context_mib,
            Some(1 << 20)
        );
    }

    #[test]
    fn settings_the_interposer_would_refuse_are_refused_at_start() {
        for bad in [
            "--isolation-context-mib=1048577",
            "--isolation-context-mib=-1",
            "--isolation-context-mib=half",
            "--isolation-managed-memory=off",
        ] {
            assert!(options(&[bad]).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn the_library_is_installed_under_a_name_of_its_content_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("libgpushare_isolation.so");
        std::fs::write(&source, b"version one").unwrap();
        let host = dir.path().join("host");
        let first = install_library(&source, &host).unwrap();
        assert_eq!(std::fs::read(&first).unwrap(), b"version one");
        assert_eq!(install_library(&source, &host).unwrap(), first);

        // An upgrade installs beside it: a running container's file stays.
        std::fs::write(&source, b"version two").unwrap();
        let second = install_library(&source, &host).unwrap();
        assert_ne!(first, second);
        assert_eq!(std::fs::read(&first).unwrap(), b"version one");
        assert_eq!(std::fs::read(&second).unwrap(), b"version two");
        let leftovers: Vec<_> = std::fs::read_dir(host.join("lib"))
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".partial"))
            .collect();
        assert!(leftovers.is_empty());
    }

    #[test]
    fn a_missing_library_names_the_flag() {
        let dir = tempfile::tempdir().unwrap();
        let error = install_library(&dir.path().join("absent.so"), dir.path()).unwrap_err();
        assert!(error.to_string().contains("--isolation-library"), "{error}");
    }

    #[test]
    fn accounting_dirs_are_made_and_removed_by_name_only() {
        let dir = tempfile::tempdir().unwrap();
        let made = accounting_dir(dir.path(), "default_pod_main_1").unwrap();
        assert!(made.is_dir());
        for bad in ["", "../x", "a/b", ".hidden"] {
            assert!(accounting_dir(dir.path(), bad).is_err(), "{bad}");
        }
        remove_accounting_dir(dir.path(), "default_pod_main_1").unwrap();
        assert!(!made.exists());
        remove_accounting_dir(dir.path(), "default_pod_main_1").unwrap();
    }
}
