# qlserve container image (CPU build for now; the CUDA builder stage and the
# runtime hardening come with the deployment work).
#
# The builder runs the same install script and test script as CI, so a green
# CI means these steps work on a fresh Debian.
FROM debian:bookworm AS builder
WORKDIR /src
COPY . .
RUN scripts/install-deps.sh && QL_SKIP_SANITIZE=1 QL_SKIP_FUZZ=1 scripts/test.sh

FROM debian:bookworm-slim AS cpu
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends libuv1 libcjson1 \
    && rm -rf /var/lib/apt/lists/* && useradd --system --uid 10001 qlserve
COPY --from=builder /src/build/qlserve /usr/local/bin/qlserve
USER qlserve
ENTRYPOINT ["qlserve"]
CMD ["version"]
