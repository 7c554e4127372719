//! Per-GPU capacity and booked memory and compute, read from the view at scrape time:
//! `gpushare_gpu_capacity_bytes`, `gpushare_gpu_allocated_bytes` and
//! `gpushare_gpu_compute_allocated_percent`, labelled `node`, `gpu` (the index), `uuid` and
//! `model` (empty where the node's inventory does not say).
//!
//! Why computed per scrape and not gauges set as the view changes: the figures are the view's
//! own, so a node that left the view takes its series with it and no bookkeeping beside the
//! view can drift from it. The view's read lock is held only to copy one row per GPU (a name
//! and a GPU shared with the view, no string copied).
//!
//! One series per GPU and metric: 5,000 nodes of 8 GPUs make 40,000 each, about 18 MB of
//! text for the three. Written whole into one buffer, a scrape raised the extender's peak RSS
//! by 40 MiB (docs/performance.md); so the text is written [`ROWS_PER_CHUNK`] GPUs at a time
//! as the response body is sent, after the registry's own families and before the end marker.
//! Nothing else (no pod, no health) is a label, so the count follows the hardware and nothing
//! a user does.
//!
//! The same view serves both modes: in DRA mode the GPUs come from our driver's
//! ResourceSlices and the bookings from allocated claims, and these gauges read them alike.

use std::fmt::{self, Write as _};
use std::sync::{Arc, RwLock};

use gpushare_allocator::Gpu;
use gpushare_runtime::metrics::label_value;
use prometheus_client::registry::Registry;

use crate::scheduling::view::View;

/// Bytes in a GiB, the unit the view counts in.
const GIB: u64 = 1 << 30;

/// GPUs written per piece of the body: about 300 KB of text, whatever the cluster's size.
pub const ROWS_PER_CHUNK: usize = 2048;

/// The OpenMetrics end marker, which must come after every family.
const EOF: &str = "# EOF\n";

/// One GPU as a scrape reads it.
struct Row {
    node: Arc<str>,
    gpu: Arc<Gpu>,
    allocated_gib: u64,
    allocated_compute: u32,
}

/// `/metrics` as OpenMetrics text in pieces: `registry`'s families (encoded now), then the
/// per-GPU gauges of `view` as it is now, each piece written only when the caller takes it,
/// then the end marker. Concatenated, the pieces are one exposition.
pub fn exposition(
    registry: &Registry,
    view: &RwLock<View>,
) -> Result<impl Iterator<Item = String> + Send + 'static, fmt::Error> {
    let mut families = String::new();
    prometheus_client::encoding::text::encode(&mut families, registry)?;
    if families.ends_with(EOF) {
        families.truncate(families.len() - EOF.len());
    }
    let rows: Arc<[Row]> = rows(view).into();
    let per_gpu = GAUGES.iter().flat_map(move |gauge| {
        let rows = rows.clone();
        let pieces = rows.len().div_ceil(ROWS_PER_CHUNK).max(1);
        (0..pieces).map(move |piece| {
            let start = piece * ROWS_PER_CHUNK;
            let end = rows.len().min(start + ROWS_PER_CHUNK);
            gauge.text(&rows[start..end], piece == 0)
        })
    });
    Ok(std::iter::once(families)
        .chain(per_gpu)
        .chain(std::iter::once(EOF.to_owned())))
}

/// Every GPU of every node in `view`, by node name and index.
fn rows(view: &RwLock<View>) -> Vec<Row> {
    let mut rows = {
        let view = view.read().unwrap_or_else(|e| e.into_inner());
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

/// One of the gauges: its name, its help, and the value it reads of a GPU.
struct PerGpu {
    name: &'static str,
    help: &'static str,
    value: fn(&Row) -> i64,
}

impl PerGpu {
    /// The samples of `rows`, after the family's HELP and TYPE lines when `first`.
    fn text(&self, rows: &[Row], first: bool) -> String {
        let mut text = String::with_capacity(rows.len() * 160 + 512);
        // Writing into a String cannot fail.
        if first {
            let _ = write!(
                text,
                "# HELP {name} {help}\n# TYPE {name} gauge\n",
                name = self.name,
                help = self.help
            );
        }
        for row in rows {
            let _ = writeln!(
                text,
                "{}{{node=\"{}\",gpu=\"{}\",uuid=\"{}\",model=\"{}\"}} {}",
                self.name,
                label_value(&row.node),
                row.gpu.index,
                label_value(&row.gpu.uuid),
                label_value(&row.gpu.model),
                (self.value)(row)
            );
        }
        text
    }
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

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use gpushare_allocator::{Policy, Request};
    use gpushare_testkit::fixtures::node;
    use prometheus_client::collector::Collector;
    use prometheus_client::encoding::DescriptorEncoder;
    use prometheus_client::metrics::MetricType;

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
        exposition(&Registry::default(), view).unwrap().collect()
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

    /// What prometheus_client writes for the same rows, the encoder the gauges used before
    /// they were written piece by piece.
    struct Reference(Arc<RwLock<View>>);

    impl fmt::Debug for Reference {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("Reference")
        }
    }

    impl Collector for Reference {
        fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
            let rows = rows(&self.0);
            for gauge in GAUGES {
                let mut family =
                    encoder.encode_descriptor(gauge.name, gauge.help, None, MetricType::Gauge)?;
                for row in &rows {
                    let labels = [
                        ("node", label_value(&row.node)),
                        ("gpu", Cow::Owned(row.gpu.index.to_string())),
                        ("uuid", label_value(&row.gpu.uuid)),
                        ("model", label_value(&row.gpu.model)),
                    ];
                    family
                        .encode_family(&labels)?
                        .encode_gauge(&(gauge.value)(row))?;
                }
            }
            Ok(())
        }
    }

    #[test]
    fn the_pieces_make_the_exposition_prometheus_client_writes() {
        let view = view();
        // More GPUs than one piece holds, so families span pieces.
        let nodes: Vec<_> = (0..300)
            .map(|i| node(&format!("n{i:03}")).gpushare().gpus(&[16; 8]).build())
            .collect();
        view.write().unwrap().replace_nodes(&nodes);
        book(&view, "a", "n007", (12, 30));
        let mut registry = Registry::default();
        let counter = prometheus_client::metrics::counter::Counter::<u64>::default();
        registry.register("gpushare_extender_example", "An example", counter);

        let pieces: Vec<String> = exposition(&registry, &view).unwrap().collect();
        assert_eq!(
            pieces.len(),
            1 + 3 * 2 + 1,
            "2,400 GPUs: two pieces a gauge"
        );
        assert!(pieces.iter().all(|piece| piece.len() < 400_000));

        registry.register_collector(Box::new(Reference(view.clone())));
        let mut whole = String::new();
        prometheus_client::encoding::text::encode(&mut whole, &registry).unwrap();
        assert_eq!(pieces.concat(), whole);
        assert!(whole.contains("gpushare_gpu_allocated_bytes{node=\"n007\",gpu=\"0\","));
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
