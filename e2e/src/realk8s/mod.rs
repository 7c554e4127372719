//! The real-Kubernetes tier: the chart installed by `helm` on the real v1.36 cluster of
//! `../shared/realk8s` (upstream control plane, one real kubelet whose runtime runs our
//! chart's containers as processes).
//!
//! Why a second cluster: the in-process one is only as strict as we made it. The real one is
//! the judge; every disagreement found so far is listed in `docs/testing.md`.
//!
//! [`Kit::locate`] sets the kit up once into `target/realk8s` and stages a project folder whose
//! `target/release`, `.tools` and `charts` point at this test build's binaries
//! ([`crate::cluster::binaries`]), so the real tier needs no second, release build.
//! [`Kit::up`] runs the kit's `chart-cluster.sh up`, ending in `helm install` as a user types
//! it. The cluster uses fixed ports and `/var/lib/kubelet`: one scenario at a time.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use serde::Deserialize;

use crate::cluster::{binaries, wait_for};
use crate::scenarios::Harness;
use crate::tools;

pub mod barrage;
mod drain_cost;
mod fake_nodes;
pub mod latency;
pub mod load;
mod mix;
pub mod prometheus;
mod scale;
mod stand_in;

/// The kit's set-up steps, in `build.sh`'s words; the stamp records which archive they set up.
const SETUP_STEPS: [&str; 4] = ["unpack", "etcd", "pki", "harness"];
const STAMP: &str = ".gpushare-kit-stamp";
/// The release's namespace.
const SYSTEM: &str = "kube-system";

/// Which install `chart-cluster.sh up` makes (the chart's `mode` value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// kube-scheduler extender, device plugin, admission webhook.
    Extender,
    /// Dynamic Resource Allocation: the DRA kubelet plugin, and the extender to rank nodes
    /// (`dra.scheduler.ranking`).
    Dra,
}

impl Mode {
    fn as_str(self) -> &'static str {
        match self {
            Mode::Extender => "extender",
            Mode::Dra => "dra",
        }
    }
}

/// The kit (`source`: `../shared/realk8s`), set up in `root` (`target/realk8s`, the scripts'
/// `REALK8S`), with the staged `project` folder its scripts read binaries and the chart from.
#[derive(Debug, Clone)]
pub struct Kit {
    source: PathBuf,
    root: PathBuf,
    project: PathBuf,
}

