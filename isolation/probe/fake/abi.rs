// The driver API's structures (CUDA 12, NVML) that the probe fills and the fake libraries
// read or answer with, one definition for both sides: included (`include!`) by `src/probe.rs`,
// `libcuda.rs` and `libnvidia-ml.rs`, each of which defines `Ptr` (`*mut c_void`).

/// `CUlaunchConfig`: grid, block, shared memory, stream, attributes.
#[repr(C)]
pub struct LaunchConfig {
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared_mem_bytes: c_uint,
    stream: Ptr,
    attrs: Ptr,
    num_attrs: c_uint,
}

/// `CUmemAllocationProp` (`PAD` 8) and `CUmemPoolProps` (`PAD` 64) as the probe fills them:
/// type, requested handle types, location { type, id }, a Windows pointer, then fields left
/// zero (compression, RDMA, usage; max size, usage).
#[repr(C)]
pub struct DeviceProps<const PAD: usize> {
    kind: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    win32: Ptr,
    zeros: [u8; PAD],
}

pub type AllocationProp = DeviceProps<8>;
pub type PoolProps = DeviceProps<64>;

/// `CUDA_MEM_ALLOC_NODE_PARAMS` (`dptr` is an output).
#[repr(C)]
pub struct MemAllocNodeParams {
    pool_props: PoolProps,
    access_descs: *const AccessDesc,
    access_desc_count: usize,
    bytesize: usize,
    dptr: u64,
}

/// `CUmemAccessDesc`: location { type, id }, flags.
#[repr(C)]
pub struct AccessDesc {
    location_type: c_int,
    location_id: c_int,
    flags: c_int,
}

const _: () = assert!(std::mem::size_of::<AllocationProp>() == 32);
const _: () = assert!(std::mem::size_of::<PoolProps>() == 88);
const _: () = assert!(std::mem::size_of::<MemAllocNodeParams>() == 120);

/// `CUDA_ARRAY_DESCRIPTOR`.
#[repr(C)]
pub struct ArrayDescriptor {
    width: usize,
    height: usize,
    format: c_uint,
    channels: c_uint,
}

/// `CUDA_ARRAY3D_DESCRIPTOR`.
#[repr(C)]
pub struct Array3dDescriptor {
    width: usize,
    height: usize,
    depth: usize,
    format: c_uint,
    channels: c_uint,
    flags: c_uint,
}

/// `nvmlUtilization_t`: gpu, memory (percent).
#[repr(C)]
#[derive(Default)]
pub struct NvmlUtilization {
    gpu: c_uint,
    memory: c_uint,
}

/// `nvmlMemory_t`.
#[repr(C)]
#[derive(Default)]
pub struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
#[derive(Default)]
pub struct NvmlMemoryV2 {
    version: c_uint,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}
