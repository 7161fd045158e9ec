#!/usr/bin/env python3
"""run_activations.py - what --activations q8 changes on the default model's files (bench/
activations.sh finds the binaries and the models, then runs this): for each file, the same greedy
prompts through `qlserve serve --activations f32` and `--activations q8` (TGI /generate with
details: the token ids), how many tokens q8's answer shares with f32's before the first that
differs, and bench_decode's decode tok/s with each (alternating rounds; medians). One JSON
document on stdout, progress on stderr.

The distance from the float64 reference's logits is tests/test_kquant_model.c's to measure (its
q8_activations cases run the reference forward over the dequantized weights): with --float64
TEST (the built test_kquant_model) those cases run and their logged figures are read into the
document's "float64"; without it, the document says it has none.

Python only because it runs processes and gathers their JSON; qlserve never needs it.
"""
import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe"))
from run_moe import cpu_name  # noqa: E402  (the machine's CPU as the MoE benchmark names it)

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nName three prime numbers.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain what a hash table is in two sentences.<|im_end|>\n"
    "<|im_start|>assistant\n",
    "Once upon a time, in a small village by the mountains,",
]


def log(msg):
    print("run_activations: " + msg, file=sys.stderr, flush=True)


def http(port, method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


class Server:
    """qlserve serve on a free port, its log in a temporary file; stopped with SIGTERM."""

    def __init__(self, a, model, activations):
        self.log = tempfile.NamedTemporaryFile(prefix="qlserve-act-", suffix=".log", delete=False)
        cmd = [a.qlserve, "serve", "--model", model, "--port", "0", "--threads", str(a.threads),
               "--device", "cpu", "--activations", activations, "--no-prefix-cache",
               "--state-file", "none"]
        log(" ".join(cmd))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log)
        self.port = self.wait_port()

    def text(self):
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def wait_port(self):
        for _ in range(3000):
            m = re.search(r"listening on http://\S*:(\d+)", self.text())
            if m:
                port = int(m.group(1))
                for _ in range(3000):
                    try:
                        http(port, "GET", "/health")
                        return port
                    except OSError:
                        time.sleep(0.1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise SystemExit("run_activations: the server did not serve:\n" + self.text()[-2000:])

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)
        os.unlink(self.log.name)


def greedy_ids(a, model, activations):
    """{"activations_reported": /info's, "answers": [{"ids", "text"}] per prompt}."""
    s = Server(a, model, activations)
    try:
        info = http(s.port, "GET", "/info")
        answers = []
        for p in PROMPTS:
            r = http(s.port, "POST", "/generate",
                     {"inputs": p, "parameters": {"max_new_tokens": a.new_tokens,
                                                  "details": True, "do_sample": False}})
            answers.append({"ids": [t["id"] for t in r["details"]["tokens"]],
                            "text": r["generated_text"]})
        serving = [line for line in s.text().splitlines() if "qlserve: serving" in line]
    finally:
        s.stop()
    return {"activations_reported": info.get("activations"),
            "serving_line": serving[0] if serving else None, "answers": answers}


def agreement(f32, q8):
    out = []
    for i, (x, y) in enumerate(zip(f32["answers"], q8["answers"])):
        same = 0
        while same < len(x["ids"]) and same < len(y["ids"]) and x["ids"][same] == y["ids"][same]:
            same += 1
        out.append({"prompt": i, "tokens_f32": len(x["ids"]), "tokens_q8": len(y["ids"]),
                    "equal_until": same, "identical": x["ids"] == y["ids"],
                    "text_f32": x["text"], "text_q8": y["text"]})
    return out


def decode_speed(a, model, activations):
    cmd = [a.bench_decode, "--model", model, "--threads", str(a.threads), "--batches", a.batches,
           "--prompt-tokens", str(a.prompt_tokens), "--new-tokens", str(a.decode_tokens),
           "--activations", activations]
    log(" ".join(cmd))
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit("run_activations: bench_decode failed: " + p.stderr[-1500:])
    doc = json.loads(p.stdout)
    assert doc.get("activations") == activations, doc.get("activations")
    return {r["batch"]: r["decode_tok_s"] for r in doc["kinds"][0]["results"]}


