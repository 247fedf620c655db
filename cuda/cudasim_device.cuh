// cudasim, Device API: everything NVRTC provides implicitly that lowbit kernels call
// (barriers, warp intrinsics, atomics, min/max, float and integer intrinsics, cp.async,
// assert), on top of the runtime of cudasim_block.cuh and cudasim_launch.cuh.
//
// Included only by cudasim.cuh, last. tests/test_cudasim.py holds every intrinsic defined
// here to a use in a kernel.
#pragma once

// ---------------------------------------------------------------------------------------------
// Device API
// ---------------------------------------------------------------------------------------------

// Dynamic shared memory of the running block (see LOWBIT_DYNAMIC_SHARED in cuda/common.cuh).
inline void* lowbit_sim_dynamic_shared() {
    lowbit_sim::Runtime& rt = *lowbit_sim::g_runtime;
    if (rt.smem_size == 0) {
        // Any access would be out of bounds; say so instead of crashing the process.
        lowbit_sim::Block& b = rt.block;
        {
            std::lock_guard<lowbit_sim::SpinLock> lock(b.mu);
            b.fail_locked("the kernel uses dynamic shared memory but was launched with "
                          "shared_mem=0");
        }
        throw lowbit_sim::Abort{};
    }
    return rt.smem;
}

inline void __syncthreads(std::source_location loc = std::source_location::current()) {
    int count = 0, n = 0;
    lowbit_sim::sync_block_impl(loc, 0, count, n);
}
inline int __syncthreads_count(int pred,
                               std::source_location loc = std::source_location::current()) {
    int count = 0, n = 0;
    lowbit_sim::sync_block_impl(loc, pred, count, n);
    return count;
}
inline int __syncthreads_and(int pred,
                             std::source_location loc = std::source_location::current()) {
    int count = 0, n = 0;
    lowbit_sim::sync_block_impl(loc, pred, count, n);
    return count == n;
}
inline int __syncthreads_or(int pred,
                            std::source_location loc = std::source_location::current()) {
    int count = 0, n = 0;
    lowbit_sim::sync_block_impl(loc, pred, count, n);
    return count != 0;
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
    lowbit_sim::warp_sync(mask, lowbit_sim::kOpSync, 0);
}
inline unsigned __activemask() { return lowbit_sim::block().warps[lowbit_sim::t_warp].live; }

[[noreturn]] inline void __trap() {
    lowbit_sim::Block& b = lowbit_sim::block();
    {
        std::lock_guard<lowbit_sim::SpinLock> lock(b.mu);
        b.fail_locked("__trap() called by thread " + std::to_string(lowbit_sim::t_index) +
                      " of " + b.where());
    }
    throw lowbit_sim::Abort{};
}

inline long long clock64() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}
inline void __nanosleep(unsigned ns) { std::this_thread::sleep_for(std::chrono::nanoseconds(ns)); }

// Warp shuffles: one overload per type CUDA provides, so other argument types convert the
// way they do under NVRTC.
#define LOWBIT_SIM_SHFL(T)                                                                    \
    inline T __shfl_sync(unsigned mask, T var, int src, int width = warpSize) {              \
        return lowbit_sim::shfl<T>(lowbit_sim::kOpShflIdx, mask, var, src, width);            \
    }                                                                                         \
    inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {    \
        return lowbit_sim::shfl<T>(lowbit_sim::kOpShflUp, mask, var, static_cast<int>(delta), \
                                   width);                                                    \
    }                                                                                         \
    inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {  \
        return lowbit_sim::shfl<T>(lowbit_sim::kOpShflDown, mask, var,                        \
                                   static_cast<int>(delta), width);                           \
    }                                                                                         \
    inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {    \
        return lowbit_sim::shfl<T>(lowbit_sim::kOpShflXor, mask, var, lane_mask, width);      \
    }
LOWBIT_SIM_SHFL(int)
LOWBIT_SIM_SHFL(unsigned int)
LOWBIT_SIM_SHFL(long)
LOWBIT_SIM_SHFL(unsigned long)
LOWBIT_SIM_SHFL(long long)
LOWBIT_SIM_SHFL(unsigned long long)
LOWBIT_SIM_SHFL(float)
LOWBIT_SIM_SHFL(double)
#undef LOWBIT_SIM_SHFL

inline unsigned __ballot_sync(unsigned mask, int pred) {
    return lowbit_sim::ballot_of(lowbit_sim::warp_sync(mask, lowbit_sim::kOpBallot, pred != 0));
}
inline int __any_sync(unsigned mask, int pred) {
    return lowbit_sim::ballot_of(lowbit_sim::warp_sync(mask, lowbit_sim::kOpAny, pred != 0)) != 0;
}
inline int __all_sync(unsigned mask, int pred) {
    const lowbit_sim::WarpView v = lowbit_sim::warp_sync(mask, lowbit_sim::kOpAll, pred != 0);
    return lowbit_sim::ballot_of(v) == v.members;
}

