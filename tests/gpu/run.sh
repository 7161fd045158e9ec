#!/usr/bin/env bash
# tests/gpu/run.sh - build qlserve with CUDA and run the GPU checks, on a
# machine that has a GPU. Run from anywhere; it works in the repository root.
#
# Why shaped so: GPU time is scarce and often remote, so this is one script
# that does everything in a few minutes, puts every step under `timeout`
# (a hung driver or a runaway build cannot eat the session), keeps each
# step's full log under build-gpu/gpu-check/, and ends with a short table
# that is all a reader of a truncated remote log needs.
#
# Environment (all optional):
#   QL_GPU_TARGET   build only this target (e.g. test_cuda_dequant) instead
#                   of the whole project
#   QL_GPU_ARCHS    CUDA architectures, e.g. "90" to build for the H200 only
#                   (passed as -DQLSERVE_CUDA_ARCHITECTURES)
#   QL_GPU_JOBS     parallel build jobs (default: all cores)
#
# Exit status: 0 when every step passed, 1 otherwise.
set -u

cd "$(dirname "$0")/../.." || exit 1
BUILD=build-gpu
LOGS=$BUILD/gpu-check
mkdir -p "$LOGS"

declare -a STEP_NAMES STEP_RCS STEP_SECS
failed=0

# run_step NAME TIMEOUT_S COMMAND...: run under timeout, log to $LOGS/NAME.log
# and to stdout, record rc and seconds.
run_step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 124 ] && echo "== $name: timed out after ${limit}s"
    STEP_NAMES+=("$name")
    STEP_RCS+=("$rc")
    STEP_SECS+=("$((SECONDS - t0))")
    [ "$rc" -ne 0 ] && failed=1
    return "$rc"
}

skip_step() {
    STEP_NAMES+=("$1")
    STEP_RCS+=("-")
    STEP_SECS+=("-")
}

configure_args=(-S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release)
[ -n "${QL_GPU_ARCHS:-}" ] && configure_args+=("-DQLSERVE_CUDA_ARCHITECTURES=${QL_GPU_ARCHS}")
build_args=(--build "$BUILD" -j "${QL_GPU_JOBS:-$(nproc)}")
[ -n "${QL_GPU_TARGET:-}" ] && build_args+=(--target "$QL_GPU_TARGET")

if command -v nvidia-smi >/dev/null 2>&1; then
    run_step device 30 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap \
        --format=csv,noheader
else
    echo "== device: nvidia-smi not found"
    skip_step device
fi

if run_step configure 300 cmake "${configure_args[@]}"; then
    run_step build 480 cmake "${build_args[@]}"
else
    skip_step build
fi

TEST=$BUILD/tests/gpu/test_cuda_dequant
if [ ! -x "$TEST" ]; then
    # The top-level CMakeLists may place it elsewhere; take what is there.
    found=$(find "$BUILD" -type f -name test_cuda_dequant -perm -u+x 2>/dev/null | head -n 1)
    [ -n "$found" ] && TEST=$found
fi
if [ -x "$TEST" ]; then
    run_step test_cuda_dequant 240 "$TEST"
else
    echo "== test_cuda_dequant: not built (expected $BUILD/tests/gpu/test_cuda_dequant)."
    cuda_line=$(grep -E '^CMAKE_CUDA_COMPILER:' "$BUILD/CMakeCache.txt" 2>/dev/null)
    echo "   Was CUDA enabled? ${cuda_line:-no CMAKE_CUDA_COMPILER in $BUILD/CMakeCache.txt}"
    skip_step test_cuda_dequant
    failed=1
fi

echo
echo "== tests/gpu/run.sh summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(hostname))"
printf '%-20s %5s %8s  %s\n' step rc seconds log
for i in "${!STEP_NAMES[@]}"; do
    printf '%-20s %5s %8s  %s\n' "${STEP_NAMES[$i]}" "${STEP_RCS[$i]}" "${STEP_SECS[$i]}" \
        "$LOGS/${STEP_NAMES[$i]}.log"
done
if [ -f "$LOGS/test_cuda_dequant.log" ]; then
    grep -E '^cuda: ' "$LOGS/test_cuda_dequant.log"
    grep -E 'FAIL' "$LOGS/test_cuda_dequant.log" | grep -v '^FAIL:' | head -n 10
    grep -E '^timing ' "$LOGS/test_cuda_dequant.log"
    grep -E '^(PASS|FAIL|SKIP)' "$LOGS/test_cuda_dequant.log"
fi
if [ "$failed" -eq 0 ]; then
    echo "RESULT: PASS"
else
    echo "RESULT: FAIL"
fi
exit "$failed"
