"""The result of a derivation and the table a bit budget is allocated from.

``TensorPolicy`` / ``ModelPolicy``
    How every cached tensor of every attention layer is quantized, with the analysis
    behind it (``derived_axis``, ``derived_pre_rope``, ``contraction``, ``rope``) and a
    sentence a user can read (``reason``). Renders as a table (render.py), round-trips
    through YAML and JSON, and loading goes through the schema: a file is validated, never
    patched up.
``Calibration`` (``LayerSensitivity`` per layer; calibration.py, re-exported here)
    The measured sensitivity of each tensor at each candidate width.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..errors import CacheError, PolicyError
from ..kernels.layout import NORMAL_LEVELS, VQ_BITS, Codebook, QuantSpec, vq_dim
from .calibration import GROUP_TABLES, Calibration, LayerSensitivity  # noqa: E402, F401
from .field_docs import documented
from .messages import translate
from .render import ranges, render_table
from .rules import (
    FULL_PRECISION,
    Axis,
    Frozen,
    ResidualBits,
    TensorKind,
    WindowChoice,
    check_bits,
    check_byte_aligned,
    check_divides,
    invalid,
    levels_at,
    packed_bytes_per_element,
    stored_bits,
)
from .yaml_io import parse_yaml, text_or_file

# --------------------------------------------------------------------------- result


@documented
class TensorPolicy(Frozen):
    """How one cached tensor (key or value) of one attention layer is quantized."""

    layer: StrictInt = Field(ge=0)
    tensor: TensorKind
    axis: Axis
    bits: StrictInt
    group_size: StrictInt = Field(gt=0)
    pre_rope: StrictBool  # keys cached before the rotation; RoPE re-applied after dequant
    residual: StrictInt = Field(ge=0)  # most recent tokens kept out of the packed body
    # How those recent tokens are held (runtime.recent): 16, full precision; 8 or 4, packed
    # per token (a scale and a zero per token and kv head). Sinks stay at 16.
    residual_bits: ResidualBits = 16
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
    # An orthogonal rotation of the head dim before quantization (kernels.rotation);
    # values only. "auto": chosen per tensor from the calibration of a bit budget.
    rotation: Literal["none", "hadamard", "auto"] = "none"
    # The candidates a stored-bits budget chose ``group_size`` from (``group_size: auto``
    # or a list); empty: the group size was fixed by the spec.
    group_sizes: tuple[StrictInt, ...] = ()
    # The levels setting (uniform, normal or auto: a budget measures both, else
    # rules.levels_at); ``code_levels`` is what the cache uses at ``bits``.
    # "vq": values vector-quantized, one byte per sub-vector of 8 // bits channels into
    # 256 centroids per kv head fitted on calibration text (``codebook``; kernels.layout).
    levels: Literal["uniform", "normal", "auto", "vq"] = "uniform"
    # Width of the stored scale and zero (kernels.layout): 16, the cache dtype; 8, a byte
    # each (a scale index and a zero point; uniform levels); "auto" (under a stored-bits
    # budget, before allocation): measured both ways, the allocator chooses.
    meta_bits: Literal[16, 8, "auto"] = 16
    # How a group's 8-bit grid is fitted (kernels.layout): min-max, or the least squared
    # error among the min-max scale and the table steps below it (8-bit metadata only).
    fit: Literal["minmax", "mse"] = "minmax"
    # Per-channel key widths (kernels.layout): "uniform", every channel at ``bits``;
    # "auto", each kv head's channels take 1-4 bits, ``bits`` on average, allocated where
    # the queries look (calibrate.channels); ``widths`` [kv heads][head_dim] once allocated.
    channel_widths: Literal["uniform", "auto"] = "uniform"
    widths: tuple[tuple[StrictInt, ...], ...] = ()
    # levels: vq: the centroids, base64 of fp16 [kv heads][256][8 // bits] (kernels.layout
    # Codebook); "" until fitted on calibration text (calibrate.vq).
    codebook: StrictStr = ""
    reason: StrictStr

    @field_validator("bits")
    @classmethod
    def _bits_supported(cls, bits: int) -> int:
        check_bits(bits)
        return bits

    @model_validator(mode="after")
    def _consistent(self) -> TensorPolicy:
        rope_fields = (self.rope, self.rope_style, self.rotary_dim)
        if any(f is None for f in rope_fields) and any(f is not None for f in rope_fields):
            raise invalid("rope", "rope, rope_style and rotary_dim are set together or not at all")
        if self.rotary_dim is not None and self.rotary_dim > self.head_dim:
            raise invalid(
                "rotary_dim", f"rotary_dim={self.rotary_dim} exceeds head_dim={self.head_dim}"
            )
        if self.tensor is TensorKind.VALUE and self.rope is not None:
            raise invalid("rope", "values are never rotated; rope must be null for a value")
        if self.pre_rope and self.rope is None:
            if self.tensor is TensorKind.VALUE:
                msg = "values are never rotated, so pre_rope applies to keys only; use tensor: key"
            else:
                msg = (
                    "no RoPE was found on this layer's key path, so there is nothing to "
                    "quantize before; drop pre_rope or restrict 'layers' to layers with RoPE"
                )
            raise invalid("pre_rope", msg)
        if self.residual_bits < FULL_PRECISION and self.full_precision:
            raise invalid("residual_bits", "a full-precision tensor (bits 16) keeps every "
                          "token at 16 bits; drop residual_bits or give bits below 16")
        if self.rotation != "none":
            if self.tensor is TensorKind.KEY:
                raise invalid(
                    "rotation",
                    "keys are not rotated: their RoPE is re-applied after dequantization and "
                    "a rotation of the head dim does not commute with it; use tensor: value",
                )
            if self.head_dim & (self.head_dim - 1):
                raise invalid(
                    "rotation",
                    f"a Hadamard rotation needs a power-of-two head_dim, got {self.head_dim}",
                )
        if (self.levels == "normal" and self.bits not in NORMAL_LEVELS
                and not self.full_precision and self.bits_from != "budget"):
            raise invalid(
                "levels",
                f"normal levels have tables for {list(NORMAL_LEVELS)} bits, not {self.bits}; "
                "use levels: uniform (or auto) at this width",
            )
        if self.meta_bits == 8 and self.levels == "normal" and not self.full_precision:
            raise invalid(
                "meta_bits",
                "8-bit metadata stores a zero point on the uniform grid, which normal levels "
                "do not have; use levels: uniform (or auto) with meta_bits: 8, or meta_bits: 16",
                "meta_bits",
                "levels",
            )
        if self.fit == "mse" and self.meta_bits == 16 and not self.full_precision:
            raise invalid(
                "fit",
                "fit: mse searches the 8-bit scale table; use it with meta_bits: 8 (or auto "
                "under a stored-bits budget), or fit: minmax",
                "fit",
                "meta_bits",
            )
        if self.channel_widths == "auto" or self.widths:
            self._check_channel_widths()
        if self.levels == "vq" or self.codebook:
            self._check_vq()
        if self.derived_pre_rope and self.rope is None:
            raise invalid("derived_pre_rope", "derived_pre_rope is true but rope is null")
        if self.group_sizes:
            if list(self.group_sizes) != sorted(set(self.group_sizes)) or len(
                    self.group_sizes) < 2 or self.group_size not in self.group_sizes:
                raise invalid(
                    "group_sizes",
                    f"group_sizes {list(self.group_sizes)}: at least two increasing "
                    f"candidates, among them group_size {self.group_size}",
                )
            if self.axis is Axis.TOKEN:
                for g in self.group_sizes:
                    check_divides(g, self.head_dim, self.bits)
        if self.bits < FULL_PRECISION:
            check_byte_aligned(self.group_size, self.bits)
            if self.axis is Axis.TOKEN:
                check_divides(self.group_size, self.head_dim, self.bits)
        return self

    def _check_channel_widths(self) -> None:
        if self.tensor is not TensorKind.KEY or self.axis is not Axis.CHANNEL:
            raise invalid(
                "channel_widths",
                "per-channel widths are for keys grouped per channel (a key is contracted "
                "over its channels; a value's channels each reach the output alone); use "
                "tensor: key with axis: channel",
            )
        if self.channel_widths == "uniform":
            raise invalid("widths", "widths are allocated by channel_widths: auto; drop "
                          "widths or set channel_widths: auto")
        if self.widths and self.code_levels != "uniform":
            raise invalid(
                "channel_widths",
                f"per-channel widths place uniform levels, and this key uses "
                f"{self.code_levels} levels at {self.bits} bits; set levels: uniform",
                "channel_widths",
                "levels",
            )
        if self.widths:
            try:
                self.quant_spec()
            except CacheError as e:
                raise invalid("widths", str(e)) from None
            if len(self.widths) != self.num_kv_heads or len(self.widths[0]) != self.head_dim:
                raise invalid("widths", f"widths must be [{self.num_kv_heads} kv heads]"
                              f"[{self.head_dim} channels]")

    def _check_vq(self) -> None:
        if self.levels != "vq":
            raise invalid("codebook", "a codebook is for levels: vq; drop it or set levels: vq")
        if self.tensor is not TensorKind.VALUE or self.axis is not Axis.TOKEN:
            raise invalid(
                "levels",
                "levels: vq codes sub-vectors of one token's channels, which is how a value "
                "is consumed (a weighted sum over tokens); use it on tensor: value with "
                "axis: token",
            )
        if self.full_precision:
            return
        if self.bits not in VQ_BITS:
            raise invalid("levels", f"levels: vq has {list(VQ_BITS)} bits per element (one "
                          f"byte per {vq_dim(VQ_BITS[-1])} or {vq_dim(VQ_BITS[0])} channels), "
                          f"not {self.bits}; use one of them or levels: uniform",
                          "levels", "bits")
        d = vq_dim(self.bits)
        if self.group_size % d:
            raise invalid("group_size", f"levels: vq at {self.bits} bits codes sub-vectors "
                          f"of {d} channels; group_size {self.group_size} is not a multiple "
                          f"of {d}", "group_size", "levels")
        if self.fit == "mse":
            raise invalid("fit", "fit: mse fits a uniform grid; use fit: minmax with levels: "
                          "vq", "fit", "levels")
        if self.codebook:
            try:
                self.quant_spec()
            except (CacheError, ValueError) as e:
                raise invalid("codebook", f"not a codebook of {self.num_kv_heads} kv heads x "
                              f"256 centroids x {d} channels in base64 fp16 ({e}); delete it "
                              "so that compile_model fits it again") from None

    @property
    def full_precision(self) -> bool:
        """True when the tensor is stored unquantized (``bits == 16``)."""
        return self.bits == FULL_PRECISION

    @property
    def code_levels(self) -> Literal["uniform", "normal", "vq"]:
        """The levels the cache quantizes this tensor with at its width
        (``kernels.layout``; ``levels: auto`` by ``rules.levels_at``; uniform with 8-bit
        metadata, unless vector-quantized)."""
        if self.levels == "vq":
            return "uniform" if self.full_precision else "vq"
        return "uniform" if self.meta_bits == 8 else levels_at(self.levels, self.bits)

    @property
    def vq(self) -> bool:
        """Vector-quantized (levels: vq below 16 bits): a scale per group and no zero."""
        return self.levels == "vq" and not self.full_precision

    def codebook_bytes(self) -> int:
        """Bytes of the vector-quantized centroids this tensor holds per layer (fp16), 0
        for a tensor that has none."""
        return self.num_kv_heads * 256 * vq_dim(self.bits) * 2 if self.vq else 0

    @property
    def stored_meta_bits(self) -> int:
        """The width the cache stores scale and zero in: 8, or 16 (also for an unallocated
        ``auto``)."""
        return 8 if self.meta_bits == 8 else 16

    def quant_spec(self) -> QuantSpec:
        """The kernels' :class:`~kvpolicy.kernels.layout.QuantSpec` of this tensor."""
        book = None
        if self.vq and self.codebook:
            book = Codebook(self.num_kv_heads, vq_dim(self.bits),
                            base64.b64decode(self.codebook, validate=True))
        return QuantSpec(self.bits, self.group_size, self.axis.value,  # type: ignore[arg-type]
                         self.code_levels, self.stored_meta_bits,
                         self.fit if self.stored_meta_bits == 8 else "minmax",
                         None if self.full_precision else (self.widths or None), book)

    @property
    def pinned_full_precision(self) -> bool:
        """A rule keeps this tensor at 16 bits: a budget does not allocate it, and the cache
        takes it token by token, so its layer's other tensor packs token by token too."""
        return self.bits_from == "rule" and self.full_precision

    @property
    def elements_per_token(self) -> int:
        return self.num_kv_heads * self.head_dim

    def meta_bytes(self, scale_bytes: int = 2) -> int:
        """Bytes of one stored scale (and of one zero): ``scale_bytes`` (the cache dtype's;
        fp16 by default), or 1 with 8-bit metadata."""
        return 1 if self.meta_bits == 8 else scale_bytes

    def bytes_per_token(self, scale_bytes: int = 2) -> float:
        """Bytes one token of this tensor takes once packed: codes plus a scale and a zero
        per group (:meth:`meta_bytes` each), or 2 bytes per element at 16 bits. The
        full-precision sink and residual windows are not counted."""
        if self.full_precision:
            return 2.0 * self.elements_per_token
        return self.elements_per_token * packed_bytes_per_element(
            self.bits, self.group_size, self.meta_bytes(scale_bytes), 1 if self.vq else 2
        )

    def residual_bytes_per_token(self, scale_bytes: int = 2) -> float:
        """Bytes one token in the residual window takes (``residual_bits``): 2 per element
        at 16, else the codes and a scale and a zero per kv head."""
        if self.residual_bits == FULL_PRECISION:
            return 2.0 * self.elements_per_token
        return self.num_kv_heads * (self.head_dim * self.residual_bits / 8 + 2 * scale_bytes)

    def stored_bits(self, scale_bytes: int = 2) -> float:
        """Stored bits per packed element: ``bits + 2 * 8 * meta_bytes / group_size`` (the
        code and its share of a scale and a zero), 16 in full precision."""
        return stored_bits(self.bits, self.group_size, 8 * self.meta_bytes(scale_bytes),
                           1 if self.vq else 2)


