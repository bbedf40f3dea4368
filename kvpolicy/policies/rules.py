"""The rules shared by the spec models and ``TensorPolicy``, so that one rule has one message.

The supported code widths and bit budgets, kvpolicy's own defaults, the axes and tensor
kinds, and the checks (bits, budget, byte alignment, group size dividing head_dim) that
raise a pydantic custom error carrying the field(s) it is about: ``PolicyError``
messages name that field, and ``build_policy`` blames the rule that set it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from ..kernels.layout import FULL_PRECISION, NORMAL_LEVELS, SUPPORTED_BITS, byte_aligned

# The widths recent tokens may be held at (runtime.recent.RESIDUAL_BITS; 16: full precision).
ResidualBits = Literal[16, 8, 4]
# A recent-window choice: (residual tokens, residual_bits), as a whole-cache budget weighs it.
WindowChoice = tuple[Annotated[int, Field(strict=True, ge=0)], ResidualBits]

# SUPPORTED_BITS and FULL_PRECISION (16: kept in full precision) are facts of the packed
# layout; they live in kernels.layout and are re-exported here.
# The widths a bit budget (a non-integer ``bits``) chooses from, one per tensor.
BUDGET_WIDTHS: tuple[int, ...] = (1, 2, 3, 4, 8)

# The group sizes a stored-bits budget chooses each tensor's group from (``group_size:
# auto``), where they fit: any of them groups tokens (axis 'channel'), and those dividing
# head_dim group channels (axis 'token'). Powers of two, which the kernels tile well;
# their scale and zero cost 1, 0.5 and 0.25 bits per element in fp16.
GROUP_CHOICES: tuple[int, ...] = (32, 64, 128)

# kvpolicy's own defaults (docs/design.md §1–§2): KIVI's group size and residual window,
# four sink tokens, keys quantized before RoPE wherever the key path has one.
KVPOLICY_DEFAULTS: dict[str, Any] = {
    "group_size": 32,
    "residual": 128,
    "sinks": 4,
    "pre_rope": True,
}


class Axis(str, Enum):
    """The axis along which scales vary (docs/design.md §1): one scale per index of this axis."""

    CHANNEL = "channel"  # per-channel scales; groups of G consecutive tokens of one channel
    TOKEN = "token"  # per-token scales; groups of G consecutive channels of one token

    def __str__(self) -> str:
        return self.value


class TensorKind(str, Enum):
    """Which cached tensor of an attention layer."""

    KEY = "key"
    VALUE = "value"

    def __str__(self) -> str:
        return self.value


class Frozen(BaseModel):
    """Base of every policy model: immutable, and unknown fields are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid")


# --------------------------------------------------------------------------- checks


# levels: auto (the default) is uniform levels without a budget; under one the calibration
# measures normal levels too and keeps them where they cost less (calibrate.apply). NOTE:
# SmolLM2 at 2 bits, normal keys with uniform values against uniform levels: perplexity
# 1.113x fp against 1.055x (kvpolicy eval, 4 pydoc segments, 768 + 128 tokens) but 1.015x
# against 1.092x on 2 other segments; KL to fp lower in all four runs measured (768 and
# 3,072 tokens); retrieval top-1 0.841x fp against 0.868x. Not a consistent win, so a
# fixed width keeps uniform levels; normal values were worse everywhere (1.267x).


# meta_bits: auto at a fixed width (no budget): the widths at which kvpolicy stores 8-bit
# scales and zeros in groups of half its default size, so that the stored bits stay what
# groups of the default size cost in fp16 (2 bits: 3.0 per element either way). NOTE:
# SmolLM2 at 2 bits, groups of 16 with 8-bit metadata against groups of 32 with fp16:
# KL to fp 0.081 against 0.104 (4 pydoc segments, 768 + 128), 0.056 against 0.079
# (typing.py), 0.103 against 0.166 (3,072 + 256); retrieval top-1 0.869x fp against
# 0.816x and 0.862x against 0.823x; perplexity 1.060x against 1.055x, 1.027x against
# 1.093x, 1.102x against 1.121x. Not measured at other widths, so they keep fp16.
META8_WIDTHS: frozenset[int] = frozenset({2})

# The groups of a tensor whose meta_bits auto became 8 at a fixed width (kvpolicy chose
# the group): the 3.0 stored bits per element of groups of 32 in fp16 are split toward the
# keys, which a recall of distant tokens depends on (2 bits on SmolLM2, retrieval of
# 2,048-token passages: keys at 4 bits kept 0.975x fp's top-1, values at 4 bits 0.814x,
# both at 2 bits 0.801x). Keys in groups of 12 tokens store 3.33 bits per element, values
# in groups of 32 channels 2.5, Hadamard-rotated where head_dim is a power of two
# (META8_ROTATE_VALUES): 2.92 on average. NOTE: against groups of 16 for both (3.0):
# perplexity x fp / KL / top-1 = fp 1.044 / 0.036 / 0.941 against 1.052 / 0.041 / 0.912
# (4 pydoc segments, 768 + 128), 1.011 / 0.028 / 0.914 against 1.035 / 0.035 / 0.902
# (2 segments, 3,072 + 256), 1.020 / 0.022 / 0.939 against 0.999 / 0.023 / 0.926
# (typing.py); retrieval 0.828x fp against 0.801x. Without the rotation: 1.041 / 0.039 /
# 0.932 and retrieval 0.800x on pydoc, 1.001 / 0.025 / 0.924 on typing.py.
META8_GROUPS: dict[TensorKind, int] = {TensorKind.KEY: 12, TensorKind.VALUE: 32}
META8_ROTATE_VALUES = True


