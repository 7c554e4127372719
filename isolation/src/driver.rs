//! Finding the real driver: the real `dlsym` (ours is the interposer's), the CUDA driver and
//! NVML, and the entry points we forward to, resolved once.
//!
//! Which driver: the one the program uses. A program that opens the driver by path
//! (`NUMBA_CUDA_DRIVER`, a compat driver beside the host's) binds the hooks to that object
//! on its first lookup of a hooked name ([`bind_cuda`]); otherwise the driver already loaded
//! as `libcuda.so.1`, or found in the process's global scope, or `libcuda.so.1` loaded now.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

/// `CUresult` / `nvmlReturn_t`.
pub type Status = c_int;
/// A `CUdeviceptr`.
pub type DevicePtr = u64;
/// An opaque driver handle (`CUstream`, `CUcontext`, `CUarray`, `nvmlDevice_t`, ...).
pub type Handle = *mut c_void;

/// `CUDA_ERROR_NOT_INITIALIZED`: what a hook answers when the real driver cannot be loaded.
pub const CUDA_ERROR_NOT_INITIALIZED: Status = 3;
/// `CUDA_ERROR_NOT_READY`: an event's work has not completed yet.
pub const CUDA_ERROR_NOT_READY: Status = 600;
/// `CUDA_ERROR_NOT_FOUND`: the real driver lacks the entry point.
pub const CUDA_ERROR_NOT_FOUND: Status = 500;
/// `CUDA_ERROR_UNKNOWN`: a hook failed inside (a caught panic).
pub const CUDA_ERROR_UNKNOWN: Status = 999;
/// `NVML_ERROR_LIBRARY_NOT_FOUND`.
pub const NVML_ERROR_LIBRARY_NOT_FOUND: Status = 12;
/// `NVML_ERROR_FUNCTION_NOT_FOUND`.
pub const NVML_ERROR_FUNCTION_NOT_FOUND: Status = 13;
/// `NVML_ERROR_UNKNOWN`.
pub const NVML_ERROR_UNKNOWN: Status = 999;

type DlsymFn = unsafe extern "C" fn(Handle, *const c_char) -> Handle;

static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

/// glibc's `dlsym`, found with `dlvsym(RTLD_NEXT, "dlsym", version)` so that it never comes
/// back to ours (dlvsym is not interposed, so there is no recursion).
pub fn real_dlsym() -> Option<DlsymFn> {
    let cached = REAL_DLSYM.load(Ordering::Acquire);
    if cached != 0 {
        // SAFETY: only dlsym's address is ever stored here.
        return Some(unsafe { std::mem::transmute::<usize, DlsymFn>(cached) });
    }
    // x86_64 has GLIBC_2.2.5 (and GLIBC_2.34 since dlsym moved into libc); aarch64 GLIBC_2.17.
    for version in [c"GLIBC_2.2.5", c"GLIBC_2.34", c"GLIBC_2.17"] {
        // SAFETY: NUL-terminated names; RTLD_NEXT searches the objects loaded after us.
        let found = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
        if !found.is_null() {
            REAL_DLSYM.store(found as usize, Ordering::Release);
            // SAFETY: glibc's dlsym has this signature.
            return Some(unsafe { std::mem::transmute::<Handle, DlsymFn>(found) });
        }
    }
    None
}

/// Looks `name` up in `handle` with the real dlsym.
pub fn lookup(handle: Handle, name: &CStr) -> Handle {
    match real_dlsym() {
        // SAFETY: a handle from dlopen (or a pseudo-handle) and a NUL-terminated name.
        Some(dlsym) => unsafe { dlsym(handle, name.as_ptr()) },
        None => std::ptr::null_mut(),
    }
}

fn dlopen(name: &CStr) -> Handle {
    // SAFETY: a NUL-terminated name. The handle is never closed: the driver stays loaded.
    unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) }
}

