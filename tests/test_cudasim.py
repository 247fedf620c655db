"""Tests of cudasim: the emulation header ``cuda/cudasim.cuh`` (with the parts it includes,
``cuda/cudasim_*.cuh``) and its loader ``lowbit/_cudasim.py``, with the test kernels of
``tests/cuda/sim_kernels.cu``.

One module holds every test kernel so that the suite compiles it once (the default cache
keeps it between runs). The failure paths, thread start-up and build cache are
``tests/test_cudasim_runtime.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from lowbit import _cudasim

pytestmark = pytest.mark.skipif(not _cudasim.available(), reason=_cudasim.unavailable_reason())

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
INCLUDE_DIRS = [str(ROOT / "cuda"), str(TESTS / "cuda")]
SOURCE = (TESTS / "cuda" / "sim_kernels.cu").read_text()

#: Every kernel of tests/cuda/sim_kernels.cu; tests/test_nvrtc.py compiles the same list.
NAME_EXPRESSIONS = (
    "block_reduce_sum",
    "transpose_tiled",
    "dyn_shared_reverse",
    "histogram",
    "atomics_misc",
    "grid_coords",
    "scale_add<2, float>",
    "scale_add<3, int>",
    "scale_add<-1, long long>",
    "shuffle_ops",
    "shuffle_halves",
    "shuffle_wide",
    "dp4a_kernel",
    "ldmatrix_probe",
    "cp_async_probe",
    "math_ops",
    "bit_ops",
    "sync_votes",
    "early_exit_barrier",
    "divergent_barrier",
    "true_deadlock",
    "slow_thread",
    "staggered_barrier",
    "trap_kernel",
    "assert_kernel",
)
WARP = 32
POISON_INT = -1  # what a shuffle returns for a lane that does not take part (all bits set)
BOUNDED_S = 10.0  # a failing launch must return well within this


@pytest.fixture(scope="module")
def mod():
    return _cudasim.load_module(SOURCE, NAME_EXPRESSIONS, INCLUDE_DIRS)


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def cdiv(a, b):
    return -(-a // b)


# ------------------------------------------------------------------------------------------
# Kernels against numpy
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("blocks,threads", [(3, 96), (64, 256)])
def test_block_reduce_shuffle_and_shared(mod, rng, blocks, threads):
    x = rng.standard_normal(blocks * threads).astype(np.float32)
    partial = np.full(blocks, np.nan, np.float32)
    mod.get_function("block_reduce_sum")(blocks, threads, (x, partial, np.int32(x.size)))
    expected = x.reshape(blocks, threads).astype(np.float64).sum(axis=1)
    np.testing.assert_allclose(partial, expected, rtol=1e-5, atol=1e-4)


def test_transpose_tiled_odd_sizes(mod, rng):
    rows, cols = 37, 45
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    out = np.full((cols, rows), np.nan, np.float32)
    mod.get_function("transpose_tiled")((cdiv(cols, 32), cdiv(rows, 32)), (32, 8),
                                        (x, out, np.int32(rows), np.int32(cols)))
    np.testing.assert_array_equal(out, x.T)


def test_dynamic_shared_memory(mod, rng):
    n, threads = 300, 128
    blocks = cdiv(n, threads)
    x = rng.standard_normal(n).astype(np.float32)
    y = np.full(n, np.nan, np.float32)
    info = np.zeros(2, np.int32)
    kernel = mod.get_function("dyn_shared_reverse")
    kernel(blocks, threads, (x, y, info, np.int32(n)), shared_mem=threads * 4)
    padded = np.zeros(blocks * threads, np.float32)
    padded[:n] = x
    expected = padded.reshape(blocks, threads)[:, ::-1].reshape(-1)[:n]
    np.testing.assert_array_equal(y, expected)
    assert info[0] == 0, "dynamic shared memory must be 16-byte aligned"
    assert info[1] == POISON_INT, "dynamic shared memory is poisoned before each block"


def test_dynamic_shared_memory_limit(mod):
    kernel = mod.get_function("dyn_shared_reverse")
    args = (np.zeros(32, np.float32), np.zeros(32, np.float32), np.zeros(2, np.int32),
            np.int32(32))
    with pytest.raises(RuntimeError, match="launched with shared_mem=0"):
        kernel(1, 32, args)
    big = 64 * 1024
    with pytest.raises(ValueError, match="max_dynamic_shared_size_bytes"):
        kernel(1, 32, args, shared_mem=big)
    previous = kernel.max_dynamic_shared_size_bytes
    kernel.max_dynamic_shared_size_bytes = big
    try:
        kernel(1, 32, args, shared_mem=big)
    finally:
        kernel.max_dynamic_shared_size_bytes = previous


def test_atomic_histogram(mod, rng):
    n, nbins = 5000, 17
    x = rng.integers(0, 1000, n).astype(np.int32)
    bins = np.zeros(nbins, np.int32)
    mod.get_function("histogram")(4, 128, (x, bins, np.int32(n), np.int32(nbins)))
    np.testing.assert_array_equal(bins, np.bincount(x % nbins, minlength=nbins))


def test_atomics_misc(mod):
    blocks, threads = 3, 64
    total = blocks * threads
    out = np.array([-1, 1 << 30, 0, 0, 0, 0, 0, -1], np.int32)
    uout = np.zeros(2, np.uint32)
    fout = np.zeros(1, np.float32)
    big = np.zeros(1, np.uint64)
    mod.get_function("atomics_misc")(blocks, threads, (out, uout, fout, big))
    g = np.arange(total)
    bits = np.bitwise_or.reduce(1 << (g % 31))
    assert out[0] == total - 1
    assert out[1] == 0
    assert out[2] == bits
    assert out[3] == 7
    assert 1 <= out[4] <= total
    assert out[5] == g.sum()
    assert out[6] == -total
    assert out[7] == np.int32(-1) & ~np.int32(bits)
    assert uout[0] == 2 * total
    assert uout[1] == total % 10  # atomicInc wraps after 9
    assert fout[0] == 0.5 * total
    assert big[0] == total << 33


def test_3d_grid_coordinates(mod):
    grid, block = (3, 2, 2), (4, 3, 2)
    nblocks, nthreads = int(np.prod(grid)), int(np.prod(block))
    out = np.full((nblocks, nthreads, 12), -7, np.int32)
    mod.get_function("grid_coords")(grid, block, (out,))
    bz, by, bx = np.meshgrid(*(np.arange(d) for d in grid[::-1]), indexing="ij")
    tz, ty, tx = np.meshgrid(*(np.arange(d) for d in block[::-1]), indexing="ij")
    b_idx = np.stack([bx.ravel(), by.ravel(), bz.ravel()], axis=1)
    t_idx = np.stack([tx.ravel(), ty.ravel(), tz.ravel()], axis=1)
    np.testing.assert_array_equal(out[:, :, 0:3], np.repeat(b_idx[:, None, :], nthreads, 1))
    np.testing.assert_array_equal(out[:, :, 3:6], np.repeat(t_idx[None, :, :], nblocks, 0))
    np.testing.assert_array_equal(out[:, :, 6:9], np.broadcast_to(grid, (nblocks, nthreads, 3)))
    np.testing.assert_array_equal(out[:, :, 9:12],
                                  np.broadcast_to(block, (nblocks, nthreads, 3)))


@pytest.mark.parametrize("name,dtype,scale", [
    ("scale_add<2, float>", np.float32, 2),
    ("scale_add<3, int>", np.int32, 3),
    ("scale_add<-1, long long>", np.int64, -1),
])
def test_template_instantiations(mod, rng, name, dtype, scale):
    n = 1000  # not a multiple of the block: the last threads return early
    x = (rng.standard_normal(n) * 100).astype(dtype)
    y = np.zeros(n, dtype)
    offset = dtype(5)
    kernel = mod.get_function(name)
    assert kernel.param_sizes == (8, 8, np.dtype(dtype).itemsize, 8)
    kernel(cdiv(n, 256), 256, (x, y, offset, np.int64(n)))
    np.testing.assert_array_equal(y, x * dtype(scale) + offset)


def _shuffle_expected(x, nthreads, src, delta, width):
    """The CUDA programming guide's shuffle semantics, lane by lane."""
    rows = np.zeros((9, nthreads), np.int64)
    for t in range(nthreads):
        warp0 = t // WARP * WARP
        exists = min(WARP, nthreads - warp0)
        lane = t - warp0
        seg = lane // width * width

        def read(j):
            return x[warp0 + j] if j < exists else POISON_INT

        rows[0, t] = read(seg + src % width)
        rows[1, t] = read(lane - delta) if lane - seg >= delta else x[t]
        rows[2, t] = read(lane + delta) if lane - seg + delta < width else x[t]
        partner = lane ^ delta
        rows[3, t] = read(partner) if partner < seg + width else x[t]
        vals = x[warp0:warp0 + exists]
        rows[4, t] = np.int32(np.uint32(sum(1 << j for j in range(exists) if vals[j] & 1)))
        rows[5, t] = int(any(vals == 3))
        rows[6, t] = int(all(vals >= 0))
        rows[7, t] = np.int32(np.uint32((1 << exists) - 1))
        rows[8, t] = vals.sum()
    return rows


