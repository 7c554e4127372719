//! Where a drain's bind time goes, from the histograms the processes export: the API server's
//! own time for each Binding (`apiserver_request_duration_seconds` of `pods/binding` POSTs)
//! and, in the chart's drains, the leading extender's bind stages
//! (`gpushare_extender_bind_stage_duration_seconds`). Each is read before and after a drain and
//! the difference summarised, so the figures are the drain's own whatever ran before it.
//! Quantiles are interpolated inside a bucket, as Prometheus' `histogram_quantile` does.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use anyhow::Context;
use kube::Client;

use super::KitCluster;
use super::drain_cost::apiserver_metrics;
use crate::cluster::http_get;

/// A histogram's cumulative buckets (upper bound, count), its sum and its count.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    buckets: Vec<(f64, f64)>,
    sum: f64,
    count: f64,
}

impl Histogram {
    /// What was observed between `before` and `self` (both of the same series).
    pub fn since(&self, before: &Histogram) -> Histogram {
        let earlier = |le: f64| {
            let bucket = before.buckets.iter().find(|(b, _)| *b == le);
            bucket.map_or(0.0, |(_, c)| *c)
        };
        Histogram {
            buckets: self
                .buckets
                .iter()
                .map(|(le, c)| (*le, c - earlier(*le)))
                .collect(),
            sum: self.sum - before.sum,
            count: self.count - before.count,
        }
    }

    /// Observations.
    pub fn count(&self) -> f64 {
        self.count
    }

    /// The mean, in seconds (`None` when nothing was observed).
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum / self.count)
    }

    /// The `q` quantile, in seconds, interpolated inside its bucket (`None` when nothing was
    /// observed; the last finite bound when it falls in the `+Inf` bucket).
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let wanted = q * total;
        let (mut lower, mut below) = (0.0, 0.0);
        for (le, count) in &self.buckets {
            if *count >= wanted {
                if le.is_infinite() {
                    return Some(lower);
                }
                let share = (wanted - below) / (count - below).max(1e-12);
                return Some(lower + (le - lower) * share);
            }
            (lower, below) = (*le, *count);
        }
        Some(lower)
    }

    /// `n=… mean=… p50=… p90=… p99=…`, in milliseconds.
    pub fn summary(&self) -> String {
        let ms = |v: Option<f64>| v.map_or("-".to_owned(), |s| format!("{:.1}ms", s * 1e3));
        format!(
            "n={} mean={} p50={} p90={} p99={}",
            self.count,
            ms(self.mean()),
            ms(self.quantile(0.5)),
            ms(self.quantile(0.9)),
            ms(self.quantile(0.99))
        )
    }
}

/// Every series of histogram `name` in the Prometheus text `text` whose labels (without `le`)
/// pass `keep`, keyed by those labels.
pub fn histograms(
    text: &str,
    name: &str,
    keep: impl Fn(&str) -> bool,
) -> BTreeMap<String, Histogram> {
    let mut found: BTreeMap<String, Histogram> = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let Some((kind, rest)) = rest.split_once('{') else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        let mut le = None;
        let series: Vec<&str> = labels
            .split(',')
            .filter(|label| match label.strip_prefix("le=\"") {
                Some(bound) => {
                    le = bound.trim_end_matches('"').parse::<f64>().ok();
                    false
                }
                None => true,
            })
            .collect();
        let series = series.join(",");
        if !keep(&series) {
            continue;
        }
        let histogram = found.entry(series).or_default();
        match (kind, le) {
            ("_bucket", Some(le)) => histogram.buckets.push((le, value)),
            ("_sum", _) => histogram.sum = value,
            ("_count", _) => histogram.count = value,
            _ => {}
        }
    }
    for histogram in found.values_mut() {
        histogram.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    found
}

/// The histograms a drain's bind latency is read from, at one moment.
#[derive(Debug, Clone, Default)]
pub struct BindLatency {
    /// The API server's own time for `pods/binding` POSTs.
    binding_on_server: Histogram,
    /// The leading extender's bind stages by stage (empty outside the chart's drains).
    extender_stages: BTreeMap<String, Histogram>,
}

impl BindLatency {
    /// Reads them now; `extender` is the leading extender's monitoring address, when the
    /// drain is the chart's.
    pub async fn read(client: &Client, extender: Option<SocketAddr>) -> anyhow::Result<Self> {
        let text = apiserver_metrics(client).await?;
        let binding_on_server = histograms(&text, "apiserver_request_duration_seconds", |l| {
            l.contains("subresource=\"binding\"") && l.contains("verb=\"POST\"")
        })
        .into_values()
        .next()
        .unwrap_or_default();
        let mut extender_stages = BTreeMap::new();
        if let Some(addr) = extender {
            let (status, text) = http_get(addr, "/metrics").await?;
            anyhow::ensure!(status == 200, "the extender's /metrics answered {status}");
            for (labels, histogram) in histograms(
                &text,
                "gpushare_extender_bind_stage_duration_seconds",
                |_| true,
            ) {
                let stage = labels
                    .strip_prefix("stage=\"")
                    .map_or(labels.as_str(), |s| s.trim_end_matches('"'))
                    .to_owned();
                extender_stages.insert(stage, histogram);
            }
        }
        Ok(Self {
            binding_on_server,
            extender_stages,
        })
    }

