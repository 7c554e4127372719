//! Property tests of the fragmentation policy, whatever the workload it learned and whatever
//! sequence of binds, failed binds, deletions, CPU bookings and GPU health changes happens:
//! - no GPU is ever over-committed, and the GPU it picks is healthy and has room;
//! - it refuses exactly where the filter refuses (the policy chooses among fits only);
//! - its scores are a pure function of the cluster: the same on a second call, on a rebuilt
//!   copy, and whatever order kube-scheduler lists the candidates in;
//! - rebuilding from the pods (as after a restart) equals the state the binds booked;
//! - the per-GPU change the decision reads ([`Before::delta`], computed in O(shapes)) equals
//!   the node's fragmentation measured from scratch after the placement, minus before.

use std::collections::BTreeMap;

use gpushare_allocator::fragmentation::{self, Before, Host, NodeFree, Shape, Workload};
use gpushare_allocator::{Cluster, Gpu, PodId, PodPlacement, Policy, Request};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    /// A pod of this shape arrives: the extender learns it, then binds it to `node`.
    Reserve {
        pod: u8,
        node: u8,
        containers: Vec<u64>,
        cores: u64,
    },
    /// The watch shows the bound pod: its CPU and memory are booked on its node.
    Bound {
        pod: u8,
    },
    /// The Binding failed: the reservation is undone.
    Release {
        pod: u8,
    },
    /// The pod was deleted or finished.
    Remove {
        pod: u8,
    },
    /// The device plugin allocated every container.
    MarkAssigned {
        pod: u8,
    },
    /// A CPU-only pod lands on a node, taking CPU and memory the GPUs' pods then lack.
    CpuPod {
        pod: u8,
        node: u8,
        cores: u64,
    },
    SetHealth {
        node: u8,
        gpu: u8,
        healthy: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..16u8, 0..3u8, prop::collection::vec(1..=8u64, 1..3), 0..=12u64).prop_map(
            |(pod, node, containers, cores)| Op::Reserve { pod, node, containers, cores }
        ),
        3 => (0..16u8).prop_map(|pod| Op::Bound { pod }),
        1 => (0..16u8).prop_map(|pod| Op::Release { pod }),
        1 => (0..16u8).prop_map(|pod| Op::Remove { pod }),
        2 => (0..16u8).prop_map(|pod| Op::MarkAssigned { pod }),
        1 => (16..20u8, 0..3u8, 1..=16u64).prop_map(|(pod, node, cores)| Op::CpuPod { pod, node, cores }),
        1 => (0..3u8, 0..3u8, any::<bool>()).prop_map(|(node, gpu, healthy)| Op::SetHealth { node, gpu, healthy }),
    ]
}

fn node_name(node: u8) -> String {
    format!("n{node}")
}

fn host(cores: u64) -> Host {
    Host::new(cores * 1_000, cores * 4_096)
}

/// Three nodes: 2×8 GiB with 16 cores, 16+24 GiB with 24 cores, 3×12 GiB with CPU unknown.
fn initial_nodes() -> BTreeMap<String, (Vec<Gpu>, Option<Host>)> {
    let gpu = |index, total_gib| Gpu {
        index,
        uuid: format!("GPU-{index}"),
        model: String::new(),
        numa: None,
        total_gib,
        healthy: true,
    };
    BTreeMap::from([
        (node_name(0), (vec![gpu(0, 8), gpu(1, 8)], Some(host(16)))),
        (node_name(1), (vec![gpu(0, 16), gpu(1, 24)], Some(host(24)))),
        (
            node_name(2),
            (vec![gpu(0, 12), gpu(1, 12), gpu(2, 12)], None),
        ),
    ])
}

fn cluster_of(nodes: &BTreeMap<String, (Vec<Gpu>, Option<Host>)>) -> Cluster {
    let mut cluster = Cluster::rebuild(
        nodes
            .iter()
            .map(|(name, (gpus, _))| (name.clone(), gpus.clone(), true)),
        [],
    );
    for (name, (_, allocatable)) in nodes {
        cluster.set_node_host(name, *allocatable);
    }
    cluster
}

/// A workload learned from these shapes, in order.
fn workload_strategy() -> impl Strategy<Value = Vec<Shape>> {
    prop::collection::vec(
        (1..=24u64, 0..=16u64).prop_map(|(gpu_gib, cores)| Shape {
            gpu_gib,
            host: host(cores),
        }),
        0..24,
    )
}

/// The model's facts the cluster is checked against.
#[derive(Default)]
struct Model {
    /// Every shape observed, in order.
    observed: Vec<Shape>,
    /// CPU and memory booked per pod: (node, host).
    hosts: BTreeMap<PodId, (String, Host)>,
    /// CPU and memory each GPU pod asks for, booked once the watch shows it bound.
    asks: BTreeMap<PodId, Host>,
}

