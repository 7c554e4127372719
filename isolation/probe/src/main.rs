//! `gpushare-isolation-probe`: reaches the NVIDIA driver one of three ways, runs scripted
//! steps, prints one machine-readable line per step (`word key=value ...`).
//!
//! ```text
//! gpushare-isolation-probe [--via link|dlsym|getproc|path:FILE] STEP...
//! gpushare-isolation-probe-dl [--via dlsym|getproc|path:FILE] STEP...
//!
//! --via link       call the driver's symbols, linked by name (the default)
//! --via dlsym      dlopen("libcuda.so.1") / dlopen("libnvidia-ml.so.1") and dlsym every entry point
//! --via getproc    dlsym only cuGetProcAddress, fetch cuGetProcAddress (v2) through it, and every
//!                  CUDA entry point through that by base name (cudaVersion 12000; the _ptsz
//!                  variants with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM; the 32-bit v1
//!                  cuMemAlloc, cuMemFree, cuMemGetInfo, cuDeviceTotalMem with cudaVersion 3000);
//!                  NVML by dlsym
//! --via path:FILE  dlopen(FILE, RTLD_NOW | RTLD_LOCAL), a driver by absolute path under any file
//!                  name, and dlsym every CUDA entry point from that handle; NVML by dlsym
//!
//! gpushare-isolation-probe links libcuda.so.1 and libnvidia-ml.so.1 (DT_NEEDED), so it starts
//! only where they are found by soname. gpushare-isolation-probe-dl (src/dl.rs, same steps)
//! links neither: it runs where only a driver opened by path exists.
//!
//! Steps (device 0 is made current first, unless the first step is `no-context`), each with
//! the lines it prints after `->`:
//!   no-context          (first only) make no device current: what a process without a
//!                       context is still told
//!   device:N            make device N current -> device dev=N result=CODE
//!   info                memory as the program sees it, one line per call:
//!                       cuMemGetInfo_v2           -> cuda dev=N total=B free=B result=CODE
//!                       cuDeviceTotalMem_v2       -> cuda-total dev=N total=B result=CODE
//!                       nvmlDeviceGetMemoryInfo   -> nvml dev=N total=B free=B used=B result=CODE
//!                       (the same, _v2)           -> nvml2 dev=N total=B free=B used=B result=CODE
//!   alloc:PATH:MIB[:D]  allocate MIB MiB and keep it; PATH: mem pitch managed async async-ptsz
//!                       pool pool-ptsz vmm array array3d mipmap; D: the device a vmm
//!                       allocation names (default: the current one)
//!                       -> alloc path=PATH mib=MIB result=CODE
//!   free                free all kept allocations, each with its matching call
//!                       -> free count=N result=CODE (first error)
//!   threads:N:MIB       N threads (each making the current device current) allocate MIB MiB
//!                       (cuMemAlloc_v2) until refused; kept
//!                       -> threads n=N mib=MIB allocated=COUNT
//!   fork-alloc:MIB      fork; the child allocates MIB MiB and exits without freeing
//!                       -> alloc path=mem mib=MIB result=CODE (the child)
//!                          fork child=PID status=STATUS
//!   fork-sleep          fork; the child sleeps until killed -> fork-sleep child=PID
//!   rtld-next           whether dlsym(RTLD_NEXT, "dlsym") from this program finds the same dlsym
//!                       as RTLD_DEFAULT (it should: the interposer keeps the caller)
//!                       -> rtld-next same=0|1
//!   exec                exec this probe (same --via) with the steps that follow: a new program
//!                       in the same process -> exec
//!   hold                print `holding`, wait until killed
//!   wait                print `waiting`, read one line from stdin, go on (a test's checkpoint)
//!   ctx-create          cuCtxCreate_v2 on the current device (it becomes current)
//!                       -> ctx-create result=CODE
//!   ctx-destroy         cuCtxDestroy_v2 of the last created, then the context before it current
//!                       -> ctx-destroy result=CODE
//!   reset               cuDevicePrimaryCtxReset_v2 of the current device, then retain + set
//!                       current again (kept allocations are forgotten: the reset freed them)
//!                       -> reset dev=N result=CODE device-dev=N-result=CODE
//!   pool-alloc:MIB      cuMemAllocAsync (current device's current pool, legacy stream), kept
//!                       -> alloc path=pool-alloc mib=MIB result=CODE
//!   pool-create:D       cuMemPoolCreate on device D -> pool-create dev=D result=CODE
//!   pool-alloc-from:MIB cuMemAllocFromPoolAsync from the last created pool, kept
//!                       -> alloc path=pool-alloc-from mib=MIB result=CODE
//!   pool-free           cuMemFreeAsync of every kept pool pointer -> pool-free count=N result=CODE
//!   sync                cuCtxSynchronize -> sync result=CODE
//!   pool-threshold:MIB  CU_MEMPOOL_ATTR_RELEASE_THRESHOLD of the current device's current pool
//!                       -> pool-threshold mib=MIB result=CODE
//!   trim:MIB            cuMemPoolTrimTo that pool -> trim mib=MIB result=CODE
//!   vmm-map:MIB[:D]     cuMemCreate (device D, default the current one), cuMemAddressReserve,
//!                       cuMemMap, cuMemSetAccess, then cuMemRelease while mapped (NVIDIA's
//!                       sample); the mapping is kept -> alloc path=vmm-map mib=MIB result=CODE
//!                       create=C reserve=C map=C access=C release=C
//!   vmm-unmap           cuMemUnmap + cuMemAddressFree of every kept mapping
//!                       -> vmm-unmap count=N result=CODE
//!   graph-alloc:MIB     cuGraphCreate, cuGraphAddMemAllocNode (MIB on the current device), a
//!                       free node, cuGraphInstantiateWithFlags, cuGraphLaunch (exec and graph
//!                       then destroyed; the graph pool keeps its reservation)
//!                       -> graph-alloc mib=MIB result=CODE create=C node=C free-node=C
//!                       instantiate=C launch=C
//!   graph-capture:MIB   on a new stream: begin capture, cuMemAllocAsync MIB + cuMemFreeAsync,
//!                       end capture, instantiate, launch -> graph-capture mib=MIB result=CODE
//!                       stream=C begin=C alloc=C free=C end=C instantiate=C launch=C
//!   graph-trim          cuDeviceGraphMemTrim (current dev) -> graph-trim result=CODE
//!   limit:heap:MIB      cuCtxSetLimit(MALLOC_HEAP_SIZE) -> limit name=heap value=B result=CODE
//!   limit:printf:MIB    cuCtxSetLimit(PRINTF_FIFO_SIZE) -> limit name=printf value=B result=CODE
//!   limit:stack:KIB     cuCtxSetLimit(STACK_SIZE) -> limit name=stack value=B result=CODE
//!   v1-alloc:MIB        the 32-bit v1 cuMemAlloc (linked, dlsym'd or cuGetProcAddress with
//!                       cudaVersion 3000, as --via says), kept
//!                       -> alloc path=v1 mib=MIB result=CODE
//!   v1-info             v1 cuMemGetInfo, cuDeviceTotalMem -> v1-info total=B free=B result=CODE
//!                                                            v1-total total=B result=CODE
//!   v1-free             v1 cuMemFree of every kept v1 pointer -> v1-free count=N result=CODE
//!   info-null-free      cuMemGetInfo_v2(NULL, &total) -> info-null-free total=B result=CODE
//!   uuid                cuDeviceGetUuid_v2, current device -> uuid dev=N uuid=GPU-... result=CODE
//!   nvml-info:I         NVML memory info of NVML index I
//!                       -> nvml-info index=I total=B free=B used=B result=CODE
//!   kernels:PATH:MS:US  back-to-back kernels of US µs each (the fake runs a kernel for as many
//!                       µs as its grid has blocks), each followed by cuStreamSynchronize, for MS
//!                       ms of wall time; PATH: launch launch-ptsz ex coop (cuLaunchKernel, _ptsz,
//!                       Ex, Cooperative) graph graph-ptsz (one kernel captured into a graph,
//!                       cuGraphLaunch(_ptsz) each time)
//!                       -> kernels path=PATH us=US count=N result=CODE
//!   gpu-util            nvmlDeviceGetUtilizationRates of the current device
//!                       -> gpu-util dev=N gpu=PERCENT result=CODE
//!   held:P              what the fake driver the probe looked up (the FILE of --via path:,
//!                       libcuda.so.1 otherwise) holds for this process on physical GPU P: its
//!                       own fakeHeldBytes, not a hooked call, so it tells which loaded copy
//!                       served the calls -> held gpu=P bytes=B
//! ```
//! B are bytes; CODE is the driver's result (0 success, 2 CUDA_ERROR_OUT_OF_MEMORY; -1: the
//! step was not reached because an earlier one failed). A failed setup (driver not found,
//! cuInit) prints `error message=...` and exits with status 1.

#[macro_use]
mod probe;

/// The driver's symbols, linked by name.
mod linked {
    use crate::probe::*;
    use std::ffi::{c_int, c_uint, c_void};

    link_cuda!();
    link_nvml!();
}

fn main() {
    probe::main(Some(|| (probe::Cuda::linked(), probe::Nvml::linked())));
}
