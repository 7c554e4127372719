//! How a container's share is enforced, as Allocate answers it: the mode for the pod (no
//! interposer in an exempt namespace), the mounts that mode needs (the MPS daemon's pipe
//! directory; for the interposer, the library, a fresh accounting directory and the
//! read-only limits file, prepared before the container starts) and the interposer's shares.

use std::path::PathBuf;

use gpushare_contract::GpuInfo;
use gpushare_contract::env::{self, Enforcement, EnforcerSettings, IsolationOptions};
use gpushare_proto::v1beta1::Mount;

/// The interposer as installed on this node ([`Enforcement::Preload`]).
#[derive(Debug, Clone)]
pub struct Isolation {
    /// The library on the host, under its versioned name.
    pub library: PathBuf,
    /// The host directory holding `containers/<name>`, the accounting directories.
    pub host_dir: PathBuf,
    /// Namespaces whose containers get no interposer.
    pub exempt_namespaces: std::collections::BTreeSet<String>,
    /// The interposer's settings, passed to every container it is loaded into.
    pub options: IsolationOptions,
}

impl Isolation {
    /// Whether containers of `pod` (`namespace/name`) get the interposer.
    pub fn applies_to(&self, pod: &str) -> bool {
        let namespace = pod.split_once('/').map_or(pod, |(ns, _)| ns);
        !self.exempt_namespaces.contains(namespace)
    }

    /// The mounts that load the interposer into a container of `pod` (`namespace/name`),
    /// granted `shares` (bytes per GPU) of the GPUs `uuids` (in the same order), and give it
    /// a fresh accounting directory, named `<namespace>_<pod>_<container>_<n>` (Kubernetes
    /// names hold no `_`; `<n>` tells apart containers of a re-created pod). The accounting
    /// is prepared here, before the container starts: its budget, and the read-only limits
    /// file the interposer takes its limits from
    /// ([`gpushare_runtime::isolation::prepare_accounting`]).
    ///
    /// A container with a compute share (`compute_percent` of each GPU, 0 for none) also gets
    /// the node-wide compute directory, where the interposers of every container on its GPUs
    /// hold one another to their shares, and its limits file says the share
    /// ([`gpushare_runtime::isolation::prepare_accounting_with_compute`]).
    pub fn mounts(
        &self,
        (pod, container): (&str, &str),
        (shares, uuids): (&[u64], &[String]),
        compute_percent: u32,
    ) -> std::io::Result<Vec<Mount>> {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let name = format!("{}_{container}_{stamp:x}", pod.replace('/', "_"));
        let accounting = gpushare_runtime::isolation::prepare_accounting_with_compute(
            &self.host_dir,
            &name,
            (shares, uuids),
            self.options,
            compute_percent,
        )?;
        let dir = accounting.dir;
        let mut mounts = vec![
            Mount {
                container_path: env::ISOLATION_LIBRARY_IN_CONTAINER.to_owned(),
                host_path: self.library.display().to_string(),
                read_only: true,
            },
            Mount {
                container_path: env::ISOLATION_DIR_IN_CONTAINER.to_owned(),
                host_path: dir.display().to_string(),
                read_only: false,
            },
            Mount {
                container_path: env::ISOLATION_LIMITS_IN_CONTAINER.to_owned(),
                host_path: accounting.limits_file.display().to_string(),
                read_only: true,
            },
        ];
        if compute_percent > 0 {
            mounts.push(Mount {
                container_path: env::ISOLATION_COMPUTE_DIR_IN_CONTAINER.to_owned(),
                host_path: gpushare_runtime::isolation::compute_dir(&self.host_dir)?
                    .display()
                    .to_string(),
                read_only: false,
            });
        }
        Ok(mounts)
    }
}

