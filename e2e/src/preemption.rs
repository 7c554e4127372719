//! Preemption stories, run on the real cluster (`e2e/tests/real.rs`), whose kube-scheduler is
//! upstream's own: a more important GPU pod arrives on a full node, and the pods evicted for it
//! must be exactly those whose going makes room on one GPU.
//!
//! Every story runs on one node with GPUs of 15 and 16 GiB (the kit's `node-k`), its pods
//! pinned there, with priorities from the [`CLASSES`] it creates. The fill is placed one pod at
//! a time, each pod's class checked against the GPU it landed on, so the layout a story needs
//! does not rest on a guess of the placement policy's choice.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, PostParams};

use crate::cluster::{published_gpus, wait_for};
use crate::fixtures::pod;
use crate::scenarios::{
    Harness, START_TIMEOUT, allocation, check_no_overcommit, delete_now, phase, wait_bound,
};

/// The label every pod of a story carries, with the story's name.
const STORY_LABEL: &str = "gpushare-e2e-preemption";

/// The classes the stories use, by name and value.
pub const CLASSES: [(&str, i32); 3] = [
    ("gpushare-e2e-low", 10),
    ("gpushare-e2e-mid", 100),
    ("gpushare-e2e-high", 100_000),
];

/// Creates the stories' PriorityClasses (those that exist are left as they are). Only the
/// high class preempts: a fill pod that finds no room for a moment (a twin not yet admitted, a
/// hold for a pod still binding) waits instead of preempting a fill pod the count does not
/// see go. Whom the high pod evicts does not depend on the victims' own policy.
pub async fn create_priority_classes(h: &impl Harness) -> anyhow::Result<()> {
    let classes: Api<PriorityClass> = Api::all(h.client());
    for (name, value) in CLASSES {
        let policy = match name == CLASSES[2].0 {
            true => "PreemptLowerPriority",
            false => "Never",
        };
        let class: PriorityClass = serde_json::from_value(serde_json::json!({
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": name},
            "value": value,
            "preemptionPolicy": policy,
        }))?;
        match classes.create(&PostParams::default(), &class).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(error) => return Err(error).with_context(|| format!("creating {name}")),
        }
    }
    Ok(())
}

/// A pod of `story` asking `gib` (over `gpus` GPUs), of priority class `class`, pinned to
/// `node`.
fn story_pod(
    h: &impl Harness,
    story: &str,
    name: &str,
    node: &str,
    gib: u64,
    gpus: u32,
    class: &str,
) -> anyhow::Result<Pod> {
    let mut builder = pod(name).namespace(h.namespace()).gpu_mem(gib);
    if gpus > 1 {
        builder = builder.annotation("gpushare.example.com/gpus", &gpus.to_string());
    }
    let mut pod = builder.build();
    pod.metadata
        .labels
        .get_or_insert_default()
        .insert(STORY_LABEL.to_owned(), story.to_owned());
    let spec = pod.spec.as_mut().context("pod spec")?;
    spec.priority_class_name = Some(class.to_owned());
    spec.affinity = Some(serde_json::from_value(
        serde_json::json!({"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
        ]}}}),
    )?);
    Ok(pod)
}

