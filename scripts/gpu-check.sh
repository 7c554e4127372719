#!/usr/bin/env bash
# The isolation interposer (libgpushare_isolation.so) on a machine with a real NVIDIA GPU.
#
# What it checks, and why:
#  1. The probe (a driver-API program linked to the real libcuda.so.1), under a 1 GiB share,
#     each of the three ways to the driver (linked, dlopen+dlsym, cuGetProcAddress): sees
#     1024 MiB (CUDA and NVML), is refused past it, VMM and managed memory counted too;
#     nvidia-smi shows 1024 MiB; without the library the driver's own total is seen.
#  2. What one CUDA context costs on this GPU, measured without the library (NVML's device-wide
#     used memory before vs while a process holds a bare context: PyTorch's, and cuCtxCreate
#     alone): `context-cost mib=N`. The runs below leave the library to measure each context
#     itself (or, with GPUSHARE_CHECK_CONTEXT=configured, get GPUSHARE_CONTEXT_MIB=N).
#  3. The programs users run, each in its own process under a 4 GiB share (a fresh
#     GPUSHARE_ISOLATION_DIR each, GPUSHARE_GPU_UUID the GPU's UUID): PyTorch filling memory
#     under each of its allocators (default, expandable segments, cudaMallocAsync and its pool
#     giving back), a CUDA graph with memory nodes, two processes of one container,
#     CUDA_VISIBLE_DEVICES naming the GPU by UUID and by index, JAX preallocating, CuPy, Numba,
#     nvidia-smi, a primary-context reset, the 32-bit v1 cuMemAlloc (under 2 GiB, after a control
#     run without the library shows the driver alone grants it). The share is only a share
#     if the GPU really holds no more than it: for each, the GPU's used memory is read from NVML
#     in a process that does not load the library (scripts/gpu-check/harness.py; the library
#     hooks NVML's memory info too), and one line says
#        RESULT name share_mib=S got_mib=G device_mib=D pass|fail (why)
#     got = what the program allocated, device = what the GPU held for it at its peak less what
#     it held before; pass = device <= share + slack, the program ran to its end, and the
#     scenario's own conditions held (scripts/gpu-check/scenarios.py says what each does).
#  4. Compute shares (scripts/gpu-check/compute.py): PyTorch matrix multiplies in processes
#     that each stand for a container (their own budget, one node-wide compute directory):
#     three at 20/30/50 % (shared) must get their share of the total within 5 points, one alone
#     at 30 % shared at least 90 % of what it gets without the library, one alone at 30 %
#     capped 30 % within 5 points. `COMPUTE run=...` lines give each one's throughput.
#  5. SUMMARY passed=N failed=M skipped=K; the exit status is non-zero if any failed.
#
# Usage, from anywhere: scripts/gpu-check.sh
#   GPUSHARE_ISOLATION_BIN_DIR=DIR  use DIR's libgpushare_isolation.so and
#                                   gpushare-isolation-probe (no cargo needed); unset: build
#                                   the shipped library (scripts/build-interposer.sh) and the
#                                   probes with cargo
#   GPUSHARE_CHECK_SHARE_GIB=4      the scenarios' share
#   GPUSHARE_CHECK_SLACK_MIB        the slack (default max(64 MiB, 2 % of the share))
#   GPUSHARE_CHECK_TIMEOUT=60       seconds per scenario
#   GPUSHARE_CHECK_CONTEXT=measured the library measures each context (its default);
#                                   `configured`: GPUSHARE_CONTEXT_MIB is set to the figure
#                                   measured in section 2
#   GPUSHARE_CHECK_BUDGET_S=210     no scenario starts after this many seconds (the whole run
#                                   must fit the GPU machine's few minutes); later ones SKIP
#   PYTHON=python3                  the Python with torch, jax, cuda-bindings, nvidia-ml-py
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
HARNESS=$ROOT/scripts/gpu-check/harness.py
PY=${PYTHON:-python3}
SHARE_GIB=${GPUSHARE_CHECK_SHARE_GIB:-4}
TIMEOUT=${GPUSHARE_CHECK_TIMEOUT:-60}
BUDGET_S=${GPUSHARE_CHECK_BUDGET_S:-210}
export PYTHONUNBUFFERED=1
unset LD_PRELOAD GPUSHARE_CONTEXT_MIB GPUSHARE_ISOLATION_KEY GPUSHARE_GPU_COUNT \
    GPUSHARE_CONTAINER_MEM_GIB_PER_GPU GPUSHARE_CONTAINER_MEM_GIB PYTORCH_CUDA_ALLOC_CONF

