#!/usr/bin/env bash
# run.sh - the conformance test: the real clients (the official `openai`
# Python SDK, huggingface_hub's InferenceClient and the official `anthropic`
# SDK, versions pinned in requirements.txt) against a running `qlserve
# serve`, calling every field of the OpenAI, TGI and Anthropic Messages
# surfaces qlserve implements (clients.py).
#
#   tests/conformance/run.sh QLSERVE_BINARY WORKDIR
#
# WORKDIR (ctest passes BUILD/conformance) keeps the virtual environment
# between runs: it is reused while its stamp matches requirements.txt (and
# the Python it was made with), and
# made again (from PyPI, with pip) when not. The model is the tiny random
# Llama the C tests use (tiny_model.py writes it, no dependency), served
# with SmolLM2's real chat template (tests/fixtures/chat_templates) through
# --chat-template; a second server asks for an API key (--api-key-file).
# Each server is stopped with SIGTERM and must exit 0 with no sanitizer
# report in its log.
#
# Exit status: 0 every check passed; 1 a check failed (clients.py prints
# one PASS/FAIL line per call, then a summary) or the setup failed; 77 (the
# test's SKIP_RETURN_CODE) only when the venv must be made and pip cannot
# reach its package index, and 1 then too under QL_REQUIRE_ALL=1 (CI's
# setting: every test runs).
set -uo pipefail

binary=${1:?usage: run.sh QLSERVE_BINARY WORKDIR}
work=${2:?usage: run.sh QLSERVE_BINARY WORKDIR}
here=$(cd "$(dirname "$0")" && pwd)
template=$here/../fixtures/chat_templates/HuggingFaceTB-SmolLM2-135M-Instruct.jinja
python=${PYTHON:-python3}
venv=$work/venv
stamp=$venv/.qlserve-requirements
mkdir -p "$work"
started=$(date +%s)

fail() {
  echo "conformance: $*" >&2
  exit 1
}

command -v "$python" >/dev/null || fail "$python is missing: the conformance test runs the clients in Python 3"

# --- the virtual environment: reused when its stamp is requirements.txt's
# hash and this Python's version, and the clients import
want="$(sha256sum "$here/requirements.txt" | cut -d' ' -f1) $("$python" -V 2>&1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] ||
  ! "$venv/bin/python" -c 'import openai, huggingface_hub, anthropic, jsonschema' 2>/dev/null; then
  # can pip reach its index? (the one case this test skips rather than fails)
  index=${PIP_INDEX_URL:-$("$python" -m pip config get global.index-url 2>/dev/null || true)}
  index=${index:-https://pypi.org/simple}
  if ! reach=$("$python" - "$index" 2>&1 <<'PY'
import sys, urllib.request
url = sys.argv[1].rstrip("/") + "/openai/"
try:
    urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=20)
except Exception as e:
    # an HTTP answer (even 404) means the index is reachable
    import urllib.error
    if isinstance(e, urllib.error.HTTPError):
        sys.exit(0)
    print(e)
    sys.exit(1)
PY
  ); then
    why="pip cannot reach its package index ($index: $reach); the real clients cannot be installed"
    [ "${QL_REQUIRE_ALL:-0}" = 1 ] && fail "FAILED: $why, and QL_REQUIRE_ALL=1 asks that every test run"
    echo "conformance: NOT RUN: $why" >&2
    exit 77
  fi
  rm -rf "$venv"
  "$python" -m venv "$venv" ||
    fail "$python -m venv failed (on Debian the venv module is the python3-venv package)"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
    -r "$here/requirements.txt" || fail "pip install -r $here/requirements.txt failed"
  echo "$want" >"$stamp"
  echo "conformance: made the venv in $(($(date +%s) - started)) s"
else
  echo "conformance: reusing the venv $venv"
fi

# --- the model and the API key
model=$work/tiny-chat
rm -rf "$model"
"$venv/bin/python" "$here/tiny_model.py" "$model" || fail "tiny_model.py failed"
key_file=$work/api-key
echo "conformance-key-$$-$RANDOM" >"$key_file"
chmod 600 "$key_file"

