/* tests/gpu/emu/include/cuda_runtime.h - what device code sees under the
 * host emulator: the runtime API (cuda_runtime_api.h), the built-in
 * variables, vector types, warp intrinsics, atomics and the launch entry
 * that tests/gpu/emu/cu2cpp.pl rewrites every `k<<<g, b, s, st>>>(args)`
 * into.
 *
 * Why shaped so: a CUDA thread is a coroutine (emu_runtime.cpp), so device
 * code is plain host C++ and the intrinsics that synchronise (__syncthreads,
 * __syncwarp, the shuffles, __ballot_sync) are real barriers that switch
 * coroutines; atomics need no locking because coroutines never run at the
 * same time. threadIdx/blockIdx are globals the scheduler sets before it
 * resumes a thread. From C this header is only the runtime API. */
#ifndef EMU_CUDA_RUNTIME_H
#define EMU_CUDA_RUNTIME_H
#include "cuda_runtime_api.h"
#ifdef __cplusplus
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __grid_constant__
#define __restrict__ __restrict
#define __align__(n)       alignas(n)
#define __CUDACC__EMULATED 1

struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(16) int4 {
    int x, y, z, w;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(8) int2 {
    int x, y;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w)
{
    return {x, y, z, w};
}
inline int4 make_int4(int x, int y, int z, int w)
{
    return {x, y, z, w};
}
inline float4 make_float4(float x, float y, float z, float w)
{
    return {x, y, z, w};
}
inline float2 make_float2(float x, float y)
{
    return {x, y};
}
inline uint2 make_uint2(unsigned x, unsigned y)
{
    return {x, y};
}
inline int2 make_int2(int x, int y)
{
    return {x, y};
}

extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;
static const int warpSize = 32;

/* ---- barriers and warp exchange (emu_runtime.cpp) ---- */
void __syncthreads();
void __syncwarp(unsigned mask = 0xffffffffu);
/* Every lane publishes 8 bytes and, once the whole warp has arrived, reads
 * lane src's; returns src's bytes. mask is checked against the live lanes. */
uint64_t emu_warp_exchange(unsigned mask, uint64_t mine, int src_lane, int width, bool *src_valid);
unsigned __ballot_sync(unsigned mask, int pred);
int __any_sync(unsigned mask, int pred);
int __all_sync(unsigned mask, int pred);
unsigned emu_lane();

template <class T> inline uint64_t emu_pack(T v)
{
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    uint64_t u = 0;
    memcpy(&u, &v, sizeof v);
    return u;
}
template <class T> inline T emu_unpack(uint64_t u)
{
    T v;
    memcpy(&v, &u, sizeof v);
    return v;
}
template <class T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32)
{
    unsigned lane = emu_lane();
    int base = (int)(lane & ~(unsigned)(width - 1));
    bool ok;
    uint64_t r = emu_warp_exchange(mask, emu_pack(v), base + (src & (width - 1)), width, &ok);
    return emu_unpack<T>(r);
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int lanemask, int width = 32)
{
    unsigned lane = emu_lane();
    int src = (int)(lane ^ (unsigned)lanemask);
    if (src >= (int)((lane & ~(unsigned)(width - 1)) + width))
        src = (int)lane;
    bool ok;
    uint64_t r = emu_warp_exchange(mask, emu_pack(v), src, width, &ok);
    return emu_unpack<T>(r);
}
template <class T> inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32)
{
    unsigned lane = emu_lane(), in_seg = lane & (unsigned)(width - 1);
    int src = in_seg + delta < (unsigned)width ? (int)(lane + delta) : (int)lane;
    bool ok;
    uint64_t r = emu_warp_exchange(mask, emu_pack(v), src, width, &ok);
    return emu_unpack<T>(r);
}
template <class T> inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32)
{
    unsigned lane = emu_lane(), in_seg = lane & (unsigned)(width - 1);
    int src = in_seg >= delta ? (int)(lane - delta) : (int)lane;
    bool ok;
    uint64_t r = emu_warp_exchange(mask, emu_pack(v), src, width, &ok);
    return emu_unpack<T>(r);
}

/* ---- loads, atomics: coroutines never overlap, so plain operations ---- */
template <class T> inline T __ldg(const T *p)
{
    return *p;
}
template <class T> inline T emu_atomic_rmw(T *p, T v, int op)
{
    T old = *p;
    switch (op) {
    case 0: *p = old + v; break;
    case 1: *p = v < old ? v : old; break;
    case 2: *p = v > old ? v : old; break;
    case 3: *p = v; break;
    }
    return old;
}
template <class T> inline T atomicAdd(T *p, T v)
{
    return emu_atomic_rmw(p, v, 0);
}
template <class T> inline T atomicMin(T *p, T v)
{
    return emu_atomic_rmw(p, v, 1);
}
template <class T> inline T atomicMax(T *p, T v)
{
    return emu_atomic_rmw(p, v, 2);
}
template <class T> inline T atomicExch(T *p, T v)
{
    return emu_atomic_rmw(p, v, 3);
}
template <class T> inline T atomicOr(T *p, T v)
{
    T old = *p;
    *p = old | v;
    return old;
}
template <class T> inline T atomicAnd(T *p, T v)
{
    T old = *p;
    *p = old & v;
    return old;
}
template <class T> inline T atomicCAS(T *p, T cmp, T v)
{
    T old = *p;
    if (old == cmp)
        *p = v;
    return old;
}
inline void __threadfence() {}
inline void __threadfence_block() {}

/* ---- bit casts and the float intrinsics (run as the host's arithmetic) ---- */
inline float __int_as_float(int i)
{
    return emu_unpack<float>((uint64_t)(uint32_t)i);
}
inline int __float_as_int(float f)
{
    return (int)(uint32_t)emu_pack(f);
}
inline float __uint_as_float(unsigned i)
{
    return emu_unpack<float>((uint64_t)i);
}
inline unsigned __float_as_uint(float f)
{
    return (unsigned)emu_pack(f);
}
inline float rsqrtf(float x)
{
    return 1.0f / sqrtf(x);
}
inline double rsqrt(double x)
{
    return 1.0 / sqrt(x);
}
inline float __expf(float x)
{
    return expf(x);
}
inline float __logf(float x)
{
    return logf(x);
}
inline float __fdividef(float a, float b)
{
    return a / b;
}
inline float __saturatef(float x)
{
    return x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x;
}
inline int __popc(unsigned x)
{
    return __builtin_popcount(x);
}
inline int __ffs(int x)
{
    return __builtin_ffs(x);
}
inline int __clz(int x)
{
    return x ? __builtin_clz((unsigned)x) : 32;
}

/* ---- launches ---- */
/* Runs fn once per thread of every block of grid, on coroutines; checks the
 * configuration as the device would (block <= 1024 threads, grid.y/z <=
 * 65535, dynamic shared memory <= 48 KiB or the kernel's opt-in <= 227 KiB)
 * and aborts with the kernel's name when it is wrong. */
void emu_launch(const void *kernel, const char *name, const char *where, dim3 grid, dim3 block,
                size_t dyn_smem, cudaStream_t stream, const std::function<void()> &fn);
/* the dynamic shared memory of the running block (extern __shared__) */
void *emu_dynamic_smem();
/* static __shared__ variables register once, so each block starts with them poisoned */
bool emu_shared_register(void *p, size_t n);
#endif
#endif
