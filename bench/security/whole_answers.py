#!/usr/bin/env python3
# whole_answers.py BINARY N MAX_TOKENS [ROUNDS]
# One whole /v1/completions answer of N choices x MAX_TOKENS tokens with
# logprobs 20 and echo (ignore_eos: all tokens), on the default model, ROUNDS
# times; meanwhile GET /health every 5 ms from another thread. Prints the
# answer's bytes, the slowest /health while answers were built, the event
# loop's longest turn (its CPU, /metrics), and RSS before, at peak and 3 s
# after the last answer.
import json, sys, threading, time

from served import HOST, Served

binary, n, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 1
srv = Served(binary)
req, get, rss, turn_max = srv.request, srv.get, srv.rss_mib, srv.turn_max
body = json.dumps({"prompt": "Hello there", "n": n, "max_tokens": max_tokens, "ignore_eos": True,
                   "logprobs": 20, "echo": True, "temperature": 1.0, "seed": 1}).encode()
head = (b"POST /v1/completions HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
out = {"binary": binary, "n": n, "max_tokens": max_tokens, "rounds": rounds,
       "rss_before_mib": rss(), "loop_turn_max_before_s": turn_max()}
worst, peak, stop = [0.0], [0], [False]
def watch():
    while not stop[0]:
        t0 = time.time(); get("/health"); worst[0] = max(worst[0], (time.time() - t0) * 1000)
        peak[0] = max(peak[0], rss()); time.sleep(0.005)
th = threading.Thread(target=watch); th.start()
for r in range(rounds):
    t0 = time.time(); a = req(head + body)
    out["answer_status"] = a.split(b"\r\n")[0].decode(); out["answer_bytes"] = len(a)
    if b" 200 " not in a[:20]: out["answer_body"] = a[-300:].decode()
    out["answer_s"] = round(time.time() - t0, 2)
stop[0] = True; th.join()
out["health_worst_ms"] = round(worst[0], 1); out["rss_peak_mib"] = peak[0]
out["loop_turn_max_s"] = turn_max()
time.sleep(3); out["rss_3s_after_mib"] = rss()
print(json.dumps(out))
srv.stop()
