//! Per-GPU capacity and booked memory and compute, read from the view at scrape time:
//! `gpushare_gpu_capacity_bytes`, `gpushare_gpu_allocated_bytes` and
//! `gpushare_gpu_compute_allocated_percent`, labelled `node`, `gpu` (the index), `uuid` and
//! `model` (empty where the node's inventory does not say).
//!
//! Why a collector and not gauges set as the view changes: the figures are the view's own,
//! computed on each scrape, so a node that left the view takes its series with it and no
//! bookkeeping beside the view can drift from it. The view's read lock is held only to copy
//! one row per GPU (a name and a GPU shared with the view, no string copied); the text is
//! written after it is released, so a scrape of 40,000 GPUs does not hold up the watches.
//!
//! One series per GPU and metric: 5,000 nodes of 8 GPUs make 40,000 each. Nothing else (no
//! pod, no health) is a label, so the count follows the hardware and nothing a user does.
//!
//! The same view serves both modes: in DRA mode the GPUs come from our driver's
//! ResourceSlices and the bookings from allocated claims, and these gauges read them alike.

use std::borrow::Cow;
use std::fmt;
use std::sync::{Arc, RwLock};

use gpushare_allocator::Gpu;
use gpushare_runtime::metrics::label_value;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::scheduling::view::View;

/// Bytes in a GiB, the unit the view counts in.
const GIB: u64 = 1 << 30;

/// The per-GPU gauges, computed from `view` on each scrape.
pub struct GpuGauges {
    view: Arc<RwLock<View>>,
}

impl fmt::Debug for GpuGauges {
    // Not the view: the registry's Debug would print every node and pod.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuGauges").finish_non_exhaustive()
    }
}

/// One GPU as a scrape reads it.
struct Row {
    node: Arc<str>,
    gpu: Arc<Gpu>,
    allocated_gib: u64,
    allocated_compute: u32,
}

impl GpuGauges {
    /// Registers the gauges of `view`'s GPUs in `registry` (names start `gpushare_gpu_`).
    pub fn register(registry: &mut Registry, view: Arc<RwLock<View>>) {
        registry.register_collector(Box::new(Self { view }));
    }

    /// Every GPU of every node in the view, by node name and index.
    fn rows(&self) -> Vec<Row> {
        let mut rows = {
            let view = self.view.read().unwrap_or_else(|e| e.into_inner());
            let cluster = &view.cluster;
            let mut rows = Vec::new();
            for (name, node) in cluster.nodes() {
                if node.gpus().is_empty() {
                    continue;
                }
                let name = cluster.node_name(name);
                rows.extend(node.gpus().iter().map(|usage| Row {
                    node: name.clone(),
                    gpu: usage.gpu.clone(),
                    allocated_gib: usage.used_gib,
                    allocated_compute: usage.used_compute,
                }));
            }
            rows
        };
        rows.sort_unstable_by(|a, b| (&a.node, a.gpu.index).cmp(&(&b.node, b.gpu.index)));
        rows
    }
}

/// One of the gauges: its name, its help, and the value it reads of a GPU.
struct PerGpu {
    name: &'static str,
    help: &'static str,
    value: fn(&Row) -> i64,
}

const GAUGES: [PerGpu; 3] = [
    PerGpu {
        name: "gpushare_gpu_capacity_bytes",
        help: "Memory of each GPU as the extender's view has it (the node's inventory, or in DRA mode its ResourceSlice), in whole GiB",
        value: |row| bytes(row.gpu.total_gib),
    },
    PerGpu {
        name: "gpushare_gpu_allocated_bytes",
        help: "GPU memory the extender's view has booked on each GPU: bound pods, binds not yet seen in the watch and memory held for pods about to be bound (DRA mode: allocated claims and holds)",
        value: |row| bytes(row.allocated_gib),
    },
    PerGpu {
        name: "gpushare_gpu_compute_allocated_percent",
        help: "Percent of each GPU's compute (gpu-compute) the extender's view has booked, as for gpushare_gpu_allocated_bytes; a whole-GPU pod books 100",
        value: |row| i64::from(row.allocated_compute),
    },
];

/// `gib` in bytes as a gauge value: GiB figures come from node annotations and
/// ResourceSlices, and a value past what the format holds must not fail the whole scrape.
fn bytes(gib: u64) -> i64 {
    i64::try_from(gib.saturating_mul(GIB)).unwrap_or(i64::MAX)
}

