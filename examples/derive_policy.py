"""Derive and print the KV-cache policy of a transformers model and of a hand-written one.

    python examples/derive_policy.py
"""

import kvpolicy
from kvpolicy.zoo.tiny import GptFast, tiny_model

# A transformers architecture with partial rotary (GPT-NeoX: 25 % of channels rotated).
print(kvpolicy.derive_policy(tiny_model("gpt_neox"), bits=2))
print()

# gpt-fast-style attention: complex RoPE, its own cache buffers, matmul-softmax-matmul.
print(kvpolicy.derive_policy(GptFast(), bits=4))
print()

# The same model with overrides: rows that differ from what the graph
# implies are marked, and their reason says what was derived.
# (the file targets SmolLM2's 30 layers; the tiny llama has 2, so a dict is used here)
print(kvpolicy.derive_policy(tiny_model("llama"), policy={
    "overrides": [{"layers": 0, "tensor": "key", "bits": 4},
                  {"layers": "*", "tensor": "value", "axis": "channel"}]}))
