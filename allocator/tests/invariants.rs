//! Property tests: whatever sequence of binds, failed binds, deletions and device
//! allocations happens, for one-GPU, multi-GPU and whole-GPU pods alike, under every policy
//! and with or without a GPU model filter, no GPU is over-committed, a multi-GPU pod holds N
//! distinct GPUs, a whole GPU holds one pod, no pod holds a GPU of a model it refuses, a
//! node scores above 0 exactly when the pod fits it, the twin rule holds (pending containers
//! of one size all span the same GPUs), and rebuilding from the placements (as after a
//! restart) gives the same state as following the events.

use std::collections::{BTreeMap, BTreeSet};

use gpushare_allocator::fragmentation::Shape;
use gpushare_allocator::{Cluster, Gpu, ModelFilter, PodId, PodPlacement, Policy, Request};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Reserve {
        pod: u8,
        node: u8,
        containers: Vec<u64>,
        policy: Policy,
        gpus: u32,
        exclusive: bool,
        /// The pod's `gpu-model` annotation, if any.
        models: Option<&'static str>,
        /// Percent of each GPU's compute (0: none).
        compute: u32,
    },
    Release {
        pod: u8,
    },
    Remove {
        pod: u8,
    },
    /// The device plugin allocated the pod's first pending container.
    AllocateOne {
        pod: u8,
    },
    /// The device plugin allocated every container.
    MarkAssigned {
        pod: u8,
    },
    SetHealth {
        node: u8,
        gpu: u8,
        healthy: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (
            (0..16u8, 0..3u8, prop::collection::vec(1..=6u64, 1..3)),
            (prop::sample::select(vec![Policy::Binpack, Policy::Spread, Policy::Fragmentation]), 1..=3u32, prop::bool::weighted(0.15)),
            (
                prop::sample::select(vec![None, Some("A"), Some("!A"), Some("C")]),
                prop::sample::select(vec![0u32, 0, 30, 50, 70]),
            ),
        ).prop_map(
            |((pod, node, containers), (policy, gpus, exclusive), (models, compute))| Op::Reserve {
                pod,
                node,
                // Each container's GiB is a multiple of the GPU count, as the contract demands.
                containers: containers.iter().map(|gib| gib * u64::from(gpus)).collect(),
                policy,
                gpus,
                exclusive,
                models,
                compute,
            }
        ),
        1 => (0..16u8).prop_map(|pod| Op::Release { pod }),
        1 => (0..16u8).prop_map(|pod| Op::Remove { pod }),
        2 => (0..16u8).prop_map(|pod| Op::AllocateOne { pod }),
        1 => (0..16u8).prop_map(|pod| Op::MarkAssigned { pod }),
        1 => (0..3u8, 0..3u8, any::<bool>()).prop_map(|(node, gpu, healthy)| Op::SetHealth { node, gpu, healthy }),
    ]
}

fn node_name(node: u8) -> String {
    format!("n{node}")
}

/// Three nodes: 2×8, 16+24, 3×12 GiB (the last with GPUs 0 and 1 on NUMA node 0, GPU 2 on 1).
/// GPUs of model A and B alternate, from A.
fn initial_nodes() -> BTreeMap<String, Vec<Gpu>> {
    let gpu = |index, total_gib| Gpu {
        index,
        uuid: format!("GPU-{index}"),
        model: if index % 2 == 0 { "A" } else { "B" }.to_owned(),
        numa: (total_gib == 12).then_some(i64::from(index == 2)),
        total_gib,
        healthy: true,
    };
    BTreeMap::from([
        (node_name(0), vec![gpu(0, 8), gpu(1, 8)]),
        (node_name(1), vec![gpu(0, 16), gpu(1, 24)]),
        (node_name(2), vec![gpu(0, 12), gpu(1, 12), gpu(2, 12)]),
    ])
}

/// `cluster` having seen pods of 1 to 6 GiB, so the fragmentation policy measures instead of
/// packing as binpack does before it has seen any.
fn taught(mut cluster: Cluster) -> Cluster {
    for gpu_gib in 1..=6 {
        cluster.observe(Shape {
            gpu_gib,
            host: Default::default(),
        });
    }
    cluster
}

