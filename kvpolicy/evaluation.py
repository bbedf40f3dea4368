"""Measure a policy where it matters: decode-time perplexity, ablations and the peer.

A single forward pass over a prompt hardly touches the cache (DESIGN.md §3). Here every
scored token is produced by a single-token decode step that reads the cache: prefill
``context`` tokens, then score ``steps`` tokens teacher-forced, one step at a time.

``evaluate`` (``kvpolicy eval``) runs, on the same segments of pydoc text (or random
tokens for ``quick``): the full-precision cache, the derived policy, its ablations through
the public override API (axes, pre/post-RoPE keys, residual, sinks, bits) and the peer
(transformers' quanto ``QuantizedCache``) with its default and its best axes, with cache
bytes and decode-step wall time beside each perplexity; results go to ``report.md``,
``report.json`` and PNG plots.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .policy import load_spec

__all__ = [
    "DecodeResult", "decode_perplexity", "cache_keyword", "RunResult", "EvalReport",
    "evaluate", "ablations",
]

log = logging.getLogger(__name__)


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
    group: str  # headline | axes | rope | residual | sinks | bits | peer
    perplexity: float
    ratio: float  # perplexity / full-precision perplexity
    cache_bytes: int | None
    fp16_bytes: int | None
    bits_per_element: float | None  # cache bytes * 8 / cached elements, overheads included
    ms_per_step: float
    settings: dict[str, Any] = field(default_factory=dict)


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


def ablations(bits: int) -> list[tuple[str, str, dict[str, Any]]]:
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
    ]


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
    bits: int = 2,
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
        bits, policy: the policy under test, as for ``compile_model``.
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
    load, segs = _loader(model, segments, context + steps)
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

    def run_policy(name: str, group: str, spec: dict[str, Any]) -> RunResult:
        from .compiler import compile_model

        m = compile_model(load(), policy=spec)
        res = decode_perplexity(m, segs, context, steps, desc=name, progress=progress,
                                batched=True)
        mem = res.cache.memory_report()
        elems = per_token * segs.shape[0] * mem["tokens"] if per_token else None
        r = RunResult(
            name, group, res.perplexity, res.perplexity / fp.perplexity, mem["bytes"],
            mem["fp16_bytes"], mem["bytes"] * 8 / elems if elems else None,
            res.seconds_per_step * 1e3, spec,
        )
        runs.append(r)
        return r

    derived = run_policy("derived policy", "headline", user)
    seen = {json.dumps(user, sort_keys=True): derived}
    for name, group, extra in ablations(bits):
        spec = _merge(user, extra)
        key = json.dumps(spec, sort_keys=True)
        if key in seen or _same_as(spec, user):
            same = seen.get(key, derived)
            runs.append(RunResult(name, group, same.perplexity, same.ratio, same.cache_bytes,
                                  same.fp16_bytes, same.bits_per_element, same.ms_per_step,
                                  spec))
            continue
        seen[key] = run_policy(name, group, spec)

    if peers:
        runs += _peer_runs(load, segs, context, steps, fp.perplexity, user, per_token,
                           progress, notes)
    consumed = _consumed(load, segs, context, bits, runs)
    report = EvalReport(model, segs.shape[0], context, steps, runs,
                        time.perf_counter() - start, consumed, notes)
    if out is not None:
        _write(report, Path(out))
    return report


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


def _spec_dict(policy: Any, bits: int) -> dict[str, Any]:
    spec = load_spec(policy, bits=bits)
    dump = spec.model_dump(mode="json", exclude_none=True)
    defaults = {k: v for k, v in dump["defaults"].items() if k != "axis" or v is not None}
    return {"defaults": defaults, "overrides": [
        {k: v for k, v in rule.items() if v is not None} for rule in dump.get("overrides", [])
    ]}


def _fp16_bytes(per_token: int | None, batch: int, tokens: int) -> int | None:
    return None if per_token is None else 2 * per_token * batch * tokens


def _loader(model: str, segments: int, length: int) -> tuple[Callable[[], Any], torch.Tensor]:
    if model.startswith("tiny-"):
        from .testing import tiny_model

        arch = model[len("tiny-"):]
        probe = tiny_model(arch)
        gen = torch.Generator().manual_seed(0)
        segs = torch.randint(3, probe.config.vocab_size, (segments, length), generator=gen)
        return (lambda: tiny_model(arch)), segs
    from . import data, zoo

    _, tokenizer = zoo.load(model)
    return (lambda: zoo.load(model)[0]), data.segments(tokenizer, length, segments)


def _peer_runs(load, segs, context, steps, fp_ppl, user, per_token, progress, notes):
    """transformers' quanto cache at the policy's bits, group and residual: all four axis
    pairs (its users pick them by hand), reported with the default and the best."""
    from . import peers

    d = load_spec(user).defaults
    if d.bits not in (2, 4):
        notes.append(f"peer runs skipped: quanto supports 2 or 4 bits, the policy has {d.bits}")
        return []
    model = load()
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
        ))
    return out


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
    for group, marker in (("bits", "o"), ("headline", "*"), ("peer", "s")):
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
