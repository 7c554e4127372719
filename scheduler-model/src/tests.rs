//! The model's arithmetic against upstream's, case by case: quantities, a pod's effective
//! requests, the fit scores and the walk's length.

use gpushare_testkit::fixtures::{node, pod};

use crate::requests::*;
use crate::scoring::*;
use crate::{num_feasible_nodes_to_find, num_feasible_nodes_to_find_at};

const GPU: &str = "example.com/gpu-mem";

#[test]
fn quantities_parse_to_milli_units() {
    assert_eq!(parse_quantity("100m"), Some(100));
    assert_eq!(parse_quantity("4"), Some(4000));
    assert_eq!(parse_quantity("0.5"), Some(500));
    assert_eq!(parse_quantity("1.5Gi"), Some(3 * (1 << 29) * 1000));
    assert_eq!(parse_quantity("32Gi"), Some(32 * (1i128 << 30) * 1000));
    assert_eq!(parse_quantity("2k"), Some(2_000_000));
    assert_eq!(parse_quantity("1e3"), Some(1_000_000));
    assert_eq!(
        parse_quantity("1n"),
        Some(1),
        "rounds up like Quantity.MilliValue"
    );
    assert_eq!(parse_quantity(""), None);
    assert_eq!(parse_quantity("lots"), None);
    assert_eq!(parse_quantity("1Xi"), None);
}

#[test]
fn limits_count_as_requests_and_init_containers_take_the_max() {
    // gpu_mem sets a limit only; API defaulting would copy it to requests.
    let p = pod("a")
        .gpu_mem(4)
        .container("side", 2)
        .init_container("init", 5)
        .build();
    assert_eq!(pod_requests(&p, false).get(GPU), Some(&6000));
    let p = pod("b").gpu_mem(4).init_container("init", 7).build();
    assert_eq!(pod_requests(&p, false).get(GPU), Some(&7000));
}

#[test]
fn sidecars_add_to_the_sum() {
    let mut p = pod("a")
        .gpu_mem(4)
        .init_container("sidecar", 2)
        .init_container("init", 5)
        .build();
    if let Some(spec) = p.spec.as_mut() {
        spec.init_containers.as_mut().unwrap()[0].restart_policy = Some("Always".into());
    }
    // app 4 + sidecar 2 = 6; the init step is 5 + sidecar 2 = 7.
    assert_eq!(pod_requests(&p, false).get(GPU), Some(&7000));
}

#[test]
fn non_zero_requests_default_cpu_and_memory() {
    let p = pod("a").build();
    let r = pod_requests(&p, true);
    assert_eq!(r.get(CPU), Some(&DEFAULT_MILLI_CPU_REQUEST));
    assert_eq!(r.get(MEMORY), Some(&(DEFAULT_MEMORY_REQUEST * 1000)));
    assert!(pod_requests(&p, false).is_empty());
}

#[test]
fn interest_follows_managed_resources() {
    let managed = vec![GPU.to_owned()];
    assert!(pod_uses_any(&pod("a").gpu_mem(1).build(), &managed));
    assert!(pod_uses_any(
        &pod("a").init_container("i", 1).build(),
        &managed
    ));
    assert!(!pod_uses_any(&pod("a").cpu("1").build(), &managed));
}

#[test]
fn least_allocated_prefers_the_emptier_node() {
    let n = node("n1").build();
    let p = PodUsage::of(&pod("a").cpu("1").build());
    let mut busy = NodeUsage::default();
    busy.add(&PodUsage::of(&pod("b").cpu("6").build()));
    let alloc = allocatable(&n);
    let fit = FitScoring::default();
    assert!(
        default_score(&fit, &alloc, &NodeUsage::default(), &p)
            > default_score(&fit, &alloc, &busy, &p)
    );
}

fn gpu_mem_most_allocated() -> FitScoring {
    FitScoring {
        strategy: FitStrategy::MostAllocated,
        resources: vec![(GPU.to_owned(), 1)],
    }
}

#[test]
fn most_allocated_on_gpu_memory_prefers_the_fuller_node() {
    // 2 x 16 GiB: 32 units of GPU memory.
    let alloc = allocatable(&node("n1").gpus(&[16, 16]).build());
    let p = PodUsage::of(&pod("a").gpu_mem(4).build());
    let mut busy = NodeUsage::default();
    busy.add(&PodUsage::of(&pod("b").gpu_mem(12).build()));
    let fit = gpu_mem_most_allocated();
    // (0 + 4) * 100 / 32 and (12 + 4) * 100 / 32, integer division as upstream.
    assert_eq!(fit.score(&alloc, &NodeUsage::default(), &p), 12);
    assert_eq!(fit.score(&alloc, &busy, &p), 50);
    // A request beyond capacity scores as full, not as 0 (LeastAllocated's rule).
    let huge = PodUsage::of(&pod("c").gpu_mem(40).build());
    assert_eq!(fit.score(&alloc, &busy, &huge), 100);
    assert!(
        default_score(&fit, &alloc, &busy, &p)
            > default_score(&fit, &alloc, &NodeUsage::default(), &p)
    );
}

#[test]
fn most_allocated_skips_what_the_pod_does_not_request_or_the_node_lacks() {
    let fit = FitScoring {
        strategy: FitStrategy::MostAllocated,
        resources: vec![(GPU.to_owned(), 3), (CPU.to_owned(), 1)],
    };
    let gpu_node = allocatable(&node("n1").gpus(&[16]).cpu("10").build());
    let cpu_node = allocatable(&node("n2").cpu("10").build());
    let cpu_pod = PodUsage::of(&pod("a").cpu("5").build());
    // GPU memory is not requested: only cpu counts, 5 of 10 cores.
    assert_eq!(fit.score(&gpu_node, &NodeUsage::default(), &cpu_pod), 50);
    let gpu_pod = PodUsage::of(&pod("b").gpu_mem(8).cpu("1").build());
    // (50 * 3 + 10 * 1) / 4 on the GPU node; the node without the resource skips it.
    assert_eq!(fit.score(&gpu_node, &NodeUsage::default(), &gpu_pod), 40);
    assert_eq!(fit.score(&cpu_node, &NodeUsage::default(), &gpu_pod), 10);
    let nothing = FitScoring {
        strategy: FitStrategy::MostAllocated,
        resources: vec![(GPU.to_owned(), 1)],
    };
    assert_eq!(nothing.score(&gpu_node, &NodeUsage::default(), &cpu_pod), 0);
}

#[test]
fn feasible_nodes_to_find_is_adaptive_above_100_nodes() {
    assert_eq!(num_feasible_nodes_to_find(5), 5);
    assert_eq!(num_feasible_nodes_to_find(99), 99);
    assert_eq!(num_feasible_nodes_to_find(200), 100);
    assert_eq!(num_feasible_nodes_to_find(1000), 420);
    assert_eq!(num_feasible_nodes_to_find(10_000), 500);
    assert_eq!(num_feasible_nodes_to_find_at(1000, 10), 100);
    assert_eq!(num_feasible_nodes_to_find_at(1000, 1), 100);
    assert_eq!(num_feasible_nodes_to_find_at(5000, 5), 250);
    assert_eq!(num_feasible_nodes_to_find_at(1000, 100), 1000);
    assert_eq!(num_feasible_nodes_to_find_at(50, 1), 50);
}
