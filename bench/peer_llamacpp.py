#!/usr/bin/env python3
"""peer_llamacpp.py - the benchmark peer: the same GGUF model through llama.cpp (via
llama-cpp-python's low-level API), printing JSON. Not part of the build: qlserve never needs
Python; this only measures the peer on the same machine.

Run: pip install llama-cpp-python        (builds llama.cpp from source; 10-20 min on 2 cores)
     python3 bench/peer_llamacpp.py --model ~/.cache/qlserve/models/SmolLM2-135M-Instruct.Q4_1.gguf

What is measured, for each batch size B (default 1, 8, 32), in a fresh context sized for it:
  prefill_tok_s  B sequences of N prompt tokens (a fixed synthetic text, rotated per sequence so
                 no two are equal) evaluated in one llama_decode call (llama.cpp splits it into
                 ubatches of --ubatch tokens itself); logits only for each sequence's last token.
                 B * N / seconds.
  decode_tok_s   then M greedy steps: each step one llama_decode of B tokens (one per sequence,
                 each its own sequence id and position), then the argmax of each sequence's
                 logits. B * M / seconds, the argmax included. Aggregate over the B sequences.
Each B gets an untimed warm-up (a short prefill and a few decode steps), then timed rounds of
prefill + decode from an empty KV cache (batch 1, which is short: 3 rounds; larger batches:
--repeats, default 1); each figure is the best round's. The KV
cache is per sequence (kv_unified = false), so a sequence attends to its own tokens only.
peak_rss_mb is the process's high-water mark (ru_maxrss) over the whole run, Python and numpy
included.

The figures mean little on cores that other processes are using: llama.cpp's OpenMP threads
spin at barriers, so one preempted thread stalls every step. Two signs are reported:
cpu_busy_before, the share of all CPUs busy over 1 s before the run (from /proc/stat), and,
per round, cpu_util = the process's CPU seconds / (wall seconds * threads), near 1.0 on
otherwise idle cores (the threads spin rather than sleep) and lower when other processes take
them: a round well under ~0.9 was disturbed (a warning on stderr says so).

Usage: peer_llamacpp.py --model PATH [--threads 2] [--prompt-tokens 128] [--new-tokens 64]
                        [--batches 1,8,32] [--ubatch 512] [--repeats 1]
                        [--flash-attn auto|on|off]
"""
import argparse
import ctypes
import json
import os
import resource
import sys
import time

import numpy as np

import llama_cpp

# llama.cpp commit vendored by each llama-cpp-python release (its CHANGELOG); the library
# carries no build number when built from the sdist (no .git).
LLAMA_CPP_COMMIT = {"0.3.36": "0c1e57098"}

SYNTH_TEXT = (
    "The history of computing is a story of ideas that took decades to become practical. "
    "Early mechanical calculators could add and subtract, but programmable machines needed "
    "memory, control flow and a way to describe procedures. Engineers built relays, then "
    "vacuum tubes, then transistors, and each step made machines smaller, faster and cheaper. "
    "Software grew alongside the hardware: assemblers, compilers, operating systems, databases "
    "and networks. Today a small language model can run on a laptop, predicting one token at "
    "a time from the tokens before it, and the cost of each prediction depends on how many "
    "weights must be read from memory and how many multiplications the processor can do. "
)

FA = {"auto": "LLAMA_FLASH_ATTN_TYPE_AUTO", "on": "LLAMA_FLASH_ATTN_TYPE_ENABLED",
      "off": "LLAMA_FLASH_ATTN_TYPE_DISABLED"}


# module-level so that it outlives main(): llama.cpp may log while the process tears down
_QUIET = llama_cpp.llama_log_callback(lambda level, text, user: None)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def tokenize(vocab, text: bytes):
    n = len(text) + 16
    buf = (llama_cpp.llama_token * n)()
    k = llama_cpp.llama_tokenize(vocab, text, len(text), buf, n, False, False)
    if k < 0:
        raise RuntimeError("tokenize failed")
    return list(buf[:k])


def synthetic_prompt(vocab, n_tokens):
    base = tokenize(vocab, SYNTH_TEXT.encode())
    ids = []
    while len(ids) < n_tokens:
        ids.extend(base)
    return ids[:n_tokens]


def cpu_busy(seconds):
    """Share of all CPUs busy over `seconds` (from /proc/stat), or None where unreadable."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)  # idle + iowait, total
    try:
        i0, t0 = sample()
        time.sleep(seconds)
        i1, t1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


class Batch:
    """A llama_batch filled from Python lists; one sequence id per token."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.b = llama_cpp.llama_batch_init(capacity, 0, 1)

    def fill(self, tokens, positions, seqs, logits):
        b = self.b
        n = len(tokens)
        assert n <= self.capacity
        for i in range(n):
            b.token[i] = tokens[i]
            b.pos[i] = positions[i]
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seqs[i]
            b.logits[i] = logits[i]
        b.n_tokens = n

    def free(self):
        llama_cpp.llama_batch_free(self.b)


