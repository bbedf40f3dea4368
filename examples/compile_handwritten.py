"""Compile an attention module that is not transformers code and keeps its own KV cache
(gpt-fast style: complex RoPE, repeat_interleave GQA, explicit matmul -> softmax -> matmul,
preallocated K/V buffers written at ``input_pos``), then run its own decode loop.

    python examples/compile_handwritten.py

``probe_kwargs`` makes the analysis's probe forwards take the module's cached path (they
pass token ids only otherwise); the compiled blocks then read and write a packed cache that
stands in for the module's buffers, across calls, and a call at position 0 starts again.
"""

import torch

import kvpolicy
from kvpolicy.state import compiled_of
from kvpolicy.zoo.tiny import GptFast

PROMPT, STEPS = 32, 96


def gpt_fast() -> GptFast:
    model = GptFast()
    model.setup_caches(max_batch=4, max_seq=256)  # kvpolicy probes with 2 and 3 rows
    return model


@torch.no_grad()
def decode(model: GptFast, ids: torch.Tensor) -> torch.Tensor:
    """The module's own loop: prefill at positions 0..P-1, then one token per call, fed the
    same tokens (teacher forcing) so that every step's logits can be compared."""
    logits = [model(ids[:, :PROMPT], torch.arange(PROMPT))[:, -1]]
    for t in range(PROMPT, ids.shape[1] - 1):
        logits.append(model(ids[:, t : t + 1], torch.tensor([t]))[:, -1])
    return torch.stack(logits, 1)


ids = torch.randint(0, 128, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(0))
want = decode(gpt_fast(), ids)
positions = {"probe_kwargs": lambda x: {"input_pos": torch.arange(x.shape[1])}}
for bits in (4, 2):
    model = kvpolicy.compile_model(
        gpt_fast(), policy={"defaults": {"bits": bits, "residual": 16, "sinks": 2}},
        progress=False, **positions,
    )
    if bits == 2:
        print(kvpolicy.inspect(model))
    got = decode(model, ids)
    rel = ((got - want).norm() / want.norm()).item()
    cache = compiled_of(model).own_cache
    print(
        f"{bits}-bit cache, {cache.layers[0].packed.n_packed} of {cache.get_seq_length()} "
        f"tokens packed: decode logits off by {rel:.2%} from the full-precision buffers"
    )
