//! Pods spread over more than one GPU, through the plugin's real sockets: kubelet's device
//! choice is steered to each of the pod's GPUs, Allocate names every GPU (environment and,
//! with `--cdi-devices`, CDI devices), and a broken GPU of the set refuses the pod.

#[path = "device_plugin/common.rs"]
mod common;

use common::{
    Cluster, NODE, RESOURCE, WAIT, allocate, allocation_on, annotated, assigned, client,
    eventually, gpu_of, ids, marks_on, preferred, uuid,
};
use gpushare_contract::{Keys, env};
use gpushare_e2e::apiserver::Verb;
use gpushare_e2e::kubelet::AdmissionOrder;
use gpushare_testkit::fixtures::{PodBuilder, pod};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams};
use tonic::Code;

/// Pod `name` asking for `gib` in all, placed on `gpus` (the first one first), bound
/// `second` seconds into the test's timeline.
fn spread(name: &str, gib: u64, gpus: &[u32], second: u32) -> PodBuilder {
    let mut builder = pod(name).gpu_mem(gib).on_node(NODE);
    if gpus.len() > 1 {
        let request_gpus = Keys::default().request_gpus;
        builder = builder.annotation(&request_gpus, &gpus.len().to_string());
    }
    annotated(
        builder,
        allocation_on(gpus, &[("main", gib, false)], second),
    )
}

/// Creates the [`spread`] pod.
async fn create(
    cluster: &Cluster,
    name: &str,
    gib: u64,
    gpus: &[u32],
    second: u32,
) -> anyhow::Result<()> {
    spread(name, gib, gpus, second)
        .create(&cluster.client)
        .await?;
    Ok(())
}

#[tokio::test]
async fn a_two_by_eight_pod_gets_both_gpus_and_eight_devices_of_each() -> anyhow::Result<()> {
    let cluster = Cluster::start_with(
        &[16, 16, 24],
        Some(AdmissionOrder::CreationTime),
        &marks_on(),
    )
    .await?;
    let kubelet = cluster.kubelet();
    // 16 GiB spread over GPUs 2 and 0, and a shared 4 GiB pod beside it on GPU 0.
    create(&cluster, "wide", 16, &[2, 0], 1).await?;
    create(&cluster, "shared", 4, &[0], 2).await?;
    kubelet
        .wait_until(WAIT, "both pods admitted", |k| {
            k.container_env("default", "wide", "main").is_some()
                && k.container_env("default", "shared", "main").is_some()
        })
        .await?;
    assert!(
        kubelet.admission_errors().is_empty(),
        "{:?}",
        kubelet.admission_errors()
    );

    let wide = kubelet
        .container_env("default", "wide", "main")
        .unwrap_or_default();
    let both = format!("{},{}", uuid(2), uuid(0));
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
    let devices = &kubelet.pod_devices("default", "wide")[RESOURCE];
    assert_eq!(devices.len(), 16);
    for gpu in [2, 0] {
        assert_eq!(
            devices.iter().filter(|id| gpu_of(id) == uuid(gpu)).count(),
            8,
            "GPU {gpu}: {devices:?}"
        );
    }

    // The one-GPU pod beside it sees its GPU alone, with no multi-GPU variables.
    let shared = kubelet
        .container_env("default", "shared", "main")
        .unwrap_or_default();
    assert_eq!(shared[env::NVIDIA_VISIBLE_DEVICES], uuid(0));
    assert!(!shared.contains_key(env::GPU_COUNT));
    assert!(
        kubelet.pod_devices("default", "shared")[RESOURCE]
            .iter()
            .all(|id| gpu_of(id) == uuid(0))
    );

    eventually(WAIT, "the wide pod marked assigned", || {
        assigned(&cluster, "wide")
    })
    .await?;
    cluster.stop().await
}

#[tokio::test]
async fn allocate_names_every_gpu_as_a_cdi_device_when_asked() -> anyhow::Result<()> {
    let flags = ["--cdi-devices".to_owned(), "true".to_owned()];
    let cluster = Cluster::start_with(&[16, 16], None, &flags).await?;
    let mut plugin = client(&cluster).await?;
    create(&cluster, "wide", 8, &[1, 0], 1).await?;
    create(&cluster, "one", 2, &[1], 2).await?;

    let cdi = |gpus: &[u32]| -> Vec<String> {
        gpus.iter()
            .map(|&gpu| format!("nvidia.com/gpu={}", uuid(gpu)))
            .collect()
    };
    for (devices, gpus) in [(ids(0, 0..8), cdi(&[1, 0])), (ids(0, 8..10), cdi(&[1]))] {
        let response = plugin.allocate(allocate(devices)).await?.into_inner();
        let names: Vec<&str> = response.container_responses[0]
            .cdi_devices
            .iter()
            .map(|device| device.name.as_str())
            .collect();
        assert_eq!(names, gpus);
    }
    cluster.stop().await?;

    // Off by default: the environment alone.
    let cluster = Cluster::start(&[16, 16], None).await?;
    let mut plugin = client(&cluster).await?;
    create(&cluster, "wide", 8, &[1, 0], 1).await?;
    let response = plugin.allocate(allocate(ids(0, 0..8))).await?.into_inner();
    let container = &response.container_responses[0];
    assert!(container.cdi_devices.is_empty());
    assert_eq!(
        container.envs[env::NVIDIA_VISIBLE_DEVICES],
        format!("{},{}", uuid(1), uuid(0))
    );
    cluster.stop().await
}

