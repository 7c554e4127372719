//! `gpushare-isolation-probe`: reaches the NVIDIA driver one of three ways, runs scripted
//! steps, prints one machine-readable line per step (`word key=value ...`).
//!
//! ```text
//! gpushare-isolation-probe [--via link|dlsym|getproc] STEP...
//!
//! --via link     call the driver's symbols, linked by name (the default)
//! --via dlsym    dlopen("libcuda.so.1") / dlopen("libnvidia-ml.so.1") and dlsym every entry point
//! --via getproc  dlsym only cuGetProcAddress, fetch cuGetProcAddress (v2) through it, and every
//!                CUDA entry point through that by base name (cudaVersion 12000; the _ptsz
//!                variants with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM); NVML by dlsym
//!
//! Steps (device 0 is made current first):
//!   device:N            make device N current             -> device dev=N result=CODE
//!   info                memory as the program sees it     -> cuda dev=N total=B free=B result=CODE
//!                         (cuMemGetInfo_v2)                  cuda-total dev=N total=B result=CODE
//!                         (cuDeviceTotalMem_v2)              nvml dev=N total=B free=B used=B result=CODE
//!                         (nvmlDeviceGetMemoryInfo, _v2)     nvml2 dev=N total=B free=B used=B result=CODE
//!   alloc:PATH:MIB[:D]  allocate MIB MiB and keep it      -> alloc path=PATH mib=MIB result=CODE
//!                       PATH: mem pitch managed async async-ptsz pool pool-ptsz vmm array array3d
//!                       mipmap; D: the device a vmm allocation names (default: the current one)
//!   free                free all kept allocations, each   -> free count=N result=CODE (first error)
//!                       with its matching call
//!   threads:N:MIB       N threads (each making the current -> threads n=N mib=MIB allocated=COUNT
//!                       device current) allocate MIB MiB
//!                       (cuMemAlloc_v2) until refused; kept
//!   fork-alloc:MIB      fork; the child allocates MIB MiB   -> alloc path=mem mib=MIB result=CODE (child)
//!                       and exits without freeing            fork child=PID status=STATUS
//!   rtld-next           whether dlsym(RTLD_NEXT, "dlsym")    -> rtld-next same=0|1
//!                       from this program finds the same
//!                       dlsym as RTLD_DEFAULT (it should:
//!                       the interposer keeps the caller)
//!   exec                exec this probe (same --via) with   -> exec
//!                       the steps that follow: a new program
//!                       in the same process
//!   hold                print `holding`, wait until killed
//! ```
//! B are bytes; CODE is the driver's result (0 success, 2 CUDA_ERROR_OUT_OF_MEMORY). A failed
//! setup (driver not found, cuInit) prints `error message=...` and exits with status 1.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::io::Write;

type Fn0 = unsafe extern "C" fn() -> c_int;

macro_rules! cuda_api {
    ($($field:ident: $sym:ident = $base:literal, $flags:expr => fn($($arg:ty),*);)*) => {
        #[link(name = "cuda")]
        unsafe extern "C" {
            $(fn $sym($(_: $arg),*) -> c_int;)*
        }

        /// The CUDA entry points the probe uses, however they were found.
        struct Cuda {
            $($field: unsafe extern "C" fn($($arg),*) -> c_int,)*
        }

        impl Cuda {
            fn linked() -> Self {
                Self { $($field: $sym,)* }
            }

            /// `lookup(symbol, base name, cuGetProcAddress flags)`.
            fn lookup(lookup: impl Fn(&CStr, &CStr, u64) -> *mut c_void) -> Result<Self, String> {
                Ok(Self {
                    $($field: {
                        let p = lookup(
                            // SAFETY: a literal with one NUL at its end.
                            unsafe { CStr::from_bytes_with_nul_unchecked(concat!(stringify!($sym), "\0").as_bytes()) },
                            // SAFETY: as above.
                            unsafe { CStr::from_bytes_with_nul_unchecked(concat!($base, "\0").as_bytes()) },
                            $flags,
                        );
                        if p.is_null() {
                            return Err(format!("{} not found", stringify!($sym)));
                        }
                        // SAFETY: the driver's entry point of that name, with this signature.
                        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> c_int>(p) }
                    },)*
                })
            }
        }
    };
}

