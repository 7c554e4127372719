//! `gpushare-extender check-routing`: the chart's post-install and post-upgrade hook.
//!
//! Why: `helm install` returns the moment its objects exist, but the API server loads a new
//! MutatingAdmissionPolicy (and the allocation ValidatingAdmissionPolicy) a moment later, and
//! a webhook routes nothing until an extender replica is Ready. A GPU pod created in between
//! keeps `default-scheduler`: the allocation policy refuses it, or, before that policy is
//! loaded too, it is placed with no gpushare decision and fails at the device plugin's
//! Allocate. Seen on a real 1.36 cluster with pods created within a second of the install.
//!
//! The hook makes `helm install` and `helm upgrade` return only once the API server routes
//! GPU pods itself. It asks with server-side dry-run creates (admission runs, nothing is
//! stored), every half second until the timeout:
//! 1. a pod asking for the resource must come back with gpushare's `schedulerName`;
//! 2. with the allocation policy installed, a pod carrying a forged allocation annotation
//!    must be refused (asked only after 1 passed in the same round, so a refusal from RBAC
//!    cannot pass for the policy's).
//!
//! It needs `create` on pods in one namespace the routing covers; the chart grants it to the
//! hook's own ServiceAccount for the hook's lifetime only.

use std::time::{Duration, Instant};

use clap::Parser;
use gpushare_contract::DEFAULT_RESOURCE;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::PostParams;

use crate::config::LogFormat;

/// The first argument that selects this job instead of the extender.
pub const SUBCOMMAND: &str = "check-routing";

/// Configuration of `gpushare-extender check-routing`.
#[derive(Debug, Clone, Parser)]
#[command(name = "gpushare-extender check-routing", version, about)]
pub struct RoutingCheckConfig {
    /// Namespace of the dry-run pods: one the routing covers (not excluded, not kube-system).
    #[arg(long, env = "GPUSHARE_CHECK_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// What the dry-run pods ask for and what must come back.
    #[command(flatten)]
    pub probe: RoutingProbe,
    /// Give up (and fail the hook, so helm reports it) after this many seconds.
    #[arg(long, env = "GPUSHARE_CHECK_TIMEOUT_SECONDS", default_value_t = 240)]
    pub timeout_seconds: u64,
    /// Log format.
    #[arg(long, env = "GPUSHARE_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

/// The dry-run pods' request and the answer routing must give (also `check-install`'s).
#[derive(Debug, Clone, clap::Args)]
pub struct RoutingProbe {
    /// The extended resource GPU pods ask for.
    #[arg(long, env = "GPUSHARE_RESOURCE", default_value = DEFAULT_RESOURCE)]
    pub resource: String,
    /// The scheduler a routed GPU pod must name.
    #[arg(
        long,
        env = "GPUSHARE_SCHEDULER_NAME",
        default_value = "gpushare-scheduler"
    )]
    pub scheduler_name: String,
    /// An annotation key the allocation policy refuses on a pod created by anyone but
    /// gpushare (`<domain>/v1.<anything>`); empty when no allocation policy is installed.
    #[arg(long, env = "GPUSHARE_FORGED_ANNOTATION", default_value = "")]
    pub forged_annotation: String,
    /// The image of the dry-run pods (never pulled or run: they are not stored). Admission
    /// sees it, so a cluster with an image allowlist needs one it allows (the chart passes
    /// `routingCheck.probeImage`, through `global.imageRegistry`).
    #[arg(
        long,
        env = "GPUSHARE_CHECK_PROBE_IMAGE",
        default_value = "registry.k8s.io/pause:3.10"
    )]
    pub probe_image: String,
}

/// Why routing is not (yet) in place.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No client for the API server.
    #[error("no Kubernetes client: {0}")]
    Client(#[source] kube::Error),
    /// The timeout passed before both checks held.
    #[error(
        "GPU pods were still not routed by the API server after {seconds} s: {reason}. \
         GPU pods created now would keep default-scheduler; check the routing policy or \
         webhook (kubectl gpushare doctor)"
    )]
    NotRouted {
        /// The timeout, in seconds.
        seconds: u64,
        /// The last round's finding.
        reason: String,
    },
}

