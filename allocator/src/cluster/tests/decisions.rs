//! Tests of the per-node decisions as the scheduling path asks them through [`Cluster`]:
//! which GPU or GPUs a request gets under each policy, why a node does not fit (and whether
//! that can change), node scores, the twin rule, NUMA locality and model filters.

use super::*;

#[test]
fn design_doc_example_binpacks_onto_the_gpu_with_8_free() {
    let cluster = design_doc_node();
    assert_eq!(free_gib(&cluster, "n1"), vec![12, 8, 4, 16]);
    assert_eq!(
        cluster.choose_gpu("n1", &request(8), Policy::Binpack),
        Ok(1)
    );
    assert_eq!(cluster.choose_gpu("n1", &request(8), Policy::Spread), Ok(3));
    let mut cluster = cluster;
    let placed = cluster
        .reserve("p".into(), "n1", &request(8), Policy::Binpack)
        .unwrap();
    assert_eq!((placed.gpu, placed.uuid.as_str()), (1, "GPU-1"));
    assert_eq!(cluster.node("n1").unwrap().gpus()[1].free_gib(), 0);
}

#[test]
fn mixed_gpu_sizes_use_each_gpus_own_total() {
    let mut cluster = Cluster::new();
    cluster.set_node("n1", vec![gpu(0, 16), gpu(1, 24)], true);
    assert_eq!(
        cluster.choose_gpu("n1", &request(20), Policy::Binpack),
        Ok(1)
    );
    assert_eq!(
        cluster.choose_gpu("n1", &request(10), Policy::Binpack),
        Ok(0)
    );
    assert_eq!(
        cluster.fit("n1", &request(30)),
        Err(Unfit::TooLarge {
            need: 30,
            largest_total: 24
        })
    );
    assert!(
        cluster
            .fit("n1", &request(30))
            .unwrap_err()
            .is_unresolvable()
    );
    cluster.upsert_pod("a".into(), "n1", running(1, 20));
    let err = cluster.fit("n1", &request(20)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "needs 20 GiB on one GPU; largest free is 16 GiB (GPU 0)"
    );
    assert!(!err.is_unresolvable());
}

#[test]
fn unhealthy_gpus_are_skipped() {
    let mut cluster = Cluster::new();
    let mut sick = gpu(0, 24);
    sick.healthy = false;
    cluster.set_node("n1", vec![sick.clone(), gpu(1, 8)], true);
    assert_eq!(cluster.choose_gpu("n1", &request(4), Policy::Spread), Ok(1));
    assert!(matches!(
        cluster.fit("n1", &request(16)),
        Err(Unfit::TooLarge {
            largest_total: 8,
            ..
        })
    ));
    cluster.set_node("n1", vec![sick], true);
    assert_eq!(
        cluster.fit("n1", &request(1)),
        Err(Unfit::AllUnhealthy { count: 1 })
    );
}

#[test]
fn unknown_unlabelled_and_empty_nodes_are_unresolvable() {
    let mut cluster = Cluster::new();
    assert_eq!(cluster.fit("ghost", &request(1)), Err(Unfit::UnknownNode));
    cluster.set_node("plain", vec![gpu(0, 16)], false);
    assert_eq!(cluster.fit("plain", &request(1)), Err(Unfit::NotEligible));
    // Capacity fallback is the caller's: a node with no inventory and no capacity has no GPUs.
    cluster.set_node("bare", vec![], true);
    assert_eq!(cluster.fit("bare", &request(1)), Err(Unfit::NoGpus));
    for node in ["ghost", "plain", "bare"] {
        assert!(
            cluster
                .fit(node, &request(1))
                .unwrap_err()
                .is_unresolvable()
        );
        assert_eq!(cluster.score(node, &request(1), Policy::Binpack), 0);
    }
}

