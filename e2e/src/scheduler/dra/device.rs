//! Whether one device can serve one device request: the CEL selectors of the class and the
//! request, the device's taints, and its consumable capacity.
//!
//! Consumable capacity (KEP-5075) as upstream's allocator does it: a device with
//! `allowMultipleAllocations` may serve many requests; a request consumes, per capacity of
//! the device, what it asks for (`capacity.requests`) or else the policy's default (or the
//! whole capacity without a policy), rounded up to the policy (`validRange` min/step/max,
//! `validValues`); the sum over all allocations never exceeds the capacity's value. A device
//! without `allowMultipleAllocations` is allocated at most once. A device with a `NoSchedule`
//! or `NoExecute` taint (KEP-5055) goes only to requests that tolerate it; allocations made
//! before the taint stay (this driver does not evict for `NoExecute`). CEL selectors that
//! read `device.capacity` are refused (the attributes and the driver are available).

use std::collections::BTreeMap;

use gpushare_dra_plugin::quantity;
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, Device, DeviceAttribute, DeviceTaint, DeviceToleration,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::json;

use super::AllocateError;
use super::usage::{DeviceId, Hold, Usage};

/// The amount of a capacity a request consumes on a device, rounded to the device's
/// policy; `None` when the policy cannot be met.
fn consumption(
    requested: Option<u128>,
    value: u128,
    policy: Option<&CapacityRequestPolicy>,
) -> Result<Option<u128>, String> {
    let parse = |q: &Quantity| quantity::bytes(&q.0).map_err(|e| e.to_string());
    let Some(policy) = policy else {
        return Ok(Some(requested.unwrap_or(value)));
    };
    let default = policy.default.as_ref().map(parse).transpose()?;
    let mut amount = match (requested, default) {
        (Some(r), _) => r,
        (None, Some(d)) => d,
        (None, None) => value,
    };
    if let Some(values) = &policy.valid_values {
        let mut valid = values.iter().map(parse).collect::<Result<Vec<_>, _>>()?;
        valid.sort_unstable();
        return Ok(valid.into_iter().find(|v| *v >= amount));
    }
    if let Some(range) = &policy.valid_range {
        let min = parse(&range.min)?;
        amount = amount.max(min);
        if let Some(step) = range
            .step
            .as_ref()
            .map(parse)
            .transpose()?
            .filter(|s| *s > 0)
        {
            amount = min.saturating_add((amount - min).div_ceil(step).saturating_mul(step));
        }
        if let Some(max) = range.max.as_ref().map(parse).transpose()?
            && amount > max
        {
            return Ok(None);
        }
    }
    Ok(Some(amount))
}

fn cel_attribute(value: &DeviceAttribute) -> serde_json::Value {
    if let Some(s) = &value.string {
        json!(s)
    } else if let Some(i) = value.int {
        json!(i)
    } else if let Some(b) = value.bool {
        json!(b)
    } else if let Some(v) = &value.version {
        json!(v)
    } else {
        serde_json::Value::Null
    }
}

/// The `device` variable CEL selectors see: driver and attributes by domain (an unqualified
/// attribute is in the driver's domain), as upstream.
fn cel_device(driver: &str, device: &Device) -> serde_json::Value {
    let mut domains: BTreeMap<String, serde_json::Map<String, serde_json::Value>> = BTreeMap::new();
    for (name, value) in device.attributes.iter().flatten() {
        let (domain, id) = name.split_once('/').unwrap_or((driver, name));
        domains
            .entry(domain.to_owned())
            .or_default()
            .insert(id.to_owned(), cel_attribute(value));
    }
    json!({"driver": driver, "attributes": domains})
}