type Ptr = *mut c_void;
const PTSZ: u64 = 2;

cuda_api! {
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
}

#[link(name = "nvidia-ml")]
unsafe extern "C" {
    fn nvmlInit_v2() -> c_int;
    fn nvmlDeviceGetHandleByIndex_v2(index: c_uint, device: *mut Ptr) -> c_int;
    fn nvmlDeviceGetMemoryInfo(device: Ptr, memory: *mut NvmlMemory) -> c_int;
    fn nvmlDeviceGetMemoryInfo_v2(device: Ptr, memory: *mut NvmlMemoryV2) -> c_int;
}

/// The NVML entry points the probe uses.
struct Nvml {
    init: Fn0,
    handle_by_index: unsafe extern "C" fn(c_uint, *mut Ptr) -> c_int,
    memory_info: unsafe extern "C" fn(Ptr, *mut NvmlMemory) -> c_int,
    memory_info_v2: unsafe extern "C" fn(Ptr, *mut NvmlMemoryV2) -> c_int,
}

#[repr(C)]
#[derive(Default)]
struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
#[derive(Default)]
struct NvmlMemoryV2 {
    version: c_uint,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}

/// `nvmlMemory_v2`: sizeof(nvmlMemory_v2_t) | 2 << 24.
const NVML_MEMORY_V2: c_uint = std::mem::size_of::<NvmlMemoryV2>() as c_uint | 2 << 24;

/// `CUmemAllocationProp` (CUDA 12): pinned device memory at `location_id`.
#[repr(C)]
struct AllocationProp {
    kind: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    win32_metadata: Ptr,
    compression_type: u8,
    gpu_direct_rdma_capable: u8,
    usage: u16,
    reserved: [u8; 4],
}

#[repr(C)]
struct ArrayDescriptor {
    width: usize,
    height: usize,
    format: c_uint,
    channels: c_uint,
}

#[repr(C)]
struct Array3dDescriptor {
    width: usize,
    height: usize,
    depth: usize,
    format: c_uint,
    channels: c_uint,
    flags: c_uint,
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
}

fn real_dlsym(handle: Ptr, name: &CStr) -> Ptr {
    // SAFETY: dlsym with a handle from dlopen and a NUL-terminated name.
    unsafe { libc::dlsym(handle, name.as_ptr()) }
}

fn dlopen(name: &CStr) -> Result<Ptr, String> {
    // SAFETY: dlopen with a NUL-terminated name.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        Err(format!("dlopen {name:?} failed"))
    } else {
        Ok(handle)
    }
}

fn nvml_by_dlsym() -> Result<Nvml, String> {
    let handle = dlopen(c"libnvidia-ml.so.1")?;
    let find = |name: &CStr| {
        let p = real_dlsym(handle, name);
        if p.is_null() {
            Err(format!("{name:?} not found"))
        } else {
            Ok(p)
        }
    };
    // SAFETY (each transmute): NVML's entry points of those names, with these signatures.
    unsafe {
        Ok(Nvml {
            init: std::mem::transmute::<Ptr, Fn0>(find(c"nvmlInit_v2")?),
            handle_by_index: std::mem::transmute::<
                Ptr,
                unsafe extern "C" fn(c_uint, *mut Ptr) -> c_int,
            >(find(c"nvmlDeviceGetHandleByIndex_v2")?),
            memory_info: std::mem::transmute::<
                Ptr,
                unsafe extern "C" fn(Ptr, *mut NvmlMemory) -> c_int,
            >(find(c"nvmlDeviceGetMemoryInfo")?),
            memory_info_v2: std::mem::transmute::<
                Ptr,
                unsafe extern "C" fn(Ptr, *mut NvmlMemoryV2) -> c_int,
            >(find(c"nvmlDeviceGetMemoryInfo_v2")?),
        })
    }
}

