#!/usr/bin/env bash
# merge_vs_peft.sh - issue 18's merge figure, side by side in one run: a rank-16 adapter merged
# into all 210 NF4 projections of the default model by qlserve (bench_adapters --merge-nf4,
# through the registry with --threads merge threads) and by PEFT + bitsandbytes on the CPU
# (bench/peer_peft_merge.py, torch on the same threads), alternating ours, PEFT's, ours, PEFT's
# for --rounds rounds, then one JSON with each side's best wall and CPU seconds and the ratios.
# The target: merge_ratio (ours / PEFT's, wall) at most 0.2. The cores are shared, so the wall
# figures move with the machine's load; process CPU seconds move less, and are reported too.
#
# Needs: a build with bench_adapters (BUILD, default build/, else build-cpu/), the default model
# (scripts/fetch-model.sh), and Python with torch, transformers, peft, bitsandbytes, gguf
# (PEFT_PYTHON, default python3; see bench/peer_peft_merge.py). The first run writes the GGUF's
# weights as an HF folder next to it (GGUF.hf, ~0.5 GB f32), later runs reuse it.
#
# Usage: bench/merge_vs_peft.sh [--model GGUF] [--threads 2] [--repeat 3] [--rounds 2]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
model="${HOME}/.cache/qlserve/models/SmolLM2-135M-Instruct.Q4_1.gguf"
threads=2
repeat=3
rounds=2
while [ $# -gt 0 ]; do
    case "$1" in
    --model) model="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --repeat) repeat="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    *) echo "usage: $0 [--model GGUF] [--threads N] [--repeat N] [--rounds N]" >&2; exit 2 ;;
    esac
done
. "$here/bench/lib.sh"
bench="$(bench_binary bench_adapters)"
py="${PEFT_PYTHON:-python3}"
[ -f "$model" ] || { echo "merge_vs_peft: no model at $model (scripts/fetch-model.sh)" >&2; exit 1; }
"$py" -c "import torch, transformers, peft, bitsandbytes, gguf" 2>/dev/null ||
    { echo "merge_vs_peft: $py lacks torch/transformers/peft/bitsandbytes/gguf (PEFT_PYTHON=...)" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
adapter="$work/adapter"
for r in $(seq 1 "$rounds"); do
    "$bench" --model "$model" --threads "$threads" --merge-nf4 "$repeat" --adapter-dir "$adapter" \
        > "$work/ours.$r.json"
    HF_HUB_DISABLE_PROGRESS_BARS=1 "$py" "$here/bench/peer_peft_merge.py" --model "$model" \
        --adapter "$adapter" --threads "$threads" --repeat "$repeat" > "$work/peft.$r.json" \
        2> "$work/peft.$r.err" || { cat "$work/peft.$r.err" >&2; exit 1; }
done

"$py" - "$work" "$rounds" <<'EOF'
import json, sys
work, rounds = sys.argv[1], int(sys.argv[2])
ours = [json.load(open(f"{work}/ours.{r}.json")) for r in range(1, rounds + 1)]
peft = [json.load(open(f"{work}/peft.{r}.json")) for r in range(1, rounds + 1)]
o_wall = min(x["merge_nf4_seconds"] for x in ours)
o_cpu = min(x["merge_nf4_cpu_seconds"] for x in ours)
p_wall = min(x["merge_seconds"] for x in peft)
p_cpu = min(x["merge_cpu_seconds"] for x in peft)
print(json.dumps({
    "bench": "merge_vs_peft",
    "modules": ours[0]["modules"],
    "threads": ours[0]["merge_threads"],
    "rounds": [{"ours_s": o["merge_nf4_seconds"], "peft_s": p["merge_seconds"],
                "ratio": round(o["merge_nf4_seconds"] / p["merge_seconds"], 3),
                "ours_cpu_s": o["merge_nf4_cpu_seconds"], "peft_cpu_s": p["merge_cpu_seconds"]}
               for o, p in zip(ours, peft)],
    "merge_nf4_seconds": o_wall,
    "peft_merge_seconds": p_wall,
    "merge_ratio": round(o_wall / p_wall, 3),
    "merge_nf4_cpu_seconds": o_cpu,
    "peft_merge_cpu_seconds": p_cpu,
    "merge_cpu_ratio": round(o_cpu / p_cpu, 3),
    "target_ratio": 0.2,
    "unmerge_seconds": min(x["unmerge_seconds"] for x in ours),
    "digest_restored": all(x["digest_restored"] for x in ours),
    "peer_versions": peft[0]["versions"],
}, indent=2))
EOF
