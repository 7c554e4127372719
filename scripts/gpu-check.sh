#!/usr/bin/env bash
# The isolation interposer on a machine with an NVIDIA GPU and driver: under a 1 GiB share,
# a CUDA driver-API program (the probe, linked to the real libcuda.so.1) sees 1024 MiB and is
# refused past it, each of the three ways it can reach the driver; nvidia-smi shows 1024 MiB
# total; PyTorch too, where it is installed. Prints PASS/FAIL per check; exits non-zero on any
# FAIL. Run from the repository root: scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

cargo build --release --quiet -p gpushare-isolation -p gpushare-isolation-probe || exit 1
LIB=$PWD/target/release/libgpushare_isolation.so
PROBE=$PWD/target/release/gpushare-isolation-probe
BUDGETS=$(mktemp -d)
trap 'rm -rf "$BUDGETS"' EXIT
export GPUSHARE_CONTAINER_MEM_GIB=1 GPUSHARE_ISOLATION_DIR=$BUDGETS
failed=0
check() { # what, condition
    if eval "$2"; then echo "PASS $1"; else echo "FAIL $1"; failed=1; fi
}

nvidia-smi -L || { echo "FAIL no NVIDIA GPU visible"; exit 1; }
for via in link dlsym getproc; do
    export GPUSHARE_ISOLATION_KEY=$via
    out=$(LD_PRELOAD=$LIB "$PROBE" --via "$via" info alloc:mem:900 alloc:mem:200 free alloc:vmm:512 alloc:managed:600 free 2>&1)
    echo "$out" | sed "s/^/  [$via] /"
    check "$via: CUDA reports 1024 MiB" 'echo "$out" | grep -q "^cuda dev=0 total=1073741824 "'
    check "$via: NVML reports 1024 MiB" 'echo "$out" | grep -q "^nvml dev=0 total=1073741824 "'
    check "$via: 900 MiB granted" 'echo "$out" | grep -q "^alloc path=mem mib=900 result=0"'
    check "$via: 200 MiB more refused" 'echo "$out" | grep -q "^alloc path=mem mib=200 result=2"'
    check "$via: 512 MiB of VMM then 600 MiB managed refused" \
        'echo "$out" | grep -q "^alloc path=vmm mib=512 result=0" && echo "$out" | grep -q "^alloc path=managed mib=600 result=2"'
done
unset GPUSHARE_ISOLATION_KEY
smi=$(LD_PRELOAD=$LIB nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)
check "nvidia-smi shows 1024 MiB total (saw $smi)" '[ "$(echo "$smi" | tr -d " ")" = 1024 ]'
plain=$("$PROBE" info 2>&1 | grep '^cuda ')
check "without the library the driver's own total is seen ($plain)" '! echo "$plain" | grep -q "total=1073741824 "'
if python3 -c 'import torch' 2>/dev/null; then
    torch=$(LD_PRELOAD=$LIB python3 - <<'PY' 2>&1
import torch
free, total = torch.cuda.mem_get_info(0)
print("total", total)
x = torch.empty(900 * 2**20, dtype=torch.uint8, device="cuda")
try:
    y = torch.empty(300 * 2**20, dtype=torch.uint8, device="cuda")
    print("over: allocated")
except RuntimeError as e:
    print("over: refused")
PY
)
    echo "$torch" | sed 's/^/  [torch] /'
    check "PyTorch sees 1024 MiB" 'echo "$torch" | grep -q "^total 1073741824"'
    check "PyTorch refused past the share" 'echo "$torch" | grep -q "^over: refused"'
else
    echo "SKIP PyTorch (not installed)"
fi
exit $failed
