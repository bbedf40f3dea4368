"""Install a compiled model: the per-layer block forwards and the model's cache wiring.

Each compiled attention layer's ``forward`` becomes a ``_BlockForward``: it flattens the
call exactly as it was traced, finds the cache among the arguments, picks the rewritten
graph of that call structure (a ``KindGraph``; one ``GraphModule`` per layer, bound to the
layer's own parameters and built on its first call) and runs it with the layer's packed
cache in ``attend.CURRENT``. The model's ``forward`` and ``generate`` are wrapped so that
they create a ``KVPolicyCache`` where transformers would create its own.

Runtime state lives in three places, each for a reason: the ``CompiledModel`` on the model
(``kvpolicy.state``); the ``KVPolicyCache`` the caller holds (or, for a call without one, the
cache of that one whole-model call, ``_CALL``); and ``attend.CURRENT``, the layer
a block call writes to, set around each call so that the graph needs no cache argument.

Under ``torch.compile``: the model's forward binds the call's cache in ``attend.CURRENT``
for the whole call and is itself never traced (``torch.compiler.disable`` of that one
frame); a block traced by dynamo skips the per-block binding, which dynamo cannot trace,
and its layer's graph names its layer to the op ``kvpolicy::attend`` (``runtime.ops``),
which looks the layer up in the bound cache. A decode step is then one graph.
"""

from __future__ import annotations

import contextvars
import functools
import inspect as _inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..errors import KVPolicyError
from ..passes.analyse import ModelAnalysis
from ..passes.fx_graph import copy_graph
from ..passes.trace import is_cache_object
from ..policies import ModelPolicy
from ..state import state_of
from .attend import CURRENT, AttendContext, KVAttend
from .cache import KVPolicyCache

__all__ = [
    "CompiledModel", "KindGraph", "call_signature", "flatten_call", "install",
    "layer_graph_module", "resolve_attr", "run_block",
]

log = logging.getLogger(__name__)

class _CallScope:
    """One whole-model call. A block called without a cache argument (nanoGPT-style
    models, ``use_cache=False``) uses this call's cache, built on the first such block."""

    def __init__(self, compiled: CompiledModel) -> None:
        self.compiled = compiled
        self._cache: KVPolicyCache | None = None

    def cache(self) -> KVPolicyCache:
        if self._cache is None:
            self._cache = self.compiled.new_cache()
        return self._cache


_CALL: contextvars.ContextVar[_CallScope | None] = contextvars.ContextVar(
    "kvpolicy_call", default=None
)


def call_signature(leaves: list) -> tuple:
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


def flatten_call(args: tuple, kwargs: dict):
    """Drop the cache object; return (cache, leaves, treespec)."""
    # NOTE: runs once per layer per decode step: plain ``tree_flatten`` (no key paths) and
    # one pass over the leaves; key paths cost ~2 ms per SmolLM2 step.
    leaves, spec = pytree.tree_flatten((args, kwargs), is_leaf=is_cache_object)
    cache = None
    for i, x in enumerate(leaves):
        if is_cache_object(x):
            cache, leaves[i] = x, None
    return cache, leaves, spec


@dataclass
class KindGraph:
    """One rewritten graph of a block kind for one call structure."""

    graph: fx.Graph
    attend: KVAttend
    consts: dict[str, Any]  # get_attr targets that are not the layer's own parameters
    per_layer: dict[int, fx.GraphModule] = field(default_factory=dict)


