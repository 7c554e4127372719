//! Tests of the cluster model, and the fixtures every test of the model builds on.
//!
//! Here: what the watches and [`Cluster::reserve`] record (bookings that follow a GPU's
//! UUID, pods before their node, forgetting and releasing). The per-node decisions (which
//! GPU, the fit reasons, scores, the twin rule, NUMA, model filters) are tested in
//! `decisions`; preemption and the fragmentation policy next to their own code.

use super::*;

mod decisions;

/// A healthy Tesla T4 of `total_gib` with index `index` (UUID `GPU-<index>`); the other
/// modules' tests build their nodes with it too.
pub(super) fn gpu(index: u32, total_gib: u64) -> Gpu {
    Gpu {
        index,
        uuid: format!("GPU-{index}"),
        model: "Tesla T4".into(),
        numa: None,
        total_gib,
        healthy: true,
    }
}

fn request(gib: u64) -> Request {
    Request {
        models: Default::default(),
        gpus: 1,
        exclusive: false,
        pod_gib: gib,
        containers: vec![gib],
        host: Host::default(),
        compute: 0,
    }
}

fn running(gpu: u32, gib: u64) -> PodPlacement {
    PodPlacement {
        more_gpus: Vec::new(),
        exclusive: false,
        gpu,
        uuid: "".into(),
        pod_gib: gib,
        pending: vec![gib],
        assigned: true,
        compute: 0,
    }
}

/// A pod bound to the GPU with `uuid`, recorded at `index`, with a container still waiting.
fn waiting_on(uuid: &str, index: u32, gib: u64) -> PodPlacement {
    PodPlacement {
        uuid: uuid.into(),
        assigned: false,
        ..running(index, gib)
    }
}

fn multi(gpus: u32, per_gpu: u64, exclusive: bool) -> Request {
    Request {
        models: Default::default(),
        gpus,
        exclusive,
        pod_gib: per_gpu * u64::from(gpus),
        containers: vec![per_gpu * u64::from(gpus)],
        host: Host::default(),
        compute: 0,
    }
}

fn two_by_two() -> Cluster {
    let mut cluster = Cluster::new();
    for name in ["a", "b"] {
        cluster.set_node(name, vec![gpu(0, 16), gpu(1, 16)], true);
    }
    cluster
}

/// Four 16 GiB GPUs with 12, 8, 4 and 16 GiB free.
fn design_doc_node() -> Cluster {
    let mut cluster = Cluster::new();
    cluster.set_node("n1", (0..4).map(|i| gpu(i, 16)).collect(), true);
    cluster.upsert_pod("a".into(), "n1", running(0, 4));
    cluster.upsert_pod("b".into(), "n1", running(1, 8));
    cluster.upsert_pod("c".into(), "n1", running(2, 12));
    cluster
}

/// The GiB free on each GPU of `node`, in index order.
fn free_gib(cluster: &Cluster, node: &str) -> Vec<u64> {
    let gpus = cluster.node(node).unwrap().gpus();
    gpus.iter().map(GpuUsage::free_gib).collect()
}

#[test]
fn first_fit_takes_the_lowest_gpus_with_room_whatever_the_policy_prefers() {
    // Free 12, 8, 4, 16: binpack would take GPU 1 for 8 GiB; first fit takes GPU 0.
    let mut cluster = design_doc_node();
    let placed = cluster
        .reserve_first_fit("p".into(), "n1", &request(8))
        .unwrap();
    assert_eq!((placed.gpu, placed.uuid.as_str()), (0, "GPU-0"));
    // Now 4, 8, 4, 16: two slices of 6 GiB go to GPUs 1 and 3, the first two with room.
    let placed = cluster
        .reserve_first_fit("q".into(), "n1", &multi(2, 6, false))
        .unwrap();
    assert_eq!((placed.gpu, placed.more_gpus.len()), (1, 1));
    assert_eq!(placed.more_gpus[0].0, 3);
    assert_eq!(free_gib(&cluster, "n1"), vec![4, 2, 4, 10]);
    // What fits nowhere is refused as a policy's choice refuses it, and books nothing.
    assert_eq!(
        cluster.reserve_first_fit("r".into(), "n1", &request(11)),
        Err(cluster
            .reserve("r".into(), "n1", &request(11), Policy::Binpack)
            .unwrap_err())
    );
    assert!(
        cluster
            .reserve_first_fit("r".into(), "n1", &multi(2, 5, false))
            .is_err()
    );
    assert!(
        cluster
            .reserve_first_fit("r".into(), "n1", &multi(1, 16, true))
            .is_err()
    );
    assert_eq!(cluster.pod_count(), 5);
}

