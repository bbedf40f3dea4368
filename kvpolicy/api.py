"""The public entry points: ``derive_policy`` and ``inspect`` (``compile_model`` lands with
the rewrite pass).

Pipeline (DESIGN.md §4): *trace* one attention block per distinct kind, *analyse* how its
consumer contracts K and V and whether RoPE sits on the key path (``kvpolicy.passes``),
*derive* a policy per tensor from those facts plus the user's YAML (``kvpolicy.policy``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from .errors import AnalysisError, KVPolicyError
from .facts import LayerFacts, TensorFacts
from .passes.contraction import (
    CachePoint,
    Consumer,
    describe_contraction,
    find_consumers,
    op_name,
    walk_to_cache_point,
)
from .passes.rope import RopeMatch, find_rope, precedes_projection
from .passes.trace import (
    TracedBlock,
    block_kind,
    dynamic_dims,
    find_attention_blocks,
    trace_block,
)
from .policy import ModelPolicy, PolicySpec, build_policy, load_spec

__all__ = [
    "BlockAnalysis", "ModelAnalysis", "analyse_model", "derive_policy", "inspect", "save_policy",
]

log = logging.getLogger(__name__)

_POLICY_ATTR = "_kvpolicy_policy"
_ANALYSIS_ATTR = "_kvpolicy_analysis"
_SPEC_ATTR = "_kvpolicy_spec"


@dataclass
class BlockAnalysis:
    """What the analysis found in one traced block kind."""

    traced: TracedBlock
    consumer: Consumer
    key_point: CachePoint  # the key as the consumer reads it (post-RoPE)
    value_point: CachePoint
    rope: RopeMatch | None
    key: TensorFacts
    value: TensorFacts


@dataclass
class ModelAnalysis:
    layers: list[LayerFacts]
    blocks: dict[str, BlockAnalysis]
    modules: list[nn.Module]  # the attention module of each layer, in layer order
    calls: list  # the probe call of each layer (passes.trace.AttentionCall)
    seconds: float
    trace_seconds: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)


def _probe_inputs(model: nn.Module, batch: int, length: int) -> torch.Tensor:
    """Token ids to drive one probe forward: sizes only matter, values stay in-vocabulary."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        if emb is None:
            raise AnalysisError(
                f"cannot build probe inputs for {type(model).__name__}: it has no config."
                "vocab_size and no nn.Embedding; pass example inputs explicitly"
            )
        vocab = emb.num_embeddings
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(min(3, vocab - 1), vocab, (batch, length), generator=gen)
    return ids.to(device)


def _names(traced: TracedBlock) -> tuple[set[str], dict[str, str]]:
    sig = traced.exported.graph_signature
    params = set(sig.inputs_to_parameters)
    names = {n: f"buffer '{t.removeprefix('module.')}'" for n, t in sig.inputs_to_buffers.items()}
    names.update({n: p for n, p in zip(sig.user_inputs, traced.input_paths, strict=False)})
    return params, names


def _check_single_source(point: CachePoint, tensor: str, names: dict[str, str]) -> None:
    src = point.chain[-1]
    node = next(n for n in point.node.graph.nodes if n.name == src)
    from_outside = node.name in names and not names[node.name].startswith("buffer")
    if node.op == "placeholder" and from_outside:
        raise AnalysisError(
            f"the {tensor} enters the attention block as an input ({names[node.name]}) instead "
            f"of being computed in it ({node.format_node()}); kvpolicy caches tensors the "
            "block computes — compile the module that projects the keys and values"
        )
    if op_name(node) == "cat":
        parts = [a for a in node.args[0]]
        raise AnalysisError(
            f"the {tensor} is a concatenation of {len(parts)} tensors "
            f"({', '.join(a.name for a in parts)}) at {node.format_node()}: two candidate "
            "caches (does the module keep its own past?); expected one computed tensor"
        )


def analyse_block(traced: TracedBlock) -> BlockAnalysis:
    """Contraction analysis and RoPE detection on one exported attention block."""
    gm: fx.GraphModule = traced.graph_module
    consumers = find_consumers(gm)
    if not consumers:
        raise AnalysisError(
            f"no attention consumer in the exported graph of {traced.kind}: expected "
            "scaled_dot_product_attention, or matmul/bmm/einsum -> softmax -> matmul/bmm/einsum"
        )
    if len(consumers) > 1:
        raise AnalysisError(
            f"{len(consumers)} attention consumers in one block "
            f"({', '.join(c.node.name for c in consumers)}); kvpolicy expects one per block"
        )
    c = consumers[0]
    params, names = _names(traced)
    kpoint = walk_to_cache_point(c.key, c.key_channel_dim, c.key_token_dim)
    vpoint = walk_to_cache_point(c.value, c.value_token_dim, c.value_channel_dim)
    rope = find_rope(
        gm, kpoint.node, kpoint.shape[kpoint.token_dim], kpoint.head_dim, params, names
    )
    if rope is None:
        _check_single_source(kpoint, "key", names)
    _check_single_source(vpoint, "value", names)
    key_source = rope.pre_rope if rope is not None else kpoint.node
    norm_before = rope is not None and not precedes_projection(rope.pre_rope)[0]
    key = TensorFacts(
        tensor="key", contracted=kpoint.contracted, head_dim=kpoint.head_dim,
        num_kv_heads=kpoint.num_heads, contraction=describe_contraction(c, "key", kpoint),
        source_node=key_source.name, consumer_node=c.node.name,
        rope=rope.facts if rope is not None else None, norm_before_rope=norm_before,
    )
    value = TensorFacts(
        tensor="value", contracted=vpoint.contracted, head_dim=vpoint.head_dim,
        num_kv_heads=vpoint.num_heads, contraction=describe_contraction(c, "value", vpoint),
        source_node=vpoint.node.name, consumer_node=c.node.name,
    )
    for node, tag in ((kpoint.node, "key"), (vpoint.node, "value"), (key_source, "key_source")):
        node.meta[f"kvpolicy.{tag}"] = key if tag != "value" else value
    c.node.meta["kvpolicy.consumer"] = c.kind
    return BlockAnalysis(traced, c, kpoint, vpoint, rope, key, value)


