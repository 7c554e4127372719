//! The pure allocation core of gpushare: which GPU of which node a pod's GPU memory goes to.
//!
//! The extender feeds this crate what its watches see (nodes with their GPUs, pods with the
//! allocation annotations the extender wrote at bind) and asks it three questions on the
//! scheduling path: does a pod *fit* a node, how good is the node (*score*), and, at bind,
//! which GPU gets the pod (*reserve*, which decides and books in one step so two binds can
//! never take the same memory). Nothing here knows about kube, HTTP, gRPC or NVML, so every
//! rule is testable with plain values, and rebuilding the whole state from annotations after
//! a restart is the same code path as following the watch.
//!
//! ```text
//!   Cluster
//!    ├─ node "n1"  (eligible: labelled gpushare=true; present: seen in the node watch)
//!    │   ├─ GPU 0  total 16 GiB, used 12 ──┐ used = Σ pod_gib of the pods on it (and Σ compute %)
//!    │   ├─ GPU 1  total 24 GiB, used  4   │ free = total − used (saturating)
//!    │   ├─ pods   uid → PodPlacement { gpu, pod_gib, compute, pending container sizes, assigned }
//!    │   └─ pending (size GiB, gpu) → count  ◀── the twin rule reads this
//!    └─ node "n2" …
//!   pod index: uid → node   (remove_pod / release without knowing the node)
//! ```
//!
//! **The twin rule.** At `Allocate` the device plugin learns only "a container wants N GiB";
//! it must work out which pending pod that container belongs to, and so which GPU to pin it
//! to. It can do that without locks or guesses only if, on each node, every container still
//! waiting for device allocation that has the same size sits on the same GPU. So when a new
//! pod has a container of a size that is already pending on the node, the pod is pinned to
//! that GPU (and refused, retryably, if the GPU has no room). Sizes with no pending twin may
//! go to any GPU. All containers of one pod share one GPU.
//!
//! **Bookings follow the GPU, not its index.** A pod's memory is booked on the GPU whose UUID
//! its allocation names. NVML indices can shift (a GPU falls off the bus and the node
//! reboots with one fewer), and booking by index would then put running pods' memory on the
//! wrong card and hand the real one out again. A pod whose GPU is no longer in the node's
//! inventory books nothing on any other card; the index is used only when the allocation or
//! the inventory has no UUIDs.
//!
//! **Compute.** A pod may ask for a share of each of its GPUs' compute besides the memory
//! ([`Request::compute`], percent of [`COMPUTE_PER_GPU`]). A GPU takes it only where both
//! fit, and books both; under the fragmentation policy such a pod is measured only on the
//! GPUs with its compute free. Pods without it book no compute and may go where the
//! compute is all booked (they are promised none), so on GPUs only they share, memory alone
//! decides, as before.
//!
//! **No over-commit.** [`Cluster::reserve`] never books a GPU beyond its memory or its
//! compute. What the
//! watch reports ([`Cluster::upsert_pod`]) is the truth and is kept even when it collides
//! (for instance two pods' annotations after an outage); such a GPU shows as full, and all
//! arithmetic saturates instead of going negative.
//!
//! **Cost.** Per node, `fit` and `score` are O(GPUs) with no allocation: per-GPU used totals
//! are kept up to date on every change, and the pending-size map is only consulted for the
//! (few) container sizes of the pod being placed.

mod cluster;
pub mod demand_mix;
pub mod fragmentation;
pub mod kube_scores;
mod unfit;

use std::fmt;
use std::sync::Arc;

pub use cluster::{Cluster, Evictable, Eviction, GpuSet, GpuUsage, Node};
pub use unfit::{GpuList, Refusal, Unfit};

/// The compute of one GPU, in the percent a pod asks for (`gpu-compute`): a GPU is booked
/// up to this much, as it is up to its memory.
pub const COMPUTE_PER_GPU: u32 = 100;

/// A pod's identity: its UID, so a pod recreated under the same name is a different pod.
///
/// Shared, not copied: the same UID keys the extender's pod index, the node's pods and the
/// pod-to-node index, so one allocation serves all three (at 50,000 pods that is megabytes).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodId(Arc<str>);

