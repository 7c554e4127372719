//! How much GPU memory a pod asks for, read from its spec the way kubelet counts it.
//!
//! Per container, the limit of the resource (or, without a limit, the request). Init
//! containers run one at a time before the app containers, so the pod needs
//! `max(sum over app containers and sidecars, largest plain init container)`. Native sidecars
//! (init containers with `restartPolicy: Always`) keep running beside the app containers and
//! count toward the sum.
//!
//! Only whole, non-negative GiB are valid: `4` is; `4.5`, `-1`, `10G`, `4Gi` and values over
//! [`crate::MAX_GIB`] are rejected with an error that names the pod, container and value.

use k8s_openapi::api::core::v1::{Container, Pod};
use serde::{Deserialize, Serialize};

use crate::MAX_GIB;

/// One container's share of the pod's request, in kubelet's admission order. Also the element
/// of the `<domain>/v1.containers` annotation: `{"name":"main","gib":4,"init":false}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerRequest {
    /// Container name (unique across init and app containers of a pod).
    pub name: String,
    /// Whole GiB requested; never zero (containers asking for nothing are left out).
    pub gib: u64,
    /// True for init containers (including sidecars).
    #[serde(default)]
    pub init: bool,
}

/// What a pod asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRequest {
    /// The containers that ask for the resource, init containers first, in spec order.
    pub containers: Vec<ContainerRequest>,
    /// GiB the pod holds on its GPU while it runs.
    pub pod_gib: u64,
}

/// Why a pod's request cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The quantity is not a whole number of GiB.
    #[error(
        "pod {pod}: container {container} asks for {resource}: {value:?}, which is not a whole number of GiB (write e.g. \"4\")"
    )]
    NotWholeGib {
        /// namespace/name
        pod: String,
        /// container name
        container: String,
        /// the resource name
        resource: String,
        /// the value as written
        value: String,
    },
    /// The quantity is larger than any GPU could be.
    #[error(
        "pod {pod}: container {container} asks for {value} GiB of {resource}, more than the {max} GiB limit"
    )]
    TooLarge {
        /// namespace/name
        pod: String,
        /// container name
        container: String,
        /// the resource name
        resource: String,
        /// the value as written
        value: String,
        /// the limit
        max: u64,
    },
}

/// Reads `pod`'s request for `resource`; `Ok(None)` when it asks for none.
pub fn pod_request(pod: &Pod, resource: &str) -> Result<Option<PodRequest>, RequestError> {
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(None);
    };
    let pod_key = pod_key(pod);
    let mut containers = Vec::new();
    let mut sidecar_sum = 0u64;
    let mut largest_init = 0u64;
    for container in spec.init_containers.iter().flatten() {
        let Some(gib) = container_gib(&pod_key, container, resource)? else {
            continue;
        };
        if container.restart_policy.as_deref() == Some("Always") {
            sidecar_sum += gib;
        } else {
            largest_init = largest_init.max(gib);
        }
        containers.push(ContainerRequest {
            name: container.name.clone(),
            gib,
            init: true,
        });
    }
    let mut app_sum = 0u64;
    for container in &spec.containers {
        let Some(gib) = container_gib(&pod_key, container, resource)? else {
            continue;
        };
        app_sum += gib;
        containers.push(ContainerRequest {
            name: container.name.clone(),
            gib,
            init: false,
        });
    }
    if containers.is_empty() {
        return Ok(None);
    }
    Ok(Some(PodRequest {
        containers,
        pod_gib: (app_sum + sidecar_sum).max(largest_init),
    }))
}

/// `namespace/name` of a pod, for messages.
pub fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or("<unnamed>")
    )
}

fn container_gib(
    pod: &str,
    container: &Container,
    resource: &str,
) -> Result<Option<u64>, RequestError> {
    let Some(resources) = container.resources.as_ref() else {
        return Ok(None);
    };
    let quantity = resources
        .limits
        .as_ref()
        .and_then(|limits| limits.get(resource))
        .or_else(|| {
            resources
                .requests
                .as_ref()
                .and_then(|requests| requests.get(resource))
        });
    let Some(quantity) = quantity else {
        return Ok(None);
    };
    let value = quantity.0.trim();
    let gib = parse_whole_gib(value).ok_or_else(|| RequestError::NotWholeGib {
        pod: pod.to_owned(),
        container: container.name.clone(),
        resource: resource.to_owned(),
        value: value.to_owned(),
    })?;
    if gib > MAX_GIB {
        return Err(RequestError::TooLarge {
            pod: pod.to_owned(),
            container: container.name.clone(),
            resource: resource.to_owned(),
            value: value.to_owned(),
            max: MAX_GIB,
        });
    }
    Ok((gib > 0).then_some(gib))
}