#[test]
fn twin_rule_pins_equal_sizes_to_one_gpu() {
    let mut cluster = Cluster::new();
    cluster.set_node("n1", vec![gpu(0, 16), gpu(1, 16)], true);
    cluster
        .reserve("a".into(), "n1", &request(4), Policy::Spread)
        .unwrap();
    // Spread would pick the empty GPU 1, but a 4 GiB container waits on GPU 0.
    assert_eq!(cluster.choose_gpu("n1", &request(4), Policy::Spread), Ok(0));
    // A 6 GiB pod has no twin: spread is free to choose.
    assert_eq!(cluster.choose_gpu("n1", &request(6), Policy::Spread), Ok(1));
    // Fill GPU 0: the next 4 GiB pod must wait for "a" to start.
    cluster
        .reserve("b".into(), "n1", &request(12), Policy::Binpack)
        .unwrap();
    let err = cluster.fit("n1", &request(4)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "a 4 GiB container is still waiting for device allocation on GPU 0, which has no room (pod needs 4 GiB, 0 GiB free); retry once it starts"
    );
    assert!(!err.is_unresolvable());
    assert!(err.awaits_admission());
    assert!(
        !cluster
            .fit("n1", &request(17))
            .unwrap_err()
            .awaits_admission()
    );
    // Once "a" is allocated the pin goes away.
    cluster.upsert_pod("a".into(), "n1", running(0, 4));
    assert_eq!(
        cluster.choose_gpu("n1", &request(4), Policy::Binpack),
        Ok(1)
    );
}

#[test]
fn twin_pins_on_two_gpus_conflict() {
    let mut cluster = Cluster::new();
    cluster.set_node("n1", vec![gpu(0, 16), gpu(1, 16)], true);
    let pending = |gpu, gib| PodPlacement {
        assigned: false,
        ..running(gpu, gib)
    };
    cluster.upsert_pod("a".into(), "n1", pending(0, 2));
    cluster.upsert_pod("c".into(), "n1", pending(1, 3));
    let both = Request {
        models: Default::default(),
        gpus: 1,
        exclusive: false,
        pod_gib: 5,
        containers: vec![2, 3],
        host: Host::default(),
        compute: 0,
    };
    assert!(matches!(
        cluster.fit("n1", &both),
        Err(Unfit::TwinConflict { .. })
    ));
}

#[test]
fn the_twin_rule_keys_on_the_gpu_set() {
    let mut cluster = two_by_two();
    // A pending 2 × 4 GiB pod: its container asks kubelet for 8 devices.
    cluster
        .reserve("two".into(), "a", &multi(2, 4, false), Policy::Binpack)
        .unwrap();
    // A one-GPU 8 GiB container would look the same to the device plugin.
    let err = cluster.fit("a", &request(8)).unwrap_err();
    assert!(
        matches!(
            err,
            Unfit::TwinShape {
                size: 8,
                wanted: 1,
                ..
            }
        ),
        "{err}"
    );
    // Another 2 × 4 GiB pod is pinned to the same two GPUs.
    let twin = cluster
        .reserve("twin".into(), "a", &multi(2, 4, false), Policy::Spread)
        .unwrap();
    assert_eq!((twin.gpu, twin.more_gpus[0].0), (0, 1));
    // Once allocated, the one-GPU pod fits again.
    for uid in ["two", "twin"] {
        let (_, placement) = cluster.pod(&uid.into()).unwrap();
        let placement = PodPlacement {
            assigned: true,
            ..placement.clone()
        };
        cluster.upsert_pod(uid.into(), "a", placement);
    }
    assert!(cluster.fit("a", &request(8)).is_ok());
}

#[test]
fn scores_prefer_fuller_nodes_under_binpack() {
    let mut cluster = Cluster::new();
    cluster.set_node("empty", vec![gpu(0, 16)], true);
    cluster.set_node("half", vec![gpu(0, 16)], true);
    cluster.upsert_pod("a".into(), "half", running(0, 8));
    let req = request(4);
    let (empty, half) = (
        cluster.score("empty", &req, Policy::Binpack),
        cluster.score("half", &req, Policy::Binpack),
    );
    assert!(half > empty, "{half} > {empty}");
    let (empty, half) = (
        cluster.score("empty", &req, Policy::Spread),
        cluster.score("half", &req, Policy::Spread),
    );
    assert!(empty > half, "{empty} > {half}");
    cluster.upsert_pod("b".into(), "half", running(0, 4));
    assert_eq!(cluster.score("half", &req, Policy::Binpack), 10);
}

