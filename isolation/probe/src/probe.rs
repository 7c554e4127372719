//! The probe's steps, shared by `gpushare-isolation-probe` (which links the driver by name)
//! and `gpushare-isolation-probe-dl` (which never does). The CLI is documented in `main.rs`.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::io::Write;
use std::ptr::{null, null_mut};

/// Declares `$api`, entry points the probe uses however they were found, and `$link!()`,
/// which declares them linked by name from `lib$lib.so` and adds `$api::linked` (only the
/// linked probe expands it: the other never needs the driver to start).
macro_rules! api {
    ($api:ident, $link:ident, $lib:literal, $missing:literal;
     $($field:ident: $sym:ident = $base:literal, $flags:expr => fn($($arg:ty),*);)*) => {
        #[allow(unused_macros)]
        macro_rules! $link {
            () => {
                #[link(name = $lib)]
                unsafe extern "C" {
                    $(fn $sym($(_: $arg),*) -> c_int;)*
                }

                impl crate::probe::$api {
                    pub fn linked() -> Self {
                        Self { $($field: $sym,)* }
                    }
                }
            };
        }

        pub struct $api {
            $(pub $field: unsafe extern "C" fn($($arg),*) -> c_int,)*
        }

        impl $api {
            /// `lookup(symbol, base name, cuGetProcAddress flags)`, NULL when not found.
            fn lookup(lookup: impl Fn(&CStr, &CStr, u64) -> Ptr) -> Result<Self, String> {
                Ok(Self {
                    $($field: {
                        // SAFETY: literals with one NUL, at their end.
                        let (sym, base) = unsafe { (
                            CStr::from_bytes_with_nul_unchecked(concat!(stringify!($sym), "\0").as_bytes()),
                            CStr::from_bytes_with_nul_unchecked(concat!($base, "\0").as_bytes()),
                        ) };
                        let p = lookup(sym, base, $flags);
                        if p.is_null() {
                            return Err(format!($missing, stringify!($sym)));
                        }
                        // SAFETY: the entry point of that name, with this signature.
                        unsafe { std::mem::transmute::<Ptr, unsafe extern "C" fn($($arg),*) -> c_int>(p) }
                    },)*
                })
            }
        }
    };
}

pub type Ptr = *mut c_void;

include!("../fake/abi.rs");
const PTSZ: u64 = 2;
/// Not a driver flag: marks the 32-bit v1 entry points, which `--via getproc` asks for with
/// cudaVersion 3000 (and without this bit).
const V1: u64 = 1 << 63;

