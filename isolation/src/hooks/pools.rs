//! Stream-ordered allocation (`cuMemAllocAsync`, `cuMemAllocFromPoolAsync`): a pool is
//! charged what it reserves, on its own GPU, not what was asked of it.
//!
//! `cuMemFreeAsync` gives memory back to the pool, not to the device; with a raised release
//! threshold (PyTorch's `cudaMallocAsync` backend, TensorFlow's `cuda_malloc_async`, RMM)
//! the pool keeps it. So an allocation is held to the share for what the pool would have to
//! grow by (what is asked less what it holds unused), and afterwards the pool's charge is
//! its reservation as the driver reports it (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`). The
//! reservation is re-read after each free, trim and synchronisation (where the driver
//! releases down to the threshold), when memory is queried, and before a refusal.

use std::ffi::{c_int, c_void};

use crate::devices;
use crate::driver::{self, DevicePtr, Handle, Status};
use crate::interposer::Place;
use crate::process::{
    POOL_RESERVED, POOL_USED, forward, guard, here, pool_attribute, read_out, real, refresh_pools,
    state,
};

/// The pool device `ordinal` allocates from now (`cuDeviceGetMemPool`).
fn current_pool(ordinal: c_int) -> Option<u64> {
    let get = real(|c| c.device_get_mem_pool).ok()?;
    let mut pool: Handle = std::ptr::null_mut();
    // SAFETY: a place for the pool and a device ordinal.
    (unsafe { get(&mut pool, ordinal) } == 0 && !pool.is_null()).then_some(pool as u64)
}

/// The GPU `pool` is on, for a pool not made through our hook: the device whose current or
/// default pool it is.
fn gpu_of_unknown_pool(pool: u64) -> Option<usize> {
    let default = real(|c| c.device_get_default_mem_pool).ok();
    devices::known_ordinals().find_map(|(ordinal, gpu)| {
        let is_default = default.is_some_and(|get| {
            let mut p: Handle = std::ptr::null_mut();
            // SAFETY: a place for the pool and a device ordinal.
            unsafe { get(&mut p, ordinal) == 0 && p as u64 == pool }
        });
        (is_default || current_pool(ordinal) == Some(pool)).then_some(gpu)
    })
}

/// An allocation of `bytes` from `pool` (`None`: the current device's current pool).
fn alloc_from_pool(
    dptr: *mut DevicePtr,
    bytes: u64,
    pool: Option<u64>,
    call: impl FnOnce() -> Status,
) -> Status {
    let Some(interposer) = state() else {
        return call();
    };
    let Some(here) = here(interposer) else {
        return call();
    };
    let Some(pool) = pool.or_else(|| current_pool(here.ordinal)) else {
        return super::alloc_here(crate::ledger::Kind::Pointer, bytes, dptr, call);
    };
    let gpu = match interposer.pool_gpu(pool) {
        Some(gpu) => gpu,
        None => {
            let gpu = gpu_of_unknown_pool(pool).or(here.gpu).unwrap_or(usize::MAX);
            interposer.pool_created(pool, gpu);
            gpu
        }
    };
    let (Some(reserved), Some(used)) = (
        pool_attribute(pool, POOL_RESERVED),
        pool_attribute(pool, POOL_USED),
    ) else {
        // A driver without pool attributes: count what was asked, per pointer.
        return super::alloc_here(crate::ledger::Kind::Pointer, bytes, dptr, call);
    };
    let place = Place { gpu, ctx: here.ctx };
    interposer.allocate_from_pool(
        place,
        pool,
        bytes,
        reserved.saturating_sub(used),
        || match call() {
            0 => Ok(read_out(dptr)),
            code => Err(code),
        },
        || pool_attribute(pool, POOL_RESERVED),
    )
}

/// # Safety
/// As `cuMemAllocAsync`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut DevicePtr,
    bytesize: usize,
    stream: Handle,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        alloc_from_pool(dptr, bytesize as u64, None, || {
            forward!(mem_alloc_async(dptr, bytesize, stream))
        })
    })
}

/// # Safety
/// As `cuMemAllocAsync_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(
    dptr: *mut DevicePtr,
    bytesize: usize,
    stream: Handle,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        alloc_from_pool(dptr, bytesize as u64, None, || {
            forward!(mem_alloc_async_ptsz(dptr, bytesize, stream))
        })
    })
}

