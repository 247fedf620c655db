"""The timing harness and the card's measured ceilings of ``bench/gpu_kernels.py``: rows
(``Row``), their runner (``Runner``: arrays, backend and clocks, cupy on the GPU and numpy on
cudasim in the dry run), the result checks, and the copy and FMA ceiling rows."""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Callable

import numpy as np

import lowbit
from lowbit import _backend

from ._harness import Config

REPEATS = 5
#: Seconds of calls in one timed sample (at most ``MAX_INNER`` calls).
SAMPLE_S = 0.02
MAX_INNER = 200
UNITS = {"GB/s": 1e9, "TFLOP/s": 1e12, "tokens/s": 1.0}
COPY_BYTES = 512 * 2**20
FMA_CHAINS, FMA_ITERS, FMA_BLOCK, FMA_WAVES = 8, 4096, 256, 4
_CARD_SOURCE = r"""
extern "C" __global__ void bench_fma(float* __restrict__ out, float b, float c, int iters) {
    // out: [gridDim.x * blockDim.x]; independent chains keep every FP32 lane issuing.
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    float a[CHAINS];
#pragma unroll
    for (int j = 0; j < CHAINS; ++j) a[j] = 0.125f * (j + 1) + 1e-4f * (float)(i & 1023);
#pragma unroll 16
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int j = 0; j < CHAINS; ++j) a[j] = fmaf(a[j], b, c);
    }
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < CHAINS; ++j) sum += a[j];
    out[i] = sum;
}

extern "C" __global__ void bench_spin(long long ns) {
    // Holds the stream while the host queues the calls a sample times; a timer read takes well
    // over a nanosecond, so the read count bounds the spin even if the timer stood still.
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    for (long long reads = 0; reads < ns; ++reads) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start >= (unsigned long long)ns) break;
    }
}
""".replace("CHAINS", str(FMA_CHAINS))


class Skip(Exception):
    """A row that cannot run here; the message says why."""


@dataclasses.dataclass
class Row:
    """One row. ``prepare(row)`` builds the inputs, checks the result (raising on a wrong one),
    may set ``work`` and ``info``, and returns the zero-argument call that is timed.

    ``clock``: "cupy" (CUDA events), "queued" (events, the calls queued behind a spin kernel) or
    "torch" (torch's CUDA events). ``work`` in ``unit`` per call gives the rate; ``ceiling`` and
    ``peer`` name rows of the same group whose rate this one's is divided by (``share``, ``x
    peer``), each with an optional aim.
    """

    name: str
    prepare: Callable
    unit: str
    work: float | None = None
    clock: str = "cupy"
    ceiling: str | None = None
    aim: float | None = None
    peer: str | None = None
    peer_aim: float | None = None
    info: dict = dataclasses.field(default_factory=dict)


class Runner:
    """The arrays, backend and clocks of one group's run (cupy on the GPU, numpy in the dry run)."""

    def __init__(self, config: Config):
        self.gpu = config.gpu
        self.backend = config.backend or ("cuda" if self.gpu else "cudasim")
        if self.gpu:
            import cupy

            self.xp = cupy
        else:
            self.xp = np
        self.repeats = REPEATS if self.gpu else 1
        self.spin_ns = 2_000_000

    def forced(self):
        return lowbit.use_backend(self.backend)

    def need_gpu(self, what):
        if not self.gpu:
            raise Skip(f"{what}: needs cupy and a CUDA device (dry run)")

    def torch(self):
        """torch, on a CUDA device when on the GPU; Skip when it cannot run here."""
        try:
            import torch
        except ImportError:
            raise Skip("torch not installed") from None
        if self.gpu and not torch.cuda.is_available():
            raise Skip("torch sees no CUDA device")
        return torch

    def to_torch(self, torch, a):
        return torch.from_dlpack(a) if self.gpu else torch.from_numpy(a)

    def from_torch(self, t):
        t = t.detach().contiguous()
        return self.xp.from_dlpack(t) if self.gpu else t.numpy()

    def normal(self, shape, seed):
        if self.gpu:
            return self.xp.random.RandomState(seed).standard_normal(shape, dtype=np.float32)
        return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)

    def uniform(self, shape, seed, low, high):
        if self.gpu:
            return self.xp.random.RandomState(seed).uniform(low, high, shape, dtype=np.float32)
        return np.random.default_rng(seed).uniform(low, high, shape).astype(np.float32)

    def time(self, fn, clock):
        """(best, median) seconds per call and the calls per sample, after a warm-up call."""
        fn()
        inner = 1
        if self.gpu:
            once = self._sample(fn, 1, clock)
            inner = max(1, min(MAX_INNER, int(SAMPLE_S / max(once, 1e-7))))
        samples = [self._sample(fn, inner, clock) for _ in range(self.repeats)]
        return min(samples), statistics.median(samples), inner

    def _sample(self, fn, inner, clock):
        if not self.gpu:
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            return (time.perf_counter() - start) / inner
        cp = self.xp
        if clock == "torch":  # torch's events on torch's stream, as its users time it
            torch = self.torch()
            torch.cuda.synchronize()
            start, stop = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        else:
            cp.cuda.Device().synchronize()
            start, stop = cp.cuda.Event(), cp.cuda.Event()
        if clock == "queued":
            _card_module(cp).get_function("bench_spin")((1,), (1,), (np.int64(self.spin_ns),))
        start.record()
        wall = time.perf_counter()
        for _ in range(inner):
            fn()
        wall = time.perf_counter() - wall
        stop.record()
        stop.synchronize()
        if clock == "queued" and wall * 1e9 > self.spin_ns / 2:
            # The host outran the spin: this sample saw launch gaps; the next ones will not.
            self.spin_ns = int(3 * wall * 1e9)
        ms = start.elapsed_time(stop) if clock == "torch" else cp.cuda.get_elapsed_time(start,
                                                                                          stop)
        return ms * 1e-3 / inner


