// tests/gpu/emu/emu_runtime.cpp - the host emulator of a CUDA device: the
// thread scheduler behind emu_launch and the warp/block barriers, the
// runtime API (memory, streams, events, pools, device queries) and a
// cuBLASLt that multiplies with a plain loop.
//
// Why shaped so:
//  - A CUDA thread is a coroutine with its own stack, so kernels run as
//    written: locals stay per thread, and __syncthreads / __syncwarp /
//    shuffles / ballots suspend the thread until every live thread of the
//    block (or lane of the warp) has arrived. A barrier that not all
//    threads reach, a shuffle with exited lanes or a mask that leaves out a
//    live lane aborts with the block's coordinates: on a device these are
//    hangs or undefined results.
//  - Coroutines are started once with makecontext and then switched with
//    _setjmp/_longjmp, which skip the signal-mask system calls of
//    swapcontext: a switch costs nanoseconds, and each coroutine is reused
//    for the same thread index of every block.
//  - Blocks run one after another and threads in index order, so races
//    between blocks cannot show; QL_EMU_REVERSE=1 runs blocks and threads in
//    reverse order, which exposes code that depends on an order the device
//    does not promise.
//  - Device memory is host memory from malloc, poisoned with 0xff (a NaN as
//    f32, -1 as an integer) when allocated, and every copy, memset and
//    cuBLASLt operand is checked to lie inside one live allocation. Static
//    __shared__ arrays and dynamic shared memory are poisoned before each
//    block, since on a device they start with whatever the last block left.
//  - Launch limits are the device's: at most 1024 threads a block, grid.y
//    and grid.z at most 65535, dynamic shared memory at most 48 KiB unless
//    cudaFuncSetAttribute raised the kernel's limit (at most 227 KiB).
//  - A fault aborts: the tests that run under it must not hide one as a
//    failed check.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <setjmp.h>
#include <stdarg.h>
#include <ucontext.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

[[noreturn]] static void emu_die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "EMU FAULT: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    fflush(stderr);
    abort();
}

// ---------------------------------------------------------------------------
// the scheduler