api! { Cuda, link_cuda, "cuda", "{} not found";
    init: cuInit = "cuInit", 0 => fn(c_uint);
    device_get: cuDeviceGet = "cuDeviceGet", 0 => fn(*mut c_int, c_int);
    primary_ctx_retain: cuDevicePrimaryCtxRetain = "cuDevicePrimaryCtxRetain", 0 => fn(*mut Ptr, c_int);
    ctx_set_current: cuCtxSetCurrent = "cuCtxSetCurrent", 0 => fn(Ptr);
    ctx_get_device: cuCtxGetDevice = "cuCtxGetDevice", 0 => fn(*mut c_int);
    default_mem_pool: cuDeviceGetDefaultMemPool = "cuDeviceGetDefaultMemPool", 0 => fn(*mut Ptr, c_int);
    mem_alloc: cuMemAlloc_v2 = "cuMemAlloc", 0 => fn(*mut u64, usize);
    mem_alloc_pitch: cuMemAllocPitch_v2 = "cuMemAllocPitch", 0 => fn(*mut u64, *mut usize, usize, usize, c_uint);
    mem_alloc_managed: cuMemAllocManaged = "cuMemAllocManaged", 0 => fn(*mut u64, usize, c_uint);
    mem_alloc_async: cuMemAllocAsync = "cuMemAllocAsync", 0 => fn(*mut u64, usize, Ptr);
    mem_alloc_async_ptsz: cuMemAllocAsync_ptsz = "cuMemAllocAsync", PTSZ => fn(*mut u64, usize, Ptr);
    mem_alloc_pool: cuMemAllocFromPoolAsync = "cuMemAllocFromPoolAsync", 0 => fn(*mut u64, usize, Ptr, Ptr);
    mem_alloc_pool_ptsz: cuMemAllocFromPoolAsync_ptsz = "cuMemAllocFromPoolAsync", PTSZ => fn(*mut u64, usize, Ptr, Ptr);
    mem_create: cuMemCreate = "cuMemCreate", 0 => fn(*mut u64, usize, *const AllocationProp, u64);
    mem_release: cuMemRelease = "cuMemRelease", 0 => fn(u64);
    array_create: cuArrayCreate_v2 = "cuArrayCreate", 0 => fn(*mut Ptr, *const ArrayDescriptor);
    array3d_create: cuArray3DCreate_v2 = "cuArray3DCreate", 0 => fn(*mut Ptr, *const Array3dDescriptor);
    mipmap_create: cuMipmappedArrayCreate = "cuMipmappedArrayCreate", 0 => fn(*mut Ptr, *const Array3dDescriptor, c_uint);
    mem_free: cuMemFree_v2 = "cuMemFree", 0 => fn(u64);
    mem_free_async: cuMemFreeAsync = "cuMemFreeAsync", 0 => fn(u64, Ptr);
    mem_free_async_ptsz: cuMemFreeAsync_ptsz = "cuMemFreeAsync", PTSZ => fn(u64, Ptr);
    array_destroy: cuArrayDestroy = "cuArrayDestroy", 0 => fn(Ptr);
    mipmap_destroy: cuMipmappedArrayDestroy = "cuMipmappedArrayDestroy", 0 => fn(Ptr);
    mem_get_info: cuMemGetInfo_v2 = "cuMemGetInfo", 0 => fn(*mut usize, *mut usize);
    device_total_mem: cuDeviceTotalMem_v2 = "cuDeviceTotalMem", 0 => fn(*mut usize, c_int);
    device_get_uuid: cuDeviceGetUuid_v2 = "cuDeviceGetUuid", 0 => fn(*mut [u8; 16], c_int);
    ctx_create: cuCtxCreate_v2 = "cuCtxCreate", 0 => fn(*mut Ptr, c_uint, c_int);
    ctx_destroy: cuCtxDestroy_v2 = "cuCtxDestroy", 0 => fn(Ptr);
    ctx_get_current: cuCtxGetCurrent = "cuCtxGetCurrent", 0 => fn(*mut Ptr);
    ctx_synchronize: cuCtxSynchronize = "cuCtxSynchronize", 0 => fn();
    ctx_set_limit: cuCtxSetLimit = "cuCtxSetLimit", 0 => fn(c_int, usize);
    primary_ctx_reset: cuDevicePrimaryCtxReset_v2 = "cuDevicePrimaryCtxReset", 0 => fn(c_int);
    device_get_mem_pool: cuDeviceGetMemPool = "cuDeviceGetMemPool", 0 => fn(*mut Ptr, c_int);
    pool_create: cuMemPoolCreate = "cuMemPoolCreate", 0 => fn(*mut Ptr, *const PoolProps);
    pool_set_attribute: cuMemPoolSetAttribute = "cuMemPoolSetAttribute", 0 => fn(Ptr, c_int, *mut c_void);
    pool_trim_to: cuMemPoolTrimTo = "cuMemPoolTrimTo", 0 => fn(Ptr, usize);
    stream_create: cuStreamCreate = "cuStreamCreate", 0 => fn(*mut Ptr, c_uint);
    stream_destroy: cuStreamDestroy_v2 = "cuStreamDestroy", 0 => fn(Ptr);
    stream_begin_capture: cuStreamBeginCapture_v2 = "cuStreamBeginCapture", 0 => fn(Ptr, c_int);
    stream_end_capture: cuStreamEndCapture = "cuStreamEndCapture", 0 => fn(Ptr, *mut Ptr);
    address_reserve: cuMemAddressReserve = "cuMemAddressReserve", 0 => fn(*mut u64, usize, usize, u64, u64);
    address_free: cuMemAddressFree = "cuMemAddressFree", 0 => fn(u64, usize);
    mem_map: cuMemMap = "cuMemMap", 0 => fn(u64, usize, usize, u64, u64);
    mem_unmap: cuMemUnmap = "cuMemUnmap", 0 => fn(u64, usize);
    mem_set_access: cuMemSetAccess = "cuMemSetAccess", 0 => fn(u64, usize, *const AccessDesc, usize);
    graph_create: cuGraphCreate = "cuGraphCreate", 0 => fn(*mut Ptr, c_uint);
    graph_destroy: cuGraphDestroy = "cuGraphDestroy", 0 => fn(Ptr);
    graph_add_alloc: cuGraphAddMemAllocNode = "cuGraphAddMemAllocNode", 0 => fn(*mut Ptr, Ptr, *const Ptr, usize, *mut MemAllocNodeParams);
    graph_add_free: cuGraphAddMemFreeNode = "cuGraphAddMemFreeNode", 0 => fn(*mut Ptr, Ptr, *const Ptr, usize, u64);
    graph_instantiate: cuGraphInstantiateWithFlags = "cuGraphInstantiateWithFlags", 0 => fn(*mut Ptr, Ptr, u64);
    graph_launch: cuGraphLaunch = "cuGraphLaunch", 0 => fn(Ptr, Ptr);
    graph_exec_destroy: cuGraphExecDestroy = "cuGraphExecDestroy", 0 => fn(Ptr);
    graph_mem_trim: cuDeviceGraphMemTrim = "cuDeviceGraphMemTrim", 0 => fn(c_int);
    launch_kernel: cuLaunchKernel = "cuLaunchKernel", 0 => fn(Ptr, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, Ptr, *mut Ptr, *mut Ptr);
    launch_kernel_ptsz: cuLaunchKernel_ptsz = "cuLaunchKernel", PTSZ => fn(Ptr, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, Ptr, *mut Ptr, *mut Ptr);
    launch_kernel_ex: cuLaunchKernelEx = "cuLaunchKernelEx", 0 => fn(*const LaunchConfig, Ptr, *mut Ptr, *mut Ptr);
    launch_cooperative: cuLaunchCooperativeKernel = "cuLaunchCooperativeKernel", 0 => fn(Ptr, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, Ptr, *mut Ptr);
    graph_launch_ptsz: cuGraphLaunch_ptsz = "cuGraphLaunch", PTSZ => fn(Ptr, Ptr);
    stream_synchronize: cuStreamSynchronize = "cuStreamSynchronize", 0 => fn(Ptr);
    v1_alloc: cuMemAlloc = "cuMemAlloc", V1 => fn(*mut u32, c_uint);
    v1_free: cuMemFree = "cuMemFree", V1 => fn(c_uint);
    v1_get_info: cuMemGetInfo = "cuMemGetInfo", V1 => fn(*mut u32, *mut u32);
    v1_total_mem: cuDeviceTotalMem = "cuDeviceTotalMem", V1 => fn(*mut u32, c_int);
}

api! { Nvml, link_nvml, "nvidia-ml", "\"{}\" not found";
    init: nvmlInit_v2 = "nvmlInit_v2", 0 => fn();
    utilization: nvmlDeviceGetUtilizationRates = "nvmlDeviceGetUtilizationRates", 0 => fn(Ptr, *mut NvmlUtilization);
    handle_by_index: nvmlDeviceGetHandleByIndex_v2 = "nvmlDeviceGetHandleByIndex_v2", 0 => fn(c_uint, *mut Ptr);
    memory_info: nvmlDeviceGetMemoryInfo = "nvmlDeviceGetMemoryInfo", 0 => fn(Ptr, *mut NvmlMemory);
    memory_info_v2: nvmlDeviceGetMemoryInfo_v2 = "nvmlDeviceGetMemoryInfo_v2", 0 => fn(Ptr, *mut NvmlMemoryV2);
}

/// `nvmlMemory_v2`: sizeof(nvmlMemory_v2_t) | 2 << 24.
const NVML_MEMORY_V2: c_uint = std::mem::size_of::<NvmlMemoryV2>() as c_uint | 2 << 24;

impl<const PAD: usize> DeviceProps<PAD> {
    /// Pinned device memory on CUDA device `dev`.
    fn device(dev: c_int) -> Self {
        Self {
            kind: 1,          // CU_MEM_ALLOCATION_TYPE_PINNED
            handle_types: 0,  // none
            location_type: 1, // CU_MEM_LOCATION_TYPE_DEVICE
            location_id: dev,
            win32: null_mut(),
            zeros: [0; PAD],
        }
    }
}