#[tokio::test]
async fn a_pod_whose_second_gpu_is_unhealthy_is_refused_and_named() -> anyhow::Result<()> {
    let cluster = Cluster::start(&[16, 16], None).await?;
    let mut plugin = client(&cluster).await?;
    cluster.set_unhealthy("1")?;
    common::wait_for_unhealthy_devices(&mut plugin).await?;
    create(&cluster, "wide", 8, &[0, 1], 1).await?;
    let err = plugin.allocate(allocate(ids(0, 0..8))).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert!(
        err.message().contains(&format!(
            "pod default/wide was placed on GPU 1 ({}) (one of its GPUs 0,1), which is unhealthy",
            uuid(1)
        )),
        "{}",
        err.message()
    );
    // All or nothing: the pod was not marked, so it still waits and is refused again (not
    // "no pod is waiting").
    let err = plugin.allocate(allocate(ids(0, 0..8))).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{}", err.message());
    cluster.stop().await
}

#[tokio::test]
async fn preferred_allocation_over_grpc_and_health_events_cover_every_gpu() -> anyhow::Result<()> {
    let cluster = Cluster::start(&[16, 16, 16], None).await?;
    let mut plugin = client(&cluster).await?;
    create(&cluster, "wide", 8, &[1, 0], 1).await?;
    create(&cluster, "other", 2, &[2], 2).await?;

    // kubelet offers GPU 2's devices first; the answer takes 4 of GPU 1 and 4 of GPU 0.
    let available: Vec<String> = [2, 0, 1].into_iter().flat_map(|g| ids(g, 0..6)).collect();
    let chosen = preferred(&mut plugin, available, 8).await?;
    let mut expected = ids(1, 0..4);
    expected.extend(ids(0, 0..4));
    assert_eq!(chosen, expected);

    // The pod's second GPU turns unhealthy: the pod is told; the pod on GPU 2 is not.
    cluster.set_unhealthy("0")?;
    let events: Api<Event> = Api::namespaced(cluster.client.clone(), "default");
    let told = || async {
        anyhow::Ok(
            events
                .list(&ListParams::default())
                .await?
                .into_iter()
                .filter(|e| e.reason.as_deref() == Some("GpuUnhealthy"))
                .filter_map(|e| e.regarding?.name)
                .collect::<Vec<_>>(),
        )
    };
    eventually(WAIT, "the GpuUnhealthy Event", || async {
        Ok(!told().await?.is_empty())
    })
    .await?;
    let about = told().await?;
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
    let keys = Keys::default();
    // Seed 11 runs with the marks off (the default): matching then rests on kubelet's
    // `startTime` and the plugin's own memory alone.
    for (seed, marks) in [(3, true), (11, false), (29, true)] {
        let flags = if marks { marks_on() } else { Vec::new() };
        let cluster = Cluster::start_with(
            &[16, 16, 16, 16],
            Some(AdmissionOrder::Shuffled(seed)),
            &flags,
        )
        .await?;
        let kubelet = cluster.kubelet();
        let mut order: Vec<usize> = (0..PODS.len()).collect();
        order.sort_by_key(|&i| (i as u64 + 1).wrapping_mul(seed).rotate_left(13));
        for (second, &i) in order.iter().enumerate() {
            let (name, gib, gpus, exclusive) = PODS[i];
            let mut builder = spread(name, gib, gpus, u32::try_from(second).unwrap_or(0));
            if exclusive {
                builder = builder
                    .annotation(&keys.request_exclusive, "true")
                    .annotation(&keys.exclusive, "true");
            }
            builder.create(&cluster.client).await?;
        }
        kubelet
            .wait_until(WAIT, "every pod admitted or refused", |k| {
                k.admission_errors().len()
                    + PODS
                        .iter()
                        .filter(|p| k.container_env("default", p.0, "main").is_some())
                        .count()
                    == PODS.len()
            })
            .await?;
        assert!(
            kubelet.admission_errors().is_empty(),
            "seed {seed}: {:?}",
            kubelet.admission_errors()
        );
        for (name, gib, gpus, _) in PODS {
            let env = kubelet
                .container_env("default", name, "main")
                .unwrap_or_default();
            let visible = gpus.iter().map(|&g| uuid(g)).collect::<Vec<_>>().join(",");
            assert_eq!(
                env[env::NVIDIA_VISIBLE_DEVICES],
                visible,
                "seed {seed}: {name}"
            );
            assert_eq!(env[env::CONTAINER_GIB], gib.to_string(), "{name}");
            // kubelet's devices: the container's share of each of its GPUs, nothing else.
            let devices = &kubelet.pod_devices("default", name)[RESOURCE];
            let share = gib / u64::try_from(gpus.len())?;
            for &gpu in gpus {
                let held = devices.iter().filter(|id| gpu_of(id) == uuid(gpu)).count();
                assert_eq!(
                    u64::try_from(held)?,
                    share,
                    "seed {seed}: {name} on GPU {gpu}"
                );
            }
            assert_eq!(u64::try_from(devices.len())?, gib, "seed {seed}: {name}");
        }
        let whole = kubelet
            .container_env("default", "whole", "main")
            .unwrap_or_default();
        assert_eq!(whole[env::CONTAINER_GIB_PER_GPU], "16");
        assert_eq!(whole[env::POD_GIB], "32");

        if !marks {
            assert_eq!(
                cluster.server.stats().count(Verb::Patch, "pods"),
                0,
                "seed {seed}: without --allocation-marks the plugin writes no pod"
            );
            cluster.stop().await?;
            continue;
        }
        // Every pod ends up marked assigned, whichever twin the Allocate calls matched.
        eventually(WAIT, "every pod marked assigned", || async {
            for (name, ..) in PODS {
                if !assigned(&cluster, name).await? {
                    return Ok(false);
                }
            }
            Ok(true)
        })
        .await?;
        cluster.stop().await?;
    }
    Ok(())
}