impl Collector for GpuGauges {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let rows = self.rows();
        let labels: Vec<[(&str, Cow<'_, str>); 4]> = rows
            .iter()
            .map(|row| {
                [
                    ("node", label_value(&row.node)),
                    ("gpu", Cow::Owned(row.gpu.index.to_string())),
                    ("uuid", label_value(&row.gpu.uuid)),
                    ("model", label_value(&row.gpu.model)),
                ]
            })
            .collect();
        for gauge in GAUGES {
            let mut family =
                encoder.encode_descriptor(gauge.name, gauge.help, None, MetricType::Gauge)?;
            for (row, labels) in rows.iter().zip(&labels) {
                family
                    .encode_family(labels)?
                    .encode_gauge(&(gauge.value)(row))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use gpushare_allocator::{Policy, Request};
    use gpushare_testkit::fixtures::node;

    use super::*;
    use crate::scheduling::view::Settings;

    fn view() -> Arc<RwLock<View>> {
        Arc::new(RwLock::new(View::new(Settings::new(
            gpushare_contract::DEFAULT_RESOURCE,
            gpushare_contract::DEFAULT_DOMAIN,
            "gpushare=true",
        ))))
    }

    fn scrape(view: &Arc<RwLock<View>>) -> String {
        let mut registry = Registry::default();
        GpuGauges::register(&mut registry, view.clone());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    }

    fn samples(text: &str) -> Vec<&str> {
        text.lines().filter(|l| !l.starts_with('#')).collect()
    }

    fn book(view: &Arc<RwLock<View>>, uid: &str, node: &str, (gib, compute): (u64, u32)) {
        let request = Request {
            pod_gib: gib,
            containers: vec![gib],
            compute,
            ..Request::default()
        };
        let mut view = view.write().unwrap();
        view.cluster
            .reserve(uid.into(), node, &request, Policy::Binpack)
            .unwrap();
    }

    #[test]
    fn each_gpu_shows_its_capacity_and_bookings_and_a_node_gone_takes_its_series() {
        let view = view();
        let n7 = node("node-7").gpushare().gpus(&[16, 16]).build();
        view.write()
            .unwrap()
            .replace_nodes(&[n7.clone(), node("n1").gpushare().gpus(&[8]).build()]);
        book(&view, "a", "node-7", (12, 30));

        let text = scrape(&view);
        let sample = |metric: &str, node: &str, index: u32, value: u64| {
            format!(
                "gpushare_gpu_{metric}{{node=\"{node}\",gpu=\"{index}\",uuid=\"GPU-{node}-{index}\",model=\"Simulated GPU\"}} {value}"
            )
        };
        let gpu =
            |metric: &str, node: &str, index: u32, gib: u64| sample(metric, node, index, gib << 30);
        assert_eq!(
            samples(&text),
            [
                gpu("capacity_bytes", "n1", 0, 8),
                gpu("capacity_bytes", "node-7", 0, 16),
                gpu("capacity_bytes", "node-7", 1, 16),
                gpu("allocated_bytes", "n1", 0, 0),
                gpu("allocated_bytes", "node-7", 0, 12),
                gpu("allocated_bytes", "node-7", 1, 0),
                sample("compute_allocated_percent", "n1", 0, 0),
                sample("compute_allocated_percent", "node-7", 0, 30),
                sample("compute_allocated_percent", "node-7", 1, 0),
            ],
            "{text}"
        );
        assert!(
            text.contains("# TYPE gpushare_gpu_capacity_bytes gauge"),
            "{text}"
        );

        view.write().unwrap().delete_node(&n7);
        let text = scrape(&view);
        assert!(!text.contains("node-7"), "{text}");
        assert_eq!(samples(&text).len(), 3, "{text}");
    }

    #[test]
    fn an_empty_view_still_describes_every_gauge() {
        let text = scrape(&view());
        for gauge in GAUGES {
            assert!(
                text.contains(&format!("# TYPE {} gauge", gauge.name)),
                "{text}"
            );
        }
        assert!(samples(&text).is_empty(), "{text}");
    }

    #[test]
    fn what_a_node_publishes_cannot_break_the_scrape() {
        let view = view();
        {
            let mut view = view.write().unwrap();
            let gpu = Gpu {
                index: 0,
                uuid: "GPU-\\0".to_owned(),
                model: "A\"} 1\nfake{x=\"".to_owned(),
                total_gib: u64::MAX,
                healthy: true,
                numa: None,
            };
            view.cluster.set_node("n1", vec![gpu], true);
        }
        let text = scrape(&view);
        assert!(
            text.lines().any(|l| l
                == format!(
                    "gpushare_gpu_capacity_bytes{{node=\"n1\",gpu=\"0\",uuid=\"GPU-\\\\0\",model=\"A\\\"}} 1\\nfake{{x=\\\"\"}} {}",
                    i64::MAX
                )),
            "{text}"
        );
        assert!(!text.lines().any(|l| l.starts_with("fake")), "{text}");
    }
}
