#!/usr/bin/env python3
"""run_moe.py - the MoE benchmark's driver (bench/moe.sh finds the binaries and the model, then
runs this): qlserve against llama.cpp on one Qwen3-MoE-shaped Q4_K_M file, in alternating rounds,
printing one JSON document with every figure and the ratios qlserve / llama.cpp.

Python only because it runs processes and gathers their JSON; qlserve never needs it.

Per round (the order of the two engines flips each round, so drift on a shared machine falls on
both):
  prefill_512, decode_b1   qlserve: bench_decode --batches 1 --prompt-tokens 512 --new-tokens 128
                           (prefill of one 512-token prompt, then 128 greedy steps from depth 512);
                           llama.cpp: llama-batched-bench -npp 512 -ntg 128 -npl 1 (the same
                           work: S_PP and S_TG) and llama-bench -p 512 -n 128 (pp512 and tg128,
                           the figures people quote: tg128 decodes from an empty context, a
                           little less work than depth 512, so its ratio is the harder one).
  decode_b8, decode_b32    qlserve: bench_decode --batches 8,32 --prompt-tokens 128
                           --new-tokens 32 (B sequences prefilled, then 32 steps of all B);
                           llama.cpp: llama-batched-bench -npp 128 -ntg 32 -npl 8,32 (the same:
                           B prompts, then 32 steps of B tokens; S_TG).
  serve_1, serve_8, serve_32   bench_serve --workloads distinct_1,distinct_8,distinct_32
                           --rounds 1: qlserve serve against llama-server, streamed completions,
                           1/8/32 concurrent streams; tok_s (aggregate) and itl_p50_ms.
Both engines get the same thread count and an f16 KV cache (llama.cpp's default; bench_decode
--kv-dtype f16, qlserve serve --kv-dtype f16). --activations q8 gives qlserve's side llama.cpp's
arithmetic too (bench_decode --activations q8, qlserve serve --activations q8: activations
quantized to int8 per block of 256 for the K-quant products, as llama.cpp always does); the
default, f32, is qlserve's own (the float64 reference's greedy text). The figures per round, their
medians, and the ratio of the medians are under "figures"; the raw JSON of every run under
"rounds".
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time


def log(msg):
    print("run_moe: " + msg, file=sys.stderr, flush=True)


def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return f.read().strip()
    except OSError:
        return None


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run(cmd, parse):
    """Runs cmd; {"cmd", "loadavg_before", "seconds", "out"} or with "error" instead of "out"."""
    rec = {"cmd": cmd, "loadavg_before": loadavg()}
    log(" ".join(cmd))
    t = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        rec["error"] = "cannot run %s: %s" % (cmd[0], e)
        log("  failed: " + rec["error"])
        return rec
    rec["seconds"] = round(time.monotonic() - t, 1)
    if p.returncode != 0:
        rec["error"] = "exit status %d: %s" % (p.returncode, (p.stderr or p.stdout)[-1500:])
        log("  failed: " + rec["error"][-300:])
        return rec
    try:
        rec["out"] = parse(p.stdout)
    except (ValueError, KeyError) as e:
        rec["error"] = "unreadable output (%s): %s" % (e, p.stdout[-1500:])
    return rec


def jsonl(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def qlserve_decode(a, prompt, new, batches):
    return run([a.bench_decode, "--model", a.model, "--threads", str(a.threads),
                "--prompt-tokens", str(prompt), "--new-tokens", str(new), "--batches", batches,
                "--kv-dtype", "f16", "--activations", a.activations], json.loads)


def llama_bench(a):
    return run([os.path.join(a.llama_bin, "llama-bench"), "-m", a.model, "-p", str(a.prefill),
                "-n", str(a.new_tokens), "-t", str(a.threads), "-b", "2048", "-ub", "512",
                "-r", "3", "-o", "json"], json.loads)


def llama_batched(a, prompt, new, npl):
    # each sequence gets prompt + new cells, and kv_unified is off: n_ctx covers all of them
    most = max(int(x) for x in npl.split(","))
    return run([os.path.join(a.llama_bin, "llama-batched-bench"), "-m", a.model,
                "-c", str(most * (prompt + new) + 64), "-b", "2048", "-ub", "512",
                "-npp", str(prompt), "-ntg", str(new), "-npl", npl, "-t", str(a.threads),
                "--output-format", "jsonl"], jsonl)


def serve(a, servers):
    cmd = [a.bench_serve, "--llama-server", os.path.join(a.llama_bin, "llama-server"),
           "--qlserve", a.qlserve, "--model", a.model, "--threads", str(a.threads),
           "--rounds", "1", "--seconds", str(a.seconds), "--max-tokens", "64",
           "--workloads", "distinct_1,distinct_8,distinct_32", "--ctx-per-stream", "512",
           "--servers", servers, "--qlserve-arg", "--kv-dtype", "--qlserve-arg", "f16",
           "--qlserve-arg", "--activations", "--qlserve-arg", a.activations]
    if a.llama_commit:
        cmd += ["--llama-commit", a.llama_commit]
    return run(cmd, json.loads)


def qlserve_part(a):
    return {"decode_prefill": qlserve_decode(a, a.prefill, a.new_tokens, "1"),
            "decode_batched": qlserve_decode(a, a.batch_prompt, a.batch_new, a.big_batches)}


def llama_part(a):
    return {"bench": llama_bench(a),
            "batched_b1": llama_batched(a, a.prefill, a.new_tokens, "1"),
            "batched": llama_batched(a, a.batch_prompt, a.batch_new, a.big_batches)}


# --- the figures, read out of one round's raw runs -------------------------------------------

def ql_result(rec, batch):
    for r in rec.get("out", {}).get("kinds", [{}])[0].get("results", []):
        if r["batch"] == batch:
            return r
    return None


def ql_moe_counters(rec):
    """bench_decode's experts' work per step, per batch: {"moe": ..., "b1": {...}, ...}."""
    kind = rec.get("out", {}).get("kinds", [{}])[0]
    out = {"moe": kind.get("moe")}
    for r in kind.get("results", []):
        out["b%d" % r["batch"]] = {k: v for k, v in r.items() if "expert" in k}
    return out if kind else None


def lb_row(rec, n_prompt, n_gen):
    for r in rec.get("out", []) or []:
        if r.get("n_prompt") == n_prompt and r.get("n_gen") == n_gen:
            return r
    return None


def bb_row(rec, pl):
    for r in rec.get("out", []) or []:
        if r.get("pl") == pl:
            return r
    return None


def serve_fig(rec, server, workload, fig):
    runs = rec.get("out", {}).get("runs", [])
    for r in runs:
        if r["server"] == server:
            w = r["workloads"].get(workload)
            return w.get(fig) if w else None
    return None


def get(d, key):
    return d.get(key) if d else None


def round_figures(a, rd):
    """{figure: (qlserve, llama.cpp, unit)} for one round."""
    q, l, s = rd["qlserve"], rd["llama_cpp"], rd["serve"]
    q1 = ql_result(q["decode_prefill"], 1)
    lb_pp = lb_row(l["bench"], a.prefill, 0)
    lb_tg = lb_row(l["bench"], 0, a.new_tokens)
    bb1 = bb_row(l["batched_b1"], 1)
    f = {
        "prefill_%d_tok_s" % a.prefill: (get(q1, "prefill_tok_s"), get(lb_pp, "avg_ts")),
        "prefill_%d_tok_s_vs_batched_bench" % a.prefill: (get(q1, "prefill_tok_s"),
                                                          get(bb1, "speed_pp")),
        "decode_b1_tok_s": (get(q1, "decode_tok_s"), get(bb1, "speed_tg")),
        "decode_b1_tok_s_vs_llama_bench_tg%d" % a.new_tokens: (get(q1, "decode_tok_s"),
                                                             get(lb_tg, "avg_ts")),
    }
    for b in (int(x) for x in a.big_batches.split(",")):
        f["decode_b%d_tok_s" % b] = (get(ql_result(q["decode_batched"], b), "decode_tok_s"),
                                     get(bb_row(l["batched"], b), "speed_tg"))
    for n in (1, 8, 32):
        w = "distinct_%d" % n
        for fig in ("tok_s", "itl_p50_ms"):
            f["serve_%d_%s" % (n, fig)] = (serve_fig(s, "qlserve", w, fig),
                                           serve_fig(s, "llama_server", w, fig))
    return f


def ratio(x, y):
    return round(x / y, 3) if x and y else None


def median(v):
    v = [x for x in v if x is not None]
    return round(statistics.median(v), 2) if v else None


def summarize(a, rounds):
    per = [round_figures(a, rd) for rd in rounds]
    out = {}
    for name in per[0]:
        qs = [p[name][0] for p in per]
        ls = [p[name][1] for p in per]
        qm, lm = median(qs), median(ls)
        out[name] = {"qlserve": qs, "llama_cpp": ls, "qlserve_median": qm, "llama_cpp_median": lm,
                     "ratio_per_round": [ratio(x, y) for x, y in zip(qs, ls)],
                     "ratio_of_medians": ratio(qm, lm),
                     "better": "lower" if name.endswith("_ms") else "higher"}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--bench-decode", required=True)
    ap.add_argument("--bench-serve", required=True)
    ap.add_argument("--qlserve", required=True)
    ap.add_argument("--llama-bin", required=True, help="folder of llama-bench, "
                    "llama-batched-bench and llama-server")
    ap.add_argument("--llama-commit", default=None)
    ap.add_argument("--qlserve-commit", default=None)
    ap.add_argument("--model-info", default=None, help="JSON object describing the model file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch-prompt", type=int, default=128)
    ap.add_argument("--batch-new", type=int, default=32)
    ap.add_argument("--big-batches", default="8,32")
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--no-qlserve", action="store_true",
                    help="llama.cpp only (qlserve cannot load the file yet)")
    ap.add_argument("--no-serve", action="store_true", help="skip the server benchmark")
    ap.add_argument("--activations", choices=("f32", "q8"), default="f32",
                    help="qlserve's side only (bench_decode and serve --activations): q8 is "
                    "llama.cpp's 8-bit activations; f32 (default) qlserve's reference arithmetic")
    a = ap.parse_args()

    rounds = []
    for r in range(a.rounds):
        ql_first = r % 2 == 0
        rd = {"round": r + 1, "order": "qlserve first" if ql_first else "llama.cpp first"}
        parts = [("llama_cpp", llama_part)]
        if not a.no_qlserve:
            parts.insert(0 if ql_first else 1, ("qlserve", qlserve_part))
        for key, fn in parts:
            log("round %d: %s" % (r + 1, key))
            rd[key] = fn(a)
        rd.setdefault("qlserve", {"decode_prefill": {}, "decode_batched": {}})
        if a.no_serve:
            rd["serve"] = {}
        else:
            log("round %d: servers" % (r + 1))
            rd["serve"] = serve(a, "llama_server" if a.no_qlserve else "qlserve,llama_server")
        rd["qlserve_moe_counters"] = {
            "prefill_b1": ql_moe_counters(rd["qlserve"]["decode_prefill"]),
            "batched": ql_moe_counters(rd["qlserve"]["decode_batched"])}
        rounds.append(rd)

    doc = {
        "benchmark": "moe",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "kernel": platform.release(),
                    "loadavg_at_end": loadavg()},
        "model": json.loads(a.model_info) if a.model_info else {"path": a.model},
        "inputs": {"threads": a.threads, "rounds": a.rounds, "prefill_tokens": a.prefill,
                   "new_tokens_b1": a.new_tokens, "prompt_tokens_batched": a.batch_prompt,
                   "new_tokens_batched": a.batch_new, "batches": "1," + a.big_batches,
                   "serve_seconds_per_workload": a.seconds, "serve_max_tokens": 64,
                   "kv_cache": "f16 on both", "qlserve_measured": not a.no_qlserve,
                   "qlserve_activations": a.activations,
                   "llama_cpp_activations": "q8 (llama.cpp quantizes the activations of its "
                                            "K-quant products, q8_K, always)"},
        "llama_cpp": {"commit": a.llama_commit, "bin": a.llama_bin},
        "qlserve": {"commit": a.qlserve_commit, "bench_decode": a.bench_decode},
        "figures": summarize(a, rounds),
        "qlserve_moe_work_round_1": rounds[0]["qlserve_moe_counters"],
        "rounds": rounds,
    }
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
