"""Measure a policy where it matters: ``evaluate`` (``kvpolicy eval``).

On the same segments of pydoc text (or random tokens for ``quick``), every run is scored
by teacher-forced decode through its cache (:mod:`kvpolicy.evaluation.decode`,
docs/design.md §3): the full-precision cache, the derived policy, its ablations through
the public override API (axes, pre/post-RoPE keys, residual, sinks, bits), bit budgets
(``FRONTIER_BUDGETS``, allocated from one calibration; the middle one once more from the
``relative`` currency of ``budget.CALIBRATION_METRICS``, to show what the default's loss
weighting buys), stored-bits budgets (``STORED_BUDGETS``: widths and group sizes allocated,
scales and zeros counted, from one more calibration; :mod:`kvpolicy.evaluation.stored`)
and the peer (transformers' quanto ``QuantizedCache``) with its default
and its best axes, with cache bytes and decode-step wall time beside each perplexity, and
the KL divergence and top-1 agreement of each run's next-token distributions with the
full-precision run's on the same steps; the retrieval check
(:mod:`kvpolicy.evaluation.retrieval`: a passage, then the same passage, scored on the
second copy) for the full-precision cache, the derived policy, ``RETRIEVAL_BUDGET`` and the
peer at its best axes; then the where-consumed axis study
(:mod:`kvpolicy.evaluation.axis_study`). The results
(:mod:`kvpolicy.evaluation.report`) go to ``report.md``, ``report.json`` and PNG plots.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from .. import zoo
from ..api import compile_model, derive_policy
from ..api import inspect as inspect_policy
from ..calibrate import budget
from ..errors import KVPolicyError, PolicyError
from ..passes.analyse import analyse_model
from ..policies import (
    BUDGET_WIDTHS,
    Defaults,
    build_policy,
    is_budget,
    load_spec,
    metadata_at,
)
from ..policies.footprint import CONTEXT, whole_cache
from ..policies.rules import META8_WIDTHS, meta8_rotates_values
from ..zoo import text
from ..zoo.tiny import tiny_model
from .axis_study import consumed_study
from .decode import NextTokenReference, decode_perplexity
from .peer_rows import check_peer_context, peer_runs
from .peers import cache_bytes
from .report import EvalReport, RetrievalResult, RunResult, frontier_dominance, write_report
from .retrieval import retrieval_task, score_retrieval
from .stored import (
    QUICK_STORED_GROUPS,
    STORED_BUDGETS,
    WHOLE_BUDGETS,
    stored_calibration,
    stored_specs,
)

__all__ = ["evaluate", "ablations", "FRONTIER_BUDGETS", "STORED_BUDGETS", "RETRIEVAL_BUDGET",
           "RETRIEVAL_TOKENS"]

log = logging.getLogger(__name__)

# Bit budgets of the frontier (average code bits per cached element; a float is always a
# budget, so 3.0 is allocated, not uniform 3 bits). One calibration serves all of them.
FRONTIER_BUDGETS: tuple[float, ...] = (2.25, 2.5, 3.0)
# The budget of the retrieval rows (one of FRONTIER_BUDGETS: its run is reused).
RETRIEVAL_BUDGET = 2.5
# Ablations that also run the retrieval check: what the 2-bit default replaced.
RETRIEVAL_ABLATIONS = ("fp16 metadata, groups of 32", "groups of 16 (8-bit metadata)",
                       "one width per key")
# Default passage length of the retrieval check; ``quick`` uses QUICK_RETRIEVAL_TOKENS.
RETRIEVAL_TOKENS = 1024
QUICK_RETRIEVAL_TOKENS = 48
# The axis study measures errors on T x T attention matrices of every layer: its prefill
# is cut to this many tokens so that a long --context stays within memory (at 8,192 tokens
# SmolLM2's 9 heads would need 2.4 GB per score matrix).
STUDY_TOKENS = 1024


def ablations(bits: int | float) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, group, overrides on top of the user's spec) of every ablation run."""
    key, value = {"layers": "*", "tensor": "key"}, {"layers": "*", "tensor": "value"}
    return [
        ("K token / V token", "axes", {"overrides": [{**key, "axis": "token"}]}),
        ("K channel / V channel", "axes", {"overrides": [{**value, "axis": "channel"}]}),
        ("K token / V channel", "axes",
         {"overrides": [{**key, "axis": "token"}, {**value, "axis": "channel"}]}),
        ("keys post-RoPE", "rope", {"overrides": [{**key, "pre_rope": False}]}),
        # One of the two is the derived run (rules.META8_ROTATE_VALUES).
        ("values rotated (Hadamard)", "rotation", {"defaults": {"rotation": "hadamard"}}),
        ("values not rotated", "rotation", {"defaults": {"rotation": "none"}}),
        # What the 2-bit default replaced, at 3.0 stored bits (rules.META8_GROUPS).
        ("fp16 metadata, groups of 32", "metadata", {"defaults": {"meta_bits": 16}}),
        *([("groups of 16 (8-bit metadata)", "metadata",
            {"overrides": [{**key, "group_size": 16, "meta_bits": 8},
                           {**value, "group_size": 16, "meta_bits": 8}]})]
          if isinstance(bits, int) and bits in META8_WIDTHS else []),
        ("one width per key", "channel widths", {"defaults": {"channel_widths": "uniform"}}),
        ("normal levels, keys", "levels", {"overrides": [{**key, "levels": "normal"}]}),
        ("normal levels, keys and values", "levels", {"defaults": {"levels": "normal"}}),
        ("residual 0", "residual", {"defaults": {"residual": 0}}),
        ("residual 32", "residual", {"defaults": {"residual": 32}}),
        ("residual 128", "residual", {"defaults": {"residual": 128}}),
        ("sinks 0", "sinks", {"defaults": {"sinks": 0}}),
        ("sinks 4", "sinks", {"defaults": {"sinks": 4}}),
        *[(f"{b} bits", "bits", {"defaults": {"bits": b}}) for b in (2, 3, 4)],
        # The same 2.5 bits split by hand, each way, against the budget's own allocation.
        *([
            ("keys 3 / values 2", "split",
             {"overrides": [{**key, "bits": 3}, {**value, "bits": 2}]}),
            ("keys 2 / values 3", "split",
             {"overrides": [{**key, "bits": 2}, {**value, "bits": 3}]}),
        ] if isinstance(bits, int) else []),
    ]


