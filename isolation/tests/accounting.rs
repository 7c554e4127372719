//! The accounting core without a driver: the budget file, the ledger and the interposer's
//! allocate/free, with threads and forked processes racing. The reader's own tests are in
//! gpushare-isolation-budget.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use gpushare_isolation::ledger::Kind;
use gpushare_isolation::{
    Budget, CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, Interposer, Limits, Place, Settings,
};
use gpushare_isolation_budget::Snapshot;
use gpushare_isolation_budget::layout::FILE_LEN;
use proptest::prelude::*;

const MIB: u64 = 1 << 20;

fn budget_file(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("budget.v1")
}

/// A process that has exited and been reaped: its pid is dead (until reused).
fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

#[test]
fn an_allocation_past_the_share_is_refused_and_never_reaches_the_driver() {
    let dir = tempfile::tempdir().unwrap();
    let ip = Interposer::open(&Limits::new(vec![4096 * MIB]), &budget_file(&dir)).unwrap();
    assert_eq!(
        ip.allocate(Kind::Pointer, 0, 3072 * MIB, || Ok(0x1000)),
        CUDA_SUCCESS
    );
    let mut reached = false;
    let refused = ip.allocate(Kind::Pointer, 0, 2048 * MIB, || {
        reached = true;
        Ok(0x2000)
    });
    assert_eq!(refused, CUDA_ERROR_OUT_OF_MEMORY);
    assert!(!reached);
    assert_eq!(ip.budget().used(0), 3072 * MIB);
    assert_eq!(ip.budget().refused_count(0), 1);
    // A GPU the container has no share of refuses everything.
    assert_eq!(
        ip.allocate(Kind::Pointer, 1, MIB, || Ok(0x3000)),
        CUDA_ERROR_OUT_OF_MEMORY
    );
}

#[test]
fn frees_give_back_exactly_what_was_counted() {
    let dir = tempfile::tempdir().unwrap();
    let ip = Interposer::open(
        &Limits::new(vec![4096 * MIB, 2048 * MIB]),
        &budget_file(&dir),
    )
    .unwrap();
    assert_eq!(ip.allocate(Kind::Pointer, 0, 100 * MIB, || Ok(0x10)), 0);
    assert_eq!(ip.allocate(Kind::Handle, 1, 200 * MIB, || Ok(0x10)), 0);
    // The driver fails: nothing stays counted.
    assert_eq!(ip.allocate(Kind::Pointer, 0, 300 * MIB, || Err(999)), 999);
    // Pitched: the estimate is replaced by the real size.
    assert_eq!(
        ip.allocate_sized(Kind::Pointer, 0, 10 * MIB, || Ok((0x20, 12 * MIB))),
        0
    );
    assert_eq!(ip.budget().used(0), 112 * MIB);
    assert_eq!(ip.budget().used(1), 200 * MIB);
    // A free the driver refuses keeps the count; an unknown key passes without changing it.
    assert_eq!(ip.free(Kind::Pointer, 0x10, || 1), 1);
    assert_eq!(ip.free(Kind::Pointer, 0x999, || 0), 0);
    assert_eq!(ip.budget().used(0), 112 * MIB);
    // Same key, other kind: each gives back its own.
    assert_eq!(ip.free(Kind::Handle, 0x10, || 0), 0);
    assert_eq!(ip.budget().used(1), 0);
    assert_eq!(ip.free(Kind::Pointer, 0x10, || 0), 0);
    assert_eq!(ip.free(Kind::Pointer, 0x20, || 0), 0);
    assert_eq!(ip.budget().used(0), 0);
    assert!(ip.ledger().is_empty());
}

#[test]
fn memory_shows_the_share_and_the_smaller_free() {
    let dir = tempfile::tempdir().unwrap();
    let ip = Interposer::open(&Limits::new(vec![4096 * MIB]), &budget_file(&dir)).unwrap();
    assert_eq!(ip.memory(0, 80_000 * MIB), (4096 * MIB, 4096 * MIB));
    ip.allocate(Kind::Pointer, 0, 1024 * MIB, || Ok(1));
    assert_eq!(ip.memory(0, 80_000 * MIB), (3072 * MIB, 4096 * MIB));
    // The GPU is fuller than the share says: the driver's free wins.
    assert_eq!(ip.memory(0, 500 * MIB), (500 * MIB, 4096 * MIB));
}

