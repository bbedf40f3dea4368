"""What an evaluation reports: one :class:`RunResult` per run, the :class:`EvalReport` that
holds them, the frontier read from them, and the files written (``report.md``,
``report.json`` and PNG plots).

The frontier puts the uniform widths (the "2/3/4 bits" ablations), the budgets (of code
bits, and of stored bits over the body, group "stored", or over the whole cache, group
"whole") and the peer side by side: its table gives the steady-state compression, i.e. bytes
per token of the quantized body (codes plus per-group scales and zeros; the full-precision
sink and residual windows, which a long context amortises, not counted) against fp16, and
the whole-cache bits after ``policies.footprint.CONTEXT`` tokens, windows included, which is
the axis of ``frontier.png``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..policies.footprint import CONTEXT

__all__ = ["RunResult", "RetrievalResult", "EvalReport", "frontier_points", "frontier_dominance",
           "write_report"]


@dataclass
class RunResult:
    """One scored run: perplexity, cache bytes and step time, with the spec it ran."""

    name: str
    # headline | axes | rope | residual | sinks | bits | split | budget | currency | stored
    # (a stored-bits budget) | peer
    group: str
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
    # Stored bits per element of the quantized body (codes + scales + zeros): what a
    # stored-bits budget bounds; bytes_per_token * 8 over the elements per token.
    avg_stored_bits: float | None = None
    fp16_bytes_per_token: int | None = None
    # The same figure measured on the cache held at the end of the eval: bytes of codes,
    # scales and zeros divided by the quantized tokens (a cross-check of bytes_per_token).
    measured_bytes_per_token: float | None = None
    # On the same decode steps as the full-precision run: mean KL(fp || this run) of the
    # next-token distributions per scored token (nats), and the share of steps whose argmax
    # equals fp's.
    kl: float | None = None
    top1_agreement: float | None = None
    # Stored bits per element of the whole cache after policies.footprint.CONTEXT tokens:
    # the body and the sinks, residual window and incomplete chunk in full precision
    # (``inspect``'s last line; quanto: its residual window counted full).
    whole_bits: float | None = None

    @property
    def steady_compression(self) -> float | None:
        """``fp16_bytes_per_token / bytes_per_token``: times smaller than fp16, steady state."""
        if self.bytes_per_token and self.fp16_bytes_per_token:
            return self.fp16_bytes_per_token / self.bytes_per_token
        return None


@dataclass
class RetrievalResult:
    """One run of the retrieval check (:mod:`kvpolicy.evaluation.retrieval`): scored on the
    second copy of each passage."""

    name: str
    top1: float  # share of scored tokens the model's argmax predicts
    perplexity: float
    tokens: int  # scored tokens, passages x steps
    agreement: float | None  # share of steps whose argmax equals the fp run's
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvalReport:
    """Every run of one :func:`~kvpolicy.evaluation.run.evaluate`, with the axis study."""

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
    retrieval: list[RetrievalResult] = field(default_factory=list)
    # The retrieval check's passages: {"passages", "length", "prefix", "steps", "source"}.
    retrieval_setup: dict[str, Any] | None = None
    text: str = "pydoc"  # what the segments were cut from: "pydoc", "random" or a file path

    def run(self, name: str) -> RunResult:
        """The run called ``name``."""
        return next(r for r in self.runs if r.name == name)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)

    def to_markdown(self) -> str:
        lines = [
            f"# kvpolicy eval: {self.model}",
            "",
            f"{self.segments} segment(s) of {self.text} text: {self.context}-token prefill, "
            f"then {self.steps} "
            f"teacher-forced decode steps through the cache; {self.seconds:.0f} s in all. "
            "KL to fp: mean KL(fp ‖ run) of the next-token distributions per scored step "
            "(nats); top-1 = fp: share of steps whose argmax is the full-precision run's.",
            "",
            "| run | group | perplexity | × fp | KL to fp | top-1 = fp | bits/elem | cache bytes "
            "| × smaller than fp16 | ms/step |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in self.runs:
            smaller = (
                f"{r.fp16_bytes / r.cache_bytes:.2f}" if r.cache_bytes and r.fp16_bytes else "-"
            )
            bpe = f"{r.bits_per_element:.2f}" if r.bits_per_element else "-"
            kl = f"{r.kl:.3g}" if r.kl is not None else "-"
            agree = f"{r.top1_agreement:.3f}" if r.top1_agreement is not None else "-"
            lines.append(
                f"| {r.name} | {r.group} | {r.perplexity:.3f} | {r.ratio:.3f} | {kl} | {agree} | "
                f"{bpe} | "
                f"{r.cache_bytes if r.cache_bytes is not None else '-'} | {smaller} | "
                f"{r.ms_per_step:.1f} |"
            )
        lines += self._retrieval_markdown()
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

    def _retrieval_markdown(self) -> list[str]:
        """The retrieval table: top-1 accuracy and perplexity on the repeated passages."""
        if not self.retrieval or not self.retrieval_setup:
            return []
        s = self.retrieval_setup
        lines = [
            "", "## Retrieval: a passage, then the same passage again", "",
            f"{s['passages']} passage(s) of {s['length']} {s['source']} tokens, each followed "
            f"by itself. The prefill holds the first copy and the first {s['prefix']} tokens of "
            f"the second; {s['steps']} teacher-forced decode steps score the rest of the second "
            "copy. top-1: share of those tokens the model's argmax predicts; top-1 = fp: share "
            "of steps whose argmax is the full-precision run's.",
            "",
            "| run | top-1 | perplexity | top-1 = fp | scored tokens |",
            "|---|---|---|---|---|",
        ]
        for r in self.retrieval:
            agree = f"{r.agreement:.3f}" if r.agreement is not None else "-"
            lines.append(f"| {r.name} | {r.top1:.3f} | {r.perplexity:.3f} | {agree} | "
                         f"{r.tokens} |")
        return lines

    def _frontier_markdown(self) -> list[str]:
        """The frontier table, the dominance lines and the widths of the middle budget."""
        points = frontier_points(self.runs)
        if not any(r.group in ("budget", "stored", "whole") for r in points):
            return []
        lines = [
            "", "## Frontier: perplexity vs compression", "",
            "Steady state: bytes per token of the quantized body over all layers (codes plus "
            "per-group scales and zeros, in the dtype each cache stores them in; the "
            "sink and residual windows not counted). Whole cache: stored bits per element of "
            f"everything held after {CONTEXT:,} tokens, the sinks (full precision), residual "
            "window and incomplete chunk (at the policy's residual_bits) included (quanto: "
            "its residual window counted full). Measured: the whole cache held at the end of "
            "this eval.",
            "",
            "| run | avg code bits | bytes/token | stored bits | whole-cache bits | × smaller "
            "than fp16 (steady state) | × smaller, measured at the end | perplexity | × fp | "
            "KL to fp | top-1 = fp |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in points:
            bits = f"{r.avg_bits:.3f}" if r.avg_bits is not None else "-"
            bpt = f"{r.bytes_per_token:.1f}" if r.bytes_per_token else "-"
            steady = f"{r.steady_compression:.2f}" if r.steady_compression else "-"
            measured = (
                f"{r.fp16_bytes / r.cache_bytes:.2f}" if r.cache_bytes and r.fp16_bytes else "-"
            )
            stored = f"{r.avg_stored_bits:.3f}" if r.avg_stored_bits is not None else "-"
            whole = f"{r.whole_bits:.3f}" if r.whole_bits is not None else "-"
            kl = f"{r.kl:.3g}" if r.kl is not None else "-"
            agree = f"{r.top1_agreement:.3f}" if r.top1_agreement is not None else "-"
            lines.append(f"| {r.name} | {bits} | {bpt} | {stored} | {whole} | {steady} | "
                         f"{measured} | "
                         f"{r.perplexity:.3f} | {r.ratio:.3f} | {kl} | {agree} |")
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
        for key, what in (("stored", "the stored-bits budgets"),
                          ("whole", f"the whole-cache budgets (at {CONTEXT:,} tokens)")):
            got = (self.frontier or {}).get(key)
            if got:
                cal = got["calibration"]
                lines += ["", f"One more calibration for {what} (widths and group sizes, of "
                              f"{got['groups'] or 'fixed groups'}): {cal['source']}, "
                              f"{cal['rows']}x{cal['tokens']} tokens, {cal['seconds']:.1f} s "
                              f"to measure ({cal['wall_seconds']:.1f} s with the policy "
                              "derivation)."]
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


# frontier.png's second panel: the points at most this far above full precision.
ZOOM_RATIO = 1.2


def frontier_points(runs: list[RunResult]) -> list[RunResult]:
    """The frontier's runs: uniform widths ("bits" group), budgets (and the "currency" run),
    stored-bits budgets over the body ("stored") and over the whole cache ("whole"), the hand
    splits and the peer, each with a steady-state bytes-per-token figure."""
    return [r for g in ("bits", "budget", "currency", "stored", "whole", "split", "peer")
            for r in runs if r.group == g and r.bytes_per_token]


def frontier_dominance(runs: list[RunResult]) -> dict[str, list[str]]:
    """For each budget run (code or stored bits), the uniform-width runs that dominate it:
    at most its steady-state bytes per token, and lower perplexity. An empty list: not
    dominated (the target)."""
    uniform = [r for r in runs if r.group == "bits" and r.bytes_per_token]
    return {
        b.name: [u.name for u in uniform
                 if u.bytes_per_token <= b.bytes_per_token and u.perplexity < b.perplexity]
        for b in runs if b.group in ("budget", "stored", "whole") and b.bytes_per_token
    }


def write_report(report: EvalReport, out: Path) -> None:
    """Write ``report.md``, ``report.json`` and the plots (when matplotlib is installed)
    into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        _plots(report, out)
    except ImportError as exc:  # matplotlib is a dev extra; the note lands in the reports
        report.notes.append(f"plots skipped: {exc}")
    (out / "report.md").write_text(report.to_markdown())
    (out / "report.json").write_text(report.to_json())


