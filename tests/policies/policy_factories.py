"""Factories shared by the policy tests: synthetic analysis facts, building a policy
from a spec, writing a policy file, and asserting the PolicyError a spec raises."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpolicy.errors import PolicyError
from kvpolicy.passes.facts import Contracted, LayerFacts, RopeFacts, RopeStyle, TensorFacts
from kvpolicy.policies import ModelPolicy, build_policy, load_spec

# --------------------------------------------------------------------------- factories


def rope_facts(
    head_dim: int = 64, rotary_dim: int | None = None, style: RopeStyle = RopeStyle.ROTATE_HALF
) -> RopeFacts:
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    return RopeFacts(
        style=style,
        rotary_dim=rotary_dim,
        head_dim=head_dim,
        cos_source="position_embeddings[0]",
        sin_source="position_embeddings[1]",
        pre_rope_node="k_proj_view",
        description=f"{style.value} RoPE on channels 0-{rotary_dim - 1} of {head_dim}",
    )


def key_facts(
    head_dim: int = 64,
    rope: RopeFacts | None | str = "default",
    contracted: Contracted = Contracted.CHANNEL,
) -> TensorFacts:
    if rope == "default":
        rope = rope_facts(head_dim)
    return TensorFacts(
        tensor="key",
        contracted=contracted,
        head_dim=head_dim,
        num_kv_heads=3,
        contraction=f"q·kᵀ over head_dim={head_dim} (scaled_dot_product_attention)",
        source_node="k_proj_view",
        consumer_node="scaled_dot_product_attention",
        rope=rope,
    )


def value_facts(head_dim: int = 64, contracted: Contracted = Contracted.TOKEN) -> TensorFacts:
    return TensorFacts(
        tensor="value",
        contracted=contracted,
        head_dim=head_dim,
        num_kv_heads=3,
        contraction="softmax·V over tokens (scaled_dot_product_attention)",
        source_node="v_proj_view",
        consumer_node="scaled_dot_product_attention",
    )


def layer_facts(layer: int, head_dim: int = 64, rope: Any = "default", **kw: Any) -> LayerFacts:
    return LayerFacts(
        layer=layer,
        block_kind="LlamaAttention[hd=64]",
        key=kw.get("key") or key_facts(head_dim, rope),
        value=kw.get("value") or value_facts(head_dim),
    )


def model_facts(n: int = 4, **kw: Any) -> list[LayerFacts]:
    return [layer_facts(i, **kw) for i in range(n)]


def build(policy: Any = None, bits: int = 2, facts: list[LayerFacts] | None = None) -> ModelPolicy:
    return build_policy(facts or model_facts(), load_spec(policy, bits=bits), "tiny")


def write(tmp_path: Path, text: str, name: str = "policy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def raises(policy: Any, *fragments: str, facts: list[LayerFacts] | None = None) -> str:
    """Build with ``policy``; assert a PolicyError whose message holds every fragment."""
    with pytest.raises(PolicyError) as info:
        build(policy, facts=facts)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message