const FORMAT_U8: c_uint = 0x01;

#[derive(Debug, Clone, Copy)]
enum Kept {
    Mem(u64),
    Async(u64),
    AsyncPtsz(u64),
    Vmm(u64),
    Array(Ptr),
    Mipmap(Ptr),
    V1(u32),
}

/// The first failure of calls made in turn (0: none); every call is made.
fn first_error(results: impl IntoIterator<Item = c_int>) -> c_int {
    results.into_iter().fold(0, |first, r| then(first, || r))
}

/// `next()` when `r` is success, else `r`.
fn then(r: c_int, next: impl FnOnce() -> c_int) -> c_int {
    if r != 0 { r } else { next() }
}

/// `next()` when `r` is success, else -1 (not reached).
fn reached(r: c_int, next: impl FnOnce() -> c_int) -> c_int {
    if r != 0 { -1 } else { next() }
}

fn real_dlsym(handle: Ptr, name: &CStr) -> Ptr {
    // SAFETY: dlsym with a handle from dlopen and a NUL-terminated name.
    unsafe { libc::dlsym(handle, name.as_ptr()) }
}

fn dlopen(name: &CStr, flags: c_int) -> Result<Ptr, String> {
    // SAFETY: dlopen with a NUL-terminated name.
    let handle = unsafe { libc::dlopen(name.as_ptr(), flags) };
    if handle.is_null() {
        Err(format!("dlopen {name:?} failed"))
    } else {
        Ok(handle)
    }
}

fn nvml_by_dlsym() -> Result<Nvml, String> {
    let handle = dlopen(c"libnvidia-ml.so.1", libc::RTLD_NOW | libc::RTLD_GLOBAL)?;
    Nvml::lookup(|name, _, _| real_dlsym(handle, name))
}

/// CUDA's entry points by dlsym from `handle`, NVML's by dlsym.
fn by_dlsym(handle: Ptr) -> Result<(Cuda, Nvml, Ptr), String> {
    let cuda = Cuda::lookup(|name, _, _| real_dlsym(handle, name))?;
    Ok((cuda, nvml_by_dlsym()?, handle))
}

type GetProcV1 = unsafe extern "C" fn(*const c_char, *mut Ptr, c_int, u64) -> c_int;
type GetProcV2 = unsafe extern "C" fn(*const c_char, *mut Ptr, c_int, u64, *mut c_int) -> c_int;

/// The driver linked by name, when this probe links it.
pub type Linked = fn() -> (Cuda, Nvml);

/// The driver's entry points, NVML's, and the handle the driver was looked up in
/// (`RTLD_DEFAULT` when linked).
fn connect(via: &str, linked: Option<Linked>) -> Result<(Cuda, Nvml, Ptr), String> {
    if let Some(path) = via.strip_prefix("path:") {
        let path = std::ffi::CString::new(path).map_err(|_| "a NUL in the path")?;
        return by_dlsym(dlopen(&path, libc::RTLD_NOW | libc::RTLD_LOCAL)?);
    }
    let libcuda = || dlopen(c"libcuda.so.1", libc::RTLD_NOW | libc::RTLD_GLOBAL);
    match via {
        "link" => {
            let no = "this probe does not link the driver: --via dlsym, getproc or path:FILE";
            let (cuda, nvml) = linked.ok_or(no)?();
            Ok((cuda, nvml, libc::RTLD_DEFAULT))
        }
        "dlsym" => by_dlsym(libcuda()?),
        "getproc" => {
            let handle = libcuda()?;
            let v1 = real_dlsym(handle, c"cuGetProcAddress");
            if v1.is_null() {
                return Err("cuGetProcAddress not found".into());
            }
            // SAFETY: cuGetProcAddress has the v1 signature.
            let v1 = unsafe { std::mem::transmute::<Ptr, GetProcV1>(v1) };
            let mut v2: Ptr = null_mut();
            // SAFETY: a NUL-terminated name and a place for the pointer.
            let r = unsafe { v1(c"cuGetProcAddress".as_ptr(), &mut v2, 12000, 0) };
            if r != 0 || v2.is_null() {
                return Err(format!(
                    "cuGetProcAddress(\"cuGetProcAddress\", 12000) returned {r}"
                ));
            }
            // SAFETY: for cudaVersion 12000 the driver answers cuGetProcAddress_v2.
            let v2 = unsafe { std::mem::transmute::<Ptr, GetProcV2>(v2) };
            let cuda = Cuda::lookup(|_, base, flags| {
                let mut p: Ptr = null_mut();
                let mut status: c_int = 0;
                let version = if flags & V1 != 0 { 3000 } else { 12000 };
                // SAFETY: a NUL-terminated name and places for the answers.
                let r = unsafe { v2(base.as_ptr(), &mut p, version, flags & !V1, &mut status) };
                if r == 0 { p } else { null_mut() }
            })?;
            Ok((cuda, nvml_by_dlsym()?, handle))
        }
        other => Err(format!(
            "unknown --via {other}: link, dlsym, getproc or path:FILE"
        )),
    }
}

struct Probe {
    cuda: Cuda,
    /// The handle the driver was looked up in.
    driver: Ptr,
    nvml: Nvml,
    nvml_ready: bool,
    kept: Vec<Kept>,
    /// Pointers from `pool-alloc` and `pool-alloc-from`.
    pool_kept: Vec<u64>,
    /// (context, the one current before it) of each `ctx-create`.
    created: Vec<(Ptr, Ptr)>,
    /// The last `pool-create`'s pool.
    pool: Ptr,
    /// (address, size) of each `vmm-map`.
    mapped: Vec<(u64, usize)>,
}

impl Probe {
    fn current_device(&self) -> c_int {
        let mut dev = -1;
        // SAFETY: a place for the answer.
        unsafe { (self.cuda.ctx_get_device)(&mut dev) };
        dev
    }

