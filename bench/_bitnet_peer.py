"""The engines of ``bench/bitnet.py``: lowbit's cached forward and llama.cpp (``llama_cpp``)
behind one interface (``prefill``, ``step`` at a context, ``logits``), the alternating timer,
the per-op profile of a decode step, and the peak-memory subprocess (``python -m bench.bitnet
--rss ENGINE FILE THREADS PREFILL STEPS [BACKEND]``)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import lowbit

REPO = Path(__file__).resolve().parent.parent
#: Pause before each timed block of the other engine: the threads of the one just run (ggml's
#: pool, Numba's OpenMP workers) spin a while after their work and would take a core.
SETTLE_S = 0.05


def _maybe(backend):
    return lowbit.use_backend(backend) if backend else contextlib.nullcontext()


def host(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.get()


def prompt(vocab: int, n: int) -> np.ndarray:
    """The seeded token ids every engine is fed (prepared before any clock)."""
    return np.random.default_rng(1).integers(0, vocab, n).astype(np.int64)


def to_xp(params: dict, xp) -> dict:
    """``params`` with every array moved by ``xp.asarray`` (numpy: the same objects)."""
    if xp is np:
        return params
    from lowbit.models.bitnet import Dense
    from lowbit.ops.quantize import PackedWeight
    out = {}
    for k, v in params.items():
        if isinstance(v, PackedWeight):
            out[k] = PackedWeight(v.format, v.shape, xp.asarray(v.data), xp.asarray(v.scale))
        elif isinstance(v, Dense):
            out[k] = Dense(xp.asarray(v.data), v.dtype)
        else:
            out[k] = xp.asarray(v)
    return out


def ref_weights(params: dict) -> dict:
    """float64 weights in transformers' layout for ``reference/bitnet.py``, decoded by the
    reference's own unpacking."""
    from lowbit.models.bitnet import Dense
    from lowbit.ops.quantize import PackedWeight
    from lowbit.reference.quantize import unpack_weight_ref
    out = {}
    for name, v in params.items():
        if isinstance(v, PackedWeight):
            codes = unpack_weight_ref(host(v.data), v.format, v.shape[0])
            out[name] = (codes * np.float64(host(v.scale))).T
        elif isinstance(v, Dense):
            bits = host(v.data)
            out[name] = ((bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
                         if v.dtype == "bfloat16" else bits.astype(np.float64))
        else:
            out[name] = host(v).astype(np.float64)
    return out


def llama_available() -> tuple[bool, str]:
    try:
        import llama_cpp
    except Exception as exc:  # ImportError, or a broken shared library
        return False, f"llama_cpp does not import ({type(exc).__name__}: {exc})"
    return True, f"llama_cpp {getattr(llama_cpp, '__version__', '?')}"


class Lowbit:
    """lowbit's ``forward`` over one KV cache of one sequence (``capacity`` positions)."""

    def __init__(self, config, params, backend=None, capacity=256, cache=None):
        from lowbit.models import bitnet
        self.bn, self.config, self.params, self.backend = bitnet, config, params, backend
        xp = np if isinstance(params["model.embed_tokens"].data, np.ndarray) else None
        if cache is None:
            if xp is None:
                from lowbit import _backend
                xp = _backend.array_module(params["model.embed_tokens"].data)
            cache = bitnet.new_cache(config, 1, capacity=capacity, xp=xp)
        self.cache = cache

    def prefill(self, ids, start: int = 0, chunk: int = 256):
        """Logits [vocab] of the last of ``ids``, whose first ``start`` are in the cache
        (default none: an empty cache), fed in chunks of ``chunk``."""
        self.cache.lengths[:] = start
        logits = None
        with _maybe(self.backend):
            for i in range(start, len(ids), chunk):
                logits, _ = self.bn.forward(self.config, self.params, ids[i:i + chunk],
                                            self.cache, logits="last")
        return logits

    def step(self, token: int, at: int):
        """Logits [vocab] of ``token`` decoded at position ``at`` (the cache cut back to it)."""
        self.cache.lengths[:] = at
        with _maybe(self.backend):
            logits, _ = self.bn.forward(self.config, self.params, np.array([token]), self.cache,
                                        logits="last")
        return logits


class Llama:
    """``llama_cpp.Llama`` on a GGUF file, ``threads`` threads for decode and batches."""

    def __init__(self, path, threads: int, n_ctx: int, n_batch: int = 512):
        import llama_cpp
        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), n_threads=threads,
                                   n_threads_batch=threads, n_ctx=n_ctx, n_batch=n_batch,
                                   logits_all=False, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def logits(self) -> np.ndarray:
        """A copy of the logits of the last token evaluated."""
        ptr = self.lib.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def prefill(self, ids, start: int = 0) -> None:
        """Evaluate ``ids``, whose first ``start`` are in the cache (default: none)."""
        if start == 0:
            self.llm.reset()
        self.llm.n_tokens = start
        ids = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
        if len(ids) > start:
            self.llm.eval(ids[start:])

    def step(self, token: int, at: int) -> None:
        self.llm.n_tokens = at  # eval drops the cached positions from here on
        self.llm.eval([token])

    def close(self) -> None:
        self.llm.close()