#[test]
fn relative_scores_keep_packing_decisive_on_nearly_empty_nodes() {
    let mut cluster = Cluster::new();
    for name in ["a", "b", "c", "full"] {
        cluster.set_node(
            name,
            vec![gpu(0, 16), gpu(1, 16), gpu(2, 16), gpu(3, 16)],
            true,
        );
    }
    cluster.upsert_pod("p1".into(), "a", running(0, 3));
    cluster.upsert_pod("p2".into(), "b", running(0, 2));
    for index in 0..4 {
        cluster.upsert_pod(format!("f{index}").into(), "full", running(index, 16));
    }
    let req = request(1);
    // Absolute scores cannot tell a (3 GiB used of 64) from b (2 GiB used).
    assert_eq!(
        cluster.score("a", &req, Policy::Binpack),
        cluster.score("b", &req, Policy::Binpack)
    );
    let scores = cluster.scores(&["a", "b", "c", "full"], &req, Policy::Binpack);
    assert_eq!(scores[0], 10, "the fullest node that fits wins: {scores:?}");
    assert!(scores[1] > scores[2] && scores[2] >= 1, "{scores:?}");
    assert_eq!(scores[3], 0, "a node that does not fit scores 0");
    let spread = cluster.scores(&["a", "b", "c"], &req, Policy::Spread);
    assert_eq!(spread[2], 10, "spread prefers the emptiest: {spread:?}");
    assert_eq!(cluster.scores(&["c"], &req, Policy::Binpack), vec![10]);
}

#[test]
fn multi_gpu_pods_take_distinct_gpus_next_to_shared_pods() {
    let mut cluster = two_by_two();
    // A 2 × 8 GiB pod, a whole-2-GPU pod, and shared 4 GiB pods on two 2-GPU nodes.
    let two = cluster
        .reserve("two".into(), "a", &multi(2, 8, false), Policy::Binpack)
        .unwrap();
    assert_eq!((two.gpu, two.more_gpus.len(), two.pod_gib), (0, 1, 8));
    assert_eq!(two.more_gpus[0].0, 1);
    let whole = cluster
        .reserve("whole".into(), "b", &multi(2, 16, true), Policy::Binpack)
        .unwrap();
    assert!(whole.exclusive);
    // Node b is taken whole: nothing shares it, however small.
    assert!(matches!(
        cluster.fit("b", &request(1)),
        Err(Unfit::Busy { .. })
    ));
    for (i, expected) in [(0, 0), (1, 0), (2, 1), (3, 1)] {
        let uid = PodId::from(format!("s{i}"));
        let placed = cluster
            .reserve(uid.clone(), "a", &request(4), Policy::Binpack)
            .unwrap();
        assert_eq!(placed.gpu, expected, "shared pod {i}");
        // kubelet admits it before the next one comes (else the twin rule pins them).
        let (_, placement) = cluster.pod(&uid).unwrap();
        let placement = PodPlacement {
            assigned: true,
            ..placement.clone()
        };
        cluster.upsert_pod(uid, "a", placement);
    }
    let used: Vec<u64> = cluster
        .node("a")
        .unwrap()
        .gpus()
        .iter()
        .map(|g| g.used_gib)
        .collect();
    assert_eq!(used, vec![16, 16]);
    let used: Vec<u64> = cluster
        .node("b")
        .unwrap()
        .gpus()
        .iter()
        .map(|g| g.used_gib)
        .collect();
    assert_eq!(used, vec![16, 16]);
    // Releasing the whole-GPU pod frees both GPUs in full.
    cluster.release(&"whole".into());
    assert!(
        cluster
            .node("b")
            .unwrap()
            .gpus()
            .iter()
            .all(|g| g.used_gib == 0)
    );
}

#[test]
fn a_whole_gpu_is_only_taken_empty() {
    let mut cluster = two_by_two();
    cluster
        .reserve("small".into(), "a", &request(1), Policy::Binpack)
        .unwrap();
    let err = cluster.fit("a", &multi(2, 8, true)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "needs 2 whole free GPUs of at least 8 GiB; node has 1"
    );
    assert!(!err.is_unresolvable());
    let one = cluster
        .reserve("one".into(), "a", &multi(1, 8, true), Policy::Binpack)
        .unwrap();
    assert_eq!(one.gpu, 1, "the empty GPU, not the one holding 1 GiB");
}

#[test]
fn filter_reasons_name_the_shortfall() {
    let mut cluster = two_by_two();
    cluster
        .reserve("big".into(), "a", &request(12), Policy::Binpack)
        .unwrap();
    let err = cluster.fit("a", &multi(2, 8, false)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "needs 2 GPUs with 8 GiB free each; node has 1"
    );
    assert!(
        !err.is_unresolvable(),
        "it may fit once the 12 GiB pod leaves"
    );
    let err = cluster.fit("a", &multi(3, 4, false)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "needs 3 GPUs with 4 GiB free each; node has 2 healthy GPUs that large"
    );
    assert!(err.is_unresolvable());
    let err = cluster.fit("a", &multi(2, 20, false)).unwrap_err();
    assert!(err.is_unresolvable(), "{err}");
}

