#!/usr/bin/env bash
# The aarch64 build of the interposer (Grace nodes), run: under qemu-user, a small aarch64
# program (scripts/aarch64-smoke/smoke.c, linked by zig cc) against the fake driver built for
# aarch64, with and without the library preloaded.
#
# Why: the library's `dlsym` is a hand-written trampoline per architecture (it must enter
# glibc's dlsym with the caller's return address, or every `dlsym(RTLD_NEXT, ...)` in the
# container, as malloc interposers make, resolves from the wrong place). A cross-build proves
# it links; this proves it runs.
#
# Needs: target/interposer/aarch64/libgpushare_isolation.so (GPUSHARE_INTERPOSER_TARGET=aarch64
# scripts/build-interposer.sh, which also installs zig), the aarch64 Rust std, and qemu-user
# with an arm64 glibc: installed with apt-get (qemu-user-static, libc6:arm64) when run as root.
# Usage: scripts/aarch64-smoke.sh
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
zig="$(ls -d "${repo_root}"/.tools/zigbuild/ziglang-*/ziglang/zig 2>/dev/null | tail -1)"
library="${repo_root}/target/interposer/aarch64/libgpushare_isolation.so"
work="${repo_root}/target/interposer/aarch64-smoke"

die() {
    echo "aarch64-smoke: $*" >&2
    exit 1
}

[[ -x "${zig}" ]] || die "zig is missing: run scripts/build-interposer.sh first"
[[ -f "${library}" ]] || die "${library} is missing: GPUSHARE_INTERPOSER_TARGET=aarch64 scripts/build-interposer.sh"

if ! command -v qemu-aarch64-static >/dev/null 2>&1 || [[ ! -e /lib/ld-linux-aarch64.so.1 ]]; then
    [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1 \
        || die "qemu-user-static and libc6:arm64 are needed (apt-get, as root)"
    echo "aarch64-smoke: installing qemu-user-static and libc6:arm64 (apt-get)" >&2
    dpkg --add-architecture arm64
    {
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            qemu-user-static libc6:arm64
    } >/dev/null
fi

mkdir -p "${work}/driver" "${work}/budgets"
linker="${work}/cc"
printf '#!/bin/sh\nexec "%s" cc -target aarch64-linux-gnu.2.17 "$@"\n' "${zig}" >"${linker}"
chmod +x "${linker}"
# The fake driver, as isolation/probe/build.rs builds it, for aarch64.
rustc --edition 2021 --crate-type cdylib -C opt-level=2 --crate-name libcuda_so_1 \
    --target aarch64-unknown-linux-gnu -C linker="${linker}" \
    -C link-arg=-Wl,-soname,libcuda.so.1 -C link-arg=-Wl,-Bsymbolic \
    -o "${work}/driver/libcuda.so.1" "${repo_root}/isolation/probe/fake/libcuda.rs"
"${linker}" -O1 -o "${work}/smoke" "${repo_root}/scripts/aarch64-smoke/smoke.c" -ldl

run() {
    timeout 120 qemu-aarch64-static -L / -E LD_LIBRARY_PATH="${work}/driver" "$@" "${work}/smoke"
}
plain=$(run)
echo "${plain}" | sed 's/^/  [plain] /'
rm -rf "${work}/budgets"/*
held=$(run -E LD_PRELOAD="${library}" -E GPUSHARE_CONTAINER_MEM_GIB=1 -E GPUSHARE_CONTEXT_MIB=0 \
    -E GPUSHARE_ISOLATION_DIR="${work}/budgets")
echo "${held}" | sed 's/^/  [held] /'

failed=0
expect() { # what, output, line
    if grep -qx "$3" <<<"$2"; then echo "PASS $1"; else echo "FAIL $1 (no line '$3')"; failed=1; fi
}
expect "without the library the driver's total and both allocations" "${plain}" \
    "total=17179869184 alloc900=0 alloc200=0"
expect "dlsym(RTLD_NEXT) stays relative to its caller" "${held}" "rtld-next same=1"
expect "dlsym(RTLD_NEXT, malloc) is found" "${held}" "malloc-next nonnull=1"
expect "the share is seen and held through dlsym" "${held}" "total=1073741824 alloc900=0 alloc200=2"
exit "${failed}"