namespace {

enum state { READY, WAIT_BLOCK, WAIT_WARP, DONE };

struct thread_slot {
    jmp_buf jb;
    void *sp;  // x86-64: the saved stack pointer (emu_ctx_switch)
    ucontext_t start_ctx;
    char *stack;
    int state;
    uint3 tid;
    unsigned gen;          // warp exchanges this thread has made in this block
    uint64_t publish;      // this thread's value for the warp exchange in progress
    unsigned mask;         // its mask
    bool in_block;         // part of the running block
};

const size_t kStackBytes = 128 * 1024;
std::vector<thread_slot> g_slots;
jmp_buf g_sched;
int g_cur;
int g_n;                                  // threads in the running block
const std::function<void()> *g_fn;
uint64_t g_exchange[2][1024];             // per-parity lane values (double buffered)
const char *g_kernel_name = "?";
bool g_reverse;
std::vector<std::pair<void *, size_t>> g_shared_regions;
alignas(16) unsigned char g_dyn_smem[227 * 1024];
size_t g_dyn_smem_bytes;
std::map<const void *, int> g_func_smem_optin;

#if defined(__x86_64__)
// Switching coroutines on x86-64: push the callee-saved registers, swap
// stack pointers, pop. A few nanoseconds, against glibc longjmp's pointer
// demangling and cleanup walk; other machines use _setjmp/_longjmp.
extern "C" void emu_ctx_switch(void **save_sp, void *load_sp);
asm(".text\n"
    ".globl emu_ctx_switch\n"
    ".type emu_ctx_switch,@function\n"
    "emu_ctx_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size emu_ctx_switch, .-emu_ctx_switch\n");
void *g_sched_sp;
int g_starting;
void coroutine_entry()
{
    int me = g_starting;
    for (;;) {
        emu_ctx_switch(&g_slots[me].sp, g_sched_sp);  // parked; resumed to run one thread of one block
        (*g_fn)();
        g_slots[me].state = DONE;
    }
}
#define EMU_FAST_SWITCH 1
#endif

void coroutine_main(unsigned lo, unsigned hi)
{
    int me = (int)(((uintptr_t)hi << 32) | lo);
    for (;;) {
        if (!_setjmp(g_slots[me].jb))
            _longjmp(g_sched, 1);  // parked; resumed to run one thread of one block
        (*g_fn)();
        g_slots[me].state = DONE;
    }
}

void ensure_slots(int n)
{
    ucontext_t here;
    while ((int)g_slots.size() < n) {
        // grow without moving started coroutines' jmp_bufs: reserve once
        if (g_slots.capacity() < 1024)
            g_slots.reserve(1024);
        int i = (int)g_slots.size();
        g_slots.emplace_back();
        thread_slot &t = g_slots[i];
        t.stack = static_cast<char *>(malloc(kStackBytes));
        if (!t.stack)
            emu_die("no memory for a thread stack");
#ifdef EMU_FAST_SWITCH
        // a stack that emu_ctx_switch "returns" into coroutine_entry from: six
        // zero registers, the entry address, a fake return address; 16-byte
        // aligned so that coroutine_entry starts as if called
        uintptr_t top = ((uintptr_t)t.stack + kStackBytes) & ~(uintptr_t)15;
        void **sp = (void **)(top - 64);
        for (int r = 0; r < 6; r++)
            sp[r] = nullptr;
        sp[6] = (void *)coroutine_entry;
        sp[7] = nullptr;
        g_starting = i;
        emu_ctx_switch(&g_sched_sp, sp);
        continue;
#endif
        getcontext(&t.start_ctx);
        t.start_ctx.uc_stack.ss_sp = t.stack;
        t.start_ctx.uc_stack.ss_size = kStackBytes;
        t.start_ctx.uc_link = nullptr;
        makecontext(&t.start_ctx, (void (*)())coroutine_main, 2, (unsigned)i, 0u);
        // run it up to its first park
        if (!_setjmp(g_sched))
            swapcontext(&here, &t.start_ctx);
    }
}

void resume(int i)
{
    g_cur = i;
    threadIdx = g_slots[i].tid;
#ifdef EMU_FAST_SWITCH
    emu_ctx_switch(&g_sched_sp, g_slots[i].sp);
#else
    if (!_setjmp(g_sched))
        _longjmp(g_slots[i].jb, 1);
#endif
}

void yield_as(int st)
{
    thread_slot &t = g_slots[g_cur];
    t.state = st;
#ifdef EMU_FAST_SWITCH
    emu_ctx_switch(&t.sp, g_sched_sp);
#else
    if (!_setjmp(t.jb))
        _longjmp(g_sched, 1);
#endif
    threadIdx = t.tid;
}

const char *state_name(int s)
{
    return s == READY ? "running" : s == WAIT_BLOCK ? "at __syncthreads" : s == WAIT_WARP ? "at a warp barrier" : "exited";
}

[[noreturn]] void block_fault(const char *what, int warp)
{
    fprintf(stderr, "EMU FAULT: %s in kernel %s, block (%u,%u,%u), warp %d of a %d-thread block\n", what,
            g_kernel_name, blockIdx.x, blockIdx.y, blockIdx.z, warp, g_n);
    int lo = warp >= 0 ? warp * 32 : 0, hi = warp >= 0 ? std::min(g_n, warp * 32 + 32) : g_n;
    for (int i = lo; i < hi && i < lo + 64; i++)
        fprintf(stderr, "  thread %d: %s\n", i, state_name(g_slots[i].state));
    abort();
}

void run_block()
{
    int n = g_n;
    for (int i = 0; i < n; i++) {
        thread_slot &t = g_slots[i];
        t.tid = {(unsigned)(i % blockDim.x), (unsigned)((i / blockDim.x) % blockDim.y),
                 (unsigned)(i / (blockDim.x * blockDim.y))};
        t.state = READY;
        t.gen = 0;
    }
    for (;;) {
        for (int k = 0; k < n; k++) {
            int i = g_reverse ? n - 1 - k : k;
            if (g_slots[i].state == READY)
                resume(i);
        }
        bool all_done = true, progress = false;
        for (int i = 0; i < n; i++)
            all_done = all_done && g_slots[i].state == DONE;
        if (all_done)
            return;
        // a warp whose live lanes all wait at a warp barrier goes on
        for (int w = 0; w * 32 < n; w++) {
            int waiting = 0, done = 0, other = 0, hi = std::min(n, w * 32 + 32);
            for (int i = w * 32; i < hi; i++)
                g_slots[i].state == WAIT_WARP ? waiting++ : g_slots[i].state == DONE ? done++ : other++;
            if (!waiting || other)
                continue;
            unsigned live = 0, mask = g_slots[w * 32].state == WAIT_WARP ? g_slots[w * 32].mask : 0;
            for (int i = w * 32; i < hi; i++) {
                if (g_slots[i].state != WAIT_WARP)
                    continue;
                live |= 1u << (i - w * 32);
                if (!mask)
                    mask = g_slots[i].mask;
                if (g_slots[i].mask != mask)
                    block_fault("lanes of one warp meet at a warp barrier with different masks", w);
            }
            if (done && (mask & ~live))
                block_fault("a warp barrier's mask names lanes that have exited", w);
            if (live & ~mask)
                block_fault("a lane waits at a warp barrier whose mask leaves it out", w);
            if ((mask & ~live) & ((hi - w * 32 == 32) ? 0xffffffffu : ((1u << (hi - w * 32)) - 1)))
                block_fault("a warp barrier's mask names lanes that never arrive", w);
            for (int i = w * 32; i < hi; i++)
                if (g_slots[i].state == WAIT_WARP)
                    g_slots[i].state = READY;
            progress = true;
        }
        if (!progress) {
            int wb = 0, live = 0;
            for (int i = 0; i < n; i++) {
                live += g_slots[i].state != DONE;
                wb += g_slots[i].state == WAIT_BLOCK;
            }
            if (wb == live) {
                for (int i = 0; i < n; i++)
                    if (g_slots[i].state == WAIT_BLOCK)
                        g_slots[i].state = READY;
                progress = true;
            }
        }
        if (!progress)
            block_fault("deadlock: threads wait at barriers that the others never reach", -1);
    }
}

}  // namespace

