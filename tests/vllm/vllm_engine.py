"""One vLLM engine run in a fresh process, for the tests: ``python vllm_engine.py SPEC_JSON``.

The spec names the checkpoint, the engine arguments and what to run; the result is printed
as one JSON line prefixed by ``RESULT`` (the engine's own logging goes to stderr). Every run
is its own process because vLLM's CPU engine spawns its core and workers and holds them for
the life of the ``LLM`` object.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = {"enable_prefix_caching": False, **spec.get("engine", {})}
    llm = LLM(model=spec["model"], seed=0, enforce_eager=True, **engine)
    out: dict = {}
    cfg = llm.llm_engine.vllm_config
    out["block_size"] = cfg.cache_config.block_size
    out["num_gpu_blocks"] = cfg.cache_config.num_gpu_blocks
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec.get("prompts", [])]
    params = SamplingParams(max_tokens=spec.get("max_tokens", 16), temperature=0,
                            ignore_eos=True)
    if prompts:
        if spec.get("alone"):  # one request at a time, each served alone
            res = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        else:
            res = llm.generate(prompts, params)
            out["cached"] = [r.num_cached_tokens or 0 for r in res]
        out["tokens"] = [list(r.outputs[0].token_ids) for r in res]
    if "load" in spec:
        out["load"] = _load(llm, spec["load"])
    if "score" in spec:
        ids = spec["score"]
        r = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                         SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        lps = [r.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
        out["logprobs"] = lps
        out["perplexity"] = math.exp(-sum(lps) / len(lps))
    print("RESULT " + json.dumps(out), flush=True)
    # NOTE: a front end whose engine started while the policy was being derived (the first
    # engine of a checkpoint and policy) has aborted in interpreter teardown ("terminate
    # called without an active exception") after the engine's work was done; the same run
    # with the derived policy on disk exits cleanly. Cause not found: leave without the
    # teardown, after shutting the engine down.
    llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _load(llm, load: dict) -> dict:
    """Serve ``load["prompts"]`` at once through the engine's own request API, abort the
    requests ``load["abort"]`` names once each has ``load["abort_after"]`` output tokens,
    and report the finished outputs, the aborted and the preempted requests and the block
    pool's free blocks after the run. Needs the engine core in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    preempted: dict[str, int] = {}  # request -> its output tokens when first preempted
    preempt = sched._preempt_request

    def counted(request, *args, **kwargs):
        rid = request.request_id.rsplit("-", 1)[0]  # vLLM suffixes the id it was given
        preempted.setdefault(rid, request.num_output_tokens)
        return preempt(request, *args, **kwargs)

    sched._preempt_request = counted
    for i, ids in enumerate(load["prompts"]):
        params = SamplingParams(max_tokens=load["max_tokens"][i], temperature=0,
                                ignore_eos=True)
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids), params)
    to_abort = {str(i) for i in load.get("abort", ())}
    finished: dict[str, list[int]] = {}
    aborted: list[str] = []
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for r in engine.step():
            toks = list(r.outputs[0].token_ids)
            if r.finished:
                finished[r.request_id] = toks
            elif r.request_id in to_abort and len(toks) >= load.get("abort_after", 1):
                engine.abort_request([r.request_id])
                to_abort.discard(r.request_id)
                aborted.append(r.request_id)
    pool = sched.kv_cache_manager.block_pool
    return {"tokens": finished, "aborted": sorted(aborted), "preempted": preempted,
            "steps": steps, "free_blocks": pool.get_num_free_blocks(),
            "blocks": pool.num_gpu_blocks - 1}  # block 0 is vLLM's null block, never free


def parse(stdout: str) -> dict:
    """The result of a run from its standard output."""
    found = re.findall(r"^RESULT (.*)$", stdout, flags=re.M)
    if not found:
        raise AssertionError("the engine run printed no result")
    return json.loads(found[-1])


if __name__ == "__main__":
    main()
