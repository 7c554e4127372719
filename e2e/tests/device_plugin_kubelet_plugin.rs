//! The device plugin against the test kubelet and the in-process API server, over real unix
//! sockets: registration, device lists, health, Allocate. Re-registration after a kubelet
//! restart runs in `scenarios.rs` (`device_plugin_and_kubelet_restarts_keep_serving`) and on
//! the real cluster (`kubelet_restart_keeps_gpu_pods`).

#[path = "device_plugin/common.rs"]
mod common;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use common::{
    Cluster, NODE, RESOURCE, WAIT, allocation, annotated, eventually, gpu_of, marks, marks_on,
    placed, uuid,
};
use gpushare_contract::{Keys, env, inventory};
use gpushare_e2e::apiserver::Verb;
use gpushare_e2e::kubelet::AdmissionOrder;
use gpushare_testkit::fixtures::pod;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

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
    assert_eq!(
        units
            .iter()
            .filter(|(id, _)| id.starts_with(&format!("{}-c", uuid(2))))
            .count(),
        100
    );

    let devices = kubelet.devices(RESOURCE);
    assert_eq!(devices.len(), 56);
    assert!(devices.iter().all(|(_, healthy)| *healthy));
    let per_gpu = |devices: &[(String, bool)], gpu: u32| {
        devices
            .iter()
            .filter(|(id, _)| gpu_of(id) == uuid(gpu))
            .count()
    };
    assert_eq!(per_gpu(&devices, 0), 16);
    assert_eq!(per_gpu(&devices, 2), 24);
    assert!(
        devices
            .iter()
            .any(|(id, _)| *id == format!("{}-23", uuid(2)))
    );

    // The node carries the inventory for the extender.
    let keys = Keys::default();
    let published = |node: &k8s_openapi::api::core::v1::Node| -> anyhow::Result<Vec<gpushare_contract::GpuInfo>> {
        let annotations = node.metadata.annotations.clone().unwrap_or_default();
        let text = annotations.get(&keys.node_gpus).cloned().unwrap_or_default();
        Ok(inventory::decode(&text)?)
    };
    eventually(WAIT, "the inventory annotation", || async {
        Ok(published(&cluster.node().await?).is_ok_and(|gpus| gpus.len() == 3))
    })
    .await?;
    let node = cluster.node().await?;
    let gpus = published(&node)?;
    assert_eq!(
        gpus.iter().map(|g| g.mem_gib).collect::<Vec<_>>(),
        [16, 16, 24]
    );
    assert_eq!(gpus[1].uuid, uuid(1));
    assert_eq!(
        node.metadata.labels.unwrap_or_default()[&keys.node_gpu_count],
        "3"
    );

    // GPU 1 breaks: its devices (memory and compute) turn unhealthy for kubelet and on the
    // node.
    cluster.set_unhealthy("1")?;
    kubelet
        .wait_until(WAIT, "GPU 1's devices unhealthy", |k| {
            let devices = k.devices(RESOURCE);
            let units = k.devices(&compute);
            devices.len() == 56
                && devices
                    .iter()
                    .all(|(id, healthy)| *healthy == (gpu_of(id) != uuid(1)))
                && units
                    .iter()
                    .all(|(id, healthy)| *healthy != id.starts_with(&format!("{}-c", uuid(1))))
        })
        .await?;
    eventually(WAIT, "GPU 1 unhealthy on the node", || async {
        Ok(published(&cluster.node().await?)?
            .iter()
            .any(|g| g.index == 1 && !g.healthy))
    })
    .await?;

    // And recovers.
    cluster.set_unhealthy("")?;
    kubelet
        .wait_until(WAIT, "every device healthy again", |k| {
            k.devices(RESOURCE).iter().all(|(_, healthy)| *healthy)
        })
        .await?;
    eventually(WAIT, "GPU 1 healthy on the node", || async {
        Ok(published(&cluster.node().await?)?.iter().all(|g| g.healthy))
    })
    .await?;

    // Stopping, the plugin marks its GPUs unavailable: until a plugin serves kubelet again,
    // kubelet would refuse the GPU pods the extender sent here.
    if let Some(plugin) = cluster.plugin.take() {
        plugin.stop().await?;
    }
    let left = published(&cluster.node().await?)?;
    assert_eq!(left.len(), 3);
    assert!(left.iter().all(|g| !g.healthy), "{left:?}");
    cluster.stop().await
}

