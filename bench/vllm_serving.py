"""vLLM's bf16 cache against kvpolicy's packed pages, in the same KV memory, in one run.

    .venv-vllm/bin/python bench/vllm_serving.py          # make bench-vllm

SmolLM2-135M in bf16 on vLLM's CPU engine, four caches: vLLM's own (bf16, its CPU
attention), ``{"kvpolicy": 2}``, ``{"kvpolicy": {"defaults": {"stored_bits": 3.0}}}`` and
the same budget counted per 512-token page (``budget_pages: 512``).
Every engine gets the KV memory that holds 8 requests (448 prompt + 128 output tokens) in
bf16 pages, except a last bf16 row given the memory for 32 (what this machine does with
32 requests in flight at best: the ceiling of any cache in the @32 column), and reports:

- KV capacity: the tokens its blocks hold, and the requests of this shape that fit at once;
- output tokens/s with 1, 8 and 32 requests submitted together (greedy, 128 tokens each);
- prompt-logprob perplexity of 1,024 pydoc tokens scored in chunks of 64 (a separate
  engine with ``max_num_batched_tokens=64``, so that later chunks read the packed cache).

Each engine runs in its own process (``--worker``); ratios are against bf16 in this run.

The long-context part (``--parts long``), where the KV bytes a decode step reads outweigh
the weights, runs vLLM's bf16 cache and ``{"kvpolicy": 2}`` only:

- (a) 1 request of a 7,680-token prompt and 256 output tokens, in the KV memory that holds
  it in bf16: time to first token (a run with 1 output token) and decode tokens/s (the 255
  later tokens over the time the full run takes beyond the first token's run);
- (b) 8 requests of 2,048-token prompts and 256 outputs, in the KV memory that holds them
  in bf16: output tokens/s, time to first token and decode tokens/s as in (a).

Beside each row: the bytes a decode step reads at the run's mean context (the weights in
bf16, and every cached token's KV bytes as the engine's blocks hold them: its KV memory
over its capacity in tokens), and the ratio of bf16's bytes to the row's, which bounds the
speed-up a cache can give when reading bytes is all a step does.

    .venv-vllm/bin/python bench/vllm_serving.py --parts long     # the long part only

The prefix-caching part (``--parts prefix``): 32 requests, each a shared 1,024-token system
prompt and a 64-token question of its own, submitted together; the time until every one
has its first token, with prefix caching on and off in the same engine configuration (KV
memory holding all 32 in bf16), for vLLM's bf16 cache and ``{"kvpolicy": 2}`` at its
default block (576 tokens: one block of the system prompt is shared) and at 192-token
blocks (five). Beside each: how many first tokens equal the run's with caching off (bf16:
all, the cache being exact; packed: a request reusing blocks reads them packed, as a later
chunk of a chunked prefill does, where caching off attends over its prompt unquantized).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time

PROMPT, OUTPUT = 448, 128
CONFIGS = {
    "vLLM bf16": None,
    "kvpolicy bits=2": 2,
    "kvpolicy stored_bits=3.0": {"defaults": {"stored_bits": 3.0}},
    "kvpolicy stored_bits=3.0 per page": {"defaults": {"stored_bits": 3.0,
                                                       "budget_pages": 512}},
    "vLLM bf16, KV for 32": None,
}
REQUESTS = {"vLLM bf16, KV for 32": 32}  # requests whose bf16 pages the KV memory holds


def bf16_bytes_per_token() -> int:
    from transformers import AutoConfig

    from kvpolicy import zoo
    c = AutoConfig.from_pretrained(zoo.checkpoint())
    head_dim = getattr(c, "head_dim", c.hidden_size // c.num_attention_heads)
    return c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 2


def _kv_memory(requests: int = 8) -> int:
    blocks = math.ceil((PROMPT + OUTPUT) / 128)  # vLLM's CPU block of 128 tokens
    return requests * blocks * 128 * bf16_bytes_per_token()


def _prompts(n: int, seed: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from kvpolicy import zoo
    from kvpolicy.zoo.text import pydoc_tokens
    ids = pydoc_tokens(AutoTokenizer.from_pretrained(zoo.checkpoint())).tolist()
    return [ids[(seed + i) * PROMPT * 2 : (seed + i) * PROMPT * 2 + PROMPT] for i in range(n)]


# The long-context part: (prompt tokens, output tokens, requests) per row
LONG = {"a: 1 x 7,680": (7680, 256, 1), "b: 8 x 2,048": (2048, 256, 8)}
LONG_CONFIGS = ("vLLM bf16", "kvpolicy bits=2")


def _long_prompts(prompt: int, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from kvpolicy import zoo
    from kvpolicy.zoo.text import pydoc_tokens
    ids = pydoc_tokens(AutoTokenizer.from_pretrained(zoo.checkpoint())).tolist()
    return [ids[i * prompt : (i + 1) * prompt] for i in range(n)]


def _weight_bytes() -> int:
    """The model's weights in bf16: what every decode step reads besides the KV cache."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvpolicy import zoo
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(zoo.checkpoint()))
    return 2 * sum(p.numel() for p in model.parameters())