type GetProcV1 = unsafe extern "C" fn(*const c_char, *mut Ptr, c_int, u64) -> c_int;
type GetProcV2 = unsafe extern "C" fn(*const c_char, *mut Ptr, c_int, u64, *mut c_int) -> c_int;

fn connect(via: &str) -> Result<(Cuda, Nvml), String> {
    match via {
        "link" => Ok((
            Cuda::linked(),
            Nvml {
                init: nvmlInit_v2,
                handle_by_index: nvmlDeviceGetHandleByIndex_v2,
                memory_info: nvmlDeviceGetMemoryInfo,
                memory_info_v2: nvmlDeviceGetMemoryInfo_v2,
            },
        )),
        "dlsym" => {
            let handle = dlopen(c"libcuda.so.1")?;
            Ok((
                Cuda::lookup(|name, _, _| real_dlsym(handle, name))?,
                nvml_by_dlsym()?,
            ))
        }
        "getproc" => {
            let handle = dlopen(c"libcuda.so.1")?;
            let v1 = real_dlsym(handle, c"cuGetProcAddress");
            if v1.is_null() {
                return Err("cuGetProcAddress not found".into());
            }
            // SAFETY: cuGetProcAddress has the v1 signature.
            let v1 = unsafe { std::mem::transmute::<Ptr, GetProcV1>(v1) };
            let mut v2: Ptr = std::ptr::null_mut();
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
                let mut p: Ptr = std::ptr::null_mut();
                let mut status: c_int = 0;
                // SAFETY: a NUL-terminated name and places for the answers.
                let r = unsafe { v2(base.as_ptr(), &mut p, 12000, flags, &mut status) };
                if r == 0 { p } else { std::ptr::null_mut() }
            })?;
            Ok((cuda, nvml_by_dlsym()?))
        }
        other => Err(format!("unknown --via {other}: link, dlsym or getproc")),
    }
}

struct Probe {
    cuda: Cuda,
    nvml: Nvml,
    nvml_ready: bool,
    kept: Vec<Kept>,
}

impl Probe {
    fn current_device(&self) -> c_int {
        let mut dev = -1;
        // SAFETY: a place for the answer.
        unsafe { (self.cuda.ctx_get_device)(&mut dev) };
        dev
    }

