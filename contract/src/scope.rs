//! What the extender and `kubectl gpushare` read a cluster with: the resource pods ask for,
//! the annotation keys of the domain, and the label of the nodes that take part. One type so
//! the two read a `--node-label` the same way.

use crate::{DEFAULT_NODE_LABEL_KEY, DEFAULT_NODE_LABEL_VALUE, DEFAULT_RESOURCE, Keys};

/// The resource, keys and participation label gpushare reads a cluster with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    /// The extended resource pods ask for (`example.com/gpu-mem`).
    pub resource: String,
    /// Annotation and label keys under the configured domain.
    pub keys: Keys,
    /// Label key admins set on participating nodes.
    pub label_key: String,
    /// Its value.
    pub label_value: String,
}

impl Scope {
    /// The scope of `resource`, annotation `domain` and participation label `node_label`:
    /// `key=value`, or a bare `key` meaning `key=true`.
    pub fn new(resource: &str, domain: &str, node_label: &str) -> Self {
        let (label_key, label_value) = match node_label.split_once('=') {
            Some((key, value)) => (key.trim().to_owned(), value.trim().to_owned()),
            None => (node_label.trim().to_owned(), "true".to_owned()),
        };
        Self {
            resource: resource.to_owned(),
            keys: Keys::new(domain),
            label_key,
            label_value,
        }
    }
}

impl Default for Scope {
    fn default() -> Self {
        Self {
            resource: DEFAULT_RESOURCE.to_owned(),
            keys: Keys::default(),
            label_key: DEFAULT_NODE_LABEL_KEY.to_owned(),
            label_value: DEFAULT_NODE_LABEL_VALUE.to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_label_is_key_equals_value_or_a_bare_key_meaning_true() {
        let scope = Scope::new("example.com/gpu-mem", "gpushare.example.com", "pool = gpu");
        assert_eq!(
            (scope.label_key.as_str(), scope.label_value.as_str()),
            ("pool", "gpu")
        );
        let bare = Scope::new("example.com/gpu-mem", "gpushare.example.com", "gpushare");
        assert_eq!(
            (bare.label_key.as_str(), bare.label_value.as_str()),
            ("gpushare", "true")
        );
        assert_eq!(
            Scope::new(
                "example.com/gpu-mem",
                "gpushare.example.com",
                "gpushare=true"
            ),
            Scope::default()
        );
    }
}
