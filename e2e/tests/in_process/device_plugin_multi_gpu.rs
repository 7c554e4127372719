//! Pods spread over more than one GPU, through the plugin's real sockets: kubelet's device
//! choice is steered to each of the pod's GPUs, Allocate names every GPU (environment and,
//! with `--cdi-devices`, CDI devices), and a broken GPU of the set refuses the pod.

use crate::device_plugin_common as common;

use common::{
    Cluster, NODE, WAIT, allocate_slots, allocation_on, annotated, assigned, client, eventually,
    ids, marks_on, on_gpu, preferred, refused, uuid, wait_all_assigned, wait_for_unhealthy_devices,
};
use gpushare_contract::{Keys, env};
use gpushare_e2e::apiserver::Verb;
use gpushare_e2e::cluster::wait_for;
use gpushare_e2e::kubelet::AdmissionOrder;
use gpushare_e2e::scenarios::events_with_reason;
use gpushare_testkit::fixtures::{PodBuilder, pod};
use tonic::Code;

/// Pod `name` asking for `gib` in all, placed on `gpus` (the first one first), bound
/// `second` seconds into the test's timeline.
fn spread(name: &str, gib: u64, gpus: &[u32], second: u32) -> PodBuilder {
    let mut builder = pod(name).gpu_mem(gib).on_node(NODE);
    if gpus.len() > 1 {
        let request_gpus = Keys::default().request_gpus;
        builder = builder.annotation(&request_gpus, &gpus.len().to_string());
    }
    let allocation = allocation_on(gpus, &[("main", gib, false)], second);
    annotated(builder, allocation)
}

/// `NVIDIA_VISIBLE_DEVICES` of a pod on `gpus`.
fn visible(gpus: &[u32]) -> String {
    gpus.iter().map(|&g| uuid(g)).collect::<Vec<_>>().join(",")
}

#[tokio::test]
async fn a_two_by_eight_pod_gets_both_gpus_and_eight_devices_of_each() -> anyhow::Result<()> {
    let order = Some(AdmissionOrder::CreationTime);
    let cluster = Cluster::start_with(&[16, 16, 24], order, &marks_on()).await?;
    // 16 GiB spread over GPUs 2 and 0, and a shared 4 GiB pod beside it on GPU 0.
    let c = &cluster.client;
    for (name, gib, gpus, second) in [("wide", 16, &[2, 0][..], 1), ("shared", 4, &[0], 2)] {
        spread(name, gib, gpus, second).create(c).await?;
    }
    cluster.wait_admitted(WAIT, &["wide", "shared"]).await?;

    let wide = cluster.env("wide", "main");
    let both = visible(&[2, 0]);
    for (name, value) in [
        (env::NVIDIA_VISIBLE_DEVICES, both.as_str()),
        (env::GPU_UUID, &both),
        (env::GPU_INDEX, "2,0"),
        (env::GPU_COUNT, "2"),
        (env::CONTAINER_GIB, "16"),
        (env::CONTAINER_GIB_PER_GPU, "8"),
        (env::POD_GIB, "16"),
        (env::GPU_TOTAL_GIB, "16"),
    ] {
        assert_eq!(wide.get(name).map(String::as_str), Some(value), "{name}");
    }
    // The preferred allocation split kubelet's 16 devices: 8 of each of the pod's GPUs.
    let devices = cluster.devices("wide");
    assert_eq!(devices.len(), 16);
    for gpu in [2, 0] {
        assert_eq!(on_gpu(&devices, gpu), 8, "GPU {gpu}: {devices:?}");
    }

    // The one-GPU pod beside it sees its GPU alone, with no multi-GPU variables.
    let shared = cluster.env("shared", "main");
    assert_eq!(shared[env::NVIDIA_VISIBLE_DEVICES], uuid(0));
    assert!(!shared.contains_key(env::GPU_COUNT));
    let devices = cluster.devices("shared");
    assert_eq!(on_gpu(&devices, 0), devices.len(), "{devices:?}");

    let wide = || assigned(&cluster, "wide");
    eventually(WAIT, "the wide pod marked assigned", wide).await?;
    cluster.stop().await
}

#[tokio::test]
async fn allocate_names_every_gpu_as_a_cdi_device_when_asked() -> anyhow::Result<()> {
    // Off by default: the environment alone.
    for cdi in [true, false] {
        let flags = ["--cdi-devices".to_owned(), "true".to_owned()];
        let flags = &flags[..if cdi { 2 } else { 0 }];
        let cluster = Cluster::start_with(&[16, 16], None, flags).await?;
        let mut plugin = client(&cluster).await?;
        let c = &cluster.client;
        for (name, gib, gpus, second) in [("wide", 8, &[1, 0][..], 1), ("one", 2, &[1], 2)] {
            spread(name, gib, gpus, second).create(c).await?;
        }
        for (slots, gpus) in [(0..8, &[1, 0][..]), (8..10, &[1])] {
            let container = allocate_slots(&mut plugin, slots).await?;
            let names: Vec<&str> = container.cdi_devices.iter().map(|d| &*d.name).collect();
            let want: Vec<String> = (gpus.iter().filter(|_| cdi))
                .map(|&gpu| format!("nvidia.com/gpu={}", uuid(gpu)))
                .collect();
            assert_eq!(names, want, "cdi {cdi}");
            let visible_devices = &container.envs[env::NVIDIA_VISIBLE_DEVICES];
            assert_eq!(*visible_devices, visible(gpus), "cdi {cdi}");
        }
        cluster.stop().await?;
    }
    Ok(())
}

