//! The filter that passes only the best nodes (`--filter-keep-best`), and when it must not.
//!
//! Why: kube-scheduler binds the one feasible node without scoring, so a filter that passes
//! only the best node saves the prioritize round trip and kube-scheduler's own score plugins
//! on every pod's serial cycle (docs/performance.md, "Cost to kube-scheduler"). The node
//! kept must then be the one kube-scheduler would have chosen with scores, so the ranking is
//! kube-scheduler's: our score × the extender's weight × 10, plus its default CPU and memory
//! scores ([`gpushare_allocator::kube_scores`]). The chart's dedicated profile scores nothing
//! else for a pod without soft preferences (it turns ImageLocality and the default topology
//! spreading off while this is on).
//!
//! One deliberate difference: while multi-GPU pods bring a quarter or more of the recent GPU
//! demand, the ranking leaves kube-scheduler's CPU and memory scores out and is our score
//! alone ([`gpushare_allocator::demand_mix`]): spreading small pods' CPU over every node would
//! leave none with the GPUs and the CPU a multi-GPU job needs. Pods that step aside are
//! scored by kube-scheduler with its profile, its CPU and memory scores included.
//!
//! A pod whose placement other score plugins would move is not narrowed: its own preferred
//! node or pod (anti-)affinity, a `ScheduleAnyway` topology spread constraint, or a
//! candidate node with a `PreferNoSchedule` taint it does not tolerate
//! ([`StepAside`]). Every fitting node passes, and kube-scheduler scores them with
//! prioritize as usual.

use std::borrow::Cow;

use gpushare_allocator::{Policy, Request};
use gpushare_contract::taints::tolerates;
use k8s_openapi::api::core::v1::{Pod, Toleration};
use serde_json::value::RawValue;

use crate::scheduling::view::View;

/// Why every fitting node passes although keep-best is on: kube-scheduler's scores would
/// weigh something the extender does not model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepAside {
    /// The pod prefers nodes (`preferredDuringSchedulingIgnoredDuringExecution`).
    PreferredNodeAffinity,
    /// The pod prefers to be near or away from other pods.
    PreferredPodAffinity,
    /// The pod spreads with `whenUnsatisfiable: ScheduleAnyway`.
    SoftTopologySpread,
    /// A candidate node has a `PreferNoSchedule` taint the pod does not tolerate.
    PreferNoScheduleTaint,
}

impl StepAside {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            StepAside::PreferredNodeAffinity => "preferred_node_affinity",
            StepAside::PreferredPodAffinity => "preferred_pod_affinity",
            StepAside::SoftTopologySpread => "soft_topology_spread",
            StepAside::PreferNoScheduleTaint => "prefer_no_schedule_taint",
        }
    }
}

/// The pod's own soft preferences, if it has any.
pub fn soft_preferences(pod: &Pod) -> Option<StepAside> {
    let spec = pod.spec.as_ref()?;
    if let Some(affinity) = &spec.affinity {
        let preferred_nodes = affinity
            .node_affinity
            .as_ref()
            .and_then(|a| {
                a.preferred_during_scheduling_ignored_during_execution
                    .as_ref()
            })
            .is_some_and(|terms| !terms.is_empty());
        if preferred_nodes {
            return Some(StepAside::PreferredNodeAffinity);
        }
        let near = affinity
            .pod_affinity
            .as_ref()
            .and_then(|a| {
                a.preferred_during_scheduling_ignored_during_execution
                    .as_ref()
            })
            .is_some_and(|terms| !terms.is_empty());
        let away = affinity
            .pod_anti_affinity
            .as_ref()
            .and_then(|a| {
                a.preferred_during_scheduling_ignored_during_execution
                    .as_ref()
            })
            .is_some_and(|terms| !terms.is_empty());
        if near || away {
            return Some(StepAside::PreferredPodAffinity);
        }
    }
    let soft_spread = spec
        .topology_spread_constraints
        .iter()
        .flatten()
        .any(|c| c.when_unsatisfiable == "ScheduleAnyway");
    soft_spread.then_some(StepAside::SoftTopologySpread)
}

