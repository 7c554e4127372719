//! Criterion benchmarks of the pure allocation core: what the extender does per scheduling
//! cycle (filter and prioritize over every candidate node), per bind (decide + book), per
//! preempt call (the cheapest eviction on each candidate node), and once at start-up (rebuild
//! the view from every pod's annotations).
//!
//! ```sh
//! cargo bench -p gpushare-perf --bench allocator
//! ```

use std::collections::BTreeMap;
use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use gpushare_allocator::fragmentation::Host;
use gpushare_allocator::{Cluster, Evictable, Gpu, PodId, PodPlacement, Policy, Request};
use gpushare_contract::{Keys, PodAllocation};
use gpushare_perf::filled::{
    Fill, GPU_GIB, GPUS_PER_NODE, filled_pods, learn_full_workload, node_names,
};
use gpushare_testkit::workload::{Placed, allocated_pod};

/// One node's 8 GPUs of 32 GiB, `uuid` naming each by index.
fn node_gpus(uuid: impl Fn(u32) -> String, model: &str) -> Vec<Gpu> {
    (0..GPUS_PER_NODE)
        .map(|index| Gpu {
            index,
            uuid: uuid(index),
            model: model.to_owned(),
            numa: None,
            total_gib: GPU_GIB,
            healthy: true,
        })
        .collect()
}

/// `nodes` nodes × 8 GPUs × 32 GiB, each GPU holding `fill`'s pods of 2 GiB.
fn cluster_filled(nodes: usize, fill: Fill) -> (Cluster, Vec<String>) {
    let names = node_names(nodes);
    let node_list = names.iter().map(|name| {
        let gpus = node_gpus(|index| format!("GPU-{name}-{index}"), "bench");
        (name.clone(), gpus, true)
    });
    let cluster = Cluster::rebuild(node_list, filled_pods(&names, fill));
    (cluster, names)
}

/// A pod of 4 GiB on one GPU, 4 cores and 16 GiB.
fn four_gib_request() -> Request {
    Request {
        models: Default::default(),
        gpus: 1,
        exclusive: false,
        pod_gib: 4,
        containers: vec![4],
        host: Host::new(4_000, 16_384),
        compute: 0,
    }
}

/// A group `name` of one bench per cluster size, each timing `f` over every node's name.
fn per_size<R>(c: &mut Criterion, name: &str, f: impl Fn(&Cluster, &[String]) -> R) {
    let mut group = c.benchmark_group(name);
    for nodes in [100, 1_000, 5_000] {
        let (cluster, names) = cluster_filled(nodes, Fill::Uniform);
        group.bench_with_input(BenchmarkId::from_parameter(nodes), &names, |b, names| {
            b.iter(|| f(&cluster, names))
        });
    }
    group.finish();
}

fn filter_and_prioritize(c: &mut Criterion) {
    let request = four_gib_request();
    per_size(c, "filter", |cluster, names| {
        let fits = |name: &&String| cluster.fit(name, black_box(&request)).is_ok();
        names.iter().filter(fits).count()
    });
    per_size(c, "prioritize", |cluster, names| {
        let score = |name: &String| cluster.score(name, black_box(&request), Policy::Binpack);
        names.iter().map(|name| u32::from(score(name))).sum::<u32>()
    });
    // What the extender's prioritize runs: scores relative to all candidates, in one call.
    let mut group = c.benchmark_group("prioritize (relative scores)");
    let rows = [
        (100, Fill::Uniform),
        (1_000, Fill::Uniform),
        (5_000, Fill::Uniform),
        (5_000, Fill::Varied),
    ];
    for (nodes, fill) in rows {
        let (mut cluster, names) = cluster_filled(nodes, fill);
        for name in &names {
            cluster.set_node_host(name, Some(Host::new(128_000, 1 << 20)));
            cluster.set_pod_host(
                PodId::from(format!("{name}-cpu")),
                name,
                Host::new(80_000, 1 << 19),
            );
        }
        learn_full_workload(&mut cluster);
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        for policy in [Policy::Binpack, Policy::Fragmentation] {
            let name = match fill {
                Fill::Uniform => policy.to_string(),
                Fill::Varied => format!("{policy}, varied"),
            };
            group.bench_with_input(BenchmarkId::new(name, nodes), &refs, |b, refs| {
                b.iter(|| cluster.scores(refs, black_box(&request), policy))
            });
        }
        if fill == Fill::Uniform {
            // A 2-GPU pod: scored by the measure on the GPUs bind would take, node by node;
            // a pod naming its GPU model: every node's GPUs checked against it first.
            let two_gpus = Request {
                gpus: 2,
                pod_gib: 8,
                containers: vec![8],
                ..request.clone()
            };
            let named_model = Request {
                models: gpushare_allocator::ModelFilter::parse(["bench"]),
                ..request.clone()
            };
            for (name, request) in [("2 GPUs", two_gpus), ("named model", named_model)] {
                let name = format!("fragmentation, {name}");
                group.bench_with_input(BenchmarkId::new(name, nodes), &refs, |b, refs| {
                    b.iter(|| cluster.scores(refs, black_box(&request), Policy::Fragmentation))
                });
            }
        }
    }
    group.finish();
}