    /// NVML's handle of its device `index` (NVML initialized first): (result, handle).
    fn nvml_handle(&mut self, index: c_uint) -> (c_int, Ptr) {
        if !self.nvml_ready {
            // SAFETY: no arguments.
            self.nvml_ready = unsafe { (self.nvml.init)() } == 0;
        }
        let mut handle = null_mut();
        // SAFETY: a place for the handle.
        let r = unsafe { (self.nvml.handle_by_index)(index, &mut handle) };
        (r, handle)
    }

    fn device(&mut self, dev: c_int) -> String {
        let c = &self.cuda;
        let (mut ctx, mut device) = (null_mut(), 0);
        // SAFETY: places for the answers; the context from the driver.
        let r = unsafe {
            let r = (c.device_get)(&mut device, dev);
            let r = then(r, || (c.primary_ctx_retain)(&mut ctx, device));
            then(r, || (c.ctx_set_current)(ctx))
        };
        format!("device dev={dev} result={r}")
    }

    fn info(&mut self) -> Vec<String> {
        let dev = self.current_device();
        let (mut free, mut total, mut dtotal) = (0usize, 0usize, 0usize);
        // SAFETY: places for the answers.
        let r = unsafe { (self.cuda.mem_get_info)(&mut free, &mut total) };
        // SAFETY: as above.
        let rt = unsafe { (self.cuda.device_total_mem)(&mut dtotal, dev) };
        let (rh, handle) = self.nvml_handle(dev.max(0) as c_uint);
        let mut m = NvmlMemory::default();
        let mut m2 = NvmlMemoryV2 {
            version: NVML_MEMORY_V2,
            ..Default::default()
        };
        // SAFETY: a handle from NVML and places for the answers.
        let r1 = then(rh, || unsafe { (self.nvml.memory_info)(handle, &mut m) });
        // SAFETY: as above.
        let r2 = then(rh, || unsafe {
            (self.nvml.memory_info_v2)(handle, &mut m2)
        });
        let nvml = |word: &str, (t, f, u): (u64, u64, u64), r: c_int| {
            format!("{word} dev={dev} total={t} free={f} used={u} result={r}")
        };
        vec![
            format!("cuda dev={dev} total={total} free={free} result={r}"),
            format!("cuda-total dev={dev} total={dtotal} result={rt}"),
            nvml("nvml", (m.total, m.free, m.used), r1),
            nvml("nvml2", (m2.total, m2.free, m2.used), r2),
        ]
    }

    fn alloc(&mut self, path: &str, mib: usize, vmm_dev: Option<c_int>) -> Result<String, String> {
        let bytes = mib << 20;
        let c = &self.cuda;
        let (mut ptr, mut handle, stream) = (0u64, null_mut(), null_mut());
        let array = ArrayDescriptor {
            width: 1 << 16,
            height: bytes >> 16,
            format: FORMAT_U8,
            channels: 1,
        };
        let cube = Array3dDescriptor {
            width: 1 << 10,
            height: 1 << 10,
            depth: mib,
            format: FORMAT_U8,
            channels: 1,
            flags: 0,
        };
        // SAFETY (the whole block): driver calls with places for their answers and descriptors
        // that live across the call.
        let r = unsafe {
            match path {
                "mem" => (c.mem_alloc)(&mut ptr, bytes),
                "pitch" => (c.mem_alloc_pitch)(&mut ptr, &mut 0usize, 1 << 16, bytes >> 16, 4),
                "managed" => (c.mem_alloc_managed)(&mut ptr, bytes, 1),
                "async" => (c.mem_alloc_async)(&mut ptr, bytes, stream),
                "async-ptsz" => (c.mem_alloc_async_ptsz)(&mut ptr, bytes, stream),
                "pool" | "pool-ptsz" => {
                    let mut pool = null_mut();
                    let r = (c.default_mem_pool)(&mut pool, self.current_device());
                    let from = if path == "pool" {
                        c.mem_alloc_pool
                    } else {
                        c.mem_alloc_pool_ptsz
                    };
                    then(r, || from(&mut ptr, bytes, pool, stream))
                }
                "vmm" => {
                    let dev = vmm_dev.unwrap_or_else(|| self.current_device());
                    (c.mem_create)(&mut ptr, bytes, &AllocationProp::device(dev), 0)
                }
                "array" => (c.array_create)(&mut handle, &array),
                "array3d" => (c.array3d_create)(&mut handle, &cube),
                "mipmap" => (c.mipmap_create)(&mut handle, &cube, 1),
                other => return Err(format!("unknown allocation path {other}")),
            }
        };
        if r == 0 {
            self.kept.push(match path {
                "async" | "pool" => Kept::Async(ptr),
                "async-ptsz" | "pool-ptsz" => Kept::AsyncPtsz(ptr),
                "vmm" => Kept::Vmm(ptr),
                "array" | "array3d" => Kept::Array(handle),
                "mipmap" => Kept::Mipmap(handle),
                _ => Kept::Mem(ptr),
            });
        }
        Ok(format!("alloc path={path} mib={mib} result={r}"))
    }

    fn current_pool(&self) -> (c_int, Ptr) {
        let mut pool = null_mut();
        // SAFETY: a place for the answer.
        let r = unsafe { (self.cuda.device_get_mem_pool)(&mut pool, self.current_device()) };
        (r, pool)
    }

    fn ctx_create(&mut self) -> String {
        let c = &self.cuda;
        let (mut prev, mut ctx) = (null_mut(), null_mut());
        // SAFETY: places for the answers.
        let r = unsafe {
            (c.ctx_get_current)(&mut prev);
            (c.ctx_create)(&mut ctx, 0, self.current_device())
        };
        if r == 0 {
            self.created.push((ctx, prev));
        }
        format!("ctx-create result={r}")
    }

    fn ctx_destroy(&mut self) -> String {
        let Some((ctx, prev)) = self.created.pop() else {
            return "ctx-destroy result=-1".into();
        };
        // SAFETY: a context this probe created, then the one current before it.
        let r = unsafe {
            let r = (self.cuda.ctx_destroy)(ctx);
            (self.cuda.ctx_set_current)(prev);
            r
        };
        format!("ctx-destroy result={r}")
    }

    fn reset(&mut self) -> String {
        let dev = self.current_device();
        // SAFETY: a device ordinal.
        let r = unsafe { (self.cuda.primary_ctx_reset)(dev) };
        // What the reset freed is gone from the probe's books too.
        self.kept.clear();
        self.pool_kept.clear();
        let again = self.device(dev);
        format!("reset dev={dev} result={r} {}", again.replace(' ', "-"))
    }