impl Kit {
    /// Finds the kit (`GPUSHARE_REALK8S_KIT`, else `../shared/realk8s` beside the repository)
    /// and sets it up; `Ok(None)` when there is no kit on this machine.
    pub fn locate() -> anyhow::Result<Option<Kit>> {
        let repo = tools::repo_root();
        let source = std::env::var_os("GPUSHARE_REALK8S_KIT")
            .map(PathBuf::from)
            .unwrap_or_else(|| repo.join("..").join("shared").join("realk8s"));
        if !source.join("chart-cluster.sh").is_file() {
            return Ok(None);
        }
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| repo.join("target"));
        let root = target.join("realk8s");
        let kit = Kit {
            project: root.join("project"),
            source,
            root,
        };
        kit.set_up()?;
        kit.stage_project(&repo)?;
        Ok(Some(kit))
    }

    /// `REALK8S`: where the kit keeps binaries, certificates, state and logs.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The cluster-admin kubeconfig the kit made.
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.root.join("admin.kubeconfig")
    }

    fn set_up(&self) -> anyhow::Result<()> {
        let archive = std::fs::read_dir(&self.source)
            .with_context(|| format!("reading {}", self.source.display()))?
            .filter_map(Result::ok)
            .find(|entry| entry.file_name().to_string_lossy().ends_with("-bin.tar.xz"))
            .with_context(|| format!("no *-bin.tar.xz in {}", self.source.display()))?;
        let meta = archive.metadata()?;
        let stamp = format!(
            "{} {} {:?}",
            archive.file_name().to_string_lossy(),
            meta.len(),
            meta.modified().ok()
        );
        let stamp_path = self.root.join(STAMP);
        // Set up already: refresh only the scripts, so a newer kit's fixes apply.
        let done = std::fs::read_to_string(&stamp_path).ok().as_deref() == Some(stamp.as_str());
        let steps: &[&str] = if done { &["harness"] } else { &SETUP_STEPS };
        let output = Command::new("bash")
            .arg(self.source.join("build.sh"))
            .args(steps)
            .env("REALK8S", &self.root)
            .output()
            .context("running the kit's build.sh")?;
        stdout_of("the kit's build.sh", steps, &output)?;
        std::fs::write(&stamp_path, stamp)?;
        Ok(())
    }

    /// Points `$PROJECT/target/release/gpushare-*`, `.tools` and `charts` at this build.
    fn stage_project(&self, repo: &Path) -> anyhow::Result<()> {
        let bins = binaries()?;
        tools::helm()?;
        tools::kubectl()?;
        let release = self.project.join("target").join("release");
        std::fs::create_dir_all(&release)?;
        let links = [
            (bins.extender, release.join("gpushare-extender")),
            (bins.device_plugin, release.join("gpushare-device-plugin")),
            (bins.dra_plugin, release.join("gpushare-dra-plugin")),
            (repo.join(".tools"), self.project.join(".tools")),
            (repo.join("charts"), self.project.join("charts")),
        ];
        for (from, link) in links {
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(&from, &link)
                .with_context(|| format!("linking {} to {}", link.display(), from.display()))?;
        }
        Ok(())
    }

    async fn admin_config(&self) -> anyhow::Result<Config> {
        Ok(Config::from_custom_kubeconfig(
            Kubeconfig::read_from(self.admin_kubeconfig())?,
            &KubeConfigOptions::default(),
        )
        .await?)
    }

    /// A command running the kit's script `name` (`chart-cluster.sh`, `realk8s.sh`, …).
    pub fn script(&self, name: &str) -> Command {
        let mut command = Command::new("bash");
        command
            .arg(self.root.join("harness").join(name))
            .env("REALK8S", &self.root)
            .env("PROJECT", &self.project)
            .env("KUBECONFIG", self.admin_kubeconfig());
        command
    }

    /// Stops whatever an earlier run left behind (a killed test leaves the cluster up).
    pub fn down(&self) {
        let _ = self.script("chart-cluster.sh").arg("down").output();
    }

    /// Brings the cluster up and installs the chart in `mode`, with `helm_args` added to
    /// `helm install`; waits until every gpushare pod is Ready.
    pub async fn up(&self, mode: Mode, helm_args: &[&str]) -> anyhow::Result<KitCluster> {
        self.down();
        let started = std::time::Instant::now();
        // The plugins install the interposer from "their image", here this build's, into a
        // host directory of the kit's own (never a host-wide path), fresh for each cluster.
        let host_dir = self.root.join("isolation");
        let _ = std::fs::remove_dir_all(&host_dir);
        // A new Service proxy writes the hosts afresh: what a load run kept of the last is stale.
        load::forget_proxy_ip(self);
        let bins = binaries()?;
        // Pods of the probe's image run for real: a CUDA program against the fake driver.
        let probe = bins.isolation_probe.display();
        let fakecri = format!("-exec-image {PROBE_IMAGE}={probe}");
        let isolation = [
            format!("isolation.libraryPath={}", bins.isolation_library.display()),
            format!("isolation.hostDir={}", host_dir.display()),
        ];
        let output = self
            .script("chart-cluster.sh")
            .arg("up")
            .args(isolation.iter().flat_map(|value| ["--set", value.as_str()]))
            .args(helm_args)
            .env("FAKECRI_EXTRA", fakecri)
            .env("MODE", mode.as_str())
            .output()
            .context("running chart-cluster.sh up")?;
        // From here on the cluster may be (partly) up: the guard takes it down on any error.
        let guard = DownOnDrop(self.clone());
        if !output.status.success() {
            bail!(
                "chart-cluster.sh up (mode {}) failed ({}):\n{}\n{}",
                mode.as_str(),
                output.status,
                String::from_utf8_lossy(&output.stdout),
                tail(&String::from_utf8_lossy(&output.stderr), 40)
            );
        }
        let client = Client::try_from(self.admin_config().await?)?;
        tracing::info!(
            mode = mode.as_str(),
            seconds = started.elapsed().as_secs_f64(),
            "real cluster up"
        );
        Ok(KitCluster {
            kit: self.clone(),
            client,
            _guard: guard,
        })
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

struct DownOnDrop(Kit);

impl Drop for DownOnDrop {
    fn drop(&mut self) {
        if std::env::var_os("GPUSHARE_REALK8S_KEEP").is_none() {
            self.0.down();
        }
    }
}

/// Pods whose image names this run `gpushare-isolation-probe` for real (the kit's
/// `-exec-image`), with the fake driver on `LD_LIBRARY_PATH` ([`probe_container`]).
pub const PROBE_IMAGE: &str = "gpushare-isolation-probe";

/// The environment the probe runs in: the fake driver (one 16 GiB GPU) on `LD_LIBRARY_PATH`.
pub fn probe_env() -> [(&'static str, String); 2] {
    let driver = gpushare_isolation_probe::fake_driver_dir();
    [
        ("LD_LIBRARY_PATH", driver.display().to_string()),
        ("FAKE_GPU_MEM_MIB", "16384".to_owned()),
    ]
}

/// A container of image [`PROBE_IMAGE`] running the probe with `args` in [`probe_env`]:
/// `--via dlsym info alloc:mem:3000 … hold` (see `isolation/probe/src/main.rs`).
pub fn probe_container(args: &[&str]) -> serde_json::Value {
    let env = probe_env().map(|(name, value)| serde_json::json!({"name": name, "value": value}));
    serde_json::json!({
        "image": format!("example.com/{PROBE_IMAGE}:test"),
        "args": args,
        "env": env,
    })
}

/// The elements of the JSON array `value`; none if it is not one.
pub fn items(value: &serde_json::Value) -> impl Iterator<Item = &serde_json::Value> {
    value.as_array().into_iter().flatten()
}

/// The JSON string `value`; empty if it is not one.
pub fn text(value: &serde_json::Value) -> &str {
    value.as_str().unwrap_or_default()
}

/// Removes the empty mount targets an isolated container left on this machine (the kit's
/// runtime, and [`run_with_cdi_edits`], share the host's root). Why: the interposer reads
/// `/var/run/gpushare/limits` wherever it exists, so an empty one left here would make every
/// interposed program on this machine refuse all GPU memory.
pub fn remove_isolation_placeholders() {
    use gpushare_contract::env::{
        ISOLATION_DIR_IN_CONTAINER, ISOLATION_LIBRARY_IN_CONTAINER, ISOLATION_LIMITS_IN_CONTAINER,
    };
    let library = Path::new(ISOLATION_LIBRARY_IN_CONTAINER);
    for file in [library, Path::new(ISOLATION_LIMITS_IN_CONTAINER)] {
        if std::fs::metadata(file).is_ok_and(|m| m.is_file() && m.len() == 0) {
            let _ = std::fs::remove_file(file);
        }
    }
    let accounting = Path::new(ISOLATION_DIR_IN_CONTAINER);
    for dir in [library.parent(), Some(accounting)].into_iter().flatten() {
        // remove_dir removes only an empty directory.
        let _ = std::fs::remove_dir(dir);
        if let Some(parent) = dir.parent().filter(|p| p.ends_with("gpushare")) {
            let _ = std::fs::remove_dir(parent);
        }
    }
}

/// Runs `argv` as a CDI-enabled runtime would given CDI `edits` (a device's `containerEdits`):
/// their bind mounts in a private mount namespace, their environment plus `extra_env`. Why:
/// the kit's runtime applies no CDI spec. Returns stdout, then stderr.
pub fn run_with_cdi_edits(
    edits: &serde_json::Value,
    argv: &[String],
    extra_env: &[(&str, String)],
) -> anyhow::Result<String> {
    let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
    let mut script = String::from("set -e; mount --make-rprivate /\n");
    for mount in items(&edits["mounts"]) {
        let (Some(src), Some(dst)) = (mount["hostPath"].as_str(), mount["containerPath"].as_str())
        else {
            bail!("a CDI mount without hostPath or containerPath: {mount}");
        };
        let (src, dst) = (quote(src), quote(dst));
        script.push_str(&format!(
            "if [ -d {src} ]; then mkdir -p {dst}; else mkdir -p \"$(dirname {dst})\"; [ -e {dst} ] || touch {dst}; fi\nmount --bind {src} {dst}\n"
        ));
        if items(&mount["options"]).any(|option| option == "ro") {
            script.push_str(&format!("mount -o remount,bind,ro {dst}\n"));
        }
    }
    script.push_str("exec env \"$@\"");
    let mut env: Vec<String> = items(&edits["env"])
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    env.extend(extra_env.iter().map(|(k, v)| format!("{k}={v}")));
    let output = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "/bin/sh", "-c"])
        .args([script.as_str(), "sh"])
        .args(&env)
        .args(argv)
        .env_clear()
        .env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )
        .output()
        .context("running unshare")?;
    Ok(format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    ))
}

