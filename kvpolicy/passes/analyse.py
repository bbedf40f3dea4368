"""Run the analysis over a model: find its attention blocks, trace one per kind, and
establish the facts of each cached tensor (docs/design.md §4, *trace* and *analyse*).

``analyse_block`` runs the contraction analysis and RoPE detection on one exported block;
``analyse_model`` drives two probe forwards (two batch sizes and lengths, so that batch and
sequence dims are traced as dynamic), traces each distinct block kind once and caches the
result on the model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ..errors import AnalysisError
from ..state import state_of
from .config import check_supported, probe_lengths
from .contraction import (
    CachePoint,
    Consumer,
    describe_contraction,
    find_consumers,
    walk_to_cache_point,
)
from .facts import LayerFacts, TensorFacts
from .fx_graph import op_name
from .rope import RopeMatch, find_rope, find_rope_in_place, precedes_projection
from .trace import TracedBlock, block_kind, dynamic_dims, find_attention_blocks, trace_block

__all__ = [
    "CONSUMER_META",
    "KEY_META",
    "ROPE_META",
    "VALUE_META",
    "BlockAnalysis",
    "ModelAnalysis",
    "analyse_block",
    "analyse_model",
    "probe_inputs",
]

log = logging.getLogger(__name__)

# The records ``analyse_block`` leaves in ``node.meta`` for the rewrite (docs/design.md §4),
# as torch.fx's ShapeProp leaves ``meta["tensor_meta"]``. Each is a frozen match record
# whose node fields belong to the analysed (lifted) export; the rewrite runs on the
# unlifted module, whose nodes carry the same meta entries, and matches nodes by name.
CONSUMER_META = "kvpolicy.consumer"  # on the attention consumer: its Consumer
KEY_META = "kvpolicy.key"  # on the key as the consumer reads it (post-RoPE): its CachePoint
VALUE_META = "kvpolicy.value"  # on the value's cache point: its CachePoint
ROPE_META = "kvpolicy.rope"  # on the key in front of a rotation, if any: its RopeMatch
_RECORDS = (CONSUMER_META, KEY_META, VALUE_META, ROPE_META)


@dataclass
class BlockAnalysis:
    """What the analysis found in one traced block kind.

    ``consumer``, ``key_point``, ``value_point`` and ``rope`` are also recorded in the
    exported graph's ``node.meta`` (``CONSUMER_META`` ...), where the rewrite reads them.
    """

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
    calls: list  # the probe call of each layer (analysis.trace.AttentionCall)
    seconds: float
    trace_seconds: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)


def probe_inputs(model: nn.Module, batch: int, length: int) -> torch.Tensor:
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


def _check_not_returned(gm: fx.GraphModule, points: dict[str, CachePoint]) -> None:
    """Refuse a block that returns the keys or values it attends over: it keeps its own
    past the way a caller holds it (passed in, concatenated, returned: nanoGPT variants),
    which a packed cache the block reads cannot stand in for."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    returned = [x for x in torch.utils._pytree.tree_leaves(out.args)
                if isinstance(x, fx.Node)]
    for tensor, point in points.items():
        walked = set(point.chain)
        for i, node in enumerate(returned):
            if node.name in walked:
                raise AnalysisError(
                    f"the attention block returns the {tensor}s it attends over (output {i}, "
                    f"{node.format_node()}): it keeps its own past the hand-written way, past "
                    "keys and values passed in, concatenated and returned to the caller, who "
                    "holds them in full precision. kvpolicy cannot take over a past the "
                    "caller holds. Way out: take a transformers Cache argument and call "
                    "cache.update(k, v, layer_idx) (kvpolicy passes its packed cache there), "
                    "or write K/V into a buffer at input_pos (gpt-fast style) and compile "
                    "with probe_kwargs"
                )


def analyse_block(traced: TracedBlock) -> BlockAnalysis:
    """Contraction analysis and RoPE detection on one exported attention block.

    Besides returning what it found, it records the consumer, the cache points and the
    rotation in ``node.meta`` of the exported graph (``CONSUMER_META`` ...) for the rewrite;
    copies of the graph taken afterwards (``traced.exported.module()``) carry them too.
    """
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
    rope_facts = rope.facts if rope is not None else None
    if rope is None:
        # A rotation on one slice of a key written in place (MLA) is described, not moved.
        rope_facts = find_rope_in_place(
            gm, kpoint.node, kpoint.shape[kpoint.token_dim], kpoint.head_dim, params, names
        )
        _check_single_source(kpoint, "key", names)
    _check_single_source(vpoint, "value", names)
    _check_not_returned(gm, {"key": kpoint, "value": vpoint})
    key_source = rope.pre_rope if rope is not None else kpoint.node
    norm_before = rope is not None and not precedes_projection(rope.pre_rope)[0]
    key = TensorFacts(
        tensor="key", contracted=kpoint.contracted, head_dim=kpoint.head_dim,
        num_kv_heads=kpoint.num_heads, contraction=describe_contraction(c, "key", kpoint),
        source_node=key_source.name, consumer_node=c.node.name,
        rope=rope_facts, norm_before_rope=norm_before,
    )
    value = TensorFacts(
        tensor="value", contracted=vpoint.contracted, head_dim=vpoint.head_dim,
        num_kv_heads=vpoint.num_heads, contraction=describe_contraction(c, "value", vpoint),
        source_node=vpoint.node.name, consumer_node=c.node.name,
    )
    for node in gm.graph.nodes:  # records of an earlier run on this graph go stale
        for tag in _RECORDS:
            node.meta.pop(tag, None)
    c.node.meta[CONSUMER_META] = c
    kpoint.node.meta[KEY_META] = kpoint
    vpoint.node.meta[VALUE_META] = vpoint
    if rope is not None:
        rope.pre_rope.meta[ROPE_META] = rope
    return BlockAnalysis(traced, c, kpoint, vpoint, rope, key, value)


def analyse_model(
    model: nn.Module, probe_kwargs: Callable[[torch.Tensor], dict[str, Any]] | None = None
) -> ModelAnalysis:
    """Find, trace (once per block kind) and analyse every attention block of ``model``.

    Args:
        probe_kwargs: for a model whose forward needs more than token ids to take its
            cached path: ``ids [B, T] -> {keyword: value}`` added to each probe forward
            (gpt-fast: ``lambda ids: {"input_pos": torch.arange(ids.shape[1])}``).
    """
    st = state_of(model)
    if st.analysis is not None:
        return st.analysis
    extra = probe_kwargs or (lambda ids: {})
    check_supported(model)
    start = time.perf_counter()
    short, long = probe_lengths(model)
    was_training = model.training
    model.eval()
    try:
        ids, ids2 = probe_inputs(model, 2, short), probe_inputs(model, 3, long)
        calls = find_attention_blocks(model, ids, **extra(ids))
        calls2 = find_attention_blocks(model, ids2, **extra(ids2))
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
    st.analysis = analysis
    return analysis