fn check(
    cluster: &Cluster,
    nodes: &BTreeMap<String, (Vec<Gpu>, Option<Host>)>,
    model: &Model,
) -> Result<(), TestCaseError> {
    for (name, node) in cluster.nodes() {
        for usage in node.gpus() {
            prop_assert!(
                usage.used_gib <= usage.gpu.total_gib,
                "{name} GPU {} over-committed: {} > {}",
                usage.gpu.index,
                usage.used_gib,
                usage.gpu.total_gib
            );
        }
    }
    // Rebuilt from the pods, the CPU bookings and the observed shapes, as a restarted
    // extender would from its watches.
    let pods: Vec<(PodId, String, PodPlacement)> = cluster
        .nodes()
        .flat_map(|(name, node)| {
            node.pods()
                .map(move |(uid, placement)| (uid.clone(), name.to_owned(), placement.clone()))
        })
        .collect();
    let mut rebuilt = Cluster::rebuild(
        nodes
            .iter()
            .map(|(name, (gpus, _))| (name.clone(), gpus.clone(), true)),
        pods.into_iter().rev(),
    );
    for (name, (_, allocatable)) in nodes {
        rebuilt.set_node_host(name, *allocatable);
    }
    for (uid, (node, booked)) in model.hosts.iter().rev() {
        rebuilt.set_pod_host(uid.clone(), node, *booked);
    }
    for shape in &model.observed {
        rebuilt.observe(*shape);
    }
    prop_assert_eq!(&rebuilt, cluster);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn never_over_commits_never_misfits_and_rebuilds_the_same(
        learned in workload_strategy(),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let mut nodes = initial_nodes();
        let mut cluster = cluster_of(&nodes);
        let mut model = Model::default();
        for shape in learned {
            cluster.observe(shape);
            model.observed.push(shape);
        }
        for op in ops {
            match op {
                Op::Reserve { pod, node, containers, cores } => {
                    let request = Request {
                        gpus: 1,
                        exclusive: false,
                        pod_gib: containers.iter().sum(),
                        containers,
                        host: host(cores),
                        ..Request::default()
                    };
                    let shape = Shape { gpu_gib: request.pod_gib, host: request.host };
                    cluster.observe(shape);
                    model.observed.push(shape);
                    let name = node_name(node);
                    let uid = PodId::from(pod.to_string());
                    let already = cluster.pod(&uid).is_some();
                    let fits = cluster.fit(&name, &request);
                    let chosen = cluster.choose_gpu(&name, &request, Policy::Fragmentation);
                    prop_assert_eq!(fits.is_ok(), chosen.is_ok(), "{:?} vs {:?}", fits, chosen);
                    if let Ok(index) = chosen {
                        let usage = cluster
                            .node(&name)
                            .unwrap()
                            .gpus()
                            .iter()
                            .find(|u| u.gpu.index == index)
                            .unwrap();
                        prop_assert!(usage.gpu.healthy, "picked unhealthy GPU {}", index);
                        prop_assert!(
                            usage.free_gib() >= request.pod_gib,
                            "picked GPU {} with {} GiB free for {} GiB",
                            index, usage.free_gib(), request.pod_gib
                        );
                    }
                    let result = cluster.reserve(uid.clone(), &name, &request, Policy::Fragmentation);
                    prop_assert_eq!(fits.is_ok() && !already, result.is_ok(), "{:?} vs {:?}", fits, result);
                    if let (Ok(placed), Ok(index)) = (&result, chosen) {
                        prop_assert_eq!(placed.gpu, index, "bind books the GPU the policy chose");
                    }
                    if result.is_ok() {
                        model.asks.insert(uid, request.host);
                    }
                }
                Op::Bound { pod } => {
                    let uid = PodId::from(pod.to_string());
                    if let (Some((node, _)), Some(ask)) = (cluster.pod(&uid), model.asks.get(&uid)) {
                        let node = node.to_owned();
                        cluster.set_pod_host(uid.clone(), &node, *ask);
                        // Booked even when it asks for nothing: kube-scheduler's scores
                        // count such a pod too.
                        model.hosts.insert(uid, (node, *ask));
                    }
                }
                Op::Release { pod } => {
                    let uid = PodId::from(pod.to_string());
                    // Only a reservation (not yet shown bound) is released.
                    if !model.hosts.contains_key(&uid) {
                        cluster.release(&uid);
                        model.asks.remove(&uid);
                    }
                }
                Op::Remove { pod } => {
                    let uid = PodId::from(pod.to_string());
                    cluster.remove_pod(&uid);
                    cluster.remove_pod_host(&uid);
                    model.hosts.remove(&uid);
                    model.asks.remove(&uid);
                }
                Op::MarkAssigned { pod } => {
                    let uid = PodId::from(pod.to_string());
                    if let Some((node, placement)) = cluster.pod(&uid) {
                        let (node, mut placement) = (node.to_owned(), placement.clone());
                        placement.assigned = true;
                        cluster.upsert_pod(uid, &node, placement);
                    }
                }
                Op::CpuPod { pod, node, cores } => {
                    let uid = PodId::from(pod.to_string());
                    cluster.set_pod_host(uid.clone(), &node_name(node), host(cores));
                    model.hosts.insert(uid, (node_name(node), host(cores)));
                }
                Op::SetHealth { node, gpu, healthy } => {
                    let name = node_name(node);
                    if let Some((gpus, _)) = nodes.get_mut(&name)
                        && let Some(g) = gpus.get_mut(usize::from(gpu))
                    {
                        g.healthy = healthy;
                        cluster.set_node(&name, gpus.clone(), true);
                    }
                }
            }
            check(&cluster, &nodes, &model)?;
        }
    }

    #[test]
    fn scores_are_a_function_of_the_cluster_not_of_the_call(
        learned in workload_strategy(),
        used in prop::collection::vec(0..=24u64, 7),
        cpu_used in prop::collection::vec(0..=24u64, 3),
        gib in 1..=16u64,
        cores in 0..=12u64,
        rotate in 0..3usize,
    ) {
        let nodes = initial_nodes();
        let mut cluster = cluster_of(&nodes);
        for shape in &learned {
            cluster.observe(*shape);
        }
        // Fill the seven GPUs up to `used` (capped at their size), as the watch reports.
        let mut slot = 0;
        for (name, (gpus, _)) in &nodes {
            for gpu in gpus {
                let gib = used[slot].min(gpu.total_gib);
                slot += 1;
                if gib > 0 {
                    cluster.upsert_pod(
                        PodId::from(format!("{name}-{}", gpu.index)),
                        name,
                        PodPlacement {
                            more_gpus: Vec::new(),
                            exclusive: false,
                            gpu: gpu.index,
                            uuid: gpu.uuid.as_str().into(),
                            pod_gib: gib,
                            pending: vec![],
                            assigned: true, compute: 0, },
                    );
                }
            }
        }
        for (i, name) in nodes.keys().enumerate() {
            cluster.set_pod_host(PodId::from(format!("{name}-cpu")), name, host(cpu_used[i]));
        }
        let request = Request { models: Default::default(), gpus: 1, exclusive: false, pod_gib: gib, containers: vec![gib], host: host(cores), compute: 0, };
        let names: Vec<&str> = nodes.keys().map(String::as_str).collect();
        let scores = cluster.scores(&names, &request, Policy::Fragmentation);
        prop_assert_eq!(&cluster.scores(&names, &request, Policy::Fragmentation), &scores);
        let copy = cluster.clone();
        prop_assert_eq!(&copy.scores(&names, &request, Policy::Fragmentation), &scores);
        // The candidates in another order get the same scores, each to its node.
        let mut rotated = names.clone();
        rotated.rotate_left(rotate);
        let mut expected = scores.clone();
        expected.rotate_left(rotate);
        prop_assert_eq!(cluster.scores(&rotated, &request, Policy::Fragmentation), expected);
        // Zero exactly where the filter refuses, and the best fitting node gets the top.
        for (name, score) in names.iter().zip(&scores) {
            prop_assert_eq!(cluster.fit(name, &request).is_ok(), *score > 0, "{}: {}", name, score);
        }
        if scores.iter().any(|s| *s > 0) {
            prop_assert!(scores.contains(&gpushare_allocator::MAX_SCORE));
        }
    }

    #[test]
    fn the_incremental_change_equals_the_measure_from_scratch(
        learned in workload_strategy(),
        free in prop::collection::vec(prop::option::weighted(0.9, 0..=32u64), 1..=8),
        host_cores in 0..=64u64,
        need in 1..=32u64,
        cores in 0..=16u64,
    ) {
        let mut workload = Workload::new();
        for shape in &learned {
            workload.observe(*shape);
        }
        let node_host = host(host_cores);
        let view = |free: Vec<Option<u64>>, host: Host| {
            let gpus = free.len();
            NodeFree { gpus, free: move |i: usize| free[i].map(|free| (free, 32)), host }
        };
        let before_view = view(free.clone(), node_host);
        let before = Before::new(&workload, &before_view);
        for (gpu, slot) in free.iter().enumerate() {
            let Some(gpu_free) = *slot else { continue };
            if gpu_free < need {
                continue;
            }
            let mut after_free = free.clone();
            after_free[gpu] = Some(gpu_free - need);
            let after = Before::new(&workload, &view(after_free, node_host.saturating_sub(host(cores))));
            let from_scratch = after.fragmentation(&workload) - before.fragmentation(&workload);
            let incremental = before.delta(&workload, gpu_free, need, host(cores));
            prop_assert!(
                (from_scratch - incremental).abs() < 1e-6,
                "GPU {}: from scratch {} vs incremental {}", gpu, from_scratch, incremental
            );
        }
        // The GPU best_gpu picks is one where the pod fits, and none is strictly better.
        match fragmentation::best_gpu(&workload, &before_view, need, host(cores)) {
            None => prop_assert!(free.iter().flatten().all(|f| *f < need)),
            Some((gpu, goodness)) => {
                prop_assert!(free[gpu].is_some_and(|f| f >= need));
                for (other, slot) in free.iter().enumerate() {
                    if let Some(f) = *slot && f >= need {
                        let g = before.goodness(&workload, f, need, host(cores));
                        prop_assert!(g <= goodness + 1e-9, "GPU {} ({}) beats the pick {} ({})", other, g, gpu, goodness);
                    }
                }
            }
        }
    }
}
