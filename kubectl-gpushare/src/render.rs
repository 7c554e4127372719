//! Text output of `kubectl gpushare top`: pure functions over [`NodeUsage`], golden-tested.

use std::fmt::Write as _;

use crate::usage::{GpuUsage, NodeUsage, PodUsage};

/// Left-aligned columns separated by two spaces, as `kubectl get` prints them.
pub fn table(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|cell| cell.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let mut line = String::new();
        for (cell, width) in row.iter().zip(&widths) {
            let _ = write!(line, "{cell:<width$}  ");
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn percent(part: u64, whole: u64) -> u64 {
    (part * 100).checked_div(whole).unwrap_or(0)
}

fn or_dash(text: &str) -> String {
    if text.is_empty() {
        "-".to_owned()
    } else {
        text.to_owned()
    }
}

fn cluster_line(nodes: &[NodeUsage]) -> String {
    let allocated: u64 = nodes.iter().map(NodeUsage::allocated_gib).sum();
    let total: u64 = nodes.iter().map(NodeUsage::total_gib).sum();
    format!(
        "Allocated/Total GPU Memory In Cluster: {allocated}/{total} ({}%)\n",
        percent(allocated, total)
    )
}

const UNHEALTHY_NOTE: &str = "* unhealthy GPU: nothing new is placed on it\n";

/// `kubectl gpushare top`: one line per node, one column per GPU, then the cluster total.
pub fn render_top(nodes: &[NodeUsage]) -> String {
    if nodes.is_empty() {
        return "No GPU nodes found (none labelled, none advertising the resource).\n".to_owned();
    }
    let gpu_columns = nodes.iter().map(|n| n.gpus.len()).max().unwrap_or(0);
    let mut header = vec!["NAME".to_owned(), "IPADDRESS".to_owned()];
    header.extend((0..gpu_columns).map(|i| format!("GPU{i}(Allocated/Total)")));
    header.push("PENDING(Allocated)".to_owned());
    header.push("GPU Memory(GiB)".to_owned());
    let mut rows = vec![header];
    let mut any_unhealthy = false;
    for node in nodes {
        let mut row = vec![node.name.clone(), or_dash(&node.ip)];
        for column in 0..gpu_columns {
            row.push(match node.gpus.get(column) {
                Some(gpu) => {
                    let mark = if gpu.healthy { "" } else { "*" };
                    any_unhealthy |= !gpu.healthy;
                    format!("{}/{}{mark}", gpu.allocated_gib, gpu.total_gib)
                }
                None => "-".to_owned(),
            });
        }
        row.push(node.pending_gib().to_string());
        row.push(format!("{}/{}", node.allocated_gib(), node.total_gib()));
        rows.push(row);
    }
    let mut out = table(&rows);
    let width = out.lines().map(str::len).max().unwrap_or(0);
    out.push_str(&"-".repeat(width));
    out.push('\n');
    out.push_str(&cluster_line(nodes));
    if any_unhealthy {
        out.push_str(UNHEALTHY_NOTE);
    }
    out
}

/// `kubectl gpushare top -d`: per node, its pods per GPU and a per-GPU summary.
pub fn render_top_details(nodes: &[NodeUsage]) -> String {
    if nodes.is_empty() {
        return render_top(nodes);
    }
    let mut out = String::new();
    for node in nodes {
        let _ = writeln!(out, "NAME:       {}", node.name);
        let _ = writeln!(out, "IPADDRESS:  {}", or_dash(&node.ip));
        out.push('\n');
        if node.pods.is_empty() {
            out.push_str("No GPU pods on this node.\n");
        } else {
            let mut header = vec!["NAMESPACE".to_owned(), "NAME".to_owned()];
            header.extend(
                node.gpus
                    .iter()
                    .map(|g| format!("GPU{}(Allocated)", g.index)),
            );
            header.push("PENDING(Allocated)".to_owned());
            header.extend(compute_header(node));
            header.extend(used_header(node));
            header.extend(counted_header(node));
            let mut rows = vec![header];
            for pod in &node.pods {
                let mut row = vec![pod.namespace.clone(), pod.name.clone()];
                row.extend(node.gpus.iter().map(|g| {
                    let gib = if pod.gpu == Some(g.index) { pod.gib } else { 0 };
                    gib.to_string()
                }));
                row.push(if pod.gpu.is_none() { pod.gib } else { 0 }.to_string());
                row.extend(compute_header(node).map(|_| pod_compute_cell(pod)));
                row.extend(pod_used_cell(node, pod));
                row.extend(counted_header(node).map(|_| {
                    pod.counted_mib
                        .filter(|_| pod.used_mib.is_some())
                        .map_or_else(|| "-".to_owned(), gib_from_mib)
                }));
                rows.push(row);
            }
            out.push_str(&table(&rows));
        }
        out.push('\n');
        let mut header = ["GPU", "MODEL", "UUID", "ALLOCATED/TOTAL"]
            .map(str::to_owned)
            .to_vec();
        header.extend(compute_header(node));
        header.extend(used_header(node));
        header.push("HEALTHY".to_owned());
        let mut rows = vec![header];
        for gpu in &node.gpus {
            let mut row = vec![
                format!("GPU{}", gpu.index),
                or_dash(&gpu.model),
                or_dash(&gpu.uuid),
                format!(
                    "{}/{} ({}%)",
                    gpu.allocated_gib,
                    gpu.total_gib,
                    percent(gpu.allocated_gib, gpu.total_gib)
                ),
            ];
            row.extend(compute_header(node).map(|_| format!("{}%", gpu.allocated_compute)));
            row.extend(gpu_used_cell(node, gpu));
            row.push(if gpu.healthy { "yes" } else { "no" }.to_owned());
            rows.push(row);
        }
        let mut pending = vec![
            "PENDING".to_owned(),
            "-".to_owned(),
            "-".to_owned(),
            node.pending_gib().to_string(),
        ];
        pending.extend(compute_header(node).map(|_| "-".to_owned()));
        pending.extend(used_header(node).map(|_| "-".to_owned()));
        pending.push("-".to_owned());
        rows.push(pending);
        out.push_str(&table(&rows));
        out.push_str(usage_legend(node));
        let _ = writeln!(
            out,
            "Allocated/Total on node: {}/{} ({}%)",
            node.allocated_gib(),
            node.total_gib(),
            percent(node.allocated_gib(), node.total_gib())
        );
        out.push_str(&"-".repeat(60));
        out.push('\n');
    }
    out.push_str(&cluster_line(nodes));
    out
}

/// Why a pod is flagged in the USED column.
const OVER_SHARE_NOTE: &str =
    "! over its share: its processes use more GPU memory than it was allocated\n";

/// The COMPUTE column's header (percent of each GPU's compute held by pods that asked for
/// `gpu-compute`), on nodes where a pod holds some, so `top -d` reads as before elsewhere.
fn compute_header(node: &NodeUsage) -> Option<String> {
    node.gpus
        .iter()
        .any(|gpu| gpu.allocated_compute > 0)
        .then(|| "COMPUTE".to_owned())
}

/// A pod's COMPUTE cell: the percent of each GPU it holds, and what its kernels ran lately
/// where the device plugin publishes that (`30% (used 28%)`); `-` for a pod without a share.
fn pod_compute_cell(pod: &PodUsage) -> String {
    match (pod.compute, pod.compute_used) {
        (0, _) => "-".to_owned(),
        (share, Some(used)) => format!("{share}% (used {used}%)"),
        (share, None) => format!("{share}%"),
    }
}

/// The USED column's header, on nodes whose device plugin publishes measured use only, so
/// `top -d` reads as before where nothing is measured.
fn used_header(node: &NodeUsage) -> Option<String> {
    node.measured.then(|| "USED(GiB)".to_owned())
}

/// The COUNTED column's header, where the plugin publishes what the interposer counted
/// beside the driver's figures: a pod whose USED is well above its COUNTED runs something
/// the interposer does not see.
fn counted_header(node: &NodeUsage) -> Option<String> {
    (node.measured && node.counted).then(|| "COUNTED(GiB)".to_owned())
}

/// GiB with one decimal: MiB figures are exact, GiB ones would hide a 600 MiB overrun.
fn gib_from_mib(mib: u64) -> String {
    let tenths = mib.saturating_mul(10).saturating_add(512) / 1024;
    format!("{}.{}", tenths / 10, tenths % 10)
}

/// A pod's USED cell: `-` when not measured, `!` when over its share.
fn pod_used_cell(node: &NodeUsage, pod: &PodUsage) -> Option<String> {
    node.measured.then(|| match pod.used_mib {
        Some(mib) => format!(
            "{}{}",
            gib_from_mib(mib),
            if pod.over_share() { "!" } else { "" }
        ),
        None => "-".to_owned(),
    })
}

/// A GPU's USED cell: GiB in use and the share of the GPU it is.
fn gpu_used_cell(node: &NodeUsage, gpu: &GpuUsage) -> Option<String> {
    node.measured.then(|| match gpu.used_mib {
        Some(mib) => format!(
            "{} ({}%)",
            gib_from_mib(mib),
            percent(mib, gpu.total_gib.saturating_mul(1024))
        ),
        None => "-".to_owned(),
    })
}

/// The legend for `!`, when a pod of the node carries it.
fn usage_legend(node: &NodeUsage) -> &'static str {
    if node.pods.iter().any(PodUsage::over_share) {
        OVER_SHARE_NOTE
    } else {
        ""
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::usage::{Settings, cluster_usage};
    use gpushare_contract::Keys;
    use gpushare_contract::usage::NodeMemoryUse;
    use gpushare_testkit::fixtures::{node, pod};
    use k8s_openapi::api::core::v1::Pod;

    /// A pod the extender placed on GPU `gpu` of n1, as its annotations record it.
    fn placed(name: &str, gpu: u32, gib: u64) -> Pod {
        let keys = Keys::default();
        let containers = format!(r#"[{{"name":"main","gib":{gib},"init":false}}]"#);
        [
            (&keys.gpu_index, gpu.to_string()),
            (&keys.pod_gib, gib.to_string()),
            (&keys.containers, containers),
            (&keys.bind_time, "2026-01-01T00:00:00Z".to_owned()),
            (&keys.assigned, "true".to_owned()),
            (&keys.allocated, "main".to_owned()),
        ]
        .iter()
        .fold(pod(name).gpu_mem(gib).on_node("n1"), |b, (k, v)| {
            b.annotation(k, v)
        })
        .build()
    }

    #[test]
    fn top_details_shows_used_beside_allocated_and_flags_pods_over_their_share() {
        let mut n1 = node("n1").gpushare().gpus(&[16, 16]).build();
        let measured = NodeMemoryUse {
            gpus: [(0, 6656), (1, 0)].into(),
            pods: [
                ("default/a".to_owned(), 6144),
                ("default/b".to_owned(), 512),
            ]
            .into(),
            counted: Default::default(),
            compute: Default::default(),
        };
        n1.metadata
            .annotations
            .get_or_insert_default()
            .insert(Keys::default().node_usage, measured.encode());
        let pods = vec![
            placed("a", 0, 4),
            placed("b", 0, 2),
            // Not in the annotation (started after it was written): no figure.
            placed("c", 1, 8),
        ];
        let text = render_top_details(&cluster_usage(&[n1], &pods, &Settings::default()));
        let want = "\
NAME:       n1
IPADDRESS:  -

NAMESPACE  NAME  GPU0(Allocated)  GPU1(Allocated)  PENDING(Allocated)  USED(GiB)
default    a     4                0                0                   6.0!
default    b     2                0                0                   0.5
default    c     0                8                0                   -

GPU      MODEL          UUID      ALLOCATED/TOTAL  USED(GiB)  HEALTHY
GPU0     Simulated GPU  GPU-n1-0  6/16 (37%)       6.5 (40%)  yes
GPU1     Simulated GPU  GPU-n1-1  8/16 (50%)       0.0 (0%)   yes
PENDING  -              -         0                -          -
! over its share: its processes use more GPU memory than it was allocated
Allocated/Total on node: 14/32 (43%)
";
        assert!(text.starts_with(want), "{text}");
    }

    #[test]
    fn a_pod_the_classic_gpushare_placed_shows_on_its_gpu() {
        use gpushare_contract::allocation::classic;
        let n1 = node("n1").gpushare().gpus(&[16, 16]).build();
        let old = pod("old")
            .gpu_mem(12)
            .on_node("n1")
            .annotation(classic::GPU_INDEX, "1")
            .annotation(classic::POD_MEM, "12")
            .build();
        let text = render_top_details(&cluster_usage(
            &[n1],
            &[old, placed("a", 0, 4)],
            &Settings::default(),
        ));
        let want = "\
NAMESPACE  NAME  GPU0(Allocated)  GPU1(Allocated)  PENDING(Allocated)
default    a     4                0                0
default    old   0                12               0
";
        assert!(text.contains(want), "{text}");
        assert!(
            text.contains("Allocated/Total on node: 16/32 (50%)"),
            "{text}"
        );
    }

    #[test]
    fn top_details_shows_what_the_interposer_counted_beside_the_drivers_figure() {
        let mut n1 = node("n1").gpushare().gpus(&[16]).build();
        // a runs something the interposer does not see: the driver says 6 GiB, it counted 3.
        let measured = NodeMemoryUse {
            gpus: [(0, 7168)].into(),
            pods: [
                ("default/a".to_owned(), 6144),
                ("default/b".to_owned(), 1024),
            ]
            .into(),
            counted: [
                ("default/a".to_owned(), 3072),
                ("default/b".to_owned(), 1024),
            ]
            .into(),
            compute: Default::default(),
        };
        n1.metadata
            .annotations
            .get_or_insert_default()
            .insert(Keys::default().node_usage, measured.encode());
        let pods = vec![placed("a", 0, 4), placed("b", 0, 2)];
        let text = render_top_details(&cluster_usage(&[n1], &pods, &Settings::default()));
        let want = "\
NAMESPACE  NAME  GPU0(Allocated)  PENDING(Allocated)  USED(GiB)  COUNTED(GiB)
default    a     4                0                   6.0!       3.0
default    b     2                0                   1.0        1.0
";
        assert!(text.contains(want), "{text}");
        assert!(text.contains(OVER_SHARE_NOTE), "{text}");
    }

    #[test]
    fn top_details_shows_the_compute_held_where_pods_asked_for_it() {
        let keys = Keys::default();
        let gpu_node = || node("n1").gpushare().gpus(&[16, 16]).build();
        let trainer = || {
            let mut with_compute = placed("trainer", 1, 4);
            with_compute
                .metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert(keys.compute.clone(), "30".to_owned());
            with_compute
        };
        let nodes = cluster_usage(
            &[gpu_node()],
            &[placed("notebook", 0, 4), trainer()],
            &Settings::default(),
        );
        let out = render_top_details(&nodes);
        assert!(out.contains("COMPUTE"), "{out}");
        let gpu1 = out.lines().find(|l| l.starts_with("GPU1")).unwrap();
        assert!(gpu1.contains("30%"), "{out}");
        let gpu0 = out.lines().find(|l| l.starts_with("GPU0")).unwrap();
        assert!(gpu0.contains(" 0%"), "{out}");
        // The pod rows: the share, and "-" for a pod without one.
        let row = |name: &str| {
            out.lines()
                .find(|l| l.split_whitespace().nth(1) == Some(name))
                .unwrap()
                .to_owned()
        };
        assert!(
            row("trainer").split_whitespace().any(|cell| cell == "30%"),
            "{out}"
        );
        assert!(!row("notebook").contains('%'), "{out}");
        // With the device plugin's measurement: what its kernels ran beside the share.
        let mut measured = gpu_node();
        let usage = NodeMemoryUse {
            compute: [("default/trainer".to_owned(), 28)].into(),
            ..NodeMemoryUse::default()
        };
        measured
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(keys.node_usage.clone(), usage.encode());
        let out = render_top_details(&cluster_usage(
            &[measured],
            &[trainer()],
            &Settings::default(),
        ));
        assert!(out.contains("30% (used 28%)"), "{out}");
        // Without compute anywhere, no column.
        let plain = cluster_usage(
            &[gpu_node()],
            &[placed("notebook", 0, 4)],
            &Settings::default(),
        );
        assert!(!render_top_details(&plain).contains("COMPUTE"));
    }

    #[test]
    fn nodes_without_measured_use_render_as_before() {
        let n1 = node("n1").gpushare().gpus(&[16]).build();
        let text = render_top_details(&cluster_usage(
            &[n1],
            &[placed("a", 0, 4)],
            &Settings::default(),
        ));
        assert!(!text.contains("USED"), "{text}");
        assert!(!text.contains("over its share"), "{text}");
    }
}
