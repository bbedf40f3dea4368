"""Where 2-bit error comes from, per element: SmolLM2's keys and values quantized with the
derived axes (keys per channel over groups of 32 tokens, pre-RoPE; values per token over
groups of 32 channels) under four quantizers with the same metadata (two fp16 numbers per
group), side by side on the same tensors:

- ``uniform``: kvpolicy's codes today, ``2^b`` evenly spaced levels from the group's min to
  its max (``kernels.reference.quantize``);
- ``uniform + hadamard``: the same after an orthogonal rotation of the head dim (a
  Walsh-Hadamard matrix with a fixed random sign flip), rotated back after dequantization;
- ``lloyd-max``: non-uniform levels, the Lloyd-Max levels of a unit Gaussian scaled by the
  group's standard deviation around its mean (mean and deviation replace zero and scale);
- ``lloyd-max + hadamard``.

    python bench/quant_levels.py [--tokens 512] [--bits 2 3]

Prints the relative error ``‖x̂ - x‖ / ‖x‖`` averaged over the 30 layers, and each
quantizer's error as a ratio of uniform's. The Lloyd-Max quantizer here is what
``levels: normal`` stores (kvpolicy.kernels.layout). Per-element error is not what
attention consumes: it scores normal levels alike for keys and values (0.87x at 2 bits),
but end to end they hurt values and are mixed for keys (docs/results.md, "Levels"), which
is why ``levels: auto`` is decided per axis and, under a budget, by the calibration's cost.
"""

from __future__ import annotations

import argparse
import math

import torch

from kvpolicy import zoo
from kvpolicy.kernels import reference
from kvpolicy.kernels.layout import QuantSpec
from kvpolicy.zoo import text

GROUP = 32
# Lloyd-Max quantizer of N(0, 1) (minimum mean squared error), 2 and 3 bits.
LLOYD_MAX = {
    2: (-1.510, -0.4528, 0.4528, 1.510),
    3: (-2.152, -1.344, -0.7560, -0.2451, 0.2451, 0.7560, 1.344, 2.152),
}


def hadamard(n: int, seed: int = 0) -> torch.Tensor:
    """An orthogonal ``[n, n]``: Sylvester's Hadamard matrix / sqrt(n), rows sign-flipped."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return signs[:, None].float() * h / math.sqrt(n)


def _uniform(x: torch.Tensor, bits: int, axis: str) -> torch.Tensor:
    spec = QuantSpec(bits, GROUP, axis)
    return reference.dequantize(reference.quantize(x, spec), spec)


def _lloyd_max(x: torch.Tensor, bits: int, axis: str) -> torch.Tensor:
    b, h, t, d = x.shape
    if axis == "token":  # groups of GROUP channels of one token
        g = x.reshape(b, h, t, d // GROUP, GROUP)
        dim = -1
    else:  # groups of GROUP tokens of one channel
        g = x.reshape(b, h, t // GROUP, GROUP, d)
        dim = -2
    mean, std = g.mean(dim, keepdim=True), g.std(dim, keepdim=True).clamp_min(1e-8)
    levels = torch.tensor(LLOYD_MAX[bits])
    codes = ((g - mean) / std)[..., None].sub(levels).abs().argmin(-1)
    return (levels[codes] * std + mean).reshape(x.shape)


def relative_error(x, bits, axis, levels, rotation=None) -> float:
    y = x @ rotation if rotation is not None else x
    q = (_uniform if levels == "uniform" else _lloyd_max)(y, bits, axis)
    if rotation is not None:
        q = q @ rotation.T
    return ((q - x).norm() / x.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="pydoc tokens (default 512)")
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 3])
    args = parser.parse_args()
    if args.tokens % GROUP:
        parser.error(f"--tokens must be a multiple of {GROUP}")
    model, tokenizer = zoo.load("smollm2-135m")
    ids = text.segments(tokenizer, args.tokens, 1)
    captured: dict[str, list[torch.Tensor]] = {"key": [], "value": []}
    hooks = []
    for layer in model.model.layers:
        attn = layer.self_attn
        for name, proj in (("key", attn.k_proj), ("value", attn.v_proj)):
            hooks.append(proj.register_forward_hook(
                lambda _m, _i, out, name=name: captured[name].append(out.detach())))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    d = model.config.head_dim
    rot = hadamard(d)
    rows = [("uniform", None), ("uniform + hadamard", rot), ("lloyd-max", None),
            ("lloyd-max + hadamard", rot)]
    print(f"SmolLM2-135M, {args.tokens} pydoc tokens, {len(captured['key'])} layers, "
          f"groups of {GROUP}; relative error ‖x̂ - x‖/‖x‖ averaged over layers (× uniform)")
    print("| tensor (axis) | bits | " + " | ".join(name for name, _ in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for tensor, axis in (("key", "channel"), ("value", "token")):
        xs = [x.view(1, args.tokens, -1, d).transpose(1, 2).contiguous()
              for x in captured[tensor]]
        for bits in args.bits:
            errs = [sum(relative_error(x, bits, axis, name.split(" ")[0], r) for x in xs)
                    / len(xs) for name, r in rows]
            cells = " | ".join(f"{e:.4f} ({e / errs[0]:.2f})" for e in errs)
            print(f"| {tensor} ({axis}) | {bits} | {cells} |")


if __name__ == "__main__":
    main()
