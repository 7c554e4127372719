//! The device plugin against the test kubelet and the in-process API server, over real unix
//! sockets: registration, device lists, health, Allocate. Re-registration after a kubelet
//! restart runs on the real cluster (`kubelet_restart_keeps_gpu_pods`).

use crate::device_plugin_common as common;

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use common::{
    Cluster, Container, NODE, RESOURCE, WAIT, allocation, annotated, eventually, marked, marks,
    marks_on, on_gpu, placed, pod_gib, uuid, wait_all_assigned,
};
use gpushare_contract::{GpuInfo, Keys, env};
use gpushare_e2e::apiserver::Verb;
use gpushare_e2e::cluster::published_gpus;
use gpushare_e2e::kubelet::{AdmissionOrder, KubeletDriver};
use gpushare_testkit::fixtures::{PodBuilder, pod};
use k8s_openapi::api::core::v1::Node;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// The node and the GPU inventory the plugin published on it for the extender.
async fn inventory(cluster: &Cluster) -> anyhow::Result<(Node, Vec<GpuInfo>)> {
    let node = cluster.node().await?;
    let gpus = published_gpus(&node).context("no inventory on the node")??;
    Ok((node, gpus))
}

#[tokio::test]
async fn registers_lists_one_device_per_gib_and_follows_health() -> anyhow::Result<()> {
    let mut cluster = Cluster::start(&[16, 16, 24], Some(AdmissionOrder::CreationTime)).await?;
    let kubelet = cluster.kubelet();
    let compute = gpushare_contract::request::compute_resource_of(RESOURCE);
    // Memory and compute register apart, each on its own socket.
    kubelet
        .wait_until(WAIT, "both resources registered", |k| {
            let mut registered = k.registered_resources();
            registered.sort();
            registered == [compute.clone(), RESOURCE.to_owned()]
        })
        .await?;
    let units = kubelet.devices(&compute);
    assert_eq!(units.len(), 300, "100 compute units per GPU");
    let gpu2 = format!("{}-c", uuid(2));
    assert_eq!(
        units.iter().filter(|(id, _)| id.starts_with(&gpu2)).count(),
        100
    );

    let devices = kubelet.devices(RESOURCE);
    assert!(devices.iter().all(|(_, healthy)| *healthy));
    let memory: Vec<String> = devices.into_iter().map(|(id, _)| id).collect();
    assert_eq!(memory.len(), 56);
    assert_eq!((on_gpu(&memory, 0), on_gpu(&memory, 2)), (16, 24));
    assert!(memory.contains(&format!("{}-23", uuid(2))));

    let published = || async { Ok(inventory(&cluster).await.is_ok_and(|(_, g)| g.len() == 3)) };
    eventually(WAIT, "the inventory annotation", published).await?;
    let (node, gpus) = inventory(&cluster).await?;
    let sizes: Vec<u64> = gpus.iter().map(|g| g.mem_gib).collect();
    assert_eq!(sizes, [16, 16, 24]);
    assert_eq!(gpus[1].uuid, uuid(1));
    let labels = node.metadata.labels.unwrap_or_default();
    assert_eq!(labels[&Keys::default().node_gpu_count], "3");

    // GPU 1 breaks: its devices (memory and compute) turn unhealthy for kubelet and on the
    // node; then it recovers.
    for broken in [Some(1), None] {
        cluster.set_unhealthy(&broken.map(|g: u32| g.to_string()).unwrap_or_default())?;
        let sick = |id: &str| broken.is_some_and(|g| id.starts_with(&format!("{}-", uuid(g))));
        kubelet
            .wait_until(WAIT, &format!("only GPU {broken:?} unhealthy"), |k| {
                let (memory, units) = (k.devices(RESOURCE), k.devices(&compute));
                memory.len() == 56 && memory.iter().chain(&units).all(|(id, up)| *up != sick(id))
            })
            .await?;
        eventually(WAIT, "the node's inventory to follow", || async {
            let gpus = inventory(&cluster).await?.1;
            Ok(gpus.iter().all(|g| g.healthy != (Some(g.index) == broken)))
        })
        .await?;
    }

    // Stopping, the plugin marks its GPUs unavailable: until a plugin serves kubelet again,
    // kubelet would refuse the GPU pods the extender sent here.
    cluster.stop_plugin().await?;
    let left = inventory(&cluster).await?.1;
    assert!(
        left.len() == 3 && left.iter().all(|g| !g.healthy),
        "{left:?}"
    );
    cluster.stop().await
}

