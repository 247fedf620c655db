"""``mpiexec -n 2 python -m bench train --distributed [--quick]``: data-parallel training.

The model and batches of the main job (``bench/train.py``; ``--quick``: its CI shape) trained
with ``lowbit.models.train.train(..., comm=)`` under fp32 and ternary+int8, at 1 rank (rank 0
alone, 1 and then all numba threads, while the other ranks wait) and at every rank of the job (1
thread each): tokens/s per rank and in total, the time per step spent averaging gradients (it
includes waiting for the slowest rank). Then the bytes on the wire: the fp32 gradient bucket of
a step, the master weights in fp32 against the ternary projections packed (2 bits a weight plus
a scale; ``embed`` and ``lm_head`` stay fp32), each broadcast and timed; and the bandwidth of
``allreduce_mean``'s bucket against a plain mpi4py ``Allreduce`` of the same bytes, in the same
run. Every part checks its result before it is timed. Without ``mpiexec`` only the 1-rank rows
run. The communicator: ``lowbit/distributed/``; tests ``tests/test_distributed.py``.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

import lowbit
from lowbit import distributed
from lowbit.models import bdh
from lowbit.models import train as training

from . import _harness, train

#: The main job's model and batch, trained long enough for a steady rate.
DIST = dict(train.MAIN, steps=20, eval_every=0, eval_batches=2)
QUICK = dict(train.QUICK, eval_every=0, eval_batches=2)
NAMES = ("fp32", "ternary+int8")
REPEATS = 15


def _threads(n):
    try:
        import numba

        numba.set_num_threads(n)
        return numba.get_num_threads()
    except ImportError:
        return 1


def _trained(name, run, corpus, comm):
    plan, saved, kind = train.CONFIGS[name]
    config = train.model_config(run, plan, saved)
    params = bdh.init_params(config, train.PARAM_SEED)
    batches = training.Batches(corpus, block=run["block"], batch=run["batch"],
                               seed=train.DATA_SEED, rank=comm.rank)
    schedule = training.Schedule(kind, lr=run["lr"], weight_decay=0.1, warmup=run["warmup"],
                                 steps=run["steps"])
    history = training.train(config, params, batches, schedule, seed=train.DROPOUT_SEED,
                             eval_batches=run["eval_batches"], progress=False, comm=comm)
    return config, params, history


def speed_rows(run, corpus, world, progress):
    """Training rows at 1 rank (1 and all threads) and at ``world.size`` ranks (1 thread each)."""
    cpus = _harness.threads()["cpus"]
    plans = [(1, 1), (1, cpus)] if cpus > 1 else [(1, 1)]
    if world.size > 1:
        plans.append((world.size, 1))
    rows, trained = [], {}
    for name in NAMES:
        for ranks, threads in plans:
            progress(f"  {name}: {ranks} rank(s) x {threads} thread(s) ...")
            threads = _threads(threads)
            comm = world if ranks == world.size else distributed.Communicator()
            result = None
            if world.rank < ranks:
                config, params, history = _trained(name, run, corpus, comm)
                result = (history["tokens_per_s"], history["comm_s"] / run["steps"],
                          history["val"][-1][1])
                if ranks == world.size:
                    trained[name] = (config, params)
            per_rank = [r for r in world.allgather_object(result) if r is not None]
            rate = [r[0] for r in per_rank]
            rows.append({"case": name, "ranks": ranks, "threads/rank": threads,
                         "tokens/s per rank": statistics.mean(rate), "tokens/s total": sum(rate),
                         "comm ms/step": 1e3 * statistics.mean(r[1] for r in per_rank),
                         "val loss": per_rank[0][2]})
    _threads(cpus)
    for r in rows:
        best = max(b["tokens/s total"] for b in rows if b["case"] == r["case"] and b["ranks"] == 1)
        r["total vs best 1 rank"] = r["tokens/s total"] / best
    return rows, trained


def _packed(config, params):
    """The ternary projections of the plan, packed (``lowbit.quantize_weight``), per head."""
    out = []
    for name in ("encoder", "encoder_v", "decoder"):
        w = params[name]
        out += [lowbit.quantize_weight(m, "ternary") for m in (w if w.ndim == 3 else [w])]
    return out


def _timed(world, *fns):
    """Median seconds of each of ``fns`` over ``REPEATS`` rounds, after one untimed call each
    (MPI sets up a message size at its first use); the fns alternate within a round and every
    rank starts each call together."""
    times = [[] for _ in fns]
    for round_ in range(REPEATS + 1):
        for fn, out in zip(fns, times):
            world.allgather_object(None)
            begin = time.perf_counter()
            fn()
            if round_:
                out.append(time.perf_counter() - begin)
    return [statistics.median(t) for t in times]


def wire_rows(world, config, params):
    """Bytes (and broadcast time) of the master weights in fp32 against ternary packed."""
    names = sorted(params)
    fp32 = [params[n].copy() for n in names]
    packed = _packed(config, params)
    wire = [p.data for p in packed] + [p.scale for p in packed] + \
        [params["embed"].copy(), params["lm_head"].copy()]
    mine = [a.copy() for a in wire]
    world.broadcast(wire)  # the ranks trained to the same bits: rank 0's packing is theirs
    for i, (a, b) in enumerate(zip(wire, mine)):
        if not np.array_equal(a, b):
            raise AssertionError(f"packed weights: array {i} differs from rank 0's")
    dense = sum(a.nbytes for a in fp32)  # also the gradient bucket's: one fp32 per parameter
    fp32_s, wire_s = _timed(world, lambda: world.broadcast(fp32), lambda: world.broadcast(wire))
    rows = [{"case": "gradient bucket per step (fp32)", "bytes": dense, "vs fp32": 1.0},
            {"case": "master weights fp32", "bytes": dense, "vs fp32": 1.0,
             "broadcast ms": 1e3 * fp32_s},
            {"case": "ternary packed (2 bits + scale) + fp32 embed, lm_head",
             "bytes": sum(a.nbytes for a in wire), "vs fp32": sum(a.nbytes for a in wire) / dense,
             "broadcast ms": 1e3 * wire_s}]
    proj = sum(p.nbytes for p in packed)
    rows.append({"case": "ternary projections alone", "bytes": proj,
                 "vs fp32": proj / sum(p.dense_nbytes for p in packed)})
    return rows


def bandwidth_rows(world, config):
    """``allreduce_mean`` of a gradient-shaped bucket against ``Allreduce`` of the same bytes."""
    from mpi4py import MPI

    rng = np.random.default_rng(world.rank)
    grads = [rng.standard_normal(s).astype(np.float32) for s in config.shapes().values()]
    flat = np.concatenate([g.reshape(-1) for g in grads])
    gathered = world.allgather_object(flat)
    want = np.sum(gathered, axis=0, dtype=np.float32) / np.float32(world.size)
    check = world.allreduce_mean([g.copy() for g in grads])
    got = np.concatenate([g.reshape(-1) for g in check])
    if world.size <= 2 and not np.array_equal(got, want):
        raise AssertionError("allreduce_mean differs from the fp32 mean of the ranks' buckets")
    if not np.allclose(got, np.mean(np.asarray(gathered, np.float64), axis=0), rtol=1e-6):
        raise AssertionError("allreduce_mean differs from the float64 mean")
    plain = flat.copy()  # summed in place REPEATS + 1 times: grows by size**16, stays finite
    bucket_s, raw_s = _timed(world, lambda: world.allreduce_mean(grads),
                             lambda: MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, plain, op=MPI.SUM))
    nbytes = flat.nbytes
    return [{"case": "allreduce_mean (bucket: pack, Iallreduce, polled, unpack)", "bytes": nbytes,
             "ms": 1e3 * bucket_s, "GB/s": nbytes / bucket_s / 1e9, "vs plain": raw_s / bucket_s},
            {"case": "mpi4py Allreduce (IN_PLACE, blocking)", "bytes": nbytes, "ms": 1e3 * raw_s,
             "GB/s": nbytes / raw_s / 1e9, "vs plain": 1.0}]


def main(args, config) -> int:
    """The distributed bench; rank 0 prints and writes ``train_distributed.json``."""
    world = distributed.communicator()
    lead = world.rank == 0

    def say(message):
        if lead:
            print(message, flush=True)

    with world.guard():
        run = QUICK if config.quick else DIST
        corpus = training.default_corpus()
        say(f"\n== BDH data-parallel training: {world.size} rank(s) ==\n{train.describe(run)}")
        train.check_small()
        rows, trained = speed_rows(run, corpus, world, say)
        say(_harness.table(rows))
        say("comm ms/step: time in allreduce_mean of the gradient bucket, waiting for the "
            "slowest rank included; tokens/s: per rank, forward + backward + averaging + AdamW")
        extra = []
        if world.size > 1:
            wire = wire_rows(world, *trained["ternary+int8"])
            extra += wire + bandwidth_rows(world, trained["ternary+int8"][0])
            say(_harness.table(extra))
        else:
            say("(run under mpiexec -n 2 for the multi-rank rows, bytes on the wire and bandwidth)")
        if lead:
            path = _harness.write_json("train_distributed",
                                       [{"suite": "train_distributed", **r} for r in rows + extra],
                                       config, args.results)
            print(f"({path})", flush=True)
    return 0
