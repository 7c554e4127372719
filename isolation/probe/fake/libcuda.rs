//! A fake `libcuda.so.1` for gpushare-isolation's tests: simulated GPUs, no hardware.
//!
//! Compiled by this crate's `build.rs` with `rustc --crate-type cdylib` (soname
//! `libcuda.so.1`); std only, so that it needs no crate. GPUs: `FAKE_GPU_COUNT` (default 1),
//! each with `FAKE_GPU_MEM_MIB` MiB (default 16384). Pointers and handles are numbers, never
//! memory. It implements just what the probe and the interposer call, with the driver's
//! signatures and error codes.
//!
//! Exported functions never call each other (an LD_PRELOADed interposer would catch the
//! call); they call private `*_impl` functions.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::Mutex;

type CuResult = c_int;
const SUCCESS: CuResult = 0;
const INVALID_VALUE: CuResult = 1;
const OUT_OF_MEMORY: CuResult = 2;
const NOT_INITIALIZED: CuResult = 3;
const INVALID_DEVICE: CuResult = 101;
const INVALID_CONTEXT: CuResult = 201;
const NOT_FOUND: CuResult = 500;

struct Driver {
    mem: Vec<u64>,
    used: Vec<u64>,
    /// pointer or handle -> (device, bytes, the entry point that allocated it)
    allocs: HashMap<u64, (usize, u64, &'static str)>,
    next: u64,
    /// The entry point of the last free.
    last_free: &'static str,
}

static DRIVER: Mutex<Option<Driver>> = Mutex::new(None);

thread_local! {
    /// The current context's device, -1 for none.
    static CURRENT: Cell<i32> = const { Cell::new(-1) };
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn with_driver<T>(f: impl FnOnce(&mut Driver) -> Result<T, CuResult>) -> Result<T, CuResult> {
    let mut guard = DRIVER.lock().unwrap_or_else(|e| e.into_inner());
    match guard.as_mut() {
        Some(driver) => f(driver),
        None => Err(NOT_INITIALIZED),
    }
}

fn code(r: Result<(), CuResult>) -> CuResult {
    r.err().unwrap_or(SUCCESS)
}

fn current() -> Result<usize, CuResult> {
    let dev = CURRENT.with(|c| c.get());
    if dev < 0 {
        Err(INVALID_CONTEXT)
    } else {
        Ok(dev as usize)
    }
}

fn alloc_impl(dev: usize, bytes: u64, by: &'static str) -> Result<u64, CuResult> {
    with_driver(|d| {
        if dev >= d.mem.len() {
            return Err(INVALID_DEVICE);
        }
        if bytes == 0 {
            return Err(INVALID_VALUE);
        }
        if d.used[dev] + bytes > d.mem[dev] {
            return Err(OUT_OF_MEMORY);
        }
        d.used[dev] += bytes;
        let ptr = d.next;
        d.next += bytes.div_ceil(1 << 21).max(1) << 21;
        d.allocs.insert(ptr, (dev, bytes, by));
        Ok(ptr)
    })
}

/// Frees `ptr` if one of `allocators` allocated it (each entry point passes its own list, so
/// that no two are the same code: rustc would merge them into one address).
fn free_impl(ptr: u64, allocators: &[&str], freer: &'static str) -> CuResult {
    code(with_driver(|d| match d.allocs.get(&ptr) {
        Some(&(dev, bytes, by)) if allocators.contains(&by) => {
            d.last_free = freer;
            d.allocs.remove(&ptr);
            d.used[dev] -= bytes;
            Ok(())
        }
        _ => Err(INVALID_VALUE),
    }))
}

unsafe fn out<T>(p: *mut T, value: T) -> Result<(), CuResult> {
    if p.is_null() {
        return Err(INVALID_VALUE);
    }
    unsafe { p.write(value) };
    Ok(())
}

unsafe fn alloc_current(dptr: *mut u64, bytes: u64, by: &'static str) -> CuResult {
    code(
        current()
            .and_then(|dev| alloc_impl(dev, bytes, by))
            .and_then(|p| unsafe { out(dptr, p) }),
    )
}

#[no_mangle]
pub extern "C" fn cuInit(_flags: c_uint) -> CuResult {
    let mut guard = DRIVER.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_none() {
        let count = env_u64("FAKE_GPU_COUNT", 1) as usize;
        let mem = env_u64("FAKE_GPU_MEM_MIB", 16384) << 20;
        *guard = Some(Driver {
            mem: vec![mem; count],
            used: vec![0; count],
            allocs: HashMap::new(),
            next: 0x7f00_0000_0000,
            last_free: "",
        });
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CuResult {
    code(with_driver(|d| Ok(d.mem.len() as c_int)).and_then(|n| unsafe { out(count, n) }))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut c_int, ordinal: c_int) -> CuResult {
    code(
        with_driver(|d| {
            if ordinal < 0 || ordinal as usize >= d.mem.len() {
                Err(INVALID_DEVICE)
            } else {
                Ok(ordinal)
            }
        })
        .and_then(|o| unsafe { out(device, o) }),
    )
}

fn ctx_of(dev: c_int) -> *mut c_void {
    (0x1000 + dev as usize * 0x10) as *mut c_void
}

fn device_of(ctx: *mut c_void) -> Result<c_int, CuResult> {
    let raw = ctx as usize;
    if raw < 0x1000 || (raw - 0x1000) % 0x10 != 0 {
        return Err(INVALID_CONTEXT);
    }
    let dev = ((raw - 0x1000) / 0x10) as c_int;
    with_driver(|d| {
        if dev as usize >= d.mem.len() {
            Err(INVALID_CONTEXT)
        } else {
            Ok(dev)
        }
    })
}

fn valid_device(dev: c_int) -> Result<(), CuResult> {
    with_driver(|d| {
        if dev < 0 || dev as usize >= d.mem.len() {
            Err(INVALID_DEVICE)
        } else {
            Ok(())
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v2(
    pctx: *mut *mut c_void,
    _flags: c_uint,
    dev: c_int,
) -> CuResult {
    code(valid_device(dev).and_then(|()| {
        CURRENT.with(|c| c.set(dev));
        unsafe { out(pctx, ctx_of(dev)) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut *mut c_void, dev: c_int) -> CuResult {
    code(valid_device(dev).and_then(|()| unsafe { out(pctx, ctx_of(dev)) }))
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: *mut c_void) -> CuResult {
    if ctx.is_null() {
        CURRENT.with(|c| c.set(-1));
        return SUCCESS;
    }
    code(device_of(ctx).map(|dev| CURRENT.with(|c| c.set(dev))))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut c_int) -> CuResult {
    code(current().and_then(|dev| unsafe { out(device, dev as c_int) }))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetDefaultMemPool(pool: *mut *mut c_void, dev: c_int) -> CuResult {
    code(
        valid_device(dev)
            .and_then(|()| unsafe { out(pool, (0x9000 + dev as usize * 0x10) as *mut c_void) }),
    )
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, bytes: usize) -> CuResult {
    unsafe { alloc_current(dptr, bytes as u64, "cuMemAlloc_v2") }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut u64,
    pitch: *mut usize,
    width: usize,
    height: usize,
    _element: c_uint,
) -> CuResult {
    let p = width.div_ceil(512) * 512;
    if pitch.is_null() {
        return INVALID_VALUE;
    }
    let r = unsafe { alloc_current(dptr, (p * height) as u64, "cuMemAllocPitch_v2") };
    if r == SUCCESS {
        unsafe { pitch.write(p) };
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut u64,
    bytes: usize,
    _flags: c_uint,
) -> CuResult {
    unsafe { alloc_current(dptr, bytes as u64, "cuMemAllocManaged") }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut u64,
    bytes: usize,
    _stream: *mut c_void,
) -> CuResult {
    unsafe { alloc_current(dptr, bytes as u64, "cuMemAllocAsync") }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(
    dptr: *mut u64,
    bytes: usize,
    _stream: *mut c_void,
) -> CuResult {
    unsafe { alloc_current(dptr, bytes as u64, "cuMemAllocAsync_ptsz") }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut u64,
    bytes: usize,
    _pool: *mut c_void,
    _stream: *mut c_void,
) -> CuResult {
    unsafe { alloc_current(dptr, bytes as u64, "cuMemAllocFromPoolAsync") }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut u64,
    bytes: usize,
    _pool: *mut c_void,
    _stream: *mut c_void,
) -> CuResult {
    unsafe { alloc_current(dptr, bytes as u64, "cuMemAllocFromPoolAsync_ptsz") }
}

/// The head of `CUmemAllocationProp`: type, requested handle types, location { type, id }.
#[repr(C)]
pub struct AllocationPropHead {
    kind: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
}

#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut u64,
    size: usize,
    prop: *const AllocationPropHead,
    _flags: u64,
) -> CuResult {
    if prop.is_null() {
        return INVALID_VALUE;
    }
    let dev = unsafe { (*prop).location_id };
    code(
        valid_device(dev)
            .and_then(|()| alloc_impl(dev as usize, size as u64, "cuMemCreate"))
            .and_then(|h| unsafe { out(handle, h) }),
    )
}

#[no_mangle]
pub extern "C" fn cuMemRelease(handle: u64) -> CuResult {
    free_impl(handle, &["cuMemCreate"], "cuMemRelease")
}

#[repr(C)]
pub struct ArrayDescriptor {
    width: usize,
    height: usize,
    format: c_uint,
    channels: c_uint,
}

#[repr(C)]
pub struct Array3dDescriptor {
    width: usize,
    height: usize,
    depth: usize,
    format: c_uint,
    channels: c_uint,
    flags: c_uint,
}

fn element_bytes(format: c_uint) -> u64 {
    match format {
        0x01 | 0x08 => 1,
        0x02 | 0x09 | 0x10 => 2,
        _ => 4,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuArrayCreate_v2(
    array: *mut *mut c_void,
    desc: *const ArrayDescriptor,
) -> CuResult {
    if desc.is_null() {
        return INVALID_VALUE;
    }
    let d = unsafe { &*desc };
    let bytes =
        d.width as u64 * d.height.max(1) as u64 * element_bytes(d.format) * d.channels as u64;
    code(
        current()
            .and_then(|dev| alloc_impl(dev, bytes, "cuArrayCreate_v2"))
            .and_then(|p| unsafe { out(array, p as *mut c_void) }),
    )
}

#[no_mangle]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    array: *mut *mut c_void,
    desc: *const Array3dDescriptor,
) -> CuResult {
    if desc.is_null() {
        return INVALID_VALUE;
    }
    let d = unsafe { &*desc };
    let bytes = d.width as u64
        * d.height.max(1) as u64
        * d.depth.max(1) as u64
        * element_bytes(d.format)
        * d.channels as u64;
    code(
        current()
            .and_then(|dev| alloc_impl(dev, bytes, "cuArray3DCreate_v2"))
            .and_then(|p| unsafe { out(array, p as *mut c_void) }),
    )
}

#[no_mangle]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    array: *mut *mut c_void,
    desc: *const Array3dDescriptor,
    levels: c_uint,
) -> CuResult {
    if desc.is_null() {
        return INVALID_VALUE;
    }
    let d = unsafe { &*desc };
    let mut bytes = 0;
    for level in 0..levels.max(1) {
        let dim = |x: usize| (x >> level).max(1) as u64;
        bytes += dim(d.width)
            * dim(d.height)
            * dim(d.depth)
            * element_bytes(d.format)
            * d.channels as u64;
    }
    code(
        current()
            .and_then(|dev| alloc_impl(dev, bytes, "cuMipmappedArrayCreate"))
            .and_then(|p| unsafe { out(array, p as *mut c_void) }),
    )
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(ptr: u64) -> CuResult {
    free_impl(
        ptr,
        &[
            "cuMemAlloc_v2",
            "cuMemAllocPitch_v2",
            "cuMemAllocManaged",
            "cuMemAllocAsync",
            "cuMemAllocAsync_ptsz",
            "cuMemAllocFromPoolAsync",
            "cuMemAllocFromPoolAsync_ptsz",
        ],
        "cuMemFree_v2",
    )
}

#[no_mangle]
pub extern "C" fn cuMemFreeAsync(ptr: u64, _stream: *mut c_void) -> CuResult {
    free_impl(
        ptr,
        &[
            "cuMemAlloc_v2",
            "cuMemAllocPitch_v2",
            "cuMemAllocManaged",
            "cuMemAllocAsync",
            "cuMemAllocAsync_ptsz",
            "cuMemAllocFromPoolAsync",
            "cuMemAllocFromPoolAsync_ptsz",
        ],
        "cuMemFreeAsync",
    )
}

#[no_mangle]
pub extern "C" fn cuMemFreeAsync_ptsz(ptr: u64, _stream: *mut c_void) -> CuResult {
    free_impl(
        ptr,
        &[
            "cuMemAlloc_v2",
            "cuMemAllocPitch_v2",
            "cuMemAllocManaged",
            "cuMemAllocAsync",
            "cuMemAllocAsync_ptsz",
            "cuMemAllocFromPoolAsync",
            "cuMemAllocFromPoolAsync_ptsz",
        ],
        "cuMemFreeAsync_ptsz",
    )
}

#[no_mangle]
pub extern "C" fn cuArrayDestroy(array: *mut c_void) -> CuResult {
    free_impl(
        array as u64,
        &["cuArrayCreate_v2", "cuArray3DCreate_v2"],
        "cuArrayDestroy",
    )
}

#[no_mangle]
pub extern "C" fn cuMipmappedArrayDestroy(array: *mut c_void) -> CuResult {
    free_impl(
        array as u64,
        &["cuMipmappedArrayCreate"],
        "cuMipmappedArrayDestroy",
    )
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    code(
        current()
            .and_then(|dev| with_driver(|d| Ok((d.mem[dev] - d.used[dev], d.mem[dev]))))
            .and_then(|(f, t)| unsafe {
                out(free, f as usize).and_then(|()| out(total, t as usize))
            }),
    )
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int) -> CuResult {
    code(
        valid_device(dev)
            .and_then(|()| with_driver(|d| Ok(d.mem[dev as usize])))
            .and_then(|t| unsafe { out(bytes, t as usize) }),
    )
}

/// `cuGetProcAddress`'s resolution: a base name, the caller's CUDA version and flags
/// (bit 1: per-thread default stream) pick the variant, as the real driver does.
fn proc_address(symbol: *const c_char, version: c_int, flags: u64) -> *mut c_void {
    if symbol.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: a NUL-terminated name from the caller.
    let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    let ptsz = flags & 2 != 0;
    let f: *mut c_void = match name {
        b"cuInit" => cuInit as *mut c_void,
        b"cuDeviceGetCount" => cuDeviceGetCount as *mut c_void,
        b"cuDeviceGet" => cuDeviceGet as *mut c_void,
        b"cuCtxCreate" => cuCtxCreate_v2 as *mut c_void,
        b"cuDevicePrimaryCtxRetain" => cuDevicePrimaryCtxRetain as *mut c_void,
        b"cuCtxSetCurrent" => cuCtxSetCurrent as *mut c_void,
        b"cuCtxGetDevice" => cuCtxGetDevice as *mut c_void,
        b"cuDeviceGetDefaultMemPool" => cuDeviceGetDefaultMemPool as *mut c_void,
        b"cuMemAlloc" => cuMemAlloc_v2 as *mut c_void,
        b"cuMemAllocPitch" => cuMemAllocPitch_v2 as *mut c_void,
        b"cuMemAllocManaged" => cuMemAllocManaged as *mut c_void,
        b"cuMemAllocAsync" if ptsz => cuMemAllocAsync_ptsz as *mut c_void,
        b"cuMemAllocAsync" => cuMemAllocAsync as *mut c_void,
        b"cuMemAllocFromPoolAsync" if ptsz => cuMemAllocFromPoolAsync_ptsz as *mut c_void,
        b"cuMemAllocFromPoolAsync" => cuMemAllocFromPoolAsync as *mut c_void,
        b"cuMemCreate" => cuMemCreate as *mut c_void,
        b"cuMemRelease" => cuMemRelease as *mut c_void,
        b"cuArrayCreate" => cuArrayCreate_v2 as *mut c_void,
        b"cuArray3DCreate" => cuArray3DCreate_v2 as *mut c_void,
        b"cuMipmappedArrayCreate" => cuMipmappedArrayCreate as *mut c_void,
        b"cuMemFree" => cuMemFree_v2 as *mut c_void,
        b"cuMemFreeAsync" if ptsz => cuMemFreeAsync_ptsz as *mut c_void,
        b"cuMemFreeAsync" => cuMemFreeAsync as *mut c_void,
        b"cuArrayDestroy" => cuArrayDestroy as *mut c_void,
        b"cuMipmappedArrayDestroy" => cuMipmappedArrayDestroy as *mut c_void,
        b"cuMemGetInfo" => cuMemGetInfo_v2 as *mut c_void,
        b"cuDeviceTotalMem" => cuDeviceTotalMem_v2 as *mut c_void,
        b"cuGetProcAddress" if version >= 12000 => cuGetProcAddress_v2 as *mut c_void,
        b"cuGetProcAddress" => cuGetProcAddress as *mut c_void,
        _ => std::ptr::null_mut(),
    };
    f
}

#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> CuResult {
    if pfn.is_null() {
        return INVALID_VALUE;
    }
    let f = proc_address(symbol, version, flags);
    unsafe { pfn.write(f) };
    if f.is_null() {
        NOT_FOUND
    } else {
        SUCCESS
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CuResult {
    if pfn.is_null() {
        return INVALID_VALUE;
    }
    let f = proc_address(symbol, version, flags);
    unsafe { pfn.write(f) };
    if !status.is_null() {
        // CU_GET_PROC_ADDRESS_SUCCESS = 0, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1
        unsafe { status.write(if f.is_null() { 1 } else { 0 }) };
    }
    if f.is_null() {
        NOT_FOUND
    } else {
        SUCCESS
    }
}
