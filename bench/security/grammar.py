#!/usr/bin/env python3
"""Another client's per-token time while one client sends guided_regex (.*.){300} with n choices.

usage: grammar.py BINARY MODEL [N_CHOICES [MAX_TOKENS]]
Starts BINARY serve on MODEL (port 0, 2 threads), streams a neighbour completion
(300 tokens, ignore_eos), and after its 30th token sends the bomb (non-stream,
max_tokens 200, temperature 1, seed 30; RE=none in the environment: the same request
without a grammar, the reference for what n choices cost by themselves). Prints JSON: the neighbour's gaps
before, during the bomb, and after; the bomb's status, wall seconds and message.
"""
import json, socket, subprocess, sys, threading, time, re, os, tempfile

binary, model = sys.argv[1], sys.argv[2]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 16
max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 200
log = tempfile.NamedTemporaryFile(delete=False, suffix=".log")
proc = subprocess.Popen([binary, "serve", "--model", model, "--port", "0", "--threads", "2"],
                        stdout=log, stderr=subprocess.STDOUT, env={k: v for k, v in os.environ.items() if not k.startswith("QLSERVE_")})
port = None
for _ in range(3000):
    text = open(log.name).read()
    m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", text)
    if m:
        port = int(m.group(1)); break
    time.sleep(0.01)

def request(body, path="/v1/completions"):
    s = socket.create_connection(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % (path.encode(), len(data)) + data)
    return s

def health_ok():
    try:
        s = socket.create_connection(("127.0.0.1", port)); s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        return b" 200 " in s.recv(100)
    except OSError:
        return False
while not health_ok():
    time.sleep(0.05)

times = []
bomb = {}
def neighbour():
    s = request({"prompt": "Tell me a long story about a lighthouse.", "max_tokens": 300, "ignore_eos": True, "stream": True})
    buf = b""
    while True:
        d = s.recv(65536)
        if not d: break
        now = time.monotonic()
        buf += d
        while b"\ndata: " in buf or buf.startswith(b"data: "):
            i = buf.find(b"data: ")
            j = buf.find(b"\n\n", i)
            if j < 0: break
            ev = buf[i+6:j]; buf = buf[j+2:]
            if ev != b"[DONE]": times.append(now)
def attack():
    t0 = time.monotonic(); bomb["t0"] = t0
    s = request({"prompt": "x", "n": n, "max_tokens": max_tokens, "temperature": 1, "seed": 30, **({"guided_regex": os.environ.get("RE", "(.*.){300}")} if os.environ.get("RE") != "none" else {})})
    out = b""
    while True:
        d = s.recv(65536)
        if not d: break
        out += d
    bomb["t1"] = time.monotonic()
    head, _, body = out.partition(b"\r\n\r\n")
    bomb["status"] = int(head.split()[1])
    m = re.search(rb'"message":"([^"]*)"', body)
    bomb["message"] = m.group(1).decode() if m else body[:200].decode(errors="replace")

t = threading.Thread(target=neighbour); t.start()
while len(times) < 30: time.sleep(0.001)
a = threading.Thread(target=attack); a.start(); a.join(); t.join()
proc.terminate(); proc.wait()
gaps = [(times[i] - times[i-1], times[i]) for i in range(1, len(times))]
before = [g for g, at in gaps if at < bomb["t0"]]
during = [g for g, at in gaps if bomb["t0"] <= at <= bomb["t1"]]
after = [g for g, at in gaps if at > bomb["t1"]]
ms = lambda xs: round(1000 * sum(xs) / len(xs), 1) if xs else None
print(json.dumps({"binary": binary, "n": n, "tokens": len(times),
    "before_ms_per_token": ms(before), "during_ms_per_token": ms(during),
    "during_max_ms": round(1000 * max(during), 1) if during else None, "during_tokens": len(during),
    "after_ms_per_token": ms(after), "bomb_status": bomb["status"], "bomb_seconds": round(bomb["t1"] - bomb["t0"], 3),
    "bomb_message": bomb["message"]}))
