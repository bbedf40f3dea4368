import math
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, QuantizedCache

from kvpolicy.errors import KVPolicyError, PolicyError
from kvpolicy.evaluation import peers
from kvpolicy.zoo.tiny import tiny_model

# Tiny llama: 2 layers, 2 KV heads, head_dim 32. Groups of 16 and a residual of 8 make quanto
# quantize after the prefill and every 8 decode steps (2 * 40 and 2 * 8 rows are multiples
# of 16, as its axis=-1 grouping needs).
CONTEXT, STEPS, GROUP, RESIDUAL = 40, 32, 16, 8
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny shapes run faster on one thread, and far faster than two threads on busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sharp():
    """(model, segments [1, 72]) where the cache visibly matters.

    Random weights give near-uniform attention and logits, which hide any cache error.
    Sharper keys (x4) and logits (x8), scored on the model's own greedy continuation, make
    the perplexity respond to the cache: fp about 6.5 here.
    """
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(4.0)
        ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(0))
        while ids.shape[1] < CONTEXT + STEPS:
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return model, ids


def _quanto(model, bits, axes=(0, 0)):
    return lambda: peers.peer_cache(model, "quanto", bits=bits, group_size=GROUP,
                                    residual=RESIDUAL, axis_key=axes[0], axis_value=axes[1])


def _forward_nll(model, segs: torch.Tensor, context: int, steps: int) -> float:
    """Summed next-token loss of tokens ``[context, context + steps)`` from one plain
    forward over the whole segments: no cache is read, so nothing the peer loop does."""
    with torch.no_grad():
        logits = model(segs).logits[:, context - 1 : context + steps - 1]
    targets = segs[:, context : context + steps]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                           reduction="sum").item()


def test_fp_peer_reproduces_one_plain_forward(sharp):
    """Teacher-forced decode through a fresh full-precision DynamicCache per segment scores
    what one forward over the same tokens scores; the 2-bit quanto peer does not."""
    model, ids = sharp
    segs = torch.cat([ids, ids.flip(1)])  # two segments: each must start from a fresh cache
    nll = _forward_nll(model, segs, CONTEXT, STEPS)
    made = []

    def fp_cache():
        made.append(peers.peer_cache(model, "fp"))
        return made[-1]

    fp = peers.peer_decode_perplexity(model, segs, CONTEXT, STEPS, fp_cache, progress=False)
    assert fp.tokens == 2 * STEPS
    assert fp.nll == pytest.approx(nll, rel=1e-4)
    assert fp.perplexity == pytest.approx(math.exp(nll / (2 * STEPS)), rel=1e-4)
    # one cache built per segment; the result holds the last segment's, as it ended
    assert len(made) == 2 and made[0] is not made[1] and fp.cache is made[1]
    assert type(fp.cache) is DynamicCache
    tokens = CONTEXT + STEPS
    assert fp.bytes.tokens == tokens
    assert fp.bytes.fp16 == 2 * LAYERS * KV_HEADS * tokens * HEAD_DIM * 2
    assert fp.seconds_per_step > 0
    q2 = peers.peer_decode_perplexity(model, segs, CONTEXT, STEPS, _quanto(model, 2),
                                      progress=False)
    assert q2.bytes.packed > 0 and type(q2.cache) is QuantizedCache
    assert abs(q2.nll / nll - 1) > 0.01, (
        f"2-bit quanto nll {q2.nll:.3f} within 1% of the full-precision {nll:.3f}")


def test_quanto_cache_gets_the_settings(sharp):
    model, _ = sharp
    cache = peers.peer_cache(model, "quanto", bits=4, group_size=GROUP, residual=RESIDUAL,
                             axis_key=-1, axis_value=0)
    assert len(cache.layers) == LAYERS
    layer = cache.layers[0]
    assert (layer.nbits, layer.q_group_size, layer.residual_length) == (4, GROUP, RESIDUAL)
    assert (layer.axis_key, layer.axis_value) == (-1, 0)


@pytest.mark.parametrize("axes", [(0, 0), (-1, 0)])
def test_quanto_4_bits_near_fp_and_2_bits_worse(sharp, axes):
    model, segs = sharp
    fp = peers.peer_decode_perplexity(model, segs, CONTEXT, STEPS,
                                      lambda: peers.peer_cache(model, "fp"), progress=False)
    q4, q2 = (peers.peer_decode_perplexity(model, segs, CONTEXT, STEPS, _quanto(model, b, axes),
                                           progress=False) for b in (4, 2))
    assert q4.bytes.packed > 0  # groups were really quantized
    assert abs(q4.perplexity / fp.perplexity - 1) < 0.04, (
        f"4-bit {q4.perplexity:.3f} vs fp {fp.perplexity:.3f}: more than 4% apart")
    assert q2.perplexity > 1.05 * q4.perplexity, (
        f"2-bit {q2.perplexity:.3f} not 5% worse than 4-bit {q4.perplexity:.3f}")


