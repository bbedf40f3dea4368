"""Vector-quantized values as a policy choice: written (``levels: vq``, codebooks fitted on
calibration text) and priced by a stored-bits budget (``calibrate.vq``)."""

from __future__ import annotations

import copy

import pytest
import torch

import kvpolicy
from kvpolicy.calibrate import vq
from kvpolicy.errors import KVPolicyError, PolicyError
from kvpolicy.kernels.layout import VQ_ENTRIES
from kvpolicy.policies import ModelPolicy
from kvpolicy.policies.footprint import whole_cache
from kvpolicy.zoo.tiny import tiny_model

VQ = {"defaults": {"bits": 2, "levels": "vq", "residual": 16, "sinks": 2}}


def _ids(t: int, rows: int = 1, vocab: tuple[int, int] = (3, 120), seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(*vocab, (rows, t), generator=gen)


def test_kmeans_finds_planted_clusters():
    gen = torch.Generator().manual_seed(0)
    centers = torch.randn(VQ_ENTRIES, 4, generator=gen) * 10
    x = centers.repeat(8, 1) + 0.01 * torch.randn(8 * VQ_ENTRIES, 4, generator=gen)
    got = vq.kmeans(x, iters=30)
    nearest = torch.cdist(centers, got).min(1).values
    assert nearest.max() < 0.05  # every planted center has a centroid on it


def test_written_vq_values_fit_a_codebook_deterministically(tmp_path):
    model = tiny_model("llama")
    ids = _ids(96)
    compiled = kvpolicy.compile_model(copy.deepcopy(model), policy=VQ, calibration=ids)
    pol = kvpolicy.inspect(compiled)
    for t in pol.tensors:
        if t.tensor.value == "key":
            assert t.levels != "vq" and not t.codebook
            continue
        # the format's defaults: one 8-bit scale per token and head, Hadamard-rotated
        assert (t.levels, t.group_size, t.meta_bits, t.rotation) == ("vq", 32, 8, "hadamard")
        assert t.stored_bits() == 2 + 8 / 32
        assert "codebook: 256 centroids per kv head fitted by k-means" in t.reason
        assert t.quant_spec().codebook.heads == 2
    assert "vq" in str(pol)  # the table's levels column
    # the codebooks differ per layer (fitted on each layer's own values)
    assert pol.get(0, "value").codebook != pol.get(1, "value").codebook
    path = kvpolicy.save_policy(compiled, tmp_path / "vq.yaml")
    # the file keeps the spec; the same text fits the same codebooks
    again = kvpolicy.compile_model(copy.deepcopy(model), policy=str(path), calibration=ids)
    assert kvpolicy.inspect(again).get(1, "value").codebook == pol.get(1, "value").codebook
    x = _ids(60, seed=1)
    with torch.no_grad():
        a = compiled.generate(x, max_new_tokens=8, do_sample=False)
        b = again.generate(x, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b)


def test_the_cache_counts_the_codebook_and_agrees_with_the_whole_cache_figure():
    model = kvpolicy.compile_model(tiny_model("llama"), policy=VQ, calibration=_ids(96))
    pol = kvpolicy.inspect(model)
    ids = _ids(200, seed=2)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    report = cache.memory_report()
    held = report["bytes"] - report["position_bytes"] - report["rope_bytes"]
    book = sum(t.codebook_bytes() for t in pol.tensors)
    assert book == 2 * 2 * VQ_ENTRIES * 4 * 2  # 2 layers x 2 kv heads x 256 x 4 fp16
    figure = whole_cache(pol, 200)
    assert abs(held - figure.bytes) <= 0.02 * figure.bytes


def test_vq_without_calibration_text_names_the_fix_and_leaves_the_model_usable():
    model = tiny_model("llama")  # no tokenizer beside it
    x = _ids(20)
    with torch.no_grad():
        before = model(x).logits
    with pytest.raises(KVPolicyError, match=r"levels: vq fits its codebooks.*calibration="):
        kvpolicy.compile_model(model, policy=VQ)
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)


@pytest.mark.parametrize(("rule", "match"), [
    ({"tensor": "key", "levels": "vq"}, "tensor: value"),
    ({"tensor": "value", "levels": "vq", "bits": 3}, "not 3"),
    ({"tensor": "value", "levels": "vq", "group_size": 12, "bits": 1}, "multiple of 8"),
])
def test_a_vq_setting_that_cannot_be_served_is_refused(rule, match):
    spec = {"defaults": {"bits": 2, "residual": 16}, "overrides": [{"layers": 0, **rule}]}
    with pytest.raises(PolicyError, match=match):
        kvpolicy.derive_policy(tiny_model("llama"), policy=spec, calibration=_ids(96))


