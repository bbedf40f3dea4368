"""The packed KV-cache format: one contract shared by every backend.

A cached tensor has the Hugging Face layout ``[B, H, T, D]`` (batch, kv heads, tokens,
head_dim). Quantization is asymmetric per *group*, with one of two sets of levels
(``QuantSpec.levels``):

``"uniform"`` (the default): 2**bits evenly spaced levels from the group's min to its max

    zero  = min(group)                       stored in the cache dtype
    scale = (max(group) - min(group)) / (2**bits - 1)   stored in the cache dtype
    code  = clamp(round((x - zero) / scale), 0, 2**bits - 1)  (0 where scale == 0)

``"normal"``: the Lloyd-Max levels of a unit Gaussian (:data:`NORMAL_LEVELS`, minimum
mean squared error for normal data), placed by the group's mean and standard deviation

    zero  = mean(group)                      stored in the cache dtype
    scale = sqrt(mean((group - mean)**2))    stored in the cache dtype
    code  = number of thresholds t_i < (x - zero) / scale   (0 where scale == 0)
            (t_i: the midpoints between neighbouring levels, :func:`thresholds`)

and in both cases the same dequantization, through the width's table of level values
(:func:`level_table`: ``0, 1, ..., 2**bits - 1`` for uniform levels)

    x̂     = table[code] * scale + zero

Codes are computed against the *stored* (rounded) scale and zero so that dequantization
reproduces exactly what the quantizer assumed. The metadata is the same two numbers per
group either way, so the stored bytes do not depend on the levels.

Metadata width (``QuantSpec.meta_bits``, uniform levels only at 8): 16 stores scale and
zero in the cache dtype, as above. 8 stores each in one byte

    scale index  uint8  i = the smallest i with SCALE_TABLE[i] >= (max - min) / (2**bits - 1)
                        (:func:`scale_table`: 2**((i - 128) / 8), steps of 9%)
    zero point   int8   p = round(4 * -min / scale),  zero = -p * scale / 4
    code  = clamp(round((x - zero) / scale), 0, 2**bits - 1)

so the grid is at most one 9% step coarser than the fp16 one, and its zero sits on a
quarter of the step (:data:`ZERO_STEPS`; the rounding moves the grid by at most an eighth
of a step, which the clamp absorbs at the ends). Where the zero point would not fit an
int8 the scale widens until it does (``|min| <= 127 / 4 * scale``), so every group is
representable: only a group far from zero relative to its spread pays a coarser step.
At 2 bits and groups of 16 this is 2 + 16/16 = 3.0 stored bits, what groups of 32 cost
in fp16.

Fit (``QuantSpec.fit``, 8-bit metadata only): ``minmax`` is the grid above. ``mse`` also
tries the :data:`FIT_STEPS` table scales below that one, each with its grid centred on the
group's midrange (``p = round(4 * -(mid - (2**bits - 1) * scale / 2) / scale)``, clamped
to an int8), and keeps the candidate with the least squared error over the group (the
first on a tie, the min-max grid first): the grid clips the group's extremes where that
costs less than the coarser steps. The stored format and every decoder are unchanged.

Two layouts, named by the axis along which the scales vary (docs/design.md §1):

``Axis "channel"`` (keys: contracted over channels -> one scale per channel)
    groups are G consecutive tokens of one channel.
    codes  uint8 [B, H, T // G, G * bits // 8, D]   (the G codes of one channel form a
                                                       bit stream along dim 3; D innermost
                                                       so that a block of channels loads
                                                       contiguously)
    scale  [B, H, T // G, D]
    zero   [B, H, T // G, D]

``Axis "token"`` (values: contracted over tokens -> one scale per token)
    groups are G consecutive channels of one token.
    codes  uint8 [B, H, T, D * bits // 8]            (the D codes of one token form a bit
                                                       stream; group j is bytes
                                                       [j*G*bits//8, (j+1)*G*bits//8))
    scale  [B, H, T, D // G]
    zero   [B, H, T, D // G]

Bit order: element i of a stream occupies bits ``[i*bits, (i+1)*bits)`` of the stream,
counted from the least significant bit of byte 0 (little-endian). 3-bit codes therefore
straddle byte boundaries: 32 codes take 12 bytes, no padding to 4 bits.
``G * bits`` must be a multiple of 8 so that every group starts on a byte boundary
(:func:`byte_aligned`).

``bits == 16`` means "kept in full precision": the segment is stored as the plain tensor.

Per-channel widths (``QuantSpec.widths``; axis "channel", uniform levels): channel ``d``
of kv head ``h`` takes ``widths[h][d]`` bits (:data:`CHANNEL_WIDTHS`), each head's widths
summing to ``bits * D``, so a group holds as many bytes as at the uniform width and the
shapes above do not change. Only the order inside a group differs: the
``G * bits // 8 * D`` bytes of one group (the last two dims, in memory order) are one bit
stream in which channel ``d``'s G codes follow each other, token ``t``'s code at bit
``G * off[h][d] + t * widths[h][d]`` with ``off[h][d] = sum(widths[h][:d])``
(:func:`channel_offsets`). Scale and zero are per group and channel as above, with
``2**widths[h][d] - 1`` steps. A key is contracted over channels, so its error in channel
``d`` costs about ``E[q_d²] · step_d²``: the widths follow where the queries look.

Vector-quantized values (``QuantSpec.levels == "vq"``; axis "token" only, values). Each
group of G channels of one token is split into sub-vectors of ``d = 8 // bits`` channels
(:func:`vq_dim`: 4 at 2 bits, 8 at 1 bit), and each sub-vector is one byte, an index into
:data:`VQ_ENTRIES` centroids of ``d`` channels learned per kv head (:class:`Codebook`,
stored in fp16). One scale per group, no zero:

    r     = sqrt(mean(group**2))                       (0: every code 0, scale 0)
    code  = argmin_k |group[j*d:(j+1)*d] / r - C[h, k]|**2   (the first k on a tie)
    c     = concat_j C[h, code_j]                      the group's centroids, fp32
    scale = max(<group, c> / <c, c>, 0)                (least squares; 0 where <c, c> = 0)
            stored in the cache dtype, or (8-bit metadata) as the uint8 index of the
            nearest :func:`scale_table` entry (log-nearest: i = round(8 * log2(scale)) + 128;
            a zero scale is index 0, 2**-16, so an all-zero group decodes to within
            2**-16 * |C[h, 0]| of zero)
    x̂     = C[h, code_j][i] * scale                   (fp32 product, cast at the end)

    codes  uint8 [B, H, T, D // d]     = D * bits // 8 bytes, the token layout's shape
    scale  [B, H, T, D // G]
    zero   [B, H, T, 0]                 (empty: a VQ group has no zero point)

``G`` must be a multiple of ``d``. The centroids cost ``H * 256 * d * 2`` bytes per layer
whatever the context, which the whole-cache accounting counts.

This module is the one home of these facts (:data:`SUPPORTED_BITS`, :data:`FULL_PRECISION`,
:func:`byte_aligned`). It imports torch only for type checking, so the policy schema can
import them without loading torch.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Literal, NamedTuple

from ..errors import CacheError

if TYPE_CHECKING:
    import torch

__all__ = [
    "SUPPORTED_BITS", "FULL_PRECISION", "LEVELS", "NORMAL_LEVELS", "META_BITS", "ZERO_STEPS",
    "CHANNEL_WIDTHS", "channel_offsets", "byte_aligned", "level_table", "thresholds",
    "scale_table", "QuantSpec", "Packed", "RotarySpec", "VQ_BITS", "VQ_ENTRIES", "vq_dim",
    "Codebook",
]

# The code widths the packed layout supports; 16 means "kept in full precision".
SUPPORTED_BITS: tuple[int, ...] = (1, 2, 3, 4, 8, 16)
FULL_PRECISION = 16


# The widths one key channel may take under per-channel widths (QuantSpec.widths).
CHANNEL_WIDTHS: tuple[int, ...] = (1, 2, 3, 4)


def channel_offsets(widths: tuple[int, ...]) -> tuple[int, ...]:
    """Where each channel's codes start in a group's stream, in units of G bits: the
    running sum of ``widths`` before it (per-channel widths, module docstring)."""
    out, acc = [], 0
    for w in widths:
        out.append(acc)
        acc += w
    return tuple(out)


def byte_aligned(n: int, bits: int) -> bool:
    """Whether ``n`` codes of ``bits`` bits fill whole bytes, i.e. a group of ``n`` codes
    starts every following group on a byte boundary (always true in full precision)."""
    return bits >= FULL_PRECISION or (n * bits) % 8 == 0

AxisName = Literal["channel", "token"]
LevelsName = Literal["uniform", "normal", "vq"]
LEVELS: tuple[str, ...] = ("uniform", "normal", "vq")

# Vector-quantized values (module docstring): widths in bits per element, one byte index per
# sub-vector of 8 // bits channels into VQ_ENTRIES centroids.
VQ_BITS: tuple[int, ...] = (1, 2)
VQ_ENTRIES = 256


def vq_dim(bits: int) -> int:
    """Channels per vector-quantized sub-vector at ``bits`` bits per element: ``8 // bits``
    (one byte index each)."""
    return 8 // bits


@dataclass(frozen=True)
class Codebook:
    """The centroids of vector-quantized values (module docstring): fp16, little-endian,
    ``[heads, VQ_ENTRIES, dim]`` in ``data``. Hashable and compared by content, so a
    :class:`QuantSpec` holding one stays a value; :meth:`tensor` gives the fp32 tensor the
    kernels read, built once per device."""

    heads: int
    dim: int
    data: bytes

    def __post_init__(self) -> None:
        if self.heads < 1 or self.dim < 1:
            raise CacheError(f"a codebook needs heads >= 1 and dim >= 1, got "
                             f"{self.heads} and {self.dim}")
        if len(self.data) != self.heads * VQ_ENTRIES * self.dim * 2:
            raise CacheError(
                f"a codebook of {self.heads} heads x {VQ_ENTRIES} centroids x {self.dim} "
                f"channels holds {self.heads * VQ_ENTRIES * self.dim * 2} bytes of fp16, "
                f"got {len(self.data)}"
            )

    @property
    def nbytes(self) -> int:
        """Bytes the centroids take (fp16), per layer whatever the context."""
        return len(self.data)

    @classmethod
    def from_tensor(cls, centroids: torch.Tensor) -> Codebook:
        """The codebook of ``centroids [heads, VQ_ENTRIES, dim]`` (rounded to fp16)."""
        import torch

        if centroids.dim() != 3 or centroids.shape[1] != VQ_ENTRIES:
            raise CacheError(f"centroids must be [heads, {VQ_ENTRIES}, dim], got "
                             f"{tuple(centroids.shape)}")
        c = centroids.detach().to("cpu", torch.float16).contiguous()
        if not torch.isfinite(c).all():
            raise CacheError("codebook centroids must be finite in fp16")
        return cls(c.shape[0], c.shape[2], c.view(torch.uint8).numpy().tobytes())

    def tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The centroids as fp32 ``[heads, VQ_ENTRIES, dim]`` on ``device`` (cached: a
        pointer into it stays valid)."""
        return _codebook_tensor(self, str(device))


