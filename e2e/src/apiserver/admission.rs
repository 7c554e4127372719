//! ValidatingAdmissionPolicy, evaluated as the real API server evaluates it.
//!
//! The rules are not ours to re-type: they come from the chart (`allocation-policy.yaml`,
//! rendered by helm) as `ValidatingAdmissionPolicy` + `ValidatingAdmissionPolicyBinding`
//! documents, and their CEL is compiled and run here with the `cel` crate. A test that passes
//! against this server therefore passes against the rules a cluster enforces.
//!
//! ```text
//!  create / update / patch ──▶ defaults, patched result ──▶ admit ──▶ store
//!                                                             │
//!      for each bound policy whose matchConstraints match (operation, resource/subresource):
//!        matchConditions ─▶ variables (in order, as `variables.<name>`) ─▶ validations
//!        false ─▶ deny: 403/422 `pods "NAME" is forbidden: ValidatingAdmissionPolicy 'P'
//!                       with binding 'B' denied request: MESSAGE`
//!        error ─▶ failurePolicy Fail: deny, Ignore: allow
//! ```
//!
//! CEL sees what the real server gives it: `object` (the object as it would be stored),
//! `oldObject` (`null` on CREATE), `request` (`operation`, `userInfo.username`, `namespace`,
//! `name`, `resource`, `subResource`, `kind`). Variables are evaluated in order; one that
//! fails to evaluate is left out, so an expression that needs it fails (and one whose
//! short-circuit does not need it does not), as with the real server's lazy variables.
//!
//! Supported: `matchConstraints.resourceRules` / `excludeResourceRules`, `matchConditions`,
//! `variables`, `validations` (`expression`, `message`, `messageExpression`, `reason`),
//! `failurePolicy`, bindings with `validationActions: [Deny]`. Parameters (`paramKind`,
//! `paramRef`) and namespace/object selectors are refused at load time rather than ignored.

use std::collections::HashMap;

use cel::{Context, Program};
use serde_json::Value;

use super::objects::meta_str;

/// Why a policy document could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// The YAML stream did not parse.
    #[error("parsing the policy YAML: {0}")]
    Yaml(#[from] serde_yaml::Error),
    /// A CEL expression did not compile.
    #[error("policy {policy:?}: compiling {expression:?}: {message}")]
    Compile {
        policy: String,
        expression: String,
        message: String,
    },
    /// A field this server does not evaluate, which would change the policy's meaning.
    #[error("{object:?}: {field} is not supported by the e2e API server's admission")]
    Unsupported { object: String, field: &'static str },
    /// A required field is missing or of the wrong shape.
    #[error("{object:?}: {field} is missing or malformed")]
    Malformed { object: String, field: &'static str },
    /// A binding names a policy that is not in the set.
    #[error("binding {binding:?} names policy {policy:?}, which is not loaded")]
    UnknownPolicy { binding: String, policy: String },
}

/// CREATE or UPDATE (a PATCH is an UPDATE, evaluated on the patched result).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operation {
    Create,
    Update,
}

impl Operation {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Operation::Create => "CREATE",
            Operation::Update => "UPDATE",
        }
    }
}

/// One write, as admission sees it.
#[derive(Clone, Debug)]
pub struct AdmissionRequest<'a> {
    pub operation: Operation,
    /// Who is calling (`request.userInfo.username`).
    pub username: &'a str,
    /// The node claim of the caller's token (`request.userInfo.extra`), if it has one.
    pub node_claim: Option<&'a str>,
    /// `""` for the core group.
    pub group: &'a str,
    pub version: &'a str,
    /// The resource's plural (`pods`).
    pub resource: &'a str,
    /// `""` for the resource itself, else `status`, `binding`, …
    pub subresource: &'a str,
    pub kind: &'a str,
    pub namespace: &'a str,
    pub name: &'a str,
    /// The object as it would be stored.
    pub object: &'a Value,
    /// The stored object an UPDATE replaces.
    pub old_object: Option<&'a Value>,
}

