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
//!
//! # More than one GPU
//!
//! The resource is always the pod's total. Two pod annotations, read by [`pod_request_with`],
//! say how that total is laid out:
//!
//! ```yaml
//! metadata:
//!   annotations:
//!     gpushare.example.com/gpus: "2"          # spread evenly over 2 GPUs of one node
//!     gpushare.example.com/exclusive: "true"  # optional: those GPUs are the pod's alone
//! spec:
//!   containers:
//!   - name: train
//!     resources:
//!       limits:
//!         example.com/gpu-mem: 16              # 8 GiB on each of the 2 GPUs
//! ```
//!
//! - Every container that asks for the resource sees all N GPUs and gets `gib / N` on each,
//!   so each container's GiB must be a multiple of N (an error says so otherwise).
//! - `exclusive` takes whole GPUs with at least `total / N` GiB each: the pod books every
//!   byte of them and no other pod is placed there. A whole-GPU pod on 2 × 24 GiB GPUs writes
//!   `gpu-mem: 48`; on nodes with larger GPUs it still takes them whole.
//! - Why the total and not a per-GPU amount: kube-scheduler and kubelet count the resource
//!   per node, and the node advertises its GPUs' total. The total keeps their fit right (an
//!   exclusive pod on GPUs larger than it asked for holds more than kubelet counts; the
//!   extender, which books the whole GPUs, is the one that keeps others off them).
//! - Limits: all of a pod's GPU containers share the same N GPUs with the same split; at most
//!   [`MAX_GPUS_PER_POD`] GPUs, all on one node.

use k8s_openapi::api::core::v1::{Container, Pod};
use serde::{Deserialize, Serialize};

use crate::{Keys, MAX_GIB};

/// The most GPUs one pod may spread over.
pub const MAX_GPUS_PER_POD: u32 = 16;

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
    /// GiB the pod holds while it runs, over all its GPUs.
    pub pod_gib: u64,
    /// How many GPUs of one node the memory is spread over, evenly (1 unless the pod's
    /// `<domain>/gpus` annotation says more; see the module doc).
    pub gpus: u32,
    /// Whether the pod takes its GPUs whole (`<domain>/exclusive: "true"`).
    pub exclusive: bool,
    /// GPU models allowed (`name`) or refused (`!name`), as written in `<domain>/gpu-model`;
    /// empty for any model.
    pub models: Vec<String>,
}

impl PodRequest {
    /// GiB the pod holds on each of its GPUs.
    pub fn gib_per_gpu(&self) -> u64 {
        self.pod_gib / u64::from(self.gpus.max(1))
    }

    /// Whether the pod needs anything but a shared slice of one GPU.
    pub fn is_multi(&self) -> bool {
        self.gpus > 1 || self.exclusive
    }
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
    /// An annotation that shapes the request is malformed.
    #[error("pod {pod}: annotation {key} is {value:?}; {expected}")]
    BadAnnotation {
        /// namespace/name
        pod: String,
        /// the annotation key
        key: String,
        /// its value
        value: String,
        /// what it should be
        expected: String,
    },
    /// A container's GiB cannot be split evenly over the pod's GPUs.
    #[error(
        "pod {pod}: container {container} asks for {gib} GiB spread over {gpus} GPUs; with {key} the GiB of every container must be a multiple of {gpus}"
    )]
    Uneven {
        /// namespace/name
        pod: String,
        /// container name
        container: String,
        /// its GiB
        gib: u64,
        /// number of GPUs
        gpus: u32,
        /// the annotation key
        key: String,
    },
}

/// Reads `pod`'s request for `resource` with its layout over GPUs: the one parse of a pod's
/// request, which the webhook, the extender (its view, whose reading bind and filter use, and
/// preempt) and `kubectl gpushare` all call, so they never read a pod differently (the `<domain>/gpus` and
/// `<domain>/exclusive` annotations, see the module doc); `Ok(None)` when it asks for none.
pub fn pod_request_with(
    pod: &Pod,
    resource: &str,
    keys: &Keys,
) -> Result<Option<PodRequest>, RequestError> {
    let Some(mut request) = pod_request(pod, resource)? else {
        return Ok(None);
    };
    let annotations = pod.metadata.annotations.as_ref();
    let annotation = |key: &str| annotations.and_then(|a| a.get(key)).map(|v| v.trim());
    let bad = |key: &str, value: &str, expected: &str| RequestError::BadAnnotation {
        pod: pod_key(pod),
        key: key.to_owned(),
        value: value.to_owned(),
        expected: expected.to_owned(),
    };
    if let Some(value) = annotation(&keys.request_gpus) {
        request.gpus = value
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=MAX_GPUS_PER_POD).contains(n))
            .ok_or_else(|| {
                bad(
                    &keys.request_gpus,
                    value,
                    &format!("write a whole number of GPUs from 1 to {MAX_GPUS_PER_POD}"),
                )
            })?;
    }
    if let Some(value) = annotation(&keys.request_exclusive) {
        request.exclusive = match value {
            "true" => true,
            "false" => false,
            _ => {
                return Err(bad(
                    &keys.request_exclusive,
                    value,
                    "write \"true\" or \"false\"",
                ));
            }
        };
    }
    if let Some(value) = annotation(&keys.request_models) {
        request.models = value
            .split(',')
            .map(str::trim)
            .filter(|name| !name.is_empty())
            .map(str::to_owned)
            .collect();
        if request.models.is_empty() || request.models.iter().any(|m| m == "!") {
            return Err(bad(
                &keys.request_models,
                value,
                "write GPU model names separated by commas, e.g. \"NVIDIA-A10G\" or \"!Tesla-T4\"",
            ));
        }
    }
    if let Some(container) = request
        .containers
        .iter()
        .find(|c| c.gib % u64::from(request.gpus) != 0)
    {
        return Err(RequestError::Uneven {
            pod: pod_key(pod),
            container: container.name.clone(),
            gib: container.gib,
            gpus: request.gpus,
            key: keys.request_gpus.clone(),
        });
    }
    Ok(Some(request))
}

