#!/usr/bin/env bash
# tests/gpu/run.sh - build the GPU checks and run them, on a machine that has
# a GPU. Run from anywhere; it works in the repository root.
#
# Why shaped so: GPU time is scarce and remote (a 15-minute device budget,
# minutes of it spent starting the machine), so this is one script that does
# everything in a few minutes, puts every step under `timeout` and the whole
# under one budget (QL_GPU_BUDGET_S) so the summary is always printed, keeps
# each step's full log under build-gpu/gpu-check/ (and a tarball of them in
# $OUT, which the device tool brings back), and ends with a short table that
# is all a reader of a truncated remote log needs; `RESULT: PASS|FAIL` last.
#
# The GPU machine has CUDA, CMake and ninja but none of our Debian packages
# and no network, so the build is -DQL_GPU_CHECKS_ONLY=ON (the CUDA
# libraries and tests/gpu only; cJSON the one dependency), with cJSON from
# .gpu-deps/ that tests/gpu/pack-deps.sh copies here beforehand.
#
# ---- The device-tool calls, in order ------------------------------------------
# Here, first:   tests/gpu/pack-deps.sh            (cJSON only)
#           or:  tests/gpu/pack-deps.sh --model    (cJSON and the model halves)
#
# A. Without the default model (one call; test_cuda_engine skips the part
#    that needs it):
#      run(command="bash tests/gpu/run.sh", carry=[".gpu-deps"], timeout_s=560)
#    (the script's own budget is 480 s; 560 leaves room for its last kill)
#
# B. With the default model (98 MB; a call carries 64 MiB, so two calls, the
#    second at once after the first: the machine stays warm only 30 s after
#    a call, and /tmp/qlserve-model/ and build-gpu/ live only as long as it
#    does). Every check runs in call 1, so call 2 is only the model's part:
#      1. run(command="bash tests/gpu/run.sh --stash-model-part",
#             carry=[".gpu-deps", ".gpu-model-a"], timeout_s=560)
#         stores part a under /tmp/qlserve-model/, builds, runs everything
#         (test_cuda_engine without the default model);
#      2. run(command="bash tests/gpu/run.sh --only test_cuda_engine",
#             carry=[".gpu-deps", ".gpu-model-b"], timeout_s=300)
#         joins a and b into /tmp/qlserve-model/<name>.gguf, checks the sha256
#         pack-deps.sh recorded, and runs test_cuda_engine with
#         QL_DEFAULT_MODEL set (the build is already there: seconds).
#    If the machine went back in between, call 2 says "only part b is here"
#    and rebuilds; skip it then unless the budget allows ~4 more minutes.
# Then give_back() unless another call follows at once. Logs come back as
# gpu-check-logs.tar.gz, summary.txt and bench_cuda.json under files_at.
# Expect: machine start 1-2 min; configure ~20 s; build ~1.5 min for sm_90
# (qt_cuda_matmul.cu is the long pole); tests seconds each; bench_cuda ~1 min.
#
# ---- Options and environment (all optional) --------------------------------------
#   --stash-model-part  copy the carried model half (.gpu-model-a/ or
#                       .gpu-model-b/) to /tmp/qlserve-model/ for a later call
#   --build-only        configure and build, run nothing
#   --only A,B          run only these steps (e.g. test_cuda_engine); the
#                       build is still the whole of tests/gpu
#   QL_GPU_ARCHS        CUDA architectures (-DQLSERVE_CUDA_ARCHITECTURES);
#                       default: the device's compute capability from
#                       nvidia-smi ("90" on an H200), else CMake's default list
#   QL_GPU_JOBS         parallel build jobs (default: all cores)
#   QL_GPU_TARGET       build only this target instead of all of tests/gpu
#   QL_GPU_BUDGET_S     seconds for the whole script (default 480); every
#                       step's timeout is cut to what is left
#   QL_GPU_BENCH_ARGS   arguments for bench_cuda (e.g. "--no-merge")
#   QL_GPU_ALLOW_NO_DEVICE=1  tests that find no device (exit 77) do not make
#                       the result FAIL (for trying this script without a GPU)
#   QL_DEFAULT_MODEL    the default model's GGUF, when it is already there
#
# Each test exits 0 (every check passed), 1 (one failed) or 77 (no usable
# device); its lines beginning `PASS `, `FAIL `, `SKIP ` and `timing ` are
# gathered in the summary. Exit status: 0 when every step passed, 1 otherwise.
set -u

cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
BUILD=build-gpu
LOGS=$BUILD/gpu-check
MODEL_STASH=/tmp/qlserve-model
T_START=$SECONDS
BUDGET=${QL_GPU_BUDGET_S:-480}
TESTS=(test_cuda_dequant test_cuda_matmul test_cuda_ops test_cuda_lora test_cuda_quantfmt
    test_cuda_hybrid test_cuda_gemma4 test_cuda_speculative test_cuda_engine)
# each step's own limit in seconds, before the budget cuts it
declare -A LIMIT=([configure]=120 [build]=300 [test_cuda_dequant]=60 [test_cuda_matmul]=90
    [test_cuda_ops]=90 [test_cuda_lora]=90 [test_cuda_quantfmt]=60 [test_cuda_hybrid]=60
    [test_cuda_gemma4]=60 [test_cuda_speculative]=60 [test_cuda_engine]=150 [bench_cuda]=200)
RESERVE=15 # seconds kept for the summary and the tarball

stash_part=0
build_only=0
only=""
while [ $# -gt 0 ]; do
    arg=$1
    shift
    case $arg in
    --stash-model-part) stash_part=1 ;;
    --build-only) build_only=1 ;;
    --only)
        only=${1:-}
        if [ -z "$only" ]; then
            echo "run.sh: --only needs a comma-separated list of steps" >&2
            exit 1
        fi
        shift
        for t in ${only//,/ }; do
            case " ${TESTS[*]} bench_cuda " in
            *" $t "*) ;;
            *)
                echo "run.sh: --only: no step '$t' (${TESTS[*]} bench_cuda)" >&2
                exit 1
                ;;
            esac
        done
        ;;
    -h | --help)
        sed -n '2,67p' "$0"
        exit 0
        ;;
    *)
        echo "run.sh: unknown argument '$arg' (see --help)" >&2
        exit 1
        ;;
    esac
done

rm -rf "$LOGS"
mkdir -p "$LOGS"
declare -a STEP_NAMES=() STEP_RCS=() STEP_SECS=() STEP_NOTES=()
failed=0

# Copy the logs to $OUT (the device tool returns what is there: at most 8
# files, so one tarball), after every step: a call cut short still returns
# what was done.
save_out() {
    [ -n "${OUT:-}" ] && [ -d "$OUT" ] || return 0
    tar czf "$OUT/gpu-check-logs.tar.gz" -C "$BUILD" gpu-check 2>/dev/null
    [ -f "$LOGS/bench_cuda.json" ] && cp "$LOGS/bench_cuda.json" "$OUT/"
    [ -f "$LOGS/summary.txt" ] && cp "$LOGS/summary.txt" "$OUT/"
    return 0
}

record() { # NAME RC SECONDS NOTE
    STEP_NAMES+=("$1")
    STEP_RCS+=("$2")
    STEP_SECS+=("$3")
    STEP_NOTES+=("$4")
}

# The seconds a step may take: its own limit, cut to what the budget leaves.
step_limit() {
    local own=$1 left=$((BUDGET - (SECONDS - T_START) - RESERVE))
    [ "$left" -lt "$own" ] && own=$left
    echo "$own"
}

# run_step NAME LIMIT COMMAND...: run under timeout with its output line
# buffered, into $LOGS/NAME.log and stdout; STEP_STDOUT, when set, takes the
# command's stdout instead (stderr still goes to the log). Sets $step_rc.
run_step() {
    local name=$1 limit
    limit=$(step_limit "$2")
    shift 2
    if [ "$limit" -lt 5 ]; then
        echo "== $name: skipped, the budget of ${BUDGET}s is spent"
        record "$name" "-" "-" "no time left"
        failed=1
        step_rc=125
        return 125
    fi
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS buf=()
    command -v stdbuf >/dev/null 2>&1 && buf=(stdbuf -oL -eL)
    if [ -n "${STEP_STDOUT:-}" ]; then
        timeout --kill-after=10 "$limit" "${buf[@]}" "$@" 2>&1 1>"$STEP_STDOUT" |
            tee "$LOGS/$name.log"
    else
        timeout --kill-after=10 "$limit" "${buf[@]}" "$@" 2>&1 | tee "$LOGS/$name.log"
    fi
    step_rc=${PIPESTATUS[0]}
    local note=""
    case $step_rc in
    0) note="ok" ;;
    77) note="no usable device" ;;
    124 | 137) note="timed out after ${limit}s" ;;
    *) note="failed" ;;
    esac
    echo "== $name: rc $step_rc ($note) in $((SECONDS - t0))s"
    record "$name" "$step_rc" "$((SECONDS - t0))" "$note"
    if [ "$step_rc" -eq 77 ]; then
        [ "${QL_GPU_ALLOW_NO_DEVICE:-0}" = 1 ] || failed=1
    elif [ "$step_rc" -ne 0 ]; then
        failed=1
    fi
    save_out
    return "$step_rc"
}