void __syncthreads() { yield_as(WAIT_BLOCK); }

unsigned emu_lane() { return (unsigned)(g_cur & 31); }

void __syncwarp(unsigned mask)
{
    g_slots[g_cur].mask = mask;
    yield_as(WAIT_WARP);
}

uint64_t emu_warp_exchange(unsigned mask, uint64_t mine, int src_lane, int width, bool *src_valid)
{
    thread_slot &t = g_slots[g_cur];
    if (width <= 0 || width > 32 || (width & (width - 1)))
        emu_die("shuffle width %d in kernel %s", width, g_kernel_name);
    unsigned parity = t.gen++ & 1;
    g_exchange[parity][g_cur] = mine;
    t.mask = mask;
    yield_as(WAIT_WARP);
    int src = (g_cur & ~31) + src_lane;
    *src_valid = src < g_n && (mask >> src_lane & 1);
    if (src >= g_n || !(mask >> src_lane & 1)) {
        // reading an inactive lane is undefined on the device
        fprintf(stderr, "EMU FAULT: kernel %s block (%u,%u,%u) thread %d shuffles from lane %d, outside mask 0x%08x\n",
                g_kernel_name, blockIdx.x, blockIdx.y, blockIdx.z, g_cur, src_lane, mask);
        abort();
    }
    return g_exchange[parity][src];
}

unsigned __ballot_sync(unsigned mask, int pred)
{
    thread_slot &t = g_slots[g_cur];
    unsigned parity = t.gen++ & 1;
    g_exchange[parity][g_cur] = pred != 0;
    t.mask = mask;
    yield_as(WAIT_WARP);
    unsigned r = 0;
    int base = g_cur & ~31;
    for (int l = 0; l < 32 && base + l < g_n; l++)
        if ((mask >> l & 1) && g_exchange[parity][base + l])
            r |= 1u << l;
    return r;
}
int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) == (mask & __ballot_sync(mask, 1)); }

void *emu_dynamic_smem()
{
    if (!g_dyn_smem_bytes)
        emu_die("kernel %s uses extern __shared__ memory but was launched with 0 bytes", g_kernel_name);
    return g_dyn_smem;
}

bool emu_shared_register(void *p, size_t n)
{
    g_shared_regions.push_back({p, n});
    memset(p, 0xff, n);
    return true;
}

static long long g_launches, g_threads_run;
static std::mutex g_launch_lock;

