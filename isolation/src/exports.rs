//! The exported `extern "C"` hooks: the driver's and NVML's names, `dlsym`, and the process
//! state they share.
//!
//! Every hook runs inside [`guard`] (no panic crosses into C), forwards to the real entry
//! point, and counts only when limits are set ([`state`] is `Some`). Hooks never call each
//! other by their exported names.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::panic::AssertUnwindSafe;
use std::sync::OnceLock;

use gpushare_isolation_budget::Limits;

use crate::budget;
use crate::driver::{self, DevicePtr, Handle, Status};
use crate::interposer::Interposer;
use crate::ledger::Kind;

/// This process's accounting: see [`state`].
static STATE: OnceLock<Option<Interposer>> = OnceLock::new();

/// This process's accounting, set up on first use from the environment; `None` when no
/// limits are set or the budget cannot be opened (then every hook passes through, and one
/// line on stderr says why).
fn state() -> Option<&'static Interposer> {
    STATE.get_or_init(set_up).as_ref()
}

fn set_up() -> Option<Interposer> {
    let limits = match Limits::from_env() {
        Ok(Some(limits)) => limits,
        Ok(None) => return None,
        Err(e) => {
            eprintln!("gpushare-isolation: not limiting GPU memory: {e}");
            return None;
        }
    };
    let path = budget::path_from_env(&limits);
    match Interposer::open(&limits, &path) {
        Ok(interposer) => {
            // SAFETY: plain functions that only read `STATE` without blocking on it.
            unsafe {
                libc::pthread_atfork(
                    Some(before_fork),
                    Some(after_fork_parent),
                    Some(after_fork_child),
                )
            };
            Some(interposer)
        }
        Err(e) => {
            eprintln!("gpushare-isolation: not limiting GPU memory: {e}");
            None
        }
    }
}

/// The state if it is set, never waiting for (or starting) its set-up: for fork handlers.
fn state_if_set() -> Option<&'static Interposer> {
    STATE.get().and_then(Option::as_ref)
}

extern "C" fn before_fork() {
    let _ = std::panic::catch_unwind(|| state_if_set().map(Interposer::before_fork));
}

extern "C" fn after_fork_parent() {
    let _ = std::panic::catch_unwind(|| state_if_set().map(Interposer::after_fork_in_parent));
}

extern "C" fn after_fork_child() {
    let _ = std::panic::catch_unwind(|| state_if_set().map(Interposer::after_fork_in_child));
}

/// Runs a hook's body; a panic becomes `on_panic`.
fn guard(on_panic: Status, body: impl FnOnce() -> Status) -> Status {
    std::panic::catch_unwind(AssertUnwindSafe(body)).unwrap_or(on_panic)
}

/// The real CUDA entry point `pick` chooses, or the status to answer without it.
fn real<F>(pick: impl FnOnce(&driver::Cuda) -> Option<F>) -> Result<F, Status> {
    let cuda = driver::cuda().ok_or(driver::CUDA_ERROR_NOT_INITIALIZED)?;
    pick(&cuda.fns).ok_or(driver::CUDA_ERROR_NOT_FOUND)
}

/// The current context's device, through the real driver.
fn current_device() -> Option<usize> {
    let get = real(|c| c.ctx_get_device).ok()?;
    let mut device: c_int = -1;
    // SAFETY: a place for the answer.
    let status = unsafe { get(&mut device) };
    (status == 0)
        .then_some(device)
        .and_then(|d| usize::try_from(d).ok())
}

/// Reads a pointer-sized answer the driver wrote (0 if the place is null).
fn read_out<T: Copy + Default>(place: *const T) -> T {
    if place.is_null() {
        T::default()
    } else {
        // SAFETY: the driver wrote this place on success; it is the caller's and aligned.
        unsafe { place.read() }
    }
}