macro_rules! entry_points {
    ($(#[$doc:meta])* $table:ident { $($field:ident = $sym:literal: fn($($arg:ty),*);)* }) => {
        $(#[$doc])*
        pub struct $table {
            $(
                #[doc = concat!("`", $sym, "`")]
                pub $field: Option<unsafe extern "C" fn($($arg),*) -> Status>,
            )*
        }

        impl $table {
            /// Resolves every entry point with `find` (null: missing).
            pub fn resolve(find: impl Fn(&CStr) -> Handle) -> Self {
                Self {
                    $($field: {
                        // SAFETY: a literal without interior NUL.
                        let name = unsafe { CStr::from_bytes_with_nul_unchecked(concat!($sym, "\0").as_bytes()) };
                        let p = find(name);
                        // SAFETY: the driver's entry point of that name has this signature.
                        (!p.is_null()).then(|| unsafe {
                            std::mem::transmute::<Handle, unsafe extern "C" fn($($arg),*) -> Status>(p)
                        })
                    },)*
                }
            }
        }
    };
}

entry_points! {
    /// The CUDA driver's entry points that the hooks forward to or use.
    Cuda {
        ctx_get_current = "cuCtxGetCurrent": fn(*mut Handle);
        ctx_get_device = "cuCtxGetDevice": fn(*mut c_int);
        device_get_uuid = "cuDeviceGetUuid": fn(*mut [u8; 16], c_int);
        device_get_uuid_v2 = "cuDeviceGetUuid_v2": fn(*mut [u8; 16], c_int);
        device_get_attribute = "cuDeviceGetAttribute": fn(*mut c_int, c_int, c_int);
        ctx_create_v2 = "cuCtxCreate_v2": fn(*mut Handle, c_uint, c_int);
        ctx_create_v3 = "cuCtxCreate_v3": fn(*mut Handle, *mut c_void, c_int, c_uint, c_int);
        ctx_create_v4 = "cuCtxCreate_v4": fn(*mut Handle, *mut c_void, c_uint, c_int);
        ctx_destroy = "cuCtxDestroy_v2": fn(Handle);
        primary_retain = "cuDevicePrimaryCtxRetain": fn(*mut Handle, c_int);
        primary_release = "cuDevicePrimaryCtxRelease": fn(c_int);
        primary_release_v2 = "cuDevicePrimaryCtxRelease_v2": fn(c_int);
        primary_reset = "cuDevicePrimaryCtxReset": fn(c_int);
        primary_reset_v2 = "cuDevicePrimaryCtxReset_v2": fn(c_int);
        ctx_set_limit = "cuCtxSetLimit": fn(c_int, usize);
        ctx_get_limit = "cuCtxGetLimit": fn(*mut usize, c_int);
        ctx_synchronize = "cuCtxSynchronize": fn();
        stream_synchronize = "cuStreamSynchronize": fn(Handle);
        stream_synchronize_ptsz = "cuStreamSynchronize_ptsz": fn(Handle);
        event_synchronize = "cuEventSynchronize": fn(Handle);
        mem_alloc = "cuMemAlloc_v2": fn(*mut DevicePtr, usize);
        mem_alloc_pitch = "cuMemAllocPitch_v2": fn(*mut DevicePtr, *mut usize, usize, usize, c_uint);
        mem_alloc_managed = "cuMemAllocManaged": fn(*mut DevicePtr, usize, c_uint);
        mem_alloc_async = "cuMemAllocAsync": fn(*mut DevicePtr, usize, Handle);
        mem_alloc_async_ptsz = "cuMemAllocAsync_ptsz": fn(*mut DevicePtr, usize, Handle);
        mem_alloc_pool = "cuMemAllocFromPoolAsync": fn(*mut DevicePtr, usize, Handle, Handle);
        mem_alloc_pool_ptsz = "cuMemAllocFromPoolAsync_ptsz": fn(*mut DevicePtr, usize, Handle, Handle);
        device_get_mem_pool = "cuDeviceGetMemPool": fn(*mut Handle, c_int);
        device_get_default_mem_pool = "cuDeviceGetDefaultMemPool": fn(*mut Handle, c_int);
        mem_pool_get_attribute = "cuMemPoolGetAttribute": fn(Handle, c_int, *mut c_void);
        mem_pool_create = "cuMemPoolCreate": fn(*mut Handle, *const c_void);
        mem_pool_destroy = "cuMemPoolDestroy": fn(Handle);
        mem_pool_trim_to = "cuMemPoolTrimTo": fn(Handle, usize);
        mem_create = "cuMemCreate": fn(*mut u64, usize, *const c_void, u64);
        mem_release = "cuMemRelease": fn(u64);
        mem_map = "cuMemMap": fn(DevicePtr, usize, usize, u64, u64);
        mem_unmap = "cuMemUnmap": fn(DevicePtr, usize);
        mem_retain_handle = "cuMemRetainAllocationHandle": fn(*mut u64, *mut c_void);
        array_create = "cuArrayCreate_v2": fn(*mut Handle, *const c_void);
        array3d_create = "cuArray3DCreate_v2": fn(*mut Handle, *const c_void);
        mipmap_create = "cuMipmappedArrayCreate": fn(*mut Handle, *const c_void, c_uint);
        mem_free = "cuMemFree_v2": fn(DevicePtr);
        mem_free_async = "cuMemFreeAsync": fn(DevicePtr, Handle);
        mem_free_async_ptsz = "cuMemFreeAsync_ptsz": fn(DevicePtr, Handle);
        array_destroy = "cuArrayDestroy": fn(Handle);
        mipmap_destroy = "cuMipmappedArrayDestroy": fn(Handle);
        graph_add_mem_alloc_node = "cuGraphAddMemAllocNode": fn(*mut Handle, Handle, *const Handle, usize, *mut c_void);
        graph_launch = "cuGraphLaunch": fn(Handle, Handle);
        graph_launch_ptsz = "cuGraphLaunch_ptsz": fn(Handle, Handle);
        graph_upload = "cuGraphUpload": fn(Handle, Handle);
        graph_upload_ptsz = "cuGraphUpload_ptsz": fn(Handle, Handle);
        device_get_graph_mem_attribute = "cuDeviceGetGraphMemAttribute": fn(c_int, c_int, *mut c_void);
        device_graph_mem_trim = "cuDeviceGraphMemTrim": fn(c_int);
        mem_get_info = "cuMemGetInfo_v2": fn(*mut usize, *mut usize);
        device_total_mem = "cuDeviceTotalMem_v2": fn(*mut usize, c_int);
        v1_mem_alloc = "cuMemAlloc": fn(*mut u32, c_uint);
        v1_mem_alloc_pitch = "cuMemAllocPitch": fn(*mut u32, *mut c_uint, c_uint, c_uint, c_uint);
        v1_mem_free = "cuMemFree": fn(u32);
        v1_mem_get_info = "cuMemGetInfo": fn(*mut c_uint, *mut c_uint);
        v1_device_total_mem = "cuDeviceTotalMem": fn(*mut c_uint, c_int);
        launch_kernel = "cuLaunchKernel": fn(Handle, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, Handle, *mut *mut c_void, *mut *mut c_void);
        launch_kernel_ptsz = "cuLaunchKernel_ptsz": fn(Handle, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, Handle, *mut *mut c_void, *mut *mut c_void);
        launch_kernel_ex = "cuLaunchKernelEx": fn(*const c_void, Handle, *mut *mut c_void, *mut *mut c_void);
        launch_kernel_ex_ptsz = "cuLaunchKernelEx_ptsz": fn(*const c_void, Handle, *mut *mut c_void, *mut *mut c_void);
        launch_cooperative = "cuLaunchCooperativeKernel": fn(Handle, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, Handle, *mut *mut c_void);
        launch_cooperative_ptsz = "cuLaunchCooperativeKernel_ptsz": fn(Handle, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, Handle, *mut *mut c_void);
        event_create = "cuEventCreate": fn(*mut Handle, c_uint);
        event_record = "cuEventRecord": fn(Handle, Handle);
        event_record_ptsz = "cuEventRecord_ptsz": fn(Handle, Handle);
        event_query = "cuEventQuery": fn(Handle);
        event_elapsed = "cuEventElapsedTime": fn(*mut f32, Handle, Handle);
        event_destroy = "cuEventDestroy_v2": fn(Handle);
        stream_is_capturing = "cuStreamIsCapturing": fn(Handle, *mut c_int);
        stream_is_capturing_ptsz = "cuStreamIsCapturing_ptsz": fn(Handle, *mut c_int);
        get_proc_address = "cuGetProcAddress": fn(*const c_char, *mut Handle, c_int, u64);
        get_proc_address_v2 = "cuGetProcAddress_v2": fn(*const c_char, *mut Handle, c_int, u64, *mut c_int);
    }
}

entry_points! {
    /// NVML's entry points that the hooks forward to or use.
    Nvml {
        init = "nvmlInit_v2": fn();
        device_get_index = "nvmlDeviceGetIndex": fn(Handle, *mut c_uint);
        device_get_uuid = "nvmlDeviceGetUUID": fn(Handle, *mut c_char, c_uint);
        device_by_uuid = "nvmlDeviceGetHandleByUUID": fn(*const c_char, *mut Handle);
        memory_info = "nvmlDeviceGetMemoryInfo": fn(Handle, *mut c_void);
        memory_info_v2 = "nvmlDeviceGetMemoryInfo_v2": fn(Handle, *mut c_void);
    }
}

/// A loaded driver library: its handle and where it is mapped (which object answered a
/// lookup is told by its base address).
struct Object {
    handle: Handle,
    base: usize,
}

// SAFETY: a dlopen handle and an address, both valid in every thread.
unsafe impl Send for Object {}
// SAFETY: as above.
unsafe impl Sync for Object {}

/// The loaded CUDA driver.
pub struct RealCuda {
    /// Its entry points.
    pub fns: Cuda,
    /// The loaded object, for lookups of other names (the hooks' own table, which this
    /// module does not know: it only finds the driver).
    pub handle: Handle,
}

// SAFETY: a table of function addresses and a dlopen handle, valid in every thread.
unsafe impl Send for RealCuda {}
// SAFETY: as above.
unsafe impl Sync for RealCuda {}

/// The object that holds `address`: its file name and base address (`dladdr`).
pub fn object_of(address: *const c_void) -> Option<(std::ffi::CString, usize)> {
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    if address.is_null() {
        return None;
    }
    // SAFETY: dladdr only reads the address and fills `info`.
    let found = unsafe { libc::dladdr(address, &mut info) };
    if found == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr's file name is a NUL-terminated string of the loaded object.
    let name = unsafe { CStr::from_ptr(info.dli_fname) }.to_owned();
    Some((name, info.dli_fbase as usize))
}

/// Whether a file name is a library of that family: `libcuda.so*` for the driver.
fn is_named(path: &CStr, prefix: &[u8]) -> bool {
    let bytes = path.to_bytes();
    let base = bytes.rsplit(|b| *b == b'/').next().unwrap_or(bytes);
    base.starts_with(prefix)
}

/// The library that `probe` (a name it exports) is found in: the one already loaded under
/// `soname`, else whichever the process has in its global scope (linked by any path), else
/// `soname` loaded now.
fn find_object(soname: &CStr, probe: &CStr) -> Option<Object> {
    // SAFETY: a NUL-terminated name; RTLD_NOLOAD only finds an object already loaded.
    let loaded = unsafe { libc::dlopen(soname.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    let handle = if !loaded.is_null() {
        loaded
    } else if let Some((path, _)) = object_of(lookup(libc::RTLD_DEFAULT, probe)) {
        // SAFETY: the path of an object already loaded.
        unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) }
    } else {
        dlopen(soname)
    };
    if handle.is_null() {
        return None;
    }
    let base = object_of(lookup(handle, probe)).map_or(0, |(_, base)| base);
    Some(Object { handle, base })
}

static CUDA_OBJECT: OnceLock<Option<Object>> = OnceLock::new();

/// Binds the hooks to the CUDA driver that holds `address` (a lookup of the program's
/// found it there), unless they are bound to one already. Returns whether the hooks now
/// forward to that very object: false for an object that is not a `libcuda.so*` (the
/// program's own stand-in, another library) or another driver than the one bound.
pub fn bind_cuda(address: *const c_void) -> bool {
    let Some((path, base)) = object_of(address) else {
        return false;
    };
    if !is_named(&path, b"libcuda.so") {
        return false;
    }
    let bound = match CUDA_OBJECT.get() {
        Some(bound) => bound,
        None => {
            // SAFETY: the path of an object already loaded (RTLD_NOLOAD loads nothing).
            let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
            let object = (!handle.is_null()).then_some(Object { handle, base });
            CUDA_OBJECT.get_or_init(|| object)
        }
    };
    bound.as_ref().is_some_and(|o| o.base == base)
}

static CUDA: OnceLock<Option<RealCuda>> = OnceLock::new();

/// The real CUDA driver, loaded on first use: the object [`bind_cuda`] bound, else the
/// one [`find_object`] finds; `None` if there is none.
///
/// The library is found and loaded outside the `OnceLock`s' set-up (only the result is
/// stored there): loading runs the driver's constructors, and one that looked up a hooked
/// name would come back here while the set-up was still running.
pub fn cuda() -> Option<&'static RealCuda> {
    if let Some(cuda) = CUDA.get() {
        return cuda.as_ref();
    }
    let object = match CUDA_OBJECT.get() {
        Some(object) => object,
        None => {
            let found = find_object(c"libcuda.so.1", c"cuInit");
            CUDA_OBJECT.get_or_init(|| found)
        }
    }
    .as_ref();
    let real = object.map(|object| RealCuda {
        fns: Cuda::resolve(|name| lookup(object.handle, name)),
        handle: object.handle,
    });
    CUDA.get_or_init(|| real).as_ref()
}

/// The real CUDA driver if a hook has loaded it already; never loads it (for re-reads that
/// only matter once the program uses the driver).
pub fn cuda_if_loaded() -> Option<&'static RealCuda> {
    CUDA.get().and_then(Option::as_ref)
}

/// The real NVML, loaded on first use (as [`cuda`], for `libnvidia-ml.so.1`); `None` if it
/// cannot be found.
pub fn nvml() -> Option<&'static Nvml> {
    static NVML: OnceLock<Option<Nvml>> = OnceLock::new();
    if let Some(nvml) = NVML.get() {
        return nvml.as_ref();
    }
    let found = find_object(c"libnvidia-ml.so.1", c"nvmlInit_v2")
        .map(|object| Nvml::resolve(|name| lookup(object.handle, name)));
    NVML.get_or_init(|| found).as_ref()
}