#[tokio::test]
async fn allocate_pins_containers_to_the_annotated_gpu_without_listing_pods() -> anyhow::Result<()>
{
    let cluster = Cluster::start_with(
        &[16, 16, 24],
        Some(AdmissionOrder::CreationTime),
        &marks_on(),
    )
    .await?;
    let kubelet = cluster.kubelet();
    let lists_before = cluster.server.stats().count(Verb::List, "pods");

    placed("a", 2, 4, 1).create(&cluster.client).await?;
    let b = pod("b").init_container("init", 6).gpu_mem(4).on_node(NODE);
    let b_allocation = allocation(1, &[("init", 6, true), ("main", 4, false)], 2);
    annotated(b, b_allocation).create(&cluster.client).await?;

    kubelet
        .wait_until(WAIT, "both pods admitted", |k| {
            k.container_env("default", "b", "main").is_some()
                && k.container_env("default", "a", "main").is_some()
        })
        .await?;
    assert!(
        kubelet.admission_errors().is_empty(),
        "{:?}",
        kubelet.admission_errors()
    );

    let a_env = kubelet
        .container_env("default", "a", "main")
        .unwrap_or_default();
    let expected = BTreeMap::from([
        (env::NVIDIA_VISIBLE_DEVICES.to_owned(), uuid(2)),
        (env::GPU_INDEX.to_owned(), "2".to_owned()),
        (env::GPU_UUID.to_owned(), uuid(2)),
        (env::CONTAINER_GIB.to_owned(), "4".to_owned()),
        (env::POD_GIB.to_owned(), "4".to_owned()),
        (env::GPU_TOTAL_GIB.to_owned(), "24".to_owned()),
    ]);
    assert_eq!(a_env, expected);
    // The preferred allocation kept kubelet's device IDs on the chosen GPU.
    let a_devices = &kubelet.pod_devices("default", "a")[RESOURCE];
    assert_eq!(a_devices.len(), 4);
    assert!(
        a_devices.iter().all(|id| gpu_of(id) == uuid(2)),
        "{a_devices:?}"
    );

    for container in ["init", "main"] {
        let env = kubelet
            .container_env("default", "b", container)
            .unwrap_or_default();
        assert_eq!(env[env::NVIDIA_VISIBLE_DEVICES], uuid(1), "{container}");
        assert_eq!(env[env::POD_GIB], "6");
    }
    assert_eq!(
        kubelet
            .container_env("default", "b", "init")
            .unwrap_or_default()[env::CONTAINER_GIB],
        "6"
    );
    // The app container reused the init container's devices: 6 in all, on GPU 1.
    let b_devices = &kubelet.pod_devices("default", "b")[RESOURCE];
    assert_eq!(b_devices.len(), 6);
    assert!(
        b_devices.iter().all(|id| gpu_of(id) == uuid(1)),
        "{b_devices:?}"
    );

    // With `--allocation-marks`, the plugin records its progress on the pods.
    for (name, allocated) in [("a", "main"), ("b", "init,main")] {
        eventually(WAIT, "the assigned mark", || async {
            Ok(marks(&cluster, name).await? == (allocated.to_owned(), "true".to_owned()))
        })
        .await?;
    }
    assert_eq!(
        cluster.server.stats().count(Verb::List, "pods"),
        lists_before,
        "Allocate must be answered from the watch cache"
    );
    cluster.stop().await
}