fn check(cluster: &Cluster, nodes: &BTreeMap<String, Vec<Gpu>>) -> Result<(), TestCaseError> {
    for (name, node) in cluster.nodes() {
        for usage in node.gpus() {
            prop_assert!(
                usage.used_gib <= usage.gpu.total_gib,
                "{name} GPU {} over-committed: {} > {}",
                usage.gpu.index,
                usage.used_gib,
                usage.gpu.total_gib
            );
            prop_assert!(
                usage.used_compute <= gpushare_allocator::COMPUTE_PER_GPU,
                "{name} GPU {} compute over-committed: {} %",
                usage.gpu.index,
                usage.used_compute
            );
        }
        let mut gpus_by_size: BTreeMap<u64, BTreeSet<Vec<u32>>> = BTreeMap::new();
        let mut holders: BTreeMap<u32, Vec<bool>> = BTreeMap::new();
        for (uid, placement) in node.pods() {
            let mut gpus: Vec<u32> = std::iter::once(placement.gpu)
                .chain(placement.more_gpus.iter().map(|(index, _)| *index))
                .collect();
            let count = gpus.len();
            gpus.sort_unstable();
            gpus.dedup();
            prop_assert_eq!(gpus.len(), count, "{} {} holds a GPU twice", name, uid);
            for &gpu in &gpus {
                holders.entry(gpu).or_default().push(placement.exclusive);
            }
            for &size in placement.pending_sizes() {
                gpus_by_size.entry(size).or_default().insert(gpus.clone());
            }
        }
        for (gpu, pods) in holders {
            prop_assert!(
                pods.len() == 1 || !pods.contains(&true),
                "{name} GPU {gpu} is held whole by one pod and shared with others: {pods:?}"
            );
        }
        for (size, gpus) in gpus_by_size {
            prop_assert!(
                gpus.len() == 1,
                "{name}: pending {size} GiB containers on GPUs {gpus:?}"
            );
        }
    }
    let pods: Vec<(PodId, String, PodPlacement)> = cluster
        .nodes()
        .flat_map(|(name, node)| {
            node.pods()
                .map(move |(uid, placement)| (uid.clone(), name.to_owned(), placement.clone()))
        })
        .collect();
    let rebuilt = taught(Cluster::rebuild(
        nodes
            .iter()
            .map(|(name, gpus)| (name.clone(), gpus.clone(), true)),
        pods.into_iter().rev(),
    ));
    prop_assert_eq!(&rebuilt, cluster);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn never_over_commits_memory_or_compute_and_keeps_the_twin_rule(ops in prop::collection::vec(op(), 1..80)) {
        let mut nodes = initial_nodes();
        let mut cluster = taught(Cluster::rebuild(
            nodes.iter().map(|(name, gpus)| (name.clone(), gpus.clone(), true)),
            [],
        ));
        for op in ops {
            match op {
                Op::Reserve { pod, node, containers, policy, gpus, exclusive, models, compute } => {
                    let models = ModelFilter::parse(models);
                    let request = Request { gpus, exclusive, pod_gib: containers.iter().sum(), containers, host: Default::default(), models, compute };
                    let name = node_name(node);
                    let fits = cluster.fit(&name, &request);
                    // A node scores above 0 exactly when the pod fits it.
                    let scores = cluster.scores(&[&name, "n0"], &request, policy);
                    prop_assert_eq!(scores[0] > 0, fits.is_ok(), "{:?} vs {:?}", scores, fits);
                    let uid = PodId::from(pod.to_string());
                    let already = cluster.pod(&uid).is_some();
                    let result = cluster.reserve(uid, &name, &request, policy);
                    // fit and reserve agree (unless the pod already holds a place).
                    prop_assert_eq!(fits.is_ok() && !already, result.is_ok(), "{:?} vs {:?}", fits, result);
                    if let Ok(placement) = result {
                        prop_assert_eq!(placement.more_gpus.len() + 1, gpus as usize);
                        prop_assert_eq!(placement.pod_gib * u64::from(gpus), request.pod_gib);
                        let gpus = &nodes[&name];
                        for index in std::iter::once(placement.gpu).chain(placement.more_gpus.iter().map(|(index, _)| *index)) {
                            let model = &gpus[index as usize].model;
                            prop_assert!(request.models.allows(model), "{} got GPU {} of model {}", request.models, index, model);
                        }
                    }
                }
                Op::Release { pod } => {
                    cluster.release(&PodId::from(pod.to_string()));
                }
                Op::Remove { pod } => {
                    cluster.remove_pod(&PodId::from(pod.to_string()));
                }
                Op::AllocateOne { pod } | Op::MarkAssigned { pod } => {
                    let uid = PodId::from(pod.to_string());
                    if let Some((node, placement)) = cluster.pod(&uid) {
                        let (node, mut placement) = (node.to_owned(), placement.clone());
                        if matches!(op, Op::MarkAssigned { .. }) || placement.pending.len() <= 1 {
                            placement.assigned = true;
                        } else {
                            placement.pending.remove(0);
                        }
                        cluster.upsert_pod(uid, &node, placement);
                    }
                }
                Op::SetHealth { node, gpu, healthy } => {
                    let name = node_name(node);
                    if let Some(gpus) = nodes.get_mut(&name)
                        && let Some(g) = gpus.get_mut(usize::from(gpu))
                    {
                        g.healthy = healthy;
                        cluster.set_node(&name, gpus.clone(), true);
                    }
                }
            }
            check(&cluster, &nodes)?;
        }
    }
}
