"""``python -m lowbit.models.bitnet PATH --prompt "..." [-n 64] [--temperature T] [--top-k K]
[--top-p P] [--seed S] [--int8-head]`` (or ``--ids 1,2,3`` for ``--prompt``): stream a BitNet
model's continuation of a prompt.

PATH is a Hugging Face folder or a GGUF file (``lowbit.models.bitnet.load``). The text streams
to stdout as it is generated; the prefill and decode speeds (tokens/s) go to stderr. A model
without a tokenizer takes ``--ids`` and prints ids. The prompt is encoded with the special tokens
the tokenizer adds (the BOS of Llama 3's vocabulary).
"""

from __future__ import annotations

import argparse
import sys
import time

from . import generate, load, quantize_head


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lowbit.models.bitnet",
                                description="Stream a BitNet b1.58 model's continuation.")
    p.add_argument("path", help="a Hugging Face model folder or a .gguf file")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text (needs the model's tokenizer)")
    src.add_argument("--ids", help="the prompt as comma-separated token ids")
    p.add_argument("-n", "--max-new-tokens", type=int, default=64, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--int8-head", action="store_true",
                   help="an int8 per-row output head (half the bytes of a 16-bit one)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        config, params, tokenizer = load(args.path)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.int8_head:
        params = quantize_head(config, params)
    load_s = time.perf_counter() - t0
    if args.prompt is not None:
        if tokenizer is None:
            print(f"error: {args.path} holds no tokenizer: give the prompt as --ids",
                  file=sys.stderr)
            return 2
        ids = tokenizer.encode(args.prompt)  # with the BOS where the tokenizer adds one
    else:
        try:
            ids = [int(t) for t in args.ids.split(",") if t.strip()]
        except ValueError:
            print(f"error: --ids must be comma-separated integers, got {args.ids!r}",
                  file=sys.stderr)
            return 2
    try:
        tokens = generate(config, params, ids, args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          seed=args.seed)
    except (TypeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out: list[int] = []
    text = tokenizer.stream_decoder(skip_special_tokens=True) if tokenizer else None
    t1 = time.perf_counter()
    t_first = None
    for tok in tokens:
        if t_first is None:
            t_first = time.perf_counter()
        out.append(tok)
        sys.stdout.write(f"{tok} " if text is None else text.step(out))
        sys.stdout.flush()
    t2 = time.perf_counter()
    print(text.step(out, final=True) if text is not None else "", file=sys.stdout)
    prefill_s = (t_first or t2) - t1
    decode_n = max(len(out) - 1, 0)
    print(f"load {load_s:.2f} s; prefill {len(ids)} tokens at {len(ids) / prefill_s:.1f} "
          f"tokens/s; decode {decode_n} tokens at "
          f"{decode_n / (t2 - t_first) if decode_n and t_first else float('nan'):.2f} tokens/s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