def _merge(spec_dict: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``spec_dict`` with ``extra``'s defaults updated over it and its overrides appended; a
    width in ``extra`` replaces a stored-bits budget of ``spec_dict`` (and what only a
    budget takes: its context or pages, ``residual: auto``)."""
    out = {"defaults": dict(spec_dict.get("defaults", {})),
           "overrides": list(spec_dict.get("overrides", []))}
    if "bits" in extra.get("defaults", {}) and "stored_bits" in out["defaults"]:
        for k in ("stored_bits", "budget_context", "budget_pages"):
            out["defaults"].pop(k, None)
        if out["defaults"].get("residual") == "auto":
            del out["defaults"]["residual"]
    out["defaults"].update(extra.get("defaults", {}))
    out["overrides"] += extra.get("overrides", [])
    return out


def _elements_per_token(model) -> int | None:
    a = analyse_model(model)
    return sum(lf.key.num_kv_heads * (lf.key.head_dim + lf.value.head_dim) for lf in a.layers)


def evaluate(
    model: str = "smollm2-135m",
    *,
    bits: int | float = 2,
    policy: Any = None,
    segments: int = 4,
    context: int = 768,
    steps: int = 256,
    out: str | Path | None = None,
    quick: bool = False,
    peers: bool = True,
    retrieval: int | None = None,
    passages: int | None = None,
    text_file: str | Path | None = None,
    progress: bool = True,
    stored_budgets: Sequence[float] = STORED_BUDGETS,
    whole_budgets: Sequence[float] = WHOLE_BUDGETS,
    ablate: bool = True,
) -> EvalReport:
    """Run the full comparison; see the module docstring.

    Args:
        model: a zoo name (``"smollm2-135m"``) or ``"tiny-<arch>"``.
        bits, policy: the policy under test, as for ``compile_model`` (a float ``bits`` is
            a budget; its runs calibrate on the segments' source, see ``_loader``).
        segments, context, steps: text to score (segments decode as one batch);
            ``context + steps`` may be up to the model's ``max_position_embeddings``.
        out: folder for ``report.md``, ``report.json`` and the plots.
        quick: a tiny random model, random tokens, short context: a smoke test.
        peers: also run transformers' quanto ``QuantizedCache`` (needs optimum-quanto).
        retrieval: tokens per passage of the retrieval check (``segments`` passages, each
            followed by itself; 0 skips it; ``quick`` makes it ``QUICK_RETRIEVAL_TOKENS``);
            default ``RETRIEVAL_TOKENS``, or half the model's positions if fewer.
        passages: how many retrieval passages (default ``segments``), e.g. several at a
            long ``context`` scored on one segment.
        text_file: a UTF-8 text to cut the segments and retrieval passages from instead of
            the pydoc text (a budget still calibrates on the end of the pydoc text, so that
            the scored text is never the calibration's).
        stored_budgets: stored-bits budgets of the frontier (rows ``"stored budget B"``,
            one calibration for all; empty skips them); ``quick`` chooses groups among
            ``QUICK_STORED_GROUPS``, else among ``GROUP_CHOICES``.
        whole_budgets: stored-bits budgets over the whole cache at ``CONTEXT`` tokens (rows
            ``"whole-cache budget B"``, one more calibration; empty skips them). A budget
            the allocator refuses is a note, not a row.
        ablate: False skips every ablation but the uniform widths (the frontier's
            reference points) and the code-bit budgets with their currency row: the
            frontier of the derived policy, the stored-bits and whole-cache budgets and the
            peers, in a fraction of the time.

    Raises:
        KVPolicyError: ``context + steps`` or ``2 * retrieval`` exceeds the model's positions,
            or the text is too short for the segments.
    """
    start = time.perf_counter()
    if quick:
        model, segments, context, steps = "tiny-llama", 2, 64, 16
        retrieval = 0 if retrieval == 0 else QUICK_RETRIEVAL_TOKENS
        if policy is None:  # a window and groups small enough for 80 tokens to be packed
            policy = {"defaults": {"bits": bits, "group_size": 16, "residual": 16, "sinks": 2}}
    if retrieval is not None and retrieval < 0:
        raise KVPolicyError(f"retrieval={retrieval}: give a passage length, or 0 to skip it")
    if passages is not None and passages < 1:
        raise KVPolicyError(f"passages={passages}: give at least 1 retrieval passage (or "
                            "retrieval=0 to skip the check)")
    if text_file is not None and (quick or model.startswith("tiny-")):
        raise KVPolicyError("--text needs a model with a tokenizer; a tiny model (and "
                            "--quick) scores random tokens")
    source = None if text_file is None else text.read_text(text_file)
    load, segs, cal_input, passages = _loader(model, segments, context, steps, retrieval,
                                              source, passages)
    user = _spec_dict(policy, bits)
    runs: list[RunResult] = []
    notes: list[str] = []
    try:  # the prefill in whole groups: quanto's per-channel axes quantize whole groups
        task = (None if passages is None
                else retrieval_task(passages, multiple=load_spec(user).defaults.group_size))
    except ValueError as exc:
        raise KVPolicyError(f"--retrieval {passages.shape[1]}: {exc}") from exc

    fp_model = load()
    per_token = _elements_per_token(fp_model)
    if peers:  # fail now, not after the fp and policy runs
        check_peer_context(fp_model, context, user)
    # NOTE: the reference holds fp16 log-probs of every scored step: segments x steps x
    # vocab x 2 bytes (4 x 256 x 49,152 x 2 = 100 MB for SmolLM2 at the defaults).
    ref = NextTokenReference()
    fp = decode_perplexity(fp_model, segs, context, steps, desc="fp", progress=progress,
                           batched=True, reference=ref, record=True)
    fp_bytes = _fp16_bytes(per_token, segs.shape[0], context + steps)
    held = _held_bytes(fp.cache)  # transformers' DynamicCache, in the model's dtype
    runs.append(RunResult(
        "full precision (DynamicCache)", "headline", fp.perplexity, 1.0, held, fp_bytes,
        held * 8 / (fp_bytes / 2) if held and fp_bytes else None, fp.seconds_per_step * 1e3,
        kl=fp.kl, top1_agreement=fp.agreement,
    ))
    # Retrieval rows compare argmaxes only: fp log-probs of every step would be
    # passages x retrieval x vocab x 2 bytes more.
    retrieval_ref = NextTokenReference(log_probs=False)
    retrieved: dict[str, RetrievalResult] = {}
    if task is not None:
        fp.cache = None  # the fp run's cache is counted: free it before the next prefill
        retrieved["full precision (DynamicCache)"] = score_retrieval(
            fp_model, task, "full precision (DynamicCache)", reference=retrieval_ref,
            record=True, progress=progress)
    del fp_model

    def run_policy(name: str, group: str, spec: dict[str, Any],
                   calibration: Any = None, retrieve: bool = False) -> RunResult:
        """Compile a fresh model with ``spec`` and score it (with ``retrieve``, on the
        retrieval task too). ``calibration``: for a budget, a measured ``Calibration``
        (default: measure on ``cal_input``)."""
        m = compile_model(load(), policy=spec, progress=progress,
                          calibration=cal_input if calibration is None else calibration)
        pol = inspect_policy(m)
        res = decode_perplexity(m, segs, context, steps, desc=name, progress=progress,
                                batched=True, reference=ref)
        mem = res.cache.memory_report()
        elems = per_token * segs.shape[0] * mem["tokens"] if per_token else None
        r = RunResult(
            name, group, res.perplexity, res.perplexity / fp.perplexity, mem["bytes"],
            mem["fp16_bytes"], mem["bytes"] * 8 / elems if elems else None,
            res.seconds_per_step * 1e3, spec, avg_bits=pol.avg_bits,
            avg_stored_bits=pol.avg_stored_bits(), bytes_per_token=pol.bytes_per_token(),
            fp16_bytes_per_token=pol.fp16_bytes_per_token,
            measured_bytes_per_token=_packed_bytes_per_token(mem, segs.shape[0]),
            kl=res.kl, top1_agreement=res.agreement,
            whole_bits=whole_cache(pol, CONTEXT).bits,
        )
        if pol.budget is not None:
            r.settings = {**spec, "budget": pol.budget, "budget_unit": pol.budget_unit,
                          "layers": list(pol.layers),
                          "key_bits": [pol.get(i, "key").bits for i in pol.layers],
                          "value_bits": [pol.get(i, "value").bits for i in pol.layers]}
            if pol.budget_unit == "stored":  # the group sizes and metadata widths too
                for kind in ("key", "value"):
                    r.settings[f"{kind}_groups"] = [pol.get(i, kind).group_size
                                                    for i in pol.layers]
                    r.settings[f"{kind}_meta_bits"] = [pol.get(i, kind).stored_meta_bits
                                                       for i in pol.layers]
        runs.append(r)
        if retrieve and task is not None:
            res.cache = None
            retrieved[name] = score_retrieval(m, task, name, reference=retrieval_ref,
                                              settings=r.settings, progress=progress)
        return r

    derived = run_policy("derived policy", "headline", user, retrieve=True)
    seen = {json.dumps(user, sort_keys=True): derived}
    for name, group, extra in ablations(bits):
        if not ablate and group != "bits":
            continue
        spec = _merge(user, extra)
        key = json.dumps(spec, sort_keys=True)
        if key in seen or _same_as(spec, user):
            same = seen.get(key, derived)
            runs.append(replace(same, name=name, group=group, settings=spec))
            continue
        seen[key] = run_policy(name, group, spec, retrieve=name in RETRIEVAL_ABLATIONS)

    frontier: dict[str, Any] = {}
    if ablate:
        frontier = _budget_rows(run_policy, runs, seen, retrieved, load, user, cal_input, notes,
                                progress)
    else:
        notes.append("ablations (other than the uniform widths) and the code-bit budgets "
                     "skipped (--no-ablations)")
    if stored_budgets:  # widths and groups under stored bits, from one more calibration
        specs = stored_specs(user, stored_budgets, QUICK_STORED_GROUPS if quick else None)
        frontier["stored"], stored_cal = stored_calibration(load, specs, cal_input, notes,
                                                            progress)
        for name, spec in specs:
            run_policy(name, "stored", spec, calibration=stored_cal, retrieve=True)
    if whole_budgets:  # the same over the whole cache: another residual, another calibration
        _whole_rows(run_policy, load, user, whole_budgets, quick, cal_input, notes, frontier,
                    progress)

    if peers:
        quanto_rows, peer_retrieved = peer_runs(load, segs, context, steps, fp.perplexity,
                                                user, per_token, progress, notes, ref, task,
                                                retrieval_ref)
        runs += quanto_rows
        retrieved.update(peer_retrieved)
    frontier["dominated_by"] = frontier_dominance(runs)
    study_bits = bits
    if isinstance(bits, float):  # a budget: the axis study compares axes at one width
        study_bits = max(w for w in BUDGET_WIDTHS if w <= bits)
        notes.append(f"the where-consumed axis study measured every tensor at {study_bits} "
                     f"bits (bits={bits:g} is a budget)")
    study_context = min(context, STUDY_TOKENS)
    if study_context < context:
        notes.append(f"the where-consumed axis study measured the first {study_context} "
                     f"tokens of the first segment (its errors need T x T score matrices)")
    consumed = consumed_study(load, segs, study_context, study_bits, runs)
    setup = None if task is None else {
        "passages": task.ids.shape[0], "length": task.length, "prefix": task.prefix,
        "steps": task.steps,
        "source": "random" if model.startswith("tiny-") else str(text_file or "pydoc"),
    }
    report = EvalReport(model, segs.shape[0], context, steps, runs,
                        time.perf_counter() - start, consumed, notes, frontier,
                        list(retrieved.values()), setup,
                        "random" if model.startswith("tiny-") else str(text_file or "pydoc"))
    if out is not None:
        write_report(report, Path(out))
    return report


def _budget_rows(run_policy, runs, seen, retrieved, load, user, cal_input, notes,
                 progress) -> dict[str, Any]:
    """The code-bit budget rows of FRONTIER_BUDGETS (one calibration) and the middle one's
    relative-error currency row; returns the frontier record."""
    frontier, budget_specs, cal = _frontier_calibration(load, user, cal_input, notes, progress)
    retrieval_budget = f"budget {RETRIEVAL_BUDGET:g}"
    for name, spec in budget_specs:
        key = json.dumps(spec, sort_keys=True)
        if key in seen:  # the user's own budget: the derived policy's run
            same = seen[key]
            runs.append(replace(same, name=name, group="budget", settings=same.settings))
            if name == retrieval_budget and same.name in retrieved:
                retrieved[name] = replace(retrieved[same.name], name=name)
            continue
        seen[key] = run_policy(name, "budget", spec, calibration=cal,
                               retrieve=name == retrieval_budget)
    # The middle budget once more, allocated from the plain relative output error: what the
    # loss weighting of the default currency buys.
    mid_name, mid_spec = budget_specs[len(budget_specs) // 2]
    relative = _relative_calibration(load, mid_spec, cal, cal_input, progress)
    run_policy(f"{mid_name}, relative-error currency", "currency", mid_spec,
               calibration=relative)
    return frontier


def _frontier_calibration(
    load, user, cal_input, notes, progress
) -> tuple[dict[str, Any], list[tuple[str, dict[str, Any]]], Any]:
    """``(frontier record, [(run name, spec)] per budget of FRONTIER_BUDGETS, calibration)``:
    the budget runs are the user's spec with only ``bits`` changed, so one calibration (on a
    fresh model, with those settings) serves them all."""
    specs = [(b, _merge(user, {"defaults": {"bits": float(b)}})) for b in FRONTIER_BUDGETS]
    for b, spec in specs:
        if load_spec(spec).budget is None:  # a budget run must allocate, never go uniform
            raise ValueError(f"frontier budget {b!r} does not load as a bit budget")
    t0 = time.perf_counter()
    base = derive_policy(load(), policy=specs[0][1], calibration=cal_input, progress=progress)
    cal = base.calibration
    wall = time.perf_counter() - t0
    notes.append(
        f"budget runs: widths allocated from one calibration on {cal.source} "
        f"({cal.rows}x{cal.tokens} tokens), measured in {cal.seconds:.1f} s "
        f"({wall:.1f} s with the policy derivation)"
    )
    record = {
        "budgets": list(FRONTIER_BUDGETS),
        "calibration": {"source": cal.source, "rows": cal.rows, "tokens": cal.tokens,
                        "seconds": cal.seconds, "wall_seconds": round(wall, 3),
                        "settings": cal.settings},
    }
    return record, [(f"budget {b:g}", spec) for b, spec in specs], cal


def _relative_calibration(load, spec: dict[str, Any], cal, cal_input, progress: bool):
    """The calibration of ``spec``'s settings on the same input as ``cal``, in the
    ``relative`` currency (``budget.CALIBRATION_METRICS``) instead of the default one."""
    model = load()
    # The policy as built from the spec, before allocation: its auto settings (rotation,
    # levels) are what a calibration measures both ways and what the runs are keyed on.
    policy = build_policy(analyse_model(model).layers, load_spec(spec), model_name=cal.model)
    return budget.calibrate_on(model, policy, cal_input, metric="relative", progress=progress)


def _packed_bytes_per_token(mem: dict[str, Any], batch: int) -> float | None:
    """Bytes per token of the quantized body measured on a kvpolicy cache: per layer, codes +
    scales + zeros over its packed tokens (times the batch), summed over layers; None
    while some layer has packed nothing."""
    total = 0.0
    for layer in mem["layers"]:
        if not layer["packed_tokens"]:
            return None
        body = layer["code_bytes"] + layer["scale_bytes"] + layer["zero_bytes"]
        total += body / (layer["packed_tokens"] * batch)
    return total


def _held_bytes(cache) -> int | None:
    try:
        return cache_bytes(cache).total
    except KVPolicyError as exc:  # a cache type peers cannot count: no figure, said why
        log.info("cache bytes of %s not measured: %s", type(cache).__name__, exc)
        return None


def _same_as(spec: dict[str, Any], user: dict[str, Any]) -> bool:
    """An ablation that only restates the user's own settings."""
    if spec.get("overrides") != user.get("overrides"):
        return False
    return _fixed_meta(load_spec(spec).defaults) == _fixed_meta(load_spec(user).defaults)


def _fixed_meta(d: Defaults) -> Defaults:
    """``d`` with ``meta_bits: auto`` resolved where a fixed width resolves it the same for
    every tensor of the defaults (``rules.metadata_at``)."""
    if d.stored_bits is not None:  # the allocator chooses per tensor
        return d
    meta = metadata_at(d.meta_bits, d.bits, d.levels, "group_size" not in d.model_fields_set,
                       is_budget(d.bits))
    update: dict[str, Any] = {"meta_bits": meta}
    if meta8_rotates_values(d.meta_bits, meta, "rotation" in d.model_fields_set):
        update["rotation"] = "hadamard"  # what derive does for a power-of-two head_dim
    return d.model_copy(update=update)


def _spec_dict(policy: Any, bits: int | float) -> dict[str, Any]:
    """The policy under test as a document the ablations extend. A default nobody wrote
    (``model_fields_set``) that holds kvpolicy's own value is left out, so that it stays
    unwritten when the document loads again (a written ``group_size`` keeps fp16
    metadata at 2 bits, ``rules.metadata_at``); a preset's own values are written out."""
    spec = load_spec(policy, bits=bits)
    dump = spec.model_dump(mode="json", exclude_none=True)
    own = Defaults().model_dump(mode="json")
    given = spec.defaults.model_fields_set | {"bits"}
    defaults = {k: v for k, v in dump["defaults"].items()
                if (k in given or v != own.get(k)) and (k != "axis" or v is not None)}
    if spec.defaults.stored_bits is not None:  # the budget allocates the widths
        defaults.pop("bits", None)
    return {"defaults": defaults, "overrides": [
        {k: v for k, v in rule.items() if v is not None} for rule in dump.get("overrides", [])
    ]}


def _fp16_bytes(per_token: int | None, batch: int, tokens: int) -> int | None:
    return None if per_token is None else 2 * per_token * batch * tokens


def _loader(
    model: str, segments: int, context: int, steps: int, retrieval: int | None,
    source: str | None = None, passages: int | None = None,
) -> tuple[Callable[[], Any], torch.Tensor, Any, torch.Tensor | None]:
    """``(load, segments, calibration input, retrieval passages or None)``, after checking
    that the model has positions for them (``_check_positions``). The calibration input of a
    budget: for a tiny random model (no tokenizer) random ids of another seed than the
    segments', as many as the default calibration text has; for a zoo model its tokenizer,
    for the default text (the last pydoc tokens, which the segments never reach). The
    retrieval passages: random ids of a third seed, or pydoc text from its start, as the
    segments; ``passages`` of them (default ``segments``)."""
    length = context + steps
    passages = segments if passages is None else passages
    if model.startswith("tiny-"):
        arch = model[len("tiny-"):]
        probe = tiny_model(arch)
        retrieval = _check_positions(probe, model, context, steps, retrieval)
        gen = torch.Generator().manual_seed(0)
        segs = torch.randint(3, probe.config.vocab_size, (segments, length), generator=gen)
        cal = torch.randint(3, probe.config.vocab_size, (1, budget.CALIBRATION_TOKENS),
                            generator=torch.Generator().manual_seed(1))
        passages = None if not retrieval else torch.randint(
            3, probe.config.vocab_size, (passages, retrieval),
            generator=torch.Generator().manual_seed(2))
        return (lambda: tiny_model(arch)), segs, cal, passages
    probe, tokenizer = zoo.load(model)
    retrieval = _check_positions(probe, model, context, steps, retrieval)
    del probe
    try:
        segs = text.segments(tokenizer, length, segments, source=source)
        passages = (None if not retrieval else
                    text.segments(tokenizer, retrieval, passages, stride=max(retrieval, 1024),
                                  source=source))
    except ValueError as exc:  # the text is finite: say which option to lower
        raise KVPolicyError(f"{exc} (--segments, --context + --steps, --retrieval, "
                            "--passages)") from exc
    return (lambda: zoo.load(model)[0]), segs, tokenizer, passages


def _check_positions(probe: torch.nn.Module, name: str, context: int, steps: int,
                     retrieval: int | None) -> int:
    """Refuse lengths past the model's ``max_position_embeddings`` (where it names one);
    the retrieval passage length, ``None`` resolved to its default."""
    if context < 1 or steps < 1:
        raise KVPolicyError(f"context={context}, steps={steps}: both must be positive")
    config = probe.config.get_text_config(decoder=True)
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return RETRIEVAL_TOKENS if retrieval is None else retrieval
    if retrieval is None:
        retrieval = min(RETRIEVAL_TOKENS, limit // 2)
    if context + steps > limit:
        raise KVPolicyError(
            f"context + steps = {context} + {steps} = {context + steps} tokens exceed the "
            f"{limit} positions of {name} (max_position_embeddings); use a --context and "
            f"--steps that sum to at most {limit}"
        )
    if 2 * retrieval > limit:
        raise KVPolicyError(
            f"retrieval={retrieval}: a passage and its repeat take {2 * retrieval} tokens, "
            f"more than the {limit} positions of {name} (max_position_embeddings); use "
            f"--retrieval {limit // 2} or less, or 0 to skip the retrieval check"
        )
    return retrieval


def _whole_rows(run_policy, load, user, budgets, quick, cal_input, notes, frontier,
                progress) -> None:
    """The whole-cache budget rows: one calibration (of the largest budget) for all; a
    budget whose full-precision tokens or smallest choices do not fit is a note."""
    specs = stored_specs(user, sorted(budgets, reverse=True),
                         QUICK_STORED_GROUPS if quick else None, context=CONTEXT)
    try:
        frontier["whole"], cal = stored_calibration(load, specs, cal_input, notes, progress,
                                                    "whole-cache budget")
    except PolicyError as exc:
        notes.append(f"whole-cache budgets {', '.join(n for n, _ in specs)}: refused ({exc})")
        return
    for name, spec in specs:
        try:
            run_policy(name, "whole", spec, calibration=cal, retrieve=True)
        except PolicyError as exc:
            notes.append(f"{name}: refused ({exc})")
