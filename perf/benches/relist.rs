//! What the extender's start-up relist costs on its own side at 5,000 nodes × 8 GPUs with
//! 40,000 bound pods, the size `realload --resident 40000` measured on the real cluster (a
//! restarted replica Ready 3.7–5.5 s after its start, most of it the API server serving the
//! list): the list's pages decoded lean ([`WatchedPod`], 500 pods a page as the watcher asks),
//! each pod cut to its facts ([`PodFacts::read`]), and the buffer swapped into the view
//! ([`View::replace_pod_facts`]), all as `watch.rs` does before `/readyz` turns 200.
//!
//! ```sh
//! cargo bench -p gpushare-perf --bench relist
//! ```
//!
//! Under `cargo test` (no `--bench`) it runs once with 2,000 pods, as a smoke test.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use gpushare_contract::{DEFAULT_DOMAIN, DEFAULT_RESOURCE, Keys};
use gpushare_extender::kube_io::watched_pod::WatchedPod;
use gpushare_extender::scheduling::view::PodFacts;
use gpushare_extender::{Settings, View};
use gpushare_testkit::workload::{gpushare_nodes, listed_bound_pod};
use kube::core::ObjectList;

const NODES: usize = 5_000;
const GPUS: u32 = 8;
const GPU_GIB: u64 = 16;
/// The watcher's page size (kube's default).
const PAGE: usize = 500;

/// The pod list as the API server sends it: JSON pages of `PAGE` bound pods.
fn pages(pods: usize) -> Vec<String> {
    let keys = Keys::default();
    let built: Vec<serde_json::Value> = (0..pods)
        .map(|i| {
            let pod = listed_bound_pod(i, NODES, GPUS, &keys, "2026-01-01T00:00:00Z");
            serde_json::to_value(pod).expect("a built pod serializes")
        })
        .collect();
    built
        .chunks(PAGE)
        .map(|items| {
            serde_json::json!({
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": "123456"},
                "items": items,
            })
            .to_string()
        })
        .collect()
}

/// The relist: every page decoded, each pod read into facts, the buffer swapped in.
fn relist(pages: &[String], settings: &Settings, view: &mut View) -> usize {
    let mut buffer = Vec::new();
    for page in pages {
        let list: ObjectList<WatchedPod> =
            serde_json::from_str(page).expect("a page of the bench decodes");
        buffer.extend(
            list.items
                .iter()
                .filter_map(|WatchedPod(pod)| PodFacts::read(pod, settings))
                .filter(PodFacts::concerns_gpushare),
        );
    }
    view.replace_pod_facts(buffer).len()
}

fn start_up(c: &mut Criterion) {
    let pods = if std::env::args().any(|a| a == "--bench") {
        40_000
    } else {
        2_000
    };
    let settings = Settings::new(DEFAULT_RESOURCE, DEFAULT_DOMAIN, "gpushare=true");
    let pages = pages(pods);
    let bytes: usize = pages.iter().map(String::len).sum();
    // A view holding the nodes, as after the node watch's list.
    let mut view = View::new(settings.clone());
    view.replace_nodes(&gpushare_nodes(NODES, GPUS, GPU_GIB));
    assert_eq!(relist(&pages, &settings, &mut view), 0, "no warnings");
    assert_eq!(view.cluster.pod_count(), pods, "every pod booked");
    let mut group = c.benchmark_group(format!(
        "relist/{NODES}_nodes_x{GPUS}/{pods}_pods_{}MB",
        bytes / 1_000_000
    ));
    group.sample_size(10);
    group.bench_function("decode_read_swap", |b| {
        b.iter(|| relist(black_box(&pages), &settings, &mut view))
    });
    group.finish();
}

criterion_group!(benches, start_up);
criterion_main!(benches);
