//! A gpushare pod through kube-scheduler and the extender: the request it makes, the
//! allocator's cluster the extender keeps, and one scheduling cycle (walk, the extender's
//! filter, the profile's scores, bind). This path runs gpushare's real allocation core
//! (`gpushare_allocator`): what the report says about gpushare is decided here.

use gpushare_allocator::demand_mix::ResourceScores;
use gpushare_allocator::fragmentation::Host;
use gpushare_allocator::{Cluster, Gpu, ModelFilter, PodId, Policy, Request, kube_scores};
use gpushare_scheduler_model::scoring::FitStrategy;

use super::generator::{MODELS, SimNode, Task};
use super::kube_scheduler::{KubeScheduler, Missed, select_host};
use super::nodes::Nodes;
use super::scores::native_most_allocated_score;
use super::strategy::{Profile, RequestForm};

pub(super) fn gpushare_cluster(nodes: &[SimNode]) -> Cluster {
    let mut cluster = Cluster::rebuild(
        nodes.iter().enumerate().map(|(n, spec)| {
            let gpus = (0..spec.gpus)
                .map(|index| Gpu {
                    index,
                    uuid: format!("GPU-{n}-{index}"),
                    model: MODELS[spec.model].name.to_owned(),
                    numa: None,
                    total_gib: spec.gpu_gib,
                    healthy: true,
                })
                .collect();
            (format!("node-{n:05}"), gpus, true)
        }),
        std::iter::empty(),
    );
    for (n, spec) in nodes.iter().enumerate() {
        cluster.set_node_host(&format!("node-{n:05}"), Some(spec.host));
    }
    cluster
}

/// The request a gpushare pod for `task` makes: fractional tasks a shared slice of one GPU;
/// whole- and multi-GPU tasks `gpus: N` and the total GiB, which in the plain `form` is N
/// shared slices of the task's GiB and with [`RequestForm::Exclusive`] N empty GPUs of at
/// least the task's GiB each, booked in full. With [`RequestForm::ModelsInRequest`] the GPU
/// models a task is pinned to are in the request.
pub fn gpushare_request(task: &Task, form: RequestForm) -> Request {
    let models = match task.model {
        Some(models) if form == RequestForm::ModelsInRequest => ModelFilter::parse(
            MODELS
                .iter()
                .enumerate()
                .filter(|(m, _)| models.contains(*m))
                .map(|(_, model)| model.name),
        ),
        _ => ModelFilter::default(),
    };
    Request {
        gpus: task.gpus.max(1),
        exclusive: form == RequestForm::Exclusive && task.is_whole(),
        pod_gib: task.demand_gib(),
        containers: vec![task.demand_gib()],
        host: task.host,
        models,
        compute: 0,
    }
}

/// A GPU task's pod, asking in `form`, through kube-scheduler and the gpushare extender:
/// kube-scheduler's walk, then on the nodes it found filter = the allocator's fit, prioritize =
/// its scores (as `profile` asks), bind = its reserve.
pub(super) fn gpushare(
    state: &Nodes<'_>,
    cluster: Option<&mut Cluster>,
    task: &Task,
    policy: Option<Policy>,
    profile: Profile,
    form: RequestForm,
    (i, kube): (usize, &mut KubeScheduler),
) -> Result<(usize, Vec<usize>), Missed> {
    let cluster = cluster.ok_or(Missed::Everywhere)?;
    let request = gpushare_request(task, form);
    // The extender's view sees the pod arrive (pending) before the scheduler asks about it;
    // as the extender, it follows the demand mix and learns its shape.
    cluster.observe_arrival(
        (request.gpus, request.gib_per_gpu()),
        request.exclusive,
        task.host,
        task.model.is_some(),
    );
    let candidates = filter(state, cluster, task, &request, kube)?;
    let names: Vec<&str> = candidates.iter().map(|&n| &*state.names[n]).collect();
    let extender: Option<Vec<u8>> = policy
        .filter(|_| candidates.len() > 1 && profile.extender_scores())
        .map(|policy| cluster.scores(&names, &request, policy));
    // The filter that keeps the best ranks as the extender does: kube-scheduler's CPU and
    // memory scores count as the recent demand mix says (`gpushare_allocator::demand_mix`).
    let which = cluster.demand().resource_scores();
    // The idle-GPU taint does not count: the chart's routing gives GPU pods a toleration.
    let totals = candidates.iter().enumerate().map(|(c, &n)| {
        let theirs = extender.as_ref().map_or(0, |s| i64::from(s[c]) * 10);
        let total = total(profile, state, (n, which), task, &request, theirs);
        (n, total)
    });
    let n = if matches!(profile, Profile::FilterKeepBest | Profile::Weighted { .. }) {
        // The first of the highest totals: the one node the filter passes.
        totals
            .rev()
            .max_by_key(|&(_, total)| total)
            .map(|(n, _)| n)
            .ok_or(Missed::Everywhere)?
    } else {
        select_host(totals, &mut kube.rng).ok_or(Missed::Everywhere)?
    };
    let gpus = bind(state, cluster, n, &request, (i, policy))?;
    Ok((n, gpus))
}

