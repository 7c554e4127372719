//! The ways real programs take GPU memory, against a fake driver that takes it the way a GPU
//! does (`isolation/probe/fake/libcuda.rs`): contexts, stream-ordered pools that keep their
//! reservation, VMM handles released while mapped, graph memory, context limits, the 32-bit
//! v1 entry points, `CUDA_VISIBLE_DEVICES`, a driver opened by path, managed memory.
//!
//! What must hold, read from the fake's device state (`FAKE_GPU_STATE`: what every process
//! holds on each physical GPU, contexts included): the container's processes never hold more
//! than its share on any GPU; allocations within the share succeed; the reports are right.
//!
//! The test builds the interposer and both probes (`gpushare-isolation-probe`, and
//! `gpushare-isolation-probe-dl`, which does not link the driver), as `interpose.rs` does, or
//! takes them from `GPUSHARE_ISOLATION_BIN_DIR`. The node, its containers and the probe
//! sessions the scenarios drive are in `common/fake_node.rs`.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

mod common;
// The harness, beside the helpers every test file shares; only this one runs it.
#[path = "common/fake_node.rs"]
mod fake_node;

use common::built;
use fake_node::{Container, GIB, MIB, Node, Session, assert_device_within, uuid};

const WAYS: [&str; 3] = ["link", "dlsym", "getproc"];

#[test]
fn a_pool_keeping_its_reservation_counts_against_the_share() {
    let node = Node::new(1, 16384, 0);
    let container = Container::new(&node, &[0], 4);
    let mut p = container.start(
        "link",
        &[
            "pool-threshold:4096",
            "pool-alloc:3072",
            "pool-free",
            "sync",
            "alloc:mem:3072",
            "info",
            "wait",
            "trim:0",
            "alloc:mem:3072",
            "info",
            "wait",
        ],
    );
    let out = p.stop();
    assert_device_within(
        &node,
        0,
        4 * GIB,
        "pool kept 3 GiB, then cuMemAlloc 3 GiB",
        &out,
    );
    assert_eq!(out.allocs(), [0, 2], "{:?}", out.lines);
    let out = p.next();
    assert_eq!(out.one("trim", "result"), 0);
    assert_eq!(out.allocs(), [0], "after trim:0: {:?}", out.lines);
    assert_device_within(&node, 0, 4 * GIB, "after trim:0", &out);
}

#[test]
fn a_pool_on_another_gpu_is_charged_on_that_gpu() {
    let node = Node::new(2, 16384, 0);
    let container = Container::new(&node, &[0, 1], 4);
    let mut p = container.start(
        "link",
        &[
            "pool-create:1",
            "pool-alloc-from:3072",
            "pool-alloc-from:2048",
            "info",
            "wait",
        ],
    );
    let out = p.stop();
    assert_eq!(out.one("pool-create", "result"), 0);
    assert_device_within(&node, 1, 4 * GIB, "a pool on GPU 1", &out);
    assert_eq!(out.allocs(), [0, 2], "GPU 1's share: {:?}", out.lines);
    assert_eq!(out.one("cuda", "dev"), 0);
    assert_eq!(
        out.one("cuda", "free"),
        4 * GIB,
        "GPU 0 (current) holds nothing: {:?}",
        out.lines
    );
}

#[test]
fn vmm_memory_released_while_mapped_still_counts() {
    let node = Node::new(1, 16384, 0);
    let container = Container::new(&node, &[0], 4);
    for via in WAYS {
        let mut p = container.start(
            via,
            &[
                "vmm-map:3072",
                "vmm-map:3072",
                "vmm-map:3072",
                "info",
                "wait",
                "vmm-unmap",
                "vmm-map:3072",
                "info",
                "wait",
            ],
        );
        let out = p.stop();
        assert_device_within(&node, 0, 4 * GIB, via, &out);
        assert_eq!(out.allocs(), [0, 2, 2], "{via}: {:?}", out.lines);
        assert_eq!(out.one("cuda", "free"), GIB, "{via}: {:?}", out.lines);
        let out = p.next();
        assert_eq!(out.one("vmm-unmap", "result"), 0, "{via}");
        assert_eq!(out.allocs(), [0], "{via}: after vmm-unmap: {:?}", out.lines);
        assert_device_within(&node, 0, 4 * GIB, via, &out);
    }
}