passed=0 failed=0 skipped=0
pass() { echo "PASS $1"; passed=$((passed + 1)); }
fail() { echo "FAIL $1"; failed=$((failed + 1)); }
skip() { echo "SKIP $1"; skipped=$((skipped + 1)); }
check() { # what, condition
    if eval "$2"; then pass "$1"; else fail "$1"; fi
}
summary() {
    echo "SUMMARY passed=$passed failed=$failed skipped=$skipped (${SECONDS}s)"
    [ "$failed" -eq 0 ]
    exit $?
}

# --- a GPU, the artifacts, the context ---------------------------------------------------------
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "FAIL no NVIDIA GPU visible (nvidia-smi missing or failing)"
    exit 1
fi

if [ -n "${GPUSHARE_ISOLATION_BIN_DIR:-}" ]; then
    BIN=$(cd "$GPUSHARE_ISOLATION_BIN_DIR" 2>/dev/null && pwd) ||
        { echo "FAIL GPUSHARE_ISOLATION_BIN_DIR=$GPUSHARE_ISOLATION_BIN_DIR is no directory"; exit 1; }
elif command -v cargo >/dev/null 2>&1; then
    # The library that ships (glibc 2.17 baseline), not the one `cargo build` links here,
    # beside the probes.
    { scripts/build-interposer.sh &&
        cargo build --release --quiet -p gpushare-isolation-probe --bins; } ||
        { echo "FAIL building the library or the probes"; exit 1; }
    BIN=$ROOT/target/interposer/gpu-check-bin
    mkdir -p "$BIN"
    cp target/interposer/libgpushare_isolation.so target/release/gpushare-isolation-probe \
        target/release/gpushare-isolation-probe-dl "$BIN/"
else
    echo "FAIL no GPUSHARE_ISOLATION_BIN_DIR and no cargo to build the library"
    exit 1
fi
LIB=$BIN/libgpushare_isolation.so
PROBE=$BIN/gpushare-isolation-probe
[ -f "$LIB" ] && [ -x "$PROBE" ] || { echo "FAIL $BIN lacks libgpushare_isolation.so or gpushare-isolation-probe"; exit 1; }

BUDGETS=$(mktemp -d)
trap 'rm -rf "$BUDGETS"' EXIT

echo "== context"
nvidia-smi -L
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,uuid --format=csv,noheader
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i 0 | tr -d ' ')
echo "kernel: $(uname -srm)$([ "$(uname -r)" = 4.4.0 ] && echo ' (gVisor, probably)')"
echo "library: $LIB"
if command -v objdump >/dev/null 2>&1; then
    echo "library needs glibc: $(objdump -T "$LIB" | grep -o 'GLIBC_[0-9.]*' | sort -Vu | tail -1)"
