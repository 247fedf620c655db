"""Suite ``gpu_kernels`` of ``python -m bench.gpu``: the GPU kernels against ceilings and peers
measured in the same process, in four groups that ``bench/gpu.py`` runs as steps of their own
(``gpu_kernels.gemv``, ...), so that a kernel that faults (a CUDA error poisons the process's
context) or hangs costs its group only.

- ``gemv``: the card's copy rate (``cudaMemcpyAsync`` of 512 MiB, device to device; GB/s counts
  bytes read and written), then packed ternary weights with int8 activations, K = N = 4096 and
  8192, M = 1, 2, 4, 8: the public ``lowbit.packed_matmul`` (it reads one status word back per
  call), and its two backend kernels alone (activation codes, then the product, through the
  backend contract of ``lowbit/ops/__init__.py``) queued behind a spin kernel, so that their GPU
  time is measured and not Python's launch rate. GB/s of the packed weight bytes and their share
  of the copy's (aim 0.5 for the kernels). Calls cycle through copies of the weight, 4x the L2
  cache in all, so the weight comes from DRAM as in a decode step.
- ``gemm``: M = N = K = 4096, ``cupy.matmul`` on float16 (cuBLAS) against packed ternary and
  int8 weights with int8 activations: TFLOP/s (TOPS), ratio to cuBLAS (aim 1.0).
- ``attention``: the measured fp32 FMA peak (independent ``fmaf`` chains, four waves of blocks),
  then ``lowbit.segmented_attention`` in fp32 at ``bench/attention.py``'s GPU shape (T = 65536 in
  segments of 512 to 2048, H = 8, D = 64), forward and forward + backward: TFLOP/s by
  FlashAttention's count and share of the FMA peak (aim 0.4); torch's SDPA in fp32 on CUDA, one
  call per segment on tensors built before the clock, as the peer.
- ``scans``: the gated delta rule (B = 16, T = 8192, H = 8, K = V = 64) forward and backward,
  tokens/s, against flash-linear-attention's Triton ``chunk_gated_delta_rule`` (fp32 inputs in its
  own [B, T, H, K] layout, ``scale=1`` so it computes lowbit's function; its ``tl.dot`` products
  run in TF32, hence ``FLA_RTOL``); the selective scan (P = 64, N = 16) alone.

Every row checks before it is timed: lowbit against the float64 references of ``reference/`` on
a slice (two rows and four columns of a product; the shortest segment, first and last head;
batch 0, head 0, the first ``SCAN_TOKENS`` tokens of a scan, whose backward gets a ``dout`` that
is zero elsewhere), peers against lowbit's whole result. Timing: a warm-up call, then the best and
the median of ``REPEATS`` samples between CUDA events on a synchronized device, each sample
enough calls for ``SAMPLE_S``. A failing row records its error and the next one runs; every
finished row is written out at once, so a group killed at its time limit keeps what it measured.
``--dry-run`` runs the same code on the cudasim backend at tiny shapes with the CPU clock and
skips what needs a CUDA device, saying so. The timing harness (``Row``, ``Runner``, the clocks)
and the two ceiling rows are ``bench/_gpu_harness.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
import traceback

import numpy as np

import lowbit
from lowbit import _dispatch
from lowbit.ops.quantize import ACT_FORMATS
from lowbit.reference.gated_delta_scan import gated_delta_scan_bwd_ref, gated_delta_scan_ref
from lowbit.reference.packed_matmul import packed_matmul_ref
from lowbit.reference.segmented_attention import (segmented_attention_bwd_ref,
                                                  segmented_attention_ref)
from lowbit.reference.selective_scan import selective_scan_bwd_ref, selective_scan_ref

from ._gpu_harness import UNITS, Row, Runner, Skip, copy_row, fma_row, host, require
from ._harness import Config
from .attention import _lengths

SUITE = "gpu_kernels"
GROUPS = ("gemv", "gemm", "attention", "scans")
#: Relative RMS error allowed against the float64 references, torch's SDPA and fla (TF32).
REF_RTOL = 1e-5
TORCH_RTOL = 1e-4
FLA_RTOL = 5e-2
#: The weight copies a GEMV row cycles through hold this many times the L2 cache.
L2_PASSES = 4
#: Tokens of a scan checked against the reference: past the first 64-token chunk.
SCAN_TOKENS = 66
#: Shapes on the GPU (True) and in the dry run (False): gemv (K = N sizes, row counts), gemm
#: (M = N = K), attention (T, shortest and longest segment, H), scans (B, T, H, K = V = P, N).
SHAPES = {True: {"gemv": ((4096, 8192), (1, 2, 4, 8)), "gemm": 4096,
                 "attention": (65536, 512, 2048, 8), "scans": (16, 8192, 8, 64, 16)},
          False: {"gemv": ((32,), (1, 3)), "gemm": 16, "attention": (64, 16, 40, 2),
                  "scans": (1, 8, 2, 16, 8)}}
def run_group(group: str, config: Config, progress=print, emit=lambda rows: None) -> list[dict]:
    """Check and time every row of ``group``; ``emit(rows)`` after each one (a row in progress
    is written as unfinished first, so a group killed in it says where it stopped)."""
    runner = Runner(config)
    rows = {"gemv": _gemv_rows, "gemm": _gemm_rows, "attention": _attention_rows,
            "scans": _scan_rows}[group](runner)
    results = []
    for row in rows:
        progress(f"  {SUITE}.{group}/{row.name} ...")
        results.append({"suite": f"{SUITE}.{group}", "case": row.name,
                        "error": "unfinished: killed at the step's limit, or crashed"})
        emit(results)
        result = dict(results[-1])
        del result["error"]
        try:
            fn = row.prepare(row)
            best, median, inner = runner.time(fn, row.clock)
            result.update(seconds=best, median_s=median, calls_per_sample=inner)
            if row.work:
                result[row.unit] = row.work / best / UNITS[row.unit]
        except Skip as why:
            result["skipped"] = str(why)
        except Exception as error:  # recorded in the row; the next rows still run
            result["error"] = f"{type(error).__name__}: {error}"[:600]
            progress(traceback.format_exc())
        result.update(row.info)
        results[-1] = result
        _compare(rows, results)
        emit(results)
    return results


def _compare(rows, results):
    """Shares of the ceilings and ratios to the peers, for every pair measured so far."""
    by_name = {r["case"]: r for r in results}
    for row, result in zip(rows, results):
        for other, key, aim, met in ((row.ceiling, "share", row.aim, "met"),
                                     (row.peer, "x peer", row.peer_aim, "peer met")):
            base = by_name.get(other)
            if other is None or base is None or not base.get(row.unit) or not result.get(
                    row.unit):
                continue
            result[key] = result[row.unit] / base[row.unit]
            result["ceiling" if key == "share" else "peer"] = other
            if aim is not None:
                result[met] = result[key] >= aim


def _check_product(x, pw, y):
    """Rows 0 and M - 1, four columns of ``y = packed_matmul(x, pw, "int8")``, bit for bit."""
    M, K = x.shape
    N = pw.shape[1]
    rows, cols = sorted({0, M - 1}), sorted({0, 1, N // 2, N - 1})
    scale = host(pw.scale)
    ref = packed_matmul_ref(host(x[rows]), host(pw.data[cols]),
                            scale if scale.ndim == 0 else scale[cols], pw.format, K, "int8")
    got = host(y[rows][:, cols])
    if not np.array_equal(got, ref):
        raise AssertionError(f"{pw.format} product differs from the reference at rows {rows}, "
                             f"columns {cols}: max |diff| {np.abs(got - ref).max():.3g}")


# -- gemv and gemm ----------------------------------------------------------------------------

def _weight_copies(run, K, N):
    with run.forced():
        pw = lowbit.quantize_weight(run.normal((K, N), K), "ternary")
    count = 2
    if run.gpu:
        props = run.xp.cuda.runtime.getDeviceProperties(run.xp.cuda.Device().id)
        count = max(2, -(-L2_PASSES * int(props.get("l2CacheSize", 64 * 2**20)) // pw.nbytes))
    return [pw] + [dataclasses.replace(pw, data=pw.data.copy()) for _ in range(count - 1)]


def _gemv_rows(run):
    rows = [copy_row(run)]
    ceiling = rows[0].name
    sizes, ms = SHAPES[run.gpu]["gemv"]
    for K in sizes:
        weights = functools.cache(lambda K=K: _weight_copies(run, K, K))
        for M in ms:
            x = functools.cache(lambda M=M, K=K: run.normal((M, K), M))

            def prepare(row, weights=weights, x=x):
                ws, xs = weights(), x()
                with run.forced():
                    want = lowbit.packed_matmul(xs, ws[0], "int8")
                    _, quantize = _dispatch.resolve("quantize", xs)
                    _, product = _dispatch.resolve("packed_matmul", xs, ws[0].data)
                _check_product(xs, ws[0], want)

                def launch(pw, queued=row.clock == "queued"):
                    if not queued:
                        with run.forced():
                            return lowbit.packed_matmul(xs, pw, "int8")
                    codes, scale = quantize.row_codes(xs, ACT_FORMATS["int8"])
                    return product.matmul_int(codes, scale, pw.data, pw.scale, pw.format,
                                              pw.shape[0])

                if not bool((launch(ws[-1]) == want).all()):
                    raise AssertionError("a copy of the weight gives another product")
                row.work = ws[0].nbytes
                row.info["weight copies"] = len(ws)
                cycle = itertools.cycle(ws)
                return lambda: launch(next(cycle))

            shape = {"shape": f"{M}x{K}x{K}", "format": "ternary/int8"}
            rows.append(Row(f"gemv {M}x{K}x{K} packed_matmul", prepare, "GB/s",
                            ceiling=ceiling, info=dict(shape)))
            rows.append(Row(f"gemv {M}x{K}x{K} kernels, queued", prepare, "GB/s",
                            clock="queued", ceiling=ceiling, aim=0.5, info=dict(shape)))
    return rows


def _gemm_rows(run):
    n = SHAPES[run.gpu]["gemm"]
    xp = run.xp
    inputs = functools.cache(lambda: (run.normal((n, n), 2), run.normal((n, n), 1)))
    peer = f"gemm {n}^3 f16 cupy.matmul (cuBLAS)"

    def f16(row):
        x, w = inputs()
        x16, w16 = x.astype(np.float16), w.astype(np.float16)
        rows, cols = [0, n - 1], [0, n // 2, n - 1]
        ref = host(x16[rows]).astype(np.float64) @ host(w16[:, cols]).astype(np.float64)
        require(row, "vs float64", ref, host(xp.matmul(x16, w16)[rows][:, cols]), 5e-3)
        return lambda: xp.matmul(x16, w16)

    rows = [Row(peer, f16, "TFLOP/s", work=2.0 * n**3)]
    for fmt in ("ternary", "int8"):
        def packed(row, fmt=fmt):
            x, w = inputs()
            with run.forced():
                pw = lowbit.quantize_weight(w, fmt)
                _check_product(x, pw, lowbit.packed_matmul(x, pw, "int8"))
            row.info["weight B"] = pw.nbytes

            def call():
                with run.forced():
                    lowbit.packed_matmul(x, pw, "int8")
            return call

        rows.append(Row(f"gemm {n}^3 {fmt}/int8 packed_matmul", packed, "TFLOP/s",
                        work=2.0 * n**3, peer=peer, peer_aim=1.0))
    return rows


# -- attention ------------------------------------------------------------------------------

def _attention_rows(run):
    tokens, low, high, heads = SHAPES[run.gpu]["attention"]
    dim = 64
    lengths = _lengths(np.random.default_rng(0), tokens, low, high)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    fwd_flops = 4.0 * sum(n * n for n in lengths) * heads * dim
    shape = {"T": tokens, "segments": len(lengths), "H": heads, "D": dim}
    inputs = functools.cache(lambda: tuple(run.normal((tokens, heads, dim), s) for s in range(4)))
    shortest = int(np.argmin(lengths))
    s0, s1 = int(offsets[shortest]), int(offsets[shortest + 1])
    sl = (slice(s0, s1), [0, heads - 1])

    def sliced(a):
        return host(a[sl[0]][:, sl[1]])

    @functools.cache
    def lowbit_both():
        q, k, v, dout = inputs()
        with run.forced():
            out, ctx = lowbit.segmented_attention_forward(q, k, v, lengths)
            return out, lowbit.segmented_attention_backward(dout, ctx)

    def fwd(row):
        q, k, v, _ = inputs()
        with run.forced():
            out = lowbit.segmented_attention(q, k, v, lengths)
        ref, _ = segmented_attention_ref(*map(sliced, (q, k, v)), [s1 - s0])
        require(row, "out vs float64", ref, sliced(out), REF_RTOL)

        def call():
            with run.forced():
                lowbit.segmented_attention(q, k, v, lengths)
        return call

    def both(row):
        q, k, v, dout = inputs()
        out, grads = lowbit_both()
        ref, _ = segmented_attention_ref(*map(sliced, (q, k, v)), [s1 - s0])
        require(row, "out vs float64", ref, sliced(out), REF_RTOL)
        refs = segmented_attention_bwd_ref(*map(sliced, (dout, q, k, v)), [s1 - s0])
        for name, ref, got in zip(("dq", "dk", "dv"), refs, grads):
            require(row, f"{name} vs float64", ref, sliced(got), REF_RTOL)

        def call():
            with run.forced():
                _, ctx = lowbit.segmented_attention_forward(q, k, v, lengths)
                lowbit.segmented_attention_backward(dout, ctx)
        return call

    def torch_rows(step):
        def prepare(row):
            torch = run.torch()
            sdpa = torch.nn.functional.scaled_dot_product_attention
            bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist()))

            def per_segment(a):
                t = run.to_torch(torch, a)
                return [t[a0:a1].transpose(0, 1).unsqueeze(0).contiguous() for a0, a1 in bounds]

            def tokens_major(parts):
                return run.from_torch(torch.cat([p[0].transpose(0, 1) for p in parts]))

            q, k, v, dout = (per_segment(a) for a in inputs())
            out, grads = lowbit_both()
            if step == "fwd":
                def call():
                    with torch.no_grad():
                        return [sdpa(*qkv) for qkv in zip(q, k, v)]

                require(row, "out vs lowbit", out, tokens_major(call()), TORCH_RTOL)
                return call
            leaves = [[t.clone().requires_grad_() for t in qkv] for qkv in zip(q, k, v)]

            def call():
                for ls, d in zip(leaves, dout):
                    for t in ls:
                        t.grad = None
                    sdpa(*ls).backward(d)

            call()
            for i, name in enumerate(("dq", "dk", "dv")):
                require(row, f"{name} vs lowbit", grads[i],
                         tokens_major([ls[i].grad for ls in leaves]), TORCH_RTOL)
            return call
        return prepare

    fma = fma_row(run)
    flops = {"fwd": fwd_flops, "fwd+bwd": 3.5 * fwd_flops}
    rows = [fma]
    for step, prepare in (("fwd", fwd), ("fwd+bwd", both)):
        peer = f"attention {step} torch sdpa fp32, per segment"
        rows.append(Row(f"attention {step} segmented_attention fp32", prepare, "TFLOP/s",
                        work=flops[step], ceiling=fma.name, aim=0.4, peer=peer,
                        info=dict(shape)))
        rows.append(Row(peer, torch_rows(step), "TFLOP/s", work=flops[step], clock="torch",
                        ceiling=fma.name, info=dict(shape)))
    return rows


# -- scans ----------------------------------------------------------------------------------

def _fla(run):
    """(torch, chunk_gated_delta_rule), or Skip with the reason."""
    if importlib.util.find_spec("fla") is None:
        raise Skip("fla not installed (fla-core: bench.gpu installs bench/results/wheels/*.whl)")
    run.need_gpu("fla's Triton kernels")
    torch = run.torch()
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as error:  # fla-core is pure Python: any import failure is reported
        raise Skip(f"fla does not import: {type(error).__name__}: {error}") from None
    return torch, chunk_gated_delta_rule


def _scan_rows(run):
    nb, nt, nh, nk, nn = SHAPES[run.gpu]["scans"]
    nv = npp = nk
    t0 = min(SCAN_TOKENS, nt)
    xp = run.xp
    token = (slice(0, 1), slice(0, t0), slice(0, 1))  # batch 0, the first t0 tokens, head 0

    @functools.cache
    def gdr():
        k = run.normal((nb, nt, nh, nk), 11)
        k /= xp.sqrt((k * k).sum(-1, keepdims=True))
        return (run.normal((nb, nt, nh, nk), 10), k, run.normal((nb, nt, nh, nv), 12),
                -run.uniform((nb, nt, nh), 13, 0.0, 0.3), run.uniform((nb, nt, nh), 14, 0.0, 1.0),
                run.normal((nb, nh, nk, nv), 15), run.normal((nb, nt, nh, nv), 16))

    @functools.cache
    def ssm():
        return (run.normal((nb, nt, nh, npp), 20), run.normal((nb, nt, nh, nn), 21),
                run.normal((nb, nt, nh, nn), 22), run.normal((nb, nt, nh), 23) - 1.0,
                0.5 * run.normal((nh,), 24), 0.5 * run.normal((nh,), 25), run.normal((nh,), 26),
                run.normal((nb, nh, npp, nn), 27), run.normal((nb, nt, nh, npp), 28))

    def head_slice(a):
        """The checked slice of an input or gradient: per-token, per-head vector or state."""
        if a.ndim == 1:
            return host(a[:1])
        return host(a[token] if a.shape[:2] == (nb, nt) else a[:1, :1])

    def masked(dout):
        out = xp.zeros_like(dout)
        out[token] = dout[token]
        return out

    def op_rows(op, data, forward, backward, ref, bwd_ref, names):
        @functools.cache
        def lowbit_run():
            """(out, state, ctx) of the forward and a function of the backward's gradients."""
            with run.forced():
                out, state, ctx = forward(*data()[:-2], initial_state=data()[-2])

            @functools.cache
            def grads():
                with run.forced():
                    return backward(data()[-1], None, ctx)
            return out, state, ctx, grads

        def fwd(row):
            inputs = data()[:-1]
            with run.forced():
                out = forward(*inputs[:-1], initial_state=inputs[-1])[0]
            require(row, "out vs float64", ref(*map(head_slice, inputs))[0], head_slice(out),
                     REF_RTOL)

            def call():
                with run.forced():
                    forward(*inputs[:-1], initial_state=inputs[-1])
            return call

        def bwd(row):
            inputs, dout = data()[:-1], data()[-1]
            ctx = lowbit_run()[2]
            with run.forced():
                grads = backward(masked(dout), None, ctx)
            refs = bwd_ref(*map(head_slice, inputs), head_slice(dout))
            for name, r, got in zip(names, refs, grads):
                require(row, f"{name} vs float64", r, head_slice(got), REF_RTOL)

            def call():
                with run.forced():
                    backward(dout, None, ctx)
            return call

        dims = {"shape": f"B={nb} T={nt} H={nh}", "checked": f"b=0 h=0 t<{t0}"}
        return lowbit_run, [Row(f"{op} {d} lowbit", p, "tokens/s", work=nb * nt,
                                peer=f"{op} {d} fla chunk_gated_delta_rule (Triton)"
                                if op == "gated_delta" else None, info=dict(dims))
                            for d, p in (("forward", fwd), ("backward", bwd))]

    gdr_run, rows = op_rows("gated_delta", gdr, lowbit.gated_delta_scan_forward,
                            lowbit.gated_delta_scan_backward, gated_delta_scan_ref,
                            gated_delta_scan_bwd_ref,
                            ("dq", "dk", "dv", "dlog_decay", "dbeta", "dinitial_state"))
    rows += op_rows("selective", ssm, lowbit.selective_scan_forward,
                    lowbit.selective_scan_backward, selective_scan_ref, selective_scan_bwd_ref,
                    ("dx", "dB", "dC", "ddt", "ddt_bias", "dA_log", "dD",
                     "dinitial_state"))[1]

    def fla_rows(direction):
        def prepare(row):
            torch, chunk = _fla(run)
            xp.cuda.Device().synchronize()
            leaves = [run.to_torch(torch, a).clone().requires_grad_() for a in gdr()[:-1]]
            dout = run.to_torch(torch, gdr()[-1])
            out, state, _, grads = gdr_run()
            grads = grads()

            def forward():
                q, k, v, g, beta, h0 = leaves
                return chunk(q, k, v, g, beta, scale=1.0, initial_state=h0,
                             output_final_state=True)

            if direction == "forward":
                o, ht = forward()
                require(row, "out vs lowbit", out, run.from_torch(o), FLA_RTOL)
                require(row, "state vs lowbit", state, run.from_torch(ht), FLA_RTOL)
                return forward
            graph = forward()[0]

            def call():
                return torch.autograd.grad(graph, leaves, dout, retain_graph=True)

            names = ("dq", "dk", "dv", "dlog_decay", "dbeta", "dinitial_state")
            for name, want, got in zip(names, grads, call()):
                require(row, f"{name} vs lowbit", want, run.from_torch(got), FLA_RTOL)
            return call
        return prepare

    rows += [Row(f"gated_delta {d} fla chunk_gated_delta_rule (Triton)", fla_rows(d), "tokens/s",
                 work=nb * nt, clock="torch", info={"dtype": "float32 (TF32 products)"})
             for d in ("forward", "backward")]
    return rows
