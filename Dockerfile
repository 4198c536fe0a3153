# Multi-stage build on Debian 12. The build stage runs the same scripts as the
# README (scripts/install_deps.sh, scripts/build.sh), so the tested path and
# the image path do not drift.
FROM debian:bookworm-slim AS build
WORKDIR /src
COPY . .
RUN bash scripts/install_deps.sh && \
    KVRELAY_BUILD_DIR=/build bash scripts/build.sh -DKVRELAY_BUILD_TESTS=OFF -DKVRELAY_BUILD_BENCHMARKS=OFF

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends \
      libabsl20220623 libstdc++6 ca-certificates && \
    rm -rf /var/lib/apt/lists/*
COPY --from=build /build/bin/kvrelayctl /usr/local/bin/kvrelayctl
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/kvrelayctl"]
CMD ["help"]
