//! What every binary's `/metrics` needs beyond `prometheus-client`.
//!
//! Why: `prometheus-client` (0.24) writes label values into the text format as they are.
//! A value read from the cluster (a GPU model in a node's inventory annotation or a
//! ResourceSlice attribute, which anyone allowed to patch the object can set) holding a `"`,
//! a `\` or a line break would end the value early: the scrape fails to parse, or the rest
//! of the value reads as series of its own. Such values go through [`label_value`] first.

use std::borrow::Cow;

/// `value` escaped as the text format wants inside a label's quotes: `\` as `\\`, `"` as
/// `\"`, a line feed as `\n`. Borrowed when there is nothing to escape (the usual case).
pub fn label_value(value: &str) -> Cow<'_, str> {
    if !value.contains(['\\', '"', '\n']) {
        return Cow::Borrowed(value);
    }
    let mut escaped = String::with_capacity(value.len() + 2);
    for c in value.chars() {
        match c {
            '\\' => escaped.push_str("\\\\"),
            '"' => escaped.push_str("\\\""),
            '\n' => escaped.push_str("\\n"),
            other => escaped.push(other),
        }
    }
    Cow::Owned(escaped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped_only_where_the_format_needs_it() {
        assert!(matches!(
            label_value("NVIDIA A100-SXM4-40GB"),
            Cow::Borrowed(_)
        ));
        assert_eq!(
            label_value("a\"} 1\nfake_metric{x=\"\\"),
            "a\\\"} 1\\nfake_metric{x=\\\"\\\\"
        );
        assert_eq!(label_value(""), "");
    }
}
