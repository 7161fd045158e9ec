# bench/lib.sh - what the benchmark scripts share; sourced, with $here the repository root.

# bench_binary NAME: the path of the built benchmark NAME, from $BUILD when set, else build/,
# else build-cpu/; a failure naming the CMake target when none of them has it.
bench_binary() {
    local name="$1" build="${BUILD:-}"
    if [ -z "$build" ]; then
        build="$here/build"
        [ -x "$build/$name" ] || build="$here/build-cpu"
    fi
    if [ ! -x "$build/$name" ]; then
        echo "$(basename "$0"): no $build/$name (cmake --build BUILD --target $name)" >&2
        return 1
    fi
    echo "$build/$name"
}