/// A pod's GiB from its `(name, gib, init)` containers: the larger of its app containers'
/// sum and its largest init container.
fn pod_gib(containers: &[(String, u64, bool)]) -> u64 {
    let app: u64 = containers.iter().filter(|c| !c.2).map(|c| c.1).sum();
    let init = containers
        .iter()
        .filter(|c| c.2)
        .map(|c| c.1)
        .max()
        .unwrap_or(0);
    app.max(init)
}

/// Places pods the way the extender does: every pending container of one size sits on the
/// same GPU (sizes linked through multi-container pods share a GPU), and no GPU holds more
/// than its memory.
fn place(pods: &[Vec<(String, u64, bool)>], gpus: &[u64]) -> Vec<u32> {
    // Union-find over sizes.
    let mut parent: HashMap<u64, u64> = HashMap::new();
    fn find(parent: &mut HashMap<u64, u64>, x: u64) -> u64 {
        let p = *parent.entry(x).or_insert(x);
        if p == x {
            x
        } else {
            let root = find(parent, p);
            parent.insert(x, root);
            root
        }
    }
    for containers in pods {
        let first = containers[0].1;
        for c in containers {
            let (a, b) = (find(&mut parent, first), find(&mut parent, c.1));
            parent.insert(a, b);
        }
    }
    let mut demand: BTreeMap<u64, u64> = BTreeMap::new();
    for containers in pods {
        let root = find(&mut parent, containers[0].1);
        *demand.entry(root).or_default() += pod_gib(containers);
    }
    let mut components: Vec<(u64, u64)> = demand.into_iter().collect();
    components.sort_by_key(|&(_, gib)| std::cmp::Reverse(gib));
    let mut free = gpus.to_vec();
    let mut gpu_of_root = HashMap::new();
    for (root, gib) in components {
        let gpu = free
            .iter()
            .position(|&f| f >= gib)
            .unwrap_or_else(|| panic!("test data does not fit: component needs {gib} GiB"));
        free[gpu] -= gib;
        gpu_of_root.insert(root, u32::try_from(gpu).unwrap_or(0));
    }
    pods.iter()
        .map(|containers| gpu_of_root[&find(&mut parent, containers[0].1)])
        .collect()
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
    let kubelet = cluster.kubelet();

    let mut rng = StdRng::seed_from_u64(42);
    let mut pods: Vec<Vec<(String, u64, bool)>> = Vec::new();
    for (gib, count) in [(1, 16), (2, 14), (3, 14), (4, 14), (5, 10), (6, 10), (8, 8)] {
        for _ in 0..count {
            pods.push(vec![("main".to_owned(), gib, false)]);
        }
    }
    for _ in 0..14 {
        // An init container of 2 GiB, then 1 GiB: links sizes 1 and 2 onto one GPU.
        pods.push(vec![
            ("init".to_owned(), 2, true),
            ("main".to_owned(), 1, false),
        ]);
    }
    assert_eq!(pods.len(), 100);
    let placement = place(&pods, &gpus);
    let mut order: Vec<usize> = (0..pods.len()).collect();
    order.shuffle(&mut rng);
    for &i in &order {
        let containers = &pods[i];
        let spec: Vec<(&str, u64, bool)> = containers
            .iter()
            .map(|(n, g, init)| (n.as_str(), *g, *init))
            .collect();
        let mut builder = pod(&format!("p{i:03}")).on_node(NODE);
        for (name, gib, init) in &spec {
            builder = if *init {
                builder.init_container(name, *gib)
            } else {
                builder.gpu_mem(*gib)
            };
        }
        let second = u32::try_from(rng.random_range(0..3600)).unwrap_or(0);
        annotated(builder, allocation(placement[i], &spec, second))
            .create(&cluster.client)
            .await?;
    }

    kubelet
        .wait_until(Duration::from_secs(60), "every pod admitted", |k| {
            k.admission_errors().len()
                + (0..pods.len())
                    .filter(|i| {
                        k.container_env("default", &format!("p{i:03}"), "main")
                            .is_some()
                    })
                    .count()
                == pods.len()
        })
        .await?;
    assert!(
        kubelet.admission_errors().is_empty(),
        "{:?}",
        kubelet.admission_errors()
    );

    let mut used = vec![0u64; gpus.len()];
    for (i, containers) in pods.iter().enumerate() {
        let name = format!("p{i:03}");
        let mut pod_gpu = None;
        for (container, gib, _) in containers {
            let env = kubelet
                .container_env("default", &name, container)
                .unwrap_or_default();
            assert_eq!(
                env.get(env::NVIDIA_VISIBLE_DEVICES),
                Some(&uuid(placement[i])),
                "{name}/{container}"
            );
            assert_eq!(
                env.get(env::CONTAINER_GIB),
                Some(&gib.to_string()),
                "{name}/{container}"
            );
            pod_gpu = env
                .get(env::GPU_INDEX)
                .and_then(|g| g.parse::<usize>().ok());
        }
        used[pod_gpu.unwrap_or(usize::MAX).min(gpus.len() - 1)] += pod_gib(containers);
    }
    for (gpu, (&used, &size)) in used.iter().zip(&gpus).enumerate() {
        assert!(used <= size, "GPU {gpu} holds {used} GiB of {size}");
    }

    if !marks {
        assert_eq!(
            cluster.server.stats().count(Verb::Patch, "pods"),
            0,
            "without --allocation-marks the plugin writes no pod"
        );
        return cluster.stop().await;
    }
    // Every pod ends up marked assigned, whichever twin the Allocate calls matched.
    let keys = Keys::default();
    eventually(
        Duration::from_secs(60),
        "every pod marked assigned",
        || async {
            let list = kube::Api::<k8s_openapi::api::core::v1::Pod>::namespaced(
                cluster.client.clone(),
                "default",
            )
            .list(&Default::default())
            .await?;
            Ok(list.items.iter().all(|p| {
                p.metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(&keys.assigned))
                    .is_some_and(|v| v == "true")
            }))
        },
    )
    .await?;
    cluster.stop().await
}

