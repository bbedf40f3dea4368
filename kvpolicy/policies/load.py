"""Loading what a user passes as ``policy=``: ``load_spec`` and ``list_presets``.

A preset name, a YAML file, a dict or a ``PolicySpec`` becomes a validated
``PolicySpec``. Every problem a user can cause raises ``PolicyError`` naming the source
(file path, ``<dict>`` or preset name), where in it (``defaults``, ``rule N`` counted from
1) and the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from ..errors import PolicyError
from .messages import show, suggest, translate
from .rules import SUPPORTED_BITS, check_bits_or_budget, check_stored_budget, is_budget
from .schema import Calibration
from .spec import Defaults, OverrideRule, PolicySpec
from .yaml_io import list_presets, parse_yaml, presets_dir, read_file

_SPEC_KEYS = ("version", "defaults", "overrides", "calibration")


def _bits_argument(bits: Any) -> int | float:
    """Validate a ``bits=`` argument: a supported width or a float budget."""
    if isinstance(bits, bool) or not isinstance(bits, (int, float)):
        raise PolicyError(
            f"bits={bits!r} is not a number; use one of {', '.join(map(str, SUPPORTED_BITS))} "
            "or a float budget such as 2.5"
        )
    try:
        return check_bits_or_budget(float(bits) if isinstance(bits, float) else int(bits))
    except PydanticCustomError as exc:
        raise PolicyError(f"bits={bits!r}: {exc.message()}") from None


def _stored_argument(stored_bits: Any, bits: int | float) -> float:
    """Validate a ``stored_bits=`` argument beside ``bits=``: a budget in stored bits
    excludes a code-bits budget and any width other than the default 2."""
    try:
        stored = check_stored_budget(stored_bits)
    except PydanticCustomError as exc:
        raise PolicyError(f"stored_bits={stored_bits!r}: {exc.message()}") from None
    if is_budget(bits):
        raise PolicyError(
            f"bits={bits!r} is a budget of code bits and stored_bits={stored_bits!r} a budget "
            "of stored bits (codes plus a scale and a zero per group); give one of them: "
            f"stored_bits={stored_bits!r} alone, or bits={bits!r} alone"
        )
    if bits != 2:
        raise PolicyError(
            f"bits={bits!r} sets one width for every tensor, and stored_bits="
            f"{stored_bits!r} allocates the widths; give one of them (pin single tensors "
            "with override rules, which count against the stored budget)"
        )
    return stored


def load_spec(
    policy: str | Path | Mapping[str, Any] | PolicySpec | None = None,
    bits: int | float = 2,
    stored_bits: float | None = None,
) -> PolicySpec:
    """Turn what a user passed as ``policy=`` into a validated ``PolicySpec``.

    Args:
        policy: ``None`` (the ``kvpolicy-<bits>`` defaults), a preset name from
            ``list_presets()``, a path to a YAML file (``str`` or ``Path``), a dict of the
            same form, or a ``PolicySpec`` (returned as is).
        bits: code width for ``policy=None``; with a file or dict, the ``kvpolicy-<bits>``
            defaults are the base that the document's ``defaults`` are layered over. A float
            (``2.5``, also ``3.0``) is a budget: the average code bits per cached element,
            allocated per tensor from measured sensitivity (``kvpolicy.calibrate.budget``);
            an int is one width for every tensor.
        stored_bits: a budget of average *stored* bits per element, codes plus a scale and
            a zero per group (``3.0``: e.g. 2-bit codes in groups of 32, or 2.5-bit ones in
            groups of 64); widths and, where ``group_size`` is not given, group sizes are
            allocated per tensor. Excludes a float ``bits`` and any width but the default
            2; a document's own ``defaults.stored_bits`` wins over it, as its ``bits`` does.

    Raises:
        PolicyError: naming the source, ``defaults`` or ``rule N``, and the field.
    """
    stored = None if stored_bits is None else _stored_argument(stored_bits, bits)
    if isinstance(policy, PolicySpec):
        if stored is None or policy.defaults.stored_bits is not None:
            return policy
        return _with_stored(policy, stored)
    bits = _bits_argument(bits)
    presets = list_presets()
    if policy is None:
        name = f"kvpolicy-{bits}"
        if name in presets:
            return load_spec(name, bits, stored)
        return PolicySpec(source=name, defaults=Defaults(bits=bits, stored_bits=stored))
    if isinstance(policy, Mapping):
        return _spec_from_document(policy, "<dict>", bits, stored=stored)
    if isinstance(policy, str) and policy in presets:
        text = presets_dir().joinpath(f"{policy}.yaml").read_text(encoding="utf-8")
        return _spec_from_document(parse_yaml(text, policy), policy, bits, builtin=True,
                                   stored=stored)
    if isinstance(policy, (str, Path)):
        path = Path(policy)
        return _spec_from_document(parse_yaml(read_file(path), str(policy)), str(policy), bits,
                                   stored=stored)
    raise PolicyError(
        f"policy must be a preset name ({', '.join(presets)}), a path to a YAML file, a dict "
        f"or a PolicySpec, not {type(policy).__name__}"
    )


def _with_stored(spec: PolicySpec, stored: float) -> PolicySpec:
    """``spec`` under a stored-bits budget, its defaults' given fields kept as given."""
    defaults = spec.defaults
    if is_budget(defaults.bits):
        raise PolicyError(
            f"{spec.source}: defaults.bits {defaults.bits} is a budget of code bits and "
            f"stored_bits={stored:g} a budget of stored bits; give one of them"
        )
    data = {**defaults.model_dump(), "stored_bits": stored}
    try:
        new = Defaults.model_validate(data)
    except ValidationError as exc:
        raise translate(exc, spec.source, _spec_where, PolicySpec) from None
    given = defaults.model_fields_set | {"stored_bits"}
    return spec.model_copy(update={"defaults": Defaults.model_construct(
        _fields_set=given, **new.model_dump())})


