//! The environment the device plugin hands each container at `Allocate`.
//!
//! `NVIDIA_VISIBLE_DEVICES` pins the container to its GPU (the NVIDIA container runtime reads
//! it); the `GPUSHARE_*` variables let an application cap its own memory use, for example
//! `torch.cuda.set_per_process_memory_fraction(GIB / TOTAL_GIB)`.

/// The GPU's UUID; read by the NVIDIA container runtime.
pub const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
/// Index of the GPU on the node.
pub const GPU_INDEX: &str = "GPUSHARE_GPU_INDEX";
/// UUID of the GPU (same as `NVIDIA_VISIBLE_DEVICES`).
pub const GPU_UUID: &str = "GPUSHARE_GPU_UUID";
/// GiB granted to this container.
pub const CONTAINER_GIB: &str = "GPUSHARE_CONTAINER_MEM_GIB";
/// GiB the whole pod holds on the GPU.
pub const POD_GIB: &str = "GPUSHARE_POD_MEM_GIB";
/// Total GiB of the GPU.
pub const GPU_TOTAL_GIB: &str = "GPUSHARE_GPU_MEM_GIB";
