//! A fake `libcuda.so.1` for gpushare-isolation's tests: simulated GPUs, no hardware.
//!
//! Built by this crate's `build.rs` with `rustc --crate-type cdylib` as `libcuda.so.1` and
//! again as `libcuda.so.550` (a driver of another soname); std only, so that it needs no
//! crate. Pointers and handles are numbers, never memory. It implements just what the probe
//! and the interposer call, with the driver's signatures and error codes, and takes device
//! memory the way a real GPU does.
//!
//! # Environment
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `FAKE_GPU_COUNT` | 1 | physical GPUs |
//! | `FAKE_GPU_MEM_MIB` | 16384 | memory of each |
//! | `FAKE_GPU_STATE` | unset | a file holding what each physical GPU holds, shared by every process naming it (format in `state.rs`); unset: each process sees a device of its own |
//! | `FAKE_CONTEXT_MIB` | 0 | device memory a context takes (primary or created), its default limits included |
//! | `FAKE_MANAGED_ON_HOST` | unset | `1`: `cuMemAllocManaged` takes no device memory (host-resident until touched); unset: it takes device memory |
//! | `CUDA_VISIBLE_DEVICES` | all | CUDA ordinals → physical GPUs: indices or `GPU-` UUIDs (prefixes), parsing stops at the first invalid or repeated entry |
//!
//! Physical GPU `i` has the UUID whose 16 bytes are 15 zeros then `i` (`cuDeviceGetUuid`),
//! written `GPU-00000000-0000-0000-0000-0000000000ii` (`ii` two hex digits, as NVML's
//! `nvmlDeviceGetUUID` returns it).
//!
//! # What takes device memory
//!
//! - Contexts: each `cuCtxCreate_v2`, and a device's primary context from its first
//!   `cuDevicePrimaryCtxRetain` until its last `cuDevicePrimaryCtxRelease_v2` or a
//!   `cuDevicePrimaryCtxReset_v2`. An allocation belongs to the context current when it was
//!   made; destroying the context frees it. `cuCtxSetLimit` takes or gives back the change
//!   (heap and printf FIFO: bytes; stack: bytes × 16 SMs × 64 threads), from the defaults
//!   (8 MiB, 1 MiB, 1 KiB) which the context's cost includes.
//! - Plain allocations (`cuMemAlloc_v2`, pitch, arrays, the 32-bit v1 `cuMemAlloc` and
//!   `cuMemAllocPitch`, whose pointers are 32-bit values of their own range).
//! - Stream-ordered pools: an allocation reuses the pool's reserved-unused bytes and reserves
//!   the rest; `cuMemFreeAsync` (or `cuMemFree_v2`) returns bytes to the pool; at every
//!   synchronisation (`cuStreamSynchronize`(`_ptsz`), `cuCtxSynchronize`,
//!   `cuEventSynchronize`) each pool keeps max(used, release threshold) reserved;
//!   `cuMemPoolTrimTo` keeps max(used, min).
//! - VMM: `cuMemCreate`'s memory comes back once every reference is released
//!   (`cuMemRelease`; `cuMemRetainAllocationHandle` adds one) and no mapping uses it.
//! - Graphs: a device's graph pool reserves, at `cuGraphUpload` or `cuGraphLaunch`, enough for
//!   every allocation node of the graph on top of the graph allocations alive; it keeps that
//!   until `cuDeviceGraphMemTrim`. Nodes the graph frees itself (`cuGraphAddMemFreeNode`, or a
//!   `cuMemFreeAsync` captured) are not alive after the launch; the others are until freed.
//!   `cuMemAllocAsync` on a capturing stream adds a node and takes nothing.
//! - Managed memory: see `FAKE_MANAGED_ON_HOST`.
//!
//! # Kernel execution
//!
//! A kernel launch (`cuLaunchKernel`, `cuLaunchKernelEx`, `cuLaunchCooperativeKernel`, each
//! also `_ptsz`) holds its physical GPU for **as many microseconds as its grid has blocks**
//! (gridDimX × gridDimY × gridDimZ; any non-null function handle does); a graph launch
//! (`cuGraphLaunch`(`_ptsz`)) holds it for the sum of the kernels captured into the graph (a
//! launch on a capturing stream adds to the graph and runs nothing). Work runs one piece at a
//! time per GPU, in submission order across every process sharing `FAKE_GPU_STATE`
//! (time-slicing at kernel granularity): it starts at max(now, the time the GPU is free).
//! Launches return at once; `cuStreamSynchronize` waits for the stream's work (the default
//! stream: all of the process's), `cuCtxSynchronize` for all of it, `cuEventSynchronize` for
//! the event. An event (`cuEventRecord`) completes when the GPU reaches it in its stream:
//! right after the stream's earlier work; on an idle stream, with the stream's next work if
//! that comes soon (`Event::Pending`), else when the GPU was next free. `cuEventQuery` says
//! `CUDA_ERROR_NOT_READY` (600) before then, and `cuEventElapsedTime` gives the milliseconds
//! between two that have completed. Each run is logged in `FAKE_GPU_STATE.kernels` (format in
//! `state.rs`), which the tests and the fake NVML's utilization read.
//!
//! One export is not the driver's: `fakeHeldBytes(phys)`, what this copy of the fake holds for
//! this process on physical GPU `phys` (0 before its `cuInit`), which tells a test which of two
//! copies loaded in one process served the calls.
//!
//! Exported functions never call each other (an LD_PRELOADed interposer would catch the
//! call); they call private functions. Functions that would compile to the same code record
//! their own name, so that rustc does not merge them into one address.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::path::PathBuf;
use std::sync::Mutex;

include!("state.rs");
include!("abi.rs");

/// A pointer or handle as the driver's API passes it.
type Ptr = *mut c_void;
type CuResult = c_int;
const SUCCESS: CuResult = 0;
const INVALID_VALUE: CuResult = 1;
const OUT_OF_MEMORY: CuResult = 2;
const NOT_INITIALIZED: CuResult = 3;
const INVALID_DEVICE: CuResult = 101;
const INVALID_CONTEXT: CuResult = 201;
const INVALID_HANDLE: CuResult = 400;
const NOT_FOUND: CuResult = 500;
const NOT_READY: CuResult = 600;
const NOT_SUPPORTED: CuResult = 801;
const STREAM_CAPTURE_UNSUPPORTED: CuResult = 900;

const MIB: u64 = 1 << 20;
/// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT` and `..._MAX_THREADS_PER_MULTIPROCESSOR`.
const SMS: u64 = 16;
const THREADS_PER_SM: u64 = 64;
const DEFAULT_LIMITS: [u64; 3] = [1024, MIB, 8 * MIB]; // stack, printf FIFO, malloc heap
/// How soon after an event the stream's next work must come to start with it.
const BATCH_NS: u64 = 1_000_000;

/// Where an allocation's bytes are held.
#[derive(Clone, Copy, PartialEq)]
enum Holder {
    /// Device memory of its own (`bytes` of it; 0 for host-resident managed memory).
    Plain,
    /// A stream-ordered pool's reservation.
    Pool(u64),
    /// A device's graph pool (CUDA ordinal).
    Graph(usize),
}

struct Alloc {
    phys: usize,
    /// Device bytes taken (plain), or bytes used in the pool.
    bytes: u64,
    by: &'static str,
    ctx: u64,
    holder: Holder,
}

struct Ctx {
    dev: usize,
    phys: usize,
    /// Device bytes this context itself takes now.
    charged: u64,
    /// stack, printf FIFO, heap.
    limits: [u64; 3],
}

#[derive(Default)]
struct Pool {
    dev: usize,
    phys: usize,
    reserved: u64,
    used: u64,
    threshold: u64,
    reserved_high: u64,
    used_high: u64,
}

#[derive(Default, Clone, Copy)]
struct GraphPool {
    reserved: u64,
    used: u64,
    reserved_high: u64,
    used_high: u64,
}

#[derive(Clone, Copy)]
struct Node {
    dev: usize,
    bytes: u64,
    dptr: u64,
    freed_in_graph: bool,
}

struct Vmm {
    phys: usize,
    bytes: u64,
    refs: u32,
    maps: u32,
}

/// A timing event.
#[derive(Clone, Copy)]
enum Event {
    /// Made, never recorded.
    Unrecorded,
    /// Completes at this time.
    At(u64),
    /// Recorded at `recorded` on an idle `stream`: completes when this process's next work
    /// on the stream starts, if that is submitted within [`BATCH_NS`] (the driver hands a
    /// command and the launch after it to the GPU together, and a channel runs its commands
    /// back to back in its time slice), else at `fallback` (when the GPU was next free).
    Pending {
        stream: u64,
        recorded: u64,
        fallback: u64,
    },
}