fn bind_decision(c: &mut Criterion) {
    let (mut cluster, names) = cluster_filled(5_000, Fill::Uniform);
    let request = four_gib_request();
    let node = names[2_500].clone();
    let uid = PodId::from("bench-pod");
    c.bench_function("bind decision (reserve + release) at 5000 nodes", |b| {
        b.iter(|| {
            let placement =
                cluster.reserve(uid.clone(), &node, black_box(&request), Policy::Binpack);
            cluster.release(&uid);
            placement.is_ok()
        })
    });
}

fn rebuild_from_annotations(c: &mut Criterion) {
    let keys = Keys::default();
    // 5,000 nodes × 10 pods = 50,000 pods' annotation maps, as the pod watch delivers them:
    // 2 GiB each, bound and allocated.
    let pods: Vec<(String, String, BTreeMap<String, String>)> = (0..50_000u32)
        .map(|p| {
            let (node, uuid) = (format!("node-{:05}", p / 10), format!("GPU-{p}"));
            let gpu = p % GPUS_PER_NODE;
            let placed = Placed {
                node: &node,
                gpu,
                uuid: &uuid,
                gib: 2,
            };
            let pod = allocated_pod("bench", &placed, true, &keys, "2026-11-22T10:00:00Z");
            let annotations = pod.build().metadata.annotations.unwrap_or_default();
            (format!("uid-{p}"), node, annotations)
        })
        .collect();
    let nodes: Vec<(String, Vec<Gpu>, bool)> = (0..5_000)
        .map(|n| {
            (
                format!("node-{n:05}"),
                node_gpus(|_| String::new(), ""),
                true,
            )
        })
        .collect();
    c.bench_function("rebuild view from 50000 pods' annotations", |b| {
        b.iter(|| {
            let placements = pods.iter().filter_map(|(uid, node, annotations)| {
                let allocation = PodAllocation::from_annotations(&keys, annotations).ok()??;
                let pending = allocation.pending_containers().map(|c| c.gib).collect();
                Some((
                    PodId::from(uid.clone()),
                    node.clone(),
                    PodPlacement {
                        gpu: allocation.gpu_index,
                        uuid: allocation.gpu_uuid.as_str().into(),
                        pod_gib: allocation.pod_gib,
                        pending,
                        assigned: allocation.assigned,
                        ..PodPlacement::default()
                    },
                ))
            });
            Cluster::rebuild(nodes.iter().cloned(), placements).pod_count()
        })
    });
}

/// The preempt verb's core: per candidate node, the cheapest eviction that makes room on one
/// GPU (or two), among 80 evictable pods (8 GPUs × 10 pods of 2 GiB, 12 GiB free each); a
/// preempt call decides up to 100 candidate nodes (kube-scheduler's `minCandidateNodesAbsolute`).
fn preemption(c: &mut Criterion) {
    let (cluster, names) = cluster_filled(100, Fill::Uniform);
    let evictable_on = |node: &str| -> Vec<Evictable> {
        let node = cluster.node(node).expect("bench node");
        node.pods()
            .enumerate()
            .map(|(i, (uid, _))| Evictable {
                uid: uid.clone(),
                priority: (i % 3) as i32,
                violates_budget: false,
            })
            .collect()
    };
    let candidates: Vec<(String, Vec<Evictable>)> = names
        .iter()
        .map(|name| (name.clone(), evictable_on(name)))
        .collect();
    let mut group = c.benchmark_group("preempt");
    for (what, gpus) in [("20 GiB on one GPU", 1), ("20 GiB on each of 2 GPUs", 2)] {
        let request = Request {
            gpus,
            pod_gib: 20 * u64::from(gpus),
            containers: vec![20 * u64::from(gpus)],
            host: Host::default(),
            ..four_gib_request()
        };
        group.bench_function(BenchmarkId::new("one node, 80 pods", what), |b| {
            let (node, evictable) = &candidates[0];
            b.iter(|| {
                cluster
                    .eviction(node, black_box(&request), evictable)
                    .is_some()
            })
        });
        group.bench_function(BenchmarkId::new("100 candidate nodes", what), |b| {
            b.iter(|| {
                candidates
                    .iter()
                    .filter(|(node, evictable)| {
                        cluster
                            .eviction(node, black_box(&request), evictable)
                            .is_some()
                    })
                    .count()
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = filter_and_prioritize, bind_decision, rebuild_from_annotations, preemption
}
criterion_main!(benches);