/// The fill of a story: each pod's name, GPU index and class.
pub type Fill = Vec<(String, u32, &'static str)>;

/// Which class a fill pod that lands on a GPU should have, given the pods placed before it.
type Want = fn(gpu: u32, placed: &Fill) -> &'static str;

/// Fills the GPUs of `node` with 4 GiB pods, one at a time, until no GPU has 4 GiB free; each
/// pod gets the class `want` gives for the GPU it lands on. The class is guessed from where
/// the last pod went (or the only GPU with room); a pod that lands elsewhere with the wrong
/// class is deleted and created again with the right one, which lands where it did.
async fn fill(h: &impl Harness, story: &str, node: &str, want: Want) -> anyhow::Result<Fill> {
    wait_no_gpu_pods_on(h, node).await?;
    let pods: Api<Pod> = Api::namespaced(h.client(), h.namespace());
    let sizes: BTreeMap<u32, u64> = gpu_sizes(h, node).await?;
    let mut used: BTreeMap<u32, u64> = sizes.keys().map(|gpu| (*gpu, 0)).collect();
    let mut placed: Fill = Vec::new();
    for i in 0.. {
        let room: Vec<u32> = (used.iter())
            .filter(|(gpu, used)| sizes.get(gpu).copied().unwrap_or(0).saturating_sub(**used) >= 4)
            .map(|(gpu, _)| *gpu)
            .collect();
        let Some(&some_room) = room.first() else {
            break;
        };
        let guess = match placed.last() {
            Some((_, last, _)) if room.contains(last) => *last,
            _ => some_room,
        };
        let name = format!("{story}-{i}");
        let mut class = want(guess, &placed);
        let mut gpu = place(h, story, &name, node, class).await?;
        if want(gpu, &placed) != class {
            delete_now(&pods, &name, &format!("{name} to be gone")).await?;
            class = want(gpu, &placed);
            let again = place(h, story, &name, node, class).await?;
            ensure!(
                again == gpu,
                "{name} went to GPU {gpu}, then to GPU {again}"
            );
            gpu = again;
        }
        let now = used.entry(gpu).or_default();
        *now += 4;
        let size = sizes.get(&gpu).copied().unwrap_or(0);
        if *now > size {
            let mut gone = Vec::new();
            for (placed_name, _, _) in &placed {
                if pods.get_opt(placed_name).await?.is_none() {
                    let said = scheduler_log_naming(h, placed_name).await;
                    gone.push(format!("{placed_name}: {said}"));
                }
            }
            let on_node = allocations_on(h, node).await;
            anyhow::bail!(
                "{name} (4 GiB) landed on GPU {gpu} of {size} GiB, where this story's pods \
                 already held {} GiB: over-committed, or another story's pods were still \
                 there; placed before it: {placed:?}; of those gone since: {gone:?}; every \
                 pod bound to {node} now: {on_node}",
                *now - 4
            );
        }
        placed.push((name, gpu, class));
    }
    for (name, _, _) in &placed {
        wait_for(&format!("{name} to run"), START_TIMEOUT, || async {
            let pod = pods.get(name).await.ok()?;
            (phase(&pod) == "Running").then_some(())
        })
        .await?;
    }
    Ok(placed)
}

/// Waits until no unfinished pod on `node` asks for GPU memory. Why: a story counts the GPUs'
/// room from its own pods only; a pod left terminating there would take room the count does
/// not see, and a fill pod of a higher class would then preempt one of this story's.
async fn wait_no_gpu_pods_on(h: &impl Harness, node: &str) -> anyhow::Result<()> {
    use gpushare_contract::{DEFAULT_RESOURCE, pod_request_with, request::pod_is_finished};
    let all: Api<Pod> = Api::all(h.client());
    let keys = gpushare_contract::Keys::default();
    wait_for(
        &format!("the GPU pods left on {node} to be gone"),
        START_TIMEOUT,
        || async {
            let pods = all.list(&Default::default()).await.ok()?;
            let holding = pods.items.iter().any(|pod| {
                pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
                    && !pod_is_finished(pod)
                    && matches!(pod_request_with(pod, DEFAULT_RESOURCE, &keys), Ok(Some(_)))
            });
            (!holding).then_some(())
        },
    )
    .await
}

/// Creates fill pod `name` (4 GiB, `class`) and returns the GPU it is bound to. The fill is
/// set-up, not what a story checks: one that vanishes before its bind (the real tier saw it
/// once) is reported, with the scheduler's log of it, and created once more.
async fn place(
    h: &impl Harness,
    story: &str,
    name: &str,
    node: &str,
    class: &str,
) -> anyhow::Result<u32> {
    let pods: Api<Pod> = Api::namespaced(h.client(), h.namespace());
    let mut tries = 0;
    let bound = loop {
        tries += 1;
        let pod = story_pod(h, story, name, node, 4, 1, class)?;
        let created = pods.create(&PostParams::default(), &pod).await?;
        match wait_bound(&pods, name).await {
            Ok(bound) => break bound,
            Err(error) if tries == 1 && matches!(pods.get_opt(name).await, Ok(None)) => {
                let uid = created.metadata.uid.unwrap_or_default();
                let said = scheduler_log_naming(h, name).await;
                println!(
                    "  {name} (uid {uid}) vanished before its bind, creating it again: {error:#}; \
                     the scheduler's log of it: {said}"
                );
            }
            Err(error) => return Err(error),
        }
    };
    ensure!(bound == node, "{name} bound elsewhere");
    Ok(allocation(&pods.get(name).await?)?.gpu_index)
}

/// Every pod bound to `node`, any namespace and phase, with its allocation's GPU and GiB, its
/// phase, whether it is being deleted and its UID: what the API server shows when a fill pod
/// lands where the story's count says there is no room.
async fn allocations_on(h: &impl Harness, node: &str) -> String {
    let all: Api<Pod> = Api::all(h.client());
    let pods = match all.list(&Default::default()).await {
        Ok(list) => list.items,
        Err(error) => return format!("listing the pods failed: {error}"),
    };
    let bound_there = pods
        .iter()
        .filter(|pod| pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node));
    let described: Vec<String> = bound_there
        .map(|pod| {
            let meta = &pod.metadata;
            let held = allocation(pod).map_or("no allocation".to_owned(), |a| {
                format!("GPU {} {} GiB", a.gpu_index, a.pod_gib)
            });
            let deleting = if meta.deletion_timestamp.is_some() {
                ", deleting"
            } else {
                ""
            };
            format!(
                "{}/{} ({held}, {}{deleting}, uid {})",
                meta.namespace.as_deref().unwrap_or_default(),
                meta.name.as_deref().unwrap_or_default(),
                phase(pod),
                meta.uid.as_deref().unwrap_or_default()
            )
        })
        .collect();
    described.join("; ")
}

