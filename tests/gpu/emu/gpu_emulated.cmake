# tests/gpu/emu/gpu_emulated.cmake - registers `gpu_emulated`, the GPU tests
# run on the CPU under the host emulator (tests/gpu/emu/run.sh), with CTest.
#
# Included from the top-level CMakeLists.txt after qlruntime, qlkernels and
# qladapters are defined:
#   include(tests/gpu/emu/gpu_emulated.cmake)
# It does nothing unless the CUDA backend is built (QL_HAVE_CUDA), because
# the emulated run swaps the runtime library's backend_cuda.c.o, which only a
# CUDA build has. The libraries are built before the tests run; run.sh
# compiles the transformed kernels and the tests itself (about 50 s on two
# cores) and runs them (about 2 minutes on two idle cores), so the timeout
# leaves room for a slower CI machine: 900 s since the nine whole-block GGUF
# kinds joined the tests (551 s measured for the whole run alone, on two
# cores shared at a load of 6 to 8; it passed 600 s there only alone), and
# 1800 s since a run beside five other builds (load 10 on two cores) took
# past 900 s where CI's quiet run takes 334 s: the timeout guards against a
# hang, not a slow machine. Needs perl and g++, which every Debian base
# and every CUDA build machine has.
# No SKIP_RETURN_CODE: run.sh exits 0 or 1 (2 for a bad argument) and
# never 77; a GPU test's own 77 ("no usable device": the emulator always
# offers one) is counted there as a failure, so nothing here can skip.
if(QL_HAVE_CUDA AND NOT QL_GPU_CHECKS_ONLY)
  find_program(QL_PERL perl)
  if(QL_PERL)
    add_test(NAME gpu_emulated
             COMMAND ${CMAKE_CURRENT_LIST_DIR}/run.sh -B ${CMAKE_BINARY_DIR} --no-lib-build
                     test_cuda_ops test_cuda_engine test_cuda_matmul test_cuda_lora
                     test_cuda_dequant)
    set_tests_properties(gpu_emulated PROPERTIES
                         TIMEOUT 1800
                         RESOURCE_LOCK gpu_emu_folder
                         LABELS "gpu;emulated;slow")
    # The checkpoint formats (FP8, GPTQ, AWQ, compressed-tensors;
    # tests/gpu/test_cuda_quantfmt.c) and the 2026 families' layers on the
    # CUDA backend (Qwen3.5's Gated DeltaNet, the output gate, partial
    # rotary: tests/gpu/test_cuda_hybrid.c; Gemma 4's per-layer inputs,
    # keys as values, MoE block and full layers' own head size:
    # tests/gpu/test_cuda_gemma4.c) and speculative decoding's verification
    # and rollback on the device (tests/gpu/test_cuda_speculative.c: the
    # engine over the tiny Qwen3, seconds) in a run of their own, so the
    # run above keeps its time: a minute or two on two idle cores, most of
    # it compiling the kernels again (once for the four). Both runs write
    # BUILD/gpu-emu/, hence the lock.
    add_test(NAME gpu_emulated_models
             COMMAND ${CMAKE_CURRENT_LIST_DIR}/run.sh -B ${CMAKE_BINARY_DIR} --no-lib-build
                     test_cuda_quantfmt test_cuda_hybrid test_cuda_gemma4
                     test_cuda_speculative)
    set_tests_properties(gpu_emulated_models PROPERTIES
                         TIMEOUT 1200
                         RESOURCE_LOCK gpu_emu_folder
                         LABELS "gpu;emulated")
  else()
    message(STATUS "qlserve: no perl, so no gpu_emulated test")
  endif()
endif()
