#!/usr/bin/env python3
"""Compute shares under the interposer on a real GPU (scripts/gpu-check.sh, section 4).

Each "container" is a process of its own: its own accounting directory (so its own budget,
which is what the interposer tells containers apart by), one node-wide compute directory
shared by all of them, and GPUSHARE_COMPUTE_PERCENT / GPUSHARE_COMPUTE_MODE as the device
plugin hands them. Each runs PyTorch matrix multiplies back to back for the same wall-clock
window and counts them. Printed, one line each:

    COMPUTE run=NAME share=P mode=M iters_per_s=X of_baseline=F of_total=T

of_baseline: its rate over the rate of one process alone without the library;
of_total: its part of all the runs' multiplies together. Verdicts (RESULT lines):

    three at 20/30/50 (shared): each of_total within 5 points of its share
    one alone at 30 (shared):   of_baseline >= 0.90 (idle SM time is used)
    one alone at 30 (capped):   of_baseline within 5 points of 0.30

Usage: compute.py LIB UUID [SECONDS]
"""

import os
import subprocess
import sys
import tempfile
import time

WORKER = r"""
import os, sys, time
import torch
n = 4096
a = torch.randn(n, n, device="cuda", dtype=torch.float16)
b = torch.randn(n, n, device="cuda", dtype=torch.float16)
for _ in range(3):
    (a @ b)
torch.cuda.synchronize()
start_at, seconds = float(sys.argv[1]), float(sys.argv[2])
while time.time() < start_at:
    time.sleep(0.001)
count = 0
end = start_at + seconds
while time.time() < end:
    for _ in range(8):
        c = a @ b
    torch.cuda.synchronize()
    count += 8
print("ITERS", count / seconds, flush=True)
"""


def run(lib, uuid, seconds, members, compute_dir):
    """Runs `members` [(share, mode)] at once; their rates (multiplies per second)."""
    start_at = time.time() + 6.0
    procs = []
    for share, mode in members:
        env = dict(os.environ)
        for key in ("LD_PRELOAD", "GPUSHARE_COMPUTE_PERCENT", "GPUSHARE_COMPUTE_MODE"):
            env.pop(key, None)
        if share is not None:
            env.update(
                LD_PRELOAD=lib,
                GPUSHARE_CONTAINER_MEM_GIB="8",
                GPUSHARE_GPU_UUID=uuid,
                GPUSHARE_ISOLATION_DIR=tempfile.mkdtemp(prefix="compute-budget."),
                GPUSHARE_COMPUTE_DIR=compute_dir,
                GPUSHARE_COMPUTE_PERCENT=str(share),
                GPUSHARE_COMPUTE_MODE=mode,
            )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", WORKER, str(start_at), str(seconds)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    rates = []
    for proc in procs:
        out, _ = proc.communicate(timeout=seconds + 120)
        line = [l for l in out.splitlines() if l.startswith("ITERS ")]
        if not line:
            print(out, end="")
            rates.append(None)
        else:
            rates.append(float(line[-1].split()[1]))
    return rates


def main():
    lib, uuid = sys.argv[1], sys.argv[2]
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 8.0
    compute_dir = tempfile.mkdtemp(prefix="compute-dir.")
    os.chmod(compute_dir, 0o1777)
    (baseline,) = run(lib, uuid, seconds, [(None, "")], compute_dir)
    if not baseline:
        print("RESULT compute-baseline fail (the worker did not run)")
        return 1
    print(f"COMPUTE run=baseline share=100 mode=none iters_per_s={baseline:.1f} of_baseline=1.00 of_total=1.00")
    failed = 0
    cases = [
        ("three-shared", [(20, "shared"), (30, "shared"), (50, "shared")]),
        ("alone-shared", [(30, "shared")]),
        ("alone-capped", [(30, "capped")]),
    ]
    for name, members in cases:
        rates = run(lib, uuid, seconds, members, compute_dir)
        if any(r is None for r in rates):
            print(f"RESULT compute-{name} fail (a worker did not run)")
            failed += 1
            continue
        total = sum(rates)
        verdicts = []
        for (share, mode), rate in zip(members, rates):
            of_base, of_total = rate / baseline, rate / total
            print(
                f"COMPUTE run={name} share={share} mode={mode} iters_per_s={rate:.1f} "
                f"of_baseline={of_base:.2f} of_total={of_total:.2f}"
            )
            if name == "three-shared":
                verdicts.append(abs(of_total - share / 100) <= 0.05)
            elif mode == "shared":
                verdicts.append(of_base >= 0.90)
            else:
                verdicts.append(abs(of_base - share / 100) <= 0.05)
        ok = all(verdicts)
        failed += 0 if ok else 1
        print(f"RESULT compute-{name} {'pass' if ok else 'fail'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
