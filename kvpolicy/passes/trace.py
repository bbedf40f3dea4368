"""Trace one attention block per distinct kind with ``torch.export``.

Finding the blocks: one ordinary forward of the model runs under a
``TorchFunctionMode`` that watches for attention consumers (``scaled_dot_product_attention``
and ``softmax``); the innermost module running at that moment is an attention block. No
module or parameter name is consulted.

Tracing: each block's real call arguments are captured by a forward pre-hook during the
same forward. The arguments are flattened with pytree; tensors become the positional
inputs of a small wrapper module (so batch and sequence dims can be declared dynamic with
``Dim.AUTO``) and everything else is baked in as a constant. A ``transformers`` ``Cache``
argument is dropped: the block is analysed as if it had no past.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from transformers.cache_utils import Cache

from ..errors import AnalysisError

__all__ = [
    "AttentionCall",
    "TracedBlock",
    "block_kind",
    "dynamic_dims",
    "find_attention_blocks",
    "trace_block",
]

log = logging.getLogger(__name__)
# Ops that keep a tensor's meaning (scores stay scores, probabilities stay probabilities).
_ELEMENTWISE = frozenset({
    "__truediv__", "__mul__", "__rmul__", "__add__", "__radd__", "__sub__", "__iadd__",
    "__imul__", "__itruediv__", "div", "div_", "mul", "mul_", "add", "add_", "sub",
    "masked_fill", "masked_fill_", "where", "to", "float", "half", "bfloat16", "type_as",
    "tanh", "clamp", "contiguous", "dropout", "clone",
})

_SOFTMAX = (torch.softmax, F.softmax, torch.Tensor.softmax)
_CONTRACTIONS = (
    torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm,
    torch.einsum, torch.baddbmm,
)


@dataclass
class AttentionCall:
    """One attention block found during the probe forward, with its real call arguments."""

    index: int  # order of first call during the forward == layer index
    module: nn.Module
    args: tuple
    kwargs: dict


@dataclass
class TracedBlock:
    """The exported ATen graph of one attention block kind."""

    kind: str
    exported: torch.export.ExportedProgram
    # pytree path of each positional tensor input, e.g. "kwargs['position_embeddings'][0]"
    input_paths: list[str]
    seconds: float
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return self.exported.graph_module


def is_cache_object(x: Any) -> bool:
    """A transformers ``Cache`` (dropped from traced calls: the block is traced pastless)."""
    return isinstance(x, Cache)


def _fname(func) -> str:
    return getattr(func, "__name__", "")


class _ConsumerWatch(TorchFunctionMode):
    """Records which module is innermost whenever an attention consumer runs.

    ``scaled_dot_product_attention`` counts at once. A softmax counts only when its input
    is the output of a contraction (``q·kᵀ`` scores, through scaling/masking/casts) and its
    output is contracted again (with V). A router's or classifier's softmax over a linear
    layer's logits is not attention.
    """

    def __init__(self, stack: list[nn.Module], hits: list[nn.Module]) -> None:
        super().__init__()
        self.stack, self.hits = stack, hits
        self._scores: set[int] = set()  # ids of contraction outputs (and elementwise of them)
        self._probs: dict[int, nn.Module] = {}  # id(probabilities) -> module of the softmax
        self._alive: list[torch.Tensor] = []  # keep tagged tensors alive so ids stay unique

    def _keep(self, out) -> list[torch.Tensor]:
        ts = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self._alive.extend(ts)
        return ts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.stack:
            return out
        if func is F.scaled_dot_product_attention:
            self.hits.append(self.stack[-1])
            return out
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func in _SOFTMAX:
            if ins and id(ins[0]) in self._scores:
                for t in self._keep(out):
                    self._probs[id(t)] = self.stack[-1]
            return out
        probs = [self._probs[id(t)] for t in ins if id(t) in self._probs]
        if func in _CONTRACTIONS:
            if probs:
                self.hits.append(probs[0])
            else:
                self._scores.update(id(t) for t in self._keep(out))
        elif _fname(func) in _ELEMENTWISE:
            if probs:
                for t in self._keep(out):
                    self._probs[id(t)] = probs[0]
            elif any(id(t) in self._scores for t in ins):
                self._scores.update(id(t) for t in self._keep(out))
        return out


def find_attention_blocks(model: nn.Module, *inputs: Any, **kw_inputs: Any) -> list[AttentionCall]:
    """Run ``model(*inputs, **kw_inputs)`` once and return its attention blocks in call order.

    A block is the innermost module active when an attention consumer runs. Its call
    arguments are those of its first call.
    """
    stack: list[nn.Module] = []
    hits: list[nn.Module] = []
    calls: dict[int, tuple[nn.Module, tuple, dict]] = {}
    handles = []

    def pre(mod, args, kwargs):
        stack.append(mod)
        calls.setdefault(id(mod), (mod, args, kwargs))

    def post(mod, args, kwargs, out):
        stack.pop()

    for mod in model.modules():
        # NOTE: hooks on every module: the probe forward is one short call (7 tokens).
        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad(), _ConsumerWatch(stack, hits):
            model(*inputs, **kw_inputs)
    except Exception as exc:  # re-raised with what was called; the cause stays chained
        shapes = ", ".join(
            f"{k}{list(v.shape)}" if isinstance(v, torch.Tensor) else k
            for k, v in [*(("ids", x) for x in inputs), *kw_inputs.items()]
        )
        raise AnalysisError(
            f"the probe forward {type(model).__name__}({shapes}) failed: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. kvpolicy "
            "finds attention blocks by calling the model once on token ids; it needs a model "
            "whose forward takes token ids alone (a decoder-only LM)"
        ) from exc
    finally:
        for h in handles:
            h.remove()

    seen: dict[int, AttentionCall] = {}
    for mod in hits:
        if id(mod) not in seen:
            m, args, kwargs = calls[id(mod)]
            seen[id(mod)] = AttentionCall(len(seen), m, args, kwargs)
    if not seen:
        raise AnalysisError(
            f"no attention found in {type(model).__name__}: no scaled_dot_product_attention "
            "or softmax ran during a forward pass. kvpolicy needs a model whose attention "
            "consumes a key and a value tensor."
        )
    return list(seen.values())


def _signature(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", x.dim(), str(x.dtype))
    return type(x).__name__


def block_kind(call: AttentionCall) -> str:
    """The tracing unit: module class + parameter shapes + argument structure.

    Layers with the same kind share one trace and one analysis.
    """
    mod = call.module
    params = tuple((tuple(p.shape), str(p.dtype)) for p in mod.parameters())
    flat, spec = pytree.tree_flatten((call.args, call.kwargs))
    args_sig = tuple(_signature(x) for x in flat if not is_cache_object(x))
    return f"{type(mod).__qualname__}#{abs(hash((params, args_sig, str(spec)))) % 10**8:08d}"


class _FlatCall(nn.Module):
    """Calls ``module`` with its captured arguments, taking only the tensors as inputs."""

    def __init__(self, module: nn.Module, flat: list, spec, tensor_slots: list[int]) -> None:
        super().__init__()
        self.module = module
        self._flat, self._spec, self._slots = flat, spec, tensor_slots

    def forward(self, *tensors: torch.Tensor):
        flat = list(self._flat)
        for slot, t in zip(self._slots, tensors, strict=True):
            flat[slot] = t
        args, kwargs = pytree.tree_unflatten(flat, self._spec)
        return self.module(*args, **kwargs)


@contextlib.contextmanager
def _quiet(logger_name: str):
    """Silence one chatty torch logger for the duration (0/1 specialisation notices)."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _path_str(path) -> str:
    out = ""
    for i, k in enumerate(path):
        s = pytree.keystr((k,))
        if i == 0:
            s = {"[0]": "args", "[1]": "kwargs"}.get(s, s)
        out += s
    return out


