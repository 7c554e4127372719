//! Finding the real driver: the real `dlsym` (ours is the interposer's), `libcuda.so.1` and
//! `libnvidia-ml.so.1`, and the entry points we forward to, resolved once.

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
        ctx_get_device = "cuCtxGetDevice": fn(*mut c_int);
        mem_alloc = "cuMemAlloc_v2": fn(*mut DevicePtr, usize);
        mem_alloc_pitch = "cuMemAllocPitch_v2": fn(*mut DevicePtr, *mut usize, usize, usize, c_uint);
        mem_alloc_managed = "cuMemAllocManaged": fn(*mut DevicePtr, usize, c_uint);
        mem_alloc_async = "cuMemAllocAsync": fn(*mut DevicePtr, usize, Handle);
        mem_alloc_async_ptsz = "cuMemAllocAsync_ptsz": fn(*mut DevicePtr, usize, Handle);
        mem_alloc_pool = "cuMemAllocFromPoolAsync": fn(*mut DevicePtr, usize, Handle, Handle);
        mem_alloc_pool_ptsz = "cuMemAllocFromPoolAsync_ptsz": fn(*mut DevicePtr, usize, Handle, Handle);
        mem_create = "cuMemCreate": fn(*mut u64, usize, *const c_void, u64);
        mem_release = "cuMemRelease": fn(u64);
        array_create = "cuArrayCreate_v2": fn(*mut Handle, *const c_void);
        array3d_create = "cuArray3DCreate_v2": fn(*mut Handle, *const c_void);
        mipmap_create = "cuMipmappedArrayCreate": fn(*mut Handle, *const c_void, c_uint);
        mem_free = "cuMemFree_v2": fn(DevicePtr);
        mem_free_async = "cuMemFreeAsync": fn(DevicePtr, Handle);
        mem_free_async_ptsz = "cuMemFreeAsync_ptsz": fn(DevicePtr, Handle);
        array_destroy = "cuArrayDestroy": fn(Handle);
        mipmap_destroy = "cuMipmappedArrayDestroy": fn(Handle);
        mem_get_info = "cuMemGetInfo_v2": fn(*mut usize, *mut usize);
        device_total_mem = "cuDeviceTotalMem_v2": fn(*mut usize, c_int);
        get_proc_address = "cuGetProcAddress": fn(*const c_char, *mut Handle, c_int, u64);
        get_proc_address_v2 = "cuGetProcAddress_v2": fn(*const c_char, *mut Handle, c_int, u64, *mut c_int);
    }
}

entry_points! {
    /// NVML's entry points that the hooks forward to or use.
    Nvml {
        device_get_index = "nvmlDeviceGetIndex": fn(Handle, *mut c_uint);
        memory_info = "nvmlDeviceGetMemoryInfo": fn(Handle, *mut c_void);
        memory_info_v2 = "nvmlDeviceGetMemoryInfo_v2": fn(Handle, *mut c_void);
    }
}

/// The loaded CUDA driver.
pub struct RealCuda {
    /// Its entry points.
    pub fns: Cuda,
    /// `(index into exports::cuda_hooks, real address)` of every hooked entry point the
    /// driver has: what `cuGetProcAddress` answers may be swapped for one of these hooks.
    pub swaps: Vec<(usize, usize)>,
}

/// The real CUDA driver, loaded on first use; `None` if `libcuda.so.1` cannot be loaded.
pub fn cuda() -> Option<&'static RealCuda> {
    static CUDA: OnceLock<Option<RealCuda>> = OnceLock::new();
    CUDA.get_or_init(|| {
        let handle = dlopen(c"libcuda.so.1");
        if handle.is_null() {
            return None;
        }
        let swaps = crate::exports::cuda_hooks()
            .iter()
            .enumerate()
            .filter_map(|(index, (name, _))| {
                let real = lookup(handle, name);
                (!real.is_null()).then_some((index, real as usize))
            })
            .collect();
        Some(RealCuda {
            fns: Cuda::resolve(|name| lookup(handle, name)),
            swaps,
        })
    })
    .as_ref()
}

/// The real NVML, loaded on first use; `None` if `libnvidia-ml.so.1` cannot be loaded.
pub fn nvml() -> Option<&'static Nvml> {
    static NVML: OnceLock<Option<Nvml>> = OnceLock::new();
    NVML.get_or_init(|| {
        let handle = dlopen(c"libnvidia-ml.so.1");
        (!handle.is_null()).then(|| Nvml::resolve(|name| lookup(handle, name)))
    })
    .as_ref()
}
