"""The rewrite pass on small exported blocks: what it replaces, what it hands the attend
op, what it removes and what it refuses. Assertions are on graph nodes, never on text."""

from __future__ import annotations

import networkx as nx
import pytest
import torch
import torch.nn.functional as F
from one_block import OneBlockLM
from torch import fx, nn

import kvpolicy
from kvpolicy.errors import KVPolicyError
from kvpolicy.passes.analyse import (
    CONSUMER_META,
    KEY_META,
    ROPE_META,
    VALUE_META,
    BlockAnalysis,
    analyse_model,
)
from kvpolicy.passes.fx_graph import fx_digraph, is_symbolic, op_name, shape_of
from kvpolicy.passes.rewrite import RewriteResult, rewrite_block
from kvpolicy.zoo.tiny import GptFast, NanoGPT, tiny_model

ATTEND = "kvpolicy_attend"
_CONSUMER_OPS = {"scaled_dot_product_attention", "softmax", "_softmax", "_safe_softmax"}


def _block(model: nn.Module) -> BlockAnalysis:
    analysis = analyse_model(model)
    assert len(analysis.blocks) == 1
    return next(iter(analysis.blocks.values()))


def _rewrite(block: BlockAnalysis, pre_rope: bool) -> RewriteResult:
    return rewrite_block(block.traced.exported.module(), pre_rope=pre_rope)


def _attend_node(graph: fx.Graph) -> fx.Node:
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target == ATTEND]
    assert len(calls) == 1, [n.format_node() for n in calls]
    return calls[0]


def _ops(graph: fx.Graph) -> list[str]:
    return [op_name(n) for n in graph.nodes]


def _names(graph: fx.Graph) -> set[str]:
    return {n.name for n in graph.nodes}


def _mul_users(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if op_name(u) == "mul"]


@pytest.fixture(scope="module")
def llama_sdpa() -> BlockAnalysis:
    return _block(tiny_model("llama"))


@pytest.fixture(scope="module")
def llama_eager() -> BlockAnalysis:
    return _block(tiny_model("llama", attn_implementation="eager"))


# ---------------------------------------------------------------------------------------
# The records the analysis leaves for the pass
# ---------------------------------------------------------------------------------------


def test_analysis_records_reach_the_unlifted_graph(llama_sdpa):
    b = llama_sdpa
    graph = b.traced.exported.module().graph
    hosts = {key: [n for n in graph.nodes if key in n.meta]
             for key in (CONSUMER_META, KEY_META, VALUE_META, ROPE_META)}
    assert {key: len(ns) for key, ns in hosts.items()} == dict.fromkeys(hosts, 1)
    assert hosts[CONSUMER_META][0].meta[CONSUMER_META] is b.consumer
    assert hosts[KEY_META][0].meta[KEY_META] is b.key_point
    assert hosts[VALUE_META][0].meta[VALUE_META] is b.value_point
    assert hosts[ROPE_META][0].meta[ROPE_META] is b.rope
    assert hosts[CONSUMER_META][0].name == b.consumer.node.name
    assert hosts[KEY_META][0].name == b.key_point.node.name
    assert hosts[VALUE_META][0].name == b.value.source_node
    assert hosts[ROPE_META][0].name == b.key.source_node == b.rope.facts.pre_rope_node