impl Event {
    fn time(self) -> Option<u64> {
        match self {
            Event::Unrecorded => None,
            Event::At(at) | Event::Pending { fallback: at, .. } => Some(at),
        }
    }
}

#[derive(Default)]
struct Driver {
    mem: u64,
    gpus: usize,
    /// CUDA ordinal -> physical GPU.
    visible: Vec<usize>,
    state: Option<PathBuf>,
    pid: u32,
    start: u64,
    /// What this process holds on each physical GPU.
    used: Vec<u64>,
    context_cost: u64,
    managed_on_host: bool,
    allocs: HashMap<u64, Alloc>,
    next: u64,
    next_v1: u32,
    next_va: u64,
    next_graph_ptr: u64,
    next_handle: u64,
    ctxs: HashMap<u64, Ctx>,
    primary_refs: Vec<u32>,
    pools: HashMap<u64, Pool>,
    current_pool: Vec<u64>,
    vmm: HashMap<u64, Vmm>,
    /// virtual address -> (size, handle)
    maps: BTreeMap<u64, (u64, u64)>,
    reservations: HashMap<u64, u64>,
    graph_pools: Vec<GraphPool>,
    graphs: HashMap<u64, Vec<Node>>,
    execs: HashMap<u64, Vec<Node>>,
    /// stream -> the graph it is capturing into
    streams: HashMap<u64, Option<u64>>,
    /// The entry point of the last call that records one.
    last_call: &'static str,
    /// stream -> when the last work submitted on it ends (0: the default stream).
    tails: HashMap<u64, u64>,
    /// event -> when it completes.
    events: HashMap<u64, Event>,
    /// stream -> when work was last submitted on it.
    submits: HashMap<u64, u64>,
    /// graph -> nanoseconds of the kernels captured into it.
    graph_kernels: HashMap<u64, u64>,
    /// graph exec -> nanoseconds of its kernels.
    exec_kernels: HashMap<u64, u64>,
}

static DRIVER: Mutex<Option<Driver>> = Mutex::new(None);

thread_local! {
    /// The current context's handle, 0 for none.
    static CURRENT: Cell<u64> = const { Cell::new(0) };
}

/// 15 zero bytes, then `phys`.
fn uuid_bytes(phys: usize) -> [u8; 16] {
    u128::from(phys as u8).to_be_bytes()
}

/// `CUDA_VISIBLE_DEVICES` as the driver reads it.
fn visible_devices(gpus: usize) -> Vec<usize> {
    let Ok(list) = std::env::var("CUDA_VISIBLE_DEVICES") else {
        return (0..gpus).collect();
    };
    let mut visible = Vec::new();
    for entry in list.split(',').map(str::trim) {
        let phys = if entry.starts_with("GPU-") {
            let mut matching = (0..gpus).filter(|&i| uuid_string(i).starts_with(entry));
            matching.next().filter(|_| matching.next().is_none())
        } else {
            entry.parse::<usize>().ok().filter(|&i| i < gpus)
        };
        match phys {
            Some(p) if !visible.contains(&p) => visible.push(p),
            _ => break,
        }
    }
    visible
}

/// Takes the next 2 MiB-aligned range of `bytes` from `next`: its address.
fn bump(next: &mut u64, bytes: u64) -> u64 {
    let at = *next;
    *next += bytes.div_ceil(1 << 21).max(1) << 21;
    at
}

/// Primary context handles: one per CUDA ordinal.
fn primary_of(dev: usize) -> u64 {
    0x1000 + dev as u64 * 0x10
}

impl Driver {
    /// After a fork, the child holds nothing of its own yet.
    fn own_process(&mut self) {
        let pid = std::process::id();
        if pid != self.pid {
            self.pid = pid;
            self.start = state::start_time(pid).unwrap_or(0);
            self.used = vec![0; self.gpus];
        }
    }

    fn publish(&self, entries: &mut Vec<state::Entry>) {
        entries.retain(|e| e.pid != self.pid);
        entries.push(state::Entry {
            pid: self.pid,
            start: self.start,
            used: self.used.clone(),
        });
    }

    /// Takes `bytes` of device memory on physical GPU `phys`, or says OUT_OF_MEMORY.
    fn charge(&mut self, phys: usize, bytes: u64) -> Result<(), CuResult> {
        self.own_process();
        if bytes == 0 {
            return Ok(());
        }
        let Some(path) = self.state.clone() else {
            if self.used[phys] + bytes > self.mem {
                return Err(OUT_OF_MEMORY);
            }
            self.used[phys] += bytes;
            return Ok(());
        };
        state::update(&path, |entries| {
            let others: u64 = entries
                .iter()
                .filter(|e| e.pid != self.pid)
                .map(|e| e.used.get(phys).copied().unwrap_or(0))
                .sum();
            if others + self.used[phys] + bytes > self.mem {
                return Err(OUT_OF_MEMORY);
            }
            self.used[phys] += bytes;
            self.publish(entries);
            Ok(())
        })
        .unwrap_or(Err(NOT_SUPPORTED))
    }

    fn uncharge(&mut self, phys: usize, bytes: u64) {
        self.own_process();
        if bytes == 0 {
            return;
        }
        self.used[phys] = self.used[phys].saturating_sub(bytes);
        if let Some(path) = self.state.clone() {
            let _ = state::update(&path, |entries| self.publish(entries));
        }
    }

    /// What physical GPU `phys` holds: every live process's bytes, or this process's.
    fn device_used(&self, phys: usize) -> u64 {
        match &self.state {
            Some(path) => state::device_used(path, self.gpus)[phys],
            None => self.used[phys],
        }
    }

    fn phys(&self, dev: c_int) -> Result<usize, CuResult> {
        let dev = usize::try_from(dev).map_err(|_| INVALID_DEVICE)?;
        self.visible.get(dev).copied().ok_or(INVALID_DEVICE)
    }

    /// `dev` as an index, once it names a visible device.
    fn ordinal(&self, dev: c_int) -> Result<usize, CuResult> {
        self.phys(dev).map(|_| dev as usize)
    }

    fn handle(&mut self) -> u64 {
        self.next_handle += 0x10;
        self.next_handle
    }

    fn context_mut(&mut self, ctx: u64) -> Result<&mut Ctx, CuResult> {
        self.ctxs.get_mut(&ctx).ok_or(INVALID_CONTEXT)
    }

    /// The current context: (handle, CUDA ordinal, physical GPU).
    fn current(&self) -> Result<(u64, usize, usize), CuResult> {
        let ctx = CURRENT.with(|c| c.get());
        self.ctxs
            .get(&ctx)
            .map(|c| (ctx, c.dev, c.phys))
            .ok_or(INVALID_CONTEXT)
    }

    fn create_context(&mut self, handle: u64, dev: usize) -> Result<(), CuResult> {
        let phys = self.phys(dev as c_int)?;
        self.charge(phys, self.context_cost)?;
        let ctx = Ctx {
            dev,
            phys,
            charged: self.context_cost,
            limits: DEFAULT_LIMITS,
        };
        self.ctxs.insert(handle, ctx);
        Ok(())
    }

    /// Frees everything allocated in `ctx` and the context itself.
    fn destroy_context(&mut self, ctx: u64) -> Result<(), CuResult> {
        let c = self.ctxs.remove(&ctx).ok_or(INVALID_CONTEXT)?;
        let mine: Vec<u64> = self
            .allocs
            .iter()
            .filter(|(_, a)| a.ctx == ctx)
            .map(|(&p, _)| p)
            .collect();
        for ptr in mine {
            self.release_alloc(ptr);
        }
        self.trim_pools(|_, p| p.dev == c.dev, |_| 0);
        self.uncharge(c.phys, c.charged);
        if CURRENT.with(Cell::get) == ctx {
            CURRENT.with(|cur| cur.set(0));
        }
        Ok(())
    }

    /// Takes an allocation out of the books and gives its bytes to where they came from.
    fn release_alloc(&mut self, ptr: u64) -> Option<Alloc> {
        let a = self.allocs.remove(&ptr)?;
        match a.holder {
            Holder::Plain => self.uncharge(a.phys, a.bytes),
            Holder::Pool(p) => {
                if let Some(pool) = self.pools.get_mut(&p) {
                    pool.used = pool.used.saturating_sub(a.bytes);
                }
            }
            Holder::Graph(dev) => {
                let gp = &mut self.graph_pools[dev];
                gp.used = gp.used.saturating_sub(a.bytes);
            }
        }
        Some(a)
    }

