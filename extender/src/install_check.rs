//! `gpushare-extender check-install`: the chart's `helm test`.
//!
//! Why: `helm install` and the routing hook say the objects exist and the API server routes
//! GPU pods, not that a GPU pod would run: an extender that never synced, a Lease nobody
//! renews, a device plugin that never registered on a labelled node (another plugin holding
//! the resource, a kubelet without the device-plugin directory) all pass `helm install`.
//! `helm test` runs this in a pod with the release's own view of the cluster and fails with
//! the reason, as `kubectl gpushare doctor` would tell an admin at a terminal:
//! 1. the extender answers `/readyz` through its Service (synced, reaching the API server);
//! 2. a replica leads: the extender's Lease has a holder and is renewed while we watch
//!    (two reads with a different `resourceVersion`: no clock is compared), and the holder
//!    is a Ready pod;
//! 3. every node with the participation label offers GPU memory: the resource in its
//!    allocatable (extender mode), or a ResourceSlice of the driver with devices (DRA mode);
//! 4. GPU pods are routed ([`crate::routing_check::ask_once`]), where the chart routes them.
//!
//! Checks are asked again every two seconds until all hold or the timeout passes; then each
//! finding is printed, and the job fails naming those that did not hold.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use clap::Parser;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::Api;
use kube::api::ListParams;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::config::LogFormat;
use crate::routing_check::{self, RoutingProbe};

/// The first argument that selects this job instead of the extender.
pub const SUBCOMMAND: &str = "check-install";

/// Configuration of `gpushare-extender check-install`.
#[derive(Debug, Clone, Parser)]
#[command(name = "gpushare-extender check-install", version, about)]
pub struct InstallCheckConfig {
    /// The release namespace: the extender's Lease and pods live there.
    #[arg(
        long,
        env = "GPUSHARE_RELEASE_NAMESPACE",
        default_value = "kube-system"
    )]
    pub release_namespace: String,
    /// The extender's monitoring address through its Service (`host:port`), whose `/readyz`
    /// must answer 200; empty where no extender runs (DRA mode without ranking).
    #[arg(long, env = "GPUSHARE_CHECK_EXTENDER", default_value = "")]
    pub extender: String,
    /// The extenders' Lease (in the release namespace); empty: not checked.
    #[arg(long, env = "GPUSHARE_LEADER_LEASE", default_value = "")]
    pub leader_lease: String,
    /// The label selector of the nodes the node plugin runs on (`gpushare=true`).
    #[arg(long, env = "GPUSHARE_NODE_SELECTOR", default_value = "gpushare=true")]
    pub node_selector: String,
    /// DRA mode: the driver whose ResourceSlice each such node must have, instead of the
    /// resource (`--resource`).
    #[arg(long, env = "GPUSHARE_DRA_DRIVER", default_value = "")]
    pub dra_driver: String,
    /// Ask whether GPU pods are routed, in this namespace (dry-run creates); empty: not
    /// checked (no routing installed).
    #[arg(long, env = "GPUSHARE_CHECK_NAMESPACE", default_value = "")]
    pub routing_namespace: String,
    /// The resource each labelled node must offer (extender mode), what the dry-run pods ask
    /// for, and the routing they must get (as `check-routing`'s).
    #[command(flatten)]
    pub probe: RoutingProbe,
    /// Fail after this many seconds if a check still does not hold.
    #[arg(long, env = "GPUSHARE_CHECK_TIMEOUT_SECONDS", default_value_t = 60)]
    pub timeout_seconds: u64,
    /// Log format.
    #[arg(long, env = "GPUSHARE_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

/// Why the installation check failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No client for the API server.
    #[error("no Kubernetes client: {0}")]
    Client(#[source] kube::Error),
    /// Some checks did not hold by the timeout.
    #[error("{} check(s) failed after {seconds} s: {}", failed.len(), failed.join("; "))]
    Failed {
        /// The timeout, in seconds.
        seconds: u64,
        /// What each failed check found.
        failed: Vec<String>,
    },
}

