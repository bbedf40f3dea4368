"""A decode step of a compiled model reads nothing back to the host unless asked to.

On a GPU every host read of device data (``.item()``, ``int(t)``, ``bool(t)``,
``torch.equal``) stalls the launch queue. The value checks of a one-token step are off
there (``runtime.checks.data_checks``); ``KVPOLICY_CHECKS=0`` gives a CPU run the same
path, so the host reads can be counted here: every one of them goes through
``aten._local_scalar_dense`` (or ``aten.equal``/``aten.is_nonzero``), which a dispatch
mode sees. Reads that transformers' own code makes (its mask building) are not counted:
only those whose innermost Python frame outside torch is in kvpolicy.
"""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvpolicy
from kvpolicy.errors import CacheError
from kvpolicy.runtime.checks import CHECKS_ENV, data_checks
from kvpolicy.zoo.tiny import tiny_model

_HOST_READS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.is_nonzero.default,
}
_PACKAGE = str(Path(kvpolicy.__file__).parent)
_TORCH = str(Path(torch.__file__).parent)
POLICY = {"defaults": {"bits": 2, "group_size": 16, "residual": 16, "sinks": 2}}


class HostReads(TorchDispatchMode):
    """Counts host reads by the kvpolicy line that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "kvpolicy":
            # kvpolicy's own ops (kvpolicy::attend): run their implementation with this
            # mode active again, so that the host reads inside them are seen too (the mode
            # is off while it handles an op); redispatching past the Python key does not
            # come back here for the op itself.
            with self:
                return func.redispatch(torch._C.DispatchKeySet("CPU"), *args, **(kwargs or {}))
        if func in _HOST_READS:
            frames = [f for f in traceback.extract_stack() if not f.filename.startswith(_TORCH)]
            caller = frames[-2] if len(frames) >= 2 else frames[-1]  # [-1]: this method
            if caller.filename.startswith(_PACKAGE):
                self.sites[f"{Path(caller.filename).name}:{caller.lineno}"] += 1
        return func(*args, **(kwargs or {}))


def _decode_reads(arch: str, backend: str, padded: bool) -> collections.Counter:
    model = kvpolicy.compile_model(tiny_model(arch), policy=POLICY, backend=backend)
    ids = torch.randint(3, 128, (2, 42), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 42, dtype=torch.long)
    if padded:
        mask[1, :5] = 0  # a left-padded row: positions differ between rows
    with torch.no_grad():
        out = model(ids[:, :40], attention_mask=mask[:, :40], use_cache=True)
        cache = out.past_key_values
        assert cache.layers[0].packed.n_packed > 0  # the step reads packed groups
        out = model(ids[:, 40:41], attention_mask=mask[:, :41], past_key_values=cache,
                    use_cache=True)
        with HostReads() as reads:
            model(ids[:, 41:42], attention_mask=mask, past_key_values=out.past_key_values,
                  use_cache=True)
    return reads.sites


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("padded", [False, True])
def test_decode_step_reads_nothing_back_without_checks(monkeypatch, arch, padded):
    monkeypatch.setenv(CHECKS_ENV, "0")  # the path of a one-token step on a GPU
    assert _decode_reads(arch, "torch", padded) == {}


@pytest.mark.triton
def test_triton_decode_step_reads_nothing_back_without_checks(monkeypatch):
    monkeypatch.setenv(CHECKS_ENV, "0")
    assert _decode_reads("llama", "triton", padded=True) == {}


def test_checks_on_read_the_values(monkeypatch):
    """The counter sees the checks when they run (so the tests above can fail)."""
    monkeypatch.setenv(CHECKS_ENV, "1")
    sites = _decode_reads("llama", "torch", padded=False)
    assert sum(sites.values()) >= 2 * 2  # key/value and query, per layer


def test_data_checks_rule(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.delenv(CHECKS_ENV, raising=False)
    assert data_checks(cpu, 1) and data_checks(cpu, 100)
    assert not data_checks(gpu, 1)  # a decode step on a GPU
    assert data_checks(gpu, 2)  # a prefill or a chunk: one stall per layer per prompt
    monkeypatch.setenv(CHECKS_ENV, "1")
    assert data_checks(gpu, 1)
    monkeypatch.setenv(CHECKS_ENV, "0")
    assert not data_checks(cpu, 100)
    monkeypatch.setenv(CHECKS_ENV, "yes")
    with pytest.raises(CacheError, match="KVPOLICY_CHECKS='yes'"):
        data_checks(cpu, 1)


def test_nan_in_a_decode_step_is_refused_where_checks_run(monkeypatch):
    """On CPU (and with KVPOLICY_CHECKS=1 anywhere) a NaN key is refused, cache unchanged."""
    from kvpolicy.kernels.layout import QuantSpec
    from kvpolicy.runtime.layer import PackedKVLayer

    monkeypatch.delenv(CHECKS_ENV, raising=False)
    layer = PackedKVLayer(QuantSpec(2, 16, "channel"), QuantSpec(2, 16, "token"), residual=4,
                          sinks=0)
    k = torch.randn(1, 2, 8, 16)
    layer.append(k, k)
    bad = torch.full((1, 2, 1, 16), float("nan"))
    with pytest.raises(CacheError, match="NaN"):
        layer.append(bad, torch.zeros_like(bad))
    assert layer.seq_len == 8
    monkeypatch.setenv(CHECKS_ENV, "0")
    layer.append(bad, torch.zeros_like(bad))  # unchecked: stored as given
    assert layer.seq_len == 9