#[test]
fn graph_memory_counts_against_the_share_until_trimmed() {
    let node = Node::new(1, 16384, 0);
    let container = Container::new(&node, &[0], 4);
    for kind in ["graph-alloc", "graph-capture"] {
        let [big, fits] = [6144, 3072].map(|m| format!("{kind}:{m}"));
        let mut p = container.start(
            "link",
            &[
                &big,
                "wait",
                &fits,
                "alloc:mem:3072",
                "wait",
                "graph-trim",
                "alloc:mem:3072",
                "wait",
            ],
        );
        let out = p.stop();
        assert_device_within(&node, 0, 4 * GIB, &big, &out);
        assert_eq!(out.one(kind, "result"), 2, "{big}: {:?}", out.lines);
        let out = p.next();
        assert_eq!(out.one(kind, "result"), 0, "{fits}: {:?}", out.lines);
        assert_eq!(
            out.allocs(),
            [2],
            "{fits}: the graph pool keeps 3 GiB: {:?}",
            out.lines
        );
        assert_device_within(&node, 0, 4 * GIB, &fits, &out);
        let out = p.next();
        assert_eq!(out.one("graph-trim", "result"), 0, "{kind}");
        assert_eq!(
            out.allocs(),
            [0],
            "{kind}: after graph-trim: {:?}",
            out.lines
        );
        assert_device_within(&node, 0, 4 * GIB, kind, &out);
    }
}

#[test]
fn a_context_limit_past_the_share_is_refused() {
    let node = Node::new(1, 16384, 0);
    let container = Container::new(&node, &[0], 4);
    let mut p = container.start("link", &["limit:heap:8192", "info", "wait"]);
    let out = p.stop();
    assert_device_within(&node, 0, 4 * GIB, "an 8 GiB heap", &out);
    assert_eq!(out.one("limit", "result"), 2, "{:?}", out.lines);
}

#[test]
fn the_v1_entry_points_are_held_to_the_share() {
    // 3 GiB: the v1 cuMemGetInfo reports in 32 bits, and 4 GiB does not fit.
    let node = Node::new(1, 16384, 0);
    let container = Container::new(&node, &[0], 3);
    for via in WAYS {
        let mut p = container.start(
            via,
            &[
                "v1-alloc:2048",
                "v1-alloc:2048",
                "v1-info",
                "wait",
                "v1-free",
                "alloc:mem:3072",
                "wait",
            ],
        );
        let out = p.stop();
        assert_device_within(&node, 0, 3 * GIB, via, &out);
        assert_eq!(out.allocs(), [0, 2], "{via}: {:?}", out.lines);
        assert_eq!(
            out.one("v1-info", "total"),
            3 * GIB,
            "{via}: {:?}",
            out.lines
        );
        assert_eq!(out.one("v1-info", "free"), GIB, "{via}: {:?}", out.lines);
        let out = p.next();
        assert_eq!(out.one("v1-free", "result"), 0, "{via}");
        assert_eq!(out.allocs(), [0], "{via}: after v1-free: {:?}", out.lines);
        assert_device_within(&node, 0, 3 * GIB, via, &out);
    }
}

