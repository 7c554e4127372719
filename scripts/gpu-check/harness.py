"""Runs scenarios.py's programs in child processes and judges them against the GPU's real use.

    python3 harness.py idle                      -> idle used_mib=N
    python3 harness.py context                   -> context-cost mib=N torch=A bare=B
    python3 harness.py run NAME [--preload LIB] [--env K=V]... [--timeout S] [--control]
                                                 -> RESULT NAME share_mib=S got_mib=G device_mib=D pass|fail
                                                    or SKIP NAME: WHY

This process never loads the isolation library (gpu-check.sh does not preload it; only the
child gets LD_PRELOAD), so what it reads from NVML (`nvmlDeviceGetMemoryInfo`, device-wide
used memory) is the driver's own figure, not the share the library reports. It reads the
GPU's used memory before the child starts (the baseline, once the last scenario's memory is
back), every 50 ms while the child runs, and several times at each `HOLD` the child prints,
before it lets the child go on. device_mib is the highest reading less the baseline: what the
GPU really held for the child and everything it started. Without pynvml it polls nvidia-smi.

A scenario passes when the child ran to its end (exit 0, DONE, no ERROR), met its own checks
(no `CHECK bad`), and the device held no more than the share plus a small slack for the
driver's rounding (GPUSHARE_CHECK_SLACK_MIB, default the larger of 64 MiB and 2 % of the share).
`--control` runs the scenario without the library (no LD_PRELOAD) and without the device
limit: a control that shows what the driver alone does.
"""

import os
import queue
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = os.path.join(HERE, "scenarios.py")
MIB = 1 << 20
NOISE_SHOWN = 25  # lines of a child's other output shown as they come; the rest only on failure


def say(line):
    print(line, flush=True)


class Gpu:
    """The GPU's used memory in MiB, from NVML (or nvidia-smi), never through the library."""

    def __init__(self):
        self.how = None
        uuid = os.environ.get("GPUSHARE_GPU_UUID", "")
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = (pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid
                           else pynvml.nvmlDeviceGetHandleByIndex(0))
            self.how = "nvml"
            self.used_mib()
        except Exception as e:
            say(f"  (NVML from Python unusable: {type(e).__name__}: {e}; polling nvidia-smi)")
            self.how = "smi"
            self.smi_id = uuid or "0"
            self.used_mib()

    def used_mib(self):
        if self.how == "nvml":
            return self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used / MIB
        text = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
             "-i", self.smi_id], capture_output=True, text=True, timeout=10).stdout
        return float(text.strip().splitlines()[0])

    def processes(self):
        """NVML's list of compute processes (empty under gVisor), for the log."""
        if self.how != "nvml":
            return "not read"
        try:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except Exception as e:
            return f"unreadable ({type(e).__name__})"
        if not procs:
            return "none listed (gVisor lists none)"
        return " ".join(f"pid={p.pid}:{(p.usedGpuMemory or 0) // MIB}MiB" for p in procs)

    def settle(self, idle, wait_s=8.0):
        """The used memory once the last scenario's has gone back (near idle, and steady)."""
        end = time.monotonic() + wait_s
        last = self.used_mib()
        while True:
            time.sleep(0.2)
            now = self.used_mib()
            steady = abs(now - last) < 2
            if steady and (idle is None or now <= idle + 32):
                return now
            if time.monotonic() > end:
                say(f"  (used memory did not settle to idle {idle} MiB: {now:.0f} MiB; "
                    f"measuring from there)")
                return now
            last = now


class Sampler(threading.Thread):
    """Reads the used memory every 50 ms and keeps the highest."""

    def __init__(self, gpu):
        super().__init__(daemon=True)
        self.gpu, self.peak, self.stop = gpu, 0.0, threading.Event()
        self.lock = threading.Lock()

    def note(self, mib):
        with self.lock:
            self.peak = max(self.peak, mib)

    def run(self):
        while not self.stop.is_set():
            try:
                self.note(self.gpu.used_mib())
            except Exception:
                pass
            self.stop.wait(0.05)


def idle_mib():
    try:
        return float(os.environ["GPUSHARE_CHECK_IDLE_MIB"])
    except (KeyError, ValueError):
        return None


def run_child(gpu, name, env, timeout, tag):
    """Runs scenario NAME with ENV; returns what it said and what the GPU held."""
    res = {"got": None, "bad": [], "ok": [], "errors": [], "skipped": None, "done": False,
           "holds": {}, "reasons": [], "rc": None, "noise": []}
    base = gpu.settle(idle_mib())
    sampler = Sampler(gpu)
    sampler.start()
    proc = subprocess.Popen([sys.executable, SCENARIOS, name], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    lines = queue.Queue()

    def reader():
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=reader, daemon=True).start()
    deadline = time.monotonic() + timeout
    shown = 0
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                res["reasons"].append(f"timed out after {timeout:.0f} s")
                break
            try:
                line = lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                break
            word = line.split(" ", 1)[0]
            rest = line[len(word) + 1:]
            if word in ("GOT", "CHECK", "HOLD", "SKIPPED", "ERROR", "DONE", "step", "info",
                        "alloc") or line.startswith("  ["):
                say(f"  [{tag}] {line}")
            else:
                res["noise"].append(line)
                if shown < NOISE_SHOWN:
                    say(f"  [{tag}] | {line}")
                    shown += 1
            if word == "GOT":
                res["got"] = int(rest.split("mib=")[1].split()[0])
            elif word == "CHECK":
                (res["ok"] if rest.startswith("ok") else res["bad"]).append(rest[3:].strip())
            elif word == "SKIPPED":
                res["skipped"] = rest
            elif word == "ERROR":
                res["errors"].append(rest)
            elif word == "DONE":
                res["done"] = True
            elif word == "HOLD":
                time.sleep(0.3)
                samples = []
                for _ in range(5):
                    samples.append(gpu.used_mib())
                    time.sleep(0.1)
                top = max(samples)
                sampler.note(top)
                res["holds"][rest] = top - base
                say(f"  [{tag}] hold {rest}: device_mib={top - base:.0f} "
                    f"(used {top:.0f} MiB, baseline {base:.0f} MiB); "
                    f"NVML processes: {gpu.processes()}")
                try:
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                except OSError:
                    pass
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            if not any("timed out" in r for r in res["reasons"]):
                res["reasons"].append(f"timed out after {timeout:.0f} s")
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
        sampler.stop.set()
        sampler.join(2)
    res["rc"] = proc.returncode
    res["base"] = base
    res["device"] = max(0.0, sampler.peak - base)
    if len(res["noise"]) > shown:
        say(f"  [{tag}] ({len(res['noise']) - shown} more lines of output not shown)")
    return res


