//! gpushare-isolation: holds each container to its share of GPU memory, from inside it.
//!
//! gpushare gives a container a share of a GPU's memory (`GPUSHARE_CONTAINER_MEM_GIB`), but
//! nothing in the driver enforces it. This crate builds `libgpushare_isolation.so`, which is
//! `LD_PRELOAD`ed into the container's processes and sits between them and the NVIDIA driver
//! (`libcuda.so.1`) and NVML (`libnvidia-ml.so.1`):
//!
//! ```text
//!   program ──(1) linked symbol ──────┐
//!   program ──(2) dlopen + dlsym ─────┼──> libgpushare_isolation.so ──> libcuda.so.1
//!   runtime ──(3) cuGetProcAddress ───┘      │ counts, refuses         libnvidia-ml.so.1
//!                                            v
//!                           budget file (mmap, shared by the container's processes)
//!                           share | used | refused per GPU; a slot per process
//! ```
//!
//! # Why preload
//!
//! A preloaded library comes first in symbol resolution, needs no change to the image or the
//! program, and sees every process of the container (the plugin sets `LD_PRELOAD` and the
//! limits in the container's environment). Limits come from
//! [`gpushare_isolation_budget::limits`]; without them every call passes through unchanged.
//!
//! # The three ways to the driver
//!
//! 1. **Linked**: the program's undefined `cuMemAlloc_v2` binds to our export of that name,
//!    which forwards to the real one found with `dlopen("libcuda.so.1")` and the real `dlsym`.
//! 2. **`dlopen` + `dlsym`**: we export `dlsym`. The real one (from
//!    `dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5")`, else `GLIBC_2.34`) answers; when the name is
//!    one we hook, the driver has it and limits are set, our hook is answered instead. Any
//!    other lookup is a tail-jump to glibc's `dlsym` that touches no state (no recursion
//!    into our set-up, and `RTLD_NEXT` stays relative to the true caller).
//! 3. **`cuGetProcAddress`(`_v2`)**: CUDA 11.3+ runtimes fetch every entry point by base name
//!    (`"cuMemAlloc"`), for a CUDA version and per-thread-stream flags. We let the driver
//!    answer, and if its answer is the real address of an entry point we hook (say
//!    `cuMemAllocAsync_ptsz`), swap in our hook of that exact variant. Variants we do not hook
//!    (the 32-bit v1 `cuMemAlloc`) pass unchanged; `cuGetProcAddress` itself is hooked.
//!
//! # What is counted
//!
//! Every allocation path, on the current context's device (`cuCtxGetDevice`) unless the call
//! names one: `cuMemAlloc_v2`, `cuMemAllocPitch_v2` (estimated, then the real pitch),
//! `cuMemAllocManaged`, `cuMemAllocAsync`(`_ptsz`), `cuMemAllocFromPoolAsync`(`_ptsz`),
//! `cuMemCreate` (on `prop->location.id`), `cuArrayCreate_v2`, `cuArray3DCreate_v2` and
//! `cuMipmappedArrayCreate` (estimated from the descriptor), and their frees. An allocation
//! that would take the container past its share on that GPU returns
//! `CUDA_ERROR_OUT_OF_MEMORY` and never reaches the driver. `cuMemGetInfo_v2`,
//! `cuDeviceTotalMem_v2` and `nvmlDeviceGetMemoryInfo`(`_v2`) report the share as total and
//! `min(share - used, the driver's free)` as free. The accounting is [`Interposer`]; the
//! process keeps pointer → (GPU, bytes) in a [`ledger::Ledger`] so that frees give back
//! exactly what was counted.
//!
//! # One budget per container
//!
//! All processes of a container share one [`budget`] file (protocol documented there; the
//! versioned layout, the file's name and the limits are in `gpushare-isolation-budget`):
//! atomics in a shared mapping, no lock on the allocation path. A process that dies without
//! freeing gives its bytes back when another allocation would be refused or memory is
//! queried. The plugin reads the file with that crate's safe reader, never through this one.
//!
//! # Never takes the program down
//!
//! No panic crosses the FFI boundary (every export runs in `catch_unwind`). If the limits are
//! malformed or the budget file cannot be opened, one line goes to stderr and every call
//! passes through. `fork` is handled (the child gets its own slot and an empty ledger), and
//! so is `exec` (the new program drops the old one's slot).
//!
//! # What it cannot catch
//!
//! - Programs that talk to `/dev/nvidia*` directly, or link the driver statically: they never
//!   pass through the dynamic linker.
//! - Off x86_64, `RTLD_NEXT` lookups made through our `dlsym` resolve from after this
//!   library rather than after their caller. On x86_64 our `dlsym` is a trampoline that
//!   tail-jumps to glibc's, so glibc sees the true caller.
//! - Memory the driver takes for itself (contexts, module code, pool reservations beyond the
//!   bytes requested): only requested bytes count, so the device's real use is higher.
//! - NVML indexes are taken for CUDA ordinals (true with `CUDA_DEVICE_ORDER=PCI_BUS_ID` or
//!   one GPU).
//! - Processes sharing a budget must share a pid namespace (dead slots are found by pid).
//! - Entry points we do not hook pass unchanged: the 32-bit v1 `cuMemAlloc`/`cuMemGetInfo`
//!   of pre-3.2 programs, host allocations (`cuMemAllocHost`, `cuMemCreate` on a host
//!   location), graph-node allocations (`cuGraphAddMemAllocNode`).
//! - `cuMemFreeAsync` gives bytes back at once, not when the stream reaches the free.
//! - A process killed between reserving a total and recording it in its slot (two atomic
//!   steps) leaves those bytes counted until the container restarts: never over the share.
//!
//! # Never link the rlib into another program
//!
//! The rlib exists for this crate's tests and bench (the accounting core, and the hooks the
//! bench calls). It carries the same `#[no_mangle]` exports, so a program that links it
//! defines `dlsym` and the hooked names itself, and its own driver and NVML calls go through
//! ours. A program that wants to read budgets links `gpushare-isolation-budget`.
//!
//! # Unsafe code
//!
//! The workspace forbids unsafe code; this crate alone allows it (its own `[lints]`), because
//! an interposer is FFI: exported `extern "C"` functions, raw pointers from programs,
//! `dlopen`/`dlsym`, `mmap` and atomics over shared memory. Each `unsafe` block is small and
//! says why it is sound (`clippy::undocumented_unsafe_blocks` is denied).

pub mod budget;
mod devices;
mod dlsym;
mod driver;
mod hooks;
mod interposer;
pub mod ledger;
mod process;
pub mod settings;
mod spin;

pub use budget::Budget;
/// The limits an [`Interposer`] and a [`Budget`] are opened for.
pub use gpushare_isolation_budget::Limits;
pub use interposer::Place;
pub use interposer::{CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, Interposer};
pub use settings::Settings;