    /// Releases the reservation of every pool `which` picks down to max(used, keep(pool)).
    fn trim_pools(&mut self, which: impl Fn(u64, &Pool) -> bool, keep: impl Fn(&Pool) -> u64) {
        let mut released = Vec::new();
        for (_, pool) in self.pools.iter_mut().filter(|(h, p)| which(**h, p)) {
            let target = pool.used.max(keep(pool));
            if pool.reserved > target {
                released.push((pool.phys, pool.reserved - target));
                pool.reserved = target;
            }
        }
        for (phys, bytes) in released {
            self.uncharge(phys, bytes);
        }
    }

    fn default_pool(dev: usize) -> u64 {
        0x9000 + dev as u64 * 0x10
    }

    /// The pool of that handle (a device's default pool comes into being when first named).
    fn pool_mut(&mut self, handle: u64) -> Result<&mut Pool, CuResult> {
        if !self.pools.contains_key(&handle) {
            let dev = (0..self.visible.len()).find(|&d| Self::default_pool(d) == handle);
            let dev = dev.ok_or(INVALID_VALUE)?;
            let phys = self.visible[dev];
            let pool = Pool {
                dev,
                phys,
                ..Pool::default()
            };
            self.pools.insert(handle, pool);
        }
        self.pools.get_mut(&handle).ok_or(INVALID_VALUE)
    }

    /// Books an allocation at `ptr` made in `ctx`.
    fn book(&mut self, ptr: u64, phys: usize, bytes: u64, by: &'static str, ctx: u64, h: Holder) {
        let alloc = Alloc {
            phys,
            bytes,
            by,
            ctx,
            holder: h,
        };
        self.allocs.insert(ptr, alloc);
    }

    /// An allocation of `bytes` from `pool` in the current context.
    fn pool_alloc(&mut self, pool: u64, bytes: u64, by: &'static str) -> Result<u64, CuResult> {
        let (ctx, _, _) = self.current()?;
        if bytes == 0 {
            return Err(INVALID_VALUE);
        }
        let p = self.pool_mut(pool)?;
        let (phys, grow) = (p.phys, bytes.saturating_sub(p.reserved - p.used));
        self.charge(phys, grow)?;
        let p = self.pool_mut(pool)?;
        p.reserved += grow;
        p.used += bytes;
        p.reserved_high = p.reserved_high.max(p.reserved);
        p.used_high = p.used_high.max(p.used);
        let ptr = bump(&mut self.next, bytes);
        self.book(ptr, phys, bytes, by, ctx, Holder::Pool(pool));
        Ok(ptr)
    }

    /// `cuMemAllocAsync` on `stream`: a graph node when it is capturing, else from the
    /// current device's current pool.
    fn async_alloc(&mut self, stream: u64, bytes: u64, by: &'static str) -> Result<u64, CuResult> {
        let (_, dev, _) = self.current()?;
        if let Some(Some(graph)) = self.streams.get(&stream).copied() {
            return self.add_node(graph, dev, bytes);
        }
        self.pool_alloc(self.current_pool[dev], bytes, by)
    }

    fn add_node(&mut self, graph: u64, dev: usize, bytes: u64) -> Result<u64, CuResult> {
        if bytes == 0 {
            return Err(INVALID_VALUE);
        }
        let dptr = bump(&mut self.next_graph_ptr, bytes);
        let nodes = self.graphs.get_mut(&graph).ok_or(INVALID_VALUE)?;
        nodes.push(Node {
            dev,
            bytes,
            dptr,
            freed_in_graph: false,
        });
        Ok(dptr)
    }

    /// Marks `graph`'s node of `dptr` freed by the graph (`missing` when it has none).
    fn free_node(&mut self, graph: u64, dptr: u64, missing: CuResult) -> Result<(), CuResult> {
        let nodes = self.graphs.get_mut(&graph).ok_or(INVALID_VALUE)?;
        let node = nodes.iter_mut().find(|n| n.dptr == dptr).ok_or(missing)?;
        node.freed_in_graph = true;
        Ok(())
    }

    /// A free on `stream`: marks the node freed when it is capturing, else frees.
    fn async_free(&mut self, stream: u64, ptr: u64, by: &'static str) -> Result<(), CuResult> {
        self.last_call = by;
        if let Some(Some(graph)) = self.streams.get(&stream).copied() {
            return self.free_node(graph, ptr, STREAM_CAPTURE_UNSUPPORTED);
        }
        self.release_alloc(ptr).map(|_| ()).ok_or(INVALID_VALUE)
    }

    /// Reserves graph-pool memory for `exec`'s nodes; with `run`, its unfreed nodes become
    /// allocations.
    fn graph_reserve(&mut self, exec: u64, run: bool) -> Result<(), CuResult> {
        let nodes = self.execs.get(&exec).ok_or(INVALID_VALUE)?.clone();
        let alive = |n: &Node| !n.freed_in_graph;
        if run
            && nodes
                .iter()
                .any(|n| alive(n) && self.allocs.contains_key(&n.dptr))
        {
            return Err(INVALID_VALUE);
        }
        for dev in 0..self.visible.len() {
            let peak: u64 = nodes.iter().filter(|n| n.dev == dev).map(|n| n.bytes).sum();
            if peak == 0 {
                continue;
            }
            let gp = self.graph_pools[dev];
            let need = gp.used + peak;
            if need > gp.reserved {
                self.charge(self.visible[dev], need - gp.reserved)?;
                self.graph_pools[dev].reserved = need;
            }
            let gp = &mut self.graph_pools[dev];
            gp.reserved_high = gp.reserved_high.max(gp.reserved);
            if run {
                gp.used_high = gp.used_high.max(gp.used + peak);
            }
        }
        if run {
            let ctx = CURRENT.with(|c| c.get());
            for n in nodes.iter().filter(|n| alive(n)) {
                self.graph_pools[n.dev].used += n.bytes;
                let (phys, holder) = (self.visible[n.dev], Holder::Graph(n.dev));
                self.book(n.dptr, phys, n.bytes, "cuGraphLaunch", ctx, holder);
            }
        }
        Ok(())
    }

    /// Gives a VMM allocation's memory back once it is released and mapped nowhere.
    fn vmm_settle(&mut self, h: u64) {
        if let Some(v) = self.vmm.get(&h) {
            if v.refs == 0 && v.maps == 0 {
                let (phys, bytes) = (v.phys, v.bytes);
                self.vmm.remove(&h);
                self.uncharge(phys, bytes);
            }
        }
    }

    /// When work was last submitted on `stream` (the default stream: on any).
    fn last_submit(&self, stream: u64) -> Option<u64> {
        if stream == 0 {
            self.submits.values().copied().max()
        } else {
            self.submits.get(&stream).copied()
        }
    }

    /// When everything this process submitted is done.
    fn all_done(&self) -> u64 {
        self.tails.values().copied().max().unwrap_or(0)
    }

    /// When everything submitted on `stream` is done (the default stream waits for all).
    fn stream_done(&self, stream: u64) -> Result<u64, CuResult> {
        if stream == 0 {
            return Ok(self.all_done());
        }
        if !self.streams.contains_key(&stream) {
            return Err(INVALID_HANDLE);
        }
        Ok(self.tails.get(&stream).copied().unwrap_or(0))
    }

    /// `ns` of work on `stream` in the current context, submitted at `submitted`: captured
    /// into the stream's graph, or run on the GPU's timeline (`state.rs`).
    fn submit(
        &mut self,
        stream: u64,
        ns: u64,
        submitted: u64,
        by: &'static str,
    ) -> Result<(), CuResult> {
        self.last_call = by;
        let (_, _, phys) = self.current()?;
        if stream != 0 {
            match self.streams.get(&stream) {
                Some(Some(graph)) => {
                    *self.graph_kernels.entry(*graph).or_default() += ns;
                    return Ok(());
                }
                Some(None) => {}
                None => return Err(INVALID_HANDLE),
            }
        }
        if ns == 0 {
            return Ok(());
        }
        self.own_process();
        let state = self.state.as_deref();
        let (start, end) = timeline::run(state, phys, ns, self.pid, submitted);
        self.tails.insert(stream, end);
        self.submits.insert(stream, submitted);
        for event in self.events.values_mut() {
            if let Event::Pending {
                stream: s,
                recorded,
                ..
            } = *event
            {
                if s == stream && submitted <= recorded + BATCH_NS {
                    *event = Event::At(start);
                }
            }
        }
        Ok(())
    }