@functools.cache
def _card_module(cp):
    return cp.RawModule(code=_CARD_SOURCE)


# -- checks -----------------------------------------------------------------------------------

def host(a):
    return a if isinstance(a, np.ndarray) else a.get()


def rel_rms(ref, got):
    """Relative RMS error of ``got`` against ``ref`` (numpy or cupy, same kind)."""
    xp = _backend.array_module(ref)
    ref, got = ref.astype(np.float64), xp.asarray(got).astype(np.float64)
    scale = max(float(xp.sqrt(xp.mean(ref * ref))), 1e-30)
    return float(xp.sqrt(xp.mean((got - ref) ** 2))) / scale


def require(row, label, ref, got, rtol):
    """Record ``label``'s relative RMS error in the row; raise when it is above ``rtol``."""
    err = rel_rms(ref, got)
    row.info[f"err {label}"] = err
    if not err <= rtol:
        raise AssertionError(f"{label}: relative RMS error {err:.2e} above {rtol:.0e}")


# -- the ceilings ----------------------------------------------------------------------------

def copy_row(run):
    def prepare(row):
        run.need_gpu("the copy ceiling")
        cp = run.xp
        src = cp.arange(COPY_BYTES // 4, dtype=cp.uint32)
        dst = cp.zeros_like(src)

        def call():
            dst.data.copy_from_device_async(src.data, src.nbytes)

        call()
        if not bool((dst == src).all()):
            raise AssertionError("the device copy differs from its source")
        row.work = 2 * src.nbytes
        return call

    return Row("copy device to device (ceiling)", prepare, "GB/s",
               info={"bytes": COPY_BYTES, "counted": "read + written"})


def fma_row(run):
    def prepare(row):
        run.need_gpu("the FMA peak")
        cp = run.xp
        kernel = _card_module(cp).get_function("bench_fma")
        sms = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"]
        per_sm = 2048 // FMA_BLOCK  # resident threads per SM on sm_80 / sm_90
        blocks = FMA_WAVES * per_sm * sms
        out = cp.empty(blocks * FMA_BLOCK, cp.float32)
        b, c = 0.99, 0.01

        def call():
            kernel((blocks,), (FMA_BLOCK,), (out, np.float32(b), np.float32(c),
                                             np.int32(FMA_ITERS)))

        call()
        got = host(out)
        for i in (0, 1, out.size - 1):
            chains = 0.125 * np.arange(1, FMA_CHAINS + 1) + 1e-4 * float(np.float32(i & 1023))
            for _ in range(FMA_ITERS):
                chains = chains * b + c
            if abs(got[i] - chains.sum()) > 1e-4 * chains.sum():
                raise AssertionError(f"FMA chains of thread {i}: {got[i]} != {chains.sum()}")
        row.work = 2.0 * FMA_CHAINS * FMA_ITERS * out.size
        row.info.update(blocks=blocks, threads=FMA_BLOCK)
        return call

    return Row("fp32 FMA peak (ceiling)", prepare, "TFLOP/s")
