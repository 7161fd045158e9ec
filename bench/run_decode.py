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
source); qlserve itself never needs it. --peer-lib DIR runs the peer on a
libllama.so built elsewhere (llama-cpp-python's LLAMA_CPP_LIB_PATH), e.g. a
CMake build of the same sdist's vendor/llama.cpp, so the Python package can
be installed without building it (CMAKE_ARGS=-DLLAMA_BUILD=OFF).

--kquant adds, after --model, the default model's K-quant files that
scripts/fetch-kquant-models.sh makes with llama-quantize (Q4_K_M, Q5_K_M,
Q6_K, Q3_K_M, Q2_K, IQ4_XS; those present), each as stored only (no requantized kinds),
and prints one document per file under "runs".

  python3 bench/run_decode.py [--model PATH] [--kquant] [--threads N]
                              [--prompt-tokens P] [--new-tokens N]
                              [--quants none,nf4,int8] [--batches 1,8,32]
                              [--repeats R] [--peer-lib DIR]
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


KQUANT_FTYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "IQ4_XS")


def kquant_models():
    d = os.environ.get("QLSERVE_KQUANT_DIR") or os.path.dirname(default_model())
    paths = [os.path.join(d, "SmolLM2-135M-Instruct.%s.gguf" % f) for f in KQUANT_FTYPES]
    return [p for p in paths if os.path.exists(p)]


def run_one(a, model, quants):
    """Both engines on one file: qlserve's kinds, the peer, the ratios."""
    cmd = [a.binary, "--model", model, "--threads", str(a.threads),
           "--prompt-tokens", str(a.prompt_tokens), "--new-tokens", str(a.new_tokens),
           "--batches", a.batches, "--repeats", str(a.repeats)]
    for q in quants:
        cmd += ["--quant", q]
    ours = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)

    env = dict(os.environ)
    if a.peer_lib:
        env["LLAMA_CPP_LIB_PATH"] = a.peer_lib
    peer = None
    try:
        out = subprocess.run([sys.executable, os.path.join(HERE, "peer_llamacpp.py"),
                              "--model", model, "--threads", str(a.threads),
                              "--prompt-tokens", str(a.prompt_tokens),
                              "--new-tokens", str(a.new_tokens),
                              "--batches", a.batches, "--repeats", str(a.repeats)],
                             check=True, capture_output=True, text=True, env=env).stdout
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
    return {"benchmark": "decode-vs-peer", "model": model, "qlserve": ours, "peer": peer,
            "ratios_qlserve_over_peer": ratios}


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
    ap.add_argument("--kquant", action="store_true",
                    help="also the K-quant files of scripts/fetch-kquant-models.sh")
    ap.add_argument("--peer-lib", default=None,
                    help="directory of the libllama.so the peer loads (LLAMA_CPP_LIB_PATH)")
    a = ap.parse_args()

    if not a.kquant:
        print(json.dumps(run_one(a, a.model, a.quants.split(",")), indent=2))
        return
    runs = [run_one(a, a.model, a.quants.split(","))]
    runs += [run_one(a, m, ["none"]) for m in kquant_models()]
    print(json.dumps({"benchmark": "decode-vs-peer", "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
