"""What the Triton kernel modules share: how Triton runs here, and the host side of the
attention kernels (layout checks, strides, RoPE and mask arguments, split counts, the
autotune configs and their prune filter, the level and threshold tables of non-uniform
levels, the scale table of 8-bit metadata, the codebook of vector-quantized values).

:mod:`kvpolicy.kernels.triton_attention` (one packed segment) and
:mod:`kvpolicy.kernels.triton_decode` (a packed and a full-precision segment in one
launch) prepare their arguments with the same functions here, so that both check a
segment, a rotary table or a mask with the same words.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from ..errors import CacheError
from . import reference
from .layout import Packed, QuantSpec, RotarySpec, scale_table, thresholds

__all__ = [
    "interpreting", "compile_ahead", "ROPE_STYLES", "ATTENTION_CONFIGS",
    "keep_attention_config", "packed_dims", "kernel_strides", "inner_extent", "fast_layout",
    "choose_splits", "plan_splits", "dots_in_fp32", "rope_arguments", "mask_arguments",
    "check_softcap", "channel_blocks", "level_lut", "threshold_table", "meta_table",
    "width_table", "vq_codebook",
]

ROPE_STYLES = {None: 0, "rotate_half": 1, "interleaved": 2}


def interpreting() -> bool:
    """True when Triton runs in interpreter mode (decided, like ``triton.jit``, at import)."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def compile_ahead(
    kernel,
    ints: dict,
    ptrs: dict,
    consts: dict,
    *,
    floats: tuple[str, ...] = (),
    target=None,
    num_warps: int = 4,
    num_stages: int = 2,
):
    """Compile ``kernel`` ahead of time (no GPU needed) with the argument specialisation the
    runtime would pick: ints equal to 1 become constants, pointers and ints that are
    multiples of 16 carry divisibility 16 (except the kernel's ``do_not_specialize``
    arguments, plain i32 as at run time). An argument with a default (the level tables
    and their flags) that ``ptrs``, ``consts`` and ``floats`` do not name is the constant
    of its default, as a launch that passes it None or False. ``target`` defaults to
    sm_90 (H100/H200).

    Args:
        ints: value of every integer argument; ptrs: Triton pointer type of every pointer
        argument (``"*fp16"``); consts: constexpr values; floats: fp32 scalar arguments.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = kernel
    while not isinstance(fn, JITFunction):  # unwrap autotune / heuristics
        fn = fn.fn
    plain = {p.name for p in fn.params if p.do_not_specialize}
    consts = dict(consts)
    sig, attrs = {}, {}
    defaults = {p.name: p.default for p in fn.params if p.has_default}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in defaults and name not in ptrs and name not in floats:
            sig[name] = "constexpr"
            consts[name] = defaults[name]
        elif name in ptrs:
            sig[name] = ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in floats:
            sig[name] = "fp32"
        elif name in plain:
            sig[name] = "i32"
        elif ints[name] == 1:
            sig[name] = "constexpr"
            consts[name] = 1
        else:
            sig[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, consts, attrs)
    target = target if target is not None else GPUTarget("cuda", 90, 32)
    return triton.compile(src, target=target,
                          options=dict(num_warps=num_warps, num_stages=num_stages))


# --------------------------------------------------------------------------- autotune


def keep_attention_config(configs, named_args, **kwargs):
    """Prune filter of the attention kernels: no key tile longer than a split, none that
    spills registers. A full-precision split (``fp_split_len``, decode kernel) counts
    like a packed one: its tiles hold the same channels."""
    longest = max(named_args["split_len"], named_args.get("fp_split_len", 0))
    split = max(16, triton.next_power_of_2(longest))
    # Channels held per key tile. Triton 3.6 and 3.9 pass the constexpr kwargs here;
    # where a version does not, only the split bound applies.
    width = 2 * kwargs.get("BLOCK_R", 0) * int(kwargs.get("ROPE", 0) != 0)
    width += kwargs.get("BLOCK_P", 0) * int(kwargs.get("DK", 0) > kwargs.get("ROT_DIM", 0))
    width += kwargs.get("BLOCK_DV", 0)
    # NOTE: sm_90 AOT compile of the 2-bit decode kernel, head_dim 128: 136 tile elements
    # per thread use 204-235 registers without spills; 272 (128 keys, 4 warps) spill.
    # fp32 queries (IEEE dots, fp32 tiles) need twice the registers per element: full
    # rotary at head_dim 128, 64 keys x 4 warps and 128 x 8 spill (408-1784 bytes of
    # stack), 32 x 4 and 64 x 8 do not (254/170 registers, the fused decode kernel alike).
    per_warp = 80 * 32 if kwargs.get("DOT_F32", False) else 160 * 32
    kept = [
        c
        for c in configs
        if c.kwargs["BLOCK_N"] <= split
        and c.kwargs["BLOCK_N"] * width <= per_warp * c.num_warps
    ]
    return kept or configs[:1]


# NOTE: no GPU was available when this was written, so the tile length along the keys
# and the warps per program are left to the autotuner (keyed on buckets of the query
# rows and split length, and on the policy). What was measured is static
# (bench/sm90_static.py): an sm_90 AOT compile of the decode shape (32q/8kv heads,
# head_dim 128, 2-bit, fp16) spills no registers in any kept config, and its key loop
# costs ~3.2-3.9K thread-instructions per key, so the kernel is likely issue-bound
# rather than bound by the packed bytes (~0.1 ns per key and kv head on an H200, about
# what SDPA needs to stream the same key from an fp16 cache). The list is
# small so that tuning stays within seconds per shape. Under the interpreter a single
# config is kept (tuning there would time the interpreter).
ATTENTION_CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=nw, num_stages=ns)
    for bn in (32, 64, 128)
    for nw in (4, 8)
    for ns in (2, 3)
    if not (bn == 32 and nw == 8)  # 8 warps over a 32-key tile leave most threads idle
]
if interpreting():
    ATTENTION_CONFIGS = [triton.Config({"BLOCK_N": 16}, num_warps=4, num_stages=1)]


# --------------------------------------------------------------------------- arguments


def packed_dims(p: Packed, spec: QuantSpec, what: str) -> tuple[int, int, int, int]:
    """(B, H, T, D) of a packed segment, checking its layout."""
    c = p.codes
    if spec.full_precision:
        if c.dim() != 4:
            raise CacheError(f"{what}: a 16-bit segment must be [B, H, T, D], got {tuple(c.shape)}")
        return tuple(c.shape)
    if spec.axis == "channel":
        if c.dim() != 5 or c.shape[3] != spec.group_size * spec.bits // 8:
            raise CacheError(
                f"{what}: channel-packed codes must be [B, H, T//G, G*bits//8, D] with "
                f"G*bits//8={spec.group_size * spec.bits // 8}, got {tuple(c.shape)}"
            )
        b, h, n, _, d = c.shape
        t = n * spec.group_size
    else:
        if c.dim() != 4 or (c.shape[3] * 8) % spec.bits != 0:
            raise CacheError(f"{what}: token-packed codes must be [B, H, T, D*bits//8], got "
                             f"{tuple(c.shape)}")
        b, h, t, nb = c.shape
        d = nb * 8 // spec.bits
    want = (b, h, n, d) if spec.axis == "channel" else (b, h, t, d // spec.group_size)
    if d % spec.group_size and spec.axis == "token":
        raise CacheError(f"{what}: head_dim={d} is not a multiple of group_size={spec.group_size}")
    if spec.vq:
        # No zero point: [B, H, T, 0], never read (pages gathered by a block table keep
        # the pool's empty zero, so only its emptiness is checked).
        if tuple(p.scale.shape) != want or p.zero.numel():
            raise CacheError(f"{what}: vector-quantized values take scale {want} and an "
                             f"empty zero, got scale {tuple(p.scale.shape)} and zero "
                             f"{tuple(p.zero.shape)} for codes {tuple(c.shape)}")
        meta_ok = p.scale.dtype == torch.uint8 if spec.meta8 else p.scale.is_floating_point()
        if not meta_ok:
            raise CacheError(f"{what}: the scale of vector-quantized values is "
                             f"{'a uint8 index' if spec.meta8 else 'a float'} with "
                             f"meta_bits={spec.meta_bits}, got {p.scale.dtype}")
        return b, h, t, d
    if tuple(p.scale.shape) != want or tuple(p.zero.shape) != want:
        raise CacheError(f"{what}: scale {tuple(p.scale.shape)} and zero "
                         f"{tuple(p.zero.shape)} must both be {want} for codes {tuple(c.shape)}")
    if spec.meta8 and (p.scale.dtype != torch.uint8 or p.zero.dtype != torch.int8):
        raise CacheError(f"{what}: 8-bit metadata (meta_bits=8) is a uint8 scale index and an "
                         f"int8 zero point, got scale {p.scale.dtype} and zero {p.zero.dtype}")
    if not spec.meta8 and not (p.scale.is_floating_point() and p.zero.is_floating_point()):
        raise CacheError(f"{what}: 16-bit metadata is float scale and zero, got scale "
                         f"{p.scale.dtype} and zero {p.zero.dtype}; a segment packed with "
                         "meta_bits=8 needs its spec")
    return b, h, t, d


def kernel_strides(p: Packed, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor, tuple, tuple]:
    """(scale, zero, codes strides (b, h, 0, 1, 2), scale strides (b, h, 0, 1)).

    A plain (16-bit) tensor reads as codes with strides (b, h, token, channel) and no
    scale: the kernels' 16-bit path loads it as it is."""
    c = p.codes
    if spec.full_precision:
        return c, c, (c.stride(0), c.stride(1), c.stride(2), c.stride(3), 0), (0, 0, 0, 0)
    scale, zero = p.scale, p.zero
    if spec.vq:  # no zero point: the scale stands in for the pointer, never read
        zero = scale
    if scale.stride() != zero.stride():
        scale, zero = scale.contiguous(), zero.contiguous()
    cs = c.stride() if c.dim() == 5 else (*c.stride(), 0)
    return scale, zero, cs, scale.stride()


