//! The real `kubectl-gpushare` binary against the in-process API server, through a
//! kubeconfig file, as a user would run it. It prints the same as the golden files of
//! `kubectl-gpushare/tests/golden.rs` for the same cluster, which both read from one module.

use crate::kubectl_common as common;

use std::path::{Path, PathBuf};
use std::process::Output;

use gpushare_e2e::apiserver::ApiServer;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::PostParams;

async fn cluster() -> anyhow::Result<(ApiServer, tempfile::TempDir, PathBuf)> {
    let server = ApiServer::start().await?;
    let client = server.client();
    let (nodes, pods) = common::cluster();
    let create = PostParams::default();
    for node in &nodes {
        Api::<Node>::all(client.clone())
            .create(&create, node)
            .await?;
    }
    for pod in &pods {
        let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
        Api::<Pod>::namespaced(client.clone(), ns)
            .create(&create, pod)
            .await?;
    }
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig)?;
    Ok((server, dir, kubeconfig))
}

/// Runs `kubectl-gpushare` with `args` and `--kubeconfig kubeconfig`.
async fn run(kubeconfig: &Path, args: &[&str]) -> Output {
    let binary = gpushare_e2e::cluster::binaries().unwrap().kubectl_gpushare;
    let mut command = tokio::process::Command::new(binary);
    command.args(args).arg("--kubeconfig").arg(kubeconfig);
    command.env_remove("KUBECONFIG").output().await.unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test]
async fn top_and_top_details_match_the_golden_files() -> anyhow::Result<()> {
    let (_server, _dir, kubeconfig) = cluster().await?;
    for (args, golden) in [
        (&["top"][..], "top.txt"),
        (&["top", "-d"], "top-details.txt"),
    ] {
        let out = run(&kubeconfig, args).await;
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        common::assert_golden(golden, &text(&out.stdout));
    }

    let out = run(&kubeconfig, &["top", "n2"]).await;
    let stdout = text(&out.stdout);
    assert!(out.status.success());
    assert!(stdout.contains("n2") && !stdout.contains("n1 "), "{stdout}");

    let out = run(&kubeconfig, &["top", "cpu1"]).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("node cpu1 is not a GPU node"));
    Ok(())
}

#[tokio::test]
async fn doctor_finds_the_bypassed_pod_and_the_unlabelled_node() -> anyhow::Result<()> {
    let (_server, _dir, kubeconfig) = cluster().await?;
    // Nothing listens on port 9: the extender probe fails, as it should be reported.
    let args = ["doctor", "--extender-url", "http://127.0.0.1:9"];
    let out = run(&kubeconfig, &args).await;
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    for finding in [
        "[FAIL] pod default/c on node n1 asks for 2 GiB of example.com/gpu-mem but carries no gpushare allocation",
        "[WARN] node n3 advertises 24 GiB of example.com/gpu-mem but lacks the label gpushare=true",
        "fix: kubectl label node n3 gpushare=true",
        "[FAIL] node n4 is labelled gpushare=true but advertises no",
        "[FAIL] extender kube-system/gpushare-extender does not answer /healthz",
    ] {
        assert!(stdout.contains(finding), "{finding}: {stdout}");
    }
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
    let out = run(&kubeconfig, &["top"]).await;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    for part in [
        "cannot reach the cluster at",
        url.trim_start_matches("http://"),
        "check KUBECONFIG",
    ] {
        assert!(stderr.contains(part), "{part}: {stderr}");
    }
    Ok(())
}

/// `scripts/krew-manifest.sh` packs this build's binary for krew: the manifest names the
/// chart's appVersion, the archive's true sha256 and its address under the base URL, and the
/// archive holds exactly what the manifest's `files` copy, the binary byte for byte.
#[test]
fn the_krew_manifest_describes_the_archive_it_was_made_with() -> anyhow::Result<()> {
    use anyhow::{Context as _, ensure};
    use std::process::Command;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let binary = gpushare_e2e::cluster::binaries()?.kubectl_gpushare;
    let out = tempfile::tempdir()?;
    let made = Command::new("bash")
        .arg(root.join("scripts/krew-manifest.sh"))
        .args(["https://downloads.example/v1/", "--bin"])
        .arg(&binary)
        .arg("--out")
        .arg(out.path())
        .output()?;
    let stderr = text(&made.stderr);
    ensure!(made.status.success(), "krew-manifest.sh failed: {stderr}");
    let manifest = std::fs::read_to_string(out.path().join("gpushare.yaml"))?;
    let manifest: serde_yaml::Value = serde_yaml::from_str(&manifest)?;
    let chart = std::fs::read_to_string(root.join("charts/gpushare/Chart.yaml"))?;
    let app_version = chart.lines().find_map(|l| l.strip_prefix("appVersion:"));
    let app_version = app_version.context("appVersion")?.trim().trim_matches('"');
    ensure!(manifest["kind"] == "Plugin" && manifest["metadata"]["name"] == "gpushare");
    ensure!(manifest["spec"]["version"].as_str() == Some(format!("v{app_version}").as_str()));
    let platform = &manifest["spec"]["platforms"][0];
    let uri = platform["uri"].as_str().context("uri")?;
    let archive_name = uri.strip_prefix("https://downloads.example/v1/");
    let archive = out
        .path()
        .join(archive_name.context("uri under the base URL")?);
    let sum = text(&Command::new("sha256sum").arg(&archive).output()?.stdout);
    ensure!(
        platform["sha256"].as_str() == sum.split_whitespace().next(),
        "manifest sha256 {:?}, archive {sum}",
        platform["sha256"]
    );
    let unpacked = tempfile::tempdir()?;
    let mut tar = Command::new("tar");
    tar.arg("-xzf").arg(&archive).arg("-C").arg(unpacked.path());
    ensure!(tar.status()?.success());
    let mut listed: Vec<String> = std::fs::read_dir(unpacked.path())?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<anyhow::Result<_>>()?;
    listed.sort();
    let files = platform["files"].as_sequence().context("files")?;
    let mut copied: Vec<String> = (files.iter())
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