    /// `pool-alloc` or `pool-alloc-from` (`path`).
    fn pool_alloc(&mut self, path: &str, mib: usize) -> String {
        let (mut ptr, from_created) = (0u64, path == "pool-alloc-from");
        // SAFETY: a place for the pointer; a pool from the driver; the legacy stream.
        let r = unsafe {
            if from_created {
                (self.cuda.mem_alloc_pool)(&mut ptr, mib << 20, self.pool, null_mut())
            } else {
                (self.cuda.mem_alloc_async)(&mut ptr, mib << 20, null_mut())
            }
        };
        if r == 0 {
            self.pool_kept.push(ptr);
        }
        format!("alloc path={path} mib={mib} result={r}")
    }

    fn pool_free(&mut self) -> String {
        let (count, c) = (self.pool_kept.len(), &self.cuda);
        // SAFETY: pool pointers, each freed once.
        let frees = self
            .pool_kept
            .drain(..)
            .map(|p| unsafe { (c.mem_free_async)(p, null_mut()) });
        format!("pool-free count={count} result={}", first_error(frees))
    }

    fn pool_threshold(&mut self, mib: usize) -> String {
        let (r, pool) = self.current_pool();
        let mut value = (mib as u64) << 20;
        // SAFETY: CU_MEMPOOL_ATTR_RELEASE_THRESHOLD takes a cuuint64_t.
        let set =
            || unsafe { (self.cuda.pool_set_attribute)(pool, 4, (&mut value as *mut u64).cast()) };
        format!("pool-threshold mib={mib} result={}", then(r, set))
    }

    fn trim(&mut self, mib: usize) -> String {
        let (r, pool) = self.current_pool();
        // SAFETY: a pool from the driver.
        let r = then(r, || unsafe { (self.cuda.pool_trim_to)(pool, mib << 20) });
        format!("trim mib={mib} result={r}")
    }

    fn pool_create(&mut self, dev: c_int) -> String {
        let props = PoolProps::device(dev);
        // SAFETY: a place for the pool and properties that live across the call.
        let r = unsafe { (self.cuda.pool_create)(&mut self.pool, &props) };
        format!("pool-create dev={dev} result={r}")
    }