def resolve_attr(root: nn.Module, target: str):
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class _Wrapper(nn.Module):
    """Mimics the traced ``_FlatCall`` root so that ``module.*`` targets resolve."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "module", module)  # not registered: no ownership


def layer_graph_module(kg: KindGraph, module: nn.Module, layer: int = -1) -> fx.GraphModule:
    """The graph of ``kg`` bound to ``module``'s parameters. With ``layer`` (the attention
    layer's index) its ``KVAttend`` call names the layer, so that ``kvpolicy::attend``
    finds it in the cache bound for the whole model call (what ``torch.compile`` runs);
    -1: the layer bound around each call (:func:`run_block`)."""
    root: dict[str, Any] = {"kvpolicy_attend": kg.attend, **kg.consts}
    w = _Wrapper(module)
    for n in kg.graph.nodes:
        if n.op == "get_attr" and n.target.startswith("module."):
            root[n.target] = resolve_attr(w, n.target)
    graph, _ = copy_graph(kg.graph)
    if layer >= 0:
        for n in graph.nodes:
            if n.op == "call_module" and n.target == "kvpolicy_attend":
                n.kwargs = {**n.kwargs, "layer": layer}
    return fx.GraphModule(root, graph, class_name="KVPolicyBlock")


@dataclass
class CompiledModel:
    """What ``compile_model`` attaches to a model (``kvpolicy.state.ModelState.compiled``)."""

    policy: ModelPolicy
    backend: str
    analysis: ModelAnalysis
    kinds: dict[str, dict[tuple, KindGraph]]  # block kind -> call signature -> graph
    layer_kind: list[str]
    cache_kw: str | None = None

    model_dtype: torch.dtype | None = None
    windows: dict[int, int] = field(default_factory=dict)  # layer -> sliding window
    # The packed cache that stands in for the model's own cache buffers, for a model
    # whose blocks write K/V into buffers of their own (gpt-fast): kept across calls.
    own_cache: KVPolicyCache | None = None

    def new_cache(self) -> KVPolicyCache:
        return KVPolicyCache(self.policy, backend=self.backend, model_dtype=self.model_dtype,
                             windows=self.windows)

    @functools.cached_property
    def keeps_own_cache(self) -> bool:
        """Whether the blocks write K/V into buffers of their own (gpt-fast style)."""
        return any(kg.attend.mask_by_position for g in self.kinds.values() for kg in g.values())

    def persistent_cache(self) -> KVPolicyCache:
        """The cache that replaces the blocks' own buffers, created on first use."""
        if self.own_cache is None:
            self.own_cache = self.new_cache()
        return self.own_cache


class _BlockForward:
    """The installed ``forward`` of one compiled attention layer."""

    def __init__(self, compiled: CompiledModel, module: nn.Module, layer: int) -> None:
        self.compiled, self.module, self.layer = compiled, module, layer
        # The call structures of this layer's kind, scanned rather than looked up: dynamo
        # cannot hash a TreeSpec (NOTE: under torch.compile the dict lookup raised
        # TypeError inside dynamo, which then ran the whole block call eagerly).
        self._structures = list(compiled.kinds[compiled.layer_kind[layer]].items())

    def _graph(self, leaves, spec) -> fx.GraphModule:
        sig = call_signature(leaves)
        for i, ((s, g), _) in enumerate(self._structures):
            if g == sig and s == spec:
                return self.layer_graph(i)
        raise KVPolicyError(
            f"attention layer {self.layer} was called with arguments that differ from "
            f"the calls kvpolicy traced ({_diff(self._structures[0][0], (spec, sig))}); "
            "kvpolicy traces each call structure at compile time (plain and left-padded "
            "batches for transformers models)"
        )

    def layer_graph(self, structure: int) -> fx.GraphModule:
        """This layer's graph of call structure ``structure``, built on first use."""
        kg = self._structures[structure][1]
        gm = kg.per_layer.get(self.layer)
        if gm is None:
            gm = kg.per_layer[self.layer] = layer_graph_module(kg, self.module, self.layer)
        return gm

    def build_graphs(self) -> None:
        """Build this layer's graph of every call structure now: dynamo cannot trace
        building a ``GraphModule``, so under ``torch.compile`` they must exist before the
        first block call is traced (the model's forward calls this on its first call)."""
        for i in range(len(self._structures)):
            self.layer_graph(i)

    def __call__(self, *args, **kwargs):
        cache, leaves, spec = flatten_call(args, kwargs)
        gm = self._graph(leaves, spec)
        if cache is not None and not isinstance(cache, KVPolicyCache):
            raise KVPolicyError(
                f"attention layer {self.layer} got a {type(cache).__name__}; a model compiled "
                "by kvpolicy stores its keys and values in a KVPolicyCache. Let the model "
                "create one (use_cache=True) or pass kvpolicy.KVPolicyCache.for_model(model)"
            )
        if torch.compiler.is_compiling():
            # NOTE: dynamo cannot trace ContextVar.set/reset: binding the layer here broke
            # the graph three times per layer and call, and split every frame above it
            # (15 graphs per decode step of a 2-layer llama). Under torch.compile the
            # model's forward (which dynamo skips: it sets contextvars) has bound this
            # call's cache, and the layer's graph names its layer to kvpolicy::attend.
            return gm(*[x for x in leaves if isinstance(x, torch.Tensor)])
        if cache is None and self.compiled.keeps_own_cache:
            # The block writes into a buffer of its own at given positions: the packed
            # cache stands in for it across calls (a call at position 0 restarts it).
            cache = self.compiled.persistent_cache()
        elif cache is None:
            scope = _CALL.get()
            cache = scope.cache() if scope is not None else self.compiled.new_cache()
        return run_block(gm, cache, self.layer, leaves)