def long_worker(name: str, row: str) -> dict:
    """One long-context row on one cache: TTFT, decode and output tokens/s, KV bytes."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvpolicy import zoo
    prompt, output, n = LONG[row]
    value = CONFIGS[name]
    extra = {} if value is None else {"additional_config": {"kvpolicy": value}}
    # n requests' blocks of 128 tokens in bf16, and the one block vLLM keeps back (its null
    # block) plus one of slack
    memory = (n * math.ceil((prompt + output) / 128) + 2) * 128 * bf16_bytes_per_token()
    llm = LLM(model=str(zoo.checkpoint()), dtype="bfloat16", seed=0, enforce_eager=True,
              enable_prefix_caching=False, max_model_len=prompt + output, max_num_seqs=n,
              kv_cache_memory_bytes=memory, **extra)
    cc = llm.llm_engine.vllm_config.cache_config
    out: dict = {"tokens": cc.block_size * cc.num_gpu_blocks, "kv_memory": memory}
    prompts = [TokensPrompt(prompt_token_ids=p) for p in _long_prompts(prompt, n)]
    warm = [TokensPrompt(prompt_token_ids=p[:512]) for p in _long_prompts(prompt, 1)]
    llm.generate(warm, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    full = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompts, one, use_tqdm=False)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    res = llm.generate(prompts, full, use_tqdm=False)
    total = time.perf_counter() - t
    got = sum(len(r.outputs[0].token_ids) for r in res)
    out.update({"ttft_s": ttft, "total_s": total, "out tok/s": got / total,
                "decode tok/s": (got - n) / max(total - ttft, 1e-9)})
    llm.llm_engine.engine_core.shutdown()
    return out


def long_part() -> None:
    weights = _weight_bytes()
    print(f"\nLong context: weights {weights / 2**20:.1f} MiB in bf16", flush=True)
    rows: dict = {}
    for row in LONG:
        for name in LONG_CONFIGS:
            rows[(row, name)] = _run(name, "long:" + row)
            print(row, name, json.dumps(rows[(row, name)]), flush=True)
    print("\n| row | cache | KV tokens (x bf16) | TTFT s (x bf16) | decode tok/s (x bf16) "
          "| out tok/s (x bf16) | bytes per step, MiB: weights + KV | bf16 bytes / these |")
    print("|" + "---|" * 8)
    for row, (prompt, output, n) in LONG.items():
        base = rows[(row, "vLLM bf16")]
        context = prompt + output / 2  # the mean context of a decode step
        base_bytes = None
        for name in LONG_CONFIGS:
            r = rows[(row, name)]
            kv = n * context * r["kv_memory"] / r["tokens"]
            step = weights + kv
            base_bytes = base_bytes or step
            print(f"| {row} | {name} | {r['tokens']:,} ({r['tokens'] / base['tokens']:.2f}x) "
                  f"| {r['ttft_s']:.2f} ({r['ttft_s'] / base['ttft_s']:.2f}x) "
                  f"| {r['decode tok/s']:.1f} "
                  f"({r['decode tok/s'] / base['decode tok/s']:.2f}x) "
                  f"| {r['out tok/s']:.1f} ({r['out tok/s'] / base['out tok/s']:.2f}x) "
                  f"| {weights / 2**20:.0f} + {kv / 2**20:.0f} "
                  f"| {base_bytes / step:.2f}x |")


SYSTEM, QUESTION, CLIENTS = 1024, 64, 32
PREFIX = {"vLLM bf16": ("vLLM bf16", None), "kvpolicy bits=2": ("kvpolicy bits=2", None),
          "kvpolicy bits=2, block 192": ("kvpolicy bits=2", 192)}


def prefix_worker(row: str, caching: str) -> dict:
    """One prefix-caching row: the first token of 32 requests sharing a system prompt."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvpolicy import zoo
    name, block = PREFIX[row]
    value = CONFIGS[name]
    extra = {} if value is None else {"additional_config": {"kvpolicy": value}}
    if block is not None:
        extra["block_size"] = block
    tokens = SYSTEM + QUESTION + 1
    memory = (CLIENTS * math.ceil(tokens / 128) + 2) * 128 * bf16_bytes_per_token()
    llm = LLM(model=str(zoo.checkpoint()), dtype="bfloat16", seed=0, enforce_eager=True,
              enable_prefix_caching=caching == "on", max_model_len=2048,
              max_num_seqs=CLIENTS, kv_cache_memory_bytes=memory, **extra)
    ids = _long_prompts(SYSTEM + CLIENTS * QUESTION + 512, 1)[0]
    system, rest = ids[:SYSTEM], ids[SYSTEM:]
    prompts = [TokensPrompt(prompt_token_ids=system + rest[i * QUESTION : (i + 1) * QUESTION])
               for i in range(CLIENTS)]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    # warm, on other text (the prefix cache stays cold for the system prompt)
    llm.generate([TokensPrompt(prompt_token_ids=rest[-512:])], one, use_tqdm=False)
    t = time.perf_counter()
    res = llm.generate(prompts, one, use_tqdm=False)
    out = {"ttft_s": time.perf_counter() - t,
           "first": [r.outputs[0].token_ids[0] for r in res],
           "cached": sum(r.num_cached_tokens or 0 for r in res),
           "block_size": llm.llm_engine.vllm_config.cache_config.block_size}
    llm.llm_engine.engine_core.shutdown()
    return out


