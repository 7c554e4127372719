//! Contexts: each costs the device memory that no allocation call shows (its code, stacks,
//! heap, printf buffer), so each is charged `GPUSHARE_CONTEXT_MIB` when it is made, and
//! everything made in it is given back when it is destroyed or reset (`cudaDeviceReset`,
//! numba's `cuda.close()`). `cuCtxSetLimit` raising the heap, the printf buffer or the stack
//! is charged what it adds.

use std::ffi::{c_int, c_uint, c_void};

use crate::devices;
use crate::driver::{self, Handle, Status};
use crate::interposer::Interposer;
use crate::process::{forward, guard, here, read_out, real, state};

/// How long a context's maker waits for its turn to measure (another process of the
/// container making one) before it goes on unmeasured.
const MEASURE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);
/// The least a context is taken to cost: a smaller drop is noise (a retain of a context
/// already made), not a context.
const MEASURE_MIN: u64 = 32 << 20;

/// What the driver's free memory on device `ordinal` dropped by during `make` (NVML, read
/// around it), with `make`'s answer; the drop is `None` when it cannot be read or makes no
/// sense: under 32 MiB, or over four times the configured charge (another process took or
/// gave memory meanwhile). The container's processes and threads take turns (the budget
/// file's lock, on a descriptor of each maker's own), so that two contexts made at once
/// are not each charged both; a maker that waits 2 s for its turn goes on unmeasured.
fn measuring<T>(
    interposer: &Interposer,
    ordinal: c_int,
    make: impl FnOnce() -> T,
) -> (T, Option<u64>) {
    if !interposer.settings().measure_context || !devices::nvml_ready() {
        return (make(), None);
    }
    let Some(_turn) = interposer.budget().exclusive(MEASURE_PATIENCE) else {
        return (make(), None);
    };
    let before = devices::driver_free(ordinal);
    let made = make();
    let after = devices::driver_free(ordinal);
    let most = interposer.settings().context_bytes.saturating_mul(4);
    let drop = match (before, after) {
        (Some(before), Some(after)) => before
            .checked_sub(after)
            .filter(|d| (MEASURE_MIN..=most).contains(d)),
        _ => None,
    };
    (made, drop)
}

/// A context made on device `ordinal` by `call`, which writes it to `pctx`.
fn create(pctx: *mut Handle, ordinal: c_int, call: impl FnOnce() -> Status) -> Status {
    let Some(interposer) = state() else {
        return call();
    };
    let Some(gpu) = devices::gpu_of_ordinal(interposer.settings(), ordinal) else {
        return call();
    };
    let drop = std::cell::Cell::new(None);
    let made = interposer.create_context_measured(
        gpu,
        || {
            let (status, measured) = measuring(interposer, ordinal, call);
            drop.set(measured);
            match status {
                0 => Ok(read_out(pctx.cast_const()) as u64),
                code => Err(code),
            }
        },
        || drop.get(),
    );
    match made {
        Ok(_) => 0,
        Err(code) => code,
    }
}

/// After a context (or everything in it) is gone: the driver freed its pools' and graphs'
/// memory with it, so they are re-read.
fn after_context_gone(interposer: &Interposer) {
    crate::process::refresh_pools(interposer);
    crate::process::refresh_graph_memory(interposer);
}

/// # Safety
/// As `cuCtxCreate_v2`: the context is charged on its GPU.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(pctx: *mut Handle, flags: c_uint, dev: c_int) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        create(pctx, dev, || forward!(ctx_create_v2(pctx, flags, dev)))
    })
}

/// # Safety
/// As `cuCtxCreate_v3`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v3(
    pctx: *mut Handle,
    params: *mut c_void,
    count: c_int,
    flags: c_uint,
    dev: c_int,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        create(pctx, dev, || {
            forward!(ctx_create_v3(pctx, params, count, flags, dev))
        })
    })
}

/// # Safety
/// As `cuCtxCreate_v4`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v4(
    pctx: *mut Handle,
    params: *mut c_void,
    flags: c_uint,
    dev: c_int,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        create(pctx, dev, || {
            forward!(ctx_create_v4(pctx, params, flags, dev))
        })
    })
}

/// # Safety
/// As `cuCtxDestroy_v2`: the context's charge and everything made in it come back.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxDestroy_v2(ctx: Handle) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let status = forward!(ctx_destroy(ctx));
        if status == 0
            && let Some(interposer) = state()
        {
            interposer.drop_context(ctx as u64);
            after_context_gone(interposer);
        }
        status
    })
}

