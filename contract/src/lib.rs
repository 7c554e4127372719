//! The contract between gpushare's two programs, and between them and the user's pod.
//!
//! ```text
//!   device plugin ──(node annotation  <domain>/v1.gpus, label <domain>/gpu-count)──▶ extender
//!   extender      ──(pod annotations on the Binding: gpu index/uuid, containers,───▶ device plugin
//!                    and their HMAC signature <domain>/v1.signature)
//!   device plugin ──(pod annotations <domain>/v1.allocated, <domain>/v1.assigned)──▶ extender
//!   device plugin ──(container env NVIDIA_VISIBLE_DEVICES, GPUSHARE_*)─────────────▶ application
//! ```
//!
//! Everything either side writes or reads lives here, so the two programs cannot drift apart:
//! the annotation keys ([`Keys`]), the node's GPU inventory ([`GpuInfo`]), the allocation the
//! extender records on a pod ([`PodAllocation`]), how that record is signed so the device
//! plugin acts only on the extender's decisions ([`signature`]: what is signed, why HMAC,
//! what it stops and what not, how to rotate keys), the environment handed to a container
//! ([`env`](mod@env)), how a pod's GPU-memory request is read from its spec ([`request`]), the
//! CPU and memory a pod requests and a node offers ([`host`]), and how DRA capacities are read
//! as bytes ([`quantity`]).
//!
//! The unit is the GiB: the device plugin advertises one device per whole GiB of a GPU
//! (`floor(bytes / 2^30)`), and pods ask for whole GiB.

pub mod allocation;
pub mod dra;
pub mod env;
pub mod host;
pub mod inventory;
pub mod keys;
pub mod quantity;
pub mod request;
pub mod scope;
pub mod signature;
pub mod taints;
pub mod usage;

pub use allocation::{AllocationError, GpuRef, PodAllocation};
pub use inventory::{GpuInfo, InventoryError};
pub use keys::Keys;
pub use request::{ContainerRequest, MAX_GPUS_PER_POD, PodRequest, RequestError, pod_request_with};
pub use scope::Scope;
pub use signature::{Keyring, KeyringError, KeyringFile, SharedKeyring, Unverified};

/// The extended resource pods ask for, in whole GiB of GPU memory.
pub const DEFAULT_RESOURCE: &str = "example.com/gpu-mem";
/// The domain under which gpushare's annotations and labels live.
pub const DEFAULT_DOMAIN: &str = "gpushare.example.com";
/// The label key an admin sets on nodes that take part.
pub const DEFAULT_NODE_LABEL_KEY: &str = "gpushare";
/// The label value an admin sets on nodes that take part.
pub const DEFAULT_NODE_LABEL_VALUE: &str = "true";
/// Version of the annotation contract; part of every annotation key.
pub const CONTRACT_VERSION: &str = "v1";
/// The largest request, in GiB, a single container may make. Anything larger is a typo.
pub const MAX_GIB: u64 = 4096;
