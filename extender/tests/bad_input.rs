//! Bad input at the scheduler port: whatever body reaches filter, prioritize, bind or preempt,
//! the extender answers 200 with the protocol's JSON or 400/413 with a JSON error naming the
//! problem, never a panic or a 500, and goes on serving.
//!
//! Property tests over three kinds of input: arbitrary bytes, arbitrary JSON built from the
//! protocol's own keys, and the captured kube-scheduler requests with one subtree replaced by
//! arbitrary JSON. CI runs proptest's default number of cases per property; a longer run:
//! `PROPTEST_CASES=20000 cargo test -p gpushare-extender --test bad_input`.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::OnceLock;

use axum::Router;
use axum::http::StatusCode;
use common::{PREFIX, bound, call, fixture, harness};
use gpushare_testkit::fixtures::{node, pod};
use gpushare_testkit::json::replace_at;
use proptest::prelude::*;
use serde_json::{Value, json};

const VERBS: [&str; 4] = ["filter", "prioritize", "bind", "preempt"];

/// One synced extender for every case: two nodes, a bound pod and the captured pod pending.
fn app() -> &'static Router {
    static APP: OnceLock<Router> = OnceLock::new();
    APP.get_or_init(|| {
        let args: Value = serde_json::from_str(&fixture("filter-request-nodenames.json")).unwrap();
        let pending: k8s_openapi::api::core::v1::Pod =
            serde_json::from_value(args["Pod"].clone()).unwrap();
        harness(
            vec![
                node("node-a").gpushare().gpus(&[16]).build(),
                node("node-b").gpushare().gpus(&[8]).build(),
            ],
            vec![pending, bound("busy", "node-b", 0, 6, true)],
        )
        .app
    })
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    })
}

/// Sends `body` to `verb` and checks the answer is a clear one.
fn answer_is_clear(verb: &str, body: Vec<u8>) -> Result<(), TestCaseError> {
    let (status, text) = runtime().block_on(common::call_bytes(
        app(),
        "POST",
        &format!("{PREFIX}/{verb}"),
        body,
    ));
    prop_assert!(
        [
            StatusCode::OK,
            StatusCode::BAD_REQUEST,
            StatusCode::PAYLOAD_TOO_LARGE
        ]
        .contains(&status),
        "{verb}: status {status}: {text}"
    );
    let value: Result<Value, _> = serde_json::from_str(&text);
    prop_assert!(value.is_ok(), "{verb}: not JSON: {text}");
    if status == StatusCode::BAD_REQUEST {
        let error = value.unwrap()["error"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        prop_assert!(
            error.starts_with(&format!("malformed {verb} request body")),
            "{error}"
        );
    }
    Ok(())
}

/// JSON values made of the protocol's keys and a few others, nested a few levels.
fn protocol_json() -> impl Strategy<Value = Value> {
    let key = prop_oneof![
        Just("Pod".to_owned()),
        Just("NodeNames".to_owned()),
        Just("Nodes".to_owned()),
        Just("items".to_owned()),
        Just("metadata".to_owned()),
        Just("name".to_owned()),
        Just("uid".to_owned()),
        Just("annotations".to_owned()),
        Just("spec".to_owned()),
        Just("containers".to_owned()),
        Just("resources".to_owned()),
        Just("limits".to_owned()),
        Just("example.com/gpu-mem".to_owned()),
        Just("gpushare.example.com/gpus".to_owned()),
        Just("priority".to_owned()),
        Just("PodName".to_owned()),
        Just("PodNamespace".to_owned()),
        Just("PodUID".to_owned()),
        Just("Node".to_owned()),
        Just("NodeNameToMetaVictims".to_owned()),
        Just("NodeNameToVictims".to_owned()),
        Just("Pods".to_owned()),
        Just("UID".to_owned()),
        "[a-zA-Z/.-]{0,8}",
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        // Quantities, sane and absurd, and names.
        prop_oneof![
            Just("4".to_owned()),
            Just("1e100".to_owned()),
            Just("-5".to_owned()),
            Just("99999999999999999999999Gi".to_owned()),
            Just("0.5".to_owned()),
            Just("node-a".to_owned()),
            ".{0,12}",
        ]
        .prop_map(Value::String),
    ];
    leaf.prop_recursive(5, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(key.clone(), inner, 0..6)
                .prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    })
}

fn captured() -> Vec<Value> {
    [
        "filter-request-nodenames.json",
        "filter-request-nodes.json",
        "prioritize-request.json",
        "bind-request.json",
    ]
    .iter()
    .map(|name| serde_json::from_str(&fixture(name)).unwrap())
    .collect()
}

