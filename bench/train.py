"""The main job: train the BDH byte-level language model under fp32 and low-bit configurations.

``python -m bench`` (no suite named; ``bench/__main__.py``) runs the main job: the same model, from
the same initial parameters on the same batches of the embedded corpus (CPython's
``pydoc_data.topics``), under ``CONFIGS`` (fp32; ternary weights + int8 activations; the same with
the ``sparse`` saved policy), then one table (losses, tokens/s, peak step memory, saved bytes, a
sample), the targets and JSON under ``bench/results/``; ``--plot FILE.png`` draws the loss curves.
``python -m bench train`` runs the same, plus a plain torch model of the same shape when torch is
installed; ``--long`` trains longer. ``cases`` gives the harness (and pytest-benchmark) one timed
training step per configuration. ``--gpu`` trains on cupy arrays, ``--backend NAME`` under
``lowbit.use_backend(NAME)``.

The model: ``lowbit/models/bdh/``; the loop: ``lowbit/models/train.py``; the torch peer:
``bench/train_torch.py``.
"""

from __future__ import annotations

import contextlib
import textwrap
import time

import numpy as np

import lowbit
from lowbit import _backend
from lowbit.models import bdh, train
from lowbit.reference.bdh import bdh_bwd_ref, bdh_ref

from . import _harness
from ._harness import Case

PLAN = lowbit.LowBitPlan.uniform("ternary", "int8")
#: name -> (plan, saved policy, schedule kind)
CONFIGS = {
    "fp32": (lowbit.LowBitPlan(), None, "fp32"),
    "ternary+int8": (PLAN, None, "bitnet"),
    "ternary+int8+sparse": (PLAN, "sparse", "bitnet"),
}
#: The model and run of the main job (D = 128, multiplier 16, H = 4, 3 levels, batch 8 x 128
#: bytes), sized for about a minute per configuration.
MAIN = dict(n_layer=3, n_embd=128, n_head=4, mlp_internal_dim_multiplier=16, dropout=0.1,
            steps=200, batch=8, block=128, lr=3e-3, warmup=20, eval_every=25, eval_batches=8)
#: ``--long``: the same model trained four times longer.
LONG = dict(MAIN, steps=800, eval_every=100)
#: ``--quick`` (CI, pytest-benchmark): seconds, not minutes.
QUICK = dict(MAIN, n_layer=1, n_embd=32, mlp_internal_dim_multiplier=4, steps=12, batch=4,
             block=32, warmup=2, eval_every=6, eval_batches=2)
PROMPT = b"The "
SAMPLE_BYTES = 60
DATA_SEED, PARAM_SEED, DROPOUT_SEED = 0, 1, 2


def shape(config) -> dict:
    return QUICK if config.quick else MAIN


def model_config(run, plan=None, saved=None) -> bdh.BDHConfig:
    return bdh.BDHConfig(n_layer=run["n_layer"], n_embd=run["n_embd"], n_head=run["n_head"],
                         mlp_internal_dim_multiplier=run["mlp_internal_dim_multiplier"],
                         dropout=run["dropout"], plan=plan or lowbit.LowBitPlan(), saved=saved)


