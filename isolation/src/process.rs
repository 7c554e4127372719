//! This process's interposer state and what every hook shares: set-up (from the limits
//! file or the environment, see [`crate::source`]),
//! `fork` handlers, the panic guard, the real entry points, and where the current
//! allocation goes ([`here`]).

use std::ffi::{c_int, c_void};
use std::panic::AssertUnwindSafe;
use std::sync::OnceLock;

use crate::budget::Budget;
use crate::devices;
use crate::driver::{self, Handle, Status};
use crate::interposer::{Interposer, Place};
use crate::source;

/// This process's accounting: see [`state`].
static STATE: OnceLock<Option<Interposer>> = OnceLock::new();

/// This process's accounting, set up on first use ([`crate::source`]): `None` when no
/// limits are set (then every hook passes through). Limits that are set but cannot be
/// applied give an interposer over a closed budget, which refuses every allocation (one line
/// on stderr says why).
pub(crate) fn state() -> Option<&'static Interposer> {
    STATE.get_or_init(set_up).as_ref()
}

fn set_up() -> Option<Interposer> {
    let opened = match source::resolve() {
        Ok(None) => return None,
        Ok(Some(resolved)) => resolved.open().map(|budget| (budget, resolved.settings)),
        Err(failure) => Err(failure),
    };
    let (budget, settings) = match opened {
        Ok(opened) => opened,
        Err(failure) => {
            eprintln!("{}", failure.message());
            match Budget::closed(failure.limits.as_ref()) {
                Ok(closed) => (closed, failure.settings),
                Err(e) => {
                    eprintln!("gpushare-isolation: cannot even refuse GPU memory: {e}");
                    return None;
                }
            }
        }
    };
    // SAFETY: plain functions that only read `STATE` without blocking on it.
    unsafe {
        libc::pthread_atfork(
            Some(before_fork),
            Some(after_fork_parent),
            Some(after_fork_child),
        )
    };
    Some(Interposer::with_budget(budget, settings).with_room_maker(make_room))
}

/// Run when the library is loaded into a program: a program started by `exec` gives back
/// at once what the earlier program of its process held (the driver freed it with that
/// program), instead of at its first allocation, which a launcher may never make.
///
/// Only where limits are set (found as [`state`] finds them: the limits file, else the
/// environment) and the budget file already exists (the plugin prepared it, or an earlier
/// program that held a slot made it): a process that never uses the GPU creates nothing.
/// Opening a finished budget takes no lock, so no process start waits on another process of
/// the container.
extern "C" fn on_load() {
    let _ = std::panic::catch_unwind(|| {
        let Ok(Some(resolved)) = source::resolve() else {
            return;
        };
        if resolved.budget.exists()
            && let Some(interposer) = state()
        {
            interposer.forget_earlier_program();
        }
    });
}

#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = on_load;

/// The state if it is set, never waiting for (or starting) its set-up: for fork handlers.
fn state_if_set() -> Option<&'static Interposer> {
    STATE.get().and_then(Option::as_ref)
}

extern "C" fn before_fork() {
    let _ = std::panic::catch_unwind(|| state_if_set().map(Interposer::before_fork));
}

extern "C" fn after_fork_parent() {
    let _ = std::panic::catch_unwind(|| state_if_set().map(Interposer::after_fork_in_parent));
}

extern "C" fn after_fork_child() {
    let _ = std::panic::catch_unwind(|| state_if_set().map(Interposer::after_fork_in_child));
}

/// Runs a hook's body; a panic becomes `on_panic`.
pub(crate) fn guard(on_panic: Status, body: impl FnOnce() -> Status) -> Status {
    std::panic::catch_unwind(AssertUnwindSafe(body)).unwrap_or(on_panic)
}

/// The real CUDA entry point `pick` chooses, or the status to answer without it.
pub(crate) fn real<F>(pick: impl FnOnce(&driver::Cuda) -> Option<F>) -> Result<F, Status> {
    let cuda = driver::cuda().ok_or(driver::CUDA_ERROR_NOT_INITIALIZED)?;
    pick(&cuda.fns).ok_or(driver::CUDA_ERROR_NOT_FOUND)
}

/// The real NVML entry point `pick` chooses, or the status to answer without it.
pub(crate) fn real_nvml<F>(pick: impl FnOnce(&driver::Nvml) -> Option<F>) -> Result<F, Status> {
    let nvml = driver::nvml().ok_or(driver::NVML_ERROR_LIBRARY_NOT_FOUND)?;
    pick(nvml).ok_or(driver::NVML_ERROR_FUNCTION_NOT_FOUND)
}

/// Calls the real entry point `$pick` with the caller's arguments, or answers why not.
macro_rules! forward {
    ($pick:ident($($arg:expr),*)) => {
        match $crate::process::real(|c| c.$pick) {
            // SAFETY: the caller's arguments, passed on unchanged to the real entry point.
            Ok(f) => unsafe { f($($arg),*) },
            Err(status) => status,
        }
    };
}
pub(crate) use forward;

