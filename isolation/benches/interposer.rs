//! What the interposer adds to an allocation + free pair (budget: at most 1 µs).
//!
//! - `straight`: `cuMemAlloc_v2` + `cuMemFree_v2` of the fake driver, called through
//!   pointers from `dlsym`: the baseline.
//! - `interposed`: the same pair through this crate's exported hooks (as a preloaded program
//!   reaches them), with limits set: `cuCtxGetDevice` through the real (fake) driver, the
//!   budget's CAS, the ledger, and the forwarded call.
//! - `core`: `Interposer::allocate` + `free` around a no-op driver: the accounting alone.
//!
//! - `launch/straight` and `launch/interposed`: a kernel launch (`cuLaunchKernel`, a 1-block
//!   grid) of the fake driver, called directly and through this crate's hook with limits set
//!   but no compute share: what the compute throttle costs a launch it does not hold
//!   (budget: at most 1 µs; the difference of the two).
//!
//! - `refused_30_live`: an allocation refused while 30 other live processes hold bytes in
//!   the container's budget: every refusal first looks for dead processes to reclaim
//!   (budget: under 20 µs).
//!
//! The fake driver is loaded by path before the hooks look for `libcuda.so.1`, so they find
//! it by its soname.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ffi::{CString, c_int, c_void};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};

use criterion::{Criterion, criterion_group, criterion_main};
use gpushare_isolation::ledger::Kind;
use gpushare_isolation::{Budget, Interposer, Limits};

unsafe extern "C" {
    // This crate's hooks: the rlib defines them.
    fn cuMemAlloc_v2(dptr: *mut u64, bytes: usize) -> c_int;
    fn cuMemFree_v2(dptr: u64) -> c_int;
    fn cuLaunchKernel(
        f: *mut c_void,
        grid_x: u32,
        grid_y: u32,
        grid_z: u32,
        block_x: u32,
        block_y: u32,
        block_z: u32,
        shared_mem_bytes: u32,
        stream: *mut c_void,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> c_int;
}

type Launch = unsafe extern "C" fn(
    *mut c_void,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    *mut c_void,
    *mut *mut c_void,
    *mut *mut c_void,
) -> c_int;

type Alloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
type Free = unsafe extern "C" fn(u64) -> c_int;

struct Fake {
    alloc: Alloc,
    free: Free,
    launch: Launch,
}

/// Loads the fake driver, initialises it and makes device 0 current.
fn load_fake() -> Fake {
    let path = gpushare_isolation_probe::fake_driver_dir().join("libcuda.so.1");
    let path = CString::new(path.into_os_string().into_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path; the library stays loaded.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    assert!(!handle.is_null(), "loading the fake driver");
    // This binary links the rlib, whose `dlsym` would answer our hooks: ask glibc's.
    // SAFETY: NUL-terminated names.
    let real_dlsym =
        unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), c"GLIBC_2.2.5".as_ptr()) };
    assert!(!real_dlsym.is_null(), "glibc's dlsym");
    // SAFETY: glibc's dlsym has this signature.
    let real_dlsym = unsafe {
        std::mem::transmute::<
            *mut c_void,
            unsafe extern "C" fn(*mut c_void, *const std::ffi::c_char) -> *mut c_void,
        >(real_dlsym)
    };
    let find = |name: &std::ffi::CStr| {
        // SAFETY: a handle from dlopen and a NUL-terminated name.
        let p = unsafe { real_dlsym(handle, name.as_ptr()) };
        assert!(!p.is_null(), "{name:?}");
        p
    };
    // SAFETY: every transmute is of the fake driver's entry point of that name to its
    // signature; every call gets places for its answers.
    unsafe {
        let init =
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn(u32) -> c_int>(find(c"cuInit"));
        let ctx_create = std::mem::transmute::<
            *mut c_void,
            unsafe extern "C" fn(*mut *mut c_void, u32, c_int) -> c_int,
        >(find(c"cuCtxCreate_v2"));
        assert_eq!(init(0), 0);
        let mut ctx = std::ptr::null_mut();
        assert_eq!(ctx_create(&mut ctx, 0, 0), 0);
        Fake {
            alloc: std::mem::transmute::<*mut c_void, Alloc>(find(c"cuMemAlloc_v2")),
            free: std::mem::transmute::<*mut c_void, Free>(find(c"cuMemFree_v2")),
            launch: std::mem::transmute::<*mut c_void, Launch>(find(c"cuLaunchKernel")),
        }
    }
}

const MIB: u64 = 1 << 20;