/// A counted allocation on the current device: `call` is the driver call, `out` where it
/// writes the new pointer.
fn alloc_current<T: Copy + Default + Into<u64>>(
    kind: Kind,
    bytes: u64,
    out: *const T,
    call: impl FnOnce() -> Status,
) -> Status {
    let Some(interposer) = state() else {
        return call();
    };
    let Some(gpu) = current_device() else {
        // No current context: the driver refuses it itself.
        return call();
    };
    interposer.allocate(kind, gpu, bytes, || match call() {
        0 => Ok(read_out(out).into()),
        code => Err(code),
    })
}

fn free_counted(kind: Kind, key: u64, call: impl FnOnce() -> Status) -> Status {
    match state() {
        Some(interposer) => interposer.free(kind, key, call),
        None => call(),
    }
}

/// `CUdeviceptr`s and handles as ledger keys.
#[derive(Clone, Copy, Default)]
struct Key(u64);

impl From<Key> for u64 {
    fn from(key: Key) -> u64 {
        key.0
    }
}

macro_rules! forward {
    ($pick:ident($($arg:expr),*)) => {
        match real(|c| c.$pick) {
            // SAFETY: the caller's arguments, passed on unchanged to the real entry point.
            Ok(f) => unsafe { f($($arg),*) },
            Err(status) => status,
        }
    };
}

/// # Safety
/// As `cuMemAlloc_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut DevicePtr, bytesize: usize) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        alloc_current(Kind::Pointer, bytesize as u64, dptr, || {
            forward!(mem_alloc(dptr, bytesize))
        })
    })
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
        let (Some(interposer), Some(gpu)) = (state(), current_device()) else {
            return call();
        };
        let estimate = (width as u64)
            .div_ceil(512)
            .saturating_mul(512)
            .saturating_mul(height as u64);
        interposer.allocate_sized(Kind::Pointer, gpu, estimate, || match call() {
            0 => Ok((
                read_out(dptr),
                (read_out(pitch) as u64).saturating_mul(height as u64),
            )),
            code => Err(code),
        })
    })
}

/// # Safety
/// As `cuMemAllocManaged` (counted on the current device).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut DevicePtr,
    bytesize: usize,
    flags: c_uint,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        alloc_current(Kind::Pointer, bytesize as u64, dptr, || {
            forward!(mem_alloc_managed(dptr, bytesize, flags))
        })
    })
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
        alloc_current(Kind::Pointer, bytesize as u64, dptr, || {
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
        alloc_current(Kind::Pointer, bytesize as u64, dptr, || {
            forward!(mem_alloc_async_ptsz(dptr, bytesize, stream))
        })
    })
}

/// # Safety
/// As `cuMemAllocFromPoolAsync` (counted on the current device).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut DevicePtr,
    bytesize: usize,
    pool: Handle,
    stream: Handle,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        alloc_current(Kind::Pointer, bytesize as u64, dptr, || {
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
        alloc_current(Kind::Pointer, bytesize as u64, dptr, || {
            forward!(mem_alloc_pool_ptsz(dptr, bytesize, pool, stream))
        })
    })
}

/// The head of `CUmemAllocationProp`: `{ type, requestedHandleTypes, location { type, id } }`.
#[repr(C)]
#[derive(Clone, Copy)]
struct AllocationPropHead {
    kind: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
}

/// `CU_MEM_LOCATION_TYPE_DEVICE`.
const LOCATION_DEVICE: c_int = 1;

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
        let head = unsafe { prop.cast::<AllocationPropHead>().read_unaligned() };
        if head.location_type != LOCATION_DEVICE {
            return call();
        }
        let Ok(gpu) = usize::try_from(head.location_id) else {
            return call();
        };
        interposer.allocate(Kind::Handle, gpu, size as u64, || match call() {
            0 => Ok(read_out(handle)),
            code => Err(code),
        })
    })
}

/// # Safety
/// As `cuMemRelease`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: u64) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        free_counted(Kind::Handle, handle, || forward!(mem_release(handle)))
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
        alloc_current(Kind::Array, bytes, array.cast::<Key>(), call)
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
        alloc_current(Kind::Array, bytes, array.cast::<Key>(), call)
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
        alloc_current(Kind::Mipmapped, bytes, array.cast::<Key>(), call)
    })
}

