//! Request counters: every call the server routes to a resource, by who made it, for which
//! API group and resource, with which RBAC verb ([`Call`]); and the field selectors lists and
//! watches asked for.
//!
//! They let a test hold the chart's RBAC against the calls our binaries really make, and
//! count writes and reads without instrumenting the clients.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use super::{Verb, locked};

/// One kind of request, in the terms an RBAC authorizer decides on: who asked
/// (the username this server resolved from the credentials), for which API group and
/// resource (with its subresource: `pods/binding`, `nodes/status`), with which verb.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Call {
    /// The username, e.g. `system:serviceaccount:kube-system:gpushare-extender`.
    pub user: String,
    /// The API group: `""` for the core group, `events.k8s.io`, `coordination.k8s.io`.
    pub group: String,
    /// The resource, `resource/subresource` for a subresource.
    pub resource: String,
    /// What was asked; [`Verb::rbac`] is the verb RBAC checks.
    pub verb: Verb,
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let group = if self.group.is_empty() {
            "core"
        } else {
            &self.group
        };
        write!(
            f,
            "{} {} {group}/{}",
            self.user,
            self.verb.rbac(),
            self.resource
        )
    }
}

/// Request counters, by caller. Every request this server routes to a resource counts,
/// failed ones (injected faults, refusals) included: a call the caller made is a call it
/// needs permission for. Cheap to clone.
#[derive(Clone, Default)]
pub struct Stats {
    calls: Arc<Mutex<BTreeMap<Call, u64>>>,
    /// The field selectors lists and watches asked for, by resource.
    field_selectors: Arc<Mutex<BTreeMap<String, BTreeSet<String>>>>,
}

impl Stats {
    /// How many calls `counts` counts.
    fn total(&self, counts: impl Fn(&Call) -> bool) -> u64 {
        let calls = locked(&self.calls);
        calls
            .iter()
            .filter(|(call, _)| counts(call))
            .map(|(_, n)| n)
            .sum()
    }

    pub(crate) fn record(&self, user: &str, verb: Verb, group: &str, resource: &str) {
        let call = Call {
            user: user.to_owned(),
            group: group.to_owned(),
            resource: resource.to_owned(),
            verb,
        };
        *locked(&self.calls).entry(call).or_default() += 1;
    }

    pub(crate) fn record_field_selector(&self, resource: &str, selector: &str) {
        locked(&self.field_selectors)
            .entry(resource.to_owned())
            .or_default()
            .insert(selector.to_owned());
    }

    /// The distinct field selectors lists and watches of `resource` asked for.
    pub fn field_selectors(&self, resource: &str) -> BTreeSet<String> {
        locked(&self.field_selectors)
            .get(resource)
            .cloned()
            .unwrap_or_default()
    }

    /// Requests seen so far with `verb` on `resource` ("pods", "nodes", "events", "leases",
    /// "pods/binding", "pods/status", "nodes/status"), by anyone, in any API group, failed
    /// ones included.
    pub fn count(&self, verb: Verb, resource: &str) -> u64 {
        self.total(|call| call.verb == verb && call.resource == resource)
    }

    /// Create + Update + Patch + Delete requests on every resource except events.
    pub fn writes(&self) -> u64 {
        self.total(|call| call.verb.is_write() && call.resource != "events")
    }

    /// Create + Update + Patch + Delete requests on every resource, events included.
    pub fn writes_including_events(&self) -> u64 {
        self.total(|call| call.verb.is_write())
    }

    /// Every kind of request seen so far, with how many times each was made.
    pub fn calls(&self) -> BTreeMap<Call, u64> {
        locked(&self.calls).clone()
    }

    /// The kinds of request `user` made so far, with how many times each was made.
    pub fn calls_by(&self, user: &str) -> BTreeMap<Call, u64> {
        let mut calls = self.calls();
        calls.retain(|call, _| call.user == user);
        calls
    }

    pub fn reset(&self) {
        locked(&self.calls).clear();
    }
}
