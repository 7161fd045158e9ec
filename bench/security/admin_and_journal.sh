#!/usr/bin/env bash
# admin_and_journal.sh BINARY TAG: the three rows of issue 30 (admin) against one binary
set -u
B=$1; D=${TMPDIR:-/tmp}/qlserve-admin-figures; W=$D/w-$2; rm -rf $W; mkdir -p $W/adapters $W/xdg
M=~/.cache/qlserve/models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -d $D/demo ] || "$(dirname "$B")/make_adapter" --model $M --out $D/demo >/dev/null
cp -r $D/demo $W/adapters/demo
wait_up() { for i in $(seq 100); do P=$(grep -o "listening on http://[0-9.]*:[0-9]*" $1 | grep -o "[0-9]*$"); [ -n "$P" ] && break; sleep 0.1; done; for i in $(seq 300); do [ "$(curl -s -o /dev/null -w '%{http_code}' 127.0.0.1:$P/health)" = 200 ] && return; sleep 0.2; done; }
echo "== row 1: cross-site POST / DNS rebinding (no admin token, --host 127.0.0.1)"
XDG_STATE_HOME=$W/xdg $B serve --model $M --port 0 --threads 2 --kv-mib 16 --adapter-dir $W/adapters --state-file none >$W/log1 2>&1 & pid=$!
wait_up $W/log1
curl -s -o /dev/null -X POST -H 'Content-Type: application/json' 127.0.0.1:$P/admin/adapters -d '{"name":"demo","path":"demo"}'
echo "text/plain + Origin evil: $(curl -s -w ' -> %{http_code}' -X POST -H 'Content-Type: text/plain' -H 'Origin: http://evil.example' --data '{"scale":100}' http://127.0.0.1:$P/admin/adapters/demo/merge | tail -c 220)"
curl -s -o /dev/null -X POST -H 'Content-Type: application/json' 127.0.0.1:$P/admin/adapters/demo/unmerge
echo "Host evil.example:$P: $(curl -s -w ' -> %{http_code}' -X POST -H "Host: evil.example:$P" -H 'Content-Type: text/plain' --data '{"scale":100}' http://127.0.0.1:$P/admin/adapters/demo/merge | tail -c 220)"
curl -s -o /dev/null -X POST -H 'Content-Type: application/json' 127.0.0.1:$P/admin/adapters/demo/unmerge
echo "rebinding, inference: $(curl -s -o /dev/null -w '%{http_code}' -H "Host: evil.example:$P" http://127.0.0.1:$P/v1/models)"
echo "JSON, Host 127.0.0.1:$P: $(curl -s -o /dev/null -w '%{http_code}' -X POST -H 'Content-Type: application/json' --data '{"scale":1}' http://127.0.0.1:$P/admin/adapters/demo/merge)"
kill $pid; wait $pid
echo "== row 1b: --host 0.0.0.0 without a token"
XDG_STATE_HOME=$W/xdg $B serve --model $M --host 0.0.0.0 --port 0 --threads 2 --kv-mib 16 >$W/log1b 2>&1 & pid=$!
wait_up $W/log1b
echo "JSON POST without token: $(curl -s -o /dev/null -w '%{http_code}' -X POST -H 'Content-Type: application/json' 127.0.0.1:$P/admin/engine/resume); token file: $(stat -c '%a %n' $W/xdg/qlserve/admin-token 2>&1 | tail -c 80)"
kill $pid; wait $pid
echo "== row 2: forged journal"
cat > $W/state.json <<'J'
{"version": 1, "adapters": [{"name": "demo", "path": "demo", "scale": 1}, {"name": "\"} 1\nforged_metric 31337\n#", "path": "demo", "scale": 1}], "merged": [{"name": "demo", "scale": 1000000, "into": null, "safe_merge": false}]}
J
XDG_STATE_HOME=$W/xdg $B serve --model $M --port 0 --threads 2 --kv-mib 16 --adapter-dir $W/adapters --state-file $W/state.json >$W/log2 2>&1 & pid=$!
wait_up $W/log2
echo "/metrics lines starting forged_metric: $(curl -s 127.0.0.1:$P/metrics | grep -c '^forged_metric')"
echo "adapters loaded: $(curl -s 127.0.0.1:$P/admin/state | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["adapters_loaded"], "merged", d["merged"], "restore_errors", len(d["restore_errors"]))')"
kill $pid; wait $pid
echo "== row 3: a 600-byte admin token"
head -c 300 /dev/urandom | od -An -tx1 | tr -d ' \n' | head -c 600 > $W/token; chmod 600 $W/token
XDG_STATE_HOME=$W/xdg timeout 60 $B serve --model $M --port 0 --threads 2 --kv-mib 16 --admin-token-file $W/token >$W/log3 2>&1 & pid=$!
for i in $(seq 100); do grep -q "listening\|admin token" $W/log3 && break; sleep 0.1; done
if grep -q listening $W/log3; then wait_up $W/log3; echo "started; right token -> $(curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $(cat $W/token)" 127.0.0.1:$P/admin/state)"; kill $pid; fi
wait $pid; echo "exit $?: $(grep -v '^$' $W/log3 | head -2 | tail -c 250)"