    /// A kernel launch: as many µs of work as `grid` has blocks.
    fn launch(&mut self, grid: [c_uint; 3], stream: u64, by: &'static str) -> Result<(), CuResult> {
        let submitted = timeline::now_ns();
        let blocks = grid.iter().map(|&g| g as u64).product::<u64>();
        if blocks == 0 {
            return Err(INVALID_VALUE);
        }
        self.submit(stream, blocks * 1000, submitted, by)
    }

    fn graph_launch(&mut self, exec: u64, stream: u64, by: &'static str) -> Result<(), CuResult> {
        let submitted = timeline::now_ns();
        self.graph_reserve(exec, true)?;
        let ns = self.exec_kernels.get(&exec).copied().unwrap_or(0);
        self.submit(stream, ns, submitted, by)
    }
}

fn with_driver<T>(f: impl FnOnce(&mut Driver) -> Result<T, CuResult>) -> Result<T, CuResult> {
    let mut guard = DRIVER.lock().unwrap_or_else(|e| e.into_inner());
    match guard.as_mut() {
        Some(driver) => f(driver),
        None => Err(NOT_INITIALIZED),
    }
}

fn code(r: Result<(), CuResult>) -> CuResult {
    r.err().unwrap_or(SUCCESS)
}

unsafe fn out<T>(p: *mut T, value: T) -> Result<(), CuResult> {
    if p.is_null() {
        return Err(INVALID_VALUE);
    }
    unsafe { p.write(value) };
    Ok(())
}

/// Runs `f` on the driver: its error code, or SUCCESS.
fn call(f: impl FnOnce(&mut Driver) -> Result<(), CuResult>) -> CuResult {
    code(with_driver(f))
}

/// Runs `f` on the driver and writes its answer to `p` (after the driver's lock is let go).
unsafe fn answer<T>(p: *mut T, f: impl FnOnce(&mut Driver) -> Result<T, CuResult>) -> CuResult {
    code(with_driver(f).and_then(|v| unsafe { out(p, v) }))
}

/// [`answer`] for a call that makes something: a NULL `p` is refused before `f` runs.
unsafe fn make<T>(p: *mut T, f: impl FnOnce(&mut Driver) -> Result<T, CuResult>) -> CuResult {
    if p.is_null() {
        return INVALID_VALUE;
    }
    unsafe { answer(p, f) }
}

/// `Ok` when a handle was there to take out, else `missing`.
fn gone<T>(taken: Option<T>, missing: CuResult) -> Result<(), CuResult> {
    taken.map(|_| ()).ok_or(missing)
}

/// Defines entry points, exported under their names with the driver's ABI. Each is one of
/// - `fn name(args) { body }`: the function's own body;
/// - `fn name(args) |d| { body }`: `body` run on the driver ([`call`]);
/// - `fn name(args) -> out |d| { body }`: `body` run on the driver, its answer written to the
///   pointer argument `out` ([`answer`]).
macro_rules! export {
    ($($(#[$doc:meta])* fn $f:ident($($arg:ident: $ty:ty),* $(,)?)
        $(-> $out:ident)? $(|$d:ident|)? $body:block)*) => {$(
        $(#[$doc])*
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $f($($arg: $ty),*) -> CuResult {
            export!(@body $($out)? $(|$d|)? $body)
        }
    )*};
    (@body $out:ident |$d:ident| $body:block) => {
        // SAFETY: the caller passes NULL or a place for the answer, as the driver's API says.
        unsafe { answer($out, |$d| $body) }
    };
    (@body |$d:ident| $body:block) => { call(|$d| $body) };
    (@body $body:block) => { $body };
}

/// Defines entry points in pairs, the call and its `_ptsz` twin (per-thread default stream,
/// which the fake treats as the legacy one), from one body in one of `export!`'s forms; each
/// sees its own name as `by`: the name it records keeps rustc from merging the two into one
/// address.
macro_rules! with_ptsz {
    (@one $f:ident $by:ident ($($arg:ident: $ty:ty),*) $($form:tt)*) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $f($($arg: $ty),*) -> CuResult {
            let $by: &'static str = stringify!($f);
            export!(@body $($form)*)
        }
    };
    ($($name:ident $ptsz:ident |$by:ident| ($($arg:ident: $ty:ty),* $(,)?)
        $(-> $out:ident)? $(|$d:ident|)? $body:block)*) => {$(
        with_ptsz!(@one $name $by ($($arg: $ty),*) $($out)? $(|$d|)? $body);
        with_ptsz!(@one $ptsz $by ($($arg: $ty),*) $($out)? $(|$d|)? $body);
    )*};
}

/// Not a driver entry point: what this copy of the fake holds for this process on physical
/// GPU `phys` (0 if this copy was never initialized, or `phys` is not a GPU).
#[unsafe(no_mangle)]
pub extern "C" fn fakeHeldBytes(phys: c_uint) -> u64 {
    with_driver(|d| Ok(d.used.get(phys as usize).copied().unwrap_or(0))).unwrap_or(0)
}

/// A plain allocation of `bytes` in the current context (`device_bytes` of them on the
/// device); a 32-bit address when `v1`.
fn alloc_impl(bytes: u64, device_bytes: u64, by: &'static str, v1: bool) -> Result<u64, CuResult> {
    with_driver(|d| {
        let (ctx, _, phys) = d.current()?;
        if bytes == 0 {
            return Err(INVALID_VALUE);
        }
        d.charge(phys, device_bytes)?;
        let ptr = if v1 {
            d.next_v1 += 0x10_0000;
            u64::from(d.next_v1)
        } else {
            bump(&mut d.next, bytes)
        };
        d.book(ptr, phys, device_bytes, by, ctx, Holder::Plain);
        Ok(ptr)
    })
}

/// Frees `ptr` if one of `allocators` allocated it (each entry point passes its own list, so
/// that no two are the same code).
fn free_impl(ptr: u64, allocators: &[&str], freer: &'static str) -> CuResult {
    call(|d| match d.allocs.get(&ptr) {
        Some(a) if allocators.contains(&a.by) => {
            d.last_call = freer;
            d.release_alloc(ptr);
            Ok(())
        }
        _ => Err(INVALID_VALUE),
    })
}

/// A plain allocation of `bytes` written to `p` (checked first) as `T`, `device_bytes` of
/// them on the device; a 32-bit address when `v1`.
unsafe fn alloc_into<T>(
    p: *mut T,
    (bytes, device_bytes): (u64, u64),
    by: &'static str,
    v1: bool,
    to: impl FnOnce(u64) -> T,
) -> CuResult {
    if p.is_null() {
        return INVALID_VALUE;
    }
    code(alloc_impl(bytes, device_bytes, by, v1).and_then(|ptr| unsafe { out(p, to(ptr)) }))
}

export! {
    fn cuInit(_flags: c_uint) {
        let mut guard = DRIVER.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            let gpus = env_u64("FAKE_GPU_COUNT", 1) as usize;
            let visible = visible_devices(gpus);
            let pid = std::process::id();
            let driver = Driver {
                mem: env_u64("FAKE_GPU_MEM_MIB", 16384) << 20,
                gpus,
                primary_refs: vec![0; visible.len()],
                current_pool: (0..visible.len()).map(Driver::default_pool).collect(),
                graph_pools: vec![GraphPool::default(); visible.len()],
                visible,
                state: std::env::var_os("FAKE_GPU_STATE").map(PathBuf::from),
                pid,
                start: state::start_time(pid).unwrap_or(0),
                used: vec![0; gpus],
                context_cost: env_u64("FAKE_CONTEXT_MIB", 0) << 20,
                managed_on_host: std::env::var("FAKE_MANAGED_ON_HOST").as_deref() == Ok("1"),
                next: 0x7f00_0000_0000,
                next_v1: 0x1000_0000,
                next_va: 0x6000_0000_0000,
                next_graph_ptr: 0x5000_0000_0000,
                next_handle: 0x10_0000,
                ..Driver::default()
            };
            // A new program image (exec keeps the pid) holds nothing yet.
            if let Some(path) = &driver.state {
                let _ = state::update(path, |entries| driver.publish(entries));
            }
            *guard = Some(driver);
        }
        SUCCESS
    }
    fn cuDeviceGetCount(count: *mut c_int) -> count |d| { Ok(d.visible.len() as c_int) }
    fn cuDeviceGet(device: *mut c_int, ordinal: c_int) -> device |d| {
        d.phys(ordinal).map(|_| ordinal)
    }
    fn cuDeviceGetUuid(uuid: *mut [u8; 16], dev: c_int) -> uuid |d| { d.phys(dev).map(uuid_bytes) }
    fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: c_int) -> uuid |d| {
        d.last_call = "cuDeviceGetUuid_v2";
        d.phys(dev).map(uuid_bytes)
    }
    fn cuDeviceGetAttribute(value: *mut c_int, attr: c_int, dev: c_int) -> value |d| {
        match (d.phys(dev)?, attr) {
            (_, 16) => Ok(SMS as c_int),
            (_, 39) => Ok(THREADS_PER_SM as c_int),
            _ => Err(INVALID_VALUE),
        }
    }
    fn cuCtxCreate_v2(pctx: *mut Ptr, _flags: c_uint, dev: c_int) {
        unsafe {
            make(pctx, |d| {
                d.phys(dev)?;
                let h = d.handle();
                d.create_context(h, dev as usize)?;
                CURRENT.with(|c| c.set(h));
                Ok(h as Ptr)
            })
        }
    }
    fn cuCtxDestroy_v2(ctx: Ptr) |d| {
        let ctx = ctx as u64;
        if d.ctxs.contains_key(&ctx) && ctx < 0x10_0000 {
            return Err(INVALID_CONTEXT); // a primary context
        }
        d.destroy_context(ctx)
    }
    fn cuDevicePrimaryCtxRetain(pctx: *mut Ptr, dev: c_int) {
        unsafe {
            make(pctx, |d| {
                let dev = d.ordinal(dev)?;
                let h = primary_of(dev);
                if d.primary_refs[dev] == 0 {
                    d.create_context(h, dev)?;
                }
                d.primary_refs[dev] += 1;
                Ok(h as Ptr)
            })
        }
    }
    fn cuDevicePrimaryCtxRelease_v2(dev: c_int) |d| {
        let dev = d.ordinal(dev)?;
        if d.primary_refs[dev] == 0 {
            return Err(INVALID_CONTEXT);
        }
        d.primary_refs[dev] -= 1;
        if d.primary_refs[dev] == 0 {
            d.destroy_context(primary_of(dev))?;
        }
        Ok(())
    }
    fn cuDevicePrimaryCtxReset_v2(dev: c_int) |d| {
        let dev = d.ordinal(dev)?;
        d.last_call = "cuDevicePrimaryCtxReset_v2";
        if d.primary_refs[dev] > 0 {
            d.primary_refs[dev] = 0;
            d.destroy_context(primary_of(dev))?;
        }
        Ok(())
    }
    fn cuCtxSetCurrent(ctx: Ptr) {
        if ctx.is_null() {
            CURRENT.with(|c| c.set(0));
            return SUCCESS;
        }
        call(|d| {
            d.context_mut(ctx as u64)?;
            CURRENT.with(|c| c.set(ctx as u64));
            Ok(())
        })
    }
    fn cuCtxGetCurrent(pctx: *mut Ptr) {
        code(unsafe { out(pctx, CURRENT.with(|c| c.get()) as Ptr) })
    }
    fn cuCtxGetDevice(device: *mut c_int) -> device |d| {
        d.current().map(|(_, dev, _)| dev as c_int)
    }
    fn cuCtxSetLimit(limit: c_int, value: usize) {
        if !(0..=2).contains(&limit) {
            return INVALID_VALUE;
        }
        let (limit, value) = (limit as usize, value as u64);
        call(|d| {
            let (ctx, _, phys) = d.current()?;
            let old = limit_cost(limit, d.context_mut(ctx)?.limits[limit]);
            let new = limit_cost(limit, value);
            if new > old {
                d.charge(phys, new - old)?;
            } else {
                d.uncharge(phys, old - new);
            }
            let c = d.context_mut(ctx)?;
            c.limits[limit] = value;
            c.charged = (c.charged + new).saturating_sub(old);
            Ok(())
        })
    }
    fn cuCtxGetLimit(value: *mut usize, limit: c_int) {
        if !(0..=2).contains(&limit) {
            return INVALID_VALUE;
        }
        unsafe {
            answer(value, |d| {
                let (ctx, _, _) = d.current()?;
                Ok(d.context_mut(ctx)?.limits[limit as usize] as usize)
            })
        }
    }
    fn cuCtxSynchronize() {
        synchronize("cuCtxSynchronize", |d| Ok(d.all_done()))
    }
}