    /// cuMemCreate, cuMemAddressReserve, cuMemMap, cuMemSetAccess, then cuMemRelease of the
    /// handle while it stays mapped, as NVIDIA's vectorAddMMAP sample does.
    fn vmm_map(&mut self, mib: usize, dev: Option<c_int>) -> String {
        let dev = dev.unwrap_or_else(|| self.current_device());
        let bytes = mib << 20;
        let c = &self.cuda;
        let prop = AllocationProp::device(dev);
        let access = AccessDesc {
            location_type: 1,
            location_id: dev,
            flags: 3, // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        };
        let (mut handle, mut va) = (0u64, 0u64);
        // SAFETY: driver calls with places for their answers and descriptors that live
        // across them.
        let (create, reserve, map, access, release) = unsafe {
            let create = (c.mem_create)(&mut handle, bytes, &prop, 0);
            if create != 0 {
                (create, -1, -1, -1, -1)
            } else {
                let reserve = (c.address_reserve)(&mut va, bytes, 0, 0, 0);
                let map = reached(reserve, || (c.mem_map)(va, bytes, 0, handle, 0));
                let set = reached(map, || (c.mem_set_access)(va, bytes, &access, 1));
                let release = (c.mem_release)(handle);
                if map != 0 && reserve == 0 {
                    (c.address_free)(va, bytes);
                }
                (create, reserve, map, set, release)
            }
        };
        let result = first_error([create, reserve, map, access, release]);
        if map == 0 {
            self.mapped.push((va, bytes));
        }
        format!(
            "alloc path=vmm-map mib={mib} result={result} create={create} reserve={reserve} map={map} access={access} release={release}"
        )
    }

    fn vmm_unmap(&mut self) -> String {
        let (count, c) = (self.mapped.len(), &self.cuda);
        // SAFETY: ranges this probe mapped, each unmapped and freed once.
        let unmaps = self.mapped.drain(..).map(|(va, bytes)| unsafe {
            let r = (c.mem_unmap)(va, bytes);
            let f = (c.address_free)(va, bytes);
            if r != 0 { r } else { f }
        });
        format!("vmm-unmap count={count} result={}", first_error(unmaps))
    }

    /// A graph with one allocation node of `mib` MiB on the current device and the node
    /// freeing it, instantiated and launched.
    fn graph_alloc(&mut self, mib: usize) -> String {
        let c = &self.cuda;
        let mut params = MemAllocNodeParams {
            pool_props: PoolProps::device(self.current_device()),
            access_descs: null(),
            access_desc_count: 0,
            bytesize: mib << 20,
            dptr: 0,
        };
        let [mut graph, mut node, mut free_node, mut exec]: [Ptr; 4] = [null_mut(); 4];
        // SAFETY: driver calls with places for their answers; parameters that live across
        // them; handles from the driver.
        let steps = unsafe {
            let create = (c.graph_create)(&mut graph, 0);
            let add = (c.graph_add_alloc)(&mut node, graph, null(), 0, &mut params);
            let free = (c.graph_add_free)(&mut free_node, graph, &node, 1, params.dptr);
            let instantiate = (c.graph_instantiate)(&mut exec, graph, 0);
            let launch = (c.graph_launch)(exec, null_mut());
            (c.graph_exec_destroy)(exec);
            (c.graph_destroy)(graph);
            [create, add, free, instantiate, launch]
        };
        let result = first_error(steps);
        let [create, add, free, instantiate, launch] = steps;
        format!(
            "graph-alloc mib={mib} result={result} create={create} node={add} free-node={free} instantiate={instantiate} launch={launch}"
        )
    }

    /// Captures a cuMemAllocAsync of `mib` MiB and its cuMemFreeAsync on a new stream, then
    /// instantiates and launches the graph.
    fn graph_capture(&mut self, mib: usize) -> String {
        let c = &self.cuda;
        let [mut stream, mut graph, mut exec]: [Ptr; 3] = [null_mut(); 3];
        let mut ptr = 0u64;
        // SAFETY: as in graph_alloc.
        let steps = unsafe {
            let create = (c.stream_create)(&mut stream, 0);
            let begin = (c.stream_begin_capture)(stream, 0);
            let alloc = (c.mem_alloc_async)(&mut ptr, mib << 20, stream);
            let free = (c.mem_free_async)(ptr, stream);
            let end = (c.stream_end_capture)(stream, &mut graph);
            let instantiate = (c.graph_instantiate)(&mut exec, graph, 0);
            let launch = (c.graph_launch)(exec, stream);
            (c.graph_exec_destroy)(exec);
            (c.graph_destroy)(graph);
            (c.stream_destroy)(stream);
            [create, begin, alloc, free, end, instantiate, launch]
        };
        let result = first_error(steps);
        let [create, begin, alloc, free, end, instantiate, launch] = steps;
        format!(
            "graph-capture mib={mib} result={result} stream={create} begin={begin} alloc={alloc} free={free} end={end} instantiate={instantiate} launch={launch}"
        )
    }

    /// Back-to-back kernels of `us` µs each (the fake runs a kernel for as many µs as its
    /// grid has blocks) through `path`, each waited for, for `ms` milliseconds.
    fn kernels(&mut self, path: &str, ms: u64, us: c_uint) -> Result<String, String> {
        let c = &self.cuda;
        // Any non-null function: the fake does not look at it.
        let f = 0x1 as Ptr;
        let mut params: [Ptr; 1] = [null_mut()];
        let p = params.as_mut_ptr();
        let [mut stream, mut graph, mut exec]: [Ptr; 3] = [null_mut(); 3];
        if path.starts_with("graph") {
            // SAFETY: places for the answers; a kernel captured on the new stream.
            let setup = unsafe {
                [
                    (c.stream_create)(&mut stream, 0),
                    (c.stream_begin_capture)(stream, 0),
                    (c.launch_kernel)(f, us, 1, 1, 32, 1, 1, 0, stream, p, null_mut()),
                    (c.stream_end_capture)(stream, &mut graph),
                    (c.graph_instantiate)(&mut exec, graph, 0),
                ]
            };
            let r = first_error(setup);
            if r != 0 {
                return Ok(format!("kernels path={path} us={us} count=0 result={r}"));
            }
        }
        let config = LaunchConfig {
            grid: [us, 1, 1],
            block: [32, 1, 1],
            shared_mem_bytes: 0,
            stream: null_mut(),
            attrs: null_mut(),
            num_attrs: 0,
        };
        let started = std::time::Instant::now();
        let (mut count, mut result) = (0u64, 0);
        let (null, none) = (null_mut(), null_mut());
        while started.elapsed() < std::time::Duration::from_millis(ms) {
            // SAFETY: the fake's launches with a grid, a stream (the default one) and
            // parameters that live across the call; then the default stream.
            let r = unsafe {
                let r = match path {
                    "launch" => (c.launch_kernel)(f, us, 1, 1, 32, 1, 1, 0, null, p, none),
                    "launch-ptsz" => {
                        (c.launch_kernel_ptsz)(f, us, 1, 1, 32, 1, 1, 0, null, p, none)
                    }
                    "ex" => (c.launch_kernel_ex)(&config, f, p, none),
                    "coop" => (c.launch_cooperative)(f, us, 1, 1, 32, 1, 1, 0, null, p),
                    "graph" => (c.graph_launch)(exec, null),
                    "graph-ptsz" => (c.graph_launch_ptsz)(exec, null),
                    other => {
                        return Err(format!(
                            "unknown kernels path {other}: launch launch-ptsz ex coop graph"
                        ));
                    }
                };
                then(r, || (c.stream_synchronize)(null))
            };
            if r != 0 {
                result = r;
                break;
            }
            count += 1;
        }
        if !exec.is_null() {
            // SAFETY: handles made above, destroyed once.
            unsafe {
                (c.graph_exec_destroy)(exec);
                (c.graph_destroy)(graph);
                (c.stream_destroy)(stream);
            }
        }
        Ok(format!(
            "kernels path={path} us={us} count={count} result={result}"
        ))
    }

    /// NVML's utilization of the current device (`nvmlDeviceGetUtilizationRates`).
    fn gpu_util(&mut self) -> String {
        let dev = self.current_device();
        let (r, handle) = self.nvml_handle(dev.max(0) as c_uint);
        let mut u = NvmlUtilization::default();
        // SAFETY: the handle from NVML and a place for the answer.
        let r = then(r, || unsafe { (self.nvml.utilization)(handle, &mut u) });
        format!("gpu-util dev={dev} gpu={} result={r}", u.gpu)
    }

    fn graph_trim(&mut self) -> String {
        // SAFETY: a device ordinal.
        let r = unsafe { (self.cuda.graph_mem_trim)(self.current_device()) };
        format!("graph-trim result={r}")
    }

    fn limit(&mut self, name: &str, amount: usize) -> Result<String, String> {
        let (limit, value) = match name {
            "stack" => (0, amount << 10),
            "printf" => (1, amount << 20),
            "heap" => (2, amount << 20),
            other => return Err(format!("unknown limit {other}: stack, printf or heap")),
        };
        // SAFETY: a limit and its value.
        let r = unsafe { (self.cuda.ctx_set_limit)(limit, value) };
        Ok(format!("limit name={name} value={value} result={r}"))
    }

    fn v1_alloc(&mut self, mib: usize) -> String {
        let mut ptr = 0u32;
        let bytes = c_uint::try_from(mib << 20).unwrap_or(c_uint::MAX);
        // SAFETY: a place for the 32-bit pointer.
        let r = unsafe { (self.cuda.v1_alloc)(&mut ptr, bytes) };
        if r == 0 {
            self.kept.push(Kept::V1(ptr));
        }
        format!("alloc path=v1 mib={mib} result={r}")
    }

    fn v1_info(&mut self) -> Vec<String> {
        let (mut free, mut total, mut dtotal) = (0u32, 0u32, 0u32);
        // SAFETY: places for the answers.
        let (r, rt) = unsafe {
            (
                (self.cuda.v1_get_info)(&mut free, &mut total),
                (self.cuda.v1_total_mem)(&mut dtotal, self.current_device()),
            )
        };
        vec![
            format!("v1-info total={total} free={free} result={r}"),
            format!("v1-total total={dtotal} result={rt}"),
        ]
    }

    fn v1_free(&mut self) -> String {
        let (mut count, mut frees, c) = (0, Vec::new(), &self.cuda);
        self.kept.retain(|k| match *k {
            Kept::V1(p) => {
                count += 1;
                // SAFETY: a v1 pointer, freed once.
                frees.push(unsafe { (c.v1_free)(p) });
                false
            }
            _ => true,
        });
        format!("v1-free count={count} result={}", first_error(frees))
    }

    fn info_null_free(&mut self) -> String {
        let mut total = 0usize;
        // SAFETY: NULL for free, a place for total.
        let r = unsafe { (self.cuda.mem_get_info)(null_mut(), &mut total) };
        format!("info-null-free total={total} result={r}")
    }

    fn uuid(&mut self) -> String {
        let dev = self.current_device();
        let mut raw = [0u8; 16];
        // SAFETY: a place for 16 bytes.
        let r = unsafe { (self.cuda.device_get_uuid)(&mut raw, dev) };
        let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        let groups = [0..8, 8..12, 12..16, 16..20, 20..32].map(|at| &hex[at]);
        format!("uuid dev={dev} uuid=GPU-{} result={r}", groups.join("-"))
    }

    /// What the fake driver the probe looked up (not the one the interposer may forward to)
    /// holds for this process on physical GPU `phys` (its `fakeHeldBytes`).
    fn held(&self, phys: c_uint) -> Result<String, String> {
        let held = real_dlsym(self.driver, c"fakeHeldBytes");
        if held.is_null() {
            return Err("fakeHeldBytes not found: not the fake driver".into());
        }
        // SAFETY: the fake's fakeHeldBytes has this signature.
        let held = unsafe { std::mem::transmute::<Ptr, unsafe extern "C" fn(c_uint) -> u64>(held) };
        // SAFETY: a plain number argument.
        let bytes = unsafe { held(phys) };
        Ok(format!("held gpu={phys} bytes={bytes}"))
    }

    fn nvml_info(&mut self, index: c_uint) -> String {
        let (r, handle) = self.nvml_handle(index);
        let mut m = NvmlMemory::default();
        // SAFETY: the handle from NVML and a place for the answer.
        let r = then(r, || unsafe { (self.nvml.memory_info)(handle, &mut m) });
        format!(
            "nvml-info index={index} total={} free={} used={} result={r}",
            m.total, m.free, m.used
        )
    }

    fn threads(&mut self, n: usize, mib: usize) -> String {
        let (dev, cuda) = (self.current_device(), &self.cuda);
        let worker = move || {
            let (mut ctx, mut mine) = (null_mut(), Vec::new());
            // SAFETY: places for the answers; the context from the driver.
            unsafe {
                if (cuda.primary_ctx_retain)(&mut ctx, dev) == 0 && (cuda.ctx_set_current)(ctx) == 0
                {
                    let mut ptr = 0u64;
                    while mine.len() < 1_000_000 && (cuda.mem_alloc)(&mut ptr, mib << 20) == 0 {
                        mine.push(ptr);
                    }
                }
            }
            mine
        };
        let kept: Vec<u64> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..n).map(|_| s.spawn(worker)).collect();
            workers
                .into_iter()
                .flat_map(|w| w.join().unwrap_or_default())
                .collect()
        });
        let allocated = kept.len();
        self.kept.extend(kept.into_iter().map(Kept::Mem));
        format!("threads n={n} mib={mib} allocated={allocated}")
    }

    fn free(&mut self) -> String {
        let (count, c) = (self.kept.len(), &self.cuda);
        // SAFETY: each was allocated by the matching call and is freed once.
        let frees = self.kept.drain(..).map(|kept| unsafe {
            match kept {
                Kept::Mem(p) => (c.mem_free)(p),
                Kept::Async(p) => (c.mem_free_async)(p, null_mut()),
                Kept::AsyncPtsz(p) => (c.mem_free_async_ptsz)(p, null_mut()),
                Kept::Vmm(h) => (c.mem_release)(h),
                Kept::Array(a) => (c.array_destroy)(a),
                Kept::Mipmap(a) => (c.mipmap_destroy)(a),
                Kept::V1(p) => (c.v1_free)(p),
            }
        });
        format!("free count={count} result={}", first_error(frees))
    }
}