void emu_launch(const void *kernel, const char *name, const char *where, dim3 grid, dim3 block, size_t dyn_smem,
                cudaStream_t, const std::function<void()> &fn)
{
    // kernels run one at a time, as if on one stream: a process may launch from several threads
    std::lock_guard<std::mutex> hold(g_launch_lock);
    unsigned long long nthreads = (unsigned long long)block.x * block.y * block.z;
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535)
        emu_die("%s: launch of %s with grid (%u,%u,%u): the device refuses it (cudaErrorInvalidConfiguration)", where,
                name, grid.x, grid.y, grid.z);
    if (nthreads == 0 || nthreads > 1024 || block.z > 64)
        emu_die("%s: launch of %s with block (%u,%u,%u): more than 1024 threads or an empty block", where, name,
                block.x, block.y, block.z);
    auto opt = g_func_smem_optin.find(kernel);
    size_t limit = opt == g_func_smem_optin.end() ? 48 * 1024 : (size_t)opt->second;
    if (dyn_smem > limit) {
        if (dyn_smem <= 227 * 1024 && opt == g_func_smem_optin.end())
            emu_die("%s: launch of %s with %zu bytes of dynamic shared memory, over 48 KiB without "
                    "cudaFuncSetAttribute(MaxDynamicSharedMemorySize): the device refuses it",
                    where, name, dyn_smem);
        emu_die("%s: launch of %s with %zu bytes of dynamic shared memory, over the limit of %zu", where, name,
                dyn_smem, limit);
    }
    static bool reverse_read;
    if (!reverse_read) {
        const char *r = getenv("QL_EMU_REVERSE");
        g_reverse = r && *r == '1';
        reverse_read = true;
    }
    g_kernel_name = name;
    gridDim = grid;
    blockDim = block;
    g_fn = &fn;
    g_n = (int)nthreads;
    g_dyn_smem_bytes = dyn_smem;
    ensure_slots(g_n);
    g_launches++;
    unsigned long long nblocks = (unsigned long long)grid.x * grid.y * grid.z;
    for (unsigned long long b = 0; b < nblocks; b++) {
        unsigned long long k = g_reverse ? nblocks - 1 - b : b;
        blockIdx = {(unsigned)(k % grid.x), (unsigned)((k / grid.x) % grid.y), (unsigned)(k / ((unsigned long long)grid.x * grid.y))};
        for (auto &r : g_shared_regions)
            memset(r.first, 0xff, r.second);
        if (dyn_smem)
            memset(g_dyn_smem, 0xff, dyn_smem);
        run_block();
        g_threads_run += g_n;
    }
    g_kernel_name = "?";
}

// ---------------------------------------------------------------------------
// memory

namespace {
std::mutex g_mem_lock;
std::map<uintptr_t, size_t> g_allocs;  // device allocations by start
size_t g_allocated;
const size_t kTotalMem = (size_t)141 << 30;  // an H200's 141 GB, as reported
cudaError_t g_last = cudaSuccess;

cudaError_t fail(cudaError_t e)
{
    g_last = e;
    return e;
}

bool find_alloc(const void *p, uintptr_t *start, size_t *len)
{
    auto it = g_allocs.upper_bound((uintptr_t)p);
    if (it == g_allocs.begin())
        return false;
    --it;
    if ((uintptr_t)p >= it->first + (it->second ? it->second : 1))
        return false;
    *start = it->first;
    *len = it->second;
    return true;
}
}  // namespace

// Aborts unless [p, p + n) lies inside one live device allocation.
static void emu_check_device_range(const void *p, size_t n, const char *what)
{
    std::lock_guard<std::mutex> hold(g_mem_lock);
    uintptr_t s;
    size_t len;
    if (!find_alloc(p, &s, &len))
        emu_die("%s: %p (%zu bytes) is not in any live device allocation", what, p, n);
    if ((uintptr_t)p + n > s + len)
        emu_die("%s: %p + %zu bytes runs %zu bytes past the end of its %zu-byte allocation at %p", what, p, n,
                (size_t)((uintptr_t)p + n - (s + len)), len, (void *)s);
}

static bool is_device(const void *p)
{
    std::lock_guard<std::mutex> hold(g_mem_lock);
    uintptr_t s;
    size_t len;
    return find_alloc(p, &s, &len);
}

