"""``compile_model``: rewrite every attention block onto the packed cache and install it.

For each block kind the analysed export is unlifted (``ExportedProgram.module()``) and
rewritten once (``passes.rewrite``); each layer of that kind gets a ``GraphModule`` over the
rewritten graph bound to its own parameters. The layer's ``forward`` is replaced by a thin
wrapper that flattens the call exactly as it was traced, finds the cache among the
arguments, and runs the graph with that layer's packed cache in context.

Everything that can fail (analysis, policy, rewrite, the lossless numerical check) runs
before the model is touched: a failed compile leaves the model as it was.
"""

from __future__ import annotations

import contextvars
import copy
import functools
import inspect as _inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from .api import BlockAnalysis, ModelAnalysis, analyse_model, derive_policy
from .errors import KVPolicyError, PolicyError
from .model_cache import KVPolicyCache
from .passes import rewrite as rw
from .passes.trace import AttentionCall, _is_cache_object, trace_block
from .policy import ModelPolicy, load_spec

__all__ = ["compile_model", "CompiledModel", "KVPolicyCache"]

log = logging.getLogger(__name__)

_BACKENDS = ("auto", "torch", "triton")
# The cache a whole-model call created because none was passed (nanoGPT-style models,
# use_cache=False): blocks called without a cache argument use it.
_CALL_CACHE: contextvars.ContextVar[KVPolicyCache | None] = contextvars.ContextVar(
    "kvpolicy_call_cache", default=None
)


def _signature(leaves: list) -> tuple:
    """What a traced graph depends on: tensor ranks/dtypes and non-tensor values."""
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            out.append(("T", x.dim(), x.dtype))
        elif isinstance(x, (int, float, bool, str, type(None))):
            out.append(("V", x))
        else:
            out.append(("O", type(x).__name__))
    return tuple(out)


def _flatten_call(args: tuple, kwargs: dict):
    """Drop the cache object; return (cache, leaves, treespec).

    NOTE: runs once per layer per decode step: plain ``tree_flatten`` (no key paths) and
    one pass over the leaves; key paths cost ~2 ms per SmolLM2 step.
    """
    leaves, spec = pytree.tree_flatten((args, kwargs), is_leaf=_is_cache_object)
    cache = None
    for i, x in enumerate(leaves):
        if _is_cache_object(x):
            cache, leaves[i] = x, None
    return cache, leaves, spec


@dataclass
class _KindGraph:
    """One rewritten graph of a block kind for one call structure."""

    graph: fx.Graph
    attend: rw.KVAttend
    consts: dict[str, Any]  # get_attr targets that are not the layer's own parameters
    per_layer: dict[int, fx.GraphModule] = field(default_factory=dict)


def _resolve(root: nn.Module, target: str):
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _build_kind_graph(block: BlockAnalysis, pre_rope: bool) -> _KindGraph:
    unlifted = block.traced.exported.module()
    res = rw.rewrite_block(
        unlifted.graph, block.consumer, block.key_point, block.value_point, block.rope,
        pre_rope=pre_rope,
    )
    g = res.graph
    for n in list(g.nodes):
        if n.op == "call_module" and n.target == "_guards_fn":
            g.erase_node(n)
    g.eliminate_dead_code(is_impure_node=rw.rw_keep)
    g.lint()
    consts = {}
    for n in g.nodes:
        if n.op == "get_attr" and not n.target.startswith("module."):
            consts[n.target] = _resolve(unlifted, n.target)
    return _KindGraph(g, res.attend, consts)