def inner_extent(t: torch.Tensor, first: int) -> int:
    """Largest element offset of ``t`` from dim ``first`` on (the kernel's int32 range)."""
    return sum((n - 1) * st for n, st in zip(t.shape[first:], t.stride()[first:], strict=True))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fast_layout(spec: QuantSpec, axis: str, d: int) -> bool:
    """Whether the byte-at-a-time path reads this tensor (see triton_dequant)."""
    return (
        not spec.vq and spec.axis == axis and spec.bits in (1, 2, 4, 8)
        and _pow2(spec.group_size)
        and (axis == "channel" or (_pow2(d) and spec.group_size <= d))
    )


def channel_blocks(rot_dim: int, dk: int, dv: int) -> dict[str, int]:
    """The channel tiles of a head: rotated pairs, pass-through channels, values (>= 16
    each: ``tl.dot`` needs tiles of at least 16)."""
    return dict(
        BLOCK_R=max(16, triton.next_power_of_2(max(rot_dim // 2, 1))),
        BLOCK_P=max(16, triton.next_power_of_2(max(dk - rot_dim, 1))),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
    )


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_splits(q: torch.Tensor, programs: int, tk: int) -> int:
    """Splits of a key axis: enough programs for two waves, >= 256 keys per split."""
    if q.device.type != "cuda":
        return 1
    # NOTE: not measured (no GPU when written): two waves of programs and at least 256
    # keys per split follow flash-decoding; bench/gpu_attention.py shows the result.
    want = triton.cdiv(2 * _sm_count(q.device.index or 0), max(programs, 1))
    return max(1, min(want, triton.cdiv(tk, 256)))


def plan_splits(
    q: torch.Tensor, programs: int, t: int, num_splits: int | None, align: int, what: str
) -> tuple[int, int]:
    """``(splits, split_len)`` of a segment of ``t`` keys: ``num_splits`` (default
    :func:`choose_splits`), each split but the last ``align`` keys long or a multiple of
    it (whole tiles of the smallest BLOCK_N, whole key groups), none empty."""
    splits = num_splits if num_splits is not None else choose_splits(q, programs, t)
    if splits < 1:
        raise CacheError(f"{what}={splits} must be >= 1")
    split_len = triton.cdiv(t, splits)
    if splits > 1:
        split_len = triton.cdiv(split_len, align) * align
    return triton.cdiv(t, split_len), split_len


def dots_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the kernels take IEEE fp32 dots (``DOT_F32``) for queries of ``dtype``.

    fp32 queries always; bf16 queries only under the interpreter: it runs bf16 arithmetic
    (``*``, ``+`` and ``tl.dot``) on the bit patterns (triton#11584), while its bf16 loads,
    stores and conversions are right. There every bf16 tile is widened to fp32 first, so
    the interpreter checks the bf16 loads and conversions; the compiled bf16 dots are
    checked by the sm_90 compile (tests) and on a GPU.
    """
    # NOTE: measured with triton 3.9's interpreter: bf16 a*b and a+b come out as
    # ~1e31-1e38 (or NaN), tl.dot of bf16 tiles off by ~1e10; .to(float32) is exact.
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


def rope_arguments(
    rope: RotarySpec, positions: torch.Tensor | None, b: int, t: int, dk: int,
    device: torch.device, *, check: bool, name: str, keys: str = "keys",
) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(style, rotary_dim, positions, cos, sin)`` on ``device`` for keys stored pre-RoPE.

    ``name`` is the positions argument (``k_positions``), ``keys`` the segment's keys, as
    the errors say them. ``check``: raise when a position falls outside the table; the
    only host sync here (two scalar reads), skipped when the caller has checked the
    positions itself.
    """
    if rope.style not in ("rotate_half", "interleaved"):
        raise CacheError(f"unknown rotary style {rope.style!r}; use rotate_half or interleaved")
    rot_dim, style = rope.rotary_dim, ROPE_STYLES[rope.style]
    if rot_dim % 2 != 0 or not 0 < rot_dim <= dk:
        raise CacheError(f"rotary_dim={rot_dim} must be even and in (0, head_dim={dk}]")
    if positions is None:
        raise CacheError(f"pre-RoPE {keys} need {name} [B, T] (T = {t} keys)")
    if tuple(positions.shape) != (b, t):
        raise CacheError(f"{name} must be [B, T] = {(b, t)}, got {tuple(positions.shape)}")
    if positions.dtype not in (torch.int64, torch.int32):
        raise CacheError(f"{name} must be int64 (or int32), got {positions.dtype}")
    if check and positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= rope.max_positions:
            raise CacheError(
                f"positions span [{lo}, {hi}] but the rotary table has "
                f"{rope.max_positions} rows; build the RotarySpec with more positions"
            )
    cos, sin = rope.cos.to(device), rope.sin.to(device)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return style, rot_dim, positions.to(device), cos, sin


def mask_arguments(
    mask: torch.Tensor, shape: tuple[int, int, int, int], device: torch.device
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """An additive mask as the kernels read it: expanded (a view) to ``shape`` =
    ``[B, Hq, Tq, Tk]``, and its strides (0 where broadcast)."""
    if not mask.is_floating_point():
        raise CacheError(f"mask must be an additive float mask (-inf hides), got {mask.dtype}")
    mask_t = mask.to(device)
    if mask_t.dim() > 4:
        raise CacheError(f"mask has {mask_t.dim()} dims; it must broadcast to [B,Hq,Tq,Tk]")
    mask_t = mask_t.reshape((1,) * (4 - mask_t.dim()) + tuple(mask_t.shape))
    try:
        mask_t = mask_t.expand(*shape)
    except RuntimeError as e:
        raise CacheError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to {tuple(shape)}"
        ) from e
    return mask_t, mask_t.stride()


# Tables already on a device: a decode step must not copy one from the host (a copy per
# layer and step, and no copy can happen inside a captured CUDA graph).
_TABLES: dict[tuple, torch.Tensor] = {}


def _device_table(kind: str, bits: int, values: tuple[float, ...],
                  device: torch.device) -> torch.Tensor:
    key = (kind, bits, torch.device(device))
    table = _TABLES.get(key)
    if table is None:
        table = torch.tensor(values, dtype=torch.float32, device=device)
        _TABLES[key] = table
    return table


def level_lut(spec: QuantSpec, device: torch.device) -> torch.Tensor | None:
    """The fp32 value of each code (``spec.table``) on ``device`` for non-uniform levels,
    cached per device and width; None for uniform levels and full precision, whose
    kernels take a code's value from the code itself (``K_LUT``/``V_LUT`` False)."""
    if spec.uniform:
        return None
    return _device_table(spec.levels, spec.bits, spec.table, device)


def threshold_table(bits: int, device: torch.device) -> torch.Tensor:
    """The fp32 thresholds of normal levels (:func:`kvpolicy.kernels.layout.thresholds`)
    on ``device``, cached per device and width."""
    return _device_table("thresholds", bits, thresholds(bits), device)


def meta_table(*specs: QuantSpec, device: torch.device) -> torch.Tensor | None:
    """The 256 fp32 scales an 8-bit scale index stands for
    (:func:`kvpolicy.kernels.layout.scale_table`) on ``device``, cached per device, when
    one of ``specs`` stores 8-bit metadata; None otherwise (``K_M8``/``V_M8``/``META8``
    False: the kernels read scale and zero as stored)."""
    if not any(spec.meta8 for spec in specs):
        return None
    return _device_table("scales", 8, scale_table(), device)


def width_table(spec: QuantSpec, device: torch.device) -> torch.Tensor | None:
    """Per-channel key widths (``spec.widths``) as the decode kernel reads them
    (:func:`kvpolicy.kernels.reference.width_table`); None without them (``K_WID``
    False)."""
    return None if spec.widths is None else reference.width_table(spec, device)


def vq_codebook(spec: QuantSpec, heads: int, device: torch.device) -> torch.Tensor | None:
    """The fp32 centroids ``[heads, 256, d]`` of vector-quantized values on ``device``
    (:meth:`kvpolicy.kernels.layout.Codebook.tensor`, built once per device, so a decode
    step copies nothing), checked against the segment's kv heads (the kernels index them
    by head); None for other specs (``V_VQ`` 0)."""
    if not spec.vq:
        return None
    assert spec.codebook is not None  # QuantSpec checks it
    if spec.codebook.heads != heads:
        raise CacheError(f"the values' codebook has centroids for {spec.codebook.heads} kv "
                         f"heads, the segment has {heads}")
    return spec.codebook.tensor(device)


def check_softcap(softcap: float | None) -> None:
    """``softcap`` is None (no cap) or positive."""
    if softcap is not None and not softcap > 0:
        raise CacheError(f"softcap={softcap} must be a positive float (or None: no cap)")
