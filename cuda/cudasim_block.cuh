// cudasim, runtime part 1: constants, wait words (futex), warp groups, the spin lock, the
// state of the running block with the bookkeeping of its barriers (deadlock and timeout
// checks), and the jitter debugging aid. Internal to cudasim.
//
// Included only by cudasim.cuh (the entry point and its overview), after the standard headers,
// qualifiers and index types; cudasim_launch.cuh builds on it.
#pragma once

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

}  // namespace lowbit_sim
