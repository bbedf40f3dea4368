"""kvpolicy's custom ops, tested as ops: ``torch.library.opcheck`` and their fake
implementations under ``FakeTensorMode``.

``kvpolicy::quantize`` is a function of its inputs, so every opcheck test applies.
``kvpolicy::attend`` appends to a cache that lives outside its tensors: two calls with
the same inputs differ (the second sees the first's tokens), which opcheck's AOT tests
(they compare an op's repeated calls) would report as a mismatch. Bound to a context
that hands each call a fresh cache, it becomes a function of its inputs again, and then
all of opcheck's tests apply; the fake is also checked against the real output of calls
recorded from a real model run (prefill, decode step, a call that packs a group).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kvpolicy
from kvpolicy.errors import CacheError, KVPolicyError
from kvpolicy.kernels import ops as kernel_ops
from kvpolicy.kernels import reference
from kvpolicy.kernels.layout import QuantSpec
from kvpolicy.runtime import ops
from kvpolicy.runtime.attend import CURRENT, AttendContext, KVAttend
from kvpolicy.state import compiled_of
from kvpolicy.zoo.tiny import tiny_model

POLICY = {"defaults": {"bits": 2, "group_size": 16, "residual": 16, "sinks": 2}}

SPECS = [
    (2, 16, "channel"), (2, 16, "token"), (1, 32, "channel"), (3, 8, "token"),
    (4, 32, "token"), (8, 16, "channel"), (16, 32, "channel"), (16, 32, "token"),
]


def _meta(t: torch.Tensor) -> tuple:
    """Shape, strides (of the dims that have more than one element: the others never
    move a pointer), dtype and device."""
    strides = tuple(s for s, n in zip(t.stride(), t.shape, strict=True) if n > 1)
    return tuple(t.shape), strides, t.dtype, t.device.type


# --------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s[0]}b-g{s[1]}-{s[2]}")
@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_quantize_passes_opcheck(spec, dtype):
    x = torch.randn(2, 3, 32, 32)
    torch.library.opcheck(torch.ops.kvpolicy.quantize.default, (x, *spec, dtype, "torch"))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s[0]}b-g{s[1]}-{s[2]}")
def test_quantize_op_is_the_backend_kernel_and_its_fake_has_its_shapes(spec):
    x = torch.randn(2, 3, 32, 32)
    q = QuantSpec(*spec)
    got = kernel_ops.quantize_packed(x, q, torch.float16, backend="torch")
    want = reference.quantize(x, q, torch.float16)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    with FakeTensorMode() as mode:
        fake = torch.ops.kvpolicy.quantize(mode.from_tensor(x), *spec, torch.float16, "torch")
    assert [_meta(f) for f in fake] == [_meta(g) for g in got]


def test_quantize_outputs_alias_neither_input_nor_each_other_at_16_bits():
    x = torch.randn(1, 2, 8, 32)
    codes, scale, zero = torch.ops.kvpolicy.quantize(x, 16, 32, "channel", None, "torch")
    assert torch.equal(codes, x) and codes.data_ptr() != x.data_ptr()
    assert scale is not zero and scale.numel() == zero.numel() == 0


def test_quantize_fake_refuses_what_the_kernel_refuses():
    x = torch.randn(1, 2, 20, 32)  # 20 tokens: not whole groups of 16
    with pytest.raises(CacheError, match="whole token groups"):
        torch.ops.kvpolicy.quantize(x, 2, 16, "channel", None, "torch")
    with FakeTensorMode() as mode, pytest.raises(CacheError, match="whole token groups"):
        torch.ops.kvpolicy.quantize(mode.from_tensor(x), 2, 16, "channel", None, "torch")
    with pytest.raises(CacheError, match="group_size=3"):  # the spec is checked as a QuantSpec
        torch.ops.kvpolicy.quantize(x, 2, 3, "token", None, "torch")


# --------------------------------------------------------------------------- attend


class _FreshCache(AttendContext):
    """A context that hands every op call a new cache: the op is then a function of its
    inputs (what opcheck's repeated calls assume)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(layer=None, cache=None)
        self._model = model

    @property
    def cache(self):  # noqa: D102
        return kvpolicy.KVPolicyCache.for_model(self._model)

    @cache.setter
    def cache(self, value) -> None:
        pass


@pytest.fixture(scope="module")
def recorded():
    """A compiled tiny llama, its layer-0 ``KVAttend``, and the inputs of that layer's op
    calls in a real run: a 40-token prefill, then decode steps up to one that packs."""
    torch.manual_seed(0)
    model = kvpolicy.compile_model(tiny_model("llama"), policy=POLICY, progress=False)
    compiled = compiled_of(model)
    attend = next(iter(compiled.kinds[compiled.layer_kind[0]].values())).attend
    calls: list[tuple] = []

    def record(module, args, kwargs, out):
        if kwargs.get("layer", -1) == 0:
            calls.append((args, kwargs, out))

    hook = attend.register_forward_hook(record, with_kwargs=True)
    ids = torch.randint(3, 128, (1, 60))
    cache = kvpolicy.KVPolicyCache.for_model(model)
    with torch.no_grad():
        model(ids[:, :40], past_key_values=cache, use_cache=True)
        for t in range(40, 60):
            model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
    hook.remove()
    return model, attend, calls


def _op_args(attend: KVAttend, args: tuple, layer: int = 0) -> tuple:
    q, k, v, mask, cos, sin, *rest = args
    return (q, k, v, mask, cos, sin, rest[0] if rest else None, attend.op_id, layer)


def test_the_rewritten_graph_calls_the_op_once_per_block_call(recorded):
    _, _, calls = recorded
    assert len(calls) == 21  # the prefill and 20 decode steps of layer 0


def test_attend_passes_opcheck_with_a_fresh_cache_per_call(recorded):
    model, attend, calls = recorded
    token = CURRENT.set(_FreshCache(model))
    try:
        for args, _, _ in calls[:2]:  # the prefill and a decode step onto an empty cache
            torch.library.opcheck(torch.ops.kvpolicy.attend.default, _op_args(attend, args))
    finally:
        CURRENT.reset(token)


def test_attend_schema_is_honest_on_a_real_cache(recorded):
    """On one cache, every call of a run: no tensor argument is written (``mutates_args``
    is empty: the op changes the cache's Python state, which no argument holds)."""
    model, attend, calls = recorded
    cache = kvpolicy.KVPolicyCache.for_model(model)
    token = CURRENT.set(AttendContext(layer=None, cache=cache))
    try:
        for args, _, _ in calls:
            torch.library.opcheck(torch.ops.kvpolicy.attend.default, _op_args(attend, args),
                                  test_utils="test_schema")
    finally:
        CURRENT.reset(token)
    assert cache.get_seq_length() == 60  # test_schema runs each call once: the run, replayed


def test_attend_fake_matches_the_real_output_of_every_recorded_call(recorded):
    model, attend, calls = recorded
    cache = kvpolicy.KVPolicyCache.for_model(model)
    token = CURRENT.set(AttendContext(layer=None, cache=cache))
    try:
        for args, _, seen in calls:
            real = torch.ops.kvpolicy.attend(*_op_args(attend, args))
            with FakeTensorMode(allow_non_fake_inputs=False) as mode:
                fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                         for a in _op_args(attend, args)]
                fake = torch.ops.kvpolicy.attend(*fargs)
            assert _meta(fake) == _meta(real) == _meta(seen)
    finally:
        CURRENT.reset(token)
    assert cache.get_seq_length() == 60  # the fake calls appended nothing