def run_block(gm: fx.GraphModule, cache: KVPolicyCache, layer: int, leaves: list) -> Any:
    """Run one layer's rewritten graph on the tensors of a flattened call, with ``cache``'s
    packed layer ``layer`` as the one its ``KVAttend`` appends to and attends over."""
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    token = CURRENT.set(AttendContext(layer=cache.packed_layer(layer), cache=cache))
    try:
        return gm(*tensors)
    finally:
        CURRENT.reset(token)


def _diff(a: tuple, b: tuple) -> str:
    if a[0] != b[0]:
        return "different arguments were passed"
    for i, (x, y) in enumerate(zip(a[1], b[1], strict=False)):
        if x != y:
            return f"argument {i}: traced {x}, got {y}"
    return "different argument count"


def install(model: nn.Module, compiled: CompiledModel) -> None:
    """Replace the ``forward`` of every compiled attention layer and wire the model's
    ``forward``/``generate`` to create a ``KVPolicyCache``. Cannot fail: everything that
    can was checked at compile time."""
    blocks = []
    for i, module in enumerate(compiled.analysis.modules):
        module.forward = _BlockForward(compiled, module, i)
        blocks.append(module.forward)
    _install_model_hooks(model, compiled, blocks)
    st = state_of(model)
    st.compiled, st.policy = compiled, compiled.policy


def _call_cache(compiled: CompiledModel, scope: _CallScope, args: tuple,
                kwargs: dict) -> KVPolicyCache:
    """The cache the blocks of one model call use, as ``_BlockForward`` finds it: the
    ``KVPolicyCache`` among the call's arguments (transformers hands it to every block),
    else the blocks' own-buffer stand-in, else the call's own cache. Bound for the whole
    call, for the blocks that ``torch.compile`` runs without a per-block binding."""
    for x in (*args, *kwargs.values()):
        if isinstance(x, KVPolicyCache):
            return x
    if compiled.keeps_own_cache:
        return compiled.persistent_cache()
    return scope.cache()


def _install_model_hooks(model: nn.Module, compiled: CompiledModel,
                         blocks: list[_BlockForward]) -> None:
    """Make ``model(...)`` and ``model.generate(...)`` create a KVPolicyCache, and bind
    the cache of each call for its blocks (``attend.CURRENT``)."""
    built = [False]
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

    # The bookkeeping of a model call runs outside dynamo: recursively disabled, it is
    # never traced, nor is anything it calls (building the layer graphs, a cache).
    @torch.compiler.disable
    def enter(args: tuple, kwargs: dict) -> tuple:
        """Check the call, create its cache where transformers would (into ``kwargs``),
        bind it for the blocks; returns the tokens :func:`leave` resets."""
        check_length(args, kwargs)
        if kw is not None and has_use_cache:
            use = kwargs.get("use_cache")
            if use is None:
                use = getattr(getattr(model, "config", None), "use_cache", False)
            given = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
            if use and not given:
                kwargs[kw] = compiled.new_cache()
        if not built[0]:
            # On the first call rather than at install: a graph binds the parameters and
            # buffers the module has then (after a .to(device), say). NOTE: 5.5 ms per
            # graph module of the tiny llama's 33 nodes.
            for block in blocks:
                block.build_graphs()
            built[0] = True
        scope = _CallScope(compiled)
        return (_CALL.set(scope),
                CURRENT.set(AttendContext(layer=None,
                                          cache=_call_cache(compiled, scope, args, kwargs))))

    @torch.compiler.disable
    def leave(tokens: tuple) -> None:
        CURRENT.reset(tokens[1])
        _CALL.reset(tokens[0])

    @functools.wraps(orig_forward)
    def forward(*args, **kwargs):
        tokens = enter(args, kwargs)
        try:
            return orig_forward(*args, **kwargs)
        finally:
            leave(tokens)

    # Dynamo skips this frame and compiles what it calls: orig_forward. NOTE: traced, it
    # broke the graph at each of its four ContextVar set/reset calls, every decode step;
    # skipped, a step is one graph.
    model.forward = torch.compiler.disable(forward, recursive=False)
    if hasattr(model, "generate") and kw is not None:
        orig_generate = model.generate

        @functools.wraps(orig_generate)
        def generate(*args, **kwargs):
            if kwargs.get("cache") is None and kwargs.get("past_key_values") is None:
                kwargs[kw] = compiled.new_cache()
            return orig_generate(*args, **kwargs)

        model.generate = generate
