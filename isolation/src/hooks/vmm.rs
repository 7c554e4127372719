//! Virtual memory management (`cuMemCreate`, PyTorch's expandable segments): a handle's
//! memory is charged at creation and given back with its last reference.
//!
//! The driver keeps a handle's memory while it is mapped: NVIDIA's own sample releases the
//! handle right after `cuMemMap`, and the memory lives until `cuMemUnmap`. So the creation,
//! each mapping and each `cuMemRetainAllocationHandle` are references, and `cuMemRelease`
//! and `cuMemUnmap` drop them.

use std::ffi::c_void;

use crate::devices;
use crate::driver::{self, DevicePtr, Status};
use crate::ledger::Kind;
use crate::process::{forward, guard, here, read_out, state};

use super::pools::{LOCATION_DEVICE, LocationHead};

/// # Safety
/// As `cuMemCreate`. Counted on the device `prop->location` names; host locations pass.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut u64,
    size: usize,
    prop: *const c_void,
    flags: u64,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let call = || forward!(mem_create(handle, size, prop, flags));
        let Some(interposer) = state() else {
            return call();
        };
        if prop.is_null() {
            return call();
        }
        // SAFETY: a non-null CUmemAllocationProp from the caller, which starts with this head.
        let head = unsafe { prop.cast::<LocationHead>().read_unaligned() };
        if head.location_type != LOCATION_DEVICE {
            return call();
        }
        let gpu =
            devices::gpu_of_ordinal(interposer.settings(), head.location_id).unwrap_or(usize::MAX);
        let mut place = here(interposer).map(|h| h.place()).unwrap_or_default();
        place.gpu = gpu;
        // Handles outlive contexts: not tied to one.
        place.ctx = 0;
        interposer.allocate_at(Kind::Handle, place, size as u64, || match call() {
            0 => Ok(read_out(handle)),
            code => Err(code),
        })
    })
}

/// # Safety
/// As `cuMemRelease`: the bytes come back once the handle is also mapped nowhere.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: u64) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let status = forward!(mem_release(handle));
        if status == 0
            && let Some(interposer) = state()
        {
            interposer.released(handle);
        }
        status
    })
}

/// # Safety
/// As `cuMemMap`: the mapping holds a reference to the handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemMap(
    ptr: DevicePtr,
    size: usize,
    offset: usize,
    handle: u64,
    flags: u64,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let status = forward!(mem_map(ptr, size, offset, handle, flags));
        if status == 0
            && let Some(interposer) = state()
        {
            interposer.mapped(ptr, size as u64, handle);
        }
        status
    })
}

/// # Safety
/// As `cuMemUnmap`: each mapping in the range drops its reference.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemUnmap(ptr: DevicePtr, size: usize) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let status = forward!(mem_unmap(ptr, size));
        if status == 0
            && let Some(interposer) = state()
        {
            interposer.unmapped(ptr, size as u64);
        }
        status
    })
}

/// # Safety
/// As `cuMemRetainAllocationHandle`: a reference, released by its own `cuMemRelease`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(
    handle: *mut u64,
    address: *mut c_void,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let status = forward!(mem_retain_handle(handle, address));
        if status == 0
            && !handle.is_null()
            && let Some(interposer) = state()
        {
            interposer.retained(read_out(handle.cast_const()));
        }
        status
    })
}