    /// How long a bind kept the scheduler waiting between `before` and `self`, the median in
    /// seconds, and what it was read from: the extender's whole answer where the extender's
    /// stages were read (the chart's extender-mode drains), elsewhere the API server's own
    /// time for the Bindings (the scheduler waits at least that). `None` when nothing was
    /// observed.
    pub fn bind_p50_since(&self, before: &BindLatency) -> Option<(f64, &'static str)> {
        match self.extender_stages.get("answer") {
            Some(answer) => {
                let earlier = before.extender_stages.get("answer").cloned();
                let p50 = answer.since(&earlier.unwrap_or_default()).quantile(0.5)?;
                Some((p50, "the extender's answer"))
            }
            None => {
                let on_server = self.binding_on_server.since(&before.binding_on_server);
                Some((on_server.quantile(0.5)?, "the Binding on the API server"))
            }
        }
    }

    /// One line per histogram: what was observed between `before` and `self`.
    pub fn lines_since(&self, before: &BindLatency) -> Vec<String> {
        let server = (self.binding_on_server.since(&before.binding_on_server)).summary();
        let mut lines = vec![format!("Binding POST, the API server's own time: {server}")];
        for (stage, histogram) in &self.extender_stages {
            let earlier = before.extender_stages.get(stage).cloned();
            let observed = histogram.since(&earlier.unwrap_or_default()).summary();
            lines.push(format!("extender bind stage {stage}: {observed}"));
        }
        lines
    }
}

/// The leading extender's monitoring address (its pod IP and the chart's `monitorPort`).
pub async fn leader_monitor_addr(cluster: &KitCluster) -> anyhow::Result<SocketAddr> {
    let leader = super::scale::leader_pod(cluster)?;
    let ip = (cluster.system_pod_ip(&leader).await?)
        .with_context(|| format!("{leader} has no pod IP"))?;
    Ok(format!("{ip}:{}", super::scale::EXTENDER_MONITOR_PORT).parse()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP apiserver_request_duration_seconds x
apiserver_request_duration_seconds_bucket{resource="pods",subresource="binding",verb="POST",le="0.01"} 2
apiserver_request_duration_seconds_bucket{resource="pods",subresource="binding",verb="POST",le="0.1"} 6
apiserver_request_duration_seconds_bucket{resource="pods",subresource="binding",verb="POST",le="+Inf"} 8
apiserver_request_duration_seconds_sum{resource="pods",subresource="binding",verb="POST"} 1.6
apiserver_request_duration_seconds_count{resource="pods",subresource="binding",verb="POST"} 8
apiserver_request_duration_seconds_bucket{resource="pods",subresource="",verb="GET",le="0.01"} 100
"#;

    #[test]
    fn a_series_is_read_and_summarised() {
        let found = histograms(TEXT, "apiserver_request_duration_seconds", |l| {
            l.contains("binding")
        });
        assert_eq!(found.len(), 1);
        let histogram = found.into_values().next().unwrap();
        assert_eq!(histogram.count(), 8.0);
        assert_eq!(histogram.mean(), Some(0.2));
        // The 4th of 8 lies halfway through the (0.01, 0.1] bucket's 4.
        let p50 = histogram.quantile(0.5).unwrap();
        assert!((p50 - 0.055).abs() < 1e-9, "{p50}");
        // Beyond the last finite bound: that bound.
        assert_eq!(histogram.quantile(0.99), Some(0.1));
    }

    #[test]
    fn the_difference_is_what_a_drain_observed() {
        let after = histograms(TEXT, "apiserver_request_duration_seconds", |l| {
            l.contains("binding")
        })
        .into_values()
        .next()
        .unwrap();
        let before = Histogram {
            buckets: vec![(0.01, 2.0), (0.1, 2.0), (f64::INFINITY, 2.0)],
            sum: 0.01,
            count: 2.0,
        };
        let drain = after.since(&before);
        assert_eq!(drain.count(), 6.0);
        assert_eq!(drain.quantile(0.5), Some(0.01 + 0.09 * 0.75));
        assert_eq!(
            Histogram::default().since(&Histogram::default()).mean(),
            None
        );
    }

    /// The chart's bind is the extender's whole answer; alone's, the API server's time.
    #[test]
    fn the_bind_p50_is_the_extenders_answer_where_there_is_one() {
        let binding = |count: f64| Histogram {
            buckets: vec![(1.0, count), (f64::INFINITY, count)],
            sum: count / 2.0,
            count,
        };
        let answer = |count: f64| Histogram {
            buckets: vec![(2.0, 0.0), (4.0, count), (f64::INFINITY, count)],
            sum: 3.0 * count,
            count,
        };
        let alone = |count: f64| BindLatency {
            binding_on_server: binding(count),
            extender_stages: BTreeMap::new(),
        };
        let chart = |count: f64| BindLatency {
            extender_stages: [("answer".to_owned(), answer(count))].into(),
            ..alone(count)
        };
        let on_server = "the Binding on the API server";
        assert_eq!(
            alone(10.0).bind_p50_since(&alone(2.0)),
            Some((0.5, on_server))
        );
        let answer = "the extender's answer";
        assert_eq!(chart(10.0).bind_p50_since(&chart(2.0)), Some((3.0, answer)));
        assert_eq!(alone(2.0).bind_p50_since(&alone(2.0)), None);
    }
}
