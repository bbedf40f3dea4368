"""The C++ decode kernel of another git revision against the working tree's, in one process.

Both sources are built (each its own library) and two paged layers of SmolLM2 shapes per
source (:mod:`bench.paged_decode`'s ``bits=2`` served quantizer, bf16 pages, 1 sequence) step
interleaved, so machine noise falls on both alike. Prints each source's median time per
layer-step and the ratio::

    .venv/bin/python bench/kernel_ab.py [--base HEAD~1] [--tokens 7680] [--steps 96]
        [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paged_decode as pd  # noqa: E402  (this folder's bench, not a package)

from kvpolicy.kernels import cpu_ext  # noqa: E402
from kvpolicy.kernels.layout import RotarySpec  # noqa: E402

SOURCE = "kvpolicy/kernels/cpu_ext.cpp"


def _case(src: Path, tokens: int, steps: int, rope: RotarySpec) -> pd.Case:
    cpu_ext._SOURCE_FILE = src
    cpu_ext._source.cache_clear()
    cpu_ext._libs.clear()
    case = pd.Case(pd.KEY, pd.VALUE, 1, tokens, steps, 2, rope,
                   torch.Generator().manual_seed(0))
    case.step()  # the first decode step builds the fused step with this source's library
    if case.kv[0].fused_step is None:
        raise SystemExit(f"the kernel from {src} did not build (see the log above)")
    return case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD~1", help="git revision of the base source")
    ap.add_argument("--tokens", type=int, default=7680)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(__file__).resolve().parent.parent
    try:
        base = subprocess.run(["git", "show", f"{args.base}:{SOURCE}"], cwd=root, check=True,
                              capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"cannot read {SOURCE} at {args.base!r}: {e.stderr.strip()}") from e
    rope = pd.rope_table(args.tokens + args.steps + 8)
    with tempfile.TemporaryDirectory() as tmp:
        base_src = Path(tmp) / "cpu_ext.cpp"
        base_src.write_text(base)
        cases = {args.base: _case(base_src, args.tokens, args.steps, rope),
                 "working tree": _case(root / SOURCE, args.tokens, args.steps, rope)}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.steps - 1):
        for name, case in cases.items():
            times[name].append(case.step())
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"# {args.tokens} cached tokens, 1 sequence, {args.threads} thread(s), "
          f"{args.steps - 1} steps of 2 layers, medians per layer-step")
    print("| kernel source | ms per layer-step |")
    print("|---|---|")
    for name, ms in med.items():
        print(f"| {name} | {ms:.3f} |")
    a, b = med.values()
    print(f"\nworking tree / {args.base}: {b / a:.3f}x")


if __name__ == "__main__":
    main()