impl PodId {
    /// The UID as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PodId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for PodId {
    fn from(uid: &str) -> Self {
        Self(uid.into())
    }
}

impl From<String> for PodId {
    fn from(uid: String) -> Self {
        Self(uid.into())
    }
}

/// One GPU of a node, as its inventory describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// Index on the node (NVML index).
    pub index: u32,
    /// UUID (`GPU-…`), empty when the node published no inventory.
    pub uuid: String,
    /// Product name, for people.
    pub model: String,
    /// Whole GiB of memory.
    pub total_gib: u64,
    /// False while the GPU must not receive new pods.
    pub healthy: bool,
    /// The NUMA node the GPU hangs off, when the inventory says; multi-GPU pods prefer GPUs
    /// that share one.
    pub numa: Option<i64>,
}

/// What a pod asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// GiB the pod holds, over all its GPUs.
    pub pod_gib: u64,
    /// GiB of each container that will ask the device plugin for memory, in admission order
    /// (a container's whole request, over all the pod's GPUs: what kubelet asks for).
    pub containers: Vec<u64>,
    /// CPU and memory the pod requests (only [`Policy::Fragmentation`] reads them).
    pub host: fragmentation::Host,
    /// Over how many distinct GPUs of the node `pod_gib` is spread, evenly (at least 1).
    pub gpus: u32,
    /// Whether the pod takes its GPUs whole: only empty GPUs, booked in full.
    pub exclusive: bool,
    /// Which GPU models the pod may get (default: any).
    pub models: ModelFilter,
    /// Percent of each GPU's compute the pod needs besides its memory (0: none): a GPU takes
    /// the pod only where both fit.
    pub compute: u32,
}

/// GPU models a pod requires or refuses, by name: `NVIDIA A10G` and `NVIDIA-A10G` (the node
/// label's form) name the same model, case aside. Empty lists allow every model.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelFilter {
    /// Normalized names of which one is required (empty: any).
    pub require: Vec<String>,
    /// Normalized names refused.
    pub exclude: Vec<String>,
}

impl ModelFilter {
    /// A filter from names as the user wrote them: `!name` refuses a model, any other name
    /// is one of the models allowed.
    pub fn parse<'a>(names: impl IntoIterator<Item = &'a str>) -> Self {
        let mut filter = Self::default();
        for name in names {
            match name.trim().strip_prefix('!') {
                Some(refused) => filter.exclude.push(normalize_model(refused)),
                None => filter.require.push(normalize_model(name)),
            }
        }
        filter.require.retain(|n| !n.is_empty());
        filter.exclude.retain(|n| !n.is_empty());
        filter
    }

    /// Whether any model is allowed.
    pub fn is_any(&self) -> bool {
        self.require.is_empty() && self.exclude.is_empty()
    }

    /// Whether a GPU of `model` may be given.
    pub fn allows(&self, model: &str) -> bool {
        if self.is_any() {
            return true;
        }
        let model = normalize_model(model);
        (self.require.is_empty() || self.require.contains(&model)) && !self.exclude.contains(&model)
    }
}

impl fmt::Display for ModelFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts: Vec<String> = self.require.clone();
        parts.extend(self.exclude.iter().map(|m| format!("not {m}")));
        f.write_str(&parts.join(" or "))
    }
}

/// A model name compared the way the node labels spell it: every character a label cannot
/// hold becomes `-`, leading and trailing punctuation goes, ASCII lowercase.
pub fn normalize_model(name: &str) -> String {
    let cleaned: String = name
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    cleaned
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_owned()
}

impl Default for Request {
    fn default() -> Self {
        Self {
            pod_gib: 0,
            containers: Vec::new(),
            host: fragmentation::Host::default(),
            gpus: 1,
            exclusive: false,
            models: ModelFilter::default(),
            compute: 0,
        }
    }
}

impl Request {
    /// GiB needed on each GPU.
    pub fn gib_per_gpu(&self) -> u64 {
        self.pod_gib / u64::from(self.gpus.max(1))
    }