/// # Safety
/// As `cuMemAllocFromPoolAsync` (charged on the pool's GPU).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut DevicePtr,
    bytesize: usize,
    pool: Handle,
    stream: Handle,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        alloc_from_pool(dptr, bytesize as u64, Some(pool as u64), || {
            forward!(mem_alloc_pool(dptr, bytesize, pool, stream))
        })
    })
}

/// # Safety
/// As `cuMemAllocFromPoolAsync_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut DevicePtr,
    bytesize: usize,
    pool: Handle,
    stream: Handle,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        alloc_from_pool(dptr, bytesize as u64, Some(pool as u64), || {
            forward!(mem_alloc_pool_ptsz(dptr, bytesize, pool, stream))
        })
    })
}

/// # Safety
/// As `cuMemFreeAsync`: the memory goes back to its pool, whose reservation is re-read.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: DevicePtr, stream: Handle) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        super::free_pointer(dptr, || forward!(mem_free_async(dptr, stream)))
    })
}

/// # Safety
/// As `cuMemFreeAsync_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync_ptsz(dptr: DevicePtr, stream: Handle) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        super::free_pointer(dptr, || forward!(mem_free_async_ptsz(dptr, stream)))
    })
}

/// The head of `CUmemPoolProps` (and of `CUmemAllocationProp`):
/// `{ allocType, handleTypes, location { type, id } }`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct LocationHead {
    pub kind: c_int,
    pub handle_types: c_int,
    pub location_type: c_int,
    pub location_id: c_int,
}

/// `CU_MEM_LOCATION_TYPE_DEVICE`.
pub(super) const LOCATION_DEVICE: c_int = 1;

/// # Safety
/// As `cuMemPoolCreate`: a pool on a device is charged there.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolCreate(pool: *mut Handle, props: *const c_void) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let status = forward!(mem_pool_create(pool, props));
        let Some(interposer) = state() else {
            return status;
        };
        if status != 0 || props.is_null() || pool.is_null() {
            return status;
        }
        // SAFETY: a non-null CUmemPoolProps from the caller, which starts with this head.
        let head = unsafe { props.cast::<LocationHead>().read_unaligned() };
        if head.location_type == LOCATION_DEVICE {
            let gpu = devices::gpu_of_ordinal(interposer.settings(), head.location_id)
                .unwrap_or(usize::MAX);
            interposer.pool_created(read_out(pool.cast_const()) as u64, gpu);
        }
        status
    })
}

/// # Safety
/// As `cuMemPoolDestroy`: the pool's charge goes with it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolDestroy(pool: Handle) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let status = forward!(mem_pool_destroy(pool));
        if status == 0
            && let Some(interposer) = state()
        {
            interposer.pool_destroyed(pool as u64);
        }
        status
    })
}

/// # Safety
/// As `cuMemPoolTrimTo`: the pool's reservation is re-read.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolTrimTo(pool: Handle, keep: usize) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let status = forward!(mem_pool_trim_to(pool, keep));
        if status == 0
            && let Some(interposer) = state()
        {
            interposer
                .refresh_pool_with(pool as u64, || pool_attribute(pool as u64, POOL_RESERVED));
        }
        status
    })
}

/// After a synchronisation, where pools release down to their thresholds: re-reads them.
fn after_sync(status: Status) -> Status {
    if status == 0
        && let Some(interposer) = state()
    {
        refresh_pools(interposer);
    }
    status
}

/// # Safety
/// As `cuStreamSynchronize`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize(stream: Handle) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        after_sync(forward!(stream_synchronize(stream)))
    })
}

/// # Safety
/// As `cuStreamSynchronize_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize_ptsz(stream: Handle) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        after_sync(forward!(stream_synchronize_ptsz(stream)))
    })
}

/// # Safety
/// As `cuCtxSynchronize`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSynchronize() -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        after_sync(forward!(ctx_synchronize()))
    })
}

/// # Safety
/// As `cuEventSynchronize`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventSynchronize(event: Handle) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        after_sync(forward!(event_synchronize(event)))
    })
}