def _plots(report: EvalReport, out: Path) -> None:
    # matplotlib is a dev extra: imported only when plots are drawn.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for group, marker in (("bits", "o"), ("budget", "^"), ("stored", "P"), ("headline", "*"),
                          ("peer", "s")):
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
    """``frontier.png``: perplexity ratio against stored bits per element of the whole cache
    after ``CONTEXT`` tokens (codes, scales and zeros, and the full-precision sinks, residual
    window and incomplete chunk: everything a cache holds, so that choices trading any of
    them are placed fairly), per series. When a point sits above ``ZOOM_RATIO`` (a peer, or
    a budget that collapses) the first panel has a log scale and a second one shows the
    points at or below it."""
    points = [r for r in frontier_points(report.runs) if r.whole_bits is not None]
    if not points:
        return
    near = [r for r in points if r.ratio <= ZOOM_RATIO]
    zoom = 1 < len(near) < len(points)
    fig, axes = plt.subplots(1, 2 if zoom else 1, figsize=(13 if zoom else 7, 4.5),
                             squeeze=False)
    for n_ax, ax in enumerate(axes[0]):
        shown = near if n_ax else points
        placed: dict[float, int] = {}  # labels already at a compression: stack the next
        for group, label, style in (
            ("bits", "uniform width", "o-"), ("budget", "bit budget", "^-"),
            ("currency", "budget, relative-error currency", "v"),
            ("stored", "stored-bits budget (groups allocated)", "P-"),
            ("whole", "stored-bits budget over the whole cache", "X-"),
            ("split", "keys/values split by hand", "D"), ("peer", "quanto (peer)", "s"),
        ):
            pts = sorted((r for r in shown if r.group == group), key=lambda r: r.whole_bits)
            if not pts:
                continue
            xs, ys = [r.whole_bits for r in pts], [r.ratio for r in pts]
            ax.plot(xs, ys, style, label=label)
            for r, x, y in zip(pts, xs, ys, strict=True):
                k = placed.get(round(x, 1), 0)
                placed[round(x, 1)] = k + 1
                ax.annotate(r.name, (x, y), fontsize=7, xytext=(4, 3 - 9 * k),
                            textcoords="offset points")
        if zoom and not n_ax:
            ax.set_yscale("log")
        ax.set_xlabel(f"stored bits per element of the whole cache at {CONTEXT:,} tokens "
                      "(fp16: 16)")
        ax.set_ylabel("perplexity / full-precision perplexity")
        ax.set_title(f"{report.model}: frontier"
                     + (f", ratios up to {ZOOM_RATIO:g}" if n_ax else ""))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=120)
    plt.close(fig)
