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

fn with_compute(mut c: Container, compute: &str) -> Container {
    if let Some(limits) = c.resources.as_mut().and_then(|r| r.limits.as_mut()) {
        limits.insert(
            "example.com/gpu-compute".to_owned(),
            Quantity(compute.to_owned()),
        );
    }
    c
}

#[test]
fn compute_is_summed_like_memory_and_spread_over_the_gpus() {
    let keys = Keys::default();
    assert_eq!(compute_resource_of(RES), "example.com/gpu-compute");
    let p = pod(
        vec![with_compute(container("init", Some("2"), None), "50")],
        vec![
            with_compute(container("a", Some("2"), None), "20"),
            with_compute(container("b", Some("2"), None), "10"),
            container("c", Some("2"), None),
        ],
    );
    let request = pod_request_with(&p, RES, &keys).unwrap().unwrap();
    assert_eq!((request.pod_compute, request.compute_per_gpu()), (50, 50));
    let computes: Vec<u32> = request.containers.iter().map(|c| c.compute).collect();
    assert_eq!(computes, vec![50, 20, 10, 0]);
    let p = annotated(
        pod(
            vec![],
            vec![with_compute(container("train", Some("16"), None), "60")],
        ),
        &[(&keys.request_gpus, "2")],
    );
    let two = pod_request_with(&p, RES, &keys).unwrap().unwrap();
    assert_eq!((two.pod_compute, two.compute_per_gpu()), (60, 30));
    // Without compute, nothing changes.
    let p = pod(vec![], vec![container("a", Some("4"), None)]);
    let plain = pod_request_with(&p, RES, &keys).unwrap().unwrap();
    assert_eq!((plain.pod_compute, plain.containers[0].compute), (0, 0));
}

#[test]
fn compute_that_cannot_be_placed_is_refused_with_a_reason() {
    let keys = Keys::default();
    let only_compute = pod(
        vec![],
        vec![with_compute(
            Container {
                name: "a".into(),
                resources: Some(ResourceRequirements {
                    limits: Some(BTreeMap::new()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            "30",
        )],
    );
    let err = pod_request_with(&only_compute, RES, &keys).unwrap_err();
    assert!(
        matches!(err, RequestError::ComputeWithoutMemory { .. }),
        "{err}"
    );
    for bad in ["30.5", "-1", "1601", "30%"] {
        let p = pod(
            vec![],
            vec![with_compute(container("a", Some("4"), None), bad)],
        );
        let err = pod_request_with(&p, RES, &keys).unwrap_err();
        assert!(
            matches!(err, RequestError::NotWholePercent { .. }),
            "{bad}: {err}"
        );
        assert!(err.to_string().contains("gpu-compute"), "{err}");
    }
    let over = pod(
        vec![],
        vec![
            with_compute(container("a", Some("4"), None), "60"),
            with_compute(container("b", Some("4"), None), "50"),
        ],
    );
    let err = pod_request_with(&over, RES, &keys).unwrap_err();
    assert!(
        matches!(err, RequestError::ComputeTooLarge { per_gpu: 110, .. }),
        "{err}"
    );
    let uneven = annotated(
        pod(
            vec![],
            vec![with_compute(container("a", Some("4"), None), "45")],
        ),
        &[(&keys.request_gpus, "2")],
    );
    let err = pod_request_with(&uneven, RES, &keys).unwrap_err();
    assert!(
        matches!(
            err,
            RequestError::UnevenCompute {
                compute: 45,
                gpus: 2,
                ..
            }
        ),
        "{err}"
    );
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
