// cudasim, runtime part 2: the per-library worker pool that runs a block's CUDA threads, the
// barrier entry points and shuffle, reduction and atomic helpers the Device API builds on,
// the trampolines' helpers, and the launcher lowbit_sim_launch (exported to
// lowbit/_cudasim.py). Internal to cudasim but for the launcher.
//
// Included only by cudasim.cuh, after cudasim_block.cuh; cudasim_device.cuh builds on it.
#pragma once

namespace lowbit_sim {

// A block to run, as one atomic word: generation (high 32 bits) and thread count (low 32 bits).
// A worker decides whether it takes part from the same snapshot that tells it the block is
// new, so a worker that is descheduled anywhere can neither run a block twice nor act on the
// thread count of another launch.
inline uint64_t make_job(uint32_t gen, int nthreads) {
    return (static_cast<uint64_t>(gen) << 32) | static_cast<uint32_t>(nthreads);
}
inline uint32_t job_gen(uint64_t job) { return static_cast<uint32_t>(job >> 32); }
inline int job_threads(uint64_t job) { return static_cast<int>(static_cast<uint32_t>(job)); }

struct Worker {
    bool alive = false;  // guarded by Runtime::pool_mu
    int index = 0;
    uint32_t seen_gen = 0;  // job generation current when the thread was created
};

void* worker_main(void* arg);

struct Runtime {
    pid_t pid = getpid();
    std::mutex launch_mu;  // one launch at a time per library
    std::mutex pool_mu;
    bool in_launch = false;  // guarded by pool_mu; idle workers do not exit during a launch
    std::vector<Worker*> workers;
    std::atomic<uint64_t> job{0};         // make_job(generation, threads) of the current block
    std::atomic<uint32_t> start_word{0};  // futex word: set to the generation after `job`
    std::atomic<uint32_t> done_word{0};   // bumped by the last thread of a block
    std::atomic<int> remaining{0};
    unsigned jitter_us = 0;

    Block block;
    void (*entry)(void**) = nullptr;
    void** argv = nullptr;
    unsigned char* smem = nullptr;
    size_t smem_capacity = 0;
    size_t smem_size = 0;  // dynamic shared memory bytes of the current launch

    // Starts workers [0, n) where missing; false if the OS refuses a thread.
    bool ensure_workers(int n, std::string& err) {
        while (static_cast<int>(workers.size()) < n) {
            Worker* w = new Worker;
            w->index = static_cast<int>(workers.size());
            workers.push_back(w);
        }
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, kThreadStackBytes);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        bool ok = true;
        for (int i = 0; i < n && ok; ++i) {
            Worker* w = workers[i];
            if (w->alive) continue;
            pthread_t tid;
            w->alive = true;
            w->seen_gen = job_gen(job.load(std::memory_order_relaxed));
            const int rc = pthread_create(&tid, &attr, &worker_main, w);
            if (rc != 0) {
                w->alive = false;
                err = "cudasim could not start thread " + std::to_string(i) + ": " +
                      std::strerror(rc);
                ok = false;
            }
        }
        pthread_attr_destroy(&attr);
        return ok;
    }
};

// The runtime of this library. Never destroyed: detached workers may still sleep in it when
// the process exits. Replaced in a forked child, where the parent's workers do not exist.
inline Runtime* g_runtime = nullptr;

inline Runtime& runtime_for_launch() {
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    if (g_runtime == nullptr || g_runtime->pid != getpid()) g_runtime = new Runtime;
    return *g_runtime;
}

inline Block& block() { return g_runtime->block; }

inline void run_kernel_thread(Runtime& rt, int index) {
    const dim3 bd = blockDim;
    threadIdx = uint3{index % bd.x, (index / bd.x) % bd.y, index / (bd.x * bd.y)};
    t_index = index;
    t_lane = index % kWarp;
    t_warp = index / kWarp;
    Block& b = rt.block;
    const unsigned bit = 1u << t_lane;
    if (b.warps[t_warp].started.fetch_or(bit, std::memory_order_relaxed) & bit) {
        // Cannot happen (see make_job); never run a CUDA thread twice in one block.
        std::lock_guard<SpinLock> lock(b.mu);
        b.fail_locked("cudasim internal error: thread " + std::to_string(index) + " of " +
                      b.where() + " started twice");
        return;  // its first run does the exit accounting
    }
    b.progress.fetch_add(1, std::memory_order_relaxed);
    try {
        rt.entry(rt.argv);
    } catch (const Abort&) {
    } catch (const std::exception& e) {
        std::lock_guard<SpinLock> lock(rt.block.mu);
        rt.block.fail_locked(std::string("kernel thread threw ") + e.what());
    } catch (...) {
        std::lock_guard<SpinLock> lock(rt.block.mu);
        rt.block.fail_locked("kernel thread threw an exception");
    }
    jitter(rt.jitter_us);
    rt.block.exit_thread(index);
    jitter(rt.jitter_us);
    if (rt.remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        rt.done_word.fetch_add(1, std::memory_order_release);
        word_wake_all(rt.done_word);
    }
}