#[tokio::test]
async fn allocate_pins_containers_to_the_annotated_gpu_without_listing_pods() -> anyhow::Result<()>
{
    let order = Some(AdmissionOrder::CreationTime);
    let cluster = Cluster::start_with(&[16, 16, 24], order, &marks_on()).await?;
    let lists_before = cluster.server.stats().count(Verb::List, "pods");

    placed("a", 2, 4, 1).create(&cluster.client).await?;
    let b = pod("b").init_container("init", 6).gpu_mem(4).on_node(NODE);
    let b_allocation = allocation(1, &[("init", 6, true), ("main", 4, false)], 2);
    annotated(b, b_allocation).create(&cluster.client).await?;
    cluster.wait_admitted(WAIT, &["a", "b"]).await?;

    let gpu2 = uuid(2);
    let expected = [
        (env::NVIDIA_VISIBLE_DEVICES, &*gpu2),
        (env::GPU_INDEX, "2"),
        (env::GPU_UUID, &gpu2),
        (env::CONTAINER_GIB, "4"),
        (env::POD_GIB, "4"),
        (env::GPU_TOTAL_GIB, "24"),
    ];
    let expected = expected.map(|(k, v)| (k.to_owned(), v.to_owned()));
    assert_eq!(cluster.env("a", "main"), BTreeMap::from(expected));
    for (container, gib) in [("init", "6"), ("main", "4")] {
        let env = cluster.env("b", container);
        let names = [
            env::NVIDIA_VISIBLE_DEVICES,
            env::POD_GIB,
            env::CONTAINER_GIB,
        ];
        let got = names.map(|name| env.get(name).cloned().unwrap_or_default());
        assert_eq!(
            got,
            [uuid(1), "6".to_owned(), gib.to_owned()],
            "{container}"
        );
    }
    // The preferred allocation kept kubelet's device IDs on the chosen GPU; b's app container
    // reused its init container's devices: 6 in all, on GPU 1.
    for (pod, gpu, count) in [("a", 2, 4), ("b", 1, 6)] {
        let devices = cluster.devices(pod);
        let held = (devices.len(), on_gpu(&devices, gpu));
        assert_eq!(held, (count, count), "{pod}: {devices:?}");
    }

    // With `--allocation-marks`, the plugin records its progress on the pods.
    for (name, allocated) in [("a", "main"), ("b", "init,main")] {
        let done = || async { Ok(marks(&cluster, name).await? == marked(allocated)) };
        eventually(WAIT, "the assigned mark", done).await?;
    }
    let lists = cluster.server.stats().count(Verb::List, "pods");
    assert_eq!(
        lists, lists_before,
        "Allocate must be answered from the watch cache"
    );
    cluster.stop().await
}

/// Places pods the way the extender does: every pending container of one size sits on the
/// same GPU (sizes linked through multi-container pods share a GPU), and no GPU holds more
/// than its memory.
fn place(pods: &[Vec<Container>], gpus: &[u64]) -> Vec<u32> {
    // Each size's group, named by its smallest size; a pod's containers merge their groups.
    let mut group: BTreeMap<u64, u64> = BTreeMap::new();
    for containers in pods {
        let merged: Vec<u64> = containers
            .iter()
            .map(|c| *group.entry(c.1).or_insert(c.1))
            .collect();
        let root = merged.iter().copied().min().unwrap_or(0);
        for g in group.values_mut().filter(|g| merged.contains(g)) {
            *g = root;
        }
    }
    let group_of = |containers: &[Container]| group[&containers[0].1];
    let mut demand: BTreeMap<u64, u64> = BTreeMap::new();
    for containers in pods {
        *demand.entry(group_of(containers)).or_default() += pod_gib(containers);
    }
    let mut demand: Vec<(u64, u64)> = demand.into_iter().collect();
    demand.sort_by_key(|&(_, gib)| std::cmp::Reverse(gib));
    let mut free = gpus.to_vec();
    let mut gpu_of_group = BTreeMap::new();
    for (root, gib) in demand {
        let gpu = free.iter().position(|&f| f >= gib);
        let gpu = gpu.unwrap_or_else(|| panic!("test data does not fit: a group needs {gib} GiB"));
        free[gpu] -= gib;
        gpu_of_group.insert(root, u32::try_from(gpu).unwrap_or(0));
    }
    pods.iter().map(|c| gpu_of_group[&group_of(c)]).collect()
}

#[tokio::test]
async fn hundred_pods_admitted_in_shuffled_order_land_on_their_gpus() -> anyhow::Result<()> {
    hundred_pods_in_shuffled_order(false).await
}

#[tokio::test]
async fn hundred_pods_in_shuffled_order_with_marks_end_with_every_pod_marked() -> anyhow::Result<()>
{
    hundred_pods_in_shuffled_order(true).await
}