@pytest.mark.parametrize("nthreads,src,delta,width", [
    (32, 5, 1, 32),
    (64, 17, 3, 16),
    (64, 2, 2, 8),
    (32, 1, 1, 2),
    (40, 1, 4, 32),  # partial second warp of 8 lanes
    (48, 3, 5, 4),   # partial warp with sub-warp segments
])
def test_shuffle_variants(mod, nthreads, src, delta, width):
    x = (np.arange(nthreads) * 7 + 2).astype(np.int32)
    x[5] = 3
    if nthreads > 33:
        x[33] = -4
    out = np.full((9, nthreads), 12345, np.int32)
    mod.get_function("shuffle_ops")(1, nthreads, (x, out, np.int32(src), np.int32(delta),
                                                  np.int32(width)))
    np.testing.assert_array_equal(out, _shuffle_expected(x, nthreads, src, delta, width))


def test_shuffle_with_half_warp_masks(mod):
    x = np.arange(64, dtype=np.int32) * 3
    out = np.zeros(64, np.int32)
    mod.get_function("shuffle_halves")(1, 64, (x, out))
    lane = np.arange(64) % WARP
    base = np.arange(64) - lane
    expected = np.where(lane < 16, x[base + 15], -x[base + 16])
    np.testing.assert_array_equal(out, expected)