inline unsigned __reduce_add_sync(unsigned mask, unsigned value) {
    return lowbit_sim::warp_reduce<unsigned>(lowbit_sim::kOpReduceAdd, mask, value,
                                             [](unsigned a, unsigned b) { return a + b; });
}
inline int __reduce_add_sync(unsigned mask, int value) {
    return static_cast<int>(__reduce_add_sync(mask, static_cast<unsigned>(value)));
}

// Atomics: relaxed, as on the GPU; __syncthreads() orders them.
#define LOWBIT_SIM_ATOMIC_RMW(NAME, T, OP)                                          \
    inline T NAME(T* address, T val) {                                              \
        return std::atomic_ref<T>(*address).OP(val, std::memory_order_relaxed);    \
    }
LOWBIT_SIM_ATOMIC_RMW(atomicAdd, int, fetch_add)
LOWBIT_SIM_ATOMIC_RMW(atomicAdd, unsigned int, fetch_add)
LOWBIT_SIM_ATOMIC_RMW(atomicAdd, unsigned long long, fetch_add)
LOWBIT_SIM_ATOMIC_RMW(atomicAdd, float, fetch_add)
LOWBIT_SIM_ATOMIC_RMW(atomicAdd, double, fetch_add)
LOWBIT_SIM_ATOMIC_RMW(atomicSub, int, fetch_sub)
LOWBIT_SIM_ATOMIC_RMW(atomicSub, unsigned int, fetch_sub)
LOWBIT_SIM_ATOMIC_RMW(atomicExch, int, exchange)
LOWBIT_SIM_ATOMIC_RMW(atomicExch, unsigned int, exchange)
LOWBIT_SIM_ATOMIC_RMW(atomicExch, unsigned long long, exchange)
LOWBIT_SIM_ATOMIC_RMW(atomicExch, float, exchange)
LOWBIT_SIM_ATOMIC_RMW(atomicAnd, int, fetch_and)
LOWBIT_SIM_ATOMIC_RMW(atomicAnd, unsigned int, fetch_and)
LOWBIT_SIM_ATOMIC_RMW(atomicAnd, long long, fetch_and)
LOWBIT_SIM_ATOMIC_RMW(atomicAnd, unsigned long long, fetch_and)
LOWBIT_SIM_ATOMIC_RMW(atomicOr, int, fetch_or)
LOWBIT_SIM_ATOMIC_RMW(atomicOr, unsigned int, fetch_or)
LOWBIT_SIM_ATOMIC_RMW(atomicOr, long long, fetch_or)
LOWBIT_SIM_ATOMIC_RMW(atomicOr, unsigned long long, fetch_or)
#undef LOWBIT_SIM_ATOMIC_RMW

#define LOWBIT_SIM_ATOMIC_MINMAX(T)                                                        \
    inline T atomicMax(T* address, T val) { return lowbit_sim::atomic_max<T>(address, val); } \
    inline T atomicMin(T* address, T val) { return lowbit_sim::atomic_min<T>(address, val); }
LOWBIT_SIM_ATOMIC_MINMAX(int)
LOWBIT_SIM_ATOMIC_MINMAX(unsigned int)
LOWBIT_SIM_ATOMIC_MINMAX(long long)
LOWBIT_SIM_ATOMIC_MINMAX(unsigned long long)
#undef LOWBIT_SIM_ATOMIC_MINMAX

inline int atomicCAS(int* address, int compare, int val) {
    return lowbit_sim::atomic_cas(address, compare, val);
}
inline unsigned atomicCAS(unsigned* address, unsigned compare, unsigned val) {
    return lowbit_sim::atomic_cas(address, compare, val);
}
inline unsigned long long atomicCAS(unsigned long long* address, unsigned long long compare,
                                    unsigned long long val) {
    return lowbit_sim::atomic_cas(address, compare, val);
}
// CUDA's wrapping increment.
inline unsigned atomicInc(unsigned* address, unsigned val) {
    std::atomic_ref<unsigned> ref(*address);
    unsigned old = ref.load(std::memory_order_relaxed);
    while (!ref.compare_exchange_weak(old, old >= val ? 0u : old + 1u, std::memory_order_relaxed)) {
    }
    return old;
}

// min/max: CUDA's overload set, so calls that are ambiguous under NVRTC are ambiguous here too.
#define LOWBIT_SIM_MINMAX(R, A, B)                           \
    inline R min(A a, B b) { return (R)a < (R)b ? (R)a : (R)b; } \
    inline R max(A a, B b) { return (R)a > (R)b ? (R)a : (R)b; }
