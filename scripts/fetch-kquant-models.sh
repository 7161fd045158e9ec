#!/usr/bin/env bash
# fetch-kquant-models.sh - make the default model's K-quant GGUF files with
# llama.cpp's own llama-quantize, the way published GGUFs are made, and put
# them beside the default model:
#
#   SmolLM2-135M-Instruct.{Q4_K_M,Q5_K_M,Q6_K,Q3_K_M,Q2_K,IQ4_XS}.gguf
#
# tests/test_kquant_model.c checks qlserve's greedy decoding of each against
# the float64 reference forward over its dequantized weights, and
# bench/run_decode.py --kquant measures them against llama.cpp. The test
# says loudly when a file is absent (a failure under QL_REQUIRE_ALL=1), so
# scripts/test.sh runs this script in a stage of its own before the tests;
# a second run finds the files and builds nothing.
#
# llama-quantize comes from the llama-cpp-python sdist on PyPI (its
# vendor/llama.cpp): `scripts/build-llama-server.sh --quantize` builds that
# one target into the cache (about 5 minutes on 2 cores with the download, only when a file
# is missing) and reuses it, or the one a full build (llama-server,
# llama-bench, llama-quantize: 20-30 minutes) put there. The default model
# is a Q4_1 file, so the K-quants are
# requantized from it (--allow-requantize):
# the weights are Q4_1's values, quantized again, as a user's requantized
# file would be. Tensors whose rows are not a multiple of 256 (most of this
# model's, its hidden size is 576) fall back to llama-quantize's own choice,
# so each file mixes several types (this llama.cpp, 0.3.36's):
#   Q4_K_M  q4_K, q6_K, q5_0, q8_0        Q5_K_M  q5_K, q6_K, q5_1, q8_0
#   Q6_K    q6_K, q8_0                    Q3_K_M  q4_K, q5_K, q4_0, q5_0, q5_1, q8_0
#   Q2_K    q3_K, q4_0, q8_0              IQ4_XS  iq4_xs, iq4_nl, q5_K, q8_0
# (Q3_K_M holds no q3_K here: its q3_K rows are 576 wide and fall back to
# q4_0; the Q2_K file carries q3_K, the IQ4_XS file iq4_nl and iq4_xs.)
#
#   scripts/fetch-kquant-models.sh              prints the paths made
#   QLSERVE_CACHE=DIR scripts/fetch-kquant-models.sh
#   LLAMA_QUANTIZE=/path/to/llama-quantize scripts/fetch-kquant-models.sh
set -euo pipefail
cd "$(dirname "$0")/.."

cache=${QLSERVE_CACHE:-$HOME/.cache/qlserve}
models=$cache/models
base=$(scripts/fetch-model.sh)

ftypes=(Q4_K_M Q5_K_M Q6_K Q3_K_M Q2_K IQ4_XS)
quantize=""
for ftype in "${ftypes[@]}"; do
  out=$models/SmolLM2-135M-Instruct.$ftype.gguf
  if [ ! -s "$out" ]; then
    if [ -z "$quantize" ]; then # the first missing file: llama-quantize, built when absent
      quantize=${LLAMA_QUANTIZE:-$(scripts/build-llama-server.sh --quantize)}
      [ -x "$quantize" ] || { echo "fetch-kquant-models: $quantize is not an executable file" >&2; exit 1; }
    fi
    "$quantize" --allow-requantize "$base" "$out.tmp" "$ftype" >"$out.log" 2>&1 ||
      { echo "fetch-kquant-models: llama-quantize $ftype failed; see $out.log" >&2; rm -f "$out.tmp"; exit 1; }
    mv "$out.tmp" "$out"
  fi
  echo "$out"
done
