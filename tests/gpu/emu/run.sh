#!/usr/bin/env bash
# tests/gpu/emu/run.sh - build every kernels/cuda/*.cu and the GPU tests
# against the host emulator of a CUDA device (tests/gpu/emu/) and run the
# tests on the CPU, with QL_GPU_EMULATED=1 (the tests then skip their timing
# lines and their largest shapes).
#
# Why shaped so: no GPU is at hand in most sessions, and GPU time is scarce
# when there is one; this finds the bugs a device would show as wrong
# numbers, out-of-bounds accesses, divergent barriers or bad launch
# configurations before anyone spends device time. The .cu files stay the
# one source: cu2cpp.pl rewrites each mechanically into host C++. The CPU
# libraries come from a normal CMake build folder configured with the CUDA
# backend (their backend_cuda.c.o, built against the real CUDA headers, is
# swapped for one built against the emulator's).
#
# kernels/cuda/*.c (the table of kinds) compile as they are, with gcc.
# Usage: tests/gpu/emu/run.sh [-B BUILD_DIR] [--no-lib-build] [--reverse] [TEST...]
#   -B DIR          the CMake build folder (default: build); it must be
#                   configured with the CUDA backend (QL_HAVE_CUDA)
#   --no-lib-build  do not run `cmake --build` for qlkernels, the engine's
#                   modules, qladapters (ctest uses this: the libraries are built)
#   --reverse       QL_EMU_REVERSE=1: blocks and threads run in reverse order
#   TEST            test_cuda_dequant test_cuda_matmul test_cuda_ops
#                   test_cuda_lora test_cuda_quantfmt test_cuda_hybrid
#                   test_cuda_gemma4 test_cuda_engine test_cuda_speculative
#                   (default: all)
# Environment: QL_EMU_JOBS (parallel compiles and tests; default nproc),
#   QL_EMU_TIMEOUT (seconds per test, default 1200), QL_EMU_OPT (default -O2).
# Output: objects, binaries and logs under BUILD_DIR/gpu-emu/; a table at the
# end and `RESULT: PASS|FAIL`. Exit status 0 when every test passed.
set -u
cd "$(dirname "$0")/../../.." || exit 1
ROOT=$PWD
BUILD=build
build_libs=1
# longest first, so the two cores finish together
ALL=(test_cuda_ops test_cuda_engine test_cuda_matmul test_cuda_lora test_cuda_quantfmt
    test_cuda_hybrid test_cuda_gemma4 test_cuda_speculative test_cuda_dequant)
TESTS=()
while [ $# -gt 0 ]; do
    case $1 in
    -B)
        BUILD=$2
        shift 2
        ;;
    --no-lib-build)
        build_libs=0
        shift
        ;;
    --reverse)
        export QL_EMU_REVERSE=1
        shift
        ;;
    -h | --help)
        sed -n '2,30p' "$0"
        exit 0
        ;;
    test_cuda_*)
        TESTS+=("$1")
        shift
        ;;
    *)
        echo "emu/run.sh: unknown argument '$1'" >&2
        exit 2
        ;;
    esac