# --- the servers: --port 0, the port read from the log
declare -A pid port
# shellcheck disable=SC2317 # the EXIT trap calls it
stop_all() {
  for p in "${pid[@]}"; do kill -KILL "$p" 2>/dev/null; done
}
trap stop_all EXIT

start() { # start NAME [flags...]: sets pid[NAME] and port[NAME] (START_TEMPLATE: another template)
  local name=$1
  shift
  local log=$work/server-$name.log
  # emptied here, not only by the redirection below, which the background
  # child makes when it gets to run: the loop below must never read the
  # port of a previous run's log
  : >"$log"
  env -u QLSERVE_API_KEY -u QLSERVE_CONFIG "$binary" serve --model "$model" --port 0 \
    --chat-template "${START_TEMPLATE:-$template}" --threads 1 "$@" >"$log" 2>&1 &
  pid[$name]=$!
  local p=""
  for _ in $(seq 1 1000); do
    # the port and the space after it: a line still being written is not read short
    p=$(sed -n 's/.*listening on http:\/\/127\.0\.0\.1:\([0-9][0-9]*\) .*/\1/p' "$log" | head -1)
    [ -n "$p" ] && break
    kill -0 "${pid[$name]}" 2>/dev/null || fail "the $name server exited: $(cat "$log")"
    sleep 0.05
  done
  [ -n "$p" ] || fail "the $name server did not listen: $(cat "$log")"
  local code=""
  for _ in $(seq 1 1200); do
    code=$(PORT=$p "$venv/bin/python" -c '
import os, urllib.request, urllib.error
try:
    print(urllib.request.urlopen("http://127.0.0.1:%s/health" % os.environ["PORT"], timeout=5).status)
except urllib.error.HTTPError as e:
    print(e.code)
except Exception:
    print(0)')
    [ "$code" = 200 ] && break
    kill -0 "${pid[$name]}" 2>/dev/null || fail "the $name server exited: $(cat "$log")"
    sleep 0.05
  done
  [ "$code" = 200 ] ||
    fail "the $name server's /health on port $p never said 200 (last: $code; 0 is no answer): $(cat "$log")"
  port[$name]=$p
}

stop() { # stop NAME: SIGTERM, exit status 0, no sanitizer report
  local name=$1
  local log=$work/server-$name.log
  kill -TERM "${pid[$name]}"
  wait "${pid[$name]}"
  local rc=$?
  unset "pid[$name]"
  [ "$rc" = 0 ] || {
    echo "conformance: the $name server exited $rc after SIGTERM: $(tail -20 "$log")" >&2
    return 1
  }
  if grep -q "ERROR: AddressSanitizer\|ERROR: LeakSanitizer\|runtime error:" "$log"; then
    echo "conformance: the $name server's log has a sanitizer report: $(cat "$log")" >&2
    return 1
  fi
}

start open
start keyed --api-key-file "$key_file"
# reasoning kept apart: Qwen3's template marks the model as one that thinks
START_TEMPLATE=$here/../fixtures/chat_templates/Qwen-Qwen3-0.6B.jinja start thinking
echo "conformance: servers on ports ${port[open]} (open), ${port[keyed]} (API key) and" \
  "${port[thinking]} (Qwen3's template), model $model"

# bounded well inside ctest's 300 s, so a hung call still stops the servers
PYTHONDONTWRITEBYTECODE=1 timeout 150 "$venv/bin/python" "$here/clients.py" \
  --base "http://127.0.0.1:${port[open]}" --keyed "http://127.0.0.1:${port[keyed]}" \
  --key "$(cat "$key_file")" --model tiny-chat --thinking "http://127.0.0.1:${port[thinking]}"
status=$?
[ "$status" = 124 ] && echo "conformance: clients.py ran past 150 s" >&2

stop open || status=1
stop keyed || status=1
stop thinking || status=1
echo "conformance: took $(($(date +%s) - started)) s in all"
exit $status
