"""Calibrate: activations captured where each cached tensor is consumed (``capture``), the
errors measured there (``metrics``), and the bit-budget allocator built on them (``budget``).
"""

from .budget import (
    CALIBRATION_METRICS,
    CALIBRATION_TOKENS,
    allocate,
    apply_budget,
    budget_policy,
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
    "calibration_ids", "calibration_ids_from_file", "allocate", "apply_budget",
    "budget_policy",
]