    fn device(&mut self, dev: c_int) -> String {
        let mut ctx: Ptr = std::ptr::null_mut();
        let mut device = 0;
        // SAFETY: places for the answers; the context from the driver.
        let r = unsafe {
            let r = (self.cuda.device_get)(&mut device, dev);
            if r != 0 {
                r
            } else {
                let r = (self.cuda.primary_ctx_retain)(&mut ctx, device);
                if r != 0 {
                    r
                } else {
                    (self.cuda.ctx_set_current)(ctx)
                }
            }
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
        let mut lines = vec![
            format!("cuda dev={dev} total={total} free={free} result={r}"),
            format!("cuda-total dev={dev} total={dtotal} result={rt}"),
        ];
        if !self.nvml_ready {
            // SAFETY: no arguments.
            let r = unsafe { (self.nvml.init)() };
            self.nvml_ready = r == 0;
        }
        let mut handle: Ptr = std::ptr::null_mut();
        // SAFETY: a place for the handle.
        let rh = unsafe { (self.nvml.handle_by_index)(dev.max(0) as c_uint, &mut handle) };
        let mut m = NvmlMemory::default();
        let mut m2 = NvmlMemoryV2 {
            version: NVML_MEMORY_V2,
            ..Default::default()
        };
        let (r1, r2) = if rh != 0 {
            (rh, rh)
        } else {
            // SAFETY: a handle from NVML and places for the answers.
            unsafe {
                (
                    (self.nvml.memory_info)(handle, &mut m),
                    (self.nvml.memory_info_v2)(handle, &mut m2),
                )
            }
        };
        lines.push(format!(
            "nvml dev={dev} total={} free={} used={} result={r1}",
            m.total, m.free, m.used
        ));
        lines.push(format!(
            "nvml2 dev={dev} total={} free={} used={} result={r2}",
            m2.total, m2.free, m2.used
        ));
        lines
    }

    fn alloc(
        &mut self,
        path: &str,
        mib: usize,
        vmm_device: Option<c_int>,
    ) -> Result<String, String> {
        let bytes = mib << 20;
        let c = &self.cuda;
        let mut ptr = 0u64;
        let mut handle: Ptr = std::ptr::null_mut();
        let stream: Ptr = std::ptr::null_mut();
        // SAFETY (the whole block): driver calls with places for their answers and descriptors
        // that live across the call.
        let (r, kept) = unsafe {
            match path {
                "mem" => ((c.mem_alloc)(&mut ptr, bytes), Kept::Mem(ptr)),
                "pitch" => {
                    let mut pitch = 0usize;
                    (
                        (c.mem_alloc_pitch)(&mut ptr, &mut pitch, 1 << 16, bytes >> 16, 4),
                        Kept::Mem(ptr),
                    )
                }
                "managed" => ((c.mem_alloc_managed)(&mut ptr, bytes, 1), Kept::Mem(ptr)),
                "async" => (
                    (c.mem_alloc_async)(&mut ptr, bytes, stream),
                    Kept::Async(ptr),
                ),
                "async-ptsz" => (
                    (c.mem_alloc_async_ptsz)(&mut ptr, bytes, stream),
                    Kept::AsyncPtsz(ptr),
                ),
                "pool" | "pool-ptsz" => {
                    let mut pool: Ptr = std::ptr::null_mut();
                    let r = (c.default_mem_pool)(&mut pool, self.current_device());
                    if r != 0 {
                        (r, Kept::Mem(0))
                    } else if path == "pool" {
                        (
                            (c.mem_alloc_pool)(&mut ptr, bytes, pool, stream),
                            Kept::Async(ptr),
                        )
                    } else {
                        (
                            (c.mem_alloc_pool_ptsz)(&mut ptr, bytes, pool, stream),
                            Kept::AsyncPtsz(ptr),
                        )
                    }
                }
                "vmm" => {
                    let prop = AllocationProp {
                        kind: 1,          // CU_MEM_ALLOCATION_TYPE_PINNED
                        handle_types: 0,  // none
                        location_type: 1, // CU_MEM_LOCATION_TYPE_DEVICE
                        location_id: vmm_device.unwrap_or_else(|| self.current_device()),
                        win32_metadata: std::ptr::null_mut(),
                        compression_type: 0,
                        gpu_direct_rdma_capable: 0,
                        usage: 0,
                        reserved: [0; 4],
                    };
                    ((c.mem_create)(&mut ptr, bytes, &prop, 0), Kept::Vmm(ptr))
                }
                "array" => {
                    let desc = ArrayDescriptor {
                        width: 1 << 16,
                        height: bytes >> 16,
                        format: FORMAT_U8,
                        channels: 1,
                    };
                    let r = (c.array_create)(&mut handle, &desc);
                    (r, Kept::Array(handle))
                }
                "array3d" | "mipmap" => {
                    let desc = Array3dDescriptor {
                        width: 1 << 10,
                        height: 1 << 10,
                        depth: mib,
                        format: FORMAT_U8,
                        channels: 1,
                        flags: 0,
                    };
                    if path == "array3d" {
                        let r = (c.array3d_create)(&mut handle, &desc);
                        (r, Kept::Array(handle))
                    } else {
                        let r = (c.mipmap_create)(&mut handle, &desc, 1);
                        (r, Kept::Mipmap(handle))
                    }
                }
                other => return Err(format!("unknown allocation path {other}")),
            }
        };
        if r == 0 {
            self.kept.push(kept);
        }
        Ok(format!("alloc path={path} mib={mib} result={r}"))
    }

    fn threads(&mut self, n: usize, mib: usize) -> String {
        let dev = self.current_device();
        let cuda = &self.cuda;
        let kept: Vec<Vec<u64>> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..n)
                .map(|_| {
                    s.spawn(move || {
                        let mut ctx: Ptr = std::ptr::null_mut();
                        let mut mine = Vec::new();
                        // SAFETY: places for the answers; the context from the driver.
                        unsafe {
                            if (cuda.primary_ctx_retain)(&mut ctx, dev) != 0
                                || (cuda.ctx_set_current)(ctx) != 0
                            {
                                return mine;
                            }
                            for _ in 0..1_000_000 {
                                let mut ptr = 0u64;
                                if (cuda.mem_alloc)(&mut ptr, mib << 20) != 0 {
                                    break;
                                }
                                mine.push(ptr);
                            }
                        }
                        mine
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().unwrap_or_default())
                .collect()
        });
        let allocated: usize = kept.iter().map(Vec::len).sum();
        self.kept.extend(kept.into_iter().flatten().map(Kept::Mem));
        format!("threads n={n} mib={mib} allocated={allocated}")
    }

    fn free(&mut self) -> String {
        let c = &self.cuda;
        let count = self.kept.len();
        let mut first = 0;
        for kept in self.kept.drain(..) {
            // SAFETY: each was allocated by the matching call and is freed once.
            let r = unsafe {
                match kept {
                    Kept::Mem(p) => (c.mem_free)(p),
                    Kept::Async(p) => (c.mem_free_async)(p, std::ptr::null_mut()),
                    Kept::AsyncPtsz(p) => (c.mem_free_async_ptsz)(p, std::ptr::null_mut()),
                    Kept::Vmm(h) => (c.mem_release)(h),
                    Kept::Array(a) => (c.array_destroy)(a),
                    Kept::Mipmap(a) => (c.mipmap_destroy)(a),
                }
            };
            if first == 0 {
                first = r;
            }
        }
        format!("free count={count} result={first}")
    }
}

/// `--via` and the steps; `None` after printing the usage (`--help`).
fn parse_args(args: Vec<String>) -> Result<Option<(String, Vec<String>)>, String> {
    let mut via = "link".to_string();
    let mut steps = Vec::new();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--via" => via = args.next().ok_or("--via needs link, dlsym or getproc")?,
            "-h" | "--help" => {
                println!(
                    "usage: gpushare-isolation-probe [--via link|dlsym|getproc] STEP... (see the source's header)"
                );
                println!(
                    "steps: device:N info alloc:PATH:MIB[:DEV] free threads:N:MIB fork-alloc:MIB rtld-next hold"
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
    format!(
        "rtld-next same={}",
        u8::from(!next.is_null() && next == default)
    )
}

fn run(args: Vec<String>) -> Result<(), String> {
    let Some((via, steps)) = parse_args(args)? else {
        return Ok(());
    };
    let (cuda, nvml) = connect(&via)?;
    // SAFETY: flags 0.
    let r = unsafe { (cuda.init)(0) };
    if r != 0 {
        return Err(format!("cuInit returned {r}"));
    }
    let mut probe = Probe {
        cuda,
        nvml,
        nvml_ready: false,
        kept: Vec::new(),
    };
    let first = probe.device(0);
    if !first.ends_with("result=0") {
        return Err(format!("making device 0 current: {first}"));
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
        match parts[0] {
            "device" => say(probe.device(number(1)? as c_int)),
            "info" => probe.info().into_iter().for_each(&mut say),
            "alloc" => {
                let path = parts
                    .get(1)
                    .ok_or_else(|| format!("step {step}: alloc:PATH:MIB"))?;
                let dev = if parts.len() > 3 {
                    Some(number(3)? as c_int)
                } else {
                    None
                };
                say(probe.alloc(path, number(2)?, dev)?)
            }
            "free" => say(probe.free()),
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
                // SAFETY: the child allocates, prints and leaves with _exit.
                let pid = unsafe { libc::fork() };
                if pid < 0 {
                    return Err("fork failed".into());
                }
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

fn main() {
    if let Err(message) = run(std::env::args().skip(1).collect()) {
        println!("error message={}", message.replace(' ', "_"));
        std::process::exit(1);
    }
}
