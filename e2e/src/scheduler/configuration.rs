//! Reads a `KubeSchedulerConfiguration` (`kubescheduler.config.k8s.io/v1`) into the driver's
//! [`SchedulerConfig`], so an end-to-end test runs the scheduler the chart configures rather than
//! a hand-written copy of it.
//!
//! Only what the driver models is accepted: one profile, `NodeResourcesFit`'s `scoringStrategy`
//! (LeastAllocated or MostAllocated), `percentageOfNodesToScore` (global or the profile's),
//! turning off score plugins it does not run, `PodTopologySpread` without default spreading
//! (it spreads nothing), and the extender fields kube-scheduler's HTTP extender client reads.
//! Anything else is an error, so a chart change the driver cannot follow fails the test that
//! renders it instead of being silently ignored.
//! Validation follows upstream where it matters here: a prioritize verb needs a positive weight,
//! resource weights lie in 1..=100, `percentageOfNodesToScore` in 0..=100.

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use serde::Deserialize;

use super::framework::{CPU, FitScoring, FitStrategy, MEMORY};
use super::{ExtenderConfig, SchedulerConfig};

/// Upstream's `httpTimeout` when the configuration leaves it out.
const DEFAULT_EXTENDER_HTTP_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Configuration {
    api_version: String,
    kind: String,
    // Read by serde only: accepted, not modelled, as none changes a placement here.
    /// Which replica schedules; one driver runs.
    #[allow(dead_code)]
    leader_election: Option<serde_yaml::Value>,
    /// The API client's rate limits: the driver's client has none.
    #[allow(dead_code)]
    client_connection: Option<serde_yaml::Value>,
    /// Goroutines for filtering and scoring: speed only.
    #[allow(dead_code)]
    parallelism: Option<i64>,
    /// Every profile's, unless the profile sets its own.
    percentage_of_nodes_to_score: Option<i64>,
    #[serde(default)]
    profiles: Vec<Profile>,
    #[serde(default)]
    extenders: Vec<Extender>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Profile {
    scheduler_name: Option<String>,
    percentage_of_nodes_to_score: Option<i64>,
    plugins: Option<Plugins>,
    #[serde(default)]
    plugin_config: Vec<PluginConfig>,
}

/// A profile's `plugins`: only score plugins turned off, and only ones the driver does not
/// score anyway (so turning them off changes nothing it models).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Plugins {
    score: Option<PluginSet>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PluginSet {
    #[serde(default)]
    disabled: Vec<PluginRef>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PluginRef {
    name: String,
}

/// Score plugins of the default profile the driver does not run: it scores with
/// `NodeResourcesFit` and `NodeResourcesBalancedAllocation` only, so these may be turned off.
const UNMODELLED_SCORE_PLUGINS: [&str; 2] = ["ImageLocality", "PodTopologySpread"];

/// `PodTopologySpread`'s args: the driver spreads nothing, which is what `defaultingType:
/// List` with no default constraints configures for pods without constraints of their own.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PodTopologySpreadArgs {
    defaulting_type: Option<String>,
    #[serde(default)]
    default_constraints: Vec<serde_yaml::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PluginConfig {
    name: String,
    args: serde_yaml::Value,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct NodeResourcesFitArgs {
    scoring_strategy: Option<ScoringStrategy>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ScoringStrategy {
    #[serde(rename = "type")]
    strategy: Option<String>,
    #[serde(default)]
    resources: Vec<ResourceSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ResourceSpec {
    name: String,
    weight: i64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Extender {
    url_prefix: String,
    filter_verb: Option<String>,
    /// Accepted as the chart renders it, and not acted on: this driver has no PostFilter
    /// (preemption runs on the real cluster only).
    preempt_verb: Option<String>,
    prioritize_verb: Option<String>,
    #[serde(default)]
    weight: i64,
    bind_verb: Option<String>,
    #[serde(rename = "enableHTTPS", default)]
    enable_https: bool,
    /// Certificates are the harness's own; the caller supplies them.
    #[allow(dead_code)] // read by serde only: accepted, replaced by the caller
    tls_config: Option<serde_yaml::Value>,
    http_timeout: Option<String>,
    #[serde(default)]
    node_cache_capable: bool,
    #[serde(default)]
    managed_resources: Vec<ManagedResource>,
    #[serde(default)]
    ignorable: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ManagedResource {
    name: String,
    /// `true` would make kube-scheduler's fit skip the resource; the driver always counts it.
    #[serde(default)]
    ignored_by_scheduler: bool,
}

impl SchedulerConfig {
    /// The driver configuration a `KubeSchedulerConfiguration` file describes; fields the file
    /// does not set keep `base`'s values (queue timing, bind parallelism, seed). Extender TLS
    /// material is not read: set [`ExtenderConfig::tls`] afterwards.
    pub fn from_kube_scheduler_configuration(
        text: &str,
        base: SchedulerConfig,
    ) -> anyhow::Result<SchedulerConfig> {
        let config: Configuration =
            serde_yaml::from_str(text).context("parsing the KubeSchedulerConfiguration")?;
        ensure!(
            config.api_version == "kubescheduler.config.k8s.io/v1"
                && config.kind == "KubeSchedulerConfiguration",
            "not a kubescheduler.config.k8s.io/v1 KubeSchedulerConfiguration: {} {}",
            config.api_version,
            config.kind
        );
        let mut driver = base;
        if let Some(percentage) = config.percentage_of_nodes_to_score {
            driver.percentage_of_nodes_to_score = percentage_of_nodes_to_score(percentage)?;
        }
        match config.profiles.as_slice() {
            [] => {}
            [profile] => {
                if let Some(name) = &profile.scheduler_name {
                    driver.scheduler_name.clone_from(name);
                }
                if let Some(percentage) = profile.percentage_of_nodes_to_score {
                    driver.percentage_of_nodes_to_score = percentage_of_nodes_to_score(percentage)?;
                }
                if let Some(score) = profile.plugins.as_ref().and_then(|p| p.score.as_ref()) {
                    for plugin in &score.disabled {
                        ensure!(
                            UNMODELLED_SCORE_PLUGINS.contains(&plugin.name.as_str()),
                            "score plugin {} turned off: the driver models turning off only {UNMODELLED_SCORE_PLUGINS:?}",
                            plugin.name
                        );
                    }
                }
                driver.fit_scoring = fit_scoring(&profile.plugin_config)?;
            }
            more => bail!("{} profiles: the driver runs one", more.len()),
        }
        driver.extenders = config
            .extenders
            .into_iter()
            .map(extender_config)
            .collect::<anyhow::Result<_>>()?;
        Ok(driver)
    }
}

/// Upstream's validation: "not in valid range [0-100]"; 0 is the adaptive default.
fn percentage_of_nodes_to_score(percentage: i64) -> anyhow::Result<u32> {
    ensure!(
        (0..=100).contains(&percentage),
        "percentageOfNodesToScore {percentage} is not in valid range [0-100]"
    );
    Ok(u32::try_from(percentage)?)
}

fn fit_scoring(plugin_config: &[PluginConfig]) -> anyhow::Result<FitScoring> {
    let mut scoring = FitScoring::default();
    for plugin in plugin_config {
        if plugin.name == "PodTopologySpread" {
            let args: PodTopologySpreadArgs = serde_yaml::from_value(plugin.args.clone())
                .context("PodTopologySpread args the driver does not model")?;
            ensure!(
                args.defaulting_type.as_deref() == Some("List")
                    && args.default_constraints.is_empty(),
                "PodTopologySpread: the driver spreads nothing, so it models only defaultingType List without defaultConstraints"
            );
            continue;
        }
        ensure!(
            plugin.name == "NodeResourcesFit",
            "pluginConfig for {}: the driver models only NodeResourcesFit's scoringStrategy",
            plugin.name
        );
        let args: NodeResourcesFitArgs = serde_yaml::from_value(plugin.args.clone())
            .context("NodeResourcesFit args the driver does not model")?;
        let Some(strategy) = args.scoring_strategy else {
            continue;
        };
        scoring.strategy = match strategy.strategy.as_deref() {
            None | Some("LeastAllocated") => FitStrategy::LeastAllocated,
            Some("MostAllocated") => FitStrategy::MostAllocated,
            Some(other) => bail!("scoringStrategy type {other} is not modelled"),
        };
        scoring.resources = if strategy.resources.is_empty() {
            vec![(CPU.to_owned(), 1), (MEMORY.to_owned(), 1)]
        } else {
            strategy
                .resources
                .into_iter()
                .map(|r| {
                    ensure!(
                        (1..=100).contains(&r.weight),
                        "resource {} weight {} is not in 1..=100",
                        r.name,
                        r.weight
                    );
                    Ok((r.name, r.weight))
                })
                .collect::<anyhow::Result<_>>()?
        };
    }
    Ok(scoring)
}

fn extender_config(extender: Extender) -> anyhow::Result<ExtenderConfig> {
    let verb = |v: Option<String>| v.filter(|v| !v.is_empty());
    if let Some(preempt) = verb(extender.preempt_verb) {
        tracing::debug!(%preempt, "preemptVerb ignored: the driver does not preempt");
    }
    let prioritize_verb = verb(extender.prioritize_verb);
    ensure!(
        prioritize_verb.is_none() || extender.weight > 0,
        "extender weight {} with a prioritize verb: must have a positive weight applied to it",
        extender.weight
    );
    let http_timeout = match &extender.http_timeout {
        Some(text) => go_duration(text)?,
        None => DEFAULT_EXTENDER_HTTP_TIMEOUT,
    };
    Ok(ExtenderConfig {
        url_prefix: extender.url_prefix,
        filter_verb: verb(extender.filter_verb),
        prioritize_verb,
        bind_verb: verb(extender.bind_verb),
        weight: extender.weight,
        node_cache_capable: extender.node_cache_capable,
        managed_resources: extender
            .managed_resources
            .into_iter()
            .map(|r| {
                ensure!(
                    !r.ignored_by_scheduler,
                    "managed resource {}: ignoredByScheduler is not modelled",
                    r.name
                );
                Ok(r.name)
            })
            .collect::<anyhow::Result<_>>()?,
        ignorable: extender.ignorable,
        http_timeout,
        enable_https: extender.enable_https,
        tls: None,
    })
}

/// A Go `time.Duration` string as `metav1.Duration` writes it: `5s`, `1m30s`, `500ms`.
fn go_duration(text: &str) -> anyhow::Result<Duration> {
    let mut total = Duration::ZERO;
    let mut rest = text.trim();
    ensure!(!rest.is_empty(), "empty duration");
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .context(format!("duration {text:?} lacks a unit"))?;
        let value: f64 = rest[..digits]
            .parse()
            .with_context(|| format!("duration {text:?}"))?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let seconds = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            unit => bail!("duration {text:?}: unknown unit {unit:?}"),
        };
        total += Duration::from_secs_f64(value * seconds);
        rest = &rest[unit_len..];
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> anyhow::Result<SchedulerConfig> {
        SchedulerConfig::from_kube_scheduler_configuration(text, SchedulerConfig::default())
    }

    const CHART_LIKE: &str = r#"
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
leaderElection:
  leaderElect: true
profiles:
  - schedulerName: gpushare-scheduler
    percentageOfNodesToScore: 1
    pluginConfig:
      - name: NodeResourcesFit
        args:
          scoringStrategy:
            type: MostAllocated
            resources:
              - name: example.com/gpu-mem
                weight: 1
extenders:
  - urlPrefix: https://gpushare-extender.kube-system.svc:39999/gpushare-scheduler
    filterVerb: filter
    bindVerb: bind
    enableHTTPS: true
    tlsConfig:
      caFile: /etc/ca.crt
    nodeCacheCapable: true
    httpTimeout: 5s
    ignorable: false
    managedResources:
      - name: example.com/gpu-mem
        ignoredByScheduler: false
"#;

    #[test]
    fn reads_the_profile_scoring_and_the_extender() {
        let config = parse(CHART_LIKE).unwrap();
        assert_eq!(config.scheduler_name, "gpushare-scheduler");
        assert_eq!(config.percentage_of_nodes_to_score, 1);
        assert_eq!(config.fit_scoring.strategy, FitStrategy::MostAllocated);
        assert_eq!(
            config.fit_scoring.resources,
            vec![("example.com/gpu-mem".to_owned(), 1)]
        );
        let [extender] = config.extenders.as_slice() else {
            panic!("one extender expected");
        };
        assert_eq!(extender.filter_verb.as_deref(), Some("filter"));
        assert_eq!(extender.prioritize_verb, None);
        assert_eq!(extender.bind_verb.as_deref(), Some("bind"));
        assert_eq!(extender.http_timeout, Duration::from_secs(5));
        assert!(extender.node_cache_capable && extender.enable_https && !extender.ignorable);
        assert_eq!(extender.managed_resources, vec!["example.com/gpu-mem"]);
    }

    #[test]
    fn refuses_what_the_driver_does_not_model_or_upstream_rejects() {
        let unknown_plugin =
            CHART_LIKE.replace("name: NodeResourcesFit", "name: PodTopologySpread");
        let ratio = CHART_LIKE.replace("MostAllocated", "RequestedToCapacityRatio");
        let weightless = CHART_LIKE.replace(
            "bindVerb: bind",
            "bindVerb: bind\n    prioritizeVerb: prioritize",
        );
        let heavy = CHART_LIKE.replace("weight: 1", "weight: 101");
        let unknown_field =
            CHART_LIKE.replace("ignorable: false", "ignorable: false\n    retries: 3");
        let ignored = CHART_LIKE.replace("ignoredByScheduler: false", "ignoredByScheduler: true");
        for text in [
            unknown_plugin,
            ratio,
            weightless,
            heavy,
            unknown_field,
            ignored,
        ] {
            assert!(parse(&text).is_err(), "accepted:\n{text}");
        }
    }

    #[test]
    fn the_profile_percentage_of_nodes_to_score_wins_over_the_global_one() {
        let adaptive = CHART_LIKE.replace("    percentageOfNodesToScore: 1\n", "");
        let config = parse(&adaptive).unwrap();
        assert_eq!(config.percentage_of_nodes_to_score, 0);
        let global = adaptive.replace(
            "leaderElection:",
            "percentageOfNodesToScore: 30\nleaderElection:",
        );
        let config = parse(&global).unwrap();
        assert_eq!(config.percentage_of_nodes_to_score, 30);
        let both = CHART_LIKE.replace(
            "leaderElection:",
            "percentageOfNodesToScore: 30\nleaderElection:",
        );
        let config = parse(&both).unwrap();
        assert_eq!(config.percentage_of_nodes_to_score, 1);
        for bad in ["101", "-1"] {
            let text = CHART_LIKE.replace(
                "percentageOfNodesToScore: 1",
                &format!("percentageOfNodesToScore: {bad}"),
            );
            let err = parse(&text).unwrap_err();
            assert!(format!("{err:#}").contains("[0-100]"), "{err:#}");
        }
    }

    #[test]
    fn go_durations_parse_like_metav1() {
        assert_eq!(go_duration("5s").unwrap(), Duration::from_secs(5));
        assert_eq!(go_duration("1m30s").unwrap(), Duration::from_secs(90));
        assert_eq!(go_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(go_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert!(go_duration("5").is_err());
        assert!(go_duration("5d").is_err());
    }
}
