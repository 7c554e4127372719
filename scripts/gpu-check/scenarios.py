"""The programs gpu-check.sh runs under the isolation library, one scenario per process.

    python3 scenarios.py NAME

Each scenario is what a user's program does with GPU memory (fill it with PyTorch under each of
its allocators, a CUDA graph with memory nodes, two processes of one container, ...). It runs
here, in a process that `harness.py` started with the library preloaded, and talks to the
harness over stdout and stdin, one line at a time:

    GOT mib=N          what the program managed to allocate (the last one counts)
    CHECK ok|bad WHAT  a condition of the scenario, met or not
    HOLD LABEL         the program holds its memory now: the harness reads the device's use from
                       NVML (in its own process, not through the library), then answers a line
                       on stdin, and the program goes on
    SKIPPED WHY        the scenario cannot run here (a package is missing)
    ERROR WHAT         an exception ended the scenario
    DONE               the scenario ran to its end
    step/info ...      what happened, for the log

The share comes from GPUSHARE_CONTAINER_MEM_GIB, what one CUDA context costs from
GPUSHARE_CONTEXT_MIB (gpu-check.sh measures it first). Heavy packages are imported inside each
scenario, so that one missing package skips only the scenarios that use it.
"""

import ctypes
import os
import subprocess
import sys
import time
import traceback

MIB = 1 << 20
CHUNK_MIB = 256
CUDA_ERROR_OUT_OF_MEMORY = 2


def out(*words):
    print(*words, flush=True)


def got(mib):
    out(f"GOT mib={mib}")


def check(ok, what):
    out(f"CHECK {'ok' if ok else 'bad'} {what}")
    return ok


def hold(label):
    """Holds here until the harness has read the device's use (at once, when run by hand)."""
    out(f"HOLD {label}")
    sys.stdin.readline()


def skipped(why):
    out(f"SKIPPED {why}")
    sys.exit(0)


def share_mib():
    gib = float(os.environ.get("GPUSHARE_CONTAINER_MEM_GIB", "4"))
    return int(gib * 1024)


def context_mib():
    try:
        return int(os.environ.get("GPUSHARE_CHECK_CONTEXT_MIB")
                   or os.environ.get("GPUSHARE_CONTEXT_MIB", "0"))
    except ValueError:
        return 0


def fill_cap_mib():
    """Fill loops stop here if nothing refuses them: far past the share, far below the GPU."""
    return 3 * share_mib()


