//! Plain allocations, counted per pointer on the current context's GPU: `cuMemAlloc`,
//! pitched and managed memory, arrays, and the 32-bit v1 entry points of pre-3.2 programs
//! (still exported by the driver, and answered by `cuGetProcAddress` for an old CUDA
//! version).

use std::ffi::{c_uint, c_void};

use crate::driver::{self, DevicePtr, Handle, Status};
use crate::ledger::Kind;
use crate::process::{forward, guard, here, read_out, state};
use crate::settings::Managed;

use super::{alloc_here, free_counted};

/// `CUdeviceptr`s and handles as ledger keys.
#[derive(Clone, Copy, Default)]
struct Key(u64);

impl From<Key> for u64 {
    fn from(key: Key) -> u64 {
        key.0
    }
}

/// # Safety
/// As `cuMemAlloc_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut DevicePtr, bytesize: usize) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        alloc_here(Kind::Pointer, bytesize as u64, dptr, || {
            forward!(mem_alloc(dptr, bytesize))
        })
    })
}

/// A pitch of the width rounded up to 512 bytes, times the height: what a pitched
/// allocation is held to before the driver says its real pitch.
fn pitched_estimate(width: u64, height: u64) -> u64 {
    width
        .div_ceil(512)
        .saturating_mul(512)
        .saturating_mul(height)
}

/// # Safety
/// As `cuMemAllocPitch_v2`. The pitch is unknown before the call: a pitch of the width
/// rounded up to 512 bytes is held to the share, and the driver's real pitch × height counted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut DevicePtr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element_size: c_uint,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let call = || forward!(mem_alloc_pitch(dptr, pitch, width, height, element_size));
        let Some(interposer) = state() else {
            return call();
        };
        let Some(here) = here(interposer) else {
            return call();
        };
        let estimate = pitched_estimate(width as u64, height as u64);
        interposer.allocate_sized_at(Kind::Pointer, here.place(), estimate, || match call() {
            0 => Ok((
                read_out(dptr),
                (read_out(pitch) as u64).saturating_mul(height as u64),
            )),
            code => Err(code),
        })
    })
}

/// # Safety
/// As `cuMemAllocManaged`: counted in full on the current GPU, unless
/// `GPUSHARE_MANAGED_MEMORY=ignore`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut DevicePtr,
    bytesize: usize,
    flags: c_uint,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let call = || forward!(mem_alloc_managed(dptr, bytesize, flags));
        if state().is_some_and(|s| s.settings().managed == Managed::Ignore) {
            return call();
        }
        alloc_here(Kind::Pointer, bytesize as u64, dptr, call)
    })
}

/// # Safety
/// As `cuMemFree_v2` (a pool's pointer too: its pool is re-read).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: DevicePtr) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        super::free_pointer(dptr, || forward!(mem_free(dptr)))
    })
}

/// `CUDA_ARRAY_DESCRIPTOR`.
#[repr(C)]
#[derive(Clone, Copy)]
struct ArrayDescriptor {
    width: usize,
    height: usize,
    format: c_uint,
    channels: c_uint,
}

/// `CUDA_ARRAY3D_DESCRIPTOR`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Array3dDescriptor {
    width: usize,
    height: usize,
    depth: usize,
    format: c_uint,
    channels: c_uint,
    flags: c_uint,
}

/// Bytes per channel of a `CUarray_format`: 8-, 16- and 32-bit formats exactly; NV12 as 2;
/// any other (packed or block-compressed) as 4, which overestimates.
fn element_bytes(format: c_uint) -> u64 {
    match format {
        0x01 | 0x08 => 1,
        0x02 | 0x09 | 0x10 | 0xb0 => 2,
        _ => 4,
    }
}

