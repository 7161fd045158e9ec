#!/usr/bin/env python3
"""Decode benchmark against a named peer, in one run on one machine.

Runs build/bench_decode (qlserve's forward pass: the model's own weights and,
requantized on load, NF4 and int8) and bench/peer_llamacpp.py (llama.cpp
through llama-cpp-python, same model, same thread count, same prompt length
and number of new tokens), then prints one JSON document with both results
and the ratios qlserve / llama.cpp for the same weights (the GGUF's own kind)
at each batch size both measured. Absolute figures drift on shared machines;
the ratio is the figure to compare.

Python is needed only for the peer (llama-cpp-python from PyPI, built from
source); qlserve itself never needs it.

  python3 bench/run_decode.py [--model PATH] [--threads N] [--prompt-tokens P]
                              [--new-tokens N] [--quants none,nf4,int8]
                              [--batches 1,8,32] [--repeats R]
Both engines get an untimed warm-up and report the best of 3 rounds for
batch 1 and of R (default 1) for larger batches.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def default_model():
    cache = os.environ.get("QLSERVE_CACHE") or os.path.expanduser("~/.cache/qlserve")
    return os.path.join(cache, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--quants", default="none,nf4,int8")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed rounds for batches > 1, both engines (batch 1: 3)")
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "bench_decode"))
    a = ap.parse_args()

    cmd = [a.binary, "--model", a.model, "--threads", str(a.threads),
           "--prompt-tokens", str(a.prompt_tokens), "--new-tokens", str(a.new_tokens),
           "--batches", a.batches, "--repeats", str(a.repeats)]
    for q in a.quants.split(","):
        cmd += ["--quant", q]
    ours = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)

    peer = None
    try:
        out = subprocess.run([sys.executable, os.path.join(HERE, "peer_llamacpp.py"),
                              "--model", a.model, "--threads", str(a.threads),
                              "--prompt-tokens", str(a.prompt_tokens),
                              "--new-tokens", str(a.new_tokens),
                              "--batches", a.batches, "--repeats", str(a.repeats)],
                             check=True, capture_output=True, text=True).stdout
        peer = json.loads(out)
    except (subprocess.CalledProcessError, json.JSONDecodeError, FileNotFoundError) as e:
        peer = {"peer": "llama.cpp", "error": str(e)[:500]}

    ratios = []
    native = ours["kinds"][0]  # the model's own weights ("none") come first
    peer_rows = {r["batch"]: r for r in peer.get("results", []) if isinstance(r, dict)}
    for r in native["results"]:
        p = peer_rows.get(r["batch"])
        if not p or not p.get("decode_tok_s"):
            continue
        ratios.append({
            "weights": native["weights"], "batch": r["batch"],
            "prefill_ratio": round(r["prefill_tok_s"] / p["prefill_tok_s"], 3)
            if p.get("prefill_tok_s") else None,
            "decode_ratio": round(r["decode_tok_s"] / p["decode_tok_s"], 3),
        })
    print(json.dumps({"benchmark": "decode-vs-peer", "qlserve": ours, "peer": peer,
                      "ratios_qlserve_over_peer": ratios}, indent=2))


if __name__ == "__main__":
    main()
