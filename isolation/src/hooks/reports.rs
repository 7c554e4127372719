//! What programs are told of memory: the share as the GPU's total, and what is left of it
//! as free, through CUDA (`cuMemGetInfo`, `cuDeviceTotalMem`, v2 and v1) and NVML
//! (`nvmlDeviceGetMemoryInfo`, so `nvidia-smi`).
//!
//! Used includes the contexts' charge, so NVML's `used + free == total`. A GPU the
//! container has no share of keeps the driver's total and shows nothing free.
//!
//! A process that refuses everything (limits set but not applicable, see
//! `crate::source`) shows each GPU full: the share as total where the shares could be read,
//! else the driver's total, and nothing free.

use std::ffi::{c_int, c_uint, c_void};

use crate::devices;
use crate::driver::{self, Handle, Status};
use crate::interposer::Interposer;
use crate::process::{forward, guard, here, read_out, real, real_nvml, state};

/// `gpu` if the budget has a share for it to show: not a GPU of a refusing budget whose
/// shares could not be read (that one keeps the driver's total and shows nothing free).
fn with_share(interposer: &Interposer, gpu: Option<usize>) -> Option<usize> {
    let budget = interposer.budget();
    gpu.filter(|gpu| !budget.is_closed() || *gpu < budget.gpu_count())
}

/// `(free, total)` the program sees for the current context's GPU, given the driver's.
fn shown_here(driver_free: u64, driver_total: u64) -> (u64, u64) {
    let Some(interposer) = state() else {
        return (driver_free, driver_total);
    };
    match here(interposer) {
        Some(here) => match with_share(interposer, here.gpu) {
            Some(gpu) => interposer.memory(gpu, driver_free),
            None => (0, driver_total),
        },
        None => (driver_free, driver_total),
    }
}

/// The real `cuMemGetInfo_v2` into places of our own: `(status, free, total)`.
fn driver_info() -> (Status, u64, u64) {
    let (mut free, mut total) = (0usize, 0usize);
    match real(|c| c.mem_get_info) {
        Ok(get) => {
            // SAFETY: places for the answers.
            let status = unsafe { get(&mut free, &mut total) };
            (status, free as u64, total as u64)
        }
        Err(status) => (status, 0, 0),
    }
}

/// Writes `value` to `place` unless it is null.
fn write_out<T>(place: *mut T, value: T) {
    if !place.is_null() {
        // SAFETY: the caller's non-null place for the answer.
        unsafe { place.write(value) };
    }
}

/// # Safety
/// As `cuMemGetInfo_v2`: total is the share of the current device, free
/// `min(share - used, the driver's free)`. Either place may be null (OptiX asks for the
/// total alone).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        if state().is_none() || (free.is_null() && total.is_null()) {
            return forward!(mem_get_info(free, total));
        }
        let (status, driver_free, driver_total) = driver_info();
        if status != 0 {
            return status;
        }
        let (shown_free, shown_total) = shown_here(driver_free, driver_total);
        write_out(free, shown_free as usize);
        write_out(total, shown_total as usize);
        status
    })
}

/// # Safety
/// As the v1 `cuMemGetInfo` (32-bit figures, capped at 4 GiB - 1).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo(free: *mut c_uint, total: *mut c_uint) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        if state().is_none() || (free.is_null() && total.is_null()) {
            return forward!(v1_mem_get_info(free, total));
        }
        let (status, driver_free, driver_total) = driver_info();
        if status != 0 {
            return status;
        }
        let (shown_free, shown_total) = shown_here(driver_free, driver_total);
        let narrow = |v: u64| c_uint::try_from(v).unwrap_or(c_uint::MAX);
        write_out(free, narrow(shown_free));
        write_out(total, narrow(shown_total));
        status
    })
}

/// The share of device `device`, if the container has one there.
fn share_of(device: c_int) -> Option<u64> {
    let interposer = state()?;
    let gpu = with_share(
        interposer,
        devices::gpu_of_ordinal(interposer.settings(), device),
    )?;
    Some(interposer.budget().share(gpu))
}

/// # Safety
/// As `cuDeviceTotalMem_v2`: the share of `device`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, device: c_int) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let status = forward!(device_total_mem(bytes, device));
        if status == 0
            && let Some(share) = share_of(device)
        {
            write_out(bytes, share as usize);
        }
        status
    })
}

/// # Safety
/// As the v1 `cuDeviceTotalMem`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem(bytes: *mut c_uint, device: c_int) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let status = forward!(v1_device_total_mem(bytes, device));
        if status == 0
            && let Some(share) = share_of(device)
        {
            write_out(bytes, c_uint::try_from(share).unwrap_or(c_uint::MAX));
        }
        status
    })
}

/// `nvmlMemory_t`.
#[repr(C)]
#[derive(Clone, Copy)]
struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
#[derive(Clone, Copy)]
struct NvmlMemoryV2 {
    version: c_uint,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}

/// `(total, free, used)` as the container should see NVML device `device`, given NVML's
/// total and free; `None` to leave NVML's answer as it is (no limits).
fn nvml_view(device: Handle, nvml_total: u64, nvml_free: u64) -> Option<(u64, u64, u64)> {
    let interposer = state()?;
    Some(
        match with_share(
            interposer,
            devices::gpu_of_nvml(interposer.settings(), device),
        ) {
            Some(gpu) => {
                let (free, total) = interposer.memory(gpu, nvml_free);
                (total, free, total - free)
            }
            None => (nvml_total, 0, nvml_total),
        },
    )
}

/// # Safety
/// As `nvmlDeviceGetMemoryInfo`: total is the share, free `min(share - used, NVML's free)`,
/// used the rest.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(device: Handle, memory: *mut c_void) -> Status {
    guard(driver::NVML_ERROR_UNKNOWN, || {
        let status = match real_nvml(|n| n.memory_info) {
            // SAFETY: the caller's arguments, unchanged.
            Ok(f) => unsafe { f(device, memory) },
            Err(status) => status,
        };
        if status != 0 || memory.is_null() {
            return status;
        }
        let memory = memory.cast::<NvmlMemory>();
        let m = read_out(memory.cast_const().cast::<[u64; 3]>());
        if let Some((total, free, used)) = nvml_view(device, m[0], m[1]) {
            // SAFETY: the caller's non-null nvmlMemory_t, which NVML just wrote.
            unsafe { memory.cast::<[u64; 3]>().write([total, free, used]) };
        }
        status
    })
}

/// # Safety
/// As `nvmlDeviceGetMemoryInfo_v2`; see [`nvmlDeviceGetMemoryInfo`]. `reserved` becomes 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(device: Handle, memory: *mut c_void) -> Status {
    guard(driver::NVML_ERROR_UNKNOWN, || {
        let status = match real_nvml(|n| n.memory_info_v2) {
            // SAFETY: the caller's arguments, unchanged.
            Ok(f) => unsafe { f(device, memory) },
            Err(status) => status,
        };
        if status != 0 || memory.is_null() {
            return status;
        }
        let memory = memory.cast::<NvmlMemoryV2>();
        // SAFETY: the caller's non-null nvmlMemory_v2_t, which NVML just wrote.
        let mut m = unsafe { memory.read() };
        if let Some((total, free, used)) = nvml_view(device, m.total, m.free) {
            m.total = total;
            m.free = free;
            m.used = used;
            m.reserved = 0;
            // SAFETY: as above.
            unsafe { memory.write(m) };
        }
        status
    })
}