#[test]
fn contexts_count_against_the_share() {
    // 256 MiB per context; a neighbour on the same 8 GiB GPU needs all of its 4 GiB.
    let node = Node::new(1, 8192, 256);
    let container = Container::new(&node, &[0], 4);
    let mut holders: Vec<Session> = Vec::new();
    let mut results = Vec::new();
    for i in 0..4 {
        let mut holder = container.start("link", &["alloc:mem:1024", "info", "hold"]);
        let out = holder.stop();
        holders.push(holder);
        let pids: Vec<u32> = holders.iter().map(|h| h.pid).collect();
        let held = node.held_by(&pids, 0);
        assert!(
            held <= 4 * GIB,
            "process {i}: the container holds {} MiB: {:?}\nstate: {:?}",
            held / MIB,
            out.lines,
            node.holdings()
        );
        results.push(out.one("alloc", "result"));
        assert_eq!(out.one("cuda", "total"), 4 * GIB, "process {i}");
        for word in ["nvml", "nvml2"] {
            assert_eq!(out.one(word, "total"), 4 * GIB, "process {i} {word}");
            assert_eq!(
                out.one(word, "used") + out.one(word, "free"),
                4 * GIB,
                "process {i} {word}: {:?}",
                out.lines
            );
        }
        if i == 0 {
            assert_eq!(
                out.one("nvml", "used"),
                1280 * MIB,
                "its context and 1 GiB: {:?}",
                out.lines
            );
        }
    }
    assert!(
        results.contains(&2),
        "four processes of 256 MiB + 1 GiB under 4 GiB: {results:?}"
    );
    let neighbour = Container::new(&node, &[0], 4);
    let mut other = neighbour.start("link", &["alloc:mem:3840", "hold"]);
    let out = other.stop();
    assert_eq!(
        out.allocs(),
        [0],
        "the neighbour's 4 GiB less its context: {:?}\nstate: {:?}",
        out.lines,
        node.holdings()
    );
}

#[test]
fn a_context_is_charged_what_it_took_when_no_figure_is_set() {
    // 300 MiB per context, and no GPUSHARE_CONTEXT_MIB: the interposer measures (through NVML).
    let node = Node::new(1, 16384, 300);
    let mut container = Container::new(&node, &[0], 4);
    container
        .vars
        .retain(|(name, _)| *name != "GPUSHARE_CONTEXT_MIB");
    // Two processes, one after the other (a measure is a drop of the device's free memory:
    // another process allocating during it would be counted in).
    let mut a = container.start("link", &["alloc:mem:1024", "hold"]);
    let out_a = a.stop();
    let mut b = container.start("link", &["alloc:mem:1024", "hold"]);
    let out_b = b.stop();
    assert_eq!((out_a.allocs(), out_b.allocs()), (vec![0], vec![0]));
    // A third context: three of 300 MiB and 2 GiB leave 1,148 MiB.
    let out = container.run(
        "link",
        &["info", "alloc:mem:1200", "alloc:mem:1100", "info"],
    );
    assert_eq!(
        out.all("nvml", "used"),
        [2948 * MIB, 4048 * MIB],
        "{:?}\nstate: {:?}",
        out.lines,
        node.holdings()
    );
    assert_eq!(out.allocs(), [2, 0], "{:?}", out.lines);
    assert_device_within(&node, 0, 4 * GIB, "measured contexts", &out);
}

#[test]
fn cuda_visible_devices_maps_ordinals_to_physical_gpus() {
    let node = Node::new(2, 16384, 0);
    let container = Container::new(&node, &[0, 1], 4);
    let start = |visible: Option<&str>, steps: &[&str]| {
        let mut command = container.command(&built().probe, "link", steps);
        if let Some(v) = visible {
            command.env("CUDA_VISIBLE_DEVICES", v);
        }
        container.start_command(command, steps)
    };
    // Different GPUs: both fit.
    let mut a = start(Some("0"), &["uuid", "alloc:mem:3072", "hold"]);
    let out_a = a.stop();
    let mut b = start(Some("1"), &["uuid", "alloc:mem:3072", "hold"]);
    let out_b = b.stop();
    assert_eq!(out_a.allocs(), [0], "{:?}", out_a.lines);
    assert_eq!(
        out_b.allocs(),
        [0],
        "CUDA_VISIBLE_DEVICES=1 is GPU 1: {:?}",
        out_b.lines
    );
    for gpu in 0..2 {
        assert_device_within(&node, gpu, 4 * GIB, "A and B", &out_b);
    }
    drop((a, b));
    // The same GPU under two ordinals: one is refused.
    let mut c = start(Some("1,0"), &["device:1", "uuid", "alloc:mem:3072", "hold"]);
    let out_c = c.stop();
    assert!(
        out_c.lines.iter().any(|l| l.contains(&uuid(0))),
        "ordinal 1 under 1,0 is GPU 0: {:?}",
        out_c.lines
    );
    let mut d = start(None, &["alloc:mem:3072", "hold"]);
    let out_d = d.stop();
    for gpu in 0..2 {
        assert_device_within(&node, gpu, 4 * GIB, "C (1,0: ordinal 1) and D", &out_d);
    }
    assert_eq!(out_c.allocs(), [0], "{:?}", out_c.lines);
    assert_eq!(out_d.allocs(), [2], "GPU 0 is C's: {:?}", out_d.lines);
}

