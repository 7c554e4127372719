#!/usr/bin/env bash
# krew-manifest.sh - package kubectl-gpushare for krew: an archive and the plugin manifest.
#
#   scripts/krew-manifest.sh BASE_URL [--bin PATH] [--out DIR]
#
# Builds kubectl-gpushare (cargo build --release; --bin takes a binary already built instead)
# for this machine's OS and architecture, packs it with LICENSE into
# DIR/kubectl-gpushare-<os>-<arch>.tar.gz (DIR defaults to target/krew), and writes
# DIR/gpushare.yaml from kubectl-gpushare/krew/gpushare.yaml.in: the chart's appVersion, the
# archive's sha256, and BASE_URL/<archive> as where you will publish it. Install from the two
# files directly, before publishing anything:
#
#   kubectl krew install --manifest=target/krew/gpushare.yaml \
#     --archive=target/krew/kubectl-gpushare-linux-amd64.tar.gz
#
# Run it once per platform (or with --bin per cross-built binary) and merge the `platforms`
# entries to publish one manifest for several.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
base_url="" bin="" out="target/krew"
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin="${2:?--bin needs a path}"; shift ;;
    --out) out="${2:?--out needs a directory}"; shift ;;
    -h|--help) usage 0 ;;
    -*) echo "krew-manifest.sh: unknown option $1" >&2; usage ;;
    *) [ -z "$base_url" ] || { echo "krew-manifest.sh: one BASE_URL only" >&2; usage; }; base_url="${1%/}" ;;
  esac
  shift
done
[ -n "$base_url" ] || usage

version=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/gpushare/Chart.yaml)
[ -n "$version" ] || { echo "krew-manifest.sh: no appVersion in charts/gpushare/Chart.yaml" >&2; exit 1; }
case "$(uname -s)" in
  Linux) os=linux ;; Darwin) os=darwin ;;
  *) echo "krew-manifest.sh: unsupported OS $(uname -s)" >&2; exit 1 ;;
esac
case "$(uname -m)" in
  x86_64|amd64) arch=amd64 ;; aarch64|arm64) arch=arm64 ;;
  *) echo "krew-manifest.sh: unsupported architecture $(uname -m)" >&2; exit 1 ;;
esac
if [ -z "$bin" ]; then
  cargo build --release --locked -p kubectl-gpushare
  bin=target/release/kubectl-gpushare
fi
[ -x "$bin" ] || { echo "krew-manifest.sh: $bin is not an executable" >&2; exit 1; }

mkdir -p "$out"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
install -m 755 "$bin" "$stage/kubectl-gpushare"
cp LICENSE "$stage/LICENSE"
archive="kubectl-gpushare-$os-$arch.tar.gz"
# Reproducible: fixed order, owner and times, so one binary always gives one sha256.
tar -C "$stage" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 \
  -cf - kubectl-gpushare LICENSE | gzip -n >"$out/$archive"
sha=$(sha256sum "$out/$archive" | cut -d' ' -f1)
sed -e "s|@VERSION@|$version|g" -e "s|@OS@|$os|g" -e "s|@ARCH@|$arch|g" \
  -e "s|@URI@|$base_url/$archive|g" -e "s|@SHA256@|$sha|g" \
  kubectl-gpushare/krew/gpushare.yaml.in >"$out/gpushare.yaml"
echo "$out/gpushare.yaml"
echo "$out/$archive"