fi
echo "glibc here: $(ldd --version 2>/dev/null | head -1)"
"$PY" - <<'PY' 2>&1
import sys
from importlib import metadata
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "jax", "jaxlib", "jax-cuda13-plugin", "cupy-cuda13x", "numba",
             "numba-cuda", "cuda-bindings", "cuda-python", "nvidia-ml-py", "tensorflow"):
    try:
        print(f"  {name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"  {name} not installed")
PY
command -v nvcc >/dev/null 2>&1 && nvcc --version | tail -1

# --- 1. the probe under a 1 GiB share ----------------------------------------------------------
echo "== the probe, 1 GiB share"
# Allocation counting alone here: no per-context charge (section 2 measures that).
probe_env=(GPUSHARE_CONTAINER_MEM_GIB=1 GPUSHARE_CONTEXT_MIB=0 GPUSHARE_ISOLATION_DIR="$BUDGETS/probe")
mkdir -p "$BUDGETS/probe"
for via in link dlsym getproc; do
    out=$(env "${probe_env[@]}" GPUSHARE_ISOLATION_KEY=$via LD_PRELOAD="$LIB" timeout 60 \
        "$PROBE" --via "$via" info alloc:mem:900 alloc:mem:200 free alloc:vmm:512 alloc:managed:600 free 2>&1)
    echo "$out" | sed "s/^/  [$via] /"
    check "$via: CUDA reports 1024 MiB" 'echo "$out" | grep -q "^cuda dev=0 total=1073741824 "'
    check "$via: NVML reports 1024 MiB" 'echo "$out" | grep -q "^nvml dev=0 total=1073741824 "'
    check "$via: 900 MiB granted" 'echo "$out" | grep -q "^alloc path=mem mib=900 result=0"'
    check "$via: 200 MiB more refused" 'echo "$out" | grep -q "^alloc path=mem mib=200 result=2"'
    check "$via: 512 MiB of VMM then 600 MiB managed refused" \
        'echo "$out" | grep -q "^alloc path=vmm mib=512 result=0" && echo "$out" | grep -q "^alloc path=managed mib=600 result=2"'
done
smi=$(env "${probe_env[@]}" LD_PRELOAD="$LIB" timeout 30 nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2>&1)
check "nvidia-smi shows 1024 MiB total (saw $smi)" '[ "$(echo "$smi" | tr -d " ")" = 1024 ]'
plain=$(timeout 30 "$PROBE" info 2>&1 | grep '^cuda ')
check "without the library the driver's own total is seen ($plain)" \
    '[ -n "$plain" ] && ! echo "$plain" | grep -q "total=1073741824 "'

# --- 2. what one context costs, without the library --------------------------------------------
echo "== one CUDA context, without the library"
idle=$("$PY" "$HARNESS" idle 2>&1 | sed -n 's/^idle used_mib=//p')
echo "idle used_mib=${idle:-?}"
[ -n "$idle" ] && export GPUSHARE_CHECK_IDLE_MIB=$idle
export GPUSHARE_GPU_UUID=$UUID
ctx_out=$(timeout 150 "$PY" "$HARNESS" context 2>&1)
echo "$ctx_out"
CONTEXT_MIB=$(echo "$ctx_out" | sed -n 's/^context-cost mib=\([0-9]*\).*/\1/p')
if [ -n "$CONTEXT_MIB" ]; then
    pass "context cost measured: $CONTEXT_MIB MiB"
    # What the scenarios size themselves by (scripts/gpu-check/scenarios.py).
    export GPUSHARE_CHECK_CONTEXT_MIB=$CONTEXT_MIB
    # The library measures each context itself unless told a figure; GPUSHARE_CHECK_CONTEXT=
    # configured hands it the figure measured here instead.
    if [ "${GPUSHARE_CHECK_CONTEXT:-measured}" = configured ]; then
        export GPUSHARE_CONTEXT_MIB=$CONTEXT_MIB
    fi
else
    fail "context cost not measured (GPUSHARE_CONTEXT_MIB left unset)"
fi

# --- 3. the programs users run, under a share ----------------------------------------------------
SHARE_MIB=$(awk -v g="$SHARE_GIB" 'BEGIN { printf "%d", g * 1024 }')
# harness.py applies the same default to each scenario's own share
SLACK_MIB=${GPUSHARE_CHECK_SLACK_MIB:-$(( SHARE_MIB * 2 / 100 > 64 ? SHARE_MIB * 2 / 100 : 64 ))}
echo "== scenarios: share ${SHARE_MIB} MiB, slack ${SLACK_MIB} MiB, context ${CONTEXT_MIB:-?} MiB," \
    "GPU $UUID, ${TIMEOUT}s each"

tally() { # the verdict line of a scenario's log
    local name=$1 log=$2 rc=$3 share_gib=$4 line
    line=$(grep -E '^(RESULT|SKIP) ' "$log" | tail -1)
    case "$line" in
        RESULT*" pass") passed=$((passed + 1)) ;;
        RESULT*) failed=$((failed + 1)) ;;
        SKIP*) skipped=$((skipped + 1)) ;;
        *)
            echo "RESULT $name share_mib=$(awk -v g="$share_gib" 'BEGIN { printf "%d", g * 1024 }') got_mib=? device_mib=? fail (no verdict: harness exit $rc$([ "$rc" = 124 ] && echo ', timed out'))"
            failed=$((failed + 1))
            ;;
    esac
}

