"""Evaluate a policy where it matters: decode-time perplexity through the cache (``decode``),
ablations and bit budgets (``run``), transformers' own caches as peers (``peers``), the
where-consumed axis study (``axis_study``), and the report they fill (``report``)."""

from .decode import DecodeResult, cache_keyword, decode_perplexity
from .report import EvalReport, RunResult, frontier_dominance, frontier_points
from .run import FRONTIER_BUDGETS, ablations, evaluate

__all__ = [
    "DecodeResult", "decode_perplexity", "cache_keyword", "RunResult", "EvalReport",
    "evaluate", "ablations", "FRONTIER_BUDGETS", "frontier_points", "frontier_dominance",
]