@cache
def _codebook_tensor(book: Codebook, device: str) -> torch.Tensor:
    import torch

    raw = torch.frombuffer(bytearray(book.data), dtype=torch.float16)
    return raw.float().reshape(book.heads, VQ_ENTRIES, book.dim).to(device).contiguous()

# Lloyd-Max quantizer of N(0, 1), 2**bits levels: each level the mean of the normal
# density between its thresholds (Lloyd's iteration to 1e-13, rounded to 6 digits).
NORMAL_LEVELS: dict[int, tuple[float, ...]] = {
    1: (-0.797885, 0.797885),
    2: (-1.510418, -0.45278, 0.45278, 1.510418),
    3: (-2.151946, -1.343909, -0.756005, -0.245094, 0.245094, 0.756005, 1.343909, 2.151946),
    4: (-2.73259, -2.069017, -1.618046, -1.256231, -0.94234, -0.656759, -0.388048,
        -0.128395, 0.128395, 0.388048, 0.656759, 0.94234, 1.256231, 1.618046, 2.069017,
        2.73259),
}


def level_table(bits: int, levels: str = "uniform") -> tuple[float, ...]:
    """The value of each code in units of its group's scale above its zero:
    ``0, 1, ..., 2**bits - 1`` for uniform levels, :data:`NORMAL_LEVELS` for normal ones."""
    if levels == "normal":
        return NORMAL_LEVELS[bits]
    return tuple(float(c) for c in range(1 << bits))