def test_shuffle_64bit(mod, rng):
    x = rng.standard_normal(WARP)
    sums = np.zeros(WARP)
    rot = np.zeros(WARP, np.int64)
    mod.get_function("shuffle_wide")(1, WARP, (x, sums, rot))
    np.testing.assert_allclose(sums, np.full(WARP, x.sum()), rtol=1e-12)
    np.testing.assert_array_equal(rot, (1 << 40) + (np.arange(WARP) + 1) % WARP)


def test_dp4a(mod, rng):
    n = 200
    a = rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
    b = rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
    c = rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
    a[0], b[0], c[0] = -1, -1, 2**31 - 1  # wraps
    out_s = np.zeros(n, np.int32)
    out_u = np.zeros(n, np.uint32)
    mod.get_function("dp4a_kernel")(cdiv(n, 64), 64, (a, b, c, out_s, out_u, np.int32(n)))
    sa, sb = a.view(np.int8).reshape(n, 4), b.view(np.int8).reshape(n, 4)
    ua, ub = a.view(np.uint8).reshape(n, 4), b.view(np.uint8).reshape(n, 4)
    exp_s = (sa.astype(np.int64) * sb).sum(1) + c
    exp_u = (ua.astype(np.int64) * ub).sum(1) + c.view(np.uint32)
    np.testing.assert_array_equal(out_s, exp_s.astype(np.uint64).astype(np.uint32).view(np.int32))
    np.testing.assert_array_equal(out_u, exp_u.astype(np.uint64).astype(np.uint32))


