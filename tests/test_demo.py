"""The demo's helpers (kvpolicy/demo.py): the long-context prompt and the comparisons it
prints. The demo itself runs SmolLM2-135M for minutes: ``make demo``."""

from __future__ import annotations

import pytest
import torch

from kvpolicy import demo
from kvpolicy.errors import KVPolicyError


class _Words:
    """One token per whitespace-separated word (its length as the id), and a chat template
    that frames each message with a role word."""

    def __call__(self, body: str, add_special_tokens: bool = False, **_) -> dict:
        return {"input_ids": [len(w) for w in body.split()]}

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        assert not tokenize
        body = "".join(f"<{m['role']}> {m['content']} </{m['role']}> " for m in messages)
        return body + ("<assistant> " if add_generation_prompt else "")


def test_prompt_asks_after_the_passage_and_locates_the_answer():
    words = _Words()
    ids, back = demo.prompt_ids(words, demo.QUESTION, 2000)
    assert ids.dtype == torch.long and ids.shape[0] == 1
    passage = demo.text.topic_passage(words, demo.QUESTION.topic, 2000)
    question = demo.QUESTION.question.split()
    # <user>, the passage, "Question:", the question, </user>, <assistant>
    assert ids.shape[1] == 1 + len(passage.split()) + 1 + len(question) + 2
    # ``back`` counts from the evidence's first word to the end of the prompt.
    tail = passage[passage.index(demo.QUESTION.evidence):].split()
    assert back == len(tail) + 1 + len(question) + 2
    assert back > 128  # behind the default residual window, in the packed part of the cache


def test_prompt_refuses_a_passage_without_the_answer():
    with pytest.raises(KVPolicyError, match="do not contain"):
        demo.prompt_ids(_Words(), demo.QUESTION, 50)


def test_agreement_counts_the_words_in_common():
    assert demo.agreement("It raises ValueError.", " It  raises\nValueError.") == (
        "the two answers are identical")
    assert "first 2 of 3 words" in demo.agreement("It raises ValueError.", "It raises KeyError.")
    assert "first 2 of 2 words" in demo.agreement("It raises", "It raises ValueError.")


def test_gist_keeps_the_first_clauses():
    assert demo.gist("a; b; c; d", clauses=2) == "a; b; ..."
    assert demo.gist("a; b", clauses=3) == "a; b"


def test_the_short_setup_is_short_and_the_full_one_is_the_published_one():
    assert (demo.FULL.segments, demo.FULL.context, demo.FULL.steps) == (4, 768, 256)
    short = demo.SHORT.segments * (demo.SHORT.context + demo.SHORT.steps)
    assert short < demo.FULL.segments * (demo.FULL.context + demo.FULL.steps) / 2
