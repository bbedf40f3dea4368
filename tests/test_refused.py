"""Architectures kvpolicy does not compile are refused at compile time with the reason,
and the model is left as it was: encoder-decoders, cross-layer KV sharing, a forward that
does not take token ids alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

import kvpolicy
from kvpolicy import AnalysisError
from kvpolicy.state import compiled_of


def _bart() -> nn.Module:
    config = AutoConfig.for_model(
        "bart", vocab_size=128, d_model=64, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_position_embeddings=64,
    )
    return AutoModelForSeq2SeqLM.from_config(config).eval()


def _t5() -> nn.Module:
    config = AutoConfig.for_model(
        "t5", vocab_size=128, d_model=64, d_kv=32, d_ff=128, num_layers=1,
        num_decoder_layers=1, num_heads=2, decoder_start_token_id=0,
    )
    return AutoModelForSeq2SeqLM.from_config(config).eval()


def _gemma3n() -> nn.Module:
    config = AutoConfig.for_model(
        "gemma3n_text", vocab_size=128, hidden_size=64, intermediate_size=[128] * 3,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_kv_shared_layers=1, sliding_window=16, laurel_rank=8,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=128, altup_num_inputs=2,
        activation_sparsity_pattern=[0.0] * 3, max_position_embeddings=64,
    )
    return AutoModelForCausalLM.from_config(config).eval()


REFUSED = {
    "bart": (_bart, "encoder-decoder"),
    "t5": (_t5, "encoder-decoder"),
    "gemma3n": (_gemma3n, r"shares keys and values across layers \(config.num_kv_shared_layers=1"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_architecture_is_refused_before_probing_and_left_usable(name):
    build, message = REFUSED[name]
    torch.manual_seed(0)
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    forward = model.forward
    with pytest.raises(AnalysisError, match=message):
        kvpolicy.compile_model(model, bits=2, progress=False)
    assert compiled_of(model) is None and model.forward == forward
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


class _NeedsTwoInputs(nn.Module):
    """A forward that cannot run on token ids alone (like a seq2seq model's)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)

    def forward(self, ids: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        if other is None:
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        return self.emb(ids)


def test_a_probe_forward_that_fails_names_the_call_and_keeps_the_cause():
    with pytest.raises(AnalysisError, match=r"probe forward _NeedsTwoInputs\(ids\[2, 7\]\) "
                       r"failed: ValueError: You must specify") as err:
        kvpolicy.compile_model(_NeedsTwoInputs(), bits=2, progress=False)
    assert isinstance(err.value.__cause__, ValueError)
