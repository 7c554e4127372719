//! Label and field selectors, parsed once per request and applied to lists and watches.
//!
//! The grammar follows apimachinery's: comma-joined requirements; labels support `=`, `==`,
//! `!=`, `in (..)`, `notin (..)`, `key` and `!key`; fields support `=`, `==`, `!=` on the
//! fields each resource allows (anything else is a 400, as on the real server).

use std::borrow::Cow;

use serde_json::Value;

use super::resources::Kind;
use super::status::{ApiError, ApiResult};

#[derive(Debug, Clone, PartialEq, Eq)]
enum LabelOp {
    Equals(String),
    NotEquals(String),
    In(Vec<String>),
    NotIn(Vec<String>),
    Exists,
    DoesNotExist,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct LabelRequirement {
    key: String,
    op: LabelOp,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct FieldRequirement {
    field: String,
    /// Where the field lives in the object, key by key (split once: watches evaluate
    /// selectors on every change).
    path: Vec<String>,
    value: String,
    equal: bool,
}

/// A request's label and field selectors together.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Selector {
    labels: Vec<LabelRequirement>,
    fields: Vec<FieldRequirement>,
}

impl Selector {
    pub fn parse(kind: Kind, label: Option<&str>, field: Option<&str>) -> ApiResult<Self> {
        let fields = field.map(|text| parse_fields(kind, text)).transpose()?;
        Ok(Self {
            labels: label.map(parse_labels).transpose()?.unwrap_or_default(),
            fields: fields.unwrap_or_default(),
        })
    }

    /// The node a `spec.nodeName=<node>` requirement pins the selection to, if any.
    pub fn node_name(&self) -> Option<&str> {
        self.fields
            .iter()
            .find(|req| req.equal && req.field == "spec.nodeName")
            .map(|req| req.value.as_str())
    }

    pub fn matches(&self, object: &Value) -> bool {
        let labels = object.get("metadata").and_then(|m| m.get("labels"));
        let label = |key: &str| labels.and_then(|l| l.get(key)).and_then(Value::as_str);
        let labels_ok = self.labels.iter().all(|req| match &req.op {
            LabelOp::Equals(v) => label(&req.key) == Some(v.as_str()),
            // As upstream: `!=` matches objects without the label too.
            LabelOp::NotEquals(v) => label(&req.key) != Some(v.as_str()),
            LabelOp::In(vs) => label(&req.key).is_some_and(|l| vs.iter().any(|v| v == l)),
            LabelOp::NotIn(vs) => label(&req.key).is_none_or(|l| vs.iter().all(|v| v != l)),
            LabelOp::Exists => label(&req.key).is_some(),
            LabelOp::DoesNotExist => label(&req.key).is_none(),
        });
        labels_ok
            && self
                .fields
                .iter()
                .all(|req| (field_value(object, req) == req.value) == req.equal)
    }
}

fn invalid_label(text: &str, why: &str) -> ApiError {
    ApiError::bad_request(format!(
        "unable to parse requirement: {why} in label selector {text:?}"
    ))
}

fn parse_labels(text: &str) -> ApiResult<Vec<LabelRequirement>> {
    let chars: Vec<char> = text.chars().collect();
    let mut pos = 0;
    let mut out = Vec::new();
    // The characters from `pos` on that `keep` accepts; `pos` moves past them.
    let take = |pos: &mut usize, keep: &dyn Fn(char) -> bool| -> String {
        let start = *pos;
        while *pos < chars.len() && keep(chars[*pos]) {
            *pos += 1;
        }
        chars[start..*pos].iter().collect()
    };
    let skip_ws = |pos: &mut usize| drop(take(pos, &char::is_whitespace));
    let is_key_char = |c: char| !(c.is_whitespace() || ",=!()<>".contains(c));
    skip_ws(&mut pos);
    if pos == chars.len() {
        return Ok(out);
    }
    loop {
        skip_ws(&mut pos);
        let negated = chars.get(pos) == Some(&'!');
        if negated {
            pos += 1;
            skip_ws(&mut pos);
        }
        let key = take(&mut pos, &is_key_char);
        if key.is_empty() {
            return Err(invalid_label(text, "expected a label key"));
        }
        skip_ws(&mut pos);
        let rest: String = chars[pos..].iter().collect();
        let op = if negated {
            LabelOp::DoesNotExist
        } else if pos == chars.len() || chars[pos] == ',' {
            LabelOp::Exists
        } else if let Some(op) = ["==", "!=", "="]
            .into_iter()
            .find(|op| rest.starts_with(op))
        {
            pos += op.len();
            skip_ws(&mut pos);
            let value = take(&mut pos, &is_key_char);
            if op == "!=" {
                LabelOp::NotEquals(value)
            } else {
                LabelOp::Equals(value)
            }
        } else if let Some(op) = ["notin", "in"].into_iter().find(|op| rest.starts_with(op)) {
            pos += op.len();
            skip_ws(&mut pos);
            if chars.get(pos) != Some(&'(') {
                return Err(invalid_label(text, "expected '(' after in/notin"));
            }
            pos += 1;
            let list = take(&mut pos, &|c| c != ')');
            if pos == chars.len() {
                return Err(invalid_label(text, "missing ')'"));
            }
            pos += 1;
            let values = list.split(',').map(|v| v.trim().to_owned()).collect();
            if op == "notin" {
                LabelOp::NotIn(values)
            } else {
                LabelOp::In(values)
            }
        } else {
            return Err(invalid_label(text, "unknown operator"));
        };
        out.push(LabelRequirement { key, op });
        skip_ws(&mut pos);
        match chars.get(pos) {
            None => return Ok(out),
            Some(',') => pos += 1,
            Some(_) => return Err(invalid_label(text, "expected ',' between requirements")),
        }
    }
}

fn parse_fields(kind: Kind, text: &str) -> ApiResult<Vec<FieldRequirement>> {
    let mut out = Vec::new();
    for term in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let (field, value, equal) = if let Some((f, v)) = term.split_once("!=") {
            (f, v, false)
        } else if let Some((f, v)) = term.split_once("==") {
            (f, v, true)
        } else if let Some((f, v)) = term.split_once('=') {
            (f, v, true)
        } else {
            return Err(ApiError::bad_request(format!(
                "invalid selector: '{text}'; can't understand '{term}'"
            )));
        };
        let field = field.trim();
        if !kind.selectable_fields().contains(&field) {
            return Err(ApiError::bad_request(format!(
                "field label not supported: {field}"
            )));
        }
        out.push(FieldRequirement {
            field: field.to_owned(),
            path: match field {
                "source" => vec!["source".to_owned(), "component".to_owned()],
                other => other.split('.').map(str::to_owned).collect(),
            },
            value: value.trim().to_owned(),
            equal,
        });
    }
    Ok(out)
}