def two_context_mib():
    """What each of two processes asks for: 3 GiB, unless two contexts leave less than 4 GiB.

    One must fit next to both contexts, two must not: 0.75 of what the contexts leave."""
    left = share_mib() - 2 * context_mib()
    mib = min(3072, int(left * 0.75) // 64 * 64)
    out(f"info size mib={mib} (3 GiB, or 0.75 of the share less two contexts of "
        f"{context_mib()} MiB)")
    return mib


def want(module):
    try:
        return __import__(module, fromlist=["_"])
    except Exception as e:  # ImportError, or a broken install
        skipped(f"{module} cannot be imported: {type(e).__name__}: {e}")


# --- the CUDA driver through cuda-bindings --------------------------------------------------


def driver():
    try:
        from cuda.bindings import driver as cu
    except Exception:
        try:
            from cuda import cuda as cu  # cuda-python before 12.6
        except Exception as e:
            skipped(f"cuda-bindings cannot be imported: {type(e).__name__}: {e}")
    return cu


def rc_of(res):
    """(code, the other values) of a cuda-bindings call's answer."""
    if isinstance(res, tuple):
        return int(res[0]), res[1:]
    return int(res), ()


def step(name, res, cu=None):
    code, vals = rc_of(res)
    label = ""
    if cu is not None and code:
        try:
            label = " " + cu.CUresult(code).name
        except Exception:
            pass
    out(f"step {name} rc={code}{label}")
    return code, vals


def primary_context(cu):
    """cuInit, device 0's primary context made current: (device, context)."""
    code, _ = step("cuInit", cu.cuInit(0), cu)
    if code:
        raise RuntimeError(f"cuInit failed: {code}")
    code, (dev,) = step("cuDeviceGet", cu.cuDeviceGet(0), cu)
    code, (ctx,) = step("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(dev), cu)
    if code:
        raise RuntimeError(f"cuDevicePrimaryCtxRetain failed: {code}")
    step("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx), cu)
    return dev, ctx


def mem_alloc(cu, mib):
    """cuMemAlloc of MIB MiB: (code, pointer or None)."""
    code, vals = step(f"cuMemAlloc mib={mib}", cu.cuMemAlloc(mib * MIB), cu)
    return code, (vals[0] if not code else None)


# --- measuring one context, without the library ---------------------------------------------


def ctx_torch():
    torch = want("torch")
    torch.cuda.init()
    x = torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    hold("context")
    del x


def ctx_bare():
    cu = driver()
    step("cuInit", cu.cuInit(0), cu)
    _, (dev,) = step("cuDeviceGet", cu.cuDeviceGet(0), cu)
    try:  # CUDA 13: cuCtxCreate(params, flags, dev); before: cuCtxCreate(flags, dev)
        res = cu.cuCtxCreate(None, 0, dev)
    except TypeError:
        res = cu.cuCtxCreate(0, dev)
    code, vals = step("cuCtxCreate", res, cu)
    if code:
        raise RuntimeError(f"cuCtxCreate failed: {code}")
    hold("context")
    step("cuCtxDestroy", cu.cuCtxDestroy(vals[0]), cu)


# --- PyTorch ---------------------------------------------------------------------------------


def torch_oom(torch):
    return getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def torch_fill(torch):
    """256 MiB tensors until PyTorch says out of memory (or the cap): the tensors."""
    oom = torch_oom(torch)
    held = []
    cap = fill_cap_mib()
    while len(held) * CHUNK_MIB < cap:
        try:
            held.append(torch.empty(CHUNK_MIB * MIB, dtype=torch.uint8, device="cuda"))
        except oom as e:
            out(f"info out of memory after {len(held) * CHUNK_MIB} MiB: "
                f"{str(e).splitlines()[0][:160]}")
            break
    else:
        out(f"info nothing refused up to the cap of {cap} MiB")
    if held:  # the memory is usable, not only counted
        for t in held:
            t.fill_(1)
        torch.cuda.synchronize()
    return held


def torch_scenario(refill=False):
    torch = want("torch")
    backend = torch.cuda.get_allocator_backend()
    out(f"info allocator backend={backend} "
        f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')}")
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "cudaMallocAsync" in conf:
        check(backend == "cudaMallocAsync", f"the allocator is cudaMallocAsync ({backend})")
    free, total = torch.cuda.mem_get_info(0)
    out(f"info torch.cuda.mem_get_info total_mib={total // MIB} free_mib={free // MIB}")
    check(total // MIB == share_mib(), f"PyTorch sees the share as total ({total // MIB} MiB)")
    held = torch_fill(torch)
    first = len(held) * CHUNK_MIB
    got(first)
    check(first >= share_mib() // 2, f"at least half the share allocated ({first} MiB)")
    hold("filled")
    if not refill:
        return
    del held
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = torch_fill(torch)
    second = len(held) * CHUNK_MIB
    out(f"info after freeing everything, allocated again {second} MiB (first {first} MiB)")
    check(second >= first - CHUNK_MIB,
          f"the pool gave back: again {second} MiB of the first {first} MiB")
    got(min(first, second))
    hold("refilled")


def torch_default():
    torch_scenario()


def torch_expandable():
    torch_scenario()


def torch_async():
    torch_scenario(refill=True)


def _two_procs_worker(i, mib, ready, results, release):
    import torch

    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    ready.wait(30)  # both contexts exist before either allocates
    oom = torch_oom(torch)
    x = None
    try:
        x = torch.empty(mib * MIB, dtype=torch.uint8, device="cuda")
        x.fill_(1)
        torch.cuda.synchronize()
        results.put((i, "ok", ""))
    except oom:
        results.put((i, "refused", ""))
    except Exception as e:
        results.put((i, "error", f"{type(e).__name__}: {str(e)[:200]}"))
    release.wait(60)
    del x


def two_procs():
    torch = want("torch")
    import torch.multiprocessing as mp

    mib = two_context_mib()
    ctx = mp.get_context("spawn")
    ready, release, results = ctx.Barrier(2), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_two_procs_worker, args=(i, mib, ready, results, release))
             for i in range(2)]
    for p in procs:
        p.start()
    answers = []
    try:
        for _ in procs:
            answers.append(results.get(timeout=45))
        for i, what, err in sorted(answers):
            out(f"info process {i} allocating {mib} MiB: {what} {err}")
        ok = sorted(a[1] for a in answers)
        got(mib * ok.count("ok"))
        check(ok == ["ok", "refused"], f"exactly one of two processes allocated ({ok})")
        hold("both")
    finally:
        release.set()
        for p in procs:
            p.join(20)
            if p.exitcode is None:
                p.kill()
        for p in procs:
            out(f"info process exit code {p.exitcode}")
    check(all(p.exitcode == 0 for p in procs), "both processes exited cleanly")


# --- CUDA_VISIBLE_DEVICES: one GPU under two names ----------------------------------------------


def cvd_worker():
    """Run by `cvd`: device 0's context, then on `go` allocate argv[2] MiB, then wait."""
    cu = driver()
    primary_context(cu)
    code, (count,) = rc_of(cu.cuDeviceGetCount())
    out(f"info devices={count} CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}")
    out("ready")
    sys.stdin.readline()
    code, ptr = mem_alloc(cu, int(sys.argv[2]))
    out(f"alloc rc={code}")
    sys.stdin.readline()
    if ptr is not None:
        step("cuMemFree", cu.cuMemFree(ptr), cu)


def cvd():
    driver()  # skips here, not in the workers, without cuda-bindings
    uuid = os.environ.get("GPUSHARE_GPU_UUID", "")
    if not uuid:
        skipped("GPUSHARE_GPU_UUID is not set")
    mib = two_context_mib()
    procs, codes = [], []

    def start(visible):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible)
        p = subprocess.Popen([sys.executable, __file__, "cvd-worker", str(mib)], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        procs.append((visible, p))
        return p

    def read_until(p, visible, word):
        for line in p.stdout:
            out(f"  [{visible}] {line.rstrip()}")
            if line.startswith(word):
                return line
        raise RuntimeError(f"the worker with CUDA_VISIBLE_DEVICES={visible} ended early")

    def say(p):
        p.stdin.write("go\n")
        p.stdin.flush()

    try:
        for visible in (uuid, "0"):  # both contexts exist before either allocates
            read_until(start(visible), visible, "ready")
        for visible, p in procs:
            say(p)
            line = read_until(p, visible, "alloc ")
            codes.append(int(line.split("rc=")[1].split()[0]))
        got(mib * codes.count(0))
        check(codes[0] == 0, f"CUDA_VISIBLE_DEVICES={uuid} allocated {mib} MiB (rc={codes[0]})")
        check(codes[1] == CUDA_ERROR_OUT_OF_MEMORY,
              f"CUDA_VISIBLE_DEVICES=0 refused {mib} MiB more on the same GPU (rc={codes[1]})")
        hold("both")
    finally:
        for visible, p in procs:
            try:
                say(p)
            except (OSError, ValueError):
                pass
        for visible, p in procs:
            try:
                rest = p.communicate(timeout=20)[0]  # closes its stdin
            except subprocess.TimeoutExpired:
                p.kill()
                rest = p.communicate()[0]
            for line in (rest or "").splitlines():
                out(f"  [{visible}] {line}")
            out(f"info worker CUDA_VISIBLE_DEVICES={visible} exit code {p.returncode}")
    check(all(p.returncode == 0 for _, p in procs), "both workers exited cleanly")


# --- a CUDA graph with memory nodes -----------------------------------------------------------


def graph_run(cu, dev, stream, mib):
    """A graph of one memory-allocation node of MIB MiB, instantiated and launched.

    Returns (where it was refused or None, the allocation's address or None)."""
    code, (graph,) = step("cuGraphCreate", cu.cuGraphCreate(0), cu)
    if code:
        raise RuntimeError(f"cuGraphCreate failed: {code}")
    p = cu.CUDA_MEM_ALLOC_NODE_PARAMS()
    p.poolProps.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.poolProps.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.poolProps.location.id = int(dev)
    p.bytesize = mib * MIB
    code, _ = step(f"cuGraphAddMemAllocNode mib={mib}",
                   cu.cuGraphAddMemAllocNode(graph, None, 0, p), cu)
    if code:
        return "cuGraphAddMemAllocNode", None
    ptr = p.dptr
    code, vals = step("cuGraphInstantiate", cu.cuGraphInstantiate(graph, 0), cu)
    if code:
        return "cuGraphInstantiate", None
    code, _ = step("cuGraphLaunch", cu.cuGraphLaunch(vals[0], stream), cu)
    if code:
        return "cuGraphLaunch", None
    code, _ = step("cuStreamSynchronize", cu.cuStreamSynchronize(stream), cu)
    if code:
        return "cuStreamSynchronize", None
    return None, ptr


def graph_mem():
    cu = driver()
    dev, _ = primary_context(cu)
    _, (stream,) = step("cuStreamCreate", cu.cuStreamCreate(0), cu)
    share = share_mib()
    over = share + 2048  # 6 GiB under 4 GiB
    refused, ptr = graph_run(cu, dev, stream, over)
    check(refused is not None, f"a graph allocating {over} MiB is refused "
          f"(at {refused or 'nowhere: it ran'})")
    if ptr is not None:
        hold("over")
        step("cuMemFreeAsync", cu.cuMemFreeAsync(ptr, stream), cu)
        step("cuStreamSynchronize", cu.cuStreamSynchronize(stream), cu)
    step("cuDeviceGraphMemTrim", cu.cuDeviceGraphMemTrim(dev), cu)
    fits = 3072
    refused, ptr = graph_run(cu, dev, stream, fits)
    check(refused is None, f"a graph allocating {fits} MiB runs (refused at {refused})")
    got(fits if refused is None else 0)
    code, extra = mem_alloc(cu, 3072)
    check(code == CUDA_ERROR_OUT_OF_MEMORY,
          f"then cuMemAlloc of 3072 MiB is refused (rc={code})")
    hold("graph-and-alloc")
    if extra is not None:
        step("cuMemFree", cu.cuMemFree(extra), cu)
    if ptr is not None:
        step("cuMemFreeAsync", cu.cuMemFreeAsync(ptr, stream), cu)
        step("cuStreamSynchronize", cu.cuStreamSynchronize(stream), cu)
    step("cuDeviceGraphMemTrim", cu.cuDeviceGraphMemTrim(dev), cu)


# --- a primary-context reset ------------------------------------------------------------------


def ctx_reset():
    cu = driver()
    dev, _ = primary_context(cu)
    code, _ = mem_alloc(cu, 3072)
    check(code == 0, f"3072 MiB allocated (rc={code})")
    hold("before-reset")
    code, _ = step("cuDevicePrimaryCtxReset", cu.cuDevicePrimaryCtxReset(dev), cu)
    check(code == 0, f"the primary context reset (rc={code})")
    code, (ctx,) = step("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(dev), cu)
    step("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx), cu)
    code, ptr = mem_alloc(cu, 3072)
    check(code == 0, f"after the reset 3072 MiB allocated again: the reset gave back (rc={code})")
    got(3072 if code == 0 else 0)
    hold("after-reset")
    if ptr is not None:
        step("cuMemFree", cu.cuMemFree(ptr), cu)


# --- the 32-bit v1 entry point ----------------------------------------------------------------


def v1_alloc(control=False):
    """Twice X MiB through the 32-bit v1 cuMemAlloc: the second must be refused.

    The v1 API addresses 4 GiB in all, so the driver itself refuses two allocations of 3 GiB;
    gpu-check.sh runs this under a 2 GiB share, with X = 0.75 of the share less one context
    (one fits, two do not), and first as `v1-control`, without the library, where both must
    be granted: the refusal is then the library's."""
    mib = min(3072, int((share_mib() - context_mib()) * 0.75) // 64 * 64)
    out(f"info size mib={mib} (0.75 of the share less one context of {context_mib()} MiB)")
    lib = ctypes.CDLL("libcuda.so.1")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    out(f"step cuInit rc={lib.cuInit(0)}")
    out(f"step cuDeviceGet rc={lib.cuDeviceGet(ctypes.byref(dev), 0)}")
    # The driver keeps v1 calls to contexts made by the v1 API (a primary context answers
    # them CUDA_ERROR_INVALID_CONTEXT, 201): the v1 cuCtxCreate, else the primary context.
    code = lib.cuCtxCreate(ctypes.byref(ctx), ctypes.c_uint(0), dev)
    out(f"step cuCtxCreate(v1) rc={code}")
    if code:
        out(f"step cuDevicePrimaryCtxRetain rc="
            f"{lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)}")
        out(f"step cuCtxSetCurrent rc={lib.cuCtxSetCurrent(ctx)}")
    v1 = lib.cuMemAlloc  # the v1 symbol: CUresult cuMemAlloc(unsigned int *dptr, unsigned int)
    v1.restype = ctypes.c_int
    v1.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    codes = []
    for _ in range(2):
        ptr = ctypes.c_uint64(0)  # 8 bytes, in case anything writes a 64-bit pointer
        code = v1(ctypes.byref(ptr), ctypes.c_uint(mib * MIB))
        out(f"step cuMemAlloc(v1) mib={mib} rc={code} ptr={ptr.value:#x}")
        codes.append(code)
    if codes[0] not in (0, CUDA_ERROR_OUT_OF_MEMORY):
        skipped(f"the driver's v1 cuMemAlloc allocates nothing here (rc={codes[0]})")
    got(mib * codes.count(0))
    check(codes[0] == 0, f"the first {mib} MiB through v1 cuMemAlloc allocated (rc={codes[0]})")
    if control:
        check(codes[1] == 0, f"without the library the driver grants {mib} MiB more through "
              f"v1 cuMemAlloc (rc={codes[1]})")
    else:
        check(codes[1] == CUDA_ERROR_OUT_OF_MEMORY,
              f"the second {mib} MiB through v1 cuMemAlloc refused (rc={codes[1]})")
    hold("both")


def v1_control():
    v1_alloc(control=True)


# --- JAX, CuPy, Numba -------------------------------------------------------------------------


def jax_prealloc():
    jax = want("jax")
    import jax.numpy as jnp

    devs = jax.devices()
    out(f"info jax devices={devs}")
    check(devs and devs[0].platform == "gpu", "JAX runs on the GPU")
    try:
        stats = devs[0].memory_stats() or {}
        out(f"info jax bytes_limit_mib={stats.get('bytes_limit', 0) // MIB} "
            f"reserved_mib={stats.get('bytes_reserved', 0) // MIB}")
    except Exception as e:
        out(f"info memory_stats: {e}")
    held = []
    cap = fill_cap_mib()
    while len(held) * CHUNK_MIB < cap:
        try:
            a = jnp.ones((CHUNK_MIB * MIB,), dtype=jnp.uint8)
            a.block_until_ready()
            held.append(a)
        except Exception as e:
            text = str(e)
            if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
                out(f"info out of memory after {len(held) * CHUNK_MIB} MiB: "
                    f"{text.splitlines()[0][:160]}")
                break
            raise
    got(len(held) * CHUNK_MIB)
    check(held, "JAX started and allocated")
    hold("filled")


def cupy_fill():
    cp = want("cupy")
    held = []
    cap = fill_cap_mib()
    while len(held) * CHUNK_MIB < cap:
        try:
            held.append(cp.ones(CHUNK_MIB * MIB, dtype=cp.uint8))
        except cp.cuda.memory.OutOfMemoryError as e:
            out(f"info out of memory after {len(held) * CHUNK_MIB} MiB: {str(e)[:160]}")
            break
    cp.cuda.runtime.deviceSynchronize()
    got(len(held) * CHUNK_MIB)
    check(len(held) * CHUNK_MIB >= share_mib() // 2, "at least half the share allocated")
    hold("filled")


def numba_fill():
    want("numba")
    from numba import cuda
    import numpy as np

    held = []
    cap = fill_cap_mib()
    while len(held) * CHUNK_MIB < cap:
        try:
            held.append(cuda.device_array(CHUNK_MIB * MIB, dtype=np.uint8))
        except Exception as e:
            text = str(e)
            if "OUT_OF_MEMORY" in text or "out of memory" in text.lower():
                out(f"info out of memory after {len(held) * CHUNK_MIB} MiB: {text[:160]}")
                break
            raise
    cuda.synchronize()
    got(len(held) * CHUNK_MIB)
    check(len(held) * CHUNK_MIB >= share_mib() // 2, "at least half the share allocated")
    hold("filled")


SCENARIOS = {
    "ctx-torch": ctx_torch,
    "ctx-bare": ctx_bare,
    "torch-default": torch_default,
    "torch-expandable": torch_expandable,
    "torch-async": torch_async,
    "graph-mem": graph_mem,
    "two-procs": two_procs,
    "cvd": cvd,
    "cvd-worker": cvd_worker,
    "jax": jax_prealloc,
    "ctx-reset": ctx_reset,
    "v1-control": v1_control,
    "v1-alloc": v1_alloc,
    "cupy": cupy_fill,
    "numba": numba_fill,
}


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else ""
    scenario = SCENARIOS.get(name)
    if scenario is None:
        out(f"ERROR unknown scenario {name!r}; known: {' '.join(SCENARIOS)}")
        sys.exit(2)
    start = time.monotonic()
    try:
        scenario()
    except SystemExit:
        raise
    except BaseException as e:
        traceback.print_exc()
        out(f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        sys.exit(1)
    out(f"DONE seconds={time.monotonic() - start:.1f}")


if __name__ == "__main__":
    main()