/// `--via` and the steps; `None` after printing the usage (`--help`).
fn parse_args(args: Vec<String>) -> Result<Option<(String, Vec<String>)>, String> {
    let mut via = "link".to_string();
    let mut steps = Vec::new();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--via" => {
                via = args
                    .next()
                    .ok_or("--via needs link, dlsym, getproc or path:FILE")?
            }
            "-h" | "--help" => {
                println!(
                    "usage: gpushare-isolation-probe[-dl] [--via link|dlsym|getproc|path:FILE] [no-context] STEP... (see src/main.rs's header)\n\
                     steps: device:N info alloc:PATH:MIB[:DEV] free threads:N:MIB fork-alloc:MIB fork-sleep rtld-next exec wait hold \
                     ctx-create ctx-destroy reset pool-alloc:MIB pool-free sync pool-threshold:MIB trim:MIB \
                     pool-create:D pool-alloc-from:MIB vmm-map:MIB[:D] vmm-unmap graph-alloc:MIB graph-capture:MIB \
                     graph-trim limit:heap|printf:MIB limit:stack:KIB v1-alloc:MIB v1-info v1-free info-null-free \
                     uuid nvml-info:I kernels:PATH:MS:US gpu-util"
                );
                return Ok(None);
            }
            _ => steps.push(arg),
        }
    }
    Ok(Some((via, steps)))
}

/// Whether `dlsym(RTLD_NEXT, "dlsym")` finds the same `dlsym` as the default lookup.
fn rtld_next_line() -> String {
    // SAFETY: lookups with pseudo-handles and a NUL-terminated name.
    let (next, default) = unsafe {
        (
            libc::dlsym(libc::RTLD_NEXT, c"dlsym".as_ptr()),
            libc::dlsym(libc::RTLD_DEFAULT, c"dlsym".as_ptr()),
        )
    };
    let same = u8::from(!next.is_null() && next == default);
    format!("rtld-next same={same}")
}

