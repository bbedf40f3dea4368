"""Evaluate a policy where it matters: decode-time perplexity through the cache (``decode``),
ablations and bit budgets (``run``), transformers' own caches as peers (``peers``; their rows:
``peer_rows``), the
where-consumed axis study (``axis_study``), the retrieval check (``retrieval``: a passage,
then the same passage), and the report they fill (``report``)."""

from .decode import (
    DecodeResult,
    NextTokenReference,
    cache_keyword,
    decode_perplexity,
    output_cache,
)
from .report import EvalReport, RetrievalResult, RunResult, frontier_dominance, frontier_points
from .retrieval import RetrievalTask, retrieval_task, score_retrieval
from .run import FRONTIER_BUDGETS, RETRIEVAL_TOKENS, ablations, evaluate

__all__ = [
    "DecodeResult", "NextTokenReference", "decode_perplexity", "cache_keyword", "output_cache",
    "RunResult", "RetrievalResult", "EvalReport", "evaluate", "ablations", "FRONTIER_BUDGETS",
    "RETRIEVAL_TOKENS", "frontier_points", "frontier_dominance", "RetrievalTask",
    "retrieval_task", "score_retrieval",
]
