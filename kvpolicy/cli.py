"""Command line: ``kvpolicy inspect --model smollm2-135m [--bits 2 | --stored-bits 3.0]
[--policy FILE] [--calibration FILE]``, ``kvpolicy eval ...``, ``kvpolicy presets``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from . import api, evaluation, zoo
from .calibrate.budget import calibration_ids_from_file
from .errors import KVPolicyError, ZooError
from .evaluation.stored import STORED_BUDGETS, WHOLE_BUDGETS
from .policies import SUPPORTED_BITS, list_presets, load_spec
from .policies.footprint import CONTEXT
from .zoo import tiny

__all__ = ["main", "build_parser", "load_model"]

_TINY_PREFIX = "tiny-"


def _bits(text: str) -> int | float:
    """``--bits``: an int is one width for every tensor, a float (``2.5``, ``3.0``) a budget
    of average code bits per element, between 1 and 16."""
    try:
        bits: int | float = int(text)
    except ValueError:
        try:
            bits = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a number of bits (e.g. 2, or 2.5 for a budget)"
            ) from None
    if isinstance(bits, int) and bits not in SUPPORTED_BITS:
        raise argparse.ArgumentTypeError(
            f"{bits} is not a width; use one of {', '.join(map(str, SUPPORTED_BITS))}, or a "
            f"float such as {bits}.0 or 2.5 for a budget of average bits"
        )
    if isinstance(bits, float) and not 1 <= bits <= 16:
        raise argparse.ArgumentTypeError(f"a budget of {bits} bits is outside [1, 16]")
    return bits


def _stored_bits(text: str) -> float:
    """``--stored-bits``: a budget of average stored bits per element (codes plus a scale
    and a zero per group), between 1 and 16; ``3`` and ``3.0`` alike."""
    try:
        stored = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of stored bits (e.g. 3.0)") from None
    if not 1 <= stored <= 16:
        raise argparse.ArgumentTypeError(f"a stored-bits budget of {stored} is outside [1, 16]")
    return stored


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpolicy",
        description="Derive, inspect and apply KV-cache compression policies.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    inspect = commands.add_parser(
        "inspect",
        help="print the policy derived for a model",
        description="Trace a model's attention, derive its KV-cache policy and print it.",
    )
    inspect.add_argument(
        "--model",
        required=True,
        metavar="NAME_OR_PATH",
        help='a zoo name ("smollm2-135m"), a tiny test architecture ("tiny-llama") or a path',
    )
    inspect.add_argument(
        "--bits",
        type=_bits,
        default=2,
        help="code bits when no --policy is given: the kvpolicy-BITS defaults (default 2); "
        "a float such as 2.5 is a budget, allocated per tensor from measured sensitivity",
    )
    inspect.add_argument(
        "--stored-bits",
        type=_stored_bits,
        default=None,
        metavar="BITS",
        help="a budget of average stored bits per element, scales and zeros included "
        "(3.0: e.g. 2-bit codes in groups of 32 or 2.5 in groups of 64): widths and group "
        "sizes allocated per tensor from measured sensitivity; instead of a float --bits",
    )
    inspect.add_argument(
        "--policy",
        metavar="FILE_OR_PRESET",
        help="a YAML policy file or a preset name (see `kvpolicy presets`)",
    )
    inspect.add_argument(
        "--calibration",
        metavar="FILE",
        help="for a budget: calibrate on this file instead of the default pydoc text; "
        "token ids saved with torch.save as a .pt/.pth file (an integer tensor [T] or "
        "[B, T], used whole), or UTF-8 text, of which up to 4 rows of 512 tokens from its "
        "start are used (needs a tokenizer saved beside the model)",
    )
    inspect.add_argument(
        "--format",
        choices=("table", "yaml", "json"),
        default="table",
        help="output format (default: table)",
    )
    inspect.add_argument(
        "--save",
        metavar="FILE",
        help="also write the policy file behind this policy (defaults, overrides and, for a "
        "budget, the calibration) so that compiling from it skips calibrating",
    )
    inspect.set_defaults(run=_cmd_inspect)

    ev = commands.add_parser(
        "eval",
        help="measure a policy: decode-time perplexity, ablations, the peer, bytes, speed",
        description="Decode-time perplexity of the derived policy, its ablations and "
        "transformers' quanto cache on pydoc text; writes report.md/report.json/plots.",
    )
    ev.add_argument("--model", default="smollm2-135m", metavar="NAME",
                    help='a zoo name or "tiny-<arch>" (default: smollm2-135m)')
    ev.add_argument("--bits", type=_bits, default=2,
                    help="code bits when no --policy is given (default 2; a float is a budget)")
    ev.add_argument("--policy", metavar="FILE_OR_PRESET", help="a YAML file or preset name")
    ev.add_argument("--segments", type=int, default=4, help="pydoc segments (default 4)")
    ev.add_argument("--context", type=int, default=768,
                    help="prefill tokens (default 768); context + steps may be up to the "
                    "model's max_position_embeddings (8192 for smollm2-135m)")
    ev.add_argument("--steps", type=int, default=256, help="scored decode steps (default 256)")
    ev.add_argument("--retrieval", type=int, default=None, metavar="L",
                    help="retrieval check: --passages passages of L pydoc tokens, each followed "
                    "by itself, scored on the second copy (top-1 accuracy, perplexity) for fp, "
                    "the derived policy, budget 2.5, the stored-bits budgets and quanto; 0 "
                    "skips it (default "
                    f"{evaluation.RETRIEVAL_TOKENS}, or half the model's positions if fewer; "
                    "about L decode steps per run)")
    ev.add_argument("--passages", type=int, default=None, metavar="N",
                    help="retrieval passages (default: --segments), e.g. 4 passages beside "
                    "one long segment")
    ev.add_argument("--text", metavar="FILE", default=None,
                    help="a UTF-8 text file to cut the segments and retrieval passages from "
                    "instead of the pydoc text (a budget still calibrates on pydoc)")
    ev.add_argument("--stored-bits", type=_stored_bits, nargs="*", metavar="B",
                    default=list(STORED_BUDGETS),
                    help="stored-bits budgets of the frontier (codes plus fp16 scale and zero "
                    "per group; widths and group sizes allocated, one calibration for all; "
                    "default: " + " ".join(f"{b:g}" for b in STORED_BUDGETS)
                    + "; --stored-bits with no value skips them)")
    ev.add_argument("--whole-cache", type=_stored_bits, nargs="*", metavar="B",
                    default=list(WHOLE_BUDGETS),
                    help="stored-bits budgets over the whole cache at "
                    f"{CONTEXT:,} tokens (budget_context: sinks, residual and incomplete chunk "
                    "counted, the residual at 8 bits; one more calibration for all); default: "
                    + " ".join(f"{b:g}" for b in WHOLE_BUDGETS)
                    + "; --whole-cache with no value skips them")
    ev.add_argument("--out", metavar="DIR", default="eval-out", help="output folder")
    ev.add_argument("--quick", action="store_true",
                    help="a tiny random model and short text: a smoke test in seconds")
    ev.add_argument("--no-peers", action="store_true", help="skip the quanto peer runs")
    ev.add_argument("--no-ablations", action="store_true",
                    help="skip the ablations but the uniform widths, and the code-bit budgets: "
                    "the derived policy, the stored-bits and whole-cache budgets and the peers")
    ev.set_defaults(run=_cmd_eval)

    presets = commands.add_parser("presets", help="list the shipped policy presets")
    presets.set_defaults(run=_cmd_presets)
    return parser


def load_model(name: str) -> Any:
    """The model for ``--model``: ``tiny-<arch>`` from ``kvpolicy.zoo.tiny``, else the zoo."""
    if name.startswith(_TINY_PREFIX):
        try:
            built = tiny.tiny_model(name[len(_TINY_PREFIX) :])
        except KeyError as exc:  # unknown architecture: a user error, not a crash
            raise ZooError(f"--model {name}: {exc.args[0] if exc.args else exc}") from None
    else:
        built = zoo.load(name)
    # zoo.load returns (model, tokenizer); accept a bare model as well.
    return built[0] if isinstance(built, tuple) else built


def _cmd_inspect(args: argparse.Namespace) -> int:
    extra: dict[str, Any] = {}
    if args.stored_bits is not None:  # passed only when given
        extra["stored_bits"] = args.stored_bits
    if args.calibration is not None:
        if load_spec(args.policy, bits=args.bits, **extra).budget is None:
            given = f"--bits {args.bits}" + (f" with --policy {args.policy}" if args.policy
                                             else "")
            raise KVPolicyError(
                f"--calibration is only for a bit budget, and {given} sets fixed widths; "
                "give a budget (a float such as --bits 2.5, --stored-bits 3.0, or a "
                "--policy whose defaults.bits is a float) or leave out --calibration"
            )
    model = load_model(args.model)
    if args.calibration is not None:
        extra["calibration"] = calibration_ids_from_file(model, args.calibration)
    policy = api.derive_policy(model, bits=args.bits, policy=args.policy, **extra)
    if args.save:
        path = api.save_policy(model, args.save)
        print(f"policy file written to {path}", file=sys.stderr)
    if args.format == "yaml":
        text = policy.to_yaml()
    elif args.format == "json":
        text = policy.to_json()
    else:
        text = str(policy)
    print(text.rstrip("\n"))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    report = evaluation.evaluate(
        args.model, bits=args.bits, policy=args.policy, segments=args.segments,
        context=args.context, steps=args.steps, out=args.out, quick=args.quick,
        peers=not args.no_peers, retrieval=args.retrieval, passages=args.passages,
        text_file=args.text,
        stored_budgets=args.stored_bits, whole_budgets=args.whole_cache,
        ablate=not args.no_ablations,
    )
    print(report.to_markdown().rstrip("\n"))
    print(f"\nwritten to {args.out}/ (report.md, report.json, plots)")
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    for name in list_presets():
        print(name)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 on a usage or kvpolicy error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2): argparse printed why
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return args.run(args)
    except KVPolicyError as exc:
        print(f"kvpolicy: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