#[test]
fn a_dead_process_share_comes_back_when_an_allocation_needs_it() {
    let dir = tempfile::tempdir().unwrap();
    let limits = Limits::new(vec![4096 * MIB]);
    let budget = Budget::open(&budget_file(&dir), &limits).unwrap();
    let dead = budget.claim_slot(dead_pid(), 0).unwrap();
    assert!(budget.try_reserve(Some(dead), 0, 3072 * MIB));
    let me = budget.claim_slot(std::process::id(), 0).unwrap();
    assert!(budget.try_reserve(Some(me), 0, 2048 * MIB));
    assert_eq!(budget.used(0), 2048 * MIB);
    assert_eq!(budget.slot_bytes(dead, 0), 0);
    assert_eq!(budget.refused_count(0), 0);
}

#[test]
fn a_reused_pid_is_told_from_its_dead_predecessor() {
    let dir = tempfile::tempdir().unwrap();
    let budget = Budget::open(&budget_file(&dir), &Limits::new(vec![MIB])).unwrap();
    // Our own (live) pid, but a start time that is not ours: a predecessor's slot.
    let stale = budget.claim_slot(std::process::id(), 1).unwrap();
    assert!(budget.try_reserve(Some(stale), 0, MIB));
    assert_eq!(budget.reclaim_dead(), MIB);
    // A live process with an unknown start time is left alone.
    let live = budget.claim_slot(std::process::id(), 0).unwrap();
    assert!(budget.try_reserve(Some(live), 0, MIB));
    assert_eq!(budget.reclaim_dead(), 0);
    assert_eq!(budget.used(0), MIB);
}

#[test]
fn the_file_is_shared_by_path_and_refuses_other_limits() {
    let dir = tempfile::tempdir().unwrap();
    let path = budget_file(&dir);
    let a = Budget::open(&path, &Limits::new(vec![4096 * MIB])).unwrap();
    let b = Budget::open(&path, &Limits::new(vec![4096 * MIB])).unwrap();
    assert!(a.try_reserve(None, 0, 4000 * MIB));
    assert!(!b.try_reserve(None, 0, 100 * MIB));
    assert!(Budget::open(&path, &Limits::new(vec![2048 * MIB])).is_err());
    // A file its creator left sized but without a header is set up again.
    let orphan = dir.path().join("orphan");
    std::fs::write(&orphan, vec![0u8; FILE_LEN]).unwrap();
    let c = Budget::open(&orphan, &Limits::new(vec![MIB])).unwrap();
    assert!(c.try_reserve(None, 0, MIB));
    std::fs::write(dir.path().join("junk"), b"not a budget").unwrap();
    assert!(Budget::open(&dir.path().join("junk"), &Limits::new(vec![MIB])).is_err());
}

/// The mapping writes where the reader (gpushare-isolation-budget, its own tests) reads.
#[test]
fn the_reader_sees_what_the_interposer_counted() {
    let dir = tempfile::tempdir().unwrap();
    let path = budget_file(&dir);
    let ip = Interposer::open(&Limits::new(vec![4096 * MIB, 2048 * MIB]), &path).unwrap();
    ip.allocate(Kind::Pointer, 1, 1500 * MIB, || Ok(1));
    ip.allocate(Kind::Pointer, 1, 1000 * MIB, || Ok(2));
    let snapshot = Snapshot::read(&path).unwrap();
    assert_eq!(snapshot.gpus.len(), 2);
    assert_eq!(
        (
            snapshot.gpus[0].share,
            snapshot.gpus[0].used,
            snapshot.gpus[0].refused
        ),
        (4096 * MIB, 0, 0)
    );
    assert_eq!(
        (
            snapshot.gpus[1].share,
            snapshot.gpus[1].used,
            snapshot.gpus[1].refused
        ),
        (2048 * MIB, 1500 * MIB, 1)
    );
    assert_eq!(snapshot.processes.len(), 1);
    assert_eq!(snapshot.processes[0].pid, std::process::id());
    assert_eq!(snapshot.processes[0].used, vec![0, 1500 * MIB]);
}