#[tokio::test]
async fn unhealthy_or_unknown_gpus_fail_admission_with_a_reason() -> anyhow::Result<()> {
    let cluster = Cluster::start(&[16, 16], Some(AdmissionOrder::CreationTime)).await?;
    let kubelet = cluster.kubelet();

    // A pod without the extender's annotations: nothing waits for it.
    pod("stray")
        .gpu_mem(4)
        .on_node(NODE)
        .create(&cluster.client)
        .await?;
    kubelet
        .wait_until(WAIT, "stray rejected", |k| !k.admission_errors().is_empty())
        .await?;
    let (pod_key, message) = kubelet.admission_errors()[0].clone();
    assert_eq!(pod_key, "default/stray");
    assert!(
        message.contains(
            "no pod bound to node n1 is waiting for a 4 GiB example.com/gpu-mem allocation"
        ),
        "{message}"
    );
    eventually(WAIT, "stray Failed", || async {
        let status = cluster.pod("stray").await?.status.unwrap_or_default();
        Ok(status.phase.as_deref() == Some("Failed")
            && status.reason.as_deref() == Some("UnexpectedAdmissionError"))
    })
    .await?;

    // A pod placed on a GPU this node does not have.
    placed("ghost", 5, 2, 1).create(&cluster.client).await?;
    kubelet
        .wait_until(WAIT, "ghost rejected", |k| k.admission_errors().len() == 2)
        .await?;
    let message = &kubelet.admission_errors()[1].1;
    assert!(
        message.contains("was placed on GPU 5") && message.contains("FailedPrecondition"),
        "{message}"
    );
    cluster.stop().await
}