def meta8_rotates_values(meta_setting: str | int, meta_bits: int, rotation_written: bool) -> bool:
    """Whether values take ``META8_ROTATE_VALUES``'s Hadamard rotation: their ``meta_bits:
    auto`` became 8 at a fixed width (``META8_GROUPS``) and nobody wrote a rotation. The
    rotation also needs a power-of-two head_dim, which the caller checks where it knows it."""
    return (META8_ROTATE_VALUES and meta_setting == "auto" and meta_bits == 8
            and not rotation_written)


def metadata_at(setting: str | int, bits: int, levels: str, default_group: bool,
                budget: bool = False) -> int:
    """The metadata width (16 or 8) a tensor at width ``bits`` stores under the setting
    ``meta_bits`` (16, 8 or auto), outside a stored-bits budget (whose allocator chooses).
    ``auto`` is 8 at ``META8_WIDTHS`` with uniform levels and kvpolicy's default group size
    (``default_group``: none was written), whose group is then :data:`META8_GROUPS`; 16
    otherwise, and under a code-bits ``budget`` (one width of metadata for every tensor it
    allocates)."""
    if setting != "auto":
        return int(setting)
    uniform = levels_at(levels, bits) == "uniform"
    return 8 if bits in META8_WIDTHS and uniform and default_group and not budget else 16


def fit_at(setting: str, key: bool, meta_bits: int | str) -> str:
    """How a tensor's 8-bit grid is fitted under the setting ``fit`` (minmax, mse or
    auto). ``auto`` is mse for keys whose metadata is, or may become, 8-bit (``meta_bits``
    8, or ``auto`` under a stored-bits budget, where the calibration measures the fitted
    grid and the fit applies only if the allocator chooses 8-bit metadata); minmax
    otherwise. See kernels.layout.FIT_STEPS for what it measured (mse values lost their
    extreme channels)."""
    if setting != "auto":
        return setting
    return "mse" if key and meta_bits in (8, "auto") else "minmax"


def levels_at(setting: str, bits: int) -> Literal["uniform", "normal"]:
    """The levels a tensor uses at ``bits`` under the setting ``setting`` (uniform, normal
    or auto: uniform unless a budget chose). A width without a normal table (8, 16 bits) is
    uniform."""
    if bits not in NORMAL_LEVELS:
        return "uniform"
    return "normal" if setting == "normal" else "uniform"


def invalid(field: str, message: str, *involved: str) -> PydanticCustomError:
    """A validation error that remembers which field(s) it is about.

    Model-level validators have no ``loc``; the context carries the field so that
    ``PolicyError`` messages can name it and ``build_policy`` can blame the rule that set it.
    """
    return PydanticCustomError(
        "kvpolicy",
        "{message}",
        {"message": message, "field": field, "involved": ",".join(involved or (field,))},
    )


def check_bits(bits: int, hint: str = "") -> None:
    """``bits`` is a supported width; ``hint`` ends the message (e.g. what a budget is)."""
    if bits not in SUPPORTED_BITS:
        supported = ", ".join(map(str, SUPPORTED_BITS))
        raise invalid(
            "bits",
            f"{bits} bits is not supported; use one of {supported} (16 = full precision){hint}",
        )


def check_bits_or_budget(bits: int | float) -> int | float:
    """A width (an int of SUPPORTED_BITS) or a budget (any float in [1, 16], so ``3.0`` is a
    budget that averages 3 bits while ``3`` is every tensor at 3 bits)."""
    if isinstance(bits, float):
        if not math.isfinite(bits):
            raise invalid("bits", f"bits={bits} is not a number of bits")
        if bits < BUDGET_WIDTHS[0] or bits > FULL_PRECISION:
            raise invalid(
                "bits",
                f"a bit budget of {bits} is outside [{BUDGET_WIDTHS[0]}, {FULL_PRECISION}]: "
                f"the smallest width is {BUDGET_WIDTHS[0]} bit and {FULL_PRECISION} is full "
                "precision; give an average between them, e.g. 2.5",
            )
        return bits
    check_bits(
        bits,
        f", or a float such as 2.5 or {float(bits)} for a budget: that average of code bits "
        "per element, spread over the tensors by measured sensitivity",
    )
    return bits