def test_a_graph_without_analysis_records_is_refused():
    class Plain(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    x = torch.randn(1, 2, 5, 8)
    gm = torch.export.export(Plain(), (x, x, x)).module()
    with pytest.raises(KVPolicyError, match=r"no node of the graph carries node.meta\['kvpolicy"):
        rewrite_block(gm, pre_rope=False)


# ---------------------------------------------------------------------------------------
# SDPA with rotate-half RoPE (tiny Llama)
# ---------------------------------------------------------------------------------------


def test_sdpa_pre_rope_key_replaces_the_consumer_and_drops_the_key_rotation(llama_sdpa):
    b = llama_sdpa
    source = b.traced.exported.module().graph
    res = _rewrite(b, pre_rope=True)
    g = res.graph
    call = _attend_node(g)
    assert not _CONSUMER_OPS & set(_ops(g))
    q, k, v, mask, cos, sin, positions = call.args
    assert positions is None  # no buffer of its own
    assert (q.name, k.name, v.name) == (b.consumer.query.name, b.key.source_node,
                                        b.value.source_node)
    assert mask is None and res.attend.mask_kind is None and res.attend.causal
    assert (cos.name, sin.name) == (b.rope.cos_node.name, b.rope.sin_node.name)
    # Shapes: query [B, Hq, T, D], pre-RoPE key [B, Hkv, T, D] (GQA 4:2), value [B, T, Hkv, D].
    (bq, hq, tq, dq), (bk, hk, tk, dk) = shape_of(q), shape_of(k)
    assert (hq, dq, hk, dk) == (4, 32, 2, 32) and is_symbolic(tq) and tq == tk and bq == bk
    assert shape_of(v)[2:] == (2, 32)
    # The key's rotation is dead code; the query's stays and feeds the attend op.
    assert set(b.rope.region) <= _names(source)
    assert not set(b.rope.region) & _names(g)
    assert len(_mul_users(cos)) == len(_mul_users(sin)) == 1  # the query's
    assert {op_name(a) for a in q.all_input_nodes} == {"mul"}
    assert res.attend.rope_style == "rotate_half" and not res.attend.complex_rope
    assert res.attend.scale == pytest.approx(32 ** -0.5)
    g.lint()


def test_sdpa_post_rope_key_keeps_the_rotation(llama_sdpa):
    b = llama_sdpa
    res = _rewrite(b, pre_rope=False)
    call = _attend_node(res.graph)
    q, k, v, mask, cos, sin, positions = call.args
    assert positions is None  # no buffer of its own
    assert k.name == b.key_point.node.name != b.key.source_node
    assert (mask, cos, sin) == (None, None, None)
    assert set(b.rope.region) <= _names(res.graph)
    assert res.attend.rope_style is None and res.attend.cos_layout is None
    res.graph.lint()


def test_the_pass_leaves_its_input_alone_and_takes_a_graph_too(llama_sdpa):
    gm = llama_sdpa.traced.exported.module()
    before = [n.format_node() for n in gm.graph.nodes]
    res = rewrite_block(gm.graph, pre_rope=True)
    assert [n.format_node() for n in gm.graph.nodes] == before
    assert "scaled_dot_product_attention" in _ops(gm.graph)
    assert res.graph is not gm.graph
    _attend_node(res.graph)


# ---------------------------------------------------------------------------------------
# matmul -> softmax -> matmul (tiny Llama, eager attention)
# ---------------------------------------------------------------------------------------


def test_matmul_softmax_matmul_is_replaced_with_its_scale_and_mask(llama_eager):
    b = llama_eager
    assert b.consumer.kind == "matmul-softmax-matmul"
    res = _rewrite(b, pre_rope=True)
    g = res.graph
    call = _attend_node(g)
    assert b.consumer.node.name not in _names(g)  # the weighted sum ·V
    # The eager block also returns its attention weights: what computes them may stay
    # for that output, but nothing of it feeds the attend op.
    feeding = {n.name for n in nx.ancestors(fx_digraph(g), call)}
    assert b.consumer.softmax.name not in feeding and b.consumer.scores.name not in feeding
    q, k, v, mask, cos, sin, positions = call.args
    assert positions is None  # no buffer of its own
    assert (q.name, k.name, v.name) == (b.consumer.query.name, b.key.source_node,
                                        b.value.source_node)
    # The additive causal mask the block received: [B, 1, T, T].
    assert mask.op == "placeholder" and shape_of(mask)[1] == 1
    assert shape_of(mask)[2] == shape_of(mask)[3] == shape_of(q)[2]
    assert res.attend.mask_kind == "additive" and not res.attend.causal
    assert res.attend.scale == pytest.approx(32 ** -0.5)
    assert (cos.name, sin.name) == (b.rope.cos_node.name, b.rope.sin_node.name)
    g.lint()


# ---------------------------------------------------------------------------------------
# Other key paths: complex RoPE (gpt-fast), no RoPE with a fused qkv (nanoGPT)
# ---------------------------------------------------------------------------------------


def test_complex_rope_hands_over_one_freqs_cis_and_keeps_the_query_rotation():
    b = _block(GptFast())
    source = b.traced.exported.module().graph
    res = _rewrite(b, pre_rope=True)
    call = _attend_node(res.graph)
    _, k, _, mask, cos, sin, _ = call.args
    assert k.name == b.key.source_node and sin is None
    assert cos.name == b.rope.cos_node.name
    assert res.attend.complex_rope and res.attend.rope_style == "interleaved"
    assert res.attend.mask_kind == "fill" and mask.meta["val"].dtype == torch.bool
    assert _ops(source).count("view_as_complex") == 2  # query and key
    assert _ops(res.graph).count("view_as_complex") == 1  # the query's
    res.graph.lint()


def test_no_rope_fused_qkv_reads_the_split_key():
    b = _block(NanoGPT())
    assert b.rope is None
    for pre_rope in (True, False):  # nothing to move in front of: the same rewrite
        res = _rewrite(b, pre_rope=pre_rope)
        _, k, v, mask, cos, sin, _ = _attend_node(res.graph).args
        assert (k.name, v.name) == (b.key.source_node, b.value.source_node)
        assert (mask, cos, sin) == (None, None, None)
        assert "scaled_dot_product_attention" not in _ops(res.graph)
        res.graph.lint()


# ---------------------------------------------------------------------------------------
# What sits between the scores and the softmax
# ---------------------------------------------------------------------------------------


class _Heads(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 2, kv_heads: int | None = None) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads or heads, dim // heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, self.kv_heads * self.hd)
        self.v_proj = nn.Linear(dim, self.kv_heads * self.hd)

    def qkv(self, x):  # [B, T, C] -> [B, H, T, D] each
        B, T, _ = x.shape
        return tuple(
            p(x).view(B, T, h, self.hd).transpose(1, 2)
            for p, h in ((self.q_proj, self.heads), (self.k_proj, self.kv_heads),
                         (self.v_proj, self.kv_heads))
        )

    def merge(self, y):
        B, H, T, D = y.shape
        return y.transpose(1, 2).reshape(B, T, H * D)


def _additive_causal(t: int) -> torch.Tensor:
    return torch.full((t, t), float("-inf")).triu(1)


def _bool_causal(t: int) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool).triu(1)


