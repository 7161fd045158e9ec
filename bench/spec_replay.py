#!/usr/bin/env python3
"""bench/spec_replay.py - what the n-gram drafter's length rule leaves on the table.

Replays `--speculative ngram` over greedy answers: takes bench_serve's request bodies
(`bench_serve --print-requests N`), has a running qlserve (any speculation setting; greedy
answers are the same tokens) write each answer as token ids (`/chat_tokenize` or `/tokenize`
for the prompt, `/generate` with details for the answer, its prefill checked against the
prompt's ids; it ends at its end token, where the benchmark's, with ignore_eos, goes on),
then walks each answer as the engine does, step by step: the lookup
(`eng_ngram_draft`: the longest suffix of at most --ngram-max tokens, its latest earlier
place), the length rule (`eng_spec_len_want` / `_keep` / `_adapt` / `_prior` in
engine/scheduler/drafter.c, written again here), and the verification (drafts taken up to the
first that differs from the answer). A step of r rows costs `fixed + r` rows' worth, `fixed`
from --fixed-rows (the server's step fit measures about 2.7 on the 2-core dev machine; the
engine alone, `bench_decode`'s cost curve, about 1.5). Nothing is timed: the figures are
counts and the decode speed-up they give under that cost, for four rules:

  one_rate     one pair of rates a sequence, the length chosen before the lookup (the rule
               before per-class rates)
  per_class    a pair per class of draft (the matched suffix's length: 1, 2, 3 or more), the
               lookup's draft cut to the class's length
  engine_prior per_class, a new sequence starting from the engine's counts
  oracle       every draft cut at its first miss (no rule can do better with this lookup)
  memory       engine_prior with the memory of earlier answers (ngram_memory.c, written again
               here without its table's collisions; the answers replayed in order, each kept
               once it ends): what ships
  memory_oracle  the memory's drafts too, cut at their first miss

Prints one JSON document. Python 3's standard library only; qlserve never needs it.

  bench/spec_replay.py --url http://127.0.0.1:PORT [--answers FILE]
                       [--workloads copy_1,quote_1,distinct_1] [--requests N (12)]
                       [--fixed-rows F (2.7)] [--batch B (1)] [--no-override]
                       [--ngram-min 1] [--ngram-max 3] [--draft-max 16] [--bench-serve PATH]

--batch B replays each answer as one of B sequences decoding together: the length rule
weighs its drafts against a step of B rows, and the step's fixed part is shared by the B
(an approximation: the other sequences are taken as plain rows). --no-override drops the
rule's floor of one drafted token while the first is accepted more often than not.
"""
import argparse
import json
import os
import subprocess
import sys
import urllib.request

OVERRIDE = True
DECAY, PROBE_STEPS, PRIOR_TRIALS, PRIOR_RATE, CLASSES = 0.8, 16, 5.0, 0.6, 7
MEMORY_MIN, MEMORY_MAX, MEMORY_CLASS = 2, 4, 4


class Rates:
    """eng_spec_len: decayed counts of the first drafted position and of the later ones."""

    def __init__(self, fh=PRIOR_RATE * PRIOR_TRIALS, ft=PRIOR_TRIALS, h=None, t=None):
        self.fh, self.ft = fh, ft
        self.h = PRIOR_RATE * PRIOR_TRIALS if h is None else h
        self.t = PRIOR_TRIALS if t is None else t
        self.idle = 0

    def want(self, fixed, most, n=1):
        first = self.fh / self.ft if self.ft > 0 else 0.0
        nxt = self.h / self.t if self.t > 0 else 0.0
        gain, p, best_value, best = 0.0, first, n / (fixed + n), 0
        for j in range(1, most + 1):
            gain += p
            value = (n + gain) / (fixed + n + j)
            if value > best_value:
                best_value, best = value, j
            p *= nxt
        if OVERRIDE and best == 0 and first > 0.5 and most > 0:
            best = 1
        if best > 0:
            self.idle = 0
            return best
        self.idle += 1
        if self.idle >= PROBE_STEPS:
            self.idle = 0
            return 1
        return 0

    def adapt(self, drafted, accepted):
        if drafted <= 0:
            return
        later_tried = accepted if accepted < drafted else drafted - 1
        later_hits = accepted - 1 if accepted > 0 else 0
        self.fh = self.fh * DECAY + (accepted > 0)
        self.ft = self.ft * DECAY + 1.0
        self.h = self.h * DECAY + later_hits
        self.t = self.t * DECAY + later_tried

    def prior(self):
        """eng_spec_len_prior: these counts weighing at most five positions, topped up."""

        def counts(hits, trials):
            w = min(trials, PRIOR_TRIALS)
            taken = hits * (w / trials) if trials > 0 else 0.0
            return taken + PRIOR_RATE * (PRIOR_TRIALS - w), PRIOR_TRIALS

        fh, ft = counts(self.fh, self.ft)
        h, t = counts(self.h, self.t)
        return Rates(fh, ft, h, t)


