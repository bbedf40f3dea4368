"""Activations captured where each cached tensor is consumed (kvpolicy.calibrate.capture)."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from kvpolicy import analyse_model, compile_model, derive_policy
from kvpolicy.calibrate import budget
from kvpolicy.calibrate.capture import _fold_heads, capture_activations, reduce_activations
from kvpolicy.errors import AnalysisError, KVPolicyError
from kvpolicy.kernels import reference
from kvpolicy.zoo.tiny import tiny_model

B, T = 2, 40

# arch -> (query heads, kv heads, head_dim, rope style, rotary_dim)
SHAPES = {
    "llama": (4, 2, 32, "rotate_half", 32),  # GQA
    "phi": (4, 2, 32, "rotate_half", 16),  # partial rotary
    "codegen": (4, 4, 32, "interleaved", 16),  # GPT-J pairs, half-width tables
    "gpt2": (4, 4, 32, None, None),  # learned positions, no RoPE
}


def _ids(batch: int = B, tokens: int = T, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, tokens), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def captured() -> dict[str, list]:
    return {arch: capture_activations(tiny_model(arch), _ids()) for arch in SHAPES}


@pytest.mark.parametrize("arch", list(SHAPES))
def test_capture_shapes(captured, arch: str) -> None:
    hq, hkv, d, style, r = SHAPES[arch]
    acts = captured[arch]
    assert [a.layer for a in acts] == [0, 1]
    for a in acts:
        assert a.query.shape == (B, hq, T, d)
        for t in (a.key_pre, a.key, a.value):
            assert t.shape == (B, hkv, T, d) and t.dtype == torch.float32
        assert a.scale == pytest.approx(d**-0.5)
        assert a.rope_style == style and a.rotary_dim == r
        if style is None:
            assert a.cos is None and a.key_pre is a.key
        else:
            assert a.cos.shape == a.sin.shape == (B, T, r)
            assert not torch.allclose(a.key_pre, a.key)


@pytest.mark.parametrize("arch", [a for a, s in SHAPES.items() if s[3] is not None])
def test_pre_rope_keys_rerotate_to_post_rope(captured, arch: str) -> None:
    for a in captured[arch]:
        spec, positions = a.rotary()
        again = reference.apply_rope(a.key_pre, positions, spec)
        err = (again - a.key).abs().max().item()
        assert err < 1e-5, f"layer {a.layer}: re-rotated pre-RoPE keys differ by {err:.2e}"


def test_pre_rope_keys_are_the_projected_keys() -> None:
    """Independent ground truth: the inverted keys equal k_proj's output (Llama layout)."""
    model = tiny_model("llama")
    analyse_model(model)  # its probe forwards run before the hooks below
    seen: list[torch.Tensor] = []
    layers = model.model.layers
    hooks = [
        layer.self_attn.k_proj.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
        for layer in layers
    ]
    try:
        acts = capture_activations(model, _ids())
    finally:
        for h in hooks:
            h.remove()
    for a, proj in zip(acts, seen, strict=True):
        expected = proj.view(B, T, 2, 32).transpose(1, 2)
        err = (a.key_pre - expected).abs().max().item()
        assert err < 1e-5, f"layer {a.layer}: pre-RoPE key differs from k_proj by {err:.2e}"



def test_fold_heads_undoes_repeat_kv() -> None:
    kv = torch.randn(1, 2, 5, 4)
    repeated = kv.repeat_interleave(3, dim=1)  # what repeat_kv hands to SDPA
    assert torch.equal(_fold_heads(repeated, 2, "key"), kv)
    with pytest.raises(AnalysisError, match="not 2 kv heads each repeated"):
        _fold_heads(torch.randn(1, 6, 5, 4), 2, "key")


class _Nudge(TorchFunctionMode):
    """Adds ``delta`` to the output of the ``layer``-th SDPA call of a forward."""

    def __init__(self, layer: int, delta: torch.Tensor) -> None:
        super().__init__()
        self.layer, self.delta, self.calls = layer, delta, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is F.scaled_dot_product_attention:
            self.calls += 1
            if self.calls - 1 == self.layer:
                out = out + self.delta
        return out