/// A refused request: which policy and binding, and what they say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denial {
    pub policy: String,
    pub binding: String,
    /// The validation's `reason` (`Invalid` when it gives none, and for evaluation errors).
    pub reason: String,
    pub message: String,
}

impl Denial {
    /// The HTTP status the real server answers with for this reason.
    pub fn code(&self) -> u16 {
        match self.reason.as_str() {
            "Unauthorized" => 401,
            "Forbidden" => 403,
            "RequestEntityTooLarge" => 413,
            _ => 422,
        }
    }

    /// The `metav1.Status` reason, as one of the strings the real server sends.
    pub fn status_reason(&self) -> &'static str {
        match self.reason.as_str() {
            "Unauthorized" => "Unauthorized",
            "Forbidden" => "Forbidden",
            "RequestEntityTooLarge" => "RequestEntityTooLarge",
            _ => "Invalid",
        }
    }

    /// `ValidatingAdmissionPolicy 'P' with binding 'B' denied request: MESSAGE`.
    pub fn decision(&self) -> String {
        format!(
            "ValidatingAdmissionPolicy '{}' with binding '{}' denied request: {}",
            self.policy, self.binding, self.message
        )
    }

    /// The whole message: `pods "NAME" is forbidden: ValidatingAdmissionPolicy …`.
    pub fn status_message(&self, resource: &str, name: &str) -> String {
        format!("{resource} \"{name}\" is forbidden: {}", self.decision())
    }
}

/// A CEL expression with its source, for messages.
struct Expr {
    source: String,
    program: Program,
}

struct Validation {
    expr: Expr,
    message: Option<String>,
    message_expr: Option<Expr>,
    reason: Option<String>,
}

/// `resourceRules` entry: which groups, versions, operations and resources.
struct Rule {
    groups: Vec<String>,
    versions: Vec<String>,
    operations: Vec<String>,
    resources: Vec<String>,
}

struct Policy {
    name: String,
    fail_closed: bool,
    rules: Vec<Rule>,
    exclude: Vec<Rule>,
    conditions: Vec<(String, Expr)>,
    variables: Vec<(String, Expr)>,
    validations: Vec<Validation>,
}

/// A loaded set of policies and the bindings that put them in force. Cheap to share.
pub struct AdmissionPolicies {
    policies: Vec<Policy>,
    /// (binding name, index of its policy); only bindings whose actions include Deny.
    bindings: Vec<(String, usize)>,
}

