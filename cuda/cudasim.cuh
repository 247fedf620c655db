// cudasim: compile lowbit's CUDA C++ kernels with g++ and run them on the CPU.
//
// lowbit/_cudasim_build.py force-includes this header (g++ -include) in front of a
// cuda/<op>.cu file and defines LOWBIT_CUDASIM, lowbit/_cudasim.py appends one extern "C"
// trampoline per name expression, and the result is built into a shared library;
// tests/test_cudasim.py tests the header with tests/cuda/*.cu. The dynamic shared memory macro
// that kernels use lives in cuda/common.cuh and calls lowbit_sim_dynamic_shared() from
// cudasim_device.cuh.
//
// This file is the one entry point: it includes the standard headers and declares the
// qualifiers, index types and built-in index variables, then includes its parts from this
// folder: cudasim_block.cuh (runtime: wait words, warp groups, the block's state and barrier
// checks), cudasim_launch.cuh (runtime: worker pool, barrier entry points, the launcher
// lowbit_sim_launch) and cudasim_device.cuh (the Device API kernels call).
//
// Execution model (see docs/architecture.rst, "Checks on the kernels"):
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
// declared here and in cudasim_device.cuh, and nothing they do not use: tests/test_cudasim.py
// holds every intrinsic to a use in cuda/*.cu or tests/cuda/*.cu (add one together with a test
// kernel). The g++ side also sees the C++ standard headers included below; the NVRTC compile
// check (lowbit/_nvrtc.py) is what keeps kernels free of them.
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
// The parts, in the order they build on each other; nothing else includes them.
// ---------------------------------------------------------------------------------------------
#include "cudasim_block.cuh"   // runtime: wait words, warp groups, block state, barriers
#include "cudasim_launch.cuh"  // runtime: worker pool, barrier entry points, launcher
#include "cudasim_device.cuh"  // Device API: the intrinsics kernels call