def lookup(hist, n_min, n_max, most):
    """eng_ngram_draft: (draft, matched suffix length)."""
    total = len(hist)
    for n in range(n_max, n_min - 1, -1):
        suffix = total - n
        if suffix <= 0:
            continue
        tail = hist[suffix:]
        for at in range(suffix - 1, -1, -1):
            if hist[at:at + n] == tail:
                return hist[at + n:at + n + most], n
    return [], 0


class Memory:
    """ngram_memory.c: earlier answers' runs of MEMORY_MIN..MEMORY_MAX tokens, each to the place
    that followed its latest occurrence (a dict: the ring and its table's collisions left out)."""

    def __init__(self):
        self.tokens, self.at = [], {}

    def add(self, answer):
        start = len(self.tokens)
        for i, tok in enumerate(answer):
            self.tokens.append(tok)
            for n in range(MEMORY_MIN, MEMORY_MAX + 1):
                if i < n:
                    break
                self.at[tuple(answer[i - n:i])] = start + i
        self.tokens.append(None)  # the break between answers

    def draft(self, hist, shorter, most):
        for n in range(MEMORY_MAX, max(MEMORY_MIN, shorter + 1) - 1, -1):
            p = self.at.get(tuple(hist[-n:])) if len(hist) >= n else None
            if p is None:
                continue
            out = []
            while len(out) < most and self.tokens[p] is not None:
                out.append(self.tokens[p])
                p += 1
            if out:
                return out, n
        return [], 0


def replay(answers, rule, a):
    """Steps, rows and accepted drafts of every answer under rule, in order (the engine's
    counts carry from one answer to the next)."""
    seen = [Rates(0.0, 0.0, 0.0, 0.0) for _ in range(CLASSES)]
    memory = Memory() if rule in ("memory", "memory_oracle") else None
    steps = rows = accepted = 0
    for prompt, answer in answers:
        if rule in ("engine_prior", "memory"):
            mine = [seen[c].prior() for c in range(CLASSES)]
        else:
            mine = [Rates() for _ in range(CLASSES)]
        pos = 0  # answer[pos] is the token the step feeds; the prefill gave answer[0]
        while pos < len(answer) - 1:
            room = min(a.draft_max, len(answer) - pos - 2)
            hist = prompt + answer[:pos + 1]
            if rule == "one_rate":
                want = min(mine[0].want(a.fixed_rows, a.draft_max, a.batch), room)
                draft, n = lookup(hist, a.ngram_min, a.ngram_max, want) if want > 0 else ([], 0)
                cls = 0
            else:
                draft, n = lookup(hist, a.ngram_min, a.ngram_max, room) if room > 0 else ([], 0)
                cls = min(n, MEMORY_CLASS - 1)
                if memory and room > 0:
                    kept, m = memory.draft(hist, n if draft else 0, room)
                    if kept:
                        draft, n, cls = kept, m, MEMORY_CLASS + min(m, MEMORY_MAX) - MEMORY_MIN
            k = len(draft)
            taken = 0
            while taken < k and draft[taken] == answer[pos + 1 + taken]:
                taken += 1
            if rule in ("oracle", "memory_oracle"):
                k = taken
            elif rule != "one_rate" and k > 0:
                k = mine[cls].want(a.fixed_rows, k, a.batch)
                taken = min(taken, k)
            if k > 0 and rule not in ("oracle", "memory_oracle"):
                mine[cls].adapt(k, taken)
                seen[cls].adapt(k, taken)
            steps += 1
            rows += 1 + k
            accepted += taken
            pos += 1 + taken
        if memory:
            memory.add(answer[:-1])  # the tokens fed: the last one sampled never is
    return steps, rows, accepted


