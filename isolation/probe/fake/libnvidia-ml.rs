//! A fake `libnvidia-ml.so.1` for gpushare-isolation's tests: simulated GPUs, no hardware.
//!
//! Compiled by this crate's `build.rs` with `rustc --crate-type cdylib` (soname
//! `libnvidia-ml.so.1`); std only. GPUs: `FAKE_GPU_COUNT` (default 1), each with
//! `FAKE_GPU_MEM_MIB` MiB (default 16384), all of it free. Device handles are numbers that are
//! not the index, so that a caller must ask `nvmlDeviceGetIndex`.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, Ordering};

type NvmlReturn = c_int;
const SUCCESS: NvmlReturn = 0;
const UNINITIALIZED: NvmlReturn = 1;
const INVALID_ARGUMENT: NvmlReturn = 2;

static INITIALIZED: AtomicBool = AtomicBool::new(false);

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn count() -> u32 {
    env_u64("FAKE_GPU_COUNT", 1) as u32
}

fn handle_of(index: u32) -> *mut c_void {
    (0x5000 + index as usize * 0x40) as *mut c_void
}

fn index_of(handle: *mut c_void) -> Result<u32, NvmlReturn> {
    if !INITIALIZED.load(Ordering::Acquire) {
        return Err(UNINITIALIZED);
    }
    let raw = handle as usize;
    if raw < 0x5000 || (raw - 0x5000) % 0x40 != 0 || ((raw - 0x5000) / 0x40) as u32 >= count() {
        return Err(INVALID_ARGUMENT);
    }
    Ok(((raw - 0x5000) / 0x40) as u32)
}

#[no_mangle]
pub extern "C" fn nvmlInit_v2() -> NvmlReturn {
    INITIALIZED.store(true, Ordering::Release);
    SUCCESS
}

#[no_mangle]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    INITIALIZED.store(false, Ordering::Release);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(n: *mut c_uint) -> NvmlReturn {
    if !INITIALIZED.load(Ordering::Acquire) {
        return UNINITIALIZED;
    }
    if n.is_null() {
        return INVALID_ARGUMENT;
    }
    unsafe { n.write(count()) };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut *mut c_void,
) -> NvmlReturn {
    if !INITIALIZED.load(Ordering::Acquire) {
        return UNINITIALIZED;
    }
    if device.is_null() || index >= count() {
        return INVALID_ARGUMENT;
    }
    unsafe { device.write(handle_of(index)) };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: *mut c_void, index: *mut c_uint) -> NvmlReturn {
    match index_of(device) {
        Ok(i) if !index.is_null() => {
            unsafe { index.write(i) };
            SUCCESS
        }
        Ok(_) => INVALID_ARGUMENT,
        Err(e) => e,
    }
}

#[repr(C)]
pub struct Memory {
    total: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
pub struct MemoryV2 {
    version: c_uint,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: *mut c_void,
    memory: *mut Memory,
) -> NvmlReturn {
    if let Err(e) = index_of(device) {
        return e;
    }
    if memory.is_null() {
        return INVALID_ARGUMENT;
    }
    let total = env_u64("FAKE_GPU_MEM_MIB", 16384) << 20;
    unsafe {
        memory.write(Memory {
            total,
            free: total,
            used: 0,
        })
    };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: *mut c_void,
    memory: *mut MemoryV2,
) -> NvmlReturn {
    if let Err(e) = index_of(device) {
        return e;
    }
    if memory.is_null() {
        return INVALID_ARGUMENT;
    }
    let total = env_u64("FAKE_GPU_MEM_MIB", 16384) << 20;
    let version = unsafe { (*memory).version };
    unsafe {
        memory.write(MemoryV2 {
            version,
            total,
            reserved: 0,
            free: total,
            used: 0,
        })
    };
    SUCCESS
}
