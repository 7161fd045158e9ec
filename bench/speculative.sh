#!/usr/bin/env bash
# bench/speculative.sh - issue 37's benchmark: speculative decoding through the server, qlserve
# against llama-server on the same target file, with and without speculation, on the
# prompt-copying workloads (bench_serve's copy_1, copy_8: a paragraph to write out again
# corrected; quote_1, quote_8: a passage to summarize with word-for-word quotes) and the
# distinct prompts (distinct_1, distinct_8). Each round is two bench_serve runs of one round,
# in turn, each of both servers: "off" (qlserve --speculative off against llama-server without a
# drafter) and the drafter's:
#
#   --drafter ngram (default)  qlserve --speculative ngram against llama-server
#                              --spec-type ngram-simple; the target is the default model
#   --drafter draft            qlserve --speculative draft --draft-model Q4_1 against
#                              llama-server --spec-type draft-simple -md Q4_1 -ngld 0 (its
#                              draft-model settings left at their defaults: --spec-draft-n-max 3,
#                              --spec-draft-n-min 0, --spec-draft-p-min 0); the draft is the
#                              default model (its Q4_1 file) and the target that file converted
#                              to Q8_0 by `qlserve quantize --kind q8_0 --allow-requantize`
#
# --target KIND picks the target: `default` (the default model's file as fetched) or a GGUF kind
# `qlserve quantize` writes (q8_0, f32, q6_k, ...), converted from the default model once into
# ${QLSERVE_CACHE:-~/.cache/qlserve}/bench/ and reused from there (its quantize log beside it).
# The default model is a Q4_1 file, so a converted target holds Q4_1's values quantized again:
# the draft is the very weights the target was made from, and agrees with it more than a Q4_1
# made from the original float weights would.
#
# Prints one JSON document on stdout: every run's whole JSON (runs.off and runs.DRAFTER, one a
# round), the files and the speculative flags of each server, and per workload the median over
# the rounds of each of the four's tok/s and the ratios that the issue's targets read (qlserve's
# drafter / qlserve off, qlserve's drafter / llama-server's, qlserve's
# drafter / llama-server's best of off and its drafter, llama-server's drafter / its off).
#
#   bench/speculative.sh [--drafter ngram|draft] [--target default|KIND] [--rounds R (2)]
#                        [--seconds S (20)] [--workloads LIST] [--draft-max N]
#                        [--llama-spec TYPES] [bench_serve flags...]
#
# --llama-spec replaces llama-server's --spec-type for --drafter ngram (its other n-gram drafters:
# ngram-mod, shared across requests as qlserve's memory of earlier answers is, ngram-map-k,
# ngram-cache, or a comma-separated list; their own flags through --llama-arg), the JSON's
# labels named after it (ngram_mod, ...). --draft-max goes to qlserve alone (llama-server's is --llama-arg --spec-draft-n-max
# --llama-arg N). Needs build/bench/bench_serve and build/qlserve (BUILD=DIR picks the folder),
# the default model (scripts/fetch-model.sh) and llama-server (scripts/build-llama-server.sh).
# Python 3 (its standard library only) joins the two runs' JSON; qlserve never needs it.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/lib.sh"

rounds=2 seconds=20 drafter=ngram target_kind=""
workloads=copy_1,copy_8,quote_1,quote_8,distinct_1,distinct_8
ql_extra=()
llama_types=""
args=()
while [ $# -gt 0 ]; do
    case "$1" in
    --drafter) drafter=${2:?}; shift 2 ;;
    --target) target_kind=${2:?}; shift 2 ;;
    --rounds) rounds=${2:?}; shift 2 ;;
    --seconds) seconds=${2:?}; shift 2 ;;
    --workloads) workloads=${2:?}; shift 2 ;;
    --draft-max) ql_extra+=(--draft-max "${2:?}"); shift 2 ;;
    --llama-spec) llama_types=${2:?}; shift 2 ;;
    *) args+=("$1"); shift ;;
    esac
done
case "$drafter" in
ngram) target_kind=${target_kind:-default} ;;
draft) target_kind=${target_kind:-q8_0} ;;
*) echo "speculative.sh: --drafter $drafter: want ngram or draft" >&2; exit 2 ;;
esac

bench_serve=$(bench_binary bench/bench_serve)
qlserve=$(bench_binary qlserve)
model=$("$here/scripts/fetch-model.sh")
server=$("$here/scripts/build-llama-server.sh")
commit=$("$here/scripts/build-llama-server.sh" --commit)

# converted_target KIND: the default model converted to KIND by qlserve quantize, made once
# into the bench cache and reused; its path on stdout.
converted_target() {
    local kind="$1" cache=${QLSERVE_CACHE:-$HOME/.cache/qlserve}/bench
    local out
    out=$cache/$(basename "$model" .gguf | sed 's/\.Q4_1$//').${kind^^}-from-Q4_1.gguf
    if [ ! -s "$out" ]; then
        mkdir -p "$cache"
        echo "speculative.sh: writing $out (qlserve quantize --kind $kind --allow-requantize)" >&2
        if ! "$qlserve" quantize --in "$model" --out "$out.tmp" --kind "$kind" \
            --allow-requantize >"$out.quantize.log" 2>&1; then
            echo "speculative.sh: qlserve quantize --kind $kind failed; see $out.quantize.log" >&2
            rm -f "$out.tmp"
            exit 1
        fi
        mv "$out.tmp" "$out"
    fi
    echo "$out"
}

