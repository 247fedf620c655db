// cudasim: compile lowbit's CUDA C++ kernels with g++ and run them on the CPU.
//
// lowbit/_cudasim_build.py force-includes this header (g++ -include) in front of a
// cuda/<op>.cu file and defines LOWBIT_CUDASIM, lowbit/_cudasim.py appends one extern "C"
// trampoline per name expression, and the result is built into a shared library;
// tests/test_cudasim.py tests the header with tests/cuda/*.cu. The dynamic shared memory macro
// that kernels use lives in cuda/common.cuh and calls lowbit_sim_dynamic_shared() from here.
//
// Execution model (see DESIGN.md, "cudasim"):
//   * one OS thread per CUDA thread, from a per-library pool of worker threads with a fixed
//     stack of kThreadStackBytes; the blocks of a grid run one after another;
//   * threadIdx is thread_local; blockIdx, blockDim and gridDim are globals, set before the
//     threads of a block start;
//   * __shared__ is `static`: one copy per library, reused by every block without being
//     cleared; dynamic shared memory is refilled with 0xff bytes before every block so a read
//     before write shows up as NaN / -1;
//   * __syncthreads() and every warp intrinsic are barriers; a thread that returns from the
//     kernel leaves all of them (as on Volta and later GPUs, exited threads do not take part);
//   * every barrier is checked: threads of one block waiting at different __syncthreads()
//     calls, lanes of one warp in different kinds of warp intrinsic with the same mask, and
//     states where every running thread of the block waits on a barrier that cannot complete
//     (a deadlock) abort the launch with an error message instead of hanging.
//
//   * every thread of a block counts as running from the moment the block is launched until
//     it returns, whether or not its OS thread has been scheduled yet: a lane that has not
//     started is still expected at warp intrinsics and __syncthreads(), and a deadlock is only
//     reported when every one of the block's not-yet-exited threads waits. Each worker takes
//     the (block generation, thread count) of a launch from one atomic word, so it runs its
//     CUDA thread exactly once per block however late it is scheduled;
//   * a barrier wait during which no thread of the block makes progress (starts, arrives at a
//     barrier, exits) for the launch's timeout aborts too, once the thread that keeps the
//     others waiting reaches a barrier or exits; a thread that loops forever
//     outside barriers hangs the launch, and a crash (bad pointer, stack overflow) kills the
//     process: neither can be caught;
//   * a failing device assert() or __trap() aborts the launch with its message;
//   * cp.async (cuda/common.cuh) writes its destination only at the cp_async_wait that covers
//     it, and the tensor-core twins exchange registers through warp_gather (one warp barrier
//     per exchange).
//
// Numerics: plain C++ float arithmetic without FMA contraction (lowbit/_cudasim_build.py passes
// -ffp-contract=off), while NVRTC contracts a * b + c into an FMA by default, so float results
// may differ from a GPU in the last bits; the fast-math intrinsics (__expf, __fdividef) are
// computed to full precision.
//
// Everything NVRTC provides implicitly (no #include needed there) that lowbit kernels use is
// declared here, and nothing they do not use: tests/test_cudasim.py holds every intrinsic to a
// use in cuda/*.cu or tests/cuda/*.cu (add one together with a test kernel). The g++ side also
// sees the C++ standard headers included below; the NVRTC compile check (lowbit/_nvrtc.py) is
// what keeps kernels free of them.
#pragma once

#ifndef LOWBIT_CUDASIM
#define LOWBIT_CUDASIM 1
#endif

// Standard headers first: the qualifier macros below would break standard headers included
// after them (<memory> spells __attribute__((__noinline__))), so kernels should not include
// standard headers of their own (NVRTC has none anyway).
#include <pthread.h>
#include <sched.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif
#include <ctime>

#include <atomic>
#include <bit>
#include <cfloat>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <semaphore>
#include <source_location>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

// ---------------------------------------------------------------------------------------------
// Qualifiers
// ---------------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __constant__
#define __managed__
#define __grid_constant__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define LOWBIT_SIM_EXPORT __attribute__((visibility("default")))

// ---------------------------------------------------------------------------------------------
// Index types
// ---------------------------------------------------------------------------------------------
struct uint3 {
    unsigned int x, y, z;
};

// The 128-bit vector type kernels load and store whole (aligned as on the GPU).
struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
        : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};

// ---------------------------------------------------------------------------------------------
// Built-in index variables
// ---------------------------------------------------------------------------------------------
inline thread_local uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;
constexpr int warpSize = 32;