/// One check's outcome in a round.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Finding {
    /// What was checked.
    check: &'static str,
    /// What was found: `Ok` the evidence, `Err` what is wrong and what to do.
    outcome: Result<String, String>,
}

/// What one round remembers for the next: the Lease's last `resourceVersion`.
#[derive(Debug, Default)]
struct Memory {
    lease_version: Option<String>,
}

/// Runs the checks until all hold or the timeout passes; prints each finding.
pub async fn run(config: InstallCheckConfig) -> Result<(), Error> {
    let client = kube::Client::try_default().await.map_err(Error::Client)?;
    let deadline = Instant::now() + Duration::from_secs(config.timeout_seconds);
    let mut memory = Memory::default();
    loop {
        let findings = round(&client, &config, &mut memory).await;
        let failed: Vec<String> = findings
            .iter()
            .filter_map(|f| {
                f.outcome
                    .as_ref()
                    .err()
                    .map(|e| format!("{}: {e}", f.check))
            })
            .collect();
        if failed.is_empty() || Instant::now() >= deadline {
            for finding in &findings {
                match &finding.outcome {
                    Ok(evidence) => println!("ok    {}: {evidence}", finding.check),
                    Err(problem) => println!("FAIL  {}: {problem}", finding.check),
                }
            }
            if failed.is_empty() {
                return Ok(());
            }
            return Err(Error::Failed {
                seconds: config.timeout_seconds,
                failed,
            });
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// One round of every check that applies.
async fn round(
    client: &kube::Client,
    config: &InstallCheckConfig,
    memory: &mut Memory,
) -> Vec<Finding> {
    let mut findings = Vec::new();
    if !config.extender.is_empty() {
        findings.push(Finding {
            check: "extender ready",
            outcome: readyz(&config.extender).await,
        });
    }
    if !config.leader_lease.is_empty() {
        findings.push(Finding {
            check: "extender leading",
            outcome: leading(client, config, memory).await,
        });
    }
    findings.push(Finding {
        check: "plugin on labelled nodes",
        outcome: nodes_offer_gpus(client, config).await,
    });
    if !config.routing_namespace.is_empty() {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &config.routing_namespace);
        findings.push(Finding {
            check: "GPU pods routed",
            outcome: routing_check::ask_once(&pods, &config.probe)
                .await
                .map(|()| {
                    format!(
                        "a GPU pod in {} is admitted for {}",
                        config.routing_namespace, config.probe.scheduler_name
                    )
                })
                .map_err(|reason| format!("{reason} (kubectl gpushare doctor)")),
        });
    }
    findings
}

/// `GET /readyz` at `address` (`host:port`), over plain HTTP/1.0.
async fn readyz(address: &str) -> Result<String, String> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(address).await?;
        let host = address.rsplit_once(':').map_or(address, |(host, _)| host);
        let request = format!("GET /readyz HTTP/1.0\r\nHost: {host}\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut answer = Vec::new();
        stream.take(4096).read_to_end(&mut answer).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&answer).into_owned())
    };
    let answer = match tokio::time::timeout(Duration::from_secs(5), exchange).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(error)) => return Err(format!("cannot reach {address}: {error}")),
        Err(_) => return Err(format!("{address} did not answer within 5 s")),
    };
    readyz_verdict(address, &answer)
}

/// Reads an HTTP answer to `GET /readyz`.
fn readyz_verdict(address: &str, answer: &str) -> Result<String, String> {
    let status = answer.lines().next().unwrap_or_default();
    let body = answer
        .split_once("\r\n\r\n")
        .map_or("", |(_, body)| body)
        .trim();
    if status.split_whitespace().nth(1) == Some("200") {
        Ok(format!("{address} answers /readyz"))
    } else {
        Err(format!(
            "{address} answers /readyz with {status:?}: {body} (kubectl logs of the extender say why)"
        ))
    }
}

