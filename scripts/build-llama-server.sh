#!/usr/bin/env bash
# build-llama-server.sh - the benchmark's peer: llama.cpp's llama-server,
# with llama-bench and llama-quantize, built from the llama.cpp sources the
# llama-cpp-python sdist on PyPI vendors (the llama.cpp a Python user gets
# with `pip install llama-cpp-python`), and the llama.cpp commit it is.
#
#   scripts/build-llama-server.sh             prints the path of llama-server
#   scripts/build-llama-server.sh --commit    prints the llama.cpp commit
#   scripts/build-llama-server.sh --quantize  prints the path of llama-quantize
#
# Built once into the cache, $QLSERVE_CACHE/llama.cpp-VERSION (default
# ~/.cache/qlserve/llama.cpp-0.3.36): bin/llama-server, bin/llama-bench,
# bin/llama-batched-bench (decode of N parallel sequences, what bench/moe.sh
# compares at batch 8 and 32), bin/llama-quantize (static, so they run from
# there) and `commit`. Later calls find them and build nothing. The build
# (CMake targets llama-server llama-bench llama-batched-bench llama-quantize,
# Release, -DLLAMA_CURL=OFF,
# GGML_NATIVE on, no tests) takes 20-30 minutes on 2 cores.
#
# --quantize builds only llama-quantize when it is missing (what
# scripts/fetch-kquant-models.sh needs; CI runs it): the one CMake target,
# without the server, GGML_NATIVE off (the binary runs on any x86-64 that
# shares the cache) and -O1, since what it writes does not depend on its
# speed: the files it makes are byte for byte those of an -O3 build (Q4_K_M
# and IQ4_XS of the default model compared), and the build takes 3 min 35 s
# on 2 quiet cores where -O3 takes 6 min 47 s. A later call without
# --quantize still builds all three, at -O3.
#
# A build made elsewhere is used as it is, and nothing is built:
#   LLAMA_CPP_BUILD=DIR   a CMake build folder of that vendor/llama.cpp
#                         (DIR/bin/llama-server); its commit is read from the
#                         sources CMakeCache.txt names
#   LLAMA_SERVER=PATH     a llama-server binary; its commit from --version
# LLAMA_CPP_COMMIT=HASH overrides the commit reported for either.
#
# The commit: the sdist carries vendor/llama.cpp's git metadata, so `git
# rev-parse HEAD` there; without git, the sdist's CHANGELOG.md, whose newest
# "update llama.cpp to ggml-org/llama.cpp@HASH" line names it (0.3.36:
# 0c1e57098).
set -euo pipefail
cd "$(dirname "$0")/.."

version=0.3.36
cache=${QLSERVE_CACHE:-$HOME/.cache/qlserve}
prefix=$cache/llama.cpp-$version
want=server
case "${1:-}" in
  "") ;;
  --commit) want=commit ;;
  --quantize) want=quantize ;;
  *) echo "build-llama-server: unknown argument '$1' (usage: build-llama-server.sh [--commit|--quantize])" >&2; exit 2 ;;
esac

# The commit of the llama.cpp sources in $1 (vendor/llama.cpp of the sdist).
commit_of_sources() {
  local src=$1 c=""
  if command -v git >/dev/null; then
    c=$(git -C "$src" rev-parse HEAD 2>/dev/null || true)
  fi
  if [ -z "$c" ] && [ -f "$src/../../CHANGELOG.md" ]; then
    c=$(sed -n 's/.*update llama\.cpp to ggml-org\/llama\.cpp@\([0-9a-f]\{7,40\}\).*/\1/p' \
      "$src/../../CHANGELOG.md" | head -1)
  fi
  echo "${c:-unknown}"
}

# The commit a llama-server binary says it was built from: "version: 0.5.0-dev
# (build 1, commit HASH)", or "version: N (HASH)" in older ones.
commit_of_binary() {
  local c
  c=$("$1" --version 2>&1 | sed -n -e 's/^version: .*commit \([0-9a-f]*\)).*/\1/p' \
    -e 's/^version: [0-9]* (\([0-9a-f]*\)).*/\1/p' | head -1)
  echo "${c:-unknown}"
}

