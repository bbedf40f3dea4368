"""Stored-bits budgets over the whole cache (``budget_context``) on SmolLM2: quality and bytes.

Every row is one policy, compared with the fp cache in the same run:

- decode: 4 pydoc segments, a 768-token prefill and 128 scored single-token steps, batched;
  perplexity, mean KL(fp || row) of the next-token distributions and top-1 agreement with
  fp per scored step (``evaluation.decode_perplexity`` with a ``NextTokenReference``);
- retrieval: 2 pydoc passages of ``--retrieval`` tokens each followed by itself, top-1 on
  the second copy (``evaluation.retrieval``);
- bytes: ``inspect``'s whole-cache figure at 4,096 tokens (sinks, residual and incomplete
  chunk in full precision included) and the packed body's stored bits.

Rows: ``bits=2`` (the default), ``stored_bits=2.5`` counted over the body alone (what the
published frontier used), and the whole-cache budgets ``--budgets`` at 4,096 tokens, with
``residual: 128`` (kvpolicy's residual window elsewhere) and ``residual: 32``; ``--residuals
auto`` writes ``residual: auto``: the budget chooses each global layer's window, tokens and
width (calibrate.whole_cache).
``--residual-bits 16 8`` also runs each written-window row with its residual window held at
8 bits per token (``residual_bits``, runtime.recent). A budget the full-precision
tokens alone exceed is a row that says so. Budgets share one calibration per residual.

    .venv/bin/python bench/whole_cache_budget.py [--budgets 3.0 2.5 2.0 1.5]
        [--retrieval 1024] [--residuals 128 32 auto] [--residual-bits 16 8] [--no-fixed]
        [--levels uniform]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import kvpolicy
from kvpolicy import evaluation, zoo
from kvpolicy.errors import PolicyError
from kvpolicy.evaluation.decode import NextTokenReference
from kvpolicy.evaluation.retrieval import retrieval_task
from kvpolicy.policies.footprint import whole_cache
from kvpolicy.zoo import text

CONTEXT, STEPS, SEGMENTS, AT = 768, 128, 4, 4096


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=float, nargs="+", default=[3.0, 2.5, 2.0, 1.5])
    ap.add_argument("--retrieval", type=int, default=1024)
    ap.add_argument("--residuals", nargs="+", default=["128", "32"],
                    help="residual windows of the whole-cache rows (default 128 32); auto: "
                         "residual: auto, the budget chooses each layer's window")
    ap.add_argument("--residual-bits", type=int, nargs="+", default=[16],
                    help="residual_bits of the whole-cache rows (default 16)")
    ap.add_argument("--no-fixed", action="store_true",
                    help="skip the bits=2 and body-only stored_bits=2.5 rows")
    ap.add_argument("--levels", default=None,
                    help="levels of the whole-cache rows (e.g. uniform: no vq values)")
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok = zoo.load("smollm2-135m")
    segs = text.segments(tok, CONTEXT + STEPS, SEGMENTS)
    task = retrieval_task(text.segments(tok, args.retrieval, 2,
                                        stride=max(args.retrieval, 1024)))
    ref, rref = NextTokenReference(log_probs=True), NextTokenReference(log_probs=False)
    fp = evaluation.decode_perplexity(model, segs, CONTEXT, STEPS, progress=False,
                                      reference=ref, record=True, batched=True)
    fr = evaluation.score_retrieval(model, task, "fp", reference=rref, record=True,
                                    progress=False)
    print(f"# SmolLM2-135M; decode {SEGMENTS} x ({CONTEXT} + {STEPS}) batched, fp perplexity "
          f"{fp.perplexity:.3f}; retrieval 2 x {args.retrieval} tokens, fp top-1 "
          f"{fr.top1:.3f}; whole cache at {AT:,} tokens")
    print("| policy | whole-cache bits | x fp16 | body stored bits | perplexity x fp | KL | "
          "top-1 = fp | retrieval x fp | derive s |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows: list[tuple[str, dict]] = [] if args.no_fixed else [
        ("bits=2", {"defaults": {"bits": 2}}),
        ("stored_bits=2.5, body only", {"defaults": {"stored_bits": 2.5}}),
    ]
    levels = {} if args.levels is None else {"levels": args.levels}
    for residual in args.residuals:
        for b in args.budgets:
            if residual == "auto":
                rows.append((f"stored_bits={b:g} whole, residual: auto", {
                    "defaults": {"stored_bits": b, "budget_context": AT, "residual": "auto",
                                 **levels}}))
                continue
            for rb in args.residual_bits:
                rows.append((f"stored_bits={b:g} whole, residual {residual}"
                             + (f" at {rb} bits" if rb != 16 else "")
                             + (f", levels {args.levels}" if levels else ""),
                             {"defaults": {"stored_bits": b, "budget_context": AT,
                                           "residual": int(residual), "residual_bits": rb,
                                           **levels}}))
    calibrations: dict[object, object] = {}
    for name, spec in rows:
        residual = spec["defaults"].get("residual", "auto" if "budget_context" in
                                        spec["defaults"] else 128)
        m = copy.deepcopy(model)
        t0 = time.perf_counter()
        try:
            kvpolicy.compile_model(m, policy=spec, progress=False,
                                   calibration=calibrations.get(residual, tok))
        except PolicyError as e:
            print(f"| {name} | - | - | - | refused: {str(e).split(';')[0]} | | | | |")
            continue
        took = time.perf_counter() - t0
        pol = kvpolicy.inspect(m)
        if pol.calibration is not None and pol.budget_unit == "stored":
            calibrations.setdefault(residual, pol.calibration)
        whole = whole_cache(pol, AT)
        q = evaluation.decode_perplexity(m, segs, CONTEXT, STEPS, progress=False,
                                         reference=ref, batched=True)
        r = evaluation.score_retrieval(m, task, name, reference=rref, progress=False)
        print(f"| {name} | {whole.bits:.2f} | {whole.compression:.2f} | "
              f"{pol.avg_stored_bits():.2f} | {q.perplexity / fp.perplexity:.4f} | "
              f"{q.kl:.4f} | {q.agreement:.3f} | {r.top1 / fr.top1:.3f} | {took:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
