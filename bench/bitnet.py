"""Suite ``bitnet``: BitNet b1.58 inference (``lowbit/models/bitnet``) on a model with
microsoft/bitnet-b1.58-2B-4T's shapes and random ternary weights made in place (no download),
against this machine's measured read bandwidth and llama.cpp on the same GGUF file.

Rows (CPU; ``--quick``: hidden 256, 2 layers, vocab 1024, the same contexts, seconds in all):

- read bandwidth: a Numba ``prange`` sum over all threads of a uint64 buffer far larger than the
  caches (2 GiB; quick 256 MiB), best of ``BW_REPEATS``: the ceiling of a decode step; measured
  again before each decode context, the bounds using the best seen (``Bandwidth``);
- the relu2 model (BitNet b1.58's FFN, the main figure): made with ``random_params``, written
  with ``save_gguf`` (TQ2_0) and read back with ``load`` (each timed, the load is "load time");
  prefill of 128 tokens (tokens/s), decode at contexts 128 and 1024 (one token after a prefill
  of that length; the cache is set back to that length before each timed step), with the bytes a
  decode step reads (every ternary projection's packed bytes, the bf16 head, the KV cache at that
  context, norms, one embedding row) and the bandwidth bound they imply (target: decode at
  ``BANDWIDTH_TARGET`` of it); the same with ``quantize_head``'s int8 head, and that head's
  logit error and greedy agreement against the 16-bit head; per-op time of a decode step
  (``bench/_bitnet_peer.py``'s ``op_profile``);
- peak memory: the peak resident set (``VmHWM``; ``_bitnet_peer.peak_rss_mib``) of a fresh
  subprocess that loads the relu2 file, prefills 128 tokens and decodes ``RSS_STEPS``, against
  its value after the imports (lowbit; llama.cpp, whose mmap'd file pages count once touched);
- llama.cpp (``llama_cpp``, when it imports; never a dependency of lowbit): its ``bitnet`` graph
  builds the FFN with SiLU whatever the file says, so the comparison runs a "silu" model with
  the same shapes on both sides, from the same file. First the logits of both at the prefill's
  last position and ``CHECK_STEPS`` decode positions (max abs difference, relative RMS, top-1
  agreement; a relative RMS above ``GROSS`` means a layout bug and fails ``agree met``), then
  prefill 128 and decode at 128 and 1024, timed in alternation (``paired``), with the same
  thread count (Numba's); targets: lowbit at least as fast (``PEER_TARGET``). llama.cpp on the
  relu2 file is compared too, to show its SiLU quirk (no target).

With ``--gpu`` (``python -m bench.gpu`` runs it): a small model's decode tokens/s on cupy arrays,
checked first against the same model on the host. Every target is reported, never asserted.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np

import lowbit

from . import _bitnet_peer as peer
from ._harness import Case, Config

SUITE = "bitnet"
#: microsoft/bitnet-b1.58-2B-4T's shapes (the other fields: BitNetConfig's defaults, its too).
FULL = dict(vocab_size=128256, hidden_size=2560, intermediate_size=6912, num_hidden_layers=30,
            num_attention_heads=20, num_key_value_heads=5, head_dim=128)
QUICK = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64)
#: The ``--gpu`` row's model.
GPU_SHAPE = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=128)
PREFILL = 128
CONTEXTS = (128, 1024)
SEED = 0
BANDWIDTH_TARGET = 0.5
PEER_TARGET = 1.0
#: Relative RMS difference of the logits above which two engines disagree grossly.
GROSS = 0.1
#: Decode positions compared after the prefill (lowbit against llama.cpp); head positions.
CHECK_STEPS = 8
HEAD_POSITIONS = 16
RSS_STEPS = 8
BW_REPEATS = 5


def _bn():
    from lowbit.models import bitnet
    return bitnet


def _maybe(backend):
    return lowbit.use_backend(backend) if backend else contextlib.nullcontext()


def _progress(message):
    print(f"  {SUITE}: {message}", file=sys.stderr, flush=True)


# -- read bandwidth -----------------------------------------------------------------------------

@numba.njit(parallel=True, cache=True)
def _fill(a):
    for i in numba.prange(a.shape[0]):
        a[i] = i


@numba.njit(parallel=True, cache=True)
def _read_sum(a, chunks):
    """The sum of ``a`` (uint64, wrapping) in ``chunks`` contiguous parts, one thread each
    (four accumulators: the adds do not wait on one another)."""
    n = a.shape[0]
    step = ((n + chunks - 1) // chunks + 7) // 8 * 8
    part = np.zeros(chunks, np.uint64)
    for c in numba.prange(chunks):
        s0 = s1 = s2 = s3 = np.uint64(0)
        i, hi = c * step, min(n, (c + 1) * step)
        while i + 8 <= hi:
            s0 += a[i] + a[i + 4]
            s1 += a[i + 1] + a[i + 5]
            s2 += a[i + 2] + a[i + 6]
            s3 += a[i + 3] + a[i + 7]
            i += 8
        while i < hi:
            s0 += a[i]
            i += 1
        part[c] = s0 + s1 + s2 + s3
    return part.sum()


class Bandwidth:
    """This machine's read bandwidth: a parallel read (all Numba threads) of a buffer of
    ``nbytes`` far larger than the caches, best of ``repeats`` per ``measure``; ``best`` is the
    best over every measure (the machine is shared: the suite measures again before each decode
    row, and its bound uses the best seen, never a figure depressed by a busy spell)."""

    def __init__(self, nbytes: int):
        self.a = np.empty(nbytes // 8, np.uint64)
        _fill(self.a)  # written by the threads: every page is touched before the clock
        n = self.a.shape[0]
        self.chunks = 16 * numba.get_num_threads()
        if int(_read_sum(self.a, self.chunks)) != (n * (n - 1) // 2) % 2**64:
            raise AssertionError("the bandwidth kernel's sum is wrong")
        self.best = 0.0

    def measure(self, repeats: int = BW_REPEATS) -> dict:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            _read_sum(self.a, self.chunks)
            times.append(time.perf_counter() - start)
        gbs = self.a.nbytes / min(times) / 1e9
        self.best = max(self.best, gbs)
        return {"seconds": min(times), "GB/s": gbs}

    def close(self) -> None:
        self.a = np.empty(0, np.uint64)


# -- timing ---------------------------------------------------------------------------------------

def time_steps(fn, calls: int, min_s: float) -> list[float]:
    """Seconds of each of at least ``calls`` calls of ``fn`` (and ``min_s`` in all, at most 4x
    ``calls``), after one warm-up call."""
    fn()
    out: list[float] = []
    begin = time.perf_counter()
    while len(out) < calls or (time.perf_counter() - begin < min_s and len(out) < 4 * calls):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def model_bytes(config, params) -> dict:
    """Bytes a decode step reads from the parameters: ternary projections, head, norms, and the
    embedding row it looks up."""
    from lowbit.ops.quantize import PackedWeight
    bn = _bn()
    head = params.get("lm_head", params["model.embed_tokens"])
    proj = sum(v.nbytes for k, v in params.items() if isinstance(v, PackedWeight)
               and k != "lm_head")
    norms = sum(v.nbytes for v in params.values() if isinstance(v, np.ndarray))
    emb = params["model.embed_tokens"]
    row = emb.nbytes // config.vocab_size if isinstance(emb, bn.Dense) else 0
    return {"projections": proj, "head": int(head.nbytes), "norms": norms, "embedding row": row}


def kv_bytes(config, context: int, itemsize: int = 4) -> int:
    """KV cache bytes a decode step at ``context`` reads (its own new row included)."""
    return (2 * config.num_hidden_layers * (context + 1) * config.num_key_value_heads
            * config.head_dim * itemsize)


def _rel(a, b) -> dict:
    """``a`` against ``b`` (rows of logits): max abs difference, its share of max |b|, the
    relative RMS of the difference (against b's spread about its row means), top-1 agreement."""
    a, b = np.atleast_2d(np.asarray(a, np.float64)), np.atleast_2d(np.asarray(b, np.float64))
    d = a - b
    spread = np.sqrt(np.mean((b - b.mean(axis=-1, keepdims=True)) ** 2))
    agree = int(np.sum(a.argmax(-1) == b.argmax(-1)))
    big = float(np.abs(d).max())
    return {"max |diff|": big, "of max": big / float(np.abs(b).max()),
            "rms diff": float(np.sqrt(np.mean(d ** 2)) / spread), "top-1": f"{agree}/{len(a)}"}


def _config(shape, act):
    return _bn().BitNetConfig(**shape, hidden_act=act)


def check_small(backend=None, xp=np) -> None:
    """A tiny model's cached prefill and decode against the float64 reference (before timing)."""
    from lowbit.reference.bitnet import bitnet_ref
    bn = _bn()
    config = _config(dict(vocab_size=61, hidden_size=64, intermediate_size=96,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16), "relu2")
    params = bn.random_params(config, seed=3)
    ids = np.random.default_rng(4).integers(0, config.vocab_size, 9)
    with _maybe(backend):
        dev = peer.to_xp(params, xp)
        first, cache = bn.forward(config, dev, ids[:6])
        rest = [bn.forward(config, dev, ids[i:i + 1], cache)[0] for i in range(6, 9)]
    got = np.concatenate([peer.host(first)] + [peer.host(r) for r in rest])
    ref = bitnet_ref(config, peer.ref_weights(params), ids)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    if not err <= 2e-3:
        raise AssertionError(f"bitnet logits: relative error {err:.2e} against the reference")


# -- the suite ------------------------------------------------------------------------------------

#: Timing per shape: decode (rounds of alternation, calls per block), prefill (calls, rounds).
TIMING = {True: dict(rounds=5, block=5, prefill=5, prefill_rounds=5, profile=10),
          False: dict(rounds=5, block=3, prefill=2, prefill_rounds=3, profile=3)}


def cases(config: Config):
    if config.gpu:
        yield from gpu_cases(config)
        return
    shape = QUICK if config.quick else FULL
    timing = TIMING[config.quick]
    backend = config.backend
    threads = numba.get_num_threads()
    load = os.getloadavg()
    print(f"load average (1, 5, 15 min): {load}; Numba threads {threads} (NUMBA_NUM_THREADS "
          f"{os.environ.get('NUMBA_NUM_THREADS', 'unset')}), llama.cpp n_threads the same")
    print("tokens/s: per-call medians (best: the fastest call); decode at context c: one token "
          "after a prefill of c, the cache cut back to c before each call; MB/token: bytes a "
          "decode step reads (ternary packed bytes, head, KV cache, norms); bound: read "
          "bandwidth / MB/token; x llama.cpp, x bf16 head: timed in alternation, median of "
          "the rounds' ratios; peak MiB: VmHWM of a fresh process (load, prefill, decode)")
    nbytes = (256 if config.quick else 2048) * 2**20
    _progress(f"reading {nbytes / 2**30:.2f} GiB, {BW_REPEATS} times ...")
    bw = Bandwidth(nbytes)
    yield Case(SUITE, "read bandwidth", check=lambda: check_small(backend),
               info={**bw.measure(), "threads": threads,
                     "note": f"{nbytes / 2**30:g} GiB, load {load[0]:.0f}"})
    with tempfile.TemporaryDirectory(prefix="lowbit_bench_bitnet_") as tmp:
        relu2_file = Path(tmp) / "relu2.gguf"
        kept: dict = {}
        yield from _relu2_rows(shape, relu2_file, bw, backend, timing, kept)
        bw.close()
        gc.collect()
        have_llama, why = peer.llama_available()
        yield from _rss_rows(relu2_file, threads, backend, have_llama)
        if not have_llama:
            yield Case(SUITE, "llama.cpp rows skipped", info={"note": why})
            print(f"(llama.cpp rows skipped: {why})")
            return
        yield from _relu2_quirk_row(relu2_file, threads, kept["logits"])
        relu2_file.unlink()
        yield from _peer_rows(shape, Path(tmp) / "silu.gguf", threads, backend, timing)


def _speed(steps: list[float], tokens: int = 1) -> dict:
    s = statistics.median(steps)
    return {"seconds": s, "tokens/s": tokens / s, "best tok/s": tokens / min(steps)}


def _bound(config, params, context, bw, steps) -> dict:
    """The bandwidth bound of a decode step at ``context`` and the share of it reached."""
    per_token = sum(model_bytes(config, params).values()) + kv_bytes(config, context)
    bound = bw.best * 1e9 / per_token
    share = 1 / statistics.median(steps) / bound
    return {"MB/token": per_token / 1e6, "GB/s": bw.best, "bound tok/s": bound, "of bound": share,
            "target": BANDWIDTH_TARGET, "met": bool(share >= BANDWIDTH_TARGET)}


def _load(bn, path, backend):
    start = time.perf_counter()
    with _maybe(backend):
        config, params, _ = bn.load(path)
    return config, params, time.perf_counter() - start


def _relu2_rows(shape, path, bw, backend, timing, kept):
    bn = _bn()
    config = _config(shape, "relu2")
    _progress("making the relu2 model in place ...")
    start = time.perf_counter()
    params = bn.random_params(config, seed=SEED)
    made = time.perf_counter() - start
    b = model_bytes(config, params)
    yield Case(SUITE, "relu2 make (random_params)",
               info={"seconds": made, "note": f"ternary {b['projections'] / 1e6:.0f} MB, "
                     f"head {b['head'] / 1e6:.0f} MB"})
    start = time.perf_counter()
    bn.save_gguf(path, config, params, "TQ2_0")
    yield Case(SUITE, "relu2 save_gguf TQ2_0", info={
        "seconds": time.perf_counter() - start, "note": f"{path.stat().st_size / 1e6:.0f} MB"})
    del params
    gc.collect()
    _progress("loading the relu2 GGUF file ...")
    config, params, seconds = _load(bn, path, backend)
    yield Case(SUITE, "relu2 load (GGUF -> lowbit)", info={"seconds": seconds})
    ids = peer.prompt(config.vocab_size, max(CONTEXTS) + CHECK_STEPS)
    engine = peer.Lowbit(config, params, backend, max(CONTEXTS) + CHECK_STEPS + 1)
    _progress(f"prefill {PREFILL} ...")
    steps = time_steps(lambda: engine.prefill(ids[:PREFILL]), timing["prefill"], 0.0)
    kept["logits"] = peer.host(engine.prefill(ids[:PREFILL]))
    yield Case(SUITE, f"relu2 prefill {PREFILL}", info=_speed(steps, PREFILL))
    with _maybe(backend):
        q = bn.quantize_head(config, params)
    head = peer.Lowbit(config, q, backend, cache=engine.cache)
    at = PREFILL
    for c in CONTEXTS:
        engine.prefill(ids[:c], start=min(at, c))
        at = c
        bw.measure()
        _progress(f"decode at {c}, 16-bit and int8 head in alternation ...")
        int8, bf16, ratio = peer.paired(lambda c=c: head.step(7, c),
                                        lambda c=c: engine.step(7, c), timing["rounds"],
                                        timing["block"])
        yield Case(SUITE, f"relu2 decode @{c}",
                   info={**_speed(bf16), **_bound(config, params, c, bw, bf16)})
        yield Case(SUITE, f"relu2 int8 head decode @{c}",
                   info={**_speed(int8), **_bound(config, q, c, bw, int8),
                         "x bf16 head": ratio})
        _progress(f"profiling a decode step at {c} ...")
        for r in peer.op_profile(engine, c, timing["profile"]):
            yield Case(SUITE, f"relu2 decode @{c} profile: {r.pop('op')}", info=r)
    with _maybe(backend):
        ref = peer.host(bn.forward(config, params, ids[:HEAD_POSITIONS])[0])
        got = peer.host(bn.forward(config, q, ids[:HEAD_POSITIONS])[0])
    yield Case(SUITE, f"relu2 int8 head logits ({HEAD_POSITIONS} positions)",
               info=_rel(got, ref))
    del engine, head, params, q
    gc.collect()


def _rss_rows(path, threads, backend, have_llama):
    for engine in ["lowbit"] + (["llama.cpp"] if have_llama else []):
        _progress(f"peak memory of {engine} in a fresh process ...")
        r = peer.peak_rss(engine, path, threads, PREFILL, RSS_STEPS, backend)
        yield Case(SUITE, f"peak RSS {engine} (ms: its load)",
                   info={"seconds": r["load s"], "peak MiB": r["peak MiB"],
                         "base MiB": r["base MiB"], "loaded MiB": r["loaded MiB"]})


def _relu2_quirk_row(path, threads, lowbit_logits):
    """llama.cpp on the relu2 file against lowbit's relu2 logits (its FFN runs SiLU)."""
    ids = peer.prompt(len(lowbit_logits), PREFILL)
    llm = peer.Llama(path, threads, PREFILL + 64)
    llm.prefill(ids)
    row = _rel(llm.logits(), lowbit_logits)
    llm.close()
    yield Case(SUITE, "relu2 file: llama.cpp vs lowbit",
               info={**row, "note": "llama.cpp's FFN is SiLU"})


def _peer_rows(shape, path, threads, backend, timing):
    bn = _bn()
    config = _config(shape, "silu")
    _progress("making, writing and loading the silu model ...")
    params = bn.random_params(config, seed=SEED)
    bn.save_gguf(path, config, params, "TQ2_0")
    del params
    gc.collect()
    config, params, seconds = _load(bn, path, backend)
    yield Case(SUITE, "silu load: lowbit", info={"seconds": seconds})
    n_ctx = max(CONTEXTS) + CHECK_STEPS + 64
    start = time.perf_counter()
    llm = peer.Llama(path, threads, n_ctx)
    yield Case(SUITE, "silu load: llama.cpp", info={"seconds": time.perf_counter() - start,
                                                    "note": "mmap"})
    engine = peer.Lowbit(config, params, backend, n_ctx)
    ids = peer.prompt(config.vocab_size, max(CONTEXTS) + CHECK_STEPS)
    _progress("checking llama.cpp's logits against lowbit's ...")
    mine = [engine.prefill(ids[:PREFILL])]
    llm.prefill(ids[:PREFILL])
    theirs = [llm.logits()]
    for i in range(PREFILL, PREFILL + CHECK_STEPS):
        mine.append(engine.step(int(ids[i]), i))
        llm.step(int(ids[i]), i)
        theirs.append(llm.logits())
    row = _rel(theirs, mine)
    row["agree met"] = bool(row["rms diff"] <= GROSS)
    if not row["agree met"]:
        print(f"\n!!! llama.cpp and lowbit DISAGREE GROSSLY on the same file (relative RMS "
              f"{row['rms diff']:.3f} > {GROSS}): a layout bug (q/k order in the export?)\n")
    yield Case(SUITE, f"silu: llama.cpp vs lowbit logits ({CHECK_STEPS + 1} positions)",
               info=row)
    _progress(f"prefill {PREFILL}, in alternation ...")
    prompt_ids, prompt_list = ids[:PREFILL], ids[:PREFILL].tolist()
    mine_s, theirs_s, ratio = peer.paired(lambda: engine.prefill(prompt_ids),
                                          lambda: llm.prefill(prompt_list),
                                          timing["prefill_rounds"], 1)
    yield from _peer_pair(f"silu prefill {PREFILL}", mine_s, theirs_s, ratio, PREFILL)
    at = PREFILL
    for c in CONTEXTS:
        engine.prefill(ids[:c], start=min(at, c))
        llm.prefill(ids[:c], start=min(at, c))
        at = c
        _progress(f"decode at {c}, in alternation ...")
        mine_s, theirs_s, ratio = peer.paired(lambda c=c: engine.step(7, c),
                                              lambda c=c: llm.step(7, c), timing["rounds"],
                                              timing["block"])
        yield from _peer_pair(f"silu decode @{c}", mine_s, theirs_s, ratio)
    llm.close()
    del engine, params
    gc.collect()


def _peer_pair(name, mine_s, theirs_s, ratio, tokens=1):
    yield Case(SUITE, f"{name}: llama.cpp", info=_speed(theirs_s, tokens))
    yield Case(SUITE, f"{name}: lowbit", info={
        **_speed(mine_s, tokens), "x llama.cpp": ratio, "target": PEER_TARGET,
        "peer met": bool(ratio >= PEER_TARGET)})


# -- GPU ------------------------------------------------------------------------------------------

def gpu_cases(config: Config, xp=None, shape=None, sync=None):
    """A small model's decode tokens/s on ``xp`` arrays (cupy), its logits checked first against
    the same model on the host (numpy, the default backend) over a prefill and ``CHECK_STEPS``
    decode steps. ``xp``, ``shape`` and ``sync`` let a host run rehearse it."""
    bn = _bn()
    if xp is None:
        import cupy as xp

        def sync():
            xp.cuda.Device().synchronize()
    sync = sync or (lambda: None)
    backend = config.backend
    mconfig = _config(shape or GPU_SHAPE, "relu2")
    host = bn.random_params(mconfig, seed=SEED)
    engine = peer.Lowbit(mconfig, peer.to_xp(host, xp), backend,
                         max(CONTEXTS) + CHECK_STEPS + 1)
    ids = peer.prompt(mconfig.vocab_size, max(CONTEXTS) + CHECK_STEPS)
    tail = range(PREFILL, PREFILL + CHECK_STEPS)
    got = [peer.host(engine.prefill(ids[:PREFILL]))]
    got += [peer.host(engine.step(int(ids[i]), i)) for i in tail]
    ref = peer.Lowbit(mconfig, host, None, PREFILL + CHECK_STEPS + 1)
    want = [ref.prefill(ids[:PREFILL])] + [ref.step(int(ids[i]), i) for i in tail]
    agree = _rel(got, want)
    if not agree["rms diff"] <= 1e-2:
        raise AssertionError(f"bitnet on the device: logits off the host's by "
                             f"{agree['rms diff']:.2e} (relative RMS)")
    engine.prefill(ids[:max(CONTEXTS)])
    label = f"{mconfig.num_hidden_layers} layers, hidden {mconfig.hidden_size}"
    for c in CONTEXTS:
        def step(c=c):
            engine.step(7, c)
            sync()

        s = statistics.median(time_steps(step, 10, 0.5))
        yield Case(SUITE, f"gpu decode @{c} ({label})",
                   info={"seconds": s, "tokens/s": 1 / s, **agree,
                         "note": "logits vs the host's, prefill + decode"})


if __name__ == "__main__":
    sys.exit(peer.rss_main(sys.argv[1:]))