/// 100 pods of seven sizes (twins everywhere) admitted in shuffled order: each container gets
/// its pod's GPU. With `marks`, every pod ends marked assigned, whichever twin each Allocate
/// matched; without, the plugin writes nothing on any pod and matches by kubelet's
/// `startTime` alone.
async fn hundred_pods_in_shuffled_order(marks: bool) -> anyhow::Result<()> {
    let gpus = [80, 80, 80, 80, 80, 80, 48, 40];
    let flags = if marks { marks_on() } else { Vec::new() };
    let cluster = Cluster::start_with(&gpus, Some(AdmissionOrder::Shuffled(7)), &flags).await?;

    let sizes = [(1, 16), (2, 14), (3, 14), (4, 14), (5, 10), (6, 10), (8, 8)];
    let mut pods: Vec<Vec<Container>> = sizes
        .into_iter()
        .flat_map(|(gib, count)| std::iter::repeat_n(vec![("main", gib, false)], count))
        .collect();
    // An init container of 2 GiB, then 1 GiB: links sizes 1 and 2 onto one GPU.
    let linked = vec![("init", 2, true), ("main", 1, false)];
    pods.extend(std::iter::repeat_n(linked, 14));
    assert_eq!(pods.len(), 100);
    let names: Vec<String> = (0..pods.len()).map(|i| format!("p{i:03}")).collect();
    let placement = place(&pods, &gpus);
    let mut rng = StdRng::seed_from_u64(42);
    let mut order: Vec<usize> = (0..pods.len()).collect();
    order.shuffle(&mut rng);
    for i in order {
        let add = |b: PodBuilder, &(name, gib, init): &Container| match init {
            true => b.init_container(name, gib),
            false => b.gpu_mem(gib),
        };
        let builder = pods[i].iter().fold(pod(&names[i]).on_node(NODE), add);
        let second = u32::try_from(rng.random_range(0..3600)).unwrap_or(0);
        annotated(builder, allocation(placement[i], &pods[i], second))
            .create(&cluster.client)
            .await?;
    }
    cluster
        .wait_admitted(Duration::from_secs(60), &names)
        .await?;

    let mut used = vec![0u64; gpus.len()];
    for ((name, containers), gpu) in names.iter().zip(&pods).zip(&placement) {
        for &(container, gib, _) in containers {
            let env = cluster.env(name, container);
            let got = [env::NVIDIA_VISIBLE_DEVICES, env::CONTAINER_GIB].map(|k| env.get(k));
            let want = [Some(&uuid(*gpu)), Some(&gib.to_string())];
            assert_eq!(got, want, "{name}/{container}");
        }
        let env = cluster.env(name, "main");
        let told = env.get(env::GPU_INDEX).and_then(|g| g.parse().ok());
        used[told.unwrap_or(usize::MAX).min(gpus.len() - 1)] += pod_gib(containers);
    }
    for (gpu, (&used, &size)) in used.iter().zip(&gpus).enumerate() {
        assert!(used <= size, "GPU {gpu} holds {used} GiB of {size}");
    }

    if marks {
        wait_all_assigned(&cluster, Duration::from_secs(60), &names).await?;
    } else {
        let patches = cluster.server.stats().count(Verb::Patch, "pods");
        assert_eq!(
            patches, 0,
            "without --allocation-marks the plugin writes no pod"
        );
    }
    cluster.stop().await
}

/// A pod placed on a GPU this node does not have fails admission, naming the GPU. (A pod
/// refused at Allocate fails with `UnexpectedAdmissionError` on the real cluster,
/// `forgeries_without_the_policy_are_refused_at_allocate`; an unplaced pod's reason is
/// checked over gRPC in `device_plugin_plugin_grpc.rs`.)
#[tokio::test]
async fn a_pod_on_an_unknown_gpu_fails_admission_with_a_reason() -> anyhow::Result<()> {
    let cluster = Cluster::start(&[16, 16], Some(AdmissionOrder::CreationTime)).await?;
    let kubelet = cluster.kubelet();
    placed("ghost", 5, 2, 1).create(&cluster.client).await?;
    let rejected = |k: &KubeletDriver| !k.admission_errors().is_empty();
    kubelet.wait_until(WAIT, "ghost rejected", rejected).await?;
    let (pod_key, message) = kubelet.admission_errors()[0].clone();
    assert_eq!(pod_key, "default/ghost");
    let said = ["was placed on GPU 5", "FailedPrecondition"];
    assert!(said.iter().all(|s| message.contains(s)), "{message}");
    cluster.stop().await
}