# --- the device ---------------------------------------------------------------
if ! command -v nvcc >/dev/null 2>&1; then
    for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
        if [ -x "$d/nvcc" ]; then
            export PATH=$d:$PATH
            break
        fi
    done
fi
echo "== nvcc: $(command -v nvcc || echo 'not found'); cmake: $(cmake --version 2>/dev/null | head -n 1)"
device_line="no nvidia-smi"
if command -v nvidia-smi >/dev/null 2>&1; then
    device_line=$(timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap \
        --format=csv,noheader 2>&1 | head -n 1)
fi
echo "== device: $device_line"
echo "$device_line" >"$LOGS/device.log"
archs=${QL_GPU_ARCHS:-}
if [ -z "$archs" ]; then
    cap=$(echo "$device_line" | awk -F', *' 'NF >= 4 {print $4}' | tr -d '.')
    case $cap in
    [1-9][0-9]) archs=$cap ;;
    esac
fi

# --- the default model: stash a half, or join both ------------------------------
model_note="not carried (test_cuda_engine skips its default-model check)"
if [ "$stash_part" -eq 1 ]; then
    mkdir -p "$MODEL_STASH"
    stashed=""
    for h in a b; do
        if [ -f ".gpu-model-$h/part" ] && [ -f ".gpu-model-$h/SHA256" ]; then
            cp ".gpu-model-$h/part" "$MODEL_STASH/part-$h" &&
                cp ".gpu-model-$h/SHA256" "$MODEL_STASH/SHA256" && stashed="$stashed $h"
        fi
    done
    if [ -n "$stashed" ]; then
        model_note="stashed part(s)$stashed in $MODEL_STASH"
    else
        model_note="--stash-model-part, but no .gpu-model-a/ or .gpu-model-b/ was carried"
    fi
fi
if [ -n "${QL_DEFAULT_MODEL:-}" ]; then
    model_note="QL_DEFAULT_MODEL=$QL_DEFAULT_MODEL (from the environment)"
elif [ "$build_only" -eq 0 ]; then
    sums=""
    for f in .gpu-model-a/SHA256 .gpu-model-b/SHA256 "$MODEL_STASH/SHA256"; do
        [ -f "$f" ] && sums=$f && break
    done
    if [ -n "$sums" ]; then
        want=$(cut -d' ' -f1 "$sums")
        name=$(awk '{print $2}' "$sums")
        joined="$MODEL_STASH/$name"
        part_a="" part_b=""
        for f in .gpu-model-a/part "$MODEL_STASH/part-a"; do
            [ -f "$f" ] && part_a=$f && break
        done
        for f in .gpu-model-b/part "$MODEL_STASH/part-b"; do
            [ -f "$f" ] && part_b=$f && break
        done
        if [ -f "$joined" ] && [ "$(sha256sum "$joined" | cut -d' ' -f1)" = "$want" ]; then
            export QL_DEFAULT_MODEL=$joined
            model_note="$joined (already joined, sha256 ok)"
        elif [ -n "$part_a" ] && [ -n "$part_b" ]; then
            mkdir -p "$MODEL_STASH"
            cat "$part_a" "$part_b" >"$joined.tmp"
            got=$(sha256sum "$joined.tmp" | cut -d' ' -f1)
            if [ "$got" = "$want" ]; then
                mv "$joined.tmp" "$joined"
                export QL_DEFAULT_MODEL=$joined
                model_note="$joined (joined from $part_a and $part_b, sha256 ok)"
            else
                rm -f "$joined.tmp"
                model_note="FAILED: $part_a + $part_b have sha256 $got, not $want"
                failed=1
            fi
        else
            model_note="only part ${part_a:+a}${part_b:+b} is here (the other was not carried, or the machine went back between the calls): test_cuda_engine skips its default-model check"
        fi
    fi
fi
echo "== model: $model_note"

# --- configure and build --------------------------------------------------------------
configure_args=(-S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DQL_GPU_CHECKS_ONLY=ON)
[ -n "$archs" ] && configure_args+=("-DQLSERVE_CUDA_ARCHITECTURES=$archs")
if [ -d .gpu-deps/usr ]; then
    configure_args+=("-DQL_DEPS_PREFIX=$ROOT/.gpu-deps/usr")
    export LD_LIBRARY_PATH="$ROOT/.gpu-deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
generator=""
if command -v ninja >/dev/null 2>&1; then
    generator=Ninja
    configure_args+=(-G Ninja)