#[test]
fn a_reset_or_destroyed_context_gives_its_memory_back() {
    let node = Node::new(1, 16384, 0);
    let container = Container::new(&node, &[0], 4);
    let mut p = container.start(
        "link",
        &[
            "alloc:mem:3072",
            "reset",
            "alloc:mem:3072",
            "alloc:mem:2048",
            "wait",
            "ctx-create",
            "alloc:mem:1024",
            "ctx-destroy",
            "alloc:mem:1024",
            "wait",
        ],
    );
    let out = p.stop();
    assert_eq!(out.one("reset", "result"), 0);
    assert_eq!(
        out.allocs(),
        [0, 0, 2],
        "the reset freed 3 GiB, and the share still holds: {:?}",
        out.lines
    );
    assert_device_within(&node, 0, 4 * GIB, "reset", &out);
    let out = p.next();
    assert_eq!(out.one("ctx-create", "result"), 0);
    assert_eq!(out.one("ctx-destroy", "result"), 0);
    assert_eq!(
        out.allocs(),
        [0, 0],
        "cuCtxDestroy freed 1 GiB: {:?}",
        out.lines
    );
    assert_device_within(&node, 0, 4 * GIB, "ctx-destroy", &out);
}

/// Runs `probe --via path:DRIVER` (1 GiB share; `library_path`: its `LD_LIBRARY_PATH`, else
/// the fake's directory) up to its `wait`: 900 MiB fit, 200 MiB more do not, and the driver
/// the program opened holds the 900 MiB itself (its `fakeHeldBytes`, no hooked call), so
/// the hooks forwarded to that file and not to another driver.
fn run_by_path(probe: &Path, driver: &Path, library_path: Option<&Path>) {
    let node = Node::new(1, 16384, 0);
    let container = Container::new(&node, &[0], 1);
    let via = format!("path:{}", driver.display());
    let steps = [
        "info",
        "alloc:mem:900",
        "alloc:mem:200",
        "info",
        "held:0",
        "wait",
    ];
    let mut command = container.command(probe, &via, &steps);
    if let Some(dir) = library_path {
        command.env("LD_LIBRARY_PATH", dir);
    }
    let mut p = container.start_command(command, &steps);
    let out = p.stop();
    let what = format!("{} --via {via}", probe.display());
    assert_device_within(&node, 0, GIB, &what, &out);
    assert_eq!(
        out.all("cuda", "total"),
        [GIB; 2],
        "{what}: {:?}",
        out.lines
    );
    assert_eq!(out.allocs(), [0, 2], "{what}: {:?}", out.lines);
    assert_eq!(
        out.one("held", "bytes"),
        900 * MIB,
        "{what}: the driver opened by path served the calls: {:?}",
        out.lines
    );
}