/// A container's shares for the interposer's budget, bytes per GPU, and the GPUs' UUIDs in
/// the same order: what [`container_env`] passes as `GPUSHARE_CONTAINER_MEM_GIB` (one GPU)
/// or `GPUSHARE_CONTAINER_MEM_GIB_PER_GPU` on `GPUSHARE_GPU_COUNT` GPUs.
///
/// [`container_env`]: env::container_env
pub fn isolation_shares(gpus: &[GpuInfo], gib: u64) -> (Vec<u64>, Vec<String>) {
    let count = gpus.len().max(1);
    let per_gpu = gib / u64::try_from(count).unwrap_or(u64::MAX);
    (
        vec![per_gpu.saturating_mul(1 << 30); count],
        gpus.iter().map(|gpu| gpu.uuid.clone()).collect(),
    )
}

/// How the containers of `pod` (`namespace/name`) are enforced on a node running `mode`:
/// that mode, with the MPS pipe directory and the interposer's settings (`isolation`, the
/// installed interposer, present with [`Enforcement::Preload`]), except no interposer in a
/// namespace exempt from it.
pub fn container_enforcement<'a>(
    mode: Enforcement,
    isolation: Option<&Isolation>,
    mps_pipe_directory: &'a str,
    pod: &str,
) -> (Enforcement, EnforcerSettings<'a>) {
    let mode = match (mode, isolation) {
        (Enforcement::Preload, Some(isolation)) if !isolation.applies_to(pod) => Enforcement::None,
        (mode, _) => mode,
    };
    let settings = EnforcerSettings {
        mps_pipe_directory,
        isolation: isolation
            .map(|isolation| isolation.options)
            .unwrap_or_default(),
    };
    (mode, settings)
}

