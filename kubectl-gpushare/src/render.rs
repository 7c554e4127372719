//! Text output of `kubectl gpushare top`: pure functions over [`NodeUsage`], golden-tested.

use std::fmt::Write as _;

use crate::usage::NodeUsage;

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
            let mut rows = vec![header];
            for pod in &node.pods {
                let mut row = vec![pod.namespace.clone(), pod.name.clone()];
                row.extend(node.gpus.iter().map(|g| {
                    let gib = if pod.gpu == Some(g.index) { pod.gib } else { 0 };
                    gib.to_string()
                }));
                row.push(if pod.gpu.is_none() { pod.gib } else { 0 }.to_string());
                rows.push(row);
            }
            out.push_str(&table(&rows));
        }
        out.push('\n');
        let mut rows = vec![
            ["GPU", "MODEL", "UUID", "ALLOCATED/TOTAL", "HEALTHY"]
                .map(str::to_owned)
                .to_vec(),
        ];
        for gpu in &node.gpus {
            rows.push(vec![
                format!("GPU{}", gpu.index),
                or_dash(&gpu.model),
                or_dash(&gpu.uuid),
                format!(
                    "{}/{} ({}%)",
                    gpu.allocated_gib,
                    gpu.total_gib,
                    percent(gpu.allocated_gib, gpu.total_gib)
                ),
                if gpu.healthy { "yes" } else { "no" }.to_owned(),
            ]);
        }
        rows.push(vec![
            "PENDING".to_owned(),
            "-".to_owned(),
            "-".to_owned(),
            node.pending_gib().to_string(),
            "-".to_owned(),
        ]);
        out.push_str(&table(&rows));
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