/// fork(2): 0 in the child, the child's pid in the parent. The caller's child only allocates
/// and prints, or sleeps, and never returns from its step.
fn fork() -> Result<libc::pid_t, String> {
    // SAFETY: see above; the child leaves with _exit or is killed.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        Err("fork failed".into())
    } else {
        Ok(pid)
    }
}

fn run(args: Vec<String>, linked: Option<Linked>) -> Result<(), String> {
    let Some((via, steps)) = parse_args(args)? else {
        return Ok(());
    };
    let (cuda, nvml, driver) = connect(&via, linked)?;
    // SAFETY: flags 0.
    let r = unsafe { (cuda.init)(0) };
    if r != 0 {
        return Err(format!("cuInit returned {r}"));
    }
    let mut probe = Probe {
        cuda,
        driver,
        nvml,
        nvml_ready: false,
        kept: Vec::new(),
        pool_kept: Vec::new(),
        created: Vec::new(),
        pool: null_mut(),
        mapped: Vec::new(),
    };
    // A first step `no-context` skips making device 0 current (to see what a process that
    // gets no context is still told).
    let no_context = steps.first().is_some_and(|s| s == "no-context");
    let steps: Vec<String> = steps.into_iter().skip(usize::from(no_context)).collect();
    if !no_context {
        let first = probe.device(0);
        if !first.ends_with("result=0") {
            return Err(format!("making device 0 current: {first}"));
        }
    }
    let mut out = std::io::stdout().lock();
    let mut say = |line: String| {
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    };
    let mut steps = steps.into_iter();
    while let Some(step) = steps.next() {
        let parts: Vec<&str> = step.split(':').collect();
        let number = |i: usize| -> Result<usize, String> {
            parts
                .get(i)
                .and_then(|p| p.parse().ok())
                .ok_or_else(|| format!("step {step}: field {i} must be a number"))
        };
        // An optional device number in field `i`.
        let device = |i: usize| {
            (parts.len() > i)
                .then(|| number(i).map(|d| d as c_int))
                .transpose()
        };
        let word = |i: usize, usage: &str| {
            parts
                .get(i)
                .copied()
                .ok_or_else(|| format!("step {step}: {usage}"))
        };
        match parts[0] {
            "device" => say(probe.device(number(1)? as c_int)),
            "info" => probe.info().into_iter().for_each(&mut say),
            "alloc" => {
                let (path, dev) = (word(1, "alloc:PATH:MIB")?, device(3)?);
                say(probe.alloc(path, number(2)?, dev)?)
            }
            "free" => say(probe.free()),
            "ctx-create" => say(probe.ctx_create()),
            "ctx-destroy" => say(probe.ctx_destroy()),
            "reset" => say(probe.reset()),
            "pool-alloc" | "pool-alloc-from" => say(probe.pool_alloc(parts[0], number(1)?)),
            "pool-free" => say(probe.pool_free()),
            "pool-create" => say(probe.pool_create(number(1)? as c_int)),
            "pool-threshold" => say(probe.pool_threshold(number(1)?)),
            "trim" => say(probe.trim(number(1)?)),
            "sync" => {
                // SAFETY: no arguments.
                let r = unsafe { (probe.cuda.ctx_synchronize)() };
                say(format!("sync result={r}"))
            }
            "vmm-map" => {
                let dev = device(2)?;
                say(probe.vmm_map(number(1)?, dev))
            }
            "vmm-unmap" => say(probe.vmm_unmap()),
            "graph-alloc" => say(probe.graph_alloc(number(1)?)),
            "graph-capture" => say(probe.graph_capture(number(1)?)),
            "graph-trim" => say(probe.graph_trim()),
            "limit" => say(probe.limit(parts.get(1).copied().unwrap_or_default(), number(2)?)?),
            "v1-alloc" => say(probe.v1_alloc(number(1)?)),
            "v1-info" => probe.v1_info().into_iter().for_each(&mut say),
            "v1-free" => say(probe.v1_free()),
            "info-null-free" => say(probe.info_null_free()),
            "uuid" => say(probe.uuid()),
            "nvml-info" => say(probe.nvml_info(number(1)? as c_uint)),
            "kernels" => {
                let path = word(1, "kernels:PATH:MS:US")?;
                say(probe.kernels(path, number(2)? as u64, number(3)? as c_uint)?)
            }
            "gpu-util" => say(probe.gpu_util()),
            "held" => say(probe.held(number(1)? as c_uint)?),
            "threads" => say(probe.threads(number(1)?, number(2)?)),
            "exec" => {
                say("exec".into());
                let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
                let err = std::os::unix::process::CommandExt::exec(
                    std::process::Command::new(exe)
                        .args(["--via", &via])
                        .args(steps.by_ref()),
                );
                return Err(format!("exec: {err}"));
            }
            "rtld-next" => say(rtld_next_line()),
            "fork-alloc" => {
                let mib = number(1)?;
                let pid = fork()?;
                if pid == 0 {
                    let line = probe.alloc("mem", mib, None)?;
                    say(line);
                    // SAFETY: ends the child without running the parent's destructors.
                    unsafe { libc::_exit(0) };
                }
                let mut status = 0;
                // SAFETY: our child and a place for its status.
                unsafe { libc::waitpid(pid, &mut status, 0) };
                say(format!("fork child={pid} status={status}"));
            }
            "fork-sleep" => {
                let pid = fork()?;
                if pid == 0 {
                    loop {
                        // SAFETY: waits for a signal; no state of the parent is touched.
                        unsafe { libc::pause() };
                    }
                }
                say(format!("fork-sleep child={pid}"));
            }
            "wait" => {
                say("waiting".into());
                let mut line = String::new();
                let _ = std::io::stdin().read_line(&mut line);
            }
            "hold" => {
                say("holding".into());
                loop {
                    std::thread::park();
                }
            }
            other => return Err(format!("unknown step {other}")),
        }
    }
    Ok(())
}

/// Runs the probe on this process's arguments; `linked` when the program links the driver.
pub fn main(linked: Option<Linked>) {
    if let Err(message) = run(std::env::args().skip(1).collect(), linked) {
        println!("error message={}", message.replace(' ', "_"));
        std::process::exit(1);
    }
}
