#!/usr/bin/env python3
"""Issue 30, rows 1 and 3: before/after figures on the default model.

usage: requests.py BINARY CASE
CASE: bigstops  - /v1/completions n 64, 8 stop strings of 128,000 bytes, max_tokens 16
      maxstops  - n 64, 8 stop strings of 1,024 bytes (8 KiB, the most allowed), max_tokens 16,
                  10 requests held queued behind a paused engine
      logprobs  - echo, logprobs 20, max_tokens 0, 8 prompts of 1000 ids
Prints JSON: status, seconds, RSS growth (VmRSS and VmHWM) in MiB, the longest /health
round trip meanwhile and the event loop's longest turn (CPU s, from /metrics).
"""
import http.client, json, os, subprocess, sys, tempfile, threading, time, re

MODEL = os.path.expanduser("~/.cache/qlserve/models/SmolLM2-135M-Instruct.Q4_1.gguf")
binary, case = sys.argv[1], sys.argv[2]
port = 18000 + os.getpid() % 1000
log = open(os.path.join(tempfile.gettempdir(), f"qlserve-measure-{case}.log"), "w")
srv = subprocess.Popen([binary, "serve", "--model", MODEL, "--port", str(port), "--threads", "2",
                        "--host", "127.0.0.1"], stdout=log, stderr=log)


def req(method, path, body=None, timeout=600):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request(method, path, body=json.dumps(body) if body is not None else None,
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def status_kib(field):
    for line in open(f"/proc/{srv.pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])


for _ in range(600):
    try:
        if req("GET", "/health")[0] == 200:
            break
    except OSError:
        pass
    time.sleep(0.1)

worst = [0.0]
stop = [False]


def health():
    while not stop[0]:
        t = time.time()
        req("GET", "/health")
        worst[0] = max(worst[0], time.time() - t)
        time.sleep(0.02)


def body_of():
    if case == "bigstops":
        return {"prompt": "Hello", "n": 64, "max_tokens": 16,
                "stop": [chr(ord("a") + i) * 128000 for i in range(8)]}
    if case == "maxstops":
        return {"prompt": "Hello", "n": 64, "max_tokens": 16,
                "stop": [chr(ord("a") + i) * 1024 for i in range(8)]}
    return {"echo": True, "logprobs": 20, "max_tokens": 0,
            "prompt": [[(p * 1000 + i) % 40000 + 100 for i in range(1000)] for p in range(8)]}


rss0, hwm0 = status_kib("VmRSS"), status_kib("VmHWM")
h = threading.Thread(target=health)
h.start()
t0 = time.time()
out = {"binary": binary, "case": case}
if case == "maxstops":
    req("POST", "/admin/engine/pause", {"after_steps": 0})
    results = []
    ths = [threading.Thread(target=lambda: results.append(req("POST", "/v1/completions", body_of())))
           for _ in range(10)]
    for t in ths:
        t.start()
    for _ in range(6000):
        st = json.loads(req("GET", "/admin/engine")[1])
        if st.get("waiting", 0) + (1 if st.get("running", 0) else 0) >= 10:
            break
        time.sleep(0.01)
    out["held_requests"] = 10
    out["rss_growth_mib_while_held"] = round((status_kib("VmRSS") - rss0) / 1024, 1)
    req("POST", "/admin/engine/resume")
    for t in ths:
        t.join()
    out["statuses"] = sorted(r[0] for r in results)
else:
    status, data = req("POST", "/v1/completions", body_of())
    out["status"] = status
    out["answer_bytes"] = len(data)
    out["message"] = data[:200].decode("utf-8", "replace") if status != 200 else None
out["seconds"] = round(time.time() - t0, 2)
stop[0] = True
h.join()
metrics = req("GET", "/metrics")[1].decode()
m = re.search(r"\nqlserve_event_loop_turn_cpu_seconds_max (\S+)", metrics)
out["rss_growth_mib"] = round((status_kib("VmRSS") - rss0) / 1024, 1)
out["peak_rss_growth_mib"] = round((status_kib("VmHWM") - hwm0) / 1024, 1)
out["health_worst_ms"] = round(worst[0] * 1000, 1)
out["loop_turn_max_cpu_s"] = float(m.group(1)) if m else None
srv.terminate()
srv.wait(timeout=60)
print(json.dumps(out))
