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

    pub fn plural(self) -> &'static str {
        match self {
            Kind::Pod => "pods",
            Kind::Node => "nodes",
            Kind::Event | Kind::EventV1 => "events",
            Kind::Lease => "leases",
            Kind::MutatingWebhookConfiguration => "mutatingwebhookconfigurations",
            Kind::ResourceSlice => "resourceslices",
            Kind::ResourceClaim => "resourceclaims",
        }
    }

    pub fn kind(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::Node => "Node",
            Kind::Event | Kind::EventV1 => "Event",
            Kind::Lease => "Lease",
            Kind::MutatingWebhookConfiguration => "MutatingWebhookConfiguration",
            Kind::ResourceSlice => "ResourceSlice",
            Kind::ResourceClaim => "ResourceClaim",
        }
    }

    pub fn api_version(self) -> &'static str {
        match self {
            Kind::Pod | Kind::Node | Kind::Event => "v1",
            Kind::EventV1 => "events.k8s.io/v1",
            Kind::Lease => "coordination.k8s.io/v1",
            Kind::MutatingWebhookConfiguration => "admissionregistration.k8s.io/v1",
            Kind::ResourceSlice | Kind::ResourceClaim => "resource.k8s.io/v1",
        }
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