@pytest.mark.parametrize("axes", [(0, 0), (-1, -1)])
@pytest.mark.parametrize("steps, residual_tokens", [(32, 0), (29, 5)])
def test_cache_bytes_counts_codes_scales_and_residual(sharp, axes, steps, residual_tokens):
    model, segs = sharp
    tokens = CONTEXT + steps
    quantized = tokens - residual_tokens  # quanto flushed at 48, 56, 64 (and 72)
    per_tensor = KV_HEADS * quantized * HEAD_DIM  # elements of one layer's keys or values
    n = 2 * LAYERS  # keys and values of every layer
    fp = peers.peer_decode_perplexity(model, segs, CONTEXT, steps,
                                      lambda: peers.peer_cache(model, "fp"), progress=False)
    q = peers.peer_decode_perplexity(model, segs, CONTEXT, steps, _quanto(model, 2, axes),
                                     progress=False)
    b = q.bytes
    assert b.tokens == fp.bytes.tokens == tokens
    assert b.fp16 == fp.bytes.fp16 == n * KV_HEADS * tokens * HEAD_DIM * 2
    assert b.packed == n * per_tensor * 2 // 8  # four 2-bit codes per byte
    assert b.scales == n * (per_tensor // GROUP) * 2 * 4  # fp32 scale + shift per group
    assert b.residual == n * KV_HEADS * residual_tokens * HEAD_DIM * 4
    assert b.total < b.fp16 and b.compression > 1
    # the fp peer holds the model's fp32 states, twice the fp16 bytes
    assert (fp.bytes.packed, fp.bytes.scales, fp.bytes.residual) == (0, 0, 2 * fp.bytes.fp16)


def test_best_quanto_axes_scores_all_four_pairs(sharp):
    model, segs = sharp
    best, results = peers.best_quanto_axes(model, segs, CONTEXT, STEPS, bits=2,
                                           group_size=GROUP, residual=RESIDUAL)
    assert list(results) == [(0, 0), (0, -1), (-1, 0), (-1, -1)]
    assert results[best].perplexity == min(r.perplexity for r in results.values())
    assert all(math.isfinite(r.perplexity) for r in results.values())


def test_best_quanto_axes_refuses_groups_quanto_cannot_form(sharp):
    model, segs = sharp
    with pytest.raises(PolicyError, match="context=44.*multiples of 8"):
        peers.best_quanto_axes(model, segs, 44, 8, bits=2, group_size=GROUP, residual=RESIDUAL)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="quanto", bits=8), "use 2 or 4"),
    (dict(kind="quanto", axis_key=1), "axis_key"),
    (dict(kind="hqq"), "unknown peer kind"),
])
def test_peer_cache_rejects_what_quanto_cannot_do(sharp, kwargs, match):
    model, _ = sharp
    with pytest.raises(PolicyError, match=match):
        peers.peer_cache(model, **kwargs)


def test_missing_quanto_names_the_install_command(sharp, monkeypatch):
    model, _ = sharp
    monkeypatch.setitem(sys.modules, "optimum.quanto", None)  # import now raises ImportError
    with pytest.raises(KVPolicyError, match="pip install optimum-quanto"):
        peers.peer_cache(model, "quanto")
    assert type(peers.peer_cache(model, "fp")) is DynamicCache  # fp needs no quanto


@pytest.mark.real_model
def test_smollm2_per_channel_keys_beat_quantos_default_axes(smollm2):
    from kvpolicy.zoo import text as data

    model, tokenizer = smollm2
    segs = data.segments(tokenizer, 128 + 32, 1)
    ppl = {
        axes: peers.peer_decode_perplexity(
            model, segs, 128, 32,
            lambda axes=axes: peers.peer_cache(model, "quanto", bits=2, group_size=32,
                                               residual=32, axis_key=axes[0],
                                               axis_value=axes[1]),
            progress=False,
        ).perplexity
        for axes in [(0, 0), (-1, 0)]
    }
    assert ppl[(-1, 0)] < ppl[(0, 0)], (
        f"axes (-1, 0) {ppl[(-1, 0)]:.2f} vs (0, 0) {ppl[(0, 0)]:.2f}")
