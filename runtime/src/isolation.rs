//! The node side of isolation (`--enforcement preload`): putting the interposer
//! (`libgpushare_isolation.so`, see `isolation/`) where containers can mount it, and making
//! each container's accounting directory.
//!
//! Both plugins do this, the device plugin for Allocate's mounts and the DRA plugin for its
//! CDI specs. The library is copied from the plugin's image to a host directory under a
//! versioned name (its size and a hash of its bytes), written beside and renamed into
//! place: a container started earlier keeps the file it mounted, byte for byte, while a
//! plugin upgrade installs its own next to it.
//!
//! Each container's (or DRA claim's) accounting is prepared before it starts
//! ([`prepare_accounting`]): the budget file in its accounting directory
//! (`<host_dir>/containers/<name>/`, mounted read-write), and a limits file naming the
//! budget and the shares at `<host_dir>/limits/<name>`, mounted read-only at
//! [`LIMITS_FILE_IN_CONTAINER`]. The interposer takes its limits from that file, not from
//! the environment any process may change for its children. The accounting directory is
//! root's, mode 0755: a container user cannot delete or replace the budget (the budget
//! itself is 0666, so any user maps it), and the limits file lies outside the read-write
//! mount, so it cannot be rewritten through it.

use std::io;
use std::path::{Path, PathBuf};

use gpushare_contract::env::{
    ComputeMode, ISOLATION_COMPUTE_DIR_IN_CONTAINER, ISOLATION_DIR_IN_CONTAINER, IsolationOptions,
    MAX_CONTEXT_MIB, ManagedMemory,
};
pub use gpushare_isolation_budget::prepared::LIMITS_FILE_IN_CONTAINER;
use gpushare_isolation_budget::{Limits, PreparedCompute, PreparedLimits, budget_path};

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
    /// How the interposer holds a container's compute share (`--enforcement preload`, pods
    /// that ask for `gpu-compute`): `shared` (work-conserving: idle SM time may be used, each
    /// gets at least its share under contention), `capped` (never above the share) or `off`.
    /// `shared` is the interposer's default and is not passed.
    #[arg(
        long,
        env = "GPUSHARE_ISOLATION_COMPUTE",
        default_value = "shared",
        value_parser = parse_compute_mode
    )]
    pub isolation_compute: ComputeMode,
}

/// `--isolation-compute`'s value.
fn parse_compute_mode(text: &str) -> Result<ComputeMode, String> {
    ComputeMode::parse(text).ok_or_else(|| {
        format!("unknown compute mode {text:?}: use \"shared\", \"capped\" or \"off\"")
    })
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
            compute_mode: self.isolation_compute,
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

/// Makes (or keeps) the accounting directory `name` under `<host_dir>/containers/`: root's
/// (the plugin's), mode 0755. The interposer creates nothing there; the budget in it is
/// made by [`prepare_accounting`], writable by every user.
pub fn accounting_dir(host_dir: &Path, name: &str) -> io::Result<PathBuf> {
    check_name(name)?;
    let dir = host_dir.join("containers").join(name);
    std::fs::create_dir_all(&dir)?;
    set_mode(&dir, 0o755)?;
    Ok(dir)
}

/// A container's (or claim's) accounting, prepared: see [`prepare_accounting`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accounting {
    /// The accounting directory on the host, mounted read-write at
    /// [`ISOLATION_DIR_IN_CONTAINER`].
    pub dir: PathBuf,
    /// The budget file in it, on the host.
    pub budget: PathBuf,
    /// The limits file on the host, mounted read-only at [`LIMITS_FILE_IN_CONTAINER`].
    pub limits_file: PathBuf,
}

/// Prepares the accounting of container (or claim) `name` before it starts: its accounting
/// directory ([`accounting_dir`]) with the budget for `shares` (bytes per GPU, in share
/// order; `uuids` the GPUs in the same order) in it, and its limits file at
/// `<host_dir>/limits/<name>` (root's, mode 0444, outside the directory the container may
/// write), with the node's `options`. A budget already there for the same shares is kept (a
/// restarted container keeps what its processes hold).
pub fn prepare_accounting(
    host_dir: &Path,
    name: &str,
    shares: &[u64],
    uuids: &[String],
    options: IsolationOptions,
) -> io::Result<Accounting> {
    prepare_accounting_with_compute(host_dir, name, (shares, uuids), options, 0)
}

/// Where [`compute_dir`] is, without making it.
pub fn compute_dir_path(host_dir: &Path) -> PathBuf {
    host_dir.join("compute")
}