class _Wrapper(nn.Module):
    """Mimics the traced ``_FlatCall`` root so that ``module.*`` targets resolve."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "module", module)  # not registered: no ownership


def _layer_graph_module(kg: _KindGraph, module: nn.Module) -> fx.GraphModule:
    root: dict[str, Any] = {"kvpolicy_attend": kg.attend, **kg.consts}
    w = _Wrapper(module)
    for n in kg.graph.nodes:
        if n.op == "get_attr" and n.target.startswith("module."):
            root[n.target] = _resolve(w, n.target)
    return fx.GraphModule(root, copy.deepcopy(kg.graph), class_name="KVPolicyBlock")


@dataclass
class CompiledModel:
    """What ``compile_model`` attaches to a model (``model._kvpolicy_compiled``)."""

    policy: ModelPolicy
    backend: str
    analysis: ModelAnalysis
    kinds: dict[str, dict[tuple, _KindGraph]]  # block kind -> call signature -> graph
    layer_kind: list[str]
    cache_kw: str | None = None

    model_dtype: torch.dtype | None = None

    def new_cache(self) -> KVPolicyCache:
        return KVPolicyCache(self.policy, backend=self.backend, model_dtype=self.model_dtype)


class _BlockForward:
    """The installed ``forward`` of one compiled attention layer."""

    def __init__(self, compiled: CompiledModel, module: nn.Module, layer: int) -> None:
        self.compiled, self.module, self.layer = compiled, module, layer

    def _graph(self, leaves, spec) -> fx.GraphModule:
        kind = self.compiled.layer_kind[self.layer]
        sig = (spec, _signature(leaves))
        graphs = self.compiled.kinds[kind]
        kg = graphs.get(sig)
        if kg is None:
            known = next(iter(graphs))
            raise KVPolicyError(
                f"attention layer {self.layer} was called with arguments that differ from "
                f"the calls kvpolicy traced ({_diff(known, sig)}); kvpolicy traces each "
                "call structure at compile time (plain and left-padded batches for "
                "transformers models)"
            )
        gm = kg.per_layer.get(self.layer)
        if gm is None:
            gm = kg.per_layer[self.layer] = _layer_graph_module(kg, self.module)
        return gm

    def __call__(self, *args, **kwargs):
        cache, leaves, spec = _flatten_call(args, kwargs)
        gm = self._graph(leaves, spec)
        if cache is not None and not isinstance(cache, KVPolicyCache):
            raise KVPolicyError(
                f"attention layer {self.layer} got a {type(cache).__name__}; a model compiled "
                "by kvpolicy stores its keys and values in a KVPolicyCache. Let the model "
                "create one (use_cache=True) or pass kvpolicy.KVPolicyCache.for_model(model)"
            )
        if cache is None:
            cache = _CALL_CACHE.get() or self.compiled.new_cache()
        layer = cache.packed_layer(self.layer)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        token = rw.CURRENT.set(rw.AttendContext(layer=layer, cache=cache))
        try:
            return gm(*tensors)
        finally:
            rw.CURRENT.reset(token)


def _diff(a: tuple, b: tuple) -> str:
    if a[0] != b[0]:
        return "different arguments were passed"
    for i, (x, y) in enumerate(zip(a[1], b[1], strict=False)):
        if x != y:
            return f"argument {i}: traced {x}, got {y}"
    return "different argument count"


def _probe_calls(model: nn.Module, analysis: ModelAnalysis) -> list[tuple]:
    """Extra call structures to trace: a left-padded batch for transformers models."""
    params = _inspect.signature(model.forward).parameters
    if "attention_mask" not in params:
        return []
    from .api import _probe_inputs
    from .passes.trace import dynamic_dims, find_attention_blocks

    out = []
    ids1, ids2 = _probe_inputs(model, 2, 7), _probe_inputs(model, 3, 11)
    m1, m2 = torch.ones_like(ids1), torch.ones_like(ids2)
    m1[0, :2] = 0
    m2[1, :3] = 0
    calls1 = find_attention_blocks(model, ids1, attention_mask=m1)
    calls2 = find_attention_blocks(model, ids2, attention_mask=m2)
    for c1, c2 in zip(calls1, calls2, strict=True):
        out.append((c1, dynamic_dims(c1, c2)))
    return out


def _lossless_check(block: BlockAnalysis, kg: _KindGraph, call: AttentionCall, policy) -> None:
    fp = _full_precision(policy)
    cache = KVPolicyCache(fp, backend="torch")
    cache_obj, leaves, spec = _flatten_call(call.args, call.kwargs)
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    with torch.no_grad():
        ref = call.module(*args, **kwargs)
        gm = _layer_graph_module(kg, call.module)
        token = rw.CURRENT.set(rw.AttendContext(layer=cache.packed_layer(call.index), cache=cache))
        try:
            got = gm(*[x for x in leaves if isinstance(x, torch.Tensor)])
        finally:
            rw.CURRENT.reset(token)
    r = next(x for x in pytree.tree_leaves(ref) if isinstance(x, torch.Tensor))
    g = next(x for x in pytree.tree_leaves(got) if isinstance(x, torch.Tensor))
    rw.lossless_check(r, g, f"layer {call.index} ({block.traced.kind})")


def _full_precision(policy: ModelPolicy) -> ModelPolicy:
    tensors = tuple(t.model_copy(update={"bits": 16}) for t in policy.tensors)
    return policy.model_copy(update={"tensors": tensors})


def compile_model(
    model: nn.Module,
    bits: int | float = 2,
    policy: Any = None,
    backend: str = "auto",
    calibration: Any = None,
    progress: bool = True,
) -> nn.Module:
    """Rewrite every attention block of ``model`` onto a packed, quantized KV cache.

    Args:
        model: a transformers causal LM or any module whose forward takes token ids.
        bits: code width when ``policy`` is None (the ``kvpolicy-<bits>`` preset; 16 keeps
            everything in full precision), or a float budget such as ``2.5``: the average
            code bits per cached element, allocated per tensor from its sensitivity measured
            where it is consumed (one calibration forward; see ``kvpolicy.budget``).
        policy: preset name, YAML path, dict or ``PolicySpec`` (see ``derive_policy``).
        backend: ``"torch"``, ``"triton"`` or ``"auto"`` (triton for CUDA tensors).
        calibration: for a budget: token ids, a tokenizer or a saved ``Calibration`` (see
            ``derive_policy``); ``kvpolicy.save_policy(model, path)`` writes it into a
            policy file so that a later compile skips calibrating.
        progress: show a progress bar while calibrating.

    Returns:
        The same model object, compiled: ``model.generate`` and manual decode loops work
        unchanged and return a ``KVPolicyCache``; ``kvpolicy.inspect(model)`` gives the
        policy in use.

    Raises:
        KVPolicyError: compiled twice; a bad backend; a policy or graph kvpolicy cannot
            handle. The model is left unchanged.
    """
    if getattr(model, "_kvpolicy_compiled", None) is not None:
        raise KVPolicyError(
            f"{type(model).__name__} is already compiled by kvpolicy; compile a fresh copy "
            "of the original model to change the policy"
        )
    if backend not in _BACKENDS:
        raise KVPolicyError(f"backend={backend!r} is not one of {_BACKENDS}")
    spec = load_spec(policy, bits=bits)
    pol = derive_policy(model, bits=bits, policy=spec, calibration=calibration,
                        progress=progress)
    analysis = analyse_model(model)
    _check_policy_fits(pol)

    kinds: dict[str, dict[tuple, _KindGraph]] = {}
    layer_kind = [lf.block_kind for lf in analysis.layers]
    first_call: dict[str, AttentionCall] = {}
    for call, lf in zip(analysis.calls, analysis.layers, strict=True):
        first_call.setdefault(lf.block_kind, call)
    for kind, block in analysis.blocks.items():
        pre = pol.get(next(lf.layer for lf in analysis.layers if lf.block_kind == kind),
                      "key").pre_rope
        kg = _build_kind_graph(block, pre)
        call = first_call[kind]
        _, leaves, spec_ = _flatten_call(call.args, call.kwargs)
        kinds[kind] = {(spec_, _signature(leaves)): kg}
        _lossless_check(block, kg, call, pol)
    # Left-padded batches pass an attention mask: a second call structure per kind.
    from .api import analyse_block

    was_training = model.training
    model.eval()
    try:
        extra = _probe_calls(model, analysis)
    finally:
        model.train(was_training)
    for call, dyn in extra:
        kind = layer_kind[call.index]
        _, leaves, spec_ = _flatten_call(call.args, call.kwargs)
        sig = (spec_, _signature(leaves))
        if sig in kinds[kind]:
            continue
        traced = trace_block(call, dyn, kind)
        block = analyse_block(traced)
        pre = pol.get(call.index, "key").pre_rope
        kg = _build_kind_graph(block, pre)
        _lossless_check(block, kg, call, pol)
        kinds[kind][sig] = kg

    # Nothing below can fail on a model that got this far: install.
    params = _inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in params else (
        "past_key_values" if "past_key_values" in params else None
    )
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    compiled = CompiledModel(pol, backend, analysis, kinds, layer_kind, cache_kw, dtype)
    for i, module in enumerate(analysis.modules):
        module.forward = _BlockForward(compiled, module, i)
    _install_model_hooks(model, compiled)
    object.__setattr__(model, "_kvpolicy_compiled", compiled)
    object.__setattr__(model, "_kvpolicy_policy", pol)
    log.info("compiled %d attention layers (%d block kinds)", len(layer_kind), len(kinds))
    return model


def _check_policy_fits(policy: ModelPolicy) -> None:
    for layer in policy.layers:
        k, v = policy.get(layer, "key"), policy.get(layer, "value")
        if k.residual != v.residual or k.sinks != v.sinks:
            raise PolicyError(
                f"layer {layer}: key and value must share residual and sinks "
                f"(got {k.residual}/{v.residual} and {k.sinks}/{v.sinks})"
            )


def _install_model_hooks(model: nn.Module, compiled: CompiledModel) -> None:
    """Make ``model(...)`` and ``model.generate(...)`` create a KVPolicyCache."""
    orig_forward = model.forward
    has_use_cache = "use_cache" in _inspect.signature(orig_forward).parameters
    kw = compiled.cache_kw

    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)

    def check_length(args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if not isinstance(ids, torch.Tensor) or ids.dim() < 2 or not limit:
            return
        cache = kwargs.get("cache") or kwargs.get("past_key_values")
        past = cache.get_seq_length() if isinstance(cache, KVPolicyCache) else 0
        if past + ids.shape[1] > limit:
            raise KVPolicyError(
                f"{past + ids.shape[1]} tokens ({past} cached + {ids.shape[1]} new) exceed "
                f"the model's max_position_embeddings={limit}; shorten the input"
            )

    @functools.wraps(orig_forward)
    def forward(*args, **kwargs):
        check_length(args, kwargs)
        if kw is not None and has_use_cache:
            use = kwargs.get("use_cache")
            if use is None:
                use = getattr(getattr(model, "config", None), "use_cache", False)
            given = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
            if use and not given:
                kwargs[kw] = compiled.new_cache()
        token = _CALL_CACHE.set(compiled.new_cache())
        try:
            return orig_forward(*args, **kwargs)
        finally:
            _CALL_CACHE.reset(token)

    model.forward = forward
    if hasattr(model, "generate") and kw is not None:
        orig_generate = model.generate

        @functools.wraps(orig_generate)
        def generate(*args, **kwargs):
            if kwargs.get("cache") is None and kwargs.get("past_key_values") is None:
                kwargs[kw] = compiled.new_cache()
            return orig_generate(*args, **kwargs)

        model.generate = generate

