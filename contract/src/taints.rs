//! Taints and tolerations as kube-scheduler matches them, for the two places gpushare reads
//! them: the extender's filter that keeps the best (does a pod tolerate a node's
//! `PreferNoSchedule` taints?) and the admission webhook (does a routed pod already tolerate
//! the idle-GPU taint?).

use k8s_openapi::api::core::v1::{Taint, Toleration};

/// Whether `toleration` tolerates `taint`, as kube-scheduler matches them (an empty key
/// matches every key, an empty effect every effect, `Exists` any value).
pub fn tolerates(toleration: &Toleration, taint: &Taint) -> bool {
    if let Some(effect) = toleration.effect.as_deref()
        && !effect.is_empty()
        && effect != taint.effect
    {
        return false;
    }
    let key = toleration.key.as_deref().unwrap_or_default();
    if !key.is_empty() && key != taint.key {
        return false;
    }
    match toleration.operator.as_deref().unwrap_or("Equal") {
        "Exists" => true,
        "" | "Equal" => {
            toleration.value.as_deref().unwrap_or_default()
                == taint.value.as_deref().unwrap_or_default()
        }
        // Operators this build does not know (numeric comparisons): not tolerated, so the
        // pod is scored by kube-scheduler, which does know.
        _ => false,
    }
}

/// The idle-GPU taint under `key` ([`crate::Keys::node_idle_gpu_taint`]): `PreferNoSchedule`,
/// no value.
pub fn idle_gpu_taint(key: &str) -> Taint {
    Taint {
        key: key.to_owned(),
        effect: "PreferNoSchedule".to_owned(),
        ..Taint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taint(key: &str, value: Option<&str>) -> Taint {
        Taint {
            key: key.to_owned(),
            value: value.map(str::to_owned),
            effect: "PreferNoSchedule".to_owned(),
            ..Default::default()
        }
    }

    fn toleration(key: &str, operator: &str, value: &str, effect: &str) -> Toleration {
        Toleration {
            key: Some(key.to_owned()).filter(|k| !k.is_empty()),
            operator: Some(operator.to_owned()),
            value: Some(value.to_owned()).filter(|v| !v.is_empty()),
            effect: Some(effect.to_owned()).filter(|e| !e.is_empty()),
            ..Default::default()
        }
    }

    #[test]
    fn tolerations_match_as_kube_scheduler_matches_them() {
        let t = taint("gpu", Some("a100"));
        assert!(tolerates(&toleration("", "Exists", "", ""), &t));
        assert!(tolerates(&toleration("gpu", "Exists", "", ""), &t));
        assert!(tolerates(
            &toleration("gpu", "Equal", "a100", "PreferNoSchedule"),
            &t
        ));
        assert!(!tolerates(&toleration("gpu", "Equal", "t4", ""), &t));
        assert!(!tolerates(
            &toleration("gpu", "Exists", "", "NoSchedule"),
            &t
        ));
        assert!(!tolerates(&toleration("other", "Exists", "", ""), &t));
        assert!(!tolerates(&toleration("gpu", "Lt", "5", ""), &t));
    }
}
