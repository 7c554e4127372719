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

/// `scripts/krew-manifest.sh` packs this build's binary for krew: the manifest names the
/// chart's appVersion, the archive's true sha256 and its address under the base URL, and the
/// archive holds exactly what the manifest's `files` copy, the binary byte for byte.
#[test]
fn the_krew_manifest_describes_the_archive_it_was_made_with() -> anyhow::Result<()> {
    use anyhow::{Context as _, ensure};
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let binary = gpushare_e2e::cluster::binaries()?.kubectl_gpushare;
    let out = tempfile::tempdir()?;
    let made = std::process::Command::new("bash")
        .arg(root.join("scripts/krew-manifest.sh"))
        .arg("https://downloads.example/v1/")
        .arg("--bin")
        .arg(&binary)
        .arg("--out")
        .arg(out.path())
        .output()?;
    ensure!(
        made.status.success(),
        "krew-manifest.sh failed: {}",
        String::from_utf8_lossy(&made.stderr)
    );
    let manifest: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(out.path().join("gpushare.yaml"))?)?;
    let chart = std::fs::read_to_string(root.join("charts/gpushare/Chart.yaml"))?;
    let app_version = chart
        .lines()
        .find_map(|l| l.strip_prefix("appVersion:"))
        .context("appVersion")?
        .trim()
        .trim_matches('"');
    ensure!(manifest["kind"] == "Plugin" && manifest["metadata"]["name"] == "gpushare");
    ensure!(manifest["spec"]["version"].as_str() == Some(format!("v{app_version}").as_str()));
    let platform = &manifest["spec"]["platforms"][0];
    let uri = platform["uri"].as_str().context("uri")?;
    let archive_name = uri
        .strip_prefix("https://downloads.example/v1/")
        .context("uri under the base URL")?;
    let archive = out.path().join(archive_name);
    let sum = std::process::Command::new("sha256sum")
        .arg(&archive)
        .output()?;
    let sum = String::from_utf8_lossy(&sum.stdout);
    ensure!(
        platform["sha256"].as_str() == sum.split_whitespace().next(),
        "manifest sha256 {:?}, archive {sum}",
        platform["sha256"]
    );
    let unpacked = tempfile::tempdir()?;
    let status = std::process::Command::new("tar")
        .arg("-xzf")
        .arg(&archive)
        .arg("-C")
        .arg(unpacked.path())
        .status()?;
    ensure!(status.success());
    let mut listed: Vec<String> = std::fs::read_dir(unpacked.path())?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<anyhow::Result<_>>()?;
    listed.sort();
    let mut copied: Vec<String> = platform["files"]
        .as_sequence()
        .context("files")?
        .iter()
        .filter_map(|f| f["from"].as_str().map(str::to_owned))
        .collect();
    copied.sort();
    ensure!(
        listed == copied,
        "archive {listed:?}, manifest copies {copied:?}"
    );
    ensure!(std::fs::read(unpacked.path().join("kubectl-gpushare"))? == std::fs::read(&binary)?);
    ensure!(platform["bin"] == "kubectl-gpushare");
    Ok(())
}