/// One container as the kit's runtime recorded it at CreateContainer: what kubelet passed
/// from our plugins' answers.
#[derive(Debug, Clone, Deserialize)]
pub struct CreatedContainer {
    pub namespace: String,
    pub pod: String,
    #[serde(rename = "podUID")]
    pub pod_uid: String,
    pub container: String,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Fully-qualified CDI device names (DRA mode).
    #[serde(default)]
    pub cdi: Option<Vec<String>>,
    /// `hostPath:containerPath` of each mount kubelet passed (the device plugin's among them).
    #[serde(default)]
    pub mounts: Option<Vec<String>>,
}

/// The real cluster with the chart installed; taken down when dropped (unless
/// `GPUSHARE_REALK8S_KEEP` is set, to look around after a failure).
pub struct KitCluster {
    kit: Kit,
    client: Client,
    _guard: DownOnDrop,
}

impl KitCluster {
    /// The kit it runs from.
    pub fn kit(&self) -> &Kit {
        &self.kit
    }

    /// A client acting as `username` (the admin impersonating it), for attacks by a user the
    /// chart does not trust; with `node`, its token names that node, as the claim a projected
    /// ServiceAccount token carries (`authentication.kubernetes.io/node-name`).
    pub async fn client_as(&self, username: &str, node: Option<&str>) -> anyhow::Result<Client> {
        let mut config = self.kit.admin_config().await?;
        config.auth_info.impersonate = Some(username.to_owned());
        if let Some(node) = node {
            let claim = "authentication.kubernetes.io/node-name".to_owned();
            config.auth_info.impersonate_user_extra = Some([(claim, vec![node.to_owned()])].into());
        }
        Ok(Client::try_from(config)?)
    }