extern "C" {

cudaError_t cudaMalloc(void **p, size_t n)
{
    if (!p)
        return fail(cudaErrorInvalidValue);
    const char *cap = getenv("QL_EMU_DEVICE_BYTES");
    size_t total = cap ? strtoull(cap, nullptr, 10) : kTotalMem;
    std::lock_guard<std::mutex> hold(g_mem_lock);
    if (g_allocated + n > total) {
        *p = nullptr;
        return fail(cudaErrorMemoryAllocation);
    }
    // 256-byte aligned, as cudaMalloc's are
    void *m = nullptr;
    if (posix_memalign(&m, 256, n ? n : 1) != 0) {
        *p = nullptr;
        return fail(cudaErrorMemoryAllocation);
    }
    memset(m, 0xff, n);
    g_allocs[(uintptr_t)m] = n;
    g_allocated += n;
    *p = m;
    return cudaSuccess;
}

cudaError_t cudaFree(void *p)
{
    if (!p)
        return cudaSuccess;
    std::lock_guard<std::mutex> hold(g_mem_lock);
    auto it = g_allocs.find((uintptr_t)p);
    if (it == g_allocs.end())
        emu_die("cudaFree(%p): not the start of a live device allocation (double free, or a host pointer)", p);
    // poison before giving back: a use after free reads NaNs if the block is reused
    memset(p, 0xfe, it->second);
    g_allocated -= it->second;
    g_allocs.erase(it);
    free(p);
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void **p, size_t n)
{
    *p = malloc(n ? n : 1);
    return *p ? cudaSuccess : fail(cudaErrorMemoryAllocation);
}
cudaError_t cudaFreeHost(void *p)
{
    free(p);
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void *d, const void *s, size_t n, cudaMemcpyKind k)
{
    if (n == 0)
        return cudaSuccess;
    switch (k) {
    case cudaMemcpyHostToDevice:
        emu_check_device_range(d, n, "cudaMemcpy HostToDevice, destination");
        if (is_device(s))
            emu_die("cudaMemcpy HostToDevice from device pointer %p", s);
        break;
    case cudaMemcpyDeviceToHost:
        emu_check_device_range(s, n, "cudaMemcpy DeviceToHost, source");
        if (is_device(d))
            emu_die("cudaMemcpy DeviceToHost into device pointer %p", d);
        break;
    case cudaMemcpyDeviceToDevice:
        emu_check_device_range(d, n, "cudaMemcpy DeviceToDevice, destination");
        emu_check_device_range(s, n, "cudaMemcpy DeviceToDevice, source");
        break;
    case cudaMemcpyDefault:
        if (is_device(d))
            emu_check_device_range(d, n, "cudaMemcpy Default, destination");
        if (is_device(s))
            emu_check_device_range(s, n, "cudaMemcpy Default, source");
        break;
    case cudaMemcpyHostToHost: break;
    default: return fail(cudaErrorInvalidValue);
    }
    memmove(d, s, n);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind k, cudaStream_t)
{
    return cudaMemcpy(d, s, n, k);
}
cudaError_t cudaMemset(void *d, int v, size_t n)
{
    if (n == 0)
        return cudaSuccess;
    emu_check_device_range(d, n, "cudaMemset");
    memset(d, v, n);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t) { return cudaMemset(d, v, n); }
cudaError_t cudaMemGetInfo(size_t *f, size_t *t)
{
    const char *cap = getenv("QL_EMU_DEVICE_BYTES");
    size_t total = cap ? strtoull(cap, nullptr, 10) : kTotalMem;
    std::lock_guard<std::mutex> hold(g_mem_lock);
    *t = total;
    *f = total > g_allocated ? total - g_allocated : 0;
    return cudaSuccess;
}

// ---- device queries: one H200-like sm_90 device ----
cudaError_t cudaGetDeviceCount(int *count)
{
    *count = 1;
    return cudaSuccess;
}
cudaError_t cudaGetDevice(int *dev)
{
    *dev = 0;
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int dev) { return dev == 0 ? cudaSuccess : fail(cudaErrorInvalidDevice); }
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int dev)
{
    if (dev != 0)
        return fail(cudaErrorInvalidDevice);
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "NVIDIA H200 (host emulator)");
    prop->totalGlobalMem = kTotalMem;
    prop->sharedMemPerBlock = 48 * 1024;
    prop->sharedMemPerBlockOptin = 227 * 1024;
    prop->regsPerBlock = 65536;
    prop->warpSize = 32;
    prop->maxThreadsPerBlock = 1024;
    prop->maxThreadsDim[0] = prop->maxThreadsDim[1] = 1024;
    prop->maxThreadsDim[2] = 64;
    prop->maxGridSize[0] = 2147483647;
    prop->maxGridSize[1] = prop->maxGridSize[2] = 65535;
    prop->major = 9;
    prop->minor = 0;
    prop->multiProcessorCount = 132;
    prop->memoryPoolsSupported = 1;
    prop->l2CacheSize = 50 * 1024 * 1024;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int dev)
{
    if (dev != 0)
        return fail(cudaErrorInvalidDevice);
    switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = 48 * 1024; break;
    case cudaDevAttrMultiProcessorCount: *value = 132; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = 227 * 1024; break;
    case cudaDevAttrMemoryPoolsSupported: *value = 1; break;
    default: return fail(cudaErrorInvalidValue);
    }
    return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int *v)
{
    *v = CUDART_VERSION;
    return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int *v)
{
    *v = 12040;
    return cudaSuccess;
}

