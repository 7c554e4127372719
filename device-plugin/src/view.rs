//! What the plugin knows of one pod ([`PodView`]), the marks it owns on it ([`Marks`]) and
//! whether its allocation may be acted on ([`Trust`]): the data every decision about pods
//! reads — no kube or tonic.
//!
//! Why a module of its own: the decisions that read these views ([`crate::matching`] for
//! Allocate, [`crate::facts`] and [`crate::facts_plan`] for kubelet's listing) and the cache
//! that builds them (`pod_views`) all sit above the type. Where it was, in
//! `matching`, `facts` imported `matching` for it while `matching` imported `facts`.

use std::cmp::Ordering;
use std::sync::Arc;

use gpushare_contract::PodAllocation;

/// What the plugin knows of one pod: its place and its allocation (with our own unsaved
/// marks already applied).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    /// `namespace/name`.
    pub key: String,
    /// The pod's UID.
    pub uid: String,
    /// `spec.nodeName`.
    pub node: Option<String>,
    /// `status.phase`.
    pub phase: Option<String>,
    /// Whether the pod has a deletion timestamp.
    pub deleting: bool,
    /// Whether kubelet admitted the pod (its status has a `startTime`): admission is where
    /// kubelet calls Allocate for every container, so an admitted pod waits for nothing,
    /// whatever its marks say (with `--allocation-marks=false` none are ever written).
    pub admitted: bool,
    /// The extender's allocation, with our marks.
    pub allocation: PodAllocation,
    /// Whether the allocation is the extender's.
    pub trust: Trust,
}

/// Whether an allocation may be acted on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trust {
    /// Its signature verifies under the keyring.
    Verified,
    /// No keyring is configured: every allocation is taken as the extender's (the
    /// behaviour before signatures existed).
    Unchecked,
    /// A keyring is configured and the signature does not verify: why, for the user.
    Refused(String),
}

/// The plugin's progress marks on a pod: the annotations it owns.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Marks {
    /// Containers allocated so far.
    pub allocated: Vec<String>,
    /// True once every container is allocated.
    pub assigned: bool,
}

impl PodView {
    /// The marks currently on this view.
    pub fn marks(&self) -> Marks {
        Marks {
            allocated: self.allocation.allocated.clone(),
            assigned: self.allocation.assigned,
        }
    }

    /// Replaces the marks.
    pub fn set_marks(&mut self, marks: &Marks) {
        self.allocation.allocated = marks.allocated.clone();
        self.allocation.assigned = marks.assigned;
    }

    /// Records `container` as allocated; sets `assigned` once every container is.
    pub fn mark_allocated(&mut self, container: &str) {
        let alloc = &mut self.allocation;
        if !alloc.allocated.iter().any(|name| name == container) {
            alloc.allocated.push(container.to_owned());
        }
        alloc.assigned = alloc
            .containers
            .iter()
            .all(|c| alloc.allocated.iter().any(|name| name == &c.name));
    }

    /// Whether this allocation may be acted on: signed by the extender, or no keyring.
    pub fn trusted(&self) -> bool {
        !matches!(self.trust, Trust::Refused(_))
    }

    pub(crate) fn bound_to(&self, node: &str) -> bool {
        self.node.as_deref() == Some(node)
    }

    pub(crate) fn finished(&self) -> bool {
        gpushare_contract::request::phase_is_finished(self.phase.as_deref())
    }

    /// Whether kubelet reports the pod Running.
    pub fn running(&self) -> bool {
        self.phase.as_deref() == Some("Running")
    }

    /// Still waiting for Allocate calls: bound here, alive, not admitted by kubelet, not
    /// fully allocated.
    pub(crate) fn waiting_on(&self, node: &str) -> bool {
        self.bound_to(node)
            && !self.deleting
            && !self.finished()
            && !self.admitted
            && !self.allocation.assigned
    }
}
/// Sorts `indices` into `views` oldest bind first; unparsable bind times last; then by key,
/// so the order is total. Each bind time is parsed once (a comparator that parses would
/// parse each time n log n times, and Allocate sorts every waiting pod on the node).
pub(crate) fn sort_by_bind_time(views: &[Arc<PodView>], indices: &mut [usize]) {
    let mut keyed: Vec<(Option<jiff::Timestamp>, usize)> = indices
        .iter()
        .map(|&i| (views[i].allocation.bind_time.parse().ok(), i))
        .collect();
    keyed.sort_by(|(time_a, a), (time_b, b)| {
        match (time_a, time_b) {
            (Some(x), Some(y)) => x.cmp(y),
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (None, None) => Ordering::Equal,
        }
        .then_with(|| views[*a].key.cmp(&views[*b].key))
    });
    for (slot, (_, index)) in indices.iter_mut().zip(keyed) {
        *slot = index;
    }
}

/// Views to build tests from: `view("a", 10, &[("main", 4, false)])` is pod `default/a`,
/// bound to `n1` at second 10, with one 4 GiB container.
#[cfg(test)]
pub(crate) mod fixtures {
    use gpushare_contract::ContainerRequest;

    use super::*;

    pub(crate) fn view(name: &str, bind_second: u32, containers: &[(&str, u64, bool)]) -> PodView {
        PodView {
            key: format!("default/{name}"),
            uid: format!("uid-{name}"),
            node: Some("n1".into()),
            phase: Some("Pending".into()),
            deleting: false,
            admitted: false,
            allocation: PodAllocation {
                more_gpus: Vec::new(),
                exclusive: false,
                gpu_index: 0,
                gpu_uuid: "GPU-0".into(),
                pod_gib: containers.iter().map(|c| c.1).sum(),
                containers: containers
                    .iter()
                    .map(|&(name, gib, init)| ContainerRequest {
                        name: name.into(),
                        gib,
                        init,
                        compute: 0,
                    })
                    .collect(),
                bind_time: format!("2026-11-22T10:00:{bind_second:02}Z"),
                assigned: false,
                allocated: vec![],
                signature: None,
                compute: 0,
            },
            trust: Trust::Verified,
        }
    }

    pub(crate) fn forged(mut view: PodView) -> PodView {
        view.trust = Trust::Refused("it carries no signature".into());
        view
    }

    pub(crate) fn shared(views: Vec<PodView>) -> Vec<Arc<PodView>> {
        views.into_iter().map(Arc::new).collect()
    }
}
