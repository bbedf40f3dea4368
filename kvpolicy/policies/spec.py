"""What a user asks for: ``PolicySpec``, made of ``Defaults`` and ordered ``OverrideRule``s.

A spec comes from a preset name, a YAML file or a dict (``load_spec``, load.py) and is
validated here field by field with the messages of rules.py; an override's ``layers`` is
a selector (an int, a list, a range ``"a-b"`` or ``"*"``) resolved against the model's
layers when ``build_policy`` (derive.py) applies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .field_docs import documented
from .render import ranges
from .rules import (
    KVPOLICY_DEFAULTS,
    Axis,
    Frozen,
    ResidualBits,
    TensorKind,
    check_bits,
    check_bits_or_budget,
    check_byte_aligned,
    check_group_setting,
    check_stored_budget,
    invalid,
    is_budget,
)
from .schema import GROUP_TABLES, Calibration

_SETTABLE = (
    "bits", "group_size", "axis", "pre_rope", "residual", "residual_bits", "sinks", "rotation",
    "levels", "meta_bits", "fit", "channel_widths",
)
# The quantization levels (kernels.layout): "auto" is chosen per tensor by a budget's
# calibration, and is uniform without one (rules.levels_at).
LevelsSetting = Literal["uniform", "normal", "auto", "vq"]

LayerSelector = Union[StrictInt, StrictStr, tuple[Union[StrictInt, StrictStr], ...]]
# A fixed group size, "auto" (a stored-bits budget chooses among rules.GROUP_CHOICES) or the
# candidates it chooses among (rules.check_group_setting).
GroupSetting = Union[StrictInt, Literal["auto"], tuple[StrictInt, ...]]


def _parse_range(text: str) -> tuple[int, int] | None:
    a, sep, b = text.replace(" ", "").partition("-")
    if not sep and a.isdigit():
        return int(a), int(a)
    if sep and a.isdigit() and b.isdigit():
        return int(a), int(b)
    return None


def _layers_error(message: str) -> PydanticCustomError:
    return invalid("layers", f'{message}; write an int, a list of ints, a range "a-b" or "*"')


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


@documented
class Defaults(Frozen):
    """Settings for every tensor before the overrides; the derived axis unless ``axis``.

    A ``group_size`` that was not given (not in ``model_fields_set``; presets count as not
    given) is the built-in default: where a tensor's axis is ``token`` and it does not
    divide head_dim, ``build_policy`` uses the largest byte-aligned divisor below it (a
    power of two or head_dim itself where one fits) and says so in the reason. A given one
    that does not divide is an error.

    Two budgets, one at a time: a float ``bits`` counts code bits only (the group size
    stays what the policy sets), ``stored_bits`` counts what the cache stores per element,
    a scale and a zero per group included. Under ``stored_bits`` a ``group_size`` that was
    not given is ``auto``: the allocator chooses each tensor's group among
    ``rules.GROUP_CHOICES`` with its width, from the measured cost of each pair (a given
    int stays fixed and is counted). A code-bits budget never chooses groups: its metadata
    is free, so the smallest group would always win.
    """

    # A width from SUPPORTED_BITS, or a float budget: the average code bits per cached
    # element, spread over the tensors by measured sensitivity (kvpolicy.calibrate.budget).
    bits: Union[StrictInt, StrictFloat] = 2
    # A budget of average *stored* bits per element (codes + a scale and a zero per group),
    # widths and group sizes allocated by measured sensitivity; excludes a float ``bits``.
    stored_bits: Union[StrictFloat, None] = None
    # None: ``stored_bits`` prices the packed body. An int L: it prices the whole cache each
    # layer holds after L tokens (a local layer: its window), sinks, residual and the
    # incomplete chunk counted in full precision (policies.footprint).
    budget_context: Union[StrictInt, None] = Field(default=None, ge=1)
    # None, or a paged server's block of this many tokens: ``stored_bits`` prices each
    # layer's page (codes, scales, zeros, a stage of one chunk and the sink area in full
    # precision, runtime.paged.PagedLayout), every layer within it on its own.
    budget_pages: Union[StrictInt, None] = Field(default=None, ge=16, multiple_of=16)
    group_size: GroupSetting = KVPOLICY_DEFAULTS["group_size"]
    # "auto": a whole-cache budget chooses each global layer's window, tokens and width
    # (policies.derive.WINDOW_CHOICES, calibrate.whole_cache).
    residual: Union[Annotated[int, Field(strict=True, ge=0)], Literal["auto"]] = \
        KVPOLICY_DEFAULTS["residual"]
    # How the residual window's tokens are held (runtime.recent): 16, full precision; 8 or
    # 4, packed per token. A full-precision tensor keeps 16. Left out under a whole-cache
    # budget (budget_context): 8 (policies.derive.whole_cache_residuals).
    residual_bits: ResidualBits = 16
    sinks: StrictInt = Field(default=KVPOLICY_DEFAULTS["sinks"], ge=0)
    # True means "pre-RoPE where RoPE exists": a layer without RoPE is not an error here.
    pre_rope: StrictBool = KVPOLICY_DEFAULTS["pre_rope"]
    # None: the derived axis. Set, it applies to keys and values alike and counts as an
    # override wherever it differs from the derived one.
    axis: Axis | None = None
    # An orthogonal rotation of the head dim before quantization (kernels.rotation). In
    # the defaults it applies to values only (keys' RoPE does not commute with it).
    # "auto": a bit budget's calibration measures both and keeps the rotation where it
    # cuts the measured cost (calibrate.apply.ROTATION_GAIN).
    rotation: Literal["none", "hadamard", "auto"] = "none"
    # The quantization levels (kernels.layout): uniform, normal (Lloyd-Max levels of a unit
    # Gaussian placed by each group's mean and deviation), vq (values only: sub-vectors of
    # 8 // bits channels coded by 256 centroids per kv head fitted on calibration text) or
    # auto (rules.levels_at; under a stored-bits budget the calibration also prices vq).
    levels: LevelsSetting = "auto"
    # Width of each group's stored scale and zero (kernels.layout): 16 (the cache dtype) or
    # 8 (a scale index and a zero point, uniform levels): at 2 bits and groups of 16,
    # 3.0 stored bits per element, what groups of 32 cost at 16. "auto": a stored-bits
    # budget measures both and chooses per tensor; 16 without one.
    meta_bits: Literal[16, 8, "auto"] = "auto"
    # How a group's 8-bit grid is fitted (kernels.layout): minmax, mse (the least squared
    # error among the min-max scale and the table steps below it; 8-bit metadata only) or
    # auto (rules.fit_at: mse for keys whose metadata is or may become 8-bit).
    fit: Literal["minmax", "mse", "auto"] = "auto"
    # Per-channel key widths (kernels.layout): "auto" gives each key channel 1-4 bits,
    # ``bits`` on average per kv head, by E[q²]·range² measured on a calibration text
    # (calibrate.channels); keys only. "uniform": one width per tensor. Left at kvpolicy's
    # "auto", a model with no calibration text at hand (no tokenizer) keeps uniform keys;
    # written, it is an error there.
    channel_widths: Literal["uniform", "auto"] = "auto"

    @field_validator("bits")
    @classmethod
    def _bits_supported(cls, bits: int | float) -> int | float:
        return check_bits_or_budget(bits)

    @field_validator("stored_bits", mode="before")
    @classmethod
    def _stored_budget(cls, stored: Any) -> float | None:
        return None if stored is None else check_stored_budget(stored)

    @field_validator("group_size", mode="before")
    @classmethod
    def _group_setting(cls, value: Any) -> int | str | tuple[int, ...]:
        return check_group_setting(value)

    @model_validator(mode="after")
    def _aligned(self) -> Defaults:
        if self.stored_bits is not None and is_budget(self.bits):
            raise invalid(
                "stored_bits",
                f"bits {self.bits} is a budget of code bits and stored_bits "
                f"{self.stored_bits:g} a budget of stored bits (codes plus scales and "
                "zeros); give one of them: drop bits, or drop stored_bits",
                "stored_bits",
                "bits",
            )
        for name, says in (("budget_context", "at how many tokens a stored-bits budget "
                                              "counts the whole cache"),
                           ("budget_pages", "how large the pages are that a stored-bits "
                                            "budget counts")):
            if getattr(self, name) is not None and self.stored_bits is None:
                raise invalid(
                    name,
                    f"{name} {getattr(self, name)} says {says}, and there is no "
                    f"stored_bits; add stored_bits: 3.0, or drop {name}",
                )
        if self.residual == "auto" and (self.budget_context is None
                                        or "residual_bits" in self.model_fields_set):
            raise invalid(
                "residual",
                "residual: auto lets a whole-cache budget choose each layer's recent window, "
                "its tokens and their width; it needs stored_bits and budget_context (e.g. "
                "4096) and no residual_bits, or give a number of tokens",
                "residual", "budget_context",
            )
        if self.budget_pages is not None and self.budget_context is not None:
            raise invalid(
                "budget_pages",
                "budget_context counts the cache of one process and budget_pages a paged "
                "server's blocks; give one of them",
                "budget_pages", "budget_context",
            )
        if not isinstance(self.group_size, int) and self.stored_bits is None:
            raise invalid(
                "group_size",
                f"group_size {_show_group(self.group_size)} is chosen per tensor by a "
                "stored-bits budget (under code bits a scale and a zero cost nothing, so "
                "the smallest group would always win); add stored_bits: 3.0, or give one "
                "group size such as 32",
            )
        if not is_budget(self.bits) and self.stored_bits is None:
            # A budget's widths are checked per tensor.
            check_byte_aligned(self.group_size, self.bits)  # type: ignore[arg-type]
        return self

    @property
    def budget_unit(self) -> Literal["code", "stored"] | None:
        """Which budget: ``"code"`` (a float ``bits``), ``"stored"``, or None (widths)."""
        if self.stored_bits is not None:
            return "stored"
        return "code" if is_budget(self.bits) else None


def _show_group(value: Any) -> str:
    return value if isinstance(value, str) else str(list(value))


@documented
class OverrideRule(Frozen):
    """One override: which layers and tensors, and the fields it sets (None: not set)."""

    layers: LayerSelector
    tensor: Literal["key", "value", "*"]
    bits: StrictInt | None = None
    # A fixed size, or "auto" / a list of candidates for a stored-bits budget to choose from.
    group_size: GroupSetting | None = None
    axis: Axis | None = None
    pre_rope: StrictBool | None = None
    residual: StrictInt | None = Field(default=None, ge=0)
    residual_bits: ResidualBits | None = None
    sinks: StrictInt | None = Field(default=None, ge=0)
    rotation: Literal["none", "hadamard", "auto"] | None = None
    levels: LevelsSetting | None = None
    meta_bits: Literal[16, 8, "auto"] | None = None
    fit: Literal["minmax", "mse", "auto"] | None = None
    channel_widths: Literal["uniform", "auto"] | None = None

    @field_validator("layers", mode="before")
    @classmethod
    def _selector(cls, value: Any) -> int | str | tuple[int | str, ...]:
        return _normalize_selector(value)

    @field_validator("bits")
    @classmethod
    def _bits_supported(cls, bits: int | None) -> int | None:
        if bits is not None:
            check_bits(bits)
        return bits

    @field_validator("group_size", mode="before")
    @classmethod
    def _group_setting(cls, value: Any) -> int | str | tuple[int, ...] | None:
        return None if value is None else check_group_setting(value)

    @model_validator(mode="after")
    def _sets_something(self) -> OverrideRule:
        if not self.settings():
            raise invalid(
                "layers",
                f"the rule selects layers and a tensor but sets nothing; set one of "
                f"{', '.join(_SETTABLE)}",
            )
        if self.bits is not None and isinstance(self.group_size, int):
            check_byte_aligned(self.group_size, self.bits)
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
    return f"the model has {n} attention layers ({ranges(layer_ids)})"


@documented
class PolicySpec(Frozen):
    """A user's policy request: defaults for every tensor plus ordered override rules, and
    for a bit budget optionally the measured sensitivity to allocate it from."""

    version: Literal[1] = 1
    source: StrictStr = "<dict>"  # for messages: file path, "<dict>" or preset name
    defaults: Defaults = Field(default_factory=Defaults)
    overrides: tuple[OverrideRule, ...] = ()
    calibration: Calibration | None = None

    @property
    def budget(self) -> float | None:
        """The budget, in the unit of :attr:`budget_unit`: a float ``defaults.bits`` (code
        bits) or ``defaults.stored_bits``; None for widths."""
        if self.defaults.stored_bits is not None:
            return self.defaults.stored_bits
        return self.defaults.bits if is_budget(self.defaults.bits) else None

    @property
    def budget_unit(self) -> Literal["code", "stored"] | None:
        """``"code"``: average code bits per element; ``"stored"``: average stored bits,
        scales and zeros included; None without a budget."""
        return self.defaults.budget_unit

    def to_yaml(self) -> str:
        """This spec as a policy file: the defaults that were given, the overrides, and the
        calibration if any (so that compiling from the file skips calibrating)."""
        # Under stored_bits the widths are allocated: bits is only the start, left out.
        given = set(self.defaults.model_fields_set)
        if self.defaults.stored_bits is not None:
            given = (given - {"bits"}) | {"stored_bits"}
        else:
            given |= {"bits"}
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
            cal = self.calibration.model_dump(mode="json")
            # The group tables of a stored-bits budget only where measured: a code-bits
            # budget's file reads as it did before they existed.
            if not cal["groups"]:
                del cal["groups"]
            for layer in cal["layers"]:
                for name in ("value_rotated", "key_normal", "value_normal", *GROUP_TABLES):
                    if layer[name] is None:
                        del layer[name]
            doc["calibration"] = cal
        # Flow style for lists of scalars: one line per tensor of the calibration table.
        return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=1 << 16,
                              default_flow_style=None)

