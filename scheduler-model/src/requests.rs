//! What pods request and nodes hold, in kube-scheduler's arithmetic: quantities parsed to
//! exact milli-units, a pod's effective requests (init containers, sidecars, overhead, and
//! the scoring defaults for containers that request nothing), and the usage a node carries.
//!
//! The in-process scheduler's filters (`gpushare-e2e`) and the scores ([`crate::scoring`]) both
//! read these.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Node, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// Request assumed for a container without a cpu request when scoring (`DefaultMilliCPURequest`).
pub const DEFAULT_MILLI_CPU_REQUEST: i128 = 100;
/// Request assumed for a container without a memory request when scoring (200 MiB).
pub const DEFAULT_MEMORY_REQUEST: i128 = 200 * 1024 * 1024;

pub const CPU: &str = "cpu";
pub const MEMORY: &str = "memory";
pub const EPHEMERAL_STORAGE: &str = "ephemeral-storage";
pub const PODS: &str = "pods";

/// An amount of a resource in thousandths of its unit (millicores for cpu, milli-bytes for memory),
/// so every quantity compares exactly, as `resource.Quantity` does.
pub type Milli = i128;

/// Resource name → amount in milli-units.
pub type Resources = BTreeMap<String, Milli>;

/// Parses a Kubernetes quantity ("100m", "1.5Gi", "4", "1e3") into milli-units, rounding up.
pub fn parse_quantity(text: &str) -> Option<Milli> {
    let text = text.trim();
    let (negative, text) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text.strip_prefix('+').unwrap_or(text)),
    };
    let number_end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(number_end);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() {
        return None;
    }
    // value = digits * 10^(-fraction.len()) * multiplier
    let digits: i128 = format!("{whole}{fraction}").parse().ok()?;
    let mut exponent10: i32 = -i32::try_from(fraction.len()).ok()?;
    let mut binary: u32 = 0;
    match suffix {
        "" => {}
        "n" => exponent10 -= 9,
        "u" => exponent10 -= 6,
        "m" => exponent10 -= 3,
        "k" => exponent10 += 3,
        "M" => exponent10 += 6,
        "G" => exponent10 += 9,
        "T" => exponent10 += 12,
        "P" => exponent10 += 15,
        "E" => exponent10 += 18,
        "Ki" => binary = 10,
        "Mi" => binary = 20,
        "Gi" => binary = 30,
        "Ti" => binary = 40,
        "Pi" => binary = 50,
        "Ei" => binary = 60,
        other => {
            let exp = other.strip_prefix(['e', 'E'])?;
            exponent10 += exp.parse::<i32>().ok()?;
        }
    }
    exponent10 += 3; // to milli-units
    let mut value = digits.checked_mul(1i128.checked_shl(binary)?)?;
    if exponent10 >= 0 {
        value = value.checked_mul(10i128.checked_pow(u32::try_from(exponent10).ok()?)?)?;
    } else {
        let divisor = 10i128.checked_pow(u32::try_from(-exponent10).ok()?)?;
        value = (value + divisor - 1) / divisor;
    }
    Some(if negative { -value } else { value })
}

fn quantities(map: Option<&BTreeMap<String, Quantity>>) -> Resources {
    map.into_iter()
        .flatten()
        .filter_map(|(name, q)| Some((name.clone(), parse_quantity(&q.0)?)))
        .collect()
}

fn add_into(total: &mut Resources, more: &Resources) {
    for (name, amount) in more {
        *total.entry(name.clone()).or_default() += amount;
    }
}

fn max_into(total: &mut Resources, other: &Resources) {
    for (name, amount) in other {
        let entry = total.entry(name.clone()).or_default();
        *entry = (*entry).max(*amount);
    }
}

/// A container's requests; a limit without a request counts as the request, as API defaulting does.
fn container_requests(container: &Container, non_zero: bool) -> Resources {
    let resources = container.resources.as_ref();
    let mut requests = quantities(resources.and_then(|r| r.requests.as_ref()));
    for (name, amount) in quantities(resources.and_then(|r| r.limits.as_ref())) {
        requests.entry(name).or_insert(amount);
    }
    if non_zero {
        // An absent request counts the default; an explicit zero stays zero, as upstream.
        requests
            .entry(CPU.to_owned())
            .or_insert(DEFAULT_MILLI_CPU_REQUEST);
        requests
            .entry(MEMORY.to_owned())
            .or_insert(DEFAULT_MEMORY_REQUEST * 1000);
    }
    requests
}

