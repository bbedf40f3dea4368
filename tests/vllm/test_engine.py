"""kvpolicy served by the real vLLM CPU engine (no mocks): each run is a fresh process.

What holds: a 16-bit policy generates the tokens vLLM's own attention generates (SmolLM2,
and a tiny Gemma3 with sliding-window layers); at 2 bits vLLM holds several times more
tokens in the same KV memory and its prompt-logprob perplexity is within 1% of the same
quantizer through ``compile_model`` (also on sliding-window layers); tensor parallelism
over 2 ranks equals one rank; a policy that does not fit the model is refused at engine
start, naming the mismatch; vector-quantized values are served as compile_model serves
them; under load (more requests than blocks, aborts, prefix caching) the engine finishes
every request and frees every block.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm_engine import parse

from kvpolicy import zoo

ENGINE = Path(__file__).with_name("vllm_engine.py")
_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_engine(spec: dict, env: dict | None = None, timeout: int = 600
               ) -> tuple[dict, str]:
    """Run ``vllm_engine.py`` on ``spec``; ``(result, the engine's log)``."""
    proc = subprocess.run(
        [sys.executable, str(ENGINE), json.dumps(spec)], capture_output=True, text=True,
        timeout=timeout, env={**os.environ, **_ENV, **(env or {})})
    if proc.returncode != 0:
        raise AssertionError(f"engine run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return parse(proc.stdout), proc.stdout + proc.stderr


def kv_tokens(log: str) -> int:
    """The KV capacity the engine core logged (``KV cache size: N tokens``)."""
    found = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    assert found, "the engine logged no KV cache size"
    return int(found[-1].replace(",", ""))


@pytest.fixture(scope="module")
def smollm2() -> str:
    return str(zoo.checkpoint("smollm2-135m"))


@pytest.fixture(scope="module")
def pydoc_ids(smollm2) -> list[int]:
    from transformers import AutoTokenizer

    from kvpolicy.zoo.text import pydoc_tokens
    tok = AutoTokenizer.from_pretrained(smollm2)
    return pydoc_tokens(tok)[40000:40768].tolist()


def _tiny(tmp_path_factory, arch: str, *, tokenizer: bool = False, **overrides) -> str:
    """A tiny model saved to a fresh folder (``tokenizer``: with a byte tokenizer beside
    it, for policies that calibrate on text; then ``vocab_size`` must be 256)."""
    from kvpolicy.zoo.tiny import byte_tokenizer, tiny_model
    model = tiny_model(arch, **overrides)
    out = tmp_path_factory.mktemp(arch)
    model.save_pretrained(out)
    if tokenizer:
        byte_tokenizer().save_pretrained(out)
    return str(out)


PROMPTS = [[1, 504, 3145, 282, 4649, 314], [1, 1489, 28121, 30, 94, 33, 29, 55, 21, 42]]


def test_16_bits_is_vllms_own_attention_on_smollm2(smollm2):
    base, _ = run_engine({"model": smollm2, "engine": {"dtype": "float32"},
                          "prompts": PROMPTS, "max_tokens": 24})
    ours, log = run_engine({"model": smollm2, "prompts": PROMPTS, "max_tokens": 24,
                            "engine": {"dtype": "float32",
                                       "additional_config": {"kvpolicy": 16}}})
    assert ours["tokens"] == base["tokens"]
    assert kv_tokens(log) > 0


def test_16_bits_with_sliding_window_layers(tmp_path_factory):
    """Gemma3: local layers of a 16-token window and global ones; a 70-token prompt and
    24 generated tokens run past the window in every local layer."""
    path = _tiny(tmp_path_factory, "gemma3_text", sliding_window=16, vocab_size=256,
                 max_position_embeddings=512, initializer_range=0.2,
                 layer_types=["sliding_attention", "full_attention"])
    prompts = [[(7 * i + 3) % 250 + 3 for i in range(70)], [5, 9, 11]]
    engine = {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 256}
    base, _ = run_engine({"model": path, "engine": engine, "prompts": prompts,
                          "max_tokens": 24})
    ours, _ = run_engine({"model": path, "prompts": prompts, "max_tokens": 24,
                          "engine": {**engine, "additional_config": {"kvpolicy": 16}}})
    assert ours["tokens"] == base["tokens"]


def test_2_bits_with_sliding_window_layers(tmp_path_factory):
    """Gemma3 at 2 bits: local layers (a 16-token window, one table of pre-RoPE keys per
    layer type) hold packed pages too, in blocks of 96 tokens that vLLM frees once the
    window has passed them (a 400-token prompt spans 5); prompt-logprob perplexity within
    1% of compile_model's over the same chunks; decode steps after a 250-token prompt, whose
    first two local blocks are freed, give the torch path's tokens
    (``KVPOLICY_FUSED_STEP=0``); and 2 ranks give one rank's tokens."""
    path = _tiny(tmp_path_factory, "gemma3_text", sliding_window=16, vocab_size=256,
                 max_position_embeddings=1024, initializer_range=0.2, tokenizer=True,
                 layer_types=["sliding_attention", "full_attention"])
    score = [(11 * i + 7) % 250 + 3 for i in range(400)]
    policy = {"defaults": {"bits": 2, "residual": 0}}
    spec = {"model": path, "score": score, "max_tokens": 16,
            "prompts": [[(5 * i + 1) % 250 + 3 for i in range(250)], [4, 8, 15]],
            "engine": {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 512,
                       "max_num_batched_tokens": 32, "max_num_seqs": 32, "block_size": 96,
                       "additional_config": {"kvpolicy": policy}}}
    one, log = run_engine(spec)
    assert "one table per layer type" in log, "local and global layers share a RoPE table"
    assert one["block_size"] == 96
    want = _compiled_perplexity(path, score, policy, 32)
    got = one["perplexity"]
    assert abs(got / want - 1) <= 0.01, f"vLLM {got:.4f} vs compile_model {want:.4f}"
    assert "runs decode steps with the fused C++ step" in log
    torch_path, _ = run_engine({**spec, "score": score[:40]}, env={"KVPOLICY_FUSED_STEP": "0"})
    assert torch_path["tokens"] == one["tokens"]
    spec["engine"]["tensor_parallel_size"] = 2
    two, _ = run_engine(spec, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert two["tokens"] == one["tokens"]
    # this random model's logits are steep (perplexity ~3,000 over 256 tokens): a float
    # reordering between ranks moves a logprob by up to ~3e-3
    worst = max(abs(a - b) for a, b in zip(one["logprobs"], two["logprobs"], strict=True))
    assert worst < 1e-2, f"prompt logprobs differ by {worst:.3g} between 1 and 2 ranks"


def _compiled_perplexity(path: str, ids: list[int], policy, chunk: int) -> float:
    """Perplexity of ``ids`` through ``compile_model`` fed in chunks of ``chunk``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvpolicy
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    if policy is not None:
        model = kvpolicy.compile_model(model, policy=policy, calibration=tok, progress=False)
    cache, nll = None, 0.0
    with torch.no_grad():
        for a in range(0, len(ids), chunk):
            out = model(torch.tensor(ids[a : a + chunk])[None], past_key_values=cache,
                        use_cache=True)
            cache = out.past_key_values
            lp = out.logits[0].float().log_softmax(-1)
            for i, t in enumerate(ids[a + 1 : a + chunk + 1]):
                nll -= lp[i, t].item()
    return math.exp(nll / (len(ids) - 1))


def test_2_bits_capacity_and_perplexity_match_compile_model(smollm2, pydoc_ids):
    """The served 2-bit policy: the same quantizer as compile_model's (served with its
    residual window as the incomplete key group, so compared with ``residual: 0``) within
    1% in perplexity, the prompt scored in chunks of 64 tokens so that later chunks read
    the packed cache; and at least 4.5x the tokens of a bf16 cache in 1 GiB."""
    engine = {"dtype": "float32", "max_model_len": 2048, "max_num_batched_tokens": 64,
              "max_num_seqs": 64}
    ours, log = run_engine({"model": smollm2, "score": pydoc_ids,
                            "engine": {**engine, "additional_config": {"kvpolicy": 2}}})
    base, _ = run_engine({"model": smollm2, "prompts": PROMPTS[:1], "max_tokens": 1,
                              "engine": {"dtype": "bfloat16", "max_model_len": 2048}})
    # The blocks the engine allocated, times their tokens (the log's "KV cache size" line
    # is not that product for a packed page).
    ratio = (ours["num_gpu_blocks"] * ours["block_size"]) / (
        base["num_gpu_blocks"] * base["block_size"])
    assert ratio >= 4.5, f"2-bit pages hold {ratio:.2f}x the tokens of bf16 pages"
    want = _compiled_perplexity(smollm2, pydoc_ids, {"defaults": {"residual": 0}}, 64)
    fp = _compiled_perplexity(smollm2, pydoc_ids, None, 64)
    got = ours["perplexity"]
    assert abs(got / want - 1) <= 0.01, f"vLLM {got:.4f} vs compile_model {want:.4f}"
    assert got / fp < 1.05, f"2 bits {got:.4f} against fp {fp:.4f}"


VQ = {"defaults": {"bits": 2, "levels": "vq", "residual": 0}}


def test_vq_values_served_within_1_percent_of_compile_model(smollm2, pydoc_ids):
    """Vector-quantized values (``levels: vq``, codebooks fitted on the tokenizer's text as
    compile_model fits them) in pages of one byte per 4 channels and a scale per group:
    more tokens per byte than ``bits=2``'s pages, perplexity within 1% of compile_model's."""
    engine = {"dtype": "float32", "max_model_len": 2048, "max_num_batched_tokens": 64,
              "max_num_seqs": 64}
    ours, log = run_engine({"model": smollm2, "score": pydoc_ids,
                            "engine": {**engine, "additional_config": {"kvpolicy": VQ}}})
    page = re.findall(r"layer 0 (\d+) bytes per block of (\d+) tokens \(([\d.]+)x smaller "
                      r"than torch.float16 K/V\); k_codes, k_scale, k_zero, v_codes, v_scale, "
                      r"v_zero", log)
    assert page, "the engine logged no vq page for layer 0"
    assert float(page[-1][2]) >= 5.0, f"a vq page holds {page[-1][2]}x fp16's tokens"
    want = _compiled_perplexity(smollm2, pydoc_ids, VQ, 64)
    got = ours["perplexity"]
    assert abs(got / want - 1) <= 0.01, f"vLLM {got:.4f} vs compile_model {want:.4f}"


@pytest.mark.parametrize("value", [2, VQ], ids=["bits2", "vq-values"])
def test_tensor_parallel_2_equals_one_rank(tmp_path_factory, value):
    """Each rank holds the packed pages of its kv head (and, for vq values, its head's
    codebook); outputs as with one rank."""
    path = _tiny(tmp_path_factory, "llama", vocab_size=256, initializer_range=0.2,
                 max_position_embeddings=1024, tokenizer=value is VQ)
    prompts = [[(5 * i + 1) % 250 + 3 for i in range(90)]]
    score = [(11 * i + 7) % 250 + 3 for i in range(200)]
    spec = {"model": path, "prompts": prompts, "max_tokens": 16, "score": score,
            "engine": {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 512,
                       "max_num_batched_tokens": 32, "max_num_seqs": 32,
                       "additional_config": {"kvpolicy": value}}}
    one, _ = run_engine(spec)
    spec["engine"]["tensor_parallel_size"] = 2
    two, _ = run_engine(spec, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert two["tokens"] == one["tokens"]
    worst = max(abs(a - b) for a, b in zip(one["logprobs"], two["logprobs"], strict=True))
    assert worst < 1e-3, f"prompt logprobs differ by {worst:.3g} between 1 and 2 ranks"


def test_fused_decode_step_generates_what_the_torch_path_does(tmp_path_factory):
    """At 2 bits, decode steps run the fused C++ step (one call per layer); greedy
    generation of ragged prompts, across several key groups and a block, gives the tokens
    of the step's torch path (``KVPOLICY_FUSED_STEP=0``), which the paged-cache tests hold
    to the contiguous cache."""
    path = _tiny(tmp_path_factory, "llama", vocab_size=256, initializer_range=0.2,
                 max_position_embeddings=2048)
    prompts = [[(7 * i + j) % 250 + 3 for i in range(n)]
               for j, n in enumerate((3, 40, 130, 517))]
    spec = {"model": path, "prompts": prompts, "max_tokens": 80,
            "engine": {"dtype": "bfloat16", "skip_tokenizer_init": True,
                       "max_model_len": 1024, "max_num_seqs": 8,
                       "additional_config": {"kvpolicy": 2}}}
    fused, log = run_engine(spec)
    assert "layer 0 runs decode steps with the fused C++ step" in log
    torch_path, log = run_engine(spec, env={"KVPOLICY_FUSED_STEP": "0"})
    assert "layer 0 runs decode steps with the torch path (fused=False)" in log
    assert fused["tokens"] == torch_path["tokens"]


def _prefix_spec(path: str, prompts: list, **engine) -> dict:
    return {"model": path, "prompts": prompts, "max_tokens": 40,
            "engine": {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 512,
                       "block_size": 96, "additional_config": {"kvpolicy": 2}, **engine}}


def test_prefix_caching_shares_packed_blocks(tmp_path_factory):
    """Prefix caching on: prompts sharing a 200-token prefix get its two full packed
    blocks (of 96 tokens) from the cache, one prompt being the prefix's first 193 tokens
    (its one new token attends over the shared blocks). A request reusing blocks reads
    them packed, as a later chunk of a chunked prefill reads the earlier chunks: with
    prefills chunked at the blocks (one sequence, 96 tokens a step), greedy outputs are
    those of prefix caching off. With 8 sequences in a step, the others share the blocks
    the first fills in that step (vLLM lists a block when it allocates it): on a one-layer
    model, whose cached keys and values do not depend on how the prompt was split, their
    outputs equal the chunked run's."""
    head = [(7 * i + 5) % 250 + 3 for i in range(200)]
    prompts = [head + [(11 * i + j) % 250 + 3 for i in range(5 + 13 * j)] for j in range(4)]
    prompts += [head[:193], prompts[1]]
    chunked = {"max_num_seqs": 1, "max_num_batched_tokens": 96}
    for layers in (2, 1):
        path = _tiny(tmp_path_factory, "llama", vocab_size=256, initializer_range=0.2,
                     max_position_embeddings=1024, num_hidden_layers=layers)
        on, _ = run_engine(_prefix_spec(path, prompts, enable_prefix_caching=True, **chunked))
        assert min(on["cached"][1:]) >= 192, f"no block shared: {on['cached']}"
        if layers == 2:
            off, _ = run_engine(_prefix_spec(path, prompts, **chunked))
            assert max(off["cached"]) == 0
            assert on["tokens"] == off["tokens"]
            continue
        same, _ = run_engine(_prefix_spec(path, prompts, enable_prefix_caching=True,
                                          max_num_seqs=8, max_num_batched_tokens=2048))
        assert min(same["cached"][1:]) >= 192, f"no block shared in a step: {same['cached']}"
        assert same["tokens"][1:] == on["tokens"][1:]


def test_under_load_with_aborts_and_preemption(tmp_path_factory):
    """16 requests at once (half sharing a 96-token head) into 8 blocks of 96 tokens, with
    prefix caching on and two requests aborted after 5 output tokens: vLLM preempts some,
    the engine finishes the rest at full length, and every block is free after the run.
    A request never preempted generates what it generates served alone. A preempted one
    does up to its preemption point; after it vLLM recomputes the request as one prefill,
    whose queries read their own recent tokens in full precision where its decode steps
    read completed key groups packed, so its later tokens may differ (docs/serving.md).
    One layer, so that cached keys and values do not depend on how prompts were split."""
    import random
    path = _tiny(tmp_path_factory, "llama", vocab_size=256, initializer_range=0.2,
                 max_position_embeddings=1024, num_hidden_layers=1)
    rng = random.Random(0)
    head = [(7 * i + 5) % 250 + 3 for i in range(96)]
    prompts, max_tokens = [], []
    for j in range(16):
        tail = [rng.randrange(3, 253) for _ in range(rng.randrange(5, 150))]
        prompts.append(head + tail if j % 2 else tail)
        max_tokens.append(rng.randrange(20, 90))
    engine = {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 512,
              "block_size": 96, "enable_prefix_caching": True,
              "additional_config": {"kvpolicy": 2}}
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine core in the front end
    got, _ = run_engine({"model": path,
                         "engine": {**engine, "num_gpu_blocks_override": 8, "max_num_seqs": 16},
                         "load": {"prompts": prompts, "max_tokens": max_tokens,
                                  "abort": [3, 10], "abort_after": 5}}, env=env)
    load = got["load"]
    assert load["aborted"] == ["10", "3"]
    assert sorted(load["tokens"], key=int) == [str(i) for i in range(16) if i not in (3, 10)]
    assert load["preempted"], "8 blocks for 16 requests: vLLM preempted none"
    assert load["free_blocks"] == load["blocks"], f"blocks leaked: {load}"
    alone, _ = run_engine({"model": path, "engine": engine, "alone": True,
                           "prompts": prompts, "max_tokens": max(max_tokens)}, env=env)
    for rid, toks in load["tokens"].items():
        want = alone["tokens"][int(rid)][: max_tokens[int(rid)]]
        assert len(toks) == len(want), f"request {rid}: {len(toks)} of {len(want)} tokens"
        upto = load["preempted"].get(rid, len(want))
        assert toks[:upto] == want[:upto], f"request {rid} differs from its run alone"


def test_a_policy_that_does_not_fit_is_refused(smollm2, tmp_path):
    """A policy file written for a deeper model names a layer SmolLM2 does not have."""
    bad = tmp_path / "deeper.yaml"
    bad.write_text("version: 1\ndefaults: {bits: 2}\n"
                   "overrides:\n  - {layers: 40, tensor: key, bits: 4}\n")
    proc = subprocess.run(
        [sys.executable, str(ENGINE), json.dumps({
            "model": smollm2, "engine": {"additional_config": {"kvpolicy": str(bad)}}})],
        capture_output=True, text=True, timeout=600, env={**os.environ, **_ENV})
    assert proc.returncode != 0
    assert "layer 40 is out of range; the model has 30 layers" in proc.stdout + proc.stderr


def test_the_server_refuses_additional_config_that_is_not_json(tmp_path_factory):
    """``--additional-config`` that does not parse: vLLM's server exits at start naming
    the field and the text it got (the plugin's own refusals, of keys and values it
    cannot serve, are in tests/policies/test_served_config.py)."""
    path = _tiny(tmp_path_factory, "llama")
    proc = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path,
         "--host", "127.0.0.1", "--port", str(_free_port()), "--enforce-eager",
         "--additional-config", '{"kvpolicy": 2'],
        capture_output=True, text=True, timeout=300, env={**os.environ, **_ENV})
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "additional_config" in said and "input_value='{\"kvpolicy\": 2'" in said, \
        said[-3000:]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_over_http(smollm2, tmp_path):
    """vLLM's OpenAI server with ``--additional-config '{"kvpolicy": 2}'`` answers a
    completion request on loopback with text generated over the packed cache. (It is what
    ``vllm serve`` runs; vllm-cpu 0.32.0's ``vllm`` command itself fails looking up the
    version of a distribution named ``vllm``.)"""
    import time
    import urllib.request
    port = _free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", smollm2,
         "--host", "127.0.0.1", "--port", str(port),
         "--enforce-eager", "--max-model-len", "1024",
         "--additional-config", json.dumps({"kvpolicy": 2})],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **_ENV},
        start_new_session=True)
    try:
        deadline = time.monotonic() + 420
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "vllm serve did not come up in 420 s"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                time.sleep(2)
        body = json.dumps({"model": smollm2, "prompt": "The capital of France is",
                           "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
        text = answer["choices"][0]["text"]
        assert answer["usage"]["completion_tokens"] == 8 and text.strip(), answer
        served = (tmp_path / "serve.log").read_text()
        assert "kvpolicy: layer 0" in served and "smaller than" in served
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)
        log.close()
