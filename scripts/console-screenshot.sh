#!/usr/bin/env bash
# console-screenshot.sh - makes the README's picture of the console
# (docs/console.png): the default model (scripts/fetch-model.sh) served
# with a random rank-16 adapter (bench/make_adapter.c), the adapter loaded
# and merged into the model's own Q4_1 through the page, the base and the
# adapter asked the same question side by side, a few seconds of traffic,
# then the whole page captured by Debian's chromium through chromedriver.
# WebDriver is plain HTTP and JSON, so curl drives it; the scripts sent to
# the page hold no double quote, so they need no JSON escaping.
#
#   scripts/console-screenshot.sh BUILD_DIR [OUT.png]
set -euo pipefail

build=${1:?usage: console-screenshot.sh BUILD_DIR [OUT.png]}
out=${2:-docs/console.png}
model=${QLSERVE_MODEL:-$HOME/.cache/qlserve/models/SmolLM2-135M-Instruct.Q4_1.gguf}
port=${PORT:-18089}
driver_port=$((port + 1))
work=$(mktemp -d)
[ -f "$model" ] || { echo "no model at $model (scripts/fetch-model.sh)" >&2; exit 1; }
command -v chromedriver >/dev/null || { echo "chromedriver is missing (apt-get install chromium chromium-driver)" >&2; exit 1; }

mkdir -p "$work/adapters/random-r16"
"$build/make_adapter" --model "$model" --out "$work/adapters/random-r16" --rank 16 \
  --delta-ratio 0.02 >/dev/null
"$build/qlserve" serve --model "$model" --adapter-dir "$work/adapters" --port "$port" \
  --threads 2 --state-file none >"$work/server.log" 2>&1 &
server=$!
chromedriver --port="$driver_port" >/dev/null 2>&1 &
driver=$!
trap 'kill $server $driver 2>/dev/null; rm -rf "$work"' EXIT

for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  sleep 0.1
done
for _ in $(seq 100); do
  curl -sf "http://127.0.0.1:$driver_port/status" >/dev/null && break
  sleep 0.1
done

wd() { curl -sf -X "$1" "http://127.0.0.1:$driver_port$2" -H 'Content-Type: application/json' ${3:+-d "$3"}; }
session=$(wd POST /session '{"capabilities": {"alwaysMatch": {"browserName": "chrome",
  "goog:chromeOptions": {"args": ["--headless=new", "--no-sandbox", "--disable-gpu",
  "--hide-scrollbars", "--force-device-scale-factor=1", "--window-size=1280,900"]}}}}' |
  grep -o '"sessionId":"[^"]*"' | cut -d'"' -f4)
js() { wd POST "/session/$session/execute/sync" "{\"script\": \"$1\", \"args\": []}"; }
until_page() {
  for _ in $(seq 1200); do
    [ "$(js "return !!($1);")" = '{"value":true}' ] && return
    sleep 0.1
  done
  echo "the page never showed: $1" >&2
  exit 1
}
click() { js "document.querySelector('$1').click();" >/dev/null; }
set_value() { js "document.querySelector('$1').value = '$2';" >/dev/null; }

wd POST "/session/$session/url" "{\"url\": \"http://127.0.0.1:$port/console?poll=1000\"}" >/dev/null
until_page "document.body.dataset.auth === 'ok'"
set_value '#load-name' random-r16
set_value '#load-path' random-r16
click '#load-go'
click '#confirm-yes'
until_page "document.querySelector('#adapter-table tr[data-adapter=random-r16]')"
click 'button[data-action=merge][data-adapter=random-r16]'
click '#confirm-yes'
until_page "document.querySelector('#cost-chart svg.delta_retained rect')"
set_value '#chat-prompt' 'What is the capital of France? Answer in one sentence.'
for _ in 1 2 3; do
  click '#chat-send'
  until_page "document.getElementById('pane-0').dataset.state === 'done' && document.getElementById('pane-1').dataset.state === 'done'"
done
until_page "Number(document.getElementById('plots').dataset.samples) >= 12"
wd POST "/session/$session/goog/cdp/execute" '{"cmd": "Page.captureScreenshot",
  "params": {"format": "png", "captureBeyondViewport": true}}' |
  sed 's/.*"data":"\([^"]*\)".*/\1/' | base64 -d >"$out"
wd DELETE "/session/$session" >/dev/null
echo "wrote $out"
