"""What kvpolicy keeps on a model: one record, under one attribute.

``analyse_model`` caches its analysis here, ``derive_policy`` the spec a policy came from
(for ``save_policy``), and ``compile_model`` the policy in use and the compiled runtime.
The record is set with ``object.__setattr__`` so that it is never registered as a
submodule or parameter of the ``nn.Module``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ATTRIBUTE", "ModelState", "state_of", "compiled_of"]

ATTRIBUTE = "_kvpolicy"


@dataclass
class ModelState:
    """kvpolicy's record on one model (types named in comments to keep this module at the
    bottom of the dependency order)."""

    analysis: Any = None  # analysis.analyse.ModelAnalysis
    spec: Any = None  # policy.PolicySpec behind the last derived policy
    policy: Any = None  # policy.ModelPolicy of the compiled model
    compiled: Any = None  # runtime.install.CompiledModel

    def __deepcopy__(self, memo: dict[int, Any]) -> ModelState:
        """A copy for ``copy.deepcopy(model)``: the analysis is a cache of this model's
        trace (exported graphs holding fake tensors, which cannot be copied) and is left
        out, so the copy traces itself again when asked; the rest is copied."""
        import copy

        return ModelState(None, *(copy.deepcopy(getattr(self, f), memo)
                                  for f in ("spec", "policy", "compiled")))


def state_of(model: object) -> ModelState:
    """The record of ``model``, created empty on first use."""
    st = model.__dict__.get(ATTRIBUTE)
    if st is None:
        st = ModelState()
        object.__setattr__(model, ATTRIBUTE, st)
    return st


def compiled_of(model: object) -> Any:
    """The ``CompiledModel`` of a compiled model, else None."""
    st = model.__dict__.get(ATTRIBUTE)
    return None if st is None else st.compiled
