//! Graph memory (`cuGraphAddMemAllocNode`, and `cudaMallocAsync` captured in a graph): taken
//! from each GPU's graph memory pool when a graph is uploaded or launched, and kept there
//! until `cuDeviceGraphMemTrim`.
//!
//! A node asking more than the share has left is refused when it is added; afterwards each
//! GPU's graph memory pool is charged what it reserves
//! (`CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`), re-read after each upload, launch and trim.
//!
//! A graph launch is also held to the compute share, as a kernel launch is
//! (`launches::held`): graphs count.

use std::ffi::{c_int, c_void};

use crate::devices;
use crate::driver::{self, Handle, Status};
use crate::interposer::CUDA_ERROR_OUT_OF_MEMORY;
use crate::process::{forward, guard, here, refresh_graph_memory, state};

use super::launches::held;
use super::pools::{LOCATION_DEVICE, LocationHead};

/// `CUDA_MEM_ALLOC_NODE_PARAMS`: `CUmemPoolProps` (88 bytes: its location head,
/// `win32SecurityAttributes`, then 64 bytes of `maxSize`, `usage` and reserved), the access
/// descriptors, `bytesize`, and the `dptr` the driver writes.
#[repr(C)]
#[derive(Clone, Copy)]
struct MemAllocNodeParams {
    head: LocationHead,
    win32_security_attributes: *mut c_void,
    pool_props_rest: [u8; 64],
    access_descs: *const c_void,
    access_desc_count: usize,
    bytesize: usize,
    dptr: u64,
}

/// # Safety
/// As `cuGraphAddMemAllocNode`: a node asking more than the share has left on its GPU is
/// refused with `CUDA_ERROR_OUT_OF_MEMORY`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphAddMemAllocNode(
    node: *mut Handle,
    graph: Handle,
    dependencies: *const Handle,
    count: usize,
    params: *mut c_void,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let call = || {
            forward!(graph_add_mem_alloc_node(
                node,
                graph,
                dependencies,
                count,
                params
            ))
        };
        let Some(interposer) = state() else {
            return call();
        };
        if params.is_null() {
            return call();
        }
        // SAFETY: a non-null CUDA_MEM_ALLOC_NODE_PARAMS from the caller.
        let p = unsafe { params.cast::<MemAllocNodeParams>().read_unaligned() };
        let gpu = if p.head.location_type == LOCATION_DEVICE {
            devices::gpu_of_ordinal(interposer.settings(), p.head.location_id)
        } else {
            here(interposer).and_then(|h| h.gpu)
        };
        if !interposer.would_fit(gpu.unwrap_or(usize::MAX), p.bytesize as u64) {
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        call()
    })
}

/// After an upload or launch: the graph memory pools are re-read.
fn after_graph_work(status: Status) -> Status {
    if status == 0
        && let Some(interposer) = state()
    {
        refresh_graph_memory(interposer);
    }
    status
}

/// # Safety
/// As `cuGraphLaunch`: held to the compute share as a kernel launch is (the whole graph is
/// measured between two events).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphLaunch(exec: Handle, stream: Handle) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        after_graph_work(held(stream, false, || forward!(graph_launch(exec, stream))))
    })
}

/// # Safety
/// As `cuGraphLaunch_ptsz`: held as `cuGraphLaunch`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphLaunch_ptsz(exec: Handle, stream: Handle) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        after_graph_work(held(stream, true, || {
            forward!(graph_launch_ptsz(exec, stream))
        }))
    })
}

/// # Safety
/// As `cuGraphUpload`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphUpload(exec: Handle, stream: Handle) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        after_graph_work(forward!(graph_upload(exec, stream)))
    })
}

/// # Safety
/// As `cuGraphUpload_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphUpload_ptsz(exec: Handle, stream: Handle) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        after_graph_work(forward!(graph_upload_ptsz(exec, stream)))
    })
}

/// # Safety
/// As `cuDeviceGraphMemTrim`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGraphMemTrim(device: c_int) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        after_graph_work(forward!(device_graph_mem_trim(device)))
    })
}
