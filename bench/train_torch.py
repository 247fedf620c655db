"""The torch peer of the training comparison: the same BDH model in plain torch (fp32, autograd,
``torch.optim.AdamW``), written here from the equations of ``lowbit/models/bdh/``.

Used by ``python -m bench train`` when torch is installed (``bench/train.py``). Timed the way a
torch user runs it: tensors built before the clock starts, ``torch.set_num_threads`` equal to
Numba's threads, the same initial parameters, batches, learning rate and steps; its loss is
checked against lowbit's on the first batch before anything is timed.
"""

from __future__ import annotations

import importlib.util
import math
import time

import numpy as np

from lowbit.models import bdh, train

from . import _harness

#: Base of the rotary angles (lowbit's and BDH's): phi = t * ROPE_THETA ** (-2j / N).
ROPE_THETA = 2.0**16
LN_EPS = 1e-5


def available() -> bool:
    return importlib.util.find_spec("torch") is not None


def _model(torch, params, config):
    """A torch module holding ``params`` (copies), with the forward of the lowbit model."""
    nn, F = torch.nn, torch.nn.functional
    D, H, N = config.n_embd, config.n_head, config.n_latent

    class BDH(nn.Module):
        def __init__(self):
            super().__init__()
            for name, value in params.items():
                setattr(self, name, nn.Parameter(torch.tensor(np.array(value))))
            self.drop = nn.Dropout(config.dropout)

        def ln(self, x):
            return F.layer_norm(x, (x.shape[-1],), eps=LN_EPS)

        def rope(self, u, cos, sin):
            even, odd = u[..., 0::2], u[..., 1::2]
            out = torch.empty_like(u)
            out[..., 0::2] = even * cos - odd * sin
            out[..., 1::2] = odd * cos + even * sin
            return out

        def forward(self, ids, targets):
            B, T = ids.shape
            j = torch.arange(N // 2, dtype=torch.float64)
            phi = torch.arange(T, dtype=torch.float64)[:, None] * ROPE_THETA ** (-2.0 * j / N)
            cos, sin = torch.cos(phi).float(), torch.sin(phi).float()
            mask = torch.ones(T, T).tril(-1)
            x = self.ln(self.embed[ids])
            for _ in range(config.n_layer):
                xs = F.relu(x[:, None] @ self.encoder)                          # B, H, T, N
                q = self.rope(xs, cos, sin)
                a = ((q @ q.transpose(-1, -2)) * mask) @ x[:, None]             # B, H, T, D
                ys = F.relu(self.ln(a) @ self.encoder_v)
                xy = self.drop(xs * ys).transpose(1, 2).reshape(B, T, H * N)
                x = self.ln(x + self.ln(xy @ self.decoder))
            logits = x @ self.lm_head
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return BDH()


def rows(run, corpus, progress=print):
    """The torch row of the comparison (fp32), or none when torch is missing."""
    if not available():
        progress("  torch is not installed: no torch row (pip install torch)")
        return []
    import torch

    torch.set_num_threads(_harness.threads()["numba_threads"])
    from . import train as lb

    config = lb.model_config(run)
    params = bdh.init_params(config, lb.PARAM_SEED)
    model = _model(torch, params, config)
    batches = train.Batches(corpus, block=run["block"], batch=run["batch"], seed=lb.DATA_SEED)
    data = [batches.sample() for _ in range(run["steps"])]
    tensors = [(torch.from_numpy(i), torch.from_numpy(t)) for i, t in data]
    model.eval()
    with torch.no_grad():
        want = bdh.loss(config, params, *data[0])
        got = float(model(*tensors[0]))
    if not math.isclose(got, want, rel_tol=1e-4):
        raise AssertionError(f"torch BDH loss {got} vs lowbit {want} on the first batch")
    model.train()
    schedule = train.Schedule("fp32", lr=run["lr"], weight_decay=0.1, warmup=run["warmup"],
                              steps=run["steps"])
    opt = torch.optim.AdamW(model.parameters(), lr=run["lr"], weight_decay=0.1)
    progress(f"  training torch fp32 ({run['steps']} steps) ...")
    busy, losses = 0.0, []
    begin = time.perf_counter()
    for step, (ids, targets) in enumerate(tensors):
        for group in opt.param_groups:
            group["lr"], group["weight_decay"] = schedule(step)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(ids, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        busy += time.perf_counter() - start
        losses.append(loss.item())
    seconds = time.perf_counter() - begin
    model.eval()
    trained = {k: v.detach().numpy() for k, v in model.named_parameters()}
    val = train.evaluate(config, trained, batches, run["eval_batches"])
    peak = _peak_step_bytes(torch, model, opt, tensors[0])
    tokens = run["steps"] * run["batch"] * run["block"]
    return [{"case": "torch fp32", "steps": run["steps"],
             "train loss": float(np.mean(losses[-10:])), "val loss": val,
             "tokens/s": tokens / busy, "peak step MiB": peak / 2**20,
             "saved MiB/step": float("nan"), "wall s": seconds, "sample": ""}]


def _peak_step_bytes(torch, model, opt, batch):
    """Peak CPU memory of one training step by torch.profiler (allocations minus frees)."""
    from torch.profiler import ProfilerActivity, profile

    model.train()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.zero_grad(set_to_none=True)
        model(*batch).backward()
        opt.step()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage),
                    key=lambda e: e.time_range.start)
    held = peak = 0
    for e in events:
        held += e.self_cpu_memory_usage
        peak = max(peak, held)
    return peak