inline void* worker_main(void* arg) {
    Worker* w = static_cast<Worker*>(arg);
#if defined(SCHED_BATCH)
    // Kernel threads wake each other all the time; as batch threads a woken thread does not
    // preempt the running one, which roughly halves the context switches.
    sched_param param{};
    pthread_setschedparam(pthread_self(), SCHED_BATCH, &param);
#endif
    Runtime& rt = *g_runtime;
    uint32_t seen = w->seen_gen;
    auto idle_since = std::chrono::steady_clock::now();
    for (;;) {
        // The futex word first: if the launcher publishes a job after this load, the wait
        // below returns at once instead of missing the wake-up.
        const uint32_t word = rt.start_word.load(std::memory_order_acquire);
        const uint64_t job = rt.job.load(std::memory_order_acquire);
        if (job_gen(job) != seen) {
            // A block this worker has not looked at. If the worker is needed (index < threads
            // of this very job), the block cannot finish without it, so the job is still
            // current; if not, it only records the generation.
            seen = job_gen(job);
            if (w->index < job_threads(job)) {
                jitter(rt.jitter_us);
                run_kernel_thread(rt, w->index);
            }
            idle_since = std::chrono::steady_clock::now();
            continue;
        }
        const auto left = idle_since + kWorkerIdle - std::chrono::steady_clock::now();
        if (left.count() <= 0) {
            std::lock_guard<std::mutex> lock(rt.pool_mu);
            if (!rt.in_launch && job_gen(rt.job.load(std::memory_order_acquire)) == seen) {
                w->alive = false;
                return nullptr;
            }
            idle_since = std::chrono::steady_clock::now();
            continue;
        }
        word_wait(rt.start_word, word, left);
    }
}

inline void sync_block_impl(const std::source_location& loc, int pred, int& count, int& n) {
    Block& b = block();
    std::unique_lock<SpinLock> lock(b.mu);
    if (b.aborted.load(std::memory_order_relaxed)) throw Abort{};
    const Site site{loc.file_name(), loc.line(), loc.column(), loc.function_name()};
    if (b.bar_arrived == 0) {
        b.bar_site = site;
    } else if (!b.bar_site.same(site)) {
        b.fail_locked("divergent __syncthreads() in " + b.where() + ": " +
                      std::to_string(b.bar_arrived) + " thread(s) wait at " + b.bar_site.str() +
                      " while thread " + std::to_string(t_index) + " arrived at " + site.str() +
                      " (a barrier every thread of the block must reach; on a GPU this hangs "
                      "or corrupts results)");
        throw Abort{};
    }
    ++b.bar_arrived;
    b.bar_count += pred != 0;
    b.progress.fetch_add(1, std::memory_order_relaxed);
    const uint32_t seen = b.bar_word.load(std::memory_order_relaxed);
    if (b.bar_arrived == b.live) {
        count = b.bar_count;
        n = b.bar_arrived;
        b.complete_bar_locked();
        return;
    }
    ++b.bar_waiting;
    b.wait_locked(lock, b.bar_word, seen);
    count = b.bar_result_count[seen & 1];
    n = b.bar_result_n[seen & 1];
}

inline WarpView warp_sync(unsigned mask, int op, uint64_t value) {
    Block& b = block();
    std::unique_lock<SpinLock> lock(b.mu);
    if (b.aborted.load(std::memory_order_relaxed)) throw Abort{};
    const int w = t_warp;
    const int lane = t_lane;
    const unsigned me = 1u << lane;
    mask |= me;
    Warp& warp = b.warps[w];
    WarpGroup* g = nullptr;
    for (auto& cand : warp.groups) {
        if (cand->mask == mask) {
            g = cand.get();
            break;
        }
    }
    if (g == nullptr) {
        warp.groups.push_back(std::make_unique<WarpGroup>());
        g = warp.groups.back().get();
        g->mask = mask;
    }
    if (g->arrived == 0) {
        g->op = op;
    } else if (g->op != op) {
        char buf[200];
        std::snprintf(buf, sizeof buf,
                      "divergent warp intrinsics in %s, warp %d: lanes 0x%08x are in %s while "
                      "lane %d called %s with the same mask 0x%08x",
                      b.where().c_str(), w, g->arrived, op_name(g->op), lane, op_name(op), mask);
        b.fail_locked(buf);
        throw Abort{};
    }
    const uint32_t seen = g->word.load(std::memory_order_relaxed);
    const int parity = static_cast<int>(seen & 1);
    g->vals[parity][lane] = value;
    g->arrived |= me;
    b.progress.fetch_add(1, std::memory_order_relaxed);
    if (g->arrived == (g->mask & warp.live)) {
        b.complete_group_locked(*g);
    } else {
        ++g->waiting;
        b.wait_locked(lock, g->word, seen);
    }
    return WarpView{g->vals[parity], g->members[parity]};
}

