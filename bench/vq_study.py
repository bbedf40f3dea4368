"""Below 2.5 bits: scalar codes against vector-quantized (k-means) codes, per layer, on SmolLM2.

A study for the quality frontier below 2.5 stored bits, not a feature: nothing here is
served. Every cached tensor of SmolLM2 is quantized three ways on held-out text and the
attention output that reads it is compared with the exact one:

- scalar, what the stored-bits allocator chooses between below 2.5 bits today
  (``kernels.reference`` at the derived axes, groups of 64): keys per channel, pre-RoPE,
  1 bit with normal levels and fp16 metadata (1.50 stored bits) or 2 bits with 8-bit
  metadata fitted by least squares (2.25); values per token after the Hadamard rotation,
  the same widths (1.50 / 2.25);
- vector-quantized: sub-vectors of ``d`` consecutive channels coded as the index of the
  nearest of ``2^(b*d)`` centroids, one codebook per layer, kv head and tensor, fitted by
  k-means on the first row of the text and scored on the second. Keys are first
  normalised per channel over each group of 64 tokens (mean and deviation, priced as two
  8-bit numbers: +0.25 bits), values per token by their RMS (one least-squares scale per
  token and head, priced at 8 bits: +0.125 bits).

- per-token precision on top of the scalar codes: of every 65 tokens, the one whose pre-RoPE
  key deviates most from the others (the sum over heads and channels of its squared
  deviation in units of the channel's spread) kept exact in fp16 in both tensors, the
  other 64 coded as one group (priced at 16 bits for 1/65 of the tokens).

The second table is end to end and for values alone: every value SmolLM2's ``v_proj``
writes is replaced by its code (keys exact), and the model scores 4 pydoc segments of
``--segment`` tokens from the start of the text (the codebooks were fitted on its end):
perplexity, mean KL(fp || coded) of the next-token distributions and top-1 agreement, each
against the same forward without codes. Every value is coded, the current token's and the
most recent ones included, which a cache with a residual window would keep exact.

Each row of the first table quantizes both tensors of every layer (the packed part: tokens
after 4 sinks, in whole groups of 64); the other columns change one tensor at a time against
the scalar 2-bit row. Printed: the stored bits of each code, and the relative attention-output error
``‖o' - o‖ / ‖o‖`` averaged over the 30 layers (every query row from the first packed group
on reads only quantized tokens and the sinks: a harsher setting than a cache with a
residual window, which is why the errors are large).

    .venv/bin/python bench/vq_study.py [--tokens 1024] [--iters 25] [--segment 896]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from kvpolicy import zoo
from kvpolicy.calibrate.budget import calibration_ids
from kvpolicy.calibrate.capture import capture_activations
from kvpolicy.calibrate.metrics import roundtrip
from kvpolicy.kernels import reference
from kvpolicy.kernels.layout import QuantSpec
from kvpolicy.kernels.rotation import rotation_matrix
from kvpolicy.zoo import text

SINKS, GROUP = 4, 64
SCALAR = {  # name: (key spec, value spec, stored bits of each)
    "scalar 1 bit (normal levels, fp16 metadata)": (
        QuantSpec(1, GROUP, "channel", "normal", 16), QuantSpec(1, GROUP, "token", "normal", 16),
        1.5, 1.5),
    "scalar 2 bits (8-bit metadata)": (
        QuantSpec(2, GROUP, "channel", "uniform", 8, "mse"),
        QuantSpec(2, GROUP, "token", "uniform", 8), 2.25, 2.25),
}
VQ = ((8, 1.0), (4, 1.5), (4, 2.0))  # (sub-vector channels d, code bits per element b)


def kmeans(x: torch.Tensor, k: int, iters: int) -> torch.Tensor:
    """``k`` centroids of the rows of ``x [N, d]`` (Lloyd's algorithm, seeded rows)."""
    g = torch.Generator().manual_seed(0)
    c = x[torch.randperm(x.shape[0], generator=g)[:k]].clone()
    for _ in range(iters):
        a = torch.cdist(x, c).argmin(1)
        n = torch.bincount(a, minlength=k)
        s = torch.zeros_like(c).index_add_(0, a, x)
        c = torch.where((n > 0)[:, None], s / n.clamp_min(1)[:, None].float(), c)
    return c


def nearest(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` with each sub-vector replaced by its nearest centroid."""
    d = codebook.shape[1]
    flat = x.reshape(-1, d)
    return codebook[torch.cdist(flat, codebook).argmin(1)].reshape(x.shape)


def key_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [..., n*64, D]`` per group of 64 tokens and channel: (normalised, mean, deviation)."""
    g = x.unflatten(-2, (-1, GROUP))
    m = g.mean(-2, keepdim=True)
    s = g.std(-2, keepdim=True, unbiased=False) + 1e-6
    return (g - m) / s, m, s


def vq_keys(train: torch.Tensor, test: torch.Tensor, d: int, bits: float, iters: int):
    """Pre-RoPE keys ``[Hkv, T, D]`` of the packed tokens, coded per head."""
    out = torch.empty_like(test)
    for h in range(test.shape[0]):
        z, _, _ = key_groups(train[h])
        cb = kmeans(z.reshape(-1, d), round(2 ** (bits * d)), iters)
        z, m, s = key_groups(test[h])
        out[h] = (nearest(z, cb) * s + m).flatten(-3, -2)
    return out


def rms_unit(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` over each row's RMS."""
    return x / (x.norm(dim=-1, keepdim=True) / math.sqrt(x.shape[-1])).clamp_min(1e-9)


def value_codebook(x: torch.Tensor, d: int, bits: float, iters: int) -> torch.Tensor:
    """Centroids of the ``d``-channel sub-vectors of rotated values ``x [..., D]``, each
    value first brought to unit RMS."""
    return kmeans(rms_unit(x).reshape(-1, d), round(2 ** (bits * d)), iters)


def vq_code(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Rotated values ``x [..., D]`` coded with ``codebook``: the nearest centroids of their
    unit-RMS sub-vectors, times one least-squares scale per value."""
    q = nearest(rms_unit(x), codebook)
    scale = (x * q).sum(-1, keepdim=True) / q.square().sum(-1, keepdim=True)
    return q * scale.nan_to_num(0.0)


def vq_values(train: torch.Tensor, test: torch.Tensor, d: int, bits: float, iters: int):
    """Rotated values ``[Hkv, T, D]``, coded per head with one scale per token."""
    return torch.stack([vq_code(test[h], value_codebook(train[h], d, bits, iters))
                        for h in range(test.shape[0])])


def exact_outliers(k: torch.Tensor, v: torch.Tensor, ks: QuantSpec, vs: QuantSpec
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and (rotated) values ``[Hkv, T, D]`` coded by ``ks``/``vs`` in chunks of 65
    tokens, the most deviating token of each kept exact (a trailing part chunk is left
    exact as well)."""
    kq, vq = k.clone(), v.clone()
    span = GROUP + 1
    for c0 in range(0, k.shape[1] - span + 1, span):
        kc = k[:, c0:c0 + span]
        z = (kc - kc.mean(1, keepdim=True)) / (kc.std(1, keepdim=True) + 1e-6)
        keep = torch.ones(span, dtype=torch.bool)
        keep[int(z.square().sum((0, 2)).argmax())] = False
        idx = torch.arange(c0, c0 + span)[keep]
        kq[:, idx] = roundtrip(k[None, :, idx].contiguous(), ks)[0]
        vq[:, idx] = roundtrip(v[None, :, idx].contiguous(), vs)[0]
    return kq, vq


def output_error(act, k_pre: torch.Tensor, v: torch.Tensor) -> float:
    """Relative attention-output error of row 1 with keys ``k_pre`` and values ``v``."""
    q = act.query[1:2]
    hq, (hkv, t, _) = q.shape[1], k_pre.shape
    rope, pos = act.rotary(t)
    mask = torch.full((t, t), float("-inf")).triu(1)

    def attend(k: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        k, vv = (x.repeat_interleave(hq // hkv, 1) for x in (k, vv))
        return torch.softmax(q @ k.transpose(-1, -2) * act.scale + mask, -1) @ vv

    exact = attend(act.key[1:2], act.value[1:2])
    got = attend(reference.apply_rope(k_pre[None], pos[1:2], rope), v[None])
    rows = slice(SINKS + GROUP, None)
    return float((got - exact)[:, :, rows].norm() / exact[:, :, rows].norm())


def _code_values(v: torch.Tensor, rot: torch.Tensor, code) -> torch.Tensor:
    """``v [B, T, Hkv * D]`` (a ``v_proj`` output) coded per head by ``code(head, x)`` on
    rotated values ``x [T', D]``, rotated back."""
    b, t, _ = v.shape
    d = rot.shape[0]
    x = (v.float().view(b, t, -1, d) @ rot).transpose(1, 2)  # [B, Hkv, T, D]
    out = torch.stack([code(h, x[:, h].reshape(-1, d)).view(b, t, d)
                       for h in range(x.shape[1])], 1)
    return (out.transpose(1, 2) @ rot.T).reshape(v.shape).to(v.dtype)


@torch.no_grad()
def end_to_end(model, acts, segs: torch.Tensor, iters: int) -> list[str]:
    """Rows of the end-to-end table: values coded in every layer, keys exact."""
    d_head = acts[0].value.shape[-1]
    rot = rotation_matrix("hadamard", d_head, acts[0].value.device)
    layers = model.model.layers
    ref = model(segs).logits[:, :-1].float().log_softmax(-1)
    fp_nll = -ref.gather(-1, segs[:, 1:, None]).mean()

    def scalar(spec: QuantSpec):
        return lambda layer, h, x: roundtrip(x[None, None], spec)[0, 0]

    def kmeans_code(dim: int, bits: float):
        books = {}
        for i, act in enumerate(acts):
            vr = act.value @ rot  # [B, Hkv, T, D], both calibration rows
            for h in range(vr.shape[1]):
                books[i, h] = value_codebook(vr[:, h], dim, bits, iters)
        return lambda layer, h, x: vq_code(x, books[layer, h])

    codes = {  # name: (stored bits of a value, code(layer, head, x))
        name: (vb, scalar(vs)) for name, (_, vs, _, vb) in SCALAR.items()}
    codes.update({f"k-means, {b:g} bits in {dm}-channel sub-vectors":
                  (b + 0.125, kmeans_code(dm, b)) for dm, b in VQ})

    def coding_hook(i: int, code):
        return lambda mod, args, out: _code_values(out, rot, lambda h, x: code(i, h, x))

    rows = []
    for name, (bits, code) in codes.items():
        hooks = [layer.self_attn.v_proj.register_forward_hook(coding_hook(i, code))
                 for i, layer in enumerate(layers)]
        try:
            got = model(segs).logits[:, :-1].float().log_softmax(-1)
        finally:
            for hook in hooks:
                hook.remove()
        nll = -got.gather(-1, segs[:, 1:, None]).mean()
        kl = (ref.exp() * (ref - got)).sum(-1).mean()
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean()
        rows.append(f"| {name} | {bits:.3g} | {math.exp(nll - fp_nll):.4f} | {kl:.4f} | "
                    f"{agree:.3f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per row (2 rows)")
    ap.add_argument("--iters", type=int, default=25, help="k-means iterations")
    ap.add_argument("--segment", type=int, default=896,
                    help="tokens per scored segment of the end-to-end table (4 segments)")
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok = zoo.load("smollm2-135m")
    ids, source = calibration_ids(model, args.tokens, tok, rows=2)
    acts = capture_activations(model, ids)
    n = (args.tokens - SINKS) // GROUP * GROUP
    seg = slice(SINKS, SINKS + n)
    t0 = time.perf_counter()
    errors: dict[str, list[float]] = {}
    bits: dict[str, str] = {}
    for act in acts:
        k, v = act.key_pre, act.value
        rot = rotation_matrix("hadamard", v.shape[-1], v.device)
        vr = v @ rot
        coded_k: dict[str, torch.Tensor] = {}
        coded_v: dict[str, torch.Tensor] = {}
        for name, (ks, vs, kb, vb) in SCALAR.items():
            coded_k[name] = roundtrip(k[1:2, :, seg].contiguous(), ks)[0]
            coded_v[name] = roundtrip(vr[1:2, :, seg].contiguous(), vs)[0]
            bits[name] = f"{kb:.2f} / {vb:.2f}"
        for name, (ks, vs, kb, vb) in SCALAR.items():
            row = f"{name}, 1 token in 65 exact"
            coded_k[row], coded_v[row] = exact_outliers(k[1, :, seg], vr[1, :, seg], ks, vs)
            bits[row] = f"{(64 * kb + 16) / 65:.2f} / {(64 * vb + 16) / 65:.2f}"
        for d, b in VQ:
            name = f"k-means, {b:g} bits in {d}-channel sub-vectors"
            coded_k[name] = vq_keys(k[0, :, seg], k[1, :, seg], d, b, args.iters)
            coded_v[name] = vq_values(vr[0, :, seg], vr[1, :, seg], d, b, args.iters)
            bits[name] = f"{b + 0.25:.3g} / {b + 0.125:.3g}"
        base_k, base_v = coded_k["scalar 2 bits (8-bit metadata)"], coded_v[
            "scalar 2 bits (8-bit metadata)"]

        def whole(kq: torch.Tensor, vq: torch.Tensor, k=k, v=v, rot=rot) -> tuple:
            kk, vv = k[1].clone(), v[1].clone()
            kk[:, seg], vv[:, seg] = kq, vq @ rot.T
            return kk, vv

        for name in coded_k:
            for col, (kq, vq) in (("both", (coded_k[name], coded_v[name])),
                                  ("keys only", (coded_k[name], base_v)),
                                  ("values only", (base_k, coded_v[name]))):
                errors.setdefault(f"{name}|{col}", []).append(
                    output_error(act, *whole(kq, vq)))
    print(f"# SmolLM2-135M, {source}; codebooks fitted on row 0, scored on row 1; "
          f"{len(acts)} layers, {time.perf_counter() - t0:.0f} s")
    print("| code | stored bits, keys / values | error, both | keys only, values 2-bit "
          "scalar | values only, keys 2-bit scalar |")
    print("|---|---|---|---|---|")
    for name in bits:
        e = [sum(errors[f"{name}|{c}"]) / len(acts) for c in ("both", "keys only",
                                                                "values only")]
        print(f"| {name} | {bits[name]} | {e[0]:.3f} | {e[1]:.3f} | {e[2]:.3f} |")
    t0 = time.perf_counter()
    rows = end_to_end(model, acts, text.segments(tok, args.segment, 4), args.iters)
    print(f"\n# end to end: values coded in every layer, keys exact; 4 pydoc segments of "
          f"{args.segment} tokens from the start of the text; {time.perf_counter() - t0:.0f} s")
    print("| value code | stored bits | perplexity x fp | KL to fp | top-1 = fp |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
