#!/usr/bin/env bash
# bench-serve.sh - the README's server-against-server benchmark in one
# command, from a fresh clone: installs the build dependencies, builds
# qlserve's release tree (build/, as scripts/run.sh does) and
# build/bench/bench_serve, fetches the default model, builds llama.cpp's
# llama-server once into the cache (scripts/build-llama-server.sh, 20-30
# minutes on 2 cores the first time), then runs bench_serve on both and
# prints its JSON on stdout (progress goes to stderr).
#
#   scripts/bench-serve.sh [bench_serve flags...]     e.g. --rounds 3 --seconds 30
#
# qlserve's own flags go through --qlserve-arg, one word each (recorded in the JSON's
# qlserve.args): --qlserve-arg --activations --qlserve-arg q8 measures the 8-bit activations.
#
# LLAMA_CPP_BUILD=DIR or LLAMA_SERVER=PATH use a llama-server built
# elsewhere (see scripts/build-llama-server.sh); --model PATH another GGUF.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh >&2
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc 2>/dev/null || echo 2)" --target bench_serve >/dev/null

model=$(scripts/fetch-model.sh)
server=$(scripts/build-llama-server.sh)
commit=$(scripts/build-llama-server.sh --commit)
exec build/bench/bench_serve --model "$model" --llama-server "$server" --llama-commit "$commit" "$@"