def child_env(preload, extra):
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env["PYTHONUNBUFFERED"] = "1"
    if preload:
        env["LD_PRELOAD"] = preload
    for pair in extra:
        key, _, value = pair.partition("=")
        env[key] = value
    return env


def cmd_idle(gpu):
    say(f"idle used_mib={gpu.settle(None, wait_s=3):.0f}")


def cmd_context(gpu):
    """What one context costs, measured without the library: a PyTorch one and a bare one."""
    env = child_env(None, [])
    env.pop("GPUSHARE_CONTEXT_MIB", None)
    costs = {}
    for name in ("ctx-torch", "ctx-bare"):
        res = run_child(gpu, name, env, 60, name)
        if res["skipped"] or res["rc"] != 0 or "context" not in res["holds"]:
            say(f"  [{name}] not measured (exit {res['rc']}, {res['skipped'] or res['errors']})")
            continue
        costs[name] = round(res["holds"]["context"])
    if not costs:
        say("context-cost unknown")
        return 1
    say(f"context-cost mib={max(costs.values())} torch={costs.get('ctx-torch', '?')} "
        f"bare={costs.get('ctx-bare', '?')}")
    return 0


def cmd_run(gpu, name, preload, extra, timeout, control=False):
    share = int(float(os.environ.get("GPUSHARE_CONTAINER_MEM_GIB", "4")) * 1024)
    slack = int(os.environ.get("GPUSHARE_CHECK_SLACK_MIB", "0") or 0) or max(64, share * 2 // 100)
    if control:
        preload = None
    res = run_child(gpu, name, child_env(preload, extra), timeout, name)
    if res["skipped"] and res["rc"] == 0:
        say(f"SKIP {name}: {res['skipped']}")
        return 0
    reasons = list(res["reasons"])
    rc = res["rc"]
    timed_out = any("timed out" in r for r in reasons)
    if rc is not None and rc < 0 and not timed_out:  # a timeout's SIGKILL is ours
        reasons.append(f"crashed with signal {-rc} ({signal.Signals(-rc).name})")
    elif rc and not timed_out:
        reasons.append(f"exit status {rc}")
    reasons += [f"error: {e}" for e in res["errors"]]
    if not res["done"] and not reasons:
        reasons.append("did not run to its end")
    reasons += [f"not met: {b}" for b in res["bad"]]
    device = res["device"]
    if device > share + slack and not control:
        reasons.append(f"the device held {device:.0f} MiB > share {share} + slack {slack} MiB")
    if reasons:  # the end of its other output, where not shown already
        shown = min(len(res["noise"]), NOISE_SHOWN)
        for line in res["noise"][max(shown, len(res["noise"]) - 12):]:
            say(f"  [{name}] | {line}")
    got = "?" if res["got"] is None else res["got"]
    verdict = "pass" if not reasons else "fail (" + "; ".join(reasons) + ")"
    say(f"RESULT {name} share_mib={share} got_mib={got} device_mib={device:.0f} {verdict}")
    return 0


def main(argv):
    if not argv:
        say(__doc__)
        return 2
    try:
        gpu = Gpu()
    except Exception as e:
        name = argv[1] if argv[0] == "run" and len(argv) > 1 else argv[0]
        say(f"  cannot read the GPU's memory: {type(e).__name__}: {e}")
        if argv[0] == "run":
            say(f"RESULT {name} share_mib=? got_mib=? device_mib=? fail (no NVML, no nvidia-smi)")
        return 1
    if argv[0] == "idle":
        return cmd_idle(gpu)
    if argv[0] == "context":
        return cmd_context(gpu)
    if argv[0] == "run" and len(argv) > 1:
        name, preload, extra, timeout, control = argv[1], None, [], 60.0, False
        args = argv[2:]
        while args:
            if args[0] == "--control":
                control, args = True, args[1:]
                continue
            flag, value, args = args[0], (args[1] if len(args) > 1 else ""), args[2:]
            if flag == "--preload":
                preload = value
            elif flag == "--env":
                extra.append(value)
            elif flag == "--timeout":
                timeout = float(value)
            else:
                say(f"unknown argument {flag}")
                return 2
        try:
            return cmd_run(gpu, name, preload, extra, timeout, control)
        except Exception as e:  # never leave the script without a verdict
            import traceback

            traceback.print_exc()
            say(f"RESULT {name} share_mib=? got_mib=? device_mib=? fail "
                f"(harness error: {type(e).__name__}: {e})")
            return 1
    say(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]) or 0)