/// # Safety
/// As `cuDevicePrimaryCtxRetain`: the first retain makes the primary context, charged.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut Handle, dev: c_int) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let call = || forward!(primary_retain(pctx, dev));
        let Some(interposer) = state() else {
            return call();
        };
        let Some(gpu) = devices::gpu_of_ordinal(interposer.settings(), dev) else {
            return call();
        };
        let drop = std::cell::Cell::new(None);
        interposer.retain_primary(
            dev,
            gpu,
            || {
                let (status, measured) = measuring(interposer, dev, call);
                drop.set(measured);
                match status {
                    0 => Ok(read_out(pctx.cast_const()) as u64),
                    code => Err(code),
                }
            },
            || drop.get(),
        )
    })
}

fn released(dev: c_int, status: Status) -> Status {
    if status == 0
        && let Some(interposer) = state()
    {
        interposer.release_primary(dev);
        after_context_gone(interposer);
    }
    status
}

fn reset(dev: c_int, status: Status) -> Status {
    if status == 0
        && let Some(interposer) = state()
    {
        interposer.reset_primary(dev);
        after_context_gone(interposer);
    }
    status
}

/// # Safety
/// As `cuDevicePrimaryCtxRelease`: the last release destroys the primary context.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease(dev: c_int) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        released(dev, forward!(primary_release(dev)))
    })
}

/// # Safety
/// As `cuDevicePrimaryCtxRelease_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: c_int) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        released(dev, forward!(primary_release_v2(dev)))
    })
}

/// # Safety
/// As `cuDevicePrimaryCtxReset`: everything in the primary context comes back.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset(dev: c_int) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        reset(dev, forward!(primary_reset(dev)))
    })
}

/// # Safety
/// As `cuDevicePrimaryCtxReset_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset_v2(dev: c_int) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        reset(dev, forward!(primary_reset_v2(dev)))
    })
}

/// `CU_LIMIT_STACK_SIZE`: bytes per thread, for every thread the device can hold.
const LIMIT_STACK_SIZE: c_int = 0;
/// `CU_LIMIT_PRINTF_FIFO_SIZE`.
const LIMIT_PRINTF_FIFO_SIZE: c_int = 1;
/// `CU_LIMIT_MALLOC_HEAP_SIZE`.
const LIMIT_MALLOC_HEAP_SIZE: c_int = 2;
/// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`.
const ATTRIBUTE_MULTIPROCESSORS: c_int = 16;
/// `CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR`.
const ATTRIBUTE_THREADS_PER_MULTIPROCESSOR: c_int = 39;

/// A device attribute, through the real driver.
fn attribute(ordinal: c_int, attribute: c_int) -> Option<u64> {
    let get = real(|c| c.device_get_attribute).ok()?;
    let mut value: c_int = 0;
    // SAFETY: a place for the answer, an attribute and a device ordinal.
    (unsafe { get(&mut value, attribute, ordinal) } == 0)
        .then(|| u64::try_from(value).ok())
        .flatten()
}

/// # Safety
/// As `cuCtxSetLimit`: raising the heap, the printf buffer or the stack past what the share
/// has left is refused with `CUDA_ERROR_OUT_OF_MEMORY`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSetLimit(limit: c_int, value: usize) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        let call = || forward!(ctx_set_limit(limit, value));
        if !matches!(
            limit,
            LIMIT_STACK_SIZE | LIMIT_PRINTF_FIFO_SIZE | LIMIT_MALLOC_HEAP_SIZE
        ) {
            return call();
        }
        let (Some(interposer), Ok(get)) = (state(), real(|c| c.ctx_get_limit)) else {
            return call();
        };
        let Some(here) = here(interposer) else {
            return call();
        };
        let mut old: usize = 0;
        // SAFETY: a place for the answer and a limit.
        if unsafe { get(&mut old, limit) } != 0 {
            return call();
        }
        let per_unit = if limit == LIMIT_STACK_SIZE {
            let sms = attribute(here.ordinal, ATTRIBUTE_MULTIPROCESSORS).unwrap_or(1);
            let threads =
                attribute(here.ordinal, ATTRIBUTE_THREADS_PER_MULTIPROCESSOR).unwrap_or(1);
            sms.saturating_mul(threads)
        } else {
            1
        };
        let delta = (value as i128 - old as i128) * i128::from(per_unit);
        interposer.change_limit(here.place(), limit as u8, delta, call)
    })
}