class _Between(_Heads):
    """q·kᵀ -> ``between(scores, T)`` -> softmax -> ·V."""

    def __init__(self, between) -> None:
        super().__init__()
        self.between = between

    def forward(self, x):
        q, k, v = self.qkv(x)
        s = self.between(q @ k.transpose(-1, -2), x.shape[1])
        return self.merge(torch.softmax(s, dim=-1) @ v)


def _softcap(s, t, mask=True):
    """Gemma2's order: scale, soft-cap (cap 3), then the mask."""
    s = torch.tanh(s * 0.125 / 3.0) * 3.0
    return s + _additive_causal(t) if mask else s


# (between, scale, mask kind, mask dtype, softcap)
_SUPPORTED = {
    "mul": (lambda s, t: s * 0.125, 0.125, None, None, None),
    "div": (lambda s, t: s / 4.0, 0.25, None, None, None),
    "mul-then-div": (lambda s, t: s * 2.0 / 8.0, 0.25, None, None, None),
    "additive": (lambda s, t: s * 0.5 + _additive_causal(t), 0.5, "additive", torch.float32,
                 None),
    "additive-mask-first": (lambda s, t: _additive_causal(t) + s / 2.0, 0.5, "additive",
                            torch.float32, None),
    "masked_fill": (lambda s, t: (s / 2.0).masked_fill(_bool_causal(t), float("-inf")), 0.5,
                    "fill", torch.bool, None),
    # softcap * tanh(scale * s / softcap): scale is every constant, softcap those after tanh
    "softcap": (_softcap, 0.125, "additive", torch.float32, 3.0),
    "softcap-no-mask": (lambda s, t: _softcap(s, t, mask=False), 0.125, None, None, 3.0),
    "softcap-cap-in-two": (lambda s, t: torch.tanh(s / 4.0) * 2.0 * 2.0, 1.0, None, None, 4.0),
    "softcap-cast-then-fill": (
        lambda s, t: (torch.tanh(s.float() / 8.0).to(s.dtype) * 8.0).masked_fill(
            _bool_causal(t), float("-inf")), 1.0, "fill", torch.bool, 8.0),
}


@pytest.mark.parametrize("case", sorted(_SUPPORTED))
def test_scale_and_mask_between_scores_and_softmax(case):
    between, scale, kind, dtype, softcap = _SUPPORTED[case]
    b = _block(OneBlockLM(_Between(between)))
    res = _rewrite(b, pre_rope=False)
    g = res.graph
    q, k, v, mask, cos, sin, _ = _attend_node(g).args
    assert not _CONSUMER_OPS & set(_ops(g)) and "matmul" not in _ops(g)
    assert "tanh" not in _ops(g)
    assert (k.name, v.name) == (b.key.source_node, b.value.source_node)
    assert res.attend.scale == pytest.approx(scale)
    assert (res.attend.softcap is None) if softcap is None else (
        res.attend.softcap == pytest.approx(softcap))
    assert res.attend.mask_kind == kind and not res.attend.causal
    if kind is None:
        assert mask is None
    else:
        t = shape_of(q)[2]
        assert mask.meta["val"].dtype == dtype and shape_of(mask) == (t, t)
    assert (cos, sin) == (None, None)
    g.lint()