// ---- streams and events: work is done when it is issued ----
cudaError_t cudaStreamCreate(cudaStream_t *s)
{
    *s = reinterpret_cast<cudaStream_t>(new char[1]);
    return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) { return cudaStreamCreate(s); }
cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    delete[] reinterpret_cast<char *>(s);
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }

struct CUevent_st {
    double ms;
    bool recorded;
};
cudaError_t cudaEventCreate(cudaEvent_t *e)
{
    *e = new CUevent_st{0, false};
    return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned) { return cudaEventCreate(e); }
cudaError_t cudaEventDestroy(cudaEvent_t e)
{
    delete e;
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t)
{
    e->ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
    e->recorded = true;
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b)
{
    if (!a->recorded || !b->recorded)
        return fail(cudaErrorInvalidValue);
    *ms = (float)(b->ms - a->ms);
    return cudaSuccess;
}

// ---- memory pools: plain emulated allocations ----
struct CUmemPoolHandle_st {
    int dev;
};
cudaError_t cudaMemPoolCreate(cudaMemPool_t *pool, const struct cudaMemPoolProps *props)
{
    if (props->allocType != cudaMemAllocationTypePinned || props->location.type != cudaMemLocationTypeDevice ||
        props->location.id != 0)
        return fail(cudaErrorInvalidValue);
    *pool = new CUmemPoolHandle_st{0};
    return cudaSuccess;
}
cudaError_t cudaMemPoolDestroy(cudaMemPool_t pool)
{
    delete pool;
    return cudaSuccess;
}
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t, enum cudaMemPoolAttr attr, void *)
{
    return attr == cudaMemPoolAttrReleaseThreshold || attr == cudaMemPoolReuseFollowEventDependencies
               ? cudaSuccess
               : fail(cudaErrorInvalidValue);
}
cudaError_t cudaMallocFromPoolAsync(void **p, size_t n, cudaMemPool_t pool, cudaStream_t)
{
    if (!pool)
        return fail(cudaErrorInvalidValue);
    return cudaMalloc(p, n);
}
cudaError_t cudaMallocAsync(void **p, size_t n, cudaStream_t) { return cudaMalloc(p, n); }
cudaError_t cudaFreeAsync(void *p, cudaStream_t) { return cudaFree(p); }

cudaError_t cudaGetLastError(void)
{
    cudaError_t e = g_last;
    g_last = cudaSuccess;
    return e;
}
cudaError_t cudaPeekAtLastError(void) { return g_last; }

const char *cudaGetErrorName(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    default: return "cudaErrorUnknown (emulated)";
    }
}
const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    default: return "emulated error";
    }
}

cudaError_t emu_func_set_attribute(const void *func, enum cudaFuncAttribute attr, int value)
{
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || value > 227 * 1024)
        return fail(cudaErrorInvalidValue);
    g_func_smem_optin[func] = value;
    return cudaSuccess;
}

// ---------------------------------------------------------------------------
// cuBLASLt

struct emu_lt_context {
    int magic;
};
struct emu_lt_desc {
    cublasComputeType_t compute;
    cudaDataType scale;
    cublasOperation_t ta, tb;
};
struct emu_lt_layout {
    cudaDataType type;
    uint64_t rows, cols;
    int64_t ld;
};
struct emu_lt_pref {
    uint64_t workspace;
    uint32_t align[4];
};