#[test]
fn slices_follow_the_policy_and_prefer_one_numa_node() {
    let mut cluster = Cluster::new();
    let on = |index, numa| Gpu {
        numa: Some(numa),
        ..gpu(index, 16)
    };
    cluster.set_node("n", vec![on(0, 0), on(1, 1), on(2, 1), on(3, 0)], true);
    cluster.upsert_pod("x".into(), "n", running(0, 10));
    cluster.upsert_pod("y".into(), "n", running(1, 6));
    // Binpack alone would take GPUs 0 and 1 (least free); both of NUMA node 1 (1, 2) hold
    // less in all than both of node 0 (0, 3) ... the snuggest NUMA group wins: 0 and 3
    // have 6 + 16 free, 1 and 2 have 10 + 16.
    let binpack = cluster
        .choose_gpus("n", &multi(2, 4, false), Policy::Binpack)
        .unwrap();
    assert_eq!(binpack, vec![0, 3]);
    let spread = cluster
        .choose_gpus("n", &multi(2, 4, false), Policy::Spread)
        .unwrap();
    assert_eq!(spread, vec![2, 1]);
    // No NUMA node can hold three: taken across, by the policy.
    let three = cluster
        .choose_gpus("n", &multi(3, 4, false), Policy::Binpack)
        .unwrap();
    assert_eq!(three, vec![0, 1, 2]);
}

#[test]
fn model_filters_pick_gpus_on_mixed_model_nodes() {
    let mut cluster = Cluster::new();
    let of = |index, model: &str, gib| Gpu {
        model: model.into(),
        ..gpu(index, gib)
    };
    cluster.set_node(
        "mixed",
        vec![
            of(0, "Tesla T4", 16),
            of(1, "NVIDIA A10G", 24),
            of(2, "NVIDIA A10G", 24),
        ],
        true,
    );
    let wants = |names: &[&str], gib| Request {
        models: crate::ModelFilter::parse(names.iter().copied()),
        ..request(gib)
    };
    // Binpack alone would take the T4 (least free that fits); the label form of the name
    // selects the A10Gs.
    assert_eq!(
        cluster.choose_gpu("mixed", &request(4), Policy::Binpack),
        Ok(0)
    );
    assert_eq!(
        cluster.choose_gpu("mixed", &wants(&["nvidia-a10g"], 4), Policy::Binpack),
        Ok(1)
    );
    assert_eq!(
        cluster.choose_gpu("mixed", &wants(&["!Tesla T4"], 4), Policy::Spread),
        Ok(1)
    );
    let two = Request {
        models: crate::ModelFilter::parse(["NVIDIA A10G"]),
        ..multi(2, 8, false)
    };
    assert_eq!(
        cluster.choose_gpus("mixed", &two, Policy::Binpack),
        Ok(vec![1, 2])
    );
    let t4_pair = Request {
        models: crate::ModelFilter::parse(["Tesla-T4"]),
        ..multi(2, 8, false)
    };
    let err = cluster.fit("mixed", &t4_pair).unwrap_err();
    assert!(err.is_unresolvable(), "one T4 only: {err}");
    // A waiting twin on an A10G does not hide that the node has no H100 at all.
    cluster
        .reserve(
            "twin".into(),
            "mixed",
            &wants(&["NVIDIA A10G"], 4),
            Policy::Binpack,
        )
        .unwrap();
    let err = cluster.fit("mixed", &wants(&["H100"], 4)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "needs a GPU of model h100; node has NVIDIA A10G, Tesla T4"
    );
    assert!(err.is_unresolvable());
    // Room on the T4 does not help a pod that wants an A10G.
    cluster.remove_pod(&"twin".into());
    cluster.upsert_pod("big1".into(), "mixed", running(1, 24));
    cluster.upsert_pod("big2".into(), "mixed", running(2, 24));
    let err = cluster
        .fit("mixed", &wants(&["NVIDIA A10G"], 4))
        .unwrap_err();
    assert!(matches!(err, Unfit::Busy { .. }), "{err}");
    assert!(cluster.fit("mixed", &request(4)).is_ok());
}

fn with_compute(mut request: Request, compute: u32) -> Request {
    request.compute = compute;
    request
}