def check_small(xp=np):
    """The model against its float64 reference on a tiny shape, forward and every gradient, in
    full precision and with the low-bit plan, on ``xp`` arrays (checked before anything is
    timed). Each is the first (cold) call of its kernels: announced by ``first_call``."""
    rng = np.random.default_rng(7)
    for what, plan in (("bdh fp32 (embedding, layer_norm, lowrank_residual, linear, "
                        "cross_entropy)", lowbit.LowBitPlan()),
                       ("bdh ternary+int8 (quantize, packed_matmul)", PLAN)):
        config = bdh.BDHConfig(n_layer=2, n_embd=16, n_head=2, mlp_internal_dim_multiplier=4,
                               vocab_size=32, dropout=0.2, plan=plan)
        params = {k: v * 25 for k, v in bdh.init_params(config, 3).items()}
        ids = rng.integers(0, 32, size=(2, 6))
        targets = np.roll(ids, -1, axis=1)
        seeds = [bdh._level_seed(4, level) for level in range(config.n_layer)]
        with _harness.first_call(what):
            loss, ctx = bdh.forward(config, {k: xp.asarray(v) for k, v in params.items()},
                                    xp.asarray(ids), xp.asarray(targets), seed=4)
            grads = {k: _host(v) for k, v in bdh.backward(ctx).items()}
        ref = bdh_bwd_ref(params, ids, targets, level_seeds=seeds, plan=plan, dropout=0.2)
        want = bdh_ref(params, ids, targets, level_seeds=seeds, plan=plan, dropout=0.2)
        if not abs(float(loss) - want) <= 1e-4 * abs(want):
            raise AssertionError(f"bdh loss {float(loss)} vs reference {want}")
        for name, r in ref.items():
            err = np.linalg.norm(grads[name] - r) / np.linalg.norm(r)
            if not err < 3e-3:
                raise AssertionError(f"bdh d{name}: relative error {err:.2e} vs reference")


def _host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def step_memory(config, params, batches):
    """Peak bytes allocated during one training step (forward, backward, AdamW step), by
    ``lowbit.profile`` (on the CPU tracemalloc: every array allocated in the step and alive at
    the peak; on a GPU CuPy's memory pool; the parameters and optimizer moments held before the
    step are excluded), and the bytes the step's ctx saved."""
    xp = _backend.array_module(params["embed"])
    ids, targets = (xp.asarray(a) for a in batches.sample("train", np.random.default_rng(99)))
    opt = lowbit.AdamW()
    work = {k: v.copy() for k, v in params.items()}
    opt.step(work, {k: xp.zeros_like(v) for k, v in work.items()})  # moments allocated
    with lowbit.profile() as prof:
        loss, ctx = bdh.forward(config, work, ids, targets, seed=1)
        saved = ctx.nbytes
        grads = bdh.backward(ctx)
        del ctx
        opt.step(work, grads)
        del grads, loss
    return prof.peak_bytes, saved


def run_config(name, run, corpus, progress=None, xp=np):
    """Train one configuration on ``xp`` arrays; returns its table row and loss curves."""
    plan, saved, kind = CONFIGS[name]
    config = model_config(run, plan, saved)
    params = bdh.init_params(config, PARAM_SEED, xp=xp)
    batches = train.Batches(corpus, block=run["block"], batch=run["batch"], seed=DATA_SEED)
    schedule = train.Schedule(kind, lr=run["lr"], weight_decay=0.1, warmup=run["warmup"],
                              steps=run["steps"])
    begin = time.perf_counter()
    history = train.train(config, params, batches, schedule, seed=DROPOUT_SEED,
                          eval_every=run["eval_every"], eval_batches=run["eval_batches"],
                          progress=progress is not None)
    seconds = time.perf_counter() - begin
    # Measured on the trained parameters: the sparsity of the ReLU activations is the model's.
    peak, saved_bytes = step_memory(config, params, batches)
    # recurrent: prompt and sample (64 bytes) fit in one training block, so no window is needed
    sample = bdh.generate(config, params, PROMPT, SAMPLE_BYTES, temperature=0.8, top_k=20,
                          seed=0)
    train_loss = float(np.mean([loss for _, loss in history["train"][-10:]]))
    row = {"case": name, "steps": run["steps"], "train loss": train_loss,
           "val loss": history["val"][-1][1], "tokens/s": history["tokens_per_s"],
           "peak step MiB": peak / 2**20, "saved MiB/step": saved_bytes / 2**20,
           "wall s": seconds, "sample": (PROMPT + sample).decode("utf-8", "replace")}
    return row, history


