import pytest
import torch

from kvpolicy.zoo.tiny import TINY_ARCHITECTURES, GptFast, NanoGPT, tiny_model


@pytest.mark.parametrize("arch", sorted(TINY_ARCHITECTURES))
def test_tiny_model_is_small_in_eval_mode_and_decodes_with_cache(arch):
    model = tiny_model(arch)
    # What keeps every test that builds one cheap: two layers, well under a million weights.
    assert model.config.num_hidden_layers == 2
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    assert not model.training
    ids = torch.randint(3, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        full = model(ids).logits
        prefix = model(ids[:, :6], use_cache=True)
        step = model(ids[:, 6:], past_key_values=prefix.past_key_values, use_cache=True)
    assert torch.isfinite(full).all()
    # Decoding the last token through the cache gives the full forward's last logits.
    torch.testing.assert_close(step.logits[:, -1], full[:, -1], atol=1e-4, rtol=1e-4)


def test_tiny_models_are_deterministic_per_seed():
    a, b, c = tiny_model("llama", seed=3), tiny_model("llama", seed=3), tiny_model("llama")
    wa, wb, wc = (m.model.layers[0].self_attn.k_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_unknown_architecture_lists_known_ones():
    with pytest.raises(KeyError, match="known: llama"):
        tiny_model("not-an-arch")


def test_nanogpt_is_causal():
    model = NanoGPT()
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        full = model(ids)
        prefix = model(ids[:, :5])
    torch.testing.assert_close(full[:, :5], prefix, atol=1e-5, rtol=1e-5)


def test_gpt_fast_cache_matches_full_forward():
    model = GptFast()
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        full = model(ids)
        model.setup_caches(max_batch=2, max_seq=32)
        model(ids[:, :8], torch.arange(8))
        step = model(ids[:, 8:], torch.tensor([8]))
    torch.testing.assert_close(step[:, -1], full[:, -1], atol=1e-4, rtol=1e-4)