/// Asks until the API server routes GPU pods, or the timeout passes.
pub async fn run(config: RoutingCheckConfig) -> Result<(), Error> {
    let client = kube::Client::try_default().await.map_err(Error::Client)?;
    let pods: Api<Pod> = Api::namespaced(client, &config.namespace);
    let started = Instant::now();
    let deadline = started + Duration::from_secs(config.timeout_seconds);
    let mut last_logged: Option<Instant> = None;
    loop {
        let Err(finding) = ask_once(&pods, &config.probe).await else {
            break;
        };
        if Instant::now() >= deadline {
            return Err(Error::NotRouted {
                seconds: config.timeout_seconds,
                reason: finding,
            });
        }
        if last_logged.is_none_or(|at| at.elapsed() >= Duration::from_secs(5)) {
            tracing::info!(%finding, "GPU pods not routed yet; asking again");
            last_logged = Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tracing::info!(
        seconds = started.elapsed().as_secs_f64(),
        scheduler = %config.probe.scheduler_name,
        "the API server routes GPU pods"
    );
    Ok(())
}

/// One round of both checks with `pods` (of a namespace the routing covers): `Ok` when the
/// API server routes GPU pods (and refuses forged allocations), else what it did instead.
pub async fn ask_once(pods: &Api<Pod>, config: &RoutingProbe) -> Result<(), String> {
    let dry_run = PostParams {
        dry_run: true,
        field_manager: Some("gpushare-routing-check".to_owned()),
    };
    routed(
        &pods.create(&dry_run, &probe_pod(config, None)).await,
        &config.scheduler_name,
    )?;
    if config.forged_annotation.is_empty() {
        return Ok(());
    }
    let forged = probe_pod(config, Some(&config.forged_annotation));
    refused(&pods.create(&dry_run, &forged).await)
}

/// The dry-run pod: one container asking for 1 unit of the resource, no `schedulerName`,
/// and `forged` as an allocation annotation when given.
///
/// It is admitted like any pod of the namespace, so it meets Pod Security `restricted`
/// (non-root, no privilege escalation, no capabilities, seccomp `RuntimeDefault`) and has
/// CPU and memory requests and limits (a ResourceQuota may require them): a namespace that
/// enforces either must not fail `helm install`.
fn probe_pod(config: &RoutingProbe, forged: Option<&str>) -> Pod {
    let mut pod = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gpushare-routing-check"},
        "spec": {
            "securityContext": {
                "runAsNonRoot": true,
                "runAsUser": 65535,
                "runAsGroup": 65535,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [{
                "name": "check",
                "image": config.probe_image,
                "resources": {
                    "requests": {"cpu": "10m", "memory": "16Mi"},
                    "limits": {config.resource.as_str(): "1", "cpu": "10m", "memory": "16Mi"},
                },
                "securityContext": {
                    "allowPrivilegeEscalation": false,
                    "readOnlyRootFilesystem": true,
                    "capabilities": {"drop": ["ALL"]},
                },
            }],
        },
    });
    if let Some(key) = forged {
        pod["metadata"]["annotations"] = serde_json::json!({ key: "0" });
    }
    // A literal of Pod's own fields: it always deserializes.
    serde_json::from_value(pod).unwrap_or_default()
}

/// Whether the answer to the plain dry-run pod shows it routed to `scheduler`.
fn routed(answer: &Result<Pod, kube::Error>, scheduler: &str) -> Result<(), String> {
    match answer {
        Ok(pod) => {
            let got = pod
                .spec
                .as_ref()
                .and_then(|s| s.scheduler_name.as_deref())
                .unwrap_or("");
            if got == scheduler {
                Ok(())
            } else {
                Err(format!(
                    "a GPU pod was admitted with schedulerName {got:?}, not {scheduler:?}"
                ))
            }
        }
        Err(kube::Error::Api(status)) => Err(format!(
            "a GPU pod was refused ({}): {}",
            status.code, status.message
        )),
        Err(error) => Err(format!("the API server did not answer: {error}")),
    }
}

/// Whether the answer to the forged pod is the allocation policy's refusal.
fn refused(answer: &Result<Pod, kube::Error>) -> Result<(), String> {
    match answer {
        Err(kube::Error::Api(status)) if matches!(status.code, 403 | 422) => Ok(()),
        Err(kube::Error::Api(status)) => Err(format!(
            "a pod with a forged allocation annotation got {} rather than a refusal: {}",
            status.code, status.message
        )),
        Err(error) => Err(format!("the API server did not answer: {error}")),
        Ok(_) => Err(
            "a pod with a forged allocation annotation was admitted: the allocation policy \
             is not in force yet"
                .to_owned(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> RoutingProbe {
        RoutingCheckConfig::parse_from([
            "check-routing",
            "--scheduler-name=gpushare-scheduler",
            "--forged-annotation=gpushare.example.com/v1.check",
        ])
        .probe
    }

    fn api_error(code: u16, message: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure(message, "Forbidden")
                .with_code(code)
                .boxed(),
        )
    }

    fn with_scheduler(name: Option<&str>) -> Pod {
        let mut pod = probe_pod(&config(), None);
        pod.spec.get_or_insert_default().scheduler_name = name.map(str::to_owned);
        pod
    }

    #[test]
    fn the_probe_asks_for_the_resource_and_names_no_scheduler() {
        let pod = probe_pod(&config(), None);
        let spec = pod.spec.expect("spec");
        assert_eq!(spec.scheduler_name, None);
        let limits = spec.containers[0]
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .expect("limits");
        assert_eq!(limits["example.com/gpu-mem"].0, "1");
        assert_eq!(pod.metadata.annotations, None);
        // Pod Security `restricted`, checked field by field as the API server's admission does.
        let pod_security = spec.security_context.as_ref().expect("pod securityContext");
        assert_eq!(pod_security.run_as_non_root, Some(true));
        assert!(pod_security.run_as_user.is_some_and(|uid| uid != 0));
        assert_eq!(
            pod_security
                .seccomp_profile
                .as_ref()
                .map(|p| p.type_.as_str()),
            Some("RuntimeDefault")
        );
        let container = &spec.containers[0];
        let security = container
            .security_context
            .as_ref()
            .expect("securityContext");
        assert_eq!(security.allow_privilege_escalation, Some(false));
        assert_eq!(security.privileged, None);
        let drop = security.capabilities.as_ref().and_then(|c| c.drop.as_ref());
        assert_eq!(drop.map(Vec::as_slice), Some(&["ALL".to_owned()][..]));
        assert!(spec.volumes.is_none() && spec.host_network.is_none());
        // A ResourceQuota on CPU and memory needs both requests and limits.
        let resources = container.resources.as_ref().expect("resources");
        for list in [&resources.requests, &resources.limits] {
            let list = list.as_ref().expect("requests and limits");
            assert!(list.contains_key("cpu") && list.contains_key("memory"));
        }
        let forged = probe_pod(&config(), Some("gpushare.example.com/v1.check"));
        assert!(
            forged
                .metadata
                .annotations
                .expect("annotations")
                .contains_key("gpushare.example.com/v1.check")
        );
    }

    #[test]
    fn only_a_pod_back_with_our_scheduler_counts_as_routed() {
        assert!(
            routed(
                &Ok(with_scheduler(Some("gpushare-scheduler"))),
                "gpushare-scheduler"
            )
            .is_ok()
        );
        let default = routed(
            &Ok(with_scheduler(Some("default-scheduler"))),
            "gpushare-scheduler",
        );
        assert!(default.unwrap_err().contains("\"default-scheduler\""));
        assert!(routed(&Ok(with_scheduler(None)), "gpushare-scheduler").is_err());
        let refused_create = routed(&Err(api_error(403, "denied")), "gpushare-scheduler");
        assert!(
            refused_create
                .unwrap_err()
                .contains("refused (403): denied")
        );
    }

    #[test]
    fn only_a_refusal_counts_as_the_policy_in_force() {
        assert!(refused(&Err(api_error(403, "forged"))).is_ok());
        assert!(refused(&Err(api_error(422, "invalid"))).is_ok());
        assert!(refused(&Err(api_error(500, "etcd"))).is_err());
        let admitted = refused(&Ok(with_scheduler(Some("gpushare-scheduler"))));
        assert!(admitted.unwrap_err().contains("not in force yet"));
    }
}