#[test]
fn a_gpu_takes_a_pod_only_where_its_memory_and_compute_both_fit() {
    for policy in [Policy::Binpack, Policy::Spread, Policy::Fragmentation] {
        let mut cluster = Cluster::new();
        cluster.set_node("n", vec![gpu(0, 16), gpu(1, 16)], true);
        // Three 4 GiB pods asking 40 % each: memory would take all three on one GPU, compute
        // only two.
        // (Sizes differ so that no pod is pinned to a twin still waiting for allocation.)
        let mut gpus = Vec::new();
        for (uid, gib) in [("a", 4), ("b", 5), ("c", 3)] {
            let placement = cluster
                .reserve(uid.into(), "n", &with_compute(request(gib), 40), policy)
                .unwrap();
            assert_eq!(placement.compute, 40);
            gpus.push(placement.gpu);
        }
        for gpu in [0, 1] {
            let used = cluster.node("n").unwrap().gpus()[gpu].used_compute;
            assert!(used <= 100, "{policy}: GPU {gpu} booked {used} %");
        }
        assert_eq!(
            gpus.iter().filter(|&&g| g == gpus[0]).count(),
            2,
            "{policy}: {gpus:?}"
        );
        // Both GPUs now have 7+ GiB free but at most 60 % compute: a 70 % pod fits nowhere,
        // and the refusal says compute, not memory.
        let err = cluster.fit("n", &with_compute(request(6), 70)).unwrap_err();
        assert!(
            matches!(
                err,
                Unfit::ComputeBusy {
                    compute: 70,
                    free: 60,
                    ..
                }
            ),
            "{policy}: {err}"
        );
        assert!(err.to_string().contains("70 % compute"), "{err}");
        // A pod without compute still takes the memory.
        cluster
            .reserve("d".into(), "n", &request(4), policy)
            .unwrap();
        // Releasing a pod gives its compute back.
        cluster.release(&"a".into());
        cluster.fit("n", &with_compute(request(4), 60)).unwrap();
    }
}

#[test]
fn compute_counts_on_each_gpu_of_a_multi_gpu_pod_and_exclusive_takes_it_all() {
    let mut cluster = Cluster::new();
    cluster.set_node("n", vec![gpu(0, 16), gpu(1, 16), gpu(2, 16)], true);
    cluster
        .reserve(
            "one".into(),
            "n",
            &with_compute(request(2), 80),
            Policy::Binpack,
        )
        .unwrap();
    // Two GPUs with 30 % each: GPU 0 (80 % booked) cannot be one of them.
    // (Sizes differ so that no pod is pinned to a twin still waiting for allocation.)
    let two = cluster
        .reserve(
            "two".into(),
            "n",
            &with_compute(multi(2, 4, false), 30),
            Policy::Binpack,
        )
        .unwrap();
    let mut taken: Vec<u32> = std::iter::once(two.gpu)
        .chain(two.more_gpus.iter().map(|(index, _)| *index))
        .collect();
    taken.sort_unstable();
    assert_eq!(taken, vec![1, 2]);
    let err = cluster
        .fit("n", &with_compute(multi(2, 3, false), 80))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Unfit::TooFewFree {
                compute: 80,
                fitting: 0,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("80 % compute"), "{err}");
    // An exclusive pod books every GPU's compute whole: nothing with compute fits beside it.
    let mut whole = Cluster::new();
    whole.set_node("n", vec![gpu(0, 16), gpu(1, 16)], true);
    whole
        .reserve("x".into(), "n", &multi(1, 8, true), Policy::Binpack)
        .unwrap();
    let used: Vec<u32> = whole
        .node("n")
        .unwrap()
        .gpus()
        .iter()
        .map(|g| g.used_compute)
        .collect();
    assert!(used.contains(&100), "{used:?}");
}

#[test]
fn watched_bookings_of_compute_survive_a_rebuild() {
    let booked = PodPlacement {
        compute: 70,
        ..running(0, 4)
    };
    let cluster = Cluster::rebuild(
        [("n".to_owned(), vec![gpu(0, 16)], true)],
        [("p".into(), "n".to_owned(), booked)],
    );
    assert_eq!(cluster.node("n").unwrap().gpus()[0].used_compute, 70);
    assert!(cluster.fit("n", &with_compute(request(4), 31)).is_err());
    cluster.fit("n", &with_compute(request(4), 30)).unwrap();
}