def targets(rows, entropy):
    """``(what, measured, relation, bound, met)`` of the main job's targets."""
    by = {r["case"]: r for r in rows}
    fp, low, sparse = by["fp32"], by["ternary+int8"], by["ternary+int8+sparse"]
    out = [("fp32 validation loss below the unigram entropy by", entropy - fp["val loss"], ">=",
            1.2),
           ("ternary+int8+sparse validation loss above fp32 by", sparse["val loss"] -
            fp["val loss"], "<=", 0.15),
           ("ternary+int8+sparse peak step memory vs fp32", sparse["peak step MiB"] /
            fp["peak step MiB"], "<=", 1 / 3),
           ("ternary+int8+sparse saved bytes vs fp32", sparse["saved MiB/step"] /
            fp["saved MiB/step"], "<=", 1 / 8),
           ("ternary+int8 tokens/s vs fp32", low["tokens/s"] / fp["tokens/s"], ">=", 1.0)]
    return [(w, m, rel, b, m >= b if rel == ">=" else m <= b) for w, m, rel, b in out]


def comparison(run, corpus, progress=print, names=tuple(CONFIGS), xp=np):
    """Train every configuration of ``names`` on ``xp`` arrays: (table rows, loss curves)."""
    rows, curves = [], {}
    for name in names:
        progress(f"  training {name} ({run['steps']} steps) ...")
        row, history = run_config(name, run, corpus, progress, xp=xp)
        rows.append(row)
        curves[name] = {"train": history["train"], "val": history["val"]}
    return rows, curves


def plot(curves, entropy, path, title):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib: pip install 'lowbit[plot]' ({exc})") from exc
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (name, c) in enumerate(curves.items()):
        color = f"C{i}"
        steps, losses = zip(*c["train"])
        ax.plot(steps, losses, color=color, alpha=0.5, lw=1, label=f"{name} train")
        vs, vl = zip(*c["val"])
        ax.plot(vs, vl, "o-", color=color, lw=2, label=f"{name} validation")
    ax.axhline(entropy, color="gray", ls="--", lw=1, label=f"unigram entropy {entropy:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title(textwrap.fill(title, 90), fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cases(config):
    """One timed training step (forward, backward, AdamW) per configuration, quick shapes."""
    run = QUICK if config.quick else MAIN
    xp = _harness.xp(config)
    ids, targets = (xp.asarray(a) for a in train.Batches(
        train.default_corpus(), block=run["block"], batch=run["batch"]).sample())
    tokens = run["batch"] * run["block"]
    for name, (plan, saved, kind) in CONFIGS.items():
        cfg = model_config(run, plan, saved)
        params = bdh.init_params(cfg, PARAM_SEED, xp=xp)
        opt = lowbit.AdamW()

        def step(cfg=cfg, params=params, opt=opt):
            with forced_backend(config.backend):
                loss, ctx = bdh.forward(cfg, params, ids, targets)
                opt.step(params, bdh.backward(ctx))
            if config.gpu:
                xp.cuda.Device().synchronize()

        def check():
            with forced_backend(config.backend):
                check_small(xp)

        yield Case("train", f"step {name}", fn=step, check=check,
                   baseline=None if name == "fp32" else "step fp32",
                   info={"tokens/step": tokens, "shape": describe(run).split(",")[0]})


def forced_backend(name):
    """``lowbit.use_backend(name)``, or nothing when ``name`` is None."""
    return lowbit.use_backend(name) if name else contextlib.nullcontext()


def describe(run) -> str:
    config = model_config(run)
    n = sum(int(np.prod(s)) for s in config.shapes().values())
    return (f"BDH D={run['n_embd']} H={run['n_head']} N={config.n_latent} levels="
            f"{run['n_layer']} ({n / 1e6:.2f} M parameters), batch {run['batch']} x "
            f"{run['block']} bytes, {run['steps']} steps, AdamW lr {run['lr']} (fp32: warmup + "
            f"cosine; low-bit: BitNet's two-stage schedule), dropout {run['dropout']}")

