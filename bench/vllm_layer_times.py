"""Per-layer attention times inside vLLM's engine: its bf16 cache against ``{"kvpolicy": 2}``.

    .venv-vllm/bin/python bench/vllm_layer_times.py [--prompt 7680] [--outputs 128]

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the
attention impls' ``forward`` can be timed per call: one request of ``--prompt`` pydoc
tokens and ``--outputs`` greedy tokens, on each cache in turn, each in its own process.
Printed per cache: the median time of one layer's attention call for decode steps (one
query token) and for each prefill chunk size, the decoder layer's attention block and MLP
medians, and the run's output tokens/s. Medians of thousands of calls are steadier on a
shared machine than whole-run tokens/s, which a slow prefill moves.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import subprocess
import sys
import time


def _timed(cls, name: str, calls: dict) -> None:
    f = cls.forward

    def timed(self, *args, **kwargs):
        t = time.perf_counter()
        out = f(self, *args, **kwargs)
        dt = time.perf_counter() - t
        key = name
        if name == "attention" and len(args) > 1 and hasattr(args[1], "shape"):
            key = f"attention, {args[1].shape[0]} query tokens"
        calls[key].append(dt)
        return out

    cls.forward = timed


def worker(cache: str, prompt: int, outputs: int) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.models import llama
    from vllm.v1.attention.backends import cpu_attn

    import kvpolicy.vllm.backend as kb
    from kvpolicy import zoo
    sys.path.insert(0, os.path.dirname(__file__))
    import vllm_serving as vs

    calls: dict = collections.defaultdict(list)
    _timed(cpu_attn.CPUAttentionBackendImpl, "attention", calls)
    _timed(kb.KVPolicyAttentionImpl, "attention", calls)
    _timed(llama.LlamaAttention, "attention block", calls)
    _timed(llama.LlamaMLP, "mlp", calls)
    extra = {} if cache == "bf16" else {"additional_config": {"kvpolicy": 2}}
    memory = (math.ceil((prompt + outputs) / 128) + 2) * 128 * vs._bf16_bytes_per_token()
    llm = LLM(model=str(zoo.checkpoint()), dtype="bfloat16", seed=0, enforce_eager=True,
              enable_prefix_caching=False, max_model_len=prompt + outputs, max_num_seqs=8,
              kv_cache_memory_bytes=memory, **extra)
    ids = vs._long_prompts(prompt, 1)[0]
    llm.generate([TokensPrompt(prompt_token_ids=ids[:256])],
                 SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    calls.clear()
    t = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                       SamplingParams(max_tokens=outputs, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    dt = time.perf_counter() - t
    out = {k: (len(v), statistics.median(v) * 1e3) for k, v in sorted(calls.items())}
    out["out tok/s"] = len(res[0].outputs[0].token_ids) / dt
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=7680)
    ap.add_argument("--outputs", type=int, default=128)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.prompt, args.outputs)), flush=True)
        os._exit(0)  # skip the engine's teardown, as bench/vllm_serving.py
    rows = {}
    for cache in ("bf16", "kvpolicy"):
        proc = subprocess.run([sys.executable, __file__, "--worker", cache, "--prompt",
                               str(args.prompt), "--outputs", str(args.outputs)],
                              capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
            raise SystemExit(f"{cache}: the engine run failed ({proc.returncode})")
        rows[cache] = json.loads(lines[-1][7:])
    print(f"# 1 request, {args.prompt} prompt + {args.outputs} output tokens, "
          f"load {os.getloadavg()[0]:.1f}; medians per call (calls)")
    print("| what | vLLM bf16 (ms) | kvpolicy bits=2 (ms) | kvpolicy / bf16 |")
    print("|---|---|---|---|")
    for key in sorted(set(rows["bf16"]) | set(rows["kvpolicy"])):
        if key == "out tok/s":
            continue
        a, b = rows["bf16"].get(key), rows["kvpolicy"].get(key)
        cell = lambda r: "-" if r is None else f"{r[1]:.3f} ({r[0]})"  # noqa: E731
        ratio = f"{b[1] / a[1]:.2f}x" if a and b else "-"
        print(f"| {key} | {cell(a)} | {cell(b)} | {ratio} |")
    a, b = rows["bf16"]["out tok/s"], rows["kvpolicy"]["out tok/s"]
    print(f"| output tok/s (whole run) | {a:.1f} | {b:.1f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
