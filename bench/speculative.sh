#!/usr/bin/env bash
# bench/speculative.sh - issue 37's benchmark: speculative decoding through the server, qlserve
# against llama-server on the default model, with and without speculation, on the
# prompt-copying workloads (bench_serve's copy_1, copy_8: a paragraph to write out again
# corrected) and the distinct prompts (distinct_1, distinct_8). Two bench_serve runs, each
# alternating the two servers per round: "off" (qlserve --speculative off against llama-server
# without a drafter) and "ngram" (qlserve --speculative ngram against llama-server
# --spec-type ngram-simple). Prints one JSON document on stdout: both runs' whole JSON and,
# per workload, tok/s of each of the four and the ratios that the issue's targets read
# (qlserve ngram / qlserve off, qlserve ngram / llama-server ngram-simple,
# llama-server ngram-simple / llama-server off).
#
#   bench/speculative.sh [--rounds R (2)] [--seconds S (20)] [--workloads LIST]
#                        [--draft-max N] [bench_serve flags...]
#
# Needs build/bench/bench_serve and build/qlserve (BUILD=DIR picks the folder), the default
# model (scripts/fetch-model.sh) and llama-server (scripts/build-llama-server.sh). Python 3
# (its standard library only) joins the two runs' JSON; qlserve never needs it.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/lib.sh"

rounds=2 seconds=20 workloads=copy_1,copy_8,distinct_1,distinct_8
ql_spec=(--qlserve-arg --speculative --qlserve-arg ngram)
args=()
while [ $# -gt 0 ]; do
    case "$1" in
    --rounds) rounds=${2:?}; shift 2 ;;
    --seconds) seconds=${2:?}; shift 2 ;;
    --workloads) workloads=${2:?}; shift 2 ;;
    --draft-max) ql_spec+=(--qlserve-arg --draft-max --qlserve-arg "${2:?}"); shift 2 ;;
    *) args+=("$1"); shift ;;
    esac
done

bench_serve=$(bench_binary bench/bench_serve)
qlserve=$(bench_binary qlserve)
model=$("$here/scripts/fetch-model.sh")
server=$("$here/scripts/build-llama-server.sh")
commit=$("$here/scripts/build-llama-server.sh" --commit)

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(--model "$model" --llama-server "$server" --llama-commit "$commit" --qlserve "$qlserve"
    --qlserve-commit "$(git -C "$here" rev-parse --short HEAD)" --rounds "$rounds"
    --seconds "$seconds" --workloads "$workloads")
echo "speculative.sh: without speculation" >&2
"$bench_serve" "${common[@]}" --qlserve-arg --speculative --qlserve-arg off \
    ${args[@]+"${args[@]}"} >"$out/off.json"
echo "speculative.sh: qlserve ngram, llama-server ngram-simple" >&2
"$bench_serve" "${common[@]}" "${ql_spec[@]}" --llama-arg --spec-type --llama-arg ngram-simple \
    ${args[@]+"${args[@]}"} >"$out/ngram.json"

python3 - "$out/off.json" "$out/ngram.json" <<'PY'
import json
import sys

off, ngram = (json.load(open(p)) for p in sys.argv[1:3])


def tok_s(doc, server, workload):
    """The median tok/s of server on workload over the rounds (bench_serve's medians)."""
    try:
        return doc["medians"][server][workload]["tok_s"]
    except (KeyError, TypeError):
        return None


def ratio(a, b):
    return round(a / b, 3) if a and b else None


table = {}
for w in off.get("medians", {}).get("qlserve", {}):
    q0, q1 = tok_s(off, "qlserve", w), tok_s(ngram, "qlserve", w)
    l0, l1 = tok_s(off, "llama_server", w), tok_s(ngram, "llama_server", w)
    table[w] = {"tok_s": {"qlserve_off": q0, "qlserve_ngram": q1, "llama_server_off": l0,
                          "llama_server_ngram_simple": l1},
                "qlserve_ngram_over_off": ratio(q1, q0),
                "qlserve_ngram_over_llama_ngram_simple": ratio(q1, l1),
                "qlserve_ngram_over_llama_best": ratio(q1, max(x for x in (l0, l1) if x)
                                                       if l0 or l1 else None),
                "llama_ngram_simple_over_off": ratio(l1, l0)}
json.dump({"benchmark": "speculative decoding through the server (bench/speculative.sh)",
           "figures": table, "runs": {"off": off, "ngram": ngram}}, sys.stdout, indent=1)
print()
PY
