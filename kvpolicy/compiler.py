"""Compile time: rewrite each analysed block kind onto the packed cache and check it.

For each block kind the analysed export is unlifted (``ExportedProgram.module()``) and
rewritten once (``kvpolicy.passes.rewrite``). A second call structure is traced where the model
takes an attention mask (left-padded batches). Every rewritten graph is run once at full
precision against the original block; only then does ``kvpolicy.api.compile_model`` install
anything (``runtime.install``), so a failed compile leaves the model as it was.
"""

from __future__ import annotations

import inspect as _inspect

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .errors import KVPolicyError
from .passes import rewrite as rw
from .passes.analyse import (
    BlockAnalysis,
    ModelAnalysis,
    analyse_block,
    probe_inputs,
)
from .passes.config import sliding_windows
from .passes.trace import AttentionCall, dynamic_dims, find_attention_blocks, trace_block
from .policies import ModelPolicy
from .runtime.cache import KVPolicyCache
from .runtime.install import (
    KindGraph,
    call_signature,
    flatten_call,
    layer_graph_module,
    resolve_attr,
    run_block,
)
from .runtime.rotary import rotary_sources

__all__ = ["compile_blocks", "sliding_windows"]


def compile_blocks(
    model: nn.Module, analysis: ModelAnalysis, policy: ModelPolicy
) -> dict[str, dict[tuple, KindGraph]]:
    """Rewrite every block kind of ``analysis`` onto the packed cache and check each
    rewrite: at full precision the rewritten block must reproduce the original.

    Returns:
        ``{block kind: {call signature: KindGraph}}``: the plain call of each kind, plus
        the left-padded call (an attention mask) of transformers models.

    Raises:
        KVPolicyError: a block kvpolicy cannot rewrite, or a rewrite that changes the
            block's output. The model is not touched.
    """
    kinds: dict[str, dict[tuple, KindGraph]] = {}
    # The model's own RoPE frequencies, for the cache to compute cos/sin rows from
    # positions instead of storing rows per token (runtime.rotary).
    sources = rotary_sources(model)
    first_call: dict[str, AttentionCall] = {}
    for call, lf in zip(analysis.calls, analysis.layers, strict=True):
        first_call.setdefault(lf.block_kind, call)
    for kind, block in analysis.blocks.items():
        pre = policy.get(next(lf.layer for lf in analysis.layers if lf.block_kind == kind),
                      "key").pre_rope
        kg = _build_kind_graph(block, pre)
        kg.attend.rotary_sources = sources
        call = first_call[kind]
        _, leaves, spec_ = flatten_call(call.args, call.kwargs)
        kinds[kind] = {(spec_, call_signature(leaves)): kg}
        _lossless_check(block, kg, call, policy)
    # Left-padded batches pass an attention mask: a second call structure per kind.
    was_training = model.training
    model.eval()
    try:
        extra = _probe_calls(model, analysis)
    finally:
        model.train(was_training)
    for call, dyn in extra:
        kind = analysis.layers[call.index].block_kind
        _, leaves, spec_ = flatten_call(call.args, call.kwargs)
        sig = (spec_, call_signature(leaves))
        if sig in kinds[kind]:
            continue
        traced = trace_block(call, dyn, kind)
        block = analyse_block(traced)
        pre = policy.get(call.index, "key").pre_rope
        kg = _build_kind_graph(block, pre)
        kg.attend.rotary_sources = sources
        _lossless_check(block, kg, call, policy)
        kinds[kind][sig] = kg

    return kinds


def _build_kind_graph(block: BlockAnalysis, pre_rope: bool) -> KindGraph:
    unlifted = block.traced.exported.module()
    # The analysis left its records in node.meta of the export; the unlifted copy,
    # taken after it, carries them (rewrite.rewrite_block reads them there).
    res = rw.rewrite_block(unlifted, pre_rope=pre_rope)
    g = res.graph
    for n in list(g.nodes):
        if n.op == "call_module" and n.target == "_guards_fn":
            g.erase_node(n)
    g.eliminate_dead_code(is_impure_node=rw.rw_keep)
    g.lint()
    consts = {}
    for n in g.nodes:
        if n.op == "get_attr" and not n.target.startswith("module."):
            consts[n.target] = resolve_attr(unlifted, n.target)
    return KindGraph(g, res.attend, consts)


def _probe_calls(model: nn.Module, analysis: ModelAnalysis) -> list[tuple]:
    """Extra call structures to trace: a left-padded batch for transformers models."""
    params = _inspect.signature(model.forward).parameters
    if "attention_mask" not in params:
        return []

    out = []
    ids1, ids2 = probe_inputs(model, 2, 7), probe_inputs(model, 3, 11)
    m1, m2 = torch.ones_like(ids1), torch.ones_like(ids2)
    m1[0, :2] = 0
    m2[1, :3] = 0
    calls1 = find_attention_blocks(model, ids1, attention_mask=m1)
    calls2 = find_attention_blocks(model, ids2, attention_mask=m2)
    for c1, c2 in zip(calls1, calls2, strict=True):
        out.append((c1, dynamic_dims(c1, c2)))
    return out


def _lossless_check(block: BlockAnalysis, kg: KindGraph, call: AttentionCall,
                    policy: ModelPolicy) -> None:
    cache = KVPolicyCache(_full_precision(policy), backend="torch")
    _, leaves, spec = flatten_call(call.args, call.kwargs)
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    with torch.no_grad():
        ref = call.module(*args, **kwargs)
        got = run_block(layer_graph_module(kg, call.module), cache, call.index, leaves)
    r = next(x for x in pytree.tree_leaves(ref) if isinstance(x, torch.Tensor))
    g = next(x for x in pytree.tree_leaves(got) if isinstance(x, torch.Tensor))
    _check_lossless(r, g, f"layer {call.index} ({block.traced.kind})")


def _full_precision(policy: ModelPolicy) -> ModelPolicy:
    tensors = tuple(t.model_copy(update={"bits": 16}) for t in policy.tensors)
    return policy.model_copy(update={"tensors": tensors})


def _check_lossless(original: torch.Tensor, rewritten: torch.Tensor, where: str) -> None:
    """The compile-time check: the rewritten block at full precision equals the original."""
    if original.shape != rewritten.shape:
        raise KVPolicyError(f"{where}: rewritten block returns {tuple(rewritten.shape)}, "
                            f"the original {tuple(original.shape)}")
    err = (original.float() - rewritten.float()).abs().max().item()
    ref = original.float().abs().max().item() + 1e-6
    # A half-precision block rounds its scores, rotation and output in its dtype where the
    # rewrite may keep fp32: a few units of rounding apart, far below what a wrong rewrite
    # gives (a misplaced rotation or scale is O(1)). NOTE: fp16 Llama block, hidden 4096:
    # 6.5e-4 relative (0.67 eps); a tiny fp16 Llama: 4e-4.
    tol = max(1e-4, 8 * torch.finfo(original.dtype).eps) if original.is_floating_point() else 1e-4
    if not err <= tol * max(ref, 1.0):
        raise KVPolicyError(
            f"{where}: the rewritten block differs from the original by {err:.3g} (max |out| "
            f"{ref:.3g}) at full precision; the rewrite is wrong for this block - please report"
        )
