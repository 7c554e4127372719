//! Which of the container's GPUs a CUDA device or an NVML device is: its index in the
//! budget.
//!
//! Budgets are per GPU, and a GPU is named by its UUID ([`crate::settings`]): a CUDA ordinal
//! depends on the process's `CUDA_VISIBLE_DEVICES` (ordinal 0 of one process may be ordinal
//! 1 of another), and NVML's index ignores it. A device's UUID is read once per process
//! (`cuDeviceGetUuid`, `nvmlDeviceGetUUID`) and looked up in the container's list. Without a
//! list, the GPU is the NVML index of the device with that UUID (the node's order, the same
//! in every process of the container), and without NVML the CUDA ordinal.

use std::ffi::{c_char, c_int, c_uint};
use std::sync::atomic::{AtomicU8, Ordering};

use crate::driver::{self, Handle};
use crate::settings::{Settings, Uuid, format_uuid, parse_uuid};

/// CUDA ordinals remembered per process.
const ORDINALS: usize = 64;
/// Not looked up yet.
const UNKNOWN: u8 = 0;
/// Not one of the container's GPUs.
const NONE: u8 = u8::MAX;

/// Per CUDA ordinal: `UNKNOWN`, `NONE`, or the budget index plus one.
static BY_ORDINAL: [AtomicU8; ORDINALS] = [const { AtomicU8::new(UNKNOWN) }; ORDINALS];

/// The budget index of CUDA device `ordinal`, `None` when it is not one of the container's
/// GPUs.
pub fn gpu_of_ordinal(settings: &Settings, ordinal: c_int) -> Option<usize> {
    let Some(cached) = usize::try_from(ordinal)
        .ok()
        .and_then(|o| BY_ORDINAL.get(o))
    else {
        return resolve_ordinal(settings, ordinal);
    };
    match cached.load(Ordering::Relaxed) {
        UNKNOWN => {
            let gpu = resolve_ordinal(settings, ordinal);
            let code = gpu.and_then(|g| u8::try_from(g + 1).ok()).unwrap_or(NONE);
            cached.store(code, Ordering::Relaxed);
            gpu
        }
        NONE => None,
        code => Some(usize::from(code - 1)),
    }
}

/// Every CUDA ordinal of this process that is one of the container's GPUs, with its index.
pub fn known_ordinals() -> impl Iterator<Item = (c_int, usize)> {
    BY_ORDINAL.iter().enumerate().filter_map(|(ordinal, code)| {
        let code = code.load(Ordering::Relaxed);
        (code != UNKNOWN && code != NONE).then(|| (ordinal as c_int, usize::from(code - 1)))
    })
}

fn resolve_ordinal(settings: &Settings, ordinal: c_int) -> Option<usize> {
    let Some(uuid) = cuda_uuid(ordinal) else {
        return usize::try_from(ordinal).ok();
    };
    if !settings.uuids.is_empty() {
        return settings.gpu_of_uuid(&uuid);
    }
    nvml_index_of(&uuid).or_else(|| usize::try_from(ordinal).ok())
}

/// The UUID of CUDA device `ordinal`.
pub fn cuda_uuid(ordinal: c_int) -> Option<Uuid> {
    let cuda = driver::cuda()?;
    let get = cuda.fns.device_get_uuid_v2.or(cuda.fns.device_get_uuid)?;
    let mut uuid = [0u8; 16];
    // SAFETY: a place for the 16 bytes and a device ordinal.
    (unsafe { get(&mut uuid, ordinal) } == 0).then_some(uuid)
}

/// NVML's index of the device with `uuid`.
fn nvml_index_of(uuid: &Uuid) -> Option<usize> {
    if !nvml_ready() {
        return None;
    }
    let nvml = driver::nvml()?;
    let (by_uuid, index_of) = (nvml.device_by_uuid?, nvml.device_get_index?);
    let text = std::ffi::CString::new(format_uuid(uuid)).ok()?;
    let mut device: Handle = std::ptr::null_mut();
    // SAFETY: a NUL-terminated UUID and a place for the handle.
    if unsafe { by_uuid(text.as_ptr(), &mut device) } != 0 {
        return None;
    }
    let mut index: c_uint = 0;
    // SAFETY: a handle from NVML and a place for the answer.
    (unsafe { index_of(device, &mut index) } == 0).then_some(index as usize)
}

/// The budget index of NVML device `device`, `None` when it is not one of the container's
/// GPUs (or NVML cannot tell).
pub fn gpu_of_nvml(settings: &Settings, device: Handle) -> Option<usize> {
    let nvml = driver::nvml()?;
    if !settings.uuids.is_empty()
        && let Some(get_uuid) = nvml.device_get_uuid
    {
        let mut text = [0 as c_char; 96];
        // SAFETY: the caller's device handle and a buffer of that length.
        if unsafe { get_uuid(device, text.as_mut_ptr(), text.len() as c_uint) } == 0 {
            // SAFETY: NVML wrote a NUL-terminated string into the buffer.
            let text = unsafe { std::ffi::CStr::from_ptr(text.as_ptr()) };
            let uuid = parse_uuid(&text.to_string_lossy())?;
            return settings.gpu_of_uuid(&uuid);
        }
    }
    let index_of = nvml.device_get_index?;
    let mut index: c_uint = 0;
    // SAFETY: the caller's device handle and a place for the answer.
    (unsafe { index_of(device, &mut index) } == 0).then_some(index as usize)
}

/// Initialises NVML for this process's own reads, once (`nvmlInit_v2` is reference-counted
/// and never shut down here, so a program's own `nvmlShutdown` leaves ours standing);
/// whether NVML can be read.
pub fn nvml_ready() -> bool {
    static READY: AtomicU8 = AtomicU8::new(UNKNOWN);
    match READY.load(Ordering::Acquire) {
        UNKNOWN => {
            let ready = driver::nvml()
                .and_then(|n| n.init)
                // SAFETY: no arguments.
                .is_some_and(|init| unsafe { init() } == 0);
            READY.store(if ready { 1 } else { NONE }, Ordering::Release);
            ready
        }
        code => code == 1,
    }
}

/// What the driver has free on CUDA device `ordinal` now, from NVML (device-wide, every
/// process's use counted): for measuring what a context takes. Needs [`nvml_ready`].
pub fn driver_free(ordinal: c_int) -> Option<u64> {
    let uuid = cuda_uuid(ordinal)?;
    let nvml = driver::nvml()?;
    let (by_uuid, memory_info) = (nvml.device_by_uuid?, nvml.memory_info?);
    let text = std::ffi::CString::new(format_uuid(&uuid)).ok()?;
    let mut device: Handle = std::ptr::null_mut();
    let mut memory = [0u64; 3];
    // SAFETY: a NUL-terminated UUID and places for the answers (nvmlMemory_t is three u64s:
    // total, free, used).
    let read = unsafe {
        by_uuid(text.as_ptr(), &mut device) == 0
            && memory_info(device, memory.as_mut_ptr().cast()) == 0
    };
    read.then_some(memory[1])
}
