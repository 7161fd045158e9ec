#!/usr/bin/env bash
# bench/moe.sh - issue 32's benchmark: qlserve against llama.cpp on a mixture-of-experts model
# with Qwen3-30B-A3B's layer shapes (random weights, a handful of layers, Q4_K_M made by
# llama.cpp's llama-quantize), on the same file in the same run, in alternating rounds:
# bench_decode against llama-bench and llama-batched-bench (prefill of 512, decode at batch 1, 8
# and 32), and bench_serve against llama-server (1, 8 and 32 streams). Prints one JSON document
# on stdout (progress on stderr): each figure per round, the medians and the ratios
# qlserve / llama.cpp. README.md ("Mixture of experts against llama.cpp") says what each figure is.
#
#   bench/moe.sh [--layers N (4)] [run_moe.py flags: --rounds 2 --threads 2 --seconds 20
#                 --no-serve --no-qlserve --activations q8 ...]
#
# --activations q8 runs qlserve's side (bench_decode, qlserve serve) with 8-bit activations,
# llama.cpp's arithmetic; the default f32 is qlserve's own. The JSON's inputs record it.
#
# Needs, built beforehand (BUILD=DIR picks the build folder, as bench/lib.sh does):
#   cmake --build build --target bench_decode bench_serve qlserve
# and python3 with numpy and gguf (pip install numpy gguf) for the model, made once into
# $QLSERVE_CACHE/bench/ (default ~/.cache/qlserve/bench/). llama.cpp's binaries come from
# scripts/build-llama-server.sh (built once into the cache, 20-30 minutes on 2 cores;
# LLAMA_CPP_BUILD=DIR uses a build of your own that has llama-bench and llama-batched-bench).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/lib.sh"

layers=4
args=()
while [ $# -gt 0 ]; do
    case "$1" in
    --layers)
        layers=${2:?--layers needs a number}
        shift 2
        ;;
    *)
        args+=("$1")
        shift
        ;;
    esac
done

bench_decode=$(bench_binary bench_decode)
bench_serve=$(bench_binary bench/bench_serve)
qlserve=$(bench_binary qlserve)

server=$("$here/scripts/build-llama-server.sh")
commit=$("$here/scripts/build-llama-server.sh" --commit)
llama_bin=$(dirname "$server")
for b in llama-bench llama-batched-bench; do
    [ -x "$llama_bin/$b" ] || {
        echo "moe.sh: no $llama_bin/$b (scripts/build-llama-server.sh builds it beside llama-server)" >&2
        exit 1
    }
done

# The model: made once, then reused; the f16 file it is quantized from is removed (5.4 GB at 4
# layers) unless MOE_KEEP_F16=1.
cache=${QLSERVE_CACHE:-$HOME/.cache/qlserve}/bench
name=qwen3moe-a3b-shapes-L$layers
model=$cache/$name.Q4_K_M.gguf
if [ ! -s "$model" ]; then
    quantize=$("$here/scripts/build-llama-server.sh" --quantize)
    f16=$(python3 "$here/bench/moe/make_moe_gguf.py" --layers "$layers" --out "$cache/$name.f16.gguf")
    echo "moe.sh: quantizing $f16 to Q4_K_M" >&2
    "$quantize" "$f16" "$model.tmp" Q4_K_M >"$cache/$name.quantize.log" 2>&1 || {
        echo "moe.sh: llama-quantize failed; its log: $cache/$name.quantize.log" >&2
        exit 1
    }
    mv "$model.tmp" "$model"
    [ "${MOE_KEEP_F16:-0}" = 1 ] || rm -f "$f16"
fi

info=$(printf '{"path": "%s", "bytes": %s, "layers": %s, "made_by": "bench/moe/make_moe_gguf.py (random normal weights, std 0.02; norms 1) then llama-quantize Q4_K_M", "shapes": "Qwen3-30B-A3B: hidden 2048, 128 experts, 8 used, expert width 768, 32 q heads / 4 kv heads, head_dim 128, q/k norms", "vocabulary": "SmolLM2-135M-Instruct (49152 tokens), not Qwen3'"'"'s 151936"}' \
    "$model" "$(stat -c %s "$model")" "$layers")

exec python3 "$here/bench/moe/run_moe.py" --model "$model" --model-info "$info" \
    --bench-decode "$bench_decode" --bench-serve "$bench_serve" --qlserve "$qlserve" \
    --llama-bin "$llama_bin" --llama-commit "$commit" \
    --qlserve-commit "$(git -C "$here" rev-parse --short HEAD)" ${args[@]+"${args[@]}"}