proptest! {
    #[test]
    fn arbitrary_bytes_get_a_clear_answer(verb in prop::sample::select(&VERBS[..]), body in prop::collection::vec(any::<u8>(), 0..512)) {
        answer_is_clear(verb, body)?;
    }

    #[test]
    fn arbitrary_protocol_json_gets_a_clear_answer(verb in prop::sample::select(&VERBS[..]), body in protocol_json()) {
        answer_is_clear(verb, serde_json::to_vec(&body).unwrap())?;
    }

    #[test]
    fn captured_requests_with_a_subtree_replaced_get_a_clear_answer(
        verb in prop::sample::select(&VERBS[..]),
        which in 0usize..4,
        steps in prop::collection::vec(any::<usize>(), 0..8),
        replacement in protocol_json(),
    ) {
        let mut body = captured().swap_remove(which);
        replace_at(&mut body, &steps, replacement);
        answer_is_clear(verb, serde_json::to_vec(&body).unwrap())?;
    }
}

/// The shapes of the barrage, one by one: truncated and empty bodies, JSON nested 100,000
/// deep, a body of 8 MiB, absurd quantities, 10,000 node names, unknown pods and nodes; then
/// the extender still answers the captured filter as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_barrage_gets_clear_answers_and_the_extender_keeps_serving() {
    let app = app();
    let post = |verb: &'static str, body: Vec<u8>| async move {
        common::call_bytes(app, "POST", &format!("{PREFIX}/{verb}"), body).await
    };
    let filter = fixture("filter-request-nodenames.json");
    for cut in (0..filter.len()).step_by(97) {
        let (status, _) = post("filter", filter.as_bytes()[..cut].to_vec()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "cut at {cut}");
    }
    for verb in VERBS {
        assert_eq!(post(verb, Vec::new()).await.0, StatusCode::BAD_REQUEST);
        // At the top (refused at the first bracket) and under a key the protocol does not
        // know (skipped without recursion): a clear answer either way, and no stack blown.
        let open = "[".repeat(100_000);
        let close = "]".repeat(100_000);
        for deep in [
            format!("{open}{close}"),
            format!(r#"{{"Unknown":{open}{close}}}"#),
        ] {
            let (status, text) = post(verb, deep.into_bytes()).await;
            assert!(
                status == StatusCode::OK || status == StatusCode::BAD_REQUEST,
                "{verb}: {status} {text}"
            );
            assert!(serde_json::from_str::<Value>(&text).is_ok(), "{text}");
        }
        let (status, _) = post(verb, vec![b' '; 8 << 20]).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
    }
    // Absurd quantities: every node fails with the reason, nobody panics.
    for quantity in ["1e100", "-5", "99999999999999999999999Gi", "0.5", "NaN", ""] {
        let mut asking = pod("absurd").build();
        asking.metadata.uid = Some("uid-absurd".into());
        let mut body = json!({"Pod": asking, "NodeNames": ["node-a"]});
        body["Pod"]["spec"]["containers"][0]["resources"] =
            json!({"limits": {"example.com/gpu-mem": quantity}});
        for verb in ["filter", "prioritize", "preempt"] {
            let (status, text) = post(verb, serde_json::to_vec(&body).unwrap()).await;
            assert!(
                status == StatusCode::OK || status == StatusCode::BAD_REQUEST,
                "{verb} {quantity}: {status} {text}"
            );
        }
        let (_, answer) = call(app, "POST", &format!("{PREFIX}/filter"), &body.to_string()).await;
        assert_eq!(answer["NodeNames"], json!([]), "{quantity}: {answer}");
    }
    // 10,000 node names, all unknown but one.
    let mut names: Vec<String> = (0..10_000).map(|i| format!("ghost-{i}")).collect();
    names.push("node-a".into());
    let mut args: Value = serde_json::from_str(&filter).unwrap();
    args["NodeNames"] = json!(names);
    let (status, answer) = call(app, "POST", &format!("{PREFIX}/filter"), &args.to_string()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(answer["NodeNames"], json!(["node-a"]));
    // Unknown pods and nodes at bind and preempt.
    let bind =
        json!({"PodName": "nobody", "PodNamespace": "default", "PodUID": "u", "Node": "ghost"});
    let (status, answer) = call(app, "POST", &format!("{PREFIX}/bind"), &bind.to_string()).await;
    assert_eq!(status, StatusCode::OK);
    assert_ne!(answer["Error"], "", "{answer}");
    let preempt =
        json!({"Pod": args["Pod"], "NodeNameToMetaVictims": {"ghost": {"Pods": [{"UID": "x"}]}}});
    let (status, answer) = call(
        app,
        "POST",
        &format!("{PREFIX}/preempt"),
        &preempt.to_string(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(answer, json!({"NodeNameToMetaVictims": {}}));
    // Still serving: the captured filter passes node-a as ever.
    let (status, answer) = call(app, "POST", &format!("{PREFIX}/filter"), &filter).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(answer["NodeNames"], json!(["node-a"]));
}