/// The string a field selector compares against: missing fields read as "" (so
/// `spec.nodeName=` selects unbound pods), booleans as "true"/"false".
fn field_value<'a>(object: &'a Value, req: &FieldRequirement) -> Cow<'a, str> {
    let value = req
        .path
        .iter()
        .try_fold(object, |value, key| value.get(key.as_str()));
    match value {
        Some(Value::String(s)) => Cow::Borrowed(s),
        Some(Value::Bool(b)) => Cow::Owned(b.to_string()),
        Some(Value::Number(n)) => Cow::Owned(n.to_string()),
        None | Some(Value::Null)
            if matches!(
                req.field.as_str(),
                "spec.hostNetwork" | "spec.unschedulable"
            ) =>
        {
            Cow::Borrowed("false")
        }
        _ => Cow::Borrowed(""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(labels: Value, node: Option<&str>, phase: &str) -> Value {
        let mut pod = json!({"metadata": {"name": "p", "namespace": "ns", "labels": labels},
                             "spec": {}, "status": {"phase": phase}});
        if let Some(node) = node {
            pod["spec"]["nodeName"] = json!(node);
        }
        pod
    }

    fn sel(label: &str) -> Selector {
        Selector::parse(Kind::Pod, Some(label), None).unwrap()
    }

    #[test]
    fn label_operators() {
        let p = pod(json!({"app": "web", "tier": "fe"}), None, "Pending");
        assert!(sel("app=web").matches(&p));
        assert!(sel("app==web, tier = fe").matches(&p));
        assert!(!sel("app!=web").matches(&p));
        assert!(sel("missing!=x").matches(&p));
        assert!(sel("app in (db, web)").matches(&p));
        assert!(!sel("app notin (db,web)").matches(&p));
        assert!(sel("app,!missing").matches(&p));
        assert!(!sel("!app").matches(&p));
        assert!(sel("").matches(&p));
        assert!(Selector::parse(Kind::Pod, Some("app in (a"), None).is_err());
        assert!(Selector::parse(Kind::Pod, Some("=x"), None).is_err());
    }

    #[test]
    fn field_selectors() {
        let bound = pod(json!({}), Some("n1"), "Running");
        let unbound = pod(json!({}), None, "Pending");
        let f = |s: &str| Selector::parse(Kind::Pod, None, Some(s)).unwrap();
        assert!(f("spec.nodeName=n1").matches(&bound));
        assert!(!f("spec.nodeName=n1").matches(&unbound));
        assert!(f("spec.nodeName=").matches(&unbound));
        assert!(f("spec.nodeName!=").matches(&bound));
        assert!(f("status.phase==Running,metadata.namespace=ns").matches(&bound));
        assert!(!f("status.phase!=Running").matches(&bound));
        assert!(Selector::parse(Kind::Pod, None, Some("spec.bogus=1")).is_err());
        assert!(Selector::parse(Kind::Node, None, Some("spec.nodeName=x")).is_err());
    }
}