def _summed_loss(model, ids: torch.Tensor) -> float:
    logits = model(ids).logits[:, :-1]
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                 reduction="sum"))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_loss_grad_is_the_gradient_of_the_next_token_loss(arch: str) -> None:
    """``out_grad`` against a central difference of the summed next-token loss along a
    random direction of one layer's attention output (a float64 model; its RoPE tables stay
    float32, which limits how small a step stays exact); every path downstream, later
    layers included, is in it."""
    model = tiny_model(arch).double()
    ids = _ids(2, 24)
    acts = capture_activations(model, ids, loss_grad=True)
    assert all(p.grad is None and p.requires_grad for p in model.parameters())
    gen = torch.Generator().manual_seed(5)
    for act in acts:
        g = act.out_grad
        assert g is not None and g.dtype == torch.float32 and g.shape == act.query.shape
        direction = torch.randn(g.shape, generator=gen, dtype=torch.float64)
        eps = 1e-3
        with torch.no_grad(), _Nudge(act.layer, eps * direction):
            up = _summed_loss(model, ids)
        with torch.no_grad(), _Nudge(act.layer, -eps * direction):
            down = _summed_loss(model, ids)
        assert (up - down) / (2 * eps) == pytest.approx(float((g.double() * direction).sum()),
                                                        rel=2e-4)
    # Layer 0's output reaches the loss through layer 1 too: its gradient is not the one
    # of the last layer.
    assert not torch.allclose(acts[0].out_grad, acts[1].out_grad)
    assert capture_activations(model, ids)[0].out_grad is None


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_capture_stops_after_the_last_attention_layer(arch: str) -> None:
    """Without a gradient the forward stops once every layer's attention ran: the model's
    head (the [B, T, vocab] logits) never runs, the activations are those a whole forward
    sees, and the hooks are gone afterwards (the model still runs whole)."""
    model = tiny_model(arch)
    analyse_model(model)  # its probe forwards run the head; the capture reuses its result
    head = model.get_output_embeddings()
    calls: list[int] = []
    handle = head.register_forward_hook(lambda *a: calls.append(1))
    ids = _ids(2, 24)
    short = capture_activations(model, ids)
    assert calls == []
    whole = capture_activations(model, ids, loss_grad=True)
    assert calls == [1]
    for a, b in zip(short, whole, strict=True):
        for name in ("query", "key_pre", "key", "value"):
            assert torch.equal(getattr(a, name), getattr(b, name))
    handle.remove()
    model(ids)  # no hook of the capture is left to stop it


def test_loss_grad_inside_inference_mode_and_for_a_frozen_model() -> None:
    """Same gradients when called under ``torch.inference_mode()`` and when no parameter
    requires grad (an inference-only model)."""
    plain = capture_activations(tiny_model("llama"), _ids(), loss_grad=True)
    model = tiny_model("llama")
    with torch.inference_mode():
        inside = capture_activations(model, _ids(), loss_grad=True)
        built_inside = tiny_model("llama")
    with pytest.raises(KVPolicyError, match="built under torch.inference_mode"):
        capture_activations(built_inside, _ids(), loss_grad=True)
    frozen_model = tiny_model("llama").requires_grad_(False)
    frozen = capture_activations(frozen_model, _ids(), loss_grad=True)
    assert not any(p.requires_grad for p in frozen_model.parameters())
    for a, b, c in zip(plain, inside, frozen, strict=True):
        assert a.out_grad.abs().sum() > 0
        torch.testing.assert_close(b.out_grad, a.out_grad)
        torch.testing.assert_close(c.out_grad, a.out_grad)


class _NotLogits(nn.Module):
    """A causal LM wrapped to return ``what`` of its last hidden state instead of logits."""

    def __init__(self, model: nn.Module, what: str) -> None:
        super().__init__()
        self.m, self.what, self.config = model, what, model.config

    def forward(self, ids: torch.Tensor):
        hidden = self.m.model(ids).last_hidden_state
        return {"hidden": hidden} if self.what == "dict" else hidden[..., :64]


@pytest.mark.parametrize("what, match", [
    ("dict", "returned dict, not \\[B, T, vocab\\] logits"),
    ("narrow", "not next-token logits over a vocabulary that holds every calibration id"),
])
def test_loss_grad_needs_logits_over_the_vocabulary(what: str, match: str) -> None:
    model = _NotLogits(tiny_model("llama"), what)
    with pytest.raises(KVPolicyError, match=match) as info:
        capture_activations(model, _ids(), loss_grad=True)
    assert "metric='relative'" in str(info.value)
    # The way out the message gives: a budget from the relative currency.
    spec = {"defaults": {"bits": 2, "group_size": 16, "residual": 16, "sinks": 2}}
    ids = _ids(1, 96)
    cal = budget.calibrate(model, derive_policy(model, policy=spec), ids, metric="relative",
                           progress=False)
    spec["defaults"]["bits"] = 2.5
    pol = derive_policy(model, policy=spec, calibration=cal)
    assert pol.budget == 2.5 and pol.avg_bits <= 2.5


@pytest.mark.parametrize("arch", list(SHAPES))
def test_reduce_activations_sees_what_capture_sees_one_layer_at_a_time(captured, arch: str
                                                                       ) -> None:
    """reduce_activations hands fn each layer's activations, the same tensors
    capture_activations returns (RoPE, partial rotary and none), and lets go of a layer's
    before the next one's are made."""
    alive: list[weakref.ref] = []
    held: list[int] = []

    def fn(act):
        held.append(sum(r() is not None for r in alive))
        alive.extend(weakref.ref(getattr(act, n)) for n in ("query", "key_pre", "value"))
        return {n: getattr(act, n).clone() for n in ("query", "key_pre", "key", "value")}

    got = reduce_activations(tiny_model(arch), _ids(), fn)
    want = captured[arch]
    assert sorted(got) == [a.layer for a in want]
    for a in want:
        for name, x in got[a.layer].items():
            assert torch.equal(x, getattr(a, name)), (a.layer, name)
    assert held == [0] * len(want)


def test_eager_attention_is_refused() -> None:
    model = tiny_model("llama", attn_implementation="eager")
    with pytest.raises(AnalysisError, match="attn_implementation='sdpa'"):
        capture_activations(model, _ids())
    with pytest.raises(AnalysisError, match="attn_implementation='sdpa'"):
        reduce_activations(model, _ids(), lambda act: None)


def test_compiled_model_is_refused() -> None:
    model = compile_model(tiny_model("llama"), bits=2)
    with pytest.raises(KVPolicyError, match="uncompiled"):
        capture_activations(model, _ids())