# Download the sdist into a fresh folder and echo its vendor/llama.cpp (the
# caller's EXIT trap removes the folder, $work).
download_sources() {
  command -v python3 >/dev/null || { echo "build-llama-server: python3 (with pip) is needed to download the llama-cpp-python sdist" >&2; exit 1; }
  command -v cmake >/dev/null || { echo "build-llama-server: cmake is needed (scripts/install-deps.sh)" >&2; exit 1; }
  echo "build-llama-server: downloading the llama-cpp-python $version sdist from PyPI" >&2
  python3 -m pip download --quiet --no-binary :all: --no-deps --disable-pip-version-check \
    "llama-cpp-python==$version" -d "$work" >&2
  tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
  local src=$work/llama_cpp_python-$version/vendor/llama.cpp
  [ -f "$src/CMakeLists.txt" ] || { echo "build-llama-server: the sdist has no vendor/llama.cpp/CMakeLists.txt" >&2; exit 1; }
  echo "$src"
}

# Copy the built binaries named in $@ into $prefix/bin, and the commit of
# the sources $src beside them, each through a .tmp so a reader never finds
# half a file.
install_built() {
  mkdir -p "$prefix/bin"
  for b in "$@"; do
    cp "$work/build/bin/$b" "$prefix/bin/$b.tmp"
    mv "$prefix/bin/$b.tmp" "$prefix/bin/$b"
  done
  commit_of_sources "$src" >"$prefix/commit.tmp"
  mv "$prefix/commit.tmp" "$prefix/commit"
}

if [ "$want" = quantize ]; then
  # a build named by the caller, when it has llama-quantize; else the cache's
  for q in ${LLAMA_CPP_BUILD:+"$LLAMA_CPP_BUILD/bin/llama-quantize"} \
           ${LLAMA_SERVER:+"$(dirname "$LLAMA_SERVER")/llama-quantize"}; do
    [ -x "$q" ] && { echo "$q"; exit 0; }
  done
  quantize=$prefix/bin/llama-quantize
  if [ ! -x "$quantize" ] || [ ! -s "$prefix/commit" ]; then
    work=$(mktemp -d "${TMPDIR:-/tmp}/llama-src.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    src=$(download_sources)
    echo "build-llama-server: building llama-quantize alone (about 4 minutes on 2 cores)" >&2
    cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
      "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG" "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG" \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF >&2
    cmake --build "$work/build" -j "$(nproc 2>/dev/null || echo 2)" --target llama-quantize >&2
    install_built llama-quantize
  fi
  echo "$quantize"
  exit 0
fi

if [ -n "${LLAMA_SERVER:-}" ]; then
  [ -x "$LLAMA_SERVER" ] || { echo "build-llama-server: LLAMA_SERVER=$LLAMA_SERVER is not an executable file" >&2; exit 1; }
  server=$LLAMA_SERVER
  commit=${LLAMA_CPP_COMMIT:-$(commit_of_binary "$server")}
elif [ -n "${LLAMA_CPP_BUILD:-}" ]; then
  server=$LLAMA_CPP_BUILD/bin/llama-server
  [ -x "$server" ] || { echo "build-llama-server: LLAMA_CPP_BUILD=$LLAMA_CPP_BUILD has no bin/llama-server (build the CMake target llama-server there)" >&2; exit 1; }
  src=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$LLAMA_CPP_BUILD/CMakeCache.txt" 2>/dev/null || true)
  commit=${LLAMA_CPP_COMMIT:-$([ -n "$src" ] && commit_of_sources "$src" || commit_of_binary "$server")}
else
  server=$prefix/bin/llama-server
  if [ ! -x "$server" ] || [ ! -x "$prefix/bin/llama-bench" ] || [ ! -x "$prefix/bin/llama-quantize" ] ||
     [ ! -x "$prefix/bin/llama-batched-bench" ] || [ ! -s "$prefix/commit" ]; then
    work=$(mktemp -d "${TMPDIR:-/tmp}/llama-src.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    src=$(download_sources)
    echo "build-llama-server: building llama-server, llama-bench, llama-batched-bench and llama-quantize (20-30 minutes on 2 cores)" >&2
    cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
      -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF >&2
    cmake --build "$work/build" -j "$(nproc 2>/dev/null || echo 2)" \
      --target llama-server llama-bench llama-batched-bench llama-quantize >&2
    install_built llama-server llama-bench llama-batched-bench llama-quantize
  fi
  commit=${LLAMA_CPP_COMMIT:-$(cat "$prefix/commit")}
fi

if [ "$want" = commit ]; then
  echo "$commit"
else
  echo "$server"
fi
