"""PackedKVLayer on the Triton backend (interpreter on CPU) against the torch backend."""

from __future__ import annotations

import pytest
import torch

from kvpolicy.kernels.layout import QuantSpec, RotarySpec
from kvpolicy.runtime.layer import PackedKVLayer

pytestmark = pytest.mark.triton


def make_rope(rotary_dim: int, positions: int = 256) -> RotarySpec:
    inv = 1.0 / 1e4 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None]
    ang = torch.cat((ang, ang), -1)
    return RotarySpec("rotate_half", rotary_dim, ang.cos().float(), ang.sin().float())


@pytest.mark.parametrize("tq", (1, 3))
def test_triton_backend_matches_torch_backend(tq: int) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ks, vs = QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token")
    rope = make_rope(32)
    layers = {
        name: PackedKVLayer(ks, vs, residual=8, sinks=2, rope=rope, backend=name)
        for name in ("torch", "triton")
    }
    g = torch.Generator().manual_seed(tq)
    k, v = torch.randn(2, 1, 2, 75, 32, generator=g).unbind(0)
    q = torch.randn(1, 4, tq, 32, generator=g)
    out = {}
    for name, layer in layers.items():
        dev = "cpu" if name == "torch" else device
        layer.append(k.to(dev), v.to(dev))
        assert layer.n_packed == 64
        out[name] = layer.attend(q.to(dev)).cpu()
    for a, b in zip(layers["torch"]._pk, layers["triton"]._pk, strict=True):
        assert torch.equal(a.view().cpu(), b.view().cpu()), "packed codes differ"
    torch.testing.assert_close(out["triton"], out["torch"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_packed_residual_reads_alike_on_both_backends(bits: int) -> None:
    """``residual_bits`` below 16: each backend quantizes the recent tokens with its own
    kernel, bit-identically, and attends over them dequantized."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ks, vs = QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token")
    g = torch.Generator().manual_seed(bits)
    k, v = torch.randn(2, 1, 2, 75, 32, generator=g).unbind(0)
    q = torch.randn(1, 4, 1, 32, generator=g)
    layers, out = {}, {}
    for name in ("torch", "triton"):
        dev = "cpu" if name == "torch" else device
        layers[name] = PackedKVLayer(ks, vs, residual=8, sinks=2, backend=name,
                                     residual_bits=bits, dtype=torch.float16)
        layers[name].append(k.to(dev), v.to(dev))
        out[name] = layers[name].attend(q.to(dev)).cpu()
    assert layers["torch"].n_residual == 9
    for a, b in zip(layers["torch"]._res_v.data, layers["triton"]._res_v.data, strict=True):
        assert torch.equal(a, b.cpu()), "packed residual differs"
    torch.testing.assert_close(out["triton"], out["torch"], atol=1e-3, rtol=1e-3)