/// A process's start time, `/proc/PID/stat` field 22.
fn start_time(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 1..];
    rest.split_whitespace().nth(19).unwrap().parse().unwrap()
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    // SAFETY: set before any other thread runs, and read by the hooks' set-up.
    unsafe {
        std::env::set_var("GPUSHARE_CONTAINER_MEM_GIB", "8");
        std::env::set_var("GPUSHARE_ISOLATION_DIR", dir.path());
    }
    let fake = load_fake();
    let bytes = 1usize << 20;

    let mut group = c.benchmark_group("alloc_free_1MiB");
    group.bench_function("straight", |b| {
        b.iter(|| {
            let mut p = 0u64;
            // SAFETY: the fake's entry points with a place for the pointer.
            unsafe {
                assert_eq!((fake.alloc)(&mut p, black_box(bytes)), 0);
                assert_eq!((fake.free)(black_box(p)), 0);
            }
        })
    });
    group.bench_function("interposed", |b| {
        b.iter(|| {
            let mut p = 0u64;
            // SAFETY: the hooks, with a place for the pointer.
            unsafe {
                assert_eq!(cuMemAlloc_v2(&mut p, black_box(bytes)), 0);
                assert_eq!(cuMemFree_v2(black_box(p)), 0);
            }
        })
    });
    let limits = Limits::new(vec![8 << 30]);
    let core = Interposer::open(&limits, &dir.path().join("core.v1")).unwrap();
    let next = AtomicU64::new(1);
    group.bench_function("core", |b| {
        b.iter(|| {
            let key = next.fetch_add(1, Ordering::Relaxed);
            assert_eq!(
                core.allocate(Kind::Pointer, 0, black_box(bytes as u64), || Ok(key)),
                0
            );
            assert_eq!(core.free(Kind::Pointer, black_box(key), || 0), 0);
        })
    });
    group.finish();

    // A launch the throttle does not hold: no compute share is set. The fake runs a 1-block
    // kernel for 1 µs of simulated time and returns at once.
    let null: *mut c_void = std::ptr::null_mut();
    let none: *mut *mut c_void = std::ptr::null_mut();
    let f = std::ptr::dangling_mut::<c_void>();
    let mut group = c.benchmark_group("launch");
    group.bench_function("straight", |b| {
        b.iter(|| {
            // SAFETY: the fake's entry point: a grid, the default stream, no parameters.
            let r = unsafe { (fake.launch)(f, black_box(1), 1, 1, 32, 1, 1, 0, null, none, none) };
            assert_eq!(r, 0);
        })
    });
    group.bench_function("interposed", |b| {
        b.iter(|| {
            // SAFETY: the hook, with the same arguments.
            let r = unsafe { cuLaunchKernel(f, black_box(1), 1, 1, 32, 1, 1, 0, null, none, none) };
            assert_eq!(r, 0);
        })
    });
    group.finish();

    // 30 live processes (sleepers) with slots holding bytes, and the share full.
    let full = Interposer::open(&limits, &dir.path().join("full.v1")).unwrap();
    let mut sleepers: Vec<_> = (0..30)
        .map(|_| {
            std::process::Command::new("sleep")
                .arg("120")
                .spawn()
                .unwrap()
        })
        .collect();
    for sleeper in &sleepers {
        let pid = sleeper.id();
        let slot = full.budget().claim_slot(pid, start_time(pid)).unwrap();
        assert!(full.budget().try_reserve(Some(slot), 0, 256 * MIB));
    }
    assert_eq!(full.budget().used(0), 30 * 256 * MIB);
    assert_eq!(full.allocate(Kind::Pointer, 0, 512 * MIB, || Ok(1)), 0);
    c.bench_function("refused_30_live", |b| {
        b.iter(|| {
            assert_eq!(full.allocate(Kind::Pointer, 0, black_box(MIB), || Ok(2)), 2);
        })
    });
    for sleeper in &mut sleepers {
        let _ = sleeper.kill();
        let _ = sleeper.wait();
    }

    // The same with 30 holders that lock their slots (each its own open file description,
    // as 30 processes have, maybe in other PID namespaces): one F_OFD_GETLK per slot past
    // the 50 ms proof of life.
    let locked = Interposer::open(&limits, &dir.path().join("locked.v1")).unwrap();
    let holders: Vec<Budget> = (0..30)
        .map(|i| {
            let holder = Budget::open(&dir.path().join("locked.v1"), &limits).unwrap();
            let slot = holder.claim_own_slot(1_000_000 + i, 1).unwrap();
            assert!(holder.try_reserve(Some(slot), 0, 256 * MIB));
            holder
        })
        .collect();
    assert_eq!(locked.allocate(Kind::Pointer, 0, 512 * MIB, || Ok(1)), 0);
    c.bench_function("refused_30_live_locked", |b| {
        b.iter(|| {
            assert_eq!(
                locked.allocate(Kind::Pointer, 0, black_box(MIB), || Ok(2)),
                2
            );
        })
    });
    drop(holders);

    // The hooks really forward to the fake (which frees what they allocated) and count (past
    // the share they refuse).
    let mut p = 0u64;
    // SAFETY: as above.
    unsafe {
        assert_eq!(cuMemAlloc_v2(&mut p, 1 << 30), 0);
        assert_eq!((fake.free)(p), 0);
        assert_eq!(cuMemAlloc_v2(&mut p, 8 << 30), 2);
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