#[test]
fn bookings_follow_the_gpu_uuid_when_indices_shift() {
    let mut cluster = Cluster::new();
    cluster.set_node("n1", (0..3).map(|i| gpu(i, 16)).collect(), true);
    cluster.upsert_pod("a".into(), "n1", waiting_on("GPU-1", 1, 12));
    cluster.upsert_pod("b".into(), "n1", waiting_on("GPU-2", 2, 4));
    // GPU-0 fell off the bus: the node comes back with GPU-1 at index 0, GPU-2 at 1.
    let renumbered = |index: u32, uuid: &str| Gpu {
        uuid: uuid.into(),
        ..gpu(index, 16)
    };
    cluster.set_node(
        "n1",
        vec![renumbered(0, "GPU-1"), renumbered(1, "GPU-2")],
        true,
    );
    let node = cluster.node("n1").unwrap();
    let used: Vec<(&str, u64)> = node
        .gpus()
        .iter()
        .map(|g| (g.gpu.uuid.as_str(), g.used_gib))
        .collect();
    assert_eq!(used, vec![("GPU-1", 12), ("GPU-2", 4)]);
    // The twin rule pins to the GPU where the waiting container really is.
    let pending: Vec<(u64, &[u32], u32)> = node.pending().collect();
    assert_eq!(pending, vec![(4, &[1][..], 1), (12, &[0][..], 1)]);
    assert_eq!(
        node.gpu_of(&waiting_on("GPU-1", 1, 12))
            .map(|g| g.gpu.index),
        Some(0)
    );
    // 12 GiB of GPU-1 stay taken, so a 12 GiB twin cannot go there.
    assert!(
        cluster
            .reserve("c".into(), "n1", &request(12), Policy::Binpack)
            .is_err()
    );

    // A pod whose GPU left the node books nothing on the card now at its index.
    cluster.upsert_pod("d".into(), "n1", waiting_on("GPU-0", 0, 8));
    let node = cluster.node("n1").unwrap();
    assert_eq!(node.gpus()[0].used_gib, 12);
    assert!(node.gpu_of(&waiting_on("GPU-0", 0, 8)).is_none());
    // Removing it unbooks nothing either.
    cluster.remove_pod(&"d".into());
    assert_eq!(cluster.node("n1").unwrap().gpus()[0].used_gib, 12);
}

#[test]
fn without_uuids_bookings_use_the_index() {
    let mut cluster = Cluster::new();
    let anonymous = |index| Gpu {
        uuid: String::new(),
        ..gpu(index, 16)
    };
    cluster.set_node("n1", vec![anonymous(0), anonymous(1)], true);
    cluster.upsert_pod("a".into(), "n1", waiting_on("GPU-9", 1, 4));
    cluster.upsert_pod("b".into(), "n1", running(0, 2));
    let used: Vec<u64> = cluster
        .node("n1")
        .unwrap()
        .gpus()
        .iter()
        .map(|g| g.used_gib)
        .collect();
    assert_eq!(used, vec![2, 4]);
}