/// The lines of the chart's kube-scheduler logs (`--v=2`: binds, failures, preemption
/// victims) that name pod `name`, joined; what went wrong when they cannot be read.
async fn scheduler_log_naming(h: &impl Harness, name: &str) -> String {
    let system: Api<Pod> = Api::namespaced(h.client(), "kube-system");
    let selector = kube::api::ListParams::default().labels("app.kubernetes.io/component=scheduler");
    let schedulers = match system.list(&selector).await {
        Ok(list) => list.items,
        Err(error) => return format!("listing the schedulers failed: {error}"),
    };
    let needle = format!("/{name}\"");
    let mut lines = Vec::new();
    for scheduler in schedulers {
        let pod = scheduler.metadata.name.unwrap_or_default();
        match system.logs(&pod, &Default::default()).await {
            Ok(log) => lines.extend(
                log.lines()
                    .filter(|line| line.contains(&needle))
                    .map(|line| format!("{pod}: {line}")),
            ),
            Err(error) => lines.push(format!("{pod}: reading its log failed: {error}")),
        }
    }
    match lines.is_empty() {
        true => "no line names it".into(),
        false => lines.join(" | "),
    }
}

/// Each GPU's size on `node`, from its published inventory.
async fn gpu_sizes(h: &impl Harness, node: &str) -> anyhow::Result<BTreeMap<u32, u64>> {
    let node = Api::<k8s_openapi::api::core::v1::Node>::all(h.client())
        .get(node)
        .await?;
    let gpus = published_gpus(&node).context("no GPU inventory")??;
    Ok(gpus.into_iter().map(|g| (g.index, g.mem_gib)).collect())
}

/// What a story's preemption did.
#[derive(Debug)]
pub struct Preempted {
    /// The fill's pods that are gone or going, with their GPU and class.
    pub evicted: Fill,
    /// The preemptor's GPUs, once it is bound (`None` when it is not).
    pub gpus: Option<Vec<u32>>,
    /// Seconds from the preemptor's creation to its bind.
    pub bound_after: Option<f64>,
    /// When the preemptor was created.
    pub created: Instant,
}

/// Creates the preemptor (`gib` over `gpus` GPUs, class high) and waits up to `wait` for its
/// bind, then reports which of `fill` were evicted.
async fn preempt(
    h: &impl Harness,
    story: &str,
    node: &str,
    gib: u64,
    gpus: u32,
    fill: &Fill,
    wait: Duration,
) -> anyhow::Result<Preempted> {
    let pods: Api<Pod> = Api::namespaced(h.client(), h.namespace());
    let name = format!("{story}-important");
    let started = Instant::now();
    let preemptor = story_pod(h, story, &name, node, gib, gpus, CLASSES[2].0)?;
    pods.create(&PostParams::default(), &preemptor).await?;
    let bound = wait_for(&format!("{name} to be bound"), wait, || async {
        pods.get(&name).await.ok()?.spec?.node_name
    })
    .await;
    let bound_after = bound.is_ok().then(|| started.elapsed().as_secs_f64());
    let gpus = match bound {
        Ok(_) => Some(
            allocation(&pods.get(&name).await?)?
                .gpus()
                .map(|(i, _)| i)
                .collect(),
        ),
        Err(_) => None,
    };
    let mut evicted = Vec::new();
    for (pod_name, gpu, class) in fill {
        let pod = pods.get_opt(pod_name).await?;
        if pod.is_none_or(|pod| pod.metadata.deletion_timestamp.is_some()) {
            evicted.push((pod_name.clone(), *gpu, *class));
        }
    }
    check_no_overcommit(&h.client()).await?;
    Ok(Preempted {
        evicted,
        gpus,
        bound_after,
        created: started,
    })
}