fi
# a build folder made with another generator cannot be reused
if [ -f "$BUILD/CMakeCache.txt" ]; then
    old=$(sed -n 's/^CMAKE_GENERATOR:INTERNAL=//p' "$BUILD/CMakeCache.txt")
    if [ "$old" != "${generator:-Unix Makefiles}" ]; then
        echo "== build folder made with '$old': starting it afresh"
        rm -rf "$BUILD/CMakeCache.txt" "$BUILD/CMakeFiles"
    fi
fi
jobs=${QL_GPU_JOBS:-$(nproc)}
build_args=(--build "$BUILD" -j "$jobs")
if [ -n "${QL_GPU_TARGET:-}" ]; then
    build_args+=(--target "$QL_GPU_TARGET")
fi
# keep going past a target that fails: the other tests still get built and run
if [ "$generator" = Ninja ]; then
    build_args+=(-- -k 0)
else
    build_args+=(-- -k)
fi

if run_step configure "${LIMIT[configure]}" cmake "${configure_args[@]}"; then
    run_step build "${LIMIT[build]}" cmake "${build_args[@]}"
else
    record build "-" "-" "not configured"
fi

# --- the checks -----------------------------------------------------------------------
if [ "$build_only" -eq 0 ]; then
    for t in "${TESTS[@]}" bench_cuda; do
        case ",$only," in
        ,, | *",$t,"*) ;;
        *) continue ;;
        esac
        bin=$BUILD/tests/gpu/$t
        if [ ! -x "$bin" ]; then
            echo "== $t: not built ($bin): see $LOGS/build.log"
            record "$t" "-" "-" "not built"
            failed=1
            continue
        fi
        if [ "$t" = bench_cuda ]; then
            # its JSON alone on stdout, into bench_cuda.json; `timing ` lines to the log
            # shellcheck disable=SC2086 # QL_GPU_BENCH_ARGS is a list of words
            STEP_STDOUT=$LOGS/bench_cuda.json run_step bench_cuda "${LIMIT[bench_cuda]}" \
                "$bin" ${QL_GPU_BENCH_ARGS:-}
        else
            run_step "$t" "${LIMIT[$t]}" "$bin"
        fi
    done
fi

# --- the summary ------------------------------------------------------------------------
count() { # PATTERN FILE
    [ -f "$2" ] || {
        echo "-"
        return
    }
    grep -c "$1" "$2"
}

summary() {
    echo
    echo "== tests/gpu/run.sh summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), ${HOSTNAME:-?}, $((SECONDS - T_START))s)"
    echo "device: $device_line"
    echo "archs: ${archs:-CMake default}; model: $model_note"
    printf '%-18s %5s %7s %5s %5s %5s  %s\n' step rc seconds pass fail skip note
    local i name log
    for i in "${!STEP_NAMES[@]}"; do
        name=${STEP_NAMES[$i]}
        log=$LOGS/$name.log
        local p="" f="" s=""
        case $name in
        test_* | bench_*)
            p=$(count '^PASS ' "$log")
            f=$(count '^FAIL ' "$log")
            s=$(count '^SKIP ' "$log")
            ;;
        esac
        printf '%-18s %5s %7s %5s %5s %5s  %s\n' "$name" "${STEP_RCS[$i]}" "${STEP_SECS[$i]}" \
            "$p" "$f" "$s" "${STEP_NOTES[$i]}"
    done
    if [ -f "$LOGS/build.log" ] && grep -qE 'error|FAILED' "$LOGS/build.log"; then
        echo "-- build errors (first 15 lines):"
        grep -E 'error|FAILED' "$LOGS/build.log" | head -n 15
    fi
    for t in "${TESTS[@]}" bench_cuda; do
        [ -f "$LOGS/$t.log" ] || continue
        if grep -q '^FAIL ' "$LOGS/$t.log"; then
            echo "-- $t failures (first 10):"
            grep '^FAIL ' "$LOGS/$t.log" | head -n 10
        fi
        if grep -q '^timing ' "$LOGS/$t.log"; then
            echo "-- $t timing:"
            grep '^timing ' "$LOGS/$t.log"
        fi
    done
    if [ -s "$LOGS/bench_cuda.json" ]; then
        echo "-- bench_cuda JSON:"
        cat "$LOGS/bench_cuda.json"
    fi
    if [ "$build_only" -eq 1 ]; then
        echo "(--build-only: nothing was run)"
    fi
    if [ "$failed" -eq 0 ]; then
        echo "RESULT: PASS"
    else
        echo "RESULT: FAIL"
    fi
}

summary | tee "$LOGS/summary.txt"
save_out
exit "$failed"
