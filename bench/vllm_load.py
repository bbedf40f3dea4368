"""vLLM's OpenAI server under load and faults, its bf16 cache against kvpolicy's, in one run.

    .venv-vllm/bin/python bench/vllm_load.py             # both caches, about 10 minutes
    .venv-vllm/bin/python bench/vllm_load.py --clients 16 --caches kvpolicy

For each cache a fresh server (``vllm.entrypoints.openai.api_server`` on 127.0.0.1,
SmolLM2-135M in bf16, prefix caching on as vLLM sets it) gets the same KV memory: what
holds ``--hold`` requests of the longest shape in bf16 pages, small enough that with 64
clients vLLM runs out of blocks and preempts. Then:

1. **Load.** ``--clients`` streaming completions at once, each a shared 600-token system
   prompt and a question of 16 to 400 tokens of its own (pydoc text), greedy, 32 to 128
   output tokens; every tenth client closes its stream after 8 chunks (vLLM aborts the
   request when the client goes away).
2. **Alone.** Each request that completed, sent again on its own (the server otherwise
   idle, the system prompt's blocks still in the prefix cache); its tokens compared with
   those it streamed under load.
3. **After.** ``/health``; the server's preemption counter; the blocks in use after a
   1-token probe (vLLM's ``kv_cache_usage_perc`` times its blocks: anything left leaked).

Reported per cache: output tokens/s of the load phase, time to first token (median and
90th percentile), requests completed / aborted / failed, preemptions, the completed
outputs that equal their run alone, and the leaked blocks. Ratios against bf16 in the
same run. A packed cache's outputs depend on how the engine split the work (a preempted
request is recomputed as a prefill, and a prefill reads its own tokens unquantized where
decode reads them packed: docs/serving.md), so it is the equal-to-alone column that tells.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_serving import bf16_bytes_per_token  # noqa: E402  (this folder's bench)

SYSTEM, QUESTIONS, OUTPUTS = 600, (16, 400), (32, 128)
CACHES = {"vLLM bf16": None, "kvpolicy bits=2": 2}
ABORT_EVERY, ABORT_AFTER = 10, 8  # every tenth client leaves after 8 chunks


def _requests(path: str, clients: int) -> list[dict]:
    """Each client's prompt (token ids) and output length, the same for every cache."""
    import random

    from transformers import AutoTokenizer

    from kvpolicy.zoo.text import pydoc_tokens
    ids = pydoc_tokens(AutoTokenizer.from_pretrained(path)).tolist()
    rng = random.Random(0)
    system, at, out = ids[:SYSTEM], SYSTEM, []
    for _ in range(clients):
        n = rng.randrange(*QUESTIONS)
        out.append({"prompt": system + ids[at : at + n],
                    "max_tokens": rng.randrange(*OUTPUTS)})
        at += n
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _metric(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples (every label set), 0 when absent."""
    found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([-0-9.e+]+)$", text, flags=re.M)
    return sum(float(x) for x in found)


class Server:
    """One ``api_server`` process, in its own process group (killed whole at exit)."""

    def __init__(self, path: str, value, kv_bytes: int, clients: int, log: Path,
                 budget: int | None = None, block: int | None = None) -> None:
        self.port, self.log = _free_port(), log
        extra = [] if value is None else ["--additional-config",
                                          json.dumps({"kvpolicy": value})]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path,
             "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16",
             "--enforce-eager", "--max-model-len", "2048", "--seed", "0",
             "--max-num-seqs", str(clients), "--kv-cache-memory-bytes", str(kv_bytes),
             "--disable-uvicorn-access-log", *extra,
             *([] if budget is None else ["--max-num-batched-tokens", str(budget)]),
             *([] if block is None else ["--block-size", str(block)])],
            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited ({self.proc.returncode}):\n"
                                 + self.log.read_text()[-4000:])
            if time.monotonic() > deadline:
                raise SystemExit(f"the server did not come up in {timeout:.0f} s")
            with contextlib.suppress(OSError):
                _get(self.url + "/health", timeout=5)
                return
            time.sleep(2)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


async def _stream(session, url: str, model: str, req: dict, leave_after: int | None) -> dict:
    """One streaming completion: its tokens, time to first token, and how it ended."""
    body = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"],
            "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
    t0, first, tokens, chunks = time.perf_counter(), None, [], 0
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                return {"end": f"HTTP {r.status}: {(await r.text())[:200]}"}
            async for line in r.content:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                got = choice.get("token_ids") or []
                if got and first is None:
                    first = time.perf_counter() - t0
                tokens += got
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    return {"end": "aborted", "tokens": tokens}  # closes the connection
    except Exception as e:  # a failed request is counted and named, never dropped
        return {"end": f"{type(e).__name__}: {e}"}
    return {"end": "done", "tokens": tokens, "ttft": first}


async def _load(url: str, model: str, reqs: list[dict]) -> tuple[list[dict], float]:
    import aiohttp
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        t = time.perf_counter()
        res = await asyncio.gather(*[
            _stream(s, url, model, r, ABORT_AFTER if i % ABORT_EVERY == ABORT_EVERY // 2
                    else None) for i, r in enumerate(reqs)])
        return list(res), time.perf_counter() - t


async def _alone(url: str, model: str, reqs: list[dict]) -> list:
    """``reqs`` one after the other: each one's tokens, or how it ended if it failed."""
    import aiohttp
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        for r in reqs:
            got = await _stream(s, url, model, r, None)
            out.append(got.get("tokens") if got["end"] == "done" else got["end"])
    return out


def _info(metrics: str, label: str) -> int | None:
    """A label of vLLM's ``cache_config_info`` metric, as an int (None when absent)."""
    found = re.search(rf'^vllm:cache_config_info{{[^}}]*{label}="(\d+)"', metrics, flags=re.M)
    return int(found.group(1)) if found else None


def run_cache(name: str, path: str, reqs: list[dict], kv_bytes: int, logs: Path,
              budget: int | None = None, block: int | None = None) -> dict:
    server = Server(path, CACHES[name], kv_bytes, len(reqs), logs / f"{name}.log", budget,
                    block if CACHES[name] is not None else None)
    try:
        server.wait()
        metrics = _get(server.url + "/metrics")
        blocks, block_size = _info(metrics, "num_gpu_blocks"), _info(metrics, "block_size")
        # warm the server on other text (the system prompt stays out of the prefix cache)
        warm = {"prompt": reqs[-1]["prompt"][SYSTEM:][:64], "max_tokens": 4}
        asyncio.run(_alone(server.url, path, [warm]))
        res, wall = asyncio.run(_load(server.url, path, reqs))
        done = [i for i, r in enumerate(res) if r["end"] == "done"]
        aborted = [i for i, r in enumerate(res) if r["end"] == "aborted"]
        failed = {i: r["end"] for i, r in enumerate(res) if i not in done + aborted}
        metrics = _get(server.url + "/metrics")
        preempted = _metric(metrics, "vllm:num_preemptions_total")
        alone = asyncio.run(_alone(server.url, path, [reqs[i] for i in done]))
        equal = sum(a == res[i]["tokens"] for a, i in zip(alone, done, strict=True))
        full = sum(len(res[i]["tokens"]) == reqs[i]["max_tokens"] for i in done)
        # A 1-token probe, then the usage gauge: it is set from the scheduler's stats after
        # a step's finished requests are freed, so anything still in use leaked.
        probe = {"prompt": reqs[0]["prompt"][SYSTEM:][:8], "max_tokens": 1}
        asyncio.run(_alone(server.url, path, [probe]))
        usage = _metric(_get(server.url + "/metrics"), "vllm:kv_cache_usage_perc")
        try:
            _get(server.url + "/health", timeout=10)
            healthy = True
        except OSError:
            healthy = False
    finally:
        server.close()
    ttft = sorted(res[i]["ttft"] for i in done if res[i]["ttft"] is not None)
    out_tokens = sum(len(r.get("tokens") or ()) for r in res)
    return {"blocks": blocks, "block_size": block_size,
            "tok/s": out_tokens / wall, "wall_s": wall,
            "ttft_p50": statistics.median(ttft) if ttft else math.nan,
            "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))] if ttft else math.nan,
            "done": len(done), "full_length": full, "aborted": len(aborted),
            "failed": failed, "preempted": int(preempted), "equal_alone": equal,
            "leaked": None if blocks is None else round(usage * blocks),
            "healthy": healthy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--hold", type=int, default=8,
                    help="KV memory: what holds this many of the longest requests in bf16")
    ap.add_argument("--caches", nargs="+", choices=("bf16", "kvpolicy"),
                    default=["bf16", "kvpolicy"])
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the server's token budget per step (vLLM's CPU default: 2048); "
                    "one above all prompts' tokens together keeps every prompt whole")
    ap.add_argument("--block-size", type=int, default=None,
                    help="kvpolicy's block (default: the plugin's, 576 for bits=2, where a "
                    "request of this shape never outgrows the blocks it was admitted with, "
                    "so vLLM never preempts it; 192 makes it grow)")
    args = ap.parse_args()
    from kvpolicy import zoo
    path = str(zoo.checkpoint())
    reqs = _requests(path, args.clients)
    longest = SYSTEM + QUESTIONS[1] + OUTPUTS[1]
    kv_bytes = args.hold * math.ceil(longest / 128) * 128 * bf16_bytes_per_token()
    names = [n for n, key in zip(CACHES, ("bf16", "kvpolicy"), strict=True)
             if key in args.caches]
    print(f"{args.clients} streaming clients, a shared {SYSTEM}-token system prompt + "
          f"{QUESTIONS[0]}-{QUESTIONS[1]} tokens each, {OUTPUTS[0]}-{OUTPUTS[1]} outputs, "
          f"1 in {ABORT_EVERY} leaving after {ABORT_AFTER} chunks; KV memory "
          f"{kv_bytes / 2**20:.1f} MiB ({args.hold} x {longest} tokens in bf16)", flush=True)
    rows = {}
    with tempfile.TemporaryDirectory() as logs:
        for name in names:
            rows[name] = run_cache(name, path, reqs, kv_bytes, Path(logs),
                                   args.max_num_batched_tokens, args.block_size)
            print(name, json.dumps(rows[name]), flush=True)
    base = rows.get("vLLM bf16")
    print("\n| cache | blocks x tokens | out tok/s (x bf16) | TTFT p50 / p90 s | completed "
          "(full length) | aborted | failed | preemptions | equal to alone | blocks in use after "
          "| up after |")
    print("|" + "---|" * 11)
    for name, r in rows.items():
        x = f" ({r['tok/s'] / base['tok/s']:.2f}x)" if base else ""
        print(f"| {name} | {r['blocks']} x {r['block_size']} | {r['tok/s']:.1f}{x} "
              f"| {r['ttft_p50']:.2f} / {r['ttft_p90']:.2f} | {r['done']} ({r['full_length']}) "
              f"| {r['aborted']} | {len(r['failed'])} | {r['preempted']} "
              f"| {r['equal_alone']} / {r['done']} | {r['leaked']} | {r['healthy']} |")
    for name, r in rows.items():
        for i, why in r["failed"].items():
            print(f"{name}: request {i} failed: {why}")


if __name__ == "__main__":
    main()