/// A plain decimal integer, as the API server canonicalises whole quantities. Digits only:
/// signs, fractions, exponents and suffixes are refused.
fn parse_whole_gib(value: &str) -> Option<u64> {
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // Only digits: the parse fails only on overflow, which is absurdly large.
    Some(value.parse().unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodSpec, ResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use std::collections::BTreeMap;

    const RES: &str = "example.com/gpu-mem";

    fn container(name: &str, limit: Option<&str>, request: Option<&str>) -> Container {
        let map =
            |v: Option<&str>| v.map(|v| BTreeMap::from([(RES.to_owned(), Quantity(v.to_owned()))]));
        Container {
            name: name.into(),
            resources: Some(ResourceRequirements {
                limits: map(limit),
                requests: map(request),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn pod(init: Vec<Container>, app: Vec<Container>) -> Pod {
        let mut pod = Pod {
            spec: Some(PodSpec {
                init_containers: Some(init),
                containers: app,
                ..Default::default()
            }),
            ..Default::default()
        };
        pod.metadata.name = Some("p".into());
        pod.metadata.namespace = Some("ns".into());
        pod
    }

    #[test]
    fn sums_app_containers_and_takes_largest_init() {
        let p = pod(
            vec![container("init", Some("6"), None)],
            vec![
                container("a", Some("2"), None),
                container("b", None, Some("3")),
            ],
        );
        let req = pod_request(&p, RES).unwrap().unwrap();
        assert_eq!(req.pod_gib, 6);
        let names: Vec<_> = req
            .containers
            .iter()
            .map(|c| (c.name.as_str(), c.gib, c.init))
            .collect();
        assert_eq!(
            names,
            vec![("init", 6, true), ("a", 2, false), ("b", 3, false)]
        );

        let p = pod(
            vec![container("init", Some("1"), None)],
            vec![container("a", Some("4"), None)],
        );
        assert_eq!(pod_request(&p, RES).unwrap().unwrap().pod_gib, 4);
    }

    #[test]
    fn sidecars_count_toward_the_sum() {
        let mut sidecar = container("proxy", Some("1"), None);
        sidecar.restart_policy = Some("Always".into());
        let p = pod(vec![sidecar], vec![container("a", Some("4"), None)]);
        assert_eq!(pod_request(&p, RES).unwrap().unwrap().pod_gib, 5);
    }

    #[test]
    fn limit_wins_over_request_and_zero_means_none() {
        let p = pod(vec![], vec![container("a", Some("4"), Some("2"))]);
        assert_eq!(pod_request(&p, RES).unwrap().unwrap().pod_gib, 4);
        let p = pod(vec![], vec![container("a", Some("0"), None)]);
        assert_eq!(pod_request(&p, RES).unwrap(), None);
        let p = pod(
            vec![],
            vec![Container {
                name: "a".into(),
                ..Default::default()
            }],
        );
        assert_eq!(pod_request(&p, RES).unwrap(), None);
    }

    #[test]
    fn malformed_quantities_name_the_pod_and_value() {
        for bad in ["4.5", "-1", "10G", "4Gi", "", "1e3", "+4"] {
            let p = pod(vec![], vec![container("main", Some(bad), None)]);
            let err = pod_request(&p, RES).unwrap_err();
            assert!(
                matches!(err, RequestError::NotWholeGib { .. }),
                "{bad}: {err}"
            );
            let text = err.to_string();
            assert!(text.contains("ns/p") && text.contains("main"), "{text}");
        }
        for huge in ["4097", "99999999999999999999999"] {
            let p = pod(vec![], vec![container("main", Some(huge), None)]);
            let err = pod_request(&p, RES).unwrap_err();
            assert!(
                matches!(err, RequestError::TooLarge { .. }),
                "{huge}: {err}"
            );
            assert!(err.to_string().contains(huge));
        }
    }
}
