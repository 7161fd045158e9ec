#!/usr/bin/env python3
"""Issue 30: /tokenize answers, idle connections and obs-fold against one binary.

usage: answers_and_connections.py BINARY tokenize|idle|fold (default model)."""
import socket, subprocess, sys, tempfile, time, re, os, json
binary = sys.argv[1]
model = os.path.expanduser("~/.cache/qlserve/models/SmolLM2-135M-Instruct.Q4_1.gguf")
log = open(os.path.join(tempfile.gettempdir(), "qlserve-measure-%d.log" % os.getpid()), "w")
p = subprocess.Popen([binary, "serve", "--model", model, "--port", "0", "--threads", "2"], stdout=log, stderr=subprocess.STDOUT)
port = None
for _ in range(600):
    t = open(log.name).read()
    m = re.search(r"listening on http://127.0.0.1:(\d+)", t)
    if m: port = int(m.group(1)); break
    time.sleep(0.1)
def req(raw, src="127.0.0.1", timeout=120):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(src, 0))
    s.sendall(raw); data = b""
    while True:
        try: b = s.recv(1 << 20)
        except ConnectionResetError: break
        if not b: break
        data += b
    s.close(); return data
def get(path, src="127.0.0.1"):
    return req(b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path.encode(), src)
while True:
    try:
        if get("/health").startswith(b"HTTP/1.1 200"): break
    except Exception: pass
    time.sleep(0.2)
def rss():
    for l in open("/proc/%d/status" % p.pid):
        if l.startswith("VmRSS"): return int(l.split()[1]) // 1024
def turn_max():
    m = re.search(rb"\nqlserve_event_loop_turn_cpu_seconds_max ([0-9.e-]+)", get("/metrics"))
    return float(m.group(1))
def health_ms(src="127.0.0.1"):
    t0 = time.time(); r = get("/health", src); return (time.time() - t0) * 1000, r.split(b"\r\n")[0].decode()
mode = sys.argv[2]
out = {"binary": binary, "mode": mode}
if mode == "tokenize":
    body = json.dumps({"inputs": "\ue000" * 333333}, ensure_ascii=False).encode()
    head = b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    out["rss_before_mib"] = rss()
    t0 = time.time(); r = req(head + body); out["one_s"] = round(time.time() - t0, 2)
    out["one_status"] = r.split(b"\r\n")[0].decode(); out["one_answer_bytes"] = len(r)
    out["loop_turn_max_s"] = turn_max()
    n = int(sys.argv[3])
    socks = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port)); s.sendall(head.replace(b"Connection: close\r\n", b"") + body); socks.append(s)
    worst = 0
    t0 = time.time()
    while time.time() - t0 < float(sys.argv[4]):
        ms, st = health_ms(); worst = max(worst, ms); time.sleep(0.2)
    out["unread_clients"] = n; out["health_worst_ms_during"] = round(worst, 1)
    out["rss_peak_with_unread_mib"] = rss()
    for s in socks: s.close()
    time.sleep(3)
    out["rss_after_close_mib"] = rss(); out["loop_turn_max_s_after"] = turn_max()
elif mode == "idle":
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(256)]
    time.sleep(0.5)
    out["health_from_127.0.0.2_with_256_idle"] = health_ms("127.0.0.2")
    out["health_from_127.0.0.1_with_256_idle"] = health_ms("127.0.0.1")
    time.sleep(11)
    out["health_from_127.0.0.1_after_11s"] = health_ms("127.0.0.1")
    m = get("/metrics")
    out["metrics"] = [l.decode() for l in m.split(b"\n") if b"refused_total{" in l or b"first_byte_timeouts_total " in l]
    for s in socks: s.close()
elif mode == "fold":
    b = b'{"inputs":"hi"}'
    raw = b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\nTransfer-Encoding:\r\n chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(b), b)
    r = req(raw); out["folded_te"] = r.split(b"\r\n")[0].decode() + " " + r.split(b"\r\n\r\n", 1)[1][:120].decode()
print(json.dumps(out))
p.terminate(); p.wait()
