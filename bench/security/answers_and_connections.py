#!/usr/bin/env python3
"""Issue 30: /tokenize answers, idle connections and obs-fold against one binary.

usage: answers_and_connections.py BINARY tokenize|idle|fold (default model)."""
import json, sys, time

from served import HOST, Served

binary = sys.argv[1]
srv = Served(binary)
req, get, rss, turn_max = srv.request, srv.get, srv.rss_mib, srv.turn_max
def health_ms(src="127.0.0.1"):
    t0 = time.time(); r = get("/health", src); return (time.time() - t0) * 1000, r.split(b"\r\n")[0].decode()
mode = sys.argv[2]
out = {"binary": binary, "mode": mode}
if mode == "tokenize":
    body = json.dumps({"inputs": "\ue000" * 333333}, ensure_ascii=False).encode()
    head = b"POST /tokenize HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    out["rss_before_mib"] = rss()
    t0 = time.time(); r = req(head + body); out["one_s"] = round(time.time() - t0, 2)
    out["one_status"] = r.split(b"\r\n")[0].decode(); out["one_answer_bytes"] = len(r)
    out["loop_turn_max_s"] = turn_max()
    n = int(sys.argv[3])
    socks = []
    for i in range(n):
        s = srv.connect(); s.sendall(head.replace(b"Connection: close\r\n", b"") + body); socks.append(s)
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
    socks = [srv.connect() for _ in range(256)]
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
    raw = b"POST /tokenize HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\nConnection: close\r\nTransfer-Encoding:\r\n chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(b), b)
    r = req(raw); out["folded_te"] = r.split(b"\r\n")[0].decode() + " " + r.split(b"\r\n\r\n", 1)[1][:120].decode()
print(json.dumps(out))
srv.stop()