/// # Safety
/// As `cuMemFree_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: DevicePtr) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        free_counted(Kind::Pointer, dptr, || forward!(mem_free(dptr)))
    })
}

/// # Safety
/// As `cuMemFreeAsync` (given back at once, not in stream order).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: DevicePtr, stream: Handle) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        free_counted(Kind::Pointer, dptr, || {
            forward!(mem_free_async(dptr, stream))
        })
    })
}

/// # Safety
/// As `cuMemFreeAsync_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync_ptsz(dptr: DevicePtr, stream: Handle) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        free_counted(Kind::Pointer, dptr, || {
            forward!(mem_free_async_ptsz(dptr, stream))
        })
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
/// As `cuMemGetInfo_v2`: total is the share of the current device, free
/// `min(share - used, the driver's free)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let status = forward!(mem_get_info(free, total));
        if status != 0 || free.is_null() || total.is_null() {
            return status;
        }
        let (Some(interposer), Some(gpu)) = (state(), current_device()) else {
            return status;
        };
        let (shown_free, shown_total) = interposer.memory(gpu, read_out(free) as u64);
        // SAFETY: non-null places the driver just wrote.
        unsafe {
            free.write(shown_free as usize);
            total.write(shown_total as usize);
        }
        status
    })
}

/// # Safety
/// As `cuDeviceTotalMem_v2`: the share of `device`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, device: c_int) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let status = forward!(device_total_mem(bytes, device));
        if status != 0 || bytes.is_null() {
            return status;
        }
        if let (Some(interposer), Ok(gpu)) = (state(), usize::try_from(device)) {
            // SAFETY: a non-null place the driver just wrote.
            unsafe { bytes.write(interposer.budget().share(gpu) as usize) };
        }
        status
    })
}

/// The base name `cuGetProcAddress` is asked for, of an exported variant's name:
/// `cuMemAllocAsync_ptsz` and `cuMemAlloc_v2` give `cuMemAllocAsync` and `cuMemAlloc`.
pub(crate) fn base_name(name: &[u8]) -> &[u8] {
    let name = name.strip_suffix(b"_ptsz").unwrap_or(name);
    let name = name.strip_suffix(b"_ptds").unwrap_or(name);
    match name.len().checked_sub(3).map(|at| name.split_at(at)) {
        Some((base, [b'_', b'v', digit])) if digit.is_ascii_digit() => base,
        _ => name,
    }
}

/// Swaps a real entry point that `cuGetProcAddress` answered for `symbol` for our hook of
/// it: the answer must be the real address of a variant we hook of that base name (an
/// address alone is ambiguous: a driver may alias identical functions).
fn swap_for_hook(symbol: *const c_char, pfn: *mut Handle) {
    if symbol.is_null() || pfn.is_null() || state().is_none() {
        return;
    }
    let Some(cuda) = driver::cuda() else {
        return;
    };
    // SAFETY: a non-null, NUL-terminated name from the caller.
    let asked = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    let answered = read_out(pfn.cast_const()) as usize;
    let hooks = cuda_hooks();
    let hook = cuda.swaps.iter().find_map(|&(index, real)| {
        let (name, hook) = hooks[index];
        (real == answered && base_name(name.to_bytes()) == asked).then_some(hook)
    });
    if let Some(hook) = hook {
        // SAFETY: the caller's non-null place for the answer.
        unsafe { pfn.write(hook.cast_mut()) };
    }
}

/// # Safety
/// As `cuGetProcAddress`: the driver answers, and an entry point we hook is swapped for our
/// hook of that exact variant (older variants we do not hook pass unchanged).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut Handle,
    cuda_version: c_int,
    flags: u64,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let status = forward!(get_proc_address(symbol, pfn, cuda_version, flags));
        if status == 0 {
            swap_for_hook(symbol, pfn);
        }
        status
    })
}

