//! The plugin's gRPC API called directly over its unix socket (no kubelet): bad input and
//! refusals come back as clear gRPC errors, and Allocate never lists pods.

use crate::device_plugin_common as common;

use std::time::Duration;

use anyhow::Context as _;
use common::{
    Cluster, NODE, WAIT, allocate, allocate_slots, allocation, annotated, client, ids, placed,
    preferred, refused, uuid, wait_for_unhealthy_devices,
};
use gpushare_contract::env;
use gpushare_e2e::apiserver::Verb;
use gpushare_proto::v1beta1::Empty;
use gpushare_testkit::fixtures::pod;
use tonic::Code;

#[tokio::test]
async fn bad_requests_get_clear_errors() -> anyhow::Result<()> {
    let cluster = Cluster::start(&[16, 16], None).await?;
    let mut plugin = client(&cluster).await?;

    let options = plugin.get_device_plugin_options(Empty {}).await?;
    let options = options.into_inner();
    assert!(options.get_preferred_allocation_available && !options.pre_start_required);

    let empty = plugin.allocate(allocate(vec![])).await;
    refused(empty, Code::InvalidArgument, &["asks for no devices"]);
    let unknown = [vec!["GPU-nope-0".to_owned()], ids(&[0], 0..1)].concat();
    let unknown = plugin.allocate(allocate(unknown)).await;
    let err = refused(unknown, Code::InvalidArgument, &["GPU-nope-0"]);
    assert!(!err.message().contains(&uuid(0)), "{}", err.message());
    let why = "no pod bound to node n1 is waiting for a 4 GiB example.com/gpu-mem allocation; was it scheduled by the gpushare extender?";
    let four = allocate_slots(&mut plugin, 0..4).await;
    refused(four, Code::FailedPrecondition, &[why]);

    // Preferred allocation never fails: with no pod to go by, kubelet's own pick.
    let available = ids(&[0, 1], 0..3);
    let chosen = preferred(&mut plugin, available.clone(), 2).await?;
    assert_eq!(chosen, available[..2].to_vec());
    cluster.stop().await
}

#[tokio::test]
async fn allocate_answers_from_the_watch_cache_and_refuses_broken_gpus() -> anyhow::Result<()> {
    let mut cluster = Cluster::start(&[16, 16], None).await?;
    let mut plugin = client(&cluster).await?;
    for (name, gpu, second) in [("a", 1, 1), ("b", 1, 2), ("c", 0, 3)] {
        placed(name, gpu, 3, second).create(&cluster.client).await?;
    }
    // The uuid in the annotation must be ours.
    let mut forged = allocation(0, &[("main", 5, false)], 4);
    for (_, v) in forged.iter_mut().filter(|(_, v)| *v == uuid(0)) {
        *v = "GPU-elsewhere".to_owned();
    }
    let wrong = annotated(pod("wrong").gpu_mem(5).on_node(NODE), forged);
    wrong.create(&cluster.client).await?;

    // Preferred allocation steers kubelet to the oldest waiting pod's GPU (a → GPU 1).
    // The pods may not have reached the plugin's cache yet; then the answer is the first 3.
    let chosen = preferred(&mut plugin, ids(&[0, 1], 0..16), 3).await?;
    assert_eq!(chosen.len(), 3);

    let lists_before = cluster.server.stats().count(Verb::List, "pods");
    // Three 3 GiB Allocates: a and b (GPU 1, oldest first), then c (GPU 0).
    let mut got = Vec::new();
    for slot in 0..3u64 {
        let env = allocate_slots(&mut plugin, slot * 3..slot * 3 + 3).await;
        let env = env?.envs;
        got.push(env[env::NVIDIA_VISIBLE_DEVICES].clone());
        let gib = (&*env[env::CONTAINER_GIB], &*env[env::GPU_TOTAL_GIB]);
        assert_eq!(gib, ("3", "16"));
    }
    assert_eq!(got, [uuid(1), uuid(1), uuid(0)]);
    // No fourth 3 GiB container waits.
    let fourth = allocate_slots(&mut plugin, 9..12).await;
    refused(fourth, Code::FailedPrecondition, &[]);
    let wrong = allocate_slots(&mut plugin, 0..5).await;
    refused(
        wrong,
        Code::FailedPrecondition,
        &["GPU-elsewhere", "default/wrong"],
    );
    let lists = cluster.server.stats().count(Verb::List, "pods");
    assert_eq!(lists, lists_before);

    // A pod on a GPU that turned unhealthy is refused as unavailable.
    placed("late", 1, 2, 5).create(&cluster.client).await?;
    cluster.set_unhealthy("1")?;
    let mut devices = wait_for_unhealthy_devices(&mut plugin).await?;
    let late = allocate_slots(&mut plugin, 0..2).await;
    refused(late, Code::Unavailable, &["unhealthy", "default/late"]);

    // Shutdown ends ListAndWatch streams and removes the socket.
    cluster.stop_plugin().await?;
    let ended = tokio::time::timeout(Duration::from_secs(5), devices.message()).await?;
    let ended = matches!(ended, Ok(None) | Err(_));
    assert!(ended, "the stream must end at shutdown");
    assert!(!cluster.plugin_socket().exists());
    cluster.stop().await
}

/// ListAndWatch sends the device list a second time shortly after it opens: kubelet marks a
/// resource unhealthy when any of its clients ends, even one it already replaced, and only a
/// later list makes the devices healthy again (`service::REANNOUNCE_AFTER`).
#[tokio::test]
async fn list_and_watch_sends_the_list_again_after_opening() -> anyhow::Result<()> {
    let cluster = Cluster::start(&[16, 8], None).await?;
    let mut plugin = client(&cluster).await?;
    let mut devices = plugin.list_and_watch(Empty {}).await?.into_inner();
    let mut next = async |which: &str| {
        let list = tokio::time::timeout(WAIT, devices.message()).await;
        let list = list.with_context(|| format!("no {which} list"))??;
        list.with_context(|| format!("ListAndWatch ended before the {which} list"))
    };
    let first = next("first").await?;
    assert_eq!(first.devices.len(), 24);
    assert_eq!(next("second").await?, first, "the same GPUs, listed again");
    cluster.stop().await
}