/// Whether a replica holds the Lease, renews it between two rounds, and is a Ready pod.
async fn leading(
    client: &kube::Client,
    config: &InstallCheckConfig,
    memory: &mut Memory,
) -> Result<String, String> {
    let namespace = &config.release_namespace;
    let name = &config.leader_lease;
    let lease = Api::<Lease>::namespaced(client.clone(), namespace)
        .get_opt(name)
        .await
        .map_err(|e| format!("cannot read Lease {namespace}/{name}: {e}"))?
        .ok_or_else(|| {
            format!("no Lease {namespace}/{name}: no extender replica has run for election")
        })?;
    let holder = lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.clone())
        .unwrap_or_default();
    let pod_name = holder_pod(&holder).ok_or_else(|| {
        format!("Lease {namespace}/{name} has no holder: no extender replica leads, so none binds")
    })?;
    let version = lease.metadata.resource_version.clone();
    let renewed = memory
        .lease_version
        .replace(version.clone().unwrap_or_default());
    match renewed {
        Some(before) if Some(before.as_str()) != version.as_deref() => {}
        Some(_) => {
            return Err(format!(
                "{holder} holds Lease {namespace}/{name} but did not renew it between two reads: the leader is stuck or gone"
            ));
        }
        None => {
            return Err(format!(
                "{holder} holds Lease {namespace}/{name}; waiting for a renewal"
            ));
        }
    }
    let pod = Api::<Pod>::namespaced(client.clone(), namespace)
        .get_opt(pod_name)
        .await
        .map_err(|e| format!("cannot read the leader's pod {namespace}/{pod_name}: {e}"))?
        .ok_or_else(|| format!("the Lease names pod {pod_name}, which does not exist"))?;
    if pod_ready(&pod) {
        Ok(format!(
            "{pod_name} leads and renews Lease {namespace}/{name}"
        ))
    } else {
        Err(format!("the leader {pod_name} is not Ready"))
    }
}

/// The pod name in a `holderIdentity` (`<pod>_<random>`, [`crate::leader::identity`]).
fn holder_pod(holder: &str) -> Option<&str> {
    let pod = holder.rsplit_once('_').map_or(holder, |(pod, _)| pod);
    (!pod.is_empty()).then_some(pod)
}

fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
        })
}

/// Whether every node matching the selector offers GPU memory.
async fn nodes_offer_gpus(
    client: &kube::Client,
    config: &InstallCheckConfig,
) -> Result<String, String> {
    let selector = &config.node_selector;
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default().labels(selector))
        .await
        .map_err(|e| format!("cannot list nodes {selector}: {e}"))?
        .items;
    let offering = if config.dra_driver.is_empty() {
        None
    } else {
        let slices = Api::<ResourceSlice>::all(client.clone())
            .list(&ListParams::default())
            .await
            .map_err(|e| format!("cannot list ResourceSlices: {e}"))?
            .items;
        Some(nodes_with_devices(&slices, &config.dra_driver))
    };
    let names: Vec<String> = nodes.iter().map(kube::ResourceExt::name_any).collect();
    let missing: Vec<String> = nodes
        .iter()
        .filter(|node| match &offering {
            Some(with_devices) => !with_devices.contains(&kube::ResourceExt::name_any(*node)),
            None => !offers(node, &config.probe.resource),
        })
        .map(kube::ResourceExt::name_any)
        .collect();
    let what = if config.dra_driver.is_empty() {
        config.probe.resource.as_str()
    } else {
        "a ResourceSlice of the driver"
    };
    nodes_verdict(selector, what, &names, &missing)
}

/// Whether `node` has `resource` allocatable, more than zero.
fn offers(node: &Node, resource: &str) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .and_then(|a| a.get(resource))
        .is_some_and(|q| !matches!(q.0.trim(), "" | "0"))
}

/// The nodes that have a ResourceSlice of `driver` with at least one device.
fn nodes_with_devices(slices: &[ResourceSlice], driver: &str) -> BTreeSet<String> {
    slices
        .iter()
        .filter(|s| s.spec.driver == driver)
        .filter(|s| s.spec.devices.as_ref().is_some_and(|d| !d.is_empty()))
        .filter_map(|s| s.spec.node_name.clone())
        .collect()
}

