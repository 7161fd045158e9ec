#!/usr/bin/env bash
# bench/qwen35.sh - issue 33's benchmark: qlserve's bench_decode against llama.cpp's llama-bench
# and llama-batched-bench on one Qwen3.5-shaped file (Gated DeltaNet layers beside gated full
# attention; random weights, a handful of layers, converted by llama.cpp's convert_hf_to_gguf.py
# and quantized to Q4_K_M by its llama-quantize), in the same run. The driver is the MoE
# benchmark's (bench/moe/run_moe.py: prefill of 512, decode at batch 1, 8 and 32, alternating
# rounds, one JSON document on stdout with the ratios qlserve / llama.cpp); the server part is
# left out by default (--serve adds it).
#
#   bench/qwen35.sh [--layers N (4)] [--serve] [run_moe.py flags: --rounds 1 --threads 2 ...]
#
# Needs, built beforehand (BUILD=DIR picks the build folder, as bench/lib.sh does):
#   cmake --build build --target bench_decode bench_serve qlserve
# python3 with torch, transformers (5.x), numpy, gguf and sentencepiece (the converter's imports)
# for the model, made once into $QLSERVE_CACHE/bench/; the llama.cpp sources the converter comes
# from (LLAMA_CPP, default: the llama-cpp-python 0.3.36 sdist unpacked into the cache), and
# llama.cpp's binaries from scripts/build-llama-server.sh.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/lib.sh"

layers=4
serve=--no-serve
args=()
while [ $# -gt 0 ]; do
    case "$1" in
    --layers)
        layers=${2:?--layers needs a number}
        shift 2
        ;;
    --serve)
        serve=""
        shift
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

cache=${QLSERVE_CACHE:-$HOME/.cache/qlserve}/bench
name=qwen35-shapes-L$layers
model=$cache/$name.Q4_K_M.gguf
if [ ! -s "$model" ]; then
    version=0.3.36
    if [ -z "${LLAMA_CPP:-}" ]; then
        export LLAMA_CPP=$cache/llama_cpp_python-$version/vendor/llama.cpp
        if [ ! -f "$LLAMA_CPP/convert_hf_to_gguf.py" ]; then
            mkdir -p "$cache"
            python3 -m pip download -q --no-binary :all: --no-deps -d "$cache" \
                "llama-cpp-python==$version"
            tar -xzf "$cache/llama_cpp_python-$version.tar.gz" -C "$cache"
        fi
    fi
    quantize=$("$here/scripts/build-llama-server.sh" --quantize)
    f16=$(python3 "$here/bench/qwen35/make_qwen35_gguf.py" --layers "$layers" \
        --out "$cache/$name.f16.gguf" | tail -1)
    echo "qwen35.sh: quantizing $f16 to Q4_K_M" >&2
    "$quantize" "$f16" "$model.tmp" Q4_K_M >"$cache/$name.quantize.log" 2>&1 || {
        echo "qwen35.sh: llama-quantize failed; its log: $cache/$name.quantize.log" >&2
        exit 1
    }
    mv "$model.tmp" "$model"
    rm -f "$f16"
fi

info=$(printf '{"path": "%s", "bytes": %s, "layers": %s, "made_by": "bench/qwen35/make_qwen35_gguf.py (transformers initialization, f16) then convert_hf_to_gguf.py --no-mtp and llama-quantize Q4_K_M", "shapes": "Qwen3_5TextConfig defaults: hidden 4096, intermediate 12288; full layers 16 q / 4 kv heads of 256 with output gate, partial rotary 0.25; linear layers 16 key / 32 value heads of 128, conv 4; three linear layers per full one", "vocabulary": "a 49152-token byte-level stand-in, not Qwen3.5'"'"'s 248320"}' \
    "$model" "$(stat -c %s "$model")" "$layers")

exec python3 "$here/bench/moe/run_moe.py" --model "$model" --model-info "$info" \
    --bench-decode "$bench_decode" --bench-serve "$bench_serve" --qlserve "$qlserve" \
    --llama-bin "$llama_bin" --llama-commit "$commit" \
    --qlserve-commit "$(git -C "$here" rev-parse --short HEAD)" $serve ${args[@]+"${args[@]}"}