/// The device bytes a limit of `value` takes: the stack's is per thread.
fn limit_cost(limit: usize, value: u64) -> u64 {
    value * if limit == 0 { SMS * THREADS_PER_SM } else { 1 }
}

/// Waits (without the driver's lock) until what `until` picks is done, then trims the pools.
fn synchronize(by: &'static str, until: impl FnOnce(&Driver) -> Result<u64, CuResult>) -> CuResult {
    match with_driver(|d| until(d)) {
        Ok(at) => timeline::sleep_until(at),
        Err(e) => return e,
    }
    call(|d| {
        d.last_call = by;
        d.trim_pools(|_, _| true, |p| p.threshold);
        Ok(())
    })
}

with_ptsz! {
    cuStreamSynchronize cuStreamSynchronize_ptsz |by| (stream: Ptr) {
        synchronize(by, |d| d.stream_done(stream as u64))
    }
    cuLaunchKernel cuLaunchKernel_ptsz |by| (
        _f: Ptr, grid_x: c_uint, grid_y: c_uint, grid_z: c_uint, _block_x: c_uint,
        _block_y: c_uint, _block_z: c_uint, _shared: c_uint, stream: Ptr,
        _params: *mut Ptr, _extra: *mut Ptr,
    ) {
        call(|d| d.launch([grid_x, grid_y, grid_z], stream as u64, by))
    }
    cuLaunchCooperativeKernel cuLaunchCooperativeKernel_ptsz |by| (
        _f: Ptr, grid_x: c_uint, grid_y: c_uint, grid_z: c_uint, _block_x: c_uint,
        _block_y: c_uint, _block_z: c_uint, _shared: c_uint, stream: Ptr,
        _params: *mut Ptr,
    ) {
        call(|d| d.launch([grid_x, grid_y, grid_z], stream as u64, by))
    }
    cuLaunchKernelEx cuLaunchKernelEx_ptsz |by| (
        config: *const LaunchConfig, _f: Ptr, _params: *mut Ptr,
        _extra: *mut Ptr,
    ) {
        if config.is_null() {
            return INVALID_VALUE;
        }
        let (grid, stream) = unsafe { ((*config).grid, (*config).stream as u64) };
        call(|d| d.launch(grid, stream, by))
    }
    cuEventRecord cuEventRecord_ptsz |by| (event: Ptr, stream: Ptr) |d| {
        let (event, stream) = (event as u64, stream as u64);
        d.last_call = by;
        let (_, _, phys) = d.current()?;
        if !d.events.contains_key(&event) || (stream != 0 && !d.streams.contains_key(&stream)) {
            return Err(INVALID_HANDLE);
        }
        let tail = d.stream_done(stream)?;
        let now = timeline::now_ns();
        // Right after the stream's last work was submitted (an event after a launch: the
        // fake's own launch may have taken longer than the kernel), or while it runs: it
        // completes with that work.
        let after_work = d.last_submit(stream).is_some_and(|at| now.saturating_sub(at) <= BATCH_NS);
        let recorded = if tail > now || (after_work && tail > 0) {
            Event::At(tail)
        } else {
            let free = timeline::free_at(d.state.as_deref(), phys);
            Event::Pending { stream, recorded: now, fallback: free.max(now) }
        };
        d.events.insert(event, recorded);
        Ok(())
    }
    cuStreamIsCapturing cuStreamIsCapturing_ptsz |by| (stream: Ptr, status: *mut c_int)
        -> status |d|
    {
        d.last_call = by;
        match d.streams.get(&(stream as u64)) {
            Some(Some(_)) => Ok(1),
            Some(None) => Ok(0),
            None if stream.is_null() => Ok(0),
            None => Err(INVALID_HANDLE),
        }
    }
}