def thresholds(bits: int) -> tuple[float, ...]:
    """The ``2**bits - 1`` decision thresholds of normal levels: the midpoints between
    neighbouring levels, rounded to fp32 (a code counts the thresholds below its input)."""
    table = NORMAL_LEVELS[bits]
    mids = ((table[i] + table[i + 1]) / 2 for i in range(len(table) - 1))
    return tuple(struct.unpack("f", struct.pack("f", m))[0] for m in mids)


# Widths of the stored scale and zero: 16 (the cache dtype) or 8 (one byte each).
META_BITS: tuple[int, ...] = (16, 8)
# Scale index i stands for 2**((i - _SCALE_BIAS) / _SCALE_STEPS): 2**-16 .. 2**15.875.
_SCALE_STEPS, _SCALE_BIAS = 8, 128
# An 8-bit zero point counts quarters of the scale: zero = -p * scale / ZERO_STEPS. NOTE:
# SmolLM2, 2 bits, groups of 16, 4 pydoc segments (768 + 128): whole steps 1.101x fp
# perplexity, KL 0.087, retrieval 0.845x fp; quarter steps 1.062x, KL 0.081, 0.869x
# (fp16 metadata in groups of 32: 1.055x, 0.104, 0.816x). Relative MSE of the keys 0.82 ->
# 0.76 of fp16 metadata in groups of 32; halves 0.78, eighths 0.76.
ZERO_STEPS = 4
# Fits of a group's grid (QuantSpec.fit) and the scale-table steps below the min-max scale
# that "mse" tries. NOTE: SmolLM2, 2 bits, groups of 16, 8-bit metadata, 4 pydoc segments
# (768 + 128): "mse" keys 1.052x fp perplexity, KL 0.041, top-1 = fp 0.912, retrieval
# 0.877x fp; min-max 1.060x, 0.081, 0.852, 0.872x; "mse" keys and values 1.079x, 0.052,
# 0.902, 0.869x (values lose their extreme channels).
FITS: tuple[str, ...] = ("minmax", "mse")
FIT_STEPS = 3