def speeds(a, model):
    per = {"f32": [], "q8": []}
    for r in range(a.rounds):
        order = ("f32", "q8") if r % 2 == 0 else ("q8", "f32")
        for act in order:
            per[act].append(decode_speed(a, model, act))
    out = {}
    for b in per["f32"][0]:
        f = [x[b] for x in per["f32"]]
        q = [x[b] for x in per["q8"]]
        fm, qm = statistics.median(f), statistics.median(q)
        out["b%d" % b] = {"f32_decode_tok_s": f, "q8_decode_tok_s": q,
                          "f32_median": round(fm, 1), "q8_median": round(qm, 1),
                          "q8_over_f32": round(qm / fm, 3) if fm else None}
    return out


FLOAT64_LINE = re.compile(
    r"(\S+) q8 activations, prompt (\d+): (\d+) of (\d+) greedy tokens equal f32's, (\d+) the "
    r"float64 reference's \(its top-two gap (\S+) at the first that is not\); logits vs "
    r"float64: max \|d\| (\S+), worst step's relative L2 (\S+) \(f32: (\S+), (\S+)\)")


def float64_figures(test):
    cmd = [test, "--jobs", "1", "--verbose", "--filter", "kquant_model/q8_activations_*"]
    log(" ".join(cmd))
    p = subprocess.run(cmd, capture_output=True, text=True)
    rows = []
    for m in FLOAT64_LINE.finditer(p.stdout + p.stderr):
        g = m.groups()
        rows.append({"file": g[0], "prompt": int(g[1]), "q8_tokens": int(g[3]),
                     "equal_to_f32_until": int(g[2]), "equal_to_float64_until": int(g[4]),
                     "float64_top2_gap_there": float(g[5]), "q8_max_abs_logit_error": float(g[6]),
                     "q8_worst_step_relative_l2": float(g[7]),
                     "f32_max_abs_logit_error": float(g[8]),
                     "f32_worst_step_relative_l2": float(g[9])})
    return {"cmd": cmd, "exit_status": p.returncode,
            "prompts": "test_kquant_model.c's two, 24 new tokens at most, teacher-forced",
            "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", required=True, help="comma-separated GGUF paths")
    ap.add_argument("--qlserve", required=True)
    ap.add_argument("--bench-decode", required=True)
    ap.add_argument("--float64", default=None, help="the built tests/test_kquant_model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--rounds", type=int, default=2, help="bench_decode rounds per setting")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--no-speed", action="store_true", help="agreement only")
    a = ap.parse_args()

    files = []
    for model in a.models.split(","):
        log("model " + model)
        f32 = greedy_ids(a, model, "f32")
        q8 = greedy_ids(a, model, "q8")
        rec = {"model": model, "bytes": os.path.getsize(model),
               "serving_line_q8": q8["serving_line"],
               "info_activations": {"f32": f32["activations_reported"],
                                    "q8": q8["activations_reported"]},
               "greedy_agreement_q8_vs_f32": agreement(f32, q8)}
        if not a.no_speed:
            rec["decode"] = speeds(a, model)
        files.append(rec)

    doc = {
        "benchmark": "activations",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "kernel": platform.release()},
        "inputs": {"threads": a.threads, "prompts": PROMPTS, "new_tokens": a.new_tokens,
                   "greedy_through": "qlserve serve, TGI /generate details (token ids), "
                                     "--no-prefix-cache, --device cpu, KV f32",
                   "decode_through": "bench_decode --batches %s --prompt-tokens %d "
                                     "--new-tokens %d, %d alternating rounds"
                                     % (a.batches, a.prompt_tokens, a.decode_tokens, a.rounds),
                   "q8_covers": "Q4_K, Q5_K and Q6_K products (activations per 256) and Q4_0, "
                                "Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL and MXFP4 ones (per 32); every "
                                "other kind keeps f32 activations"},
        "files": files,
        "float64": float64_figures(a.float64) if a.float64 else
        "not measured here: bench/activations.sh runs tests/test_kquant_model's q8 cases when "
        "the test is built",
    }
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