if [ "$target_kind" = default ]; then
    target=$model
else
    target=$(converted_target "$target_kind")
fi

# each server's speculative flags, as given to it
if [ "$drafter" = ngram ]; then
    ql_spec=(--speculative ngram)
    llama_spec=(--spec-type "${llama_types:-ngram-simple}")
    llama_label=$(echo "${llama_types:-ngram-simple}" | tr ',-' '__')
else
    ql_spec=(--speculative draft --draft-model "$model")
    llama_spec=(--spec-type draft-simple -md "$model" -ngld 0)
    llama_label=draft_simple
fi
ql_spec+=(${ql_extra[@]+"${ql_extra[@]}"})
spec_args=()
for a in "${ql_spec[@]}"; do spec_args+=(--qlserve-arg "$a"); done
for a in "${llama_spec[@]}"; do spec_args+=(--llama-arg "$a"); done

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(--model "$target" --llama-server "$server" --llama-commit "$commit" --qlserve "$qlserve"
    --qlserve-commit "$(git -C "$here" rev-parse --short HEAD)" --rounds 1
    --seconds "$seconds" --workloads "$workloads")
# Each round is one bench_serve run without speculation and one with, in turn, so that a host
# that drifts (a noisy neighbour, a warmer cache) weighs on both halves alike: two long runs one
# after the other once read 1.26x on a workload with no drafts at all.
for r in $(seq 1 "$rounds"); do
    echo "speculative.sh: round $r: without speculation, on $target" >&2
    "$bench_serve" "${common[@]}" --qlserve-arg --speculative --qlserve-arg off \
        ${args[@]+"${args[@]}"} >"$out/off.$r.json"
    echo "speculative.sh: round $r: qlserve ${ql_spec[*]}, llama-server ${llama_spec[*]}" >&2
    "$bench_serve" "${common[@]}" "${spec_args[@]}" ${args[@]+"${args[@]}"} >"$out/spec.$r.json"
done

{
    printf '%s\n' "$drafter" "$llama_label" "$target" "$target_kind" "$model"
    printf '%s\n' "${#ql_spec[@]}" "${ql_spec[@]}" "${#llama_spec[@]}" "${llama_spec[@]}"
} >"$out/what"
python3 - "$out" "$rounds" <<'PY'
import json
import os
import statistics
import sys

out, rounds = sys.argv[1], int(sys.argv[2])
off, spec = ([json.load(open(os.path.join(out, "%s.%d.json" % (half, r))))
              for r in range(1, rounds + 1)] for half in ("off", "spec"))
lines = open(os.path.join(out, "what")).read().split("\n")
drafter, llama_label, target, target_kind, default_model = lines[:5]
n = int(lines[5])
ql_flags = lines[6:6 + n]
m = int(lines[6 + n])
llama_flags = lines[7 + n:7 + n + m]


def tok_s(docs, server, workload):
    """The median tok/s of server on workload over the rounds (one bench_serve run each)."""
    got = []
    for doc in docs:
        try:
            got.append(doc["medians"][server][workload]["tok_s"])
        except (KeyError, TypeError):
            pass
    got = [x for x in got if x]
    return round(statistics.median(got), 3) if got else None


def ratio(a, b):
    return round(a / b, 3) if a and b else None


d, ll = drafter, "llama_" + llama_label
table = {}
for w in off[0].get("medians", {}).get("qlserve", {}):
    q0, q1 = tok_s(off, "qlserve", w), tok_s(spec, "qlserve", w)
    l0, l1 = tok_s(off, "llama_server", w), tok_s(spec, "llama_server", w)
    best = max(x for x in (l0, l1) if x) if l0 or l1 else None
    table[w] = {"tok_s": {"qlserve_off": q0, "qlserve_" + d: q1, "llama_server_off": l0,
                          "llama_server_" + llama_label: l1},
                "qlserve_%s_over_off" % d: ratio(q1, q0),
                "qlserve_%s_over_%s" % (d, ll): ratio(q1, l1),
                "qlserve_%s_over_llama_best" % d: ratio(q1, best),
                "%s_over_off" % ll: ratio(l1, l0)}
json.dump({"benchmark": "speculative decoding through the server (bench/speculative.sh)",
           "drafter": drafter,
           "target_model": target,
           "target": ("the default model" if target_kind == "default" else
                      "the default model converted by qlserve quantize --kind %s "
                      "--allow-requantize" % target_kind),
           "draft_model": default_model if drafter == "draft" else None,
           "speculative_flags": {"qlserve": ql_flags, "llama_server": llama_flags},
           "rounds": rounds, "figures": table, "runs": {"off": off, drafter: spec}},
          sys.stdout, indent=1)
print()
PY
