"""Compile an attention module that is not transformers code (gpt-fast style: complex
RoPE, repeat_interleave GQA, explicit matmul -> softmax -> matmul).

    python examples/compile_handwritten.py
"""

import torch

import kvpolicy
from kvpolicy.zoo.tiny import GptFast

reference, model = GptFast(), GptFast()
kvpolicy.compile_model(model, policy={"defaults": {"bits": 4, "residual": 16, "sinks": 2}})
print(kvpolicy.inspect(model))

ids = torch.randint(0, 128, (1, 96))
with torch.no_grad():
    want, got = reference(ids), model(ids)
rel = ((got - want).norm() / want.norm()).item()
print(f"4-bit cache with 16 recent tokens in full precision: logits off by {rel:.2%}")