#[test]
fn a_driver_opened_by_path_is_held_to_the_share() {
    // A driver of another soname (libcuda.so.550) under another file name, as a compat
    // driver or a NUMBA_CUDA_DRIVER target is; no libcuda.so.1 anywhere the loader looks.
    let drivers = tempfile::tempdir().unwrap();
    let fake = gpushare_isolation_probe::fake_driver_dir();
    let cuda = drivers.path().join("libcuda.so.550.54.15");
    std::fs::copy(fake.join("libcuda.so.550"), &cuda).unwrap();
    std::fs::copy(
        fake.join("libnvidia-ml.so.1"),
        drivers.path().join("libnvidia-ml.so.1"),
    )
    .unwrap();
    run_by_path(&built().probe_dl, &cuda, Some(drivers.path()));

    // The scenario is real: no driver is found by the soname libcuda.so.1 there.
    let node = Node::new(1, 16384, 0);
    let container = Container::new(&node, &[0], 1);
    let mut command = container.command(&built().probe_dl, "dlsym", &["info"]);
    command.env("LD_LIBRARY_PATH", drivers.path());
    let out = command.output().unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("error message=dlopen"),
        "libcuda.so.1 was found: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn a_driver_opened_by_path_beside_the_systems_is_the_one_served() {
    // libcuda.so.1 is found by soname (the fake's directory is on LD_LIBRARY_PATH), and the
    // program opens another driver by path: the hooks forward to the file it opened.
    let fake = gpushare_isolation_probe::fake_driver_dir();
    run_by_path(&built().probe_dl, &fake.join("libcuda.so.550"), None);
    // The probe that links libcuda.so.1, so that it is loaded first, opening a copy of it
    // (the same soname, another file) by path.
    let drivers = tempfile::tempdir().unwrap();
    let copy = drivers.path().join("libcuda.so.1.compat");
    std::fs::copy(fake.join("libcuda.so.1"), &copy).unwrap();
    run_by_path(&built().probe, &copy, None);
}

#[test]
fn reports_show_the_share_whatever_the_call() {
    let node = Node::new(2, 16384, 0);
    let container = Container::new(&node, &[0], 4);
    let out = container.run("link", &["info-null-free", "info", "nvml-info:1"]);
    assert_eq!(out.one("info-null-free", "result"), 0, "{:?}", out.lines);
    assert_eq!(
        out.one("info-null-free", "total"),
        4 * GIB,
        "{:?}",
        out.lines
    );
    for word in ["nvml", "nvml2"] {
        assert_eq!(out.one(word, "total"), 4 * GIB, "{word}");
        assert_eq!(
            out.one(word, "used") + out.one(word, "free"),
            out.one(word, "total"),
            "{word}: {:?}",
            out.lines
        );
    }
    // NVML index 1: a GPU that is not the container's.
    assert_eq!(out.one("nvml-info", "result"), 0, "{:?}", out.lines);
    assert_ne!(out.one("nvml-info", "total"), 0, "{:?}", out.lines);
    assert_eq!(out.one("nvml-info", "free"), 0, "{:?}", out.lines);
}

#[test]
fn an_exec_gives_the_old_programs_memory_back_at_once() {
    let node = Node::new(1, 16384, 0);
    let container = Container::new(&node, &[0], 4);
    let mut p = container.start("link", &["alloc:mem:3072", "exec", "wait"]);
    let out = p.stop();
    assert_eq!(out.allocs(), [0], "{:?}", out.lines);
    // The new program never allocates; another process sees the whole share free.
    let other = container.run("link", &["info"]);
    assert_eq!(
        other.one("cuda", "free"),
        4 * GIB,
        "while the exec'd program runs: {:?}",
        other.lines
    );
    assert_eq!(node.device(0), 0, "the device: {:?}", node.holdings());
}

#[test]
fn managed_memory_is_charged_unless_ignored() {
    let node = Node::new(1, 16384, 0);
    let charged = Container::new(&node, &[0], 4);
    let out = charged.run("link", &["alloc:managed:6144"]);
    assert_eq!(out.allocs(), [2], "charged by default: {:?}", out.lines);
    let ignored = Container::new(&node, &[0], 4).with("GPUSHARE_MANAGED_MEMORY", "ignore");
    let mut p = ignored.start("link", &["alloc:managed:6144", "wait"]);
    let out = p.stop();
    assert_eq!(
        out.allocs(),
        [0],
        "GPUSHARE_MANAGED_MEMORY=ignore: {:?}",
        out.lines
    );
    assert_eq!(node.device(0), 0, "managed memory stays on the host");
}
