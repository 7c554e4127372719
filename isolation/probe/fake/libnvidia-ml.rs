//! A fake `libnvidia-ml.so.1` for gpushare-isolation's tests: simulated GPUs, no hardware.
//!
//! Compiled by this crate's `build.rs` with `rustc --crate-type cdylib` (soname
//! `libnvidia-ml.so.1`); std only. GPUs: `FAKE_GPU_COUNT` (default 1), each with
//! `FAKE_GPU_MEM_MIB` MiB (default 16384). Without `FAKE_GPU_STATE` all of it is free; with
//! it, used is what every live process holds on that physical GPU (the file `libcuda.rs`
//! keeps, format in `state.rs`) and free is total minus used. NVML ignores
//! `CUDA_VISIBLE_DEVICES`: its index is the physical index. UUIDs as `libcuda.rs` documents
//! (`GPU-00000000-0000-0000-0000-0000000000ii`). Device handles are numbers that are not the
//! index, so that a caller must ask `nvmlDeviceGetIndex`.
//!
//! Utilization follows the kernels `libcuda.rs` runs (its log, `state.rs`'s timeline):
//! `nvmlDeviceGetUtilizationRates` says what percent of the last second the GPU ran
//! kernels.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, Ordering};

include!("state.rs");
include!("abi.rs");

/// A device handle.
type Ptr = *mut c_void;
type NvmlReturn = c_int;
const SUCCESS: NvmlReturn = 0;
const UNINITIALIZED: NvmlReturn = 1;
const INVALID_ARGUMENT: NvmlReturn = 2;
const NOT_FOUND: NvmlReturn = 6;
const INSUFFICIENT_SIZE: NvmlReturn = 7;

static INITIALIZED: AtomicBool = AtomicBool::new(false);

fn count() -> u32 {
    env_u64("FAKE_GPU_COUNT", 1) as u32
}

fn handle_of(index: u32) -> Ptr {
    (0x5000 + index as usize * 0x40) as Ptr
}

fn initialized() -> Result<(), NvmlReturn> {
    if INITIALIZED.load(Ordering::Acquire) {
        Ok(())
    } else {
        Err(UNINITIALIZED)
    }
}

fn index_of(handle: Ptr) -> Result<u32, NvmlReturn> {
    initialized()?;
    let offset = (handle as usize)
        .checked_sub(0x5000)
        .ok_or(INVALID_ARGUMENT)?;
    let index = (offset / 0x40) as u32;
    if !offset.is_multiple_of(0x40) || index >= count() {
        return Err(INVALID_ARGUMENT);
    }
    Ok(index)
}

/// `f`'s error, or SUCCESS.
fn code(f: impl FnOnce() -> Result<(), NvmlReturn>) -> NvmlReturn {
    f().err().unwrap_or(SUCCESS)
}

/// `p`, unless it is NULL.
fn place<T>(p: *mut T) -> Result<*mut T, NvmlReturn> {
    (!p.is_null()).then_some(p).ok_or(INVALID_ARGUMENT)
}

unsafe fn out<T>(p: *mut T, value: T) -> Result<(), NvmlReturn> {
    unsafe { place(p)?.write(value) };
    Ok(())
}

/// Defines entry points, exported under their names with NVML's ABI: each body gives
/// `Ok(())` (NVML_SUCCESS) or the error code.
macro_rules! export {
    ($($(#[$doc:meta])* fn $f:ident($($arg:ident: $ty:ty),* $(,)?) $body:block)*) => {$(
        $(#[$doc])*
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $f($($arg: $ty),*) -> NvmlReturn {
            code(|| $body)
        }
    )*};
}

/// (total, used) of physical GPU `index`.
fn usage(index: u32) -> (u64, u64) {
    let total = env_u64("FAKE_GPU_MEM_MIB", 16384) << 20;
    let used = match std::env::var_os("FAKE_GPU_STATE") {
        Some(path) => state::device_used(std::path::Path::new(&path), count() as usize)
            .get(index as usize)
            .copied()
            .unwrap_or(0),
        None => 0,
    };
    (total, used.min(total))
}

export! {
    fn nvmlInit_v2() {
        INITIALIZED.store(true, Ordering::Release);
        Ok(())
    }
    fn nvmlShutdown() {
        INITIALIZED.store(false, Ordering::Release);
        Ok(())
    }
    fn nvmlDeviceGetCount_v2(n: *mut c_uint) {
        initialized()?;
        unsafe { out(n, count()) }
    }
    fn nvmlDeviceGetHandleByIndex_v2(index: c_uint, device: *mut Ptr) {
        initialized()?;
        if index >= count() {
            return Err(INVALID_ARGUMENT);
        }
        unsafe { out(device, handle_of(index)) }
    }
    fn nvmlDeviceGetIndex(device: Ptr, index: *mut c_uint) {
        unsafe { out(index, index_of(device)?) }
    }
    fn nvmlDeviceGetUUID(device: Ptr, uuid: *mut c_char, length: c_uint) {
        let s = uuid_string(index_of(device)? as usize);
        let uuid = place(uuid)?;
        if s.len() + 1 > length as usize {
            return Err(INSUFFICIENT_SIZE);
        }
        unsafe {
            std::ptr::copy_nonoverlapping(s.as_ptr(), uuid as *mut u8, s.len());
            uuid.add(s.len()).write(0);
        }
        Ok(())
    }
    fn nvmlDeviceGetHandleByUUID(uuid: *const c_char, device: *mut Ptr) {
        initialized()?;
        if uuid.is_null() || device.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let wanted = unsafe { CStr::from_ptr(uuid) }.to_string_lossy();
        let i = (0..count()).find(|&i| uuid_string(i as usize) == wanted);
        unsafe { device.write(handle_of(i.ok_or(NOT_FOUND)?)) };
        Ok(())
    }
    fn nvmlDeviceGetMemoryInfo(device: Ptr, memory: *mut NvmlMemory) {
        let i = index_of(device)?;
        let memory = place(memory)?;
        let (total, used) = usage(i);
        let free = total - used;
        unsafe { memory.write(NvmlMemory { total, free, used }) };
        Ok(())
    }
    fn nvmlDeviceGetMemoryInfo_v2(device: Ptr, memory: *mut NvmlMemoryV2) {
        let i = index_of(device)?;
        let memory = place(memory)?;
        let (total, used) = usage(i);
        let (version, free, reserved) = (unsafe { (*memory).version }, total - used, 0);
        unsafe { memory.write(NvmlMemoryV2 { version, total, reserved, free, used }) };
        Ok(())
    }
    fn nvmlDeviceGetUtilizationRates(device: Ptr, utilization: *mut NvmlUtilization) {
        let i = index_of(device)?;
        let utilization = place(utilization)?;
        // What percent of the last second the GPU ran kernels.
        let state = std::env::var_os("FAKE_GPU_STATE").map(std::path::PathBuf::from);
        let now = timeline::now_ns();
        let from = now.saturating_sub(1_000_000_000);
        let runs = timeline::runs(state.as_deref()).into_iter();
        let runs = runs.filter(|r| r.phys == i as usize && r.end > from && r.start < now);
        let busy = timeline::busy_within(runs, from, now);
        let gpu = (busy * 100 / (now - from).max(1)).min(100) as c_uint;
        unsafe { utilization.write(NvmlUtilization { gpu, memory: 0 }) };
        Ok(())
    }
}
