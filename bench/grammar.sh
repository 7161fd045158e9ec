#!/usr/bin/env bash
# grammar.sh - issue 19's figures on the default model: bench_grammar runs chat requests under a
# JSON Schema's grammar (and the same requests without, alternating) at batch 1 and 32, sampled
# at temperature 0.8 with distinct seeds, and prints its JSON (the masks' cost per draw and per
# step, step times with and without); then every constrained answer is validated against the
# schema by the reference validator, Python's jsonschema (with its format checker), and one line
# of JSON says how many validated. Python is used only for that check.
#
# Needs: a build with bench_grammar (BUILD, default build/, else build-cpu/), the default model
# (scripts/fetch-model.sh), and Python with jsonschema (GRAMMAR_PYTHON, default: a virtual
# environment made once under ~/.cache/qlserve/jsonschema-venv from PyPI).
#
# Usage: bench/grammar.sh [--model GGUF] [--schema FILE] [--rounds R] [--batches 1,32]
#                         [--threads 2] [--new-tokens N]
# 50 seeds: --batches 1,32 --rounds 2 gives 2 + 64 answers; --rounds 1 --batches 18,32 gives 50.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
model="${HOME}/.cache/qlserve/models/SmolLM2-135M-Instruct.Q4_1.gguf"
args=()
schema=""
while [ $# -gt 0 ]; do
    case "$1" in
    --model) model="$2"; shift 2 ;;
    --schema) schema="$2"; args+=(--schema "$2"); shift 2 ;;
    --rounds | --batches | --threads | --new-tokens | --temperature) args+=("$1" "$2"); shift 2 ;;
    *) echo "usage: $0 [--model GGUF] [--schema FILE] [--rounds R] [--batches B,..] [--threads N] [--new-tokens N]" >&2; exit 2 ;;
    esac
done
. "$here/bench/lib.sh"
bench="$(bench_binary bench_grammar)"
[ -f "$model" ] || { echo "grammar.sh: no model at $model (scripts/fetch-model.sh)" >&2; exit 1; }
py="${GRAMMAR_PYTHON:-}"
if [ -z "$py" ]; then
    venv="${HOME}/.cache/qlserve/jsonschema-venv"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/python" -c "import jsonschema" 2>/dev/null ||
        "$venv/bin/pip" install -q jsonschema rfc3339-validator >&2
    py="$venv/bin/python"
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$bench" --model "$model" --answers "$work/answers.jsonl" "${args[@]}" | tee "$work/bench.json"
"$py" "$here/bench/validate_answers.py" "$work/bench.json" "$work/answers.jsonl"
