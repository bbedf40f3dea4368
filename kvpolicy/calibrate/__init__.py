"""Calibrate: activations captured where each cached tensor is consumed (``capture``), the
errors measured there (``metrics``), the bit-budget calibration built on them (``budget``),
the allocator (``allocate``) and the policy it writes (``apply``).
"""

from .allocate import allocate, allocate_joint, allocate_stored
from .apply import ROTATION_GAIN, apply_budget, budget_policy
from .budget import (
    CALIBRATION_METRICS,
    CALIBRATION_TOKENS,
    calibrate,
    calibrate_on,
    calibration_ids,
    calibration_ids_from_file,
)
from .capture import LayerActivations, capture_activations
from .metrics import AxisChoice, consumed_errors

__all__ = [
    "LayerActivations", "capture_activations", "AxisChoice", "consumed_errors",
    "CALIBRATION_TOKENS", "CALIBRATION_METRICS", "calibrate", "calibrate_on",
    "calibration_ids", "calibration_ids_from_file", "allocate", "allocate_joint", "allocate_stored",
    "apply_budget", "budget_policy", "ROTATION_GAIN",
]