/// Threads that make a fresh process's first allocations all at once (they claim its slot
/// together) fill the share exactly. A claim used to give up the slots of "an earlier program
/// of this process", which a claim a moment earlier by another thread looked like: its bytes
/// were forgotten and the threads got past the share.
#[test]
fn threads_claiming_the_slot_together_fill_the_share_exactly() {
    const THREADS: usize = 8;
    let share = 64 * MIB;
    for _ in 0..50 {
        let dir = tempfile::tempdir().unwrap();
        let ip = Interposer::open(&Limits::new(vec![share]), &budget_file(&dir)).unwrap();
        let next_key = AtomicU64::new(1);
        let start = std::sync::Barrier::new(THREADS);
        let granted: u64 = std::thread::scope(|s| {
            let threads: Vec<_> = (0..THREADS)
                .map(|_| {
                    s.spawn(|| {
                        start.wait();
                        let mut granted = 0;
                        loop {
                            let key = next_key.fetch_add(1, Ordering::Relaxed);
                            if ip.allocate(Kind::Pointer, 0, MIB, || Ok(key)) != CUDA_SUCCESS {
                                return granted;
                            }
                            granted += MIB;
                        }
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).sum()
        });
        assert_eq!(granted, share);
        assert_eq!(ip.budget().used(0), share);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Threads of one process allocating and freeing at once never hold more than the share,
    /// and when all is freed nothing stays counted.
    #[test]
    fn threads_racing_never_pass_the_share(
        share_mib in 1u64..64,
        work in prop::collection::vec(prop::collection::vec((1u64..24, any::<bool>()), 1..60), 2..6),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let share = share_mib * MIB;
        let ip = Interposer::open(&Limits::new(vec![share]), &budget_file(&dir)).unwrap();
        let next_key = AtomicU64::new(1);
        let over = AtomicU64::new(0);
        std::thread::scope(|s| {
            for ops in &work {
                let (ip, next_key, over) = (&ip, &next_key, &over);
                s.spawn(move || {
                    let mut held = Vec::new();
                    for &(mib, free_one) in ops {
                        let key = next_key.fetch_add(1, Ordering::Relaxed);
                        if ip.allocate(Kind::Pointer, 0, mib * MIB, || Ok(key)) == CUDA_SUCCESS {
                            held.push(key);
                        }
                        if ip.budget().used(0) > share {
                            over.fetch_add(1, Ordering::Relaxed);
                        }
                        if free_one && let Some(key) = held.pop() {
                            assert_eq!(ip.free(Kind::Pointer, key, || CUDA_SUCCESS), CUDA_SUCCESS);
                        }
                    }
                    for key in held {
                        assert_eq!(ip.free(Kind::Pointer, key, || CUDA_SUCCESS), CUDA_SUCCESS);
                    }
                });
            }
        });
        prop_assert_eq!(over.load(Ordering::Relaxed), 0);
        prop_assert_eq!(ip.budget().used(0), 0);
        prop_assert!(ip.ledger().is_empty());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Processes (forked, each with its own mapping and slot) reserving at once never hold
    /// more than the share together; once they are dead, their bytes all come back.
    #[test]
    fn processes_racing_never_pass_the_share_and_the_dead_give_it_back(
        share_mib in 1u64..256,
        work in prop::collection::vec(prop::collection::vec(1u64..32, 1..40), 2..6),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = budget_file(&dir);
        let limits = Limits::new(vec![share_mib * MIB]);
        let budget = Budget::open(&path, &limits).unwrap();
        let children = race_in_children(&path, &limits, &work);
        prop_assert!(children.iter().all(|ok| *ok), "a child failed: {children:?}");
        let snapshot = Snapshot::read(&path).unwrap();
        let held: u64 = snapshot.processes.iter().map(|p| p.used[0]).sum();
        prop_assert!(snapshot.gpus[0].used <= share_mib * MIB);
        prop_assert_eq!(snapshot.gpus[0].used, held);
        // Every child is dead and reaped: reclaiming gives all back.
        prop_assert_eq!(budget.reclaim_dead(), held);
        prop_assert_eq!(budget.used(0), 0);
        prop_assert!(Snapshot::read(&path).unwrap().processes.is_empty());
    }
}

/// Forks one child per list of sizes; each opens the budget, takes a slot, waits for the
/// start, reserves every size it can (keeping them) and exits. Returns whether each exited 0.
fn race_in_children(path: &std::path::Path, limits: &Limits, work: &[Vec<u64>]) -> Vec<bool> {
    let mut fds = [0; 2];
    // SAFETY: a place for two descriptors.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    let [start_read, start_write] = fds;
    let mut pids = Vec::new();
    for sizes in work {
        // Everything the child needs is ready before the fork.
        let budget = Budget::open(path, limits).unwrap();
        // SAFETY: the child only touches the mapping, reads a pipe and calls _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // SAFETY: in the child: the descriptors are ours; _exit skips every destructor.
            unsafe {
                libc::close(start_write);
                let slot = budget.claim_slot(libc::getpid() as u32, 0);
                let mut byte = 0u8;
                libc::read(start_read, (&raw mut byte).cast(), 1);
                for &mib in sizes {
                    budget.try_reserve(slot, 0, mib * MIB);
                }
                libc::_exit(if slot.is_some() { 0 } else { 3 });
            }
        }
        pids.push(pid);
    }
    // SAFETY: our descriptors; closing the write end starts every child at once.
    unsafe {
        libc::close(start_read);
        libc::close(start_write);
    }
    pids.into_iter()
        .map(|pid| {
            let mut status = 0;
            // SAFETY: our own child and a place for its status.
            let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
            waited == pid && libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
        })
        .collect()
}

/// An interposer charging `context_mib` per context, over one GPU with a share of `gib`.
fn with_contexts(dir: &tempfile::TempDir, gib: u64, context_mib: u64) -> Interposer {
    let settings = Settings {
        context_bytes: context_mib * MIB,
        measure_context: false,
        ..Settings::default()
    };
    Interposer::open_with(&Limits::new(vec![gib << 30]), settings, &budget_file(dir)).unwrap()
}

#[test]
fn a_context_is_charged_and_everything_made_in_it_comes_back_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let ip = with_contexts(&dir, 4, 256);
    assert_eq!(ip.create_context(0, || Ok(0xc0)), Ok(0xc0));
    assert_eq!(ip.budget().used(0), 256 * MIB);
    let here = Place { gpu: 0, ctx: 0xc0 };
    assert_eq!(
        ip.allocate_at(Kind::Pointer, here, 3840 * MIB, || Ok(1)),
        CUDA_SUCCESS
    );
    // 256 MiB + 3.75 GiB held: nothing more fits.
    assert_eq!(
        ip.allocate_at(Kind::Pointer, here, 1024 * MIB, || Ok(2)),
        CUDA_ERROR_OUT_OF_MEMORY
    );
    // A context that does not fit is refused like an allocation.
    assert_eq!(
        ip.create_context(0, || Ok(0xc1)),
        Err(CUDA_ERROR_OUT_OF_MEMORY)
    );
    assert_eq!(ip.drop_context(0xc0), 4096 * MIB);
    assert_eq!(ip.budget().used(0), 0);
    // Seen again (a primary context used after a reset): charged again.
    ip.ensure_context(0xc0, 0);
    ip.ensure_context(0xc0, 0);
    assert_eq!(ip.budget().used(0), 256 * MIB);
}

#[test]
fn a_primary_context_is_charged_once_and_goes_with_its_last_release() {
    let dir = tempfile::tempdir().unwrap();
    let ip = with_contexts(&dir, 4, 256);
    assert_eq!(ip.retain_primary(0, 0, || Ok(0xd0), || None), CUDA_SUCCESS);
    assert_eq!(ip.retain_primary(0, 0, || Ok(0xd0), || None), CUDA_SUCCESS);
    assert_eq!(ip.budget().used(0), 256 * MIB);
    let here = Place { gpu: 0, ctx: 0xd0 };
    assert_eq!(
        ip.allocate_at(Kind::Pointer, here, 1024 * MIB, || Ok(1)),
        CUDA_SUCCESS
    );
    ip.reset_primary(0);
    assert_eq!(
        ip.budget().used(0),
        0,
        "a reset frees everything in the context"
    );
    ip.ensure_context(0xd0, 0);
    ip.release_primary(0);
    assert_eq!(ip.budget().used(0), 256 * MIB, "one retain is still held");
    ip.release_primary(0);
    assert_eq!(ip.budget().used(0), 0);
}

#[test]
fn a_pool_is_charged_what_it_reserves_until_it_gives_it_back() {
    let dir = tempfile::tempdir().unwrap();
    let ip = Interposer::open(
        &Limits::new(vec![4096 * MIB, 4096 * MIB]),
        &budget_file(&dir),
    )
    .unwrap();
    let pool = 0x9000;
    ip.pool_created(pool, 1);
    let on_gpu1 = Place { gpu: 1, ctx: 0 };
    // 3 GiB from an empty pool: the pool grows by 3 GiB, on the pool's GPU.
    let code = ip.allocate_from_pool(
        on_gpu1,
        pool,
        3072 * MIB,
        0,
        || Ok(0x100),
        || Some(3072 * MIB),
    );
    assert_eq!(code, CUDA_SUCCESS);
    assert_eq!((ip.budget().used(0), ip.budget().used(1)), (0, 3072 * MIB));
    // Freed back to the pool, which keeps it (a raised release threshold).
    assert_eq!(ip.free_pointer(0x100, || 0), (CUDA_SUCCESS, Some(pool)));
    ip.refresh_pool(pool, Some(3072 * MIB));
    assert_eq!(
        ip.allocate(Kind::Pointer, 1, 3072 * MIB, || Ok(0x200)),
        CUDA_ERROR_OUT_OF_MEMORY
    );
    // Reusing what the pool holds needs no room.
    let code = ip.allocate_from_pool(
        on_gpu1,
        pool,
        2048 * MIB,
        3072 * MIB,
        || Ok(0x300),
        || Some(3072 * MIB),
    );
    assert_eq!(code, CUDA_SUCCESS);
    assert_eq!(ip.budget().used(1), 3072 * MIB);
    // Trimmed: the reservation comes back.
    ip.free_pointer(0x300, || 0);
    assert_eq!(ip.refresh_pool(pool, Some(0)), 3072 * MIB);
    assert_eq!(
        ip.allocate(Kind::Pointer, 1, 3072 * MIB, || Ok(0x200)),
        CUDA_SUCCESS
    );
    // A destroyed pool's charge goes with it.
    ip.allocate_from_pool(
        on_gpu1,
        pool,
        512 * MIB,
        0,
        || Ok(0x400),
        || Some(512 * MIB),
    );
    // A pool the driver cannot be asked about keeps its charge; a destroyed one loses it.
    assert_eq!(ip.refresh_pool(pool, None), 0);
    assert_eq!(ip.pool_destroyed(pool), 512 * MIB);
    assert_eq!(ip.budget().used(1), 3072 * MIB);
}

#[test]
fn a_vmm_handle_counts_until_it_is_released_and_mapped_nowhere() {
    let dir = tempfile::tempdir().unwrap();
    let ip = Interposer::open(&Limits::new(vec![4096 * MIB]), &budget_file(&dir)).unwrap();
    let (handle, va) = (0x77, 0x7000_0000);
    assert_eq!(
        ip.allocate(Kind::Handle, 0, 3072 * MIB, || Ok(handle)),
        CUDA_SUCCESS
    );
    ip.mapped(va, 3072 * MIB, handle);
    ip.released(handle);
    assert_eq!(ip.budget().used(0), 3072 * MIB, "still mapped");
    ip.retained(handle);
    ip.unmapped(va, 3072 * MIB);
    assert_eq!(ip.budget().used(0), 3072 * MIB, "still retained");
    ip.released(handle);
    assert_eq!(ip.budget().used(0), 0);
}

#[test]
fn raising_a_context_limit_is_charged_and_lowering_gives_it_back() {
    let dir = tempfile::tempdir().unwrap();
    let ip = Interposer::open(&Limits::new(vec![4096 * MIB]), &budget_file(&dir)).unwrap();
    let here = Place { gpu: 0, ctx: 0xc0 };
    let mut reached = false;
    let code = ip.change_limit(here, 2, i128::from(8192 * MIB), || {
        reached = true;
        0
    });
    assert_eq!((code, reached), (CUDA_ERROR_OUT_OF_MEMORY, false));
    assert_eq!(
        ip.change_limit(here, 2, i128::from(1024 * MIB), || 0),
        CUDA_SUCCESS
    );
    assert_eq!(ip.budget().used(0), 1024 * MIB);
    assert_eq!(
        ip.change_limit(here, 2, -i128::from(512 * MIB), || 0),
        CUDA_SUCCESS
    );
    assert_eq!(ip.budget().used(0), 512 * MIB);
    assert_eq!(ip.drop_context(0xc0), 512 * MIB);
}

#[test]
fn graph_memory_is_charged_what_each_gpu_reserves() {
    let dir = tempfile::tempdir().unwrap();
    let ip = Interposer::open(&Limits::new(vec![4096 * MIB]), &budget_file(&dir)).unwrap();
    assert!(!ip.would_fit(0, 6144 * MIB));
    assert_eq!(ip.budget().refused_count(0), 1);
    assert!(ip.would_fit(0, 3072 * MIB));
    assert_eq!(ip.budget().used(0), 0, "nothing stays reserved");
    ip.set_graph_charge(0, 3072 * MIB);
    assert!(!ip.would_fit(0, 3072 * MIB));
    assert_eq!(ip.set_graph_charge(0, 0), 3072 * MIB);
}

/// A slot locked by its holder (here: another open file description of this process, as a
/// process of another PID namespace would hold it) is alive whatever its pid says here:
/// neither reclaimed nor given up as an earlier program's. Once the lock goes (the holder's
/// descriptor closed, as at its death), its bytes come back.
#[test]
fn a_locked_slot_is_alive_whatever_its_pid_and_free_once_its_lock_goes() {
    let dir = tempfile::tempdir().unwrap();
    let path = budget_file(&dir);
    let limits = Limits::new(vec![4096 * MIB]);
    let holder = Budget::open(&path, &limits).unwrap();
    // A pid that is dead here, and a start time, as another namespace's process has them.
    let pid = dead_pid();
    let slot = holder.claim_own_slot(pid, 7).unwrap();
    assert!(holder.try_reserve(Some(slot), 0, 3072 * MIB));

    let other = Budget::open(&path, &limits).unwrap();
    assert_eq!(
        other.reclaim_dead(),
        0,
        "a live holder's slot was reclaimed"
    );
    assert!(!other.try_reserve(None, 0, 2048 * MIB));
    assert_eq!(
        other.release_slots_of(pid, 7),
        0,
        "given up as an earlier program's"
    );
    assert!(!other.has_slot_of(pid));
    assert_eq!(other.used(0), 3072 * MIB);

    // Without the lock the same slot is judged by its (dead) pid.
    let unlocked = other.claim_slot(pid, 7).unwrap();
    assert!(other.try_reserve(Some(unlocked), 0, MIB));
    assert_eq!(other.reclaim_dead(), MIB);

    drop(holder);
    // A process that has not seen the slot alive yet (no proof of life cached).
    let later = Budget::open(&path, &limits).unwrap();
    assert_eq!(later.reclaim_dead(), 3072 * MIB);
    assert_eq!(later.used(0), 0);
    assert!(Snapshot::read(&path).unwrap().processes.is_empty());
}

/// A budget that could not be applied refuses memory of every kind, and nothing given back
/// opens room in it; queries show it full.
#[test]
fn a_closed_budget_refuses_every_kind_of_memory() {
    let share = 4096 * MIB;
    let closed = Budget::closed(Some(&Limits::new(vec![share]))).unwrap();
    assert!(closed.is_closed());
    let settings = Settings {
        context_bytes: 0,
        measure_context: false,
        ..Settings::default()
    };
    let ip = Interposer::with_budget(closed, settings);
    let place = Place { gpu: 0, ctx: 0 };
    let never = || -> Result<u64, i32> { panic!("the driver was reached") };
    assert_eq!(ip.memory(0, 80_000 * MIB), (0, share));
    // A context charged nothing is refused too: the driver would hold memory for it.
    assert_eq!(ip.create_context(0, never), Err(CUDA_ERROR_OUT_OF_MEMORY));
    for kind in [Kind::Pointer, Kind::Handle] {
        assert_eq!(ip.allocate(kind, 0, MIB, never), CUDA_ERROR_OUT_OF_MEMORY);
    }
    assert_eq!(
        ip.allocate(Kind::Pointer, 0, 0, never),
        CUDA_ERROR_OUT_OF_MEMORY
    );
    let pool_never = || -> Option<u64> { panic!("the driver was reached") };
    assert_eq!(
        ip.allocate_from_pool(place, 9, MIB, 2 * MIB, never, pool_never),
        CUDA_ERROR_OUT_OF_MEMORY,
        "room in a pool does not let an allocation through"
    );
    assert_eq!(
        ip.change_limit(place, 2, 1 << 20, || panic!("the driver was reached")),
        CUDA_ERROR_OUT_OF_MEMORY
    );
    assert!(!ip.would_fit(0, 1));
    // Charges moving down give nothing back.
    ip.set_graph_charge(0, 512 * MIB);
    ip.set_graph_charge(0, 0);
    ip.budget().release(None, 0, share);
    assert_eq!(ip.memory(0, 80_000 * MIB), (0, share));
    assert_eq!(
        ip.allocate(Kind::Pointer, 0, MIB, never),
        CUDA_ERROR_OUT_OF_MEMORY
    );
    assert_eq!(ip.budget().refused_count(0), 8);
}
