# Multi-stage build on Debian 12. The build stage runs the same scripts as the
# README (scripts/install_deps.sh, scripts/build.sh), so the tested path and
# the image path do not drift. Not built here (no Docker engine on the
# development machines); the runtime package list comes from `ldd` of the
# binaries built by scripts/build.sh.
FROM debian:bookworm-slim AS build
WORKDIR /src
COPY . .
RUN bash scripts/install_deps.sh --build-only && \
    KVRELAY_BUILD_DIR=/build bash scripts/build.sh -DKVRELAY_BUILD_TESTS=OFF -DKVRELAY_BUILD_BENCHMARKS=OFF

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends \
      libabsl20220623 libc-ares2 libcivetweb1 libfmt9 libgrpc++1.51 libgrpc29 libhtscodecs2 \
      libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libprotobuf32 libre2-9 \
      libspdlog1.10 libssl3 zlib1g ca-certificates && \
    rm -rf /var/lib/apt/lists/*
COPY --from=build /build/bin/kvrelay-server /build/bin/kvrelayctl /usr/local/bin/
# Where a spool volume goes (--spool-dir /var/lib/kvrelay/spool, docs/SPOOL.md): owned by the
# relay's user, so that a new Docker named volume mounted here (which takes the directory's owner
# and mode) is writable by it.
RUN mkdir -m 0700 -p /var/lib/kvrelay && chown 65532:65532 /var/lib/kvrelay
USER 65532:65532
EXPOSE 50051 9464
# grpc.health.v1 on the plaintext health port (--health-listen; the gRPC port may serve only TLS).
# Arguments of your own keep --health-listen on port 8081 (127.0.0.1 or 0.0.0.0) for this check.
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
  CMD ["/usr/local/bin/kvrelay-server", "health", "--addr", "127.0.0.1:8081", "--timeout", "2"]
ENTRYPOINT ["/usr/local/bin/kvrelay-server"]
# The default command is for trying the image out: plaintext gRPC on every interface, which the
# relay refuses without --insecure (and then reports as kvrelay_insecure 1). Anything reachable
# from other hosts passes its own arguments with TLS instead: --tls-cert, --tls-key and
# --tls-client-ca (deploy/kubernetes/base does; deploy/README.md).
CMD ["--listen", "0.0.0.0:50051", "--insecure", "--metrics-listen", "0.0.0.0:9464", "--health-listen", "127.0.0.1:8081"]