/// The pod's effective requests, as `resource.PodRequests`: the sum of app containers (plus
/// sidecars, i.e. restartable init containers) against the largest init container step, plus
/// overhead. With `non_zero`, containers without cpu/memory requests count the scoring defaults.
pub fn pod_requests(pod: &Pod, non_zero: bool) -> Resources {
    let Some(spec) = pod.spec.as_ref() else {
        return Resources::new();
    };
    let mut total = Resources::new();
    for container in &spec.containers {
        add_into(&mut total, &container_requests(container, non_zero));
    }
    let mut sidecars = Resources::new();
    let mut init_max = Resources::new();
    for container in spec.init_containers.iter().flatten() {
        let requests = container_requests(container, non_zero);
        let step = if container.restart_policy.as_deref() == Some("Always") {
            add_into(&mut total, &requests);
            add_into(&mut sidecars, &requests);
            sidecars.clone()
        } else {
            let mut step = requests;
            add_into(&mut step, &sidecars);
            step
        };
        max_into(&mut init_max, &step);
    }
    max_into(&mut total, &init_max);
    // Pod-level resources (when set) replace the container aggregate for the resources they name.
    let pod_level = quantities(spec.resources.as_ref().and_then(|r| r.requests.as_ref()));
    for (name, amount) in pod_level {
        if name == CPU || name == MEMORY {
            total.insert(name, amount);
        }
    }
    add_into(&mut total, &quantities(spec.overhead.as_ref()));
    total
}

/// Whether a pod requests (or limits) any of `names`: `HTTPExtender.IsInterested` for a non-empty
/// `managedResources` list.
pub fn pod_uses_any(pod: &Pod, names: &[String]) -> bool {
    let Some(spec) = pod.spec.as_ref() else {
        return false;
    };
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .filter_map(|c| c.resources.as_ref())
        .any(|r| {
            r.requests
                .iter()
                .chain(r.limits.iter())
                .flat_map(|m| m.keys())
                .any(|k| names.contains(k))
        })
}

/// What is already placed on a node: pods bound to it (and not terminal) plus pods assumed there.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeUsage {
    pub requested: Resources,
    /// cpu and memory with the scoring defaults for containers that request none.
    pub non_zero_cpu: Milli,
    pub non_zero_memory: Milli,
    pub pods: usize,
}

/// What one pod contributes to a [`NodeUsage`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PodUsage {
    pub requested: Resources,
    pub non_zero_cpu: Milli,
    pub non_zero_memory: Milli,
}

impl PodUsage {
    pub fn of(pod: &Pod) -> Self {
        let non_zero = pod_requests(pod, true);
        PodUsage {
            requested: pod_requests(pod, false),
            non_zero_cpu: non_zero.get(CPU).copied().unwrap_or_default(),
            non_zero_memory: non_zero.get(MEMORY).copied().unwrap_or_default(),
        }
    }
}

impl NodeUsage {
    pub fn add(&mut self, pod: &PodUsage) {
        add_into(&mut self.requested, &pod.requested);
        self.non_zero_cpu += pod.non_zero_cpu;
        self.non_zero_memory += pod.non_zero_memory;
        self.pods += 1;
    }

    pub fn remove(&mut self, pod: &PodUsage) {
        for (name, amount) in &pod.requested {
            if let Some(entry) = self.requested.get_mut(name) {
                *entry -= amount;
                if *entry == 0 {
                    self.requested.remove(name);
                }
            }
        }
        self.non_zero_cpu -= pod.non_zero_cpu;
        self.non_zero_memory -= pod.non_zero_memory;
        self.pods = self.pods.saturating_sub(1);
    }
}

/// A node's allocatable resources, parsed once per node update.
pub fn allocatable(node: &Node) -> Resources {
    quantities(node.status.as_ref().and_then(|s| s.allocatable.as_ref()))
}