template <class T>
inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    return bits;
}

template <class T>
inline T from_bits(uint64_t bits) {
    T v;
    std::memcpy(&v, &bits, sizeof(T));
    return v;
}

// Source lane of a shuffle, following the PTX shfl.sync rules: `c` packs the segment mask
// (32 - width) in bits 12:8 and the clamp lane in bits 4:0; an out-of-segment source reads the
// caller's own value.
inline int shfl_source(int op, int lane, int b, int width) {
    const int seg = (kWarp - width) & (kWarp - 1);
    const int clamp = op == kOpShflUp ? 0 : kWarp - 1;
    const int bval = b & (kWarp - 1);
    const int max_lane = (lane & seg) | (clamp & ~seg);
    const int min_lane = lane & seg;
    int j = lane;
    bool ok = false;
    switch (op) {
        case kOpShflUp: j = lane - bval; ok = j >= max_lane; break;
        case kOpShflDown: j = lane + bval; ok = j <= max_lane; break;
        case kOpShflXor: j = lane ^ bval; ok = j <= max_lane; break;
        default: j = min_lane | (bval & ~seg); ok = j <= max_lane; break;
    }
    return ok ? j : lane;
}

template <class T>
inline T shfl(int op, unsigned mask, T var, int b, int width) {
    const WarpView v = warp_sync(mask, op, to_bits(var));
    const int src = shfl_source(op, t_lane, b, width);
    return from_bits<T>((v.members >> src) & 1u ? v.vals[src] : kPoison);
}

inline unsigned ballot_of(const WarpView& v) {
    unsigned bits = 0;
    for (unsigned m = v.members; m; m &= m - 1) {
        const int lane = std::countr_zero(m);
        if (v.vals[lane] != 0) bits |= 1u << lane;
    }
    return bits;
}

template <class T, class F>
inline T warp_reduce(int op, unsigned mask, T value, F combine) {
    const WarpView v = warp_sync(mask, op, to_bits(value));
    unsigned m = v.members;
    T acc = from_bits<T>(v.vals[std::countr_zero(m)]);
    for (m &= m - 1; m; m &= m - 1) acc = combine(acc, from_bits<T>(v.vals[std::countr_zero(m)]));
    return acc;
}

// Stores val while it beats the value held (``beats(val, old)``); returns the old value.
template <class T, class Beats>
inline T atomic_keep_best(T* address, T val, Beats beats) {
    std::atomic_ref<T> ref(*address);
    T old = ref.load(std::memory_order_relaxed);
    while (beats(val, old) && !ref.compare_exchange_weak(old, val, std::memory_order_relaxed)) {
    }
    return old;
}

template <class T>
inline T atomic_max(T* address, T val) {
    return atomic_keep_best(address, val, [](T v, T old) { return old < v; });
}

template <class T>
inline T atomic_min(T* address, T val) {
    return atomic_keep_best(address, val, [](T v, T old) { return v < old; });
}

template <class T>
inline T atomic_cas(T* address, T compare, T val) {
    std::atomic_ref<T>(*address).compare_exchange_strong(compare, val,
                                                          std::memory_order_relaxed);
    return compare;
}

// --- trampolines appended by lowbit/_cudasim.py ---------------------------------------------

template <class T>
inline T load_arg(void* p) {
    static_assert(std::is_trivially_copyable_v<T>, "kernel parameters must be trivially copyable");
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
}

template <class... P, size_t... I>
inline void invoke_impl(void (*fn)(P...), void** argv, std::index_sequence<I...>) {
    fn(load_arg<P>(argv[I])...);
}

template <class... P>
inline void invoke(void (*fn)(P...), void** argv) {
    invoke_impl(fn, argv, std::index_sequence_for<P...>{});
}

