//! The resources this server knows, and the facts about each that the protocol depends on:
//! plural, kind, group/version, scope, and which fields a field selector may name.

/// One served resource type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Kind {
    Pod,
    Node,
    /// Core v1 `Event`.
    Event,
    /// `events.k8s.io/v1` `Event`: a separate store, as the two APIs have different shapes.
    EventV1,
    Lease,
    /// `admissionregistration.k8s.io/v1`, cluster-scoped: the webhooks this server calls on
    /// writes (see `webhooks.rs`).
    MutatingWebhookConfiguration,
    /// `resource.k8s.io/v1`, cluster-scoped: the devices a DRA driver publishes.
    ResourceSlice,
    /// `resource.k8s.io/v1`, namespaced, with a status (allocation, reservedFor).
    ResourceClaim,
}

impl Kind {
    pub const ALL: [Kind; 8] = [
        Kind::Pod,
        Kind::Node,
        Kind::Event,
        Kind::EventV1,
        Kind::Lease,
        Kind::MutatingWebhookConfiguration,
        Kind::ResourceSlice,
        Kind::ResourceClaim,
    ];

    /// Plural, kind and apiVersion, as the URL, the body and discovery name them.
    fn names(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Kind::Pod => ("pods", "Pod", "v1"),
            Kind::Node => ("nodes", "Node", "v1"),
            Kind::Event => ("events", "Event", "v1"),
            Kind::EventV1 => ("events", "Event", "events.k8s.io/v1"),
            Kind::Lease => ("leases", "Lease", "coordination.k8s.io/v1"),
            Kind::MutatingWebhookConfiguration => (
                "mutatingwebhookconfigurations",
                "MutatingWebhookConfiguration",
                "admissionregistration.k8s.io/v1",
            ),
            Kind::ResourceSlice => ("resourceslices", "ResourceSlice", "resource.k8s.io/v1"),
            Kind::ResourceClaim => ("resourceclaims", "ResourceClaim", "resource.k8s.io/v1"),
        }
    }

    pub fn plural(self) -> &'static str {
        self.names().0
    }

    pub fn kind(self) -> &'static str {
        self.names().1
    }

    pub fn api_version(self) -> &'static str {
        self.names().2
    }

    /// The API group (`""` for the core group), as RBAC rules name it.
    pub fn group(self) -> &'static str {
        self.group_version().0
    }

    /// The API group and version: `("", "v1")` for the core group.
    pub fn group_version(self) -> (&'static str, &'static str) {
        let api_version = self.api_version();
        api_version.split_once('/').unwrap_or(("", api_version))
    }

    pub fn namespaced(self) -> bool {
        !matches!(
            self,
            Kind::Node | Kind::MutatingWebhookConfiguration | Kind::ResourceSlice
        )
    }

    /// Whether the resource has a `status` subresource.
    pub fn has_status(self) -> bool {
        matches!(self, Kind::Pod | Kind::Node | Kind::ResourceClaim)
    }

    /// The resource under `group/version` with this plural, if served.
    pub fn lookup(group_version: &str, plural: &str) -> Option<Kind> {
        Kind::ALL
            .into_iter()
            .find(|kind| kind.api_version() == group_version && kind.plural() == plural)
    }

    /// Fields a field selector may name, as the real server's field-label conversion allows.
    pub fn selectable_fields(self) -> &'static [&'static str] {
        match self {
            Kind::Pod => &[
                "metadata.name",
                "metadata.namespace",
                "spec.nodeName",
                "spec.restartPolicy",
                "spec.schedulerName",
                "spec.serviceAccountName",
                "spec.hostNetwork",
                "status.phase",
                "status.podIP",
                "status.nominatedNodeName",
            ],
            Kind::Node => &["metadata.name", "spec.unschedulable"],
            Kind::Event => &[
                "metadata.name",
                "metadata.namespace",
                "involvedObject.kind",
                "involvedObject.namespace",
                "involvedObject.name",
                "involvedObject.uid",
                "involvedObject.apiVersion",
                "involvedObject.resourceVersion",
                "involvedObject.fieldPath",
                "reason",
                "reportingComponent",
                "source",
                "type",
            ],
            Kind::EventV1 => &[
                "metadata.name",
                "metadata.namespace",
                "regarding.kind",
                "regarding.namespace",
                "regarding.name",
                "regarding.uid",
                "regarding.apiVersion",
                "regarding.resourceVersion",
                "regarding.fieldPath",
                "reason",
                "reportingController",
                "type",
            ],
            Kind::Lease => &["metadata.name", "metadata.namespace"],
            Kind::MutatingWebhookConfiguration => &["metadata.name"],
            // As upstream: a node's plugin lists only its own slices.
            Kind::ResourceSlice => &["metadata.name", "spec.nodeName", "spec.driver"],
            Kind::ResourceClaim => &["metadata.name", "metadata.namespace"],
        }
    }
}