def test_ldmatrix_twin_layout(mod, rng):
    """ldmatrix.x4 / .x2 (cuda/common.cuh): lane l gets word l % 4 of row l // 4 of matrix i,
    the row whose address lane 8 i + l // 4 gave (PTX ISA, m8n8 .b16 fragments)."""
    x = rng.integers(0, 2**32, 4 * 8 * 4, dtype=np.uint64).astype(np.uint32)
    out = np.zeros((WARP, 6), np.uint32)
    mod.get_function("ldmatrix_probe")(1, WARP, (x, out))
    lane = np.arange(WARP)
    # lane 8 i + j gave tile row 8 i + 7 - j
    expected = np.stack([x[(8 * i + 7 - lane // 4) * 4 + lane % 4] for i in range(4)], axis=1)
    np.testing.assert_array_equal(out[:, :4], expected)
    np.testing.assert_array_equal(out[:, 4:], expected[:, :2])


def test_cp_async_groups_and_zero_fill(mod, rng):
    n = 40  # a partial second warp
    src = rng.integers(0, 256, 32 * n, dtype=np.uint8)
    nbytes = np.stack([rng.integers(0, 17, n), rng.integers(0, 9, n), rng.integers(0, 5, n)], 1)
    nbytes[0] = (16, 8, 4)
    nbytes[1] = (0, 0, 0)
    out = np.zeros((n, 45), np.uint8)
    mod.get_function("cp_async_probe")(1, n, (src, nbytes.astype(np.int32).ravel(), out))
    landed = np.zeros((n, 28), np.uint8)
    for t in range(n):
        for offset, size, count in zip((0, 16, 24), (16, 8, 4), nbytes[t]):
            landed[t, offset:offset + count] = src[32 * t + offset:32 * t + offset + count]
    assert (out[:, 0] == 0xab).all(), "cudasim writes a cp.async destination at the wait"
    np.testing.assert_array_equal(out[:, 1:17], landed[:, :16])
    np.testing.assert_array_equal(out[:, 17:], np.roll(landed, -1, axis=0))


def test_cp_async_misaligned_source_is_an_error(mod):
    n = 2
    src = np.zeros(32 * n + 1, np.uint8)[1:]  # 16-byte cp.async from an odd address
    with pytest.raises(RuntimeError, match="cp.async of 16 bytes .* must be aligned"):
        mod.get_function("cp_async_probe")(1, n, (src, np.full(3 * n, 4, np.int32),
                                                  np.zeros((n, 45), np.uint8)))


def test_math_intrinsics(mod, rng):
    specials = [0.5, 1.5, 2.5, -0.5, -2.5, 3.5, 0.0, -0.0, 1e10, -1e10, np.inf, np.nan]
    x = np.concatenate([specials, rng.standard_normal(40) * 4]).astype(np.float32)
    n = x.size
    out = np.full((n, 12), np.nan, np.float32)
    mod.get_function("math_ops")(cdiv(n, 32), 32, (x, out, np.int32(n)))
    with np.errstate(all="ignore"):
        f2i = np.where(np.isnan(x), 0, np.clip(np.rint(x.astype(np.float64)), -2**31, 2**31 - 1))
        bits = x.view(np.int32)
        t = np.arange(n)
        exact = {
            2: f2i.astype(np.float32),
            3: np.rint(x),
            4: np.fmax(x, np.float32(0.5)),
            5: np.fmin(x, np.float32(0.5)),
            6: np.where(np.isnan(x), 0, np.clip(x, 0, 1)).astype(np.float32),
            10: (np.minimum(bits, 0).astype(np.int64) + np.maximum(t, 3)).astype(np.float32),
            11: (bits ^ np.int32(-2**31)).view(np.float32),
        }
        approx = {
            0: np.exp(x.astype(np.float64)),
            1: 1 / np.sqrt(np.abs(x.astype(np.float64)) + 1),
            7: np.log1p(np.abs(x.astype(np.float64))),
            8: np.exp2(x.astype(np.float64)),
            9: x.astype(np.float64) / 3,
        }
    for col, expected in exact.items():
        np.testing.assert_array_equal(out[:, col], expected, err_msg=f"column {col}")
    for col, expected in approx.items():
        np.testing.assert_allclose(out[:, col], expected.astype(np.float32), rtol=2e-6,
                                   err_msg=f"column {col}")


def test_bit_intrinsics(mod, rng):
    x = np.concatenate([[0, 1, 0x80000000, 0xffffffff, 0x00f0f000],
                        rng.integers(0, 2**32, 40, dtype=np.uint64)]).astype(np.uint32)
    n = x.size
    out = np.zeros((n, 5), np.uint32)
    mod.get_function("bit_ops")(cdiv(n, 32), 32, (x, out, np.int32(n)))
    for i, v in enumerate(int(v) for v in x):
        src = (0x76543210 << 32) | v
        perm = sum(((src >> (8 * sel)) & 0xff) << (8 * k) for k, sel in enumerate((2, 5, 1, 4)))
        expected = [
            bin(v).count("1"),
            32 - v.bit_length(),
            (v & -v).bit_length(),
            int(f"{v:032b}"[::-1], 2),
            perm,
        ]
        assert out[i].tolist() == expected, f"x = {v:#x}"


@pytest.mark.parametrize("pattern", ["ones", "mixed", "zeros"])
def test_syncthreads_votes(mod, pattern):
    n = 96
    pred = {"ones": np.ones(n), "zeros": np.zeros(n), "mixed": np.arange(n) % 3 == 0}[pattern]
    pred = pred.astype(np.int32)
    out = np.full(3, -5, np.int32)
    mod.get_function("sync_votes")(1, n, (pred, out))
    assert out.tolist() == [pred.sum(), int(pred.all()), int(pred.any())]


def test_early_return_then_barrier(mod, rng):
    n = 40  # threads 40..63 return before the __syncthreads()
    x = rng.standard_normal(64).astype(np.float32)
    y = np.full(64, np.nan, np.float32)
    mod.get_function("early_exit_barrier")(1, 64, (x, y, np.int32(n)))
    np.testing.assert_array_equal(y[:n], x[:n][::-1])
    assert np.isnan(y[n:]).all()


def _header_intrinsics() -> set[str]:
    """Names the Device API part of the emulation header, cuda/cudasim_device.cuh, defines for
    kernels (not its internals)."""
    api = (ROOT / "cuda" / "cudasim_device.cuh").read_text()
    api = re.sub(r"namespace lowbit_sim \{.*?\}  // namespace lowbit_sim", "", api, flags=re.S)
    names = set(re.findall(r"^\s*(?:\[\[noreturn\]\]\s+)?inline\s+[\w:<>\s*&]*?\b(\w+)\s*\(",
                           api, flags=re.M))
    names |= set(re.findall(r"^LOWBIT_SIM_ATOMIC_RMW\((\w+),", api, flags=re.M))
    names |= set(re.findall(r"^#define (\w+)\(", api, flags=re.M))
    # Upper-case names are macro parameters (NAME in LOWBIT_SIM_ATOMIC_RMW).
    return {n for n in names if not n.startswith("lowbit_sim") and not n.isupper()}


def test_every_intrinsic_of_the_header_is_used():
    """The emulation header carries what kernels use and nothing more: every intrinsic it
    defines is called by a kernel (cuda/*.cu and the headers beside them, but the emulation
    header's own cudasim*.cuh) or a test kernel here."""
    sources = [*(ROOT / "cuda").glob("*.cu"),
               *(h for h in (ROOT / "cuda").glob("*.cuh") if not h.name.startswith("cudasim")),
               *(TESTS / "cuda").glob("*.cu")]
    used = set(re.findall(r"\w+", "\n".join(s.read_text() for s in sources)))
    defined = _header_intrinsics()
    assert {"__shfl_xor_sync", "atomicAdd", "__trap", "min", "clock64", "assert"} <= defined
    assert sorted(defined - used) == []