def prefix_part() -> None:
    print(f"\nPrefix caching: {CLIENTS} requests of a shared {SYSTEM}-token system prompt + "
          f"{QUESTION} tokens each, submitted together", flush=True)
    rows: dict = {}
    for row in PREFIX:
        for caching in ("off", "on"):
            rows[(row, caching)] = _run(row, f"prefix:{caching}")
            print(row, caching, json.dumps(rows[(row, caching)]), flush=True)
    print("\n| cache | block | prompt tokens from the cache | first token of all, s: off "
          "| on | off / on | first tokens equal to off's |")
    print("|" + "---|" * 7)
    for row in PREFIX:
        off, on = rows[(row, "off")], rows[(row, "on")]
        same = sum(a == b for a, b in zip(off["first"], on["first"], strict=True))
        total = CLIENTS * (SYSTEM + QUESTION)
        print(f"| {row} | {on['block_size']} | {on['cached']:,} of {total:,} "
              f"| {off['ttft_s']:.2f} | {on['ttft_s']:.2f} | {off['ttft_s'] / on['ttft_s']:.2f}x "
              f"| {same} / {CLIENTS} |")


def worker(name: str, job: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvpolicy import zoo
    value = CONFIGS[name]
    extra = {} if value is None else {"additional_config": {"kvpolicy": value}}
    common = dict(model=str(zoo.checkpoint()), dtype="bfloat16", seed=0, enforce_eager=True,
                  enable_prefix_caching=False, max_model_len=2048, **extra)
    out: dict = {}
    if job == "score":
        from transformers import AutoTokenizer

        from kvpolicy.zoo.text import pydoc_tokens
        ids = pydoc_tokens(AutoTokenizer.from_pretrained(zoo.checkpoint()))[40000:41024]
        ids = ids.tolist()
        llm = LLM(max_num_batched_tokens=64, max_num_seqs=64, **common)
        r = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                         SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        lps = [r.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
        out["perplexity"] = math.exp(-sum(lps) / len(lps))
    else:
        llm = LLM(kv_cache_memory_bytes=_kv_memory(REQUESTS.get(name, 8)), max_num_seqs=32,
                  **common)
        cc = llm.llm_engine.vllm_config.cache_config
        out["block_size"], out["blocks"] = cc.block_size, cc.num_gpu_blocks
        out["tokens"] = cc.block_size * cc.num_gpu_blocks
        per_req = math.ceil((PROMPT + OUTPUT) / cc.block_size)
        out["requests"] = cc.num_gpu_blocks // per_req
        sp = SamplingParams(max_tokens=OUTPUT, temperature=0, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in _prompts(1, 99)], sp)  # warm
        for n in (1, 8, 32):
            prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(n, 0)]
            t = time.perf_counter()
            res = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t
            out[f"tok/s@{n}"] = sum(len(r.outputs[0].token_ids) for r in res) / dt
    llm.llm_engine.engine_core.shutdown()
    return out