/// The node-wide directory, under `host_dir`, where the interposers of every container with a
/// compute share keep each GPU's compute state; mounted read-write at
/// [`ISOLATION_COMPUTE_DIR_IN_CONTAINER`]. Mode 1777: containers of any user write their
/// own entries there (a shared, cooperative record: it holds programs to their share, not a
/// hostile tenant, who could write into it).
pub fn compute_dir(host_dir: &Path) -> io::Result<PathBuf> {
    let dir = compute_dir_path(host_dir);
    std::fs::create_dir_all(&dir)?;
    set_mode(&dir, 0o1777)?;
    Ok(dir)
}

/// [`prepare_accounting`] for a container given `compute_percent` of each of its GPUs' SM
/// time (0: no compute share): its limits file also says the share, the node's compute mode
/// and where the node-wide compute state is mounted ([`compute_dir`]), which the interposer
/// reads from there and not from the environment.
pub fn prepare_accounting_with_compute(
    host_dir: &Path,
    name: &str,
    (shares, uuids): (&[u64], &[String]),
    options: IsolationOptions,
    compute_percent: u32,
) -> io::Result<Accounting> {
    let dir = accounting_dir(host_dir, name)?;
    let limits_dir = host_dir.join("limits");
    std::fs::create_dir_all(&limits_dir)?;
    set_mode(&limits_dir, 0o755)?;
    let budget = budget_path(&dir, "container", &Limits::new(shares.to_vec()));
    let file_name = budget.file_name().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("no budget file name under {}", dir.display()),
        )
    })?;
    let limits = PreparedLimits {
        budget: Path::new(ISOLATION_DIR_IN_CONTAINER).join(file_name),
        shares: shares.to_vec(),
        uuids: uuids.to_vec(),
        context_mib: options.context_mib,
        managed_memory: Some(options.managed_memory.to_string()),
    };
    let limits_file = limits_dir.join(name);
    let compute = match u8::try_from(compute_percent) {
        Ok(percent) if percent > 0 => {
            compute_dir(host_dir)?;
            PreparedCompute {
                percent: Some(percent),
                mode: Some(options.compute_mode.as_str().to_owned()),
                dir: Some(PathBuf::from(ISOLATION_COMPUTE_DIR_IN_CONTAINER)),
            }
        }
        _ => PreparedCompute::default(),
    };
    gpushare_isolation_budget::prepare_with_compute(&budget, &limits_file, &limits, &compute)?;
    Ok(Accounting {
        dir,
        budget,
        limits_file,
    })
}

/// Removes accounting directory `name` and its limits file; missing ones are fine.
pub fn remove_accounting_dir(host_dir: &Path, name: &str) -> io::Result<()> {
    check_name(name)?;
    let missing_is_fine = |result: io::Result<()>| match result {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    };
    let dir = host_dir.join("containers").join(name);
    release_compute_entries(host_dir, &dir);
    missing_is_fine(std::fs::remove_dir_all(dir))?;
    missing_is_fine(std::fs::remove_file(host_dir.join("limits").join(name)))
}

/// Frees, in every GPU's compute state under `host_dir`, the entries of the containers whose
/// budget files are in accounting directory `dir`, before those files go (see
/// `gpushare_isolation_budget::compute::release`: a later budget file may reuse a freed inode,
/// hence the id). Best effort: a state file that cannot be read is left as it is (its
/// entries go stale and are reclaimed by the interposers in time).
fn release_compute_entries(host_dir: &Path, dir: &Path) {
    use gpushare_isolation_budget::compute;
    let ids: Vec<u64> = gpushare_isolation_budget::budgets_in(dir)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(path, _)| compute::budget_container_id(&path).ok())
        .collect();
    if ids.is_empty() {
        return;
    }
    let Ok(states) = std::fs::read_dir(compute_dir_path(host_dir)) else {
        return;
    };
    for state in states.flatten() {
        if state.file_name().to_string_lossy().starts_with("compute-") {
            let _ = compute::release(&state.path(), &ids);
        }
    }
}

/// What a plugin puts under its host directory, each removed by [`remove_installation`]:
/// the installed interposers, the accounting directories, the limits files and the compute
/// state.
pub const INSTALLED_DIRS: [&str; 4] = ["lib", "containers", "limits", "compute"];

/// Removes everything a plugin put under `host_dir` ([`INSTALLED_DIRS`]), for an uninstall:
/// the directory itself stays (the chart's hostPath volume makes it; an admin may have
/// pointed it somewhere shared). Containers still running keep the files they mounted (a
/// bind mount holds its file, not its name); a plugin installed again prepares new ones.
/// Missing directories are fine; returns how many of them were there.
pub fn remove_installation(host_dir: &Path) -> io::Result<usize> {
    let mut removed = 0;
    for dir in INSTALLED_DIRS {
        match std::fs::remove_dir_all(host_dir.join(dir)) {
            Ok(()) => removed += 1,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("removing {}: {e}", host_dir.join(dir).display()),
                ));
            }
        }
    }
    Ok(removed)
}