def dynamic_dims(call: AttentionCall, other: AttentionCall) -> list[set[int]]:
    """Per tensor argument of ``call``, the dims whose size differs in ``other``.

    ``other`` is the same block called during a second probe forward with a different
    batch size and sequence length: exactly the batch and sequence dims change.
    """
    a = [x for x in pytree.tree_leaves((call.args, call.kwargs)) if isinstance(x, torch.Tensor)]
    b = [x for x in pytree.tree_leaves((other.args, other.kwargs)) if isinstance(x, torch.Tensor)]
    if len(a) != len(b):
        raise AnalysisError(
            f"{type(call.module).__name__} was called with {len(a)} tensors in one forward "
            f"and {len(b)} in another; kvpolicy needs a fixed argument structure"
        )
    return [
        {d for d in range(x.dim()) if x.dim() == y.dim() and x.shape[d] != y.shape[d]}
        for x, y in zip(a, b, strict=True)
    ]


def trace_block(
    call: AttentionCall, dynamic: list[set[int]] | None = None, kind: str | None = None
) -> TracedBlock:
    """``torch.export`` one attention block with dynamic batch and sequence dims.

    Args:
        call: the block and its captured arguments.
        dynamic: per tensor argument (pytree order), the dims to declare dynamic; see
            ``dynamic_dims``. Default: every dim of every tensor (``Dim.AUTO``).
    """
    from torch.export import Dim

    def drop_cache(x):
        return None if is_cache_object(x) else x

    args, kwargs = pytree.tree_map(drop_cache, (call.args, call.kwargs), is_leaf=is_cache_object)
    leaves, spec = pytree.tree_flatten_with_path((args, kwargs))
    flat = [v for _, v in leaves]
    slots = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
    tensors = tuple(flat[i] for i in slots)
    paths = [_path_str(leaves[i][0]) for i in slots]
    wrapper = _FlatCall(call.module, flat, spec, slots)
    if dynamic is None:
        dynamic = [set(range(t.dim())) for t in tensors]
    spec_dyn = tuple({d: Dim.AUTO for d in dims} for dims in dynamic[: len(tensors)])
    start = time.perf_counter()
    try:
        with _quiet("torch._export.non_strict_utils"):
            ep = torch.export.export(wrapper, tensors, dynamic_shapes=(spec_dyn,), strict=False)
    except Exception as exc:  # re-raised with the block named; the cause stays chained
        raise AnalysisError(
            f"torch.export could not trace the attention block {type(call.module).__name__} "
            f"(layer {call.index}): {type(exc).__name__}: {str(exc).splitlines()[0]}"
        ) from exc
    seconds = time.perf_counter() - start
    log.debug("traced %s in %.2f s", kind or type(call.module).__name__, seconds)
    return TracedBlock(kind or block_kind(call), ep, paths, seconds)
