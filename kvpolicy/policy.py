"""Compression policy: the schema, the user's spec, and derivation from analysis facts.

Three layers, each a frozen pydantic v2 model:

``TensorPolicy`` / ``ModelPolicy``
    The result: how every cached tensor of every attention layer is quantized, with the
    analysis behind it (``derived_axis``, ``derived_pre_rope``, ``contraction``, ``rope``)
    and a sentence a user can read (``reason``). Renders as a table, round-trips through
    YAML and JSON.
``PolicySpec`` (``Defaults`` + ``OverrideRule``)
    What a user asks for: a preset name, a YAML file or a dict, loaded by ``load_spec``.
``build_policy(facts, spec)``
    Derives each tensor's policy from the facts of ``kvpolicy.passes`` (DESIGN.md §1–§2),
    then applies the overrides in order. A value that differs from what was derived is
    kept, marked ``overridden`` and explained.

Every problem a user can cause raises ``PolicyError`` naming the source (file path,
``<dict>`` or preset name), where in it (``defaults``, ``rule N`` counted from 1) and
the field. Nothing falls back silently: the one fallback, a smaller per-token group where
the built-in group size does not divide head_dim, is written in the tensor's reason.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from enum import Enum
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .errors import PolicyError
from .facts import Contracted, LayerFacts, TensorFacts

__all__ = [
    "SUPPORTED_BITS",
    "BUDGET_WIDTHS",
    "Axis",
    "Calibration",
    "LayerSensitivity",
    "TensorKind",
    "TensorPolicy",
    "ModelPolicy",
    "Defaults",
    "OverrideRule",
    "PolicySpec",
    "list_presets",
    "load_spec",
    "build_policy",
]

# The code widths the packed layout supports; 16 means "kept in full precision".
# Same tuple as kernels.layout.SUPPORTED_BITS (a test keeps them equal); not imported from
# there because that module pulls in torch and the CLI wants a fast `--help`.
SUPPORTED_BITS: tuple[int, ...] = (1, 2, 3, 4, 8, 16)
FULL_PRECISION = 16
# The widths a bit budget (a non-integer ``bits``) chooses from, one per tensor.
BUDGET_WIDTHS: tuple[int, ...] = (1, 2, 3, 4, 8)

# kvpolicy's own defaults (DESIGN.md §1–§2): KIVI's group size and residual window, four
# sink tokens, keys quantized before RoPE wherever the key path has one.
_KVPOLICY_DEFAULTS: dict[str, Any] = {
    "group_size": 32,
    "residual": 128,
    "sinks": 4,
    "pre_rope": True,
}

_SPEC_KEYS = ("version", "defaults", "overrides", "calibration")


class Axis(str, Enum):
    """The axis along which scales vary (DESIGN.md §1): one scale per index of this axis."""

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


# A contracted axis gets its own scale per index; groups form along the free axis.
_AXIS_OF: dict[Contracted, Axis] = {Contracted.CHANNEL: Axis.CHANNEL, Contracted.TOKEN: Axis.TOKEN}
# How the attention consumes each tensor, for reasons a user reads.
_CONSUMER: dict[TensorKind, str] = {TensorKind.KEY: "q·kᵀ", TensorKind.VALUE: "softmax·V"}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# --------------------------------------------------------------------------- checks
# Shared by the spec models and TensorPolicy so that one rule has one message.


def _invalid(field: str, message: str, *involved: str) -> PydanticCustomError:
    """A validation error that remembers which field(s) it is about.

    Model-level validators have no ``loc``; the context carries the field so that
    ``PolicyError`` messages can name it and ``build_policy`` can blame the rule that set it.
    """
    return PydanticCustomError(
        "kvpolicy",
        "{message}",
        {"message": message, "field": field, "involved": ",".join(involved or (field,))},
    )


def _check_bits(bits: int, hint: str = "") -> None:
    """``bits`` is a supported width; ``hint`` ends the message (e.g. what a budget is)."""
    if bits not in SUPPORTED_BITS:
        supported = ", ".join(map(str, SUPPORTED_BITS))
        raise _invalid(
            "bits",
            f"{bits} bits is not supported; use one of {supported} (16 = full precision){hint}",
        )


def _check_bits_or_budget(bits: int | float) -> int | float:
    """A width (an int of SUPPORTED_BITS) or a budget (any float in [1, 16], so ``3.0`` is a
    budget that averages 3 bits while ``3`` is every tensor at 3 bits)."""
    if isinstance(bits, float):
        if not math.isfinite(bits):
            raise _invalid("bits", f"bits={bits} is not a number of bits")
        if bits < BUDGET_WIDTHS[0] or bits > FULL_PRECISION:
            raise _invalid(
                "bits",
                f"a bit budget of {bits} is outside [{BUDGET_WIDTHS[0]}, {FULL_PRECISION}]: "
                f"the smallest width is {BUDGET_WIDTHS[0]} bit and {FULL_PRECISION} is full "
                "precision; give an average between them, e.g. 2.5",
            )
        return bits
    _check_bits(
        bits,
        f", or a float such as 2.5 or {float(bits)} for a budget: that average of code bits "
        "per element, spread over the tensors by measured sensitivity",
    )
    return bits


def is_budget(bits: int | float) -> bool:
    """True when ``bits`` is a budget (a float), not a width (an int)."""
    return isinstance(bits, float)


def _join_or(items: Sequence[int]) -> str:
    words = [str(i) for i in items]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _check_byte_aligned(group_size: int, bits: int) -> None:
    """Every group must start on a byte boundary of the packed stream (kernels/layout.py)."""
    if bits >= FULL_PRECISION or (group_size * bits) % 8 == 0:
        return
    step = 8 // math.gcd(bits, 8)
    below = (group_size // step) * step
    choices = [g for g in (below, below + step) if g > 0]
    raise _invalid(
        "group_size",
        f"group_size {group_size} with {bits} bits does not start every group on a byte "
        f"boundary (group_size*bits must be a multiple of 8); use {_join_or(choices)}",
        "group_size",
        "bits",
    )


def _token_group_sizes(head_dim: int, bits: int) -> list[int]:
    """Group sizes that tile head_dim with byte-aligned groups, ascending. Powers of two
    (what the kernels tile well: they pad a group to the next one) and head_dim itself come
    first; other divisors only where none of those fits."""
    ok = [
        d
        for d in range(1, head_dim + 1)
        if head_dim % d == 0 and (bits >= FULL_PRECISION or (d * bits) % 8 == 0)
    ]
    return [d for d in ok if d & (d - 1) == 0 or d == head_dim] or ok


def _fallback_group_size(group_size: int, head_dim: int, bits: int) -> int | None:
    """The size that replaces a default ``group_size`` that does not divide head_dim: the
    largest of ``_token_group_sizes`` not above it; None if there is none."""
    return max((g for g in _token_group_sizes(head_dim, bits) if g <= group_size), default=None)


def _check_divides(group_size: int, head_dim: int, bits: int) -> None:
    """Axis 'token' groups G channels of one token, so G must divide head_dim."""
    if head_dim % group_size == 0:
        return
    preferred = _token_group_sizes(head_dim, bits)
    below = [d for d in preferred if d < group_size][-1:]
    above = [d for d in preferred if d > group_size][:1]
    hint = f"; use {_join_or(below + above)}" if below + above else ""
    raise _invalid(
        "group_size",
        f"{group_size} does not divide head_dim={head_dim} (axis 'token' groups the channels "
        f"of one token){hint}",
        "group_size",
        "axis",
    )


# --------------------------------------------------------------------------- calibration


class LayerSensitivity(_Frozen):
    """Measured consumed error of one layer's key and value at each candidate width.

    ``key[i]`` / ``value[i]``: the error at ``Calibration.widths[i]`` when only that tensor
    is quantized (None: the width does not fit the tensor's group size).
    """

    layer: StrictInt = Field(ge=0)
    key: tuple[Union[float, None], ...]
    value: tuple[Union[float, None], ...]


class Calibration(_Frozen):
    """The sensitivity table a bit budget is allocated from (``kvpolicy.budget.calibrate``).

    One currency for both tensors (``metric``; ``kvpolicy.budget.CALIBRATION_METRICS``):
    what the change of the attention block's output costs when one tensor of one layer is
    quantized at one width and everything else is exact; by default the squared
    first-order change of the calibration text's loss, ``Σ_t (∂L/∂o_t · Δo_t)²``. Keys act
    through the scores and the softmax, values through the weighted sum.

    ``settings`` fingerprints what the errors depend on besides the width (per tensor:
    axis, group size, pre-RoPE, residual, sinks; see ``ModelPolicy.calibration_key``), so a
    saved table is refused once those change.
    """

    metric: StrictStr = "loss-weighted attention-output error"
    model: StrictStr = ""
    source: StrictStr  # which tokens: "pydoc text, last 512 tokens" or "user token ids"
    tokens: StrictInt = Field(gt=0)  # per row
    rows: StrictInt = Field(default=1, gt=0)
    seconds: float = Field(default=0.0, ge=0)
    settings: StrictStr
    widths: tuple[StrictInt, ...] = Field(min_length=1)
    layers: tuple[LayerSensitivity, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _shapes(self) -> Calibration:
        for w in self.widths:
            if w not in BUDGET_WIDTHS:
                raise _invalid("widths", f"width {w} is not one of {BUDGET_WIDTHS}")
        for ls in self.layers:
            if len(ls.key) != len(self.widths) or len(ls.value) != len(self.widths):
                raise _invalid(
                    "layers",
                    f"layer {ls.layer}: {len(ls.key)} key and {len(ls.value)} value errors for "
                    f"{len(self.widths)} widths",
                )
        return self

    def errors(self, layer: int, tensor: TensorKind | str) -> dict[int, float]:
        """``{width: error}`` of one tensor, feasible widths only; KeyError if not measured."""
        kind = TensorKind(tensor)
        for ls in self.layers:
            if ls.layer == layer:
                row = ls.key if kind is TensorKind.KEY else ls.value
                return {w: e for w, e in zip(self.widths, row, strict=True) if e is not None}
        raise KeyError(f"layer {layer} is not in this calibration")


# --------------------------------------------------------------------------- result


def packed_bytes_per_element(bits: int, group_size: int, scale_bytes: int) -> float:
    """Bytes one quantized element takes: its code plus its share of one scale and one
    zero (``scale_bytes`` each) per group of ``group_size``."""
    return bits / 8 + 2 * scale_bytes / group_size


class TensorPolicy(_Frozen):
    """How one cached tensor (key or value) of one attention layer is quantized."""

    layer: StrictInt = Field(ge=0)
    tensor: TensorKind
    axis: Axis
    bits: StrictInt
    group_size: StrictInt = Field(gt=0)
    pre_rope: StrictBool  # keys cached before the rotation; RoPE re-applied after dequant
    residual: StrictInt = Field(ge=0)  # most recent tokens kept in full precision
    sinks: StrictInt = Field(ge=0)  # first tokens kept in full precision
    head_dim: StrictInt = Field(gt=0)
    num_kv_heads: StrictInt = Field(default=1, gt=0)  # cached heads: elements = heads*head_dim
    contraction: StrictStr  # e.g. "q·kᵀ over head_dim=64 (scaled_dot_product_attention)"
    rope: StrictStr | None = None  # e.g. "rotate_half 64/64"; None: no RoPE on this path
    rope_style: StrictStr | None = None
    rotary_dim: StrictInt | None = Field(default=None, gt=0)
    derived_axis: Axis  # what the analysis derived, kept so a reason survives an override
    derived_pre_rope: StrictBool
    overridden: StrictBool = False
    # Who chose ``bits``: the defaults (a width), an override rule, or a bit budget's
    # allocator (from the measured sensitivity in ``ModelPolicy.calibration``).
    bits_from: Literal["defaults", "rule", "budget"] = "defaults"
    reason: StrictStr

    @field_validator("bits")
    @classmethod
    def _bits_supported(cls, bits: int) -> int:
        _check_bits(bits)
        return bits

    @model_validator(mode="after")
    def _consistent(self) -> TensorPolicy:
        rope_fields = (self.rope, self.rope_style, self.rotary_dim)
        if any(f is None for f in rope_fields) and any(f is not None for f in rope_fields):
            raise _invalid("rope", "rope, rope_style and rotary_dim are set together or not at all")
        if self.rotary_dim is not None and self.rotary_dim > self.head_dim:
            raise _invalid(
                "rotary_dim", f"rotary_dim={self.rotary_dim} exceeds head_dim={self.head_dim}"
            )
        if self.tensor is TensorKind.VALUE and self.rope is not None:
            raise _invalid("rope", "values are never rotated; rope must be null for a value")
        if self.pre_rope and self.rope is None:
            if self.tensor is TensorKind.VALUE:
                msg = "values are never rotated, so pre_rope applies to keys only; use tensor: key"
            else:
                msg = (
                    "no RoPE was found on this layer's key path, so there is nothing to "
                    "quantize before; drop pre_rope or restrict 'layers' to layers with RoPE"
                )
            raise _invalid("pre_rope", msg)
        if self.derived_pre_rope and self.rope is None:
            raise _invalid("derived_pre_rope", "derived_pre_rope is true but rope is null")
        if self.bits < FULL_PRECISION:
            _check_byte_aligned(self.group_size, self.bits)
            if self.axis is Axis.TOKEN:
                _check_divides(self.group_size, self.head_dim, self.bits)
        return self

    @property
    def full_precision(self) -> bool:
        """True when the tensor is stored unquantized (``bits == 16``)."""
        return self.bits == FULL_PRECISION

    @property
    def pinned_full_precision(self) -> bool:
        """A rule keeps this tensor at 16 bits: a budget does not allocate it, and the cache
        takes it token by token, so its layer's other tensor packs token by token too."""
        return self.bits_from == "rule" and self.full_precision

    @property
    def elements_per_token(self) -> int:
        return self.num_kv_heads * self.head_dim

    def bytes_per_token(self, scale_bytes: int = 2) -> float:
        """Bytes one token of this tensor takes once packed: codes plus a scale and a zero
        per group (``scale_bytes`` each; fp16 by default), or 2 bytes per element at 16 bits.
        The full-precision sink and residual windows are not counted."""
        if self.full_precision:
            return 2.0 * self.elements_per_token
        return self.elements_per_token * packed_bytes_per_element(
            self.bits, self.group_size, scale_bytes
        )


class ModelPolicy(_Frozen):
    """The policy of every cached tensor of a model, in layer order (key, then value)."""

    version: Literal[1] = 1
    model: StrictStr = ""
    source: StrictStr = ""  # the spec it was built from: preset name, file path or "<dict>"
    tensors: tuple[TensorPolicy, ...] = Field(min_length=1)
    # A bit budget (average code bits per cached element) and the measured sensitivity it
    # was allocated from; None for uniform widths.
    budget: float | None = None
    calibration: Calibration | None = None

    @model_validator(mode="after")
    def _layer_order(self) -> ModelPolicy:
        if len(self.tensors) % 2:
            raise _invalid("tensors", "expected a key and a value for every layer")
        previous = -1
        for i in range(0, len(self.tensors), 2):
            key, value = self.tensors[i], self.tensors[i + 1]
            if key.tensor is not TensorKind.KEY or value.tensor is not TensorKind.VALUE:
                raise _invalid("tensor", f"tensors[{i}:{i + 2}] must be a key then a value")
            if key.layer != value.layer or key.layer <= previous:
                raise _invalid(
                    "layer",
                    f"tensors[{i}:{i + 2}] (layers {key.layer}, {value.layer}) break the "
                    "order: layers increase, each with its key then its value",
                )
            previous = key.layer
            for name in ("residual", "sinks"):
                k, v = getattr(key, name), getattr(value, name)
                if k != v:
                    raise PydanticCustomError(
                        "kvpolicy",
                        "{message}",
                        {
                            "message": (
                                f"layer {key.layer}: key has {name} {k} but value has {v}; key "
                                "and value of a layer must share residual and sinks because "
                                "the cache keeps one segmentation (sinks | quantized | "
                                "residual window) per layer; set it with tensor: '*'"
                            ),
                            "field": name,
                            "involved": name,
                            "layer": key.layer,
                        },
                    )
        return self

    @property
    def layers(self) -> tuple[int, ...]:
        """Indices of the attention layers, increasing."""
        return tuple(t.layer for t in self.tensors[::2])

    @property
    def num_layers(self) -> int:
        return len(self.tensors) // 2

    @property
    def avg_bits(self) -> float:
        """Code bits per cached element over all layers and both tensors, weighted by each
        tensor's elements per token (16 for full-precision tensors).

        Scales, zeros and the full-precision residual/sink windows are not counted: this is
        the width of the quantized body, what the ``bits`` settings (and a budget) buy.
        """
        total = sum(t.elements_per_token for t in self.tensors)
        return sum(t.bits * t.elements_per_token for t in self.tensors) / total

    def bytes_per_token(self, scale_bytes: int = 2) -> float:
        """Bytes one packed token takes over all layers, scales and zeros counted (see
        ``TensorPolicy.bytes_per_token``)."""
        return sum(t.bytes_per_token(scale_bytes) for t in self.tensors)

    @property
    def fp16_bytes_per_token(self) -> int:
        """Bytes one token takes in an fp16 cache, for comparison."""
        return 2 * sum(t.elements_per_token for t in self.tensors)

    def calibration_key(self) -> str:
        """A fingerprint of everything a measured sensitivity depends on except the widths:
        the model name and, per tensor, layer, axis, group size, pre-RoPE, residual, sinks,
        and whether a rule pins it at full precision (the cache then packs the layer's
        other tensor token by token)."""
        parts = [self.model] + [
            f"{t.layer}{t.tensor.value[0]}:{t.axis.value}:{t.group_size}:{int(t.pre_rope)}:"
            f"{t.residual}:{t.sinks}:{t.num_kv_heads}x{t.head_dim}"
            + (":fp" if t.pinned_full_precision else "")
            for t in self.tensors
        ]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    def get(self, layer: int, tensor: TensorKind | str) -> TensorPolicy:
        """The policy of one tensor; ``KeyError`` if the layer has no attention here."""
        kind = TensorKind(tensor)
        offset = 0 if kind is TensorKind.KEY else 1
        # Fast path: layers 0..n-1 in order (every dense model).
        i = 2 * layer + offset
        if 0 <= i < len(self.tensors) and self.tensors[i].layer == layer:
            return self.tensors[i]
        for t in self.tensors[offset::2]:
            if t.layer == layer:
                return t
        raise KeyError(f"layer {layer} is not in this policy (layers {_ranges(self.layers)})")

    def __str__(self) -> str:
        return _render_table(self)

    def to_yaml(self) -> str:
        # A very wide line width keeps each reason on one line.
        return yaml.safe_dump(
            self.model_dump(mode="json"), sort_keys=False, allow_unicode=True, width=1 << 16
        )

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_yaml(cls, text_or_path: str | Path) -> ModelPolicy:
        """Load from YAML text or a file path; validated by the schema, never patched up."""
        text, source = _text_or_file(text_or_path, "<yaml>")
        return _validate_model_policy(_parse_yaml(text, source), source)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> ModelPolicy:
        """Load from JSON text or a file path; validated by the schema."""
        text, source = _text_or_file(text_or_path, "<json>")
        if not text.strip():
            raise PolicyError(f"{source}: empty policy")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PolicyError(
                f"{source}: cannot parse JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
            ) from None
        return _validate_model_policy(data, source)


def _validate_model_policy(data: Any, source: str) -> ModelPolicy:
    if not isinstance(data, Mapping):
        raise PolicyError(
            f"{source}: expected a mapping with 'version', 'model', 'source' and 'tensors', "
            f"got {type(data).__name__}"
        )
    try:
        return ModelPolicy.model_validate(data)
    except ValidationError as exc:
        raise _translate(exc, source, _model_policy_where(data), ModelPolicy) from None


def _model_policy_where(data: Mapping[str, Any]):
    def where(loc: tuple[Any, ...]) -> tuple[str | None, Any, type[BaseModel]]:
        if len(loc) >= 2 and loc[0] == "tensors" and isinstance(loc[1], int):
            label = f"tensors[{loc[1]}]"
            items = data.get("tensors")
            item = items[loc[1]] if isinstance(items, Sequence) and loc[1] < len(items) else None
            if isinstance(item, Mapping) and "layer" in item and "tensor" in item:
                label += f" (layer {item['layer']} {item['tensor']})"
            return label, loc[2] if len(loc) > 2 else None, TensorPolicy
        return None, loc[0] if loc else None, ModelPolicy

    return where


# --------------------------------------------------------------------------- table


def _ranges(layers: Sequence[int]) -> str:
    """ "0-3, 5, 7-9" for [0, 1, 2, 3, 5, 7, 8, 9]."""
    parts: list[str] = []
    start = prev = None
    for layer in layers:
        if prev is not None and layer == prev + 1:
            prev = layer
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = layer
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ", ".join(parts)


_COLUMNS = ("layers", "tensor", "axis", "bits", "G", "pre-RoPE", "R", "sinks", "override")


def _row(label: str, t: TensorPolicy) -> list[str]:
    if t.rope is None:
        pre_rope = "-"  # nothing rotates this tensor
    else:
        pre_rope = "yes" if t.pre_rope else "no"
    return [
        label,
        t.tensor.value,
        t.axis.value,
        str(t.bits),
        str(t.group_size),
        pre_rope,
        str(t.residual),
        str(t.sinks),
        "yes" if t.overridden else "-",
        t.contraction,
        t.reason,
    ]


def _render_table(policy: ModelPolicy) -> str:
    """An aligned table, one row per tensor. Consecutive layers whose key and value
    policies are identical in every field but ``layer`` share one row pair ("0-29")."""
    groups: list[tuple[list[int], TensorPolicy, TensorPolicy]] = []
    for i in range(0, len(policy.tensors), 2):
        key, value = policy.tensors[i], policy.tensors[i + 1]
        sig = (key.model_copy(update={"layer": 0}), value.model_copy(update={"layer": 0}))
        if groups:
            layers, k0, v0 = groups[-1]
            same = (k0.model_copy(update={"layer": 0}), v0.model_copy(update={"layer": 0}))
            if layers[-1] + 1 == key.layer and sig == same:
                layers.append(key.layer)
                continue
        groups.append(([key.layer], key, value))

    header = [*_COLUMNS, "contraction", "reason"]
    rows = [header]
    for layers, key, value in groups:
        label = _ranges(layers)
        rows.append(_row(label, key))
        rows.append(_row(label, value))
    widths = [max(len(r[c]) for r in rows) for c in range(len(header) - 1)]

    def line(cells: list[str]) -> str:
        padded = [c.ljust(w) for c, w in zip(cells[:-1], widths, strict=True)]
        return "  ".join([*padded, cells[-1]]).rstrip()

    name = policy.model or "<model>"
    source = f", policy {policy.source}" if policy.source else ""
    title = (
        f"kvpolicy: {name}{source}: {policy.num_layers} attention layers, "
        f"{policy.avg_bits:.2f} code bits per element on average"
    )
    rule = "  ".join("-" * w for w in widths) + "  " + "-" * len("reason")
    return "\n".join([title, line(header), rule, *(line(r) for r in rows[1:]), rule,
                      _footer(policy)])


def _footer(policy: ModelPolicy) -> str:
    """Achieved average bits (against the budget, if any) and bytes per token vs fp16."""
    packed, fp16 = policy.bytes_per_token(), policy.fp16_bytes_per_token
    text = f"average {policy.avg_bits:.3f} code bits per cached element"
    if policy.budget is not None:
        text += f" (budget {policy.budget:g}"
        if policy.calibration is not None:
            cal = policy.calibration
            text += (
                f"; widths allocated from the {cal.metric} measured on {cal.source}, "
                f"{cal.rows}x{cal.tokens} tokens"
            )
        text += ")"
    return (
        f"{text}; {packed:,.0f} bytes per packed token vs {fp16:,} in fp16 "
        f"({fp16 / packed:.2f}x smaller; fp16 scales and zeros counted, the full-precision "
        "sink and residual windows not)"
    )


# --------------------------------------------------------------------------- spec


_SETTABLE = ("bits", "group_size", "axis", "pre_rope", "residual", "sinks")

LayerSelector = Union[StrictInt, StrictStr, tuple[Union[StrictInt, StrictStr], ...]]


def _parse_range(text: str) -> tuple[int, int] | None:
    a, sep, b = text.replace(" ", "").partition("-")
    if not sep and a.isdigit():
        return int(a), int(a)
    if sep and a.isdigit() and b.isdigit():
        return int(a), int(b)
    return None


def _layers_error(message: str) -> PydanticCustomError:
    return _invalid("layers", f'{message}; write an int, a list of ints, a range "a-b" or "*"')


def _normalize_selector(value: Any) -> int | str | tuple[int | str, ...]:
    if isinstance(value, bool):
        raise _layers_error(f"got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise _layers_error(f"layer {value} is negative (layers count from 0)")
        return value
    if isinstance(value, str):
        if value.strip() == "*":
            return "*"
        bounds = _parse_range(value)
        if bounds is None:
            raise _layers_error(f"cannot read {value!r}")
        a, b = bounds
        if a > b:
            raise _layers_error(f"range {value!r} runs backwards")
        return a if a == b else f"{a}-{b}"
    if isinstance(value, (list, tuple)):
        if not value:
            raise _layers_error("the list is empty")
        items = []
        for item in value:
            if isinstance(item, str) and item.strip() == "*":
                raise _layers_error("'*' cannot be inside a list")
            if not isinstance(item, (int, str)) or isinstance(item, bool):
                raise _layers_error(f"list item {item!r} is not a layer")
            items.append(_normalize_selector(item))
        return tuple(items)
    raise _layers_error(f"got a {type(value).__name__}")


class Defaults(_Frozen):
    """Settings for every tensor before the overrides; the derived axis unless ``axis``.

    A ``group_size`` that was not given (not in ``model_fields_set``; presets count as not
    given) is the built-in default: where a tensor's axis is ``token`` and it does not
    divide head_dim, ``build_policy`` uses the largest byte-aligned divisor below it (a
    power of two or head_dim itself where one fits) and says so in the reason. A given one
    that does not divide is an error.
    """

    # A width from SUPPORTED_BITS, or a float budget: the average code bits per cached
    # element, spread over the tensors by measured sensitivity (kvpolicy.budget).
    bits: Union[StrictInt, StrictFloat] = 2
    group_size: StrictInt = Field(default=_KVPOLICY_DEFAULTS["group_size"], gt=0)
    residual: StrictInt = Field(default=_KVPOLICY_DEFAULTS["residual"], ge=0)
    sinks: StrictInt = Field(default=_KVPOLICY_DEFAULTS["sinks"], ge=0)
    # True means "pre-RoPE where RoPE exists": a layer without RoPE is not an error here.
    pre_rope: StrictBool = _KVPOLICY_DEFAULTS["pre_rope"]
    # None: the derived axis. Set, it applies to keys and values alike and counts as an
    # override wherever it differs from the derived one.
    axis: Axis | None = None

    @field_validator("bits")
    @classmethod
    def _bits_supported(cls, bits: int | float) -> int | float:
        return _check_bits_or_budget(bits)

    @model_validator(mode="after")
    def _aligned(self) -> Defaults:
        if not is_budget(self.bits):  # a budget's widths are checked per tensor
            _check_byte_aligned(self.group_size, self.bits)
        return self


class OverrideRule(_Frozen):
    """One override: which layers and tensors, and the fields it sets (None: not set)."""

    layers: LayerSelector
    tensor: Literal["key", "value", "*"]
    bits: StrictInt | None = None
    group_size: StrictInt | None = Field(default=None, gt=0)
    axis: Axis | None = None
    pre_rope: StrictBool | None = None
    residual: StrictInt | None = Field(default=None, ge=0)
    sinks: StrictInt | None = Field(default=None, ge=0)

    @field_validator("layers", mode="before")
    @classmethod
    def _selector(cls, value: Any) -> int | str | tuple[int | str, ...]:
        return _normalize_selector(value)

    @field_validator("bits")
    @classmethod
    def _bits_supported(cls, bits: int | None) -> int | None:
        if bits is not None:
            _check_bits(bits)
        return bits

    @model_validator(mode="after")
    def _sets_something(self) -> OverrideRule:
        if not self.settings():
            raise _invalid(
                "layers",
                f"the rule selects layers and a tensor but sets nothing; set one of "
                f"{', '.join(_SETTABLE)}",
            )
        if self.bits is not None and self.group_size is not None:
            _check_byte_aligned(self.group_size, self.bits)
        return self

    def settings(self) -> dict[str, Any]:
        """The fields this rule sets, in a fixed order."""
        return {f: getattr(self, f) for f in _SETTABLE if getattr(self, f) is not None}

    def kinds(self) -> tuple[TensorKind, ...]:
        if self.tensor == "*":
            return (TensorKind.KEY, TensorKind.VALUE)
        return (TensorKind(self.tensor),)

    def select(self, layer_ids: Sequence[int]) -> list[int]:
        """The layers of ``layer_ids`` this rule applies to; ``ValueError`` (with a message
        that gives the model's layers) when it names a layer the model does not have."""
        present = set(layer_ids)
        described = _describe_layers(layer_ids)
        if self.layers == "*":
            return list(layer_ids)
        items = self.layers if isinstance(self.layers, tuple) else (self.layers,)
        chosen: set[int] = set()
        for item in items:
            if isinstance(item, int):
                if item not in present:
                    raise ValueError(f"layer {item} is out of range; {described}")
                chosen.add(item)
                continue
            a, b = _parse_range(item) or (0, -1)
            if b > max(layer_ids):
                raise ValueError(f"range {item!r} reaches layer {b}, out of range; {described}")
            hits = [layer for layer in layer_ids if a <= layer <= b]
            if not hits:
                raise ValueError(f"range {item!r} selects no attention layer; {described}")
            chosen.update(hits)
        return [layer for layer in layer_ids if layer in chosen]


def _describe_layers(layer_ids: Sequence[int]) -> str:
    n = len(layer_ids)
    if list(layer_ids) == list(range(n)):
        return f"the model has {n} layers (0-{n - 1})"
    return f"the model has {n} attention layers ({_ranges(layer_ids)})"


class PolicySpec(_Frozen):
    """A user's policy request: defaults for every tensor plus ordered override rules, and
    for a bit budget optionally the measured sensitivity to allocate it from."""

    version: Literal[1] = 1
    source: StrictStr = "<dict>"  # for messages: file path, "<dict>" or preset name
    defaults: Defaults = Field(default_factory=Defaults)
    overrides: tuple[OverrideRule, ...] = ()
    calibration: Calibration | None = None

    @property
    def budget(self) -> float | None:
        """The average-bit budget when ``defaults.bits`` is one, else None."""
        return self.defaults.bits if is_budget(self.defaults.bits) else None

    def to_yaml(self) -> str:
        """This spec as a policy file: the defaults that were given, the overrides, and the
        calibration if any (so that compiling from the file skips calibrating)."""
        given = self.defaults.model_fields_set | {"bits"}
        defaults = self.defaults.model_dump(mode="json", include=given)
        doc: dict[str, Any] = {
            "version": self.version,
            "defaults": {k: v for k, v in defaults.items() if v is not None},
        }
        if self.overrides:
            doc["overrides"] = [
                r.model_dump(mode="json", exclude_none=True) for r in self.overrides
            ]
        if self.calibration is not None:
            doc["calibration"] = self.calibration.model_dump(mode="json")
        # Flow style for lists of scalars: one line per tensor of the calibration table.
        return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=1 << 16,
                              default_flow_style=None)


# --------------------------------------------------------------------------- loading


def _presets_dir():
    return resources.files("kvpolicy").joinpath("policies")


def list_presets() -> tuple[str, ...]:
    """Names of the presets shipped in ``kvpolicy/policies/``."""
    return tuple(
        sorted(
            p.name[: -len(".yaml")] for p in _presets_dir().iterdir() if p.name.endswith(".yaml")
        )
    )


def _suggest(name: str, valid: Iterable[str]) -> str:
    valid = list(valid)
    close = difflib.get_close_matches(str(name), valid, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{hint}valid: {', '.join(valid)}"


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys: PyYAML would keep the last one silently."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            first = seen.get(key)
        except TypeError:  # unhashable key: construct_mapping reports it properly
            continue
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first set on line {first + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def _parse_yaml(text: str, source: str) -> Any:
    if not text.strip():
        raise PolicyError(f"{source}: empty policy file")
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
    except yaml.MarkedYAMLError as exc:
        raise PolicyError(f"{source}: cannot parse YAML {_yaml_problem(exc, text)}") from None
    except yaml.YAMLError as exc:
        raise PolicyError(f"{source}: cannot parse YAML: {exc}") from None
    if data is None:  # only comments
        raise PolicyError(f"{source}: empty policy file (nothing but comments)")
    return data


def _yaml_problem(exc: yaml.MarkedYAMLError, text: str) -> str:
    """Where the parser stopped and why, quoting the line (and the line of the construct it
    was reading, e.g. an unclosed bracket, when that is elsewhere)."""
    lines = text.splitlines()

    def quote(mark: Any) -> str:
        shown = lines[mark.line].strip() if mark.line < len(lines) else ""
        return f"line {mark.line + 1}, column {mark.column + 1}" + (f": {shown!r}" if shown else "")

    mark = exc.problem_mark or exc.context_mark
    if mark is None:
        return f": {exc.problem or exc.context or exc}"
    message = f"at {quote(mark)}: {exc.problem or exc.context}"
    if exc.context and exc.context_mark is not None and exc.context_mark.line != mark.line:
        message += f" ({exc.context} started at {quote(exc.context_mark)})"
    return message


def _read_file(path: Path) -> str:
    if not path.exists():
        presets = list_presets()
        close = difflib.get_close_matches(path.name, presets, n=1)
        hint = f"did you mean the preset '{close[0]}'? " if close else ""
        raise PolicyError(
            f"{path}: policy file not found; {hint}give a path to a YAML file or a preset "
            f"name ({', '.join(presets)})"
        )
    if path.is_dir():
        raise PolicyError(f"{path}: is a directory, not a policy file")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"{path}: cannot read the policy file: {exc}") from None


def _text_or_file(text_or_path: str | Path, label: str) -> tuple[str, str]:
    """Text itself, or the contents of a file. A ``str`` on one line that does not start
    a flow mapping is a path; serialized policies span many lines."""
    if isinstance(text_or_path, Path):
        return _read_file(text_or_path), str(text_or_path)
    if not isinstance(text_or_path, str):
        raise PolicyError(f"expected YAML/JSON text or a path, got {type(text_or_path).__name__}")
    one_line = "\n" not in text_or_path.strip()
    if one_line and text_or_path.strip() and not text_or_path.lstrip().startswith("{"):
        return _read_file(Path(text_or_path)), text_or_path
    return text_or_path, label


def _bits_argument(bits: Any) -> int | float:
    """Validate a ``bits=`` argument: a supported width or a float budget."""
    if isinstance(bits, bool) or not isinstance(bits, (int, float)):
        raise PolicyError(
            f"bits={bits!r} is not a number; use one of {', '.join(map(str, SUPPORTED_BITS))} "
            "or a float budget such as 2.5"
        )
    try:
        return _check_bits_or_budget(float(bits) if isinstance(bits, float) else int(bits))
    except PydanticCustomError as exc:
        raise PolicyError(f"bits={bits!r}: {exc.message()}") from None


def load_spec(
    policy: str | Path | Mapping[str, Any] | PolicySpec | None = None, bits: int | float = 2
) -> PolicySpec:
    """Turn what a user passed as ``policy=`` into a validated ``PolicySpec``.

    Args:
        policy: ``None`` (the ``kvpolicy-<bits>`` defaults), a preset name from
            ``list_presets()``, a path to a YAML file (``str`` or ``Path``), a dict of the
            same form, or a ``PolicySpec`` (returned as is).
        bits: code width for ``policy=None``; with a file or dict, the ``kvpolicy-<bits>``
            defaults are the base that the document's ``defaults`` are layered over. A float
            (``2.5``, also ``3.0``) is a budget: the average code bits per cached element,
            allocated per tensor from measured sensitivity (``kvpolicy.budget``); an int
            is one width for every tensor.

    Raises:
        PolicyError: naming the source, ``defaults`` or ``rule N``, and the field.
    """
    if isinstance(policy, PolicySpec):
        return policy
    bits = _bits_argument(bits)
    presets = list_presets()
    if policy is None:
        name = f"kvpolicy-{bits}"
        if name in presets:
            return load_spec(name, bits)
        return PolicySpec(source=name, defaults=Defaults(bits=bits))
    if isinstance(policy, Mapping):
        return _spec_from_document(policy, "<dict>", bits)
    if isinstance(policy, str) and policy in presets:
        text = _presets_dir().joinpath(f"{policy}.yaml").read_text(encoding="utf-8")
        return _spec_from_document(_parse_yaml(text, policy), policy, bits, builtin=True)
    if isinstance(policy, (str, Path)):
        path = Path(policy)
        return _spec_from_document(_parse_yaml(_read_file(path), str(policy)), str(policy), bits)
    raise PolicyError(
        f"policy must be a preset name ({', '.join(presets)}), a path to a YAML file, a dict "
        f"or a PolicySpec, not {type(policy).__name__}"
    )


def _spec_from_document(
    doc: Any, source: str, bits: int | float, builtin: bool = False
) -> PolicySpec:
    """Validate a parsed document. ``builtin``: a shipped preset, whose defaults count as
    kvpolicy's own rather than written by the user (see ``Defaults``)."""
    if not isinstance(doc, Mapping):
        raise PolicyError(
            f"{source}: the top level must be a mapping with 'defaults' and/or 'overrides', "
            f"not a {type(doc).__name__}"
        )
    if not doc:
        raise PolicyError(
            f"{source}: empty policy; give 'defaults' and/or 'overrides' "
            "(or policy=None for the kvpolicy defaults)"
        )
    for key in doc:
        if key not in _SPEC_KEYS:
            hint = ""
            if key == "tensors":
                hint = (
                    " (this is a full ModelPolicy as written by `kvpolicy inspect --format "
                    "yaml`; load it with ModelPolicy.from_yaml)"
                )
            raise PolicyError(
                f"{source}, top level, field '{key}': unknown key; {_suggest(key, _SPEC_KEYS)}"
                f"{hint}"
            )
    raw_defaults = doc.get("defaults", {})
    if not isinstance(raw_defaults, Mapping):
        raise PolicyError(
            f"{source}, defaults: expected a mapping of {', '.join(Defaults.model_fields)}, "
            f"got {_show(raw_defaults)}"
        )
    payload: dict[str, Any] = {
        "source": source,
        # Fields left out take Defaults' own (kvpolicy's) values and stay out of
        # model_fields_set, which is how build_policy tells a written group_size.
        "defaults": {"bits": bits, **raw_defaults},
        "overrides": doc.get("overrides", ()),
    }
    if "version" in doc:
        payload["version"] = doc["version"]
    if doc.get("calibration") is not None:
        payload["calibration"] = doc["calibration"]
    try:
        spec = PolicySpec.model_validate(payload)
    except ValidationError as exc:
        raise _translate(exc, source, _spec_where, PolicySpec) from None
    if builtin:
        # Same validated values, none of them marked as given by the user.
        unset = Defaults.model_construct(_fields_set=set(), **spec.defaults.model_dump())
        spec = spec.model_copy(update={"defaults": unset})
    return spec


def _spec_where(loc: tuple[Any, ...]) -> tuple[str | None, Any, type[BaseModel]]:
    if loc and loc[0] == "defaults":
        return "defaults", loc[1] if len(loc) > 1 else None, Defaults
    if loc and loc[0] == "overrides" and len(loc) > 1 and isinstance(loc[1], int):
        return f"rule {loc[1] + 1}", loc[2] if len(loc) > 2 else None, OverrideRule
    if loc and loc[0] == "calibration":
        return "calibration", ".".join(map(str, loc[1:])) or None, Calibration
    return "top level", loc[0] if loc else None, PolicySpec


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _translate(exc: ValidationError, source: str, where_of, root: type[BaseModel]) -> PolicyError:
    """Pydantic's errors as "source, where, field 'x': what is wrong" lines."""
    lines = []
    for err in exc.errors(include_url=False):
        where, field, model = where_of(tuple(err["loc"]))
        ctx = err.get("ctx") or {}
        if field is None:
            field = ctx.get("field")
        kind = err["type"]
        if kind == "extra_forbidden":
            message = f"unknown field; {_suggest(field, model.model_fields)}"
        elif kind == "missing":
            message = "required field is missing"
        elif kind == "kvpolicy":
            message = err["msg"]
        elif kind in ("model_type", "dict_type"):
            message = f"expected a mapping of fields (got {_show(err['input'])})"
        else:
            message = (
                err["msg"].replace("a valid tuple", "a list") + f" (got {_show(err['input'])})"
            )
        parts = [source] + ([where] if where else []) + ([f"field '{field}'"] if field else [])
        lines.append(f"{', '.join(parts)}: {message}")
    return PolicyError("\n".join(lines))


# --------------------------------------------------------------------------- derivation

_ANALYSIS, _DEFAULTS = -2, -1  # origins of a value; rules are 0, 1, ... (later wins)


def _sets(origin: int) -> str:
    return "the defaults set" if origin == _DEFAULTS else f"rule {origin + 1} sets"


def _where(origin: int) -> str:
    if origin == _ANALYSIS:
        return "analysis"
    return "defaults" if origin == _DEFAULTS else f"rule {origin + 1}"


def _groups(axis: Axis, group_size: int) -> str:
    if axis is Axis.CHANNEL:
        return f"each channel gets its own scale (groups of {group_size} tokens)"
    return f"each token gets its own scale (groups of {group_size} channels)"


def _rope_text(facts: TensorFacts) -> tuple[str | None, str | None, int | None, str]:
    """(short rope text, style, rotary_dim, phrase for reasons)."""
    rope = facts.rope
    if rope is None:
        return None, None, None, ""
    style = rope.style.value
    phrase = f"{style} RoPE"
    if rope.partial:
        phrase += f" on {rope.rotary_dim} of {rope.head_dim} channels"
    return f"{style} {rope.rotary_dim}/{rope.head_dim}", style, rope.rotary_dim, phrase


def _reason(
    kind: TensorKind,
    facts: TensorFacts,
    values: Mapping[str, Any],
    origins: Mapping[str, int],
    derived_axis: Axis,
    derived_pre_rope: bool,
    defaults: Defaults,
    fallback_from: int | None = None,
) -> str:
    op = _CONSUMER[kind]
    summed = "channels" if facts.contracted is Contracted.CHANNEL else "tokens"
    axis, group_size = values["axis"], values["group_size"]
    parts: list[str] = []
    if values["bits"] == FULL_PRECISION:
        parts.append(f"kept in full precision, so no scales or groups ({op} sums over {summed})")
    elif axis is derived_axis:
        parts.append(f"{op} sums over {summed}, so {_groups(axis, group_size)}")
    else:
        parts.append(
            f"{op} sums over {summed}, so per-{derived_axis.value} scales were derived, but "
            f"{_sets(origins['axis'])} axis {axis.value}: {_groups(axis, group_size)}"
        )
    if kind is TensorKind.KEY:
        phrase = _rope_text(facts)[3]
        stored = "cached" if values["bits"] == FULL_PRECISION else "quantized"
        if facts.rope is None:
            parts.append(
                "no RoPE on the key path (learned, absolute or no positions): nothing to move"
            )
        elif values["pre_rope"]:
            parts.append(
                f"{stored} before {phrase}, which smears outlier channels; RoPE is re-applied "
                "inside attention"
            )
        elif derived_pre_rope:
            parts.append(
                f"{stored} after {phrase} because {_sets(origins['pre_rope'])} pre_rope "
                "false; pre-RoPE was derived, since the rotation smears outlier channels"
            )
    if fallback_from is not None:
        parts.append(
            f"group {group_size}: the default {fallback_from} does not divide "
            f"head_dim={facts.head_dim}, {group_size} is the largest byte-aligned size under "
            f"{fallback_from} that does"
        )
    changed = [
        f"{_sets(origins[f])} {f} {values[f]} (defaults: {getattr(defaults, f)})"
        for f in ("bits", "group_size", "residual", "sinks")
        if origins[f] >= 0 and values[f] != getattr(defaults, f)
    ]
    if changed:
        parts.append(", ".join(changed))
    return "; ".join(parts)


def build_policy(
    facts: Sequence[LayerFacts], spec: PolicySpec, model_name: str = ""
) -> ModelPolicy:
    """Derive every tensor's policy from the analysis facts, then apply ``spec``.

    Derivation (DESIGN.md §1–§2): the contracted axis gets its own scales
    (``Contracted.CHANNEL`` -> ``Axis.CHANNEL``, ``Contracted.TOKEN`` -> ``Axis.TOKEN``);
    keys are cached before RoPE where the key path has one and ``defaults.pre_rope``;
    values never. Overrides apply in order; a value differing from the derived one (axis,
    pre-RoPE) or from the defaults (bits, group_size, residual, sinks) marks the tensor
    ``overridden`` and its reason says what was derived and who changed it.

    Raises:
        PolicyError: a rule names a layer the model does not have, or the result breaks a
            constraint (message: source, ``defaults``/``rule N``, field, layer and tensor).
    """
    if not facts:
        raise PolicyError(f"{spec.source}: the model has no attention layers to build a policy for")
    ordered = sorted(facts, key=lambda f: f.layer)
    layer_ids = [f.layer for f in ordered]
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"duplicate layer indices in the analysis facts: {layer_ids}")

    selections: list[set[int]] = []
    for i, rule in enumerate(spec.overrides):
        try:
            selections.append(set(rule.select(layer_ids)))
        except ValueError as exc:
            raise PolicyError(f"{spec.source}, rule {i + 1}, field 'layers': {exc}") from None

    d = spec.defaults
    # A budget's tensors start at the widest width within it; kvpolicy.budget reallocates.
    start_bits = (
        max(w for w in BUDGET_WIDTHS if w <= d.bits) if is_budget(d.bits) else d.bits
    )
    tensors: list[TensorPolicy] = []
    all_origins: list[dict[str, int]] = []
    for lf in ordered:
        for kind, tf in ((TensorKind.KEY, lf.key), (TensorKind.VALUE, lf.value)):
            derived_axis = _AXIS_OF[Contracted(tf.contracted)]
            has_rope = kind is TensorKind.KEY and tf.rope is not None
            values: dict[str, Any] = {
                "bits": start_bits,
                "group_size": d.group_size,
                "residual": d.residual,
                "sinks": d.sinks,
                "axis": d.axis if d.axis is not None else derived_axis,
                "pre_rope": d.pre_rope and has_rope,
            }
            origins = dict.fromkeys(values, _DEFAULTS)
            if d.axis is None:
                origins["axis"] = _ANALYSIS
            if not has_rope:
                origins["pre_rope"] = _ANALYSIS
            for i, rule in enumerate(spec.overrides):
                if lf.layer in selections[i] and kind in rule.kinds():
                    for name, value in rule.settings().items():
                        values[name] = value
                        origins[name] = i
            fallback_from = None
            if (
                values["axis"] is Axis.TOKEN
                and values["bits"] < FULL_PRECISION
                and origins["group_size"] == _DEFAULTS
                and "group_size" not in d.model_fields_set
                and tf.head_dim % values["group_size"]
            ):
                # Only kvpolicy's own default shrinks; one the user wrote stays an error.
                smaller = _fallback_group_size(values["group_size"], tf.head_dim, values["bits"])
                if smaller is not None:
                    fallback_from, values["group_size"] = values["group_size"], smaller
            rope_short, rope_style, rotary_dim, _ = (
                _rope_text(tf) if kind is TensorKind.KEY else (None, None, None, "")
            )
            overridden = (
                values["axis"] is not derived_axis
                or values["pre_rope"] != has_rope
                or any(
                    origins[f] >= 0 and values[f] != getattr(d, f)
                    for f in ("bits", "group_size", "residual", "sinks")
                )
            )
            try:
                tp = TensorPolicy(
                    layer=lf.layer,
                    tensor=kind,
                    **values,
                    head_dim=tf.head_dim,
                    num_kv_heads=tf.num_kv_heads,
                    bits_from="rule" if origins["bits"] >= 0 else "defaults",
                    contraction=tf.contraction,
                    rope=rope_short,
                    rope_style=rope_style,
                    rotary_dim=rotary_dim,
                    derived_axis=derived_axis,
                    derived_pre_rope=has_rope,
                    overridden=overridden,
                    reason=_reason(
                        kind, tf, values, origins, derived_axis, has_rope, d, fallback_from
                    ),
                )
            except ValidationError as exc:
                raise _blame(
                    exc,
                    spec.source,
                    [_blamable(origins, values, derived_axis, has_rope)],
                    f"layer {lf.layer} {kind.value}",
                ) from None
            tensors.append(tp)
            all_origins.append(origins)
    try:
        return ModelPolicy(model=model_name, source=spec.source, tensors=tuple(tensors))
    except ValidationError as exc:
        layer = (exc.errors()[0].get("ctx") or {}).get("layer")
        index = layer_ids.index(layer) if layer in layer_ids else 0
        pair = all_origins[2 * index : 2 * index + 2]
        raise _blame(exc, spec.source, pair) from None


def _blamable(
    origins: Mapping[str, int], values: Mapping[str, Any], derived_axis: Axis, has_rope: bool
) -> dict[str, int]:
    """Origins for blame: a rule that merely restates the derived axis or RoPE ordering
    (as the kivi presets do) is not the cause of a conflict; the analysis is."""
    out = dict(origins)
    if values["axis"] is derived_axis:
        out["axis"] = _ANALYSIS
    if values["pre_rope"] == has_rope:
        out["pre_rope"] = _ANALYSIS
    return out


def _blame(
    exc: ValidationError, source: str, origins: Sequence[Mapping[str, int]], what: str = ""
) -> PolicyError:
    """Name the rule (or the defaults) that set the offending value: among the fields a
    check involves, the one set last."""
    err = exc.errors(include_url=False)[0]
    ctx = err.get("ctx") or {}
    field = err["loc"][0] if err["loc"] else ctx.get("field", "?")
    involved = [f for f in str(ctx.get("involved", field)).split(",") if f]
    candidates = [(o.get(f, _ANALYSIS), f) for o in origins for f in involved]
    origin, field = max(candidates, default=(_ANALYSIS, field))
    message = (
        err["msg"] if err["type"] == "kvpolicy" else f"{err['msg']} (got {_show(err['input'])})"
    )
    suffix = f" ({what})" if what else ""
    return PolicyError(f"{source}, {_where(origin)}, field '{field}': {message}{suffix}")