export! {
    fn cuEventSynchronize(event: Ptr) {
        synchronize("cuEventSynchronize", |d| {
            let e = d.events.get(&(event as u64)).ok_or(INVALID_HANDLE)?;
            Ok(e.time().unwrap_or(0))
        })
    }
    fn cuEventCreate(event: *mut Ptr, _flags: c_uint) -> event |d| {
        d.current()?;
        let h = d.handle();
        d.events.insert(h, Event::Unrecorded);
        Ok(h as Ptr)
    }
    fn cuEventDestroy_v2(event: Ptr) |d| { gone(d.events.remove(&(event as u64)), INVALID_HANDLE) }
    fn cuEventQuery(event: Ptr) |d| {
        match d.events.get(&(event as u64)).map(|e| e.time()) {
            None => Err(INVALID_HANDLE),
            Some(Some(at)) if at > timeline::now_ns() => Err(NOT_READY),
            Some(_) => Ok(()),
        }
    }
    fn cuEventElapsedTime(ms: *mut f32, start: Ptr, end: Ptr) -> ms |d| {
        let at = |e: Ptr| d.events.get(&(e as u64)).and_then(|e| e.time()).ok_or(INVALID_HANDLE);
        let (start, end) = (at(start)?, at(end)?);
        if start.max(end) > timeline::now_ns() {
            return Err(NOT_READY);
        }
        Ok(end.saturating_sub(start) as f32 / 1e6)
    }
    fn cuStreamCreate(stream: *mut Ptr, _flags: c_uint) -> stream |d| {
        d.current()?;
        let h = d.handle();
        d.streams.insert(h, None);
        Ok(h as Ptr)
    }
    fn cuStreamDestroy_v2(stream: Ptr) |d| {
        gone(d.streams.remove(&(stream as u64)), INVALID_HANDLE)
    }
    fn cuStreamBeginCapture_v2(stream: Ptr, _mode: c_int) |d| {
        let graph = d.handle();
        match d.streams.get_mut(&(stream as u64)) {
            Some(s @ None) => *s = Some(graph),
            Some(Some(_)) => return Err(STREAM_CAPTURE_UNSUPPORTED),
            None => return Err(INVALID_HANDLE),
        }
        d.graphs.insert(graph, Vec::new());
        Ok(())
    }
    fn cuStreamEndCapture(stream: Ptr, graph: *mut Ptr) -> graph |d| {
        match d.streams.get_mut(&(stream as u64)) {
            Some(s @ Some(_)) => Ok(s.take().unwrap_or(0) as Ptr),
            _ => Err(INVALID_VALUE),
        }
    }
}

// Stream-ordered pools.

/// `CU_MEM_LOCATION_TYPE_DEVICE`.
const LOCATION_DEVICE: c_int = 1;

export! {
    fn cuDeviceGetDefaultMemPool(pool: *mut Ptr, dev: c_int) -> pool |d| {
        Ok(Driver::default_pool(d.ordinal(dev)?) as Ptr)
    }
    fn cuDeviceGetMemPool(pool: *mut Ptr, dev: c_int) -> pool |d| {
        Ok(d.current_pool[d.ordinal(dev)?] as Ptr)
    }
    fn cuMemPoolCreate(pool: *mut Ptr, props: *const PoolProps) {
        if props.is_null() || pool.is_null() {
            return INVALID_VALUE;
        }
        let (kind, dev) = unsafe { ((*props).location_type, (*props).location_id) };
        if kind != LOCATION_DEVICE {
            return NOT_SUPPORTED;
        }
        unsafe {
            answer(pool, |d| {
                let phys = d.phys(dev)?;
                let h = d.handle();
                d.pools.insert(h, Pool { dev: dev as usize, phys, ..Pool::default() });
                Ok(h as Ptr)
            })
        }
    }
    fn cuMemPoolDestroy(pool: Ptr) |d| {
        let h = pool as u64;
        let p = d.pool_mut(h)?;
        if Driver::default_pool(p.dev) == h {
            return Err(INVALID_VALUE);
        }
        let (dev, phys, reserved) = (p.dev, p.phys, p.reserved);
        // Outstanding allocations die with the pool.
        d.allocs.retain(|_, a| a.holder != Holder::Pool(h));
        d.pools.remove(&h);
        d.uncharge(phys, reserved);
        if d.current_pool[dev] == h {
            d.current_pool[dev] = Driver::default_pool(dev);
        }
        Ok(())
    }
    fn cuMemPoolSetAttribute(pool: Ptr, attr: c_int, value: Ptr) {
        if value.is_null() {
            return INVALID_VALUE;
        }
        let v = unsafe { *(value as *const u64) };
        call(|d| {
            let p = d.pool_mut(pool as u64)?;
            match attr {
                4 => p.threshold = v,
                6 if v == 0 => p.reserved_high = p.reserved,
                8 if v == 0 => p.used_high = p.used,
                1..=3 => {} // reuse policies
                _ => return Err(INVALID_VALUE),
            }
            Ok(())
        })
    }
    fn cuMemPoolGetAttribute(pool: Ptr, attr: c_int, value: *mut u64) -> value |d| {
        let p = d.pool_mut(pool as u64)?;
        match attr {
            4 => Ok(p.threshold),
            5 => Ok(p.reserved),
            6 => Ok(p.reserved_high),
            7 => Ok(p.used),
            8 => Ok(p.used_high),
            _ => Err(INVALID_VALUE),
        }
    }
    fn cuMemPoolTrimTo(pool: Ptr, min_bytes_to_keep: usize) |d| {
        let h = pool as u64;
        d.pool_mut(h)?;
        d.trim_pools(|p, _| p == h, |_| min_bytes_to_keep as u64);
        Ok(())
    }
}

with_ptsz! {
    cuMemAllocAsync cuMemAllocAsync_ptsz |by| (dptr: *mut u64, bytes: usize, stream: Ptr) {
        unsafe { make(dptr, |d| d.async_alloc(stream as u64, bytes as u64, by)) }
    }
    cuMemAllocFromPoolAsync cuMemAllocFromPoolAsync_ptsz |by| (
        dptr: *mut u64, bytes: usize, pool: Ptr, _stream: Ptr,
    ) {
        unsafe { make(dptr, |d| d.pool_alloc(pool as u64, bytes as u64, by)) }
    }
    cuMemFreeAsync cuMemFreeAsync_ptsz |by| (ptr: u64, stream: Ptr) {
        call(|d| d.async_free(stream as u64, ptr, by))
    }
}

// Plain allocations, VMM and arrays.

export! {
    fn cuMemAlloc_v2(dptr: *mut u64, bytes: usize) {
        let bytes = bytes as u64;
        unsafe { alloc_into(dptr, (bytes, bytes), "cuMemAlloc_v2", false, |p| p) }
    }
    fn cuMemAllocPitch_v2(
        dptr: *mut u64, pitch: *mut usize, width: usize, height: usize, _element: c_uint,
    ) {
        let p = width.div_ceil(512) * 512;
        if pitch.is_null() {
            return INVALID_VALUE;
        }
        let bytes = (p * height) as u64;
        let r = unsafe { alloc_into(dptr, (bytes, bytes), "cuMemAllocPitch_v2", false, |a| a) };
        if r == SUCCESS {
            unsafe { pitch.write(p) };
        }
        r
    }
    fn cuMemAllocManaged(dptr: *mut u64, bytes: usize, _flags: c_uint) {
        if dptr.is_null() {
            return INVALID_VALUE;
        }
        let on_host = with_driver(|d| Ok(d.managed_on_host)).unwrap_or(false);
        let sizes = (bytes as u64, if on_host { 0 } else { bytes as u64 });
        unsafe { alloc_into(dptr, sizes, "cuMemAllocManaged", false, |p| p) }
    }
    fn cuMemCreate(handle: *mut u64, size: usize, prop: *const AllocationProp, _flags: u64) {
        if prop.is_null() || handle.is_null() || size == 0 {
            return INVALID_VALUE;
        }
        let (dev, bytes) = (unsafe { (*prop).location_id }, size as u64);
        unsafe {
            answer(handle, |d| {
                let phys = d.phys(dev)?;
                d.charge(phys, bytes)?;
                let h = d.handle();
                d.vmm.insert(h, Vmm { phys, bytes, refs: 1, maps: 0 });
                Ok(h)
            })
        }
    }
    fn cuMemRelease(handle: u64) |d| {
        let v = d.vmm.get_mut(&handle).ok_or(INVALID_VALUE)?;
        if v.refs == 0 {
            return Err(INVALID_VALUE);
        }
        v.refs -= 1;
        d.vmm_settle(handle);
        Ok(())
    }
    fn cuMemAddressReserve(ptr: *mut u64, size: usize, _alignment: usize, _addr: u64, _flags: u64) {
        if size == 0 {
            return INVALID_VALUE;
        }
        unsafe {
            answer(ptr, |d| {
                let va = bump(&mut d.next_va, size as u64);
                d.reservations.insert(va, size as u64);
                Ok(va)
            })
        }
    }
    fn cuMemAddressFree(ptr: u64, _size: usize) |d| {
        gone(d.reservations.remove(&ptr), INVALID_VALUE)
    }
    fn cuMemMap(ptr: u64, size: usize, _offset: usize, handle: u64, _flags: u64) {
        let end = ptr + size as u64;
        call(|d| {
            let v = d.vmm.get_mut(&handle).ok_or(INVALID_HANDLE)?;
            if v.refs == 0 || (size as u64) > v.bytes {
                return Err(INVALID_VALUE);
            }
            let inside = d.reservations.iter().any(|(&va, &len)| va <= ptr && end <= va + len);
            if !inside || d.maps.range(ptr..end).next().is_some() {
                return Err(INVALID_VALUE);
            }
            v.maps += 1;
            d.maps.insert(ptr, (size as u64, handle));
            Ok(())
        })
    }
    fn cuMemUnmap(ptr: u64, size: usize) |d| {
        let inside: Vec<u64> = d.maps.range(ptr..ptr + size as u64).map(|(&va, _)| va).collect();
        if inside.is_empty() {
            return Err(INVALID_VALUE);
        }
        for va in inside {
            if let Some((_, h)) = d.maps.remove(&va) {
                if let Some(v) = d.vmm.get_mut(&h) {
                    v.maps -= 1;
                }
                d.vmm_settle(h);
            }
        }
        Ok(())
    }
    fn cuMemSetAccess(_ptr: u64, _size: usize, _desc: *const c_void, _count: usize) |d| {
        d.last_call = "cuMemSetAccess";
        Ok(())
    }
    fn cuMemRetainAllocationHandle(handle: *mut u64, addr: Ptr) -> handle |d| {
        let addr = addr as u64;
        let mapping = d.maps.range(..=addr).next_back();
        let inside = mapping.filter(|&(&va, &(len, _))| addr < va + len);
        let (_, &(_, h)) = inside.ok_or(INVALID_VALUE)?;
        d.vmm.get_mut(&h).ok_or(INVALID_VALUE)?.refs += 1;
        Ok(h)
    }
}

