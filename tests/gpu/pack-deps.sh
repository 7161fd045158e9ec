#!/usr/bin/env bash
# tests/gpu/pack-deps.sh - run HERE (a Debian machine with our build
# dependencies), before a call to the GPU machine: copy what the GPU build
# needs and the GPU image lacks into git-ignored folders of the repository,
# which the device tool then carries (its `carry` list; see tests/gpu/run.sh's
# header for the exact calls).
#
#   .gpu-deps/usr/include/cjson/cJSON.h                  cJSON's header and
#   .gpu-deps/usr/lib/x86_64-linux-gnu/libcjson.so{,.1}  library (real files,
#                                                        no links)
#
# Why cJSON alone: with -DQL_GPU_CHECKS_ONLY=ON the build needs nothing else
# besides CUDA (no libuv, Criterion, llhttp, libyaml). Debian's libcjson.so
# asks only for GLIBC_2.14, so the copy runs on the GPU image's glibc; the
# script checks that and says so if a newer libcjson ever asks for more.
#
# With --model (optional): split the default model (SmolLM2-135M-Instruct,
# Q4_1 GGUF, 98 MB; QL_GPU_MODEL overrides the path) into two halves,
#   .gpu-model-a/part  .gpu-model-a/SHA256
#   .gpu-model-b/part  .gpu-model-b/SHA256
# because one call carries at most 64 MiB. SHA256 is the whole file's
# `sha256sum` line; run.sh joins the halves on the GPU machine and checks it.
#
# Exit status: 0 when everything asked for is in place, 1 otherwise.
set -euo pipefail

cd "$(dirname "$0")/../.."

want_model=0
for arg in "$@"; do
    case $arg in
    --model) want_model=1 ;;
    -h | --help)
        sed -n '2,25p' "$0"
        exit 0
        ;;
    *)
        echo "pack-deps.sh: unknown argument '$arg' (expected --model)" >&2
        exit 1
        ;;
    esac
done

# --- cJSON -------------------------------------------------------------------
CJSON_H=/usr/include/cjson/cJSON.h
LIBDIR=/usr/lib/x86_64-linux-gnu
if [ ! -f "$CJSON_H" ] || [ ! -e "$LIBDIR/libcjson.so.1" ]; then
    echo "pack-deps.sh: cJSON is not installed here ($CJSON_H, $LIBDIR/libcjson.so.1);" \
        "apt-get install libcjson-dev (scripts/install-deps.sh does it)" >&2
    exit 1
fi
DEST=.gpu-deps/usr
rm -rf .gpu-deps
mkdir -p "$DEST/include/cjson" "$DEST/lib/x86_64-linux-gnu"
cp "$CJSON_H" "$DEST/include/cjson/"
# -L: the files themselves. A carried link would point at this machine's
# /usr/lib, which the GPU image does not have.
cp -L "$LIBDIR/libcjson.so.1" "$DEST/lib/x86_64-linux-gnu/libcjson.so.1"
cp -L "$LIBDIR/libcjson.so.1" "$DEST/lib/x86_64-linux-gnu/libcjson.so"
if command -v objdump >/dev/null 2>&1; then
    newest=$(objdump -T "$DEST/lib/x86_64-linux-gnu/libcjson.so.1" |
        grep -o 'GLIBC_[0-9.]*' | sort -u -V | tail -n 1)
    echo "pack-deps.sh: libcjson needs ${newest:-no versioned glibc symbol}"
    case $newest in
    GLIBC_2.[0-9] | GLIBC_2.[0-9].* | GLIBC_2.1[0-9] | GLIBC_2.1[0-9].* | "") ;;
    *) echo "pack-deps.sh: warning: $newest is newer than expected (2.14); check the GPU image's glibc" >&2 ;;
    esac
fi
echo "pack-deps.sh: cJSON -> $(du -sh .gpu-deps | cut -f1) in .gpu-deps/"

# --- the default model, in two halves ------------------------------------------
if [ "$want_model" -eq 1 ]; then
    MODEL=${QL_GPU_MODEL:-${QLSERVE_CACHE:-$HOME/.cache/qlserve}/models/SmolLM2-135M-Instruct.Q4_1.gguf}
    if [ ! -f "$MODEL" ]; then
        echo "pack-deps.sh: no model at $MODEL (scripts/fetch-model.sh fetches it)" >&2
        exit 1
    fi
    rm -rf .gpu-model-a .gpu-model-b
    mkdir -p .gpu-model-a .gpu-model-b
    size=$(stat -c %s "$MODEL")
    half=$(((size + 1) / 2))
    head -c "$half" "$MODEL" >.gpu-model-a/part
    tail -c +"$((half + 1))" "$MODEL" >.gpu-model-b/part
    sum=$(sha256sum "$MODEL" | cut -d' ' -f1)
    name=$(basename "$MODEL")
    for d in .gpu-model-a .gpu-model-b; do
        printf '%s  %s\n' "$sum" "$name" >"$d/SHA256"
    done
    # the halves must give the file back before they travel
    joined=$(cat .gpu-model-a/part .gpu-model-b/part | sha256sum | cut -d' ' -f1)
    if [ "$joined" != "$sum" ]; then
        echo "pack-deps.sh: the two halves do not join back into $MODEL" >&2
        exit 1
    fi
    echo "pack-deps.sh: $name ($size bytes, sha256 $sum) ->" \
        "$(stat -c %s .gpu-model-a/part) + $(stat -c %s .gpu-model-b/part) bytes" \
        "in .gpu-model-a/ and .gpu-model-b/"
fi

# what one call would carry besides the tree: warn before the device tool refuses
tree=$( (git ls-files -z && git ls-files -z --others --exclude-standard) |
    xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
echo "pack-deps.sh: the working tree that travels is $((tree / 1024 / 1024)) MiB" \
    "(a call carries 64 MiB in all, carried folders included)"
