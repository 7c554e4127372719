#!/usr/bin/env bash
# images.sh - build gpushare's three images (and push them) for a registry you can reach.
#
#   scripts/images.sh REGISTRY [--push] [--tag TAG]
#
# REGISTRY is where the images go, e.g. `registry.example.com/platform` or `localhost:5000`:
# REGISTRY/gpushare-extender, REGISTRY/gpushare-device-plugin and REGISTRY/gpushare-dra-plugin,
# tagged TAG (default: the chart's appVersion, which the chart pulls by default). Builds with
# docker (BuildKit) or podman, whichever is installed; --push pushes them (log in first).
# Prints the helm arguments that install the chart from those images.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
registry="" push=false tag=""
while [ $# -gt 0 ]; do
  case "$1" in
    --push) push=true ;;
    --tag) tag="${2:?--tag needs a value}"; shift ;;
    -h|--help) usage 0 ;;
    -*) echo "images.sh: unknown option $1" >&2; usage ;;
    *) [ -z "$registry" ] || { echo "images.sh: one REGISTRY only" >&2; usage; }; registry="${1%/}" ;;
  esac
  shift
done
[ -n "$registry" ] || usage
[ -n "$tag" ] || tag=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/gpushare/Chart.yaml)

# The Dockerfiles use BuildKit's cache mounts (`RUN --mount=type=cache`): docker needs buildx.
if command -v docker >/dev/null 2>&1; then
  docker buildx version >/dev/null 2>&1 || {
    echo "images.sh: docker has no buildx (BuildKit), which the Dockerfiles' cache mounts need: install docker-buildx-plugin, or use podman" >&2
    exit 1
  }
  docker info >/dev/null 2>&1 || {
    echo "images.sh: cannot reach the Docker daemon (docker info fails): start it, or set DOCKER_HOST" >&2
    exit 1
  }
  builder=(docker buildx build --load); pusher=(docker push)
elif command -v podman >/dev/null 2>&1; then
  builder=(podman build); pusher=(podman push)
else
  echo "images.sh: neither docker nor podman is installed: install one (the Dockerfiles are in docker/)" >&2
  exit 1
fi

for component in extender device-plugin dra-plugin; do
  image="$registry/gpushare-$component:$tag"
  echo "== $image (docker/$component.Dockerfile)" >&2
  "${builder[@]}" -f "docker/$component.Dockerfile" -t "$image" .
  if $push; then
    "${pusher[@]}" "$image"
  fi
done

cat <<ARGS
# helm install gpushare charts/gpushare -n kube-system with:
--set extender.image.repository=$registry/gpushare-extender --set extender.image.tag=$tag \\
--set devicePlugin.image.repository=$registry/gpushare-device-plugin --set devicePlugin.image.tag=$tag \\
--set dra.image.repository=$registry/gpushare-dra-plugin --set dra.image.tag=$tag
ARGS
