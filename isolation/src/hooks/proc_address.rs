//! `cuGetProcAddress`(`_v2`): how CUDA 11.3+ runtimes fetch every entry point, by base name
//! (`"cuMemAlloc"`), for a CUDA version and per-thread-stream flags. The driver answers, and
//! if its answer is the real address of an entry point we hook (say `cuMemAllocAsync_ptsz`,
//! or the v1 `cuMemAlloc` for an old version), our hook of that exact variant is swapped in.

use std::ffi::{CStr, c_char, c_int};
use std::sync::OnceLock;

use crate::driver::{self, Handle, Status};
use crate::process::{forward, guard, read_out, state};

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

/// `(index into the table of hooks, real address)` of every hooked entry point `cuda` has:
/// what `cuGetProcAddress` answers may be swapped for one of these hooks. Looked up once,
/// outside the `OnceLock`'s set-up (as the driver itself is: `driver::cuda`).
fn swaps(cuda: &driver::RealCuda) -> &'static [(usize, usize)] {
    static SWAPS: OnceLock<Vec<(usize, usize)>> = OnceLock::new();
    if let Some(swaps) = SWAPS.get() {
        return swaps;
    }
    let found = super::CUDA
        .iter()
        .enumerate()
        .filter_map(|(index, hook)| {
            let real = driver::lookup(cuda.handle, hook.name);
            (!real.is_null()).then_some((index, real as usize))
        })
        .collect();
    SWAPS.get_or_init(|| found)
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
    let hooks = &*super::CUDA;
    let hook = swaps(cuda).iter().find_map(|&(index, real)| {
        let hook = &hooks[index];
        (real == answered && base_name(hook.name.to_bytes()) == asked).then_some(hook.address)
    });
    if let Some(hook) = hook {
        // SAFETY: the caller's non-null place for the answer.
        unsafe { pfn.write(hook.cast_mut()) };
    }
}

/// # Safety
/// As `cuGetProcAddress`: the driver answers, and an entry point we hook is swapped for our
/// hook of that exact variant.
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
