#!/usr/bin/env bash
# test.sh - the one command that runs every test on a fresh machine:
# installs the build dependencies, builds (with the CUDA backend when nvcc
# is found, so CI compiles it), runs the Criterion tests, then builds again
# with AddressSanitizer + UndefinedBehaviorSanitizer and runs the same tests.
# Exits non-zero when any build or test fails.
#
# Last, a clang build fuzzes the safetensors, bitsandbytes and GGUF parsers,
# the chat-template renderer and the HTTP request path with libFuzzer, each for a bounded time
# (QL_FUZZ_SECONDS, default 60).
#
#   scripts/test.sh                       everything
#   QL_SKIP_SANITIZE=1 QL_SKIP_FUZZ=1 scripts/test.sh   the release build only
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
jobs=$(nproc 2>/dev/null || echo 2)

echo "== release build"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$jobs"
(cd build && ctest -V -j "$jobs")

if [ "${QL_SKIP_SANITIZE:-0}" != "1" ]; then
  echo "== address + undefined-behaviour sanitizer build"
  # the CUDA backend is left out: nothing here runs it, and the sanitizers
  # do not instrument device code
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DQL_SANITIZE=ON -DQL_CUDA=OFF
  cmake --build build-asan -j "$jobs"
  (cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
     ctest -V -j "$jobs")
fi
if [ "${QL_SKIP_FUZZ:-0}" != "1" ]; then
  echo "== fuzzing the model-file parsers, the chat-template renderer and the HTTP request path (clang + libFuzzer, bounded)"
  CC=clang cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DQL_FUZZ=ON -DQL_CUDA=OFF
  cmake --build build-fuzz -j "$jobs" --target fuzz_safetensors fuzz_gguf fuzz_template fuzz_http
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
fi
echo "== all tests passed"