/// How filter narrows the fitting nodes: how many it keeps (0: all) and what it ranks them by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeepBest {
    /// `--filter-keep-best`.
    pub keep: usize,
    /// The policy whose score is ours.
    pub policy: Policy,
    /// `--prioritize-weight`: what kube-scheduler multiplies our score by.
    pub prioritize_weight: i64,
}

impl KeepBest {
    /// Keeps only the `keep` entries of `passing` (positions in `candidates`) that
    /// kube-scheduler would rank best for `request` with scores (the cluster's
    /// `scheduler_totals`), in request order; ties go to the earlier candidate. `keep` 0 keeps
    /// every one, and so does a [`StepAside`], which is returned.
    ///
    /// The nodes left out are not reported as failed: they fit, and kube-scheduler only reads
    /// failure reasons when no node passes, which cannot happen here.
    pub fn narrow(
        self,
        view: &View,
        pod: Option<&Pod>,
        request: &Request,
        candidates: &[(Cow<'_, str>, Option<&RawValue>)],
        passing: &mut Vec<usize>,
    ) -> Option<StepAside> {
        if self.keep == 0 || passing.len() <= self.keep {
            return None;
        }
        let names: Vec<&str> = passing.iter().map(|&i| &*candidates[i].0).collect();
        let tolerations: &[Toleration] = pod
            .and_then(|pod| pod.spec.as_ref()?.tolerations.as_deref())
            .unwrap_or_default();
        let step_aside = pod.and_then(soft_preferences).or_else(|| {
            names
                .iter()
                .flat_map(|name| view.prefer_no_schedule_taints(name))
                .any(|taint| !tolerations.iter().any(|t| tolerates(t, taint)))
                .then_some(StepAside::PreferNoScheduleTaint)
        });
        if step_aside.is_some() {
            return step_aside;
        }
        let totals =
            view.cluster
                .scheduler_totals(&names, request, self.policy, self.prioritize_weight);
        let mut best: Vec<usize> = (0..passing.len()).collect();
        // Stable: among equal totals the earlier candidate stays ahead.
        best.sort_by_key(|&k| std::cmp::Reverse(totals[k]));
        best.truncate(self.keep);
        best.sort_unstable();
        *passing = best.into_iter().map(|k| passing[k]).collect();
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        Affinity, NodeAffinity, PodSpec, PreferredSchedulingTerm, TopologySpreadConstraint,
    };

    #[test]
    fn soft_preferences_are_named_and_hard_ones_are_not() {
        let mut pod = Pod {
            spec: Some(PodSpec::default()),
            ..Default::default()
        };
        assert_eq!(soft_preferences(&pod), None);
        let spec = pod.spec.as_mut().unwrap();
        spec.topology_spread_constraints = Some(vec![TopologySpreadConstraint {
            max_skew: 1,
            topology_key: "zone".to_owned(),
            when_unsatisfiable: "DoNotSchedule".to_owned(),
            ..Default::default()
        }]);
        assert_eq!(soft_preferences(&pod), None);
        let spec = pod.spec.as_mut().unwrap();
        spec.topology_spread_constraints.as_mut().unwrap()[0].when_unsatisfiable =
            "ScheduleAnyway".to_owned();
        assert_eq!(soft_preferences(&pod), Some(StepAside::SoftTopologySpread));
        let spec = pod.spec.as_mut().unwrap();
        spec.affinity = Some(Affinity {
            node_affinity: Some(NodeAffinity {
                preferred_during_scheduling_ignored_during_execution: Some(vec![
                    PreferredSchedulingTerm {
                        weight: 10,
                        ..Default::default()
                    },
                ]),
                ..Default::default()
            }),
            ..Default::default()
        });
        assert_eq!(
            soft_preferences(&pod),
            Some(StepAside::PreferredNodeAffinity)
        );
    }
}