def analyse_model(model: nn.Module) -> ModelAnalysis:
    """Find, trace (once per block kind) and analyse every attention block of ``model``."""
    cached = getattr(model, _ANALYSIS_ATTR, None)
    if cached is not None:
        return cached
    start = time.perf_counter()
    was_training = model.training
    model.eval()
    try:
        calls = find_attention_blocks(model, _probe_inputs(model, 2, 7))
        calls2 = find_attention_blocks(model, _probe_inputs(model, 3, 11))
    finally:
        model.train(was_training)
    if len(calls) != len(calls2):
        raise AnalysisError(
            f"{len(calls)} attention blocks ran in one probe forward and {len(calls2)} in "
            "another; kvpolicy needs the same blocks to run for every input"
        )
    blocks: dict[str, BlockAnalysis] = {}
    layers: list[LayerFacts] = []
    trace_seconds = 0.0
    for call, call2 in zip(calls, calls2, strict=True):
        kind = block_kind(call)
        if kind not in blocks:
            traced = trace_block(call, dynamic_dims(call, call2), kind)
            trace_seconds += traced.seconds
            blocks[kind] = analyse_block(traced)
        b = blocks[kind]
        layers.append(LayerFacts(layer=call.index, block_kind=kind, key=b.key, value=b.value))
    analysis = ModelAnalysis(
        layers, blocks, [c.module for c in calls], calls, time.perf_counter() - start,
        trace_seconds,
    )
    log.info(
        "analysed %d attention layers (%d distinct block kinds) in %.2f s",
        len(layers), len(blocks), analysis.seconds,
    )
    object.__setattr__(model, _ANALYSIS_ATTR, analysis)
    return analysis


def _model_name(model: nn.Module) -> str:
    path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return Path(path).name if path else type(model).__name__


def derive_policy(
    model: nn.Module,
    bits: int | float = 2,
    policy: str | Path | Mapping[str, Any] | PolicySpec | None = None,
    calibration: Any = None,
    progress: bool = True,
) -> ModelPolicy:
    """Derive the quantization policy of every cached tensor of ``model``.

    Args:
        model: a ``transformers`` causal LM or any ``nn.Module`` whose forward takes token
            ids and runs attention (``scaled_dot_product_attention`` or
            matmul -> softmax -> matmul).
        bits: code width when ``policy`` is None (the ``kvpolicy-<bits>`` preset). A float
            (``2.5``, also ``3.0``) is a budget: the average code bits per cached element,
            spread over the tensors by their measured sensitivity (``kvpolicy.budget``).
        policy: a preset name (``"kivi-2"``), a YAML path, a dict or a ``PolicySpec``.
        calibration: for a budget only: ``[B, T]`` token ids to measure sensitivity on, a
            tokenizer for the default text, or a ``Calibration`` measured before. Default:
            the policy file's saved calibration, else the last 512 pydoc tokens.
        progress: show a progress bar while calibrating.

    Returns:
        A ``ModelPolicy``: per layer, key then value, axis/bits/group/pre-RoPE/residual/
        sinks with the contraction found and a reason. The spec it came from (with the
        calibration, for a budget) is kept on the model for ``save_policy``.

    Raises:
        PolicyError: the policy is invalid or does not fit the model.
        AnalysisError: the graph has no attention the analysis understands.
    """
    spec = load_spec(policy, bits=bits)
    analysis = analyse_model(model)
    result = build_policy(analysis.layers, spec, model_name=_model_name(model))
    if spec.budget is not None:
        from .budget import budget_policy

        result, cal = budget_policy(model, result, spec, calibration, progress=progress)
        spec = spec.model_copy(update={"calibration": cal})
    object.__setattr__(model, _SPEC_ATTR, spec)
    return result


def save_policy(model: nn.Module, path: str | Path) -> Path:
    """Write the spec behind ``model``'s last derived or compiled policy as a YAML policy
    file, with its calibration for a budget: compiling from that file gives the same policy
    without calibrating again.

    Raises:
        KVPolicyError: no policy was derived for ``model`` yet.
    """
    spec = getattr(model, _SPEC_ATTR, None)
    if spec is None:
        raise KVPolicyError(
            f"no policy was derived for this {type(model).__name__} yet; call "
            "kvpolicy.compile_model or kvpolicy.derive_policy first"
        )
    out = Path(path)
    out.write_text(spec.to_yaml(), encoding="utf-8")
    return out


def inspect(model: nn.Module) -> ModelPolicy:
    """The policy of ``model``: the attached one for a compiled model, else the derived
    ``kvpolicy-2`` default."""
    attached = getattr(model, _POLICY_ATTR, None)
    if attached is not None:
        return attached
    return derive_policy(model)