done
[ ${#TESTS[@]} -eq 0 ] && TESTS=("${ALL[@]}")
case $BUILD in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac
OUTD=$BUILD/gpu-emu
EMU=$ROOT/tests/gpu/emu
JOBS=${QL_EMU_JOBS:-$(nproc)}
OPT=${QL_EMU_OPT:--O2}
TIMEOUT=${QL_EMU_TIMEOUT:-1200}
mkdir -p "$OUTD/obj" "$OUTD/logs"
T0=$SECONDS

die() {
    echo "emu/run.sh: $*" >&2
    echo "RESULT: FAIL"
    exit 1
}

[ -f "$BUILD/CMakeCache.txt" ] || die "$BUILD is not a CMake build folder (-B DIR)"
if [ "$build_libs" -eq 1 ]; then
    echo "== building qlkernels, the engine's modules and qladapters in $BUILD"
    cmake --build "$BUILD" -j "$JOBS" --target qlkernels qlscheduler qladapters >"$OUTD/logs/libs.log" 2>&1 ||
        die "the CPU libraries did not build: see $OUTD/logs/libs.log"
fi
# the CPU libraries the tests link, highest first (the runtime's is swapped
# for the emulated one below)
LIBS=(qladapters qlscheduler qlruntime qlmodel qlgrammar qltokenizer qlmodelfile qlkernels qlbase)
for l in "${LIBS[@]}"; do
    [ -f "$BUILD/lib$l.a" ] || die "$BUILD/lib$l.a is missing"
done
ar t "$BUILD/libqlruntime.a" | grep -qx backend_cuda.c.o ||
    die "$BUILD/libqlruntime.a has no backend_cuda.c.o: configure $BUILD with the CUDA backend (nvcc on PATH)"
# the runtime library without its real-CUDA backend object
cp "$BUILD/libqlruntime.a" "$OUTD/obj/libqlruntime_emu.a" && ar d "$OUTD/obj/libqlruntime_emu.a" backend_cuda.c.o ||
    die "cannot make the emulated runtime library"
ARCHIVES=()
for l in "${LIBS[@]}"; do
    if [ "$l" = qlruntime ]; then ARCHIVES+=("$OUTD/obj/libqlruntime_emu.a"); else ARCHIVES+=("$BUILD/lib$l.a"); fi
done
CJSON_INC=$(pkg-config --cflags libcjson 2>/dev/null || echo "-isystem /usr/include/cjson")
CJSON_LIB=$(pkg-config --libs libcjson 2>/dev/null || echo "-lcjson")

INC=(-I"$EMU/include" -I"$ROOT/base" -I"$ROOT/kernels" -I"$ROOT/kernels/internal" -I"$ROOT/kernels/math" -I"$ROOT/kernels/cuda"
     -I"$ROOT/kernels/cuda/internal" -I"$ROOT/modelfile" -I"$ROOT/tokenizer" -I"$ROOT/template"
     -I"$ROOT/engine/model" -I"$ROOT/engine/runtime" -I"$ROOT/engine/scheduler" -I"$ROOT/grammar" -I"$ROOT/adapters"
     -I"$ROOT/tests" -I"$ROOT/bench")
CXXFLAGS=(-std=c++17 "$OPT" -g -ffp-contract=off -U_FORTIFY_SOURCE -D_FORTIFY_SOURCE=0 -Wall -Wno-unused-variable -Wno-subobject-linkage)
CFLAGS=(-std=gnu11 "$OPT" -g -ffp-contract=off -Wall -Wextra -DQL_HAVE_CUDA=1 "-DQL_FIXTURES=\"$ROOT/tests/fixtures\"")

# --- compile: the transformed .cu files, the emulator, the CUDA backend, the tests
compile_one() { # KIND SRC OBJ
    local kind=$1 src=$2 obj=$3 log
    log=$OUTD/logs/compile-$(basename "$obj" .o).log
    case $kind in
    cu)
        perl "$EMU/cu2cpp.pl" "$src" >"${obj%.o}.cpp" 2>"$log" &&
            g++ "${CXXFLAGS[@]}" "${INC[@]}" -DQT_CUDA_ARCHS='"sm_90 (host emulator)"' -c "${obj%.o}.cpp" -o "$obj" >>"$log" 2>&1
        ;;
    cpp) g++ "${CXXFLAGS[@]}" "${INC[@]}" -c "$src" -o "$obj" >"$log" 2>&1 ;;
    c) gcc "${CFLAGS[@]}" "${INC[@]}" $CJSON_INC -c "$src" -o "$obj" >"$log" 2>&1 ;;
    esac
    local rc=$?
    if [ $rc -ne 0 ]; then
        echo "== compile failed: $src (log $log)"
        head -n 30 "$log"
    elif [ -s "$log" ]; then
        echo "-- warnings in $src: $(grep -c 'warning:' "$log") (see $log)"
    fi
    return $rc
}
echo "== compiling under emulation ($JOBS jobs) into $OUTD"
units=()
for f in "$ROOT"/kernels/cuda/*.cu; do units+=("cu $f $OUTD/obj/$(basename "$f" .cu).o"); done
# the table of kinds is C (kernels/cuda/qt_cuda_kinds.c)
for f in "$ROOT"/kernels/cuda/*.c; do units+=("c $f $OUTD/obj/$(basename "$f" .c).o"); done
units+=("cpp $EMU/emu_runtime.cpp $OUTD/obj/emu_runtime.o")
units+=("c $ROOT/engine/runtime/backend_cuda.c $OUTD/obj/backend_cuda.o")
for t in "${TESTS[@]}"; do units+=("c $ROOT/tests/gpu/$t.c $OUTD/obj/$t.o"); done
export -f compile_one
export OUTD EMU OPT ROOT CJSON_INC
compile_failed=0
pids=()
running=0
for u in "${units[@]}"; do
    # shellcheck disable=SC2086 # a unit is three words
    compile_one $u &
    pids+=($!)
    running=$((running + 1))
    if [ "$running" -ge "$JOBS" ]; then
        wait -n || compile_failed=1
        running=$((running - 1))
    fi
done
while [ "$running" -gt 0 ]; do
    wait -n || compile_failed=1
    running=$((running - 1))
done
[ "$compile_failed" -eq 0 ] || die "compilation failed"
KOBJS=()
for f in "$ROOT"/kernels/cuda/*.cu; do KOBJS+=("$OUTD/obj/$(basename "$f" .cu).o"); done
for f in "$ROOT"/kernels/cuda/*.c; do KOBJS+=("$OUTD/obj/$(basename "$f" .c).o"); done
for t in "${TESTS[@]}"; do
    # shellcheck disable=SC2086
    # the archives as one group: they use each other in both directions here
    # (the emulated backend_cuda.o sits outside the runtime's archive)
    g++ -o "$OUTD/$t" "$OUTD/obj/$t.o" "$OUTD/obj/backend_cuda.o" "${KOBJS[@]}" "$OUTD/obj/emu_runtime.o" \
        -Wl,--start-group "${ARCHIVES[@]}" -Wl,--end-group $CJSON_LIB -lm -lpthread >"$OUTD/logs/link-$t.log" 2>&1 ||
        {
            head -n 20 "$OUTD/logs/link-$t.log"
            die "linking $t failed"
        }
done
echo "== built in $((SECONDS - T0))s"

# --- run, JOBS at a time
run_test() { # NAME
    local t=$1 t0=$SECONDS
    QL_GPU_EMULATED=1 timeout --kill-after=10 "$TIMEOUT" "$OUTD/$t" >"$OUTD/logs/$t.log" 2>&1
    echo "$? $((SECONDS - t0))" >"$OUTD/logs/$t.rc"
}
export -f run_test
export TIMEOUT
printf '%s\n' "${TESTS[@]}" | xargs -P "$JOBS" -I{} bash -c 'run_test {}'

failed=0
echo
echo "== tests/gpu/emu/run.sh summary (${QL_EMU_REVERSE:+reverse order, }$((SECONDS - T0))s in all, $JOBS jobs)"
printf '%-18s %5s %7s %5s %5s %5s  %s\n' test rc seconds pass fail skip note
for t in "${TESTS[@]}"; do
    read -r rc secs <"$OUTD/logs/$t.rc"
    log=$OUTD/logs/$t.log
    note=ok
    case $rc in
    0) ;;
    77) note="no usable device" ;;
    124 | 137) note="timed out after ${TIMEOUT}s" ;;
    134) note="emulator fault (abort)" ;;
    *) note=failed ;;
    esac
    [ "$rc" -eq 0 ] || failed=1
    printf '%-18s %5s %7s %5s %5s %5s  %s\n' "$t" "$rc" "$secs" "$(grep -c '^PASS ' "$log")" \
        "$(grep -c '^FAIL ' "$log")" "$(grep -c '^SKIP ' "$log")" "$note"
done
for t in "${TESTS[@]}"; do
    log=$OUTD/logs/$t.log
    if grep -q '^FAIL \|EMU FAULT' "$log"; then
        echo "-- $t (log $log):"
        grep '^FAIL \|EMU FAULT\|^  thread' "$log" | head -n 15
    fi
done
if [ "$failed" -eq 0 ]; then echo "RESULT: PASS"; else echo "RESULT: FAIL"; fi
exit "$failed"