LOWBIT_SIM_MINMAX(int, int, int)
LOWBIT_SIM_MINMAX(unsigned int, unsigned int, unsigned int)
LOWBIT_SIM_MINMAX(unsigned int, int, unsigned int)
LOWBIT_SIM_MINMAX(unsigned int, unsigned int, int)
LOWBIT_SIM_MINMAX(long, long, long)
LOWBIT_SIM_MINMAX(unsigned long, unsigned long, unsigned long)
LOWBIT_SIM_MINMAX(unsigned long, long, unsigned long)
LOWBIT_SIM_MINMAX(unsigned long, unsigned long, long)
LOWBIT_SIM_MINMAX(long long, long long, long long)
LOWBIT_SIM_MINMAX(unsigned long long, unsigned long long, unsigned long long)
LOWBIT_SIM_MINMAX(unsigned long long, long long, unsigned long long)
LOWBIT_SIM_MINMAX(unsigned long long, unsigned long long, long long)
#undef LOWBIT_SIM_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double min(float a, double b) { return fmin(a, b); }
inline double max(float a, double b) { return fmax(a, b); }
inline double min(double a, float b) { return fmin(a, b); }
inline double max(double a, float b) { return fmax(a, b); }

// Float intrinsics. The fast-math ones (__expf, __fdividef) are computed to full precision
// here: kernels may not depend on their GPU error.
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x >= 1.0f ? 1.0f : (x > 0.0f ? x : 0.0f); }

inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }

namespace lowbit_sim {
// GPU float -> integer conversion: NaN gives 0, out-of-range values saturate.
template <class I, class F>
inline I cvt_sat(F r) {
    if (std::isnan(r)) return 0;
    if (r <= static_cast<F>(std::numeric_limits<I>::min())) return std::numeric_limits<I>::min();
    if (r >= static_cast<F>(std::numeric_limits<I>::max())) return std::numeric_limits<I>::max();
    return static_cast<I>(r);
}
}  // namespace lowbit_sim

inline int __float2int_rn(float x) { return lowbit_sim::cvt_sat<int>(nearbyintf(x)); }

inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
    return uint4{x, y, z, w};
}

// Integer intrinsics.
inline int __popc(unsigned x) { return std::popcount(x); }
inline int __clz(int x) { return std::countl_zero(static_cast<unsigned>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long src = (static_cast<unsigned long long>(y) << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned sel = (s >> (4 * i)) & 7u;
        r |= static_cast<unsigned>((src >> (8 * sel)) & 0xffu) << (8 * i);
    }
    return r;
}

// Four-way byte dot products with 32-bit accumulate (wrapping, as on the GPU).
inline int __dp4a(int a, int b, int c) {
    unsigned acc = static_cast<unsigned>(c);
    for (int i = 0; i < 4; ++i) {
        const int ai = static_cast<signed char>((static_cast<unsigned>(a) >> (8 * i)) & 0xffu);
        const int bi = static_cast<signed char>((static_cast<unsigned>(b) >> (8 * i)) & 0xffu);
        acc += static_cast<unsigned>(ai * bi);
    }
    return static_cast<int>(acc);
}
inline unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
    unsigned acc = c;
    for (int i = 0; i < 4; ++i) acc += ((a >> (8 * i)) & 0xffu) * ((b >> (8 * i)) & 0xffu);
    return acc;
}

// Every lane's W 64-bit values in one warp round (cuda/common.cuh's WarpValues): the register
// exchange of the tensor-core twins costs one barrier instead of one per shuffle. Lanes write
// their values to this warp's slots of the phase's parity, meet at a warp barrier, and copy
// out; a lane writes the same parity again only two gathers later, after every lane has met it
// at the gather in between, i.e. finished copying (the rule of WarpGroup::vals). Every lane of
// the warp makes the same gathers, so each lane's count of them (per block) gives the parity.
namespace lowbit_sim {
constexpr int kGatherWords = 4;
struct GatherSlots {
    unsigned long long v[2][kWarp][kGatherWords];
};
inline GatherSlots g_gather_slots[kMaxBlockThreads / kWarp];
struct GatherCount {
    uint32_t gen = 0;
    unsigned count = 0;
};
inline thread_local GatherCount t_gather;

template <int W>
inline void warp_gather(const unsigned long long (&mine)[W],
                        unsigned long long (&out)[kWarp][W]) {
    static_assert(W >= 1 && W <= kGatherWords, "warp_gather carries 1 to 4 values a lane");
    GatherCount& n = t_gather;
    const uint32_t gen = job_gen(g_runtime->job.load(std::memory_order_acquire));
    if (n.gen != gen) n = GatherCount{gen, 0};
    const int parity = static_cast<int>(n.count++ & 1u);
    auto& slots = g_gather_slots[t_warp].v[parity];
    for (int w = 0; w < W; ++w) slots[t_lane][w] = mine[w];
    const WarpView v = warp_sync(~0u, kOpShflIdx, 0);  // its lock orders the slot accesses
    for (int lane = 0; lane < kWarp; ++lane) {
        const bool member = (v.members >> lane) & 1u;
        for (int w = 0; w < W; ++w) out[lane][w] = member ? slots[lane][w] : kPoison;
    }
}
}  // namespace lowbit_sim

