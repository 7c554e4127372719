//! The chart, rendered by helm as release [`RELEASE`] in [`RELEASE_NAMESPACE`]: the
//! webhook configuration of dedicated mode,
//! and the dedicated scheduler's configuration; and the ServiceAccounts our binaries act as.
//!
//! Separate so that the harness runs what the chart ships, rendered in one place, rather
//! than a copy of it.

use std::path::Path;

use anyhow::{Context, bail};
use kube::Client;
use serde::Deserialize as _;

/// The Helm release the harness renders the chart as; the ServiceAccount names follow from it.
pub const RELEASE: &str = "gpushare";

/// The namespace of that release.
pub const RELEASE_NAMESPACE: &str = "kube-system";

/// The username the extender acts as: the chart's extender ServiceAccount.
pub const EXTENDER_USER: &str = "system:serviceaccount:kube-system:gpushare-extender";

/// The username every device plugin acts as: the chart's device plugin ServiceAccount.
pub const DEVICE_PLUGIN_USER: &str = "system:serviceaccount:kube-system:gpushare-device-plugin";

/// Renders one template of the chart (release [`RELEASE`] in [`RELEASE_NAMESPACE`],
/// `default-scheduler` mode unless `sets` say otherwise).
pub fn render_chart_template(template: &str, sets: &[&str]) -> anyhow::Result<String> {
    let helm = crate::tools::helm()?;
    let chart = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("workspace root")?
        .join("charts/gpushare");
    let mut command = std::process::Command::new(helm);
    command
        .args(["template", RELEASE])
        .arg(&chart)
        .args(["--namespace", RELEASE_NAMESPACE])
        .args(["--show-only", template])
        .args(["--set", "scheduler.mode=default-scheduler"]);
    for set in sets {
        command.args(["--set", set]);
    }
    let output = command.output().context("running helm template")?;
    if !output.status.success() {
        bail!(
            "helm template of {template} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8(output.stdout)?)
}

/// The `scheduler-config.yaml` of the chart's dedicated scheduler, rendered with the policy
/// the extender runs (its `--policy=` flag in `extender_args`, else the chart's default) and
/// the extra chart `values` (`key=value`).
pub async fn dedicated_scheduler_configuration(
    extender_args: &[String],
    values: &[String],
) -> anyhow::Result<String> {
    let mut sets = vec!["scheduler.mode=dedicated".to_owned()];
    if let Some(policy) = extender_args
        .iter()
        .find_map(|a| a.strip_prefix("--policy="))
    {
        sets.push(format!("policy={policy}"));
    }
    sets.extend(values.iter().cloned());
    let rendered = tokio::task::spawn_blocking(move || {
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        render_chart_template("templates/scheduler.yaml", &sets)
    })
    .await??;
    for document in serde_yaml::Deserializer::from_str(&rendered) {
        let value = serde_yaml::Value::deserialize(document)?;
        if value.get("kind").and_then(|k| k.as_str()) != Some("ConfigMap") {
            continue;
        }
        if let Some(text) = value
            .get("data")
            .and_then(|d| d.get("scheduler-config.yaml"))
            .and_then(|t| t.as_str())
        {
            return Ok(text.to_owned());
        }
    }
    bail!("the chart's scheduler.yaml renders no scheduler-config.yaml")
}

/// Creates the chart's MutatingWebhookConfiguration (dedicated mode, rendered by helm) as
/// `helm install` would: without a caBundle, which the extender patches in once it runs.
pub(super) async fn install_webhook_configuration(client: &Client) -> anyhow::Result<()> {
    use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
    let yaml = tokio::task::spawn_blocking(|| {
        render_chart_template("templates/webhook.yaml", &["scheduler.mode=dedicated"])
    })
    .await??;
    let config: MutatingWebhookConfiguration = serde_yaml::from_str(&yaml)?;
    kube::Api::<MutatingWebhookConfiguration>::all(client.clone())
        .create(&kube::api::PostParams::default(), &config)
        .await?;
    Ok(())
}
