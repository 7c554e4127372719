//! With `--allocation-keys-file`, the plugin acts only on allocations the extender signed:
//! a pod created with hand-written allocation annotations, or with another pod's signed
//! ones, is refused at Allocate with a clear error, while honest pods on the same node are
//! served. Real gRPC over unix sockets; kubelet's rejection of such pods runs on the real
//! cluster (`forgeries_without_the_policy_are_refused_at_allocate` in `tests/real.rs`).

use crate::device_plugin_common as common;

use std::collections::BTreeMap;

use common::{
    Cluster, NODE, Plugin, WAIT, allocate_slots, allocation, assigned, client, eventually, ids,
    marks, marks_on, placed, preferred, refused, uuid,
};
use gpushare_contract::{Keyring, Keys, PodAllocation, env};
use gpushare_testkit::fixtures::pod;
use k8s_openapi::api::core::v1::{Binding, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::PostParams;
use tempfile::TempDir;
use tonic::Code;

const KEYRING: &str = "k1:AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=\n";

/// The keyring file in a temp dir, and the plugin flag that points at it.
fn keyring_file() -> anyhow::Result<(TempDir, Vec<String>)> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("keys");
    std::fs::write(&path, KEYRING)?;
    let flags = ["--allocation-keys-file", &path.display().to_string()].map(str::to_owned);
    Ok((dir, flags.to_vec()))
}

/// Creates pod `name` unbound and binds it as the extender does: one Binding whose
/// annotations carry the decision (GPU `gpu`, one `gib` container) signed for the pod's UID.
async fn bind_signed(cluster: &Cluster, name: &str, gpu: u32, gib: u64) -> anyhow::Result<()> {
    let created = pod(name).gpu_mem(gib).create(&cluster.client).await?;
    let uid = created.metadata.uid.clone().unwrap_or_default();
    let keys = Keys::default();
    let annotations = BTreeMap::from_iter(allocation(gpu, &[("main", gib, false)], 1));
    let decision = PodAllocation::from_annotations(&keys, &annotations)?;
    let mut decision = decision.ok_or_else(|| anyhow::anyhow!("no allocation"))?;
    decision.signature = Some(Keyring::parse(KEYRING)?.sign(&uid, NODE, &decision));
    let binding = Binding {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some("default".to_owned()),
            uid: Some(uid),
            annotations: Some(decision.to_annotations(&keys)),
            ..ObjectMeta::default()
        },
        target: ObjectReference {
            api_version: Some("v1".to_owned()),
            kind: Some("Node".to_owned()),
            name: Some(NODE.to_owned()),
            ..ObjectReference::default()
        },
    };
    let pods = Api::<Pod>::default_namespaced(cluster.client.clone());
    let pp = PostParams::default();
    pods.create_subresource::<_, serde_json::Value>("binding", name, &pp, &binding)
        .await?;
    Ok(())
}

/// Creates pod `name` (asking for `gib`) on the node with the decision and signature copied
/// from pod `from`, progress marks reset: what a user who can read that pod could write.
async fn create_copy(cluster: &Cluster, name: &str, from: &str, gib: u64) -> anyhow::Result<()> {
    let keys = Keys::default();
    let source = cluster.pod(from).await?;
    let annotations = source.metadata.annotations.unwrap_or_default();
    anyhow::ensure!(
        annotations.contains_key(&keys.signature),
        "{from} is signed"
    );
    let mut builder = pod(name).gpu_mem(gib).on_node(NODE);
    for (k, v) in &annotations {
        if k.starts_with("gpushare.example.com/") && *k != keys.allocated && *k != keys.assigned {
            builder = builder.annotation(k, v);
        }
    }
    builder = builder.annotation(&keys.assigned, "false");
    builder.create(&cluster.client).await?;
    Ok(())
}

#[tokio::test]
async fn forged_and_copied_allocations_are_refused_while_signed_ones_are_served()
-> anyhow::Result<()> {
    let (_keys, mut flags) = keyring_file()?;
    // The marks show which pod the plugin served: on for this test.
    flags.extend(marks_on());
    let cluster = Cluster::start_with(&[16, 16], None, &flags).await?;
    bind_signed(&cluster, "honest", 1, 3).await?;
    // Hand-written allocation annotations (no signature).
    placed("forged", 1, 2, 0).create(&cluster.client).await?;
    create_copy(&cluster, "copy", "honest", 3).await?;

    let mut plugin = client(&cluster).await?;

    // Preferred allocation is not steered by the forged pod (GPU 1): kubelet's own pick.
    let available = ids(&[0, 1], 0..4);
    let chosen = preferred(&mut plugin, available.clone(), 2).await?;
    assert_eq!(chosen, available[..2].to_vec());

    // The forged pod: refused, named, told what to do.
    let forged = allocate_slots(&mut plugin, 0..2).await;
    refused(
        forged,
        Code::PermissionDenied,
        &[
            "pod default/forged",
            "this pod's gpushare allocation is not signed by the gpushare extender",
            "it carries no signature",
            "delete it and let the scheduler place it",
        ],
    );

    // The honest pod on the same node: served with the GPU the extender chose.
    let envs = allocate_slots(&mut plugin, 0..3).await?.envs;
    assert_eq!(envs[env::NVIDIA_VISIBLE_DEVICES], uuid(1));
    assert_eq!(envs[env::CONTAINER_GIB], "3");

    // The copy of its signed annotations on another pod (another UID): refused.
    let copy = allocate_slots(&mut plugin, 0..3).await;
    let why = ["pod default/copy", "does not match its allocation"];
    refused(copy, Code::PermissionDenied, &why);
    // The honest pod is marked allocated; neither refused pod is.
    let honest = || assigned(&cluster, "honest");
    eventually(WAIT, "the honest pod's marks", honest).await?;
    for refused in ["forged", "copy"] {
        assert_eq!(marks(&cluster, refused).await?.1, "false", "{refused}");
    }
    cluster.stop().await
}

#[tokio::test]
async fn a_malformed_keyring_stops_the_plugin_with_a_clear_error() -> anyhow::Result<()> {
    let server = gpushare_e2e::apiserver::ApiServer::start().await?;
    let dir = tempfile::tempdir()?;
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "# rotation in progress\nk1:c2hvcnQ=\n")?;
    let keys = keys.display().to_string();
    let flags = ["--allocation-keys-file".to_owned(), keys.clone()];
    let health = dir.path().join("unhealthy");
    let plugin = Plugin::start(server.client(), dir.path(), &health, &[16], &flags)?;
    let error = tokio::time::timeout(WAIT, plugin.task).await??;
    let error = error.unwrap_err().to_string();
    let said = [
        "--allocation-keys-file",
        &keys,
        "line 2: the key of \"k1\" is 5 bytes",
    ];
    assert!(said.iter().all(|s| error.contains(s)), "{error}");
    server.shutdown().await;
    Ok(())
}