size_t cublasLtGetVersion(void) { return 120402; }
const char *cublasLtGetStatusName(cublasStatus_t st)
{
    switch (st) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS_<other>";
    }
}
const char *cublasLtGetStatusString(cublasStatus_t st) { return cublasLtGetStatusName(st); }
cublasStatus_t cublasLtCreate(cublasLtHandle_t *h)
{
    *h = new emu_lt_context{0x17};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute, cudaDataType scale)
{
    if (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_FAST_TF32 &&
        compute != CUBLAS_COMPUTE_32F_FAST_16BF && compute != CUBLAS_COMPUTE_32F_FAST_16F)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (scale != CUDA_R_32F)
        return CUBLAS_STATUS_INVALID_VALUE;
    *d = new emu_lt_desc{compute, scale, CUBLAS_OP_N, CUBLAS_OP_N};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d)
{
    delete d;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t size)
{
    if (!d || !buf)
        return CUBLAS_STATUS_INVALID_VALUE;
    switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB: {
        if (size != sizeof(cublasOperation_t))
            return CUBLAS_STATUS_INVALID_VALUE;
        cublasOperation_t op;
        memcpy(&op, buf, sizeof op);
        if (op != CUBLAS_OP_N && op != CUBLAS_OP_T)
            return CUBLAS_STATUS_INVALID_VALUE;
        (attr == CUBLASLT_MATMUL_DESC_TRANSA ? d->ta : d->tb) = op;
        return CUBLAS_STATUS_SUCCESS;
    }
    default: return CUBLAS_STATUS_NOT_SUPPORTED;  // the emulator knows only what qlserve sets
    }
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType type, uint64_t rows, uint64_t cols,
                                          int64_t ld)
{
    if (type != CUDA_R_32F && type != CUDA_R_16BF && type != CUDA_R_16F)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (rows == 0 || cols == 0 || ld < (int64_t)rows)
        return CUBLAS_STATUS_INVALID_VALUE;
    *l = new emu_lt_layout{type, rows, cols, ld};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l)
{
    delete l;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p)
{
    *p = new emu_lt_pref{0, {256, 256, 256, 256}};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p)
{
    delete p;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
                                                    size_t size)
{
    if (!p || !buf)
        return CUBLAS_STATUS_INVALID_VALUE;
    switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
        if (size != sizeof(uint64_t))
            return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&p->workspace, buf, size);
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
        if (size != sizeof(uint32_t))
            return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&p->align[attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES], buf, size);
        return CUBLAS_STATUS_SUCCESS;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
    }
}

static size_t lt_elem(cudaDataType t) { return t == CUDA_R_32F ? 4 : 2; }

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                              cublasLtMatrixLayout_t d, cublasLtMatmulPreference_t pref,
                                              int requested, cublasLtMatmulHeuristicResult_t *results, int *returned)
{
    if (!h || !op || !a || !b || !c || !d || !pref || requested < 1 || !results || !returned)
        return CUBLAS_STATUS_INVALID_VALUE;
    uint64_t am = op->ta == CUBLAS_OP_N ? a->rows : a->cols, ak = op->ta == CUBLAS_OP_N ? a->cols : a->rows;
    uint64_t bk = op->tb == CUBLAS_OP_N ? b->rows : b->cols, bn = op->tb == CUBLAS_OP_N ? b->cols : b->rows;
    if (ak != bk || c->rows != am || c->cols != bn || d->rows != am || d->cols != bn)
        return CUBLAS_STATUS_INVALID_VALUE;
    if (a->type != b->type || c->type != CUDA_R_32F || d->type != CUDA_R_32F)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    // an alignment below one element, or leading dimensions that break a promised alignment: no algorithm
    *returned = 0;
    for (int i = 0; i < 4; i++) {
        size_t el = lt_elem(i == 0 ? a->type : i == 1 ? b->type : CUDA_R_32F);
        if (pref->align[i] < el)
            return CUBLAS_STATUS_SUCCESS;
    }
    memset(results, 0, sizeof *results);
    for (int i = 0; i < 4; i++)
        results->algo.data[i] = pref->align[i];
    results->algo.data[4] = 0x656d75;  // "emu": a matmul checks it got an algorithm from here
    results->workspaceSize = 0;
    results->state = CUBLAS_STATUS_SUCCESS;
    results->wavesCount = 1.0f;
    *returned = 1;
    return CUBLAS_STATUS_SUCCESS;
}