/// Whether `name` may name an accounting directory (one path component, not hidden).
fn check_name(name: &str) -> io::Result<()> {
    if name.is_empty() || name.contains('/') || name.starts_with('.') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} cannot name an accounting directory"),
        ));
    }
    Ok(())
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
                compute_mode: Default::default(),
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
        assert!(remove_accounting_dir(dir.path(), "..").is_err());
    }

    #[test]
    fn an_uninstall_removes_what_the_plugin_put_there_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("libgpushare_isolation.so");
        std::fs::write(&source, b"interposer").unwrap();
        let host = dir.path().join("host");
        install_library(&source, &host).unwrap();
        prepare_accounting(
            &host,
            "ns_pod_main_1",
            &[1 << 30],
            &["GPU-a".to_owned()],
            IsolationOptions::default(),
        )
        .unwrap();
        std::fs::write(host.join("an-admins-file"), b"kept").unwrap();
        assert_eq!(remove_installation(&host).unwrap(), 3);
        let left: Vec<_> = std::fs::read_dir(&host)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, ["an-admins-file"]);
        assert_eq!(remove_installation(&host).unwrap(), 0);
    }

    #[test]
    fn a_container_is_prepared_with_its_budget_and_a_read_only_limits_file_outside_it() {
        use gpushare_isolation_budget::{Snapshot, budgets_in};
        use std::os::unix::fs::PermissionsExt as _;
        const GIB: u64 = 1 << 30;
        let dir = tempfile::tempdir().unwrap();
        let uuids = vec!["GPU-a".to_owned(), "GPU-b".to_owned()];
        let options = IsolationOptions {
            context_mib: Some(300),
            managed_memory: ManagedMemory::Ignore,
            compute_mode: Default::default(),
        };
        let made = prepare_accounting(dir.path(), "ns_pod_main_1", &[4 * GIB; 2], &uuids, options)
            .unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(made.dir, dir.path().join("containers/ns_pod_main_1"));
        assert_eq!(
            mode(&made.dir),
            0o755,
            "root's: a container user cannot replace it"
        );
        assert_eq!(mode(&made.budget), 0o666, "any container user maps it");
        assert_eq!(mode(&made.limits_file), 0o444);
        assert!(
            !made.limits_file.starts_with(&made.dir),
            "outside the read-write mount"
        );
        // The device plugin's reader finds the budget where it looks.
        let found = budgets_in(&made.dir).unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].0, made.budget);
        let shares: Vec<u64> = Snapshot::read(&made.budget)
            .unwrap()
            .gpus
            .iter()
            .map(|g| g.share)
            .collect();
        assert_eq!(shares, [4 * GIB; 2]);

        let limits =
            PreparedLimits::parse(&std::fs::read_to_string(&made.limits_file).unwrap()).unwrap();
        let name = made.budget.file_name().unwrap();
        assert_eq!(
            limits.budget,
            Path::new(ISOLATION_DIR_IN_CONTAINER).join(name)
        );
        assert_eq!(limits.shares, [4 * GIB; 2]);
        assert_eq!(limits.uuids, uuids);
        assert_eq!(limits.context_mib, Some(300));
        assert_eq!(limits.managed_memory.as_deref(), Some("ignore"));

        // Prepared again (a restart): the same files. Removed: both go.
        let again = prepare_accounting(dir.path(), "ns_pod_main_1", &[4 * GIB; 2], &uuids, options)
            .unwrap();
        assert_eq!(again, made);
        // The container's entry in a GPU's compute state is freed with it (a later budget
        // file may reuse the inode); another container's stays.
        let id = gpushare_isolation_budget::compute::budget_container_id(&made.budget).unwrap();
        let state_dir = compute_dir(dir.path()).unwrap();
        let state = gpushare_isolation_budget::compute::compute_path(&state_dir, "GPU-a");
        let mut bytes = vec![0u8; gpushare_isolation_budget::compute::FILE_LEN];
        let header = gpushare_isolation_budget::compute::header();
        bytes[..header.len()].copy_from_slice(&header);
        for (i, entry_id) in [id, 99].into_iter().enumerate() {
            let at = header.len() + i * gpushare_isolation_budget::compute::ENTRY_LEN;
            bytes[at..at + 8].copy_from_slice(&entry_id.to_ne_bytes());
        }
        std::fs::write(&state, &bytes).unwrap();
        remove_accounting_dir(dir.path(), "ns_pod_main_1").unwrap();
        assert!(!made.dir.exists());
        assert!(!made.limits_file.exists());
        let left: Vec<u64> = gpushare_isolation_budget::compute::read(&state)
            .unwrap()
            .iter()
            .map(|e| e.id)
            .collect();
        assert_eq!(left, [99]);
    }
}
