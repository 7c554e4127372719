//! Talking to the cluster: connect through the usual kubeconfig, read nodes and pods, probe
//! the extender. Every failure says where it tried to go and what to check.

use std::path::Path;
use std::time::Duration;

use http_body_util::{BodyExt as _, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingAdmissionPolicy, MutatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::doctor::{DevicePluginSpec, Install, LeaderLease, Routing, SchedulerDeployment};

/// How long one probe of the extender may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the cluster could not be read.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The kubeconfig could not be loaded.
    #[error("cannot load a kubeconfig{}: {source}; check KUBECONFIG or pass --kubeconfig", path.as_deref().map(|p| format!(" from {p}")).unwrap_or_default())]
    Config {
        /// the file given with --kubeconfig, if any
        path: Option<String>,
        /// the cause
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The API server did not answer.
    #[error("cannot reach the cluster at {url}: {source}; check KUBECONFIG")]
    Unreachable {
        /// the API server URL from the kubeconfig
        url: String,
        /// the cause
        #[source]
        source: kube::Error,
    },
    /// The API server answered with an error (e.g. forbidden).
    #[error("the cluster at {url} refused to {what}: {source}")]
    Refused {
        /// the API server URL
        url: String,
        /// what was attempted
        what: String,
        /// the API error
        #[source]
        source: kube::Error,
    },
}

/// A connected client and the URL it talks to.
#[derive(Clone)]
pub struct Cluster {
    client: kube::Client,
    url: String,
}

impl Cluster {
    /// Connects through `kubeconfig` or, without one, the usual inference (KUBECONFIG,
    /// ~/.kube/config, in-cluster).
    pub async fn connect(kubeconfig: Option<&Path>) -> Result<Self, Error> {
        let config_error = |source: Box<dyn std::error::Error + Send + Sync>| Error::Config {
            path: kubeconfig.map(|p| p.display().to_string()),
            source,
        };
        let config = match kubeconfig {
            Some(path) => {
                let file = Kubeconfig::read_from(path).map_err(|e| config_error(Box::new(e)))?;
                kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                    .await
                    .map_err(|e| config_error(Box::new(e)))?
            }
            None => kube::Config::infer()
                .await
                .map_err(|e| config_error(Box::new(e)))?,
        };
        let url = config.cluster_url.to_string();
        let client = kube::Client::try_from(config).map_err(|e| config_error(Box::new(e)))?;
        Ok(Self { client, url })
    }

    /// The underlying client.
    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    fn classify(&self, what: &str, source: kube::Error) -> Error {
        match source {
            kube::Error::Api(_) => Error::Refused {
                url: self.url.clone(),
                what: what.to_owned(),
                source,
            },
            source => Error::Unreachable {
                url: self.url.clone(),
                source,
            },
        }
    }

    /// Every node.
    pub async fn nodes(&self) -> Result<Vec<Node>, Error> {
        Api::<Node>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .map(|list| list.items)
            .map_err(|e| self.classify("list nodes", e))
    }

    /// Every pod in every namespace.
    pub async fn pods(&self) -> Result<Vec<Pod>, Error> {
        Api::<Pod>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .map(|list| list.items)
            .map_err(|e| self.classify("list pods", e))
    }

    /// The chart's objects of kind `K` for `component` in the install namespace (selected by
    /// the chart's `app.kubernetes.io/{name,component}` labels).
    async fn chart_objects<K>(&self, install: &Install, component: &str) -> Result<Vec<K>, String>
    where
        K: kube::Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
            + Clone
            + k8s_openapi::serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        let params = ListParams::default().labels(&format!(
            "app.kubernetes.io/name=gpushare,app.kubernetes.io/component={component}"
        ));
        Api::<K>::namespaced(self.client.clone(), &install.namespace)
            .list(&params)
            .await
            .map(|list| list.items)
            .map_err(|e| e.to_string())
    }

    /// The chart's cluster-wide objects of `component` (admission configuration), by name;
    /// none where the cluster does not serve the kind (404).
    async fn chart_cluster_objects<K>(&self, component: &str) -> Result<Vec<String>, String>
    where
        K: kube::Resource<Scope = kube::core::ClusterResourceScope, DynamicType = ()>
            + Clone
            + k8s_openapi::serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        let params = ListParams::default().labels(&format!(
            "app.kubernetes.io/name=gpushare,app.kubernetes.io/component={component}"
        ));
        match Api::<K>::all(self.client.clone()).list(&params).await {
            Ok(list) => Ok(list
                .items
                .into_iter()
                .filter_map(|o| o.meta().name.clone())
                .collect()),
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(Vec::new()),
            Err(err) => Err(err.to_string()),
        }
    }

    /// What routes GPU pods to the dedicated scheduler. A cluster that does not serve
    /// MutatingAdmissionPolicies (before 1.36, or with the API off) has none of them.
    pub async fn routing(&self) -> Result<Routing, String> {
        let policies = self
            .chart_cluster_objects::<MutatingAdmissionPolicy>("routing-policy")
            .await?;
        let webhooks = self
            .chart_cluster_objects::<MutatingWebhookConfiguration>("webhook")
            .await?;
        Ok(Routing { policies, webhooks })
    }

    /// The chart's scheduler Deployments in the install namespace.
    pub async fn scheduler_deployments(
        &self,
        install: &Install,
    ) -> Result<Vec<SchedulerDeployment>, String> {
        let list: Vec<Deployment> = self.chart_objects(install, "scheduler").await?;
        Ok(list
            .into_iter()
            .map(|d| SchedulerDeployment {
                name: d.metadata.name.unwrap_or_default(),
                ready: d.status.and_then(|s| s.ready_replicas).unwrap_or(0),
                desired: d.spec.and_then(|s| s.replicas).unwrap_or(1),
            })
            .collect())
    }

    /// The chart's device plugin DaemonSets in the install namespace, with the enforcement
    /// mode their `device-plugin` container runs with (see [`crate::doctor::enforcement_of`]).
    pub async fn device_plugin_daemonsets(
        &self,
        install: &Install,
    ) -> Result<Vec<DevicePluginSpec>, String> {
        let list: Vec<DaemonSet> = self.chart_objects(install, "device-plugin").await?;
        Ok(list
            .into_iter()
            .map(|ds| {
                let container = ds
                    .spec
                    .and_then(|spec| spec.template.spec)
                    .and_then(|spec| {
                        spec.containers
                            .into_iter()
                            .find(|c| c.name == "device-plugin")
                    });
                let args = container
                    .as_ref()
                    .and_then(|c| c.args.clone())
                    .unwrap_or_default();
                let env: Vec<(String, String)> = container
                    .and_then(|c| c.env)
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|var| Some((var.name, var.value?)))
                    .collect();
                DevicePluginSpec {
                    name: ds.metadata.name.unwrap_or_default(),
                    enforcement: crate::doctor::enforcement_of(&args, &env),
                }
            })
            .collect())
    }

    /// The extender's Lease (named like its Service): who leads, and how fresh it is.
    pub async fn extender_lease(&self, install: &Install) -> Result<Option<LeaderLease>, String> {
        use k8s_openapi::api::coordination::v1::Lease;
        let lease = Api::<Lease>::namespaced(self.client.clone(), &install.namespace)
            .get_opt(&install.extender_service)
            .await
            .map_err(|e| e.to_string())?;
        Ok(lease.map(|lease| {
            let spec = lease.spec.unwrap_or_default();
            let now = k8s_openapi::jiff::Timestamp::now();
            LeaderLease {
                holder: spec.holder_identity.filter(|h| !h.is_empty()).map(|h| {
                    h.rsplit_once('_')
                        .map_or(h.clone(), |(pod, _)| pod.to_owned())
                }),
                renewed_ago: spec.renew_time.and_then(|t| {
                    let ago = now.duration_since(t.0);
                    std::time::Duration::try_from(ago).ok()
                }),
                duration: std::time::Duration::from_secs(
                    u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0),
                ),
            }
        }))
    }

    /// GETs the extender's `/healthz` through the API server's service proxy.
    pub async fn extender_health_via_proxy(&self, install: &Install) -> Result<String, String> {
        let path = format!(
            "/api/v1/namespaces/{}/services/{}:http/proxy/healthz",
            install.namespace, install.extender_service
        );
        let request = http::Request::get(&path)
            .body(Vec::new())
            .map_err(|e| e.to_string())?;
        match tokio::time::timeout(PROBE_TIMEOUT, self.client.request_text(request)).await {
            Ok(Ok(_)) => Ok(format!("through the API server proxy {path}")),
            Ok(Err(e)) => Err(format!("GET {path}: {e}")),
            Err(_) => Err(format!("GET {path}: no answer within {PROBE_TIMEOUT:?}")),
        }
    }
}

/// GETs `<base>/healthz` directly (e.g. through `kubectl port-forward`).
pub async fn extender_health_direct(base: &str) -> Result<String, String> {
    let url = format!("{}/healthz", base.trim_end_matches('/'));
    let uri: http::Uri = url.parse().map_err(|e| format!("bad URL {url}: {e}"))?;
    let client: HttpClient<_, Empty<Bytes>> =
        HttpClient::builder(TokioExecutor::new()).build_http();
    let call = async {
        let response = client.get(uri).await.map_err(|e| e.to_string())?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        if status.is_success() {
            Ok(format!("GET {url}: {status}"))
        } else {
            Err(format!(
                "GET {url}: {status} {}",
                String::from_utf8_lossy(&body).trim()
            ))
        }
    };
    match tokio::time::timeout(PROBE_TIMEOUT, call).await {
        Ok(result) => result.map_err(|e| format!("GET {url}: {e}")),
        Err(_) => Err(format!("GET {url}: no answer within {PROBE_TIMEOUT:?}")),
    }
}