// cp.async (cuda/common.cuh's cp_async, cp_async_commit, cp_async_wait): each thread queues its
// copies (the source is read at issue, as the hardware may) and writes them to shared memory
// only when a wait covers their group, so a kernel that reads a destination before its wait, or
// before the barrier after it, sees stale data here as it may on a GPU. The queue belongs to
// the block generation it was filled in: what an aborted block left behind is dropped.
namespace lowbit_sim {
constexpr int kMaxAsyncBytes = 16;
struct AsyncCopy {
    unsigned char* dst;
    int bytes;
    unsigned char data[kMaxAsyncBytes];
};
struct AsyncQueue {
    uint32_t gen = 0;
    std::vector<AsyncCopy> copies;   // issued, not yet written, oldest first
    std::vector<size_t> group_ends;  // copies.size() at each commit, oldest first
};
inline thread_local AsyncQueue t_async;

inline AsyncQueue& async_queue() {
    AsyncQueue& q = t_async;
    const uint32_t gen = job_gen(g_runtime->job.load(std::memory_order_acquire));
    if (q.gen != gen) {
        q.copies.clear();
        q.group_ends.clear();
        q.gen = gen;
    }
    return q;
}

inline void cp_async_issue(void* dst, const void* src, int bytes, int src_bytes) {
    const auto misaligned = [bytes](const void* p) {
        return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) != 0;
    };
    if (misaligned(dst) || (src_bytes > 0 && misaligned(src)) || src_bytes < 0 ||
        src_bytes > bytes) {
        Block& b = block();
        {
            std::lock_guard<SpinLock> lock(b.mu);
            b.fail_locked("cp.async of " + std::to_string(bytes) + " bytes (" +
                          std::to_string(src_bytes) + " from the source) by thread " +
                          std::to_string(t_index) + " of " + b.where() +
                          ": addresses must be aligned to the size, src_bytes within it");
        }
        throw Abort{};
    }
    AsyncCopy c{static_cast<unsigned char*>(dst), bytes, {}};
    if (src_bytes > 0) std::memcpy(c.data, src, static_cast<size_t>(src_bytes));
    async_queue().copies.push_back(c);
}

inline void cp_async_commit() {
    AsyncQueue& q = async_queue();
    q.group_ends.push_back(q.copies.size());
}

inline void cp_async_wait(int pending) {
    AsyncQueue& q = async_queue();
    const size_t groups = q.group_ends.size();
    if (groups <= static_cast<size_t>(pending)) return;
    const size_t done = q.group_ends[groups - static_cast<size_t>(pending) - 1];
    for (size_t i = 0; i < done; ++i) {
        std::memcpy(q.copies[i].dst, q.copies[i].data, static_cast<size_t>(q.copies[i].bytes));
    }
    q.copies.erase(q.copies.begin(), q.copies.begin() + static_cast<std::ptrdiff_t>(done));
    q.group_ends.erase(q.group_ends.begin(),
                       q.group_ends.end() - static_cast<std::ptrdiff_t>(pending));
    for (size_t& end : q.group_ends) end -= done;
}
}  // namespace lowbit_sim

// Device assert(): a failure aborts the launch (RuntimeError in Python) instead of the process.
namespace lowbit_sim {
[[noreturn]] inline void assert_fail(const char* expr, const char* file, unsigned line,
                                     const char* function) {
    Block& b = block();
    {
        std::lock_guard<SpinLock> lock(b.mu);
        b.fail_locked(std::string("assertion `") + expr + "` failed at " + file + ":" +
                      std::to_string(line) + " in " + function + ", thread " +
                      std::to_string(t_index) + " of " + b.where());
    }
    throw Abort{};
}
}  // namespace lowbit_sim
#undef assert
#if defined(NDEBUG)
#define assert(expr) ((void)0)
#else
#define assert(expr) \
    ((expr) ? (void)0 : ::lowbit_sim::assert_fail(#expr, __FILE__, __LINE__, __func__))
#endif