// ---------------------------------------------------------------------------------------------
// Runtime: block state, barriers, warp exchange, worker pool. Internal to cudasim.
// ---------------------------------------------------------------------------------------------
namespace lowbit_sim {

constexpr int kWarp = 32;
constexpr int kMaxBlockThreads = 1024;
// Each CUDA thread runs on an OS thread with this much stack: per-thread arrays must stay
// register-sized, as on the GPU.
constexpr size_t kThreadStackBytes = 256 * 1024;
// A worker thread that has had nothing to run for this long exits; the next launch that needs
// it starts a new one. Keeps idle libraries from holding hundreds of threads.
constexpr auto kWorkerIdle = std::chrono::seconds(5);
// Returned by a shuffle whose source lane did not take part (undefined on a GPU).
constexpr uint64_t kPoison = ~0ull;
constexpr unsigned char kSmemPoisonByte = 0xff;
constexpr size_t kSmemAlign = 64;

// Thrown into kernel threads to unwind them once a launch is aborted.
struct Abort {};

enum WarpOp : int {
    kOpSync = 1,
    kOpShflIdx,
    kOpShflUp,
    kOpShflDown,
    kOpShflXor,
    kOpBallot,
    kOpAny,
    kOpAll,
    kOpReduceAdd,
};

inline const char* op_name(int op) {
    switch (op) {
        case kOpSync: return "__syncwarp";
        case kOpShflIdx: return "__shfl_sync";
        case kOpShflUp: return "__shfl_up_sync";
        case kOpShflDown: return "__shfl_down_sync";
        case kOpShflXor: return "__shfl_xor_sync";
        case kOpBallot: return "__ballot_sync";
        case kOpAny: return "__any_sync";
        case kOpAll: return "__all_sync";
        case kOpReduceAdd: return "__reduce_add_sync";
        default: return "warp intrinsic";
    }
}

// Wait words: a thread sleeps until a 32-bit counter moves away from the value it saw. On
// Linux this is a futex, so one system call wakes every waiter of a barrier; elsewhere the
// waiters poll.
inline void word_wait(std::atomic<uint32_t>& word, uint32_t seen,
                      std::chrono::nanoseconds limit) {
    if (limit.count() <= 0) return;
#if defined(__linux__)
    timespec ts;
    ts.tv_sec = static_cast<time_t>(limit.count() / 1000000000);
    ts.tv_nsec = static_cast<long>(limit.count() % 1000000000);
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, seen, &ts,
            nullptr, 0);
#else
    (void)word;
    (void)seen;
    const std::chrono::nanoseconds poll = std::chrono::microseconds(50);
    std::this_thread::sleep_for(limit < poll ? limit : poll);
#endif
}

inline void word_wake_all(std::atomic<uint32_t>& word) {
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX,
            nullptr, nullptr, 0);
#else
    (void)word;
#endif
}

// Added to every wait word of a block when a launch aborts, so that no waiter sleeps on.
constexpr uint32_t kAbortBump = 1u << 30;

// The lanes of one warp that synchronize with one mask. Values of phase g live in
// vals[g & 1]: a lane can only overwrite them in phase g + 2, which needs every member to
// have arrived in phase g + 1, i.e. to have finished reading phase g.
struct WarpGroup {
    unsigned mask = 0;
    unsigned arrived = 0;
    int waiting = 0;
    std::atomic<uint32_t> word{0};  // phase counter
    int op = 0;
    unsigned members[2] = {0, 0};
    uint64_t vals[2][kWarp] = {};
};

struct Warp {
    unsigned live = 0;     // lanes that have not exited (started or not); guarded by Block::mu
    std::atomic<unsigned> started{0};  // lanes whose kernel thread has begun in this block
    Warp() = default;
    Warp(Warp&& o) noexcept  // for std::vector::resize (only between blocks)
        : live(o.live), started(o.started.load()), groups(std::move(o.groups)) {}
    std::vector<std::unique_ptr<WarpGroup>> groups;
};

struct WarpView {
    const uint64_t* vals;
    unsigned members;
};

struct Site {
    const char* file = nullptr;
    unsigned line = 0;
    unsigned column = 0;
    const char* function = nullptr;
    bool same(const Site& o) const {
        return line == o.line && column == o.column &&
               (file == o.file || std::strcmp(file, o.file) == 0);
    }
    std::string str() const {
        return std::string(file) + ":" + std::to_string(line) + " in " + function;
    }
};

