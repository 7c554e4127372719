//! Kernel launches (`cuLaunchKernel`, `cuLaunchKernelEx`, `cuLaunchCooperativeKernel`, each
//! with its per-thread-stream `_ptsz` variant): held to the container's compute share
//! ([`crate::compute`]). `cuGraphLaunch` is held the same way, in `graphs`.
//!
//! Without a compute share (or with `off`) a launch only looks for the throttle and
//! forwards ([`held`]'s first line): the bench's `launch` group measures that.

use std::ffi::{c_int, c_uint, c_void};

use crate::compute::Throttle;
use crate::devices;
use crate::driver::{self, Handle, Status};
use crate::interposer::Interposer;
use crate::process::{current_context, current_ordinal, forward, guard, state};
use crate::settings::format_uuid;

/// `CUlaunchConfig`'s head: the grid and block, shared memory, then the stream.
#[repr(C)]
#[derive(Clone, Copy)]
struct LaunchConfigHead {
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared_mem_bytes: c_uint,
    stream: Handle,
}

/// Runs `call`, a launch on `stream` (`ptsz`: a per-thread-stream variant), held to the
/// container's compute share when it has one.
#[inline]
pub(crate) fn held(stream: Handle, ptsz: bool, call: impl FnOnce() -> Status) -> Status {
    match state().and_then(Interposer::throttle) {
        None => call(),
        Some(throttle) => held_by(throttle, stream, ptsz, call),
    }
}

#[inline(never)]
fn held_by(
    throttle: &Throttle,
    stream: Handle,
    ptsz: bool,
    call: impl FnOnce() -> Status,
) -> Status {
    let Some(cuda) = driver::cuda() else {
        return call();
    };
    let fns = &cuda.fns;
    if capturing(fns, stream, ptsz) {
        // Recorded into a graph, not run: held when the graph is launched.
        return call();
    }
    let ctx = current_context();
    let Some(ordinal) = current_ordinal().filter(|_| ctx != 0) else {
        return call();
    };
    let Some(gpu) = throttle.gpu(ordinal, || {
        devices::cuda_uuid(ordinal).map(|u| format_uuid(&u))
    }) else {
        return call();
    };
    let poll = || {
        throttle
            .measure
            .lock()
            .poll(fns, |charge, took| throttle.settle(charge, took))
    };
    let Some(charge) = throttle.hold(ordinal, gpu, poll) else {
        return call();
    };
    let record = if ptsz {
        fns.event_record_ptsz
    } else {
        fns.event_record
    };
    let pair =
        record.and_then(|record| Some((throttle.measure.lock().take_pair(ctx, fns)?, record)));
    let started = pair.filter(|((start, _), record)| {
        // SAFETY: an event of the current context, on the caller's stream.
        unsafe { record(*start as Handle, stream) == 0 }
    });
    let status = call();
    let Some(((start, end), record)) = started else {
        if let Some(((start, end), _)) = pair {
            // Not recordable (a context destroyed under them): not kept.
            crate::compute::destroy_events(fns, &[start, end]);
        }
        if status != 0 {
            throttle.refund(charge);
        }
        return status;
    };
    // SAFETY: as above.
    let ended = status == 0 && unsafe { record(end as Handle, stream) } == 0;
    if ended {
        throttle.measure.lock().launched(ctx, (start, end), charge);
    } else {
        crate::compute::destroy_events(fns, &[start, end]);
        if status != 0 {
            throttle.refund(charge);
        }
    }
    status
}

/// Whether `stream` is capturing a graph (an error reads as not).
fn capturing(fns: &driver::Cuda, stream: Handle, ptsz: bool) -> bool {
    let is_capturing = if ptsz {
        fns.stream_is_capturing_ptsz
    } else {
        fns.stream_is_capturing
    };
    let Some(is_capturing) = is_capturing else {
        return false;
    };
    let mut status: c_int = 0;
    // SAFETY: the caller's stream and a place for the answer.
    (unsafe { is_capturing(stream, &mut status) }) == 0 && status != 0
}

/// The stream a `CUlaunchConfig` names (null: the default stream).
fn config_stream(config: *const c_void) -> Handle {
    if config.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: the caller's non-null CUlaunchConfig, which starts with this head.
    unsafe { config.cast::<LaunchConfigHead>().read_unaligned() }.stream
}

/// # Safety
/// As `cuLaunchKernel`: held to the compute share.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: Handle,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared_mem_bytes: c_uint,
    stream: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        held(stream, false, || {
            forward!(launch_kernel(
                f,
                grid_x,
                grid_y,
                grid_z,
                block_x,
                block_y,
                block_z,
                shared_mem_bytes,
                stream,
                params,
                extra
            ))
        })
    })
}

/// # Safety
/// As `cuLaunchKernel_ptsz`: held to the compute share.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel_ptsz(
    f: Handle,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared_mem_bytes: c_uint,
    stream: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        held(stream, true, || {
            forward!(launch_kernel_ptsz(
                f,
                grid_x,
                grid_y,
                grid_z,
                block_x,
                block_y,
                block_z,
                shared_mem_bytes,
                stream,
                params,
                extra
            ))
        })
    })
}

/// # Safety
/// As `cuLaunchKernelEx`: held to the compute share.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx(
    config: *const c_void,
    f: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        held(config_stream(config), false, || {
            forward!(launch_kernel_ex(config, f, params, extra))
        })
    })
}

/// # Safety
/// As `cuLaunchKernelEx_ptsz`: held to the compute share.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx_ptsz(
    config: *const c_void,
    f: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        held(config_stream(config), true, || {
            forward!(launch_kernel_ex_ptsz(config, f, params, extra))
        })
    })
}

/// # Safety
/// As `cuLaunchCooperativeKernel`: held to the compute share.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchCooperativeKernel(
    f: Handle,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared_mem_bytes: c_uint,
    stream: Handle,
    params: *mut *mut c_void,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        held(stream, false, || {
            forward!(launch_cooperative(
                f,
                grid_x,
                grid_y,
                grid_z,
                block_x,
                block_y,
                block_z,
                shared_mem_bytes,
                stream,
                params
            ))
        })
    })
}

/// # Safety
/// As `cuLaunchCooperativeKernel_ptsz`: held to the compute share.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchCooperativeKernel_ptsz(
    f: Handle,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared_mem_bytes: c_uint,
    stream: Handle,
    params: *mut *mut c_void,
) -> Status {
    guard(driver::CUDA_ERROR_UNKNOWN, || {
        held(stream, true, || {
            forward!(launch_cooperative_ptsz(
                f,
                grid_x,
                grid_y,
                grid_z,
                block_x,
                block_y,
                block_z,
                shared_mem_bytes,
                stream,
                params
            ))
        })
    })
}