impl std::fmt::Debug for AdmissionPolicies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdmissionPolicies")
            .field(
                "policies",
                &self.policies.iter().map(|p| &p.name).collect::<Vec<_>>(),
            )
            .field("bindings", &self.bindings)
            .finish()
    }
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|list| {
            list.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

fn compile(policy: &str, source: &str) -> Result<Expr, PolicyError> {
    let program = Program::compile(source).map_err(|err| PolicyError::Compile {
        policy: policy.to_owned(),
        expression: source.to_owned(),
        message: err.to_string(),
    })?;
    Ok(Expr {
        source: source.to_owned(),
        program,
    })
}

fn is_empty(value: Option<&Value>) -> bool {
    match value {
        None | Some(Value::Null) => true,
        Some(Value::Object(map)) => map.is_empty(),
        Some(Value::Array(list)) => list.is_empty(),
        Some(_) => false,
    }
}

fn rules(list: Option<&Value>) -> Vec<Rule> {
    list.and_then(Value::as_array)
        .map(|rules| {
            rules
                .iter()
                .map(|rule| Rule {
                    groups: strings(&rule["apiGroups"]),
                    versions: strings(&rule["apiVersions"]),
                    operations: strings(&rule["operations"]),
                    resources: strings(&rule["resources"]),
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Name/expression pairs (`variables`, `matchConditions`).
fn named_exprs(policy: &str, list: Option<&Value>) -> Result<Vec<(String, Expr)>, PolicyError> {
    let malformed = |field| PolicyError::Malformed {
        object: policy.to_owned(),
        field,
    };
    let Some(list) = list else {
        return Ok(Vec::new());
    };
    let list = list
        .as_array()
        .ok_or_else(|| malformed("a name/expression list"))?;
    list.iter()
        .map(|entry| {
            let name = entry["name"].as_str().ok_or_else(|| malformed("name"))?;
            let source = entry["expression"]
                .as_str()
                .ok_or_else(|| malformed("expression"))?;
            Ok((name.to_owned(), compile(policy, source)?))
        })
        .collect()
}

fn parse_policy(doc: &Value) -> Result<Policy, PolicyError> {
    let name = meta_str(doc, "name").unwrap_or("").to_owned();
    let unsupported = |field| PolicyError::Unsupported {
        object: name.clone(),
        field,
    };
    let spec = &doc["spec"];
    if !is_empty(spec.get("paramKind")) {
        return Err(unsupported("spec.paramKind"));
    }
    if !is_empty(spec.get("auditAnnotations")) {
        return Err(unsupported("spec.auditAnnotations"));
    }
    let constraints = &spec["matchConstraints"];
    for field in ["namespaceSelector", "objectSelector"] {
        if !is_empty(constraints.get(field)) {
            return Err(unsupported("spec.matchConstraints selectors"));
        }
    }
    let validations = spec["validations"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|v| {
            let source = v["expression"].as_str().ok_or(PolicyError::Malformed {
                object: name.clone(),
                field: "validations[].expression",
            })?;
            Ok(Validation {
                expr: compile(&name, source)?,
                message: v["message"].as_str().map(str::to_owned),
                message_expr: v["messageExpression"]
                    .as_str()
                    .map(|m| compile(&name, m))
                    .transpose()?,
                reason: v["reason"].as_str().map(str::to_owned),
            })
        })
        .collect::<Result<Vec<_>, PolicyError>>()?;
    Ok(Policy {
        fail_closed: spec["failurePolicy"].as_str() != Some("Ignore"),
        rules: rules(constraints.get("resourceRules")),
        exclude: rules(constraints.get("excludeResourceRules")),
        conditions: named_exprs(&name, spec.get("matchConditions"))?,
        variables: named_exprs(&name, spec.get("variables"))?,
        validations,
        name,
    })
}

impl AdmissionPolicies {
    /// No policies: every request is admitted.
    pub fn none() -> Self {
        Self {
            policies: Vec::new(),
            bindings: Vec::new(),
        }
    }

    /// Loads every `ValidatingAdmissionPolicy` and `ValidatingAdmissionPolicyBinding` of a
    /// multi-document YAML stream (such as `helm template` output); other kinds are skipped.
    pub fn from_yaml(yaml: &str) -> Result<Self, PolicyError> {
        use serde::Deserialize;
        let mut policies = Vec::new();
        let mut bindings = Vec::new();
        for document in serde_yaml::Deserializer::from_str(yaml) {
            let doc = Value::deserialize(document)?;
            match doc["kind"].as_str() {
                Some("ValidatingAdmissionPolicy") => policies.push(parse_policy(&doc)?),
                Some("ValidatingAdmissionPolicyBinding") => bindings.push(doc),
                _ => {}
            }
        }
        let bindings = bindings
            .iter()
            .filter_map(|doc| {
                let name = meta_str(doc, "name").unwrap_or("").to_owned();
                let spec = &doc["spec"];
                for (key, field) in [
                    ("paramRef", "spec.paramRef"),
                    ("matchResources", "spec.matchResources"),
                ] {
                    if !is_empty(spec.get(key)) {
                        return Some(Err(PolicyError::Unsupported {
                            object: name,
                            field,
                        }));
                    }
                }
                // Warn and Audit never refuse a request.
                if !strings(&spec["validationActions"])
                    .iter()
                    .any(|a| a == "Deny")
                {
                    return None;
                }
                let policy = spec["policyName"].as_str().unwrap_or("");
                Some(
                    policies
                        .iter()
                        .position(|p| p.name == policy)
                        .map(|index| (name.clone(), index))
                        .ok_or_else(|| PolicyError::UnknownPolicy {
                            binding: name,
                            policy: policy.to_owned(),
                        }),
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { policies, bindings })
    }

    /// Whether no binding is in force.
    pub fn is_empty(&self) -> bool {
        self.bindings.is_empty()
    }

    /// The bindings in force, in order, each as (binding, policy it binds, whether that
    /// policy fails closed: `failurePolicy: Fail`).
    pub fn bindings(&self) -> impl Iterator<Item = (&str, &str, bool)> + '_ {
        self.bindings.iter().map(|(binding, index)| {
            let policy = &self.policies[*index];
            (binding.as_str(), policy.name.as_str(), policy.fail_closed)
        })
    }

    /// Admits `request`, or says which policy refused it and why (the first refusal, in
    /// binding order).
    pub fn admit(&self, request: &AdmissionRequest<'_>) -> Result<(), Denial> {
        for (binding, index) in &self.bindings {
            let policy = &self.policies[*index];
            if !policy.matches(request) {
                continue;
            }
            if let Err(refusal) = policy.evaluate(request) {
                return Err(Denial {
                    policy: policy.name.clone(),
                    binding: binding.clone(),
                    reason: refusal.reason,
                    message: refusal.message,
                });
            }
        }
        Ok(())
    }
}

impl Rule {
    fn matches(&self, request: &AdmissionRequest<'_>) -> bool {
        let any = |list: &[String], value: &str| list.iter().any(|v| v == "*" || v == value);
        any(&self.groups, request.group)
            && any(&self.versions, request.version)
            && any(&self.operations, request.operation.as_str())
            && self.resources.iter().any(|rule| {
                let (resource, sub) = rule.split_once('/').unwrap_or((rule, ""));
                let resource_ok = resource == "*" || resource == request.resource;
                // `pods` is the resource alone, `pods/status` one subresource, `pods/*` every
                // subresource, `*/*` everything.
                let sub_ok = if rule.contains('/') {
                    sub == "*" || sub == request.subresource
                } else {
                    request.subresource.is_empty()
                };
                resource_ok && sub_ok
            })
    }
}

/// Why one policy refused.
struct Refusal {
    reason: String,
    message: String,
}

impl Policy {
    fn matches(&self, request: &AdmissionRequest<'_>) -> bool {
        self.rules.iter().any(|rule| rule.matches(request))
            && !self.exclude.iter().any(|rule| rule.matches(request))
    }

    fn error(&self, source: &str, err: impl std::fmt::Display) -> Result<(), Refusal> {
        if !self.fail_closed {
            return Ok(());
        }
        Err(Refusal {
            reason: "Invalid".to_owned(),
            message: format!("expression '{source}' resulted in error: {err}"),
        })
    }

    fn evaluate(&self, request: &AdmissionRequest<'_>) -> Result<(), Refusal> {
        let mut context = match base_context(request) {
            Ok(context) => context,
            Err(err) => return self.error("object", err),
        };
        for (name, condition) in &self.conditions {
            match condition.program.execute(&context) {
                Ok(cel::Value::Bool(true)) => {}
                Ok(cel::Value::Bool(false)) => return Ok(()),
                Ok(other) => {
                    return self.error(
                        &condition.source,
                        format!("matchCondition {name:?} gave {other:?}, not a bool"),
                    );
                }
                Err(err) => return self.error(&condition.source, err),
            }
        }
        let mut variables: HashMap<String, cel::Value> = HashMap::new();
        let mut failed: Vec<(&str, String)> = Vec::new();
        for (name, variable) in &self.variables {
            context.add_variable_from_value("variables", variables.clone());
            match variable.program.execute(&context) {
                Ok(value) => {
                    variables.insert(name.clone(), value);
                }
                Err(err) => failed.push((name, err.to_string())),
            }
        }
        context.add_variable_from_value("variables", variables);
        for validation in &self.validations {
            let source = &validation.expr.source;
            match validation.expr.program.execute(&context) {
                Ok(cel::Value::Bool(true)) => {}
                Ok(cel::Value::Bool(false)) => {
                    let message = validation
                        .message_expr
                        .as_ref()
                        .and_then(|m| match m.program.execute(&context) {
                            Ok(cel::Value::String(s)) if !s.trim().is_empty() => {
                                Some(s.to_string())
                            }
                            _ => None,
                        })
                        .or_else(|| validation.message.clone())
                        .unwrap_or_else(|| format!("failed expression: {source}"));
                    return Err(Refusal {
                        reason: validation
                            .reason
                            .clone()
                            .unwrap_or_else(|| "Invalid".to_owned()),
                        message,
                    });
                }
                Ok(other) => {
                    self.error(
                        source,
                        format!("validation expression gave {other:?}, not a bool"),
                    )?;
                }
                Err(err) => {
                    // A variable that failed shows up as a missing key; name its own error.
                    let cause = failed
                        .iter()
                        .find(|(name, _)| source.contains(&format!("variables.{name}")))
                        .map(|(name, err)| format!("variable {name:?} failed: {err}"))
                        .unwrap_or_else(|| err.to_string());
                    self.error(source, cause)?;
                }
            }
        }
        Ok(())
    }
}

/// `object`, `oldObject` and `request`, as the real server binds them.
fn base_context(
    request: &AdmissionRequest<'_>,
) -> Result<Context<'static, 'static>, cel::SerializationError> {
    let mut context = Context::default();
    context.add_variable_from_value("object", cel::to_value(request.object)?);
    let old = match request.old_object {
        Some(old) => cel::to_value(old)?,
        None => cel::Value::Null,
    };
    context.add_variable_from_value("oldObject", old);
    // The real server's `extra` is a map of lists; a caller without claims has an empty one.
    let extra = match request.node_claim {
        Some(node) => serde_json::json!({ super::NODE_NAME_CLAIM: [node] }),
        None => serde_json::json!({}),
    };
    let request_doc = serde_json::json!({
        "operation": request.operation.as_str(),
        "userInfo": {"username": request.username, "extra": extra},
        "namespace": request.namespace,
        "name": request.name,
        "kind": {"group": request.group, "version": request.version, "kind": request.kind},
        "resource": {"group": request.group, "version": request.version, "resource": request.resource},
        "subResource": request.subresource,
        "dryRun": false,
    });
    context.add_variable_from_value("request", cel::to_value(&request_doc)?);
    Ok(context)
}

#[cfg(test)]
mod tests {
    //! Loading; the chart's own policy is tested rule by rule beside its rendering
    //! (`e2e/src/cluster/chart/policy_tests.rs`), since this server knows nothing of the chart.

    use super::*;

    #[test]
    fn unsupported_fields_are_refused_at_load_time() {
        let yaml = "apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicy
metadata: {name: p}
spec:
  paramKind: {apiVersion: v1, kind: ConfigMap}
  validations: [{expression: 'true'}]
";
        assert!(matches!(
            AdmissionPolicies::from_yaml(yaml),
            Err(PolicyError::Unsupported { .. })
        ));
        let binding = "apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicyBinding
metadata: {name: b}
spec: {policyName: missing, validationActions: [Deny]}
";
        assert!(matches!(
            AdmissionPolicies::from_yaml(binding),
            Err(PolicyError::UnknownPolicy { .. })
        ));
    }
}