/// The finding over the labelled nodes `names`, of which `missing` offer nothing.
fn nodes_verdict(
    selector: &str,
    what: &str,
    names: &[String],
    missing: &[String],
) -> Result<String, String> {
    if names.is_empty() {
        return Err(format!(
            "no node is labelled {selector}: label the GPU nodes (kubectl label node NODE {selector})"
        ));
    }
    if missing.is_empty() {
        return Ok(format!(
            "{} node(s) labelled {selector} offer {what}",
            names.len()
        ));
    }
    Err(format!(
        "{} of {} node(s) labelled {selector} offer no {what}: {}; the node plugin has not \
         registered there (kubectl gpushare doctor; its pod's logs on that node say why)",
        missing.len(),
        names.len(),
        missing.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readyz_passes_on_200_only_and_quotes_the_body() {
        let ok = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
        assert!(readyz_verdict("x:9090", ok).is_ok());
        let unsynced = "HTTP/1.1 503 Service Unavailable\r\n\r\nthe view has not synced";
        let error = readyz_verdict("x:9090", unsynced).unwrap_err();
        assert!(
            error.contains("503") && error.contains("not synced"),
            "{error}"
        );
        assert!(readyz_verdict("x:9090", "").is_err());
    }

    #[test]
    fn the_holder_names_its_pod() {
        assert_eq!(
            holder_pod("gpushare-extender-7c9-abc_4f2a"),
            Some("gpushare-extender-7c9-abc")
        );
        assert_eq!(holder_pod("plain"), Some("plain"));
        assert_eq!(holder_pod(""), None);
        assert_eq!(holder_pod("_x"), None);
    }

    fn node(name: &str, allocatable: Option<&str>) -> Node {
        let mut node = Node::default();
        node.metadata.name = Some(name.to_owned());
        if let Some(quantity) = allocatable {
            node.status = Some(k8s_openapi::api::core::v1::NodeStatus {
                allocatable: Some(
                    [(
                        "example.com/gpu-mem".to_owned(),
                        k8s_openapi::apimachinery::pkg::api::resource::Quantity(quantity.into()),
                    )]
                    .into(),
                ),
                ..Default::default()
            });
        }
        node
    }

    #[test]
    fn a_labelled_node_without_the_resource_fails_by_name() {
        assert!(offers(&node("a", Some("32")), "example.com/gpu-mem"));
        assert!(!offers(&node("b", Some("0")), "example.com/gpu-mem"));
        assert!(!offers(&node("c", None), "example.com/gpu-mem"));
        let names = ["a".to_owned(), "b".to_owned()];
        let error =
            nodes_verdict("gpushare=true", "example.com/gpu-mem", &names, &names[1..]).unwrap_err();
        assert!(
            error.starts_with("1 of 2 node(s)") && error.contains(": b;"),
            "{error}"
        );
        assert!(
            nodes_verdict("gpushare=true", "x", &[], &[])
                .unwrap_err()
                .contains("kubectl label node")
        );
        assert!(nodes_verdict("gpushare=true", "x", &names, &[]).is_ok());
    }

    #[test]
    fn only_slices_of_the_driver_with_devices_count() {
        let slice = |driver: &str, node: &str, devices: usize| {
            let mut s = ResourceSlice::default();
            s.spec.driver = driver.to_owned();
            s.spec.node_name = Some(node.to_owned());
            s.spec.devices = Some(vec![Default::default(); devices]);
            s
        };
        let slices = [
            slice("gpushare.example.com", "a", 2),
            slice("gpushare.example.com", "b", 0),
            slice("gpu.nvidia.com", "c", 1),
        ];
        let with = nodes_with_devices(&slices, "gpushare.example.com");
        assert_eq!(with, BTreeSet::from(["a".to_owned()]));
    }
}