scenario() { # name [--env K=V]... [--control]; SCENARIO_GIB=G for another share
    local name=$1 share_gib=${SCENARIO_GIB:-$SHARE_GIB} dir log rc
    shift
    if [ "$SECONDS" -ge "$BUDGET_S" ]; then
        skip "$name: out of time (${SECONDS}s >= ${BUDGET_S}s)"
        return
    fi
    echo "-- $name"
    dir=$(mktemp -d "$BUDGETS/$name.XXXX")
    log=$dir.log
    GPUSHARE_CONTAINER_MEM_GIB=$share_gib GPUSHARE_ISOLATION_DIR=$dir \
        timeout $((TIMEOUT + 30)) "$PY" "$HARNESS" run "$name" --preload "$LIB" \
        --timeout "$TIMEOUT" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    tally "$name" "$log" "$rc" "$share_gib"
}

scenario torch-default
scenario torch-expandable --env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
scenario torch-async --env PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
scenario graph-mem
scenario two-procs
scenario cvd
scenario jax
skip "tensorflow: not installed on this machine"

echo "-- nvidia-smi"
dir=$(mktemp -d "$BUDGETS/smi.XXXX")
smi=$(GPUSHARE_CONTAINER_MEM_GIB=$SHARE_GIB GPUSHARE_ISOLATION_DIR=$dir LD_PRELOAD="$LIB" \
    timeout 30 nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2>&1 | tr -d ' ')
echo "  [nvidia-smi] memory.total=$smi"
if [ "$smi" = "$SHARE_MIB" ]; then verdict=pass; passed=$((passed + 1))
else verdict="fail (nvidia-smi shows $smi MiB, not the share)"; failed=$((failed + 1)); fi
echo "RESULT nvidia-smi share_mib=$SHARE_MIB got_mib=${smi:-?} device_mib=0 $verdict"

scenario ctx-reset
# The v1 API addresses 4 GiB in all: under a 2 GiB share, so that the driver alone would
# grant both allocations (the control, without the library, shows it does).
SCENARIO_GIB=2 scenario v1-control --control
SCENARIO_GIB=2 scenario v1-alloc
scenario cupy
scenario numba

# --- 4. compute shares --------------------------------------------------------------------------
echo "== compute shares (scripts/gpu-check/compute.py)"
if [ "$SECONDS" -ge "$BUDGET_S" ]; then
    skip "compute: out of time (${SECONDS}s >= ${BUDGET_S}s)"
elif ! "$PY" -c "import torch" >/dev/null 2>&1; then
    skip "compute: torch is not installed"
else
    compute_out=$(timeout 240 "$PY" "$ROOT/scripts/gpu-check/compute.py" "$LIB" "$UUID" 8 2>&1)
    echo "$compute_out"
    passed=$((passed + $(grep -c '^RESULT compute-.* pass$' <<<"$compute_out")))
    failed=$((failed + $(grep -c '^RESULT compute-.* fail' <<<"$compute_out")))
fi

summary