/// Reads `pod`'s containers' requests for `resource`, laid out on one shared GPU; `Ok(None)`
/// when it asks for none. The layout annotations are [`pod_request_with`]'s, the one reader
/// every component calls.
fn pod_request(pod: &Pod, resource: &str) -> Result<Option<PodRequest>, RequestError> {
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
        gpus: 1,
        exclusive: false,
        models: Vec::new(),
    }))
}

/// Whether a pod in `phase` has finished (`Succeeded` or `Failed`): its containers are gone
/// and the GPU memory it held is free again, whatever its allocation says.
pub fn phase_is_finished(phase: Option<&str>) -> bool {
    matches!(phase, Some("Succeeded" | "Failed"))
}

/// Whether `pod` has finished ([`phase_is_finished`]).
pub fn pod_is_finished(pod: &Pod) -> bool {
    phase_is_finished(pod.status.as_ref().and_then(|s| s.phase.as_deref()))
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

    fn annotated(mut p: Pod, pairs: &[(&str, &str)]) -> Pod {
        p.metadata.annotations = Some(
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        );
        p
    }

    #[test]
    fn annotations_spread_the_total_over_gpus() {
        let keys = Keys::default();
        let p = pod(vec![], vec![container("train", Some("16"), None)]);
        let single = pod_request_with(&p, RES, &keys).unwrap().unwrap();
        assert_eq!(
            (single.gpus, single.exclusive, single.is_multi()),
            (1, false, false)
        );
        let p = annotated(p, &[(&keys.request_gpus, "2")]);
        let two = pod_request_with(&p, RES, &keys).unwrap().unwrap();
        assert_eq!((two.pod_gib, two.gpus, two.gib_per_gpu()), (16, 2, 8));
        assert!(two.is_multi() && !two.exclusive);
        let p = annotated(
            p,
            &[
                (&keys.request_gpus, " 2 "),
                (&keys.request_exclusive, "true"),
            ],
        );
        let whole = pod_request_with(&p, RES, &keys).unwrap().unwrap();
        assert_eq!((whole.gpus, whole.exclusive), (2, true));
        let p = annotated(
            pod(vec![], vec![container("a", Some("4"), None)]),
            &[(&keys.request_models, " NVIDIA-A10G, !Tesla T4 ")],
        );
        let models = pod_request_with(&p, RES, &keys).unwrap().unwrap().models;
        assert_eq!(models, vec!["NVIDIA-A10G", "!Tesla T4"]);
        for bad in ["", " , ", "!"] {
            let p = annotated(
                pod(vec![], vec![container("a", Some("4"), None)]),
                &[(&keys.request_models, bad)],
            );
            assert!(
                matches!(
                    pod_request_with(&p, RES, &keys),
                    Err(RequestError::BadAnnotation { .. })
                ),
                "{bad:?}"
            );
        }
        // Exclusive on one GPU is a request of its own.
        let p = annotated(
            pod(vec![], vec![container("a", Some("4"), None)]),
            &[(&keys.request_exclusive, "true")],
        );
        let one = pod_request_with(&p, RES, &keys).unwrap().unwrap();
        assert!(one.is_multi() && one.gpus == 1);
    }

    #[test]
    fn bad_layout_annotations_name_the_key_and_value() {
        let keys = Keys::default();
        let base = pod(vec![], vec![container("train", Some("16"), None)]);
        for bad in ["0", "17", "two", "-1", "1.5", ""] {
            let p = annotated(base.clone(), &[(&keys.request_gpus, bad)]);
            let err = pod_request_with(&p, RES, &keys).unwrap_err();
            assert!(
                matches!(err, RequestError::BadAnnotation { .. }),
                "{bad}: {err}"
            );
            assert!(err.to_string().contains(&keys.request_gpus), "{err}");
        }
        let p = annotated(base.clone(), &[(&keys.request_exclusive, "yes")]);
        assert!(matches!(
            pod_request_with(&p, RES, &keys),
            Err(RequestError::BadAnnotation { .. })
        ));
        let p = annotated(
            pod(
                vec![],
                vec![
                    container("a", Some("8"), None),
                    container("b", Some("3"), None),
                ],
            ),
            &[(&keys.request_gpus, "2")],
        );
        let err = pod_request_with(&p, RES, &keys).unwrap_err();
        assert!(
            matches!(
                err,
                RequestError::Uneven {
                    gib: 3,
                    gpus: 2,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("container b"), "{err}");
        // Without the resource, the annotations are not read at all.
        let p = annotated(
            pod(vec![], vec![container("a", None, None)]),
            &[(&keys.request_gpus, "x")],
        );
        assert_eq!(pod_request_with(&p, RES, &keys).unwrap(), None);
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
