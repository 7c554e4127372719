//! Our `dlsym`: how a program that `dlopen`s the driver (the CUDA runtime does) reaches our
//! hooks. A lookup of a name we hook, in the driver the hooks forward to, with limits set,
//! is answered with our hook; every other lookup goes to glibc's `dlsym`, untouched.

use std::ffi::{CStr, c_char, c_void};

use crate::driver;
use crate::hooks;
use crate::process::state;

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
        let hook = hooks::hook_for(name)?;
        state()?;
        // SAFETY: the caller's arguments. Only names we hook are looked up from here (an
        // RTLD_NEXT lookup of them resolves from after this library, which is where the
        // driver is).
        let found = unsafe { real(handle, symbol) };
        if found.is_null() {
            return None;
        }
        // Our hooks forward to one driver: answer with them only where the program looked
        // in that very driver (bound to it if it is the first the program used).
        let ours = if name.starts_with(b"nvml") {
            true
        } else {
            driver::bind_cuda(found)
        };
        ours.then_some(hook.cast_mut())
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
/// As `dlsym`: the aarch64 trampoline. The frame record (x29, x30) and the caller's two
/// arguments are saved, `dlsym_route` asked (`Route` comes back in x0 and x1), everything
/// restored; then our hook is returned, or glibc's `dlsym` is entered by `br x17` with the
/// caller's arguments and return address (x30) untouched, so that glibc sees the true caller.
/// x16/x17 are the intra-procedure-call registers: free to use here, and a branch through
/// them may land on a `bti c` landing pad.
#[cfg(target_arch = "aarch64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    std::arch::naked_asm!(
        "stp x29, x30, [sp, #-32]!",
        "mov x29, sp",
        "stp x0, x1, [sp, #16]",
        "bl {route}",
        "mov x16, x0",
        "mov x17, x1",
        "ldp x0, x1, [sp, #16]",
        "ldp x29, x30, [sp], #32",
        "cbnz x16, 2f",
        "cbz x17, 3f",
        "br x17",
        "2:",
        "mov x0, x16",
        "ret",
        "3:",
        "mov x0, xzr",
        "ret",
        route = sym dlsym_route,
    )
}

/// # Safety
/// As `dlsym`. On architectures without a trampoline, the real `dlsym` is called from
/// here, so an `RTLD_NEXT` lookup resolves from after this library, not after its caller.
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
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

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;