// Parameter kinds reported to Python for argument checking (lowbit/_cudasim.py _PARAM_KINDS).
enum ParamKind : int {
    kPointer = 0,
    kSigned = 1,
    kUnsigned = 2,
    kFloat = 3,
    kBool = 4,
    kOther = 5,
};

template <class T>
constexpr int param_kind() {
    if constexpr (std::is_pointer_v<T>) return kPointer;
    else if constexpr (std::is_same_v<T, bool>) return kBool;
    else if constexpr (std::is_floating_point_v<T>) return kFloat;
    else if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) return kSigned;
    else if constexpr (std::is_integral_v<T>) return kUnsigned;
    else return kOther;
}

template <class... P>
inline const char* signature_of(void (*)(P...)) {
    return __PRETTY_FUNCTION__;
}

template <class... P>
inline int describe(void (*)(P...), long long* sizes, int* kinds, int capacity) {
    const long long sz[] = {static_cast<long long>(sizeof(P))..., 0};
    const int kd[] = {param_kind<P>()..., 0};
    const int n = static_cast<int>(sizeof...(P));
    for (int i = 0; i < n && i < capacity; ++i) {
        sizes[i] = sz[i];
        kinds[i] = kd[i];
    }
    return n;
}

}  // namespace lowbit_sim

// ---------------------------------------------------------------------------------------------
// Launcher, exported to lowbit/_cudasim.py
// ---------------------------------------------------------------------------------------------
extern "C" LOWBIT_SIM_EXPORT int lowbit_sim_launch(void (*entry)(void**), void** argv,
                                                   unsigned gx, unsigned gy, unsigned gz,
                                                   unsigned bx, unsigned by, unsigned bz,
                                                   unsigned long long shared_mem,
                                                   long long timeout_ms, unsigned jitter_us,
                                                   char* errbuf, int errcap) {
    using namespace lowbit_sim;
    Runtime& rt = runtime_for_launch();
    std::lock_guard<std::mutex> launch_lock(rt.launch_mu);
    std::string err;
    const unsigned long long nthreads = 1ull * bx * by * bz;
    if (nthreads == 0 || nthreads > kMaxBlockThreads || gx == 0 || gy == 0 || gz == 0) {
        err = "invalid launch configuration";
    }
    if (err.empty() && shared_mem > rt.smem_capacity) {
        std::free(rt.smem);
        const size_t cap = (shared_mem + kSmemAlign - 1) / kSmemAlign * kSmemAlign;
        rt.smem = static_cast<unsigned char*>(std::aligned_alloc(kSmemAlign, cap));
        rt.smem_capacity = rt.smem ? cap : 0;
        if (!rt.smem) err = "cudasim could not allocate dynamic shared memory";
    }
    if (err.empty()) {
        rt.smem_size = shared_mem;
        rt.entry = entry;
        rt.argv = argv;
        rt.block.timeout_ms = timeout_ms > 0 ? timeout_ms : 1;
        rt.jitter_us = jitter_us;
        gridDim = dim3(gx, gy, gz);
        blockDim = dim3(bx, by, bz);
        const int n = static_cast<int>(nthreads);
        {
            std::lock_guard<std::mutex> pool_lock(rt.pool_mu);
            rt.in_launch = true;
            rt.ensure_workers(n, err);
        }
        for (unsigned z = 0; z < gz && err.empty(); ++z) {
            for (unsigned y = 0; y < gy && err.empty(); ++y) {
                for (unsigned x = 0; x < gx && err.empty(); ++x) {
                    blockIdx = uint3{x, y, z};
                    rt.block.reset(n);
                    if (shared_mem) std::memset(rt.smem, kSmemPoisonByte, shared_mem);
                    rt.remaining.store(n, std::memory_order_relaxed);
                    const uint32_t done = rt.done_word.load(std::memory_order_acquire);
                    const uint32_t gen = job_gen(rt.job.load(std::memory_order_relaxed)) + 1;
                    rt.job.store(make_job(gen, n), std::memory_order_release);
                    rt.start_word.store(gen, std::memory_order_release);
                    word_wake_all(rt.start_word);
                    while (rt.done_word.load(std::memory_order_acquire) == done) {
                        word_wait(rt.done_word, done, std::chrono::seconds(1));
                    }
                    if (rt.block.aborted.load(std::memory_order_acquire)) err = rt.block.error;
                }
            }
        }
        std::lock_guard<std::mutex> pool_lock(rt.pool_mu);
        rt.in_launch = false;
    }
    if (err.empty()) return 0;
    if (errcap > 0) std::snprintf(errbuf, static_cast<size_t>(errcap), "%s", err.c_str());
    return 1;
}
