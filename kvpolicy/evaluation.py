"""Measure a policy where it matters: decode-time perplexity, ablations and the peer.

A single forward pass over a prompt hardly touches the cache (DESIGN.md §3). Here every
scored token is produced by a single-token decode step that reads the cache: prefill
``context`` tokens, then score ``steps`` tokens teacher-forced, one step at a time.

``evaluate`` (``kvpolicy eval``) runs, on the same segments of pydoc text (or random
tokens for ``quick``): the full-precision cache, the derived policy, its ablations through
the public override API (axes, pre/post-RoPE keys, residual, sinks, bits), bit budgets
(``FRONTIER_BUDGETS``, allocated from one calibration; the middle one once more from the
``relative`` currency of ``budget.CALIBRATION_METRICS``, to show what the default's loss
weighting buys) and the peer (transformers' quanto ``QuantizedCache``) with its default
and its best axes, with cache bytes and decode-step wall time beside each perplexity;
results go to ``report.md``, ``report.json`` and PNG plots.

The frontier puts the uniform widths (the "2/3/4 bits" ablations), the budgets and the
peer on the same axes: perplexity ratio against steady-state compression, i.e. bytes per
token of the quantized body (codes plus per-group scales and zeros; the full-precision
sink and residual windows, which a long context amortises, not counted) against fp16.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .policy import BUDGET_WIDTHS, load_spec, packed_bytes_per_element

__all__ = [
    "DecodeResult", "decode_perplexity", "cache_keyword", "RunResult", "EvalReport",
    "evaluate", "ablations", "FRONTIER_BUDGETS", "frontier_points", "frontier_dominance",
]

log = logging.getLogger(__name__)

# Bit budgets of the frontier (average code bits per cached element; a float is always a
# budget, so 3.0 is allocated, not uniform 3 bits). One calibration serves all of them.
FRONTIER_BUDGETS: tuple[float, ...] = (2.25, 2.5, 3.0)


@dataclass
class DecodeResult:
    perplexity: float
    tokens: int
    seconds_per_step: float  # median wall time of one decode step (of the whole batch)
    cache: object | None  # the cache after the last segment
    nll: float


def decode_perplexity(
    model: torch.nn.Module,
    segments: torch.Tensor,
    context: int,
    steps: int,
    *,
    desc: str = "decode",
    progress: bool = True,
    batched: bool = False,
    make_cache=None,
) -> DecodeResult:
    """Perplexity of ``segments [N, >= context + steps]`` scored by teacher-forced decode.

    Each segment: one forward over the first ``context`` tokens with ``use_cache=True``,
    then ``steps`` forwards of one token each through the returned cache; the logits of
    each step score the next token.

    Args:
        batched: decode all segments as one batch (same perplexity, less time; the step
            time is then per batch).
        make_cache: builds the cache handed to the prefill (a peer's cache); default:
            the model makes its own.
    """
    if segments.shape[1] < context + steps:
        raise ValueError(
            f"segments of {segments.shape[1]} tokens are shorter than context + steps = "
            f"{context + steps}"
        )
    if steps < 1:
        raise ValueError(f"steps={steps} must be positive")
    cache_kw = cache_keyword(model)
    # All segments decode as one batch: a decode step on CPU costs about the same for 1
    # or 4 rows (the weights are read once), so scoring N segments takes ~1/N the time.
    groups = [segments] if batched else [s[None] for s in segments]
    nll, n, times = 0.0, 0, []
    cache = None
    bar = tqdm(total=len(groups) * steps, desc=desc, disable=not progress, unit="step")
    with torch.no_grad():
        for ids in groups:
            first = {} if make_cache is None else {cache_kw: make_cache()}
            out = model(ids[:, :context], use_cache=True, **first)
            cache, logits = out.past_key_values, out.logits[:, -1]
            for i in range(steps):
                target = ids[:, context + i]
                nll += torch.nn.functional.cross_entropy(
                    logits.float(), target, reduction="sum"
                ).item()
                n += target.numel()
                t0 = time.perf_counter()
                out = model(ids[:, context + i : context + i + 1], use_cache=True,
                            **{cache_kw: cache})
                times.append(time.perf_counter() - t0)
                cache, logits = out.past_key_values, out.logits[:, -1]
                bar.update(1)
    bar.close()
    times.sort()
    return DecodeResult(math.exp(nll / n), n, times[len(times) // 2], cache, nll)


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a model's forward takes its cache by (transformers 5.x: ``cache``)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclass
class RunResult:
    name: str
    group: str  # headline | axes | rope | residual | sinks | bits | split | budget | peer
    perplexity: float
    ratio: float  # perplexity / full-precision perplexity
    cache_bytes: int | None  # held at the end of the eval, windows included
    fp16_bytes: int | None
    bits_per_element: float | None  # cache bytes * 8 / cached elements, overheads included
    ms_per_step: float
    settings: dict[str, Any] = field(default_factory=dict)
    # Steady state (what a long context tends to): code bits per element, and bytes per
    # token of the quantized body over all layers, codes + per-group scales and zeros, the
    # full-precision sink/residual windows not counted; from the policy (ours) or from
    # quanto's storage format (the peer). fp16_bytes_per_token: the same token in fp16.
    avg_bits: float | None = None
    bytes_per_token: float | None = None
    fp16_bytes_per_token: int | None = None
    # The same figure measured on the cache held at the end of the eval: bytes of codes,
    # scales and zeros divided by the quantized tokens (a cross-check of bytes_per_token).
    measured_bytes_per_token: float | None = None

    @property
    def steady_compression(self) -> float | None:
        """``fp16_bytes_per_token / bytes_per_token``: times smaller than fp16, steady state."""
        if self.bytes_per_token and self.fp16_bytes_per_token:
            return self.fp16_bytes_per_token / self.bytes_per_token
        return None


@dataclass
class EvalReport:
    model: str
    segments: int
    context: int
    steps: int
    runs: list[RunResult]
    seconds: float
    consumed: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    # Budgets, their shared calibration (source, tokens, seconds) and dominance results.
    frontier: dict[str, Any] | None = None

    def run(self, name: str) -> RunResult:
        return next(r for r in self.runs if r.name == name)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)

    def to_markdown(self) -> str:
        lines = [
            f"# kvpolicy eval: {self.model}",
            "",
            f"{self.segments} segment(s): {self.context}-token prefill, then {self.steps} "
            f"teacher-forced decode steps through the cache; {self.seconds:.0f} s in all.",
            "",
            "| run | group | perplexity | × fp | bits/elem | cache bytes | × smaller than fp16 "
            "| ms/step |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in self.runs:
            smaller = (
                f"{r.fp16_bytes / r.cache_bytes:.2f}" if r.cache_bytes and r.fp16_bytes else "-"
            )
            bpe = f"{r.bits_per_element:.2f}" if r.bits_per_element else "-"
            lines.append(
                f"| {r.name} | {r.group} | {r.perplexity:.3f} | {r.ratio:.3f} | {bpe} | "
                f"{r.cache_bytes if r.cache_bytes is not None else '-'} | {smaller} | "
                f"{r.ms_per_step:.1f} |"
            )
        lines += self._frontier_markdown()
        if self.consumed:
            lines += ["", "## Where the tensors are consumed", ""]
            pols = self.consumed.get("policies", {})
            metrics = sorted({m for p in pols.values() for m in p})
            lines += ["| policy | " + " | ".join(metrics) + " |",
                      "|---|" + "---|" * len(metrics)]
            for name, vals in pols.items():
                lines.append(f"| {name} | " + " | ".join(f"{vals[m]:.4f}" for m in metrics)
                             + " |")
            lines += ["", "Perplexity order of these policies: "
                      + ", ".join(self.consumed.get("perplexity_order", [])) + ".",
                      "", str(self.consumed.get("summary", ""))]
        if self.notes:
            lines += ["", "## Notes", ""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def _frontier_markdown(self) -> list[str]:
        """The frontier table, the dominance lines and the widths of the middle budget."""
        points = frontier_points(self.runs)
        if not any(r.group == "budget" for r in points):
            return []
        lines = [
            "", "## Frontier: perplexity vs compression", "",
            "Steady state: bytes per token of the quantized body over all layers (codes plus "
            "per-group scales and zeros, in the dtype each cache stores them in; the "
            "full-precision sink and residual windows not counted). Measured: the whole cache "
            "held at the end of this eval, windows included.",
            "",
            "| run | avg code bits | bytes/token | × smaller than fp16 (steady state) "
            "| × smaller, measured at the end | perplexity | × fp |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in points:
            bits = f"{r.avg_bits:.3f}" if r.avg_bits is not None else "-"
            bpt = f"{r.bytes_per_token:.1f}" if r.bytes_per_token else "-"
            steady = f"{r.steady_compression:.2f}" if r.steady_compression else "-"
            measured = (
                f"{r.fp16_bytes / r.cache_bytes:.2f}" if r.cache_bytes and r.fp16_bytes else "-"
            )
            lines.append(f"| {r.name} | {bits} | {bpt} | {steady} | {measured} | "
                         f"{r.perplexity:.3f} | {r.ratio:.3f} |")
        lines.append("")
        for name, beaten_by in frontier_dominance(self.runs).items():
            b = self.run(name)
            head = f"{name} ({b.bytes_per_token:.1f} B/token, perplexity {b.perplexity:.3f})"
            smaller = [u for u in points if u.group == "bits" and u.bytes_per_token
                       and u.bytes_per_token <= b.bytes_per_token]
            if beaten_by:
                lines.append(f"- {head}: dominated by " + ", ".join(
                    f"{u} ({self.run(u).bytes_per_token:.1f} B/token, perplexity "
                    f"{self.run(u).perplexity:.3f})" for u in beaten_by) + ".")
            elif smaller:
                lines.append(f"- {head}: not dominated; no uniform width at <= its bytes per "
                             "token (" + ", ".join(u.name for u in smaller)
                             + ") has lower perplexity.")
            else:
                lines.append(f"- {head}: not dominated; no uniform width is as small.")
        if self.frontier and self.frontier.get("calibration"):
            cal = self.frontier["calibration"]
            lines += ["", f"One calibration for all budgets: {cal['source']}, {cal['rows']}x"
                          f"{cal['tokens']} tokens, {cal['seconds']:.1f} s to measure "
                          f"({cal['wall_seconds']:.1f} s with the policy derivation)."]
        lines += self._widths_markdown()
        return lines

    def _widths_markdown(self) -> list[str]:
        """Per-layer key and value widths of the middle budget run."""
        budgets = [r for r in self.runs if r.group == "budget" and "key_bits" in r.settings]
        if not budgets:
            return []
        r = budgets[len(budgets) // 2]
        keys, values = r.settings["key_bits"], r.settings["value_bits"]
        more = sum(k > v for k, v in zip(keys, values, strict=True))
        same = sum(k == v for k, v in zip(keys, values, strict=True))
        lines = ["", f"### Widths allocated by {r.name}", "",
                 f"Layers with key bits > value bits: {more}; equal: {same}; less: "
                 f"{len(keys) - more - same} (of {len(keys)}).", "",
                 "| layer | key bits | value bits |", "|---|---|---|"]
        lines += [f"| {i} | {k} | {v} |"
                  for i, k, v in zip(r.settings["layers"], keys, values, strict=True)]
        return lines


def ablations(bits: int | float) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, group, overrides on top of the user's spec) of every ablation run."""
    key, value = {"layers": "*", "tensor": "key"}, {"layers": "*", "tensor": "value"}
    return [
        ("K token / V token", "axes", {"overrides": [{**key, "axis": "token"}]}),
        ("K channel / V channel", "axes", {"overrides": [{**value, "axis": "channel"}]}),
        ("K token / V channel", "axes",
         {"overrides": [{**key, "axis": "token"}, {**value, "axis": "channel"}]}),
        ("keys post-RoPE", "rope", {"overrides": [{**key, "pre_rope": False}]}),
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


def frontier_points(runs: list[RunResult]) -> list[RunResult]:
    """The frontier's runs: uniform widths ("bits" group), budgets (and the "currency" run),
    the hand splits and the peer, each with a steady-state bytes-per-token figure."""
    return [r for g in ("bits", "budget", "currency", "split", "peer") for r in runs
            if r.group == g and r.bytes_per_token]


def frontier_dominance(runs: list[RunResult]) -> dict[str, list[str]]:
    """For each budget run, the uniform-width runs that dominate it: at most its steady-state
    bytes per token, and lower perplexity. An empty list: not dominated (the target)."""
    uniform = [r for r in runs if r.group == "bits" and r.bytes_per_token]
    return {
        b.name: [u.name for u in uniform
                 if u.bytes_per_token <= b.bytes_per_token and u.perplexity < b.perplexity]
        for b in runs if b.group == "budget" and b.bytes_per_token
    }


def _merge(spec_dict: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = {"defaults": dict(spec_dict.get("defaults", {})),
           "overrides": list(spec_dict.get("overrides", []))}
    out["defaults"].update(extra.get("defaults", {}))
    out["overrides"] += extra.get("overrides", [])
    return out


def _elements_per_token(model) -> int | None:
    from .api import analyse_model

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
    progress: bool = True,
) -> EvalReport:
    """Run the full comparison; see the module docstring.

    Args:
        model: a zoo name (``"smollm2-135m"``) or ``"tiny-<arch>"``.
        bits, policy: the policy under test, as for ``compile_model`` (a float ``bits`` is
            a budget; its runs calibrate on the segments' source, see ``_loader``).
        segments, context, steps: text to score (segments decode as one batch).
        out: folder for ``report.md``, ``report.json`` and the plots.
        quick: a tiny random model, random tokens, short context: a smoke test.
        peers: also run transformers' quanto ``QuantizedCache`` (needs optimum-quanto).
    """
    start = time.perf_counter()
    if quick:
        model, segments, context, steps = "tiny-llama", 2, 64, 16
        if policy is None:  # a window and groups small enough for 80 tokens to be packed
            policy = {"defaults": {"bits": bits, "group_size": 16, "residual": 16, "sinks": 2}}
    load, segs, cal_input = _loader(model, segments, context + steps)
    user = _spec_dict(policy, bits)
    runs: list[RunResult] = []
    notes: list[str] = []

    fp_model = load()
    per_token = _elements_per_token(fp_model)
    fp = decode_perplexity(fp_model, segs, context, steps, desc="fp", progress=progress,
                           batched=True)
    fp_bytes = _fp16_bytes(per_token, segs.shape[0], context + steps)
    held = _held_bytes(fp.cache)  # transformers' DynamicCache, in the model's dtype
    runs.append(RunResult(
        "full precision (DynamicCache)", "headline", fp.perplexity, 1.0, held, fp_bytes,
        held * 8 / (fp_bytes / 2) if held and fp_bytes else None, fp.seconds_per_step * 1e3,
    ))

    def run_policy(name: str, group: str, spec: dict[str, Any],
                   calibration: Any = None) -> RunResult:
        """Compile a fresh model with ``spec`` and score it. ``calibration``: for a budget,
        a measured ``Calibration`` (default: measure on ``cal_input``)."""
        from .api import inspect as inspect_policy
        from .compiler import compile_model

        m = compile_model(load(), policy=spec, progress=progress,
                          calibration=cal_input if calibration is None else calibration)
        pol = inspect_policy(m)
        res = decode_perplexity(m, segs, context, steps, desc=name, progress=progress,
                                batched=True)
        mem = res.cache.memory_report()
        elems = per_token * segs.shape[0] * mem["tokens"] if per_token else None
        r = RunResult(
            name, group, res.perplexity, res.perplexity / fp.perplexity, mem["bytes"],
            mem["fp16_bytes"], mem["bytes"] * 8 / elems if elems else None,
            res.seconds_per_step * 1e3, spec, avg_bits=pol.avg_bits,
            bytes_per_token=pol.bytes_per_token(),
            fp16_bytes_per_token=pol.fp16_bytes_per_token,
            measured_bytes_per_token=_packed_bytes_per_token(mem, segs.shape[0]),
        )
        if pol.budget is not None:
            r.settings = {**spec, "budget": pol.budget, "layers": list(pol.layers),
                          "key_bits": [pol.get(i, "key").bits for i in pol.layers],
                          "value_bits": [pol.get(i, "value").bits for i in pol.layers]}
        runs.append(r)
        return r

    derived = run_policy("derived policy", "headline", user)
    seen = {json.dumps(user, sort_keys=True): derived}
    for name, group, extra in ablations(bits):
        spec = _merge(user, extra)
        key = json.dumps(spec, sort_keys=True)
        if key in seen or _same_as(spec, user):
            same = seen.get(key, derived)
            runs.append(replace(same, name=name, group=group, settings=spec))
            continue
        seen[key] = run_policy(name, group, spec)

    frontier, budget_specs, cal = _frontier_calibration(load, user, cal_input, notes, progress)
    for name, spec in budget_specs:
        key = json.dumps(spec, sort_keys=True)
        if key in seen:  # the user's own budget: the derived policy's run
            same = seen[key]
            runs.append(replace(same, name=name, group="budget", settings=same.settings))
            continue
        seen[key] = run_policy(name, "budget", spec, calibration=cal)
    # The middle budget once more, allocated from the plain relative output error: what the
    # loss weighting of the default currency buys.
    mid_name, mid_spec = budget_specs[len(budget_specs) // 2]
    relative = _relative_calibration(load, mid_spec, cal, cal_input, progress)
    run_policy(f"{mid_name}, relative-error currency", "currency", mid_spec,
               calibration=relative)

    if peers:
        runs += _peer_runs(load, segs, context, steps, fp.perplexity, user, per_token,
                           progress, notes)
    frontier["dominated_by"] = frontier_dominance(runs)
    study_bits = bits
    if isinstance(bits, float):  # a budget: the axis study compares axes at one width
        study_bits = max(w for w in BUDGET_WIDTHS if w <= bits)
        notes.append(f"the where-consumed axis study measured every tensor at {study_bits} "
                     f"bits (bits={bits:g} is a budget)")
    consumed = _consumed(load, segs, context, study_bits, runs)
    report = EvalReport(model, segs.shape[0], context, steps, runs,
                        time.perf_counter() - start, consumed, notes, frontier)
    if out is not None:
        _write(report, Path(out))
    return report


def _frontier_calibration(
    load, user, cal_input, notes, progress
) -> tuple[dict[str, Any], list[tuple[str, dict[str, Any]]], Any]:
    """``(frontier record, [(run name, spec)] per budget of FRONTIER_BUDGETS, calibration)``:
    the budget runs are the user's spec with only ``bits`` changed, so one calibration (on a
    fresh model, with those settings) serves them all."""
    from .api import derive_policy

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
    from . import budget
    from .api import derive_policy

    model = load()
    policy = derive_policy(model, policy=spec, calibration=cal, progress=False)
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
    from . import peers
    from .errors import KVPolicyError

    try:
        return peers.cache_bytes(cache).total
    except KVPolicyError as exc:  # a cache type peers cannot count: no figure, said why
        log.info("cache bytes of %s not measured: %s", type(cache).__name__, exc)
        return None


def _same_as(spec: dict[str, Any], user: dict[str, Any]) -> bool:
    """An ablation that only restates the user's own settings."""
    if spec.get("overrides") != user.get("overrides"):
        return False
    d = load_spec(spec).defaults
    u = load_spec(user).defaults
    return d == u


def _spec_dict(policy: Any, bits: int | float) -> dict[str, Any]:
    spec = load_spec(policy, bits=bits)
    dump = spec.model_dump(mode="json", exclude_none=True)
    defaults = {k: v for k, v in dump["defaults"].items() if k != "axis" or v is not None}
    return {"defaults": defaults, "overrides": [
        {k: v for k, v in rule.items() if v is not None} for rule in dump.get("overrides", [])
    ]}


def _fp16_bytes(per_token: int | None, batch: int, tokens: int) -> int | None:
    return None if per_token is None else 2 * per_token * batch * tokens


def _loader(
    model: str, segments: int, length: int
) -> tuple[Callable[[], Any], torch.Tensor, Any]:
    """``(load, segments, calibration input)``. The calibration input of a budget: for a
    tiny random model (no tokenizer) random ids of another seed than the segments', as many
    as the default calibration text has; for a zoo model its tokenizer, for the default
    text (the last pydoc tokens, which the segments never reach)."""
    if model.startswith("tiny-"):
        from .budget import CALIBRATION_TOKENS
        from .testing import tiny_model

        arch = model[len("tiny-"):]
        probe = tiny_model(arch)
        gen = torch.Generator().manual_seed(0)
        segs = torch.randint(3, probe.config.vocab_size, (segments, length), generator=gen)
        cal = torch.randint(3, probe.config.vocab_size, (1, CALIBRATION_TOKENS),
                            generator=torch.Generator().manual_seed(1))
        return (lambda: tiny_model(arch)), segs, cal
    from . import data, zoo

    _, tokenizer = zoo.load(model)
    return (lambda: zoo.load(model)[0]), data.segments(tokenizer, length, segments), tokenizer


def _peer_runs(load, segs, context, steps, fp_ppl, user, per_token, progress, notes):
    """transformers' quanto cache at the policy's bits, group and residual: all four axis
    pairs (its users pick them by hand), reported with the default and the best."""
    from . import peers

    d = load_spec(user).defaults
    if d.bits not in (2, 4):
        notes.append(f"peer runs skipped: quanto supports 2 or 4 bits, the policy has {d.bits}")
        return []
    model = load()
    steady = _quanto_bytes_per_token(per_token, d.bits, d.group_size, model)
    results = {}
    for axes in ((0, 0), (-1, 0), (0, -1), (-1, -1)):
        def factory(axes=axes):
            return peers.peer_cache(model, "quanto", bits=d.bits, group_size=d.group_size,
                                    residual=d.residual, axis_key=axes[0], axis_value=axes[1])

        results[axes] = decode_perplexity(model, segs, context, steps, desc=f"quanto {axes}",
                                          progress=progress, batched=True, make_cache=factory)
    best = min(results, key=lambda a: results[a].perplexity)
    out = []
    for label, axes in (("quanto default axes (0, 0)", (0, 0)), (f"quanto best axes {best}", best)):
        res = results[axes]
        held = peers.cache_bytes(res.cache)
        elems = per_token * segs.shape[0] * held.tokens if per_token else None
        out.append(RunResult(
            label, "peer", res.perplexity, res.perplexity / fp_ppl, held.total, held.fp16,
            held.total * 8 / elems if elems else None, res.seconds_per_step * 1e3,
            {"bits": d.bits, "group_size": d.group_size, "residual": d.residual,
             "axes": list(axes),
             "all_axes": {str(a): r.perplexity for a, r in results.items()}},
            avg_bits=float(d.bits), bytes_per_token=steady,
            fp16_bytes_per_token=2 * per_token if per_token else None,
            measured_bytes_per_token=_quanto_measured_bytes_per_token(held, per_token, model),
        ))
    return out


def _quanto_bytes_per_token(per_token: int | None, bits: int, group_size: int,
                            model: torch.nn.Module) -> float | None:
    """Steady-state bytes per token of transformers' quanto ``QuantizedCache``, counted as
    ``ModelPolicy.bytes_per_token`` counts ours: codes plus per-group scale and zero, no
    full-precision window.

    What quanto stores (transformers ``QuantoQuantizedLayer._quantize``, optimum-quanto
    ``MaxOptimizer`` and ``WeightQBitsTensor``): the whole cache re-quantized with
    ``quantize_weight(states, qint<bits>, axis, scale, shift, group_size)``; the states are
    grouped (``tensor.grouped.group``) into ``numel / group_size`` groups of ``group_size``
    elements on either axis (axis 0: along head_dim; axis -1: along the flattened
    batch*heads*tokens rows), so per element there are ``bits`` code bits (a
    ``PackedTensor``, ``8 // bits`` codes per uint8 along its first dim, padded up to a
    multiple of ``8 // bits`` rows: a few bytes per cache, nothing per token) and
    ``1 / group_size`` of one scale and one shift, both in the dtype of the cached states
    (``MaxOptimizer`` asserts it; it is the model's dtype: fp32 for the fp32 models of this
    eval, where kvpolicy stores fp16). So ``per_token * (bits / 8 + 2 * itemsize /
    group_size)``; ``_quanto_measured_bytes_per_token`` checks it against the cache held at
    the end of the eval.
    """
    if per_token is None:
        return None
    itemsize = next(model.parameters()).dtype.itemsize
    return per_token * packed_bytes_per_element(bits, group_size, itemsize)


def _quanto_measured_bytes_per_token(held, per_token: int | None,
                                     model: torch.nn.Module) -> float | None:
    """Bytes per quantized token of a quanto cache as held: (codes + scales + shifts) over
    the quantized elements (all elements less the full-precision residual window's), times
    the elements per token. None when nothing is quantized."""
    itemsize = next(model.parameters()).dtype.itemsize
    quantized = held.fp16 // 2 - held.residual // itemsize
    if not per_token or quantized <= 0:
        return None
    return (held.packed + held.scales) / quantized * per_token


# Ablation runs that are whole-policy axis/RoPE choices, by their consumed.axis_study name.
_STUDY_NAMES = {
    "derived policy": ("K-channel-pre/V-token", "K-channel/V-token"),
    "K token / V token": ("K-token-pre/V-token", "K-token/V-token"),
    "K channel / V channel": ("K-channel-pre/V-channel", "K-channel/V-channel"),
    "K token / V channel": ("K-token-pre/V-channel", "K-token/V-channel"),
    "keys post-RoPE": ("K-channel-post/V-token", None),
}


def _consumed(load, segs, context, bits, runs):
    """Errors where each tensor is consumed, on the model's own activations of the first
    segment's prefill, for the derived axes and their flips; ranked against perplexity."""
    from . import consumed

    model = load()
    acts = consumed.capture_activations(model, segs[:1, :context])
    has_rope = acts[0].rope_style is not None
    ranked = sorted((r for r in runs if r.name in _STUDY_NAMES), key=lambda r: r.perplexity)
    order = [_STUDY_NAMES[r.name][0 if has_rope else 1] for r in ranked]
    order = [n for n in order if n is not None]
    study = consumed.axis_study(model, segs[:1, :context], bits=bits,
                                reference_order=order if len(order) >= 2 else None)
    # Per layer, the largest |pre-RoPE key| of each channel: the outlier channels.
    study["key_channel_absmax"] = [
        a.key_pre.abs().amax(dim=(0, 2)).reshape(-1).tolist() for a in acts
    ]
    study["perplexity_order"] = order
    # Per layer and tensor, for the derived axes and for both flipped (DESIGN.md §3).
    study["per_layer"] = {
        choice.name: consumed.consumed_errors(acts, choice, bits=bits)
        for choice in (
            consumed.AxisChoice("channel", "token", has_rope),
            consumed.AxisChoice("token", "channel", has_rope),
        )
    }
    return study


def _write(report: EvalReport, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    try:
        _plots(report, out)
    except ImportError as exc:  # matplotlib is a dev extra; the note lands in the reports
        report.notes.append(f"plots skipped: {exc}")
    (out / "report.md").write_text(report.to_markdown())
    (out / "report.json").write_text(report.to_json())


def _plots(report: EvalReport, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for group, marker in (("bits", "o"), ("budget", "^"), ("headline", "*"), ("peer", "s")):
        pts = [r for r in report.runs if r.group == group and r.bits_per_element]
        if pts:
            ax.scatter([r.bits_per_element for r in pts], [r.perplexity for r in pts],
                       marker=marker, label=group)
            for r in pts:
                ax.annotate(r.name, (r.bits_per_element, r.perplexity), fontsize=7)
    ax.set_xlabel("cache bits per element (scales, zeros, full-precision window counted)")
    ax.set_ylabel("decode-time perplexity")
    ax.set_title(report.model)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "perplexity_vs_bits.png", dpi=120)
    plt.close(fig)
    _frontier_plot(report, out, plt)
    if not report.consumed:
        return
    mags = report.consumed.get("key_channel_absmax")
    if mags:
        fig, ax = plt.subplots(figsize=(7, 4))
        im = ax.imshow(mags, aspect="auto", cmap="magma")
        ax.set_xlabel("key channel (head-major)")
        ax.set_ylabel("layer")
        ax.set_title("max |pre-RoPE key| per channel: outlier channels")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        fig.savefig(out / "key_channel_magnitude.png", dpi=120)
        plt.close(fig)
    pols = report.consumed.get("policies", {})
    if pols:
        metrics = sorted({m for p in pols.values() for m in p})
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / max(len(pols), 1)
        for i, (name, vals) in enumerate(pols.items()):
            ax.bar([j + i * width for j in range(len(metrics))], [vals[m] for m in metrics],
                   width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(metrics))], metrics,
                      rotation=20, fontsize=8)
        ax.set_ylabel("relative error (mean over layers)")
        ax.set_title("error by axis choice and by where it is measured")
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / "error_by_axis_and_metric.png", dpi=120)
        plt.close(fig)


def _frontier_plot(report: EvalReport, out: Path, plt) -> None:
    """``frontier.png``: perplexity ratio against steady-state compression, per series; with
    a second panel zoomed onto kvpolicy's own points when a peer sits far above them."""
    points = frontier_points(report.runs)
    if not points:
        return
    own = [r.ratio for r in points if r.group != "peer"]
    zoom = bool(own) and max(r.ratio for r in points) > max(own) + 0.1
    fig, axes = plt.subplots(1, 2 if zoom else 1, figsize=(13 if zoom else 7, 4.5),
                             squeeze=False)
    for n_ax, ax in enumerate(axes[0]):
        placed: dict[float, int] = {}  # labels already at a compression: stack the next
        for group, label, style in (
            ("bits", "uniform width", "o-"), ("budget", "bit budget", "^-"),
            ("currency", "budget, relative-error currency", "v"),
            ("split", "keys/values split by hand", "D"), ("peer", "quanto (peer)", "s"),
        ):
            pts = sorted((r for r in points if r.group == group),
                         key=lambda r: r.steady_compression)
            if n_ax == 1:  # the zoomed panel: kvpolicy's points only
                pts = [r for r in pts if r.group != "peer"]
            if not pts:
                continue
            xs, ys = [r.steady_compression for r in pts], [r.ratio for r in pts]
            ax.plot(xs, ys, style, label=label)
            for r, x, y in zip(pts, xs, ys, strict=True):
                k = placed.get(round(x, 2), 0)
                placed[round(x, 2)] = k + 1
                ax.annotate(r.name, (x, y), fontsize=7, xytext=(4, 3 - 9 * k),
                            textcoords="offset points")
        ax.set_xlabel("× smaller than fp16, steady state (codes + scales + zeros per token)")
        ax.set_ylabel("perplexity / full-precision perplexity")
        ax.set_title(f"{report.model}: frontier" + (", kvpolicy's points" if n_ax else ""))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=120)
    plt.close(fig)