/// Reads a value the driver wrote (the default if the place is null).
pub(crate) fn read_out<T: Copy + Default>(place: *const T) -> T {
    if place.is_null() {
        T::default()
    } else {
        // SAFETY: the driver wrote this place on success; it is the caller's and aligned.
        unsafe { place.read() }
    }
}

/// The current context's device ordinal, through the real driver.
pub(crate) fn current_ordinal() -> Option<c_int> {
    let get = real(|c| c.ctx_get_device).ok()?;
    let mut device: c_int = -1;
    // SAFETY: a place for the answer.
    let status = unsafe { get(&mut device) };
    (status == 0 && device >= 0).then_some(device)
}

/// The current context, through the real driver (0 for none).
pub(crate) fn current_context() -> u64 {
    let Ok(get) = real(|c| c.ctx_get_current) else {
        return 0;
    };
    let mut ctx: Handle = std::ptr::null_mut();
    // SAFETY: a place for the answer.
    if unsafe { get(&mut ctx) } == 0 {
        ctx as u64
    } else {
        0
    }
}

/// Where an allocation made now goes: the current context and its GPU's budget index,
/// with the context charged if it was not yet. `None`: no current context (the driver will
/// refuse the call itself).
pub(crate) fn here(interposer: &Interposer) -> Option<Here> {
    let ctx = current_context();
    let ordinal = current_ordinal()?;
    let gpu = devices::gpu_of_ordinal(interposer.settings(), ordinal);
    if let Some(gpu) = gpu {
        interposer.ensure_context(ctx, gpu);
    }
    Some(Here { ordinal, ctx, gpu })
}

/// See [`here`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Here {
    /// The current device's CUDA ordinal.
    pub ordinal: c_int,
    /// The current context.
    pub ctx: u64,
    /// Its budget index; `None`: a GPU the container has no share of.
    pub gpu: Option<usize>,
}

impl Here {
    /// The place of an allocation made here; a GPU outside the budget gets an index past
    /// it, which refuses everything.
    pub(crate) fn place(&self) -> Place {
        Place {
            gpu: self.gpu.unwrap_or(usize::MAX),
            ctx: self.ctx,
        }
    }
}

/// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`.
pub(crate) const POOL_RESERVED: c_int = 5;
/// `CU_MEMPOOL_ATTR_USED_MEM_CURRENT`.
pub(crate) const POOL_USED: c_int = 7;
/// `CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`.
const GRAPH_RESERVED: c_int = 2;

/// A pool's attribute (a `cuuint64_t`), through the real driver.
pub(crate) fn pool_attribute(pool: u64, attribute: c_int) -> Option<u64> {
    let get = real(|c| c.mem_pool_get_attribute).ok()?;
    let mut value: u64 = 0;
    // SAFETY: a pool handle and a place for a cuuint64_t.
    let status = unsafe { get(pool as Handle, attribute, (&raw mut value).cast::<c_void>()) };
    (status == 0).then_some(value)
}

/// Re-reads every pool this process charges.
pub(crate) fn refresh_pools(interposer: &Interposer) -> u64 {
    interposer
        .pools()
        .into_iter()
        .map(|pool| interposer.refresh_pool_with(pool, || pool_attribute(pool, POOL_RESERVED)))
        .sum()
}

/// Re-reads the graph memory every GPU of the container reserves in this process.
///
/// Only once the program has used the driver: a memory query through NVML before then must
/// not load the driver (and so bind the hooks to the default one).
pub(crate) fn refresh_graph_memory(interposer: &Interposer) -> u64 {
    let Some(get) = driver::cuda_if_loaded().and_then(|c| c.fns.device_get_graph_mem_attribute)
    else {
        return 0;
    };
    let mut given_back = 0;
    let mut seen = [false; gpushare_isolation_budget::layout::MAX_GPUS];
    for (ordinal, gpu) in devices::known_ordinals() {
        if seen.get(gpu).copied().unwrap_or(true) {
            continue;
        }
        seen[gpu] = true;
        let mut reserved: u64 = 0;
        // SAFETY: a device ordinal and a place for a cuuint64_t.
        let status = unsafe {
            get(
                ordinal,
                GRAPH_RESERVED,
                (&raw mut reserved).cast::<c_void>(),
            )
        };
        if status == 0 {
            given_back += interposer.set_graph_charge(gpu, reserved);
        }
    }
    given_back
}

/// The interposer's [`crate::interposer::RoomMaker`]: re-reads pools and graph memory.
fn make_room(interposer: &Interposer) -> bool {
    let pools = refresh_pools(interposer);
    let graphs = refresh_graph_memory(interposer);
    pools + graphs > 0
}
