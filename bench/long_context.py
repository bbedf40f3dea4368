"""Long context: peak memory, prefill time, decode step and cache bytes, each run in a fresh
process, for transformers' DynamicCache (fp), kvpolicy and transformers' quanto cache.

One configuration (model, length, cache) per child process (this script run again with
``--child``, printing one JSON line), so that no run inherits another's heap. A length L
means a prefill of L - steps tokens, then ``steps`` greedy single-token decode steps: the
cache ends holding L tokens (SmolLM2's limit of 8,192 positions is a valid length). Models:

- ``smollm2``: SmolLM2-135M from the zoo (fp32 weights), default lengths 4K and 8K;
- ``tiny``: a random tiny Llama (4 layers, hidden 256, 4 heads, 2 KV heads, head_dim 64,
  MLP 512, vocabulary 128, max_position_embeddings 65,536), default lengths 16K, 32K, 64K.

Measured in the child, after the model is loaded (and compiled):

- peak RSS: the process's high-water mark (VmHWM) over the prefill and the decode steps,
  reset just before the prefill (``/proc/self/clear_refs``; where that is refused, the
  whole process's ``ru_maxrss``), model weights included; and its RSS before the prefill;
- prefill wall time; median wall time of one decode step;
- cache bytes at the end: ``memory_report()["bytes"]`` for kvpolicy, the tensors held by
  the cache for DynamicCache and quanto (``kvpolicy.evaluation.peers.cache_bytes``).

Logits are computed for the last token only (``logits_to_keep=1``) in every run, so that
the ``[T, vocab]`` prefill logits do not mask the cache's memory. quanto runs at its
default axes (0, 0), with kvpolicy's group and window (G=32, R=128). A child that dies is
a row of the table ("killed: out of memory", "timed out after N s"), not a crash.

    .venv/bin/python bench/long_context.py                       # all of the above
    .venv/bin/python bench/long_context.py --models tiny --lengths 2048 4096
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import transformers

import kvpolicy
from kvpolicy import zoo
from kvpolicy.evaluation import cache_keyword
from kvpolicy.evaluation.peers import cache_bytes, peer_cache
from kvpolicy.zoo.tiny import tiny_model

MODELS = ("smollm2", "tiny")
CACHES = ("fp", "kvpolicy", "quanto")
DEFAULT_LENGTHS = {"smollm2": (4096, 8192), "tiny": (16384, 32768, 65536)}
TINY = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=512,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64)
TINY_POSITIONS = 65536
GROUP, RESIDUAL = 32, 128  # kvpolicy's defaults, given to quanto too


# ---------------------------------------------------------------------------------------
# Child: one configuration
# ---------------------------------------------------------------------------------------


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Reset the process's RSS high-water mark (Linux ``clear_refs`` 5); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_kb("VmHWM") is not None


def _load(model: str, length: int) -> torch.nn.Module:
    if model == "tiny":
        return tiny_model("llama", **TINY, max_position_embeddings=max(TINY_POSITIONS, length))
    return zoo.load("smollm2-135m")[0]


def child(model_name: str, length: int, cache_kind: str, steps: int, bits: int) -> dict:
    """Run one configuration; the measurements as a JSON-able dict."""
    model = _load(model_name, length)
    limit = model.config.max_position_embeddings
    if length > limit:
        raise ValueError(f"length {length} exceeds the {limit} positions of {model_name}")
    if steps >= length:
        raise ValueError(f"steps={steps} leave no prefill in a length of {length}")
    if cache_kind == "kvpolicy":
        model = kvpolicy.compile_model(model, bits=bits, progress=False)
        cache = None  # the compiled model makes its own KVPolicyCache
    elif cache_kind == "quanto":
        cache = peer_cache(model, "quanto", bits=bits, group_size=GROUP, residual=RESIDUAL)
    else:
        cache = peer_cache(model, "fp")
    kw = cache_keyword(model)
    ids = torch.randint(3, model.config.vocab_size, (1, length - steps),
                        generator=torch.Generator().manual_seed(0))
    base_kb = _status_kb("VmRSS")
    hwm = _reset_peak()
    times = []
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1,
                    **({} if cache is None else {kw: cache}))
        prefill = time.perf_counter() - t0
        cache = out.past_key_values
        for _ in range(steps):
            nxt = out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            out = model(nxt, use_cache=True, logits_to_keep=1, **{kw: cache})
            times.append(time.perf_counter() - t0)
            cache = out.past_key_values
    peak_kb = _status_kb("VmHWM") if hwm else None
    if peak_kb is None:  # ru_maxrss: kilobytes on Linux, the whole process's life
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if cache_kind == "kvpolicy":
        mem = cache.memory_report()
        held, fp16, tokens = mem["bytes"], mem["fp16_bytes"], mem["tokens"]
    else:
        counted = cache_bytes(cache)
        held, fp16, tokens = counted.total, counted.fp16, counted.tokens
    return {
        "model": model_name, "length": length, "cache": cache_kind, "steps": steps,
        "bits": None if cache_kind == "fp" else bits, "tokens": tokens,
        "peak_rss_bytes": peak_kb * 1024, "peak_scope": "prefill+decode" if hwm else "process",
        "rss_before_bytes": base_kb * 1024 if base_kb is not None else None,
        "prefill_s": prefill, "decode_step_s": statistics.median(times),
        "cache_bytes": held, "fp16_cache_bytes": fp16,
    }


# ---------------------------------------------------------------------------------------
# Parent: one child per configuration, one table
# ---------------------------------------------------------------------------------------


def _failure(rc: int, stderr: str) -> str:
    if rc < 0 and -rc == signal.SIGKILL:  # what the kernel's OOM killer sends
        return "killed: out of memory"
    if rc < 0:
        return f"killed by signal {signal.Signals(-rc).name}"
    last = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    return f"failed (exit {rc}): {last[-1][:120] if last else 'no message'}"


def run_child(model: str, length: int, cache: str, steps: int, bits: int,
              timeout: float) -> dict[str, Any]:
    """Run one configuration in a fresh ``sys.executable``; its JSON line, or ``error``."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--models", model,
           "--lengths", str(length), "--caches", cache, "--steps", str(steps),
           "--bits", str(bits)]
    row: dict[str, Any] = {"model": model, "length": length, "cache": cache}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"timed out after {timeout:g} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {**row, "error": _failure(proc.returncode, proc.stderr)}
    return json.loads(lines[-1])