def check_stored_budget(stored: Any) -> float:
    """A stored-bits budget: a number in [1, 16], returned as a float (``3`` and ``3.0``
    alike: a stored budget is always a budget, never a width)."""
    if isinstance(stored, bool) or not isinstance(stored, (int, float)):
        raise invalid(
            "stored_bits",
            f"stored_bits={stored!r} is not a number; give the average stored bits per "
            "element, scales and zeros included, e.g. 3.0",
        )
    if not math.isfinite(stored) or not BUDGET_WIDTHS[0] <= stored <= FULL_PRECISION:
        raise invalid(
            "stored_bits",
            f"a stored-bits budget of {stored} is outside [{BUDGET_WIDTHS[0]}, "
            f"{FULL_PRECISION}]; give the average stored bits per element (codes plus a "
            "scale and a zero per group), e.g. 3.0",
        )
    return float(stored)


def check_group_setting(value: Any) -> int | str | tuple[int, ...]:
    """A ``group_size`` setting: a positive int (fixed), ``"auto"`` (a stored-bits budget
    chooses among :data:`GROUP_CHOICES`) or a list of candidates (it chooses among
    those), returned sorted without repeats."""
    choices = (
        "an int such as 32, 'auto' (a stored-bits budget chooses among "
        f"{list(GROUP_CHOICES)}) or a list of candidates such as [32, 64, 128]"
    )
    if isinstance(value, str):
        if value.strip() == "auto":
            return "auto"
        raise invalid("group_size", f"group_size {value!r}: give {choices}")
    if isinstance(value, (list, tuple)):
        if not value:
            raise invalid("group_size", f"the list of group sizes is empty; give {choices}")
        if any(isinstance(g, bool) or not isinstance(g, int) or g <= 0 for g in value):
            raise invalid(
                "group_size", f"group sizes {list(value)}: every candidate must be an int "
                "greater than 0"
            )
        return tuple(sorted(set(value)))
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid("group_size", f"group_size {value!r}: give {choices}")
    if value <= 0:
        raise invalid("group_size", f"group_size {value}: Input should be greater than 0")
    return value


def stored_bits(bits: int, group_size: int, scale_bits: int = 16, fields: int = 2) -> float:
    """Bits one cached element takes once packed: its code plus its share of one scale and
    one zero (``scale_bits`` each; ``fields=1``: a scale alone, vector-quantized values)
    per group of ``group_size``; 16 in full precision."""
    if bits >= FULL_PRECISION:
        return float(bits)
    return bits + fields * scale_bits / group_size


def is_budget(bits: int | float) -> bool:
    """True when ``bits`` is a budget (a float), not a width (an int)."""
    return isinstance(bits, float)


def join_or(items: Sequence[int]) -> str:
    """ "1, 2 or 3" for [1, 2, 3]."""
    words = [str(i) for i in items]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def check_byte_aligned(group_size: int, bits: int) -> None:
    """Every group must start on a byte boundary of the packed stream (kernels/layout.py)."""
    if byte_aligned(group_size, bits):
        return
    step = 8 // math.gcd(bits, 8)
    below = (group_size // step) * step
    choices = [g for g in (below, below + step) if g > 0]
    raise invalid(
        "group_size",
        f"group_size {group_size} with {bits} bits does not start every group on a byte "
        f"boundary (group_size*bits must be a multiple of 8); use {join_or(choices)}",
        "group_size",
        "bits",
    )


def token_group_sizes(head_dim: int, bits: int) -> list[int]:
    """Group sizes that tile head_dim with byte-aligned groups, ascending. Powers of two
    (what the kernels tile well: they pad a group to the next one) and head_dim itself come
    first; other divisors only where none of those fits."""
    ok = [
        d
        for d in range(1, head_dim + 1)
        if head_dim % d == 0 and byte_aligned(d, bits)
    ]
    return [d for d in ok if d & (d - 1) == 0 or d == head_dim] or ok


def fallback_group_size(group_size: int, head_dim: int, bits: int) -> int | None:
    """The size that replaces a default ``group_size`` that does not divide head_dim: the
    largest of ``token_group_sizes`` not above it; None if there is none."""
    return max((g for g in token_group_sizes(head_dim, bits) if g <= group_size), default=None)


def check_divides(group_size: int, head_dim: int, bits: int) -> None:
    """Axis 'token' groups G channels of one token, so G must divide head_dim."""
    if head_dim % group_size == 0:
        return
    preferred = token_group_sizes(head_dim, bits)
    below = [d for d in preferred if d < group_size][-1:]
    above = [d for d in preferred if d > group_size][:1]
    hint = f"; use {join_or(below + above)}" if below + above else ""
    raise invalid(
        "group_size",
        f"{group_size} does not divide head_dim={head_dim} (axis 'token' groups the channels "
        f"of one token){hint}",
        "group_size",
        "axis",
    )


def packed_bytes_per_element(bits: int, group_size: int, scale_bytes: int,
                             fields: int = 2) -> float:
    """Bytes one quantized element takes: its code plus its share of one scale and one
    zero (``scale_bytes`` each; ``fields=1``: a scale alone) per group of ``group_size``."""
    return bits / 8 + fields * scale_bytes / group_size