static float lt_load(const void *p, cudaDataType t, uint64_t i)
{
    if (t == CUDA_R_32F)
        return static_cast<const float *>(p)[i];
    uint16_t h = static_cast<const uint16_t *>(p)[i];
    if (t == CUDA_R_16BF) {
        uint32_t u = (uint32_t)h << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    // f16
    uint32_t sign = (uint32_t)(h >> 15) << 31, e = h >> 10 & 31, m = h & 1023, u;
    if (e == 0) {
        float f = ldexpf((float)m, -24);
        return sign ? -f : f;
    }
    u = e == 31 ? sign | 0x7f800000u | (m << 13) : sign | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint64_t lt_span(const emu_lt_layout *l) { return ((l->cols - 1) * (uint64_t)l->ld + l->rows) * lt_elem(l->type); }

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t op, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t a, const void *B, cublasLtMatrixLayout_t b, const void *beta,
                              const void *C, cublasLtMatrixLayout_t c, void *D, cublasLtMatrixLayout_t d,
                              const cublasLtMatmulAlgo_t *algo, void *workspace, size_t workspace_bytes,
                              cudaStream_t)
{
    if (!h || !op || !a || !b || !c || !d || !alpha || !beta || !A || !B || !D)
        return CUBLAS_STATUS_INVALID_VALUE;
    uint64_t m = op->ta == CUBLAS_OP_N ? a->rows : a->cols, k = op->ta == CUBLAS_OP_N ? a->cols : a->rows;
    uint64_t kb = op->tb == CUBLAS_OP_N ? b->rows : b->cols, n = op->tb == CUBLAS_OP_N ? b->cols : b->rows;
    if (k != kb || c->rows != m || c->cols != n || d->rows != m || d->cols != n)
        return CUBLAS_STATUS_INVALID_VALUE;
    if (algo && algo->data[4] != 0x656d75)
        emu_die("cublasLtMatmul with an algorithm that cublasLtMatmulAlgoGetHeuristic did not return");
    const void *ptrs[4] = {A, B, C, D};
    for (int i = 0; algo && i < 4; i++)
        if ((uintptr_t)ptrs[i] % algo->data[i])
            return CUBLAS_STATUS_INVALID_VALUE;  // the plan promised an alignment this pointer lacks
    if (workspace_bytes)
        emu_check_device_range(workspace, workspace_bytes, "cublasLtMatmul workspace");
    emu_check_device_range(A, lt_span(a), "cublasLtMatmul A");
    emu_check_device_range(B, lt_span(b), "cublasLtMatmul B");
    emu_check_device_range(D, lt_span(d), "cublasLtMatmul D");
    float al, be;
    memcpy(&al, alpha, 4);
    memcpy(&be, beta, 4);
    if (be != 0.0f)
        emu_check_device_range(C, lt_span(c), "cublasLtMatmul C");
    std::vector<float> out(m * n);
    for (uint64_t j = 0; j < n; j++)
        for (uint64_t i = 0; i < m; i++) {
            float acc = 0.0f;
            for (uint64_t p = 0; p < k; p++) {
                float x = op->ta == CUBLAS_OP_N ? lt_load(A, a->type, i + p * a->ld) : lt_load(A, a->type, p + i * a->ld);
                float y = op->tb == CUBLAS_OP_N ? lt_load(B, b->type, p + j * b->ld) : lt_load(B, b->type, j + p * b->ld);
                acc += x * y;
            }
            float r = al * acc;
            if (be != 0.0f)
                r += be * static_cast<const float *>(C)[i + j * c->ld];
            out[i + j * m] = r;
        }
    for (uint64_t j = 0; j < n; j++)
        for (uint64_t i = 0; i < m; i++)
            static_cast<float *>(D)[i + j * d->ld] = out[i + j * m];
    return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"

// A line at exit saying how much was emulated, so a slow run can be traced to its launches.
static struct emu_report {
    ~emu_report()
    {
        if (getenv("QL_EMU_STATS"))
            fprintf(stderr, "EMU: %lld launches, %lld threads\n", g_launches, g_threads_run);
    }
} g_report;
