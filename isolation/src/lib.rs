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
//! program, and sees every process of the container (the plugin sets `LD_PRELOAD` in the
//! container's environment). Limits come from the read-only limits file the plugin mounts
//! (`gpushare_isolation_budget::prepared`), which no process of the container can change
//! for its children, and only where there is none from the environment
//! ([`gpushare_isolation_budget::limits`]); see `source`. Without either, every call passes
//! through unchanged.
//!
//! # The ways to the driver
//!
//! 1. **Linked**: the program's undefined `cuMemAlloc_v2` binds to our export of that name,
//!    which forwards to the real one in the driver (`driver`: the `libcuda.so.1` already
//!    loaded, else the one in the process's global scope, else `libcuda.so.1` loaded now).
//! 2. **`dlopen` + `dlsym`**: we export `dlsym` (module `dlsym`). The real one
//!    (from `dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5")`, else `GLIBC_2.34`/`2.17`) answers;
//!    when the name is one we hook, limits are set and the object that answered is the
//!    driver the hooks forward to (a driver opened by path binds them to itself, found by
//!    `dladdr`, if it is the first the program uses), our hook is answered instead. Any
//!    other lookup is a tail-jump to glibc's `dlsym` that touches no state.
//! 3. **`cuGetProcAddress`(`_v2`)**: CUDA 11.3+ runtimes fetch every entry point by base name
//!    (`"cuMemAlloc"`), for a CUDA version and per-thread-stream flags. We let the driver
//!    answer, and if its answer is the real address of an entry point we hook (say
//!    `cuMemAllocAsync_ptsz`, or the 32-bit v1 `cuMemAlloc` for a version before 3.2), swap
//!    in our hook of that exact variant.
//!
//! All the hooks are in one table (`hooks`), which all three read.
//!
//! # What is counted
//!
//! What the GPU holds for the container, on the GPU the driver puts it on (see
//! [`Interposer`] for how each holder is charged, and `docs/isolation.md`
//! for the table of cases):
//! - allocations per pointer or handle: `cuMemAlloc` (v2 and v1), `cuMemAllocPitch`,
//!   `cuMemAllocManaged` (unless `GPUSHARE_MANAGED_MEMORY=ignore`), the arrays (estimated from
//!   their descriptors);
//! - each context, what it took (measured through NVML around its creation) or
//!   [`Settings::context_bytes`], from its creation to its destruction or reset, which also
//!   gives back everything made in it;
//! - stream-ordered pools, what each reserves, on its own GPU;
//! - VMM handles (`cuMemCreate`), until released and mapped nowhere;
//! - graph memory, what each GPU's graph pool reserves (a node asking more than is left is
//!   refused when added); `cuCtxSetLimit` raises of the heap, printf buffer and stack.
//!
//! An allocation that would take the container past its share on that GPU returns
//! `CUDA_ERROR_OUT_OF_MEMORY` and never reaches the driver. `cuMemGetInfo`,
//! `cuDeviceTotalMem` and `nvmlDeviceGetMemoryInfo`(`_v2`) report the share as total,
//! `min(share - used, the driver's free)` as free and the rest as used. GPUs are told apart by
//! UUID (`devices`), so `CUDA_VISIBLE_DEVICES` cannot make two processes count one GPU as two.
//!
//! # Compute: a share of SM time
//!
//! Where the container has a compute share (`GPUSHARE_COMPUTE_PERCENT`, or the limits file's
//! `compute_percent`), every kernel and graph launch is held to it ([`compute`]): `shared`
//! (work-conserving, the default) or `capped`. Busy time is measured with CUDA events around
//! each held launch; the containers on one GPU share a file of atomics in the node-wide
//! compute directory. Without a share a launch only finds that there is none.
//!
//! # One budget per container
//!
//! All processes of a container share one [`budget`] file (protocol documented there; the
//! versioned layout, the file's name and the limits are in `gpushare-isolation-budget`):
//! atomics in a shared mapping, no lock on the allocation path. A process that dies without
//! freeing gives its bytes back when another allocation would be refused or memory is
//! queried; a program started by `exec` gives back the earlier one's when the library is
//! loaded. The plugin reads the file with that crate's safe reader, never through this one.
//!
//! # Never takes the program down
//!
//! No panic crosses the FFI boundary (every export runs in `catch_unwind`). `fork` is
//! handled (the child gets its own slot and an empty record).
//!
//! # Fails closed
//!
//! Limits that are set but cannot be applied (a malformed limits file or variable, a budget
//! that cannot be opened, mapped or validated, a prepared budget that is missing) do not
//! let the program past them: every allocation, of every kind, context creation included,
//! returns `CUDA_ERROR_OUT_OF_MEMORY`, and one line on stderr says why and what to do.
//! Queries still answer, every GPU full: the share as total (the driver's total where the
//! shares could not be read) and nothing free.
//! The shipped library needs no glibc symbol newer than 2.17 (`scripts/build-interposer.sh`),
//! so it loads in old images.
//!
//! # What it cannot catch
//!
//! - Programs that talk to `/dev/nvidia*` directly, or link the driver statically: they never
//!   pass through the dynamic linker.
//! - Off x86_64 and aarch64, `RTLD_NEXT` lookups made through our `dlsym` may resolve from
//!   after this library rather than after their caller. On those two our `dlsym` is a
//!   trampoline that jumps to glibc's with the caller's return address, so glibc sees the
//!   true caller.
//! - A context is charged what the GPU's free memory dropped by while it was made (another
//!   container's allocations at that moment move it), or `GPUSHARE_CONTEXT_MIB` / 512 MiB
//!   where NVML cannot say; module code loaded later is not counted.
//! - Graph memory is held to the share node by node; a graph whose nodes fit one by one but
//!   not together runs past it (then everything else is refused until it is trimmed).
//! - Memory the driver grows on its own at a kernel launch (local memory for a kernel that
//!   needs more than the stack limit) is not counted; nor are graph memory nodes added by
//!   `cuGraphAddNode` or changed in an instantiated graph (they are counted when the graph
//!   runs, not refused node by node).
//! - Processes sharing a budget across PID namespaces (a DRA claim's containers) are told
//!   apart by their slot locks (open-file-description locks); on a filesystem without them,
//!   dead slots are found by pid, which only holds within one PID namespace.
//! - A child created without `fork`'s handlers (a raw `clone`) that does not `exec` keeps
//!   its parent's slot lock, and so the parent's slot alive, until it exits.
//! - A second CUDA driver in one process (after the first was bound) is passed through.
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
pub mod compute;
mod devices;
mod dlsym;
mod driver;
mod hooks;
mod interposer;
pub mod ledger;
mod process;
/// The settings besides the shares, read by the budget crate's rules (the plugins link the
/// same parse to check what they write).
pub use gpushare_isolation_budget::settings;
mod source;
mod spin;

pub use budget::Budget;
pub use compute::Throttle;
/// The limits an [`Interposer`] and a [`Budget`] are opened for.
pub use gpushare_isolation_budget::Limits;
pub use interposer::Place;
pub use interposer::{CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, Interposer};
pub use settings::Settings;
