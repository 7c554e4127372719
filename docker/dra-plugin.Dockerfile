# syntax=docker/dockerfile:1.7
# gpushare-dra-plugin: the per-node kubelet DRA plugin.
# Build from the repository root:
#   docker build -f docker/dra-plugin.Dockerfile -t gpushare-dra-plugin:0.1.0 .
# The kubelet API is compiled from .proto with protox (pure Rust): no protoc needed.

ARG RUST_IMAGE=rust:1-bookworm

FROM ${RUST_IMAGE} AS builder
# pip and objdump for scripts/build-interposer.sh: zig (the linker) comes from PyPI, and the
# result's glibc symbol versions are checked with objdump.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-pip binutils \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The plugin: a plain release build. The interposer is preloaded into containers whatever their
# glibc, so it is linked against a glibc 2.17 baseline instead (zig cc as the linker); the script
# fails if the library needs a newer GLIBC_ symbol version (docs/isolation.md).
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    --mount=type=cache,target=/src/.tools \
    cargo build --release --locked -p gpushare-dra-plugin \
    && scripts/build-interposer.sh \
    && install -D -m 0755 target/release/gpushare-dra-plugin /out/gpushare-dra-plugin \
    && install -D -m 0755 target/interposer/libgpushare_isolation.so /out/libgpushare_isolation.so

# glibc with dlopen, which NVML needs: libnvidia-ml.so.1 is not in the image, the NVIDIA
# container runtime injects it (NVIDIA_VISIBLE_DEVICES=all, NVIDIA_DRIVER_CAPABILITIES=utility).
# Root image variant: kubelet's plugin directories belong to root. The chart
# runs it as uid 0 without privileges or capabilities.
FROM gcr.io/distroless/cc-debian12
LABEL org.opencontainers.image.title="gpushare-dra-plugin" \
      org.opencontainers.image.description="kubelet DRA plugin publishing GPUs with consumable memory capacity and preparing claims as CDI devices" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=builder /out/gpushare-dra-plugin /usr/local/bin/gpushare-dra-plugin
# The isolation interposer, installed on the host at start (--enforcement preload) and
# mounted into GPU containers from there.
COPY --from=builder /out/libgpushare_isolation.so /usr/lib/gpushare/libgpushare_isolation.so
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility
ENTRYPOINT ["/usr/local/bin/gpushare-dra-plugin"]
