# qlserve container images: the CUDA server (the default target) and a
# CPU-only server on plain Debian (--target cpu).
#
#   docker build -t qlserve:0.1.0-cuda .              CUDA build, runtime on the CUDA runtime image
#   docker build -t qlserve:0.1.0-cpu --target cpu .  CPU build, runtime on debian:bookworm-slim
#
# (BuildKit, Docker's default builder, builds only the stages a target
# needs; the legacy builder builds every stage before it.)
#
# Each builder stage runs what CI runs (.ci/run -> scripts/test.sh, which
# runs scripts/install-deps.sh first): the install script, then the release
# build and its unit and end-to-end tests. So a green CI means the cpu
# builder's steps work on a fresh Debian 12 (the CUDA builder runs the same
# commands on Ubuntu 24.04, which CI does not), and an image is never built
# from a tree whose tests fail. QL_SKIP_SANITIZE=1 and QL_SKIP_FUZZ=1 leave out the two stages that
# do not make the shipped binary: the ASan+UBSan build (a second full build
# and test run, doubling the image build) and the bounded libFuzzer runs
# (a time-boxed search, minutes long, not a pass/fail check of what ships).
# CI runs both on every commit of the same sources.
#
# A runtime stage carries the binary and the shared libraries it links
# (libuv, cJSON; the CUDA image brings cudart and cuBLASLt), runs as an
# unprivileged user, and reads everything else from outside:
#   /etc/qlserve/config.json  the config file (a default is baked in; mount
#                             yours over it: a ConfigMap, a bind mount)
#   /models, /adapters        volumes: the model, and the adapter directory
#   QLSERVE_* variables       override the file (QLSERVE_MODEL, QLSERVE_PORT, ...)
#   QLSERVE_ADMIN_TOKEN       the admin token, from a secret at run time;
#                             never set here (or --admin-token-file on a
#                             mounted secret file)
# The baked config listens on 0.0.0.0 (inside a container the loopback
# default would be unreachable), so admin routes need the token.
# docs/operations.md is the operator's guide; tests/test_deploy.c checks
# this file against the server's defaults and routes.

# The CUDA toolkit CI compiles with (nvcc 13.0). CUDA 13 needs an NVIDIA
# driver >= 580 on the host; the container runtime refuses to start the
# image on an older one (NVIDIA_REQUIRE_CUDA), saying so.
ARG CUDA_VERSION=13.0.2
# Ubuntu 24.04: the CMake (>= 3.25) and packages install-deps.sh asks for.
ARG CUDA_OS=ubuntu24.04

# ---- CPU-only -------------------------------------------------------------

FROM debian:bookworm AS cpu-builder
WORKDIR /src
COPY . .
RUN scripts/install-deps.sh
RUN QL_SKIP_SANITIZE=1 QL_SKIP_FUZZ=1 scripts/test.sh

FROM debian:bookworm-slim AS cpu
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
       libuv1 libcjson1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 qlserve \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent qlserve \
    && mkdir -p /models /adapters
COPY --from=cpu-builder /src/build/qlserve /usr/local/bin/qlserve
COPY deploy/config.json /etc/qlserve/config.json
# every library the binary links is in the image (the list goes to the
# build log; a missing one fails the build)
# (no pipefail needed: the first ldd fails the step if ldd itself fails)
# hadolint ignore=DL4006
RUN ldd /usr/local/bin/qlserve && ! ldd /usr/local/bin/qlserve | grep -F "not found"
USER 10001:10001
EXPOSE 8080
# SIGTERM drains: no new connections, running requests get --grace-ms
# (30 s) to finish. Give `docker stop` a longer timeout (-t 40).
STOPSIGNAL SIGTERM
# No curl in the image: bash's /dev/tcp asks /health (200 once the model
# serves, 503 while it loads or drains).
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/${QLSERVE_PORT:-8080} && printf 'GET /health HTTP/1.0\\r\\n\\r\\n' >&3 && read -r status <&3 && [[ $status == *' 200 '* ]]"]
ENTRYPOINT ["qlserve"]
CMD ["serve", "--config", "/etc/qlserve/config.json"]

# ---- CUDA (the default target: the last stage) ----------------------------

FROM nvidia/cuda:${CUDA_VERSION}-devel-${CUDA_OS} AS builder
WORKDIR /src
COPY . .
# nvcc is at /usr/local/cuda/bin (on the image's PATH, and test.sh adds it),
# so the build includes the CUDA backend.
RUN scripts/install-deps.sh
RUN QL_SKIP_SANITIZE=1 QL_SKIP_FUZZ=1 scripts/test.sh
# the CUDA backend was built: QL_CUDA=AUTO would quietly leave it out
# without nvcc, and this image exists for it
# (no pipefail needed: a failing ldd prints nothing, and grep fails)
# hadolint ignore=DL4006
RUN ldd build/qlserve | grep -q libcudart

FROM nvidia/cuda:${CUDA_VERSION}-runtime-${CUDA_OS} AS cuda
# libuv1t64: Ubuntu 24.04's name for libuv1 (the 64-bit time_t rename)
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
       libuv1t64 libcjson1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 qlserve \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent qlserve \
    && mkdir -p /models /adapters
COPY --from=builder /src/build/qlserve /usr/local/bin/qlserve
COPY deploy/config.json /etc/qlserve/config.json
# (no pipefail needed: the first ldd fails the step if ldd itself fails)
# hadolint ignore=DL4006
RUN ldd /usr/local/bin/qlserve && ! ldd /usr/local/bin/qlserve | grep -F "not found"
USER 10001:10001
EXPOSE 8080
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/${QLSERVE_PORT:-8080} && printf 'GET /health HTTP/1.0\\r\\n\\r\\n' >&3 && read -r status <&3 && [[ $status == *' 200 '* ]]"]
ENTRYPOINT ["qlserve"]
CMD ["serve", "--config", "/etc/qlserve/config.json"]
