#!/usr/bin/env bash
# Fails when a shared library or program needs a glibc symbol version newer than a baseline.
#
# Why: libgpushare_isolation.so is preloaded (LD_PRELOAD) into every process of a GPU container,
# whatever glibc its image has. If the library references one symbol version the image's glibc
# lacks (say GLIBC_2.34 on Ubuntu 20.04's 2.31), the dynamic loader refuses to start ANY
# process of that container. So the shipped library must need nothing newer than GLIBC_2.17
# (the oldest glibc Rust supports on Linux); scripts/build-interposer.sh builds it that way and
# runs this check on the result. Weak references count too: the loader still checks that
# their version exists. GLIBC_PRIVATE is refused as well: it differs between every glibc build.
#
# Usage: scripts/check-glibc-baseline.sh LIB [MAX]   (MAX defaults to 2.17)
# Quiet on success apart from one line; on failure lists each offending symbol and exits 1.
set -euo pipefail

die() {
    echo "check-glibc-baseline: $*" >&2
    exit 2
}

[[ $# -ge 1 && $# -le 2 ]] || die "usage: $0 LIB [MAX=2.17]"
lib="$1"
max="${2:-2.17}"
[[ "${max}" =~ ^[0-9]+(\.[0-9]+)+$ ]] || die "MAX must look like 2.17, not '${max}'"
[[ -f "${lib}" ]] || die "no such file: ${lib}"
command -v objdump >/dev/null 2>&1 || die "objdump is needed (apt-get install binutils)"

if ! dynsyms="$(objdump -T "${lib}" 2>&1)"; then
    echo "${dynsyms}" >&2
    die "objdump -T failed on ${lib} (not a dynamic ELF object?)"
fi

# Each line of `objdump -T` that names a GLIBC_x.y[.z] version (or GLIBC_PRIVATE) newer than MAX,
# as "VERSION SYMBOL [weak]". Versions compare numerically, part by part (2.2.5 < 2.17 < 2.34).
offending="$(
    awk -v max="${max}" '
        function newer(v, m,    a, b, na, nb, i, x, y) {
            na = split(v, a, "."); nb = split(m, b, ".")
            for (i = 1; i <= (na > nb ? na : nb); i++) {
                x = (i <= na) ? a[i] + 0 : 0; y = (i <= nb) ? b[i] + 0 : 0
                if (x != y) return x > y
            }
            return 0
        }
        match($0, /GLIBC_([0-9]+(\.[0-9]+)+|PRIVATE)/) {
            tag = substr($0, RSTART, RLENGTH); ver = substr(tag, 7)
            if (ver == "PRIVATE" || newer(ver, max)) {
                weak = ($0 ~ /^[0-9a-f]+ +w /) ? " (weak)" : ""
                printf "  %-14s %s%s\n", tag, $NF, weak
            }
        }
    ' <<<"${dynsyms}" | sort -V -u
)"

if [[ -n "${offending}" ]]; then
    {
        echo "check-glibc-baseline: FAIL: ${lib} needs glibc symbol versions newer than GLIBC_${max}:"
        echo "${offending}"
        echo "A library preloaded into containers with an older glibc would stop every process there"
        echo "from starting. Build it with scripts/build-interposer.sh (zig cc as the linker, glibc ${max})."
    } >&2
    exit 1
fi

newest="$(grep -oE 'GLIBC_[0-9]+(\.[0-9]+)+' <<<"${dynsyms}" | sort -V -u | tail -n 1 || true)"
echo "check-glibc-baseline: OK: ${lib} needs at most GLIBC_${max} (newest referenced: ${newest:-none})"
