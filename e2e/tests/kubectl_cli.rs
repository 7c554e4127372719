//! The real `kubectl-gpushare` binary against the in-process API server, through a
//! kubeconfig file, as a user would run it. It prints the same as the golden files of
//! `kubectl-gpushare/tests/golden.rs` for the same cluster, which both read from one module.

#[path = "../../kubectl-gpushare/tests/common/mod.rs"]
mod common;

use std::process::Output;

use gpushare_e2e::apiserver::ApiServer;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::PostParams;

async fn cluster() -> anyhow::Result<(ApiServer, tempfile::TempDir, std::path::PathBuf)> {
    let server = ApiServer::start().await?;
    let client = server.client();
    let (nodes, pods) = common::cluster();
    for node in &nodes {
        Api::<Node>::all(client.clone())
            .create(&PostParams::default(), node)
            .await?;
    }
    for pod in &pods {
        let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
        Api::<Pod>::namespaced(client.clone(), ns)
            .create(&PostParams::default(), pod)
            .await?;
    }
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig)?;
    Ok((server, dir, kubeconfig))
}

async fn run(args: &[&str]) -> Output {
    let binary = gpushare_e2e::cluster::binaries().unwrap().kubectl_gpushare;
    let mut command = tokio::process::Command::new(binary);
    command.args(args).env_remove("KUBECONFIG");
    command.output().await.unwrap()
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test]
async fn top_and_top_details_match_the_golden_files() -> anyhow::Result<()> {
    let (_server, _dir, kubeconfig) = cluster().await?;
    let kc = kubeconfig.to_str().unwrap();

    let out = run(&["top", "--kubeconfig", kc]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    common::assert_golden("top.txt", &stdout(&out));

    let out = run(&["top", "-d", "--kubeconfig", kc]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    common::assert_golden("top-details.txt", &stdout(&out));

    let out = run(&["top", "n2", "--kubeconfig", kc]).await;
    assert!(out.status.success());
    let text = stdout(&out);
    assert!(text.contains("n2") && !text.contains("n1 "), "{text}");

    let out = run(&["top", "cpu1", "--kubeconfig", kc]).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("node cpu1 is not a GPU node"));
    Ok(())
}

#[tokio::test]
async fn doctor_finds_the_bypassed_pod_and_the_unlabelled_node() -> anyhow::Result<()> {
    let (_server, _dir, kubeconfig) = cluster().await?;
    // Nothing listens on port 9: the extender probe fails, as it should be reported.
    let out = run(&[
        "doctor",
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
        "--extender-url",
        "http://127.0.0.1:9",
    ])
    .await;
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("[FAIL] pod default/c on node n1 asks for 2 GiB of example.com/gpu-mem but carries no gpushare allocation"),
        "{text}"
    );
    assert!(
        text.contains("[WARN] node n3 advertises 24 GiB of example.com/gpu-mem but lacks the label gpushare=true"),
        "{text}"
    );
    assert!(
        text.contains("fix: kubectl label node n3 gpushare=true"),
        "{text}"
    );
    assert!(
        text.contains("[FAIL] node n4 is labelled gpushare=true but advertises no"),
        "{text}"
    );
    assert!(
        text.contains("[FAIL] extender kube-system/gpushare-extender does not answer /healthz"),
        "{text}"
    );
    Ok(())
}

#[tokio::test]
async fn unreachable_cluster_says_where_it_tried() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    // Start and stop a server so the port is known to be closed.
    let server = ApiServer::start().await?;
    server.write_kubeconfig(&kubeconfig)?;
    let url = server.url();
    server.shutdown().await;
    let out = run(&["top", "--kubeconfig", kubeconfig.to_str().unwrap()]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("cannot reach the cluster at"), "{stderr}");
    assert!(
        stderr.contains(url.trim_start_matches("http://")),
        "{stderr}"
    );
    assert!(stderr.contains("check KUBECONFIG"), "{stderr}");
    Ok(())
}