@pytest.mark.parametrize("case", ["softcap", "softcap-cap-in-two", "softcap-cast-then-fill"])
def test_soft_capped_block_compiles_exactly(case):
    """At 16 bits the compiled block computes what the module computes: the cap and scale
    read off the graph are the module's (a wrong split of the constants would differ)."""
    torch.manual_seed(0)
    ref = OneBlockLM(_Between(_SUPPORTED[case][0]))
    with torch.no_grad():  # scores of a few units: the cap is far from linear
        for p in (ref.attn.q_proj, ref.attn.k_proj):
            p.weight.mul_(8.0)
    model = OneBlockLM(_Between(_SUPPORTED[case][0]))
    model.load_state_dict(ref.state_dict())
    kvpolicy.compile_model(model, bits=16)
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = ref(ids), model(ids)
        uncapped = OneBlockLM(_Between(lambda s, t: s * _SUPPORTED[case][1] + (
            _additive_causal(t) if _SUPPORTED[case][2] else 0.0)))
        uncapped.load_state_dict(ref.state_dict())
        plain = uncapped(ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (want - plain).abs().max() > 1e-2, "the cap does not change this block's output"


_REFUSED = {
    "tanh-without-cap": (lambda s, t: torch.tanh(s / 8.0),
                         r"soft-capping.*but no constant multiplies it: %tanh"),
    "tanh-negative-cap": (lambda s, t: torch.tanh(s / 8.0) * -8.0,
                          r"soft-capping.*but it is multiplied by -8.0: %tanh"),
    "tanh-twice": (lambda s, t: torch.tanh(torch.tanh(s / 8.0) * 8.0 / 2.0) * 2.0,
                   r"a second tanh on the scores: %tanh"),
    "mask-inside-tanh": (lambda s, t: torch.tanh((s + _additive_causal(t)) / 8.0) * 8.0,
                         r"a mask on the scores inside the soft-capping tanh \(%add"),
    "tanh-times-a-tensor": (lambda s, t: torch.tanh(s / 8.0) * torch.full((t, t), 8.0),
                            r"cannot rewrite an op between the scores and the softmax: %mul"),
    "tanh-plus-a-constant": (lambda s, t: torch.tanh(s / 8.0) * 8.0 + 1.0,
                             r"cannot rewrite an op between the scores and the softmax: %add"),
    "fill-not-a-mask": (lambda s, t: s.masked_fill(_bool_causal(t), 0.0),
                        r"masked_fill with 0.0 is not a mask: %masked_fill"),
    "two-masks": (lambda s, t: s + _additive_causal(t) + _additive_causal(t),
                  r"two masks on the scores at %add"),
}


@pytest.mark.parametrize("case", sorted(_REFUSED))
def test_an_unsupported_op_before_the_softmax_is_refused_by_name(case):
    between, message = _REFUSED[case]
    b = _block(OneBlockLM(_Between(between)))
    with pytest.raises(KVPolicyError, match=message):
        _rewrite(b, pre_rope=False)


class _SdpaMask(_Heads):
    def forward(self, x):
        q, k, v = self.qkv(x)
        mask = _additive_causal(x.shape[1])
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_sdpa_mask_is_handed_over():
    res = _rewrite(_block(OneBlockLM(_SdpaMask())), pre_rope=False)
    mask = _attend_node(res.graph).args[3]
    assert res.attend.mask_kind == "sdpa" and not res.attend.causal
    assert op_name(mask) == "triu"


# ---------------------------------------------------------------------------------------
# Grouped-query heads
# ---------------------------------------------------------------------------------------


class _Gqa(_Heads):
    def __init__(self, tile: str) -> None:
        super().__init__(heads=4, kv_heads=2)
        self.tile = tile

    def forward(self, x):
        q, k, v = self.qkv(x)
        if self.tile == "repeat":  # kv head h % 2 for query head h
            k, v = k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1)
        else:  # kv head h // 2
            k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        return self.merge(F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_repeat_tiled_gqa_is_refused():
    b = _block(OneBlockLM(_Gqa("repeat")))
    with pytest.raises(KVPolicyError, match=r"tiled by %repeat"):
        _rewrite(b, pre_rope=False)


def test_repeat_interleave_gqa_reads_the_kv_heads():
    res = _rewrite(_block(OneBlockLM(_Gqa("repeat_interleave"))), pre_rope=False)
    q, k, v, *_ = _attend_node(res.graph).args
    def static(node):  # heads and head_dim, wherever the layout puts them
        return [int(s) for s in shape_of(node) if not is_symbolic(s)]

    assert static(q) == [4, 16] and static(k) == static(v) == [2, 16]
    assert "repeat_interleave" not in _ops(res.graph)
    assert res.attend.scale is None and res.attend.causal
    res.graph.lint()