inline thread_local int t_index = 0;  // linear thread index within the block
inline thread_local int t_lane = 0;
inline thread_local int t_warp = 0;

// A lock for very short critical sections: spins briefly, then yields the CPU (the holder may
// have been preempted by one of the many runnable kernel threads).
class SpinLock {
  public:
    void lock() {
        for (int i = 0; flag_.exchange(true, std::memory_order_acquire); ++i) {
            if (i >= kSpins) {
                sched_yield();
            }
        }
    }
    void unlock() { flag_.store(false, std::memory_order_release); }

  private:
    static constexpr int kSpins = 64;
    std::atomic<bool> flag_{false};
};

// State of the block being run. One mutex guards every barrier of the block: the deadlock
// check needs a consistent count of running and waiting threads. Waiters sleep on the
// barrier's word without the mutex and read their results after the word moved.
struct Block {
    SpinLock mu;
    int nthreads = 0;
    int live = 0;
    int blocked = 0;
    long long timeout_ms = 60000;
    std::atomic<bool> aborted{false};
    // Bumped whenever a thread of the block starts, arrives at a barrier or exits: a barrier
    // wait only times out when nothing at all happened in the block for timeout_ms.
    std::atomic<uint64_t> progress{0};
    std::string error;

    int bar_arrived = 0;
    int bar_count = 0;
    int bar_waiting = 0;
    std::atomic<uint32_t> bar_word{0};  // phase counter of __syncthreads()
    int bar_result_count[2] = {0, 0};
    int bar_result_n[2] = {0, 0};
    Site bar_site;

    std::vector<Warp> warps;

    void reset(int n) {
        nthreads = n;
        live = n;
        blocked = 0;
        aborted.store(false, std::memory_order_relaxed);
        error.clear();
        bar_arrived = 0;
        bar_count = 0;
        bar_waiting = 0;
        const int nwarps = (n + kWarp - 1) / kWarp;
        if (static_cast<int>(warps.size()) < nwarps) warps.resize(nwarps);
        for (int w = 0; w < nwarps; ++w) {
            const int lanes = n - w * kWarp < kWarp ? n - w * kWarp : kWarp;
            warps[w].live = lanes == kWarp ? ~0u : ((1u << lanes) - 1u);
            warps[w].started.store(0, std::memory_order_relaxed);
            for (auto& g : warps[w].groups) {
                g->arrived = 0;
                g->waiting = 0;
            }
        }
    }

    std::string where() const {
        return "block (" + std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," +
               std::to_string(blockIdx.z) + ")";
    }

    // Records the first error and wakes every waiting thread, which then throws Abort.
    void fail_locked(const std::string& msg) {
        if (aborted.load(std::memory_order_relaxed)) return;
        error = msg;
        aborted.store(true, std::memory_order_release);
        bar_word.fetch_add(kAbortBump, std::memory_order_release);
        word_wake_all(bar_word);
        for (auto& w : warps) {
            for (auto& g : w.groups) {
                g->word.fetch_add(kAbortBump, std::memory_order_release);
                word_wake_all(g->word);
            }
        }
    }

    std::string describe_waits() const {
        std::string s;
        if (bar_arrived > 0) {
            s += "; " + std::to_string(bar_arrived) + " at __syncthreads() (" + bar_site.str() +
                 ")";
        }
        const int nwarps = (nthreads + kWarp - 1) / kWarp;
        for (int w = 0; w < nwarps; ++w) {
            for (const auto& g : warps[w].groups) {
                if (g->arrived == 0) continue;
                char buf[160];
                std::snprintf(buf, sizeof buf,
                              "; warp %d: lanes 0x%08x in %s(mask 0x%08x), waiting for lanes "
                              "0x%08x",
                              w, g->arrived, op_name(g->op), g->mask,
                              g->mask & warps[w].live & ~g->arrived);
                s += buf;
            }
        }
        return s;
    }

    void check_deadlock_locked() {
        if (live > 0 && blocked == live) {
            fail_locked("deadlock in " + where() + ": all " + std::to_string(live) +
                        " running threads wait at barriers that cannot complete" +
                        describe_waits());
        }
    }

