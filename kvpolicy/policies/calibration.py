"""The sensitivity table a bit budget is allocated from: ``Calibration``, with one
``LayerSensitivity`` per layer (the measured error of each tensor at each candidate width;
``kvpolicy.calibrate.budget`` measures it, ``kvpolicy.calibrate.apply`` allocates from it).
Saved in a policy file beside the policy it priced, and refused once its settings change.
"""

from __future__ import annotations

from typing import Union

from pydantic import Field, StrictInt, StrictStr, model_validator

from .field_docs import documented
from .rules import BUDGET_WIDTHS, Frozen, TensorKind, WindowChoice, invalid

__all__ = ["Calibration", "LayerSensitivity", "GROUP_TABLES"]


@documented
class LayerSensitivity(Frozen):
    """Measured consumed error of one layer's key and value at each candidate width.

    ``key[i]`` / ``value[i]``: the error at ``Calibration.widths[i]`` when only that tensor
    is quantized (None: the width does not fit the tensor's group size).
    """

    layer: StrictInt = Field(ge=0)
    key: tuple[Union[float, None], ...]
    value: tuple[Union[float, None], ...]
    # For ``rotation: auto``: the value's errors once more with the Hadamard rotation.
    value_rotated: tuple[Union[float, None], ...] | None = None
    # For a group size chosen by a stored-bits budget: ``key_groups[j][i]`` is the error at
    # ``Calibration.groups[j]`` and ``Calibration.widths[i]`` (None: that pair does not fit
    # the tensor); None where the tensor's group is fixed (``key`` / ``value`` then).
    key_groups: tuple[tuple[Union[float, None], ...], ...] | None = None
    value_groups: tuple[tuple[Union[float, None], ...], ...] | None = None
    value_rotated_groups: tuple[tuple[Union[float, None], ...], ...] | None = None
    # For ``levels: auto`` under a budget: the errors once more with normal levels (None
    # where a width has no normal table), at the own group and per candidate group.
    key_normal: tuple[Union[float, None], ...] | None = None
    value_normal: tuple[Union[float, None], ...] | None = None
    key_normal_groups: tuple[tuple[Union[float, None], ...], ...] | None = None
    value_normal_groups: tuple[tuple[Union[float, None], ...], ...] | None = None
    # For ``meta_bits: auto`` under a stored-bits budget: the errors once more with 8-bit
    # scales and zeros (uniform levels), at the own group (where it is fixed) or per
    # candidate group.
    key_meta8: tuple[Union[float, None], ...] | None = None
    value_meta8: tuple[Union[float, None], ...] | None = None
    key_meta8_groups: tuple[tuple[Union[float, None], ...], ...] | None = None
    value_meta8_groups: tuple[tuple[Union[float, None], ...], ...] | None = None
    # For vq values (``levels: auto`` under a stored-bits budget): the value's errors with
    # vector-quantized codes at the 1- and 2-bit widths (None elsewhere), one 8-bit scale
    # per token and head (group = head_dim), and the codebook each was measured with
    # (``TensorPolicy.codebook``'s text; "" where no width was measured).
    value_vq: tuple[Union[float, None], ...] | None = None
    value_vq_books: tuple[StrictStr, ...] | None = None
    # For a window a whole-cache budget chooses (``Calibration.recent``), per choice
    # ``(body, window)``: the error of a reference body with the choice's recent tokens
    # exact, and of those tokens alone at the choice's width (0 at 16 bits); None where
    # the layer's window is fixed (a local layer).
    key_recent: tuple[tuple[float, float], ...] | None = None
    value_recent: tuple[tuple[float, float], ...] | None = None


# The per-group tables of a LayerSensitivity (None where the tensor's group is fixed).
GROUP_TABLES = ("key_groups", "value_groups", "value_rotated_groups", "key_normal_groups",
                "value_normal_groups", "key_meta8_groups", "value_meta8_groups")


