#!/usr/bin/env bash
# Builds the shipped isolation interposer, libgpushare_isolation.so, against a glibc 2.17
# baseline, and checks that it needs nothing newer.
#
# Why: the library is preloaded (LD_PRELOAD) into every process of a GPU container, whatever
# glibc the image has. Linked on this Debian 12 machine (glibc 2.36) it references GLIBC_2.34
# (dlopen, dlvsym, pthread_key_*), GLIBC_2.33 (stat64, fstat64), ...; in an image with an older
# glibc (Ubuntu 20.04 and Debian 11: 2.31, UBI 8: 2.28) the dynamic loader then refuses to start
# ANY process of the container. Linked by `zig cc -target <arch>-linux-gnu.2.17` (cargo's linker
# for that one build), the library is linked against zig's glibc 2.17 stubs instead of the build
# machine's libc, so only GLIBC_<=2.17 versions can end up in it (Rust's std itself targets 2.17
# on x86_64 and aarch64 Linux).
#
# Installs what it needs, pinned, when missing (idempotent and quiet when already there):
#   zig           from PyPI (ziglang wheel)  -> .tools/zigbuild/ziglang-<version>/ziglang/zig
#   (and, run as root where pip or objdump is missing: python3-pip, binutils with apt-get)
#   the linker wrapper                      -> .tools/zigbuild/bin/zig-cc-<arch>-glibc<baseline>
# Builds into its own target folder (target/interposer) so that it never fights the main build,
# copies the result to target/interposer/libgpushare_isolation.so (another arch:
# target/interposer/<arch>/libgpushare_isolation.so), then runs scripts/check-glibc-baseline.sh
# on it.
#
# Usage: scripts/build-interposer.sh
# Environment:
#   GPUSHARE_INTERPOSER_TARGET  x86_64 or aarch64 (or its linux-gnu triple); default: this
#                               machine's. Its Rust std must be installed (rustup target list
#                               --installed); this repository's CI has x86_64 only.
#   GPUSHARE_TOOLS_DIR          where the tools go (default: <repo>/.tools/zigbuild)
#   CARGO_TARGET_DIR            is ignored: the build always goes to <repo>/target/interposer.
set -euo pipefail

ZIGLANG_VERSION="0.15.2"
GLIBC_BASELINE="2.17"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools_dir="${GPUSHARE_TOOLS_DIR:-${repo_root}/.tools/zigbuild}"
zig_home="${tools_dir}/ziglang-${ZIGLANG_VERSION}"
zig="${zig_home}/ziglang/zig"
target_dir="${repo_root}/target/interposer"

die() {
    echo "build-interposer: $*" >&2
    exit 1
}

# A Debian package, when a command is missing: installed with apt-get where we are root.
apt_install() {
    local package="$1"
    [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1 || return 1
    echo "build-interposer: installing ${package} (apt-get)" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${package}"; } >/dev/null
}

command -v objdump >/dev/null 2>&1 || apt_install binutils \
    || die "objdump is needed for the symbol version check; install binutils"

case "${GPUSHARE_INTERPOSER_TARGET:-$(uname -m)}" in
    x86_64 | amd64 | x86_64-unknown-linux-gnu) triple="x86_64-unknown-linux-gnu" ;;
    aarch64 | arm64 | aarch64-unknown-linux-gnu) triple="aarch64-unknown-linux-gnu" ;;
    *) die "unsupported target '${GPUSHARE_INTERPOSER_TARGET:-$(uname -m)}' (x86_64 or aarch64 linux-gnu)" ;;
esac
if command -v rustup >/dev/null 2>&1 && ! rustup target list --installed | grep -qx "${triple}"; then
    die "the Rust std for ${triple} is not installed (rustup target add ${triple})"
fi

# zig, from PyPI. `pip install --target` also works under Debian's externally managed Python.
if [[ "$("${zig}" version 2>/dev/null || true)" != "${ZIGLANG_VERSION}" ]]; then
    if ! python3 -m pip --version >/dev/null 2>&1 && ! command -v pip3 >/dev/null 2>&1; then
        apt_install python3-pip \
            || die "pip is needed to install zig (ziglang ${ZIGLANG_VERSION}) from PyPI; install python3-pip"
    fi
    if python3 -m pip --version >/dev/null 2>&1; then
        pip_cmd=(python3 -m pip)
    else
        pip_cmd=(pip3)
    fi
    rm -rf "${zig_home}" "${zig_home}.partial"
    mkdir -p "${tools_dir}"
    if ! "${pip_cmd[@]}" install --quiet --disable-pip-version-check --no-deps \
        --target "${zig_home}.partial" "ziglang==${ZIGLANG_VERSION}" >"${tools_dir}/pip.log" 2>&1; then
        cat "${tools_dir}/pip.log" >&2
        die "could not install ziglang ${ZIGLANG_VERSION} from PyPI (pip output above)"
    fi
    mv "${zig_home}.partial" "${zig_home}"
    rm -f "${tools_dir}/pip.log"
    [[ "$("${zig}" version 2>/dev/null || true)" == "${ZIGLANG_VERSION}" ]] \
        || die "${zig} does not run or is not version ${ZIGLANG_VERSION}"
fi

# The linker: zig's cc for the target at the baseline, with the arguments rustc gives it.
arch="${triple%%-*}"
linker="${tools_dir}/bin/zig-cc-${arch}-glibc${GLIBC_BASELINE}"
mkdir -p "${tools_dir}/bin"
printf '#!/bin/sh\nexec "%s" cc -target %s-linux-gnu.%s "$@"\n' "${zig}" "${arch}" "${GLIBC_BASELINE}" \
    >"${linker}.tmp"
chmod +x "${linker}.tmp"
mv -f "${linker}.tmp" "${linker}"

unset CARGO_TARGET_DIR
cd "${repo_root}"
linker_var="CARGO_TARGET_$(echo "${triple}" | tr 'a-z-' 'A-Z_')_LINKER"
# --lib: the cdylib (and the rlib, which costs little); no tests, no probe. Release only.
env "${linker_var}=${linker}" cargo build --release --locked --quiet -p gpushare-isolation --lib \
    --target "${triple}" --target-dir "${target_dir}"

built="${target_dir}/${triple}/release/libgpushare_isolation.so"
[[ -f "${built}" ]] || die "cargo build finished but ${built} is missing"
# The stable path: target/interposer/libgpushare_isolation.so for this machine's arch,
# target/interposer/<arch>/libgpushare_isolation.so for another one.
out_dir="${target_dir}"
[[ "${triple}" == "$(uname -m)-"* ]] || out_dir="${target_dir}/${triple%%-*}"
mkdir -p "${out_dir}"
cp -f "${built}" "${out_dir}/libgpushare_isolation.so.tmp"
mv -f "${out_dir}/libgpushare_isolation.so.tmp" "${out_dir}/libgpushare_isolation.so"

"${repo_root}/scripts/check-glibc-baseline.sh" "${out_dir}/libgpushare_isolation.so" "${GLIBC_BASELINE}"
