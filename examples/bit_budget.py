"""A bit budget: 2.5 code bits per cached element on average, spread over the 60 cached
tensors of SmolLM2 by what each one's quantization costs: the change it makes to the
attention output, weighted by the gradient of the calibration text's loss.

    python examples/bit_budget.py

The calibration (one forward and one backward over 512 tokens of held-out text, then every
tensor at every width) runs inside compile_model; save_policy writes it into a policy file,
and compiling from that file skips it. The perplexity printed at the end scores 64 tokens
of one segment, a quick look; `kvpolicy eval` scores 4 x 256.
"""

import tempfile
import time
from pathlib import Path

import kvpolicy
from kvpolicy import evaluation, zoo
from kvpolicy.zoo import text as data

model, tokenizer = zoo.load("smollm2-135m")
t0 = time.perf_counter()
kvpolicy.compile_model(model, bits=2.5)
print(f"calibrated and compiled in {time.perf_counter() - t0:.1f} s")
policy = kvpolicy.inspect(model)
print(policy)  # the footer: achieved average bits and bytes per token against fp16

keys = [t.bits for t in policy.tensors[::2]]
values = [t.bits for t in policy.tensors[1::2]]
print("key bits:  ", keys)
print("value bits:", values)

path = Path(tempfile.mkdtemp()) / "smollm2-2.5.yaml"
kvpolicy.save_policy(model, path)
again, _ = zoo.load("smollm2-135m")
t0 = time.perf_counter()
kvpolicy.compile_model(again, policy=str(path))  # no calibration: it is in the file
print(f"recompiled from {path} in {time.perf_counter() - t0:.1f} s")
assert [t.bits for t in kvpolicy.inspect(again).tensors] == [t.bits for t in policy.tensors]

segs = data.segments(tokenizer, 512 + 64, 1)
fp = evaluation.decode_perplexity(zoo.load("smollm2-135m")[0], segs, 512, 64, desc="fp")
result = evaluation.decode_perplexity(again, segs, 512, 64, desc="budget 2.5")
print(f"decode-time perplexity: full precision {fp.perplexity:.3f}, 2.5-bit budget "
      f"{result.perplexity:.3f} ({result.perplexity / fp.perplexity:.3f}x)")
