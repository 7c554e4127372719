//! kubelet's gRPC APIs as the device plugin speaks them, generated from `proto/`:
//!
//! - the device plugin API (`v1beta1`, `proto/deviceplugin/v1beta1/api.proto`): the device
//!   plugin serves [`v1beta1::device_plugin_server`] and calls
//!   [`v1beta1::registration_client`];
//! - the PodResources API (`v1`, `proto/podresources/v1/api.proto`): what kubelet really gave
//!   each container; the device plugin calls [`podresources::v1::pod_resources_lister_client`]
//!   to check its own bookkeeping against it.
//!
//! - the DRA plugin API (`dra/v1`) and the plugin registration API (`pluginregistration`):
//!   the DRA plugin serves both, kubelet (the test kubelet in `e2e`) calls them.
//!
//! The test kubelet in `e2e` serves the other side of both. Keeping the generated code in one
//! crate means the plugin and its fake kubelet cannot disagree about the wire format.
//!
//! [`authority`] lets a tonic server accept requests whose `:authority` is a socket path, as
//! kubelet's plugin watcher sends them (h2 alone resets them). [`socket_file`] hands a
//! plugin's socket paths from a rollout's old pod to its new one.

pub mod authority;
pub mod socket_file;

/// Messages and services of `k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1beta1 {
    tonic::include_proto!("v1beta1");
}

/// kubelet's PodResources API.
pub mod podresources {
    /// Messages and services of `k8s.io/kubelet/pkg/apis/podresources/v1`.
    #[allow(missing_docs, clippy::all, clippy::pedantic)]
    pub mod v1 {
        tonic::include_proto!("v1");
    }
}

/// kubelet's Dynamic Resource Allocation plugin API.
pub mod dra {
    /// Messages and services of `k8s.io/kubelet/pkg/apis/dra/v1` (protobuf package
    /// `k8s.io.kubelet.pkg.apis.dra.v1`): a DRA driver serves
    /// [`v1::dra_plugin_server`], kubelet calls [`v1::dra_plugin_client`].
    #[allow(missing_docs, clippy::all, clippy::pedantic)]
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }

    /// The service name a DRA plugin lists in `PluginInfo.supported_versions` when it serves
    /// the v1 `DRAPlugin` service (upstream `DRAPluginService`).
    pub const V1_SERVICE: &str = "v1.DRAPlugin";
    /// `PluginInfo.type` of a DRA plugin.
    pub const PLUGIN_TYPE: &str = "DRAPlugin";
}

/// kubelet's plugin registration API (`k8s.io/kubelet/pkg/apis/pluginregistration/v1`,
/// protobuf package `pluginregistration`): a plugin serves
/// [`pluginregistration::registration_server`] on a socket in kubelet's plugin registry
/// directory; kubelet's plugin watcher finds the socket, calls `GetInfo` and then
/// `NotifyRegistrationStatus`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

/// Where kubelet's plugin watcher looks for registration sockets on a node.
pub const DEFAULT_PLUGIN_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry/";

/// Where kubelet serves the PodResources API on a node.
pub const DEFAULT_POD_RESOURCES_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";

/// The API version a plugin sends in its `RegisterRequest`.
pub const VERSION: &str = "v1beta1";
/// The file name of kubelet's registration socket inside the device plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// `Device.health` of a usable device.
pub const HEALTHY: &str = "Healthy";
/// `Device.health` of a device that must not be handed out.
pub const UNHEALTHY: &str = "Unhealthy";
/// Where kubelet looks for device plugin sockets on a node.
pub const DEFAULT_DEVICE_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins/";

/// A gRPC channel over the unix socket at `path`: how kubelet dials a plugin and a plugin
/// dials kubelet.
pub async fn connect_unix(
    path: &std::path::Path,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let path = path.to_owned();
    // The URI is required by the API but ignored: the connector dials the socket.
    tonic::transport::Endpoint::from_static("http://[::]:50051")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
}