/// An array's bytes estimated from its descriptor: width × height × depth (each at least 1)
/// × channels × bytes per channel, summed over mipmap levels. The driver's padding and
/// alignment are not counted.
fn array_bytes(
    width: usize,
    height: usize,
    depth: usize,
    format: c_uint,
    channels: c_uint,
    levels: u32,
) -> u64 {
    let per_element = element_bytes(format).saturating_mul(u64::from(channels.max(1)));
    (0..levels.clamp(1, 64))
        .map(|level| {
            let dim = |x: usize| ((x as u64) >> level).max(1);
            dim(width)
                .saturating_mul(dim(height))
                .saturating_mul(dim(depth))
                .saturating_mul(per_element)
        })
        .fold(0u64, u64::saturating_add)
}

/// # Safety
/// As `cuArrayCreate_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(array: *mut Handle, desc: *const c_void) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let call = || forward!(array_create(array, desc));
        if desc.is_null() {
            return call();
        }
        // SAFETY: a non-null CUDA_ARRAY_DESCRIPTOR from the caller.
        let d = unsafe { desc.cast::<ArrayDescriptor>().read_unaligned() };
        let bytes = array_bytes(d.width, d.height, 1, d.format, d.channels, 1);
        alloc_here(Kind::Array, bytes, array.cast::<Key>(), call)
    })
}

/// # Safety
/// As `cuArray3DCreate_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(array: *mut Handle, desc: *const c_void) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let call = || forward!(array3d_create(array, desc));
        if desc.is_null() {
            return call();
        }
        // SAFETY: a non-null CUDA_ARRAY3D_DESCRIPTOR from the caller.
        let d = unsafe { desc.cast::<Array3dDescriptor>().read_unaligned() };
        let bytes = array_bytes(d.width, d.height, d.depth, d.format, d.channels, 1);
        alloc_here(Kind::Array, bytes, array.cast::<Key>(), call)
    })
}

/// # Safety
/// As `cuMipmappedArrayCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    array: *mut Handle,
    desc: *const c_void,
    levels: c_uint,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let call = || forward!(mipmap_create(array, desc, levels));
        if desc.is_null() {
            return call();
        }
        // SAFETY: a non-null CUDA_ARRAY3D_DESCRIPTOR from the caller.
        let d = unsafe { desc.cast::<Array3dDescriptor>().read_unaligned() };
        let bytes = array_bytes(d.width, d.height, d.depth, d.format, d.channels, levels);
        alloc_here(Kind::Mipmapped, bytes, array.cast::<Key>(), call)
    })
}

/// # Safety
/// As `cuArrayDestroy`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayDestroy(array: Handle) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        free_counted(Kind::Array, array as u64, || forward!(array_destroy(array)))
    })
}

/// # Safety
/// As `cuMipmappedArrayDestroy`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayDestroy(array: Handle) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        free_counted(Kind::Mipmapped, array as u64, || {
            forward!(mipmap_destroy(array))
        })
    })
}

/// # Safety
/// As the v1 `cuMemAlloc` (32-bit pointer and size).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc(dptr: *mut u32, bytesize: c_uint) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        alloc_here(Kind::Pointer, u64::from(bytesize), dptr, || {
            forward!(v1_mem_alloc(dptr, bytesize))
        })
    })
}

/// # Safety
/// As the v1 `cuMemAllocPitch`; counted as [`cuMemAllocPitch_v2`] is.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch(
    dptr: *mut u32,
    pitch: *mut c_uint,
    width: c_uint,
    height: c_uint,
    element_size: c_uint,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let call = || forward!(v1_mem_alloc_pitch(dptr, pitch, width, height, element_size));
        let Some(interposer) = state() else {
            return call();
        };
        let Some(here) = here(interposer) else {
            return call();
        };
        let estimate = pitched_estimate(u64::from(width), u64::from(height));
        interposer.allocate_sized_at(Kind::Pointer, here.place(), estimate, || match call() {
            0 => Ok((
                u64::from(read_out(dptr)),
                u64::from(read_out(pitch)).saturating_mul(u64::from(height)),
            )),
            code => Err(code),
        })
    })
}

/// # Safety
/// As the v1 `cuMemFree`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree(dptr: u32) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        free_counted(Kind::Pointer, u64::from(dptr), || {
            forward!(v1_mem_free(dptr))
        })
    })
}