/// Story 1, the issue's: seven 4 GiB pods fill GPUs of 15 and 16 GiB (3 + 4), the first pod
/// on each GPU of low priority, the rest mid; an 8 GiB pod of high priority arrives.
pub async fn eight_gib_among_seven(
    h: &impl Harness,
    node: &str,
    wait: Duration,
) -> anyhow::Result<(Fill, Preempted)> {
    let story = "seven";
    create_priority_classes(h).await?;
    // The first pod on each GPU low, the others mid.
    let want: Want = |gpu, placed| match placed.iter().any(|(_, g, _)| *g == gpu) {
        false => CLASSES[0].0,
        true => CLASSES[1].0,
    };
    let fill = fill(h, story, node, want).await?;
    let gpus: BTreeSet<u32> = fill.iter().map(|(_, gpu, _)| *gpu).collect();
    ensure!(
        fill.len() == 7 && gpus.len() == 2,
        "the fill should be 3 + 4 pods on two GPUs: {fill:?}"
    );
    let outcome = preempt(h, story, node, 8, 1, &fill, wait).await?;
    Ok((fill, outcome))
}

/// Checks story 1 with the extender's preempt verb: exactly two pods evicted, both from the
/// GPU the preemptor got, the low one there among them.
pub fn check_eight_gib_among_seven(fill: &Fill, outcome: &Preempted) -> anyhow::Result<()> {
    let evicted = &outcome.evicted;
    let gpu = (outcome.gpus.as_ref().and_then(|gpus| gpus.first().copied()))
        .with_context(|| format!("the 8 GiB pod was not bound; evicted: {evicted:?}"))?;
    ensure!(
        evicted.len() == 2 && evicted.iter().all(|(_, g, _)| *g == gpu),
        "two pods of GPU {gpu} should have been evicted: {evicted:?} (fill {fill:?})"
    );
    ensure!(
        evicted.iter().any(|(_, _, class)| *class == CLASSES[0].0),
        "the low pod of GPU {gpu} should be among them: {evicted:?}"
    );
    Ok(())
}

/// Story 2: GPUs of 15 and 16 GiB full of 4 GiB pods, those of the GPU the first pod went to
/// of mid priority, those of the other low; a high pod asking 8 GiB on each of 2 GPUs arrives. By
/// the node's total, the four low pods would go (16 GiB free on one GPU, 3 on the other).
pub async fn two_gpus_of_eight(
    h: &impl Harness,
    node: &str,
    wait: Duration,
) -> anyhow::Result<(Fill, Preempted)> {
    let story = "twogpu";
    create_priority_classes(h).await?;
    // Mid on the GPU the first pod went to, low on the other.
    let want: Want = |gpu, placed| match placed.first() {
        Some((_, first, _)) if *first != gpu => CLASSES[0].0,
        _ => CLASSES[1].0,
    };
    let fill = fill(h, story, node, want).await?;
    let outcome = preempt(h, story, node, 16, 2, &fill, wait).await?;
    Ok((fill, outcome))
}

/// Checks story 2 with the verb: two GPUs for the pod, two pods evicted from each (the fewest
/// that free 8 GiB on both).
pub fn check_two_gpus_of_eight(fill: &Fill, outcome: &Preempted) -> anyhow::Result<()> {
    let evicted = &outcome.evicted;
    let gpus = (outcome.gpus.as_ref())
        .with_context(|| format!("the 2-GPU pod was not bound; evicted: {evicted:?}"))?;
    ensure!(gpus.len() == 2, "two GPUs: {gpus:?}");
    let mut per_gpu: BTreeMap<u32, usize> = BTreeMap::new();
    for (_, gpu, _) in evicted {
        *per_gpu.entry(*gpu).or_default() += 1;
    }
    ensure!(
        per_gpu.values().all(|n| *n == 2) && per_gpu.len() == 2,
        "two pods of each GPU should have been evicted: {evicted:?} (fill {fill:?})"
    );
    Ok(())
}

/// Story 3: the node full of low pods; a high pod asking 20 GiB (more than any GPU has)
/// arrives, and is given `wait` to bind. By the node's total (31 GiB) five pods would go.
pub async fn too_large_for_any_gpu(
    h: &impl Harness,
    node: &str,
    wait: Duration,
) -> anyhow::Result<(Fill, Preempted)> {
    let story = "toolarge";
    create_priority_classes(h).await?;
    let fill = fill(h, story, node, |_, _| CLASSES[0].0).await?;
    let outcome = preempt(h, story, node, 20, 1, &fill, wait).await?;
    Ok((fill, outcome))
}

/// Checks story 3 with the verb: nobody evicted, the pod not bound.
pub fn check_too_large_for_any_gpu(outcome: &Preempted) -> anyhow::Result<()> {
    ensure!(
        outcome.evicted.is_empty() && outcome.gpus.is_none(),
        "pods were evicted for a pod no eviction can place: {outcome:?}"
    );
    Ok(())
}