def test_attend_finds_its_layer_by_index_in_the_bound_cache(recorded):
    model, attend, calls = recorded
    by_index = kvpolicy.KVPolicyCache.for_model(model)
    by_layer = kvpolicy.KVPolicyCache.for_model(model)
    args = _op_args(attend, calls[0][0], layer=1)
    token = CURRENT.set(AttendContext(layer=None, cache=by_index))
    try:
        a = torch.ops.kvpolicy.attend(*args)
    finally:
        CURRENT.reset(token)
    token = CURRENT.set(AttendContext(layer=by_layer.packed_layer(1), cache=by_layer))
    try:
        b = torch.ops.kvpolicy.attend(*_op_args(attend, calls[0][0], layer=-1))
        with pytest.raises(KVPolicyError, match="graph of attention layer 0 ran with layer 1"):
            torch.ops.kvpolicy.attend(*_op_args(attend, calls[1][0], layer=0))
    finally:
        CURRENT.reset(token)
    assert torch.equal(a, b)
    assert [layer.get_seq_length() for layer in by_index.layers] == [0, 40]


def test_attend_without_a_binding_or_a_layer_index_is_refused(recorded):
    _, attend, calls = recorded
    with pytest.raises(KVPolicyError, match="outside its model wrapper"):
        torch.ops.kvpolicy.attend(*_op_args(attend, calls[0][0]))
    token = CURRENT.set(AttendContext(layer=None, cache=None))
    try:
        with pytest.raises(KVPolicyError, match="needs an attention layer index"):
            torch.ops.kvpolicy.attend(*_op_args(attend, calls[0][0], layer=-1))
    finally:
        CURRENT.reset(token)


def test_a_copied_attend_module_is_an_op_target_of_its_own(recorded):
    _, attend, _ = recorded
    twin = copy.deepcopy(attend)
    assert twin.op_id != attend.op_id
    assert ops.registered(twin.op_id) is twin and ops.registered(attend.op_id) is attend
    gone = twin.op_id
    del twin
    with pytest.raises(KVPolicyError, match=f"attend_id={gone}, which names no live KVAttend"):
        ops.registered(gone)