/// What a container needs mounted for `enforcement`: the MPS daemon's pipe directory.
pub fn container_mounts(enforcement: Enforcement, mps_pipe_directory: &str) -> Vec<Mount> {
    match enforcement {
        Enforcement::Mps => vec![Mount {
            container_path: mps_pipe_directory.to_owned(),
            host_path: mps_pipe_directory.to_owned(),
            read_only: false,
        }],
        Enforcement::None | Enforcement::Toolkit | Enforcement::Preload => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use gpushare_contract::ContainerRequest;

    use super::*;
    use crate::service::container_env;
    use crate::service::gpus::tests::gpu;

    #[test]
    fn isolation_skips_exempt_namespaces_and_gives_each_container_its_own_directory() {
        let dir = tempfile::tempdir().unwrap();
        let isolation = Isolation {
            library: dir.path().join("lib.so"),
            host_dir: dir.path().to_owned(),
            exempt_namespaces: ["trusted".to_owned()].into(),
            options: IsolationOptions::default(),
        };
        assert!(isolation.applies_to("default/a"));
        assert!(!isolation.applies_to("trusted/a"));
        let (shares, uuids) = isolation_shares(&[gpu(0, 16, true), gpu(1, 16, true)], 8);
        assert_eq!(shares, [4 << 30, 4 << 30]);
        let first = isolation
            .mounts(("default/a", "main"), (&shares, &uuids), 0)
            .unwrap();
        let second = isolation
            .mounts(("default/a", "main"), (&shares, &uuids), 0)
            .unwrap();
        assert_eq!(
            first.len(),
            3,
            "no compute directory without a compute share"
        );
        assert_eq!(first[0].host_path, second[0].host_path, "one library");
        assert_ne!(first[1].host_path, second[1].host_path, "a directory each");
        assert_ne!(
            first[2].host_path, second[2].host_path,
            "a limits file each"
        );
        assert!(first[0].read_only && !first[1].read_only && first[2].read_only);
        assert!(
            first[1].host_path.contains("/containers/default_a_main_"),
            "{}",
            first[1].host_path
        );
        assert_eq!(first[2].container_path, env::ISOLATION_LIMITS_IN_CONTAINER);
        assert_eq!(
            env::ISOLATION_LIMITS_IN_CONTAINER,
            gpushare_isolation_budget::LIMITS_FILE_IN_CONTAINER
        );
        // Prepared before the container starts: the limits file names the budget as the
        // container sees it, and the budget is there, for these shares.
        let limits = gpushare_isolation_budget::PreparedLimits::parse(
            &std::fs::read_to_string(&first[2].host_path).unwrap(),
        )
        .unwrap();
        assert_eq!(limits.shares, shares);
        assert_eq!(limits.uuids, ["GPU-0", "GPU-1"]);
        let name = limits
            .budget
            .strip_prefix(env::ISOLATION_DIR_IN_CONTAINER)
            .unwrap();
        let snapshot = gpushare_isolation_budget::Snapshot::read(
            &std::path::Path::new(&first[1].host_path).join(name),
        )
        .unwrap();
        assert_eq!(snapshot.gpus.len(), 2);
        assert_eq!(snapshot.gpus[1].share, 4 << 30);
    }

    #[test]
    fn a_container_with_a_compute_share_gets_it_in_its_limits_file_and_the_node_directory() {
        let dir = tempfile::tempdir().unwrap();
        let isolation = Isolation {
            library: dir.path().join("lib.so"),
            host_dir: dir.path().to_owned(),
            exempt_namespaces: Default::default(),
            options: IsolationOptions {
                compute_mode: env::ComputeMode::Capped,
                ..IsolationOptions::default()
            },
        };
        let (shares, uuids) = isolation_shares(&[gpu(0, 16, true)], 4);
        let mounts = isolation
            .mounts(("default/a", "main"), (&shares, &uuids), 30)
            .unwrap();
        let compute = mounts
            .iter()
            .find(|m| m.container_path == env::ISOLATION_COMPUTE_DIR_IN_CONTAINER)
            .expect("the compute directory is mounted");
        assert!(!compute.read_only);
        let other = isolation
            .mounts(("default/b", "main"), (&shares, &uuids), 50)
            .unwrap();
        assert!(
            other.iter().any(|m| m.host_path == compute.host_path),
            "one directory for every container of the node"
        );
        let text = std::fs::read_to_string(&mounts[2].host_path).unwrap();
        let read = gpushare_isolation_budget::PreparedCompute::parse(&text).unwrap();
        assert_eq!(read.percent, Some(30));
        assert_eq!(read.mode.as_deref(), Some("capped"));
        assert_eq!(
            read.dir.as_deref(),
            Some(std::path::Path::new(
                env::ISOLATION_COMPUTE_DIR_IN_CONTAINER
            ))
        );
    }

    #[test]
    fn preload_containers_get_the_interposers_settings_except_where_exempt() {
        let isolation = Isolation {
            library: "/var/lib/gpushare/isolation/lib/lib.so".into(),
            host_dir: "/var/lib/gpushare/isolation".into(),
            exempt_namespaces: ["trusted".to_owned()].into(),
            options: IsolationOptions {
                context_mib: Some(640),
                managed_memory: env::ManagedMemory::Ignore,
                compute_mode: Default::default(),
            },
        };
        let env_of = |pod: &str| {
            let (mode, settings) =
                container_enforcement(Enforcement::Preload, Some(&isolation), "", pod);
            container_env(&[gpu(0, 16, true)], &main(4), 4, (mode, &settings))
        };
        let held = env_of("default/a");
        assert_eq!(held[env::LD_PRELOAD], env::ISOLATION_LIBRARY_IN_CONTAINER);
        assert_eq!(held[env::ISOLATION_CONTEXT_MIB], "640");
        assert_eq!(held[env::ISOLATION_MANAGED_MEMORY], "ignore");
        let exempt = env_of("trusted/a");
        for name in [
            env::LD_PRELOAD,
            env::ISOLATION_CONTEXT_MIB,
            env::ISOLATION_MANAGED_MEMORY,
        ] {
            assert!(!exempt.contains_key(name), "{name} in an exempt namespace");
        }
        // Another mode keeps its own variables and its pipe directory.
        let (mode, settings) = container_enforcement(Enforcement::Mps, None, "/run/mps", "a/b");
        assert_eq!(mode, Enforcement::Mps);
        assert_eq!(settings, EnforcerSettings::mps("/run/mps"));
    }

    fn main(gib: u64) -> ContainerRequest {
        ContainerRequest {
            name: "main".into(),
            gib,
            init: false,
            compute: 0,
        }
    }
}