    /// Runs the kit's `chart-cluster.sh`/`kubelet.sh`/`realk8s.sh` with `args`; returns stdout.
    pub fn script(&self, name: &str, args: &[&str]) -> anyhow::Result<String> {
        let output = self.kit.script(name).args(args).output();
        let output = output.with_context(|| format!("running {name} {args:?}"))?;
        stdout_of(name, args, &output)
    }

    /// Restarts the kit's Service proxy (`svcproxy.py`, kube-proxy's stand-in) for `services`
    /// (`namespace/name`): the kit proxies `kube-system/gpushare-extender` only. Pods started
    /// from now on resolve the names; `chart-cluster.sh down` stops it (same pid file).
    pub async fn proxy_services(&self, services: &[&str]) -> anyhow::Result<()> {
        let run = self.kit.root().join("run");
        let pid_file = run.join("svcproxy.pid");
        if let Ok(pid) = std::fs::read_to_string(&pid_file) {
            let _ = Command::new("kill").arg(pid.trim()).status();
        }
        let hosts = run.join("hosts-extra");
        let _ = std::fs::remove_file(&hosts);
        let log = std::fs::File::create(run.join("svcproxy.log"))?;
        let child = Command::new("setsid")
            .arg("python3")
            .arg(self.kit.root().join("harness").join("svcproxy.py"))
            .arg("--hosts-out")
            .arg(&hosts)
            .args(services)
            .env("REALK8S", self.kit.root())
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting the kit's svcproxy.py")?;
        std::fs::write(&pid_file, child.id().to_string())?;
        let what = format!("the Service proxy to write the hosts of {services:?}");
        wait_for(&what, Duration::from_secs(10), || async {
            std::fs::metadata(&hosts)
                .is_ok_and(|m| m.len() > 0)
                .then_some(())
        })
        .await
    }