@cache
def scale_table() -> tuple[float, ...]:
    """The 256 scales an 8-bit scale index stands for, ``2**((i - 128) / 8)`` rounded to
    fp32, increasing: every backend reads a scale from this one table, so all agree.
    Computed once (the torch backend reads it on every pack and unpack)."""
    return tuple(
        struct.unpack("f", struct.pack("f", 2.0 ** ((i - _SCALE_BIAS) / _SCALE_STEPS)))[0]
        for i in range(256)
    )


@dataclass(frozen=True)
class QuantSpec:
    """How one cached tensor is quantized: code width, group size, scale axis, levels and
    the width of its stored scale and zero."""

    bits: int
    group_size: int
    axis: AxisName
    levels: LevelsName = "uniform"
    meta_bits: int = 16
    fit: str = "minmax"
    # Per kv head, per channel code widths (module docstring); None: ``bits`` everywhere.
    widths: tuple[tuple[int, ...], ...] | None = None
    # The centroids of vector-quantized values (levels "vq"; module docstring).
    codebook: Codebook | None = None

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise CacheError(f"bits={self.bits} is not supported; use one of {SUPPORTED_BITS}")
        if self.axis not in ("channel", "token"):
            raise CacheError(f"axis={self.axis!r} is not 'channel' or 'token'")
        if self.levels not in LEVELS:
            raise CacheError(f"levels={self.levels!r} is not one of {LEVELS}")
        if self.levels == "normal" and self.bits not in NORMAL_LEVELS and not self.full_precision:
            raise CacheError(
                f"levels='normal' has tables for bits {tuple(NORMAL_LEVELS)}, not "
                f"bits={self.bits}; use levels='uniform' at {self.bits} bits"
            )
        if self.meta_bits not in META_BITS:
            raise CacheError(
                f"meta_bits={self.meta_bits} is not supported; use one of {META_BITS}"
            )
        if self.levels == "vq" and not self.full_precision:
            self._check_vq()
        elif self.codebook is not None:
            raise CacheError("a codebook is for levels='vq'; drop it or set levels='vq'")
        if self.meta_bits == 8 and self.levels == "normal" and not self.full_precision:
            raise CacheError(
                "meta_bits=8 stores a zero point on the uniform grid, which normal levels do "
                "not have; use levels='uniform' with meta_bits=8, or meta_bits=16"
            )
        if self.fit not in FITS:
            raise CacheError(f"fit={self.fit!r} is not one of {FITS}")
        if self.fit == "mse" and self.meta_bits != 8 and not self.full_precision:
            raise CacheError(
                "fit='mse' searches the 8-bit scale table; use meta_bits=8 with it, or "
                "fit='minmax'"
            )
        if self.group_size < 1:
            raise CacheError(f"group_size={self.group_size} must be a positive integer")
        if self.widths is not None:
            self._check_widths()
        if not byte_aligned(self.group_size, self.bits):
            ok = [g for g in (8, 16, 32, 64, 128) if byte_aligned(g, self.bits)]
            raise CacheError(
                f"group_size={self.group_size} with bits={self.bits} does not start every "
                f"group on a byte boundary (group_size*bits must be a multiple of 8); "
                f"use one of {ok}"
            )

    def _check_vq(self) -> None:
        if self.axis != "token" or self.bits not in VQ_BITS:
            raise CacheError(
                f"levels='vq' codes sub-vectors of one token's channels (values, "
                f"axis='token') at bits {VQ_BITS}, got axis={self.axis!r}, bits={self.bits}; "
                "use levels='uniform' here"
            )
        d = vq_dim(self.bits)
        if self.group_size % d:
            raise CacheError(f"levels='vq' at {self.bits} bits codes sub-vectors of {d} "
                             f"channels; group_size={self.group_size} is not a multiple "
                             f"of {d}")
        if self.codebook is None:
            raise CacheError("levels='vq' needs its codebook (calibrated centroids); "
                             "compile the policy with calibration text to fit one")
        if self.codebook.dim != d:
            raise CacheError(f"the codebook's centroids have {self.codebook.dim} channels, "
                             f"levels='vq' at {self.bits} bits needs {d}")
        if self.fit != "minmax":
            raise CacheError("fit='mse' fits a uniform grid; use fit='minmax' with "
                             "levels='vq'")

    def _check_widths(self) -> None:
        if self.axis != "channel" or self.levels != "uniform" or self.full_precision:
            raise CacheError(
                "per-channel widths are for keys grouped per channel (axis='channel') with "
                f"uniform levels, got axis={self.axis!r}, levels={self.levels!r}, "
                f"bits={self.bits}; drop widths or use axis='channel', levels='uniform'"
            )
        rows = self.widths or ()
        if not rows or len({len(r) for r in rows}) != 1:
            raise CacheError("widths needs one row of per-channel widths per kv head, all "
                             "of the same length (head_dim)")
        for h, row in enumerate(rows):
            bad = sorted({w for w in row if w not in CHANNEL_WIDTHS})
            if bad:
                raise CacheError(f"widths of head {h} has {bad}; per-channel widths are "
                                 f"among {CHANNEL_WIDTHS}")
            if sum(row) != self.bits * len(row):
                raise CacheError(
                    f"widths of head {h} sum to {sum(row)}, not bits * head_dim = "
                    f"{self.bits * len(row)}: every head must keep the bytes of the uniform "
                    "width so that the packed shapes do not change"
                )

    @property
    def full_precision(self) -> bool:
        return self.bits == FULL_PRECISION

    @property
    def uniform(self) -> bool:
        """Evenly spaced levels: a code's value is the code itself (no table lookup)."""
        return self.levels == "uniform" or self.full_precision

    @property
    def vq(self) -> bool:
        """Vector-quantized (levels "vq", quantized): codes index :attr:`codebook`."""
        return self.levels == "vq" and not self.full_precision

    @property
    def vq_dim(self) -> int:
        """Channels per sub-vector of a vector-quantized spec (:func:`vq_dim`)."""
        return vq_dim(self.bits)

    @property
    def meta8(self) -> bool:
        """Scale and zero stored in one byte each (uint8 scale index, int8 zero point)."""
        return self.meta_bits == 8 and not self.full_precision

    @property
    def table(self) -> tuple[float, ...]:
        """The value of each code, in units of the scale (:func:`level_table`)."""
        return level_table(self.bits, self.levels)

    @property
    def token_group(self) -> int:
        """Tokens that must arrive before they can be packed (G for 'channel', else 1)."""
        return self.group_size if (self.axis == "channel" and not self.full_precision) else 1