/// kube-scheduler's filters (the model's node label, unless the request names the models;
/// CPU, memory and the GPU-memory resource, the node's total, as `NodeResourcesFit` counts
/// them) pick the nodes its walk finds; the extender's filter (the allocator's fit, models
/// included) runs on those alone. The nodes that pass both, or why there are none.
fn filter(
    state: &Nodes<'_>,
    cluster: &Cluster,
    task: &Task,
    request: &Request,
    kube: &mut KubeScheduler,
) -> Result<Vec<usize>, Missed> {
    let walk = kube.walk(state.specs.len(), |n| {
        let spec = &state.specs[n];
        (!request.models.is_any() || state.model_ok(n, task))
            && state.host_free(n).fits(task.host)
            && state.requested_gib[n] + request.pod_gib <= u64::from(spec.gpus) * spec.gpu_gib
    });
    let extender_fits = |n: usize| cluster.fit(&state.names[n], request).is_ok();
    let candidates: Vec<usize> = walk
        .feasible
        .iter()
        .copied()
        .filter(|&n| extender_fits(n))
        .collect();
    if !candidates.is_empty() {
        return Ok(candidates);
    }
    // A node the walk did not reach, passing both filters, would have taken the pod.
    let outside = walk
        .unvisited()
        .any(|n| state.model_ok(n, task) && state.host_free(n).fits(task.host) && extender_fits(n));
    Err(if outside {
        Missed::OutsideWalk
    } else {
        Missed::Everywhere
    })
}

/// Node `n`'s total under `profile`, the extender's score × 10 being `theirs` (0 when it does
/// not score); `which` says which of kube-scheduler's CPU and memory scores the extender's
/// own ranking (the filter that keeps the best) counts.
fn total(
    profile: Profile,
    state: &Nodes<'_>,
    (n, which): (usize, ResourceScores),
    task: &Task,
    request: &Request,
    theirs: i64,
) -> i64 {
    match profile {
        Profile::Default { weight } => state.default_score(n, task.host) + theirs * weight,
        Profile::FilterKeepBest => match which {
            ResourceScores::Both => state.default_score(n, task.host) + theirs,
            ResourceScores::Balanced => {
                let requested = state.used[n].saturating_add(task.host);
                kube_scores::balanced_allocation(state.specs[n].host, requested) + theirs
            }
            ResourceScores::Neither => theirs,
        },
        Profile::Weighted {
            least,
            most,
            balanced,
            extender,
        } => {
            let (allocatable, requested) =
                (state.specs[n].host, state.used[n].saturating_add(task.host));
            least * kube_scores::least_allocated(allocatable, requested)
                + most * host_most_allocated(allocatable, requested)
                + balanced * kube_scores::balanced_allocation(allocatable, requested)
                + extender * theirs
        }
        Profile::ExtenderOnly => theirs,
        Profile::NativeMostAllocated => {
            native_most_allocated_score(state, n, request.pod_gib, task.host)
        }
    }
}

/// `NodeResourcesFit` MostAllocated on CPU and memory, equally weighted, for a node with
/// `requested` of its `allocatable` once the pod is on it.
fn host_most_allocated(allocatable: Host, requested: Host) -> i64 {
    let most = |r: u64, c: u64| FitStrategy::MostAllocated.resource_score(r.into(), c.into());
    (most(requested.milli_cpu, allocatable.milli_cpu)
        + most(requested.memory_mib, allocatable.memory_mib))
        / 2
}

/// The extender's bind of task `i` on node `n` under `policy` (binpack when it has none): the
/// allocator's reserve, and the device plugin's allocation at once (no containers wait as
/// twins in this simulation). The GPUs it booked.
fn bind(
    state: &Nodes<'_>,
    cluster: &mut Cluster,
    n: usize,
    request: &Request,
    (i, policy): (usize, Option<Policy>),
) -> Result<Vec<usize>, Missed> {
    let uid = PodId::from(format!("task-{i}"));
    let bind = policy.unwrap_or(Policy::Binpack);
    let placement = cluster
        .reserve(uid.clone(), &state.names[n], request, bind)
        .map_err(|_| Missed::Everywhere)?;
    let gpus: Vec<usize> = std::iter::once(placement.gpu)
        .chain(placement.more_gpus.iter().map(|(index, _)| *index))
        .map(|index| index as usize)
        .collect();
    cluster.upsert_pod(uid, &state.names[n], placement.allocated());
    Ok(gpus)
}
