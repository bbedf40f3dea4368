"""The public entry points: ``compile_model``, ``derive_policy``, ``inspect``, ``save_policy``.

Each is a few lines over the pipeline (docs/design.md §4): *analyse* (``kvpolicy.passes``)
-> *derive* (``kvpolicy.policies``; a bit budget through ``kvpolicy.calibrate``) -> *rewrite*
and check (``kvpolicy.compiler``) -> *install* (``kvpolicy.runtime``).
"""

from __future__ import annotations

import inspect as _inspect
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .calibrate.apply import budget_policy, channel_policy, channel_text, uniform_widths
from .calibrate.channels import spreads
from .calibrate.vq import codebook_policy, pending_vq, vq_text
from .compiler import compile_blocks
from .errors import KVPolicyError, PolicyError
from .kernels.backend import check_name as check_backend
from .passes.analyse import analyse_model
from .passes.config import sliding_windows
from .policies import Calibration, ModelPolicy, PolicySpec, build_policy, load_spec
from .policies.derive import local_residuals, whole_cache_residuals
from .runtime.install import CompiledModel, install
from .state import compiled_of, state_of

__all__ = ["analyse_model", "compile_model", "derive_policy", "inspect", "save_policy"]

log = logging.getLogger(__name__)

def _model_name(model: nn.Module) -> str:
    path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return Path(path).name if path else type(model).__name__


def derive_policy(
    model: nn.Module,
    bits: int | float = 2,
    policy: str | Path | Mapping[str, Any] | PolicySpec | None = None,
    calibration: Any = None,
    progress: bool = True,
    probe_kwargs: Callable[[Any], dict[str, Any]] | None = None,
    stored_bits: float | None = None,
    vq_values: bool = True,
) -> ModelPolicy:
    """Derive the quantization policy of every cached tensor of ``model``.

    Args:
        model: a ``transformers`` causal LM or any ``nn.Module`` whose forward takes token
            ids and runs attention (``scaled_dot_product_attention`` or
            matmul -> softmax -> matmul).
        bits: code width when ``policy`` is None (the ``kvpolicy-<bits>`` preset). A float
            (``2.5``, also ``3.0``) is a budget: the average code bits per cached element,
            spread over the tensors by their measured sensitivity (``kvpolicy.calibrate.budget``).
        policy: a preset name (``"kivi-2"``), a YAML path, a dict or a ``PolicySpec``.
        calibration: for a budget and for ``channel_widths: auto`` (the default's
            per-channel key widths): ``[B, T]`` token ids to measure on, a tokenizer for
            the default text, or (a budget only) a ``Calibration`` measured before. Default:
            the policy file's saved calibration, else the end of the pydoc text in the
            tokenizer saved beside the model (512 tokens for the widths, 4 rows of 512 for
            a budget); with none, the default keeps one key width.
        progress: show a progress bar while calibrating.
        probe_kwargs: ``ids -> {keyword: value}`` passed to the analysis's probe forwards
            beside the token ids, for a model that takes its cached path only when given
            more (gpt-fast's ``input_pos``); see ``compile_model``.
        stored_bits: a budget of average *stored* bits per cached element, scales and
            zeros included (see ``compile_model``); excludes a float ``bits``.
        vq_values: let a stored-bits budget price vector-quantized values (``levels:
            auto``); False keeps it to scalar codes (a comparison without them).

    Returns:
        A ``ModelPolicy``: per layer, key then value, axis/bits/group/pre-RoPE/residual/
        sinks with the contraction found and a reason. The spec it came from (with the
        calibration, for a budget) is kept on the model for ``save_policy``.

    Raises:
        PolicyError: the policy is invalid or does not fit the model.
        AnalysisError: the graph has no attention the analysis understands.
    """
    spec = load_spec(policy, bits=bits, stored_bits=stored_bits)
    analysis = analyse_model(model, probe_kwargs)
    if spec.budget is not None and probe_kwargs is not None:
        raise KVPolicyError(
            "a bit budget calibrates with plain forwards of token ids, which a model that "
            "needs probe_kwargs does not take its cached path on; give an int width or a "
            "policy with every width set"
        )
    result = build_policy(analysis.layers, spec, model_name=_model_name(model))
    result = whole_cache_residuals(result, spec)
    result = local_residuals(result, spec, sliding_windows(model, len(analysis.layers)))
    if spec.budget is None and any(t.rotation == "auto" for t in result.tensors):
        raise PolicyError(
            f"{spec.source}: rotation: auto is chosen per tensor from a bit budget's "
            "calibration; give a budget (bits=2.5) or rotation: none / hadamard"
        )
    if spec.budget is not None and any(t.levels == "vq" for t in result.tensors):
        raise PolicyError(
            f"{spec.source}: levels: vq is written under a bit budget, whose calibration "
            "measures scalar widths; leave levels: auto (a stored-bits budget prices vq "
            "values itself), or give a fixed width (bits: 2) for levels: vq"
        )
    text = None
    if any(t.channel_widths == "auto" for t in result.tensors):
        # Decided before a budget, whose calibration prices the keys' widths with them.
        ids = calibration if isinstance(calibration, torch.Tensor) else None
        tok = None if calibration is None or ids is not None or isinstance(
            calibration, Calibration) else calibration
        written = ("channel_widths" in spec.defaults.model_fields_set
                   or any(r.channel_widths == "auto" for r in spec.overrides))
        wanted = spec.budget is not None or written or any(
            t.channel_widths == "auto" and spreads(t.bits) for t in result.tensors)
        text = channel_text(model, ids, tok, written, probe_kwargs is None) if wanted else None
        if text is None:
            result = uniform_widths(result)
    if spec.budget is not None:
        result, cal = budget_policy(model, result, spec, calibration, progress=progress,
                                    vq_values=vq_values)
        spec = spec.model_copy(update={"calibration": cal})
    if text is not None:
        result = channel_policy(model, result, text, written)
    if pending_vq(result):  # written levels: vq (a budget's choice brings its codebook)
        result = codebook_policy(
            model, result, text or vq_text(model, calibration, probe_kwargs is None))
    state_of(model).spec = spec
    return result