#[tokio::test]
async fn a_pod_whose_second_gpu_is_unhealthy_is_refused_and_named() -> anyhow::Result<()> {
    let cluster = Cluster::start(&[16, 16], None).await?;
    let mut plugin = client(&cluster).await?;
    cluster.set_unhealthy("1")?;
    wait_for_unhealthy_devices(&mut plugin).await?;
    spread("wide", 8, &[0, 1], 1)
        .create(&cluster.client)
        .await?;
    let gpu = uuid(1);
    let why = format!(
        "pod default/wide was placed on GPU 1 ({gpu}) (one of its GPUs 0,1), which is unhealthy"
    );
    let first = allocate_slots(&mut plugin, 0..8).await;
    refused(first, Code::Unavailable, &[&why]);
    // All or nothing: the pod was not marked, so it still waits and is refused again (not
    // "no pod is waiting").
    let again = allocate_slots(&mut plugin, 0..8).await;
    refused(again, Code::Unavailable, &[]);
    cluster.stop().await
}

#[tokio::test]
async fn preferred_allocation_over_grpc_and_health_events_cover_every_gpu() -> anyhow::Result<()> {
    let cluster = Cluster::start(&[16, 16, 16], None).await?;
    let mut plugin = client(&cluster).await?;
    let c = &cluster.client;
    for (name, gib, gpus, second) in [("wide", 8, &[1, 0][..], 1), ("other", 2, &[2], 2)] {
        spread(name, gib, gpus, second).create(c).await?;
    }

    // kubelet offers GPU 2's devices first; the answer takes 4 of GPU 1 and 4 of GPU 0.
    let chosen = preferred(&mut plugin, ids(&[2, 0, 1], 0..6), 8).await?;
    assert_eq!(chosen, ids(&[1, 0], 0..4));

    // The pod's second GPU turns unhealthy: the pod is told; the pod on GPU 2 is not.
    cluster.set_unhealthy("0")?;
    let told = wait_for("the GpuUnhealthy Event", WAIT, || {
        events_with_reason(&cluster.client, "default", "GpuUnhealthy")
    })
    .await?;
    let about: Vec<&str> = told.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(about, ["wide"]);
    cluster.stop().await
}

/// One pod of the shuffled-admission test: name, total GiB, its GPU set, whether exclusive.
type Placed = (&'static str, u64, &'static [u32], bool);

#[tokio::test]
async fn multi_gpu_whole_gpu_and_shared_pods_under_shuffled_admission() -> anyhow::Result<()> {
    // Four 16 GiB GPUs, filled exactly, the way the extender places them (same-sized pending
    // containers on the same GPU set): three 2 × 4 GiB pods on GPUs 0+1, a whole-GPU pod on
    // GPUs 2+3, two shared 2 GiB pods on GPU 0 and a shared 4 GiB pod on GPU 1.
    const PODS: [Placed; 7] = [
        ("w0", 8, &[0, 1], false),
        ("w1", 8, &[0, 1], false),
        ("w2", 8, &[0, 1], false),
        ("whole", 32, &[2, 3], true),
        ("s0", 2, &[0], false),
        ("s1", 2, &[0], false),
        ("s4", 4, &[1], false),
    ];
    let names = PODS.map(|p| p.0);
    let keys = Keys::default();
    // Seed 11 runs with the marks off (the default): matching then rests on kubelet's
    // `startTime` and the plugin's own memory alone.
    for (seed, marks) in [(3, true), (11, false), (29, true)] {
        let flags = if marks { marks_on() } else { Vec::new() };
        let order = Some(AdmissionOrder::Shuffled(seed));
        let cluster = Cluster::start_with(&[16, 16, 16, 16], order, &flags).await?;
        let mut order: Vec<usize> = (0..PODS.len()).collect();
        order.sort_by_key(|&i| (i as u64 + 1).wrapping_mul(seed).rotate_left(13));
        for (second, &i) in order.iter().enumerate() {
            let (name, gib, gpus, exclusive) = PODS[i];
            let mut builder = spread(name, gib, gpus, u32::try_from(second)?);
            if exclusive {
                builder = builder
                    .annotation(&keys.request_exclusive, "true")
                    .annotation(&keys.exclusive, "true");
            }
            builder.create(&cluster.client).await?;
        }
        cluster
            .wait_admitted(WAIT, &names)
            .await
            .map_err(|e| e.context(format!("seed {seed}")))?;
        for (name, gib, gpus, _) in PODS {
            let env = cluster.env(name, "main");
            let at = format!("seed {seed}: {name}");
            assert_eq!(env[env::NVIDIA_VISIBLE_DEVICES], visible(gpus), "{at}");
            assert_eq!(env[env::CONTAINER_GIB], gib.to_string(), "{at}");
            // kubelet's devices: the container's share of each of its GPUs, nothing else.
            let devices = cluster.devices(name);
            let share = gib / u64::try_from(gpus.len())?;
            for &gpu in gpus {
                let held = u64::try_from(on_gpu(&devices, gpu))?;
                assert_eq!(held, share, "{at} on GPU {gpu}");
            }
            assert_eq!(u64::try_from(devices.len())?, gib, "{at}");
        }
        let whole = cluster.env("whole", "main");
        let gib = (&*whole[env::CONTAINER_GIB_PER_GPU], &*whole[env::POD_GIB]);
        assert_eq!(gib, ("16", "32"), "seed {seed}");

        if marks {
            // Every pod ends up marked assigned, whichever twin the Allocate calls matched.
            wait_all_assigned(&cluster, WAIT, &names).await?;
        } else {
            let patches = cluster.server.stats().count(Verb::Patch, "pods");
            let why = "without --allocation-marks the plugin writes no pod";
            assert_eq!(patches, 0, "seed {seed}: {why}");
        }
        cluster.stop().await?;
    }
    Ok(())
}