/// # Safety
/// As `cuGetProcAddress_v2`; see [`cuGetProcAddress`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut Handle,
    cuda_version: c_int,
    flags: u64,
    symbol_status: *mut c_int,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let status = forward!(get_proc_address_v2(
            symbol,
            pfn,
            cuda_version,
            flags,
            symbol_status
        ));
        if status == 0 {
            swap_for_hook(symbol, pfn);
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

/// The real NVML entry point `pick` chooses, or the status to answer without it.
fn real_nvml<F>(pick: impl FnOnce(&driver::Nvml) -> Option<F>) -> Result<F, Status> {
    let nvml = driver::nvml().ok_or(driver::NVML_ERROR_LIBRARY_NOT_FOUND)?;
    pick(nvml).ok_or(driver::NVML_ERROR_FUNCTION_NOT_FOUND)
}

/// `(free, total, used)` as the container should see NVML device `device`, given NVML's free.
fn nvml_view(device: Handle, nvml_free: u64) -> Option<(u64, u64, u64)> {
    let interposer = state()?;
    let get_index = real_nvml(|n| n.device_get_index).ok()?;
    let mut index: c_uint = 0;
    // SAFETY: the caller's device handle and a place for the answer.
    if unsafe { get_index(device, &mut index) } != 0 {
        return None;
    }
    let gpu = index as usize;
    let (free, total) = interposer.memory(gpu, nvml_free);
    Some((free, total, interposer.budget().used(gpu)))
}

/// # Safety
/// As `nvmlDeviceGetMemoryInfo`: total is the share, free `min(share - used, NVML's free)`,
/// used the container's bytes. The NVML index is taken for the CUDA ordinal.
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
        let mut m = read_out(memory.cast_const().cast::<[u64; 3]>());
        if let Some((free, total, used)) = nvml_view(device, m[1]) {
            m = [total, free, used];
            // SAFETY: the caller's non-null nvmlMemory_t, which NVML just wrote.
            unsafe { memory.cast::<[u64; 3]>().write(m) };
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
        if let Some((free, total, used)) = nvml_view(device, m.free) {
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

/// Our hooks of the CUDA driver, by the names the driver exports.
pub(crate) fn cuda_hooks() -> [(&'static CStr, *const c_void); 21] {
    [
        (c"cuMemAlloc_v2", cuMemAlloc_v2 as *const c_void),
        (c"cuMemAllocPitch_v2", cuMemAllocPitch_v2 as *const c_void),
        (c"cuMemAllocManaged", cuMemAllocManaged as *const c_void),
        (c"cuMemAllocAsync", cuMemAllocAsync as *const c_void),
        (
            c"cuMemAllocAsync_ptsz",
            cuMemAllocAsync_ptsz as *const c_void,
        ),
        (
            c"cuMemAllocFromPoolAsync",
            cuMemAllocFromPoolAsync as *const c_void,
        ),
        (
            c"cuMemAllocFromPoolAsync_ptsz",
            cuMemAllocFromPoolAsync_ptsz as *const c_void,
        ),
        (c"cuMemCreate", cuMemCreate as *const c_void),
        (c"cuMemRelease", cuMemRelease as *const c_void),
        (c"cuArrayCreate_v2", cuArrayCreate_v2 as *const c_void),
        (c"cuArray3DCreate_v2", cuArray3DCreate_v2 as *const c_void),
        (
            c"cuMipmappedArrayCreate",
            cuMipmappedArrayCreate as *const c_void,
        ),
        (c"cuMemFree_v2", cuMemFree_v2 as *const c_void),
        (c"cuMemFreeAsync", cuMemFreeAsync as *const c_void),
        (c"cuMemFreeAsync_ptsz", cuMemFreeAsync_ptsz as *const c_void),
        (c"cuArrayDestroy", cuArrayDestroy as *const c_void),
        (
            c"cuMipmappedArrayDestroy",
            cuMipmappedArrayDestroy as *const c_void,
        ),
        (c"cuMemGetInfo_v2", cuMemGetInfo_v2 as *const c_void),
        (c"cuDeviceTotalMem_v2", cuDeviceTotalMem_v2 as *const c_void),
        (c"cuGetProcAddress", cuGetProcAddress as *const c_void),
        (c"cuGetProcAddress_v2", cuGetProcAddress_v2 as *const c_void),
    ]
}

/// Our hook for an exported driver or NVML name, if we have one.
fn hook_for(name: &[u8]) -> Option<*const c_void> {
    if name.starts_with(b"nvml") {
        return match name {
            b"nvmlDeviceGetMemoryInfo" => Some(nvmlDeviceGetMemoryInfo as *const c_void),
            b"nvmlDeviceGetMemoryInfo_v2" => Some(nvmlDeviceGetMemoryInfo_v2 as *const c_void),
            _ => None,
        };
    }
    cuda_hooks()
        .into_iter()
        .find(|(hooked, _)| hooked.to_bytes() == name)
        .map(|(_, hook)| hook)
}

/// What our `dlsym` does with a lookup: answer it (`answer` non-null: our hook), or jump to
/// glibc's `dlsym` (`real`, with the caller's arguments and return address untouched).
#[repr(C)]
struct Route {
    answer: *mut c_void,
    real: *const c_void,
}

/// Decides a `dlsym` lookup. Only a driver or NVML name we hook, which the real `dlsym`
/// finds, with limits set, is answered here; everything else goes to glibc's.
extern "C" fn dlsym_route(handle: *mut c_void, symbol: *const c_char) -> Route {
    let Some(real) = driver::real_dlsym() else {
        return Route {
            answer: std::ptr::null_mut(),
            real: std::ptr::null(),
        };
    };
    let pass = Route {
        answer: std::ptr::null_mut(),
        real: real as *const c_void,
    };
    if symbol.is_null() {
        return pass;
    }
    // SAFETY: a non-null, NUL-terminated name from the caller.
    let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    if !(name.starts_with(b"cu") || name.starts_with(b"nvml")) {
        // Every other lookup (std's weak symbols among them) stays on this fast path, which
        // touches no state: no recursion into our own set-up.
        return pass;
    }
    let hook = std::panic::catch_unwind(|| {
        let hook = hook_for(name)?;
        state()?;
        // SAFETY: the caller's arguments. Only names we hook are looked up from here (an
        // RTLD_NEXT lookup of them resolves from after this library, which is where the
        // driver is).
        let found = unsafe { real(handle, symbol) };
        (!found.is_null()).then_some(hook.cast_mut())
    });
    match hook {
        Ok(Some(hook)) => Route {
            answer: hook,
            real: pass.real,
        },
        _ => pass,
    }
}

/// # Safety
/// As `dlsym`. A trampoline: it asks `dlsym_route`, then returns our hook, or tail-jumps to
/// glibc's `dlsym` with the caller's arguments and return address on the stack, so that
/// glibc sees the true caller (what `RTLD_NEXT` is relative to).
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // Entry: rsp = 8 mod 16. Two pushes and 8 bytes make the call 16-aligned. `Route` comes
    // back in rax (answer) and rdx (real).
    std::arch::naked_asm!(
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {route}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jnz 2f",
        "test rdx, rdx",
        "jz 2f",
        "jmp rdx",
        "2:",
        "ret",
        route = sym dlsym_route,
    )
}

/// # Safety
/// As `dlsym`. On architectures without the trampoline, the real `dlsym` is called from
/// here, so an `RTLD_NEXT` lookup resolves from after this library, not after its caller.
#[cfg(not(target_arch = "x86_64"))]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    let route = dlsym_route(handle, symbol);
    if !route.answer.is_null() || route.real.is_null() {
        return route.answer;
    }
    // SAFETY: glibc's dlsym, with the caller's arguments.
    unsafe {
        let real = std::mem::transmute::<*const c_void, DlsymFn>(route.real);
        real(handle, symbol)
    }
}

#[cfg(not(target_arch = "x86_64"))]
type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;