def post(url, path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def answer_ids(url, line):
    """(prompt ids, greedy answer ids) of one bench_serve request body."""
    body = line["body"]
    if "messages" in body:
        toks = post(url, "/chat_tokenize", {"messages": body["messages"]})["tokenize_response"]
    else:
        toks = post(url, "/tokenize", {"inputs": body["prompt"]})
    prompt = [t["id"] for t in toks]
    # TGI's /generate has no ignore_eos: an answer ends at its end token, where the
    # benchmark's goes on to max_tokens
    params = {"max_new_tokens": body["max_tokens"], "details": True,
              "decoder_input_details": True}
    g = post(url, "/generate", {"inputs": "".join(t["text"] for t in toks), "parameters": params})
    fed = [t["id"] for t in g["details"]["prefill"]]
    if fed != prompt:
        sys.exit("spec_replay: %s: /generate's prefill is not the prompt's tokens" % line["workload"])
    return prompt, [t["id"] for t in g["details"]["tokens"]]


def main():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url")
    p.add_argument("--answers", help="the answers' ids: read from this file when it exists "
                   "(then --url is not needed), else fetched and written to it")
    p.add_argument("--workloads", default="copy_1,quote_1,distinct_1")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--fixed-rows", type=float, default=2.7)
    p.add_argument("--ngram-min", type=int, default=1)
    p.add_argument("--ngram-max", type=int, default=3)
    p.add_argument("--draft-max", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--no-override", action="store_true")
    p.add_argument("--bench-serve",
                   default=os.path.join(os.environ.get("BUILD", os.path.join(here, "build")),
                                        "bench", "bench_serve"))
    a = p.parse_args()
    global OVERRIDE
    OVERRIDE = not a.no_override
    if a.answers and os.path.exists(a.answers):
        with open(a.answers) as f:
            by_workload = json.load(f)
    else:
        out = subprocess.run([a.bench_serve, "--print-requests", str(a.requests), "--workloads",
                              a.workloads], check=True, capture_output=True, text=True).stdout
        by_workload = {}
        for text in out.splitlines():
            line = json.loads(text)
            by_workload.setdefault(line["workload"], []).append(answer_ids(a.url, line))
        if a.answers:
            with open(a.answers, "w") as f:
                json.dump(by_workload, f)
    doc = {"benchmark": "n-gram speculation replayed over greedy answers (bench/spec_replay.py)",
           "fixed_rows": a.fixed_rows, "ngram_min": a.ngram_min, "ngram_max": a.ngram_max,
           "draft_max": a.draft_max, "requests": a.requests, "workloads": {}}
    for name, answers in by_workload.items():
        tokens = sum(len(ans) - 1 for _, ans in answers)
        share = a.fixed_rows / a.batch  # a step's fixed part shared by its batch
        plain = tokens * (share + 1.0)
        fig = {"decoded_tokens": tokens}
        for rule in ("one_rate", "per_class", "engine_prior", "oracle", "memory", "memory_oracle"):
            steps, rows, accepted = replay(answers, rule, a)
            fig[rule] = {"steps": steps, "rows": rows, "accepted": accepted,
                         "decode_speedup": round(plain / (steps * share + rows), 3)}
        doc["workloads"][name] = fig
    json.dump(doc, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
