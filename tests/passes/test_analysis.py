"""The analysis on every tiny architecture, both hand-written modules, synthetic graphs
where layout or roles are changed by construction, and the error paths."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from one_block import OneBlockLM
from torch import nn

from kvpolicy import AnalysisError, analyse_model, derive_policy
from kvpolicy.passes.facts import Contracted, RopeStyle
from kvpolicy.zoo.tiny import TINY_ARCHITECTURES, GptFast, NanoGPT, tiny_model

# What each architecture's key path holds. Derived from the architectures' papers and
# code, independent of the analysis: (RoPE style or None, rotary_dim, per-head key norm).
EXPECTED_ROPE = {
    "llama": (RopeStyle.ROTATE_HALF, 32, False),
    "mistral": (RopeStyle.ROTATE_HALF, 32, False),
    "qwen2": (RopeStyle.ROTATE_HALF, 32, False),
    "qwen3": (RopeStyle.ROTATE_HALF, 32, True),
    "gemma": (RopeStyle.ROTATE_HALF, 32, False),
    "gemma3_text": (RopeStyle.ROTATE_HALF, 32, True),
    "phi": (RopeStyle.ROTATE_HALF, 16, False),  # partial_rotary_factor 0.5
    "gpt_neox": (RopeStyle.ROTATE_HALF, 8, False),  # rotary_pct 0.25
    "gpt2": (None, None, False),
    "opt": (None, None, False),
    "stablelm": (RopeStyle.ROTATE_HALF, 8, False),  # partial_rotary_factor 0.25
    "olmo2": (RopeStyle.ROTATE_HALF, 32, True),
    "starcoder2": (RopeStyle.ROTATE_HALF, 32, False),
    "mixtral": (RopeStyle.ROTATE_HALF, 32, False),
    "gpt_bigcode": (None, None, False),
    "codegen": (RopeStyle.INTERLEAVED, 16, False),  # GPT-J pairs on rotary_dim 16
    "gemma2": (RopeStyle.ROTATE_HALF, 32, False),
    # channels 16-31 of a key assembled in place (tests/passes/test_mla.py)
    "deepseek_v3": (RopeStyle.INTERLEAVED, 16, False),
}


def test_expectations_cover_every_tiny_architecture():
    assert set(EXPECTED_ROPE) == set(TINY_ARCHITECTURES)


def _check(model, rope_style, rotary_dim, norm, kv_heads):
    analysis = analyse_model(model)
    assert len(analysis.layers) == 2
    assert len(analysis.blocks) == 1  # both layers share one trace
    for lf in analysis.layers:
        k, v = lf.key, lf.value
        assert k.contracted is Contracted.CHANNEL, k
        assert v.contracted is Contracted.TOKEN, v
        assert k.head_dim == v.head_dim == 32
        assert k.num_kv_heads == v.num_kv_heads == kv_heads
        if rope_style is None:
            assert k.rope is None
        else:
            assert k.rope is not None and k.rope.style is rope_style
            assert k.rope.rotary_dim == rotary_dim
            assert k.rope.partial == (rotary_dim < 32)
        assert k.norm_before_rope is norm
    return analysis


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", sorted(TINY_ARCHITECTURES))
def test_tiny_architecture(arch, impl):
    if impl == "sdpa" and TINY_ARCHITECTURES[arch].get("attn_logit_softcapping"):
        pytest.skip("transformers has no SDPA attention for soft-capped logits (Gemma2)")
    model = tiny_model(arch, attn_implementation=impl)
    cfg = model.config
    kv_heads = 1 if getattr(cfg, "multi_query", False) else getattr(
        cfg, "num_key_value_heads", None
    ) or cfg.num_attention_heads
    style, rotary_dim, norm = EXPECTED_ROPE[arch]
    analysis = _check(model, style, rotary_dim, norm, kv_heads)
    policy = derive_policy(model, bits=2)
    pre = style is not None and analysis.layers[0].key.rope.reapplicable
    assert [t.pre_rope for t in policy.tensors] == [pre, False] * 2
    want = "scaled_dot_product_attention" if impl == "sdpa" else "matmul-softmax-matmul"
    assert want in analysis.layers[0].key.contraction


def test_nanogpt_fused_qkv_no_rope():
    _check(NanoGPT(), None, None, False, kv_heads=4)


def test_gpt_fast_complex_rope_and_repeat_interleave():
    analysis = _check(GptFast(), RopeStyle.COMPLEX, 32, False, kv_heads=2)
    assert analysis.layers[0].key.rope.sin_source is None  # one freqs_cis tensor


def test_gpt_fast_with_its_own_cache_buffers():
    model = GptFast()
    model.setup_caches(max_batch=4, max_seq=64)
    # Calls with input_pos write into preallocated buffers (index_put); the analysis must
    # follow the written keys, not the buffers.
    orig = model.forward
    model.forward = lambda idx: orig(idx, torch.arange(idx.shape[1]))
    analysis = analyse_model(model)
    k = analysis.layers[0].key
    assert k.contracted is Contracted.CHANNEL and k.rope.style is RopeStyle.COMPLEX


# ---------------------------------------------------------------------------------------
# Synthetic attention blocks: the rule, not the layout, decides
# ---------------------------------------------------------------------------------------


class _Proj(nn.Module):
    def __init__(self, dim=64, heads=2) -> None:
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim) for _ in range(3))

    def split(self, x, proj):  # [B, T, C] -> [B, H, T, D]
        B, T, _ = x.shape
        return proj(x).view(B, T, self.heads, self.hd).transpose(1, 2)

    def merge(self, y):
        B, H, T, D = y.shape
        return y.transpose(1, 2).reshape(B, T, H * D)


class EinsumAttention(_Proj):
    def forward(self, x):
        q, k, v = (self.split(x, p) for p in (self.q_proj, self.k_proj, self.v_proj))
        s = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(self.hd)
        p = torch.softmax(s, dim=-1)
        return self.merge(torch.einsum("bhqk,bhkd->bhqd", p, v))


class TransposedKeyAttention(_Proj):
    """Keys laid out [B, H, D, T], as some kernels keep them."""

    def forward(self, x):
        B, T, _ = x.shape
        q, v = self.split(x, self.q_proj), self.split(x, self.v_proj)
        k_t = self.k_proj(x).view(B, T, self.heads, self.hd).permute(0, 2, 3, 1)  # [B,H,D,T]
        p = torch.softmax(q @ k_t / math.sqrt(self.hd), dim=-1)
        return self.merge(p @ v)


class SwappedRolesAttention(_Proj):
    """The projection *named* v_proj feeds the scores and k_proj the weighted sum."""

    def forward(self, x):
        q, k, v = (self.split(x, p) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.merge(F.scaled_dot_product_attention(q, v, k))


def _source_weight(analysis, tensor: str) -> str:
    """The parameter whose projection produces the cached tensor."""
    block = next(iter(analysis.blocks.values()))
    gm = block.traced.graph_module
    sig = block.traced.exported.graph_signature
    node = next(n for n in gm.graph.nodes if n.name == getattr(block, tensor).source_node)
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and n.name in sig.inputs_to_parameters:
            target = sig.inputs_to_parameters[n.name]
            if target.endswith("weight"):
                return target
        stack.extend(n.all_input_nodes)
    raise AssertionError("no weight found")


@pytest.mark.parametrize("attn_cls", [EinsumAttention, TransposedKeyAttention])
def test_layout_does_not_decide(attn_cls):
    analysis = analyse_model(OneBlockLM(attn_cls()))
    lf = analysis.layers[0]
    assert lf.key.contracted is Contracted.CHANNEL
    assert lf.value.contracted is Contracted.TOKEN
    assert lf.key.head_dim == 32 and lf.key.num_kv_heads == 2
    assert _source_weight(analysis, "key").endswith("k_proj.weight")


def test_transposed_key_cache_point_keeps_its_layout():
    analysis = analyse_model(OneBlockLM(TransposedKeyAttention()))
    block = next(iter(analysis.blocks.values()))
    point = block.key_point
    # In [B, H, D, T] the channel dim is 2 and the token dim 3 (or their [B, T, H, D]
    # source): whichever node was chosen, the dims are read from shapes, not positions.
    assert int(point.shape[point.channel_dim]) == 32
    assert point.token_dim != point.channel_dim


def test_roles_are_decided_by_the_computation_not_names():
    analysis = analyse_model(OneBlockLM(SwappedRolesAttention()))
    assert _source_weight(analysis, "key").endswith("v_proj.weight")
    assert _source_weight(analysis, "value").endswith("k_proj.weight")
    assert analysis.layers[0].key.contracted is Contracted.CHANNEL


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------


class _MLP(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.softmax(self.fc(x), dim=-1)  # a softmax, but no attention


class SortedKeyAttention(_Proj):
    def forward(self, x):
        q, k, v = (self.split(x, p) for p in (self.q_proj, self.k_proj, self.v_proj))
        k = torch.sort(k, dim=-1).values
        return self.merge(F.scaled_dot_product_attention(q, k, v))


class OwnPastAttention(_Proj):
    """Concatenates a past it keeps itself in front of the new keys and values."""

    def __init__(self):
        super().__init__()
        self.past = nn.Parameter(torch.randn(1, 2, 3, 32))

    def forward(self, x):
        q, k, v = (self.split(x, p) for p in (self.q_proj, self.k_proj, self.v_proj))
        past = self.past.expand(k.shape[0], -1, -1, -1)
        k = torch.cat([past, k], dim=2)
        v = torch.cat([past, v], dim=2)
        return self.merge(F.scaled_dot_product_attention(q, k, v))


class KeyFromOutside(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.inner = _CoreAttention()
        self.proj = _Proj(dim)

    def forward(self, x):
        q, k, v = (self.proj.split(x, p) for p in (self.proj.q_proj, self.proj.k_proj,
                                                     self.proj.v_proj))
        return self.proj.merge(self.inner(q, k, v))


class _CoreAttention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def test_no_attention_is_a_clear_error():
    with pytest.raises(AnalysisError, match="no attention found in OneBlockLM"):
        analyse_model(OneBlockLM(_MLP()))


def test_key_from_an_unknown_op_names_the_node():
    with pytest.raises(AnalysisError, match=r"cannot follow the attention operand back .*getitem"):
        analyse_model(OneBlockLM(SortedKeyAttention()))


def test_two_candidate_caches():
    with pytest.raises(AnalysisError, match="two candidate caches"):
        analyse_model(OneBlockLM(OwnPastAttention()))


def test_key_entering_as_an_input_is_explained():
    with pytest.raises(AnalysisError, match=r"enters the attention block as an input \(args\[1"):
        analyse_model(OneBlockLM(KeyFromOutside()))


# ---------------------------------------------------------------------------------------
# The real model
# ---------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_smollm2_traced_once_and_derived(smollm2):
    model, _ = smollm2
    analysis = analyse_model(model)
    assert len(analysis.layers) == 30 and len(analysis.blocks) == 1
    policy = derive_policy(model, bits=2)
    keys = [t for t in policy.tensors if t.tensor == "key"]
    values = [t for t in policy.tensors if t.tensor == "value"]
    assert len(keys) == len(values) == 30
    assert all(t.axis == "channel" and t.pre_rope and t.head_dim == 64 for t in keys)
    assert all(t.axis == "token" and not t.pre_rope for t in values)
    rope = analysis.layers[0].key.rope
    assert rope.style is RopeStyle.ROTATE_HALF and rope.rotary_dim == 64
    assert analysis.layers[0].key.num_kv_heads == 3