def save_policy(model: nn.Module, path: str | Path) -> Path:
    """Write the spec behind ``model``'s last derived or compiled policy as a YAML policy
    file, with its calibration for a budget: compiling from that file gives the same widths
    and layout without calibrating them again. Fitted ``levels: vq`` codebooks are not
    written (a policy file has no field for them): compiling from the file refits them on
    calibration text, so it needs a tokenizer or ``calibration`` again.

    Raises:
        KVPolicyError: no policy was derived for ``model`` yet.
    """
    spec = state_of(model).spec
    if spec is None:
        raise KVPolicyError(
            f"no policy was derived for this {type(model).__name__} yet; call "
            "kvpolicy.compile_model or kvpolicy.derive_policy first"
        )
    out = Path(path)
    out.write_text(spec.to_yaml(), encoding="utf-8")
    return out


def inspect(model: nn.Module) -> ModelPolicy:
    """The policy of ``model``: the attached one for a compiled model, else the derived
    ``kvpolicy-2`` default."""
    attached = state_of(model).policy
    if attached is not None:
        return attached
    return derive_policy(model)


def compile_model(
    model: nn.Module,
    bits: int | float = 2,
    policy: Any = None,
    backend: str = "auto",
    calibration: Any = None,
    progress: bool = True,
    probe_kwargs: Callable[[Any], dict[str, Any]] | None = None,
    stored_bits: float | None = None,
) -> nn.Module:
    """Rewrite every attention block of ``model`` onto a packed, quantized KV cache.

    Args:
        model: a transformers causal LM or any module whose forward takes token ids.
        bits: code width when ``policy`` is None (the ``kvpolicy-<bits>`` preset; 16 keeps
            everything in full precision), or a float budget such as ``2.5``: the average
            code bits per cached element, allocated per tensor from its sensitivity measured
            where it is consumed (a calibration forward and backward per row of calibration
            text; see ``kvpolicy.calibrate.budget``).
        policy: preset name, YAML path, dict or ``PolicySpec`` (see ``derive_policy``).
        backend: ``"torch"``, ``"triton"`` or ``"auto"`` (triton for CUDA tensors).
        calibration: for a budget: token ids, a tokenizer or a saved ``Calibration`` (see
            ``derive_policy``); ``kvpolicy.save_policy(model, path)`` writes it into a
            policy file so that a later compile skips calibrating.
        progress: show a progress bar while calibrating.
        probe_kwargs: for a module whose forward takes its cached path only when given
            more than token ids: ``ids [B, T] -> {keyword: value}`` added to the probe
            forwards. A gpt-fast-style module that writes K/V into preallocated buffers at
            ``input_pos`` (``setup_caches`` first, for at least 3 rows) is compiled with
            ``probe_kwargs=lambda ids: {"input_pos": torch.arange(ids.shape[1])}``; its own
            decode loop (``model(ids, input_pos)``) then reads and writes a packed cache
            that stands in for the buffers, kept across calls (a call at position 0 starts
            a new sequence).
        stored_bits: a budget of average *stored* bits per cached element instead of code
            bits: codes plus a scale and a zero (fp16) per group, so 2-bit codes cost 3.0 in
            groups of 32, 2.5 in groups of 64 and 2.25 in groups of 128. Widths and group
            sizes are allocated together per tensor from measured costs (``group_size``
            not given: each tensor's group is chosen among 32, 64 and 128 where they
            fit). The policy YAML key is ``defaults: {stored_bits: 3.0}``. Give it or a
            float ``bits``, not both. The full-precision sink and residual windows are
            not counted, unless the policy writes ``budget_context: 4096``: then the
            budget counts the whole cache each layer holds after that many tokens.

    Returns:
        The same model object, compiled: ``model.generate`` and manual decode loops work
        unchanged and return a ``KVPolicyCache``; ``kvpolicy.inspect(model)`` gives the
        policy in use.

    Raises:
        KVPolicyError: compiled twice; a bad backend; a policy or graph kvpolicy cannot
            handle. The model is left unchanged.
    """
    if not isinstance(model, nn.Module):
        hint = " (zoo.load returns (model, tokenizer))" if isinstance(model, tuple) else ""
        raise KVPolicyError(
            f"compile_model needs a torch.nn.Module, got {type(model).__name__}{hint}"
        )
    if compiled_of(model) is not None:
        raise KVPolicyError(
            f"{type(model).__name__} is already compiled by kvpolicy; compile a fresh copy "
            "of the original model to change the policy"
        )
    check_backend(backend)
    spec = load_spec(policy, bits=bits, stored_bits=stored_bits)
    pol = derive_policy(model, bits=bits, policy=spec, calibration=calibration,
                        progress=progress, probe_kwargs=probe_kwargs)
    analysis = analyse_model(model, probe_kwargs)
    kinds = compile_blocks(model, analysis, pol)

    # Nothing below can fail on a model that got this far: install.
    params = _inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in params else (
        "past_key_values" if "past_key_values" in params else None
    )
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    layer_kind = [lf.block_kind for lf in analysis.layers]
    windows = {i: w for i, w in enumerate(pol.windows) if w is not None}
    install(model, CompiledModel(pol, backend, analysis, kinds, layer_kind, cache_kw, dtype,
                                 windows))
    log.info("compiled %d attention layers (%d block kinds)", len(layer_kind), len(kinds))
    return model