@documented
class Calibration(Frozen):
    """The sensitivity table a bit budget is allocated from
    (``kvpolicy.calibrate.budget.calibrate``).

    One currency for both tensors (``metric``;
    ``kvpolicy.calibrate.budget.CALIBRATION_METRICS``): what the change of the attention
    block's output costs when one tensor of one layer is quantized at one width and
    everything else is exact; by default the squared first-order change of the calibration
    text's loss, ``Σ_t (∂L/∂o_t · Δo_t)²``. Keys act through the scores and the softmax,
    values through the weighted sum.

    ``settings`` fingerprints what the errors depend on besides the width (per tensor:
    axis, group size and the candidate group sizes, pre-RoPE, residual, sinks; see
    ``ModelPolicy.calibration_key``), so a saved table is refused once those change.
    ``groups``: the group sizes measured for tensors whose group a stored-bits budget
    chooses (``LayerSensitivity.key_groups``); empty when every group is fixed.
    """

    metric: StrictStr = "loss-weighted attention-output error"
    model: StrictStr = ""
    source: StrictStr  # which tokens: "pydoc text, last 512 tokens" or "user token ids"
    tokens: StrictInt = Field(gt=0)  # per row
    rows: StrictInt = Field(default=1, gt=0)
    seconds: float = Field(default=0.0, ge=0)
    settings: StrictStr
    widths: tuple[StrictInt, ...] = Field(min_length=1)
    groups: tuple[StrictInt, ...] = ()
    layers: tuple[LayerSensitivity, ...] = Field(min_length=1)
    # (residual tokens, residual_bits) choices measured for a window a whole-cache budget
    # chooses per layer (``ModelPolicy.window_choices``); empty when none was measured.
    recent: tuple[WindowChoice, ...] = ()

    @model_validator(mode="after")
    def _shapes(self) -> Calibration:
        for w in self.widths:
            if w not in BUDGET_WIDTHS:
                raise invalid("widths", f"width {w} is not one of {BUDGET_WIDTHS}")
        if list(self.groups) != sorted(set(self.groups)) or any(g <= 0 for g in self.groups):
            raise invalid("groups", f"groups {list(self.groups)}: positive, increasing")
        for ls in self.layers:
            rows = [ls.key, ls.value] + [r for r in (ls.value_rotated, ls.key_normal,
                                                      ls.value_normal, ls.key_meta8,
                                                      ls.value_meta8, ls.value_vq,
                                                      ls.value_vq_books) if r is not None]
            if any(len(row) != len(self.widths) for row in rows):
                raise invalid(
                    "layers",
                    f"layer {ls.layer}: {len(ls.key)} key and {len(ls.value)} value errors for "
                    f"{len(self.widths)} widths",
                )
            for name in GROUP_TABLES:
                table = getattr(ls, name)
                if table is not None and (len(table) != len(self.groups) or any(
                        len(row) != len(self.widths) for row in table)):
                    raise invalid(
                        "layers",
                        f"layer {ls.layer}: {name} is not {len(self.groups)} groups x "
                        f"{len(self.widths)} widths",
                    )
        return self

    def _layer(self, layer: int) -> LayerSensitivity:
        for ls in self.layers:
            if ls.layer == layer:
                return ls
        raise KeyError(f"layer {layer} is not in this calibration")

    def errors(self, layer: int, tensor: TensorKind | str, rotated: bool = False,
               group: int | None = None, normal: bool = False, meta8: bool = False
               ) -> dict[int, float]:
        """``{width: error}`` of one tensor, feasible widths only (``rotated``: the value's
        errors with the Hadamard rotation; ``normal``: with normal levels; ``meta8``: with
        8-bit scales and zeros; each empty if not measured; ``group``: at that candidate
        group size, empty if not measured; None: at the policy's own group); KeyError if
        the layer was not measured. Vector-quantized values: :meth:`vq_errors`."""
        kind = TensorKind(tensor).value
        ls = self._layer(layer)
        if (rotated and (normal or kind == "key")) or (meta8 and (rotated or normal)):
            return {}  # not measured: keys are not rotated, 8-bit metadata is uniform only
        name = (kind + ("_rotated" if rotated else "") + ("_normal" if normal else "")
                + ("_meta8" if meta8 else ""))
        if group is not None:
            table = getattr(ls, f"{name}_groups")
            if table is None or group not in self.groups:
                return {}
            row = table[self.groups.index(group)]
        else:
            row = getattr(ls, name)
            if row is None:
                return {}
        return {w: e for w, e in zip(self.widths, row, strict=True) if e is not None}

    def recent_errors(self, layer: int, tensor: TensorKind | str
                      ) -> dict[tuple[int, int], tuple[float, float]]:
        """``{(tokens, bits): (body error, window error)}`` of one tensor's window choices
        (:attr:`LayerSensitivity.key_recent`); empty where not measured."""
        row = getattr(self._layer(layer), f"{TensorKind(tensor).value}_recent")
        return {} if row is None else dict(zip(self.recent, row, strict=True))

    def vq_errors(self, layer: int) -> dict[int, tuple[float, str]]:
        """``{width: (error, codebook text)}`` of one layer's value vector-quantized
        (:attr:`LayerSensitivity.value_vq`); empty if not measured."""
        ls = self._layer(layer)
        if ls.value_vq is None or ls.value_vq_books is None:
            return {}
        return {w: (e, b) for w, e, b in zip(self.widths, ls.value_vq, ls.value_vq_books,
                                             strict=True) if e is not None and b}