def _ratio(x: float | None, ref: float | None) -> str:
    return f"{x / ref:.2f}" if x is not None and ref else "-"


def table(rows: list[dict[str, Any]], bits: int) -> str:
    """One line per configuration, ratios against the fp run of the same model and length."""
    head = (f"| {'model':<8} | {'tokens':>6} | {'cache':<10} | {'peak RSS GB':>11} | {'× fp':>5} "
            f"| {'+RSS MB':>8} | {'prefill s':>9} | {'× fp':>5} | {'decode ms':>9} | {'× fp':>5} "
            f"| {'cache MB':>8} | {'× fp':>5} |")
    out = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    fps = {(r["model"], r["length"]): r for r in rows if r["cache"] == "fp" and "error" not in r}
    for r in rows:
        name = "fp Dynamic" if r["cache"] == "fp" else f"{r['cache']}-{bits}"
        if "error" in r:
            out.append(f"| {r['model']:<8} | {r['length']:>6} | {name:<10} | {r['error']} |")
            continue
        fp = fps.get((r["model"], r["length"]), {})
        gb, mb = r["peak_rss_bytes"] / 2**30, r["cache_bytes"] / 2**20
        before = r.get("rss_before_bytes")
        grew = f"{(r['peak_rss_bytes'] - before) / 2**20:>8.0f}" if before else f"{'-':>8}"
        out.append(
            f"| {r['model']:<8} | {r['length']:>6} | {name:<10} | {gb:>11.2f} "
            f"| {_ratio(r['peak_rss_bytes'], fp.get('peak_rss_bytes')):>5} | {grew} "
            f"| {r['prefill_s']:>9.2f} | {_ratio(r['prefill_s'], fp.get('prefill_s')):>5} "
            f"| {r['decode_step_s'] * 1e3:>9.1f} "
            f"| {_ratio(r['decode_step_s'], fp.get('decode_step_s')):>5} "
            f"| {mb:>8.1f} | {_ratio(r['cache_bytes'], fp.get('cache_bytes')):>5} |"
        )
    return "\n".join(out)


def machine() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"machine: {platform.machine()} {platform.system()}, {cores} cores usable "
            f"({os.cpu_count()} online), torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
            f"python {platform.python_version()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--lengths", type=int, nargs="+",
                        help="tokens held at the end, for every model (default: "
                        + "; ".join(f"{m} {' '.join(map(str, v))}"
                                    for m, v in DEFAULT_LENGTHS.items()) + ")")
    parser.add_argument("--caches", nargs="+", choices=CACHES, default=list(CACHES))
    parser.add_argument("--steps", type=int, default=64, help="decode steps (default 64)")
    parser.add_argument("--bits", type=int, default=2, choices=(2, 4),
                        help="bits of kvpolicy and quanto (default 2)")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds per child before it is killed (default 1800)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # one configuration, one JSON line
        print(json.dumps(child(args.models[0], args.lengths[0], args.caches[0], args.steps,
                               args.bits)))
        return 0
    print(machine())
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    rows = []
    for model in args.models:
        for length in args.lengths or DEFAULT_LENGTHS[model]:
            for cache in args.caches:
                rows.append(run_child(model, length, cache, args.steps, args.bits,
                                      args.timeout))
                print(f"  {model} {length} {cache}: "
                      + (rows[-1].get("error") or "done"), file=sys.stderr, flush=True)
    print(f"prefill of (tokens - {args.steps}), then {args.steps} decode steps; peak RSS over "
          "prefill + decode (model weights included), +RSS: that peak less the RSS before the "
          "prefill; ratios against fp at the same length")
    print(table(rows, args.bits))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