def _spec_from_document(
    doc: Any, source: str, bits: int | float, builtin: bool = False,
    stored: float | None = None,
) -> PolicySpec:
    """Validate a parsed document. ``builtin``: a shipped preset, whose defaults count as
    kvpolicy's own rather than written by the user (see ``Defaults``). ``stored``: a
    stored-bits budget from the caller, under the document's own defaults."""
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
                f"{source}, top level, field '{key}': unknown key; {suggest(key, _SPEC_KEYS)}"
                f"{hint}"
            )
    raw_defaults = doc.get("defaults", {})
    if not isinstance(raw_defaults, Mapping):
        raise PolicyError(
            f"{source}, defaults: expected a mapping of {', '.join(Defaults.model_fields)}, "
            f"got {show(raw_defaults)}"
        )
    base: dict[str, Any] = {"bits": bits}
    if stored is not None:
        base["stored_bits"] = stored
    if not builtin and "bits" in raw_defaults and ("stored_bits" in raw_defaults or stored):
        given = raw_defaults["bits"]
        why = ("is a budget of code bits" if isinstance(given, float)
               else "sets one width for every tensor")
        by = ("defaults.stored_bits" if "stored_bits" in raw_defaults
              else f"stored_bits={stored:g}")
        raise PolicyError(
            f"{source}, defaults, field 'bits': bits {given!r} {why}, and {by} allocates the "
            "widths from a budget of stored bits; give one of them (with stored_bits, drop "
            "bits: pin single tensors with override rules instead)"
        )
    payload: dict[str, Any] = {
        "source": source,
        # Fields left out take Defaults' own (kvpolicy's) values and stay out of
        # model_fields_set, which is how build_policy tells a written group_size.
        "defaults": {**base, **raw_defaults},
        "overrides": doc.get("overrides", ()),
    }
    if "version" in doc:
        payload["version"] = doc["version"]
    if doc.get("calibration") is not None:
        payload["calibration"] = doc["calibration"]
    try:
        spec = PolicySpec.model_validate(payload)
    except ValidationError as exc:
        raise translate(exc, source, _spec_where, PolicySpec) from None
    if builtin:
        # Same validated values, none of them marked as given by the user (but a
        # stored-bits budget from the caller).
        unset = Defaults.model_construct(_fields_set={"stored_bits"} if stored else set(),
                                         **spec.defaults.model_dump())
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