class Packed(NamedTuple):
    """One packed segment of a cached tensor (see the module docstring for shapes).

    For a full-precision (16-bit) segment ``codes`` is the plain ``[B, H, T, D]`` tensor
    and ``scale``/``zero`` are empty tensors.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


@dataclass(frozen=True, eq=False)
class RotarySpec:
    """A rotary embedding re-applied to pre-RoPE keys after dequantization.

    ``cos``/``sin`` are tables indexed by the keys' stored positions, ``[P, rotary_dim]``
    (absolute positions; or rows of a table of the rows the model gave, for rotations the
    cache cannot recompute, ``runtime.rotary``), in the layout the model itself multiplies
    with (for ``rotate_half``: ``cat(f, f)``; for ``interleaved``:
    ``repeat_interleave(f, 2)``), already multiplied by any attention scaling. Every RoPE
    variant whose angles depend only on the position fits (linear, NTK, YaRN, Llama-3
    scaling). Channels ``>= rotary_dim`` pass through (partial rotary).

    rotate_half:  out[:r] = x[:r] * cos + cat(-x[r/2:r], x[:r/2]) * sin
    interleaved:  pairs (x[2i], x[2i+1]) -> (x0*cos - x1*sin, x1*cos + x0*sin)
    """

    style: Literal["rotate_half", "interleaved"]
    rotary_dim: int
    cos: torch.Tensor  # [P, rotary_dim]
    sin: torch.Tensor  # [P, rotary_dim]
    # The position of row 0 (a step's rows for layers that hold no earlier token,
    # runtime.rotary): the kernels index rows, so a caller holding positions passes
    # ``rows_of(positions)``.
    offset: int = 0

    @property
    def max_positions(self) -> int:
        """Rows in the table (positions ``offset .. offset + max_positions - 1``)."""
        return self.cos.shape[0]

    def rows_of(self, positions: torch.Tensor) -> torch.Tensor:
        """The rows of ``positions`` (positions less :attr:`offset`)."""
        return positions - self.offset if self.offset else positions
