#!/usr/bin/env bash
# run.sh - the README's run command: installs the build dependencies,
# builds, and runs qlserve's main job as it stands today: it makes a tiny
# random Llama-shaped model (bf16 safetensors), quantizes its linear layers
# to NF4 with double quantization in the bitsandbytes layout, and inspects
# the result. (The HTTP server takes this place once it exists.)
#
#   scripts/run.sh [OUT_DIR]     default OUT_DIR: ./run
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-run}

scripts/install-deps.sh
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc 2>/dev/null || echo 2)" >/dev/null

mkdir -p "$out"
build/tests/mktiny "$out/tiny.safetensors" --layers 2 --hidden 256
build/qlserve version
build/qlserve quantize --in "$out/tiny.safetensors" --out "$out/tiny-nf4.safetensors" \
  --kind nf4 --double-quant
build/qlserve inspect "$out/tiny-nf4.safetensors"