/// The bytes of a `width` × `height` × `depth` array (a height or depth of 0: 1).
fn array_bytes(width: usize, height: usize, depth: usize, format: c_uint, channels: c_uint) -> u64 {
    let element: u64 = match format {
        0x01 | 0x08 => 1,
        0x02 | 0x09 | 0x10 => 2,
        _ => 4,
    };
    width as u64 * height.max(1) as u64 * depth.max(1) as u64 * element * channels as u64
}

/// An array of `bytes`, its handle written to `array` (checked first).
unsafe fn array_out(array: *mut Ptr, bytes: u64, by: &'static str) -> CuResult {
    unsafe { alloc_into(array, (bytes, bytes), by, false, |p| p as Ptr) }
}

/// What `cuMemFree_v2` and `cuMemFreeAsync` free.
const DEVICE_POINTERS: [&str; 8] = [
    "cuMemAlloc_v2",
    "cuMemAllocPitch_v2",
    "cuMemAllocManaged",
    "cuMemAllocAsync",
    "cuMemAllocAsync_ptsz",
    "cuMemAllocFromPoolAsync",
    "cuMemAllocFromPoolAsync_ptsz",
    "cuGraphLaunch",
];

export! {
    fn cuArrayCreate_v2(array: *mut Ptr, desc: *const ArrayDescriptor) {
        let Some(d) = (unsafe { desc.as_ref() }) else {
            return INVALID_VALUE;
        };
        let bytes = array_bytes(d.width, d.height, 1, d.format, d.channels);
        unsafe { array_out(array, bytes, "cuArrayCreate_v2") }
    }
    fn cuArray3DCreate_v2(array: *mut Ptr, desc: *const Array3dDescriptor) {
        let Some(d) = (unsafe { desc.as_ref() }) else {
            return INVALID_VALUE;
        };
        let bytes = array_bytes(d.width, d.height, d.depth, d.format, d.channels);
        unsafe { array_out(array, bytes, "cuArray3DCreate_v2") }
    }
    fn cuMipmappedArrayCreate(array: *mut Ptr, desc: *const Array3dDescriptor, levels: c_uint) {
        let Some(d) = (unsafe { desc.as_ref() }) else {
            return INVALID_VALUE;
        };
        let dim = |x: usize, level: c_uint| (x >> level).max(1);
        let bytes = (0..levels.max(1))
            .map(|l| {
                let (w, h, z) = (dim(d.width, l), dim(d.height, l), dim(d.depth, l));
                array_bytes(w, h, z, d.format, d.channels)
            })
            .sum();
        unsafe { array_out(array, bytes, "cuMipmappedArrayCreate") }
    }
    fn cuMemFree_v2(ptr: u64) {
        free_impl(ptr, &DEVICE_POINTERS, "cuMemFree_v2")
    }
    fn cuArrayDestroy(array: Ptr) {
        let arrays = ["cuArrayCreate_v2", "cuArray3DCreate_v2"];
        free_impl(array as u64, &arrays, "cuArrayDestroy")
    }
    fn cuMipmappedArrayDestroy(array: Ptr) {
        free_impl(array as u64, &["cuMipmappedArrayCreate"], "cuMipmappedArrayDestroy")
    }
    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) {
        // Either place may be NULL: only the other is written.
        code(mem_info().map(|(f, t)| unsafe {
            if !free.is_null() {
                free.write(f as usize);
            }
            if !total.is_null() {
                total.write(t as usize);
            }
        }))
    }
    fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int) -> bytes |d| {
        d.phys(dev).map(|_| d.mem as usize)
    }
}

/// (free, total) of the current device: total minus what every process holds on it.
fn mem_info() -> Result<(u64, u64), CuResult> {
    with_driver(|d| {
        let (_, _, phys) = d.current()?;
        Ok((d.mem.saturating_sub(d.device_used(phys)), d.mem))
    })
}

// The 32-bit v1 entry points of pre-3.2 programs. Sizes past 4 GiB read as u32::MAX.

fn clamp32(v: u64) -> u32 {
    v.min(u32::MAX as u64) as u32
}

export! {
    fn cuMemAlloc(dptr: *mut u32, bytes: c_uint) {
        let bytes = bytes as u64;
        unsafe { alloc_into(dptr, (bytes, bytes), "cuMemAlloc", true, |p| p as u32) }
    }
    fn cuMemAllocPitch(
        dptr: *mut u32, pitch: *mut u32, width: c_uint, height: c_uint, _element: c_uint,
    ) {
        if dptr.is_null() || pitch.is_null() {
            return INVALID_VALUE;
        }
        let p = (width as u64).div_ceil(512) * 512;
        let bytes = p * height as u64;
        if bytes > u32::MAX as u64 {
            return INVALID_VALUE;
        }
        let r = alloc_impl(bytes, bytes, "cuMemAllocPitch", true);
        code(r.and_then(|ptr| unsafe { out(dptr, ptr as u32).and_then(|()| out(pitch, p as u32)) }))
    }
    fn cuMemFree(ptr: c_uint) {
        free_impl(ptr as u64, &["cuMemAlloc", "cuMemAllocPitch"], "cuMemFree")
    }
    fn cuMemGetInfo(free: *mut u32, total: *mut u32) {
        code(mem_info().and_then(|(f, t)| unsafe {
            out(free, clamp32(f)).and_then(|()| out(total, clamp32(t)))
        }))
    }
    fn cuDeviceTotalMem(bytes: *mut u32, dev: c_int) -> bytes |d| {
        d.last_call = "cuDeviceTotalMem";
        d.phys(dev).map(|_| clamp32(d.mem))
    }
}

// Graphs and their memory.

/// Instantiates `graph`, its executable written to `exec`.
unsafe fn instantiate(exec: *mut Ptr, graph: Ptr, by: &'static str) -> CuResult {
    unsafe {
        answer(exec, |d| {
            d.last_call = by;
            let nodes = d.graphs.get(&(graph as u64)).ok_or(INVALID_VALUE)?.clone();
            let h = d.handle();
            d.execs.insert(h, nodes);
            let kernels = d.graph_kernels.get(&(graph as u64)).copied().unwrap_or(0);
            d.exec_kernels.insert(h, kernels);
            Ok(h as Ptr)
        })
    }
}