def paired(mine, theirs, rounds: int, block: int) -> tuple[list, list, float]:
    """``mine`` and ``theirs`` timed in alternating blocks of ``block`` calls (the order
    alternating by round, a settle pause before each block), after a warm-up call of each:
    (seconds of each call of mine, of theirs, median over rounds of theirs' block median over
    mine's: mine's speed over theirs)."""
    mine()
    theirs()
    times: tuple[list, list] = ([], [])
    ratios = []
    for r in range(rounds):
        med = [0.0, 0.0]
        for which in ((0, 1) if r % 2 == 0 else (1, 0)):
            fn = (mine, theirs)[which]
            time.sleep(SETTLE_S)
            block_s = []
            for _ in range(block):
                start = time.perf_counter()
                fn()
                block_s.append(time.perf_counter() - start)
            times[which].extend(block_s)
            med[which] = statistics.median(block_s)
        ratios.append(med[1] / med[0])
    return times[0], times[1], statistics.median(ratios)


#: The names in ``lowbit/models/bitnet/_forward.py`` that a decode step calls, by op type.
PROFILED = ("embed", "rms_norm", "packed_matmul", "rotary", "segmented_attention",
            "_activation", "head_logits")


def op_profile(engine: Lowbit, context: int, steps: int) -> list[dict]:
    """Where a decode step at ``context`` spends its time: each op type's calls of
    ``_forward.py`` wrapped in a timer (``PROFILED``; the rest, "other", is Python glue, the
    cache writes and the residual adds), over ``steps`` steps after a warm-up."""
    from lowbit.models.bitnet import _forward
    names = [n for n in PROFILED if callable(getattr(_forward, n, None))]
    totals = {n: 0.0 for n in names}
    calls = {n: 0 for n in names}
    saved = {n: getattr(_forward, n) for n in names}

    def wrap(name, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - start
                calls[name] += 1
        return timed

    engine.step(7, context)
    step_s = 0.0
    try:
        for n in names:
            setattr(_forward, n, wrap(n, saved[n]))
        for _ in range(steps):
            start = time.perf_counter()
            engine.step(7, context)
            step_s += time.perf_counter() - start
    finally:
        for n in names:
            setattr(_forward, n, saved[n])
    rows = [{"op": n, "seconds": totals[n] / steps, "calls": calls[n] // steps,
             "of step": totals[n] / step_s} for n in names]
    other = step_s - sum(totals.values())
    rows.append({"op": "other", "seconds": other / steps, "of step": other / step_s})
    rows.append({"op": "whole step", "seconds": step_s / steps, "of step": 1.0})
    return rows


def peak_rss(engine: str, path, threads: int, prefill: int, steps: int,
             backend: str | None = None) -> dict:
    """``rss_main`` in a fresh process: its JSON result."""
    cmd = [sys.executable, "-m", "bench.bitnet", "--rss", engine, str(path), str(threads),
           str(prefill), str(steps)] + ([backend] if backend else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def peak_rss_mib(key: str = "VmHWM") -> float:
    """This process's peak resident set in MiB: ``VmHWM`` of ``/proc/self/status`` on Linux
    (``ru_maxrss`` is carried across ``fork`` + ``exec``: a child would report its parent's
    peak), else ``ru_maxrss``. ``key="VmRSS"``: the resident set now (Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 2**10  # kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes there, KiB here


def rss_main(argv: list[str]) -> int:
    """The child of ``peak_rss``: load ``FILE`` with ``ENGINE``, prefill ``PREFILL`` tokens,
    decode ``STEPS``; print ``{"base MiB", "loaded MiB", "peak MiB", "load s"}`` (the peak
    resident set after the imports, the resident set after the load, the peak at the end) as
    one JSON line."""
    if len(argv) not in (6, 7) or argv[0] != "--rss":
        print("usage: python -m bench.bitnet --rss ENGINE FILE THREADS PREFILL STEPS [BACKEND]",
              file=sys.stderr)
        return 2
    engine, path, threads, n_prefill, steps = argv[1], argv[2], *map(int, argv[3:6])
    backend = argv[6] if len(argv) == 7 else None
    if engine == "lowbit":
        import numba

        from lowbit.models import bitnet
        numba.set_num_threads(threads)
    else:
        import llama_cpp  # noqa: F401
    base = peak_rss_mib()
    start = time.perf_counter()
    if engine == "lowbit":
        with _maybe(backend):
            config, params, _ = bitnet.load(path)
        vocab = config.vocab_size
        e: Lowbit | Llama = Lowbit(config, params, backend, n_prefill + steps + 1)
    else:
        e = Llama(path, threads, n_prefill + steps + 64)
        vocab = e.n_vocab
    load_s = time.perf_counter() - start
    gc.collect()
    loaded = peak_rss_mib("VmRSS")
    ids = prompt(vocab, n_prefill + steps)
    e.prefill(ids[:n_prefill])
    for i in range(n_prefill, n_prefill + steps):
        e.step(int(ids[i]), i)
    print(json.dumps({"base MiB": base, "loaded MiB": loaded, "peak MiB": peak_rss_mib(),
                      "load s": load_s}))
    return 0
