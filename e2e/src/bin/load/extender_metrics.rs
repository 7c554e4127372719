//! What the drive cost, read from outside the drive: the extender's `/metrics` (bind
//! outcomes, its own handler time), the API server's request counts and the Events written.
//!
//! Kept apart from the drive because these are the counters read before and after it; the
//! report is their change.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use anyhow::Context;
use gpushare_e2e::apiserver::{ApiServer, Verb};
use gpushare_e2e::cluster::http_get;
use gpushare_e2e::realk8s::latency::{Histogram, histograms};

use crate::extender::NAMESPACE;

/// Events in the pods' namespace by `<component>/<reason>`, counting repeats (`count`, or the
/// series count): which writes besides the Bindings the drive caused.
pub async fn events_by_reason(client: &kube::Client) -> anyhow::Result<BTreeMap<String, u64>> {
    use k8s_openapi::api::core::v1::Event;
    let api: kube::Api<Event> = kube::Api::namespaced(client.clone(), NAMESPACE);
    let list = api
        .list(&Default::default())
        .await
        .context("listing Events")?;
    let mut by_reason = BTreeMap::new();
    for event in list.items {
        let component = event
            .reporting_component
            .clone()
            .filter(|c| !c.is_empty())
            .or_else(|| event.source.as_ref().and_then(|s| s.component.clone()))
            .unwrap_or_else(|| "?".to_owned());
        let reason = event.reason.clone().unwrap_or_default();
        let repeats = event
            .series
            .as_ref()
            .and_then(|s| s.count)
            .or(event.count)
            .and_then(|n| u64::try_from(n).ok())
            .unwrap_or(1)
            .max(1);
        *by_reason
            .entry(format!("{component}/{reason}"))
            .or_default() += repeats;
    }
    Ok(by_reason)
}

/// GET and LIST requests on pods and nodes so far: what the extender reads besides its watches.
pub fn api_reads(api: &ApiServer) -> u64 {
    let stats = api.stats();
    [Verb::Get, Verb::List]
        .iter()
        .flat_map(|verb| ["pods", "nodes"].map(|resource| stats.count(*verb, resource)))
        .sum()
}

/// `gpushare_extender_binds_total` by reason, from the extender's `/metrics`.
pub async fn bind_outcomes(addr: SocketAddr) -> BTreeMap<String, u64> {
    let Ok((200, text)) = http_get(addr, "/metrics").await else {
        return BTreeMap::new();
    };
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("gpushare_extender_binds_total{")?;
            let (labels, value) = rest.split_once("} ")?;
            let reason = labels
                .split(',')
                .find_map(|label| label.strip_prefix("reason=\""))?
                .trim_end_matches('"');
            let value = value.split_whitespace().next()?.parse::<f64>().ok()?;
            // Counters are whole numbers.
            Some((reason.to_owned(), value as u64))
        })
        .collect()
}

/// `gpushare_extender_request_duration_seconds` by verb, from `/metrics`: the time the
/// extender spent in each handler, without transport or the caller's queueing.
pub async fn handler_seconds(addr: SocketAddr) -> BTreeMap<String, Histogram> {
    match http_get(addr, "/metrics").await {
        Ok((200, text)) => parse_handler_seconds(&text),
        _ => BTreeMap::new(),
    }
}

/// The extender's request-duration histograms in an OpenMetrics text, by verb.
pub fn parse_handler_seconds(text: &str) -> BTreeMap<String, Histogram> {
    let all = histograms(text, "gpushare_extender_request_duration_seconds", |_| true);
    let verb = |labels: String| {
        labels
            .trim_start_matches("verb=\"")
            .trim_end_matches('"')
            .to_owned()
    };
    all.into_iter()
        .map(|(labels, h)| (verb(labels), h))
        .collect()
}

/// `filter 0.912 ms, prioritize …`: mean handler time per verb between two scrapes.
pub fn describe_handler_time(
    before: &BTreeMap<String, Histogram>,
    after: &BTreeMap<String, Histogram>,
) -> String {
    let parts: Vec<String> = ["filter", "prioritize", "bind"]
        .iter()
        .filter_map(|verb| {
            let earlier = before.get(*verb).cloned().unwrap_or_default();
            let mean = after.get(*verb)?.since(&earlier).mean()?;
            Some(format!("{verb} {:.3} ms", mean * 1e3))
        })
        .collect();
    if parts.is_empty() {
        "unavailable".to_owned()
    } else {
        format!("mean {}", parts.join(", "))
    }
}

/// `bound=1998 unfit=2`: the change of each reason between two scrapes.
pub fn describe_outcomes(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> String {
    let parts: Vec<String> = after
        .iter()
        .filter_map(|(reason, n)| {
            let delta = n.saturating_sub(before.get(reason).copied().unwrap_or(0));
            (delta > 0).then(|| format!("{reason}={delta}"))
        })
        .collect();
    if parts.is_empty() {
        "none".to_owned()
    } else {
        parts.join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn handler_time_from_the_extenders_own_metrics() {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = gpushare_extender::metrics::Metrics::register(&mut registry);
        let mut encoded = String::new();
        prometheus_client::encoding::text::encode(&mut encoded, &registry).unwrap();
        let before = parse_handler_seconds(&encoded);
        metrics.observe("filter", Instant::now() - Duration::from_millis(3));
        metrics.observe("filter", Instant::now() - Duration::from_millis(1));
        let mut encoded = String::new();
        prometheus_client::encoding::text::encode(&mut encoded, &registry).unwrap();
        let after = parse_handler_seconds(&encoded);
        assert_eq!(after["filter"].count(), 2.0, "{encoded}");
        let text = describe_handler_time(&before, &after);
        let mean: f64 = text
            .strip_prefix("mean filter ")
            .and_then(|t| t.strip_suffix(" ms"))
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("{text}"));
        // At least the 3 ms and 1 ms the two calls were started before.
        assert!((2.0..1000.0).contains(&mean), "{text}");
        assert_eq!(describe_handler_time(&after, &after), "unavailable");
    }

    #[test]
    fn outcome_deltas() {
        let before = BTreeMap::from([("bound".to_owned(), 1), ("unfit".to_owned(), 2)]);
        let after = BTreeMap::from([("bound".to_owned(), 11), ("unfit".to_owned(), 2)]);
        assert_eq!(describe_outcomes(&before, &after), "bound=10");
        assert_eq!(describe_outcomes(&after, &after), "none");
    }
}
