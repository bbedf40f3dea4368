import pytest
import torch

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
