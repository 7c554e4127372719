//! Editing JSON documents for tests that feed decoders input they were not written for.

use serde_json::Value;

/// Replaces the subtree of `value` at the path `steps` picks with `replacement`: each step is
/// an index into the children there (array items, or object values in key order), taken
/// modulo their number; a leaf, or an empty array or object, is replaced where the path
/// reaches it. With arbitrary `steps` this reaches every subtree of a document, as a
/// property test's strategy draws them.
pub fn replace_at(value: &mut Value, steps: &[usize], replacement: Value) {
    let Some((&step, rest)) = steps.split_first() else {
        *value = replacement;
        return;
    };
    let child = match value {
        Value::Array(items) if !items.is_empty() => {
            let len = items.len();
            items.get_mut(step % len)
        }
        Value::Object(map) if !map.is_empty() => {
            let len = map.len();
            map.values_mut().nth(step % len)
        }
        _ => None,
    };
    match child {
        Some(child) => replace_at(child, rest, replacement),
        None => *value = replacement,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_path_wraps_and_stops_at_leaves() {
        let mut doc = json!({"a": [1, 2], "b": {"c": 3}});
        replace_at(&mut doc, &[0, 3], json!("x"));
        assert_eq!(doc, json!({"a": [1, "x"], "b": {"c": 3}}));
        replace_at(&mut doc, &[1, 0, 7, 7], json!(null));
        assert_eq!(doc, json!({"a": [1, "x"], "b": {"c": null}}));
        replace_at(&mut doc, &[], json!([]));
        assert_eq!(doc, json!([]));
    }
}
