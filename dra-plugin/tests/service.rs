//! The DRA and registration services over real unix sockets, as kubelet calls them, with
//! claims served from a map instead of the API server.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use gpushare_contract::GpuInfo;
use gpushare_dra_plugin::checkpoint::Checkpoint;
use gpushare_dra_plugin::service::{
    ClaimSource, DraService, Node, RegistrationService, RegistrationState,
};
use gpushare_proto::dra::v1::dra_plugin_client::DraPluginClient;
use gpushare_proto::dra::v1::dra_plugin_server::DraPluginServer;
use gpushare_proto::dra::v1::{Claim, NodePrepareResourcesRequest, NodeUnprepareResourcesRequest};
use gpushare_proto::pluginregistration::registration_client::RegistrationClient;
use gpushare_proto::pluginregistration::registration_server::RegistrationServer;
use gpushare_proto::pluginregistration::{InfoRequest, RegistrationStatus};
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;

#[derive(Clone, Default)]
struct Claims(Arc<Mutex<HashMap<(String, String), ResourceClaim>>>);

impl ClaimSource for Claims {
    async fn claim(&self, namespace: &str, name: &str) -> Result<ResourceClaim, String> {
        self.0
            .lock()
            .unwrap()
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
            .ok_or_else(|| format!("resourceclaims {name:?} not found"))
    }
}

const DRIVER: &str = "gpushare.example.com";

fn allocated(name: &str, uid: &str, device: &str, memory: &str) -> ResourceClaim {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "ns", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpushare"}}]}},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": "n1", "device": device,
             "consumedCapacity": {"memory": memory}}
        ]}}}
    }))
    .unwrap()
}

fn node(dir: &Path) -> Arc<Node> {
    node_with(
        dir,
        gpushare_dra_plugin::cdi::EnforcementConfig {
            mode: gpushare_contract::env::Enforcement::Toolkit,
            mps_pipe_directory: String::new(),
            isolation: None,
        },
    )
}

fn node_with(dir: &Path, enforcement: gpushare_dra_plugin::cdi::EnforcementConfig) -> Arc<Node> {
    Arc::new(Node {
        driver: DRIVER.to_owned(),
        node: "n1".to_owned(),
        gpus: (0..2)
            .map(|index| GpuInfo {
                index,
                uuid: format!("GPU-sim-n1-{index}"),
                model: "Simulated GPU".to_owned(),
                mem_gib: 16,
                healthy: true,
                numa_node: None,
            })
            .collect(),
        cdi_dir: dir.join("cdi"),
        checkpoint_path: dir.join("checkpoint.json"),
        enforcement,
    })
}

/// Serves a fresh service (reading the checkpoint on disk, as a restarted plugin does) and
/// returns a client and the token that stops it.
async fn serve(
    dir: &Path,
    claims: Claims,
) -> (
    DraPluginClient<tonic::transport::Channel>,
    CancellationToken,
) {
    serve_node(node(dir), dir, claims).await
}

/// [`serve`] for a given node.
async fn serve_node(
    node: Arc<Node>,
    dir: &Path,
    claims: Claims,
) -> (
    DraPluginClient<tonic::transport::Channel>,
    CancellationToken,
) {
    std::fs::create_dir_all(&node.cdi_dir).unwrap();
    let checkpoint = Checkpoint::load(&node.checkpoint_path).unwrap();
    let socket = dir.join("dra.sock");
    let _ = std::fs::remove_file(&socket);
    let listener = UnixListener::bind(&socket).unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(
        Server::builder()
            .add_service(DraPluginServer::new(DraService::new(
                node, claims, checkpoint,
            )))
            .serve_with_incoming_shutdown(
                UnixListenerStream::new(listener),
                stop.clone().cancelled_owned(),
            ),
    );
    let channel = gpushare_proto::connect_unix(&socket).await.unwrap();
    (DraPluginClient::new(channel), stop)
}

fn claim(name: &str, uid: &str) -> Claim {
    Claim {
        namespace: "ns".to_owned(),
        uid: uid.to_owned(),
        name: name.to_owned(),
    }
}