pub(super) fn selects(
    expressions: &[&str],
    driver: &str,
    device: &Device,
) -> Result<bool, AllocateError> {
    if expressions.is_empty() {
        return Ok(true);
    }
    let mut context = cel::Context::default();
    let value = cel::to_value(cel_device(driver, device))
        .map_err(|e| AllocateError::Unsupported(format!("device {}: {e}", device.name)))?;
    context.add_variable_from_value("device", value);
    for expression in expressions {
        if expression.contains("device.capacity") {
            return Err(AllocateError::Unsupported(format!(
                "CEL selector {expression:?} reads device.capacity, which this scheduler does not offer; request capacity with capacity.requests instead"
            )));
        }
        let program = cel::Program::compile(expression).map_err(|e| {
            AllocateError::Unsupported(format!("CEL selector {expression:?} does not compile: {e}"))
        })?;
        match program.execute(&context) {
            Ok(cel::Value::Bool(true)) => {}
            Ok(cel::Value::Bool(false)) => return Ok(false),
            Ok(other) => {
                return Err(AllocateError::Unsupported(format!(
                    "CEL selector {expression:?} gave {other:?}, not a bool"
                )));
            }
            Err(e) => {
                return Err(AllocateError::Unsupported(format!(
                    "CEL selector {expression:?} failed on device {}: {e}",
                    device.name
                )));
            }
        }
    }
    Ok(true)
}

/// Upstream's `resourceclaim.ToleratesTaint`.
pub(super) fn tolerates(toleration: &DeviceToleration, taint: &DeviceTaint) -> bool {
    if toleration
        .effect
        .as_deref()
        .is_some_and(|e| !e.is_empty() && e != taint.effect)
        || toleration
            .key
            .as_deref()
            .is_some_and(|k| !k.is_empty() && k != taint.key)
    {
        return false;
    }
    match toleration.operator.as_deref() {
        None | Some("" | "Equal") => {
            toleration.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("")
        }
        Some("Exists") => true,
        Some(_) => false,
    }
}

/// Whether a request with `tolerations` may get `device` (KEP-5055 device taints, beta in
/// 1.36): every `NoSchedule` or `NoExecute` taint must be tolerated. Other effects (`None`,
/// and unknown ones, which the API says to treat like `None`) keep no claim away.
pub(super) fn all_taints_tolerated(
    device: &Device,
    tolerations: Option<&[DeviceToleration]>,
) -> bool {
    device
        .taints
        .iter()
        .flatten()
        .filter(|taint| matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute"))
        .all(|taint| {
            tolerations
                .unwrap_or_default()
                .iter()
                .any(|t| tolerates(t, taint))
        })
}

/// How `device` (`id`) can serve a request for `requested` beside `trial`: whole when it is
/// not shareable and unused (and nothing is requested of its capacity), else a share when
/// every capacity has room for the request rounded to its policy; `None` when it cannot.
pub(super) fn fit(
    device: &Device,
    id: &DeviceId,
    requested: &BTreeMap<&str, u128>,
    trial: &Usage,
) -> Result<Option<Hold>, AllocateError> {
    let shared = device.allow_multiple_allocations == Some(true);
    if !shared {
        if trial.in_use(id) || !requested.is_empty() {
            return Ok(None);
        }
        return Ok(Some(Hold::Whole));
    }
    if trial.held_whole(id) {
        return Ok(None);
    }
    let capacities = device.capacity.clone().unwrap_or_default();
    if requested.keys().any(|name| !capacities.contains_key(*name)) {
        return Ok(None);
    }
    let mut consumed = BTreeMap::new();
    for (name, capacity) in &capacities {
        let value = quantity::bytes(&capacity.value.0)
            .map_err(|e| AllocateError::Unsupported(format!("device {}: {e}", device.name)))?;
        let Some(amount) = consumption(
            requested.get(name.as_str()).copied(),
            value,
            capacity.request_policy.as_ref(),
        )
        .map_err(AllocateError::Unsupported)?
        else {
            return Ok(None);
        };
        if trial.consumed(id, name).saturating_add(amount) > value {
            return Ok(None);
        }
        consumed.insert(name.clone(), amount);
    }
    Ok(Some(Hold::Share(consumed)))
}
