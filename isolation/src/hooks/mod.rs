//! The exported `extern "C"` hooks, by what they hold to the share (memory, or for
//! `launches` and `cuGraphLaunch`, SM time), and the one table of them that `dlsym`,
//! `cuGetProcAddress` and the driver's set-up read.
//!
//! Every hook runs inside [`guard`](crate::process::guard) (no panic crosses into C),
//! forwards to the real entry point, and counts only when limits are set. Hooks never call
//! each other by their exported names.

use std::ffi::{CStr, c_void};
use std::sync::LazyLock;

use crate::driver::{DevicePtr, Status};
use crate::ledger::Kind;
use crate::process::{POOL_RESERVED, here, pool_attribute, read_out, state};

mod contexts;
mod graphs;
mod launches;
mod memory;
mod pools;
mod proc_address;
mod reports;
mod vmm;

/// A hook: the driver's (or NVML's) exported name and our function of that name.
pub(crate) struct Hook {
    /// The exported name.
    pub name: &'static CStr,
    /// Our function.
    pub address: *const c_void,
}

// SAFETY: a name and a function's address, immutable and valid in every thread.
unsafe impl Send for Hook {}
// SAFETY: as above.
unsafe impl Sync for Hook {}

macro_rules! table {
    ($($module:ident::$name:ident),* $(,)?) => {
        vec![$(Hook {
            // SAFETY: a literal with one NUL at its end.
            name: unsafe { CStr::from_bytes_with_nul_unchecked(concat!(stringify!($name), "\0").as_bytes()) },
            address: $module::$name as *const c_void,
        }),*]
    };
}

/// Our hooks of the CUDA driver, by the names the driver exports.
pub(crate) static CUDA: LazyLock<Vec<Hook>> = LazyLock::new(|| {
    table![
        memory::cuMemAlloc_v2,
        memory::cuMemAllocPitch_v2,
        memory::cuMemAllocManaged,
        memory::cuMemFree_v2,
        memory::cuArrayCreate_v2,
        memory::cuArray3DCreate_v2,
        memory::cuMipmappedArrayCreate,
        memory::cuArrayDestroy,
        memory::cuMipmappedArrayDestroy,
        memory::cuMemAlloc,
        memory::cuMemAllocPitch,
        memory::cuMemFree,
        pools::cuMemAllocAsync,
        pools::cuMemAllocAsync_ptsz,
        pools::cuMemAllocFromPoolAsync,
        pools::cuMemAllocFromPoolAsync_ptsz,
        pools::cuMemFreeAsync,
        pools::cuMemFreeAsync_ptsz,
        pools::cuMemPoolCreate,
        pools::cuMemPoolDestroy,
        pools::cuMemPoolTrimTo,
        pools::cuStreamSynchronize,
        pools::cuStreamSynchronize_ptsz,
        pools::cuCtxSynchronize,
        pools::cuEventSynchronize,
        vmm::cuMemCreate,
        vmm::cuMemRelease,
        vmm::cuMemMap,
        vmm::cuMemUnmap,
        vmm::cuMemRetainAllocationHandle,
        graphs::cuGraphAddMemAllocNode,
        graphs::cuGraphLaunch,
        graphs::cuGraphLaunch_ptsz,
        launches::cuLaunchKernel,
        launches::cuLaunchKernel_ptsz,
        launches::cuLaunchKernelEx,
        launches::cuLaunchKernelEx_ptsz,
        launches::cuLaunchCooperativeKernel,
        launches::cuLaunchCooperativeKernel_ptsz,
        graphs::cuGraphUpload,
        graphs::cuGraphUpload_ptsz,
        graphs::cuDeviceGraphMemTrim,
        contexts::cuCtxCreate_v2,
        contexts::cuCtxCreate_v3,
        contexts::cuCtxCreate_v4,
        contexts::cuCtxDestroy_v2,
        contexts::cuDevicePrimaryCtxRetain,
        contexts::cuDevicePrimaryCtxRelease,
        contexts::cuDevicePrimaryCtxRelease_v2,
        contexts::cuDevicePrimaryCtxReset,
        contexts::cuDevicePrimaryCtxReset_v2,
        contexts::cuCtxSetLimit,
        reports::cuMemGetInfo_v2,
        reports::cuDeviceTotalMem_v2,
        reports::cuMemGetInfo,
        reports::cuDeviceTotalMem,
        proc_address::cuGetProcAddress,
        proc_address::cuGetProcAddress_v2,
    ]
});

/// Our hooks of NVML.
pub(crate) static NVML: LazyLock<Vec<Hook>> = LazyLock::new(|| {
    table![
        reports::nvmlDeviceGetMemoryInfo,
        reports::nvmlDeviceGetMemoryInfo_v2,
    ]
});

/// Our hook for an exported driver or NVML name, if we have one.
pub(crate) fn hook_for(name: &[u8]) -> Option<*const c_void> {
    let table = if name.starts_with(b"nvml") {
        &NVML
    } else {
        &CUDA
    };
    table
        .iter()
        .find(|hook| hook.name.to_bytes() == name)
        .map(|hook| hook.address)
}

// What more than one family of hooks counts through: an allocation in the current context,
// a free by key, a free of a pointer that may be a pool's.

/// A counted allocation in the current context: `call` is the driver call, `out` where it
/// writes the new pointer.
pub(crate) fn alloc_here<T: Copy + Default + Into<u64>>(
    kind: Kind,
    bytes: u64,
    out: *const T,
    call: impl FnOnce() -> Status,
) -> Status {
    let Some(interposer) = state() else {
        return call();
    };
    let Some(here) = here(interposer) else {
        // No current context: the driver refuses it itself.
        return call();
    };
    interposer.allocate_at(kind, here.place(), bytes, || match call() {
        0 => Ok(read_out(out).into()),
        code => Err(code),
    })
}

pub(crate) fn free_counted(kind: Kind, key: u64, call: impl FnOnce() -> Status) -> Status {
    match state() {
        Some(interposer) => interposer.free(kind, key, call),
        None => call(),
    }
}

/// A free of a device pointer from `cuMemAlloc*` or from a pool (its pool re-read).
pub(crate) fn free_pointer(key: DevicePtr, call: impl FnOnce() -> Status) -> Status {
    let Some(interposer) = state() else {
        return call();
    };
    let (code, pool) = interposer.free_pointer(key, call);
    if let Some(pool) = pool {
        interposer.refresh_pool_with(pool, || pool_attribute(pool, POOL_RESERVED));
    }
    code
}
