"""The effect of a YAML override: flip the values to per-channel scales against what the
graph implies, and see what it costs in decode-time perplexity.

    python examples/yaml_override.py
"""

from pathlib import Path

import kvpolicy
from kvpolicy import evaluation, zoo
from kvpolicy.zoo import text as data

yaml_file = Path(__file__).with_name("keys_4bit_first_layers.yaml")
_, tokenizer = zoo.load("smollm2-135m")
segs = data.segments(tokenizer, 512 + 64, 1)

for policy in ("kvpolicy-2", yaml_file):
    model, _ = zoo.load("smollm2-135m")
    kvpolicy.compile_model(model, policy=policy)
    if policy != "kvpolicy-2":
        print(kvpolicy.inspect(model))
    result = evaluation.decode_perplexity(model, segs, 512, 64, desc=str(policy))
    print(f"{policy}: decode-time perplexity {result.perplexity:.3f}")