#[test]
fn forgetting_pods_keeps_the_nodes_and_frees_their_gpus() {
    let mut cluster = design_doc_node();
    // A container still waiting for the device plugin: the twin rule's pending count.
    let waiting = PodPlacement {
        assigned: false,
        ..running(3, 4)
    };
    cluster.upsert_pod("w".into(), "n1", waiting);
    assert!(cluster.node("n1").unwrap().pending().next().is_some());
    // A pod on a node the node watch has not shown, and a node deleted with a pod on it:
    // both exist only through their pods.
    cluster.upsert_pod("x".into(), "ghost", running(0, 4));
    cluster.set_node("gone", vec![gpu(0, 16)], true);
    cluster.upsert_pod("y".into(), "gone", running(0, 4));
    cluster.remove_node("gone");
    assert!(cluster.node("gone").is_some_and(|node| !node.is_present()));

    cluster.forget_pods();
    assert_eq!(cluster.pod_count(), 0);
    assert!(cluster.node("ghost").is_none() && cluster.node("gone").is_none());
    let node = cluster.node("n1").unwrap();
    assert!(node.is_present() && node.pods().next().is_none());
    assert!(node.pending().next().is_none());
    assert!(node.gpus().iter().all(|gpu| gpu.used_gib == 0));
    // The shared name handed to pods is the node map's own.
    let name = cluster.node_name("n1");
    cluster.upsert_pod("a".into(), &name, running(0, 4));
    assert_eq!(cluster.pod(&"a".into()).map(|(node, _)| node), Some("n1"));
    assert!(std::ptr::eq(
        cluster.node_name("n1").as_ptr(),
        name.as_ptr()
    ));
}

#[test]
fn capacity_fallback_gpus_work_without_uuids() {
    // What the extender builds from capacity 32 and gpu-count 2 when no inventory exists.
    let mut cluster = Cluster::new();
    let fallback = |index| Gpu {
        index,
        uuid: String::new(),
        model: String::new(),
        numa: None,
        total_gib: 16,
        healthy: true,
    };
    cluster.set_node("n1", vec![fallback(0), fallback(1)], true);
    let placed = cluster
        .reserve("a".into(), "n1", &request(16), Policy::Binpack)
        .unwrap();
    assert_eq!((placed.gpu, placed.uuid.as_str()), (0, ""));
    cluster.upsert_pod("a".into(), "n1", running(0, 16));
    assert_eq!(
        cluster.choose_gpu("n1", &request(16), Policy::Binpack),
        Ok(1)
    );
}

#[test]
fn collisions_from_the_watch_saturate() {
    let mut cluster = Cluster::new();
    cluster.set_node("n1", vec![gpu(0, 16)], true);
    cluster.upsert_pod("a".into(), "n1", running(0, 12));
    cluster.upsert_pod("b".into(), "n1", running(0, 12));
    let gpu0 = &cluster.node("n1").unwrap().gpus()[0];
    assert_eq!((gpu0.used_gib, gpu0.free_gib()), (24, 0));
    assert!(
        cluster
            .reserve("c".into(), "n1", &request(1), Policy::Binpack)
            .is_err()
    );
    cluster.remove_pod(&"a".into());
    assert_eq!(cluster.node("n1").unwrap().gpus()[0].free_gib(), 4);
}

#[test]
fn reserve_release_and_idempotent_upsert() {
    let mut cluster = Cluster::new();
    cluster.set_node("n1", vec![gpu(0, 16)], true);
    cluster
        .reserve("a".into(), "n1", &request(4), Policy::Binpack)
        .unwrap();
    assert!(matches!(
        cluster.reserve("a".into(), "n1", &request(4), Policy::Binpack),
        Err(Refusal::AlreadyPlaced { gpu: 0, .. })
    ));
    cluster.release(&"a".into());
    assert_eq!(cluster.pod_count(), 0);
    assert_eq!(cluster.node("n1").unwrap().gpus()[0].used_gib, 0);
    assert_eq!(cluster.node("n1").unwrap().pending().count(), 0);
    cluster.upsert_pod("a".into(), "n1", running(0, 4));
    cluster.upsert_pod("a".into(), "n1", running(0, 4));
    assert_eq!(cluster.node("n1").unwrap().gpus()[0].used_gib, 4);
}

#[test]
fn pods_before_nodes_and_removed_nodes_keep_their_bookings() {
    let mut cluster = Cluster::new();
    cluster.upsert_pod("a".into(), "n1", running(1, 4));
    assert_eq!(cluster.fit("n1", &request(1)), Err(Unfit::UnknownNode));
    cluster.set_node("n1", vec![gpu(0, 8), gpu(1, 8)], true);
    assert_eq!(cluster.node("n1").unwrap().gpus()[1].used_gib, 4);
    cluster.remove_node("n1");
    assert_eq!(cluster.fit("n1", &request(1)), Err(Unfit::UnknownNode));
    cluster.remove_pod(&"a".into());
    assert!(cluster.node("n1").is_none());
}