@documented
class ModelPolicy(Frozen):
    """The policy of every cached tensor of a model, in layer order (key, then value)."""

    version: Literal[1] = 1
    model: StrictStr = ""
    source: StrictStr = ""  # the spec it was built from: preset name, file path or "<dict>"
    tensors: tuple[TensorPolicy, ...] = Field(min_length=1)
    # A bit budget and the measured sensitivity it was allocated from; None for uniform
    # widths. ``budget_unit``: "code", average code bits per cached element (a float
    # ``bits``), or "stored", average stored bits (``stored_bits``: scales and zeros
    # counted; widths and group sizes allocated).
    budget: float | None = None
    budget_unit: Literal["code", "stored"] = "code"
    budget_context: StrictInt | None = None  # a stored-bits budget over the whole cache
    budget_pages: StrictInt | None = None  # ... or over a paged server's blocks
    calibration: Calibration | None = None
    windows: tuple[StrictInt | None, ...] = ()  # per layer: a local layer's window, or None
    # (residual, residual_bits) pairs a whole-cache budget chooses among for each global
    # layer's recent window (calibrate.window); empty: every window is fixed.
    window_choices: tuple[WindowChoice, ...] = ()

    @model_validator(mode="after")
    def _layer_order(self) -> ModelPolicy:
        if len(self.tensors) % 2:
            raise invalid("tensors", "expected a key and a value for every layer")
        previous = -1
        for i in range(0, len(self.tensors), 2):
            key, value = self.tensors[i], self.tensors[i + 1]
            if key.tensor is not TensorKind.KEY or value.tensor is not TensorKind.VALUE:
                raise invalid("tensor", f"tensors[{i}:{i + 2}] must be a key then a value")
            if key.layer != value.layer or key.layer <= previous:
                raise invalid(
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
        if self.windows and len(self.windows) != len(self.tensors) // 2:
            raise invalid("windows", f"{len(self.windows)} windows for "
                          f"{len(self.tensors) // 2} layers: one per layer, or none")
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

    def avg_stored_bits(self, scale_bytes: int = 2) -> float:
        """Stored bits per packed element over all layers and both tensors (codes, scales
        and zeros; 16 for full-precision tensors): what a ``stored_bits`` budget bounds.
        The full-precision sink and residual windows are not counted."""
        total = sum(t.elements_per_token for t in self.tensors)
        return sum(t.stored_bits(scale_bytes) * t.elements_per_token
                   for t in self.tensors) / total

    @property
    def fp16_bytes_per_token(self) -> int:
        """Bytes one token takes in an fp16 cache, for comparison."""
        return 2 * sum(t.elements_per_token for t in self.tensors)

    def calibration_key(self) -> str:
        """A fingerprint of everything a measured sensitivity depends on except the widths:
        the model name and, per tensor, layer, axis, group size, pre-RoPE, residual, sinks,
        the rotation (when there is one), the candidate group sizes (when a stored-bits
        budget chooses the group: the calibration measured each, on their common packing
        schedule) and whether a rule pins it at full precision (the cache then packs the
        layer's other tensor token by token). Not per-channel key widths: a calibration
        measured with them (``channel_widths: auto`` with calibration text) and reused
        without (or the reverse) prices the keys a little off, but what it measures is the
        same tensor at the same width."""
        parts = [self.model] + [
            f"{t.layer}{t.tensor.value[0]}:{t.axis.value}:{t.group_size}:{int(t.pre_rope)}:"
            f"{t.residual}:{t.sinks}:{t.num_kv_heads}x{t.head_dim}"
            + (":fp" if t.pinned_full_precision else "")
            + (f":rot={t.rotation}" if t.rotation != "none" else "")
            + (f":lv={t.levels}" if t.levels != "uniform" else "")
            + (f":m{t.meta_bits}" if t.meta_bits != 16 else "")
            + (f":fit={t.fit}" if t.fit != "minmax" else "")
            + (f":g={'/'.join(map(str, t.group_sizes))}" if t.group_sizes else "")
            for t in self.tensors
        ] + [f"recent={self.window_choices}"] * bool(self.window_choices)
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
        raise KeyError(f"layer {layer} is not in this policy (layers {ranges(self.layers)})")

    def __str__(self) -> str:
        return render_table(self)

    def to_yaml(self) -> str:
        """This policy as YAML (``from_yaml`` reads it back)."""
        # A very wide line width keeps each reason on one line.
        return yaml.safe_dump(
            self.model_dump(mode="json"), sort_keys=False, allow_unicode=True, width=1 << 16
        )

    def to_json(self, indent: int | None = 2) -> str:
        """This policy as JSON (``from_json`` reads it back)."""
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_yaml(cls, text_or_path: str | Path) -> ModelPolicy:
        """Load from YAML text or a file path; validated by the schema, never patched up."""
        text, source = text_or_file(text_or_path, "<yaml>")
        return _validate_model_policy(parse_yaml(text, source), source)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> ModelPolicy:
        """Load from JSON text or a file path; validated by the schema."""
        text, source = text_or_file(text_or_path, "<json>")
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
        raise translate(exc, source, _model_policy_where(data), ModelPolicy) from None


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

