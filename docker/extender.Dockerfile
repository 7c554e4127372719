# syntax=docker/dockerfile:1.7
# gpushare-extender: the kube-scheduler extender (and the admission webhook it serves).
# Build from the repository root:
#   docker build -f docker/extender.Dockerfile -t gpushare-extender:0.1.0 .
# docker/extender.Dockerfile.dockerignore keeps target/, .git and the tools out of the context.

ARG RUST_IMAGE=rust:1-bookworm

FROM ${RUST_IMAGE} AS builder
WORKDIR /src
# The whole workspace: cargo needs every member's manifest to resolve it.
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p gpushare-extender \
    && install -D -m 0755 target/release/gpushare-extender /out/gpushare-extender

# glibc + libgcc, no shell, uid 65532.
FROM gcr.io/distroless/cc-debian12:nonroot
LABEL org.opencontainers.image.title="gpushare-extender" \
      org.opencontainers.image.description="kube-scheduler extender placing pods on one GPU by memory" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=builder /out/gpushare-extender /usr/local/bin/gpushare-extender
USER 65532:65532
# 39999: scheduler calls, /healthz, /readyz, /metrics; 9443: admission webhook (HTTPS).
EXPOSE 39999 9443
ENTRYPOINT ["/usr/local/bin/gpushare-extender"]
