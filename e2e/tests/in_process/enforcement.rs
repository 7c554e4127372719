//! Enforcement modes end to end: the real device plugin, started with `--enforcement`, gives
//! each container what its enforcer reads, through the kubelet driver's real Allocate calls.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::ensure;
use gpushare_contract::env;
use gpushare_e2e::cluster::{ClusterSpec, with_cluster};
use gpushare_e2e::kubelet::GrantedMount;
use gpushare_e2e::scenarios::{check_pinned, create_gpu_pod, wait_running};

/// A one-node cluster (`n1`, one 16 GiB GPU) whose device plugin runs with `args`.
fn spec(args: &[&str]) -> ClusterSpec {
    ClusterSpec::labelled(&[("n1", &[16])]).with_device_plugin_args(args)
}

/// Runs a 4 GiB and a 12 GiB pod on a [`spec`] cluster, and returns each one's environment
/// and mounts.
async fn run_pods(
    args: &[&str],
) -> anyhow::Result<Vec<(BTreeMap<String, String>, Vec<GrantedMount>)>> {
    let mut seen = Vec::new();
    with_cluster(spec(args), async |cluster| {
        for (name, gib) in [("small", 4), ("large", 12)] {
            create_gpu_pod(cluster, name, gib).await?;
            let pod = wait_running(cluster, name).await?;
            check_pinned(cluster, &pod).await?;
            let kubelet = &cluster.nodes["n1"].kubelet;
            let vars = kubelet.container_env("default", name, "main");
            let vars = vars.ok_or_else(|| anyhow::anyhow!("{name} got no environment"))?;
            seen.push((vars, kubelet.container_mounts("default", name, "main")));
        }
        Ok(())
    })
    .await?;
    Ok(seen)
}

/// The variables the toolkit's and MPS's enforcers read.
const ENFORCER_VARS: [&str; 4] = [
    env::NVIDIA_GPU_MEMORY_LIMIT,
    env::NVIDIA_GPU_MEMORY_REQUEST,
    env::CUDA_MPS_PINNED_DEVICE_MEM_LIMIT,
    env::CUDA_MPS_PIPE_DIRECTORY,
];

/// [`ENFORCER_VARS`] as the 4 and the 12 GiB pod see them.
type PerPod = [[Option<&'static str>; 4]; 2];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_enforcement_mode_gives_containers_what_its_enforcer_reads() -> anyhow::Result<()> {
    let pipe = "/run/nvidia-mps";
    let mps = ["--enforcement", "mps", "--mps-pipe-directory", pipe];
    let mps_mounts = vec![(pipe.to_owned(), pipe.to_owned(), false)];
    // Per mode: its flags, what the pods see, their mounts.
    let modes: [(&[&str], PerPod, Vec<GrantedMount>); 3] = [
        // none (the default): the share is told, nothing else.
        (&[], [[None; 4]; 2], vec![]),
        // toolkit: the CDI hook's limit and request, in MiB, per container.
        (
            &["--enforcement", "toolkit"],
            [
                [Some("4096"), Some("4096"), None, None],
                [Some("12288"), Some("12288"), None, None],
            ],
            vec![],
        ),
        // mps: the pinned-memory limit on the container's only GPU, and the daemon's pipes.
        (
            &mps,
            [
                [None, None, Some("0=4G"), Some("/run/nvidia-mps")],
                [None, None, Some("0=12G"), Some("/run/nvidia-mps")],
            ],
            mps_mounts,
        ),
    ];
    for (args, per_pod, want_mounts) in modes {
        for ((vars, mounts), want) in run_pods(args).await?.iter().zip(per_pod) {
            let set = ENFORCER_VARS.map(|name| vars.get(name).map(String::as_str));
            let told = set == want && vars.contains_key(env::CONTAINER_GIB);
            ensure!(told, "{args:?}: {vars:?}");
            ensure!(*mounts == want_mounts, "{args:?}: {mounts:?}");
        }
    }

    // preload: the interposer, installed from the plugin's image into the host directory
    // under a versioned name, mounted read-only and preloaded; each container gets an
    // accounting directory of its own, mounted writable where the interposer looks for it,
    // and a limits file naming its budget, mounted read-only.
    let dir = tempfile::tempdir()?;
    let library = dir.path().join("libgpushare_isolation.so");
    std::fs::write(&library, b"the interposer's bytes")?;
    let host = dir.path().join("host");
    let library_flag = format!("--isolation-library={}", library.display());
    let host_flag = format!("--isolation-host-dir={}", host.display());
    let seen = run_pods(&["--enforcement", "preload", &library_flag, &host_flag]).await?;
    let mut accounting = Vec::new();
    for (vars, mounts) in &seen {
        let var = |name: &str| vars.get(name).map(String::as_str);
        ensure!(
            var(env::LD_PRELOAD) == Some(env::ISOLATION_LIBRARY_IN_CONTAINER)
                && var(env::ISOLATION_DIR) == Some(env::ISOLATION_DIR_IN_CONTAINER)
                && vars.contains_key(env::CONTAINER_GIB),
            "{vars:?}"
        );
        let places: Vec<(&str, bool)> = mounts.iter().map(|m| (m.0.as_str(), m.2)).collect();
        let want = [
            (env::ISOLATION_LIBRARY_IN_CONTAINER, true),
            (env::ISOLATION_DIR_IN_CONTAINER, false),
            (env::ISOLATION_LIMITS_IN_CONTAINER, true),
        ];
        ensure!(places == want, "{mounts:?}");
        let [(_, lib_host, _), (_, dir_host, _), (_, limits_host, _)] = &mounts[..] else {
            anyhow::bail!("three mounts expected: {mounts:?}");
        };
        ensure!(
            lib_host.starts_with(&host.join("lib").display().to_string())
                && std::fs::read(lib_host)? == b"the interposer's bytes",
            "{lib_host}"
        );
        ensure!(Path::new(dir_host).is_dir(), "{dir_host}");
        // Outside the writable directory, and naming a budget the plugin made in it.
        let limits = std::fs::read_to_string(limits_host)?;
        let budget = limits.lines().find_map(|line| line.strip_prefix("budget="));
        let budget = budget.and_then(|path| path.strip_prefix(env::ISOLATION_DIR_IN_CONTAINER));
        let budget =
            budget.ok_or_else(|| anyhow::anyhow!("no budget in the limits file: {limits}"))?;
        ensure!(
            !limits_host.starts_with(dir_host.as_str())
                && Path::new(&format!("{dir_host}{budget}")).is_file(),
            "{limits_host}: {limits}"
        );
        accounting.push(dir_host.clone());
    }
    ensure!(accounting[0] != accounting[1], "{accounting:?}");
    Ok(())
}
