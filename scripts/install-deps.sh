#!/usr/bin/env bash
# install-deps.sh - install the Debian packages qlserve builds with, when
# missing. Safe to run again: it installs only what is absent. Needs root
# (or sudo) when something is missing. The CUDA toolkit is not a Debian
# package here: when nvcc is on PATH (or in /usr/local/cuda/bin) the build
# uses it, otherwise it builds the CPU backend only.
#
# The Dockerfile's builder stage runs this same script.
set -euo pipefail

packages=(
  build-essential   # gcc, make, libc headers
  cmake
  pkg-config
  libuv1-dev        # event loop
  libcjson-dev      # JSON
  libcriterion-dev  # tests
  libyaml-dev       # YAML, for tests/test_deploy.c's checks of deploy/
  node-llhttp       # llhttp C sources, compiled by our CMake
  clang             # the fuzz build (libFuzzer)
  libclang-rt-dev   # libFuzzer and the sanitizer runtimes for clang
  clang-format      # ctest clang_format: the checked-in .clang-format holds for every source
  python3           # tests/conformance only: the real OpenAI and HF clients,
  python3-venv      #   installed from PyPI into a venv (the product needs no Python)
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all build dependencies present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root to install ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
