import pytest
import torch

from kvpolicy.errors import KVPolicyError
from kvpolicy.zoo import text as data


def test_pydoc_text_is_real_and_large():
    text = data.pydoc_text()
    assert len(text) > 400_000
    from pydoc_data.topics import topics

    assert topics["for"] in text  # every topic is in, in full


@pytest.mark.real_model
def test_segments_are_disjoint_token_windows(smollm2):
    _, tokenizer = smollm2
    segs = data.segments(tokenizer, 64, 3, stride=1000)
    tokens = data.pydoc_tokens(tokenizer)
    assert segs.shape == (3, 64) and segs.dtype == torch.long
    assert torch.equal(segs[1], tokens[1000:1064])
    assert tokens.numel() > 100_000


@pytest.mark.real_model
def test_segments_past_the_end_is_an_error(smollm2):
    _, tokenizer = smollm2
    with pytest.raises(ValueError, match="do not fit"):
        data.segments(tokenizer, 1024, starts=[10**6])


def test_read_text_refuses_what_it_cannot_score(tmp_path):
    with pytest.raises(KVPolicyError, match="no such file"):
        data.read_text(tmp_path / "missing.txt")
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x80\x81\x82 not text")
    with pytest.raises(KVPolicyError, match="not UTF-8 text"):
        data.read_text(binary)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(KVPolicyError, match="empty"):
        data.read_text(empty)


@pytest.mark.real_model
def test_segments_of_a_given_text(smollm2, tmp_path):
    _, tokenizer = smollm2
    import inspect as _inspect

    source = _inspect.getsource(_inspect)  # Python source: another kind of text
    path = tmp_path / "code.py"
    path.write_text(source, encoding="utf-8")
    segs = data.segments(tokenizer, 32, 2, stride=500, source=data.read_text(path))
    tokens = data.pydoc_tokens(tokenizer, source)
    assert torch.equal(segs[1], tokens[500:532])
    assert not torch.equal(segs[0], data.segments(tokenizer, 32, 1)[0])
    with pytest.raises(ValueError, match="tokens of the given text"):
        data.segments(tokenizer, 10**6, 1, source=source)


class _Words:
    """A tokenizer with one token per whitespace-separated word."""

    def __call__(self, body: str, add_special_tokens: bool = False, **_) -> dict:
        return {"input_ids": [len(w) for w in body.split()]}


def test_topic_passage_is_whole_paragraphs_of_the_topic_within_the_budget():
    from pydoc_data.topics import topics

    words = _Words()
    full = topics["string-methods"]
    for budget in (40, 333, 2000):
        passage = data.topic_passage(words, "string-methods", budget)
        n = len(words(passage)["input_ids"])
        assert n <= budget and full.startswith(passage)
        # The next paragraph would not have fitted.
        following = full[len(passage):].split("\n\n")[1]
        assert n + len(following.split()) > budget
    # Less than the first paragraph: the first paragraph all the same.
    assert data.topic_passage(words, "pass", 1) == topics["pass"].split("\n\n")[0]
    assert data.topic_passage(words, "pass", 10**6) == topics["pass"]


def test_topic_passage_names_the_topics_when_one_is_unknown():
    unknown = "no pydoc help topic 'strings-methods'.*string-methods"
    with pytest.raises(KVPolicyError, match=unknown):
        data.topic_passage(_Words(), "strings-methods", 100)