    // Caller holds `lock`, has arrived at the barrier whose phase counter is `word` (value
    // `seen` on arrival) and did not complete it.
    void wait_locked(std::unique_lock<SpinLock>& lock, std::atomic<uint32_t>& word,
                     uint32_t seen) {
        ++blocked;
        check_deadlock_locked();
        uint64_t progress_seen = progress.load(std::memory_order_relaxed);
        lock.unlock();
        const auto limit = std::chrono::milliseconds(timeout_ms);
        auto deadline = std::chrono::steady_clock::now() + limit;
        while (word.load(std::memory_order_acquire) == seen) {
            const auto left = deadline - std::chrono::steady_clock::now();
            if (left.count() <= 0) {
                lock.lock();
                const uint64_t now_progress = progress.load(std::memory_order_relaxed);
                if (word.load(std::memory_order_relaxed) != seen) {
                    lock.unlock();
                    break;
                }
                if (now_progress != progress_seen) {
                    // Slow (a loaded machine), not stuck: other threads still move.
                    progress_seen = now_progress;
                    lock.unlock();
                    deadline = std::chrono::steady_clock::now() + limit;
                    continue;
                }
                fail_locked("barrier wait in " + where() + " exceeded the timeout of " +
                            std::to_string(timeout_ms) +
                            " ms without any thread of the block making progress (a thread "
                            "stuck in a loop outside barriers)" +
                            describe_waits());
                lock.unlock();
                break;
            }
            word_wait(word, seen, left);
        }
        if (aborted.load(std::memory_order_acquire)) throw Abort{};
    }

    void complete_bar_locked() {
        const int parity = static_cast<int>(bar_word.load(std::memory_order_relaxed) & 1);
        bar_result_count[parity] = bar_count;
        bar_result_n[parity] = bar_arrived;
        bar_arrived = 0;
        bar_count = 0;
        blocked -= bar_waiting;
        const bool wake = bar_waiting > 0;
        bar_waiting = 0;
        bar_word.fetch_add(1, std::memory_order_release);
        if (wake) word_wake_all(bar_word);
    }

    void complete_group_locked(WarpGroup& g) {
        const int parity = static_cast<int>(g.word.load(std::memory_order_relaxed) & 1);
        g.members[parity] = g.arrived;
        g.arrived = 0;
        blocked -= g.waiting;
        const bool wake = g.waiting > 0;
        g.waiting = 0;
        g.word.fetch_add(1, std::memory_order_release);
        if (wake) word_wake_all(g.word);
    }

    // Called when a kernel thread returns (or unwinds): it leaves every barrier.
    void exit_thread(int t) {
        std::lock_guard<SpinLock> lock(mu);
        progress.fetch_add(1, std::memory_order_relaxed);
        Warp& warp = warps[t / kWarp];
        const unsigned bit = 1u << (t % kWarp);
        if ((warp.live & bit) == 0) {
            // Cannot happen: each thread runs once per block. Say so loudly rather than let
            // the accounting drift into a bogus deadlock report.
            fail_locked("cudasim internal error: thread " + std::to_string(t) + " of " +
                        where() + " exited twice");
            return;
        }
        --live;
        warp.live &= ~bit;
        if (aborted.load(std::memory_order_relaxed)) return;
        for (auto& g : warp.groups) {
            if (g->arrived != 0 && g->arrived == (g->mask & warp.live)) complete_group_locked(*g);
        }
        if (bar_arrived > 0 && bar_arrived == live) complete_bar_locked();
        check_deadlock_locked();
    }
};

// Debugging aid ($LOWBIT_CUDASIM_JITTER_US, see lowbit/_cudasim.py): sleep a pseudo-random
// 0..max_us microseconds (0: just yield), to open the windows a loaded machine opens.
inline void jitter(unsigned max_us) {
    if (max_us == 0) return;
    thread_local uint64_t state =
        0x9e3779b97f4a7c15ull ^ static_cast<uint64_t>(reinterpret_cast<uintptr_t>(&state));
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    const unsigned us = static_cast<unsigned>(state % (max_us + 1ull));
    if (us == 0) {
        sched_yield();
        return;
    }
    timespec ts{static_cast<time_t>(us / 1000000), static_cast<long>(us % 1000000) * 1000};
    nanosleep(&ts, nullptr);
}

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

template <class T>
inline T atomic_max(T* address, T val) {
    std::atomic_ref<T> ref(*address);
    T old = ref.load(std::memory_order_relaxed);
    while (old < val && !ref.compare_exchange_weak(old, val, std::memory_order_relaxed)) {
    }
    return old;
}

template <class T>
inline T atomic_min(T* address, T val) {
    std::atomic_ref<T> ref(*address);
    T old = ref.load(std::memory_order_relaxed);
    while (val < old && !ref.compare_exchange_weak(old, val, std::memory_order_relaxed)) {
    }
    return old;
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