def test_a_policy_file_with_a_broken_codebook_is_refused():
    pol = kvpolicy.derive_policy(tiny_model("llama"), policy=VQ, calibration=_ids(96))
    text = pol.to_yaml().replace(pol.get(0, "value").codebook, "AAAA")
    with pytest.raises(PolicyError, match="codebook"):
        ModelPolicy.from_yaml(text)


def test_a_stored_budget_prices_vq_values_and_takes_them_on_a_clustered_layer():
    """Calibration text of 6 distinct tokens: layer 0's values are a function of the token
    alone (RoPE touches keys only), so its unit sub-vectors are a few points a codebook
    holds exactly and its vq cost is far below any scalar option's at the same width.
    The whole-cache budget then codes that layer's values with vq."""
    model = tiny_model("llama")
    ids = _ids(224, rows=2, vocab=(10, 16))
    spec = {"defaults": {"stored_bits": 2.0, "budget_context": 2048, "sinks": 2, "residual": 16}}
    pol = kvpolicy.derive_policy(model, policy=spec, calibration=ids)
    cal = pol.calibration
    got = cal.vq_errors(0)
    assert set(got) == {1, 2}
    for w, (err, book) in got.items():
        scalar = [e for g in cal.groups for e in
                  (cal.errors(0, "value", group=g).get(w), cal.errors(
                      0, "value", group=g, meta8=True).get(w)) if e is not None]
        assert scalar and err < 0.01 * min(scalar)
        assert book
    value = pol.get(0, "value")
    assert value.levels == "vq" and value.codebook == got[value.bits][1]
    assert "levels: auto chose vq" in value.reason
    assert whole_cache(pol, 2048).bits <= 2.0 + 1e-9  # the centroids counted within it
    # what the vLLM plugin derives: scalar codes only, nothing measured vq
    scalar = kvpolicy.derive_policy(model, policy=spec, calibration=ids, vq_values=False)
    assert not any(t.vq for t in scalar.tensors) and not scalar.calibration.vq_errors(0)


def test_a_saved_budget_keeps_its_vq_codebooks_without_calibrating_again(tmp_path):
    model = tiny_model("llama")
    spec = {"defaults": {"stored_bits": 2.0, "budget_context": 2048, "sinks": 2, "residual": 16,
                         "channel_widths": "uniform"}}
    compiled = kvpolicy.compile_model(copy.deepcopy(model), policy=spec,
                                      calibration=_ids(224, rows=2, vocab=(10, 16)))
    pol = kvpolicy.inspect(compiled)
    assert any(t.vq for t in pol.tensors)
    path = kvpolicy.save_policy(compiled, tmp_path / "budget.yaml")
    again = kvpolicy.inspect(kvpolicy.compile_model(copy.deepcopy(model), policy=str(path)))
    assert again.tensors == pol.tensors


def test_vllm_serving_accepts_vq_values_with_their_codebooks():
    from kvpolicy.vllm.policy import ServedPolicy

    pol = kvpolicy.derive_policy(tiny_model("llama"), policy=VQ, calibration=_ids(96))
    served = ServedPolicy(pol, None, "", torch.float32)
    served.check_model(num_layers=2, num_kv_heads=2, head_dim=32)  # no refusal
    for layer in (0, 1):
        _, vs = served.specs(layer)
        assert vs.vq and vs.codebook is not None and vs.codebook.heads == 2


def test_the_default_text_fits_codebooks_on_tokens_held_out_from_the_calibration(smollm2):
    from kvpolicy.calibrate.text import calibration_ids
    from kvpolicy.zoo.text import pydoc_tokens

    model, tok = smollm2
    ids = pydoc_tokens(tok)
    cal, where = calibration_ids(model, tokenizer=tok, rows=2, tokens=64)
    held, where_held = calibration_ids(model, tokenizer=tok, rows=2, tokens=64, skip=128)
    assert torch.equal(cal.flatten(), ids[-128:]) and torch.equal(held.flatten(), ids[-256:-128])
    assert where_held == "pydoc text, 128 tokens before the last 128 as 2 rows of 64"
    assert where == "pydoc text, last 128 tokens as 2 rows of 64"


def test_written_vq_under_a_budget_is_refused_with_the_way():
    spec = {"defaults": {"stored_bits": 2.5, "levels": "vq"}}
    with pytest.raises(PolicyError, match="leave levels: auto"):
        kvpolicy.derive_policy(tiny_model("llama"), policy=spec, calibration=_ids(96))