export! {
    fn cuGraphCreate(graph: *mut Ptr, _flags: c_uint) -> graph |d| {
        let h = d.handle();
        d.graphs.insert(h, Vec::new());
        Ok(h as Ptr)
    }
    fn cuGraphDestroy(graph: Ptr) |d| { gone(d.graphs.remove(&(graph as u64)), INVALID_VALUE) }
    fn cuGraphAddMemAllocNode(
        node: *mut Ptr, graph: Ptr, _deps: *const Ptr, _count: usize,
        params: *mut MemAllocNodeParams,
    ) {
        if params.is_null() || node.is_null() {
            return INVALID_VALUE;
        }
        let (props, bytes) = unsafe { (&(*params).pool_props, (*params).bytesize as u64) };
        if props.location_type != LOCATION_DEVICE {
            return INVALID_VALUE;
        }
        let dev = props.location_id;
        let r = with_driver(|d| d.add_node(graph as u64, d.ordinal(dev)?, bytes));
        code(r.and_then(|dptr| unsafe {
            (*params).dptr = dptr;
            out(node, dptr as Ptr)
        }))
    }
    fn cuGraphAddMemFreeNode(
        node: *mut Ptr, graph: Ptr, _deps: *const Ptr, _count: usize, dptr: u64,
    ) -> node |d| {
        d.free_node(graph as u64, dptr, INVALID_VALUE)?;
        Ok((dptr + 1) as Ptr)
    }
    fn cuGraphInstantiateWithFlags(exec: *mut Ptr, graph: Ptr, _flags: u64) {
        unsafe { instantiate(exec, graph, "cuGraphInstantiateWithFlags") }
    }
    fn cuGraphUpload(exec: Ptr, _stream: Ptr) |d| { d.graph_reserve(exec as u64, false) }
    fn cuGraphExecDestroy(exec: Ptr) |d| { gone(d.execs.remove(&(exec as u64)), INVALID_VALUE) }
    fn cuDeviceGetGraphMemAttribute(dev: c_int, attr: c_int, value: *mut u64) -> value |d| {
        let gp = d.graph_pools[d.ordinal(dev)?];
        match attr {
            0 => Ok(gp.used),
            1 => Ok(gp.used_high),
            2 => Ok(gp.reserved),
            3 => Ok(gp.reserved_high),
            _ => Err(INVALID_VALUE),
        }
    }
    fn cuDeviceGraphMemTrim(dev: c_int) |d| {
        let phys = d.phys(dev)?;
        let gp = &mut d.graph_pools[dev as usize];
        let release = gp.reserved - gp.used;
        gp.reserved = gp.used;
        d.uncharge(phys, release);
        Ok(())
    }
}

with_ptsz! {
    cuGraphLaunch cuGraphLaunch_ptsz |by| (exec: Ptr, stream: Ptr) {
        call(|d| d.graph_launch(exec as u64, stream as u64, by))
    }
}

/// `cuGetProcAddress`'s resolution: a base name, the caller's CUDA version and flags
/// (bit 1: per-thread default stream) pick the variant, as the real driver does; below
/// 3020 the memory functions are the 32-bit v1 ones.
fn proc_address(symbol: *const c_char, version: c_int, flags: u64) -> Ptr {
    if symbol.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: a NUL-terminated name from the caller.
    let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    let (ptsz, v1) = (flags & 2 != 0, version < 3020);
    // Entries: `base` (its own symbol), `base => symbol`, `base [when] variant` (the variant
    // when `when` holds, else `base` or the `=> symbol` that follows).
    macro_rules! resolve {
        (@f $base:ident) => { $base };
        (@f $base:ident $f:ident) => { $f };
        ($($base:ident $([$when:expr] $variant:ident)? $(=> $f:ident)?,)*) => {$(
            if name == stringify!($base).as_bytes() {
                $(if $when {
                    return $variant as Ptr;
                })?
                return resolve!(@f $base $($f)?) as Ptr;
            }
        )*};
    }
    resolve! {
        cuInit, cuDeviceGetCount, cuDeviceGet, cuDeviceGetAttribute,
        cuDeviceGetUuid [version >= 11040] cuDeviceGetUuid_v2,
        cuCtxCreate => cuCtxCreate_v2,
        cuCtxDestroy => cuCtxDestroy_v2,
        cuCtxGetCurrent, cuCtxSetCurrent, cuCtxGetDevice, cuCtxSynchronize,
        cuCtxSetLimit, cuCtxGetLimit, cuDevicePrimaryCtxRetain,
        cuDevicePrimaryCtxRelease => cuDevicePrimaryCtxRelease_v2,
        cuDevicePrimaryCtxReset => cuDevicePrimaryCtxReset_v2,
        cuStreamCreate,
        cuStreamDestroy => cuStreamDestroy_v2,
        cuStreamSynchronize [ptsz] cuStreamSynchronize_ptsz,
        cuEventCreate, cuEventQuery, cuEventElapsedTime, cuEventSynchronize,
        cuEventDestroy => cuEventDestroy_v2,
        cuEventRecord [ptsz] cuEventRecord_ptsz,
        cuStreamIsCapturing [ptsz] cuStreamIsCapturing_ptsz,
        cuLaunchKernel [ptsz] cuLaunchKernel_ptsz,
        cuLaunchKernelEx [ptsz] cuLaunchKernelEx_ptsz,
        cuLaunchCooperativeKernel [ptsz] cuLaunchCooperativeKernel_ptsz,
        cuStreamBeginCapture => cuStreamBeginCapture_v2,
        cuStreamEndCapture, cuDeviceGetDefaultMemPool, cuDeviceGetMemPool,
        cuMemPoolCreate, cuMemPoolDestroy, cuMemPoolSetAttribute, cuMemPoolGetAttribute,
        cuMemPoolTrimTo,
        cuMemAlloc [v1] cuMemAlloc => cuMemAlloc_v2,
        cuMemAllocPitch [v1] cuMemAllocPitch => cuMemAllocPitch_v2,
        cuMemAllocManaged,
        cuMemAllocAsync [ptsz] cuMemAllocAsync_ptsz,
        cuMemAllocFromPoolAsync [ptsz] cuMemAllocFromPoolAsync_ptsz,
        cuMemCreate, cuMemRelease, cuMemAddressReserve, cuMemAddressFree, cuMemMap, cuMemUnmap,
        cuMemSetAccess, cuMemRetainAllocationHandle,
        cuArrayCreate => cuArrayCreate_v2,
        cuArray3DCreate => cuArray3DCreate_v2,
        cuMipmappedArrayCreate,
        cuMemFree [v1] cuMemFree => cuMemFree_v2,
        cuMemFreeAsync [ptsz] cuMemFreeAsync_ptsz,
        cuArrayDestroy, cuMipmappedArrayDestroy,
        cuMemGetInfo [v1] cuMemGetInfo => cuMemGetInfo_v2,
        cuDeviceTotalMem [v1] cuDeviceTotalMem => cuDeviceTotalMem_v2,
        cuGraphCreate, cuGraphDestroy, cuGraphAddMemAllocNode, cuGraphAddMemFreeNode,
        cuGraphInstantiateWithFlags,
        cuGraphUpload,
        cuGraphLaunch [ptsz] cuGraphLaunch_ptsz,
        cuGraphExecDestroy, cuDeviceGetGraphMemAttribute, cuDeviceGraphMemTrim,
        cuGetProcAddress [version >= 12000] cuGetProcAddress_v2,
    }
    std::ptr::null_mut()
}

/// Both `cuGetProcAddress`es: the function found (NULL: none) written to `pfn`, and to
/// `status` (when not NULL) `CU_GET_PROC_ADDRESS_SUCCESS` (0) or `..._SYMBOL_NOT_FOUND` (1).
unsafe fn get_proc(
    symbol: *const c_char,
    pfn: *mut Ptr,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CuResult {
    if pfn.is_null() {
        return INVALID_VALUE;
    }
    let f = proc_address(symbol, version, flags);
    unsafe { pfn.write(f) };
    if !status.is_null() {
        unsafe { status.write(c_int::from(f.is_null())) };
    }
    if f.is_null() { NOT_FOUND } else { SUCCESS }
}

export! {
    fn cuGetProcAddress(symbol: *const c_char, pfn: *mut Ptr, version: c_int, flags: u64) {
        unsafe { get_proc(symbol, pfn, version, flags, std::ptr::null_mut()) }
    }
    fn cuGetProcAddress_v2(
        symbol: *const c_char, pfn: *mut Ptr, version: c_int, flags: u64, status: *mut c_int,
    ) {
        unsafe { get_proc(symbol, pfn, version, flags, status) }
    }
}
