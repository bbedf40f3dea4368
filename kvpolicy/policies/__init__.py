"""Compression policy: the schema, the user's spec, and derivation from analysis facts.

Three layers, each a frozen pydantic v2 model:

``TensorPolicy`` / ``ModelPolicy`` (schema.py)
    The result: how every cached tensor of every attention layer is quantized, with the
    analysis behind it and a sentence a user can read (``reason``). Renders as a table
    (render.py), round-trips through YAML and JSON.
``PolicySpec`` (``Defaults`` + ``OverrideRule``; spec.py)
    What a user asks for: a preset name, a YAML file or a dict, loaded by ``load_spec``
    (load.py).
``build_policy(facts, spec)`` (derive.py)
    Derives each tensor's policy from the facts of ``kvpolicy.passes`` (docs/design.md
    §1–§2), then applies the overrides in order.

The modules, each importing only those before it: rules.py (widths, defaults, axes and
the checks that give one rule one message), messages.py (validation errors as
``PolicyError`` lines), yaml_io.py (presets, files, strict YAML), render.py (the table),
field_docs.py (what each field means, with an example: docs/reference/policy-file.md),
calibration.py (the sensitivity table),
schema.py, spec.py, load.py, derive.py. Every problem a user can cause raises
``PolicyError`` naming the source, where in it and the field.
"""

from .derive import build_policy
from .load import load_spec
from .rules import (
    BUDGET_WIDTHS,
    FULL_PRECISION,
    GROUP_CHOICES,
    SUPPORTED_BITS,
    Axis,
    TensorKind,
    is_budget,
    levels_at,
    metadata_at,
    packed_bytes_per_element,
    stored_bits,
)
from .schema import Calibration, LayerSensitivity, ModelPolicy, TensorPolicy
from .spec import Defaults, OverrideRule, PolicySpec
from .yaml_io import list_presets

__all__ = [
    "SUPPORTED_BITS",
    "BUDGET_WIDTHS",
    "GROUP_CHOICES",
    "FULL_PRECISION",
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
    "is_budget",
    "levels_at",
    "metadata_at",
    "packed_bytes_per_element",
    "stored_bits",
]