    /// The IP of pod `kube-system/<pod>`, once it has one.
    async fn system_pod_ip(&self, pod: &str) -> anyhow::Result<Option<String>> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), SYSTEM);
        Ok(pods.get(pod).await?.status.and_then(|s| s.pod_ip))
    }

    /// The extender Lease's `holderIdentity` (`<pod>_<suffix>`).
    pub fn extender_lease_holder(&self) -> anyhow::Result<String> {
        let holder = "jsonpath={.spec.holderIdentity}";
        self.system(&["get", "lease", "gpushare-extender", "-o", holder])
    }

    /// Runs `kubectl` against the cluster; returns stdout.
    pub fn kubectl(&self, args: &[&str]) -> anyhow::Result<String> {
        self.kubectl_stdin(args, "")
    }

    /// Runs `kubectl -n kube-system` (the release's namespace) with `args`; returns stdout.
    pub fn system(&self, args: &[&str]) -> anyhow::Result<String> {
        self.kubectl(&[&["-n", SYSTEM], args].concat())
    }

    /// Runs `kubectl` against the cluster with `stdin` as its input; returns stdout.
    pub fn kubectl_stdin(&self, args: &[&str], stdin: &str) -> anyhow::Result<String> {
        use std::io::Write as _;
        let mut child = Command::new(tools::kubectl()?)
            .arg("--kubeconfig")
            .arg(self.kit.admin_kubeconfig())
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        if let Some(mut input) = child.stdin.take() {
            input.write_all(stdin.as_bytes())?;
        }
        stdout_of("kubectl", args, &child.wait_with_output()?)
    }

    /// The chart in the checkout the kit runs (`<kit>/project/charts/gpushare`).
    pub fn chart_dir(&self) -> PathBuf {
        self.kit.project.join("charts").join("gpushare")
    }

    /// The release's user-supplied values (`helm get values`), written to `name` in the kit's
    /// run folder, for an install of the same release later.
    pub fn release_values(&self, name: &str) -> anyhow::Result<PathBuf> {
        let values = self.helm(&["get", "values", "gpushare", "-n", SYSTEM, "-o", "yaml"])?;
        let file = self.kit.root().join("run").join(name);
        std::fs::write(&file, values)?;
        Ok(file)
    }

    /// Uninstalls the release from kube-system (its post-delete hook included) and returns
    /// the values it was installed with, for [`KitCluster::install_again`].
    pub fn uninstall_chart(&self) -> anyhow::Result<PathBuf> {
        let values = self.release_values("uninstalled-values.yaml")?;
        self.helm(&["uninstall", "gpushare", "-n", SYSTEM, "--wait"])?;
        Ok(values)
    }

    /// Installs the release into kube-system again with `values` and waits until its
    /// Deployments and DaemonSets are ready.
    pub fn install_again(&self, values: &Path) -> anyhow::Result<()> {
        let values = values.to_string_lossy();
        self.release("install", &["-f", &values, "--wait", "--timeout", "5m"])?;
        Ok(())
    }

    /// Runs `helm <verb> gpushare <chart> -n kube-system` with `extra` added: the release in
    /// kube-system and the chart of the checkout the kit runs ([`KitCluster::chart_dir`]);
    /// returns stdout.
    pub fn release(&self, verb: &str, extra: &[&str]) -> anyhow::Result<String> {
        let chart = self.chart_dir();
        let chart = chart.to_string_lossy();
        self.helm(&[&[verb, "gpushare", &*chart, "-n", SYSTEM], extra].concat())
    }

    /// Runs `helm` against the cluster; returns stdout.
    pub fn helm(&self, args: &[&str]) -> anyhow::Result<String> {
        let output = Command::new(tools::helm()?)
            .arg("--kubeconfig")
            .arg(self.kit.admin_kubeconfig())
            .args(args)
            .output()?;
        stdout_of("helm", args, &output)
    }

    /// Every CreateContainer the kit's runtime has seen, oldest first.
    pub fn created_containers(&self) -> anyhow::Result<Vec<CreatedContainer>> {
        let path = self.kit.root.join("run").join("creates.jsonl");
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(err) => return Err(err).with_context(|| format!("reading {}", path.display())),
        };
        text.lines()
            .filter(|line| !line.trim().is_empty())
            .map(|line| {
                serde_json::from_str(line)
                    .with_context(|| format!("a line of {}: {line}", path.display()))
            })
            .collect()
    }

    /// The latest CreateContainer of `container` in the pod `namespace/pod` with `uid`.
    pub fn created(&self, uid: &str, container: &str) -> anyhow::Result<Option<CreatedContainer>> {
        Ok(self
            .created_containers()?
            .into_iter()
            .rev()
            .find(|c| c.pod_uid == uid && c.container == container))
    }

    /// Deletes every pod in `namespace` at once and waits until they are gone, so the next
    /// scenario starts with free GPUs.
    pub async fn delete_all_pods(&self, namespace: &str) -> anyhow::Result<()> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let now = DeleteParams::default().grace_period(0);
        let _ = pods.delete_collection(&now, &ListParams::default()).await?;
        let what = format!("every pod in {namespace} to be gone");
        wait_for(&what, Duration::from_secs(120), || async {
            let list = pods.list(&ListParams::default()).await.ok()?;
            list.items.is_empty().then_some(())
        })
        .await
    }
}

impl Harness for KitCluster {
    fn client(&self) -> Client {
        self.client.clone()
    }

    fn namespace(&self) -> &str {
        "default"
    }

    async fn container_env(
        &self,
        pod: &str,
        container: &str,
    ) -> anyhow::Result<BTreeMap<String, String>> {
        let uid = crate::scenarios::get_pod(self, pod).await?.metadata.uid;
        let uid = uid.unwrap_or_default();
        // kubelet has created the container by the time the pod runs, but the record is
        // written by another process: give it a moment.
        let what = format!("the runtime's record of container {container} of pod {pod}");
        wait_for(&what, Duration::from_secs(10), || async {
            self.created(&uid, container).ok().flatten()
        })
        .await
        .map(|created| created.env)
    }
}

/// A finished tool's stdout, or an error with the end of its stderr.
fn stdout_of(tool: &str, args: &[&str], output: &std::process::Output) -> anyhow::Result<String> {
    ensure!(
        output.status.success(),
        "{tool} {args:?} failed ({}): {}",
        output.status,
        tail(&String::from_utf8_lossy(&output.stderr), 40)
    );
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}