def make_context(model, args, n_seq, per_seq_ctx, n_batch):
    p = llama_cpp.llama_context_default_params()
    p.n_ctx = n_seq * per_seq_ctx
    p.n_batch = n_batch
    p.n_ubatch = min(args.ubatch, n_batch)
    p.n_seq_max = n_seq
    p.n_threads = args.threads
    p.n_threads_batch = args.threads
    p.kv_unified = False
    p.no_perf = True
    p.flash_attn_type = getattr(llama_cpp, FA[args.flash_attn])
    ctx = llama_cpp.llama_init_from_model(model, p)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed for %d sequences" % n_seq)
    return ctx


def decode(ctx, batch):
    rc = llama_cpp.llama_decode(ctx, batch.b)
    if rc != 0:
        raise RuntimeError("llama_decode returned %d" % rc)


def argmax_rows(ctx, rows, n_vocab):
    p = llama_cpp.llama_get_logits(ctx)
    a = np.ctypeslib.as_array(p, shape=(rows * n_vocab,)).reshape(rows, n_vocab)
    return a.argmax(axis=1).tolist()


def run_batch(model, vocab, n_vocab, prompt, args, B):
    P, M = len(prompt), args.new_tokens
    per_seq = ((P + M + 8 + 255) // 256) * 256
    ctx = make_context(model, args, B, per_seq, max(B * P, B))
    mem = llama_cpp.llama_get_memory(ctx)
    batch = Batch(max(B * P, B))
    # sequence s: the prompt rotated by 7*s tokens, so the B sequences differ
    prompts = [prompt[(7 * s) % P:] + prompt[:(7 * s) % P] for s in range(B)]

    def prefill(n):
        toks, pos, seqs, outs = [], [], [], []
        for s in range(B):
            toks += prompts[s][:n]
            pos += list(range(n))
            seqs += [s] * n
            outs += [0] * (n - 1) + [1]
        batch.fill(toks, pos, seqs, outs)
        decode(ctx, batch)
        return argmax_rows(ctx, B, n_vocab)

    def steps(first, start, n):
        nxt = first
        for k in range(n):
            batch.fill(nxt, [start + k] * B, list(range(B)), [1] * B)
            decode(ctx, batch)
            nxt = argmax_rows(ctx, B, n_vocab)
        return nxt

    # warm-up: a short prefill and a few steps, then an empty cache
    w = min(P, 16)
    steps(prefill(w), w, 4)
    llama_cpp.llama_memory_clear(mem, True)

    best_p = best_d = None
    util = []
    for _ in range(3 if B == 1 else args.repeats):
        llama_cpp.llama_memory_clear(mem, True)
        c0, t0 = time.process_time(), time.perf_counter()
        first = prefill(P)
        t1 = time.perf_counter()
        steps(first, P, M)
        c2, t2 = time.process_time(), time.perf_counter()
        best_p = min(best_p or 1e30, t1 - t0)
        best_d = min(best_d or 1e30, t2 - t1)
        util.append((c2 - c0) / ((t2 - t0) * args.threads))
        if util[-1] < 0.9:
            log("warning: batch %d: cpu_util %.2f: other processes took the cores" % (B, util[-1]))

    batch.free()
    llama_cpp.llama_free(ctx)
    return {"batch": B, "prefill_tok_s": round(B * P / best_p, 2),
            "decode_tok_s": round(B * M / best_d, 2),
            "prefill_s": round(best_p, 4), "decode_s": round(best_d, 4),
            "rounds": len(util), "cpu_util": [round(u, 2) for u in util]}


def main():
    ap = argparse.ArgumentParser(description="llama.cpp peer benchmark (JSON on stdout)")
    ap.add_argument("--model", default=os.path.expanduser(
        "~/.cache/qlserve/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=1, help="timed rounds for batches > 1")
    ap.add_argument("--flash-attn", choices=sorted(FA), default="auto")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",") if x]

    llama_cpp.llama_backend_init()
    llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p(0))  # llama.cpp's log off stderr
    mp = llama_cpp.llama_model_default_params()
    mp.n_gpu_layers = 0
    t = time.perf_counter()
    model = llama_cpp.llama_model_load_from_file(args.model.encode(), mp)
    if not model:
        sys.exit("cannot load " + args.model)
    load_s = time.perf_counter() - t
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    prompt = synthetic_prompt(vocab, args.prompt_tokens)

    busy_before = cpu_busy(1.0)
    if busy_before is not None and busy_before > 0.1:
        log("warning: %.0f%% of the CPUs busy before the run: other processes share them, the "
            "figures will be low (llama.cpp's threads spin at barriers)" % (100 * busy_before))
    results, batched = [], "supported"
    for B in batches:
        log("batch %d ..." % B)
        try:
            results.append(run_batch(model, vocab, n_vocab, prompt, args, B))
        except Exception as e:  # report what ran; say why the rest did not
            if B == 1:
                raise
            batched = "unsupported: %s" % e
            break
        log("  %s" % results[-1])

    llama_cpp.llama_model_free(model)
    out = {
        "peer": "llama.cpp",
        "version": "llama-cpp-python %s, llama.cpp %s" % (
            llama_cpp.__version__, LLAMA_CPP_COMMIT.get(llama_cpp.__version__, "unknown")),
        "model": args.model,
        "threads": args.threads,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "flash_attn": args.flash_attn,
        "ubatch": args.ubatch,
        "batched": batched,
        "results": results,
        "load_s": round(load_s, 3),
        "cpu_busy_before": None if busy_before is None else round(busy_before, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1),
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