def _run(name: str, job: str) -> dict:
    # Its own process group: whatever of the engine outlives the worker (an engine core
    # has been seen running on after its front end left) is killed with it, so that the
    # next engine finds the memory free (vLLM's CPU worker checks at start).
    proc = subprocess.Popen([sys.executable, __file__, "--worker", name, job],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    out, err = proc.communicate()
    with contextlib.suppress(ProcessLookupError):  # nothing left: the group is gone
        os.killpg(proc.pid, signal.SIGKILL)
    proc = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        raise SystemExit(f"{name} {job}: the engine run failed ({proc.returncode})")
    return json.loads(lines[-1][7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", nargs=2, metavar=("CONFIG", "JOB"), help=argparse.SUPPRESS)
    ap.add_argument("--parts", nargs="+", choices=("short", "long", "prefix"),
                    default=["short", "long", "prefix"],
                    help="short: the 1/8/32-request table; long: the long-context rows; "
                    "prefix: prefix caching on and off")
    args = ap.parse_args()
    if args.worker:
        name, job = args.worker
        if job.startswith("long:"):
            got = long_worker(name, job[5:])
        elif job.startswith("prefix:"):
            got = prefix_worker(name, job[7:])
        else:
            got = worker(name, job)
        print("RESULT " + json.dumps(got), flush=True)
        os._exit(0)  # see tests/vllm/vllm_engine.py: skip the front end's teardown
    if "short" in args.parts:
        short_part()
    if "long" in args.parts:
        long_part()
    if "prefix" in args.parts:
        prefix_part()


def short_part() -> None:
    print(f"KV memory {_kv_memory() / 2**20:.1f} MiB (8 requests of {PROMPT} + {OUTPUT} "
          "tokens in bf16 pages); SmolLM2-135M bf16, vLLM CPU engine", flush=True)
    rows = {}
    for name in CONFIGS:
        rows[name] = _run(name, "serve")
        # the same cache as "vLLM bf16": the same perplexity
        rows[name].update(_run(name, "score") if name not in REQUESTS else
                          {"perplexity": rows["vLLM bf16"]["perplexity"]})
        print(name, json.dumps(rows[name]), flush=True)
    base = rows["vLLM bf16"]
    head = ("| cache | block | KV tokens (x bf16) | requests at once | tok/s @1 | @8 | @32 "
            "| perplexity (x bf16) |")
    print("\n" + head + "\n|" + "---|" * 8)
    for name, r in rows.items():
        def x(key: str, r=r) -> str:
            return f"{r[key]:.1f} ({r[key] / base[key]:.2f}x)"
        tokens = f"{r['tokens']:,} ({r['tokens'] / base['tokens']:.2f}x)"
        ppl = f"{r['perplexity']:.3f} ({r['perplexity'] / base['perplexity']:.4f}x)"
        print(f"| {name} | {r['block_size']} | {tokens} | {r['requests']} | {x('tok/s@1')} "
              f"| {x('tok/s@8')} | {x('tok/s@32')} | {ppl} |")


if __name__ == "__main__":
    main()