    /// Whether the request needs more than a shared slice of one GPU.
    pub fn is_multi(&self) -> bool {
        self.gpus > 1 || self.exclusive
    }
}

/// Where a pod sits, as recorded in its annotations (or booked by [`Cluster::reserve`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodPlacement {
    /// Index of the GPU holding the pod, as recorded at bind.
    pub gpu: u32,
    /// UUID of that GPU as recorded at bind; empty when unknown (a node without inventory).
    /// When set, it and not the index says which GPU holds the memory: see
    /// [`Cluster`]'s "Bookings follow the GPU".
    pub uuid: Arc<str>,
    /// The pod's other GPUs (index, UUID) when it spans several; empty for one GPU.
    pub more_gpus: Vec<(u32, Arc<str>)>,
    /// GiB the pod holds on each of its GPUs.
    pub pod_gib: u64,
    /// Whether the pod holds its GPUs whole: each is booked in full, whatever `pod_gib`.
    pub exclusive: bool,
    /// Percent of each of its GPUs' compute the pod holds (0: none; exclusive: all of it).
    pub compute: u32,
    /// Sizes (GiB) of the pod's containers still waiting for device allocation.
    pub pending: Vec<u64>,
    /// True once the device plugin has allocated every container; `pending` is then ignored.
    pub assigned: bool,
}

impl PodPlacement {
    /// Sizes of containers still waiting for the device plugin.
    pub fn pending_sizes(&self) -> &[u64] {
        if self.assigned { &[] } else { &self.pending }
    }
}

/// The outcome of a successful [`Cluster::reserve`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The node.
    pub node: String,
    /// Index of the chosen GPU.
    pub gpu: u32,
    /// UUID of the chosen GPU (empty when unknown).
    pub uuid: String,
    /// The other GPUs (index, UUID) of a multi-GPU pod, best first; empty for one GPU.
    pub more_gpus: Vec<(u32, String)>,
    /// GiB booked on each GPU.
    pub pod_gib: u64,
    /// Whether the GPUs are the pod's alone.
    pub exclusive: bool,
    /// Percent of each GPU's compute booked.
    pub compute: u32,
}

impl Placement {
    /// The booking of this placement once the device plugin has allocated every container
    /// (as a simulation that allocates at once records it: no containers wait as twins).
    pub fn allocated(&self) -> PodPlacement {
        PodPlacement {
            gpu: self.gpu,
            uuid: self.uuid.as_str().into(),
            more_gpus: self
                .more_gpus
                .iter()
                .map(|(index, uuid)| (*index, uuid.as_str().into()))
                .collect(),
            pod_gib: self.pod_gib,
            exclusive: self.exclusive,
            compute: self.compute,
            pending: Vec::new(),
            assigned: true,
        }
    }
}

/// How to choose among nodes and GPUs that fit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Policy {
    /// Fill the fullest nodes and GPUs first, keeping whole GPUs free for large pods.
    #[default]
    Binpack,
    /// Spread pods over the emptiest nodes and GPUs, for less contention.
    Spread,
    /// Place pods where they fragment the free GPU memory least, counting GPUs stranded
    /// behind a node's exhausted CPU or memory as lost (see [`fragmentation`]).
    Fragmentation,
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Policy::Binpack => "binpack",
            Policy::Spread => "spread",
            Policy::Fragmentation => "fragmentation",
        })
    }
}

/// A policy name that is not `binpack`, `spread` or `fragmentation`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown placement policy {0:?}: use \"binpack\", \"spread\" or \"fragmentation\"")]
pub struct UnknownPolicy(pub String);

impl std::str::FromStr for Policy {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "binpack" => Ok(Policy::Binpack),
            "spread" => Ok(Policy::Spread),
            "fragmentation" => Ok(Policy::Fragmentation),
            _ => Err(UnknownPolicy(s.to_owned())),
        }
    }
}

/// The highest score [`Cluster::score`] gives (kube-scheduler's `MaxExtenderPriority`).
pub const MAX_SCORE: u8 = 10;
