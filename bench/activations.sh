#!/usr/bin/env bash
# bench/activations.sh - what --activations q8 (llama.cpp's 8-bit activations for the K-quant
# products) changes on the default model's files, as one JSON document on stdout (progress on
# stderr): per file, five greedy prompts through `qlserve serve` with f32 and with q8
# activations (how many tokens q8's answer shares with f32's before the first that differs),
# bench_decode's decode tok/s with each, and, when tests/test_kquant_model is built, its q8
# cases' distance from the float64 reference's logits. bench/run_activations.py says what each
# figure is.
#
#   bench/activations.sh [run_activations.py flags: --threads 2 --new-tokens 64 --rounds 2
#                         --batches 1,8,32 --no-speed ...]
#
# The files: the default model (scripts/fetch-model.sh: Q4_1, no K-quant tensor, so q8 changes
# nothing there: a check that it does not) and its Q4_K_M, Q5_K_M and Q6_K files
# (scripts/fetch-kquant-models.sh; those present). MODELS=a.gguf,b.gguf picks others.
# Needs, built beforehand (BUILD=DIR picks the build folder, as bench/lib.sh does):
#   cmake --build build --target qlserve bench_decode [test_kquant_model]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/lib.sh"

qlserve=$(bench_binary qlserve)
bench_decode=$(bench_binary bench_decode)
float64=()
if test_binary=$(bench_binary tests/test_kquant_model 2>/dev/null); then
    float64=(--float64 "$test_binary")
fi

if [ -z "${MODELS:-}" ]; then
    base=$("$here/scripts/fetch-model.sh")
    MODELS=$base
    dir=${QLSERVE_KQUANT_DIR:-$(dirname "$base")}
    for t in Q4_K_M Q5_K_M Q6_K; do
        f=$dir/SmolLM2-135M-Instruct.$t.gguf
        if [ -s "$f" ]; then
            MODELS=$MODELS,$f
        else
            echo "activations.sh: no $f (scripts/fetch-kquant-models.sh makes it)" >&2
        fi
    done
fi

exec python3 "$here/bench/run_activations.py" --models "$MODELS" --qlserve "$qlserve" \
    --bench-decode "$bench_decode" ${float64[@]+"${float64[@]}"} "$@"