fn env_of(spec: &serde_json::Value) -> Vec<String> {
    spec["devices"][0]["containerEdits"]["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn prepare_writes_a_cdi_spec_and_survives_restarts_and_repeats() {
    let dir = tempfile::tempdir().unwrap();
    let claims = Claims::default();
    claims.0.lock().unwrap().insert(
        ("ns".into(), "a".into()),
        allocated("a", "ua", "gpu-1", "4Gi"),
    );
    let (mut client, stop) = serve(dir.path(), claims.clone()).await;

    let request = NodePrepareResourcesRequest {
        claims: vec![claim("a", "ua"), claim("missing", "um")],
    };
    let answer = client
        .node_prepare_resources(request.clone())
        .await
        .unwrap()
        .into_inner();
    let a = &answer.claims["ua"];
    assert_eq!(a.error, "");
    assert_eq!(a.devices.len(), 1);
    assert_eq!(a.devices[0].device_name, "gpu-1");
    assert_eq!(a.devices[0].pool_name, "n1");
    assert_eq!(
        a.devices[0].cdi_device_ids,
        vec!["gpushare.example.com/gpu=claim-ua-gpu-1".to_owned()]
    );
    // A claim that cannot be read fails alone, with a reason.
    assert!(
        answer.claims["um"].error.contains("not found"),
        "{:?}",
        answer.claims["um"]
    );

    let spec_path = dir
        .path()
        .join("cdi")
        .join("gpushare.example.com-claim-ua.json");
    let spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&spec_path).unwrap()).unwrap();
    assert_eq!(spec["kind"], "gpushare.example.com/gpu");
    let env = env_of(&spec);
    assert!(
        env.contains(&"NVIDIA_VISIBLE_DEVICES=GPU-sim-n1-1".to_owned()),
        "{env:?}"
    );
    assert!(
        env.contains(&"GPUSHARE_CONTAINER_MEM_GIB=4".to_owned()),
        "{env:?}"
    );
    // The toolkit's memory-limit hook reads the share in MiB.
    assert!(
        env.contains(&"NVIDIA_GPU_MEMORY_LIMIT=4096".to_owned()),
        "{env:?}"
    );

    // The plugin restarts, and the claim vanished from the API server meanwhile: the
    // checkpoint answers, unchanged.
    stop.cancel();
    claims.0.lock().unwrap().clear();
    let (mut client, stop) = serve(dir.path(), claims.clone()).await;
    let again = client
        .node_prepare_resources(NodePrepareResourcesRequest {
            claims: vec![claim("a", "ua")],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.claims["ua"], *a);

    // Unprepare removes the spec; a second Unprepare (and one for a claim never prepared)
    // succeeds too.
    for _ in 0..2 {
        let done = client
            .node_unprepare_resources(NodeUnprepareResourcesRequest {
                claims: vec![claim("a", "ua"), claim("x", "ux")],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(done.claims.len(), 2);
        assert!(done.claims.values().all(|c| c.error.is_empty()), "{done:?}");
        assert!(!spec_path.exists());
    }
    assert!(
        Checkpoint::load(&dir.path().join("checkpoint.json"))
            .unwrap()
            .claims
            .is_empty()
    );
    stop.cancel();
}

#[tokio::test]
async fn registration_names_the_driver_and_its_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("reg.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let (registered, mut seen) = tokio::sync::watch::channel(RegistrationState::Pending);
    let service =
        RegistrationService::new(DRIVER.to_owned(), dir.path().join("dra.sock"), registered);
    let stop = CancellationToken::new();
    tokio::spawn(
        Server::builder()
            .add_service(RegistrationServer::new(service))
            .serve_with_incoming_shutdown(
                UnixListenerStream::new(listener),
                stop.clone().cancelled_owned(),
            ),
    );
    let mut client = RegistrationClient::new(gpushare_proto::connect_unix(&socket).await.unwrap());
    let info = client.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, DRIVER);
    assert_eq!(
        info.endpoint,
        dir.path().join("dra.sock").display().to_string()
    );
    assert_eq!(info.supported_versions, vec!["v1.DRAPlugin".to_owned()]);
    client
        .notify_registration_status(RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .unwrap();
    seen.wait_for(|state| *state == RegistrationState::Registered)
        .await
        .unwrap();
    // A refusal keeps kubelet's reason, for the readiness probe to show.
    client
        .notify_registration_status(RegistrationStatus {
            plugin_registered: false,
            error: "plugin already registered".to_owned(),
        })
        .await
        .unwrap();
    assert_eq!(
        *seen.borrow(),
        RegistrationState::Refused("plugin already registered".to_owned())
    );
    stop.cancel();
}

/// `--enforcement preload`: Prepare makes the claim's accounting directory with its budget,
/// and its limits file, and its spec mounts them with the interposer (the limits file
/// read-only); Unprepare removes both with the spec.
#[tokio::test]
async fn preload_gives_each_claim_an_accounting_directory_for_its_life() {
    let dir = tempfile::tempdir().unwrap();
    let claims = Claims::default();
    claims.0.lock().unwrap().insert(
        ("ns".into(), "a".into()),
        allocated("a", "ua", "gpu-0", "2Gi"),
    );
    let host_dir = dir.path().join("isolation");
    let node = node_with(
        dir.path(),
        gpushare_dra_plugin::cdi::EnforcementConfig {
            mode: gpushare_contract::env::Enforcement::Preload,
            mps_pipe_directory: String::new(),
            isolation: Some(gpushare_dra_plugin::cdi::Isolation {
                library: host_dir.join("lib").join("libgpushare_isolation-1-2.so"),
                host_dir: host_dir.clone(),
                exempt_namespaces: Default::default(),
                options: gpushare_contract::env::IsolationOptions {
                    context_mib: Some(640),
                    managed_memory: gpushare_contract::env::ManagedMemory::Ignore,
                    compute_mode: Default::default(),
                },
            }),
        },
    );
    let (mut client, stop) = serve_node(node, dir.path(), claims).await;
    let answer = client
        .node_prepare_resources(NodePrepareResourcesRequest {
            claims: vec![claim("a", "ua")],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.claims["ua"].error, "");
    let accounting = host_dir.join("containers").join("claim-ua");
    assert!(accounting.is_dir());
    let spec_path = dir
        .path()
        .join("cdi")
        .join("gpushare.example.com-claim-ua.json");
    let spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&spec_path).unwrap()).unwrap();
    let mounts = &spec["devices"][0]["containerEdits"]["mounts"];
    assert_eq!(mounts[1]["hostPath"], accounting.display().to_string());
    let limits_file = host_dir.join("limits").join("claim-ua");
    assert_eq!(mounts[2]["hostPath"], limits_file.display().to_string());
    assert_eq!(
        mounts[2]["containerPath"],
        gpushare_contract::env::ISOLATION_LIMITS_IN_CONTAINER
    );
    assert_eq!(mounts[2]["options"], serde_json::json!(["bind", "ro"]));
    // Prepared before any container starts: the limits file names the claim's budget, which
    // is there, for the claim's share, with the node's settings.
    let limits = gpushare_isolation_budget::PreparedLimits::parse(
        &std::fs::read_to_string(&limits_file).unwrap(),
    )
    .unwrap();
    assert_eq!(limits.shares, [2 << 30]);
    assert_eq!(limits.context_mib, Some(640));
    assert_eq!(limits.managed_memory.as_deref(), Some("ignore"));
    let budget = accounting.join(limits.budget.file_name().unwrap());
    assert_eq!(
        limits.budget,
        std::path::Path::new(gpushare_contract::env::ISOLATION_DIR_IN_CONTAINER)
            .join(budget.file_name().unwrap())
    );
    let snapshot = gpushare_isolation_budget::Snapshot::read(&budget).unwrap();
    assert_eq!(snapshot.gpus[0].share, 2 << 30);
    let env = env_of(&spec);
    assert!(env.contains(&format!(
        "LD_PRELOAD={}",
        gpushare_contract::env::ISOLATION_LIBRARY_IN_CONTAINER
    )));
    // The interposer's settings (--isolation-context-mib, --isolation-managed-memory).
    for wanted in ["GPUSHARE_CONTEXT_MIB=640", "GPUSHARE_MANAGED_MEMORY=ignore"] {
        assert!(
            env.contains(&wanted.to_owned()),
            "{wanted} missing: {env:?}"
        );
    }
    let done = client
        .node_unprepare_resources(NodeUnprepareResourcesRequest {
            claims: vec![claim("a", "ua")],
        })
        .await
        .unwrap()
        .into_inner();
    assert!(done.claims.values().all(|c| c.error.is_empty()), "{done:?}");
    assert!(!accounting.exists());
    assert!(!limits_file.exists());
    stop.cancel();
}
