"""Compile SmolLM2-135M to a 2-bit KV cache and generate with it, unchanged HF usage.

    python examples/compile_transformers.py
"""

import torch

import kvpolicy
from kvpolicy import zoo

model, tokenizer = zoo.load("smollm2-135m")
model = kvpolicy.compile_model(model, bits=2)
print(kvpolicy.inspect(model))

messages = [{"role": "user", "content": "Name three uses of a hash table."}]
ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                    return_dict=True)["input_ids"]
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=200, do_sample=False, return_dict_in_generate=True)
print(tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True))

report = out.past_key_values.memory_report()  # a transformers Cache holding packed groups
print(f"{report['tokens']} tokens: {report['bytes']} bytes vs {report['fp16_bytes']} in fp16")
